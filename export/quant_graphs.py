"""Post-processing of exported float graphs: FP8 Q/DQ from calibrated scales, int8 weight-only MatMulNBits, and w8a8
(int8 weights and per-row int8 activations on MatMulInteger, SmoothQuant-smoothed: rowwise_int8).

Both passes rewrite an ONNX file produced by `export/onnx_export.py`, where every nn.Linear became
`MatMul(x, W)` over an initializer W stored [in, out] (export/layout.py) and named after the torch module path:

    target.onnx    target.inner.layers.3.mlp.up_proj.weight_t   ->  HF module  model.layers.3.mlp.up_proj
                   target.hf.lm_head.weight_t                   ->             lm_head
    draft.onnx     head.midlayer.self_attn.q_proj.weight_t      ->  draft      midlayer.self_attn.q_proj
    draft_fc.onnx  fc.weight_t                                  ->             fc

`module_name` does that mapping, so scales calibrated on the Hugging Face model (ModelOpt's unified checkpoint:
`<module>.weight` float8_e4m3fn [out, in], `<module>.weight_scale`, `<module>.input_scale`, both amax/448) land on
the right MatMul.

fp8_qdq (why this form): standard ONNX `QuantizeLinear`/`DequantizeLinear` in float8e4m3fn (opset >= 19), weights
stored as FP8 initializers behind a DequantizeLinear (the "DQ-only weight" form ModelOpt's own ONNX exporter emits),
activations through a Q/DQ pair with the calibrated static per-tensor scale. TensorRT and ONNX Runtime's TensorRT EP
fuse these into FP8 GEMMs; ONNX Runtime's CPU EP has no FP8 GEMM: eaglex's sessions fold the weight DQs into float
constants at load (runtime/ort_session.py), so on CPU the graph runs at about fp32 speed with the same FP8 numbers
(unfolded, every run dequantizes every weight, and one-token rows differ from tree rows: 40-50x slower). The FP8
activation Q/DQ amplifies float rounding as int8 activations do, so the same exactness rules apply (below).

nbits_weight_only: `com.microsoft::MatMulNBits` with 8-bit (or 4-bit) symmetric blocks of 32 along K and
accuracy_level=4 (int8 activations, quantized per row and block inside the kernel): ONNX Runtime's fast CPU path,
3-10x faster than a float32 MatMul for the few rows of a decode step (level 1, float32 compute, dequantizes the
weights on every call and runs 10x slower than float32). Its rows are independent of each other and of the row
count, but int8 activations turn the float32 rounding noise of other kernels into visible logit changes: ONNX
Runtime's fused Attention rounds a one-row call differently from a many-row one, and a key whose index in the
buffer moved. Engine graphs carry a row-independent attention since their export (export/row_attention.py);
`row_attention` checks that the heads keep it row-independent (a graph with ONNX Runtime's fused Attention would
need the exactness rules of engines/quantize.py: two rows or more per call, chains, no batching). MatMuls that read
one input (q/k/v, gate/up) are fused first (export/fuse.py: bit-identical columns, fewer kernel calls).

Both keep external data right: the input's `.onnx.data` is read with the graph, and the output goes to
`<out>.data` when its weights exceed the threshold the exporter uses, else into the file itself. Graph metadata
(the engine id the runtime checks) is kept.
"""
from __future__ import annotations

import contextlib
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from eaglex.base.errors import ModelError

from .fuse import FUSED, fuse_sibling_matmuls
from .kernel_graphs import to_kernel_f32, to_kernel_q4, to_kernel_q8, to_stock
from .onnx_export import EXTERNAL_DATA_ABOVE
from .row_attention import check_row_independent

FP8_MAX = 448.0                      # largest finite float8e4m3fn
NBITS_BLOCK = 32
NBITS_ACCURACY_LEVEL = 4   # int8 activations: the fast kernel (see the module docstring)
# Relative L2 distance between a checkpoint's dequantized FP8 weight and the graph's float weight above which the
# checkpoint is taken to come from another model (FP8 rounding alone gives about 2-3 %).
FP8_WEIGHT_MISMATCH = 0.1
_PREFIXES = (("target.inner.", "model."), ("target.hf.", ""), ("head.", ""))


@dataclass(frozen=True)
class Fp8Scales:
    """Calibrated FP8 scales of one Linear (both amax / 448), plus ModelOpt's FP8 weight bits when known."""
    weight_scale: float
    input_scale: float
    weight_fp8: np.ndarray | None = None     # uint8 bit patterns of float8_e4m3fn, [out, in] as in the checkpoint


@dataclass(frozen=True)
class QuantReport:
    """What a pass changed: quantized module names, MatMuls with a constant weight left alone, sizes."""
    method: str
    quantized: tuple[str, ...]
    skipped: tuple[str, ...]
    bytes_before: int
    bytes_after: int
    files: tuple[str, ...]                   # names of the written files (graph, external data)

    def to_json(self) -> dict:
        return {"method": self.method, "matmuls": len(self.quantized), "quantized": list(self.quantized),
                "skipped": list(self.skipped), "bytes_before": self.bytes_before, "bytes_after": self.bytes_after}


def module_name(initializer: str) -> str | None:
    """HF / draft-checkpoint module name of a MatMul weight initializer, or None for a name eaglex did not export."""
    if not initializer.endswith(".weight_t"):
        return None
    name = initializer[: -len(".weight_t")]
    for prefix, repl in _PREFIXES:
        if name.startswith(prefix):
            return repl + name[len(prefix):]
    return name


def _files_of(path: Path) -> list[Path]:
    data = path.with_name(path.name + ".data")
    return [path] + ([data] if data.is_file() else [])


def _load(path: Path) -> onnx.ModelProto:
    """The graph with its float linear layers as stock MatMuls (an engine built on eaglex's kernels holds them as
    eaglex.LinearF32: turned back bit for bit), so that every pass here reads one form."""
    try:
        model = onnx.load(str(path))                # reads `<name>.onnx.data` next to it, if the graph uses it
    except Exception as e:  # noqa: BLE001 - protobuf/IO errors: a missing or corrupt file, said in one line
        raise ModelError(f"cannot read ONNX graph {path}: {str(e).splitlines()[0][:200]}") from None
    try:
        to_stock(model)
    except ValueError as e:
        raise ModelError(f"{path.name}: {e}; rebuild the float engine with `eaglex build --force` first") from None
    return model


def save_graph(model: onnx.ModelProto, out_path: Path) -> list[Path]:
    """Save with external data above the exporter's threshold; returns the files written."""
    return _save(model, out_path)


def _save(model: onnx.ModelProto, out_path: Path) -> list[Path]:
    """Save with external data above the exporter's threshold; returns the files written."""
    out_path = Path(out_path)
    data = out_path.with_name(out_path.name + ".data")
    data.unlink(missing_ok=True)                    # onnx appends to an existing data file
    weights = sum(len(t.raw_data) or t.ByteSize() for t in model.graph.initializer)
    external = weights > EXTERNAL_DATA_ABOVE
    onnx.save_model(model, str(out_path), save_as_external_data=external, all_tensors_to_one_file=True,
                    location=data.name, size_threshold=1024)
    onnx.checker.check_model(str(out_path))         # by path: works above protobuf's 2 GiB as well
    return [out_path] + ([data] if external else [])


def _bytes(files) -> int:
    return sum(Path(f).stat().st_size for f in files)


def _weight_matmuls(graph: onnx.GraphProto) -> list[tuple[onnx.NodeProto, onnx.TensorProto]]:
    inits = {t.name: t for t in graph.initializer}
    return [(n, inits[n.input[1]]) for n in graph.node
            if n.op_type == "MatMul" and n.domain in ("", "ai.onnx") and n.input[1] in inits
            and len(inits[n.input[1]].dims) == 2]


# ---------------------------------------------------------------------------------------------------------- FP8

def _to_fp8_bits(w: np.ndarray, scale: float) -> np.ndarray:
    """Saturating round-to-nearest-even cast of w / scale to float8_e4m3fn, as uint8 bit patterns (torch's cast:
    numpy < 2 has no FP8 type)."""
    import torch
    t = torch.from_numpy(np.array(w, dtype=np.float32)) / scale         # a writable copy: ONNX arrays are read-only
    return t.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8).numpy()


def fp8_dequantize(bits: np.ndarray, scale: float) -> np.ndarray:
    """float32 values of FP8 bit patterns times `scale`."""
    import torch
    return (torch.from_numpy(np.ascontiguousarray(bits)).view(torch.float8_e4m3fn).float() * scale).numpy()


def fp8_qdq(onnx_path, out_path, scales: dict[str, Fp8Scales], exclude: tuple[str, ...] = ()) -> QuantReport:
    """Rewrite every MatMul whose weight maps to a module in `scales` (and not matching a regex in `exclude`) as
    DQ(W_fp8) x DQ(Q(x)) with the calibrated per-tensor scales; other MatMuls keep their float weights."""
    onnx_path, out_path = Path(onnx_path), Path(out_path)
    before = _bytes(_files_of(onnx_path))
    model = _load(onnx_path)
    if max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=0) < 19:
        raise ModelError(f"{onnx_path.name}: FP8 QuantizeLinear/DequantizeLinear need opset >= 19")
    g = model.graph
    pairs = _weight_matmuls(g)
    float_types = set()
    zero = "eaglex_fp8_zero"              # FP8 zero point: makes Q emit float8e4m3fn (and TensorRT expects one)
    new_inits = [helper.make_tensor(zero, TensorProto.FLOAT8E4M3FN, [], vals=b"\x00", raw=True)]
    inserted: dict[int, list[onnx.NodeProto]] = {}      # id(MatMul) -> nodes to put right before it
    act_qdq: dict[tuple[str, float], str] = {}         # (activation, scale) -> its dequantized name
    drop, quantized, skipped = set(), [], []
    for node, w_init in pairs:
        mod = module_name(w_init.name)
        if mod is None or mod not in scales or any(re.search(p, mod) for p in exclude):
            skipped.append(mod or w_init.name)
            continue
        s = scales[mod]
        w = numpy_helper.to_array(w_init)                                   # [in, out]
        float_types.add(w.dtype)
        bits = _checked_bits(mod, w, s)
        base = w_init.name
        new_inits += [
            helper.make_tensor(base + "_fp8", TensorProto.FLOAT8E4M3FN, list(w.shape), vals=bits.tobytes(), raw=True),
            numpy_helper.from_array(np.array(s.weight_scale, dtype=w.dtype), base + "_scale"),
        ]
        nodes = [helper.make_node("DequantizeLinear", [base + "_fp8", base + "_scale", zero], [base + "_dq"],
                                  name=base + "_DequantizeLinear")]
        x = node.input[0]
        key = (x, float(s.input_scale))
        if key not in act_qdq:                      # q/k/v (and gate/up) read one tensor with one scale: one pair
            tag = f"{x}_fp8_{len(act_qdq)}"
            new_inits.append(numpy_helper.from_array(np.array(s.input_scale, dtype=w.dtype), tag + "_scale"))
            nodes += [helper.make_node("QuantizeLinear", [x, tag + "_scale", zero], [tag + "_q"],
                                       name=tag + "_QuantizeLinear"),
                      helper.make_node("DequantizeLinear", [tag + "_q", tag + "_scale", zero], [tag + "_dq"],
                                       name=tag + "_DequantizeLinear")]
            act_qdq[key] = tag + "_dq"
        inserted[id(node)] = nodes
        node.input[0], node.input[1] = act_qdq[key], base + "_dq"
        drop.add(base)
        quantized.append(mod)
    if len(float_types) > 1:
        raise ModelError(f"{onnx_path.name}: weights of mixed float types; cannot pick a scale type")
    if not quantized:
        raise ModelError(f"{onnx_path.name}: no MatMul weight matches the calibrated scales (is the calibrated "
                         "checkpoint from this model?)")
    nodes = []
    for n in g.node:                                # Q/DQ go right before their MatMul: order stays topological
        nodes += inserted.get(id(n), [])
        nodes.append(n)
    del g.node[:]
    g.node.extend(nodes)
    kept = [t for t in g.initializer if t.name not in drop]
    del g.initializer[:]
    g.initializer.extend(kept + new_inits)
    files = _save(model, out_path)
    return QuantReport("fp8", tuple(quantized), tuple(skipped), before, _bytes(files), tuple(f.name for f in files))


def _checked_bits(mod: str, w: np.ndarray, s: Fp8Scales) -> np.ndarray:
    """FP8 bits [in, out] for weight w [in, out]: the checkpoint's own bits when given (bit-identical to ModelOpt),
    after checking that they are this weight; else w / weight_scale cast here."""
    if s.weight_fp8 is None:
        return _to_fp8_bits(w, s.weight_scale)
    bits = np.ascontiguousarray(s.weight_fp8.T)
    if bits.shape != w.shape:
        raise ModelError(f"calibrated weight of {mod} has shape {tuple(s.weight_fp8.shape)}, the graph's is "
                         f"{tuple(w.T.shape)}: the checkpoint was calibrated for another model")
    deq = fp8_dequantize(bits, s.weight_scale)
    ref = w.astype(np.float32)
    err = float(np.linalg.norm(deq - ref) / max(np.linalg.norm(ref), 1e-30))
    if err > FP8_WEIGHT_MISMATCH:
        raise ModelError(f"calibrated FP8 weight of {mod} differs from the engine's weight by {err:.0%} (relative): "
                         "the checkpoint was calibrated from another model")
    return bits


# ---------------------------------------------------------------------------------------------------------- int8

def _fused_graph(onnx_path: Path, exclude: tuple[str, ...], row_attention: tuple[int, int, int] | None,
                 unfit=lambda w: False) -> tuple[onnx.ModelProto, set[str]]:
    """The graph a weight pass rewrites: loaded; with `row_attention`, its attention checked row-independent for
    those heads; sibling MatMuls fused, except weights kept apart (modules matching `exclude`, or `unfit(weight)`)
    -> (model, the names of the weights kept apart)."""
    model = _load(onnx_path)
    if row_attention is not None:
        try:
            check_row_independent(*row_attention)
        except ValueError as e:
            raise ModelError(f"{onnx_path.name}: {e}") from None
        if any(n.op_type == "Attention" for n in model.graph.node):
            raise ModelError(f"{onnx_path.name} has ONNX Runtime's fused Attention, whose rows depend on the call: "
                             "rebuild the float engine with this eaglex (`eaglex build --force`)")
    apart = {w.name for _, w in _weight_matmuls(model.graph)
             if unfit(w) or any(re.search(p, module_name(w.name) or w.name) for p in exclude)}
    fuse_sibling_matmuls(model, keep=apart)
    return model, apart


def nbits_weight_only(onnx_path, out_path, bits: int = 8, exclude: tuple[str, ...] = (),
                      row_attention: tuple[int, int, int] | None = None, block_size: int = NBITS_BLOCK,
                      accuracy_level: int = NBITS_ACCURACY_LEVEL, symmetric: bool = True,
                      eight_bit: tuple[str, ...] = ()) -> QuantReport:
    """Every MatMul with a constant 2-D weight whose K is a multiple of `block_size` becomes a `bits`-bit (8 or 4)
    MatMulNBits (symmetric: no zero points; else a zero point per block, as llama.cpp's Q4_1 has a minimum);
    modules matching a regex in `exclude` stay float, those matching one in `eight_bit` get 8 bits (symmetric).
    `row_attention` (query heads, KV heads, head dim): check that the graph's attention is the row-independent one
    for them."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    onnx_path, out_path = Path(onnx_path), Path(out_path)
    before = _bytes(_files_of(onnx_path))
    model, apart = _fused_graph(onnx_path, exclude + eight_bit, row_attention,
                                lambda w: w.dims[0] % block_size != 0)
    candidates, skipped, exclude_nodes, eight_nodes, nodes = [], [], [], [], 0
    for node, w in _weight_matmuls(model.graph):
        mods = [module_name(part) or part for part in w.name.split(FUSED)]
        if w.name in apart and eight_bit and w.dims[0] % block_size == 0 and \
                all(any(re.search(p, m) for p in eight_bit) for m in mods):
            candidates += mods
            eight_nodes.append(node.name)
            nodes += 1
        elif w.name in apart:
            skipped += mods
            exclude_nodes.append(node.name)
        else:
            candidates += mods
            nodes += 1
    if not candidates:
        raise ModelError(f"{onnx_path.name}: no MatMul weight to quantize")
    metadata = [(p.key, p.value) for p in model.metadata_props]
    q = MatMulNBitsQuantizer(model, bits=bits, block_size=block_size, is_symmetric=symmetric,
                             accuracy_level=accuracy_level, nodes_to_exclude=exclude_nodes + eight_nodes)
    with _quiet_logger("onnxruntime.quantization"):        # it logs a line per node at INFO
        q.process()
        if eight_nodes:
            others = [n.name for n in q.model.model.graph.node if n.op_type == "MatMul" and n.name not in eight_nodes]
            q = MatMulNBitsQuantizer(q.model.model, bits=8, block_size=block_size, is_symmetric=True,
                                     accuracy_level=accuracy_level, nodes_to_exclude=others)
            q.process()
    out = q.model.model
    del out.metadata_props[:]                       # the quantizer rebuilds the proto: carry the engine id over
    for k, v in metadata:
        out.metadata_props.add(key=k, value=v)
    quantized = [n for n in out.graph.node if n.op_type == "MatMulNBits"]
    if len(quantized) != nodes:
        raise ModelError(f"{onnx_path.name}: MatMulNBits replaced {len(quantized)} of {nodes} MatMuls")
    files = _save(out, out_path)
    return QuantReport(f"int{bits}", tuple(candidates), tuple(skipped), before, _bytes(files), tuple(f.name for f in files))


def kernel_linear(onnx_path, out_path, bits: int = 8, exclude: tuple[str, ...] = (),
                  row_attention: tuple[int, int, int] | None = None, eight_bit: tuple[str, ...] = ()) -> QuantReport:
    """Every MatMul with a constant 2-D float weight becomes eaglex.LinearQ8 (bits 8: Q8_0's numbers, blocks of 32
    along K, fp16 scales) or eaglex.LinearQ4 (bits 4: Q4_1's, an fp16 scale and minimum per block), with int8
    activations per row and block (export/kernel_graphs.py); siblings reading one input are fused first, so that
    q|k|v and gate|up quantize their input once. Modules matching a regex in `eight_bit` take LinearQ8 (bits 4),
    those matching one in `exclude` stay float on eaglex.LinearF32. `row_attention` as for nbits_weight_only."""
    onnx_path, out_path = Path(onnx_path), Path(out_path)
    before = _bytes(_files_of(onnx_path))
    model, apart = _fused_graph(onnx_path, exclude + eight_bit, row_attention)
    parts = {w: [module_name(p) or p for p in w.split(FUSED)] for w in apart}
    eight = {w for w, mods in parts.items()
             if eight_bit and all(any(re.search(p, m) for p in eight_bit) for m in mods)}
    names = (to_kernel_q8 if bits == 8 else to_kernel_q4)(model, keep=apart)
    names += to_kernel_q8(model, keep=apart - eight) if eight else []
    if not names:
        raise ModelError(f"{onnx_path.name}: no MatMul weight to quantize")
    to_kernel_f32(model)
    quantized = [module_name(part) or part for w in names for part in w.split(FUSED)]
    skipped = [m for w in apart - eight for m in parts[w]]
    files = _save(model, out_path)
    return QuantReport(f"int{bits}", tuple(quantized), tuple(skipped), before, _bytes(files),
                       tuple(f.name for f in files))


# ------------------------------------------------------------------------------------------------------ w8a8

W8A8_ZERO = 128          # activations as uint8 around this zero point: MLAS's fast U8S8 integer GEMM
SMOOTH_ALPHA = 0.5       # SmoothQuant's migration strength: half of an input channel's range moves to the weights


def _leading_dims(onnx_path: Path) -> dict[str, tuple]:
    """Each value's dims but the last, from ONNX shape inference over the graph's structure (weights not read);
    only values whose leading dims are all named or known."""
    model = onnx.shape_inference.infer_shapes(onnx.load(str(onnx_path), load_external_data=False))
    out = {}
    for v in list(model.graph.value_info) + list(model.graph.input):
        dims = v.type.tensor_type.shape.dim
        lead = tuple(d.dim_param or d.dim_value for d in dims[:-1])
        if len(dims) >= 2 and all(lead):
            out[v.name] = lead
    return out


class _RowZeroPoints:
    """The uint8 zero points (W8A8_ZERO) a blocked QuantizeLinear takes, shaped like the rows' scales [..., 1]:
    made once per distinct symbolic leading shape (every activation of a decoder is [batch, seq, K]), else per
    input."""

    def __init__(self, leading: dict[str, tuple]):
        self.leading, self.made = leading, {}

    def _key(self, x: str):
        return self.leading.get(x, x)

    def of(self, x: str) -> str:
        return self.made[self._key(x)]

    def nodes(self, x: str, x_in: str) -> list[onnx.NodeProto]:
        key = self._key(x)
        if key in self.made:
            return []
        name = f"w8a8.zp{len(self.made)}"
        self.made[key] = name
        return [helper.make_node("Shape", [x_in], [name + ".lead"], end=-1),
                helper.make_node("Concat", [name + ".lead", "w8a8.one"], [name + ".shape"], axis=0),
                helper.make_node("ConstantOfShape", [name + ".shape"], [name],
                                 value=numpy_helper.from_array(np.array([W8A8_ZERO], np.uint8)))]


def rowwise_int8(onnx_path, out_path, exclude: tuple[str, ...] = (),
                 row_attention: tuple[int, int, int] | None = None, act_max: dict[str, np.ndarray] | None = None,
                 alpha: float = SMOOTH_ALPHA) -> QuantReport:
    """Every MatMul with a constant 2-D weight becomes an integer GEMM: weights int8 per output channel (symmetric,
    scale max|w| / 127), activations int8 per row (scale max|x| / 127 over the row, computed in the graph), the
    product summed exactly in int32 by MatMulInteger (uint8 activations around zero point 128 against int8 weights:
    MLAS's U8S8 kernel, AMX or VNNI where the CPU has them) and scaled back to float by the row's and the column's
    scales. A row's scale is its own, its integer dot products are exact, and the rescale is elementwise: every
    row's output is bit-identical whatever the other rows of the call, by construction. The kernel reads each
    weight once for all rows of a call, so a verification of a few rows costs about one row's step.

    `act_max` {module name: [K] max |input|} (calibration/smooth.py) smooths each quantized input first: channel j
    is multiplied by 1 / s_j in the graph (elementwise: rows stay independent) and the weight's row j by s_j,
    s_j = act_max_j^alpha / max|W_j|^(1 - alpha); MatMuls that share an input share its s (their weights' maxima
    together). Modules matching a regex in `exclude` stay float."""
    onnx_path, out_path = Path(onnx_path), Path(out_path)
    before = _bytes(_files_of(onnx_path))
    model, apart = _fused_graph(onnx_path, exclude, row_attention)
    g = model.graph
    consts = [numpy_helper.from_array(np.array([-1], np.int64), "w8a8.axis"),
              numpy_helper.from_array(np.array(127.0, np.float32), "w8a8.qmax"),
              numpy_helper.from_array(np.array(np.finfo(np.float32).tiny, np.float32), "w8a8.tiny"),
              numpy_helper.from_array(np.array([1], np.int64), "w8a8.one"),
              numpy_helper.from_array(np.array(W8A8_ZERO, np.uint8), "w8a8.zero")]
    zero_points = _RowZeroPoints(_leading_dims(onnx_path))
    quantized_inputs: dict[str, tuple[str, str]] = {}       # activation -> (its uint8 rows, its row scales)
    new_nodes, candidates, skipped, drop = [], [], [], set()
    pairs = {n.output[0]: w for n, w in _weight_matmuls(g)}
    smooth = _smoothing(g, pairs, apart, act_max, alpha) if act_max else {}
    for node in g.node:
        w = pairs.get(node.output[0]) if node.op_type == "MatMul" else None
        if w is None:
            new_nodes.append(node)
            continue
        mods = [module_name(part) or part for part in w.name.split(FUSED)]
        if w.name in apart:
            skipped += mods
            new_nodes.append(node)
            continue
        candidates += mods
        x, y, tag = node.input[0], node.output[0], w.name
        if x not in quantized_inputs:
            q = f"{x}.w8a8"
            if x in smooth:
                consts.append(numpy_helper.from_array((1.0 / smooth[x]).astype(np.float32), f"{q}.smooth"))
                new_nodes.append(helper.make_node("Mul", [x, f"{q}.smooth"], [f"{q}.smoothed"]))
                x_in = f"{q}.smoothed"
            else:
                x_in = x
            new_nodes += [
                helper.make_node("Abs", [x_in], [f"{q}.abs"]),
                helper.make_node("ReduceMax", [f"{q}.abs", "w8a8.axis"], [f"{q}.max"], keepdims=1),
                helper.make_node("Div", [f"{q}.max", "w8a8.qmax"], [f"{q}.s0"]),
                helper.make_node("Max", [f"{q}.s0", "w8a8.tiny"], [f"{q}.scale"])]
            new_nodes += zero_points.nodes(x, x_in)
            # round(x / scale) + 128 as uint8 in one blocked QuantizeLinear (one block per row): the numbers of a Div,
            # Round, Add and Cast (the engine's logits bit-identical to that chain's) in one kernel call instead of four
            new_nodes.append(helper.make_node("QuantizeLinear", [x_in, f"{q}.scale", zero_points.of(x)], [f"{q}.u8"],
                                              axis=-1, block_size=int(w.dims[0])))
            quantized_inputs[x] = (f"{q}.u8", f"{q}.scale")
        xq, xs = quantized_inputs[x]
        if w.name not in drop:                      # a weight some MatMuls share is quantized once
            W = numpy_helper.to_array(w).astype(np.float32)
            if x in smooth:
                W = W * smooth[x][:, None]
            sw = np.maximum(np.abs(W).max(axis=0) / 127.0, np.finfo(np.float32).tiny).astype(np.float32)
            Wq = np.clip(np.round(W / sw), -127, 127).astype(np.int8)
            consts += [numpy_helper.from_array(Wq, f"{tag}.int8"), numpy_helper.from_array(sw, f"{tag}.scale")]
            drop.add(w.name)
        new_nodes += [
            helper.make_node("MatMulInteger", [xq, f"{tag}.int8", "w8a8.zero"], [f"{y}.int32"]),
            helper.make_node("Cast", [f"{y}.int32"], [f"{y}.f32"], to=TensorProto.FLOAT),
            helper.make_node("Mul", [f"{y}.f32", xs], [f"{y}.rows"]),
            helper.make_node("Mul", [f"{y}.rows", f"{tag}.scale"], [y])]
    if not candidates:
        raise ModelError(f"{onnx_path.name}: no MatMul weight to quantize")
    del g.node[:]
    g.node.extend(new_nodes)
    keep = [t for t in g.initializer if t.name not in drop]
    del g.initializer[:]
    g.initializer.extend(keep + consts)
    files = _save(model, out_path)
    return QuantReport("w8a8", tuple(candidates), tuple(skipped), before, _bytes(files), tuple(f.name for f in files))


def _smoothing(g, pairs, apart, act_max, alpha) -> dict[str, np.ndarray]:
    """{activation: [K] s} for every quantized MatMul input whose modules all have calibrated maxima."""
    inits = {t.name: t for t in g.initializer}
    by_input: dict[str, list] = {}
    uses: dict[str, int] = {}
    for node in g.node:
        w = pairs.get(node.output[0]) if node.op_type == "MatMul" else None
        if w is not None and w.name not in apart:
            by_input.setdefault(node.input[0], []).append(w)
            uses[w.name] = uses.get(w.name, 0) + 1
    out = {}
    for x, weights in by_input.items():
        if any(uses[w.name] > 1 for w in weights):      # a weight read elsewhere too: one s would not fit both
            continue
        mods = [module_name(part) or part for w in weights for part in w.name.split(FUSED)]
        if not all(m in act_max for m in mods):
            continue
        a = np.max([act_max[m] for m in mods], axis=0).astype(np.float64)
        wmax = np.max([np.abs(numpy_helper.to_array(inits[w.name])).max(axis=1) for w in weights], axis=0)
        s = np.power(np.maximum(a, 1e-5), alpha) / np.power(np.maximum(wmax, 1e-5), 1 - alpha)
        out[x] = np.clip(s, 1e-5, 1e5).astype(np.float32)
    return out


@contextlib.contextmanager
def _quiet_logger(name: str):
    """Raise a logger and its children to WARNING for the duration (restored afterwards)."""
    loggers = [logging.getLogger(n) for n in [name] + [k for k in logging.root.manager.loggerDict if
                                                        k.startswith(name + ".")]]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
