"""Drafting one cycle's tree with the EAGLE head: the only place that calls the draft between verifications.

Each cycle first *extends* the draft's committed context with the target features of the tokens just accepted
(pairs (feature at p, token at p+1), as the official code does: only this first step sees real target features),
then grows a tree from the last row:
- dynamic (EAGLE-2): expand the best top_k candidates of each level, keep the best total_tokens-1 overall;
- chain: the dynamic tree with top_k = 1 (built directly, without the candidate pool);
- static (EAGLE-1): the fixed shape of a choices list, each node the rank-th draft candidate of its parent.
Tree rows written to the draft cache are rolled back at the end; the pure tree algebra lives in tree.py.

Devices: the candidate pool, scores and draft outputs stay on the backend's device while the tree grows (no host
read between draft steps); the finished tree is read back once and lives on the host, where the verifier walks it.
"""
from __future__ import annotations

import torch

from .backend import Backend
from .device import host, to_device
from .tree import MC_SIM_7B_63, chain_tree, next_frontier, select_dynamic, static_plan, tree_from_parents
from .types import DraftTree, TreeConfig


class Drafter:
    def __init__(self, backend: Backend, cfg: TreeConfig):
        self.backend, self.cfg = backend, cfg
        # self.depth: draft forwards after the one that extends the context (that one already yields the depth-1 nodes)
        self.top_k, self.depth, self.total = cfg.top_k, cfg.depth - 1, cfg.total_tokens
        self.plan = static_plan(cfg.choices or MC_SIM_7B_63) if cfg.kind == "static" else None
        if self.plan is not None:   # ancestor-or-self mask of the fixed shape, computed once
            self.static_anc = tree_from_parents(torch.zeros_like(self.plan.parents), self.plan.parents).mask

    def extend(self, features: torch.Tensor, next_ids: torch.Tensor, start: int):
        """Commit context pairs: features [N,F] of target positions start.., next_ids [N] the tokens after them.

        Returns (hidden of the last row [1,H], its top log-probs [k], top ids [k]) to grow the tree from.
        """
        n = next_ids.shape[0]
        pos = torch.arange(start, start + n).unsqueeze(0)
        k = self.plan.top_k if self.plan is not None else self.top_k
        h, logp, ids = self.backend.draft_forward(features.unsqueeze(0), next_ids.unsqueeze(0), pos, None,
                                                  project=True, top_k=k, last_only=True)
        self.backend.draft_commit(torch.arange(n))
        return h[0, -1:], logp[0, 0], ids[0, 0]

    def tree(self, root: int, seed: tuple[torch.Tensor, torch.Tensor, torch.Tensor], position: int) -> DraftTree:
        """Grow the tree under `root` from the extend step's output; `position` is the draft position of depth-1
        nodes (= the target position of the root; all nodes of one level share a position)."""
        try:
            if self.plan is not None:
                return self._static(root, seed, position)
            if self.top_k == 1:
                return self._chain(root, seed, position)
            return self._dynamic(root, seed, position)
        finally:
            self.backend.draft_rollback()

    def _dynamic(self, root, seed, position):
        hidden, logp, ids = seed                               # [1,H], [K], [K]
        K, depth, dev = self.top_k, self.depth, hidden.device
        # Flat candidate pool, appended level by level: K children of the root, then K*K per expansion.
        size = K + depth * K * K
        scores, tokens = torch.empty(size, device=dev), torch.empty(size, dtype=torch.long, device=dev)
        parents = torch.empty(size, dtype=torch.long, device=dev)
        scores[:K], tokens[:K], parents[:K] = logp, ids, -1
        n = K
        front = next_frontier(logp, K)                         # [F] candidate indices to expand
        front_h = hidden.expand(front.shape[0], -1)            # [F,H] draft output each frontier node came from
        mask = torch.eye(front.shape[0], dtype=torch.bool, device=dev)  # [F, processed] ancestors among processed
        for i in range(depth):
            F = front.shape[0]
            h, lp, tk = self.backend.draft_forward(front_h.unsqueeze(0), tokens[front].unsqueeze(0),
                                                   torch.full((1, F), position + i), mask.unsqueeze(0),
                                                   project=False, top_k=K)
            cu = (scores[front, None] + lp[0]).flatten()     # [F*K] cumulative log-probs of all children
            scores[n:n + F * K], tokens[n:n + F * K] = cu, tk[0].flatten()
            parents[n:n + F * K] = front.unsqueeze(1).expand(F, K).reshape(-1)   # = repeat_interleave(K)
            pick = next_frontier(cu, K)                        # best K children over the whole level
            rows = pick // K
            front, front_h, n = pick + n, h[0, rows], n + F * K
            mask = torch.cat([mask[rows], torch.eye(pick.shape[0], dtype=torch.bool, device=dev)], 1)
        return select_dynamic(scores[:n], tokens[:n], parents[:n], root, self.total)

    def _chain(self, root, seed, position):
        """top_k = 1: the dynamic path would keep all depth candidates in order (total = depth + 1), so the
        chain is built directly: each step feeds its parent's top-1 token and output row, with the causal mask
        (a chain node's ancestors are exactly the rows drafted before it), and no candidate pool or rerank."""
        hidden, _, ids = seed                                  # [1,H], [1], [1]
        last = ids[:1].view(1, 1)                              # each step's token stays where the draft runs
        tokens = [last]
        for i in range(self.depth):
            h, _, tk = self.backend.draft_forward(hidden.unsqueeze(0), last, torch.tensor([[position + i]]), None,
                                                  project=False, top_k=1)
            hidden, last = h[0], tk[0]
            tokens.append(last)
        drafted, = host(torch.cat(tokens).view(-1))
        return chain_tree(torch.cat([torch.tensor([root]), drafted]))

    def _static(self, root, seed, position):
        plan = self.plan
        hidden, logp, ids = seed
        N, dev = plan.parents.shape[0], hidden.device
        tokens = torch.zeros(N, dtype=torch.long, device=dev)
        tokens[0] = root
        top_ids = {0: ids}                                     # node -> its draft top-k target ids [k]
        out_h = {0: hidden[0]}                                 # node -> draft output row its children read
        processed: list[int] = []                              # draft rows written this cycle, by node
        for d, expand in enumerate(plan.expand):
            level = (plan.depths == d + 1).nonzero().flatten()
            par = plan.parents[level]
            tokens[to_device(level, dev)] = torch.stack([top_ids[int(p)][int(r)]
                                                         for p, r in zip(par, plan.ranks[level])])
            if d + 1 >= len(plan.expand):
                break
            nxt = plan.expand[d + 1]                           # nodes at depth d+1 that have children
            if nxt.numel() == 0:
                break
            hid = torch.stack([out_h[int(plan.parents[n])] for n in nxt])
            anc = self._ancestor_rows(nxt, processed)
            h, lp, tk = self.backend.draft_forward(hid.unsqueeze(0), tokens[to_device(nxt, dev)].unsqueeze(0),
                                                   torch.full((1, nxt.shape[0]), position + d),
                                                   anc.unsqueeze(0), project=False, top_k=plan.top_k)
            for j, n in enumerate(nxt.tolist()):
                top_ids[n], out_h[n] = tk[0, j], h[0, j]
            processed += nxt.tolist()
        return tree_from_parents(host(tokens)[0], plan.parents)

    def _ancestor_rows(self, nodes: torch.Tensor, processed: list[int]) -> torch.Tensor:
        """[len(nodes), len(processed) + len(nodes)] mask: each node sees its processed ancestors and itself."""
        cols = torch.tensor(processed + nodes.tolist(), dtype=torch.long)
        return self.static_anc[nodes][:, cols]
