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


@dataclass(frozen=True)
class TreeConfig:
    """How a cycle drafts. `kind`: dynamic (EAGLE-2), static (EAGLE-1 choices list) or chain (top_k = 1).

    dynamic: `depth` expansion forwards after the first draft forward, `top_k` nodes expanded per level and
    children per node, `total_tokens` nodes verified including the root (so total_tokens - 1 drafted nodes).
    chain: depth + 1 drafted tokens. static: the choices list fixes the shape; depth/top_k/total_tokens are unused.
    """
    kind: str = "dynamic"
    total_tokens: int = 60
    depth: int = 7
    top_k: int = 10
    choices: tuple[tuple[int, ...], ...] | None = None  # static trees only; None = mc_sim_7b_63

    def __post_init__(self):
        if self.kind not in ("dynamic", "static", "chain"):
            raise ValueError(f"tree kind must be dynamic, static or chain, got {self.kind!r}")
        if self.depth < 0 or self.top_k < 1 or self.total_tokens < 2:
            raise ValueError(f"bad tree: depth={self.depth} (>= 0), top_k={self.top_k} (>= 1), "
                             f"total_tokens={self.total_tokens} (>= 2)")

    @property
    def max_nodes(self) -> int:
        """Upper bound of the tree size (root included): what must fit in the target's context."""
        if self.kind == "chain":
            return self.depth + 2
        if self.kind == "static":
            from .tree import MC_SIM_7B_63
            return len(self.choices or MC_SIM_7B_63) + 1
        return self.total_tokens
