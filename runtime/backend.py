"""The one interface every execution backend implements, and the one KV-cache protocol behind it.

A backend owns the target, the optional draft head and `slots` KV slots for each: one request per slot. The
single-request backends (PyTorch: torch_backend.py; ONNX Runtime: ort_backend.py) have one slot, the batched ones
(batch_backend.py, ort_batch.py) many over the same models. Forwards take `rows`, a slice of slots (the batch
0..B, or one slot), and append rows after each slot's committed ones without committing them; the generator core
(batch.py) commits the rows the verifier accepted. Masks passed in cover only the uncommitted rows
(`[B, N, pending + N]` bool, True = attend): committed rows are always visible.
"""
from __future__ import annotations

from typing import Protocol

import torch

from eaglex.models.target import TargetSpec, causal_mask


class KVCache(Protocol):
    """A single-request cache (torch: kv_cache.TorchKVCache; ORT: ort_cache.OrtKVCache). A forward appends its rows
    as pending; commit(keep) makes the kept pending rows (indices, in order) the next committed rows, rollback()
    drops every pending row."""
    length: int     # committed rows
    pending: int    # rows appended since the last commit / rollback
    capacity: int

    def reset(self, capacity: int) -> None:
        """Empty, with room for `capacity` rows."""

    def commit(self, keep: torch.Tensor) -> None: ...

    def rollback(self) -> None: ...


class Backend(Protocol):
    spec: TargetSpec
    draft_kind: str | None   # "eagle3", "eagle1" or None (vanilla only)
    dtype: str
    slots: int

    def reset(self, capacity: int, draft_capacity: int | None = None) -> None:
        """Empty every slot and make room for `capacity` target rows (`draft_capacity` draft rows, default the
        same) in each."""

    def target_forward(self, rows: slice, input_ids: torch.Tensor, position_ids: torch.Tensor,
                       mask: torch.Tensor | None = None, last_only: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids/position_ids [B,N]; mask [B,N,pending+N] or None (causal). -> logits [B,N|1,V] f32,
        features [B,N,F]."""

    def draft_forward(self, rows: slice, hidden: torch.Tensor, input_ids: torch.Tensor,
                      position_ids: torch.Tensor, mask: torch.Tensor | None, project: bool, top_k: int,
                      last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One draft step. hidden [B,N,F] (target features when project) -> (hidden_out [B,N,H],
        top log-probs [B,N|1,k] f32, top target ids [B,N|1,k] int64)."""

    def target_commit(self, slot: int, keep: torch.Tensor) -> None:
        """keep [K] int64: the slot's pending target rows (in order) that become committed rows."""

    def draft_commit(self, slot: int, keep: torch.Tensor) -> None: ...

    def draft_rollback(self, rows: slice) -> None: ...

    def clear(self, slot: int) -> None:
        """Forget the slot's rows (its request left)."""

    def move(self, src: int, dst: int) -> None:
        """Slot src's committed rows into slot dst (the core keeps the active slots contiguous)."""


ONE = slice(0, 1)   # the one slot of a single-request backend


class CachedBackend:
    """The slot half of the Backend protocol for the single-request backends: one slot, whose target and draft
    (None without a head) caches `tcache` and `dcache` implement KVCache."""
    slots = 1
    tcache: KVCache
    dcache: KVCache | None

    def reset(self, capacity: int, draft_capacity: int | None = None) -> None:
        self.tcache.reset(capacity)
        if self.dcache is not None:
            self.dcache.reset(draft_capacity or capacity)

    def target_commit(self, slot: int, keep: torch.Tensor) -> None:
        self.tcache.commit(keep)

    def draft_commit(self, slot: int, keep: torch.Tensor) -> None:
        self.dcache.commit(keep)

    def draft_rollback(self, rows: slice) -> None:
        self.dcache.rollback()

    def clear(self, slot: int) -> None:
        self.reset(self.tcache.capacity, self.dcache.capacity if self.dcache is not None else None)

    def move(self, src: int, dst: int) -> None:
        raise RuntimeError("a single-request backend has one slot")

    @staticmethod
    def check_rows(rows: slice) -> None:
        if rows != ONE:
            raise ValueError(f"a single-request backend has one slot (rows 0:1), not {rows.start}:{rows.stop}")


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
