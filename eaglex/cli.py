"""The `eaglex` command line. Thin: flags become config dataclasses, then one library call per command."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

from eaglex.models.errors import ModelError

METHODS = ("eagle3", "eagle2", "eagle1", "vanilla")


def _model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--target", type=Path, help="Hugging Face model folder of the target (Llama family)")
    g.add_argument("--draft", type=Path, help="EAGLE head folder (official EAGLE-3 or EAGLE-1/2 layout)")
    g.add_argument("--engine", type=Path, help="engine folder written by `eaglex build` (instead of --target)")
    g.add_argument("--draft-kind", choices=("eagle3", "eagle1"), help="force the head kind instead of detecting it")
    g.add_argument("--method", choices=METHODS,
                   help="eagle3: EAGLE-3 head + dynamic tree; eagle2: EAGLE-1/2 head + dynamic tree; eagle1: "
                        "EAGLE-1/2 head + static tree; vanilla: no drafting (default: what the draft holds)")
    g.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    t = p.add_argument_group("tree")
    t.add_argument("--tree", choices=("dynamic", "static", "chain", "auto"),
                   help="dynamic (EAGLE-2), static (EAGLE-1 mc_sim_7b_63), chain, or auto: measure a ladder of "
                        "chains and trees on the first prompts and keep the fastest (default: by method)")
    t.add_argument("--total-tokens", type=int, default=60, help="dynamic tree: nodes verified, root included")
    t.add_argument("--depth", type=int, default=7, help="draft expansion steps after the first draft step")
    t.add_argument("--tree-top-k", type=int, default=10, help="dynamic tree: nodes expanded per level")
    s = p.add_argument_group("sampling")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=0, help="0 = off")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--max-new-tokens", type=int, default=128)
    s.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template to text prompts")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eaglex", description="Lossless EAGLE speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text with speculative (or vanilla) decoding")
    _model_args(gen)
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one text prompt (needs a tokenizer in the target folder)")
    src.add_argument("--prompts", type=Path, help='JSONL: {"prompt": "..."} or {"input_ids": [...]} per line')
    gen.add_argument("--out", type=Path, help="write one JSON line per prompt here instead of printing text")

    chk = sub.add_parser("check", help="compare speculative with vanilla on the same backend; exit 1 on mismatch")
    _model_args(chk)
    chk.add_argument("--prompts", type=Path, required=True)
    chk.add_argument("--samples", type=int, default=300, help="sampling check: generations per prompt")

    eng = sub.add_parser("engine", help="what `make engine` runs: build a preset's engine, check it, print a demo")
    eng.add_argument("--model", default="tiny", help="preset name (tiny, llama3-8b, llama3-70b, ...)")
    eng.add_argument("--model-dir", type=Path, help="local folder of the target (else HF cache, else download)")
    eng.add_argument("--draft-dir", type=Path, help="local folder of the EAGLE head (else HF cache, else download)")
    eng.add_argument("--backend", choices=("onnxruntime", "torch", "tensorrt-llm"), help="default: the preset's")
    eng.add_argument("--out", type=Path, help="engine folder (default: engines/MODEL)")
    eng.add_argument("--force", action="store_true", help="rebuild even if the engine exists")
    eng.add_argument("--max-new-tokens", type=int, default=48)

    ben = sub.add_parser("bench", help="side-by-side speed table + JSON: vanilla vs speculative per backend, peers")
    ben.add_argument("--target", type=Path, help="HF target folder (torch backend rows and transformers peers)")
    ben.add_argument("--draft", type=Path, help="EAGLE head folder for the torch backend rows")
    ben.add_argument("--engine", type=Path, action="append", default=[], help="engine folder (repeatable)")
    ben.add_argument("--draft-lm", type=Path, help="small draft LM folder for transformers assisted generation")
    ben.add_argument("--prompts", type=Path, required=True, help="JSONL prompts (see generate)")
    ben.add_argument("--num-prompts", type=int, default=0, help="use only the first N prompts (0 = all)")
    ben.add_argument("--trees", default="chain:3,dynamic:8/4/3,dynamic:60/7/10",
                     help="comma list of chain:DEPTH, dynamic:TOTAL/DEPTH/TOPK, static, auto (the engine's tuned "
                          "tree, measured once and kept in its manifest, as --tree auto)")
    ben.add_argument("--max-new-tokens", type=int, default=64)
    ben.add_argument("--no-torch", action="store_true", help="skip the torch backend rows")
    ben.add_argument("--no-peers", action="store_true", help="skip the transformers peers")
    ben.add_argument("--out", type=Path, default=Path("bench.json"), help="JSON results file")

    bld = sub.add_parser("build", help="export a target (+ EAGLE head) to an engine folder and check it")
    bld.add_argument("--target", type=Path, required=True, help="Hugging Face model folder of the target")
    bld.add_argument("--draft", type=Path, help="EAGLE head folder (omit for a vanilla-only engine)")
    bld.add_argument("--backend", choices=("onnxruntime", "tensorrt-llm"), default="onnxruntime",
                     help="onnxruntime: ONNX engine run here; tensorrt-llm: a bundle for TensorRT-LLM's LLM API "
                          "(PyTorch backend, EAGLE-3) on GPU machines")
    bld.add_argument("--out", type=Path, required=True, help="engine folder to write, e.g. engines/NAME")
    bld.add_argument("--dtype", choices=("float32", "float16"), default="float32")
    bld.add_argument("--force", action="store_true", help="replace an existing engine folder")
    q = bld.add_argument_group("quantization")
    q.add_argument("--quant", choices=("fp8", "int8"),
                   help="fp8: FP8 Q/DQ from calibrated scales (onnxruntime) or the ModelOpt FP8 checkpoint "
                        "(tensorrt-llm); int8: weight-only MatMulNBits, the fast quantized CPU path (onnxruntime)")
    q.add_argument("--calibrated", type=Path, help="FP8 checkpoint written by `eaglex calibrate` (for --quant fp8)")
    q.add_argument("--quant-draft", action="store_true", help="also quantize the draft graphs (onnxruntime)")
    q.add_argument("--calibrated-draft", type=Path, help="FP8 draft from `eaglex calibrate --quant-draft`")
    tl = bld.add_argument_group("tensorrt-llm")
    tl.add_argument("--tp", type=int, default=1, help="tensor parallel size (GPUs per pipeline stage)")
    tl.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
    tl.add_argument("--max-draft-len", type=int, default=3, help="EAGLE-3 draft steps (chain length / tree depth)")
    tl.add_argument("--dynamic-tree-top-k", type=int, default=0,
                    help="EAGLE-2-style dynamic tree with K children per node (0: linear chain)")
    tl.add_argument("--max-total-draft-tokens", type=int, default=0,
                    help="dynamic tree: draft tokens verified per step (0: K x max-draft-len)")

    cal = sub.add_parser("calibrate", help="FP8 post-training quantization with NVIDIA ModelOpt + quality report")
    cal.add_argument("--target", type=Path, required=True, help="Hugging Face model folder of the target")
    cal.add_argument("--out", type=Path, required=True, help="folder for ModelOpt's unified FP8 HF checkpoint")
    cal.add_argument("--quant", choices=("fp8",), default="fp8")
    cal.add_argument("--kv-cache", choices=("fp8",), help="also calibrate FP8 k/v cache scales")
    cal.add_argument("--data", default="builtin",
                     help='"builtin" (held-out corpus of the embedded default; needs a tokenizer) or a JSONL file '
                          'of {"prompt": ...} / {"input_ids": [...]} lines (the last fifth is held out)')
    cal.add_argument("--samples", type=int, default=32, help="calibration windows")
    cal.add_argument("--seq-len", type=int, default=256, help="tokens per window")
    cal.add_argument("--eval-samples", type=int, default=8, help="held-out windows for the quality report")
    cal.add_argument("--batch-size", type=int, default=4)
    cal.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    cal.add_argument("--device", default="auto", help='"auto" (a CUDA GPU when present, else CPU), "cpu", "cuda:N"')
    cal.add_argument("--draft", type=Path, help="EAGLE head folder (with --quant-draft)")
    cal.add_argument("--quant-draft", action="store_true", help="also quantize the EAGLE head (default: float)")
    cal.add_argument("--draft-out", type=Path, help="FP8 head folder (default: OUT-draft)")
    cal.add_argument("--force", action="store_true", help="replace existing output folders")

    tri = sub.add_parser("triton", help="write a Triton Inference Server model repository serving an engine")
    tri.add_argument("--engine", type=Path, required=True,
                     help="engine folder (or a folder with target/ and draft/ model folders)")
    tri.add_argument("--out", type=Path, required=True, help="model repository to write into")
    tri.add_argument("--name", default="eaglex", help="model name in the repository (default: eaglex)")
    tri.add_argument("--instances", type=int, default=1, help="model instances (one request each at a time)")
    tri.add_argument("--max-queue-size", type=int, default=64, help="requests waiting beyond this are refused")
    tri.add_argument("--threads", type=int, default=0,
                     help="intra-op threads per instance (0: the backend's default)")
    tri.add_argument("--vanilla", action="store_true", help="serve without drafting (for comparisons)")
    tri.add_argument("--copy", action="store_true", help="copy the engine into the repository (portable)")
    tri.add_argument("--force", action="store_true", help="replace the model folder if it exists")

    trn = sub.add_parser("train-draft", help="train an EAGLE head for a target on its own continuations of prompts")
    trn.add_argument("--target", type=Path, required=True, help="Hugging Face model folder of the target")
    trn.add_argument("--data", type=Path, required=True,
                     help='JSONL: {"prompt": "..."} or {"input_ids": [...]} per line; the last 8 are held out for τ')
    trn.add_argument("--out", type=Path, required=True, help="head folder to write (checkpoints/ inside: resumable)")
    trn.add_argument("--method", choices=("eagle3", "eagle1"), default="eagle3",
                     help="eagle3: training-time test, reduced vocabulary; eagle1: EAGLE-1/2 feature regression")
    trn.add_argument("--steps", type=int, default=1000, help="optimiser steps")
    return parser


def resolve(args) -> tuple:
    """(backend, method, TreeConfig, SamplingConfig) from the flags, or a ModelError."""
    from eaglex.runtime.types import SamplingConfig, TreeConfig

    if args.engine is not None:
        from eaglex.runtime.ort_backend import OrtBackend    # noqa: PLC0415 - optional until engines are used
        if args.target or args.draft:
            raise ModelError("give either --engine or --target/--draft, not both")
        backend = OrtBackend(args.engine, draft_kind=args.draft_kind)
    elif args.target is not None:
        from eaglex.runtime.torch_backend import TorchBackend
        backend = TorchBackend(args.target, args.draft, args.dtype, args.draft_kind)
    else:
        raise ModelError("give --target DIR (and --draft DIR) or --engine DIR")
    kind = backend.draft_kind
    method = args.method or {"eagle3": "eagle3", "eagle1": "eagle2", None: "vanilla"}[kind]
    if method != "vanilla":
        if kind is None:
            raise ModelError(f"--method {method} needs a draft head (--draft DIR)")
        want = "eagle3" if method == "eagle3" else "eagle1"
        if kind != want:
            hint = "eagle3" if kind == "eagle3" else "eagle2 or eagle1"
            raise ModelError(f"--method {method} needs an {'EAGLE-3' if want == 'eagle3' else 'EAGLE-1/2'} head, "
                             f"but the draft is an {'EAGLE-3' if kind == 'eagle3' else 'EAGLE-1/2'} head: "
                             f"use --method {hint}")
    tree_kind = args.tree or ("static" if method == "eagle1" else "dynamic")
    try:
        tree = None if tree_kind == "auto" else TreeConfig(tree_kind, args.total_tokens, args.depth, args.tree_top_k)
        sampling = SamplingConfig(args.temperature, args.top_p, args.top_k, args.seed)
    except ValueError as e:
        raise ModelError(str(e)) from None
    if args.max_new_tokens < 0:
        raise ModelError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    return backend, method, tree, sampling


def _prompts(args, backend) -> tuple[list[list[int]], object]:
    from eaglex.prompts import encode, load_tokenizer, read_prompts
    tok = load_tokenizer(getattr(backend, "tokenizer_dir", None) or args.target)
    if getattr(args, "prompt", None) is not None:
        return [encode({"prompt": args.prompt}, tok, args.chat, "--prompt")], tok
    return read_prompts(args.prompts, tok, args.chat), tok


def _auto_tree(backend, tree, prompts):
    """Resolve --tree auto: the shape `eaglex engine` measured for this engine, else measure on the first prompts."""
    if tree is not None:
        return tree
    from eaglex.runtime.types import TreeConfig
    tuned = (getattr(backend, "manifest", None) or {}).get("tuned_tree")
    if tuned:
        print(f"--tree auto: {tuned['label']} (measured when the engine was tuned)", file=sys.stderr)
        return TreeConfig(**tuned["tree"])
    from eaglex.bench import tree_label
    from eaglex.runtime.autotune import autotune
    best, rows = autotune(backend, prompts[:4], max_new_tokens=32)
    speed = {tree_label(r.tree): f"{r.tokens_per_s:.1f}" for r in rows[1:]}
    print(f"--tree auto: {tree_label(best)} (tokens/s: vanilla {rows[0].tokens_per_s:.1f}, {speed})",
          file=sys.stderr)
    return best


def _trtllm_runner(args):
    """A TrtllmRunner when --engine is a TensorRT-LLM bundle, else None."""
    if args.engine is None:
        return None
    from eaglex.engines.trtllm import is_bundle
    if not is_bundle(args.engine):
        return None
    if args.target or args.draft:
        raise ModelError("give either --engine or --target/--draft, not both")
    from eaglex.runtime.trtllm_runner import TrtllmRunner
    return TrtllmRunner(args.engine)


def cmd_generate(args) -> int:
    from eaglex.runtime.generate import SpeculativeGenerator, VanillaGenerator

    runner = _trtllm_runner(args)
    if runner is not None:
        return _trtllm_generate(args, runner)
    backend, method, tree, sampling = resolve(args)
    prompts, tok = _prompts(args, backend)
    if method != "vanilla":
        tree = _auto_tree(backend, tree, prompts)
    gen = VanillaGenerator(backend, sampling) if method == "vanilla" else SpeculativeGenerator(backend, tree, sampling)
    out = open(args.out, "w") if args.out else None
    try:
        for ids in prompts:
            try:
                r = gen.generate(ids, args.max_new_tokens)
            except ValueError as e:
                raise ModelError(str(e)) from None
            if out:
                out.write(json.dumps(r.to_json()) + "\n")
                continue
            print(tok.decode(r.output_ids) if tok is not None else " ".join(map(str, r.output_ids)))
            tps = len(r.output_ids) / r.seconds if r.seconds else 0.0
            print(f"[{method}] {len(r.output_ids)} tokens in {r.seconds:.3f} s ({tps:.1f} tokens/s), "
                  f"tau {r.tau:.2f} over {r.cycles} cycles, stop: {r.stop_reason}", file=sys.stderr)
    finally:
        if out:
            out.close()
    return 0


def _trtllm_generate(args, runner) -> int:
    prompts, tok = _prompts(args, runner)
    results = runner.generate(prompts, args.max_new_tokens, speculative=args.method != "vanilla",
                              temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    with (open(args.out, "w") if args.out else contextlib.nullcontext()) as out:
        for r in results:
            if out:
                out.write(json.dumps(r.to_json()) + "\n")
            else:
                print(tok.decode(r.output_ids) if tok is not None else " ".join(map(str, r.output_ids)))
    return 0


def _trtllm_check(args, runner) -> int:
    if args.temperature > 0:
        raise ModelError("check on a TensorRT-LLM bundle compares greedy decoding only (TensorRT-LLM's EAGLE-3 "
                         "verifies greedily); drop --temperature")
    prompts, _ = _prompts(args, runner)
    rows = runner.check(prompts, args.max_new_tokens)
    for r in rows:
        div = "-" if r["identical"] else f"at {r['divergence']}"
        print(f"{r['index']:>3} {'yes' if r['identical'] else 'NO':>9} {r['new_tokens']:>6}  {div}")
    bad = sum(not r["identical"] for r in rows)
    print(f"{len(rows) - bad}/{len(rows)} identical to vanilla (tensorrt-llm, EAGLE-3)")
    return 1 if bad else 0


def cmd_check(args) -> int:
    from eaglex.runtime.equivalence import check_distribution, check_greedy

    runner = _trtllm_runner(args)
    if runner is not None:
        return _trtllm_check(args, runner)
    backend, method, tree, sampling = resolve(args)
    if method == "vanilla":
        raise ModelError("check compares speculative with vanilla decoding: give a draft head")
    prompts, _ = _prompts(args, backend)
    tree = _auto_tree(backend, tree, prompts)
    if sampling.greedy:
        rows = check_greedy(backend, tree, prompts, args.max_new_tokens)
        print(f"{'#':>3} {'identical':>9} {'tau':>5} {'tokens':>6}  first divergence (logit margin)")
        for r in rows:
            div = "-" if r.identical else f"at {r.divergence} (margin {r.margin:.3g})"
            print(f"{r.index:>3} {'yes' if r.identical else 'NO':>9} {r.tau:>5.2f} {r.new_tokens:>6}  {div}")
        bad = sum(not r.identical for r in rows)
        taus = [r.tau for r in rows if r.speculative.cycles]
        print(f"{len(rows) - bad}/{len(rows)} identical to vanilla ({method}, {tree.kind} tree, {backend.dtype}); "
              f"mean tau {sum(taus) / max(len(taus), 1):.2f}")
        return 1 if bad else 0
    rows = check_distribution(backend, tree, sampling, prompts, samples=args.samples)
    print(f"{'#':>3} {'samples':>7} {'chi2':>8} {'dof':>4} {'p':>7} {'tau':>5}")
    for r in rows:
        print(f"{r.index:>3} {r.samples:>7} {r.chi2:>8.2f} {r.dof:>4} {r.p_value:>7.4f} {r.tau:>5.2f}")
    # Bonferroni over prompts: a correct sampler fails this with probability < 0.1 %.
    bad = [r for r in rows if r.p_value < 1e-3 / len(rows)]
    print(f"{len(rows) - len(bad)}/{len(rows)} prompts consistent with the target distribution")
    return 1 if bad else 0


def parse_trees(text: str) -> list:
    from eaglex.runtime.types import TreeConfig
    trees = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        kind, _, arg = item.partition(":")
        try:
            if kind == "chain":
                trees.append(TreeConfig("chain", depth=int(arg)))
            elif kind == "static":
                trees.append(TreeConfig("static"))
            elif kind == "dynamic":
                total, depth, top_k = (int(x) for x in arg.split("/"))
                trees.append(TreeConfig("dynamic", total, depth, top_k))
            else:
                raise ValueError(f"unknown tree kind {kind!r}")
        except ValueError as e:
            raise ModelError(f"bad tree {item!r} ({e}); use chain:DEPTH, dynamic:TOTAL/DEPTH/TOPK or static") from None
    return trees


def cmd_bench(args) -> int:
    from eaglex import bench
    from eaglex.runtime.generate import VanillaGenerator
    from eaglex.prompts import load_tokenizer, read_prompts

    load_start = [round(x, 2) for x in os.getloadavg()]
    items = [t.strip() for t in args.trees.split(",")]
    auto = "auto" in items
    trees = parse_trees(",".join(t for t in items if t != "auto"))
    backends = []
    if args.target is not None and not args.no_torch:
        from eaglex.runtime.torch_backend import TorchBackend
        backends.append(("torch", TorchBackend(args.target, args.draft)))
    for e in args.engine:
        from eaglex.runtime.ort_backend import OrtBackend
        backends.append((f"ort:{e.name}", OrtBackend(e)))
    if not backends:
        raise ModelError("give --target (torch rows) and/or --engine DIR")
    tok_dir = args.target or getattr(backends[0][1], "tokenizer_dir", None)
    prompts = read_prompts(args.prompts, load_tokenizer(tok_dir))
    if args.num_prompts:
        prompts = prompts[: args.num_prompts]
    rows, cost_models, reference = [], {}, None
    for name, backend in backends:
        method = backend.draft_kind or "vanilla"
        own = list(trees) if backend.draft_kind else []
        labels = [bench.tree_label(t) for t in own]
        if auto and backend.draft_kind:
            tuned = _tune_engine(backend, getattr(backend, "engine_dir", None), prompts)
            if tuned not in own:
                own.append(tuned)
                labels.append(bench.tree_label(tuned))
            labels[own.index(tuned)] += " (auto)"
        sizes, draft_sizes = bench.sizes_for(own)
        sampler = bench.CostSampler(backend, sizes=sizes, draft_sizes=draft_sizes)
        for i in range(3):                                   # a warm-up round, then two before the runs
            sampler.round(record=i > 0)
        got = bench.run_backend(name, backend, own, prompts, args.max_new_tokens, method, sampler)
        cm = cost_models[name] = sampler.summary()
        for row, tree, label in zip(got[1:], own, labels):
            row.tree = label
            tau = sum(row.accept_lengths) / max(len(row.accept_lengths), 1)
            row.predicted_speedup = bench.predicted_speedup(cm, tree, tau)
        rows += [r.as_dict() for r in got]
        if reference is None and args.target is not None and not args.no_peers:
            reference = [VanillaGenerator(backend).generate(p, args.max_new_tokens).output_ids for p in prompts]
    if args.target is not None and not args.no_peers:
        rows += [r.as_dict() for r in bench.run_hf_peers(args.target, prompts, args.max_new_tokens, args.draft_lm,
                                                          reference)]
    hf = next((r for r in rows if r["method"] == "hf greedy"), None)
    for r in rows:
        r["vs_hf_greedy"] = round(r["tokens_per_s"] / hf["tokens_per_s"], 3) if hf and r["tokens_per_s"] else None
    bench.print_table(rows)
    payload = {"machine": {**bench.machine(), "load_average_at_start": load_start}, "prompts": len(prompts),
               "max_new_tokens": args.max_new_tokens, "cost_model": cost_models, "rows": rows}
    bench.write_json(args.out, payload)
    print(f"wrote {args.out}")
    return 0 if all(r["identical_to_vanilla"] for r in rows) else 1


def _tune_engine(backend, engine_dir, prompts):
    """The engine's tuned tree: measured once (a ladder of chains and trees, see runtime/autotune.py) and kept in
    the manifest so that `--tree auto` and deployments reuse it."""
    import dataclasses

    from eaglex.bench import machine, tree_label
    from eaglex.engines.manifest import read_manifest, write_manifest
    from eaglex.runtime.autotune import autotune
    from eaglex.runtime.types import TreeConfig

    manifest = read_manifest(engine_dir) if engine_dir else {}
    if manifest.get("tuned_tree"):
        return TreeConfig(**manifest["tuned_tree"]["tree"])
    print("tuning the tree on this machine (vanilla vs chains and trees, interleaved) ...")
    best, rows = autotune(backend, prompts[:4], max_new_tokens=32)
    for r in rows:
        label = "vanilla" if r is rows[0] else tree_label(r.tree)
        print(f"  {label:<22} {r.tokens_per_s:8.1f} tokens/s  tau {r.tau:.2f}")
    best_row = next(r for r in rows[1:] if r.tree == best)
    note = "" if best_row.tokens_per_s > rows[0].tokens_per_s else \
        " (vanilla is faster here: this model is too small for drafting to pay off on this machine)"
    print(f"  -> {tree_label(best)}{note}")
    if engine_dir:
        manifest["tuned_tree"] = {"tree": dataclasses.asdict(best), "label": tree_label(best), "machine": machine(),
                                  "tokens_per_s": {("vanilla" if r is rows[0] else tree_label(r.tree)):
                                                   round(r.tokens_per_s, 2) for r in rows}}
        write_manifest(engine_dir, manifest)
    return best


def _engine_trtllm(preset, target_dir, draft_dir, out, force) -> int:
    """TensorRT-LLM presets: write the bundle (FP8 + tensor parallel over the visible GPUs); on a machine with
    TensorRT-LLM also check EAGLE against vanilla there, elsewhere say where it runs."""
    from eaglex.engines import trtllm

    gpus = 0
    try:
        import torch
        gpus = torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no CUDA build: count as none
        pass
    tp = max(gpus, 1)
    cfg = trtllm.TrtllmConfig(quant=preset.quant, tp=tp)
    if (out / "manifest.json").is_file() and not force:
        print(f"reusing {out} (pass FORCE=1 to rebuild)")
    else:
        print(trtllm.summary(trtllm.build_trtllm_bundle(target_dir, draft_dir, out, cfg, None, True), out))
    try:
        import tensorrt_llm  # noqa: F401 - only whether it is installed
    except ImportError:
        print(f"TensorRT-LLM is not installed here: run `eaglex check --engine {out} --prompts FILE` on a machine "
              f"with it ({preset.hardware}); the bundle is ready to copy there")
        return 0
    from eaglex.prompts import BUILTIN_PROMPTS
    import tempfile
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        f.write("".join(json.dumps({"prompt": t}) + "\n" for t in BUILTIN_PROMPTS))
    return main(["check", "--engine", str(out), "--prompts", f.name, "--max-new-tokens", "64"])


def cmd_engine(args) -> int:
    """Build (or reuse) the preset's engine, run the equivalence check, then a side-by-side demo."""
    from eaglex.engines.manifest import read_manifest
    from eaglex.prompts import BUILTIN_PROMPTS, encode, load_tokenizer, read_prompts
    from eaglex.presets import REPO_ROOT, get_preset, preset_folders
    from eaglex.runtime.equivalence import check_greedy
    from eaglex.runtime.generate import SpeculativeGenerator, VanillaGenerator

    preset = get_preset(args.model)
    backend_name = args.backend or preset.backend
    target_dir, draft_dir = preset_folders(preset, args.model_dir, args.draft_dir)
    out = args.out or Path("engines") / preset.name
    if backend_name == "tensorrt-llm":
        return _engine_trtllm(preset, target_dir, draft_dir, out, args.force)
    if backend_name == "onnxruntime":
        from eaglex.engines.build import build_engine, summary
        from eaglex.runtime.ort_backend import OrtBackend
        fresh = args.force or not (out / "manifest.json").is_file()
        if not fresh:
            try:
                read_manifest(out)
            except ModelError:
                fresh = True
        if fresh:
            print(summary(build_engine(target_dir, draft_dir, out, "onnxruntime", "float32", True), out))
        else:
            print(f"reusing {out} (pass --force or `make engine FORCE=1` to rebuild)")
        backend = OrtBackend(out)
    else:
        from eaglex.runtime.torch_backend import TorchBackend
        backend = TorchBackend(target_dir, draft_dir)
    tok = load_tokenizer(target_dir)
    prompt_file = REPO_ROOT / preset.prompts if preset.prompts else None
    if prompt_file is not None and prompt_file.is_file():   # the preset's own held-out prompts (never trained on)
        prompts = read_prompts(prompt_file, tok)
    elif tok:
        prompts = [encode({"prompt": t}, tok, False, "builtin prompt") for t in BUILTIN_PROMPTS]
    else:
        prompts = [[(7 * i + j) % backend.spec.vocab_size for j in range(1, 9)] for i in range(len(BUILTIN_PROMPTS))]
    tree = _tune_engine(backend, out if backend_name == "onnxruntime" else None, prompts)
    rows = check_greedy(backend, tree, prompts, args.max_new_tokens)
    bad = [r.index for r in rows if not r.identical]
    taus = [r.tau for r in rows if r.speculative.cycles]
    from eaglex.bench import tree_label
    print(f"check: {len(rows) - len(bad)}/{len(rows)} prompts identical to vanilla on {backend_name} "
          f"(tree {tree_label(tree)}), mean tau {sum(taus) / len(taus):.2f}")
    if bad:
        print(f"eaglex: error: speculative output differs from vanilla on prompts {bad}", file=sys.stderr)
        return 1
    demo = prompts[0]
    v = VanillaGenerator(backend).generate(demo, args.max_new_tokens)
    s = SpeculativeGenerator(backend, tree).generate(demo, args.max_new_tokens)
    text = tok.decode(demo + s.output_ids) if tok else " ".join(map(str, demo + s.output_ids))
    print("demo " + "-" * 60 + "\n" + text + "\n" + "-" * 65)
    print(f"vanilla {len(v.output_ids) / v.seconds:.1f} tokens/s | eaglex {len(s.output_ids) / s.seconds:.1f} "
          f"tokens/s, tau {s.tau:.2f} | speedup {v.seconds / s.seconds:.2f}x | identical: "
          f"{'yes' if s.output_ids == v.output_ids else 'NO'}")
    return 0


def cmd_build(args) -> int:
    from eaglex.engines.build import build_engine, summary

    if args.backend == "tensorrt-llm":
        from eaglex.engines import trtllm
        if args.quant not in (None, "fp8") or args.quant_draft:
            raise ModelError("TensorRT-LLM bundles take --quant fp8 (target only); int8 and --quant-draft are "
                             "for onnxruntime engines")
        cfg = trtllm.TrtllmConfig(quant=args.quant, tp=args.tp, pp=args.pp, max_draft_len=args.max_draft_len,
                                  dynamic_tree_top_k=args.dynamic_tree_top_k,
                                  max_total_draft_tokens=args.max_total_draft_tokens)
        manifest = trtllm.build_trtllm_bundle(args.target, args.draft, args.out, cfg, args.calibrated, args.force)
        print(trtllm.summary(manifest, args.out))
        return 0
    if args.quant is None and (args.calibrated or args.quant_draft or args.calibrated_draft):
        raise ModelError("--calibrated/--quant-draft need --quant fp8|int8")
    if args.quant == "fp8" and args.calibrated is None:   # fail before the (long) float build
        raise ModelError("--quant fp8 needs calibrated scales: run `eaglex calibrate --target DIR --out CAL` and "
                         "pass --calibrated CAL")
    manifest = build_engine(args.target, args.draft, args.out, args.backend, args.dtype, args.force)
    if args.quant is not None:
        from eaglex.engines.quantize import quantize_engine
        manifest = quantize_engine(args.out, args.quant, args.calibrated, draft=args.quant_draft,
                                   calibrated_draft_dir=args.calibrated_draft)
    print(summary(manifest, args.out))
    if args.quant is not None:
        q = manifest["quant"]
        print(f"  quantized {args.quant}: {q['bytes_before'] / 1024 ** 2:.1f} -> {q['bytes_after'] / 1024 ** 2:.1f} MB;"
              f" target logits vs float: rel. error {q['parity']['logits_rel_error']:.2e}, "
              f"top-1 agreement {q['parity']['top1_agreement']:.2%}")
    if args.quant == "fp8":   # measured on models/tiny: 42/48 prompts identical at 256 new tokens (README)
        print("  note: on ONNX Runtime CPU, FP8 activation rounding can turn last-bit differences between a tree "
              "verification and a one-token step into a flipped near-tie, so speculative output can differ from "
              "this engine's vanilla output on long generations; run `eaglex check` on your prompts",
              file=sys.stderr)
    return 0


def cmd_calibrate(args) -> int:
    from eaglex.calibration.fp8 import CalibrateConfig, calibrate, format_report

    cfg = CalibrateConfig(quant=args.quant, kv_cache=args.kv_cache, data=args.data, samples=args.samples,
                          seq_len=args.seq_len, eval_samples=args.eval_samples, batch_size=args.batch_size,
                          dtype=args.dtype, quant_draft=args.quant_draft, device=args.device)
    report = calibrate(args.target, args.out, cfg, args.draft, args.draft_out, args.force)
    print(format_report(report))
    return 0


def cmd_triton(args) -> int:
    from eaglex.engines.triton.repository import write_repository

    model = write_repository(args.engine, args.out, args.name, args.instances, args.max_queue_size, args.threads,
                             "vanilla" if args.vanilla else "default", args.copy, args.force)
    print(f"wrote {model} (engine {args.engine.resolve()}, {args.instances} instance(s)); serve it with\n"
          f"  python -m eaglex.engines.triton.server start --repo {args.out} --pid-file triton.pid")
    return 0


def cmd_train_draft(args) -> int:
    from eaglex.training.train_draft import TrainDraftConfig, train_draft

    report = train_draft(args.target, args.data, args.out, TrainDraftConfig(method=args.method, steps=args.steps))
    best = max(report["tau"], key=lambda r: r["tau"])
    print(f"wrote {args.out} ({args.method}, {args.steps} steps, loss {report['first_loss']:.3f} -> "
          f"{report['final_loss']:.3f}); best tau {best['tau']:.2f} ({best['shape']})")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return {"generate": cmd_generate, "check": cmd_check, "build": cmd_build, "bench": cmd_bench, "engine": cmd_engine,
                "triton": cmd_triton, "train-draft": cmd_train_draft,
                "calibrate": cmd_calibrate}[args.command](args)
    except ModelError as e:
        print(f"eaglex: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
