"""Rewrite an exported graph's attention: KV buffers written in place, read without copies, row-independent.

The exporter gives each layer `present = Concat(past [B,Hkv,P,D], new [B,Hkv,N,D], axis 2)` and ONNX Runtime's
fused `Attention(Q, present_k, present_v, mask)`. A one-token step then copies every layer's whole past (the
Concat; ORT's kernel copies the keys once more into its GEMM panels), so its cost grows with the context far
faster than the attention arithmetic does. This rewrite changes the KV interface of the graph to rows-first
buffers and the attention to a decomposition that reads them where they are:

    past_key_i    [P+N, B, Hkv, D]  rows 0..P-1: the cache; rows P..P+N-1: slots for this call's new rows
    present_key_i [P+N, B, Hkv, D]  the same buffer with the new rows written (ScatterND)

Bound through IOBinding to the same memory as past_key_i (runtime/ort_cache.py), the ScatterND writes the N new
rows in place and copies nothing else; a caller that binds fresh outputs gets the buffer copied instead (same
values). Rows-first, the first P+N rows of a longer buffer are one contiguous block, which is what lets a runtime
bind a prefix of a preallocated buffer. com.microsoft::FusedMatMul reads a [T, B, Hkv, ...] buffer as
[B, Hkv, T, ...] through `transBatchB` (batch strides, no transpose; bit-identical to the transposed copy).

The decomposition, per layer (G = query heads per KV head, w = SLICE columns):

    Qg  = Q as [B, Hkv, G*N, D]
    S   = scale * Qg @ K^T                         each score one dot product over D, in order
    E   = exp(where(mask, S, MIN) - rowmax)        elementwise; a masked key gives an exact zero
    out = (2 E @ V) / (2 E @ 1)                    V in slices of w columns

A row's attention output then depends only on its query and on the ordered list of keys/values it may see: not on
how many rows share the call (M), where those keys sit in the buffer (masked rows, batch padding, tree siblings
between ancestors) or what the other rows are. ONNX Runtime's fused CPU `Attention` gives none of that bit for
bit: a one-row call takes MLAS's M=1 kernel, and its softmax sums in vector lanes assigned by key index. Float
engines rarely see last-bit differences in their tokens; engines with quantized activations (MatMulNBits with int8
compute) turn them into whole quantization steps.

Why each piece holds (MLAS sgemm.cpp): every product goes through FusedMatMul with alpha != 1, which keeps MLAS off
its M=1 / N=1 vector kernels (taken only when alpha == 1): every row then runs the blocked kernel, whose result for
one output element does not depend on the other rows or on how threads split them. The blocked kernel sums over K
in order within blocks of StrideK and adds the block sums; with at most 16 output columns StrideK is 1024 (the K
stride doubles as the column stride halves down to 16), whatever M, T or the thread split. A masked key adds an
exact zero to that running sum, so a row's numerator and denominator do not change when masked keys sit anywhere,
as long as its keys stay within the same 1024-key blocks, which holds for every call that sees at most
ROW_INDEPENDENT_KEYS keys (and Q @ K^T sums D in one block while D <= MAX_HEAD_DIM). alpha = 2 scales numerator and
denominator exactly, so their quotient is the unscaled one.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from eaglex.base.kernel_ops import ATTENTION_OP, DOMAIN, VERSION

MAX_SLICE = 16                  # output columns per product: MLAS's smallest column stride, hence its largest K block
ROW_INDEPENDENT_KEYS = 1024     # MLAS_SGEMM_STRIDEK (128) * MLAS_SGEMM_STRIDEN (128) / 16
MAX_HEAD_DIM = 128              # Q @ K^T sums D in one block only while D <= MLAS_SGEMM_STRIDEK
ROWS_AXIS = "past + seq"        # the buffers' first axis, as the rewritten graph names it
_MS = "com.microsoft"
_BHSD_TO_ROWS_FIRST = {0: 1, 1: 2, 3: 3}     # axis of [B,Hkv,P,D] -> axis of [P+N,B,Hkv,D] (P itself has none)


def value_slice(head_dim: int) -> int:
    """Columns per V slice: the largest divisor of head_dim that is at most MAX_SLICE."""
    return max(w for w in range(1, MAX_SLICE + 1) if head_dim % w == 0)


def check_row_independent(num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    """ValueError unless the rewritten attention is row-independent for these heads (quantized engines need it)."""
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} KV heads")
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"row-independent attention needs head_dim <= {MAX_HEAD_DIM}, got {head_dim}")


def to_buffer(past: np.ndarray, new_rows: int) -> np.ndarray:
    """A [B,Hkv,P,D] past as the rewritten graph's input: [P+new_rows, B, Hkv, D], the new rows' slots zero."""
    B, H, P, D = past.shape
    buf = np.zeros((P + new_rows, B, H, D), past.dtype)
    buf[:P] = past.transpose(2, 0, 1, 3)
    return buf


def from_buffer(present: np.ndarray) -> np.ndarray:
    """A rewritten graph's [T, B, Hkv, D] present as [B,Hkv,T,D]."""
    return np.ascontiguousarray(present.transpose(1, 2, 0, 3))


def rewrite_attention(model: onnx.ModelProto, num_heads: int, num_kv_heads: int, head_dim: int,
                      fused: bool = False) -> int:
    """Rewrite, in place, every `Attention(Q [B,Hq,N,D], Concat(past_k, k), Concat(past_v, v), bool mask [B,1,N,T])`
    whose Concats read graph inputs past_* and are the graph outputs present_*, as described above; returns how many
    were rewritten. ValueError for any other form (the graph is left unusable then: callers drop it).

    `fused`: each layer becomes one eaglex.TreeAttention instead (kernels/, the same buffers and mask), fed the
    projections in their own [B,N,H*D] layout: the head Reshape/Transpose pairs around it go, and a rotary on them
    runs on the 3-D projection (the same per-element arithmetic)."""
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} KV heads")
    g = model.graph
    G, D, w = num_heads // num_kv_heads, head_dim, value_slice(head_dim)
    producer = {o: n for n in g.node for o in n.output}
    inputs, outputs = {i.name for i in g.input}, {o.name for o in g.output}
    consts = {
        "ra_qshape": np.array([0, num_kv_heads, -1, D], np.int64),
        "ra_vshape": np.array([0, 0, 0, D // w, w], np.int64),
        "ra_yshape": np.array([0, num_heads, -1, D], np.int64),
        "ra_last": np.array([-1], np.int64),
        "ra_axis2": np.array([2], np.int64),
        "ra_axis3": np.array([3], np.int64),
        "ra_zero": np.array([0], np.int64),
        "ra_one": np.array([1], np.int64),
        "ra_four": np.array([4], np.int64),
        "ra_w": np.array([w], np.int64),
        "ra_G": np.array([G], np.int64),
        "ra_step": np.array(1, np.int64),
        "ra_min": np.array(np.finfo(np.float32).min, np.float32),  # not -inf: a fully masked row stays finite
        "ra_flat": np.array([0, 0, -1], np.int64),
        "ra_yheads": np.array([0, 0, num_heads, D], np.int64),
    }
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in g.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    pending: list[onnx.NodeProto] = []
    derived: dict[str, tuple[str, str, str]] = {}

    def node(op, ins, out, domain="", **kw):
        pending.append(helper.make_node(op, ins, [out], name=out + "_" + op, domain=domain, **kw))
        return out

    def per_graph(mask: str) -> tuple[str, str, str]:
        """From the mask [B,1,N,T], once for all layers: the mask per grouped query row [B,1,G*N,T], ones [T,w],
        and the ScatterND indices [N,1] of the rows this call writes (T-N .. T-1)."""
        if mask not in derived:
            p = f"ra_{mask}"
            shape = node("Shape", [mask], p + "_shape")
            b1 = node("Slice", [shape, "ra_zero", "ra_axis2"], p + "_b1")                  # [B, 1]
            nt = node("Slice", [shape, "ra_axis2", "ra_four"], p + "_nt")                  # [N, T]
            n = node("Slice", [shape, "ra_axis2", "ra_axis3"], p + "_n")                   # [N]
            t = node("Slice", [shape, "ra_last", "ra_four"], p + "_t")                     # [T]
            m5 = node("Expand", [node("Unsqueeze", [mask, "ra_axis2"], p + "_m5"),
                                 node("Concat", [b1, "ra_G", nt], p + "_ex_shape", axis=0)], p + "_ex")
            rows = node("Reshape", [m5, node("Concat", [b1, "ra_last", t], p + "_rows_shape", axis=0)], p + "_rows")
            ones = node("ConstantOfShape", [node("Concat", [t, "ra_w"], p + "_ones_shape", axis=0)], p + "_ones",
                        value=numpy_helper.from_array(np.array([1.0], np.float32)))
            first = node("Squeeze", [node("Sub", [t, n], p + "_first1"), "ra_zero"], p + "_first")
            end = node("Squeeze", [t, "ra_zero"], p + "_end")
            index = node("Unsqueeze", [node("Range", [first, end, "ra_step"], p + "_range"), "ra_last"],
                         p + "_index")                                                      # [N, 1]
            derived[mask] = (rows, ones, index)
        return derived[mask]

    def kv_concat(name: str) -> tuple[onnx.NodeProto, str, str]:
        c = producer.get(name)
        if c is None or c.op_type != "Concat" or len(c.input) != 2 or c.input[0] not in inputs \
                or name not in outputs or helper.get_attribute_value(c.attribute[0]) not in (2, -2):
            raise ValueError(f"{name}: attention keys/values must be Concat(past input, new rows, axis 2) "
                             "and a graph output")
        return c, c.input[0], c.input[1]

    def op(name: str, op_type: str, perm: list[int] | None = None) -> onnx.NodeProto | None:
        n = producer.get(name)
        if n is None or n.op_type != op_type or n.domain not in ("", "ai.onnx"):
            return None
        if perm is not None and [list(a.ints) for a in n.attribute if a.name == "perm"] != [perm]:
            return None
        return n

    def rows_form(x: str, heads: int, tag: str) -> str:
        """x [B,H,N,D] as a tensor in the [B,N,H*D] layout: the head split it was made by, undone."""
        rot = op(x, "RotaryEmbedding")
        inner = rot.input[0] if rot is not None and len(rot.input) == 3 and not rot.attribute else x
        t = op(inner, "Transpose", [0, 2, 1, 3])
        r = op(t.input[0], "Reshape") if t is not None else None
        if r is None:
            flat = node("Reshape", [node("Transpose", [x], tag + "_bnhd", perm=[0, 2, 1, 3]), "ra_flat"], tag + "_flat")
            return flat
        if inner == x:
            return r.input[0]
        pending.append(helper.make_node("RotaryEmbedding", [r.input[0], rot.input[1], rot.input[2]], [tag + "_rot"],
                                        name=tag + "_rot", num_heads=heads))
        return tag + "_rot"

    def heads_output(y3: str, y: str, tag: str) -> None:
        """The op's [B,N,Hq*D] output where the graph read Y [B,Hq,N,D]: a Transpose(0,2,1,3) then Reshape reading
        Y alone read y3 instead; other readers get Y back through a Reshape and a Transpose."""
        users = consumers.get(y, [])
        t = users[0] if len(users) == 1 and users[0].op_type == "Transpose" else None
        later = consumers.get(t.output[0], []) if t is not None else []
        if t is not None and [list(a.ints) for a in t.attribute if a.name == "perm"] == [[0, 2, 1, 3]] \
                and len(later) == 1 and later[0].op_type == "Reshape" and y not in outputs:
            later[0].input[0] = y3
            return
        node("Transpose", [node("Reshape", [y3, "ra_yheads"], tag + "_heads")], y, perm=[0, 2, 1, 3])

    kv_names: set[str] = set()
    concats: set[int] = set()
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
        if fused:
            (ck, past_k, new_k), (cv, past_v, new_v) = kv_concat(k), kv_concat(v)
            concats.update((id(ck), id(cv)))
            kv_names.update((past_k, k, past_v, v))
            y3 = p + "_y"
            pending.append(helper.make_node(
                ATTENTION_OP, [rows_form(q, num_heads, p + "_q"), rows_form(new_k, num_kv_heads, p + "_k"),
                               rows_form(new_v, num_kv_heads, p + "_v"), past_k, past_v, mask],
                [y3, k, v], name=p + "_attention", domain=DOMAIN, scale=scale))
            heads_output(y3, n.output[0], p)
            out_nodes += pending
            pending.clear()
            replaced += 1
            continue
        rows, ones, index = per_graph(mask)
        for buf, kind in ((k, "k"), (v, "v")):
            c, past, new = kv_concat(buf)
            concats.add(id(c))
            kv_names.update((past, buf))
            rows_new = node("Transpose", [new], f"{p}_{kind}_rows", perm=[2, 0, 1, 3])     # [N,B,Hkv,D]
            node("ScatterND", [past, index, rows_new], buf)                                 # present: in place
        qg = node("Reshape", [q, "ra_qshape"], p + "_qg")                                     # [B,Hkv,GN,D]
        s = node("FusedMatMul", [qg, k], p + "_s", _MS, transB=1, transBatchB=1, alpha=scale)   # [B,Hkv,GN,T]
        s = node("Where", [rows, s, "ra_min"], p + "_sm")
        e = node("Exp", [node("Sub", [s, node("ReduceMax", [s, "ra_last"], p + "_mx", keepdims=1)], p + "_d")],
                 p + "_e")
        vs = node("Reshape", [v, "ra_vshape"], p + "_vs")                                     # [T,B,Hkv,D/w,w]
        num = node("FusedMatMul", [node("Unsqueeze", [e, "ra_axis2"], p + "_e5"), vs], p + "_num", _MS,
                   transBatchB=1, alpha=2.0)                                                 # [B,Hkv,D/w,GN,w]
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
    for n in g.node:                              # the past's other readers: its batch size (a Shape slice)
        if id(n) in concats or n.op_type == "Attention":
            continue
        for name in (i for i in n.input if i in kv_names):
            if name not in inputs:
                continue
            span = {a.name: a for a in n.attribute}
            if n.op_type != "Shape" or "start" not in span or "end" not in span \
                    or span["end"].i != span["start"].i + 1 or span["start"].i not in _BHSD_TO_ROWS_FIRST:
                raise ValueError(f"{n.name} ({n.op_type}) reads {name}: only the Concat and a batch-size Shape may")
            span["start"].i = _BHSD_TO_ROWS_FIRST[span["start"].i]
            span["end"].i = span["start"].i + 1
    del g.node[:]
    g.node.extend(n for n in out_nodes if id(n) not in concats)
    _drop_unread(g)
    for value in list(g.input) + list(g.output):
        if value.name in kv_names:
            dims = value.type.tensor_type.shape.dim             # [B,Hkv,P|T,D] -> [P+N,B,Hkv,D]
            kept = [onnx.TensorShapeProto.Dimension() for _ in range(3)]
            for dst, src in zip(kept, (dims[0], dims[1], dims[3])):
                dst.CopyFrom(src)
            del dims[:]
            dims.add().dim_param = ROWS_AXIS
            dims.extend(kept)
    read = {i for n in g.node for i in n.input}
    g.initializer.extend(numpy_helper.from_array(a, name) for name, a in consts.items() if name in read)
    for domain, version in ((_MS, 1), (DOMAIN, VERSION)):
        if any(n.domain == domain for n in g.node) and not any(o.domain == domain for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid(domain, version))
    return replaced


def _drop_unread(g: onnx.GraphProto) -> None:
    """Removes, in place, the nodes none of whose outputs is read by another node or is a graph output."""
    outputs = {o.name for o in g.output}
    while True:
        read = {i for n in g.node for i in n.input} | outputs
        kept = [n for n in g.node if any(o in read for o in n.output)]
        if len(kept) == len(g.node):
            return
        del g.node[:]
        g.node.extend(kept)
