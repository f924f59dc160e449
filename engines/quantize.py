"""`eaglex build --quant fp8|int8|int4|w8a8` (or `--quant-draft` alone): rewrite a built float engine folder into a
quantized one.

The float engine is built first (engines/build.py, with its own parity check against torch); this module then
rewrites target.onnx (and, when asked, the draft graphs) with export/quant_graphs.py:

- fp8:  FP8 Q/DQ from the scales of a calibrated ModelOpt checkpoint (`eaglex calibrate`). The KV cache stays in
        the engine dtype: k/v scales, if calibrated, are recorded but not applied (ONNX Runtime's CPU EP has no FP8
        attention; the TensorRT-LLM bundle is where they are used). Same exactness rules as int8.
- int8 / int4: MatMulNBits (8- or 4-bit weights in blocks of 32, accuracy level 4: int8 activations, ONNX Runtime's
  fast CPU kernel); needs no calibration. The target's attention is row-independent since the float build
  (export/row_attention.py; checked here for the target's heads), so a row's logits are bit-identical however many
  rows share the call, wherever its keys sit in the cache and whatever it is batched with: the manifest's
  `exactness` records `row_independent_keys` (calls seeing up to that many keys) and the runtime keeps no rule but
  that bound (runtime/ort_backend.py).
- w8a8: SmoothQuant (export/quant_graphs.rowwise_int8): int8 weights per output channel, int8 activations per row, on
  ONNX Runtime's integer GEMM, smoothed by activation ranges measured on the float target (calibration/smooth.py,
  calibration text as `eaglex calibrate --data`). Rows are independent by construction, so the same contract as
  int8; the GEMM reads each weight once for all rows, so verifying a few rows costs about one row's step (SmolLM2:
  t(4)/t(1) ~1.2 against int8's ~1.5) and one-row steps are faster too; top-1 agreement with the float model is lower
  than int8's (docs/results.md).
FP8 engines keep the exactness rules (EXACT_RULES below): target calls of two rows or more, a KV cache without holes,
chain trees, one request at a time.

The draft head stays float unless asked (`draft=True`; int8 MatMulNBits for int8 and w8a8 engines): it is small,
and its cost is in the number of calls.
quantize_draft rewrites the draft graphs alone (int8) and leaves the target float: the draft only proposes tokens
and the float target decides every one, so the output stays identical to float vanilla decoding, while drafting
costs less (SmolLM2, chain:2: 2.5 -> 1.7 ms per cycle, same tau). `eaglex engine` builds its engines so.

Atomic like the build: the new engine is assembled in a hidden sibling folder (unchanged files hard-linked), checked,
and swapped in by renames; the old folder is deleted last. The manifest records the method, the scales' source and
hashes, sizes before/after, and the quantized graph's error against the float graph on the same inputs.
"""
from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from eaglex.base.errors import ModelError
from eaglex.base.kernel_ops import ATTENTION_OP
from eaglex.engines.build import kernels_record
from eaglex.export.parity import ort_feeds, torch_outputs
from eaglex.export.row_attention import ROW_INDEPENDENT_KEYS
from eaglex.models.target import causal_mask
from eaglex.runtime.manifest import MANIFEST, read_manifest, sha256_file, verify_files, write_manifest

QUANT_METHODS = ("fp8", "int8", "int4", "w8a8")
_ROWS = "; attention row-independent (FusedMatMul decomposition)"
FORMATS = {
    "fp8": "ONNX QuantizeLinear/DequantizeLinear float8e4m3fn (opset 23): FP8 weights (DQ), static per-tensor "
           "activation Q/DQ; lm_head and embeddings float",
    "int8": "com.microsoft::MatMulNBits bits=8 block_size=32 symmetric accuracy_level=4 (int8 activations)" + _ROWS,
    "q8": "eaglex::LinearQ8: int8 weights in blocks of 32, fp16 scales (Q8_0), int8 activations per row and block"
          + _ROWS,
    "q4": "eaglex::LinearQ4: 4-bit weights in blocks of 32, an fp16 scale and minimum each (Q4_1), lm_head on "
          "LinearQ8, int8 activations per row and block" + _ROWS,
    "int4": "com.microsoft::MatMulNBits bits=4 block_size=32 with a zero point per block, lm_head bits=8, "
            "accuracy_level=4 (int8 activations)" + _ROWS,
    "w8a8": "MatMulInteger uint8 x int8: weights int8 per output channel, activations int8 per row (dynamic)" + _ROWS,
}
# int4: the modules kept at 8 bits (the LM head, as llama.cpp's 4-bit files keep their output layer)
INT4_EIGHT_BIT = (r"(^|\.)lm_head$",)
# Regexes of modules kept float. fp8: the ones ModelOpt excludes (lm_head has no calibrated scales anyway).
EXCLUDE = {"fp8": (r"(^|\.)lm_head$",), "int8": (), "int4": (), "w8a8": ()}
# How the runtime keeps a quantized engine's speculative output bit-identical to its vanilla output
# (export/quant_graphs.py says why): int8 or FP8 activations amplify the float rounding differences between a one-row
# and a many-row Attention call, between keys at different indices, and between rows padded together in a batch
# (measured on SmolLM2: without these rules the fp8 engine matched vanilla on 1 of 8 prompts, int8 on 0 of 4).
EXACT_RULES = {"min_rows": 2, "kv_holes": False, "trees": "chain", "batching": False}
# MatMulNBits engines with row-independent attention: no rule while a call sees at most this many keys.
ROW_INDEPENDENT = {"row_independent_keys": ROW_INDEPENDENT_KEYS}
EXACTNESS = {"int8": ROW_INDEPENDENT, "int4": ROW_INDEPENDENT, "w8a8": ROW_INDEPENDENT, "fp8": EXACT_RULES}
# A ModelOpt-exported EAGLE-3 draft names its layer layers.0.*, the engine's graph midlayer.*.
DRAFT_PREFIXES = {"layers.0.": "midlayer."}


def quantize_engine(engine_dir, quant: str, calibrated_dir=None, *, draft: bool = False, calibrated_draft_dir=None,
                    data: str = "auto", progress: bool = True) -> dict:
    """Quantize the engine folder `engine_dir` in place; returns its new manifest. `data`: w8a8's calibration text
    (calibration/windows.py's sources). Bad input: one-line ModelError."""
    t0 = time.perf_counter()
    engine = Path(engine_dir)
    if quant not in QUANT_METHODS:
        raise ModelError(f"--quant {quant!r} is not available for ONNX Runtime engines; choose "
                         f"{' or '.join(QUANT_METHODS)}")
    m = read_manifest(engine)
    if m.get("backend") != "onnxruntime":
        raise ModelError(f"engine {engine} was built for {m.get('backend')}; only onnxruntime engines are "
                         "quantized here")
    if m.get("quant"):
        raise ModelError(f"engine {engine} is already quantized ({m['quant']['method']}): rebuild the float engine "
                         "with `eaglex build --force` first")
    if draft and not m.get("draft"):
        raise ModelError(f"engine {engine} has no draft head to quantize")
    if m.get("draft_quant"):
        raise ModelError(f"engine {engine} is already quantized (int8 draft): rebuild the float engine with "
                         "`eaglex build --force` first")
    verify_files(engine, m)                          # never quantize a corrupt engine
    graphs = ["target"] + (_draft_graphs(m) if draft else [])
    scales, source = _scales(quant, calibrated_dir, calibrated_draft_dir, draft, m, data, progress)

    spec = m["target"]["spec"]
    heads = (spec["num_heads"], spec["num_kv_heads"], spec["head_dim"])

    on_kernels = bool(m.get("kernels"))

    def quantize(g: str, src: Path, dst: Path):
        return _quantize_graph(quant, src, dst, scales.get("draft" if g != "target" else "target"),
                               heads if g == "target" else None, on_kernels)

    def finish(tmp: Path, reports: dict) -> dict:
        manifest = _updated_manifest(m, tmp, quant, reports, source, target_parity(engine, tmp, m), draft)
        manifest["quant"]["seconds"] = round(time.perf_counter() - t0, 2)
        return manifest
    return _rewrite(engine, m, graphs, f"quantize {quant}", quantize, finish, progress)


def quantize_draft(engine_dir, progress: bool = True) -> dict:
    """Quantize only the draft graphs of the float engine folder `engine_dir` (int8 MatMulNBits) in place; returns
    its new manifest, whose `draft_quant` records it. The target stays float, so nothing about exactness changes."""
    t0 = time.perf_counter()
    engine = Path(engine_dir)
    m = read_manifest(engine)
    if m.get("backend") != "onnxruntime":
        raise ModelError(f"engine {engine} was built for {m.get('backend')}; only onnxruntime engines are "
                         "quantized here")
    if not m.get("draft"):
        raise ModelError(f"engine {engine} has no draft head to quantize")
    if m.get("quant") or m.get("draft_quant"):
        raise ModelError(f"engine {engine} is already quantized: rebuild the float engine with `eaglex build "
                         "--force` first")
    verify_files(engine, m)

    on_kernels = bool(m.get("kernels"))

    def finish(tmp: Path, reports: dict) -> dict:
        out = _with_files(m, tmp, reports)
        out["draft_quant"] = {"method": "int8", "format": FORMATS["q8" if on_kernels else "int8"],
                              "graphs": {g: r.to_json() for g, r in reports.items()},
                              "bytes_before": sum(r.bytes_before for r in reports.values()),
                              "bytes_after": sum(r.bytes_after for r in reports.values()),
                              "seconds": round(time.perf_counter() - t0, 2)}
        for key in ("tuning", "batch_schedule"):    # measured with the float draft's costs
            out.pop(key, None)
        return out
    return _rewrite(engine, m, _draft_graphs(m), "quantize draft int8",
                    lambda g, src, dst: _int8(src, dst, None, on_kernels), finish, progress)


def draft_quant_line(m: dict) -> str:
    """The line `eaglex build` and `eaglex engine` print for an engine with an int8 draft on a float target."""
    q = m["draft_quant"]
    return (f"  draft quantized int8: {q['bytes_before'] / 1024 ** 2:.1f} -> {q['bytes_after'] / 1024 ** 2:.1f} MB; "
            "the target stays float and decides every token, so the output is float vanilla decoding's")


def _draft_graphs(m: dict) -> list[str]:
    return [g for g in ("draft_fc", "draft") if g in m["graphs"]]


def _rewrite(engine: Path, m: dict, graphs: list[str], desc: str, quantize, finish, progress: bool) -> dict:
    """Atomically replace `graphs` of the engine folder: each rewritten by quantize(graph, src, dst) -> report into
    a hidden sibling folder (other files hard-linked), finish(folder, reports) -> the new manifest, then the swap."""
    tmp = engine.parent / f".{engine.name}.quant-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        rewritten = {f for g in graphs for f in m["graphs"][g]["files"]}
        for f in sorted(engine.iterdir()):
            if f.is_file() and f.name not in rewritten and f.name != MANIFEST:
                _link(f, tmp / f.name)
        reports = {}
        for g in tqdm(graphs, desc=desc, unit="graph", disable=not progress, file=sys.stderr):
            reports[g] = quantize(g, engine / m["graphs"][g]["file"], tmp / m["graphs"][g]["file"])
        manifest = finish(tmp, reports)
        write_manifest(tmp, manifest)
        _swap(tmp, engine)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _scales(quant, calibrated_dir, calibrated_draft_dir, draft, m: dict, data: str, progress: bool
            ) -> tuple[dict, dict]:
    """{"target": scales, "draft": scales} for fp8, {"target": activation maxima} for w8a8 (empty for int8) and
    the manifest's record of their source."""
    if quant == "w8a8":
        if calibrated_dir is not None:
            raise ModelError("--calibrated is for --quant fp8; w8a8 measures its activation ranges on the target")
        from eaglex.calibration.smooth import SMOOTH_SAMPLES, SMOOTH_SEQ_LEN, activation_max
        target = Path(m["sources"]["target"]["path"])
        if not (target / "config.json").is_file():
            raise ModelError(f"w8a8 measures activation ranges on the float target, and {target} (where this "
                             "engine was built from) is gone: rebuild with `eaglex build --quant w8a8`")
        return ({"target": activation_max(target, SMOOTH_SAMPLES, SMOOTH_SEQ_LEN, data, progress)},
                {"calibration": {"method": "SmoothQuant activation maxima", "data": data,
                                 "samples": SMOOTH_SAMPLES, "seq_len": SMOOTH_SEQ_LEN}})
    if quant != "fp8":
        if calibrated_dir is not None:
            raise ModelError(f"--calibrated is for --quant fp8; {quant} quantization needs no calibration")
        return {}, {"calibration": None}
    from eaglex.calibration.checkpoint import quant_config, read_fp8_scales

    if calibrated_dir is None:
        raise ModelError("--quant fp8 needs the activation scales of a calibration: run `eaglex calibrate --target "
                         "DIR --out CAL` first and pass --calibrated CAL")
    out = {"target": read_fp8_scales(calibrated_dir)}
    source = {"calibration": _source(calibrated_dir, quant_config(calibrated_dir))}
    if draft:
        if calibrated_draft_dir is None:
            raise ModelError("an FP8 draft needs its own calibrated scales: run `eaglex calibrate ... --draft DIR "
                             "--quant-draft` and pass --calibrated-draft")
        out["draft"] = read_fp8_scales(calibrated_draft_dir, DRAFT_PREFIXES)
        source["draft_calibration"] = _source(calibrated_draft_dir, quant_config(calibrated_draft_dir))
    return out, source


def _source(folder, qc: dict) -> dict:
    folder = Path(folder)
    report = folder / "eaglex_calibration.json"
    return {"path": str(folder.resolve()), "quant_algo": qc.get("quant_algo"),
            "kv_cache_quant_algo": qc.get("kv_cache_quant_algo"),
            "kv_cache_scales_applied": False,           # ORT engines keep the KV cache in the engine dtype
            "sha256": {f.name: sha256_file(f) for f in sorted(folder.glob("*.safetensors"))},
            "report": str(report) if report.is_file() else None}


def _quantize_graph(quant: str, src: Path, dst: Path, scales, heads: tuple[int, int, int] | None,
                    on_kernels: bool = False):
    """`heads` (query heads, KV heads, head dim) for the target graph: its attention is made row-independent. The
    draft's stays fused (faster): the draft only proposes, its numerics never reach the output. `on_kernels`: the
    float engine was built on eaglex's kernels, so int8 layers take eaglex.LinearQ8 (faster than MatMulNBits at
    every row count: docs/step.md)."""
    from eaglex.export.quant_graphs import fp8_qdq, kernel_linear, nbits_weight_only, rowwise_int8
    if quant == "fp8":
        return fp8_qdq(src, dst, scales, exclude=EXCLUDE["fp8"])
    if quant == "w8a8" and heads is None:       # the draft: only proposes, int8 weight-only suits it
        return _int8(src, dst, None, on_kernels)
    if quant == "w8a8":
        return rowwise_int8(src, dst, EXCLUDE[quant], row_attention=heads, act_max=scales)
    if quant == "int8":
        return _int8(src, dst, heads, on_kernels)
    # int4 as llama.cpp's 4-bit files: a minimum (or zero point) per block and the LM head at 8 bits
    if on_kernels:
        return kernel_linear(src, dst, 4, EXCLUDE[quant], row_attention=heads, eight_bit=INT4_EIGHT_BIT)
    return nbits_weight_only(src, dst, 4, EXCLUDE[quant], row_attention=heads, symmetric=False,
                             eight_bit=INT4_EIGHT_BIT)


def _int8(src: Path, dst: Path, heads: tuple[int, int, int] | None, on_kernels: bool):
    """int8 weights: eaglex.LinearQ8 on a kernel engine, else MatMulNBits 8-bit."""
    from eaglex.export.quant_graphs import kernel_linear, nbits_weight_only
    if on_kernels:
        return kernel_linear(src, dst, 8, EXCLUDE["int8"], row_attention=heads)
    return nbits_weight_only(src, dst, 8, EXCLUDE["int8"], row_attention=heads)


def _updated_manifest(m: dict, folder: Path, quant: str, reports: dict, source: dict, parity: dict,
                      draft: bool) -> dict:
    out = _with_files(m, folder, reports)
    weights = {"fp8": "float8e4m3fn", "int8": "int8", "int4": "int4", "w8a8": "int8"}[quant]
    out["dtypes"] = dict(m["dtypes"], weights=weights)
    ops = (out.get("kernels") or {}).get("ops") or {}
    form = {"int8": "q8" if "LinearQ8" in ops else "int8", "int4": "q4" if "LinearQ4" in ops else "int4"}
    out["quant"] = {"method": quant, "format": FORMATS[form.get(quant, quant)], "draft_quantized": draft,
                    "graphs": {g: r.to_json() for g, r in reports.items()},
                    "bytes_before": sum(r.bytes_before for r in reports.values()),
                    "bytes_after": sum(r.bytes_after for r in reports.values()),
                    "parity": parity, **source}
    # the float engine's tuned tree and schedule do not carry over: this engine runs (and is tuned) otherwise
    out["tree"] = None
    if quant in EXACTNESS and "target" in reports:
        rules = EXACTNESS[quant]
        if rules is ROW_INDEPENDENT and ATTENTION_OP in ops:
            rules = {}                      # eaglex.TreeAttention's rows are independent of the call at any context
        out["exactness"] = rules
        out["tree"] = "chain:2" if rules.get("trees") == "chain" else None
    for key in ("tuning", "batch_schedule"):
        out.pop(key, None)
    return out


def _with_files(m: dict, folder: Path, reports: dict) -> dict:
    """A copy of manifest `m` with the rewritten graphs' files and op counts, and every file's size and hash."""
    from collections import Counter

    import onnx

    out = dict(m)
    out["graphs"] = {k: dict(v) for k, v in m["graphs"].items()}
    for g, r in reports.items():
        model = onnx.load(str(folder / out["graphs"][g]["file"]), load_external_data=False)
        ops = Counter(n.op_type for n in model.graph.node)
        out["graphs"][g].update(files=list(r.files), nodes=sum(ops.values()), ops=dict(sorted(ops.items())))
    out["files"] = {f.name: {"bytes": f.stat().st_size, "sha256": sha256_file(f)}
                    for f in sorted(folder.iterdir()) if f.is_file() and f.name != MANIFEST}
    out["kernels"] = kernels_record(out["graphs"])
    return out


QUALITY_TOP1 = 0.94          # top-1 agreement with the float model on real text below which the build warns
QUALITY_PROMPTS, QUALITY_TOKENS = 8, 32


def target_parity(float_dir: Path, quant_dir: Path, m: dict, seed: int = 0) -> dict:
    """The quantized target graph against the float one on the same inputs: a 24-token prefill of random ids, then
    a 6-token step over the float graph's own KV cache (relative L2 error of the logits, top-1 agreement over all
    rows); and, where the engine has a tokenizer, `text`: top-1 agreement on real text, the float graph's own
    greedy continuations of hand-written chat prompts (what a user's answers are made of)."""
    spec = m["target"]["spec"]
    ref, new = (_target_session(d / m["graphs"]["target"]["file"]) for d in (float_dir, quant_dir))
    dtype = {"float32": np.float32, "float16": np.float16}[m["dtype"]]
    step = _Stepper(spec, dtype, [o.name for o in ref.get_outputs()])
    ids = np.random.default_rng(seed).integers(0, spec["vocab_size"], 30).tolist()
    r1, past = step.run(ref, ids[:24])
    q1, _ = step.run(new, ids[:24])
    r2, _ = step.run(ref, ids[24:], past)
    q2, _ = step.run(new, ids[24:], past)
    a = np.concatenate([r1, r2]).astype(np.float64)
    b = np.concatenate([q1, q2]).astype(np.float64)
    out = {"rows": int(a.shape[0]), "logits_rel_error": round(float(np.linalg.norm(b - a) / np.linalg.norm(a)), 5),
           "top1_agreement": round(float((a.argmax(-1) == b.argmax(-1)).mean()), 4)}
    text = _text_agreement(float_dir, ref, new, step)
    if text is not None:
        out["text"] = text
    return out


def quality_warning(manifest: dict) -> str | None:
    """One line when a quantized target agrees with the float model on less than QUALITY_TOP1 of real text."""
    q = manifest.get("quant") or {}
    text = (q.get("parity") or {}).get("text")
    if text is None or text["top1_agreement"] >= QUALITY_TOP1:
        return None
    return (f"warning: the {q['method']} target agrees with the float model on {text['top1_agreement']:.1%} of "
            f"top-1 tokens over real text (below {QUALITY_TOP1:.0%}): its answers drift from the model's; "
            "prefer --quant int8")


def _target_session(path: Path):
    import onnxruntime as ort

    from eaglex.runtime.ort_session import session_options

    # the runtime's options: on the process-wide pool, FP8 weights folded as the engine runs, eaglex's kernels
    return ort.InferenceSession(str(path), session_options(), providers=["CPUExecutionProvider"])


class _Stepper:
    """Calls of a target graph over token lists: all rows' logits, and the KV cache to continue from."""

    def __init__(self, spec: dict, dtype, outputs: list[str]):
        self.L, self.kv, self.D, self.dtype, self.outputs = (spec["num_layers"], spec["num_kv_heads"],
                                                             spec["head_dim"], dtype, outputs)

    def run(self, sess, tokens: list[int], past: list | None = None, last_only: bool = False):
        P = 0 if past is None else past[0].shape[2]
        past = past or [np.zeros((1, self.kv, 0, self.D), dtype=self.dtype)] * (2 * self.L)
        N = len(tokens)
        f = {"input_ids": np.array([tokens], np.int64), "position_ids": np.arange(P, P + N, dtype=np.int64)[None],
             "attn_mask": causal_mask(N, P).numpy(),
             "logits_rows": np.arange(N - 1 if last_only else 0, N, dtype=np.int64)}
        for i in range(self.L):
            f[f"past_key_{i}"], f[f"past_value_{i}"] = past[2 * i], past[2 * i + 1]
        got = torch_outputs(dict(zip(self.outputs, sess.run(self.outputs, ort_feeds(f, N)))))
        return got["logits"][0], [got[f"present_{kv}_{i}"] for i in range(self.L) for kv in ("key", "value")]


def _text_agreement(folder: Path, ref, new, step: _Stepper) -> dict | None:
    """Top-1 agreement of `new` with `ref` on ref's greedy continuations of hand-written chat prompts (the tuning
    set: apart from every bench's prompts), teacher-forced; None without a tokenizer."""
    from eaglex.base.honest_prompts import TUNING
    from eaglex.base.prompts import chat_ids, has_chat_template, has_tokenizer, load_tokenizer

    if not has_tokenizer(folder):
        return None
    tok = load_tokenizer(folder)
    agree = total = 0
    for _, messages in TUNING[:QUALITY_PROMPTS]:
        prompt = chat_ids(tok, list(messages)) if has_chat_template(tok) else tok.encode(messages[-1]["content"])
        logits, past = step.run(ref, prompt, last_only=True)
        seq = list(prompt)
        for _ in range(QUALITY_TOKENS):
            seq.append(int(logits[-1].argmax()))
            logits, past = step.run(ref, seq[-1:], past)
        a, _ = step.run(ref, seq[:-1])
        b, _ = step.run(new, seq[:-1])
        span = slice(len(prompt) - 1, len(seq) - 1)                     # the predictions of the continuation
        agree += int((a[span].argmax(-1) == b[span].argmax(-1)).sum())
        total += span.stop - span.start
    return {"prompts": QUALITY_PROMPTS, "tokens": total, "top1_agreement": round(agree / total, 4)}


def _link(src: Path, dst: Path) -> None:
    """Hard link (no copy of large weights) where the file system allows, else copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _swap(tmp: Path, out: Path) -> None:
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)
