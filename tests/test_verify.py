"""Verification: greedy path selection; sampled verification emits what vanilla sampling draws with the same seed,
and so preserves the target distribution exactly."""
import math
from dataclasses import replace

import pytest
import torch

from eaglex.runtime.sampling import derive_seed, draw, logits_to_probs
from eaglex.runtime.tree import MC_SIM_7B_63, static_plan, tree_from_parents
from eaglex.runtime.types import SamplingConfig, Verdict
from eaglex.runtime.verify import verify_greedy, verify_sampling

V = 10
CHAIN = ([9, 1, 2, 3], [-1, 0, 1, 2])
# root 9; children 1 (node 1), 2 (node 2); node 1 -> 3 (node 3), 4 (node 4); node 2 -> 5 (node 5)
BRANCHY = ([9, 1, 2, 3, 4, 5], [-1, 0, 0, 1, 1, 2])
_MC = static_plan(MC_SIM_7B_63)
MC = ((torch.arange(26) % V).tolist(), _MC.parents.tolist())  # node i carries token i % 10

# (name, (tokens, parents), target argmax per node, expected accepted nodes, expected next token)
GREEDY = [
    ("chain-all+bonus", CHAIN, [1, 2, 3, 7], [0, 1, 2, 3], 7),
    ("chain-early-miss", CHAIN, [1, 2, 0, 3], [0, 1, 2], 0),
    ("chain-none", CHAIN, [6, 2, 3, 4], [0], 6),
    ("branchy-left-deep", BRANCHY, [1, 3, 0, 8, 0, 0], [0, 1, 3], 8),
    ("branchy-left-second", BRANCHY, [1, 4, 0, 0, 6, 0], [0, 1, 4], 6),
    ("branchy-right", BRANCHY, [2, 0, 5, 0, 0, 0], [0, 2, 5], 0),
    ("branchy-miss-depth2", BRANCHY, [1, 8, 0, 0, 0, 0], [0, 1], 8),
    ("branchy-miss-root-children", BRANCHY, [7, 3, 5, 0, 0, 0], [0], 7),
    # mc_sim: path 0-1-5-13-21-25 carries tokens 1, 5, 3, 1, 5
    ("mc-sim-deepest", MC, {0: 1, 1: 5, 5: 3, 13: 1, 21: 5, 25: 4}, [0, 1, 5, 13, 21, 25], 4),
    ("mc-sim-branch", MC, {0: 3, 3: 0, 10: 2}, [0, 3, 10], 2),
]


def _logits_from_argmax(argmax, n):
    if isinstance(argmax, dict):  # sparse table: unlisted nodes predict token 9 (absent from the tested paths)
        argmax = [argmax.get(i, 9) for i in range(n)]
    logits = torch.zeros(n, V)
    logits[torch.arange(n), torch.tensor(argmax)] = 1.0
    return logits


@pytest.mark.parametrize("name,tree,argmax,nodes,next_token", GREEDY, ids=[g[0] for g in GREEDY])
def test_verify_greedy(name, tree, argmax, nodes, next_token):
    tree = tree_from_parents(torch.tensor(tree[0]), torch.tensor(tree[1]))
    verdict = verify_greedy(tree, _logits_from_argmax(argmax, tree.size))
    assert verdict.nodes.tolist() == nodes
    assert verdict.nodes.dtype == torch.int64
    assert verdict.num_accepted == len(nodes) - 1
    assert verdict.next_token == next_token


def test_verify_greedy_matches_the_path_algebra_in_torch():
    """The numpy walk gives the verdict of the same path algebra written in torch (evaluate_posterior's), on random
    trees."""
    from eaglex.runtime import verify

    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        n = int(torch.randint(1, 12, (1,), generator=g))
        parents = torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)])
        tree = tree_from_parents(torch.randint(0, 4, (n,), generator=g), parents)
        logits = torch.randn(n, 4, generator=g)
        host = verify.verify_greedy(tree, logits)
        top = logits.argmax(-1)
        correct = (tree.tokens == top[tree.parents.clamp(min=0)]) | (tree.parents < 0)
        match = correct[tree.paths.clamp(min=0)] & (tree.paths >= 0)
        acc = torch.cumprod(match[:, 1:].long(), dim=1).sum(dim=1)
        best = int(torch.argmax(acc))
        nodes = tree.paths[best, : int(acc[best]) + 1]
        assert host.nodes.tolist() == nodes.tolist() and host.next_token == int(top[nodes[-1]])


def test_verify_greedy_shape_check():
    tree = tree_from_parents(torch.tensor(CHAIN[0]), torch.tensor(CHAIN[1]))
    with pytest.raises(ValueError):
        verify_greedy(tree, torch.zeros(3, V))


# ---------------------------------------------------------------- sampling: exact distribution

V5 = 5
# root (token 4); depth 1: node 1 = token 0, node 2 = token 1; depth 2: under node 1 tokens 2, 3; under node 2 token 0
DIST_TREE = tree_from_parents(torch.tensor([4, 0, 1, 2, 3, 0]), torch.tensor([-1, 0, 0, 1, 1, 2]))
DIST_LOGITS = torch.tensor([
    [0.35, 0.30, 0.15, 0.12, 0.08],   # root: the children 0 and 1 hold 65%
    [0.05, 0.10, 0.50, 0.25, 0.10],   # after token 0: favours the drafted 2
    [0.40, 0.30, 0.05, 0.05, 0.20],   # after token 1
    [0.20, 0.20, 0.20, 0.20, 0.20],
    [0.10, 0.20, 0.30, 0.20, 0.20],
    [0.30, 0.10, 0.10, 0.10, 0.40],
]).log()
FIRST_NODE = {0: 1, 1: 2}  # first emitted token -> its tree node (where the target's next distribution is known)


def exact_joint(cfg):
    """Target's law of the first two emitted tokens; outcome (x1, x2), with x2 = V5 meaning 'only x1 emitted'
    (x1 not drafted: the cycle ends with the recovered token)."""
    p = logits_to_probs(DIST_LOGITS, cfg)
    joint = torch.zeros(V5, V5 + 1, dtype=torch.float64)
    for x1 in range(V5):
        if x1 in FIRST_NODE:
            joint[x1, :V5] = p[0, x1].double() * p[FIRST_NODE[x1]].double()
        else:
            joint[x1, V5] = p[0, x1]
    return joint.flatten()


def empirical_joint(verifier, cfg, draws, seed):
    """Counts of the first two emitted tokens over `draws` cycles of one stream `seed`, cycle i at positions 2i
    and 2i + 1 (so every cycle draws fresh noise)."""
    cfg = replace(cfg, seed=seed)
    counts = torch.zeros(V5 * (V5 + 1), dtype=torch.float64)
    for i in range(draws):
        verdict = verifier(DIST_TREE, DIST_LOGITS, cfg, 2 * i)
        seq = DIST_TREE.tokens[verdict.nodes[1:]].tolist() + [verdict.next_token]
        counts[seq[0] * (V5 + 1) + (seq[1] if len(seq) > 1 else V5)] += 1
    return counts


def chi2_critical(df, z=3.719):
    """Wilson-Hilferty upper quantile of chi-square(df); z = 3.719 is the 1e-4 tail of N(0, 1)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def distribution_check(counts, exact):
    """(passes, chi2, critical, tv): chi-square goodness of fit plus a total-variation bound, and nothing observed
    where the target puts zero mass."""
    n = counts.sum()
    support = exact > 0
    expected = n * exact[support]
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    crit = chi2_critical(int(support.sum()) - 1)
    tv = 0.5 * float((counts / n - exact).abs().sum())
    ok = chi2 < crit and tv < 0.03 and float(counts[~support].sum()) == 0
    return ok, chi2, crit, tv


DIST_CONFIGS = [
    (SamplingConfig(temperature=1.0), 12000),
    (SamplingConfig(temperature=0.8, top_k=3), 5000),    # tokens filtered to p = 0, one of them drafted
    (SamplingConfig(temperature=1.3, top_p=0.7), 5000),  # top-p head of 2 at the root: all of it drafted
]


@pytest.mark.parametrize("cfg,draws", DIST_CONFIGS, ids=str)
def test_verify_sampling_preserves_target_distribution(cfg, draws):
    ok, chi2, crit, tv = distribution_check(empirical_joint(verify_sampling, cfg, draws, seed=0), exact_joint(cfg))
    assert ok, f"chi2={chi2:.1f} (critical {crit:.1f}), tv={tv:.4f}"


def sequential_verifier(renormalise, residual):
    """Straight sequential rejection verifier (the official EAGLE-2 scheme: one uniform per child) whose two
    corrections can be switched off to make it WRONG: without `renormalise` a later child is accepted with its raw
    p instead of p / (mass left); without `residual` the recovered token is drawn from the full p instead of p with
    the rejected children removed."""
    def verify(tree, logits, cfg, position):
        g = torch.Generator().manual_seed(derive_seed(cfg.seed, position))
        node, nodes = 0, [0]
        while True:
            p = logits_to_probs(logits[node], cfg).double()
            p0 = p.clone()
            for kid in (tree.parents == node).nonzero().squeeze(-1).tolist():
                x = int(tree.tokens[kid])
                if float(torch.rand(1, generator=g)) < float(p[x]):
                    node = kid
                    nodes.append(kid)
                    break
                p[x] = 0
                if renormalise:
                    p = p / p.sum()
            else:
                nxt = int(torch.multinomial(p if residual else p0, 1, generator=g))
                return Verdict(nodes=torch.tensor(nodes), next_token=nxt)
    return verify


def test_sequential_reference_passes_the_check():
    # Sequential rejection is a second correct verifier: it must pass like verify_sampling
    cfg, draws = DIST_CONFIGS[0]
    counts = empirical_joint(sequential_verifier(True, True), cfg, draws // 2, seed=1)
    ok, chi2, crit, tv = distribution_check(counts, exact_joint(cfg))
    assert ok, f"chi2={chi2:.1f} (critical {crit:.1f}), tv={tv:.4f}"


@pytest.mark.parametrize("renormalise,residual", [(False, True), (True, False)])
def test_distribution_check_catches_wrong_verifier(renormalise, residual):
    # Same check, same config and seed, a fifth of the draws: failing with less data is the stronger statement
    cfg, draws = DIST_CONFIGS[0]
    counts = empirical_joint(sequential_verifier(renormalise, residual), cfg, draws // 5, seed=0)
    ok, chi2, crit, tv = distribution_check(counts, exact_joint(cfg))
    assert not ok and chi2 > 3 * crit and tv > 0.05, f"chi2={chi2:.1f}, tv={tv:.4f}"


# ---------------------------------------------------------------- sampling: the vanilla engine's draws

def _target(prefix: tuple[int, ...], vocab: int = 7) -> torch.Tensor:
    """A made-up target: logits after `prefix`, a fixed function of it."""
    g = torch.Generator().manual_seed(hash(prefix) % 2 ** 31)
    return torch.randn(vocab, generator=g) * 2


def _vanilla(prefix, cfg, position, n):
    """The tokens vanilla sampling emits at positions position..position+n-1 after `prefix`."""
    out = []
    for t in range(position, position + n):
        out.append(draw(logits_to_probs(_target(tuple(prefix) + tuple(out)), cfg), cfg.seed, t))
    return out


# (name, tokens, parents): every tree of the table is verified against the made-up target at many seeds
VANILLA_TREES = [
    ("root-only", [3], [-1]),
    ("chain", [3, 0, 1, 2, 4], [-1, 0, 1, 2, 3]),
    ("argmax-chain", None, [-1, 0, 1, 2, 3]),            # tokens: the target's argmax after each node
    ("branchy", [3, 0, 1, 2, 3, 4, 5], [-1, 0, 0, 1, 1, 2, 2]),
    ("wide", [3, 0, 1, 2, 4, 5, 6], [-1, 0, 0, 0, 0, 0, 0]),
    ("repeated-siblings", [3, 1, 1, 2, 2], [-1, 0, 0, 1, 2]),
    ("every-token-then-one", [3] + list(range(7)) + list(range(7)), [-1] + [0] * 7 + list(range(1, 8))),
]


@pytest.mark.parametrize("name,tokens,parents", VANILLA_TREES, ids=[t[0] for t in VANILLA_TREES])
@pytest.mark.parametrize("cfg", [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_k=3),
                                 SamplingConfig(temperature=1.2, top_p=0.6)], ids=str)
def test_sampled_verdict_is_what_vanilla_draws(name, tokens, parents, cfg):
    """Whatever the tree, a cycle emits exactly the tokens vanilla sampling draws with the same seed at the same
    positions: the accepted path is the longest run of them the tree holds, then the next draw."""
    prompt = (5, 2)
    if tokens is None:
        tokens = [3]
        for _ in parents[1:]:
            tokens.append(int(_target(prompt + tuple(tokens)).argmax()))
    tree = _tree(tokens, parents)
    accepted_some = 0
    for seed in range(40):
        c, position = replace(cfg, seed=seed), 3 + seed % 5
        # mask[i]: node i and its ancestors, root first (parents come before their children)
        prefixes = [prompt + tuple(tokens[n] for n in tree.mask[i].nonzero().flatten().tolist())
                    for i in range(tree.size)]
        logits = torch.stack([_target(pre) for pre in prefixes])
        v = verify_sampling(tree, logits, c, position)
        emitted = tree.tokens[v.nodes[1:]].tolist() + [v.next_token]
        assert emitted == _vanilla(prompt + (tokens[0],), c, position, len(emitted)), (name, seed)
        # ... and no longer run of them was in the tree: the next vanilla draw is not a child of the last node
        assert not any(tokens[k] == v.next_token for k in range(tree.size) if parents[k] == int(v.nodes[-1]))
        accepted_some += v.num_accepted > 0
        if name == "every-token-then-one":      # every token is a child of the root: one is always accepted
            assert v.num_accepted >= 1
    if name == "argmax-chain":
        assert accepted_some > 0, "no draft token was ever accepted: the table tests nothing"


# ---------------------------------------------------------------- sampling: edge cases

def _tree(tokens, parents):
    return tree_from_parents(torch.tensor(tokens), torch.tensor(parents))


def test_certain_child_always_accepted():
    # top_k = 1 leaves p = 1 on the drafted tokens: the whole chain is accepted and the bonus is the target's top
    tree = _tree([9, 1, 2], [-1, 0, 1])
    logits = _logits_from_argmax([1, 2, 5], 3)
    for seed in range(200):
        v = verify_sampling(tree, logits, SamplingConfig(temperature=1.0, top_k=1, seed=seed), seed % 7)
        assert v.nodes.tolist() == [0, 1, 2] and v.next_token == 5


def test_zero_probability_child_never_accepted():
    tree = _tree([9, 1, 2], [-1, 0, 0])
    logits = _logits_from_argmax([3, 0, 0], 3)  # top_k = 1 -> only token 3 has mass after the root
    for seed in range(200):
        v = verify_sampling(tree, logits, SamplingConfig(temperature=1.0, top_k=1, seed=seed), 0)
        assert v.nodes.tolist() == [0] and v.next_token == 3


def test_children_holding_all_mass_always_accept_one():
    # top_k = 2 puts all mass on tokens 1 and 2, both drafted: one of them is always accepted
    tree = _tree([9, 1, 2], [-1, 0, 0])
    logits = torch.tensor([[0.0, 2.0, 1.9, -1.0, -1.0]] * 3)
    seen = set()
    for seed in range(500):
        v = verify_sampling(tree, logits, SamplingConfig(temperature=1.0, top_k=2, seed=seed), 0)
        assert v.num_accepted == 1
        seen.add(int(v.nodes[1]))
    assert seen == {1, 2}


def test_duplicate_child_token_first_one_wins():
    # nodes 1 and 2 both carry token 1; the walk follows the first
    tree = _tree([9, 1, 1, 3], [-1, 0, 0, 2])
    logits = torch.zeros(4, 5)
    for seed in range(300):
        v = verify_sampling(tree, logits, SamplingConfig(temperature=1.0, seed=seed), 0)
        assert 2 not in v.nodes.tolist()
        if v.num_accepted == 0:
            assert v.next_token != 1


def test_sampling_is_seeded():
    logits = torch.randn(DIST_TREE.size, V5, generator=torch.Generator().manual_seed(4))
    runs = []
    for seed in range(30):
        cfg = SamplingConfig(temperature=0.9, top_p=0.95, seed=seed)
        a = verify_sampling(DIST_TREE, logits, cfg, 11)
        b = verify_sampling(DIST_TREE, logits, cfg, 11)
        assert torch.equal(a.nodes, b.nodes) and a.next_token == b.next_token
        runs.append((tuple(a.nodes.tolist()), a.next_token))
    assert len(set(runs)) > 1  # the seed matters


def test_sampling_rejects_greedy_config():
    with pytest.raises(ValueError):
        verify_sampling(DIST_TREE, DIST_LOGITS, SamplingConfig(temperature=0.0), 0)
