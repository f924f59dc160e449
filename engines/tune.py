"""Tuning an engine's tree: measure vanilla and a ladder of chains and trees on this machine (runtime/autotune.py),
keep the fastest shape whose output matched vanilla, and store it as the manifest's `tree`, so that every entry
point (generate, check, bench, Triton) runs it from then on. `tuning` in the manifest records what was measured."""
from __future__ import annotations

import os
import platform
import sys

from eaglex.runtime.autotune import autotune
from eaglex.runtime.manifest import read_manifest, write_manifest


def tune_engine(engine, prompts: list[list[int]], force: bool = False, log=print) -> None:
    """Set `engine.tree` to the measured fastest shape; for an engine folder, also write it to the manifest.
    An engine tuned before is left as it is unless `force`."""
    if engine.method == "vanilla" or engine.layout == "bundle":
        return
    manifest = read_manifest(engine.path) if engine.layout == "engine" else {}
    if manifest.get("tuning") and not force:
        log(f"tree {engine.tree} (tuned on {manifest['tuning'].get('cpu', 'this machine')})")
        return
    log("tuning the tree on this machine (vanilla vs chains and trees, interleaved) ...")
    best, rows = autotune(engine.backend, prompts[:4], max_new_tokens=32)
    for r in rows:
        log(f"  {str(r.tree or 'vanilla'):<18} {r.tokens_per_s:8.1f} tokens/s  tau {r.tau:.2f}")
    best_row = next(r for r in rows[1:] if r.tree == best)
    note = "" if best_row.tokens_per_s > rows[0].tokens_per_s else \
        " (vanilla is faster here: this model is too small for drafting to pay off on this machine)"
    log(f"  -> {best}{note}")
    engine.tree = best
    if engine.layout == "engine":
        manifest["tree"] = str(best)
        manifest["tuning"] = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                              "tokens_per_s": {str(r.tree or "vanilla"): round(r.tokens_per_s, 2) for r in rows}}
        try:
            write_manifest(engine.path, manifest)
        except OSError as e:                 # a read-only deployment: the shape still applies to this process
            print(f"eaglex: could not store the tuned tree in {engine.path} ({e})", file=sys.stderr)
