"""Plain data that moves between the drafter, the verifier and the loop.

Vocabulary used across eaglex (after vLLM): *target* is the model whose output we promise, *draft* the EAGLE head.
A cycle drafts a tree whose node 0 is the *root*: the last token emitted, not yet in the target's KV cache. The
target verifies every node in one forward; the *accepted* nodes form a root-to-node path, and the *next token* (the
bonus token when the whole path matched, the recovered token otherwise) becomes the next cycle's root.
PLACEHOLDER = -1 pads ragged index tables.

Nothing here calls a model or touches a cache.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

PLACEHOLDER = -1

# EAGLE-1's default static tree (choices.py, name inherited from Medusa): 25 nodes + root, depth 5,
# nodes per depth 4, 8, 8, 3, 2. Each entry is the path of top-k ranks from the root.
MC_SIM_7B_63: tuple[tuple[int, ...], ...] = (
    (0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0),
    (0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1, 0), (0, 1, 1), (0, 2, 0), (0, 2, 1), (1, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 0, 2), (0, 0, 0, 0, 0), (0, 0, 0, 0, 1),
)


@dataclass(frozen=True)
class DraftTree:
    tokens: torch.Tensor   # [N] int64 target token ids; tokens[0] is the root
    parents: torch.Tensor  # [N] int64 parent node index, -1 for the root; parents[i] < i (parents before children)
    depths: torch.Tensor   # [N] int64 depth of each node, root 0; position id = committed length + depth
    mask: torch.Tensor     # [N, N] bool, mask[i, j] is True when node j is node i itself or one of its ancestors
    paths: torch.Tensor    # [num_leaves, max_depth + 1] int64 node indices root -> leaf, padded with PLACEHOLDER

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])


@dataclass(frozen=True)
class DraftTip:
    """The draft's output after a request's last committed context row, which the next tree grows from: its
    hidden row and its top-k log-probs and target ids. One request: [H], [k], [k]; a batch: [B,H], [B,k], [B,k]."""
    hidden: torch.Tensor
    logp: torch.Tensor
    ids: torch.Tensor

    @staticmethod
    def stack(tips: "list[DraftTip]") -> "DraftTip":
        return DraftTip(*(torch.stack(t) for t in zip(*((x.hidden, x.logp, x.ids) for x in tips))))


@dataclass(frozen=True)
class Verdict:
    nodes: torch.Tensor  # [A + 1] int64 accepted tree nodes, root first: the rows of the target KV to keep
    next_token: int      # the target's own choice after the accepted path: bonus (all matched) or recovered token

    @property
    def num_accepted(self) -> int:
        """Drafted tokens accepted (root excluded)."""
        return int(self.nodes.shape[0]) - 1


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0            # 0 disables top-k filtering
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")


TREE_GRAMMAR = "chain:N, dynamic:TOTAL/DEPTH/TOPK, cost:DEPTH/TOPK, static or auto"
COST_MAX_NODES = 64     # cost trees: the most nodes one cycle verifies per request, root included


@dataclass(frozen=True)
class TreeConfig:
    """How a cycle drafts, in the one spelling every flag, manifest, table and report uses (`parse` / `str`):

    - ``chain:N``: N draft tokens in a line (TensorRT-LLM's ``max_draft_len=N``);
    - ``dynamic:TOTAL/DEPTH/TOPK`` (EAGLE-2): a tree DEPTH levels deep below the root, growing by expanding the
      TOPK best nodes of each level (TOPK children each), of which the best TOTAL - 1 are verified with the root.
      The official code's ``depth`` counts expansions after the first draft step: its ``total_token=60, depth=7,
      top_k=10`` is ``dynamic:60/8/10`` here;
    - ``cost:DEPTH/TOPK``: the dynamic tree's candidates, of which each cycle verifies as many as the cost model
      says pay (tree.cost_size): the best m by draft path probability, m maximising the expected tokens per
      cycle, 1 + the sum of their path probabilities, over the cycle's cost, the draft's plus the target's over
      m + 1 rows (runtime/cost.py: the curve tuning measured, stored in the engine's manifest). m is at most
      COST_MAX_NODES - 1 and the pool's size, and may be 0 (the root alone: a vanilla step) when the draft is
      unsure;
    - ``static``: EAGLE-1's fixed shape (mc_sim_7b_63, or the `choices` paths of top-k ranks);
    - ``auto`` (parse only, returns None): the engine's tuned tree.

    `depth` is always what DraftTree.depths counts: the deepest draft node, i.e. the most draft tokens one cycle
    can accept before the target's own token.
    """
    kind: str = "dynamic"
    total_tokens: int = 16   # dynamic: nodes verified per cycle, root included; cost: the most it may verify
    depth: int = 6           # draft levels below the root (chain: its length)
    top_k: int = 4           # dynamic, cost: nodes expanded per level and children per expanded node
    choices: tuple[tuple[int, ...], ...] | None = None  # static trees only; None = mc_sim_7b_63

    def __post_init__(self):
        if self.kind not in ("dynamic", "cost", "static", "chain"):
            raise ValueError(f"tree kind must be dynamic, cost, static or chain, got {self.kind!r}")
        if self.depth < 1 or self.top_k < 1 or self.total_tokens < 2:
            raise ValueError(f"bad tree {self}: depth >= 1, top_k >= 1 and total_tokens >= 2 needed")
        if self.kind == "chain":            # a chain's size follows from its length: equal chains compare equal
            object.__setattr__(self, "total_tokens", self.depth + 1)
            object.__setattr__(self, "top_k", 1)
        if self.kind == "cost":             # the root + the whole candidate pool, up to the cap
            pool = self.top_k + (self.depth - 1) * self.top_k ** 2
            object.__setattr__(self, "total_tokens", min(pool + 1, COST_MAX_NODES))

    @classmethod
    def chain(cls, n: int) -> "TreeConfig":
        return cls("chain", depth=n)

    @classmethod
    def parse(cls, text: str) -> "TreeConfig | None":
        """``chain:N`` | ``dynamic:TOTAL/DEPTH/TOPK`` | ``cost:DEPTH/TOPK`` | ``static`` | ``auto`` (-> None);
        ValueError otherwise."""
        kind, sep, arg = str(text).strip().partition(":")
        try:
            if kind == "auto" and not sep:
                return None
            if kind == "static" and not sep:
                return cls("static")
            if kind == "chain" and sep:
                return cls.chain(int(arg))
            if kind == "dynamic" and sep:
                total, depth, top_k = (int(x) for x in arg.split("/"))
                return cls("dynamic", total, depth, top_k)
            if kind == "cost" and sep:
                depth, top_k = (int(x) for x in arg.split("/"))
                return cls("cost", depth=depth, top_k=top_k)
        except ValueError as e:
            if str(e).startswith("bad tree"):
                raise ValueError(f"bad tree {text!r}: {str(e).split(': ', 1)[1]}") from None
        raise ValueError(f"bad tree {text!r}: use {TREE_GRAMMAR} (e.g. chain:3, dynamic:16/6/4, cost:6/4)")

    def __str__(self) -> str:
        if self.kind == "chain":
            return f"chain:{self.depth}"
        if self.kind == "static":
            return "static" if self.choices is None else f"static({len(self.choices)} nodes)"
        if self.kind == "cost":
            return f"cost:{self.depth}/{self.top_k}"
        return f"dynamic:{self.total_tokens}/{self.depth}/{self.top_k}"

    @property
    def max_nodes(self) -> int:
        """Upper bound of the tree size (root included): what must fit in the target's context."""
        if self.kind == "chain":
            return self.depth + 1
        if self.kind == "static":
            return len(self.choices or MC_SIM_7B_63) + 1
        return self.total_tokens
