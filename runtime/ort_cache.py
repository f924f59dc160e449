"""KV cache for ONNX Runtime engines: OrtValues that the graphs grow by concatenation, compacted lazily.

A forward takes past_* (committed + pending rows) and returns present_* with its N rows appended; those OrtValues
become the next past without leaving ORT (concat growth + IOBinding measured fastest for tree
verification on CPU). The committed values are kept aside, so:
- rollback() is free: the committed values simply become current again;
- commit(keep) of all pending rows in order (a prefill, a vanilla step, a draft extend) is free as well;
- any other commit (the accepted tree path) is free too, up to a point: the rejected rows stay where they are as
  *holes*, which `valid` marks and `attention_mask` hides from every later query. Positions are explicit
  (position_ids), so a hole shifts nothing. Once the holes outnumber max(HOLES_MIN, length / HOLES_SHARE) rows,
  the commit gathers the valid rows in a tiny ORT graph (one Gather per tensor, no numpy round trip) instead.
  Measured on the 0.5B bench target (32 KV tensors, ~300 rows): a gather costs 1.5-3 ms, about 2-4% of a cycle,
  while a hole costs each later forward one more masked row (~5 us of concat copy).
"""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper

from eaglex.models.target import causal_mask

from .ort_session import provider_device, session_options

NP_DTYPES = {"float32": np.float32, "float16": np.float16}
_ONNX_DTYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}


def gather_session(count: int, dtype: str, providers: list | None = None) -> ort.InferenceSession:
    """out_i = Gather(kv_i, index, axis=2) for `count` tensors [B,Hkv,T,D] -> [B,Hkv,K,D]."""
    t = _ONNX_DTYPES[dtype]
    shape = ["batch", "heads", "rows", "dim"]
    inputs = [helper.make_tensor_value_info(f"kv_{i}", t, shape) for i in range(count)]
    inputs.append(helper.make_tensor_value_info("index", TensorProto.INT64, ["keep"]))
    outputs = [helper.make_tensor_value_info(f"out_{i}", t, ["batch", "heads", "keep", "dim"]) for i in range(count)]
    nodes = [helper.make_node("Gather", [f"kv_{i}", "index"], [f"out_{i}"], axis=2) for i in range(count)]
    graph = helper.make_graph(nodes, "kv_gather", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    model.ir_version = 10
    onnx.checker.check_model(model)
    return ort.InferenceSession(model.SerializeToString(), session_options(),
                                providers=providers or ["CPUExecutionProvider"])


HOLES_MIN = 64        # compact when the holes exceed max(HOLES_MIN, valid rows / HOLES_SHARE)
HOLES_SHARE = 4


class OrtKVCache:
    def __init__(self, count: int, num_kv_heads: int, head_dim: int, dtype: str, providers: list | None = None,
                 holes: bool = True, holes_within: int | None = None):
        """`providers`: the engine's (runtime/ort_session.choose_providers); on a GPU provider the values live in
        device memory (the graphs' present_* outputs and the gathers are bound there) and never cross to the host.
        `holes=False`: every commit that is not all pending rows in order compacts, so a row's index in the cache
        is its position (FP8 engines need it for exactness: runtime/ort_backend.py). `holes_within`: holes are kept
        only while a forward sees at most that many rows; a forward that would see more first compacts, so every
        row beyond sits at its position's index, as in vanilla decoding (row-independent engines' bound)."""
        self.count, self.heads, self.dim, self.dtype = count, num_kv_heads, head_dim, dtype
        self.allow_holes = holes
        self.holes_within = holes_within
        self.device = provider_device(providers)
        self.gather = gather_session(count, dtype, providers)
        self.capacity = 0
        self.reset(0)

    def reset(self, capacity: int) -> None:
        empty = np.zeros((1, self.heads, 0, self.dim), NP_DTYPES[self.dtype])      # batch 1, no rows yet
        self.committed = [ort.OrtValue.ortvalue_from_numpy(empty) for _ in range(self.count)]
        self.current = self.committed
        self.length = self.pending = 0      # valid committed rows; rows appended since the last commit/rollback
        self.valid = np.zeros(0, dtype=bool)  # [rows] committed rows as stored: False = hole
        self.capacity = capacity

    @property
    def rows(self) -> int:
        """Committed rows as stored, holes included (the past length the graphs see)."""
        return int(self.valid.shape[0])

    def reserve(self, n: int) -> None:
        """Called before a forward appends n rows."""
        end = self.length + self.pending + n
        if end > self.capacity:
            raise RuntimeError(f"KV cache overflow: {end} rows > capacity {self.capacity}")
        if (self.holes_within is not None and self.rows + self.pending + n > self.holes_within
                and self.pending == 0 and self.rows > self.length):
            self._compact(np.flatnonzero(self.valid))
            self.current = self.committed

    def attention_mask(self, mask, batch: int, n: int) -> np.ndarray:
        """[B,1,N,rows+pending+N] bool for a forward of n rows: the valid committed rows, then `mask` over the
        uncommitted rows ([B,N,pending+N] bool tensor/array, None = causal over the new rows, pending all seen)."""
        rows, p = self.rows, self.pending
        out = np.empty((batch, 1, n, rows + p + n), dtype=bool)
        out[:, 0, :, :rows] = self.valid
        if mask is None:
            out[:, 0, :, rows:rows + p] = True
            out[:, 0, :, rows + p:] = causal_mask(n)[0, 0].numpy()
        else:
            out[:, 0, :, rows:] = mask.numpy() if hasattr(mask, "numpy") else mask
        return out

    def appended(self, presents: list, n: int) -> None:
        self.current = presents
        self.pending += n

    def commit(self, keep: torch.Tensor) -> None:
        """keep [K] int64: indices into the pending rows, in order; they become committed rows."""
        keep_np = keep.numpy() if isinstance(keep, torch.Tensor) else np.asarray(keep)
        n, p = int(keep_np.shape[0]), self.pending
        if n == 0:
            self.current = self.committed                  # nothing kept: the pending rows are dropped
        elif n == p and (keep_np == np.arange(n)).all():
            self.committed = self.current                  # already in place
            self.valid = np.concatenate([self.valid, np.ones(n, dtype=bool)])
        else:
            new = np.zeros(p, dtype=bool)
            new[keep_np] = True
            valid = np.concatenate([self.valid, new])
            holes = valid.shape[0] - (self.length + n)
            if self.allow_holes and holes <= max(HOLES_MIN, (self.length + n) // HOLES_SHARE):
                self.committed, self.valid = self.current, valid      # rejected rows stay as masked holes
            else:
                self._compact(np.flatnonzero(valid))
        self.current = self.committed
        self.length += n
        self.pending = 0

    def _compact(self, index: np.ndarray) -> None:
        """Gather the rows `index` (of committed + pending as stored) into new committed values without holes."""
        io = self.gather.io_binding()
        for i, v in enumerate(self.current):
            io.bind_ortvalue_input(f"kv_{i}", v)
        io.bind_cpu_input("index", index.astype(np.int64))
        for i in range(self.count):
            io.bind_output(f"out_{i}", *self.device)
        self.gather.run_with_iobinding(io)
        self.committed = list(io.get_outputs())
        self.valid = np.ones(index.shape[0], dtype=bool)

    def rollback(self) -> None:
        self.current = self.committed
        self.pending = 0
