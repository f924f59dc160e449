"""KV cache of ONNX Runtime engines: per-slot rows that the graphs read and write in place, one slot per request.

The graphs take each KV tensor as a rows-first buffer [P+N, B, Hkv, D] (export/row_attention.py): row b attends
over its own valid rows of the first P and the N new rows the graph writes at P..P+N-1. `SlotRows` keeps every KV
tensor as one such buffer [capacity, W, Hkv, D] whose width W is the number of slots in use, so a forward over all
of them binds the first P+N rows of each buffer as the graph's input and output: nothing is copied in, and only
the rows whose own end lies before P have their N new rows moved down to where a request decoded alone keeps them
(a few rows per request; none for a lone request). A forward over some of the slots (a prefill, a catch-up of one
request) gathers just those slots' rows. The width follows the batch: a slot past it widens the buffers (requests that
join together widen them once); a forward over fewer slots with the rest empty runs in place over all of them, the
empty ones as dummy rows, until the slots in use fall to half the width, when the buffers narrow (each relayout
copies every committed row, so they come once per halving, not once per departure).

Rows of a slot: the committed rows 0..length-1 in context order (a row's index is its position, as in vanilla
decoding), then the `pending` rows forwards appended since the last commit or rollback. rollback() forgets the
pending rows (the next forward overwrites them); commit(keep) of all pending rows in order (a prefill, a vanilla
step, a draft extend) moves nothing, any other (a tree's accepted path) moves the kept rows down into place.
The buffers are numpy allocations in host memory, whose pages the system commits only as rows get written, so a
large capacity costs address space, not memory.
"""
from __future__ import annotations

import functools

import numpy as np
import onnxruntime as ort
import torch
from onnx import TensorProto
from onnxruntime.capi.onnxruntime_inference_collection import OrtDevice

from .backend import SlotCounts

NARROW = 0.5   # narrow the buffers when the slots in use fall to this fraction of their width (fit)
NP_DTYPES = {"float32": np.float32, "float16": np.float16}
ONNX_DTYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}


MASK_CACHE_ROWS = 64   # square masks kept for forwards of at most this many rows (decode steps and trees)


@functools.cache
def _kept_squares(n: int) -> tuple[np.ndarray, np.ndarray]:
    eye, causal = np.eye(n, dtype=bool), np.tril(np.ones((n, n), dtype=bool))
    eye.flags.writeable = causal.flags.writeable = False
    return eye, causal


def _squares(n: int) -> tuple[np.ndarray, np.ndarray]:
    """([n, n] bool identity, [n, n] lower triangle): made once per n for decode and tree forwards, which build a
    mask every step; made fresh for a prefill's n, so that no prompt length stays in memory."""
    return _kept_squares(n) if n <= MASK_CACHE_ROWS else _kept_squares.__wrapped__(n)


def kv_names(layers: int) -> list[str]:
    """The KV tensors of `layers` layers, as the graphs' past_<name> / present_<name> call them."""
    return [f"{kv}_{i}" for i in range(layers) for kv in ("key", "value")]


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
        self._io = [("past_" + n, "present_" + n) for n in self.names]
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

    def fit(self, rows: slice) -> int | None:
        """Make the buffers at least as wide as the slots in use, `rows` included -> None when the forward must
        gather `rows`, else how many empty slots after `rows` it runs over too (0: `rows` are all of them) in place.
        Buffers narrow only when the slots in use fall to NARROW of their width: narrowing copies every row, so
        until then the empty trailing slots ride along as dummy rows (row-independent: they change no other row)."""
        if rows.stop > self.width:
            self._relayout(self.capacity, rows.stop)
        if rows.start or rows.stop == self.width:
            return None if rows.start else 0
        if any(self.own(slice(rows.stop, self.width))):
            return None
        if rows.stop <= self.width * NARROW:
            self._relayout(self.capacity, rows.stop)
            return 0
        return self.width - rows.stop

    def bind(self, io: ort.IOBinding, view: np.ndarray, rows: int) -> None:
        """Bind the first `rows` rows of each tensor of `view` [tensors, R, B, Hkv, D] as past_ and present_."""
        # Through the C++ binding under ORT's Python IOBinding, with a device object made once: the wrapper makes
        # an OrtDevice and books the name on every call, and a forward binds every KV tensor twice. The names are
        # joined once (self._io) and the base address read once: `ndarray.ctypes` builds an object per access.
        c, shape, kind, dev = io._iobinding, [rows, *view.shape[2:]], self._kind, self._c_device
        base, step = view.__array_interface__["data"][0], view.strides[0]
        for i, (past, present) in enumerate(self._io):
            ptr = base + i * step
            c.bind_input(past, dev, kind, shape, ptr)
            c.bind_output(present, dev, kind, shape, ptr)

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

    def mask(self, rows: slice, own: list[int], P: int, N: int, mask, dummies: int = 0) -> np.ndarray:
        """[B+dummies,1,N,P+N] bool for a forward of N rows over slots `rows` whose own rows end at `own` (P = the
        longest): each row sees its committed rows, then `mask` ([B,N,pending+N], the same pending count in every
        row; None = every pending row, then causal) over its pending rows and the N new ones at P..P+N-1. The
        `dummies` rows after them (empty slots run in place, see fit) see their own new row alone: a row must see
        something; nothing sees them, and they are rolled back."""
        B = rows.stop - rows.start
        attn = np.zeros((B + dummies, 1, N, P + N), dtype=bool)
        if dummies:
            attn[B:, 0, :, P:] = _squares(N)[0]
        attn, full = attn[:B], attn
        cols = np.arange(P)
        if mask is None:
            attn[:, 0, :, :P] = (cols < np.array(own)[:, None])[:, None, :]
            attn[:, 0, :, P:] = _squares(N)[1]
            return full
        m = mask.numpy() if hasattr(mask, "numpy") else np.asarray(mask)
        pend = m.shape[-1] - N
        length = self.length[rows]
        attn[:, 0, :, :P] = (cols < np.array(length)[:, None])[:, None, :]
        for b, L in enumerate(length):
            attn[b, 0, :, L:L + pend] = m[b, :, :pend]
        attn[:, 0, :, P:] = m[:, :, pend:]
        return full

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
