"""Graphs on eaglex's own kernels (kernels/, runtime/kernels.py): every MatMul with a constant 2-D weight becomes
an `eaglex` domain op whose initializers hold the weight in the kernel's packed layout, so that ONNX Runtime holds
each weight once and nothing is repacked at load.

- LinearF32: float32 weights in tiles of 16 output channels, [N/16, K, 16]; one FMA chain per output over k in
  order, so a row's result is the same bits whatever else is in the call.
- LinearQ4: 4-bit weights in blocks of 32 along K as w = d * q + m, q in [0, 15], an fp16 d and m per (channel,
  block) (llama.cpp's Q4_1 numbers: d = (max - min) / 15, m = min), two a byte, [N/16, K/32, 256] + [N/16, K/32,
  32]; activations as LinearQ8's.
- LinearQ8: int8 weights in blocks of 32 along K with an fp16 scale per (channel, block) (llama.cpp's Q8_0 numbers:
  scale amax / 127, weights round-half-even), packed for VNNI as w + 128, [N/16, K/32, 512] + [N/16, K/32, 16];
  activations are quantized per row and block inside the kernel.

(N/16 and K/32 round up: padded channels and K positions are zero weights with zero scales.)

`to_stock` turns LinearF32 back into MatMul over the original [K, N] weight, bit for bit: the quantization passes
(export/quant_graphs.py) start from a float engine's graph whichever ops it was built on.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from eaglex.base.kernel_ops import ATTENTION_OP, DOMAIN, F32_OP, Q4_OP, Q8_OP, VERSION

TILE, BLOCK = 16, 32
F32_SUFFIX, Q8_SUFFIX, SCALE_SUFFIX, Q4_SUFFIX, Q4_SCALE_SUFFIX = ".f32p", ".q8p", ".q8s", ".q4p", ".q4s"


def _ceil(n: int, m: int) -> int:
    return -(-n // m) * m


def pack_f32(w: np.ndarray) -> np.ndarray:
    """[K, N] float32 -> [ceil(N/16), K, 16] (padded channels zero)."""
    K, N = w.shape
    wp = np.zeros((K, _ceil(N, TILE)), np.float32)
    wp[:, :N] = w
    return np.ascontiguousarray(wp.reshape(K, -1, TILE).transpose(1, 0, 2))


def unpack_f32(packed: np.ndarray, N: int) -> np.ndarray:
    """pack_f32's inverse: [N/16, K, 16] -> [K, N]."""
    tiles, K, _ = packed.shape
    return np.ascontiguousarray(packed.transpose(1, 0, 2).reshape(K, tiles * TILE)[:, :N])


def quantize_q8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[K, N] float -> (q int8 [Kp, Np], scales float16 [Kp/32, Np]), K and N zero padded to 32 and 16: per
    (block of 32 along K, channel) scale = fp16(amax / 127), q = clamp(round_half_even(w / scale), -127, 127)."""
    K, N = w.shape
    wp = np.zeros((_ceil(K, BLOCK), _ceil(N, TILE)), np.float32)
    wp[:K, :N] = w
    blocks = wp.reshape(-1, BLOCK, wp.shape[1])                       # [Kb, 32, Np]
    amax = np.abs(blocks).max(axis=1)                                  # [Kb, Np]
    with np.errstate(over="ignore"):
        scales = (amax / np.float32(127)).astype(np.float16)
    if not np.isfinite(scales).all():
        raise ValueError("a weight block's scale does not fit float16 (|w| above ~8.3e6)")
    sf = scales.astype(np.float32)[:, None, :]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(sf > 0, np.rint(blocks / np.where(sf > 0, sf, 1)), 0)
    return np.clip(q, -127, 127).astype(np.int8).reshape(wp.shape), scales


def pack_q8(q: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """quantize_q8's (q [Kp, Np], scales [Kb, Np]) -> the kernel's (W uint8 [Np/16, Kb, 512], S float16
    [Np/16, Kb, 16]); a record holds k-quads j, then channels, then 4 consecutive k."""
    Kp, Np = q.shape
    kb, tiles = Kp // BLOCK, Np // TILE
    u8 = (q.astype(np.int16) + 128).astype(np.uint8).reshape(kb, BLOCK // 4, 4, tiles, TILE)   # [b, j, e, t, c]
    W = np.ascontiguousarray(u8.transpose(3, 0, 1, 4, 2)).reshape(tiles, kb, TILE * BLOCK)
    S = np.ascontiguousarray(scales.reshape(kb, tiles, TILE).transpose(1, 0, 2))
    return W, S


def quantize_q4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[K, N] float -> (q uint8 [Kp, Np] in 0..15, d float16 [Kp/32, Np], m float16 [Kp/32, Np]), padded as
    quantize_q8: per (block of 32 along K, channel) over its real weights, d = fp16((max - min) / 15), m =
    fp16(min), q = clamp(round_half_even((w - m) / d), 0, 15) (d = 0: q = 0)."""
    K, N = w.shape
    wp = np.full((_ceil(K, BLOCK), _ceil(N, TILE)), np.nan, np.float32)
    wp[:K, :N] = w
    blocks = wp.reshape(-1, BLOCK, wp.shape[1])                       # [Kb, 32, Np]
    lo = np.nan_to_num(np.fmin.reduce(blocks, axis=1))                 # NaN only where a block has no weight
    hi = np.nan_to_num(np.fmax.reduce(blocks, axis=1))
    with np.errstate(over="ignore"):
        d = ((hi - lo) / np.float32(15)).astype(np.float16)
        m = lo.astype(np.float16)
    if not (np.isfinite(d).all() and np.isfinite(m).all()):
        raise ValueError("a weight block's range does not fit float16 (|w| above ~65504)")
    df, mf = d.astype(np.float32)[:, None, :], m.astype(np.float32)[:, None, :]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(df > 0, np.rint((blocks - mf) / np.where(df > 0, df, 1)), 0)
    q = np.where(np.isnan(blocks), 0, np.clip(q, 0, 15))
    return q.astype(np.uint8).reshape(wp.shape), d, m


def pack_q4(q: np.ndarray, d: np.ndarray, m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """quantize_q4's output -> the kernel's (W uint8 [Np/16, Kb, 256], S float16 [Np/16, Kb, 32]): a record holds
    k-quads jj < 4, then channels, then 4 consecutive k, k = 4 jj + e in the low nibble and 16 + 4 jj + e in the
    high one; S holds the 16 channels' d, then their m."""
    Kp, Np = q.shape
    kb, tiles = Kp // BLOCK, Np // TILE
    r = q.reshape(kb, 2, 4, 4, tiles, TILE)                            # [b, half, jj, e, t, c]
    byte = (r[:, 0] | (r[:, 1] << 4)).astype(np.uint8)                # [b, jj, e, t, c]
    W = np.ascontiguousarray(byte.transpose(3, 0, 1, 4, 2)).reshape(tiles, kb, TILE * BLOCK // 2)
    S = np.concatenate([d.reshape(kb, tiles, TILE), m.reshape(kb, tiles, TILE)], axis=2)   # [b, t, 32]
    return W, np.ascontiguousarray(S.transpose(1, 0, 2))


def dequantize_q4(q: np.ndarray, d: np.ndarray, m: np.ndarray, K: int, N: int) -> np.ndarray:
    """The float weights a Q4 layer stands for, [K, N]."""
    blocks = q.reshape(-1, BLOCK, q.shape[1]).astype(np.float32)
    w = blocks * d.astype(np.float32)[:, None, :] + m.astype(np.float32)[:, None, :]
    return w.reshape(q.shape)[:K, :N]


def dequantize_q8(q: np.ndarray, scales: np.ndarray, K: int, N: int) -> np.ndarray:
    """The float weights a Q8 layer stands for, [K, N]."""
    w = q.reshape(-1, BLOCK, q.shape[1]).astype(np.float32) * scales.astype(np.float32)[:, None, :]
    return w.reshape(q.shape)[:K, :N]


def _weight_matmuls(graph: onnx.GraphProto) -> list[tuple[onnx.NodeProto, onnx.TensorProto]]:
    inits = {t.name: t for t in graph.initializer}
    return [(n, inits[n.input[1]]) for n in graph.node
            if n.op_type == "MatMul" and n.domain in ("", "ai.onnx") and n.input[1] in inits
            and len(inits[n.input[1]].dims) == 2 and inits[n.input[1]].data_type == onnx.TensorProto.FLOAT]


def _use_domain(model: onnx.ModelProto) -> None:
    if not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, VERSION))


def _swap_weights(model: onnx.ModelProto, replaced: dict[str, list[onnx.TensorProto]]) -> None:
    """Drop the initializers in `replaced` that no node reads any more; add their packed forms."""
    read = {i for n in model.graph.node for i in n.input}
    kept = [t for t in model.graph.initializer if t.name not in replaced or t.name in read]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept + [t for ts in replaced.values() for t in ts])


def to_kernel_f32(model: onnx.ModelProto, keep: set[str] = frozenset()) -> int:
    """MatMul(x, constant float32 W [K, N]) -> eaglex.LinearF32, in place; weights named in `keep` stay stock.
    Returns the nodes rewritten."""
    replaced: dict[str, list[onnx.TensorProto]] = {}
    count = 0
    for node, w in _weight_matmuls(model.graph):
        if w.name in keep:
            continue
        K, N = w.dims
        if w.name not in replaced:
            replaced[w.name] = [numpy_helper.from_array(pack_f32(numpy_helper.to_array(w)), w.name + F32_SUFFIX)]
        _retype(node, F32_OP, [node.input[0], w.name + F32_SUFFIX], K, N)
        count += 1
    if count:
        _use_domain(model)
        _swap_weights(model, replaced)
    return count


def to_kernel_q8(model: onnx.ModelProto, keep: set[str] = frozenset()) -> list[str]:
    """MatMul(x, constant float32 W [K, N]) -> eaglex.LinearQ8, in place; weights named in `keep` stay float.
    Returns the names of the weights quantized."""
    replaced: dict[str, list[onnx.TensorProto]] = {}
    for node, w in _weight_matmuls(model.graph):
        if w.name in keep:
            continue
        K, N = w.dims
        if w.name not in replaced:
            W, S = pack_q8(*quantize_q8(numpy_helper.to_array(w)))
            replaced[w.name] = [numpy_helper.from_array(W, w.name + Q8_SUFFIX),
                                numpy_helper.from_array(S, w.name + SCALE_SUFFIX)]
        _retype(node, Q8_OP, [node.input[0], w.name + Q8_SUFFIX, w.name + SCALE_SUFFIX], K, N)
    if replaced:
        _use_domain(model)
        _swap_weights(model, replaced)
    return list(replaced)


def to_kernel_q4(model: onnx.ModelProto, keep: set[str] = frozenset()) -> list[str]:
    """MatMul(x, constant float32 W [K, N]) -> eaglex.LinearQ4, in place; weights named in `keep` stay float.
    Returns the names of the weights quantized."""
    replaced: dict[str, list[onnx.TensorProto]] = {}
    for node, w in _weight_matmuls(model.graph):
        if w.name in keep:
            continue
        K, N = w.dims
        if w.name not in replaced:
            W, S = pack_q4(*quantize_q4(numpy_helper.to_array(w)))
            replaced[w.name] = [numpy_helper.from_array(W, w.name + Q4_SUFFIX),
                                numpy_helper.from_array(S, w.name + Q4_SCALE_SUFFIX)]
        _retype(node, Q4_OP, [node.input[0], w.name + Q4_SUFFIX, w.name + Q4_SCALE_SUFFIX], K, N)
    if replaced:
        _use_domain(model)
        _swap_weights(model, replaced)
    return list(replaced)


def to_stock(model: onnx.ModelProto) -> int:
    """eaglex.LinearF32 -> MatMul over the original [K, N] weight (bit for bit), in place. Returns the nodes
    rewritten; a LinearQ8 cannot go back (its float weights are gone): ValueError. eaglex.TreeAttention stays (it
    holds no weights; the graph keeps needing the library)."""
    inits = {t.name: t for t in model.graph.initializer}
    replaced: dict[str, list[onnx.TensorProto]] = {}
    count = 0
    for node in model.graph.node:
        if node.domain != DOMAIN or node.op_type == ATTENTION_OP:
            continue
        if node.op_type != F32_OP:
            raise ValueError(f"{node.name} is an {DOMAIN}.{node.op_type}: quantized already")
        packed = node.input[1]
        name = packed[: -len(F32_SUFFIX)]
        if packed not in replaced:
            N = _attr(node, "N")
            replaced[packed] = [numpy_helper.from_array(unpack_f32(numpy_helper.to_array(inits[packed]), N), name)]
        node.op_type, node.domain = "MatMul", ""
        node.input[1] = name
        del node.attribute[:]
        count += 1
    if count:
        _swap_weights(model, replaced)
        if not any(n.domain == DOMAIN for n in model.graph.node):
            kept_ops = [o for o in model.opset_import if o.domain != DOMAIN]
            del model.opset_import[:]
            model.opset_import.extend(kept_ops)
    return count


def _retype(node: onnx.NodeProto, op: str, inputs: list[str], K: int, N: int) -> None:
    node.op_type, node.domain = op, DOMAIN
    del node.input[:]
    node.input.extend(inputs)
    del node.attribute[:]
    node.attribute.extend([helper.make_attribute("K", int(K)), helper.make_attribute("N", int(N))])


def _attr(node: onnx.NodeProto, name: str):
    return next(helper.get_attribute_value(a) for a in node.attribute if a.name == name)
