"""The one interface every execution backend implements (PyTorch: torch_backend.py; ONNX Runtime: ort_backend.py),
and the one KV-cache protocol behind it.

A backend owns the target, the optional draft head and one KV cache for each. Forwards append rows after the
committed ones without committing them; the loop commits the rows the verifier accepted. Masks passed in cover only
the uncommitted rows (`[B, N, pending + N]` bool, True = attend): committed rows are always visible. Batch is the
leading dimension everywhere so that batch > 1 and paged caches can come without changing the loop.
"""
from __future__ import annotations

from typing import Protocol

import torch

from eaglex.models.target import TargetSpec, causal_mask


class KVCache(Protocol):
    """A decode loop's cache (torch: kv_cache.TorchKVCache; ORT: ort_cache.OrtKVCache). A forward appends its rows
    as pending; commit(keep) makes the kept pending rows (indices, in order) the next committed rows, rollback()
    drops every pending row."""
    length: int     # committed rows
    pending: int    # rows appended since the last commit / rollback

    def reset(self, capacity: int) -> None:
        """Empty, with room for `capacity` rows."""

    def commit(self, keep: torch.Tensor) -> None: ...

    def rollback(self) -> None: ...


class CachedBackend:
    """The cache half of the Backend protocol, shared by the backends: `tcache` (target) and `dcache` (draft, None
    without a head) implement KVCache."""
    tcache: KVCache
    dcache: KVCache | None

    def reset(self, capacity: int) -> None:
        self.tcache.reset(capacity)
        if self.dcache is not None:
            self.dcache.reset(capacity)

    def target_commit(self, keep: torch.Tensor) -> None:
        self.tcache.commit(keep)

    def draft_commit(self, keep: torch.Tensor) -> None:
        self.dcache.commit(keep)

    def draft_rollback(self) -> None:
        self.dcache.rollback()


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


def full_mask(mask: torch.Tensor | None, batch: int, n: int, committed: int, pending: int,
              device: torch.device | None = None) -> torch.Tensor:
    """[B,1,N,committed+pending+N] bool attention mask from a mask over the uncommitted rows (None = causal), on
    `device` (default: the mask's, else the CPU)."""
    if mask is None:
        return causal_mask(n, committed + pending, batch, device)
    if device is not None and mask.device != device:
        mask = mask.to(device, non_blocking=True)
    past = torch.ones(batch, n, committed, dtype=torch.bool, device=mask.device)
    return torch.cat([past, mask], -1).unsqueeze(1)
