"""Drafting one cycle's trees with the EAGLE head, for a batch of requests (a lone request is a batch of one).

Each cycle first *extends* the draft's committed context with the target features of the tokens just accepted
(pairs (feature at p, token at p+1), as the official code does: only this first step sees real target features;
runtime/batch.py runs that step), then grows a tree per request from its last row (types.DraftTip):
- dynamic (EAGLE-2): expand the best top_k candidates of each level, keep the best total_tokens-1 overall;
- cost: the dynamic pool, of which the best m are kept, m chosen per step by the cost model (tree.cost_size over
  the cost curve, runtime/cost.py): one m for all the requests of a step, whose trees one forward verifies;
- chain: the dynamic tree with top_k = 1 (built directly, without the candidate pool);
- static (EAGLE-1): the fixed shape of a choices list, each node the rank-th draft candidate of its parent.
Every level is one draft forward over all requests, each batch row masked to its own request's draft context and
its own ancestors among that request's tree rows; every request expands the same number of nodes per level, so the
rows line up without padding. The caller rolls the tree rows back; the pure tree algebra lives in tree.py.

Devices: the candidate pool, scores and draft outputs stay on the backend's device while the trees grow (no host
read between draft steps); the finished trees are read back once and live on the host, where the verifier walks
them.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from .cost import CostCurve
from .device import host, to_device
from .tree import chain_tree, cost_size, next_frontier, select_dynamic, static_plan, tree_from_parents
from .types import DraftTip, DraftTree, TreeConfig

# forward(hidden [B,N,H], input_ids [B,N], position_ids [B,N], mask, project, top_k) -> (hidden, logp, ids): a
# Backend.draft_forward bound to the batch's slots
DraftForward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


class Drafter:
    def __init__(self, cfg: TreeConfig, cost: CostCurve | None = None):
        """`cost`: the curve a cost tree sizes its verifications by (needed to grow one, not for its shape)."""
        self.cfg, self.cost = cfg, cost
        # self.depth: draft forwards after the one that extends the context (that one already yields the depth-1 nodes)
        self.top_k, self.depth, self.total = cfg.top_k, cfg.depth - 1, cfg.total_tokens
        self._verify_ms: dict[int, np.ndarray] = {}      # batch size -> verify_ms for cost_size
        self.plan = static_plan(cfg.choices) if cfg.kind == "static" else None
        if self.plan is not None:   # ancestor-or-self mask of the fixed shape, computed once
            self.static_anc = tree_from_parents(torch.zeros_like(self.plan.parents), self.plan.parents).mask

    @property
    def tip_k(self) -> int:
        """Candidates the tip must hold: what the first level picks from."""
        return self.plan.top_k if self.plan is not None else self.top_k

    @property
    def max_path(self) -> int:
        """Most nodes an accepted path holds, root included: the context pairs one cycle adds."""
        return int(self.plan.depths.max()) + 1 if self.plan is not None else self.cfg.depth + 1

    @property
    def draft_rows(self) -> int:
        """Draft-cache rows one growth writes past the committed ones (rolled back afterwards)."""
        if self.plan is not None:
            return sum(int(e.numel()) for e in self.plan.expand[1:])
        return self.depth * self.top_k

    def grow(self, forward: DraftForward, tip: DraftTip, roots: list[int], positions: torch.Tensor,
             room: int | None = None) -> list[DraftTree]:
        """One tree per request under `roots` [B] from the batch's tips ([B,H], [B,k], [B,k]); `positions` [B]
        int64 are the draft positions of the depth-1 nodes (= the target position of each root; all nodes of one
        level share a position). `room`: the most nodes the requests' context has left (a cost tree stays within
        it; the other kinds are only grown where their whole size fits)."""
        if self.plan is not None:
            return self._static(forward, tip, roots, positions)
        if self.top_k == 1 and self.cfg.kind != "cost":
            return self._chain(forward, tip, roots, positions)
        return self._dynamic(forward, tip, roots, positions, room)

    def _dynamic(self, forward, tip, roots, positions, room=None):
        K, depth = self.top_k, self.depth
        hidden, logp, ids = tip.hidden, tip.logp[:, :K], tip.ids[:, :K]      # [B,H], [B,K], [B,K]
        (B, H), dev = hidden.shape, hidden.device
        # Flat candidate pool per request, appended level by level: K children of the root, then K*K per expansion.
        size = K + depth * K * K
        scores = torch.empty(B, size, device=dev)
        tokens = torch.empty(B, size, dtype=torch.long, device=dev)
        parents = torch.empty(B, size, dtype=torch.long, device=dev)
        scores[:, :K], tokens[:, :K], parents[:, :K] = logp, ids, -1
        n = K
        front = next_frontier(logp, K)                                   # [B,F] candidates to expand
        F = front.shape[1]
        front_h = hidden[:, None].expand(B, F, H)                        # [B,F,H] draft output they came from
        # [B,F,processed+F]: each frontier row sees its own ancestors among its request's tree rows (and its
        # request's committed draft context, which every row sees)
        mask = torch.eye(F, dtype=torch.bool, device=dev).expand(B, F, F)
        for i in range(depth):
            F = front.shape[1]
            h, lp, tk = forward(front_h, tokens.gather(1, front), (positions[:, None] + i).expand(B, F).contiguous(),
                                mask.contiguous(), False, K)
            cu = (scores.gather(1, front)[:, :, None] + lp).reshape(B, F * K)   # cumulative log-probs of children
            scores[:, n:n + F * K], tokens[:, n:n + F * K] = cu, tk.reshape(B, F * K)
            parents[:, n:n + F * K] = front.repeat_interleave(K, dim=1)
            pick = next_frontier(cu, K)                                  # best K children of the level, per request
            came = pick // K                                             # the frontier row each came from
            front, n = pick + n, n + F * K
            F = front.shape[1]
            front_h = h.gather(1, came[..., None].expand(B, F, h.shape[-1]))
            mask = torch.cat([mask.gather(1, came[..., None].expand(B, F, mask.shape[-1])),
                              torch.eye(F, dtype=torch.bool, device=dev).expand(B, F, F)], 2)
        scores, tokens, parents = host(scores[:, :n], tokens[:, :n], parents[:, :n])   # one read of every pool
        total = self._cost_nodes(scores.numpy(), room) if self.cfg.kind == "cost" else self.total
        return [select_dynamic(scores[b], tokens[b], parents[b], roots[b], total) for b in range(B)]

    def _cost_nodes(self, scores: np.ndarray, room: int | None = None) -> int:
        """A cost tree's size this step (root included, at most `room`) for the pools `scores` [B, C]: one size for
        the batch, as
        one target forward verifies all its trees ([B, nodes] rows: a smaller tree padded would cost the same), so
        cost_size weighs the requests' expected tokens together against t(B * nodes). The draft's share of the
        cycle is fixed whatever the size: the forward extending each context by what it accepted and the tree's
        levels, each about a forward over B * top_k rows. Per-cycle host work (tree building, verification) is
        not counted."""
        if self.cost is None:
            raise ValueError(f"the cost tree {self.cfg} needs the cost curve (runtime/cost.py)")
        B = scores.shape[0]
        if B not in self._verify_ms:
            self._verify_ms[B] = np.array([self.cost.verify(B * n) for n in range(1, self.total + 1)])
        fixed = (self.depth + 1) * self.cost.draft(B * self.top_k)
        return cost_size(scores, self._verify_ms[B][:room], fixed) + 1

    def _chain(self, forward, tip, roots, positions):
        """top_k = 1: the dynamic path would keep all depth candidates in order (total = depth + 1), so the
        chain is built directly: each step feeds its parent's top-1 token and output row, with the causal mask
        (a chain node's ancestors are exactly the rows drafted before it), and no candidate pool or rerank."""
        hidden, last = tip.hidden[:, None], tip.ids[:, :1]               # [B,1,H], [B,1]: stay where the draft runs
        drafted = [last]
        for i in range(self.depth):
            h, _, tk = forward(hidden, last, positions[:, None] + i, None, False, 1)
            hidden, last = h, tk[:, :, 0]
            drafted.append(last)
        drafted, = host(torch.cat(drafted, 1))                           # [B, depth + 1]
        return [chain_tree(torch.cat([torch.tensor([root]), d])) for root, d in zip(roots, drafted)]

    def _static(self, forward, tip, roots, positions):
        plan = self.plan
        hidden, ids = tip.hidden, tip.ids                                # [B,H], [B,k]
        B, N, dev = hidden.shape[0], plan.parents.shape[0], hidden.device
        tokens = torch.zeros(B, N, dtype=torch.long, device=dev)
        tokens[:, 0] = to_device(torch.tensor(roots), dev)
        top_ids = {0: ids}                                     # node -> its draft top-k target ids [B,k]
        out_h = {0: hidden}                                    # node -> draft output row its children read [B,H]
        processed: list[int] = []                              # draft rows written this cycle, by node
        for d, expand in enumerate(plan.expand):
            level = (plan.depths == d + 1).nonzero().flatten()
            par = plan.parents[level]
            tokens[:, to_device(level, dev)] = torch.stack([top_ids[int(p)][:, int(r)]
                                                            for p, r in zip(par, plan.ranks[level])], 1)
            if d + 1 >= len(plan.expand):
                break
            nxt = plan.expand[d + 1]                           # nodes at depth d+1 that have children
            if nxt.numel() == 0:
                break
            hid = torch.stack([out_h[int(plan.parents[n])] for n in nxt], 1)
            anc = self._ancestor_rows(nxt, processed)
            h, lp, tk = forward(hid, tokens[:, to_device(nxt, dev)],
                                (positions[:, None] + d).expand(B, nxt.shape[0]).contiguous(),
                                anc.expand(B, -1, -1).contiguous(), False, plan.top_k)
            for j, n in enumerate(nxt.tolist()):
                top_ids[n], out_h[n] = tk[:, j], h[:, j]
            processed += nxt.tolist()
        tokens, = host(tokens)
        return [tree_from_parents(t, plan.parents) for t in tokens]

    def _ancestor_rows(self, nodes: torch.Tensor, processed: list[int]) -> torch.Tensor:
        """[len(nodes), len(processed) + len(nodes)] mask: each node sees its processed ancestors and itself."""
        cols = torch.tensor(processed + nodes.tolist(), dtype=torch.long)
        return self.static_anc[nodes][:, cols]
