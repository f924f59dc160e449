"""Tree structure: masks / depths / paths from parents, the EAGLE-2 rerank, the cost tree's size, EAGLE-1 static
plans."""
import math

import numpy as np
import pytest
import torch

from eaglex.runtime.tree import (
    MC_SIM_7B_63,
    chain_tree,
    cost_size,
    next_frontier,
    select_dynamic,
    static_plan,
    tree_from_parents,
)

T, F = True, False

# (name, parents, depths, mask rows, paths)
TREES = [
    ("root-only", [-1], [0], [[T]], [[0]]),
    ("chain", [-1, 0, 1, 2], [0, 1, 2, 3],
     [[T, F, F, F], [T, T, F, F], [T, T, T, F], [T, T, T, T]], [[0, 1, 2, 3]]),
    ("star", [-1, 0, 0, 0], [0, 1, 1, 1],
     [[T, F, F, F], [T, T, F, F], [T, F, T, F], [T, F, F, T]], [[0, 1], [0, 2], [0, 3]]),
    # leaves 3 (path 0-2-3) and 4 (0-1-4): rows come out lexicographic, not in leaf order
    ("lexicographic", [-1, 0, 0, 2, 1], [0, 1, 1, 2, 2],
     [[T, F, F, F, F], [T, T, F, F, F], [T, F, T, F, F], [T, F, T, T, F], [T, T, F, F, T]],
     [[0, 1, 4], [0, 2, 3]]),
    # ragged: a depth-3 path next to depth-2 leaves, padded with -1
    ("ragged", [-1, 0, 0, 1, 1, 2, 3], [0, 1, 1, 2, 2, 2, 3],
     [[T, F, F, F, F, F, F], [T, T, F, F, F, F, F], [T, F, T, F, F, F, F], [T, T, F, T, F, F, F],
      [T, T, F, F, T, F, F], [T, F, T, F, F, T, F], [T, T, F, T, F, F, T]],
     [[0, 1, 3, 6], [0, 1, 4, -1], [0, 2, 5, -1]]),
]


@pytest.mark.parametrize("n", [1, 2, 7])
def test_chain_tree_matches_tree_from_parents(n):
    tokens = torch.arange(50, 50 + n)
    want = tree_from_parents(tokens, torch.arange(n) - 1)
    got = chain_tree(tokens)
    for field in ("tokens", "parents", "depths", "mask", "paths"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    got.mask[0, 0] = False                       # the caller owns its tables: the cached shape is untouched
    assert chain_tree(tokens).mask[0, 0]


@pytest.mark.parametrize("name,parents,depths,mask,paths", TREES, ids=[t[0] for t in TREES])
def test_tree_from_parents(name, parents, depths, mask, paths):
    tokens = torch.arange(100, 100 + len(parents))
    tree = tree_from_parents(tokens, torch.tensor(parents))
    assert tree.size == len(parents)
    assert torch.equal(tree.tokens, tokens)
    assert tree.depths.tolist() == depths
    assert tree.mask.tolist() == mask
    assert tree.paths.tolist() == paths
    assert tree.paths.dtype == torch.int64 and tree.depths.dtype == torch.int64


@pytest.mark.parametrize("tokens,parents", [
    ([1, 2], [0, 0]),           # root has a parent
    ([1, 2, 3], [-1, 0, 2]),    # self-parent
    ([1, 2, 3], [-1, 2, 0]),    # parent after child
    ([1, 2, 3], [-1, 0, -1]),   # second root
    ([1, 2, 3], [-1, 0]),       # length mismatch
    ([], []),                   # empty
])
def test_tree_from_parents_rejects(tokens, parents):
    with pytest.raises(ValueError):
        tree_from_parents(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))


def test_mc_sim_7b_63_matches_reference():
    """Facts of the official choices.py: 25 nodes + root, depth 5, 4/8/8/3/2 per depth, 15 x 6 retrieve_indices."""
    assert len(MC_SIM_7B_63) == 25
    plan = static_plan(MC_SIM_7B_63)
    tree = tree_from_parents(torch.arange(26), plan.parents)
    assert tree.size == 26
    assert torch.bincount(tree.depths).tolist() == [1, 4, 8, 8, 3, 2]
    assert tree.paths.shape == (15, 6)
    assert tree.paths[0].tolist() == [0, 1, 5, 13, 21, 24]
    assert tree.paths[-1].tolist() == [0, 4, 12, -1, -1, -1]
    assert torch.equal(tree.depths, plan.depths)
    # draft side: 10 non-leaf nodes, 4, 4, 1, 1 at depths 1-4, plus the root; TOPK covers rank 3
    assert [e.numel() for e in plan.expand] == [1, 4, 4, 1, 1]
    assert plan.expand[0].tolist() == [0]
    assert plan.top_k == 4
    # mask = identity + column 0 + all ancestors; row sums = depth + 1
    assert torch.equal(tree.mask.sum(1), tree.depths + 1)
    assert bool(tree.mask[:, 0].all())


# (choices, parents, ranks, depths, expand, top_k): nodes sorted by (depth, lexicographic choice)
PLANS = [
    (((0,),), [-1, 0], [-1, 0], [0, 1], [[0]], 1),
    (((1,), (0,), (0, 2), (0, 0)), [-1, 0, 0, 1, 1], [-1, 0, 1, 0, 2], [0, 1, 1, 2, 2], [[0], [1]], 3),
    (((0,), (0, 0), (0, 0, 0), (2,), (2, 1)), [-1, 0, 0, 1, 2, 3], [-1, 0, 2, 0, 1, 0], [0, 1, 1, 2, 2, 3],
     [[0], [1, 2], [3]], 3),
]


@pytest.mark.parametrize("choices,parents,ranks,depths,expand,top_k", PLANS)
def test_static_plan(choices, parents, ranks, depths, expand, top_k):
    plan = static_plan(choices)
    assert plan.parents.tolist() == parents
    assert plan.ranks.tolist() == ranks
    assert plan.depths.tolist() == depths
    assert [e.tolist() for e in plan.expand] == expand
    assert plan.top_k == top_k
    assert plan.size == len(choices) + 1


@pytest.mark.parametrize("choices,match", [
    ((), "at least one"),
    (((0,), (0, 1, 0)), "prefix"),
    (((1, 0),), "prefix"),
    (((0,), (-1,)), "negative"),
    (((0,), (0,)), "duplicates"),
    (((0,), ()), "empty"),
])
def test_static_plan_rejects(choices, match):
    with pytest.raises(ValueError, match=match):
        static_plan(choices)


@pytest.mark.parametrize("scores,k,expected", [
    ([1.0, 3.0, 3.0, 2.0], 2, [1, 2]),
    ([1.0, 3.0, 3.0, 2.0], 3, [1, 2, 3]),
    ([1.0, 3.0, 3.0, 2.0], 10, [1, 2, 3, 0]),
    ([0.5, 0.5, 0.5], 2, [0, 1]),
    ([-1.0, float("-inf"), -0.5], 3, [2, 0, 1]),
])
def test_next_frontier(scores, k, expected):
    got = next_frontier(torch.tensor(scores), k)
    assert got.dtype == torch.int64 and got.tolist() == expected


# (name, scores, tokens, parents, num_nodes, expected tree tokens, expected tree parents); root token 99
DYNAMIC = [
    # level 1: cands 0-2; level 2: 3, 4 under 0 and 5 under 1. Best 4: 0 (-.1), 3 (-.5), 1 (-1), 5 (-1.2)
    ("basic", [-0.1, -1.0, -2.0, -0.5, -3.0, -1.2], [10, 11, 12, 13, 14, 15], [-1, -1, -1, 0, 0, 1], 5,
     [99, 10, 11, 13, 15], [-1, 0, 0, 1, 2]),
    # a child with log-prob 0 ties its parent: the parent (lower index) wins the last slot
    ("tie-parent-child", [-1.0, -1.0, -1.0], [10, 11, 12], [-1, 0, -1], 3, [99, 10, 11], [-1, 0, 1]),
    ("tie-siblings", [-1.0, -1.0, -1.0, -2.0], [10, 11, 12, 13], [-1, -1, -1, 2], 3, [99, 10, 11], [-1, 0, 0]),
    # fewer candidates than slots: keep them all
    ("keep-all", [-0.1, -0.2, -0.3], [10, 11, 12], [-1, 0, 1], 60, [99, 10, 11, 12], [-1, 0, 1, 2]),
    ("root-only", [-0.1, -0.2], [10, 11], [-1, -1], 1, [99], [-1]),
]


@pytest.mark.parametrize("name,scores,tokens,parents,num_nodes,want_tokens,want_parents", DYNAMIC,
                         ids=[d[0] for d in DYNAMIC])
def test_select_dynamic(name, scores, tokens, parents, num_nodes, want_tokens, want_parents):
    tree = select_dynamic(torch.tensor(scores), torch.tensor(tokens), torch.tensor(parents), 99, num_nodes)
    assert tree.tokens.tolist() == want_tokens
    assert tree.parents.tolist() == want_parents
    assert torch.equal(tree.mask, tree_from_parents(tree.tokens, tree.parents).mask)


@pytest.mark.parametrize("scores,parents,num_nodes", [
    ([-2.0, -0.5], [-1, 0], 2),                       # child outscores its dropped parent
    ([-0.1, -3.0, -0.2, -0.3], [-1, -1, 1, 2], 4),    # grandchild chain kept, middle parent dropped
    ([-0.1, -0.2], [-1, 1], 3),                       # parent index not before the child
])
def test_select_dynamic_rejects(scores, parents, num_nodes):
    with pytest.raises(ValueError):
        select_dynamic(torch.tensor(scores), torch.arange(len(scores)), torch.tensor(parents), 99, num_nodes)


L = math.log
FLAT = [10.0] * 9                                   # verifying 1..9 rows costs the same
STEEP = [10.0 + 10.0 * m for m in range(9)]         # every row costs as much as the one-row forward
LINEAR = [10.0, 12.0, 14.0, 16.0, 18.0]             # 2 ms a row

# (name, scores (one request [C], or a batch [B, C]), verify_ms[m] for m candidates, fixed_ms, expected m)
COST = [
    ("flat-picks-all", [L(0.9), L(0.5), L(0.2), L(0.1)], FLAT, 5.0, 4),
    ("flat-capped-by-curve", [L(0.9)] * 12, FLAT, 5.0, 8),
    ("steep-picks-few", [L(0.9), L(0.5), L(0.2), L(0.1)], STEEP, 5.0, 1),
    ("steep-unsure-root-only", [L(0.4), L(0.3)], STEEP, 5.0, 0),
    # (1 + sum p) / (fixed + t): 1/10, 1.9/12, 2.4/14, 2.5/16, 2.55/18 -> the third is best
    ("interior-optimum", [L(0.9), L(0.5), L(0.1), L(0.05)], LINEAR, 0.0, 2),
    ("order-does-not-matter", [L(0.05), L(0.5), L(0.9), L(0.1)], LINEAR, 0.0, 2),
    # a larger fixed cost (the draft's) makes a bigger tree pay: 1/110, 1.9/112, ..., 2.55/118
    ("fixed-cost-pays-for-more", [L(0.9), L(0.5), L(0.1), L(0.05)], LINEAR, 100.0, 4),
    ("near-zero-probabilities-root-only", [-50.0, -60.0, -70.0], FLAT, 5.0, 0),
    ("empty-pool", np.zeros((1, 0)), FLAT, 5.0, 0),
    # equal rates: 1/10 == 2/20 -> the smaller tree
    ("tie-to-smaller", [0.0], [10.0, 20.0], 0.0, 0),
    ("no-room-beyond-the-root", [L(0.99)], [10.0], 0.0, 0),
    # a batch: one m for both; the sure request pays for rows the unsure one does not fill
    ("batch-summed", [[L(0.95), L(0.9), L(0.85)], [L(0.01), L(0.01), L(0.01)]], LINEAR, 0.0, 3),
    ("batch-both-unsure", [[L(0.1), L(0.1)], [L(0.1), L(0.1)]], STEEP, 0.0, 0),
]


@pytest.mark.parametrize("name,scores,verify_ms,fixed_ms,want", COST, ids=[c[0] for c in COST])
def test_cost_size(name, scores, verify_ms, fixed_ms, want):
    assert cost_size(np.asarray(scores, dtype=np.float32), verify_ms, fixed_ms) == want


def test_cost_size_is_the_brute_force_argmax():
    """Against the rule spelled out: for random pools and monotone curves, the m of the best rate (the first)."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        B, C, M = rng.integers(1, 4), rng.integers(0, 30), rng.integers(0, 40)
        scores = np.cumsum(-rng.exponential(1.0, (B, C)), axis=1)
        verify = np.cumsum(rng.uniform(0.0, 3.0, M + 1)) + 5.0
        fixed = rng.uniform(0.0, 20.0)
        probs = [sorted((math.exp(x) for x in row), reverse=True) for row in scores.tolist()]
        rates = [sum(1 + sum(p[:m]) for p in probs) / (fixed + verify[m]) for m in range(min(C, M) + 1)]
        assert cost_size(scores, verify, fixed) == int(np.argmax(rates))


def test_cost_size_prefix_is_a_tree():
    """The best-first prefix of any size is connected (a parent never scores below its child and ties go to the
    lower index): select_dynamic keeps whatever m cost_size picks without refusing it."""
    scores = torch.tensor([-0.1, -1.0, -0.1, -0.5, -1.0, -1.0, -0.1])
    parents = torch.tensor([-1, -1, 0, 0, 1, 2, 2])
    for m in range(len(scores) + 1):
        tree = select_dynamic(scores, torch.arange(10, 17), parents, 99, m + 1)
        assert tree.size == m + 1


def test_cost_size_rejects_an_empty_curve():
    with pytest.raises(ValueError):
        cost_size([0.0], [], 1.0)
