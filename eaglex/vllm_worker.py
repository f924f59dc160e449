"""One vLLM engine on the CPU answering generation requests over stdin/stdout, for the bench's vLLM rows
(eaglex/vllm_peer.py starts it with the python of vLLM's own venv, `make vllm-venv`).

Run as a script, never imported: it imports only vLLM and the standard library (eaglex is not installed in that venv,
and vLLM needs transformers >= 5.16 where eaglex pins 5.14). The protocol, one JSON object per line:
  started:  {"ready": true, "vllm": VERSION, "torch": VERSION, "method": "vanilla"|"eagle3", "k": K}
            or {"error": "..."} and exit status 1
  request:  {"ids": [token ids], "max_new_tokens": N}
  reply:    {"ids": [generated ids], "seconds": wall seconds of the request, "drafts": D, "accepted": A}
            (drafts / accepted: vLLM's speculative counters over the request; absent for vanilla)
            or {"error": "..."}
End of stdin ends it. Decoding is greedy (temperature 0) from the given ids, never re-tokenized; it stops at one of
the --eos ids (kept, as eaglex keeps it) or after N tokens. vLLM logs to stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="Hugging Face folder of the target (float32)")
    p.add_argument("--head", help="EAGLE-3 head folder: speculative decoding with --k draft tokens")
    p.add_argument("--k", type=int, default=0, help="num_speculative_tokens (with --head)")
    p.add_argument("--eos", default="", help="comma list of EOS token ids that end a request")
    p.add_argument("--max-model-len", type=int, default=0, help="context limit (0: the model's)")
    p.add_argument("--kv-cache-gib", type=float, default=1.0, help="KV cache size in GiB")
    p.add_argument("--enforce-eager", action="store_true", help="no torch.compile (faster start, slower decode)")
    return p.parse_args(argv)


def protocol_out():
    """A private copy of stdout for the protocol; fd 1 then points at stderr, so that whatever vLLM, torch or a C
    library prints cannot end up between two replies."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def send(out, obj: dict) -> None:
    out.write(json.dumps(obj) + "\n")
    out.flush()


def spec_counters(llm) -> tuple[int, int] | None:
    """vLLM's speculative counters so far: (drafts, accepted tokens), or None where it keeps none."""
    got = {}
    for m in llm.get_metrics():
        name = m.name.removesuffix("_total")
        if name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens"):
            got[name] = got.get(name, 0) + int(getattr(m, "value", 0))
    if len(got) < 2:
        return None
    return got["vllm:spec_decode_num_drafts"], got["vllm:spec_decode_num_accepted_tokens"]


def start(args):
    from vllm import LLM
    kw = {}
    if args.head:
        kw["speculative_config"] = {"method": "eagle3", "model": args.head, "num_speculative_tokens": args.k}
    if args.max_model_len:
        kw["max_model_len"] = args.max_model_len
    # One request at a time, as every bench row runs. No prefix caching: the bench repeats prompts (warm-up, the K
    # sweep), and every other row prefills each prompt in full. Stats on: the speculative counters come from them.
    return LLM(model=args.model, dtype="float32", max_num_seqs=1, kv_cache_memory_bytes=int(args.kv_cache_gib * 2**30),
               enable_prefix_caching=False, enforce_eager=args.enforce_eager, disable_log_stats=False, seed=0, **kw)


def serve(llm, args, out) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    eos = [int(t) for t in args.eos.split(",") if t.strip()]
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            ids, n = [int(i) for i in req["ids"]], int(req["max_new_tokens"])
            if n < 1:
                send(out, {"ids": [], "seconds": 0.0})
                continue
            # detokenize off: eaglex's rows return ids too, and text would cost time no other row spends
            params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=False, stop_token_ids=eos,
                                    detokenize=False)
            before = spec_counters(llm) if args.head else None
            t = time.perf_counter()
            got = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
            seconds = time.perf_counter() - t
            reply = {"ids": [int(i) for i in got[0].outputs[0].token_ids], "seconds": seconds}
            after = spec_counters(llm) if before is not None else None
            if after is not None:
                reply["drafts"], reply["accepted"] = after[0] - before[0], after[1] - before[1]
            send(out, reply)
        except Exception as e:       # one bad request is one error line; the engine stays up for the next
            send(out, {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"})


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    out = protocol_out()
    try:
        import torch
        import vllm
        llm = start(args)
    except BaseException as e:      # vLLM raises SystemExit or RuntimeError from its engine process alike
        traceback.print_exc()
        text = str(e).strip().splitlines()
        send(out, {"error": f"{type(e).__name__}: {text[-1] if text else 'vLLM did not start'}"})
        return 1
    send(out, {"ready": True, "vllm": vllm.__version__, "torch": torch.__version__,
               "method": "eagle3" if args.head else "vanilla", "k": args.k if args.head else 0})
    serve(llm, args, out)
    return 0


if __name__ == "__main__":        # vLLM starts its engine in child processes that import this file again
    sys.exit(main(sys.argv[1:]))
