"""Tuning by measurement: the tree a request alone drafts (`--tree auto`, autotune) and the tree by number of
requests in flight (the batch schedule, tune_schedule), for this machine and this model, not by GPU folklore.
engines/tune.py stores what they measure in an engine's manifest.

On a GPU a 60-node tree verifies almost for free; on a CPU a target forward over N tokens costs 1.4-6x a one-token
forward, so the best shape depends on the hardware, the model size and how well the head agrees. The tuner runs
vanilla and a ladder of chains and small-to-large trees on a few prompts, interleaved, then its fastest few again on
more prompts, and keeps the fastest shape whose output matched vanilla. The ladder ends with a cost tree, which
sizes each cycle's tree by the measured cost curve (runtime/cost.py): it is kept only where it measures fastest.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from .batch import BatchedGenerator, Schedule
from .generate import SpeculativeGenerator, VanillaGenerator
from .request import Request
from .types import TreeConfig

# The one ladder of trees tuning measures: all of it for a request alone; with requests in flight its chains up to
# 4 deep and its smallest dynamic tree (BATCH_CHAINS, BATCH_TREES).
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


# ------------------------------------------------------------------------------------------- the batch schedule

BATCH_SIZES = (1, 2, 4, 8, 16)
BATCH_CHAINS = tuple(t.depth for t in CANDIDATES if t.kind == "chain" and t.depth <= 4)
# Trees tried beside the chains (with the engine's own single-request tree, engines/tune.py): the smallest dynamic
# tree of the ladder, the cheapest tree that still branches.
BATCH_TREES = (min((t for t in CANDIDATES if t.kind == "dynamic"), key=lambda t: t.max_nodes),)
# New tokens per request while tuning: an answer's body, not just its opening. At 24 tokens the tiny default measured
# chain:6 alone no faster than vanilla and picked vanilla from 4 requests on, where its 256-token requests run chain:6
# alone 1.8x vanilla and speculation still pays at 16 (eaglex bench --batch-sizes).
BATCH_TOKENS = 96
# Requests each candidate decodes per batch size at least, in rounds of B (prompts rotated): one request alone
# measures its prompt's acceptance, not the family's (on SmolLM2 a batch of one on a code prompt ran chain:4 at 3.6x
# vanilla, where the single-request ladder over 8 prompts measured 1.7x).
BATCH_MIN_REQUESTS = 4


def run_batch(batcher: Callable[[int, Schedule], BatchedGenerator], tree: TreeConfig | None,
              prompts: list[list[int]], size: int, max_new_tokens: int, first: int = 0) -> tuple[int, float, list[Request]]:
    """`size` requests (prompts cycled from index `first`) started together on `tree` (None: vanilla) in the
    generator `batcher(size, schedule)` makes (Engine.batcher: the one `generate --batch` and the server decode
    with), run to the end -> (tokens decoded after their admission, the seconds that took, the requests in
    submission order). Admission (the prefills) is the same whatever the tree, so it is not timed."""
    gen = batcher(size, Schedule.fixed(tree))
    reqs = [gen.submit(prompts[(first + i) % len(prompts)], max_new_tokens) for i in range(size)]
    gen.step()
    running = list(gen.active)
    tokens = -sum(len(r.result.output_ids) for r in running)
    t = time.perf_counter()
    gen.run()
    seconds = time.perf_counter() - t
    tokens += sum(len(r.result.output_ids) for r in running)
    return tokens, seconds, reqs


def tune_schedule(batcher: Callable[[int, Schedule], BatchedGenerator], prompts: list[list[int]],
                  sizes: tuple[int, ...] = BATCH_SIZES, chains: tuple[int, ...] = BATCH_CHAINS,
                  trees: tuple[TreeConfig, ...] = BATCH_TREES, max_new_tokens: int = BATCH_TOKENS,
                  chain_only: bool = False) -> tuple[Schedule, dict[int, dict[str, float]]]:
    """Measure, for each batch size B in ascending order, aggregate tokens/s of vanilla batching, of each chain and
    of `trees` (wider trees: dynamic or static) with B requests in flight (run_batch; candidates interleaved per
    round, BATCH_MIN_REQUESTS requests each at least; a candidate's rate is its tokens over its seconds, all rounds
    together) and pick the schedule from the table (schedule_from). Once vanilla batching wins at some B, larger
    sizes are not measured: the schedule runs vanilla there anyway. `trees` are measured at the first size and then
    only while one of them was the fastest at the size before: verification grows compute-bound with the batch, and a
    wide tree pays more verify rows per accepted token than a chain, so one that lost to a chain at B requests does
    not win at more; this keeps their cost to the sizes where they can win. Trees other than chains are left out
    for an engine exact with chains only (`chain_only`).
    `batcher(B, schedule)`: a generator of at least B slots over a model with a draft head (Engine.batcher).
    -> (schedule, {B: {tree: tokens/s}})."""
    ladder = [TreeConfig.chain(k) for k in chains]
    wide = [t for t in dict.fromkeys(trees) if t not in ladder and (t.kind == "chain" or not chain_only)]
    table: dict[int, dict[str, float]] = {}
    for tree in [None] + ladder + wide:             # warm-up: a first call of each candidate's shapes allocates
        run_batch(batcher, tree, prompts, 1, 4)
    for B in sizes:
        last = table[max(table)] if table else None
        try_wide = last is None or max(last, key=last.get) in map(str, wide)
        shapes = {str(tree or "vanilla"): tree for tree in [None] + ladder + (wide if try_wide else [])}
        tokens, seconds = dict.fromkeys(shapes, 0), dict.fromkeys(shapes, 0.0)
        for r in range(-(-BATCH_MIN_REQUESTS // B)):
            for k, tree in shapes.items():
                n, sec, _ = run_batch(batcher, tree, prompts, B, max_new_tokens, r * B)
                tokens[k] += n
                seconds[k] += sec
        rates = {k: round(n / seconds[k], 2) if seconds[k] else 0.0 for k, n in tokens.items()}
        table[B] = rates
        if schedule_from({B: rates}).tree(B) is None:      # vanilla here: the schedule stays vanilla beyond
            break
    return schedule_from(table), table


SCHEDULE_MARGIN = 0.05         # a tree must beat vanilla batching by this much: interleaved tuning runs differ ~±5 %


def schedule_from(table: dict[int, dict[str, float]], margin: float = SCHEDULE_MARGIN) -> Schedule:
    """{B: {"vanilla" | tree: tokens/s}} -> the schedule: at each measured B (ascending) the fastest tree if it beats
    vanilla batching by more than `margin` (a smaller lead is within the measurement's noise, and speculation that
    does not clearly pay only risks running slower than vanilla), else vanilla, and vanilla from the first such B
    on at every larger size. Verification grows compute-bound with the batch, so a tree that lost to vanilla at B
    requests does not win at more; a later "win" in the table is noise, and following it would flip speculation on
    and off as load moves. Between two measured sizes a new choice starts where it overtakes the old one
    (switch_point), not at the larger size: a server's requests in flight sit anywhere in between."""
    steps: list[tuple[int, TreeConfig | None]] = []
    before = None
    for B in sorted(table):
        rates = table[B]
        trees = {k: v for k, v in rates.items() if k != "vanilla"}
        best = max(trees, key=trees.get, default=None)
        win = best is not None and trees[best] > (1 + margin) * rates.get("vanilla", 0.0)
        tree = TreeConfig.parse(best) if win else None
        if not steps:
            steps.append((1, tree))
        elif steps[-1][1] != tree:
            steps.append((switch_point(table, before, B, steps[-1][1], tree, margin), tree))
        before = B
        if tree is None:
            break
    return Schedule(tuple(steps) or ((1, None),))


def switch_point(table: dict[int, dict[str, float]], b0: int, b1: int, old: TreeConfig, new: TreeConfig | None,
                 margin: float = SCHEDULE_MARGIN) -> int:
    """The number of requests in flight from which `new` (the choice measured at b1; None = vanilla) replaces `old`
    (the choice at b0 < b1): the first at which new's speed over old's, taken linear in log(requests) between the two
    measurements, reaches 1 (against vanilla: old's lead falls to `margin`); b1 when a rate is missing."""
    def ratio(b: int) -> float | None:
        o, n = table[b].get(str(old)), table[b].get(str(new) if new else "vanilla")
        return None if not o or n is None else n * (1 + margin if new is None else 1) / o
    q0, q1 = ratio(b0), ratio(b1)
    if q0 is None or q1 is None or q1 <= q0:
        return b1
    x = min(max((1 - q0) / (q1 - q0), 0.0), 1.0)
    return min(max(math.ceil(b0 * (b1 / b0) ** x - 1e-9), b0 + 1), b1)
