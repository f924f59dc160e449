"""Time of one target forward by the rows it verifies: eaglex engines side by side, beside the read floor of each
engine's target weights and llama.cpp's one-token decode step, interleaved.

For each engine and N in `--rows`: a prompt of `--context` token ids is prefilled once, then a forward of N new
rows over it is timed `--reps` times (the rows are dropped after each, so every call sees the same context) and
the median taken; a speculative step verifies its tree in one such forward. The read floor is the time to read the
engine's target weight files once from memory (the kernel library's plain load loop, on as many threads as the
engines run), what a forward that streams every weight once cannot beat. llama.cpp (`--gguf`): the server's own
predicted_ms per token of a `--tokens`-token greedy decode after the same prompt (tools/step_time.py's server).
Every (system, N) pair runs once per round in a seeded shuffled order, `--rounds` rounds, medians reported.

    python tools/step_rows.py --engine engines/smollm2-135m --engine engines/smollm2-135m-int8 \
        [--gguf Q8_0.gguf ...] [--rows 1,2,4,8,16] [--context 64] [--rounds 5] [--threads 2] [--json out.jsonl]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import random
import statistics
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import torch
from step_time import LlamaServer, prompt


class Engine:
    def __init__(self, path: str, context: int, max_rows: int):
        from eaglex.runtime.backend import ONE
        from eaglex.runtime.ort_backend import OrtBackend

        self.path = Path(path)
        self.name = f"eaglex {self.path.parent.name}/{self.path.name}"
        self.backend, self.one, self.P = OrtBackend(path), ONE, context
        self.backend.reset(context + max_rows)
        ids = torch.tensor([prompt(context)])
        self.backend.target_forward(ONE, ids, torch.arange(context)[None], last_only=True)
        self.backend.target_commit(0, torch.arange(context))

    def forward(self, n: int, reps: int) -> float:
        ids = torch.tensor([prompt(n, seed=1)])
        pos = torch.arange(self.P, self.P + n)[None]
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            self.backend.target_forward(self.one, ids, pos)
            times.append(time.perf_counter() - t)
            self.backend.tcache.rollback(self.one)
        return statistics.median(times)

    def weight_bytes(self) -> int:
        """Bytes of the target's weights a forward streams: every initializer but the embedding table (a Gather
        reads one row of it per token)."""
        import onnx
        from onnx import helper

        graph = onnx.load(str(self.path / self.backend.manifest["graphs"]["target"]["file"]),
                          load_external_data=False).graph
        gathered = {n.input[0] for n in graph.node if n.op_type == "Gather"}
        size = {t.name: int(np.prod(t.dims)) * helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
                for t in graph.initializer}
        return sum(b for name, b in size.items() if name not in gathered)


def read_floor(nbytes: int, threads: int, reps: int = 7) -> float:
    """Seconds to read `nbytes` of memory once, split over `threads` threads (the library's load loop)."""
    from eaglex.runtime import kernels

    lib = ctypes.CDLL(str(kernels.library_path()))
    lib.eaglex_read_bytes.restype = ctypes.c_uint64
    lib.eaglex_read_bytes.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    data = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    parts = np.array_split(data, threads)
    best = float("inf")
    for _ in range(reps):
        ts = [threading.Thread(target=lib.eaglex_read_bytes, args=(p.ctypes.data, p.nbytes)) for p in parts]
        t = time.perf_counter()
        for x in ts:
            x.start()
        for x in ts:
            x.join()
        best = min(best, time.perf_counter() - t)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", action="append", default=[], help="eaglex engine folder (repeatable)")
    ap.add_argument("--gguf", action="append", default=[], help="llama.cpp model file (repeatable)")
    ap.add_argument("--llama-bin", default="build/llama.cpp/bin", help="folder holding llama-server")
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--reps", type=int, default=9, help="timed forwards per (engine, rows) and round")
    ap.add_argument("--tokens", type=int, default=32, help="llama.cpp: decode steps per generation")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="cores for all (0: the physical cores)")
    ap.add_argument("--json", help="append one JSON line per measurement to this file")
    args = ap.parse_args(argv)
    from eaglex.runtime.threads import set_threads

    threads = set_threads(args.threads or None, onnxruntime=True)["onnxruntime"]
    rows = [int(n) for n in args.rows.split(",")]
    with ExitStack() as stack:
        engines = [Engine(e, args.context, max(rows)) for e in args.engine]
        servers = [LlamaServer(g, threads, args.context + args.tokens + 16, stack, Path(args.llama_bin),
                               Path("build/step_time_logs")) for g in args.gguf]
        if not engines and not servers:
            ap.error("give at least one --engine or --gguf")
        for e in engines:
            e.forward(max(rows), 2)                  # warm-up: page the weights in
        for s in servers:
            s.step(prompt(args.context), 4)
        results: dict[tuple[str, int], list[float]] = {}
        out = open(args.json, "a") if args.json else None
        for r in range(args.rounds):
            order = [(e, n) for e in engines for n in rows] + [(s, 1) for s in servers] + [("floor", 0)]
            random.Random(r).shuffle(order)
            for s, n in order:
                if s == "floor":
                    for e in engines:
                        results.setdefault((f"read floor {e.name}", 0), []).append(read_floor(e.weight_bytes(),
                                                                                               threads))
                    continue
                t = s.forward(n, args.reps) if isinstance(s, Engine) else s.step(prompt(args.context), args.tokens)[
                    "step"]
                results.setdefault((s.name, n), []).append(t)
                if out:
                    out.write(json.dumps({"system": s.name, "rows": n, "context": args.context, "round": r,
                                          "threads": threads, "seconds": round(t, 7)}) + "\n")
                    out.flush()
        print(f"context {args.context}, {threads} threads, medians of {args.rounds} rounds (ms)")
        for e in engines:
            floor = statistics.median(results[(f"read floor {e.name}", 0)])
            one = statistics.median(results[(e.name, 1)])
            cells = "  ".join(f"{n}: {statistics.median(results[(e.name, n)]) * 1e3:6.2f}" for n in rows)
            print(f"{e.name:36s} {cells}   read floor {floor * 1e3:.2f} ({e.weight_bytes() / 1e6:.0f} MB)  "
                  f"1 row / floor {one / floor:.2f}  {max(rows)} rows / 1 row "
                  f"{statistics.median(results[(e.name, max(rows))]) / one:.2f}")
        for s in servers:
            print(f"{s.name:36s} 1: {statistics.median(results[(s.name, 1)]) * 1e3:6.2f} (decode step)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
