"""Batched execution for the in-flight batcher (runtime/batch.py): one copy of the target and draft, many requests.

Each request owns a KV *slot* (target and draft at the same index) in preallocated per-layer buffers
[slots, Hkv, capacity, D]. Active requests occupy slots 0..B-1 (the batcher moves the last one into a freed slot),
so a batched forward reads one contiguous view. Row r's committed keys sit at columns [0, length[r]), exactly
where a request decoded alone keeps them; a forward writes its N new rows after the row's own committed + pending
rows, and each row's mask hides everything past its own rows (trailing padding up to the longest row).

Forwards take `rows`, a slice of slots: the batch (0..B) or one slot (a request's prefill, run alone). Masks
cover the uncommitted rows of each row ([B, N, pending + N] bool, None = causal), as in runtime/backend.py; every
row of a masked forward has the same pending count (a tree's earlier draft levels, or none when verifying), and its
own mask over them (each request's own tree).

Numerics (fp32, measured on the embedded default model): on PyTorch a row's logits inside a batched forward are not
bit-identical to the same row decoded alone: CPU GEMMs pick kernels by the number of rows M (M = 1, 2-6 and >= 7
give three different roundings of the same row). The differences are ~1e-5 on logits of magnitude ~10, the same
order as between a speculative tree verification and a one-token decode of the same request, which the
single-request path already accepts: greedy output is equal unless two logits tie within that. ONNX Runtime
engines give bit-identical rows: MLAS GEMMs are row-invariant and their attention is row-independent, masked
padding columns included (export/row_attention.py). tests/test_batch.py measures both and checks the outputs.
"""
from __future__ import annotations

import torch

from eaglex.models.target import DTYPES

from .device import to_device
from .static import CudaGraphs, WindowView, local_mask, run_static, slots_for, window_for, window_mask


class SlotCounts:
    """What every per-slot KV cache counts: per slot the committed rows `length` (in context order) and the
    `pending` rows forwards appended since its last commit or rollback; a cache copies the rows in `_copy`."""

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


class SlotCache(SlotCounts):
    """Per-slot KV buffers for `layers` layers on `device` (models.target.LayerCache over a slice of slots)."""

    def __init__(self, layers: int, slots: int, heads: int, dim: int, capacity: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
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
        starts = torch.tensor(starts)
        self._rows, self._end = rows, end
        self._cols = (starts[:, None] + torch.arange(n)).to(self.device, non_blocking=True)   # [B,N] write columns
        return starts, end

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows, end = self._rows, self._end
        B = rows.stop - rows.start
        slot = torch.arange(B, device=self.device)[:, None]
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


class SlotBackend:
    """What both batched backends share: a target and an optional draft SlotCache, one slot per request, and the
    slot half of the Backend protocol (runtime/backend.py) over them."""

    def _init_slots(self, backend, slots: int) -> None:
        self.spec, self.draft_kind, self.dtype = backend.spec, backend.draft_kind, backend.dtype
        self.exact_trees = getattr(backend, "exact_trees", None)     # "chain": the engine is exact with chains only
        self.source = backend                # the backend whose models these slots run (cost.cost_curve reads it)
        self.slots = slots

    def _allocate(self, backend, slots: int, extra_rows: int, draft_kv: tuple[int, int] | None,
                  device: torch.device | str = "cpu") -> None:
        """`draft_kv`: the draft's (kv heads, head dim), None without a head; `extra_rows`: room for one tree."""
        self._init_slots(backend, slots)
        s, dt = self.spec, DTYPES[backend.dtype]
        cap = s.max_context + extra_rows
        self.tcache = SlotCache(s.num_layers, slots, s.num_kv_heads, s.head_dim, cap, dt, device)
        self.dcache = SlotCache(1, slots, *draft_kv, cap, dt, device) if draft_kv is not None else None

    def reset(self, capacity: int, draft_capacity: int | None = None) -> bool:
        """-> whether a cache was reallocated (see SlotCache.grow)."""
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
        return self.tcache.slot_bytes + (self.dcache.slot_bytes if self.dcache is not None else 0)

    def caches(self):
        return [c for c in (self.tcache, self.dcache) if c is not None]


class TorchBatchBackend(SlotBackend):
    """Slots over a TorchBackend's models (the same modules: no second copy of the weights), on its device and in
    its mode (runtime/torch_backend.py): "eager" attends over exactly each forward's columns; "static" and "graphs"
    run fixed-shape forwards over a window of the slots' buffers (runtime/static.py) with every row's committed
    length as a device input, so one shape serves a batch size whatever the rows' lengths, and "graphs" captures
    them as CUDA graphs per batch size (and forward width, window, rows)."""

    def __init__(self, backend, slots: int, extra_rows: int = 0):
        """`backend`: a runtime.torch_backend.TorchBackend; `extra_rows`: room past the context for one tree."""
        self.target, self.draft = backend.target, backend.draft
        self.device, self.mode = backend.device, backend.mode
        d = self.draft.spec if self.draft is not None else None
        self._allocate(backend, slots, extra_rows, (d.num_kv_heads, d.head_dim) if d is not None else None,
                       self.device)
        self.graphs = CudaGraphs(self.device) if self.mode == "graphs" else None

    def reset(self, capacity: int, draft_capacity: int | None = None) -> bool:
        grown = super().reset(capacity, draft_capacity)
        if grown and self.graphs is not None:       # the captured graphs point at the old buffers
            self.graphs.clear()
        return grown

    @torch.inference_mode()
    def target_forward(self, rows: slice, input_ids, position_ids, mask=None, last_only=False):
        c, (B, N) = self.tcache, input_ids.shape
        out_rows = "last" if last_only else "all"
        if self.mode == "eager":
            starts, end = c.begin(rows, N)
            attn = c.mask(rows, starts, end, mask, N)
            return self.target(to_device(input_ids, self.device), to_device(position_ids, self.device), attn, c,
                               out_rows)
        pending = c.uniform_pending(rows, N)
        local = local_mask(mask, B, N, pending)
        window = window_for(max(c.length[rows]) + pending + N, c.capacity)
        k, v = c.k[:, rows], c.v[:, rows]

        def forward(ids, pos, loc, length):
            view = WindowView(k, v, slots_for(length, pending, N), window)
            return self.target(ids, pos, window_mask(loc, length, window), view, out_rows)

        out = run_static(self.graphs, self.device, ("target", rows.start, B, N, local.shape[2], window, out_rows),
                         forward, (input_ids, position_ids, local, torch.tensor(c.length[rows])))
        c.appended(rows, N)
        return out

    @torch.inference_mode()
    def draft_forward(self, rows: slice, hidden, input_ids, position_ids, mask, project: bool, top_k: int,
                      last_only: bool = False):
        c, draft, (B, N) = self.dcache, self.draft, input_ids.shape
        dtype = draft.fc.weight.dtype
        if self.mode == "eager":
            starts, end = c.begin(rows, N)
            attn = c.mask(rows, starts, end, mask, N)
            h = draft(to_device(hidden, self.device).to(dtype), to_device(input_ids, self.device),
                      to_device(position_ids, self.device), attn, c, project)
            logp, ids = draft.log_probs(h[:, -1:] if last_only else h).topk(top_k, dim=-1)
            return h, logp, draft.to_target_ids(ids)
        pending = c.uniform_pending(rows, N)
        local = local_mask(mask, B, N, pending)
        window = window_for(max(c.length[rows]) + pending + N, c.capacity)
        k, v = c.k[:, rows], c.v[:, rows]

        def forward(hid, ids, pos, loc, length):
            view = WindowView(k, v, slots_for(length, pending, N), window)
            h = draft(hid.to(dtype), ids, pos, window_mask(loc, length, window), view, project)
            logp, top = draft.log_probs(h[:, -1:] if last_only else h).topk(top_k, dim=-1)
            return h, logp, draft.to_target_ids(top)

        key = ("draft", rows.start, B, N, local.shape[2], window, bool(project), top_k, bool(last_only),
               hidden.shape[-1], hidden.dtype)
        out = run_static(self.graphs, self.device, key, forward,
                         (hidden, input_ids, position_ids, local, torch.tensor(c.length[rows])))
        c.appended(rows, N)
        return out


def batch_backend(backend, slots: int, extra_rows: int = 0):
    """The batched backend over a single-request backend's models (its class's `batched`: TorchBatchBackend, or
    OrtBatchBackend for an engine), with `slots` slots of the context + `extra_rows` rows."""
    if slots < 1:
        raise ValueError(f"the batch needs at least one slot, got {slots}")
    return backend.batched(backend, slots, extra_rows)
