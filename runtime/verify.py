"""Acceptance: given a drafted tree and the target's logits at every node, which nodes to keep and what comes next.

This module owns the lossless guarantee (as the official code's evaluate_posterior). Greedy: accept the longest
root path whose every token is the target's argmax at its parent, then emit the argmax after it. Sampling
(EAGLE-2/3): the draft picks its tokens deterministically, so q is a point mass and each child x is accepted with
the target's residual probability p(x); a rejected child is removed from p and p renormalised; the next token comes
from the residual.
That is sequential rejection over distinct children, and the emitted sequence is distributed exactly as sampling
the target token by token.

Row i of `logits` is the target's next-token distribution after node i (root and its ancestors in context).
"""
from __future__ import annotations

import numpy as np
import torch

from .device import host
from .sampling import argmax, logits_to_probs, sample
from .types import DraftTree, SamplingConfig, Verdict


def _check(tree: DraftTree, logits: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.shape[0] != tree.size:
        raise ValueError(f"logits must be [N={tree.size}, V], got {tuple(logits.shape)}")


def verify_greedy(tree: DraftTree, logits: torch.Tensor) -> Verdict:
    """tree with N nodes, logits [N, V] -> Verdict (longest argmax-consistent path + the argmax after it)."""
    _check(tree, logits)
    top = argmax(logits)                                         # [N] target's choice after each node
    if tree.tokens.device.type == "cpu":                         # the drafters' trees: decided on the host, after
        return _verify_greedy_host(tree, host(top)[0].numpy())  # one read of the N argmax ids from the device
    # A node is correct when its token is what the target would emit after its parent; the root is given.
    parent_top = top[tree.parents.clamp(min=0)]
    correct = (tree.tokens == parent_top) | (tree.parents < 0)   # [N]
    paths = tree.paths                                           # [L, D] root -> leaf, -1 padded
    match = correct[paths.clamp(min=0)] & (paths >= 0)           # [L, D]
    # Like evaluate_posterior: accepted length per path = run of matches after the root; first best path wins.
    acc = torch.cumprod(match[:, 1:].long(), dim=1).sum(dim=1)   # [L]
    best = int(torch.argmax(acc))
    a = int(acc[best])
    nodes = paths[best, : a + 1]
    return Verdict(nodes=nodes, next_token=int(top[nodes[-1]]))


def _verify_greedy_host(tree: DraftTree, top: np.ndarray) -> Verdict:
    """verify_greedy on the host in numpy: the same steps, without ~10 torch dispatches of a few us each on
    tensors of tens of elements (this runs once per cycle)."""
    parents, tokens, paths = tree.parents.numpy(), tree.tokens.numpy(), tree.paths.numpy()
    correct = (tokens == top[np.maximum(parents, 0)]) | (parents < 0)
    match = correct[np.maximum(paths, 0)] & (paths >= 0)
    acc = np.cumprod(match[:, 1:], axis=1).sum(axis=1)
    best = int(np.argmax(acc))                                   # first best path wins, as torch.argmax
    nodes = paths[best, : int(acc[best]) + 1].copy()
    return Verdict(nodes=torch.from_numpy(nodes), next_token=int(top[nodes[-1]]))


def verify_sampling(tree: DraftTree, logits: torch.Tensor, cfg: SamplingConfig,
                    generator: torch.Generator) -> Verdict:
    """tree with N nodes, logits [N, V] -> Verdict whose emitted tokens are distributed exactly as the target's.

    Emitted sequence = tree.tokens[nodes[1:]] followed by next_token. Loops over accepted depth only; each level
    tests all of the node's children with one vector of uniforms.
    """
    _check(tree, logits)
    if cfg.greedy:
        raise ValueError("verify_sampling needs temperature > 0; use verify_greedy")
    # The tree structure is tiny and the walk is sequential: keep it on the host, touch the device once per level.
    parents, tokens = tree.parents.cpu(), tree.tokens.cpu()
    # A sibling repeating an earlier sibling's token is never accepted (that token's p is already 0 by then), and
    # trying it again would count its mass twice: detach it from the walk once, up front (first occurrence wins).
    idx = torch.arange(parents.shape[0])
    dup = ((parents[:, None] == parents[None, :]) & (tokens[:, None] == tokens[None, :])
           & (idx[None, :] < idx[:, None])).any(dim=1)           # [N]; (bool .tril() is very slow on CPU)
    walk_parents = parents.masked_fill(dup, -2)
    node, accepted = 0, [0]
    while True:
        p = logits_to_probs(logits[node], cfg)                   # [V] target distribution after `node`
        kids = (walk_parents == node).nonzero().squeeze(-1)      # [m] distinct children in node order
        if kids.numel() == 0:
            # Leaf (or whole path accepted): the bonus token straight from the target
            return Verdict(nodes=torch.tensor(accepted, device=tree.tokens.device), next_token=sample(p, generator))
        toks = tokens[kids]                                      # [m]

        # Trying children in order with "accept x w.p. p[x], else zero it and renormalise" means child j is accepted
        # with p[x_j] / (mass not yet rejected). That mass is computed as (mass off the children) + (suffix sum over
        # the children) instead of 1 - prefix sum: when the children hold all the mass, the last one with p > 0 gets
        # exactly p/p = 1, so rounding can never leave an all-zero residual to renormalise (which would be NaN).
        dev_toks = toks.to(p.device)
        residual = p.index_fill(0, dev_toks, 0.0)                # [V] p with every child removed
        mass = torch.cat([p[dev_toks], residual.sum()[None]]).double().cpu()  # [m + 1], one transfer per level
        px, rest = mass[:-1], mass[-1]
        remaining = rest + px.flip(0).cumsum(0).flip(0)          # [m] mass still untried when child j comes up
        cond = torch.where(remaining > 0, px / remaining, torch.zeros_like(px)).clamp(max=1.0)
        u = torch.rand(cond.shape[0], generator=generator, device=generator.device, dtype=torch.float64).cpu()
        # Strict <: U in [0, 1), so cond 1 always accepts and a token filtered to p = 0 never does.
        hit = (u < cond).nonzero()
        if hit.numel() == 0:
            # Everything rejected: the recovered token comes from the residual (rest > 0 here, see above)
            return Verdict(nodes=torch.tensor(accepted, device=tree.tokens.device),
                           next_token=sample(residual / residual.sum(), generator))
        node = int(kids[int(hit[0])])
        accepted.append(node)


def verify_rows(trees: list[DraftTree], logits: torch.Tensor, samplings: list[SamplingConfig],
                generators: list[torch.Generator]) -> list[Verdict]:
    """A batch's verdicts: trees[b] (N nodes each) against logits[b] [N,V], under samplings[b] / generators[b].
    The greedy rows are decided from one argmax over all of their nodes (one read from the device), each walked
    on the host as verify_greedy walks it; each sampled row walks its own tree with its own generator."""
    out: list[Verdict | None] = [None] * len(trees)
    greedy = [b for b, s in enumerate(samplings) if s.greedy]
    if greedy:
        top, = host(argmax(logits if len(greedy) == len(trees) else logits[greedy]))       # [G,N]
        top = top.numpy()
        for j, b in enumerate(greedy):
            _check(trees[b], logits[b])
            if trees[b].tokens.device.type == "cpu":
                out[b] = _verify_greedy_host(trees[b], top[j])
            else:
                out[b] = verify_greedy(trees[b], logits[b])
    for b, s in enumerate(samplings):
        if not s.greedy:
            out[b] = verify_sampling(trees[b], logits[b], s, generators[b])
    return out
