"""Time of a one-token vanilla decoding step by context length: eaglex engines against llama.cpp, interleaved.

For each context P and each system, one greedy generation of `--tokens` new tokens after a prompt of P token ids
(seeded random ids, the same for every system), timed per decode step:
- an eaglex engine (VanillaGenerator over OrtBackend): `step` is the generator's wall time per token after the
  prefill, `forward` the time inside the backend's target_forward, `session` the time inside ONNX Runtime's
  run_with_iobinding; step - forward is the generator's Python work per token, forward - session the backend's;
- llama.cpp (`--gguf`, a llama-server per file on loopback, as eaglex's bench runs it): `step` is the server's own
  predicted_ms / predicted_n (decode only, no HTTP).
Every (system, P) pair runs once per round in a seeded shuffled order, `--rounds` rounds; the summary gives medians
per pair and each system's speed relative to the first one (> 1: faster), so background load hits all alike.

Only OrtBackend(engine), VanillaGenerator and the result's timings are used, so an older checkout's interpreter can
run this file on that checkout's engines (`/path/to/old/.venv/bin/python tools/step_time.py ...`): alternate such
runs with this checkout's to compare two versions (docs/step.md).

    python tools/step_time.py --engine engines/smollm2-135m [--engine ...] [--gguf F32.gguf ...]
        [--contexts 64,512,1024] [--tokens 32] [--rounds 5] [--threads 2] [--json out.jsonl]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np

ID_RANGE = (100, 40000)      # ordinary token ids of a 49k vocabulary, clear of the special ones at the bottom


def prompt(P: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed + P).integers(*ID_RANGE, P)]


class Engine:
    def __init__(self, path: str):
        from eaglex.runtime.generate import VanillaGenerator
        from eaglex.runtime.ort_backend import OrtBackend

        self.name = f"eaglex {Path(path).name}"
        self.backend = OrtBackend(path)
        self.generator = VanillaGenerator(self.backend)
        self.calls: list[float] = []
        sess = self.backend.target_sess
        run = sess.run_with_iobinding

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return run(*args, **kwargs)
            finally:
                self.calls.append(time.perf_counter() - t)
        sess.run_with_iobinding = timed          # the instance's own attribute: the backend calls it by name

    def step(self, ids: list[int], tokens: int) -> dict:
        self.calls = []
        r = self.generator.generate(ids, tokens)
        n = len(r.output_ids) - 1                # decode steps: every token after the prefill's first
        if n < 1 or len(self.calls) != n + 1:
            raise RuntimeError(f"{self.name}: {len(r.output_ids)} token(s) in {len(self.calls)} target calls")
        return {"step": r.decode_seconds / n, "forward": (r.target_seconds - r.prefill_target_seconds) / n,
                "session": sum(self.calls[1:]) / n, "tokens": n}


class LlamaServer:
    def __init__(self, gguf: str, threads: int, n_ctx: int, stack: ExitStack, bin_dir: Path, logs: Path):
        from eaglex.llamacpp_server import Server

        self.name = f"llama.cpp {Path(gguf).name}"
        self.server = stack.enter_context(Server(bin_dir, Path(gguf), threads, n_ctx, logs / f"{Path(gguf).stem}.log"))

    def step(self, ids: list[int], tokens: int) -> dict:
        _, _, t = self.server.complete(ids, tokens)
        return {"step": t["predicted_ms"] / 1e3 / t["predicted_n"], "tokens": int(t["predicted_n"])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", action="append", default=[], help="eaglex engine folder (repeatable)")
    ap.add_argument("--gguf", action="append", default=[], help="llama.cpp model file (repeatable)")
    ap.add_argument("--llama-bin", default="build/llama.cpp/bin", help="folder holding llama-server")
    ap.add_argument("--contexts", default="64,512,1024")
    ap.add_argument("--tokens", type=int, default=32, help="decode steps per generation")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="cores for both (0: the physical cores)")
    ap.add_argument("--json", help="append one JSON line per measurement to this file")
    args = ap.parse_args(argv)
    from eaglex.runtime.threads import set_threads

    threads = set_threads(args.threads or None, onnxruntime=True)["onnxruntime"]
    contexts = [int(c) for c in args.contexts.split(",")]
    with ExitStack() as stack:
        systems = [Engine(e) for e in args.engine]
        logs = Path("build/step_time_logs")
        systems += [LlamaServer(g, threads, max(contexts) + args.tokens + 16, stack, Path(args.llama_bin), logs)
                    for g in args.gguf]
        if not systems:
            ap.error("give at least one --engine or --gguf")
        for s in systems:                         # warm-up: page the weights in, allocate
            s.step(prompt(8), 4)
        results: dict[tuple[str, int], list[dict]] = {}
        out = open(args.json, "a") if args.json else None
        for r in range(args.rounds):
            order = [(s, P) for s in systems for P in contexts]
            random.Random(r).shuffle(order)
            for s, P in order:
                m = s.step(prompt(P), args.tokens)
                results.setdefault((s.name, P), []).append(m)
                if out:
                    out.write(json.dumps({"system": s.name, "context": P, "round": r, "threads": threads,
                                          **{k: round(v, 7) if isinstance(v, float) else v for k, v in m.items()}})
                              + "\n")
                    out.flush()
        for P in contexts:
            base = statistics.median(m["step"] for m in results[(systems[0].name, P)])
            for s in systems:
                ms = results[(s.name, P)]
                med = {k: statistics.median(m[k] for m in ms) for k in ms[0] if k != "tokens"}
                parts = "  ".join(f"{k} {v * 1e3:.2f} ms" for k, v in med.items())
                print(f"P={P:5d}  {s.name:48s} {parts}  speed vs {systems[0].name}: {base / med['step']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
