"""Rewrite every ONNX `Attention` node of a graph into a row-independent decomposition.

A row's attention output here depends only on its query and on the ordered list of keys/values it may see: not on
how many rows share the call (M), where those keys sit in the buffer (holes, batch padding, tree siblings between
ancestors) or what the other rows are. ONNX Runtime's fused CPU `Attention` gives none of that bit for bit: a
one-row call takes MLAS's M=1 kernel, and its softmax sums in vector lanes assigned by key index. Float engines
rarely see last-bit differences in their tokens; engines with quantized activations (MatMulNBits with int8
compute) turn them into whole quantization steps.

The decomposition, per layer (G = query heads per KV head, w = SLICE columns):

    Qg  = Q as [B, Hkv, G*N, D]
    S   = scale * Qg @ K^T                         each score one dot product over D, in order
    E   = exp(where(mask, S, MIN) - rowmax)        elementwise; a masked key gives an exact zero
    out = (2 E @ V) / (2 E @ 1)                    V in slices of w columns

Why each piece holds (MLAS sgemm.cpp): every product goes through com.microsoft::FusedMatMul with alpha != 1,
which keeps MLAS off its M=1 / N=1 vector kernels (taken only when alpha == 1): every row then runs the blocked
kernel, whose result for one output element does not depend on the other rows or on how threads split them.
The blocked kernel sums over K in order within blocks of StrideK and adds the block sums; with at most 16 output
columns StrideK is 1024 (the K stride doubles as the column stride halves down to 16), whatever M, T or the
thread split. A masked key adds an exact zero to that running sum, so a row's numerator and denominator do not
change when masked keys sit anywhere, as long as its keys stay within the same 1024-key blocks, which holds for
every call that sees at most ROW_INDEPENDENT_KEYS keys. alpha = 2 scales numerator and denominator exactly, so their
quotient is the unscaled one. Costs: one copy of V per call into slices (about what the KV concat moves already).
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

MAX_SLICE = 16                  # output columns per product: MLAS's smallest column stride, hence its largest K block
ROW_INDEPENDENT_KEYS = 1024     # MLAS_SGEMM_STRIDEK (128) * MLAS_SGEMM_STRIDEN (128) / 16
MAX_HEAD_DIM = 128              # Q @ K^T sums D in one block only while D <= MLAS_SGEMM_STRIDEK
_MS = "com.microsoft"


def value_slice(head_dim: int) -> int:
    """Columns per V slice: the largest divisor of head_dim that is at most MAX_SLICE."""
    return max(w for w in range(1, MAX_SLICE + 1) if head_dim % w == 0)


def rewrite_attention(model: onnx.ModelProto, num_heads: int, num_kv_heads: int, head_dim: int) -> int:
    """Replace each `Attention(Q [B,Hq,N,D], K [B,Hkv,T,D], V [B,Hkv,T,D], bool mask [B,1,N,T]) -> Y` node of
    `model` in place by the decomposition above; returns how many were replaced. ValueError for any other form."""
    g = model.graph
    G, D, w = num_heads // num_kv_heads, head_dim, value_slice(head_dim)
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} KV heads")
    if D > MAX_HEAD_DIM:
        raise ValueError(f"row-independent attention needs head_dim <= {MAX_HEAD_DIM}, got {D}")
    consts = {
        "ra_qshape": np.array([0, num_kv_heads, -1, D], np.int64),
        "ra_vshape": np.array([0, 0, 0, D // w, w], np.int64),
        "ra_yshape": np.array([0, num_heads, -1, D], np.int64),
        "ra_last": np.array([-1], np.int64),
        "ra_axis2": np.array([2], np.int64),
        "ra_zero": np.array([0], np.int64),
        "ra_one": np.array([1], np.int64),
        "ra_four": np.array([4], np.int64),
        "ra_w": np.array([w], np.int64),
        "ra_G": np.array([G], np.int64),
        "ra_min": np.array(np.finfo(np.float32).min, np.float32),  # not -inf: a fully masked row stays finite
    }
    pending: list[onnx.NodeProto] = []
    derived: dict[str, tuple[str, str]] = {}

    def node(op, ins, out, domain="", **kw):
        pending.append(helper.make_node(op, ins, [out], name=out + "_" + op, domain=domain, **kw))
        return out

    def per_graph(mask: str) -> tuple[str, str]:
        """The mask per grouped query row, [B,1,N,T] -> [B,1,G*N,T], and ones [T,w]: once, shared by all layers."""
        if mask not in derived:
            p = f"ra_{mask}"
            shape = node("Shape", [mask], p + "_shape")
            b1 = node("Slice", [shape, "ra_zero", "ra_axis2"], p + "_b1")                  # [B, 1]
            nt = node("Slice", [shape, "ra_axis2", "ra_four"], p + "_nt")                  # [N, T]
            t = node("Slice", [shape, "ra_last", "ra_four"], p + "_t")                     # [T]
            m5 = node("Expand", [node("Unsqueeze", [mask, "ra_axis2"], p + "_m5"),
                                 node("Concat", [b1, "ra_G", nt], p + "_ex_shape", axis=0)], p + "_ex")
            rows = node("Reshape", [m5, node("Concat", [b1, "ra_last", t], p + "_rows_shape", axis=0)], p + "_rows")
            ones = node("ConstantOfShape", [node("Concat", [t, "ra_w"], p + "_ones_shape", axis=0)], p + "_ones",
                        value=numpy_helper.from_array(np.array([1.0], np.float32)))
            derived[mask] = (rows, ones)
        return derived[mask]

    out_nodes, replaced = [], 0
    for n in g.node:
        if n.op_type != "Attention" or n.domain not in ("", "ai.onnx"):
            out_nodes.append(n)
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        if len(n.input) != 4 or len(n.output) != 1 or any(attrs.get(a) for a in
                                                          ("is_causal", "softcap", "qk_matmul_output_mode")):
            raise ValueError(f"{n.name}: only a plain Attention(Q, K, V, mask) -> Y is rewritten")
        scale = float(attrs.get("scale", 1.0 / np.sqrt(D)))
        q, k, v, mask = n.input
        p = f"ra{replaced}"
        rows, ones = per_graph(mask)
        qg = node("Reshape", [q, "ra_qshape"], p + "_qg")                                     # [B,Hkv,GN,D]
        s = node("FusedMatMul", [qg, k], p + "_s", _MS, transB=1, alpha=scale)               # [B,Hkv,GN,T]
        s = node("Where", [rows, s, "ra_min"], p + "_sm")
        e = node("Exp", [node("Sub", [s, node("ReduceMax", [s, "ra_last"], p + "_mx", keepdims=1)], p + "_d")],
                 p + "_e")
        vs = node("Transpose", [node("Reshape", [v, "ra_vshape"], p + "_v5")], p + "_vs",
                  perm=[0, 1, 3, 2, 4])                                                      # [B,Hkv,D/w,T,w]
        num = node("FusedMatMul", [node("Unsqueeze", [e, "ra_axis2"], p + "_e5"), vs], p + "_num", _MS,
                   alpha=2.0)                                                                # [B,Hkv,D/w,GN,w]
        num = node("Reshape", [node("Transpose", [num], p + "_numt", perm=[0, 1, 3, 2, 4]), "ra_qshape"],
                   p + "_numr")                                                              # [B,Hkv,GN,D]
        den = node("Slice", [node("FusedMatMul", [e, ones], p + "_den_w", _MS, alpha=2.0), "ra_zero", "ra_one",
                             "ra_last"], p + "_den")                                         # [B,Hkv,GN,1]
        node("Reshape", [node("Div", [num, den], p + "_o"), "ra_yshape"], n.output[0])
        out_nodes += pending
        pending.clear()
        replaced += 1
    if not replaced:
        return 0
    del g.node[:]
    g.node.extend(out_nodes)
    g.initializer.extend(numpy_helper.from_array(a, name) for name, a in consts.items())
    if not any(o.domain == _MS for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(_MS, 1))
    return replaced
