"""Greedy exactness in float32: speculative == vanilla == transformers generate(do_sample=False), token for token.

Every case runs on both fixture targets (Llama with GQA, head_dim != H/heads and llama3 RoPE scaling; Qwen2 with
qkv bias and tied embeddings), over 24 prompts that include a 1-token prompt and prompts that end on EOS, and
asserts that the head actually gets deep paths accepted *and* rejected, so a tree that never accepts fails.
"""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from eaglex.runtime import batch as batch_mod
from eaglex.runtime import drafter as drafter_mod
from eaglex.runtime.cost import CostCurve
from eaglex.runtime.generate import SpeculativeGenerator, VanillaGenerator
from eaglex.runtime.torch_backend import TorchBackend
from eaglex.runtime.types import TreeConfig

MAX_NEW = 40

# (case id, head, tree, tau floor): floors sit well below what the fixtures measure, well above 1.
CASES = [
    ("eagle3-dynamic", "eagle3", TreeConfig.parse("dynamic:60/8/10"), 2.0),
    ("eagle3-small-tree", "eagle3", TreeConfig.parse("dynamic:8/5/3"), 1.8),
    ("eagle2-dynamic", "eagle1", TreeConfig.parse("dynamic:60/8/10"), 1.5),
    ("eagle1-static", "eagle1", TreeConfig("static"), 1.5),
    ("chain", "eagle3", TreeConfig.chain(6), 1.8),
    ("eagle3-cost", "eagle3", TreeConfig.parse("cost:6/4"), 1.8),      # sized by the measured cost curve
    ("eagle2-cost", "eagle1", TreeConfig.parse("cost:5/3"), 1.5),
]
# Cost curves whose choices differ: on a flat one every candidate with any draft probability pays, on a steep one
# (each row as dear as a one-row forward) only the ones the draft is sure of, or the root alone.
CURVES = {"flat": CostCurve(((1, 10.0), (64, 10.0)), ((1, 1.0), (64, 1.0)), 256),
          "steep": CostCurve(((1, 10.0), (64, 640.0)), ((1, 1.0), (64, 1.0)), 256)}


@pytest.fixture(scope="session")
def reference(models, prompts):
    """Per target: transformers' own greedy outputs and eaglex vanilla outputs for every prompt."""
    out = {}
    for name in ("llama", "qwen2"):
        hf = AutoModelForCausalLM.from_pretrained(models[name], dtype=torch.float32).eval()
        eos = hf.generation_config.eos_token_id
        hf_out = []
        for p in prompts:
            with torch.no_grad():
                ids = hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=eos)
            hf_out.append(ids[0, len(p):].tolist())
        vanilla = VanillaGenerator(TorchBackend(models[name]))
        out[name] = (hf_out, [vanilla.generate(p, MAX_NEW).output_ids for p in prompts])
    return out


@pytest.mark.parametrize("target", ["llama", "qwen2"])
def test_vanilla_matches_transformers(target, reference):
    hf_out, vanilla = reference[target]
    assert vanilla == hf_out
    stops = [len(o) < MAX_NEW for o in hf_out]
    assert any(stops) and not all(stops), "the fixture must hit EOS on some prompts, not all"


@pytest.mark.parametrize("case,head,tree,floor", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("target", ["llama", "qwen2"])
def test_speculative_matches_vanilla(target, case, head, tree, floor, models, prompts, reference):
    hf_out, vanilla = reference[target]
    backend = TorchBackend(models[target], models[f"{target}/{head}"])
    gen = SpeculativeGenerator(backend, tree)
    results = [gen.generate(p, MAX_NEW) for p in prompts]
    for i, r in enumerate(results):
        assert r.output_ids == vanilla[i] == hf_out[i], f"prompt {i} diverged"
        assert sum(r.accept_lengths) + 1 == len(r.output_ids) or r.cycles == 0
    lengths = [a for r in results for a in r.accept_lengths]
    tau = sum(lengths) / len(lengths)
    assert tau >= floor, f"tau {tau:.2f} below {floor}: the head no longer gets drafts accepted"
    assert max(lengths) >= 4, "no deep path was ever accepted"
    assert min(lengths) == 1 or lengths.count(max(lengths)) < len(lengths), "no draft was ever rejected"


@pytest.mark.parametrize("target", ["llama", "qwen2"])
def test_cost_tree_sizes_follow_the_curve_and_stay_exact(target, models, prompts, reference, monkeypatch):
    """Whatever size the cost model picks per cycle, from the root alone to dozens of nodes, the output is
    vanilla's; a flat curve verifies bigger trees than a steep one."""
    hf_out, vanilla = reference[target]
    backend = TorchBackend(models[target], models[f"{target}/eagle3"])
    select = drafter_mod.select_dynamic
    sizes = {}
    for name, curve in CURVES.items():
        seen = sizes[name] = []
        monkeypatch.setattr(batch_mod, "cost_curve", lambda b, curve=curve: curve)
        monkeypatch.setattr(drafter_mod, "select_dynamic", lambda *a, seen=seen: (seen.append(a[-1]), select(*a))[1])
        gen = SpeculativeGenerator(backend, TreeConfig.parse("cost:6/4"))
        for i, p in enumerate(prompts):
            r = gen.generate(p, MAX_NEW)
            assert r.output_ids == vanilla[i] == hf_out[i], (name, i)
    flat, steep = sizes["flat"], sizes["steep"]
    assert min(steep) == 1, "the steep curve never verified the root alone"
    assert max(flat) > max(steep) and sum(flat) / len(flat) > sum(steep) / len(steep)


@pytest.mark.parametrize("target", ["llama", "qwen2"])
def test_max_new_tokens_edges(target, models, prompts, reference):
    backend = TorchBackend(models[target], models[f"{target}/eagle3"])
    spec, vanilla = SpeculativeGenerator(backend, TreeConfig.parse("dynamic:60/8/10")), VanillaGenerator(backend)
    for n in (0, 1, 2, 3):
        for p in prompts[:6]:
            s, v = spec.generate(p, n), vanilla.generate(p, n)
            assert s.output_ids == v.output_ids == reference[target][0][prompts.index(p)][:n]


def test_context_limit(models, prompts):
    """Near the end of the context a tree cannot fit: both loops stop at the same token, at the same limit."""
    backend = TorchBackend(models["llama"], models["llama/eagle3"])
    limit = backend.spec.max_context
    p = (prompts[3] * 40)[: limit - 30]
    s = SpeculativeGenerator(backend, TreeConfig.parse("dynamic:60/8/10")).generate(p, 1000)
    v = VanillaGenerator(backend).generate(p, 1000)
    assert s.output_ids == v.output_ids
    if v.stop_reason == "context":
        assert len(p) + len(v.output_ids) == limit
