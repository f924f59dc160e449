"""What forwards cost on the backend at hand: t(N), a target forward over N new rows after a typical context, and a
draft forward over N rows, measured (CostSampler), kept as a CostCurve and interpolated between the measured N.

Two users: the benchmark (eaglex/bench.py), which predicts a tree's speedup from the curve and the measured τ, and
the cost tree (TreeConfig kind "cost"), which sizes every cycle's verification by it (tree.cost_size). Tuning
(engines/tune.py) stores the curve in the engine's manifest (tuning.verify_ms, tuning.draft_ms), so that every
process sizes its trees the same way; a backend without a stored curve measures one the first time a cost tree
runs on it (about a second on the default model) and keeps it for every later generator over the same models.
"""
from __future__ import annotations

import random
import statistics
import time
import weakref
from dataclasses import dataclass

import torch

from .backend import ONE
from .device import synchronize

DEFAULT_SIZES = (1, 2, 4, 8, 16, 32, 60, 64)
COST_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)      # the cost tree's curve: up to types.COST_MAX_NODES rows


def interp(table: dict, n: float) -> float:
    """{N: ms} at n: linear between the measured N, the smallest N's value below it, and past the largest N along
    the last two points (a batch verifies B trees at once: B * nodes rows, past the measured sizes)."""
    t = {int(k): v for k, v in table.items()}
    sizes = sorted(t)
    if n <= sizes[0]:
        return t[sizes[0]]
    if n >= sizes[-1]:
        if len(sizes) == 1:
            return t[sizes[0]]
        a, b = sizes[-2], sizes[-1]
        return t[b] + max(t[b] - t[a], 0.0) * (n - b) / (b - a)
    lo = max(s for s in sizes if s <= n)
    hi = min(s for s in sizes if s >= n)
    return t[lo] if hi == lo else t[lo] + (t[hi] - t[lo]) * (n - lo) / (hi - lo)


@dataclass(frozen=True)
class CostCurve:
    """Milliseconds by rows: `verify` a target forward over N new rows after `context` cached ones, `draft` a draft
    step over N rows (no fc: a tree level)."""
    verify_ms: tuple[tuple[int, float], ...]
    draft_ms: tuple[tuple[int, float], ...]
    context: int

    def verify(self, n: float) -> float:
        return interp(dict(self.verify_ms), n)

    def draft(self, n: float) -> float:
        return interp(dict(self.draft_ms), n)

    def to_tuning(self) -> dict:
        """The manifest's tuning fields."""
        return {"verify_ms": {str(n): ms for n, ms in self.verify_ms},
                "draft_ms": {str(n): ms for n, ms in self.draft_ms}, "cost_context": self.context}

    @classmethod
    def from_tuning(cls, tuning: dict | None) -> CostCurve | None:
        """The curve stored in a manifest's tuning section, None where it has none (engines tuned before it was
        stored, or never tuned)."""
        if not tuning or not tuning.get("verify_ms") or not tuning.get("draft_ms"):
            return None
        pairs = lambda d: tuple(sorted((int(n), float(ms)) for n, ms in d.items()))  # noqa: E731
        return cls(pairs(tuning["verify_ms"]), pairs(tuning["draft_ms"]), int(tuning.get("cost_context", 0)))


class CostSampler:
    """The cost model measured in rounds: t(N) of a target forward over N new tokens after
    `context` cached ones, draft steps over N nodes (N = 1 for chains, K for a tree level), and the first draft step
    over 4 context rows (fc included). A round runs every case once, in a freshly shuffled order; rounds taken
    between the generation runs (the benchmark's) see the same drifting load as the runs they predict, and the
    summary keeps the median of every case over the rounds.
    """

    def __init__(self, backend, context: int = 256, sizes=DEFAULT_SIZES, draft_sizes=(1, 10), seed: int = 0):
        self.backend, self.spec = backend, backend.spec
        self.sizes, self.draft_sizes = tuple(sizes), tuple(draft_sizes)
        self.context = min(context, self.spec.max_context - max(self.sizes) - 1)
        if self.context < 1:
            raise ValueError(f"a {self.spec.max_context}-token context leaves no room to time {max(self.sizes)} rows")
        self.rng = random.Random(seed)
        g = torch.Generator().manual_seed(seed)
        self.prompt = torch.randint(0, self.spec.vocab_size, (1, self.context), generator=g)
        self.target_in = {n: torch.randint(0, self.spec.vocab_size, (1, n), generator=g) for n in self.sizes}
        H = self.spec.hidden_size
        self.draft_in = {n: (torch.randn(1, n, H, generator=g), torch.randint(0, self.spec.vocab_size, (1, n),
                                                                            generator=g)) for n in self.draft_sizes}
        self.samples: dict[str, list[float]] = {}
        self.rounds = 0

    def _cases(self, feats) -> list[tuple[str, callable]]:
        b, c = self.backend, self.context
        cases = []
        for n in self.sizes:
            ids, pos = self.target_in[n], torch.arange(c, c + n)[None]
            mask = torch.ones(n, n, dtype=torch.bool).tril()[None]

            def step(ids=ids, pos=pos, mask=mask):
                b.target_forward(ONE, ids, pos, mask)
                b.target_commit(0, torch.arange(0))          # commit nothing: the next call starts from `context`
            cases.append((f"target {n}", step))
        if b.draft_kind is None:
            return cases
        for n in self.draft_sizes:
            hid, ids = self.draft_in[n]
            hid = hid.to(feats.dtype)
            pos, mask = torch.full((1, n), c), torch.eye(n, dtype=torch.bool)[None]

            def dstep(hid=hid, ids=ids, pos=pos, mask=mask, n=n):     # a tree level keeps top_k <= 10 per row
                b.draft_forward(ONE, hid, ids, pos, mask, project=False, top_k=min(n, 10))
                b.draft_rollback(ONE)
            cases.append((f"draft {n}", dstep))
        f4, ids4, pos4 = feats[:, -4:], self.prompt[:, -4:], torch.arange(c - 4, c)[None]

        def first():
            b.draft_forward(ONE, f4, ids4, pos4, None, project=True, top_k=10, last_only=True)
            b.draft_rollback(ONE)
        cases.append(("draft first", first))
        return cases

    def round(self, repeats: int = 1, record: bool = True) -> None:
        """Prefill `context` rows, then time every case `repeats` times in a shuffled order."""
        b, c = self.backend, self.context
        b.reset(c + max(self.sizes) + 1)
        _, feats = b.target_forward(ONE, self.prompt, torch.arange(c)[None], None, last_only=True)
        b.target_commit(0, torch.arange(c))
        if b.draft_kind is not None:      # the draft's own context (token ids do not matter for timing)
            b.draft_forward(ONE, feats, self.prompt, torch.arange(c)[None], None, project=True, top_k=10, last_only=True)
            b.draft_commit(0, torch.arange(c))
        cases = self._cases(feats) * repeats
        self.rng.shuffle(cases)
        device = getattr(b, "device", "cpu")
        for name, fn in cases:
            synchronize(device)
            t = time.perf_counter()
            fn()
            synchronize(device)
            dt = time.perf_counter() - t
            if record:
                self.samples.setdefault(name, []).append(dt)
        self.rounds += record

    def summary(self, statistic=statistics.median) -> dict:
        """Milliseconds per case: by default the median over the rounds (what the runs between them saw)."""
        med = {k: round(1e3 * statistic(v), 3) for k, v in self.samples.items()}
        out = {"context": self.context, "rounds": self.rounds,
               "target_ms": {n: med[f"target {n}"] for n in self.sizes},
               "target_1_ms_range": [round(1e3 * min(self.samples["target 1"]), 3),
                                     round(1e3 * max(self.samples["target 1"]), 3)]}
        if self.backend.draft_kind is not None:
            out["draft_ms"] = {n: med[f"draft {n}"] for n in self.draft_sizes}
            out["draft_step_ms"] = out["draft_ms"].get(10)
            out["draft_chain_step_ms"] = out["draft_ms"][1]
            out["draft_first_ms"] = med["draft first"]
        return out


def measure_curve(backend, rounds: int = 3) -> CostCurve:
    """The cost tree's curve on `backend` (which needs a draft head): one warm-up round, then the fastest of
    `rounds` rounds at COST_SIZES rows. The fastest, not the median: the curve stands for what the forwards cost on
    this machine, and a neighbour's load only ever adds time, unevenly across sizes (on a busy 2-core host single
    samples of t(8) ranged 59-258 ms where the fastest of each size stayed monotone). Leaves the backend's caches
    empty of requests (reset)."""
    sampler = CostSampler(backend, sizes=COST_SIZES, draft_sizes=COST_SIZES)
    for i in range(rounds + 1):
        sampler.round(record=i > 0)
    s = sampler.summary(min)
    return CostCurve(tuple(s["target_ms"].items()), tuple(s["draft_ms"].items()), s["context"])


_measured: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # models -> their curve, measured once


def cost_curve(backend) -> CostCurve:
    """The curve a cost tree on `backend` sizes its verifications by: the one tuning stored in its engine's
    manifest, else one measured on its models the first time it is asked for (kept for every later generator over
    the same models: single-request and batched backends over them, `source`, share it). A measured curve differs
    from run to run, so sampled outputs repeat across processes only with a stored one (greedy outputs are vanilla's
    whatever the curve)."""
    root = backend
    while getattr(root, "source", None) is not None:
        root = root.source
    stored = CostCurve.from_tuning((getattr(root, "manifest", None) or {}).get("tuning"))
    if stored is not None:
        return stored
    if root not in _measured:
        # timed on the models' own single-request backend, at its full context: a batched backend's slots may be
        # sized shorter than the typical context the curve stands for; the caller resets its caches afterwards
        _measured[root] = measure_curve(root)
    return _measured[root]
