"""`eaglex build`: a target (+ EAGLE head) folder -> an ONNX Runtime engine folder.

The folder holds target.onnx, draft.onnx (+ draft_fc.onnx for EAGLE-3; external data files above ~2 GiB), the
target's config, generation config and tokenizer files, and manifest.json (engines/manifest.py). It is written into
a hidden sibling folder and renamed into place at the end, so a crash never leaves a folder that looks complete; an
existing engine is only replaced with force=True.

Order of work, chosen for memory: load torch weights once, transpose them in place for MatMul (export/layout.py),
export every graph and record torch's outputs for the parity cases, *free the torch model*, then load each graph in
ORT and compare. Torch's and ORT's copies of the weights are never alive together.
"""
from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import platform
import resource
import shutil
import sys
import time
from importlib import metadata
from pathlib import Path

from tqdm import tqdm

from eaglex.base.errors import ModelError
from eaglex.base.fsio import check_out, staged
from eaglex.base.prompts import TOKENIZER_FILES, has_tokenizer, tokenizer_class
from eaglex.runtime.manifest import FORMAT, FORMAT_VERSION, MANIFEST, default_method, sha256_file, write_manifest

BACKENDS = ("onnxruntime",)
# eaglex: the library's linear layers and TreeAttention; linear: its linear layers, the attention on stock ops; auto:
# `linear` where the library is built here, else stock. auto leaves TreeAttention out while it is slower than the
# stock attention on many-row calls at long contexts (docs/step.md: it re-reads each KV head per query row and head).
KERNELS = ("auto", "eaglex", "linear", "stock")
DTYPES = ("float32", "float16")     # ORT's CPU EP has no bfloat16 GEMM
CONFIG_FILES = ("config.json", "generation_config.json")
TOOLS = ("eaglex", "torch", "transformers", "onnx", "onnxruntime", "onnxscript", "numpy")


def build_engine(target_dir, draft_dir, out_dir, backend: str = "onnxruntime", dtype: str = "float32",
                 force: bool = False, progress: bool = True, kernels: str = "auto") -> dict:
    """Build the engine folder `out_dir`; returns its manifest. `kernels` (KERNELS): which layers run on eaglex's
    kernel library (runtime/kernels.py) rather than ONNX Runtime's stock ops. Bad input raises a one-line
    ModelError."""
    t0 = time.perf_counter()
    if backend not in BACKENDS:
        raise ModelError(f"backend {backend!r} cannot be built yet; choose {', '.join(BACKENDS)}")
    if dtype not in DTYPES:
        raise ModelError(f"dtype {dtype!r} is not available for ONNX Runtime engines; choose {' or '.join(DTYPES)}")
    use_kernels = _use_kernels(kernels, dtype)
    fused_attention = use_kernels and kernels == "eaglex"
    target_dir, out = Path(target_dir), Path(out_dir)
    draft_dir = Path(draft_dir) if draft_dir is not None else None
    check_out(out, force, (MANIFEST,), "an engine folder")
    with staged(out) as tmp:
        manifest = _build(target_dir, draft_dir, tmp, dtype, progress, use_kernels, fused_attention)
        manifest["build_seconds"] = round(time.perf_counter() - t0, 2)
        write_manifest(tmp, manifest)
    return manifest


def _use_kernels(kernels: str, dtype: str) -> bool:
    from eaglex.runtime import kernels as library

    if kernels not in KERNELS:
        raise ModelError(f"--kernels {kernels!r}: choose {', '.join(KERNELS)}")
    if kernels == "stock" or (kernels == "auto" and (dtype != "float32" or not library.available())):
        return False
    if dtype != "float32":
        raise ModelError(f"eaglex's kernels take float32 engines; build {dtype} with --kernels stock")
    library.require(f"--kernels {kernels} needs eaglex's kernel library")
    return True


def _build(target_dir: Path, draft_dir: Path | None, tmp: Path, dtype: str, progress: bool,
           use_kernels: bool = False, fused_attention: bool = False) -> dict:
    from eaglex.export.onnx_export import OPSET
    from eaglex.runtime.types import TreeConfig

    sources = {"target": _source_hashes(target_dir, progress)}
    if draft_dir is not None:
        sources["draft"] = _source_hashes(draft_dir, progress)
    engine_id = hashlib.sha256(json.dumps([FORMAT_VERSION, dtype, sources], sort_keys=True).encode()).hexdigest()[:16]
    meta = {"eaglex.engine_id": engine_id, "eaglex.format_version": str(FORMAT_VERSION)}

    target_section, draft_section, graphs, references = _export(target_dir, draft_dir, tmp, dtype, meta, progress,
                                                                 fused_attention)
    _release_memory()                          # torch's weights are gone before ORT loads its own copy
    if use_kernels:
        _on_kernels(tmp, graphs, progress)
    parity = _check(tmp, graphs, references, dtype, progress, lambda: _float64_references(
        target_dir, target_section["features"], target_section["feature_layers"]))

    for src in (target_dir / f for f in CONFIG_FILES + TOKENIZER_FILES):
        if src.is_file():
            shutil.copy2(src, tmp / src.name)
    try:
        tok_class = tokenizer_class(tmp) if has_tokenizer(tmp) else None
    except Exception as e:  # noqa: BLE001 - any loader failure: the engine could not be opened either
        raise ModelError(f"{target_dir}: its tokenizer files do not load ({type(e).__name__}: {e})") from e
    files = {f.name: {"bytes": f.stat().st_size, "sha256": sha256_file(f)} for f in sorted(tmp.iterdir())}
    kind = draft_section["kind"] if draft_section else None
    paths = {"target": target_dir, "draft": draft_dir}
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "engine_id": engine_id, "backend": "onnxruntime",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "dtype": dtype, "opset": OPSET,
        "dtypes": {"weights": dtype, "kv_cache": dtype, "features": dtype, "logits": "float32",
                   "top_logp": "float32", "attn_mask": "bool", "ids": "int64"},
        "target": target_section, "draft": draft_section,
        "method": default_method(kind),
        "kernels": kernels_record(graphs),
        "tokenizer_class": tok_class,            # what AutoTokenizer chose: the runtime loads it without AutoTokenizer
        # until `eaglex tune` (or `eaglex engine`) measures this machine: a short tree, the CPU's usual best
        "tree": str(TreeConfig()) if kind else None,
        "graphs": graphs, "files": files, "parity": parity,
        "sources": {k: {"path": str(paths[k]), "sha256": v} for k, v in sources.items()},
        "tools": _tool_versions(),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def _export(target_dir, draft_dir, tmp: Path, dtype: str, meta: dict, progress: bool,
            fused_attention: bool = False):
    """Load the torch models, export every graph, keep torch's parity outputs; the models die with this frame.
    `fused_attention`: each layer's attention as eaglex.TreeAttention."""
    from eaglex.export.graphs import draft_graphs, target_graph
    from eaglex.export.layout import to_matmul_layout
    from eaglex.export.onnx_export import export_graph
    from eaglex.export.parity import reference_cases
    from eaglex.models.eagle import load_draft
    from eaglex.models.target import DTYPES as TORCH_DTYPES
    from eaglex.models.target import load_target

    target = load_target(target_dir, TORCH_DTYPES[dtype])
    head = load_draft(draft_dir, target) if draft_dir is not None else None
    if head is not None:
        target = target.with_features(head.spec.kind, head.spec.taps)
    target_section = {"spec": dataclasses.asdict(target.spec), "features": target.features,
                      "feature_layers": list(target.taps), "feature_size": target.feature_size}
    draft_section = None
    to_matmul_layout(target)
    if head is not None:
        to_matmul_layout(head)
        if head.spec.kind == "eagle1":        # the head reads the target's lm_head, which was just replaced
            head.target_lm_head[0] = target.lm_head
        d = head.spec
        draft_section = {"kind": d.kind, "spec": dataclasses.asdict(d), "draft_vocab_size": d.draft_vocab_size,
                         "has_d2t": bool(d.kind == "eagle3" and head.d2t.any())}

    specs = [target_graph(target)] + (draft_graphs(head) if head is not None else [])
    graphs, references = {}, {}
    for spec in tqdm(specs, desc="export", unit="graph", disable=not progress, file=sys.stderr):
        res = export_graph(spec, tmp, {**meta, "eaglex.graph": spec.name}, fused_attention=fused_attention)
        references[spec.name] = reference_cases(spec)
        graphs[spec.name] = {"file": res.path.name, "files": [f.name for f in res.files],
                             "inputs": spec.input_names, "outputs": spec.output_names,
                             "nodes": sum(res.nodes.values()), "ops": dict(sorted(res.nodes.items())),
                             "export_seconds": round(res.seconds, 2)}
    return target_section, draft_section, graphs, references


def _on_kernels(tmp: Path, graphs: dict, progress: bool) -> None:
    """Each graph's float MatMuls as eaglex.LinearF32 over packed weights (export/kernel_graphs.py), in place."""
    from collections import Counter

    import onnx

    from eaglex.export.kernel_graphs import to_kernel_f32
    from eaglex.export.quant_graphs import save_graph

    for name in tqdm(list(graphs), desc="kernels", unit="graph", disable=not progress, file=sys.stderr):
        path = tmp / graphs[name]["file"]
        model = onnx.load(str(path))
        to_kernel_f32(model)
        for f in graphs[name]["files"]:
            (tmp / f).unlink()
        files = save_graph(model, path)
        ops = Counter(n.op_type for n in model.graph.node)
        graphs[name].update(files=[f.name for f in files], nodes=sum(ops.values()), ops=dict(sorted(ops.items())))
        del model
        _release_memory()


def kernels_record(graphs: dict) -> dict | None:
    """The manifest's `kernels`: the eaglex ops the graphs use and the library version they need; None when every
    graph runs on ONNX Runtime's stock ops."""
    from eaglex.base.kernel_ops import DOMAIN, OPS, VERSION

    ops = {op: sum(g["ops"].get(op, 0) for g in graphs.values()) for op in OPS}
    ops = {op: n for op, n in ops.items() if n}
    return {"domain": DOMAIN, "version": VERSION, "ops": ops} if ops else None


def _check(tmp: Path, graphs: dict, references: dict, dtype: str, progress: bool, float64_references=None) -> dict:
    """Each graph in ORT against the recorded torch outputs; ExportError above the dtype's tolerance.

    A float32 target that fails gets a second opinion against the exact answer: the same inputs through the target in
    float64. On deep targets torch's own float32 result can be the inexact one (measured on SmolLM2-135M, 30 layers,
    the case with 40 random past rows: torch float32 1.4e-4 from float64, ORT 1.1e-5), so the export fails only when
    ORT is itself more than the tolerance away from float64."""
    import onnxruntime as ort

    from eaglex.export.onnx_export import ExportError
    from eaglex.export.parity import Case, compare
    from eaglex.runtime.ort_session import session_options

    so = session_options()
    parity = {}
    total = sum(len(c) for c in references.values())
    with tqdm(total=total, desc="check", unit="case", disable=not progress, file=sys.stderr) as bar:
        for name, cases in references.items():
            try:
                sess = ort.InferenceSession(str(tmp / graphs[name]["file"]), so, providers=["CPUExecutionProvider"])
            except Exception as e:  # noqa: BLE001 - e.g. an op without a CPU kernel for this dtype
                raise ModelError(f"ONNX Runtime cannot load {name}.onnx ({dtype}): {str(e).splitlines()[0][:300]}"
                                 ) from None
            try:
                parity[name] = compare(name, sess, cases, dtype, bar).to_json()
            except ExportError as first:
                exact = float64_references() if name == "target" and dtype == "float32" and float64_references else None
                if exact is None:
                    raise
                cases = [Case(c.feeds, e.ref) for c, e in zip(cases, exact)]    # same inputs, exact outputs
                parity[name] = {**compare(name, sess, cases, dtype).to_json(), "reference": "float64",
                                "float32_reference": str(first)}
            del sess
    return parity


FLOAT64_LIMIT = 4 * 1024 ** 3     # float32 weight bytes up to which a float64 second opinion is affordable


def _float64_references(target_dir: Path, features: str, taps: list[int]):
    """The target graph's parity cases (with the features the head reads) computed in float64; None when the
    weights are too big to double."""
    from eaglex.export.graphs import target_graph
    from eaglex.export.layout import to_matmul_layout
    from eaglex.export.parity import reference_cases
    from eaglex.models.target import load_target

    if sum(f.stat().st_size for f in target_dir.glob("*.safetensors")) > FLOAT64_LIMIT:
        return None
    import torch
    target = load_target(target_dir, torch.float64).with_features(features, tuple(taps))
    to_matmul_layout(target)
    refs = reference_cases(target_graph(target))
    del target
    _release_memory()
    return refs


def _release_memory() -> None:
    """Collect, then hand freed heap pages back to the OS: glibc keeps freed weight-sized blocks in its arenas,
    where ORT's own allocations did not reuse them (measured: +0.8x the weights at the parity check without this)."""
    gc.collect()
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):           # not glibc: nothing to trim
        pass


def _source_hashes(folder: Path, progress: bool) -> dict[str, str]:
    """sha256 of the weight and config files of a model folder (what the engine was built from)."""
    if not folder.is_dir():
        raise ModelError(f"model folder {folder} does not exist")
    files = sorted(p for p in folder.iterdir() if p.is_file() and (
        p.suffix in (".safetensors", ".bin", ".pt", ".pth") or p.name == "config.json"))
    out = {}
    for f in tqdm(files, desc=f"hash {folder.name}", unit="file", disable=not progress or len(files) < 4,
                  file=sys.stderr):
        out[f.name] = sha256_file(f)
    return out


def _tool_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in TOOLS:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "?"
    return out


def summary(manifest: dict, out_dir) -> str:
    """The lines `eaglex build` prints at the end: files and sizes, graphs, parity errors, time."""
    lines = [f"engine {out_dir} ({manifest['dtype']}, opset {manifest['opset']}, "
             f"{manifest['draft']['kind'] if manifest['draft'] else 'no draft'}, "
             f"method {manifest['method']}, tree {manifest['tree'] or '-'})"]
    k = manifest.get("kernels")
    lines.append("  kernels: " + (f"eaglex v{k['version']} (" + ", ".join(f"{n} {op}" for op, n in k["ops"].items())
                                  + ")" if k else "ONNX Runtime's stock ops"))
    for name, info in manifest["files"].items():
        lines.append(f"  {name:<28} {_size(info['bytes']):>10}")
    for name, g in manifest["graphs"].items():
        p = manifest["parity"][name]
        lines.append(f"  {name + '.onnx':<28} {g['nodes']:>5} nodes, {g['ops'].get('Attention', 0)} Attention, "
                     f"worst rel. error {p['worst']:.1e} over {p['cases']} cases"
                     + (" against float64 (torch's own float32 result was further off)"
                        if p.get("reference") == "float64" else ""))
    lines.append(f"  built in {manifest['build_seconds']:.1f} s, peak RSS {_size(manifest['peak_rss_bytes'])}")
    return "\n".join(lines)


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
