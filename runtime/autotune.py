"""`--tree auto`: pick the draft tree for this machine and this model by measuring, not by GPU folklore.

On a GPU a 60-node tree verifies almost for free; on a CPU a target forward over N tokens costs 1.4-6x a one-token
forward, so the best shape depends on the hardware, the model size and how well the head agrees. The tuner runs
vanilla and a ladder of chains and small-to-large trees on a few prompts, interleaved, then its fastest few again on
more prompts, and keeps the fastest shape whose output matched vanilla. The ladder ends with a cost tree, which
sizes each cycle's tree by the measured cost curve (runtime/cost.py): it is kept only where it measures fastest.
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


FIRST_PROMPTS = 4      # the whole ladder runs on these prompts
RUNOFF = 3             # the fastest shapes on them run again, with vanilla, on the prompts after them


def autotune(backend, prompts: list[list[int]], max_new_tokens: int = 48,
             candidates: tuple[TreeConfig, ...] = CANDIDATES, first: int = FIRST_PROMPTS,
             runoff: int = RUNOFF) -> tuple[TreeConfig, list[TuneRow]]:
    """Fastest candidate by measured tokens/s (identical outputs only); rows[0] is vanilla (tree None).

    The ladder runs on the first `first` prompts; when there are more, its `runoff` fastest shapes run again with
    vanilla on the rest (the best fixed tree moves with the prompt family, and a few prompts decide close races by
    chance), and the winner is the fastest of them over all the prompts they ran; vanilla's row and theirs cover every
    prompt, the other rows the first ones."""
    if getattr(backend, "exact_trees", None) == "chain":        # an int8 engine: only chains stay exact
        candidates = tuple(t for t in candidates if t.kind == "chain")
    vanilla = VanillaGenerator(backend)
    gens = [SpeculativeGenerator(backend, t) for t in candidates]
    vanilla.generate(prompts[0], 4)
    for g in gens:                                         # warm-up
        g.generate(prompts[0], 4)
    base, acc = _ladder(vanilla, gens, prompts[:first], max_new_tokens)
    rows = _rows(candidates, base, acc)
    pool = [r for r in rows[1:] if r.identical]
    if prompts[first:] and runoff:
        finalists = sorted(range(len(candidates)), key=lambda j: -rows[j + 1].tokens_per_s)
        finalists = [j for j in finalists if rows[j + 1].identical][:runoff]
        more, extra = _ladder(vanilla, [gens[j] for j in finalists], prompts[first:], max_new_tokens)
        base = [base[0] + more[0], base[1] + more[1]]
        for j, a in zip(finalists, extra):
            acc[j] = [acc[j][0] + a[0], acc[j][1] + a[1], acc[j][2] + a[2], acc[j][3] and a[3]]
        rows = _rows(candidates, base, acc)
        pool = [rows[j + 1] for j in finalists if rows[j + 1].identical] or pool
    best = max(pool, key=lambda r: r.tokens_per_s)
    return best.tree, rows


def _ladder(vanilla, gens, prompts, max_new_tokens):
    """Each prompt: vanilla, every generator, vanilla again -> ([vanilla seconds, tokens], per generator [seconds,
    tokens, accept lengths, identical to vanilla])."""
    base_s, base_tokens = 0.0, 0
    acc = [[0.0, 0, [], True] for _ in gens]
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
    return [base_s, base_tokens], acc


def _rows(candidates, base, acc) -> list[TuneRow]:
    rows = [TuneRow(None, base[0], base[1], 1.0, True)]
    for t, (s, n, lengths, same) in zip(candidates, acc):
        rows.append(TuneRow(t, s, n, sum(lengths) / max(len(lengths), 1), same))
    return rows
