"""KV cache for ONNX Runtime engines: OrtValues that the graphs grow by concatenation, compacted in ORT.

A forward takes past_* (committed + pending rows) and returns present_* with its N rows appended; those OrtValues
become the next past without leaving ORT (onnx.md §5: concat growth + IOBinding is the fastest option for tree
verification on CPU). The committed values are kept aside, so:
- rollback() is free: the committed values simply become current again;
- commit(keep) of all pending rows in order (a prefill, a vanilla step, a draft extend) is free as well;
- any other commit (the accepted tree path) gathers rows [0, length) + length + keep along the sequence axis in
  a tiny ORT graph, one Gather per tensor, so no tensor is copied through numpy.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper

from .ort_session import session_options

NP_DTYPES = {"float32": np.float32, "float16": np.float16}
_ONNX_DTYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}


def gather_session(count: int, dtype: str) -> ort.InferenceSession:
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
    return ort.InferenceSession(model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])


class OrtKVCache:
    def __init__(self, count: int, num_kv_heads: int, head_dim: int, dtype: str):
        self.count, self.heads, self.dim, self.dtype = count, num_kv_heads, head_dim, dtype
        self.gather = gather_session(count, dtype)
        self.capacity = 0
        self.reset(0)

    def reset(self, capacity: int) -> None:
        empty = np.zeros((1, self.heads, 0, self.dim), NP_DTYPES[self.dtype])      # batch 1, no rows yet
        self.committed = [ort.OrtValue.ortvalue_from_numpy(empty) for _ in range(self.count)]
        self.current = self.committed
        self.length = self.pending = 0
        self.capacity = capacity

    def reserve(self, n: int) -> None:
        """Called before a forward appends n rows."""
        end = self.length + self.pending + n
        if end > self.capacity:
            raise RuntimeError(f"KV cache overflow: {end} rows > capacity {self.capacity}")

    def appended(self, presents: list, n: int) -> None:
        self.current = presents
        self.pending += n

    def commit(self, keep: torch.Tensor) -> None:
        """keep [K] int64: indices into the pending rows, in order; they become committed rows."""
        n = int(keep.shape[0])
        if n == 0:
            pass
        elif n == self.pending and torch.equal(keep, torch.arange(n)):
            self.committed = self.current                  # already in place
        else:
            index = np.concatenate([np.arange(self.length), self.length + keep.numpy()]).astype(np.int64)
            io = self.gather.io_binding()
            for i, v in enumerate(self.current):
                io.bind_ortvalue_input(f"kv_{i}", v)
            io.bind_cpu_input("index", index)
            for i in range(self.count):
                io.bind_output(f"out_{i}")
            self.gather.run_with_iobinding(io)
            self.committed = list(io.get_outputs())
        self.current = self.committed
        self.length += n
        self.pending = 0

    def rollback(self) -> None:
        self.current = self.committed
        self.pending = 0
