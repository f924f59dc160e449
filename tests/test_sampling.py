"""logits_to_probs must match transformers' warpers (temperature -> top-k -> top-p) exactly; draw() basics."""
import numpy as np
import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from eaglex.runtime.sampling import draw, logits_to_probs, noise
from eaglex.runtime.types import SamplingConfig


def hf_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """What generate() would sample from: the warpers it installs for this config, in its order, then softmax."""
    scores = logits.float()
    if cfg.temperature != 1.0:
        scores = TemperatureLogitsWarper(cfg.temperature)(None, scores)
    if cfg.top_k > 0:
        scores = TopKLogitsWarper(cfg.top_k)(None, scores)
    if cfg.top_p < 1.0:
        scores = TopPLogitsWarper(cfg.top_p)(None, scores)
    return scores.softmax(dim=-1)


def _random_logits():
    return torch.randn(4, 50, generator=torch.Generator().manual_seed(1)) * 3


def _tied_logits():
    # Integer logits with many repeats: ties at the top-k boundary and inside the top-p head
    return torch.randint(-3, 4, (6, 20), generator=torch.Generator().manual_seed(2)).float()


def _peaked_logits():
    x = torch.zeros(3, 30)
    x[:, 7] = 40.0  # nearly all mass on one token: top-p must still keep exactly it
    return x


CONFIGS = [
    SamplingConfig(temperature=1.0),
    SamplingConfig(temperature=0.3),
    SamplingConfig(temperature=2.5),
    SamplingConfig(temperature=1.0, top_k=1),
    SamplingConfig(temperature=1.0, top_k=5),
    SamplingConfig(temperature=1.0, top_k=1000),  # larger than V
    SamplingConfig(temperature=1.0, top_p=0.1),
    SamplingConfig(temperature=1.0, top_p=0.5),
    SamplingConfig(temperature=1.0, top_p=0.95),
    SamplingConfig(temperature=0.7, top_k=8, top_p=0.8),
    SamplingConfig(temperature=1.6, top_k=3, top_p=0.3),
]


@pytest.mark.parametrize("make_logits", [_random_logits, _tied_logits, _peaked_logits])
@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_matches_transformers_warpers(make_logits, cfg):
    logits = make_logits()
    got = logits_to_probs(logits, cfg)
    want = hf_probs(logits, cfg)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert torch.equal(got > 0, want > 0)  # the same tokens survive the filters
    torch.testing.assert_close(got.sum(-1), torch.ones(got.shape[0]))


@pytest.mark.parametrize("cfg,logits,support", [
    # top-k keeps every token tied with the k-th best
    (SamplingConfig(temperature=1.0, top_k=2), [3.0, 1.0, 3.0, 3.0, 0.0], [0, 2, 3]),
    # top-p: smallest head with mass >= top_p; p = [.5, .3, .2] -> 0.6 needs two tokens, 0.5 one
    (SamplingConfig(temperature=1.0, top_p=0.6), [0.5, 0.3, 0.2], [0, 1]),
    (SamplingConfig(temperature=1.0, top_p=0.5), [0.5, 0.3, 0.2], [0]),
    # the top token always survives
    (SamplingConfig(temperature=1.0, top_p=0.01), [0.34, 0.33, 0.33], [0]),
    # top-k then top-p on the top-k renormalised mass
    (SamplingConfig(temperature=1.0, top_k=2, top_p=0.6), [0.4, 0.35, 0.25], [0, 1]),
])
def test_filter_semantics(cfg, logits, support):
    x = torch.tensor(logits)
    if cfg.top_p < 1.0:
        x = x.log()  # the top-p rows are written as probabilities
    probs = logits_to_probs(x, cfg)
    assert (probs > 0).nonzero().squeeze(-1).tolist() == support


def test_leading_dims_are_batch():
    logits = torch.randn(2, 3, 17, generator=torch.Generator().manual_seed(3))
    cfg = SamplingConfig(temperature=0.9, top_k=6, top_p=0.7)
    got = logits_to_probs(logits, cfg)
    assert got.shape == (2, 3, 17)
    torch.testing.assert_close(got.reshape(6, 17), logits_to_probs(logits.reshape(6, 17), cfg))
    torch.testing.assert_close(got[1, 2], logits_to_probs(logits[1, 2], cfg))


def test_greedy_has_no_distribution():
    with pytest.raises(ValueError):
        logits_to_probs(torch.zeros(4), SamplingConfig(temperature=0.0))


def test_draw_point_mass_and_zeros():
    one_hot = torch.zeros(8)
    one_hot[5] = 1.0
    assert {draw(one_hot, seed, t) for seed in range(50) for t in range(5)} == {5}
    probs = torch.tensor([0.0, 0.5, 0.0, 0.5, 0.0])            # filtered tokens never come out
    assert {draw(probs, seed, 0) for seed in range(300)} == {1, 3}
    with pytest.raises(ValueError):
        draw(torch.ones(2, 2), 0, 0)


def test_draw_is_a_function_of_seed_and_position():
    probs = torch.softmax(torch.randn(1000, generator=torch.Generator().manual_seed(3)), -1)
    assert [draw(probs, 7, t) for t in range(30)] == [draw(probs, 7, t) for t in range(30)]
    assert [draw(probs, 7, t) for t in range(30)] != [draw(probs, 8, t) for t in range(30)]
    assert [draw(probs, 7, t) for t in reversed(range(30))] == [draw(probs, 7, t) for t in range(30)][::-1]
    np.testing.assert_array_equal(noise(7, 12, 1000), noise(7, 12, 5000)[:1000])  # the vocabulary size aside
    assert (noise(7, 12, 1000) > 0).all() and np.isfinite(noise(7, 12, 1000)).all()


@pytest.mark.parametrize("probs", [[0.1, 0.6, 0.3], [0.001, 0.009, 0.09, 0.9], [0.25] * 4], ids=str)
def test_draw_is_distributed_as_probs(probs):
    """Chi-square over 20000 draws: across positions of one seed, and across seeds at one position."""
    p = torch.tensor(probs)
    for draws in ([draw(p, 11, t) for t in range(20000)], [draw(p, s, 3) for s in range(20000)]):
        counts = torch.bincount(torch.tensor(draws), minlength=len(probs)).double()
        expected = 20000 * p.double()
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < 3 * len(probs) + 15, (chi2, counts.tolist())
