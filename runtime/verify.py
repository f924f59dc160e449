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
    return _greedy([tree], argmax(logits)[None])[0]


def _greedy(trees: list[DraftTree], top: torch.Tensor) -> list[Verdict]:
    """Greedy verdicts of `trees` from the target's argmax after each of their nodes (top [G,N], any device): one
    read of everything to the host, then each tree walked in numpy (a few tens of elements: ~10 torch dispatches
    of a few us each would cost more than the walk)."""
    arrays = [a.numpy() for a in host(top, *(t for tree in trees for t in (tree.parents, tree.tokens, tree.paths)))]
    return [_walk(*arrays[1 + 3 * j:4 + 3 * j], arrays[0][j]) for j in range(len(trees))]


def _walk(parents: np.ndarray, tokens: np.ndarray, paths: np.ndarray, top: np.ndarray) -> Verdict:
    # A node is correct when its token is what the target would emit after its parent; the root is given.
    correct = (tokens == top[np.maximum(parents, 0)]) | (parents < 0)
    match = correct[np.maximum(paths, 0)] & (paths >= 0)                   # [L, D] root -> leaf, -1 padded
    # Like evaluate_posterior: accepted length per path = run of matches after the root; first best path wins.
    acc = np.cumprod(match[:, 1:], axis=1).sum(axis=1)
    best = int(np.argmax(acc))
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
        for b in greedy:
            _check(trees[b], logits[b])
        top = argmax(logits if len(greedy) == len(trees) else logits[greedy])              # [G,N]
        for b, verdict in zip(greedy, _greedy([trees[b] for b in greedy], top)):
            out[b] = verdict
    for b, s in enumerate(samplings):
        if not s.greedy:
            out[b] = verify_sampling(trees[b], logits[b], s, positions[b])
    return out
