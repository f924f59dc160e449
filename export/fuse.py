"""Fuse an exported graph's small per-layer ops into fewer, larger ONNX Runtime kernels, in place.

Besides its weight reads, a one-token step of a small target is many tiny kernels: per layer a rotary embedding
spelled as 6 elementwise nodes per tensor, an Add feeding each RMSNormalization, three projections of one normed
input and two more in the MLP. Each fusion keeps the graph's interface, and its arithmetic up to the rounding of
the fused kernel (elementwise within a row, so rows stay independent of each other); the engine's parity check
against torch still applies:

- rotary: `x * cos + concat(-x2, x1) * sin` with cos/sin = Cos/Sin(concat(f, f)) becomes the standard
  RotaryEmbedding (opset 23) over Cos/Sin(f): the halves of the concatenated tables are the same numbers.
- skip + RMS norm: `RMSNormalization(a + b)` becomes com.microsoft::SkipSimplifiedLayerNormalization, whose fourth
  output is the sum a + b the residual stream goes on with.
- head layouts (after the attention rewrite): a key's rotary on its projection as it is, and two Transposes in a
  row as one, so that the new K and V rows reach the KV buffer through one copy each instead of two.
- sibling MatMuls: MatMuls that read the same input with constant [K, N_i] weights become one MatMul over the
  weights concatenated along N, then a Split. Each output column is the same dot product as before (MLAS and
  MatMulNBits sum a column over K in blocks that do not depend on the other columns: bit-identical outputs,
  measured), so only the number of kernel calls changes. It needs the weights, so it runs where they are loaded
  anyway (int8/int4 quantization, export/quant_graphs.py), where the saved calls pay (~6 % of an int8 step on
  SmolLM2-135M; nothing measurable in float32, whose step is bound by its weight reads).

The measurements behind these choices (interleaved one-token steps, 2-core host): docs/step.md.
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx
from onnx import helper, numpy_helper

_MS = "com.microsoft"


class _Graph:
    """Producer/consumer maps over a graph's nodes, rebuilt by each pass."""

    def __init__(self, graph: onnx.GraphProto):
        self.g = graph
        self.producer = {o: n for n in graph.node for o in n.output}
        self.consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
        for n in graph.node:
            for i in n.input:
                self.consumers[i].append(n)
        self.outputs = {o.name for o in graph.output}
        self.inits = {i.name: i for i in graph.initializer}

    def only_use(self, name: str, node: onnx.NodeProto) -> bool:
        """`name` is read by `node` alone and is not a graph output."""
        users = self.consumers.get(name, [])
        return name not in self.outputs and len(users) == 1 and users[0] is node

    def op(self, name: str, op_type: str) -> onnx.NodeProto | None:
        n = self.producer.get(name)
        return n if n is not None and n.op_type == op_type and n.domain in ("", "ai.onnx") else None

    def int_const(self, name: str) -> list[int] | None:
        if name in self.inits:
            return numpy_helper.to_array(self.inits[name]).reshape(-1).tolist()
        n = self.producer.get(name)
        if n is not None and n.op_type == "Constant":
            return numpy_helper.to_array(n.attribute[0].t).reshape(-1).tolist()
        return None


def _attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _replace(graph: onnx.GraphProto, drop: set[int], insert: dict[int, list[onnx.NodeProto]]) -> None:
    """Rebuild the node list: nodes whose id() is in `drop` go, `insert[id(node)]` goes in front of a node."""
    nodes = []
    for n in graph.node:
        nodes += insert.get(id(n), [])
        if id(n) not in drop:
            nodes.append(n)
    del graph.node[:]
    graph.node.extend(nodes)


FUSED = "+"      # a fused weight's name: its parts' names joined


def fuse_sibling_matmuls(model: onnx.ModelProto, keep: set[str] = frozenset()) -> int:
    """MatMuls of one input with constant 2-D weights of equal K -> one MatMul over their weights concatenated
    along N (named FUSED.join(names)) + Split; weights named in `keep` stay apart. Returns the groups fused."""
    g = _Graph(model.graph)
    groups: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for n in model.graph.node:
        if n.op_type == "MatMul" and n.domain in ("", "ai.onnx") and n.input[1] in g.inits \
                and len(g.inits[n.input[1]].dims) == 2 and n.input[1] not in keep:
            groups[n.input[0]].append(n)
    drop, insert, used, fused = set(), {}, defaultdict(int), 0
    for n in model.graph.node:
        for i in n.input:
            used[i] += 1
    new_inits, unused = [], set()
    for x, nodes in groups.items():
        if len(nodes) < 2 or len({g.inits[n.input[1]].dims[0] for n in nodes}) != 1:
            continue
        weights = [numpy_helper.to_array(g.inits[n.input[1]]) for n in nodes]
        name = FUSED.join(n.input[1] for n in nodes)
        new_inits.append(numpy_helper.from_array(np.concatenate(weights, axis=1), name))
        sizes = numpy_helper.from_array(np.array([w.shape[1] for w in weights], np.int64), name + ".split")
        new_inits.append(sizes)
        out = nodes[0].output[0] + "_fused"
        insert[id(nodes[0])] = [
            helper.make_node("MatMul", [x, name], [out], name=nodes[0].name + "_fused"),
            helper.make_node("Split", [out, sizes.name], [n.output[0] for n in nodes], axis=-1,
                             name=nodes[0].name + "_split")]
        for n in nodes:
            drop.add(id(n))
            used[n.input[1]] -= 1
            unused.add(n.input[1])
        fused += 1
    if not fused:
        return 0
    _replace(model.graph, drop, insert)
    kept = [i for i in model.graph.initializer if not (i.name in unused and used[i.name] == 0)]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept + new_inits)
    return fused


def fuse_rotary(model: onnx.ModelProto) -> int:
    """x*Unsqueeze(cos,1) + Concat(-x2, x1)*Unsqueeze(sin,1) (x [B,H,N,D], Split halves) -> RotaryEmbedding(x,
    Cos(f), Sin(f)) where cos/sin = Cos/Sin(Concat(f, f)); returns nodes fused."""
    g = _Graph(model.graph)
    drop, insert, fused = set(), {}, 0
    halves: dict[str, tuple[str, str]] = {}       # f -> (Cos(f), Sin(f)), made once per graph

    def table(unsq_out: str, fn: str):
        """Unsqueeze(Cos|Sin(Concat(f, f)), [1]) -> f, else None."""
        u = g.op(unsq_out, "Unsqueeze")
        if u is None or g.int_const(u.input[1]) != [1]:
            return None
        t = g.op(u.input[0], fn)
        c = g.op(t.input[0], "Concat") if t is not None else None
        if c is None or len(c.input) != 2 or c.input[0] != c.input[1] or _attr(c, "axis") not in (-1, 2):
            return None
        return c.input[0]

    for add in model.graph.node:
        if add.op_type != "Add" or add.domain not in ("", "ai.onnx"):
            continue
        muls = [g.op(i, "Mul") for i in add.input]
        if None in muls:
            continue
        for m_cos, m_sin in (muls, muls[::-1]):
            cat = g.op(m_sin.input[0], "Concat")
            if cat is None or len(cat.input) != 2 or _attr(cat, "axis") not in (-1, 3):
                continue
            neg, split = g.op(cat.input[0], "Neg"), g.op(cat.input[1], "Split")
            x = m_cos.input[0]
            if neg is None or split is None or split.input[0] != x or len(split.output) != 2 \
                    or _attr(split, "axis") not in (-1, 3) or len(split.input) > 1 \
                    or neg.input[0] != split.output[1] or cat.input[1] != split.output[0]:
                continue
            f_cos, f_sin = table(m_cos.input[1], "Cos"), table(m_sin.input[1], "Sin")
            if f_cos is None or f_cos != f_sin:
                continue
            parts = [m_cos, m_sin, cat, neg]
            if not all(g.only_use(p.output[0], c) for p, c in ((m_cos, add), (m_sin, add), (cat, m_sin),
                                                                (neg, cat))) \
                    or not g.only_use(split.output[1], neg) or not g.only_use(split.output[0], cat):
                continue
            new = []
            if f_cos not in halves:
                halves[f_cos] = (f_cos + "_cos_half", f_cos + "_sin_half")
                new += [helper.make_node("Cos", [f_cos], [halves[f_cos][0]], name=f_cos + "_cos_half"),
                        helper.make_node("Sin", [f_cos], [halves[f_cos][1]], name=f_cos + "_sin_half")]
            new.append(helper.make_node("RotaryEmbedding", [x, *halves[f_cos]], [add.output[0]],
                                        name=add.name + "_rotary"))
            insert[id(add)] = new
            drop.update(id(p) for p in parts + [split, add])
            fused += 1
            break
    if fused:
        _replace(model.graph, drop, insert)
        _prune(model.graph)
    return fused


def fuse_skip_rms_norm(model: onnx.ModelProto) -> int:
    """RMSNormalization(Add(a, b), w) over the last axis of a [B,N,H] stream -> SkipSimplifiedLayerNormalization(a,
    b, w) whose 4th output replaces the Add's; returns nodes fused."""
    g = _Graph(model.graph)
    drop, insert, fused = set(), {}, 0
    for norm in model.graph.node:
        if norm.op_type != "RMSNormalization" or _attr(norm, "axis", -1) != -1 or len(norm.input) != 2:
            continue
        add = g.op(norm.input[0], "Add")
        if add is None or add.input[0] in g.inits or add.input[1] in g.inits:
            continue
        node = helper.make_node("SkipSimplifiedLayerNormalization", [add.input[0], add.input[1], norm.input[1]],
                                [norm.output[0], "", "", add.output[0]], domain=_MS, name=norm.name + "_skip",
                                epsilon=float(_attr(norm, "epsilon", 1e-5)))
        insert[id(add)] = [node]
        drop.update({id(add), id(norm)})
        fused += 1
    if fused:
        _replace(model.graph, drop, insert)
        if not any(o.domain == _MS for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid(_MS, 1))
    return fused


def _prune(graph: onnx.GraphProto) -> None:
    """Drop nodes whose outputs nobody reads (the concatenated rotary tables once every user is fused)."""
    while True:
        read = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
        dead = [n for n in graph.node if not any(o in read for o in n.output if o)]
        if not dead:
            return
        ids = {id(n) for n in dead}
        keep = [n for n in graph.node if id(n) not in ids]
        del graph.node[:]
        graph.node.extend(keep)


def fuse_head_transposes(model: onnx.ModelProto, num_kv_heads: int) -> int:
    """Fewer layout copies around the heads (after export/row_attention.py's rewrite), returns Transposes removed:

    - a key's RotaryEmbedding runs on the projection [B,N,Hkv*D] itself (its 3-D form, num_heads = `num_kv_heads`),
      so that Reshape -> Transpose(0,2,1,3) -> RotaryEmbedding -> Transpose(2,0,1,3) (rows first, for the KV
      buffer) becomes RotaryEmbedding -> Reshape -> one Transpose;
    - Transpose(Transpose(x, p), q), the inner read by the outer alone, becomes Transpose(x, p[q]) (values).
    Copies only: every number stays the same (the rotary's arithmetic is per element, whatever its input layout)."""
    g = _Graph(model.graph)
    drop, insert, removed = set(), {}, 0
    for rot in model.graph.node:
        if rot.op_type != "RotaryEmbedding" or len(rot.input) != 3 or rot.attribute:
            continue
        t_in = g.op(rot.input[0], "Transpose")
        users = g.consumers.get(rot.output[0], [])
        t_out = users[0] if len(users) == 1 and users[0].op_type == "Transpose" else None
        r = g.op(t_in.input[0], "Reshape") if t_in is not None else None
        if t_out is None or r is None or _attr(t_out, "perm") != [2, 0, 1, 3] \
                or _attr(t_in, "perm") != [0, 2, 1, 3] or not g.only_use(t_in.output[0], rot) \
                or not g.only_use(r.output[0], t_in) or rot.output[0] in g.outputs:
            continue
        p, q = _attr(t_in, "perm"), _attr(t_out, "perm")
        flat = rot.output[0] + "_flat"
        insert[id(rot)] = [
            helper.make_node("RotaryEmbedding", [r.input[0], rot.input[1], rot.input[2]], [flat],
                             name=rot.name + "_3d", num_heads=num_kv_heads),
            helper.make_node("Reshape", [flat, r.input[1]], [rot.output[0] + "_heads"], name=rot.name + "_heads"),
            helper.make_node("Transpose", [rot.output[0] + "_heads"], [t_out.output[0]], name=t_out.name,
                             perm=[p[i] for i in q])]
        drop.update({id(r), id(t_in), id(rot), id(t_out)})
        removed += 1
    if removed:
        _replace(model.graph, drop, insert)
        g = _Graph(model.graph)
    drop, insert = set(), {}
    for outer in model.graph.node:
        inner = g.op(outer.input[0], "Transpose") if outer.op_type == "Transpose" else None
        if inner is None or id(inner) in drop or not g.only_use(inner.output[0], outer):
            continue
        p, q = _attr(inner, "perm"), _attr(outer, "perm")
        if p is None or q is None:
            continue
        insert[id(outer)] = [helper.make_node("Transpose", [inner.input[0]], list(outer.output), name=outer.name,
                                              perm=[p[i] for i in q])]
        drop.update({id(inner), id(outer)})
        removed += 1
    if insert:
        _replace(model.graph, drop, insert)
    return removed
