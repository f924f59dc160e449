"""Batched execution of an ONNX Runtime engine for the in-flight batcher: the engine's own graphs (batch is their
leading axis, masks are per row) over per-slot KV rows that the graphs read and write in place.

The graphs take each KV tensor as a rows-first buffer [P+N, B, Hkv, D] (export/row_attention.py): row b attends
over its own valid rows of the first P and the N new rows the graph writes at P..P+N-1. `SlotRows` keeps every KV
tensor as one such buffer [capacity, W, Hkv, D] whose width W is the number of slots in use, so a forward over all
of them binds the first P+N rows of each buffer as the graph's input and output: nothing is copied in, and only
the rows whose own end lies before P have their N new rows moved down to where a request decoded alone keeps them
(a few rows per request). A forward over some of the slots (a prefill, a catch-up of one request) gathers just
those slots' rows. The width follows the batch: a slot past it widens the buffers, a forward over fewer slots
with the rest empty narrows them (one copy of the committed rows each time, not one per forward).
"""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import torch
from onnxruntime.capi.onnxruntime_inference_collection import OrtDevice

from .batch_backend import SlotBackend, SlotCounts
from .ort_cache import NP_DTYPES, ONNX_DTYPES, kv_names
from .ort_session import outputs


class SlotRows(SlotCounts):
    """KV rows of `slots` requests for the KV tensors `names` (past_<name> / present_<name> in the graphs): one
    zero-initialised array [tensors, capacity, width, Hkv, D] (zeros: a masked key or value must be finite, since
    the attention multiplies it by an exact zero), with SlotCounts' per-slot rows (a row's index is its position)."""

    def __init__(self, names: list[str], slots: int, heads: int, dim: int, capacity: int, dtype: str):
        self.names, self.heads, self.dim, self.dtype = list(names), heads, dim, dtype
        self.layers = len(names) // 2
        self.element = NP_DTYPES[dtype]
        self._kind = ONNX_DTYPES[dtype]
        self._c_device = OrtDevice.make("cpu", 0)._get_c_device()
        self.capacity, self.width = capacity, 0
        self.kv = self._empty(capacity, 0)
        super().__init__(slots)

    def _empty(self, capacity: int, width: int) -> np.ndarray:
        return np.zeros((len(self.names), capacity, width, self.heads, self.dim), self.element)

    @property
    def slot_bytes(self) -> int:
        """KV memory of one slot (every tensor, full capacity)."""
        return len(self.names) * self.capacity * self.heads * self.dim * self.element().itemsize

    def own(self, rows: slice) -> list[int]:
        """Each slot's committed + pending rows."""
        return [self.length[s] + self.pending[s] for s in range(rows.start, rows.stop)]

    def _relayout(self, capacity: int, width: int) -> None:
        """New buffers, every committed and pending row kept (slots past the new width must be empty)."""
        kv, used = self._empty(capacity, width), max(self.own(slice(0, len(self.length))), default=0)
        w = min(width, self.width)
        kv[:, :used, :w] = self.kv[:, :used, :w]
        self.kv, self.capacity, self.width = kv, capacity, width

    def fit(self, rows: slice) -> bool:
        """Make the buffers as wide as the slots in use, `rows` included; -> whether `rows` are all of them (the
        forward then runs in place)."""
        if rows.stop > self.width:
            self._relayout(self.capacity, rows.stop)
        elif rows.start == 0 and rows.stop < self.width and not any(self.own(slice(rows.stop, self.width))):
            self._relayout(self.capacity, rows.stop)
        return rows.start == 0 and rows.stop == self.width

    def bind(self, io: ort.IOBinding, view: np.ndarray, rows: int) -> None:
        """Bind the first `rows` rows of each tensor of `view` [tensors, R, B, Hkv, D] as past_ and present_."""
        c, shape = io._iobinding, [rows, *view.shape[2:]]
        step = view.strides[0]
        for i, name in enumerate(self.names):
            ptr = view.ctypes.data + i * step
            c.bind_input("past_" + name, self._c_device, self._kind, shape, ptr)
            c.bind_output("present_" + name, self._c_device, self._kind, shape, ptr)

    def place(self, rows: slice, view: np.ndarray, own: list[int], P: int, N: int) -> None:
        """After a forward that wrote its N new rows at P..P+N-1 of `view` (the buffers themselves, or the slots
        `rows` gathered): each slot's new rows go right after its own rows, where a request alone keeps them."""
        inplace = view is self.kv
        for j, o in enumerate(own):
            s = rows.start + j
            if not inplace or o != P:
                new = view[:, P:P + N, j]
                self.kv[:, o:o + N, s] = new.copy() if inplace else new     # in place, the two may overlap
            self.pending[s] += N

    def commit(self, slot: int, keep: torch.Tensor) -> None:
        """keep [K] int64: the slot's pending rows (in order) that become committed rows."""
        keep_np = keep.numpy() if isinstance(keep, torch.Tensor) else np.asarray(keep)
        n, length = int(keep_np.shape[0]), self.length[slot]
        if n and not (keep_np == np.arange(n)).all():       # else already in place
            self.kv[:, length:length + n, slot] = self.kv[:, keep_np + length, slot]   # fancy indexing copies first
        self.length[slot] += n
        self.pending[slot] = 0

    def grow(self, capacity: int) -> bool:
        """Room for `capacity` rows per slot, keeping every slot's rows; True when the buffers were reallocated."""
        if capacity <= self.capacity:
            return False
        self._relayout(capacity, self.width)
        return True

    def _copy(self, src: int, dst: int, n: int) -> None:
        self.kv[:, :n, dst] = self.kv[:, :n, src]

    def rows(self, slot: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The slot's first n keys and values, [layers, Hkv, n, D] each (for tests and checks)."""
        kv = torch.from_numpy(self.kv[:, :n, slot].copy()).permute(0, 2, 1, 3)
        return kv[0::2], kv[1::2]


class OrtBatchBackend(SlotBackend):
    def __init__(self, backend, slots: int, extra_rows: int = 0):
        """`backend`: an opened runtime.ort_backend.OrtBackend (its sessions are shared, not copied)."""
        self.ort = backend
        self._init_slots(backend, slots)
        cap = self.spec.max_context + extra_rows
        s = self.spec
        self.tcache = SlotRows(kv_names(s.num_layers), slots, s.num_kv_heads, s.head_dim, cap, backend.dtype)
        self.dcache = None
        if backend.draft_sess is not None:
            d = backend.manifest["draft"]["spec"]
            self.dcache = SlotRows(kv_names(1), slots, d["num_kv_heads"], d["head_dim"], cap, backend.dtype)

    def _run(self, sess, io, cache: SlotRows, rows: slice, input_ids, position_ids, mask, last_only, keep: list):
        """Bind ids, positions, the masks, logits rows and the KV rows of slots `rows`, run, and place the new rows."""
        B, N = input_ids.shape
        own = cache.own(rows)
        P = max(own)
        if P + N > cache.capacity:
            raise RuntimeError(f"KV cache overflow: {P + N} rows > capacity {cache.capacity}")
        inplace = cache.fit(rows)
        if inplace:
            view = cache.kv
        else:
            view = cache._empty(P + N, B)
            view[:, :P] = cache.kv[:, :P, rows]
        attn = np.zeros((B, 1, N, P + N), dtype=bool)
        cols = np.arange(P)
        if mask is None:
            attn[:, 0, :, :P] = (cols < np.array(own)[:, None])[:, None, :]
            attn[:, 0, :, P:] = np.tril(np.ones((N, N), dtype=bool))
        else:                                     # mask [B,N,pending+N]: the same pending count in every row
            m = mask.numpy() if hasattr(mask, "numpy") else np.asarray(mask)
            pend = m.shape[-1] - N
            length = cache.length[rows]
            attn[:, 0, :, :P] = (cols < np.array(length)[:, None])[:, None, :]
            for b, L in enumerate(length):
                attn[b, 0, :, L:L + pend] = m[b, :, :pend]
            attn[:, 0, :, P:] = m[:, :, pend:]
        feeds = {"input_ids": input_ids.numpy().astype(np.int64), "position_ids": position_ids.numpy().astype(np.int64),
                 "attn_mask": attn, "logits_rows": np.array([N - 1] if last_only else range(N), dtype=np.int64)}
        for name, a in feeds.items():
            io.bind_cpu_input(name, a)
        cache.bind(io, view, P + N)
        sess.run_with_iobinding(io)
        values = outputs(io)
        out = [values[i].numpy() for i in range(len(keep))]
        cache.place(rows, view, own, P, N)
        return out

    def target_forward(self, rows: slice, input_ids, position_ids, mask=None, last_only=False):
        o, N = self.ort, input_ids.shape[1]
        io = o.target_sess.io_binding()
        for name in o._target_out:                   # logits (+ features), bound first so they come out first
            io.bind_output(name)
        out = self._run(o.target_sess, io, self.tcache, rows, input_ids, position_ids, mask, last_only,
                        o._target_out)
        feats = out[1] if o.features else np.zeros((input_ids.shape[0], N, 0), np.float32)
        return torch.from_numpy(out[0]), torch.from_numpy(feats)

    def draft_forward(self, rows: slice, hidden, input_ids, position_ids, mask, project: bool, top_k: int,
                      last_only: bool = False):
        o = self.ort
        h = hidden.detach().numpy().astype(o.np_dtype, copy=False)
        if project and o.fc_sess is not None:
            h = o.fc_sess.run(["hidden"], {"features": np.ascontiguousarray(h)})[0]
        io = o.draft_sess.io_binding()
        names = ("hidden_out", "top_logp", "top_ids")
        for name in names:
            io.bind_output(name)
        h = np.ascontiguousarray(h)
        io.bind_cpu_input("hidden", h)
        top = np.array(top_k, dtype=np.int64)
        io.bind_cpu_input("top_k", top)
        h_out, logp, ids = self._run(o.draft_sess, io, self.dcache, rows, input_ids, position_ids, mask, last_only,
                                     names)
        return torch.from_numpy(h_out), torch.from_numpy(logp), torch.from_numpy(ids)
