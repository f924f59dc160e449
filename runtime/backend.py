"""The one interface every execution backend implements (torch now; ONNX Runtime and TensorRT-LLM next).

A backend owns the target, the optional draft head and one KV cache for each. Forwards append rows after the
committed ones without committing them; the loop commits the rows the verifier accepted. Masks passed in cover only
the uncommitted rows (`[B, N, pending + N]` bool, True = attend): committed rows are always visible. Batch is the
leading dimension everywhere so that batch > 1 and paged caches can come without changing the loop.
"""
from __future__ import annotations

from typing import Protocol

import torch

from eaglex.models.target import TargetSpec


class Backend(Protocol):
    spec: TargetSpec
    draft_kind: str | None   # "eagle3", "eagle1" or None (vanilla only)
    dtype: str

    def reset(self, capacity: int) -> None:
        """Empty both caches and make room for `capacity` rows."""

    def target_forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor | None,
                       last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids/position_ids [B,N]; mask [B,N,N] or None (causal). -> logits [B,N|1,V] f32, features [B,N,F]."""

    def target_commit(self, keep: torch.Tensor) -> None:
        """keep [K] int64 rows of the last target forward to commit, in order."""

    def draft_forward(self, hidden: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
                      mask: torch.Tensor | None, project: bool, top_k: int, last_only: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One draft step. hidden [B,N,F] (target features when project) -> (hidden_out [B,N,H],
        top log-probs [B,N|1,k] f32, top target ids [B,N|1,k] int64)."""

    def draft_commit(self, keep: torch.Tensor) -> None: ...

    def draft_rollback(self) -> None: ...


def full_mask(mask: torch.Tensor | None, batch: int, n: int, committed: int, pending: int) -> torch.Tensor:
    """[B,1,N,committed+pending+N] bool attention mask from a mask over the uncommitted rows (None = causal)."""
    if mask is None:
        new = torch.ones(n, n, dtype=torch.bool).tril_()
        mask = torch.cat([torch.ones(n, pending, dtype=torch.bool), new], 1).expand(batch, n, pending + n)
    past = torch.ones(batch, n, committed, dtype=torch.bool)
    return torch.cat([past, mask], -1).unsqueeze(1)
