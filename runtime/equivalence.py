"""Equivalence checks behind `eaglex check`: speculative against vanilla on the same backend and precision.

Greedy: token-for-token identity, with the first divergence and the target's logit margin there (a tiny margin
points at floating-point reduction order, a large one at a bug). Sampling: the emitted tokens must follow the
target's own distribution, tested per prompt with a chi-square goodness-of-fit against the exact conditional
probabilities that the target assigns.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .backend import Backend
from .generate import GenerationResult, SpeculativeGenerator, VanillaGenerator
from .sampling import logits_to_probs
from .types import SamplingConfig, TreeConfig


@dataclass(frozen=True)
class GreedyRow:
    index: int
    identical: bool
    tau: float
    new_tokens: int
    divergence: int | None        # first differing output position
    margin: float | None          # target top-1 minus top-2 logit at that position (vanilla's context)
    vanilla: GenerationResult
    speculative: GenerationResult


def logit_margin(backend: Backend, context: list[int]) -> float:
    """Top-1 minus top-2 target logit for the token after `context`."""
    backend.reset(len(context) + 1)
    logits, _ = backend.target_forward(torch.tensor([context]), torch.arange(len(context)).unsqueeze(0), None,
                                       last_only=True)
    top = logits[0, -1].topk(2).values
    return float(top[0] - top[1])


def check_greedy(backend: Backend, tree: TreeConfig, prompts: list[list[int]], max_new_tokens: int) -> list[GreedyRow]:
    vanilla, spec = VanillaGenerator(backend), SpeculativeGenerator(backend, tree)
    rows = []
    for i, p in enumerate(prompts):
        v = vanilla.generate(p, max_new_tokens)
        s = spec.generate(p, max_new_tokens)
        div = next((j for j, (a, b) in enumerate(zip(v.output_ids, s.output_ids)) if a != b), None)
        if div is None and len(v.output_ids) != len(s.output_ids):
            div = min(len(v.output_ids), len(s.output_ids))
        margin = logit_margin(backend, p + v.output_ids[:div]) if div is not None else None
        rows.append(GreedyRow(i, div is None, s.tau, len(s.output_ids), div, margin, v, s))
    return rows


@dataclass(frozen=True)
class DistributionRow:
    index: int
    samples: int
    chi2: float
    dof: int
    p_value: float
    tau: float


def _chi2_sf(x: float, k: int) -> float:
    """Survival function of the chi-square distribution (regularised upper incomplete gamma)."""
    if k <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(k / 2, dtype=torch.float64),
                                         torch.tensor(x / 2, dtype=torch.float64)))


def check_distribution(backend: Backend, tree: TreeConfig, sampling: SamplingConfig, prompts: list[list[int]],
                       samples: int = 300, position: int = 1) -> list[DistributionRow]:
    """For each prompt, draw `samples` speculative generations with different seeds; the token at output
    `position` (>= 1, i.e. decided by verification, not by the prefill) is compared with the exact target
    distribution given the tokens before it, pooled over contexts with a chi-square test (expected counts < 5 are
    merged into one bin)."""
    rows = []
    for i, p in enumerate(prompts):
        observed: dict[tuple, list[int]] = {}
        taus = []
        for s in range(samples):
            cfg = SamplingConfig(sampling.temperature, sampling.top_p, sampling.top_k, seed=sampling.seed + s)
            r = SpeculativeGenerator(backend, tree, cfg).generate(p, position + 1)
            taus.append(r.tau)
            if len(r.output_ids) > position:
                observed.setdefault(tuple(r.output_ids[:position]), []).append(r.output_ids[position])
        chi2, dof, n = 0.0, 0, 0
        for ctx, toks in observed.items():
            context = p + list(ctx)
            backend.reset(len(context) + 1)
            logits, _ = backend.target_forward(torch.tensor([context]), torch.arange(len(context)).unsqueeze(0),
                                               None, last_only=True)
            probs = logits_to_probs(logits[0, -1].double(), sampling).double()
            counts = torch.bincount(torch.tensor(toks), minlength=probs.shape[0]).double()
            expected = probs * len(toks)
            big = expected >= 5
            obs = torch.cat([counts[big], counts[~big].sum().unsqueeze(0)])
            exp = torch.cat([expected[big], expected[~big].sum().unsqueeze(0)])
            if bool((counts[probs == 0] > 0).any()):
                chi2 = math.inf                                # a token the target gives zero probability
            keep = exp > 0
            obs, exp = obs[keep], exp[keep]
            chi2 += float(((obs - exp) ** 2 / exp).sum())
            dof += max(int(keep.sum()) - 1, 0)
            n += len(toks)
        rows.append(DistributionRow(i, n, chi2, dof, _chi2_sf(chi2, dof) if math.isfinite(chi2) else 0.0,
                                    sum(taus) / len(taus)))
    return rows
