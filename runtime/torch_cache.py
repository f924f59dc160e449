"""KV cache of the PyTorch backend: per-layer buffers [slots, Hkv, capacity, D] on the backend's device, one slot
per request.

Row r of a slot holds the key and value of position r of its request: the committed rows 0..length-1, then the
`pending` rows forwards appended since the last commit or rollback. A forward over slots `rows` writes each slot's
N new rows right after its own committed + pending rows (`begin`, then `update` per layer), and its mask (`mask`)
hides everything past each slot's own rows (trailing padding up to the longest slot). `commit(keep)` gathers the
rows the verifier accepted into place (EAGLE's in-place compaction), `rollback` forgets the rest: rejected rows need
no undo, the next forward overwrites them. Fixed-shape forwards (static and graphs modes) write through
runtime/static.py instead, after `uniform_pending`.
"""
from __future__ import annotations

import torch

from .backend import SlotCounts


class SlotCache(SlotCounts):
    """Per-slot KV buffers for `layers` layers on `device` (models.target.LayerCache over a slice of slots)."""

    def __init__(self, layers: int, slots: int, heads: int, dim: int, capacity: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        """Room for `capacity` rows per slot (grow() adds more)."""
        shape = (layers, slots, heads, capacity, dim)
        self.device = torch.device(device)
        self.k = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=dtype, device=self.device)
        self.layers, self.capacity = layers, capacity
        super().__init__(slots)
        self._rows = slice(0, 0)

    @property
    def slot_bytes(self) -> int:
        """KV memory of one slot (keys + values, all layers, full capacity)."""
        return 2 * self.k[:, 0].numel() * self.k.element_size()

    def begin(self, rows: slice, n: int) -> tuple[torch.Tensor, int]:
        """Prepare a forward of n rows over slots `rows`: -> (start column of each row [B], total columns T)."""
        starts = [self.length[s] + self.pending[s] for s in range(rows.start, rows.stop)]
        end = max(starts) + n
        if end > self.capacity:
            raise RuntimeError(f"KV cache overflow: {end} rows > capacity {self.capacity}")
        # one start for every row (a lone request always): a slice write, else one indexed write per layer
        self._start = starts[0] if len(set(starts)) == 1 else None
        starts = torch.tensor(starts)
        self._rows, self._end = rows, end
        if self._start is None:
            self._cols = (starts[:, None] + torch.arange(n)).to(self.device, non_blocking=True)   # [B,N] columns
        return starts, end

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows, end, start = self._rows, self._end, self._start
        if start is not None:
            self.k[layer, rows, :, start:start + k.shape[2]] = k
            self.v[layer, rows, :, start:start + k.shape[2]] = v
        else:
            slot = torch.arange(rows.stop - rows.start, device=self.device)[:, None]
            # [B,Hkv,C,D] viewed as [B,C,Hkv,D]: one indexed write of every row's N new keys at its own columns
            self.k[layer, rows].permute(0, 2, 1, 3)[slot, self._cols] = k.transpose(1, 2)
            self.v[layer, rows].permute(0, 2, 1, 3)[slot, self._cols] = v.transpose(1, 2)
        if layer == self.layers - 1:
            self.appended(rows, k.shape[2])
        return self.k[layer, rows, :, :end], self.v[layer, rows, :, :end]

    def appended(self, rows: slice, n: int) -> None:
        """n rows were written after the pending ones of every slot of `rows`."""
        for s in range(rows.start, rows.stop):
            self.pending[s] += n

    def uniform_pending(self, rows: slice, n: int) -> int:
        """The pending rows every slot of `rows` has (a fixed-shape forward needs one count), checking that n more
        rows fit."""
        pending = {self.pending[s] for s in range(rows.start, rows.stop)}
        if len(pending) != 1:
            raise ValueError(f"a fixed-shape forward needs the same pending rows in every slot, got {sorted(pending)}")
        p = pending.pop()
        end = max(self.length[rows]) + p + n
        if end > self.capacity:
            raise RuntimeError(f"KV cache overflow: {end} rows > capacity {self.capacity}")
        return p

    def commit(self, slot: int, keep: torch.Tensor) -> None:
        """keep [K] int64: the slot's pending rows (in order) that become committed rows."""
        n, length = int(keep.shape[0]), self.length[slot]
        src = keep.cpu() + length
        if n and not torch.equal(src, torch.arange(length, length + n)):
            src = src.to(self.device, non_blocking=True)
            # index_select copies first, so overlapping source and destination rows are safe
            self.k[:, slot, :, length:length + n] = self.k[:, slot].index_select(2, src)
            self.v[:, slot, :, length:length + n] = self.v[:, slot].index_select(2, src)
        self.length[slot] += n
        self.pending[slot] = 0

    def grow(self, capacity: int) -> bool:
        """Room for `capacity` rows per slot, keeping every slot's rows; True when the buffers were reallocated."""
        if capacity <= self.capacity:
            return False
        pad = (0, 0, 0, capacity - self.capacity)          # the capacity axis is the second to last
        self.k = torch.nn.functional.pad(self.k, pad)
        self.v = torch.nn.functional.pad(self.v, pad)
        self.capacity = capacity
        return True

    def _copy(self, src: int, dst: int, n: int) -> None:
        self.k[:, dst, :, :n] = self.k[:, src, :, :n]
        self.v[:, dst, :, :n] = self.v[:, src, :, :n]

    def rows(self, slot: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The slot's first n keys and values, [layers, Hkv, n, D] each (for tests and checks)."""
        return self.k[:, slot, :, :n], self.v[:, slot, :, :n]

    def mask(self, rows: slice, starts: torch.Tensor, end: int, mask: torch.Tensor | None, n: int) -> torch.Tensor:
        """[B,1,N,end] bool on the cache's device: each row sees its committed rows, then `mask` over its pending +
        new rows."""
        B = rows.stop - rows.start
        cols = torch.arange(end)
        length = torch.tensor(self.length[rows])
        out = (cols < length[:, None])[:, None, :].expand(B, n, end).clone()        # [B,N,end] committed
        if mask is None:
            new = starts[:, None] + torch.arange(n)                                  # [B,N] own column of each row
            out |= (cols >= length[:, None, None]) & (cols <= new[:, :, None])
        else:
            P = mask.shape[-1]
            idx = length[:, None] + torch.arange(P)                                  # [B,P] columns mask covers
            out.scatter_(2, idx[:, None, :].expand(B, n, P), mask.cpu())
        return out.unsqueeze(1).to(self.device, non_blocking=True)
