"""Draft-tree shapes: building a DraftTree from parent pointers, the EAGLE-2 rerank, the cost tree's size, and
EAGLE-1 static plans.

This module owns the tree *structure*: which node hangs under which, the ancestor mask the target attends with, the
root-to-leaf paths the verifier walks, the frontier an EAGLE-2 drafter expands, how many candidates a cost tree
verifies, and the node layout of an EAGLE-1 choices list. It never sees a model or a cache; the drafters produce
tokens and scores, this turns them into index tables.

Node invariant (types.DraftTree): node 0 is the root and parents[i] < i, so a parent always precedes its children
and ancestor indices increase along every root-to-leaf path.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from .device import host
from .types import MC_SIM_7B_63, PLACEHOLDER, DraftTree


def tree_from_parents(tokens: torch.Tensor, parents: torch.Tensor) -> DraftTree:
    """tokens [N] int64, parents [N] int64 (parents[0] == -1, 0 <= parents[i] < i) -> DraftTree.

    Trees hold tens of nodes and this runs once per cycle, so the work is done in numpy on the host: each torch op
    costs ~5-10 us of dispatch at this size, which used to be most of the loop's per-cycle overhead.
    """
    if tokens.dim() != 1 or parents.shape != tokens.shape or tokens.numel() == 0:
        raise ValueError(f"tokens and parents must be equal non-empty 1-D tensors, got "
                         f"{tuple(tokens.shape)} and {tuple(parents.shape)}")
    device = tokens.device
    par = parents.detach().to("cpu", torch.long).numpy()
    n = par.shape[0]
    idx = np.arange(n)
    if par[0] != -1:
        raise ValueError(f"parents[0] must be -1 (node 0 is the root), got {int(par[0])}")
    bad = (par[1:] < 0) | (par[1:] >= idx[1:])
    if bad.any():
        i = int(bad.nonzero()[0][0]) + 1
        raise ValueError(f"node {i} has parent {int(par[i])}; need 0 <= parents[i] < i")

    # Pointer jumping, one step per depth level: cur[i] walks from i up to the root, marking each ancestor.
    mask = np.eye(n, dtype=bool)
    cur = par.copy()
    live = cur >= 0
    while live.any():
        mask[idx[live], cur[live]] = True
        cur = np.where(live, par[np.maximum(cur, 0)], cur)
        live = cur >= 0
    depths = mask.sum(1) - 1

    # A leaf is nobody's parent. Its ancestors-or-self sorted by index are its root->leaf path (indices increase
    # with depth); absent columns sort last as n, which also makes n act as +inf in the row ordering below.
    is_parent = np.zeros(n, dtype=bool)
    is_parent[par[1:]] = True
    leaves = (~is_parent).nonzero()[0]
    width = int(depths.max()) + 1
    rows = np.sort(np.where(mask[leaves], idx, n), axis=1)[:, :width]      # [num_leaves, max_depth + 1]
    # Lexicographic row order, like the official retrieve_indices (lexsort's last key is the primary one).
    rows = rows[np.lexsort(rows.T[::-1])]
    paths = np.where(rows == n, PLACEHOLDER, rows)
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
    return DraftTree(tokens=tokens.long(), parents=t(par), depths=t(depths.astype(np.int64)), mask=t(mask),
                     paths=t(paths.astype(np.int64)))


@functools.lru_cache(maxsize=64)
def _chain_shape(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    idx = torch.arange(n)
    return idx - 1, idx, torch.ones(n, n, dtype=torch.bool).tril_(), idx[None].clone()


def chain_tree(tokens: torch.Tensor) -> DraftTree:
    """tokens [N] -> the chain root -> tokens[1] -> ... (what tree_from_parents gives for parents i - 1), with the
    index tables built once per length: a chain's shape never changes, only its tokens."""
    if tokens.dim() != 1 or tokens.numel() == 0:
        raise ValueError(f"tokens must be a non-empty 1-D tensor, got {tuple(tokens.shape)}")
    parents, depths, mask, paths = (t.clone() for t in _chain_shape(int(tokens.shape[0])))   # callers own them
    return DraftTree(tokens=tokens.long(), parents=parents, depths=depths, mask=mask, paths=paths)


def next_frontier(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores [..., C] -> [..., min(k, C)] int64 indices of the best scores of each row, best first; ties go to the
    lower index."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


def select_dynamic(scores: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                   root_token: int, num_nodes: int) -> DraftTree:
    """EAGLE-2 rerank of the drafted candidates into the verified tree.

    scores [C] float cumulative log-probs, tokens [C] int64, parents [C] int64 candidate index of the parent
    (-1 = root, parents[c] < c because candidates are appended level by level). Keeps the best num_nodes - 1
    candidates (ties to the lower index, so a parent - never scored below its child and always earlier - wins),
    in candidate order, behind the root.
    """
    c = scores.shape[0]
    if tokens.shape != (c,) or parents.shape != (c,):
        raise ValueError(f"scores, tokens, parents must all be [C]; got {tuple(scores.shape)}, "
                         f"{tuple(tokens.shape)}, {tuple(parents.shape)}")
    if num_nodes < 1:
        raise ValueError(f"num_nodes must be >= 1 (the root), got {num_nodes}")
    # Host-side numpy for the same reason as tree_from_parents: C is ~100-700, the per-op dispatch dominates.
    # A pool drafted on a GPU is read back here, in one synchronisation; the tree is built on the host.
    scores, tokens, parents = host(scores.detach(), tokens, parents)
    s_np = scores.to(torch.float32).numpy()
    p_np = parents.to(torch.long).numpy()
    if ((p_np < -1) | (p_np >= np.arange(c))).any():
        raise ValueError("candidate parents must satisfy -1 <= parents[c] < c")

    m = min(num_nodes - 1, c)
    keep = np.sort(np.argsort(-s_np, kind="stable")[:m])            # [M] best first, ties to the lower index
    slot = np.full(c, -1, dtype=np.int64)
    slot[keep] = np.arange(1, m + 1)                                 # candidate -> node index (root is node 0)
    par = p_np[keep]
    node_par = np.where(par < 0, 0, slot[np.maximum(par, 0)])
    lost = node_par < 0
    if lost.any():
        # The official code would silently attach such a node to the wrong slot; refuse instead.
        bad = int(keep[lost][0])
        raise ValueError(f"disconnected selection: candidate {bad} kept but its parent {int(p_np[bad])} was not "
                         f"(scores must not increase along a path)")
    keep_t = torch.from_numpy(keep).to(tokens.device)
    node_tokens = torch.cat([torch.tensor([root_token], dtype=torch.long, device=tokens.device),
                             tokens[keep_t].long()])
    node_parents = torch.from_numpy(np.concatenate([[-1], node_par]))
    return tree_from_parents(node_tokens, node_parents)


def cost_size(scores, verify_ms, fixed_ms: float) -> int:
    """How many candidates a cost tree verifies with the root: the m maximising expected tokens per millisecond.

    scores [C] or [B, C] cumulative draft log-probs of each request's candidates (any order); verify_ms [M + 1]:
    verify_ms[m] is the target forward verifying every request's root + m candidates; fixed_ms: the rest of a
    cycle, which m does not change (the draft's levels). Each request verifies its best m candidates (select_dynamic:
    a best-first prefix is always a connected tree), and a node is accepted with about its path probability
    exp(score), so a cycle commits about sum over requests of 1 + sum_{i<=m} exp(score_i) tokens (the 1: the
    target's own token). m runs over 0..min(C, M) (0: the root alone); ties go to the smaller m.
    """
    s = np.atleast_2d(np.asarray(scores, dtype=np.float64))
    cost = np.asarray(verify_ms, dtype=np.float64)
    if cost.ndim != 1 or cost.shape[0] < 1:
        raise ValueError(f"verify_ms must be [M + 1] with M >= 0, got shape {cost.shape}")
    m = min(s.shape[1], cost.shape[0] - 1)
    p = np.exp(-np.sort(-s, axis=1)[:, :m])                         # [B, m] path probabilities, best first
    gain = s.shape[0] + np.concatenate([[0.0], np.cumsum(p.sum(0))])  # [m + 1] expected tokens, 0..m candidates
    return int(np.argmax(gain / (fixed_ms + cost[: m + 1])))        # the first maximum: the smaller m


@dataclass(frozen=True)
class StaticPlan:
    """Node layout of an EAGLE-1 static tree; node 0 = root, the rest sorted by (depth, lexicographic choice)."""
    parents: torch.Tensor            # [N] int64, -1 for the root
    ranks: torch.Tensor              # [N] int64 top-k rank of each node among its parent's draft candidates, -1 root
    depths: torch.Tensor             # [N] int64, root 0
    expand: tuple[torch.Tensor, ...]  # expand[d] = int64 node indices at depth d with children; expand[0] = [0]
    top_k: int                       # candidates the draft must produce per expanded node (max rank + 1)

    @property
    def size(self) -> int:
        return int(self.parents.shape[0])


def static_plan(choices=None) -> StaticPlan:
    """choices: iterable of rank paths (None: MC_SIM_7B_63). Built once per run, so plain Python is fine here."""
    nodes = [tuple(int(r) for r in ch) for ch in (MC_SIM_7B_63 if choices is None else choices)]
    if not nodes:
        raise ValueError("a static tree needs at least one choice")
    seen = set(nodes)
    if len(seen) != len(nodes):
        raise ValueError("static tree choices contain duplicates")
    for ch in nodes:
        if len(ch) == 0:
            raise ValueError("empty choice: the root is implicit, do not list it")
        if min(ch) < 0:
            raise ValueError(f"choice {list(ch)} has a negative rank")
        for d in range(1, len(ch)):
            if ch[:d] not in seen:
                raise ValueError(f"choice {list(ch)} needs its prefix {list(ch[:d])} to be a choice too")

    nodes.sort(key=lambda ch: (len(ch), ch))
    index = {ch: i + 1 for i, ch in enumerate(nodes)}
    index[()] = 0
    parents = torch.tensor([-1] + [index[ch[:-1]] for ch in nodes], dtype=torch.long)
    ranks = torch.tensor([-1] + [ch[-1] for ch in nodes], dtype=torch.long)
    depths = torch.tensor([0] + [len(ch) for ch in nodes], dtype=torch.long)
    has_child = torch.zeros(len(nodes) + 1, dtype=torch.bool)
    has_child[parents[1:]] = True
    max_depth = int(depths.max())
    expand = tuple((has_child & (depths == d)).nonzero().squeeze(-1) for d in range(max_depth))
    return StaticPlan(parents=parents, ranks=ranks, depths=depths, expand=expand, top_k=int(ranks.max()) + 1)
