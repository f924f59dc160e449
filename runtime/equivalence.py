"""Equivalence checks behind `eaglex check`: speculative against vanilla on the same backend and precision.

Identity, greedy or sampled: token-for-token, with the first divergence and, greedy, the target's logit margin there
(a tiny margin points at floating-point reduction order, a large one at a bug); with `--batch N`, also each prompt
decoded by the in-flight batcher among the others against the same prompt decoded alone by vanilla decoding. A
sampled request draws from noise fixed by its seed and position (sampling.draw), so speculation must reproduce
vanilla's sample exactly. Sampling also gets a distribution check: the emitted tokens must follow the target's own
distribution, tested per prompt with a chi-square goodness-of-fit against the exact conditional probabilities that
the target assigns.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .backend import ONE, Backend
from .generate import GenerationResult, SpeculativeGenerator, VanillaGenerator
from .sampling import derive_seed, logits_to_probs, prompt_sampling
from .types import SamplingConfig, TreeConfig


@dataclass(frozen=True)
class IdentityRow:
    index: int
    identical: bool
    tau: float
    new_tokens: int
    divergence: int | None        # first differing output position
    margin: float | None          # greedy: target top-1 minus top-2 logit at that position (vanilla's context)
    vanilla: GenerationResult
    speculative: GenerationResult


def logit_margin(backend: Backend, context: list[int]) -> float:
    """Top-1 minus top-2 target logit for the token after `context`."""
    backend.reset(len(context) + 1)
    logits, _ = backend.target_forward(ONE, torch.tensor([context]), torch.arange(len(context)).unsqueeze(0), None,
                                       last_only=True)
    top = logits[0, -1].topk(2).values
    return float(top[0] - top[1])


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """First position where two outputs differ (a shorter one differs where it ends); None when equal."""
    div = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if div is None and len(a) != len(b):
        div = min(len(a), len(b))
    return div


def check_identical(backend: Backend, tree: TreeConfig, prompts: list[list[int]], max_new_tokens: int,
                    sampling: SamplingConfig = SamplingConfig()) -> list[IdentityRow]:
    """Each prompt decoded by vanilla and by speculative decoding, greedy or sampled (prompt i with its stream
    prompt_sampling(sampling, i), as Engine.generate gives it), compared token for token."""
    rows = []
    for i, p in enumerate(prompts):
        cfg = prompt_sampling(sampling, i)
        v = VanillaGenerator(backend, cfg).generate(p, max_new_tokens)
        s = SpeculativeGenerator(backend, tree, cfg).generate(p, max_new_tokens)
        div = first_divergence(v.output_ids, s.output_ids)
        margin = logit_margin(backend, p + v.output_ids[:div]) if div is not None and cfg.greedy else None
        rows.append(IdentityRow(i, div is None, s.tau, len(s.output_ids), div, margin, v, s))
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
    distribution given the tokens before it (chi_square)."""
    rows = []
    for i, p in enumerate(prompts):
        outputs, taus = [], []
        for s in range(samples):
            cfg = SamplingConfig(sampling.temperature, sampling.top_p, sampling.top_k,
                                 seed=derive_seed(sampling.seed, s))
            r = SpeculativeGenerator(backend, tree, cfg).generate(p, position + 1)
            taus.append(r.tau)
            outputs.append(r.output_ids)
        chi2, dof, n = chi_square(backend, sampling, p, outputs, position)
        rows.append(DistributionRow(i, n, chi2, dof, chi2_sf(chi2, dof), sum(taus) / len(taus)))
    return rows


def chi_square(backend: Backend, sampling: SamplingConfig, prompt: list[int], outputs: list[list[int]],
               position: int) -> tuple[float, int, int]:
    """(chi2, degrees of freedom, samples): the tokens at output `position` of `outputs` (continuations of
    `prompt`) against the target's exact distribution given the tokens before them, pooled over those contexts
    (expected counts < 5 merged into one bin per context). p-value: chi2_sf(chi2, dof)."""
    observed: dict[tuple, list[int]] = {}
    for out in outputs:
        if len(out) > position:
            observed.setdefault(tuple(out[:position]), []).append(out[position])
    chi2, dof, n = 0.0, 0, 0
    for ctx, toks in observed.items():
        context = prompt + list(ctx)
        backend.reset(len(context) + 1)
        logits, _ = backend.target_forward(ONE, torch.tensor([context]), torch.arange(len(context)).unsqueeze(0),
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
    return chi2, dof, n


def chi2_sf(chi2: float, dof: int) -> float:
    return _chi2_sf(chi2, dof) if math.isfinite(chi2) else 0.0


def format_identical(rows: list[IdentityRow], what: str) -> str:
    """`eaglex check`'s identity table, one line per prompt and a summary."""
    lines = [f"{'#':>3} {'identical':>9} {'tau':>5} {'tokens':>6}  first divergence (logit margin)"]
    for r in rows:
        div = "-" if r.identical else f"at {r.divergence}" + ("" if r.margin is None else f" (margin {r.margin:.3g})")
        lines.append(f"{r.index:>3} {'yes' if r.identical else 'NO':>9} {r.tau:>5.2f} {r.new_tokens:>6}  {div}")
    bad = sum(not r.identical for r in rows)
    taus = [r.tau for r in rows if r.speculative.cycles]
    lines.append(f"{len(rows) - bad}/{len(rows)} identical to vanilla ({what}); "
                 f"mean tau {sum(taus) / max(len(taus), 1):.2f}")
    return "\n".join(lines)


def format_batched(rows: list[IdentityRow], batched: list[GenerationResult], what: str) -> tuple[str, bool]:
    """The batched check: each prompt's output from the in-flight batcher against its vanilla output decoded alone
    (rows from check_identical, same sampling) -> (text, all identical)."""
    divs = [first_divergence(r.vanilla.output_ids, b.output_ids) for r, b in zip(rows, batched)]
    lines = [f"{r.index:>3} batched output differs from vanilla decoded alone at {d}"
             for r, d in zip(rows, divs) if d is not None]
    ok = len(batched) == len(rows) and all(d is None for d in divs)
    lines.append(f"{sum(d is None for d in divs)}/{len(rows)} identical to vanilla decoded alone when batched ({what})")
    return "\n".join(lines), ok


def format_distribution(rows: list[DistributionRow]) -> tuple[str, bool]:
    """`eaglex check`'s table for sampling, and whether every prompt passed. Bonferroni over prompts: a correct
    sampler fails with probability < 0.1 %."""
    lines = [f"{'#':>3} {'samples':>7} {'chi2':>8} {'dof':>4} {'p':>7} {'tau':>5}"]
    for r in rows:
        lines.append(f"{r.index:>3} {r.samples:>7} {r.chi2:>8.2f} {r.dof:>4} {r.p_value:>7.4f} {r.tau:>5.2f}")
    bad = [r for r in rows if r.p_value < 1e-3 / len(rows)]
    lines.append(f"{len(rows) - len(bad)}/{len(rows)} prompts consistent with the target distribution")
    return "\n".join(lines), not bad
