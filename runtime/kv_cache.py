"""Preallocated KV cache for the torch backend: one [B, Hkv, capacity, D] buffer pair per layer.

A forward appends its N rows after the committed length without committing them; `commit(keep)` then gathers the
rows the verifier accepted into place (EAGLE's in-place compaction) and `rollback()` forgets the rest. Rejected rows
need no undo: the next forward overwrites them.
"""
from __future__ import annotations

import torch


class TorchKVCache:
    """Implements runtime.backend.KVCache (and models.target.LayerCache for the forward)."""

    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        self.shape = (num_layers, batch, num_kv_heads, 0, head_dim)
        self.dtype, self.device = dtype, device
        self.k = self.v = torch.zeros(self.shape, dtype=dtype, device=device)
        self.capacity = 0
        self.length = 0    # committed rows
        self.pending = 0   # rows written by forwards since the last commit/rollback

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B, Hkv, N, D] after the rows already pending; return all rows [B, Hkv, T, D] to attend."""
        start = self.length + self.pending
        end = start + k.shape[2]
        if end > self.capacity:
            raise RuntimeError(f"KV cache overflow: {end} rows > capacity {self.capacity}")
        self.k[layer, :, :, start:end] = k
        self.v[layer, :, :, start:end] = v
        if layer == self.k.shape[0] - 1:
            self.pending += k.shape[2]
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def reserve(self, n: int) -> None:
        """Check that a forward of n rows fits (static forwards write through runtime/static.py, not update)."""
        end = self.length + self.pending + n
        if end > self.capacity:
            raise RuntimeError(f"KV cache overflow: {end} rows > capacity {self.capacity}")

    def appended(self, n: int) -> None:
        """A static forward wrote n rows after the pending ones."""
        self.pending += n

    def commit(self, keep: torch.Tensor) -> None:
        """keep [K] int64: indices into the pending rows, in order; they become committed rows. The indices are
        read on the host (the verifier decides there); on a GPU the gather runs on the device."""
        n = int(keep.shape[0])
        src = (keep if keep.device.type == "cpu" else keep.cpu()) + self.length
        if n and not torch.equal(src, torch.arange(self.length, self.length + n)):
            if src.device != self.k.device:
                src = src.to(self.k.device, non_blocking=True)
            # index_select copies first, so overlapping source and destination rows are safe
            self.k[:, :, :, self.length:self.length + n] = self.k.index_select(3, src)
            self.v[:, :, :, self.length:self.length + n] = self.v.index_select(3, src)
        self.length += n
        self.pending = 0

    def rollback(self) -> None:
        self.pending = 0

    def reset(self, capacity: int) -> None:
        if capacity > self.capacity:         # grow only: the buffers are reused by every later generation
            shape = self.shape[:3] + (capacity,) + self.shape[4:]
            self.k = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.v = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.capacity = capacity
        self.length = self.pending = 0


def new_cache(num_layers: int, batch: int, num_kv_heads: int, head_dim: int, capacity: int,
              dtype: torch.dtype, device: torch.device | str = "cpu") -> TorchKVCache:
    """An empty TorchKVCache with room for `capacity` rows."""
    cache = TorchKVCache(num_layers, batch, num_kv_heads, head_dim, dtype, device)
    cache.reset(capacity)
    return cache
