"""Target-side token distributions: logits -> warped probabilities, and drawing from them.

This module owns the meaning of SamplingConfig. `logits_to_probs` applies temperature, then top-k, then top-p, with
the same semantics and order as Hugging Face's TemperatureLogitsWarper / TopKLogitsWarper / TopPLogitsWarper (the
order `generate()` uses), so "lossless" here means "distributed like transformers' sampling of the target".
Greedy decoding never comes through here: it takes the argmax of the raw logits.

Drawing (`draw`) is coupled by position: the token sampled at output position t of a request is a function of the
target's distribution there, the request's seed and t alone. That is what lets verification (verify.py) accept
exactly the tokens vanilla decoding would have sampled with the same seed.

Pure functions: tensors in, tensors out.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from .device import host
from .types import SamplingConfig


def logits_to_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """logits [..., V] -> probs [..., V] float32, renormalised over the tokens that survive top-k / top-p."""
    if cfg.greedy:
        raise ValueError("greedy decoding (temperature 0) takes the argmax of the logits; it has no distribution")
    # fp32 like generate(), which upcasts the last-position logits before the warpers run
    scores = logits.float() / cfg.temperature

    if cfg.top_k > 0:
        # Like TopKLogitsWarper: keep every token scoring at least the k-th best (ties at the boundary all survive)
        k = min(cfg.top_k, scores.shape[-1])
        kth = torch.topk(scores, k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))

    if cfg.top_p < 1.0:
        # Like TopPLogitsWarper: walk the tokens from least to most likely and drop those whose cumulative mass
        # stays <= 1 - top_p; what is left is the smallest head holding >= top_p. The top token always stays.
        # (generate() skips this warper at top_p == 1.0, so do we: it would only drop underflowed tokens.)
        sorted_scores, sorted_idx = torch.sort(scores, dim=-1, descending=False)
        cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cum <= (1.0 - cfg.top_p)
        drop_sorted[..., -1] = False
        drop = drop_sorted.scatter(-1, sorted_idx, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))

    return torch.softmax(scores, dim=-1)


def noise(seed: int, position: int, size: int) -> np.ndarray:
    """[size] float64 Exp(1) variates for output position `position` of the stream `seed`, one per vocabulary id.

    Philox is counter-based: keyed by the seed, counting from (0, position, 0, 0), so the numbers at a position
    are a pure function of (seed, position), whoever asks and in whatever order. 32-bit uniforms u = (k + 1/2) / 2^32
    lie in (0, 1), so E = -log u is finite and > 0.
    """
    bits = np.random.Philox(key=seed % 2 ** 128, counter=[0, position, 0, 0]).random_raw((size + 1) // 2)
    u = bits.view(np.uint32)[:size].astype(np.float64)
    u += 0.5
    u *= 2.0 ** -32
    np.log(u, out=u)
    return np.negative(u, out=u)


def draw(probs: torch.Tensor, seed: int, position: int) -> int:
    """probs [V] (>= 0, with mass; need not sum to 1) -> the token sampled at output `position` of stream `seed`.

    An exponential race: argmax_i p_i / E_i with E = noise(seed, position), which picks i with probability
    p_i / sum(p) (the first arrival of independent Poisson clocks of rates p_i). Tokens with p = 0 never win.
    Because the noise depends on (seed, position) only, every decoder that reaches a position with the same
    distribution draws the same token there: vanilla one token at a time, any draft tree, alone or batched.
    """
    if probs.dim() != 1:
        raise ValueError(f"probs must be [V], got shape {tuple(probs.shape)}")
    p = host(probs.float())[0].numpy()
    return int(np.argmax(p / noise(seed, position, p.shape[0])))


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [..., V] -> [...] int64 index of the first maximum, as torch.argmax.

    On CPU numpy's SIMD argmax is ~10x faster than torch's (60 x 32000 floats: 0.4 ms against 4 ms), and a
    verification reads the argmax of every tree node.
    """
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.as_tensor(logits.detach().numpy().argmax(-1))
    return logits.argmax(-1)


def derive_seed(seed: int, index: int) -> int:
    """The seed of stream `index` under a run's `seed`: numpy's SeedSequence hashes (seed, index), so streams of
    different runs and of different prompts never coincide (a plain seed + index would make run s's prompt 1 and
    run s+1's prompt 0 draw the same samples). 63 bits: what torch.Generator.manual_seed takes."""
    state = np.random.SeedSequence([int(seed), int(index)]).generate_state(1, np.uint64)[0]
    return int(state) >> 1


def prompt_sampling(sampling: SamplingConfig, index: int, seed: int | None = None) -> SamplingConfig:
    """Prompt `index`'s settings in a run under `sampling`: its own `seed` when given, else the stream
    derive_seed(sampling.seed, index), so that a prompt's output never depends on the other prompts."""
    return replace(sampling, seed=seed if seed is not None else derive_seed(sampling.seed, index))
