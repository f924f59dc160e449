"""`--tree auto`: pick the draft tree for this machine and this model by measuring, not by GPU folklore.

On a GPU a 60-node tree verifies almost for free; on a CPU a target forward over N tokens costs 1.4-6x a one-token
forward, so the best shape depends on the hardware, the model size and how
well the head agrees. The tuner runs vanilla and a ladder of chains and small-to-large trees on a few prompts,
interleaved, and keeps the fastest shape whose output matched vanilla. The ladder ends with a cost tree, which sizes
each cycle's tree by the measured cost curve (runtime/cost.py): it is kept only where it measures fastest.
"""
from __future__ import annotations

from dataclasses import dataclass

from .generate import SpeculativeGenerator, VanillaGenerator
from .types import TreeConfig

CANDIDATES = tuple(TreeConfig.parse(t) for t in (
    "chain:1", "chain:2", "chain:3", "chain:4", "chain:5", "chain:6", "dynamic:6/4/2", "dynamic:8/5/3",
    "dynamic:10/6/3", "dynamic:12/6/4", "dynamic:16/6/4", "dynamic:32/7/8", "dynamic:60/8/10", "cost:6/4"))


@dataclass(frozen=True)
class TuneRow:
    tree: TreeConfig | None      # None: vanilla
    seconds: float
    tokens: int
    tau: float
    identical: bool

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def autotune(backend, prompts: list[list[int]], max_new_tokens: int = 48,
             candidates: tuple[TreeConfig, ...] = CANDIDATES) -> tuple[TreeConfig, list[TuneRow]]:
    """Fastest candidate by measured tokens/s (identical outputs only); rows[0] is vanilla (tree None)."""
    if getattr(backend, "exact_trees", None) == "chain":        # an int8 engine: only chains stay exact
        candidates = tuple(t for t in candidates if t.kind == "chain")
    vanilla = VanillaGenerator(backend)
    gens = [SpeculativeGenerator(backend, t) for t in candidates]
    vanilla.generate(prompts[0], 4)
    for g in gens:                                         # warm-up
        g.generate(prompts[0], 4)
    base_s, base_tokens = 0.0, 0
    acc = [[0.0, 0, [], True] for _ in candidates]         # seconds, tokens, accept lengths, identical
    for i, p in enumerate(prompts):
        v = vanilla.generate(p, max_new_tokens)
        # A shared host drifts in speed over a tuning run (memory bandwidth, neighbours): every other prompt runs
        # the ladder backwards, so that no shape is always measured early, and vanilla runs again at the end.
        order = list(zip(acc, gens))
        for a, g in (order if i % 2 == 0 else order[::-1]):
            r = g.generate(p, max_new_tokens)
            a[0] += r.seconds
            a[1] += len(r.output_ids)
            a[2] += r.accept_lengths
            a[3] &= r.output_ids == v.output_ids
        again = vanilla.generate(p, max_new_tokens)
        base_s, base_tokens = base_s + (v.seconds + again.seconds) / 2, base_tokens + len(v.output_ids)
    rows = [TuneRow(None, base_s, base_tokens, 1.0, True)]
    for t, (s, n, lengths, same) in zip(candidates, acc):
        rows.append(TuneRow(t, s, n, sum(lengths) / max(len(lengths), 1), same))
    best = max((r for r in rows[1:] if r.identical), key=lambda r: r.tokens_per_s)
    return best.tree, rows
