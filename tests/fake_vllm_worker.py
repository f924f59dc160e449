"""A stand-in for eaglex/vllm_worker.py that speaks its protocol without vLLM, for tests/test_vllm_peer.py.

Greedy "decoding" is a fixed function of the prompt; the seconds it reports make K=2 the fastest EAGLE-3 setting.
FAKE_VLLM_FAIL=start: it dies before its ready line, as a vLLM that cannot start does. FAKE_VLLM_DIFFER=K: the
EAGLE-3 worker with that K changes one token of every prompt that starts with 5. FAKE_VLLM_ENV=FILE: it writes its
environment and command line there.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

COST = {0: 0.010, 1: 0.009, 2: 0.005, 3: 0.007, 4: 0.008}     # seconds per token; 0: vanilla


def answer(ids: list[int], n: int, eos: set[int], k: int) -> list[int]:
    out = []
    for j in range(n):
        t = 2 if ids[0] == 7 and j == 3 else (sum(ids) + j) % 40 + 3     # prompts starting with 7 end at EOS 2
        if k and str(k) == os.environ.get("FAKE_VLLM_DIFFER") and ids[0] == 5 and j == 1:
            t += 1
        out.append(t)
        if t in eos:
            break
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--head")
    p.add_argument("--k", type=int, default=0)
    p.add_argument("--eos", default="")
    p.add_argument("--max-model-len", type=int, default=0)
    p.add_argument("--enforce-eager", action="store_true")
    args = p.parse_args()
    if os.environ.get("FAKE_VLLM_ENV"):
        with open(os.environ["FAKE_VLLM_ENV"], "a") as f:
            f.write(json.dumps({"argv": sys.argv[1:], "env": dict(os.environ)}) + "\n")
    print("INFO a log line on stderr", file=sys.stderr)
    if os.environ.get("FAKE_VLLM_FAIL") == "start":
        print("RuntimeError: Engine core initialization failed", file=sys.stderr)
        print(json.dumps({"error": "RuntimeError: Engine core initialization failed"}), flush=True)
        return 1
    k = args.k if args.head else 0
    eos = {int(t) for t in args.eos.split(",") if t}
    print(json.dumps({"ready": True, "vllm": "0.32.0-fake", "torch": "2.13.0+cpu", "method": "eagle3" if k else
                      "vanilla", "k": k}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        ids = answer(req["ids"], req["max_new_tokens"], eos, k)
        reply = {"ids": ids, "seconds": COST[k] * max(len(ids), 1)}
        if k:
            reply["drafts"], reply["accepted"] = len(ids), len(ids) // 2      # τ = 1.5
        print(json.dumps(reply), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
