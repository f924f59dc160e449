"""KV cache for ONNX Runtime engines: one preallocated rows-first buffer per KV tensor, written in place by the graphs.

An engine graph takes each KV tensor as a buffer [P+N, B, Hkv, D] whose last N rows are slots for the call's new
rows, and returns it with them written (export/row_attention.py). This cache keeps one buffer per tensor with room
for `capacity` rows and binds its first P+N rows as both that input and that output (rows-first, they are one
contiguous block): the graph writes its new rows in place, and a forward copies nothing else, however long the
context (with concatenation growth every layer's whole past was copied on every step).

Rows: the committed rows 0..length-1 in context order (a row's index is its position, as in vanilla decoding),
then the `pending` rows forwards appended since the last commit or rollback.
- rollback() forgets the pending rows (the next forward overwrites them);
- commit(keep) of all pending rows in order (a prefill, a vanilla step, a draft extend) moves nothing;
- any other commit (the accepted path of a tree) moves the kept rows down into place with a tiny ORT graph
  (Gather them, ScatterND them at `length`, bound in place): a few rows per tensor.
Buffers live on the engine's first provider's device. On the CPU they are numpy allocations, whose pages the
system commits only as rows get written, so a large capacity costs address space, not memory; a reset reallocates
them only when it asks for more capacity than they have.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper
from onnxruntime.capi.onnxruntime_inference_collection import OrtDevice

from eaglex.models.target import causal_mask

from .ort_session import provider_device, session_options

NP_DTYPES = {"float32": np.float32, "float16": np.float16}
ONNX_DTYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}


def kv_names(layers: int) -> list[str]:
    """The KV tensors of `layers` layers, as the graphs' past_<name> / present_<name> call them."""
    return [f"{kv}_{i}" for i in range(layers) for kv in ("key", "value")]


def move_session(names: list[str], dtype: str, providers: list | None = None) -> ort.InferenceSession:
    """out_<name> = ScatterND(kv_<name>, dst [K,1], Gather(kv_<name>, src [K], axis 0)) for buffers [R,B,Hkv,D]:
    rows src copied to rows dst (Gather copies first, so the two may overlap); in place when out_<name> is bound to
    kv_<name>'s memory."""
    t = ONNX_DTYPES[dtype]
    shape = ["rows", "batch", "heads", "dim"]
    inputs = [helper.make_tensor_value_info(f"kv_{n}", t, shape) for n in names]
    inputs += [helper.make_tensor_value_info("src", TensorProto.INT64, ["keep"]),
               helper.make_tensor_value_info("dst", TensorProto.INT64, ["keep", 1])]
    outputs = [helper.make_tensor_value_info(f"out_{n}", t, shape) for n in names]
    nodes = []
    for n in names:
        nodes.append(helper.make_node("Gather", [f"kv_{n}", "src"], [f"rows_{n}"], axis=0))
        nodes.append(helper.make_node("ScatterND", [f"kv_{n}", "dst", f"rows_{n}"], [f"out_{n}"]))
    graph = helper.make_graph(nodes, "kv_move", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    model.ir_version = 10
    onnx.checker.check_model(model)
    return ort.InferenceSession(model.SerializeToString(), session_options(),
                                providers=providers or ["CPUExecutionProvider"])


class OrtKVCache:
    def __init__(self, names: list[str], num_kv_heads: int, head_dim: int, dtype: str, providers: list | None = None):
        """`names`: the KV tensors, as the graph's inputs past_<name> and outputs present_<name> call them (e.g.
        key_0, value_0, ...); `providers`: the engine's (runtime/ort_session.choose_providers)."""
        self.names, self.heads, self.dim, self.dtype = list(names), num_kv_heads, head_dim, dtype
        self.device = provider_device(providers)
        self.element = NP_DTYPES[dtype]
        # Binds go through the C++ binding under ORT's Python IOBinding, with a device object made once: the
        # wrapper makes an OrtDevice and books the name on every call (~2.3 us a bind against ~0.8, measured), and a
        # forward binds every KV tensor twice (~0.2 ms of a one-token step of a 30-layer target).
        self._c_device = OrtDevice.make(*self.device)._get_c_device()
        self.mover = move_session(self.names, dtype, providers)
        self.buffers: list = []
        self.pointers: list[int] = []
        self.capacity = 0
        self.reset(0)

    def reset(self, capacity: int) -> None:
        if capacity > self.capacity:        # grow only: the buffers are reused by every later generation
            shape = (capacity, 1, self.heads, self.dim)       # batch 1
            if self.device[0] == "cpu":
                self.buffers = [np.empty(shape, self.element) for _ in self.names]
                self.pointers = [b.ctypes.data for b in self.buffers]
            else:
                self.buffers = [ort.OrtValue.ortvalue_from_shape_and_type(shape, self.element, *self.device)
                                for _ in self.names]
                self.pointers = [b.data_ptr() for b in self.buffers]
            self.capacity = capacity
        self.length = self.pending = 0      # committed rows; rows appended since the last commit / rollback

    def _bind(self, io: ort.IOBinding, rows: int, inputs: str, outputs: str) -> None:
        """Bind each buffer's first `rows` rows as input `inputs`+name and output `outputs`+name."""
        shape, kind, c = [rows, 1, self.heads, self.dim], ONNX_DTYPES[self.dtype], io._iobinding
        for name, ptr in zip(self.names, self.pointers):
            c.bind_input(inputs + name, self._c_device, kind, shape, ptr)
            c.bind_output(outputs + name, self._c_device, kind, shape, ptr)

    def bind(self, io: ort.IOBinding, n: int) -> None:
        """Bind the buffers for a forward that appends n rows after the pending ones (KV overflow: RuntimeError)."""
        end = self.length + self.pending + n
        if end > self.capacity:
            raise RuntimeError(f"KV cache overflow: {end} rows > capacity {self.capacity}")
        self._bind(io, end, "past_", "present_")

    def attention_mask(self, mask, batch: int, n: int) -> np.ndarray:
        """[B,1,N,length+pending+N] bool for a forward of n rows: every committed row, then `mask` over the
        uncommitted rows ([B,N,pending+N] bool tensor/array, None = causal over the new rows, pending all seen)."""
        rows, p = self.length, self.pending
        out = np.empty((batch, 1, n, rows + p + n), dtype=bool)
        out[:, 0, :, :rows] = True
        if mask is None:
            out[:, 0, :, rows:rows + p] = True
            out[:, 0, :, rows + p:] = causal_mask(n)[0, 0].numpy()
        else:
            out[:, 0, :, rows:] = mask.numpy() if hasattr(mask, "numpy") else mask
        return out

    def appended(self, n: int) -> None:
        self.pending += n

    def commit(self, keep: torch.Tensor) -> None:
        """keep [K] int64: indices into the pending rows, in order; they become committed rows."""
        keep_np = keep.numpy() if isinstance(keep, torch.Tensor) else np.asarray(keep)
        n = int(keep_np.shape[0])
        if n and not (keep_np == np.arange(n)).all():         # else already in place
            io = self.mover.io_binding()
            self._bind(io, self.length + self.pending, "kv_", "out_")
            io.bind_cpu_input("src", (keep_np + self.length).astype(np.int64))
            io.bind_cpu_input("dst", np.arange(self.length, self.length + n, dtype=np.int64)[:, None])
            self.mover.run_with_iobinding(io)
        self.length += n
        self.pending = 0

    def rollback(self) -> None:
        self.pending = 0
