"""Quality of quantized engines against their float engine on held-out chat prompts.

For each prompt, the float engine's greedy continuation (vanilla decoding) is the reference text. Every engine then
reads prompt + continuation in one forward, and the table gives, over the continuation's tokens: top-1 agreement
with the float engine's argmax, and perplexity of the reference text (the float engine's own perplexity is the
floor, its greedy text being what it predicts).

    python tools/quant_quality.py --float engines/smollm2-135m --engine engines/smollm2-135m-int8 \\
        --engine engines/smollm2-135m-int4 --prompts models/smollm2-135m/prompts.jsonl --num-prompts 24
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from tqdm import tqdm

from eaglex.runtime.engine import open_engine
from eaglex.runtime.manifest import read_manifest
from eaglex.runtime.ort_session import open_session


def read_prompts(path: Path, n: int) -> list[list[int]]:
    with open(path) as f:
        return [json.loads(line)["input_ids"] for line in f if line.strip()][:n]


_sessions: dict[Path, object] = {}                     # engine folder -> its target session


def forward_logits(engine: Path, ids: list[int]) -> np.ndarray:
    """[len(ids), V] logits of one causal forward over `ids` from an empty cache."""
    m = read_manifest(engine)
    spec = m["target"]["spec"]
    sess = _sessions.get(engine) or _sessions.setdefault(
        engine, open_session(engine / m["graphs"]["target"]["file"], m["engine_id"], "target"))
    n = len(ids)
    feeds = {"input_ids": np.array([ids], np.int64), "position_ids": np.arange(n)[None],
             "attn_mask": np.tril(np.ones((n, n), bool))[None, None], "logits_rows": np.arange(n)}
    for i in range(spec["num_layers"]):
        for kind in ("key", "value"):
            feeds[f"past_{kind}_{i}"] = np.zeros((1, spec["num_kv_heads"], 0, spec["head_dim"]), np.float32)
    return sess.run(["logits"], feeds)[0][0]


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--float", type=Path, required=True, dest="float_engine", help="the float engine folder")
    ap.add_argument("--engine", type=Path, action="append", required=True, help="a quantized engine (repeatable)")
    ap.add_argument("--prompts", type=Path, required=True, help="JSONL with input_ids per line")
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    prompts = read_prompts(args.prompts, args.num_prompts)
    ref = open_engine(args.float_engine, method="vanilla")
    engines = [args.float_engine] + args.engine
    nll = {e: 0.0 for e in engines}
    agree = {e: 0 for e in engines}
    count = 0
    for p in tqdm(prompts, desc="prompts", unit="prompt"):
        out = ref.generate([p], max_new_tokens=args.max_new_tokens)[0].output_ids
        ids = p + out
        rows = np.arange(len(p) - 1, len(ids) - 1)          # the rows predicting the continuation
        target = np.array(ids[len(p):])
        base = forward_logits(args.float_engine, ids)[rows].argmax(-1)
        for e in engines:
            lp = log_softmax(forward_logits(e, ids)[rows])
            nll[e] -= lp[np.arange(len(rows)), target].sum()
            agree[e] += int((lp.argmax(-1) == base).sum())
        count += len(rows)
    print(f"{len(prompts)} prompts, {count} continuation tokens (the float engine's greedy text)")
    print("| engine | quant | top-1 agreement with float | perplexity |")
    print("|---|---|---|---|")
    for e in engines:
        q = (read_manifest(e).get("quant") or {}).get("format", "float32")
        print(f"| {e} | {q} | {agree[e] / count:.2%} | {np.exp(nll[e] / count):.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
