"""One row of `eaglex bench`'s table: what one engine, method and tree measured over the prompts, and its JSON form.
The peers (eaglex/llamacpp_peer.py, eaglex/llamacpp_server.py) report in the same rows."""
from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field


@dataclass
class Row:
    engine: str
    method: str
    tree: str
    tokens: int = 0
    seconds: float = 0.0
    baseline_seconds: float = 0.0
    identical: bool = True
    accept_lengths: list[int] = field(default_factory=list)
    cycles: int = 0
    nodes: int = 0               # tree nodes verified over the cycles (root included)
    target_seconds: float = 0.0
    draft_seconds: float = 0.0
    predicted_speedup: float | None = None
    # the decode phase (after the prefill; eaglex rows only): what the cost model predicts
    decode_seconds: float = 0.0
    baseline_decode_seconds: float = 0.0
    decode_target_seconds: float = 0.0
    decode_draft_seconds: float = 0.0
    requests: int = 0
    threads: str = ""
    device: str = ""
    enforced: bool = True        # False: a mismatch with vanilla is reported, not a failure (see the docstring)
    note: str = ""
    tau: float | None = None     # a peer's own count of tokens per target forward (llama-server's timings)
    alongside: dict[str, float] = field(default_factory=dict)   # a peer row: eaglex vanillas' tokens/s beside it
    build: str = ""              # a peer row: how the peer was built (llama.cpp: the CPU features it compiled in)

    def add(self, r, baseline) -> None:
        """Accumulate one eaglex GenerationResult `r` and the vanilla result `baseline` of the same prompt."""
        self.requests += 1
        self.tokens += len(r.output_ids)
        self.seconds += r.seconds
        self.baseline_seconds += baseline.seconds
        self.accept_lengths += r.accept_lengths
        self.cycles += r.cycles
        self.nodes += r.verified_nodes
        self.target_seconds += r.target_seconds
        self.draft_seconds += r.draft_seconds
        self.decode_seconds += r.decode_seconds
        self.baseline_decode_seconds += baseline.decode_seconds
        self.decode_target_seconds += r.target_seconds - r.prefill_target_seconds
        self.decode_draft_seconds += r.draft_seconds - r.prefill_draft_seconds

    def as_dict(self) -> dict:
        # transformers' and llama.cpp's assisted and prompt-lookup rows report no acceptance: their τ is unknown
        tau = statistics.fmean(self.accept_lengths) if self.accept_lengths else self.tau if self.tau is not None \
            else (1.0 if self.method in ("vanilla", "hf greedy", "greedy") else None)
        hist = {str(k): self.accept_lengths.count(k) for k in sorted(set(self.accept_lengths))}
        per_cycle = lambda s: round(1e3 * s / self.cycles, 3) if self.cycles else None  # noqa: E731
        ratio = lambda a, b: round(a / b, 3) if a and b else None  # noqa: E731
        if self.decode_seconds:     # per-cycle split of the decode phase: what one cycle costs
            target, draft, total = self.decode_target_seconds, self.decode_draft_seconds, self.decode_seconds
        else:
            target, draft, total = self.target_seconds, self.draft_seconds, self.seconds
        decode_speedup = ratio(self.baseline_decode_seconds, self.decode_seconds)
        return {"engine": self.engine, "method": self.method, "tree": self.tree, "threads": self.threads,
                "device": self.device,
                "tokens": self.tokens,
                "tokens_per_s": round(self.tokens / self.seconds, 2) if self.seconds else None,
                "speedup": ratio(self.baseline_seconds, self.seconds),
                "decode_tokens_per_s": ratio(self.tokens - self.requests, self.decode_seconds),
                "decode_speedup": decode_speedup,
                "identical_to_vanilla": self.identical, "identical_enforced": self.enforced,
                "tau": None if tau is None else round(tau, 3),
                "tau_histogram": hist,
                "cycles": self.cycles, "nodes_per_cycle": round(self.nodes / self.cycles, 2) if self.nodes else None,
                "draft_ms_per_cycle": per_cycle(draft),
                "verify_ms_per_cycle": per_cycle(target), "other_ms_per_cycle": per_cycle(total - target - draft),
                "predicted_speedup": self.predicted_speedup,
                "measured_over_predicted": ratio(decode_speedup, self.predicted_speedup),
                **({"alongside_tokens_per_s": self.alongside} if self.alongside else {}),
                **({"build": self.build} if self.build else {}),
                **({"note": self.note} if self.note else {})}


@dataclass
class Alongside:
    """The eaglex vanilla runs a peer interleaves with its rows (`eaglex bench` passes one per engine): each engine's
    tokens/s over the same prompts, under the same load as the peer's rows."""
    tokens: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, ids: list[int], seconds: float) -> None:
        self.tokens[name] = self.tokens.get(name, 0) + len(ids)
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def rates(self) -> dict[str, float]:
        return {k: round(self.tokens[k] / s, 2) for k, s in self.seconds.items() if s}


def eos_stop(ids: list[int], limit: int, eos: set[int]) -> list[int]:
    """A peer's tokens cut as eaglex cuts: at the first EOS id (kept), at most `limit`."""
    for i, t in enumerate(ids[:limit]):
        if t in eos:
            return ids[: i + 1]
    return ids[:limit]


def interleaved(calls: dict, prompts: list[list[int]], max_new_tokens: int, max_context: int,
                alongside: Alongside, baselines: dict | None):
    """A peer's measured run: per prompt, every call once (`calls[key](prompt, limit)`, each returning ids and
    seconds first) in a seeded shuffled order, so that no row always runs first or last; the eaglex baselines' runs
    (keys ("eaglex", name)) go into `alongside`. Yields (prompt index, limit, {key: result})."""
    order = random.Random(0)
    for i, p in enumerate(prompts):
        limit = min(max_new_tokens, max_context - len(p))
        keys = list(calls)
        order.shuffle(keys)
        got = {k: calls[k](p, limit) for k in keys}
        for name in baselines or {}:
            alongside.add(name, *got[("eaglex", name)][:2])
        yield i, limit, got


def peer_label(r: dict) -> str:
    """A llama.cpp row's short name: its weights, +E3 for llama-server's EAGLE-3, py for llama-cpp-python's rows."""
    weights = r["device"].split()[1]
    return {"eagle3": f"{weights}+E3", "vanilla": weights, "greedy": f"py {weights}",
            "prompt-lookup": f"py lookup {weights}"}.get(r["method"], f"{r['method']} {weights}")


def anchored_table(rows: list[dict]) -> tuple[list[dict], list[str]]:
    """The eaglex rows that carry anchored ratios (eaglex/bench.py `anchor`) and the llama.cpp rows they are over,
    in the order first met: the table's rows and columns, printed or drawn."""
    mine = [r for r in rows if r.get("vs_llamacpp_anchored")]
    return mine, list(dict.fromkeys(c for r in mine for c in r["vs_llamacpp_anchored"]))
