"""The one interface every execution backend implements (PyTorch: torch_backend.py; ONNX Runtime: ort_backend.py),
and the slot bookkeeping both share.

A backend owns the target, the optional draft head and `slots` KV slots for each: one request per slot. A backend
opened on model files has one slot (a lone request is a batch of one); `with_slots(n)` gives the same models with
n slots for the in-flight batcher. Forwards take `rows`, a slice of slots (the batch 0..B, or one slot), and
append rows after each slot's committed ones without committing them; the generator core (batch.py) commits the
rows the verifier accepted. Masks passed in cover only the uncommitted rows (`[B, N, pending + N]` bool, True =
attend): committed rows are always visible.
"""
from __future__ import annotations

import copy
from dataclasses import replace
from typing import Protocol

import torch

from eaglex.models.target import TargetSpec


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


    def with_slots(self, slots: int, extra_rows: int = 0, context: int | None = None) -> Backend:
        """The same models with `slots` slots of `context` (default the model's) + `extra_rows` rows each."""


ONE = slice(0, 1)   # the first slot: a lone request's


class SlotCounts:
    """What every per-slot KV cache counts: per slot the committed rows `length` (in context order: a row's index
    is its position, as in vanilla decoding) and the `pending` rows forwards appended since its last commit or
    rollback; a cache copies the rows in `_copy`."""

    def __init__(self, slots: int):
        self.length = [0] * slots
        self.pending = [0] * slots

    def rollback(self, rows: slice) -> None:
        for s in range(rows.start, rows.stop):
            self.pending[s] = 0

    def clear(self, slot: int) -> None:
        self.length[slot] = self.pending[slot] = 0

    def move(self, src: int, dst: int) -> None:
        """Copy slot src's committed rows into slot dst (the batcher keeps active slots contiguous)."""
        n = self.length[src]
        if n:
            self._copy(src, dst, n)
        self.length[dst], self.pending[dst] = n, 0
        self.clear(src)

    def _copy(self, src: int, dst: int, n: int) -> None:
        raise NotImplementedError


class SlotBackend:
    """The slot half of the Backend protocol, over a target and an optional draft cache (`tcache`, `dcache`: None
    without a head), which a backend makes in `_caches(slots, capacity)`. `source` is the backend whose models
    these slots run (None for the one opened on the files; cost.cost_curve reads it)."""
    slots: int
    spec: TargetSpec
    source = None

    def _caches(self, slots: int, capacity: int) -> tuple:
        raise NotImplementedError

    def _allocate(self, slots: int, capacity: int) -> None:
        if slots < 1:
            raise ValueError(f"the batch needs at least one slot, got {slots}")
        self.slots = slots
        self.tcache, self.dcache = self._caches(slots, capacity)

    def with_slots(self, slots: int, extra_rows: int = 0, context: int | None = None):
        other = copy.copy(self)            # the same models and sessions: no second copy of the weights
        other.source = self.source or self
        if context is not None and context < self.spec.max_context:
            if context < 1:
                raise ValueError(f"the context must be at least 1 token, got {context}")
            other.spec = replace(self.spec, max_context=context)
        other._allocate(slots, other.spec.max_context + extra_rows)
        return other

    def reset(self, capacity: int, draft_capacity: int | None = None) -> bool:
        """-> whether a cache was reallocated (a cache only grows)."""
        grown = False
        for c, rows in ((self.tcache, capacity), (self.dcache, draft_capacity or capacity)):
            if c is not None:
                grown |= c.grow(rows)
                for slot in range(self.slots):
                    c.clear(slot)
        return grown

    def target_commit(self, slot: int, keep: torch.Tensor) -> None:
        self.tcache.commit(slot, keep)

    def draft_commit(self, slot: int, keep: torch.Tensor) -> None:
        self.dcache.commit(slot, keep)

    def draft_rollback(self, rows: slice) -> None:
        self.dcache.rollback(rows)

    def clear(self, slot: int) -> None:
        for c in self.caches():
            c.clear(slot)

    def move(self, src: int, dst: int) -> None:
        for c in self.caches():
            c.move(src, dst)

    @property
    def slot_bytes(self) -> int:
        """KV memory per slot, target + draft."""
        return sum(c.slot_bytes for c in self.caches())

    def caches(self):
        return [c for c in (self.tcache, self.dcache) if c is not None]
