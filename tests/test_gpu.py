"""The GPU path on a CUDA device (marked gpu: skipped where torch sees no GPU). tools/gpu_check.sh runs these on the
GPU machine; EAGLEX_TEST_DEVICE=cpu runs the same tests on the CPU with the static forwards that CUDA graphs
capture (the script's dry run), EAGLEX_TEST_QUICK=1 a subset. The device-agnostic parts run in CI in
tests/test_device.py.

- fp32: transformers greedy == eaglex vanilla == speculative, token for token, for every case of the
  equivalence suite (tests/test_exactness.py), with CUDA graphs (the CUDA default) and eagerly;
- in-flight batching on the device equals vanilla decoding per request (1, 4 and 16 requests at a time);
- CUDA graphs are captured and replayed, and a speculative cycle synchronises with the host at most twice
  (once to read the drafted tree, once for the accept decision);
- bf16: `eaglex check` reports every divergence from vanilla with the target's logit margin there;
- ONNX Runtime's CUDA execution provider, where onnxruntime-gpu is installed.
"""
from __future__ import annotations

import os
import warnings

import onnxruntime as ort
import pytest
import torch
from test_exactness import CASES, MAX_NEW
from transformers import AutoModelForCausalLM

from eaglex.runtime.equivalence import check_identical, format_identical
from eaglex.runtime.generate import SpeculativeGenerator, VanillaGenerator
from eaglex.runtime.torch_backend import TorchBackend
from eaglex.runtime.types import TreeConfig

DEVICE = os.environ.get("EAGLEX_TEST_DEVICE", "cuda")
QUICK = os.environ.get("EAGLEX_TEST_QUICK") == "1"
ON_CUDA = DEVICE.startswith("cuda")
MODE = "graphs" if ON_CUDA else "static"
cuda_only = pytest.mark.skipif(not ON_CUDA, reason="CUDA graphs and syncs exist on CUDA devices only")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(ON_CUDA and not torch.cuda.is_available(), reason="needs a CUDA GPU")]

RUN_CASES = CASES[:2] if QUICK else CASES


@pytest.fixture(scope="module", autouse=True)
def ieee_fp32():
    """fp32 means fp32: no TF32 matmuls while these tests run (PyTorch's default, asserted here)."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(before)


@pytest.fixture(scope="module")
def cases_prompts(prompts):
    return prompts[:6] if QUICK else prompts


@pytest.fixture(scope="module")
def reference(models, cases_prompts):
    """Per target, on DEVICE in fp32: transformers' greedy outputs and eaglex vanilla outputs."""
    out = {}
    for name in ("llama", "qwen2"):
        hf = AutoModelForCausalLM.from_pretrained(models[name], dtype=torch.float32).to(DEVICE).eval()
        eos = hf.generation_config.eos_token_id
        hf_out = []
        for p in cases_prompts:
            with torch.no_grad():
                ids = hf.generate(torch.tensor([p], device=DEVICE), do_sample=False, max_new_tokens=MAX_NEW,
                                  pad_token_id=eos)
            hf_out.append(ids[0, len(p):].tolist())
        del hf
        vanilla = VanillaGenerator(TorchBackend(models[name], device=DEVICE, mode=MODE))
        out[name] = (hf_out, [vanilla.generate(p, MAX_NEW).output_ids for p in cases_prompts])
    return out


@pytest.mark.parametrize("target", ["llama", "qwen2"])
def test_vanilla_matches_transformers(target, reference):
    hf_out, vanilla = reference[target]
    assert vanilla == hf_out


@pytest.mark.parametrize("case,head,tree,floor", RUN_CASES, ids=[c[0] for c in RUN_CASES])
@pytest.mark.parametrize("target", ["llama", "qwen2"])
def test_speculative_matches_vanilla(target, case, head, tree, floor, models, cases_prompts, reference):
    hf_out, vanilla = reference[target]
    backend = TorchBackend(models[target], models[f"{target}/{head}"], device=DEVICE, mode=MODE)
    gen = SpeculativeGenerator(backend, tree)
    lengths = []
    for i, p in enumerate(cases_prompts):
        r = gen.generate(p, MAX_NEW)
        assert r.output_ids == vanilla[i] == hf_out[i], f"prompt {i} diverged"
        lengths += r.accept_lengths
    assert sum(lengths) / len(lengths) >= floor and max(lengths) >= 4


@pytest.mark.parametrize("target", ["llama", "qwen2"])
def test_eager_on_device_matches(target, models, cases_prompts, reference):
    """The eager path on the device (no graphs, exact-length attention) decodes the same tokens."""
    backend = TorchBackend(models[target], models[f"{target}/eagle3"], device=DEVICE, mode="eager")
    gen = SpeculativeGenerator(backend, TreeConfig.parse("dynamic:60/8/10"))
    for i, p in enumerate(cases_prompts[:8]):
        assert gen.generate(p, MAX_NEW).output_ids == reference[target][1][i], f"prompt {i} diverged"


def test_batching_on_the_device_matches_vanilla(models, cases_prompts, reference):
    """In-flight batching on DEVICE (every slot on the device; fixed shapes per batch size, captured as CUDA graphs
    there): every request's output is its vanilla one, 1, 4 and 16 requests at a time, vanilla-batched and
    EAGLE-batched; a request alone in the slots is bit-identical to the single-request path."""
    from eaglex.runtime.batch import BatchedGenerator, Schedule

    backend = TorchBackend(models["llama"], models["llama/eagle3"], device=DEVICE, mode=MODE)
    _, want = reference["llama"]
    for text in ("1:vanilla", "1:dynamic:16/6/4,2:chain:3"):
        s = Schedule.parse(text)
        for size in (1, 4) if QUICK else (1, 4, 16):
            gen = BatchedGenerator(backend.with_slots(size, s.max_nodes), s)
            reqs = [gen.submit(p, MAX_NEW) for p in cases_prompts]
            gen.run()
            assert [r.result.output_ids for r in reqs] == want, (text, size)
    tree = TreeConfig.parse("dynamic:16/6/4")
    gen = BatchedGenerator(backend.with_slots(4, tree.max_nodes), Schedule.fixed(tree))
    for p in cases_prompts[:4]:
        w = SpeculativeGenerator(backend, tree).generate(p, MAX_NEW)
        r = gen.submit(p, MAX_NEW)
        gen.run()
        assert (r.result.output_ids, r.result.accept_lengths) == (w.output_ids, w.accept_lengths)


@cuda_only
def test_cuda_graphs_are_replayed(models, cases_prompts):
    backend = TorchBackend(models["llama"], models["llama/eagle3"], device=DEVICE)
    assert backend.mode == "graphs"
    gen = SpeculativeGenerator(backend, TreeConfig.parse("dynamic:16/6/4"))
    for p in cases_prompts[:4]:
        gen.generate(p, MAX_NEW)
    assert backend.graphs.graphs, "no forward was captured"
    assert not backend.graphs.failed, f"captures failed: {backend.graphs.failed}"
    kinds = {key[0] for key in backend.graphs.graphs}
    assert kinds == {"target", "draft"}


@cuda_only
def test_host_syncs_per_cycle(models, cases_prompts):
    """A cycle reads the device back twice at most: the drafted tree, then the target's argmax at every node
    (the prefill's first token and the end-of-generation timing read add a few)."""
    backend = TorchBackend(models["llama"], models["llama/eagle3"], device=DEVICE)
    for tree in ("dynamic:16/6/4", "chain:4"):
        gen = SpeculativeGenerator(backend, TreeConfig.parse(tree))
        for _ in range(3):                                            # every shape of this request captured first
            gen.generate(cases_prompts[1], MAX_NEW)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                r = gen.generate(cases_prompts[1], MAX_NEW)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        syncs = sum("synchroniz" in str(w.message) for w in caught)
        assert syncs <= 2 * r.cycles + 4, f"{tree}: {syncs} synchronisations over {r.cycles} cycles"


def test_bf16_check_reports_margins(models, cases_prompts):
    """bf16 speculative vs vanilla on the device: every divergence is reported with the logit margin there."""
    backend = TorchBackend(models["llama"], models["llama/eagle3"], dtype="bfloat16", device=DEVICE,
                           mode=MODE)
    tree = TreeConfig.parse("dynamic:16/6/4")
    rows = check_identical(backend, tree, cases_prompts, MAX_NEW)
    print(format_identical(rows, f"eagle3, tree {tree}, bfloat16 on {DEVICE}"))
    for r in rows:
        assert r.identical == (r.divergence is None)
        if not r.identical:
            assert r.margin is not None and r.margin >= 0
    assert sum(r.tau for r in rows) / len(rows) > 1.5


@pytest.mark.skipif("CUDAExecutionProvider" not in ort.get_available_providers() or not ON_CUDA,
                    reason="needs onnxruntime-gpu and a CUDA device")
def test_onnxruntime_cuda_provider(models, cases_prompts, tmp_path):
    from eaglex.engines.build import build_engine
    from eaglex.runtime.engine import open_engine

    out = tmp_path / "engine"
    build_engine(models["llama"], models["llama/eagle3"], out, "onnxruntime", "float32", force=True, kernels="stock")
    cpu = open_engine(out, device="cpu")
    gpu = open_engine(out, device=DEVICE)
    assert gpu.device.startswith("cuda")
    tree = TreeConfig.parse("dynamic:16/6/4")
    for p in cases_prompts[:6]:
        want = VanillaGenerator(cpu.backend).generate(p, MAX_NEW).output_ids
        assert VanillaGenerator(gpu.backend).generate(p, MAX_NEW).output_ids == want
        assert SpeculativeGenerator(gpu.backend, tree).generate(p, MAX_NEW).output_ids == want


def test_head_trainers_run_on_the_device(models, tmp_path):
    """Self-distillation, both trainers and the τ report on DEVICE (eaglex/recipe_smollm2.py --device cuda, eaglex
    train-draft --device): the head trains where the target is, learns, and its saved file decodes losslessly."""
    from dataclasses import replace as dc_replace

    from eaglex.models.target import load_target
    from eaglex.training.eagle1 import Eagle1Config, train_eagle1
    from eaglex.training.eagle3 import Eagle3Config, save_eagle3, train_eagle3
    from eaglex.training.loop import OptimConfig
    from eaglex.training.report import tau_table
    from eaglex.training.selfdistill import SelfDistillConfig, generate

    target = load_target(models["llama"], device=DEVICE)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, target.spec.vocab_size, (16, 8), generator=g).tolist()
    data = generate(target.hf, prompts, SelfDistillConfig(new_tokens=32, batch=16, sampled_fraction=0.5))
    assert data.tokens.device.type == "cpu" and data.tokens.shape == (16, 40)
    fast = OptimConfig(steps=30, lr=3e-3, warmup=3, checkpoint_every=0)
    cfg3 = Eagle3Config(draft_vocab_size=40, ttt_steps=3, batch=8, teacher_cache_gb=0.0, optim=fast)
    head, config, t2d, l3 = train_eagle3(target, data, cfg3)
    assert next(head.parameters()).device.type == torch.device(DEVICE).type
    assert sum(l3[-5:]) < sum(l3[:5]), l3
    _, _, l1 = train_eagle1(target, data, Eagle1Config(batch=8, teacher_cache_gb=0.0, optim=dc_replace(fast)))
    assert sum(l1[-5:]) < sum(l1[:5]), l1
    save_eagle3(head, config, t2d, tmp_path / "head")
    rows = tau_table(models["llama"], {"head": tmp_path / "head"}, prompts[:3], {"chain": TreeConfig.chain(3)},
                     max_new_tokens=16, progress=False, device=DEVICE)
    assert rows[0].identical == rows[0].prompts == 3
