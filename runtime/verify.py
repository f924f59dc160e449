"""Acceptance: given a drafted tree and the target's logits at every node, which nodes to keep and what comes next.

This module owns the lossless guarantee (as the official code's evaluate_posterior). Greedy: accept the longest
root path whose every token is the target's argmax at its parent, then emit the argmax after it. Sampling: the
same walk, with the target's sample in place of its argmax. A request's sample at output position t is drawn from
noise fixed by its seed and t (sampling.draw), so at each node the target draws exactly the token vanilla decoding
would draw there; the walk follows the child holding it. The emitted sequence is therefore the vanilla engine's
sampled sequence for that seed, token for token (up to float ties, as greedy), and so distributed exactly as the
target's. A child is accepted with probability p(x), the most any verifier can accept a drafted token with (the
same as sequential rejection over the children, without its residual draws).

Row i of `logits` is the target's next-token distribution after node i (root and its ancestors in context).
"""
from __future__ import annotations

import numpy as np
import torch

from .device import host
from .sampling import argmax, draw, logits_to_probs
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


def verify_sampling(tree: DraftTree, logits: torch.Tensor, cfg: SamplingConfig, position: int) -> Verdict:
    """tree with N nodes, logits [N, V] -> Verdict: the path of the target's own samples, as vanilla would draw them.

    The root's token sits at output position `position` - 1, so the token after node i is drawn at position
    `position` + depth(i), from the target's distribution there under cfg.seed (sampling.draw). The walk
    is the greedy walk with that draw in place of the argmax: follow the child holding the drawn token while there
    is one, then emit the draw after the last accepted node. Walks only the accepted depth (one draw per level).
    """
    _check(tree, logits)
    if cfg.greedy:
        raise ValueError("verify_sampling needs temperature > 0; use verify_greedy")
    # The tree structure is tiny and the walk is sequential: keep it on the host, touch the device once per level.
    parents, tokens, depths = tree.parents.cpu().numpy(), tree.tokens.cpu().numpy(), tree.depths.cpu().numpy()
    node, accepted = 0, [0]
    while True:
        token = draw(logits_to_probs(logits[node], cfg), cfg.seed, position + int(depths[node]))
        child = np.flatnonzero((parents == node) & (tokens == token))   # a repeated sibling: the first one
        if child.size == 0:
            return Verdict(nodes=torch.tensor(accepted, device=tree.tokens.device), next_token=token)
        node = int(child[0])
        accepted.append(node)


def verify_rows(trees: list[DraftTree], logits: torch.Tensor, samplings: list[SamplingConfig],
                positions: list[int]) -> list[Verdict]:
    """A batch's verdicts: trees[b] (N nodes each) against logits[b] [N,V], under samplings[b] (and its seed), the
    root of trees[b] being the token before output position positions[b]. The greedy rows are decided from one
    argmax over all of their nodes (one read from the device), each walked on the host as verify_greedy walks it;
    each sampled row walks its own tree with its own draws."""
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
            out[b] = verify_sampling(trees[b], logits[b], s, positions[b])
    return out
