"""Quality of quantized engines against their float engine on held-out chat prompts.

For each prompt, the float engine's greedy continuation (vanilla decoding) is the reference text. Every engine then
reads prompt + continuation in one forward, and the table gives, over the continuation's tokens: top-1 agreement
with the float engine's argmax, and perplexity of the reference text (the float engine's own perplexity is the
floor, its greedy text being what it predicts).

    python tools/quant_quality.py --float engines/smollm2-135m --engine engines/smollm2-135m-int8 \\
        --engine engines/smollm2-135m-int4 [--gguf model.Q8_0.gguf] --prompts models/smollm2-135m/prompts.jsonl
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from eaglex.runtime.engine import open_engine
from eaglex.runtime.manifest import read_manifest
from eaglex.runtime.ort_backend import OrtBackend
from eaglex.runtime.ort_session import physical_cores


def read_prompts(path: Path, n: int) -> list[list[int]]:
    with open(path) as f:
        return [json.loads(line)["input_ids"] for line in f if line.strip()][:n]


_backends: dict[Path, object] = {}                     # engine folder -> its backend


def forward_logits(engine: Path, ids: list[int]) -> np.ndarray:
    """[len(ids), V] logits of one causal forward over `ids` from an empty cache."""
    b = _backends.get(engine) or _backends.setdefault(engine, OrtBackend(engine))
    n = len(ids)
    b.reset(n)
    logits, _ = b.target_forward(slice(0, 1), torch.tensor([ids]), torch.arange(n)[None], None)
    return logits[0].numpy().copy()


_llamas: dict[Path, object] = {}                       # GGUF file -> its llama.cpp model


def gguf_logits(path: Path, ids: list[int]) -> np.ndarray:
    """[len(ids), V] logits of llama.cpp (llama-cpp-python) over `ids` from an empty context."""
    from llama_cpp import Llama
    llm = _llamas.get(path) or _llamas.setdefault(path, Llama(str(path), n_ctx=2048, logits_all=True,
                                                                n_threads=physical_cores(), verbose=False))
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)], dtype=np.float32)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--float", type=Path, required=True, dest="float_engine", help="the float engine folder")
    ap.add_argument("--engine", type=Path, action="append", required=True, help="a quantized engine (repeatable)")
    ap.add_argument("--gguf", type=Path, action="append", default=[],
                    help="a llama.cpp model file of the same model, scored the same way (repeatable; needs "
                         "llama-cpp-python)")
    ap.add_argument("--prompts", type=Path, required=True, help="JSONL with input_ids per line")
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    prompts = read_prompts(args.prompts, args.num_prompts)
    ref = open_engine(args.float_engine, method="vanilla")
    engines = [args.float_engine] + args.engine + args.gguf
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
            lp = log_softmax((gguf_logits if e in args.gguf else forward_logits)(e, ids)[rows])
            nll[e] -= lp[np.arange(len(rows)), target].sum()
            agree[e] += int((lp.argmax(-1) == base).sum())
        count += len(rows)
    print(f"{len(prompts)} prompts, {count} continuation tokens (the float engine's greedy text)")
    print("| engine | quant | top-1 agreement with float | perplexity |")
    print("|---|---|---|---|")
    for e in engines:
        q = "llama.cpp" if e in args.gguf else (read_manifest(e).get("quant") or {}).get("format", "float32")
        print(f"| {e} | {q} | {agree[e] / count:.2%} | {np.exp(nll[e] / count):.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
