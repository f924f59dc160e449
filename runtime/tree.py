"""Draft-tree shapes: building a DraftTree from parent pointers, the EAGLE-2 rerank, and EAGLE-1 static plans.

This module owns the tree *structure* (reference: eagle.md section 3): which node hangs under which, the
ancestor mask the target attends with, the root-to-leaf paths the verifier walks, the frontier an EAGLE-2 drafter
expands, and the node layout of an EAGLE-1 choices list. It never sees a model or a cache; the drafters produce
tokens and scores, this turns them into index tables.

Node invariant (types.DraftTree): node 0 is the root and parents[i] < i, so a parent always precedes its children
and ancestor indices increase along every root-to-leaf path.
"""
from __future__ import annotations

import math

from dataclasses import dataclass

import torch

from .types import PLACEHOLDER, DraftTree

# EAGLE-1's default static tree (choices.py, name inherited from Medusa): 25 nodes + root, depth 5,
# nodes per depth 4, 8, 8, 3, 2. Each entry is the path of top-k ranks from the root.
MC_SIM_7B_63: tuple[tuple[int, ...], ...] = (
    (0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0),
    (0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1, 0), (0, 1, 1), (0, 2, 0), (0, 2, 1), (1, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 0, 2), (0, 0, 0, 0, 0), (0, 0, 0, 0, 1),
)


def tree_from_parents(tokens: torch.Tensor, parents: torch.Tensor) -> DraftTree:
    """tokens [N] int64, parents [N] int64 (parents[0] == -1, 0 <= parents[i] < i) -> DraftTree."""
    if tokens.dim() != 1 or parents.shape != tokens.shape or tokens.numel() == 0:
        raise ValueError(f"tokens and parents must be equal non-empty 1-D tensors, got "
                         f"{tuple(tokens.shape)} and {tuple(parents.shape)}")
    n = tokens.shape[0]
    parents = parents.long()
    idx = torch.arange(n, device=parents.device)
    if int(parents[0]) != -1:
        raise ValueError(f"parents[0] must be -1 (node 0 is the root), got {int(parents[0])}")
    bad = (parents[1:] < 0) | (parents[1:] >= idx[1:])
    if bool(bad.any()):
        i = int(bad.nonzero()[0]) + 1
        raise ValueError(f"node {i} has parent {int(parents[i])}; need 0 <= parents[i] < i")

    # Pointer jumping, one step per depth level: cur[i] walks from i up to the root, marking each ancestor.
    mask = torch.eye(n, dtype=torch.bool, device=parents.device)
    cur = parents.clone()
    while bool((cur >= 0).any()):
        live = cur >= 0
        mask[idx[live], cur[live]] = True
        cur = torch.where(live, parents[cur.clamp(min=0)], cur)
    depths = mask.sum(dim=1) - 1

    # A leaf is nobody's parent. Its ancestors-or-self sorted by index are its root->leaf path (indices increase
    # with depth); absent columns sort last as n, which also makes n act as +inf in the row ordering below.
    is_parent = torch.zeros(n, dtype=torch.bool, device=parents.device)
    is_parent[parents[1:]] = True
    leaves = (~is_parent).nonzero().squeeze(-1)
    width = int(depths.max()) + 1
    rows = torch.where(mask[leaves], idx, n).sort(dim=-1).values[:, :width]  # [num_leaves, max_depth + 1]

    # Lexicographic row order, like the official retrieve_indices. Entries are < n + 1, so a row read as a number
    # in base n + 1 is one int64 sort key while it fits (n=60: up to depth 9); otherwise stable sorts per column.
    if width * math.log2(n + 1) < 62:
        weights = (n + 1) ** torch.arange(width - 1, -1, -1, device=rows.device)
        order = torch.argsort((rows * weights).sum(-1))
    else:
        order = torch.arange(rows.shape[0], device=rows.device)
        for c in range(width - 1, -1, -1):
            order = order[torch.sort(rows[order, c], stable=True).indices]
    paths = rows[order].masked_fill(rows[order] == n, PLACEHOLDER)
    return DraftTree(tokens=tokens.long(), parents=parents, depths=depths, mask=mask, paths=paths)


def next_frontier(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores [C] -> [min(k, C)] int64 indices of the best scores, best first; ties go to the lower index."""
    return torch.sort(scores, descending=True, stable=True).indices[:k]


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
    cand = torch.arange(c, device=scores.device)
    if bool(((parents < -1) | (parents >= cand)).any()):
        raise ValueError("candidate parents must satisfy -1 <= parents[c] < c")

    m = min(num_nodes - 1, c)
    keep = next_frontier(scores, m).sort().values                   # [M] candidate indices in draft order
    slot = torch.full((c,), -1, dtype=torch.long, device=scores.device)
    slot[keep] = torch.arange(1, m + 1, device=scores.device)      # candidate -> node index (root is node 0)
    par = parents[keep].long()
    node_par = torch.where(par < 0, 0, slot[par.clamp(min=0)])
    lost = node_par < 0
    if bool(lost.any()):
        # The official code would silently attach such a node to the wrong slot (eagle.md 3.2); refuse instead.
        bad = int(keep[lost][0])
        raise ValueError(f"disconnected selection: candidate {bad} kept but its parent {int(parents[bad])} was not "
                         f"(scores must not increase along a path)")
    root = torch.full((1,), root_token, dtype=torch.long, device=tokens.device)
    node_tokens = torch.cat([root, tokens[keep].long()])
    node_parents = torch.cat([torch.full((1,), -1, dtype=torch.long, device=par.device), node_par])
    return tree_from_parents(node_tokens, node_parents)


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


def static_plan(choices) -> StaticPlan:
    """choices: iterable of rank paths, e.g. MC_SIM_7B_63. Built once per run, so plain Python is fine here."""
    nodes = [tuple(int(r) for r in ch) for ch in choices]
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
