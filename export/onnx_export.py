"""Export one graph (export/graphs.py) to ONNX with the dynamo exporter at opset 23, check its structure, and
rewrite its attention for the engine.

Why this path: at opset 23 the exporter lowers SDPA to the standard `Attention` op; written with `enable_gqa=True`
(models/target.py) it keeps native GQA, with no Expand-based repeat_kv in front of it. The exporter's default
opset is 20, so it is set here. The structure check fails the export when a layer's attention did not become one
`Attention` node or when repeat_kv crept back in. Then each graph with attention is rewritten (structure only):
its RoPE and skip + RMS norm fused (export/fuse.py), its KV concatenation turned into buffers written in place and
its `Attention` into a row-independent decomposition that reads them without copies (export/row_attention.py).

Memory. Linear weights are first transposed in place (export/layout.py) so that the optimizer finds no
`Transpose(W)` to fold into a second copy; the ONNX program's initializers then wrap the torch parameters without
copying, and saving streams them to disk. Measured peak RSS: see `measure_export_memory` and the engine tests.
Graphs with more than 64 MiB of weights go to external data (`NAME.onnx.data` next to the graph): protobuf
caps a file at 2 GiB, and serializing into the proto would copy the weights twice more.

Exporting targets larger than RAM is not implemented; the plan is in docs/plans.md.
"""
from __future__ import annotations

import contextlib
import gc
import io
import logging
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import onnx
import torch

from eaglex.base.errors import ModelError

from .fuse import fuse_head_transposes, fuse_rotary, fuse_skip_rms_norm
from .graphs import GraphSpec
from .row_attention import rewrite_attention

OPSET = 23
# Weights above this go to external data. Protobuf caps a file at 2 GiB, but the limit is set far lower because
# serializing weights into the proto copies them twice in memory (proto + bytes: measured 4x the weights' size at
# peak for a 623 MB model, against 1x when streamed to external data).
EXTERNAL_DATA_ABOVE = 64 * 1024 ** 2
_SHAPE_OPS = {"Reshape", "Unsqueeze", "Expand", "Transpose", "Squeeze", "Identity"}


class ExportError(ModelError):
    """The exporter produced a graph eaglex cannot use (wrong attention lowering, failed parity); a ModelError so
    that `eaglex build` reports it as one line."""


@dataclass
class ExportResult:
    name: str
    path: Path
    files: list[Path]                 # the graph and its external data file, if any
    seconds: float
    nodes: Counter = field(default_factory=Counter)

    @property
    def bytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)


def export_graph(spec: GraphSpec, out_dir: Path, metadata: dict[str, str] | None = None,
                 fused_attention: bool = False) -> ExportResult:
    """Trace `spec` to `out_dir/<name>.onnx` (+ `.onnx.data` above ~2 GiB) and check its structure.
    `fused_attention`: each layer's attention as one eaglex.TreeAttention (the kernel library's op)."""
    t0 = time.perf_counter()
    path = Path(out_dir) / f"{spec.name}.onnx"
    with _quiet(), torch.inference_mode(False), torch.no_grad():
        prog = torch.onnx.export(spec.module, spec.args, input_names=spec.input_names,
                                 output_names=spec.output_names, dynamic_shapes=spec.dynamic_shapes,
                                 opset_version=OPSET, dynamo=True, optimize=True, verbose=False)
    for k, v in (metadata or {}).items():
        prog.model.metadata_props[k] = str(v)
    _name_dims(prog.model.graph)
    weight_bytes = sum(v.const_value.nbytes for v in prog.model.graph.initializers.values()
                       if v.const_value is not None)
    external = weight_bytes > EXTERNAL_DATA_ABOVE
    prog.save(path, external_data=external)
    del prog
    _forget_matched_graphs()
    files = [path] + ([path.with_name(path.name + ".data")] if external else [])
    check_structure(path, spec.attention_nodes)
    if spec.heads:
        nodes = _engine_rewrites(path, spec.heads, fused_attention)
    else:
        nodes = _ops(onnx.load(str(path), load_external_data=False))
    return ExportResult(spec.name, path, files, time.perf_counter() - t0, nodes)


def _engine_rewrites(path: Path, heads: tuple[int, int, int], fused_attention: bool = False) -> Counter:
    """The rewrites every engine graph with attention gets: RoPE and skip + RMS norm fused (export/fuse.py), KV
    buffers written in place and row-independent attention (export/row_attention.py), then fewer layout copies
    around the heads (export/fuse.py). They change the saved graph's structure only: the weights (external data)
    are neither read nor rewritten. Returns the new graph's op counts."""
    model = onnx.load(str(path), load_external_data=False)
    fuse_rotary(model)
    fuse_skip_rms_norm(model)
    try:
        rewrite_attention(model, *heads, fused=fused_attention)
    except ValueError as e:
        raise ExportError(f"{path.name}: {e}") from None
    fuse_head_transposes(model, heads[1])
    onnx.save(model, str(path))
    return _ops(model)


def _ops(model: onnx.ModelProto) -> Counter:
    return Counter(n.op_type for n in model.graph.node)


# Axes the exporter leaves with generated names (s85, u0): readable names for people reading the graph's I/O.
_DIM_NAMES = {"attn_mask": {3: "past + seq"}, "top_logp": {2: "top_k"}, "top_ids": {2: "top_k"}}


def _name_dims(graph) -> None:
    import onnx_ir as ir

    for value in list(graph.inputs) + list(graph.outputs):
        names = _DIM_NAMES.get(value.name)
        if names and value.shape is not None:
            dims = list(value.shape)
            for axis, name in names.items():
                dims[axis] = name
            value.shape = ir.Shape(dims)


def check_structure(path: Path, attention_nodes: int) -> None:
    """Raises ExportError unless the exported graph has `attention_nodes` Attention ops fed without repeat_kv (an
    Expand on the key/value path)."""
    model = onnx.load(str(path), load_external_data=False)
    nodes = list(model.graph.node)
    ops = Counter(n.op_type for n in nodes)
    if ops["Attention"] != attention_nodes:
        raise ExportError(f"{path.name}: expected {attention_nodes} Attention nodes (one per layer), found "
                          f"{ops['Attention']}: SDPA was not lowered to the opset-23 Attention op")
    producer = {o: n for n in nodes for o in n.output}
    for n in nodes:
        if n.op_type != "Attention":
            continue
        for name in n.input[1:3]:                    # key, value
            node = producer.get(name)
            while node is not None and node.op_type in _SHAPE_OPS:
                if node.op_type == "Expand":
                    raise ExportError(f"{path.name}: {n.name} reads its keys/values through Expand (repeat_kv); "
                                      "the attention must use native GQA (enable_gqa=True)")
                node = producer.get(node.input[0])


def _forget_matched_graphs() -> None:
    """onnxscript's rewrite rules are module-level objects whose matchers keep the last graph they visited, and
    with it every initializer (TorchTensors wrapping our parameters): without this the torch weights outlive the
    export (measured: 0.8x the weights still held when ORT loads the graph for the parity check)."""
    try:
        from onnxscript.rewriter._matcher import PatternMatcher
    except ImportError:                          # another onnxscript layout: nothing known to clear
        return
    for obj in gc.get_objects():
        if isinstance(obj, PatternMatcher):
            for attr in ("_graph", "_current_node", "_match", "_tracer"):
                if hasattr(obj, attr):
                    setattr(obj, attr, None)


@contextlib.contextmanager
def _quiet():
    """The exporter prints progress lines and warns about unrelated optional packages (torchvision)."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)
