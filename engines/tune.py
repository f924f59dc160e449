"""Tuning an engine's tree: measure vanilla and a ladder of chains and trees on this machine (runtime/autotune.py),
keep the fastest shape whose output matched vanilla, and store it as the manifest's `tree` (`eaglex tune`,
`eaglex engine`), so that every entry point (generate, check, bench, Triton) runs it from then on. The reading
commands never store: `--tree auto` on an engine never tuned measures for that run only. When vanilla measured
faster than that tree, the engine runs vanilla by default (`tuning.method` "vanilla") and the tree stays stored for an
explicit method (--method eagle3). `tuning` in the manifest records what was measured, with the cost curve cost trees
size their verifications by (runtime/cost.py: tuning.verify_ms, tuning.draft_ms)."""
from __future__ import annotations

import os
import platform
import sys

from eaglex.runtime.autotune import BATCH_SIZES, BATCH_TOKENS, BATCH_TREES, autotune, tune_schedule
from eaglex.runtime.cost import cost_curve, measure_curve
from eaglex.runtime.manifest import read_manifest, write_manifest
from eaglex.runtime.types import TreeConfig

# Tokens per tuning prompt: a chat answer's length, not just its opening. An answer's opening is drafted worse than
# its body, so short runs undervalue trees against chains and weigh the prefill more: on SmolLM2 (2 cores) tuning at
# 64 tokens picked chain:2, which runs 128-token answers at 1.52x vanilla, where dynamic:10/6/3 runs them at 1.65x.
TUNE_TOKENS = 128
# Prompts tuning measures on: the whole ladder on the first 4, its 3 fastest shapes again on the next 4 (autotune's
# runoff). On SmolLM2's hand-written prompts 4 prompts picked chain:1 for the w8a8 engine, where chain:2 ran 24 of them
# 7 % faster.
TUNE_PROMPTS = 8


def tune_engine(engine, prompts: list[list[int]], force: bool = False, log=print, store: bool = True) -> None:
    """Make `engine` run the measured fastest: its best tree, or vanilla (method "vanilla", the best tree kept as
    `engine.kept_tree`) when vanilla measured faster than every tree; for an engine folder and `store`, also write it
    to the manifest (without `store`, the reading commands' case, the folder is left as it was). An engine tuned
    before is left as it is unless `force`. Engines that cannot draft (no head, or vanilla asked for explicitly) and
    TensorRT-LLM bundles are left alone."""
    if engine.layout == "bundle" or engine.draft_kind is None or (engine.method == "vanilla"
                                                                   and engine.kept_tree is None):
        return
    manifest = read_manifest(engine.path) if engine.layout == "engine" else {}
    head = engine.method if engine.method != "vanilla" else engine.head_method
    if manifest.get("tuning") and not force:
        where = manifest["tuning"].get("cpu", "this machine")
        log(f"vanilla (tuned on {where}: {_kept(engine.kept_tree, head)})" if engine.method == "vanilla" else
            f"tree {engine.tree} (tuned on {where})")
        return
    log("tuning the tree on this machine (vanilla vs chains and trees, interleaved) ...")
    if engine.manifest is not None:     # the open engine's cost trees size by it from now on, the tuned ones first
        curve = measure_curve(engine.backend)
        engine.manifest["tuning"] = {**(engine.manifest.get("tuning") or {}), **curve.to_tuning()}
    else:                               # model folders: measured once per process, the same curve the trees use
        curve = cost_curve(engine.backend)
    log(f"  cost curve: target {_ms(curve.verify_ms)}; draft {_ms(curve.draft_ms)} (rows: ms)")
    best, rows = autotune(engine.backend, prompts[:TUNE_PROMPTS], max_new_tokens=TUNE_TOKENS)
    for r in rows:
        log(f"  {r.tree or 'vanilla'!s:<18} {r.tokens_per_s:8.1f} tokens/s  tau {r.tau:.2f}")
    best_row = next(r for r in rows[1:] if r.tree == best)
    if rows[0].tokens_per_s > best_row.tokens_per_s:
        # the default must be the fastest measured setting; the head's best tree stays for an explicit method
        log(f"  -> vanilla (fastest here; {_kept(best, head)})")
        engine.method, engine.tree, engine.kept_tree = "vanilla", None, best
    else:
        log(f"  -> {best}")
        engine.method, engine.tree, engine.kept_tree = head, best, None
    if engine.layout == "engine":
        manifest["tree"] = str(best)
        manifest["tuning"] = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                              "method": engine.method,
                              "tokens_per_s": {str(r.tree or "vanilla"): round(r.tokens_per_s, 2) for r in rows},
                              **curve.to_tuning()}
        tune_batching(engine, prompts, manifest, log, write=False)
        if store:
            _write(engine, manifest, "tuned tree")
        else:
            log(f"measured for this run only: `eaglex tune --engine {engine.path} --prompts FILE` stores it")


def tune_batching(engine, prompts: list[list[int]], manifest: dict, log=print, write: bool = True) -> None:
    """Measure the batch schedule (runtime/autotune.tune_schedule: vanilla batching vs chains and the trees of
    batch_trees at 1..16 requests in flight) and store it as the manifest's `batch_schedule`, with the measured
    table under tuning.batch."""
    if not getattr(engine.backend, "batch_exact", True):
        log("in-flight batching: off for this engine (its exactness rules keep requests apart)")
        return
    trees = batch_trees(engine.tree or engine.kept_tree)
    log(f"tuning in-flight batching (vanilla vs chains{''.join(f', {t}' for t in trees)} at "
        f"{', '.join(map(str, BATCH_SIZES))} requests, until vanilla wins) ...")
    # The rounds decode through Engine.batcher, as `generate --batch` and the server do, with slots as long as the
    # tuning requests need (the model's whole context in every slot could exceed the memory).
    context = min(max(len(p) for p in prompts) + BATCH_TOKENS, engine.spec.max_context)
    schedule, table = tune_schedule(lambda size, s: engine.batcher(size, s, context=context), prompts, trees=trees,
                                    chain_only=getattr(engine.backend, "exact_trees", None) == "chain")
    for size, row in table.items():
        log(f"  {size:>2} requests: " + "  ".join(f"{k} {v:.0f}" for k, v in row.items()) + " tokens/s")
    log(f"  -> {schedule}")
    manifest["batch_schedule"] = str(schedule)
    if engine.manifest is not None:      # the open engine runs it from now on, as the folder does once written
        engine.manifest["batch_schedule"] = str(schedule)
    manifest.setdefault("tuning", {})["batch"] = {str(k): v for k, v in table.items()}
    if write:
        _write(engine, manifest, "batch schedule")


def batch_trees(own: TreeConfig | None) -> tuple[TreeConfig, ...]:
    """The trees batch tuning tries beside the chains: the engine's own single-request tree, and the trees of
    BATCH_TREES smaller than it. When the single-request tuning picked a chain, the dynamic trees of its ladder
    (BATCH_TREES among them) lost to that chain with one request in flight, and a tree that loses to a chain does
    not win with more (tune_schedule): the chain alone is tried then."""
    if own is None:
        return BATCH_TREES
    if own.kind == "chain":
        return (own,)
    return (own,) + tuple(t for t in BATCH_TREES if t.max_nodes < own.max_nodes)


def _ms(points) -> str:
    return " ".join(f"{n}:{ms:.1f}" for n, ms in points)


def _kept(tree, head: str) -> str:
    return f"the best tree, {tree}, is kept for --method {head}"


def _write(engine, manifest: dict, what: str) -> None:
    try:
        write_manifest(engine.path, manifest)
    except OSError as e:                 # a read-only deployment: the shape still applies to this process
        print(f"eaglex: could not store the {what} in {engine.path} ({e})", file=sys.stderr)
