"""Target-side token distributions: logits -> warped probabilities, and drawing from them.

This module owns the meaning of SamplingConfig. `logits_to_probs` applies temperature, then top-k, then top-p, with
the same semantics and order as Hugging Face's TemperatureLogitsWarper / TopKLogitsWarper / TopPLogitsWarper (the
order `generate()` uses), so "lossless" here means "distributed like transformers' sampling of the target".
Greedy decoding never comes through here: it takes the argmax of the raw logits.

Pure functions: tensors in, tensors out.
"""
from __future__ import annotations

import torch

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


def sample(probs: torch.Tensor, generator: torch.Generator) -> int | torch.Tensor:
    """probs [V] -> int token, or probs [B, V] -> Tensor[B] int64. Rows need not sum to 1, only be >= 0 with mass.

    torch.multinomial draws on the generator's device, so the probabilities move there (the verifier keeps a CPU
    generator; one small copy per cycle is cheaper than a generator per device).
    """
    if probs.dim() not in (1, 2):
        raise ValueError(f"probs must be [V] or [B, V], got shape {tuple(probs.shape)}")
    out = torch.multinomial(probs.to(generator.device), 1, generator=generator)  # [1] or [B, 1]
    if probs.dim() == 1:
        return int(out.item())
    return out.squeeze(-1).to(probs.device)


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
    import numpy as np
    state = np.random.SeedSequence([int(seed), int(index)]).generate_state(1, np.uint64)[0]
    return int(state) >> 1
