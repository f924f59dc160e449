"""The device-agnostic half of the GPU path, on the CPU: device and provider choice, the static-shape forwards that
CUDA graphs capture (runtime/static.py) run eagerly here and must decode exactly like the eager reference, and the
`--device` flags. The CUDA half is tests/test_gpu.py."""
from __future__ import annotations

import json

import onnxruntime as ort
import pytest
import torch

from eaglex.base.errors import ModelError
from eaglex.cli import main
from eaglex.runtime.batch import chain_for
from eaglex.runtime.device import device_of, host, resolve_device
from eaglex.runtime.engine import open_models
from eaglex.runtime.generate import SpeculativeGenerator, VanillaGenerator
from eaglex.runtime.ort_session import choose_providers, provider_device
from eaglex.runtime.static import MIN_WINDOW, window_for, window_mask
from eaglex.runtime.torch_backend import TorchBackend
from eaglex.runtime.torch_cache import SlotCache
from eaglex.runtime.types import SamplingConfig, TreeConfig

MAX_NEW = 40
NO_CUDA = not torch.cuda.is_available()


# ------------------------------------------------------------------------------------------- device choice

def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    auto = resolve_device("auto")
    assert auto.type == ("cpu" if NO_CUDA else "cuda")
    assert resolve_device(None) == auto
    with pytest.raises(ModelError, match="device must be"):
        resolve_device("tpu")
    with pytest.raises(ModelError, match="device must be"):
        resolve_device("gpu0")


@pytest.mark.skipif(not NO_CUDA, reason="checks the messages of a machine without CUDA")
def test_resolve_device_without_cuda():
    for name in ("cuda", "cuda:0", "cuda:3"):
        with pytest.raises(ModelError, match="use --device cpu"):
            resolve_device(name)


def test_host_is_free_on_the_cpu():
    a, b = torch.arange(3), torch.ones(2)
    got = host(a, b)
    assert got[0] is a and got[1] is b


def test_choose_providers():
    assert choose_providers("cpu") == ["CPUExecutionProvider"]
    assert choose_providers(None) == ["CPUExecutionProvider"]
    assert choose_providers("cpu", "CPUExecutionProvider") == ["CPUExecutionProvider"]
    assert choose_providers("cpu", ["CPUExecutionProvider"]) == ["CPUExecutionProvider"]
    available = ort.get_available_providers()
    if "CUDAExecutionProvider" not in available:
        assert choose_providers("auto") == ["CPUExecutionProvider"]     # auto falls back to the CPU
        with pytest.raises(ModelError, match="onnxruntime-gpu"):
            choose_providers("cuda:1")
        with pytest.raises(ModelError, match="has no CUDAExecutionProvider"):
            choose_providers("cpu", "CUDAExecutionProvider,CPUExecutionProvider")
    else:
        assert choose_providers("cuda:1")[0] == ("CUDAExecutionProvider", {"device_id": 1})
        assert choose_providers("cuda:1")[-1] == "CPUExecutionProvider"
    with pytest.raises(ModelError, match="device must be"):
        choose_providers("tpu")


def test_provider_device():
    assert provider_device(None) == ("cpu", 0)
    assert provider_device(["CPUExecutionProvider"]) == ("cpu", 0)
    assert provider_device([("CUDAExecutionProvider", {"device_id": 2}), "CPUExecutionProvider"]) == ("cuda", 2)
    assert provider_device([("TensorrtExecutionProvider", {"device_id": 0})]) == ("cuda", 0)

    class Ort:
        kv_device = ("cuda", 1)
    assert device_of(Ort()) == "cuda:1"


def test_graphs_need_cuda(models):
    with pytest.raises(ModelError, match="CUDA graphs need a CUDA device"):
        TorchBackend(models["llama"], device="cpu", mode="graphs")
    with pytest.raises(ModelError, match="mode must be"):
        TorchBackend(models["llama"], mode="compiled")


# ------------------------------------------------------------------------------------------- static forwards

def test_window_for():
    assert window_for(1, 4096) == MIN_WINDOW
    assert window_for(MIN_WINDOW, 4096) == MIN_WINDOW
    assert window_for(MIN_WINDOW + 1, 4096) == 2 * MIN_WINDOW
    assert window_for(1000, 600) == 600                  # never past the capacity


@pytest.mark.parametrize("length,pending,n", [(0, 0, 5), (7, 0, 1), (7, 3, 4), (30, 12, 10), (0, 6, 6)])
def test_window_mask_matches_the_eager_mask(length, pending, n):
    """The device-built window mask = the eager mask over the rows that exist, then nothing."""
    g = torch.Generator().manual_seed(length * 100 + pending * 10 + n)
    local = torch.rand(2, n, pending + n, generator=g) < 0.5
    window = window_for(length + pending + n, 1024)
    got = window_mask(local, torch.tensor([length]), window)
    end = length + pending + n

    def eager(mask, batch):                  # the eager backend's mask for rows at `length` with `pending` rows
        c = SlotCache(1, batch, 1, 1, 1024, torch.float32)
        c.length, c.pending = [length] * batch, [pending] * batch
        starts, stop = c.begin(slice(0, batch), n)
        return c.mask(slice(0, batch), starts, stop, mask, n)
    assert got.shape == (2, 1, n, window)
    assert torch.equal(got[..., :end], eager(local, 2)) and not got[..., end:].any()
    causal = window_mask(torch.ones(1, n, pending + n, dtype=torch.bool).tril(pending), torch.tensor([length]), window)
    assert torch.equal(causal[..., :end], eager(None, 1))


CASES = [("eagle3", "dynamic:60/8/10"), ("eagle3", "chain:6"), ("eagle1", "static"), ("eagle1", "dynamic:8/5/3")]


@pytest.fixture(scope="module")
def eager_vanilla(models, prompts):
    """Vanilla outputs of the eager reference (equal to transformers: tests/test_exactness.py)."""
    return {t: [VanillaGenerator(TorchBackend(models[t])).generate(p, MAX_NEW).output_ids for p in prompts]
            for t in ("llama", "qwen2")}


@pytest.mark.parametrize("head,tree", CASES, ids=[f"{h}-{t}" for h, t in CASES])
@pytest.mark.parametrize("target", ["llama", "qwen2"])
def test_static_mode_decodes_like_eager(target, head, tree, models, prompts, eager_vanilla):
    """Static forwards (what a GPU captures as CUDA graphs): vanilla and speculative both equal eager vanilla."""
    backend = TorchBackend(models[target], models[f"{target}/{head}"], mode="static")
    vanilla = VanillaGenerator(backend)
    spec = SpeculativeGenerator(backend, TreeConfig.parse(tree))
    lengths = []
    for i, p in enumerate(prompts):
        s = spec.generate(p, MAX_NEW)
        assert s.output_ids == eager_vanilla[target][i], f"prompt {i}: speculative (static) diverged"
        lengths += s.accept_lengths
        if i % 4 == 0:
            assert vanilla.generate(p, MAX_NEW).output_ids == eager_vanilla[target][i], f"prompt {i}: vanilla"
    assert max(lengths) >= 4 and sum(lengths) / len(lengths) > 1.5


def test_static_mode_sampling_and_context_limit(models, prompts):
    """Sampling runs through the same static forwards; near the end of the context both modes stop alike."""
    eager = TorchBackend(models["llama"], models["llama/eagle3"])
    static = TorchBackend(models["llama"], models["llama/eagle3"], mode="static")
    cfg = SamplingConfig(temperature=0.8, top_p=0.9, seed=5)
    tree = TreeConfig.parse("dynamic:16/6/4")
    for p in prompts[:6]:
        a = SpeculativeGenerator(eager, tree, cfg).generate(p, 24)
        b = SpeculativeGenerator(static, tree, cfg).generate(p, 24)
        assert a.output_ids == b.output_ids
    limit = static.spec.max_context
    p = (prompts[3] * 40)[: limit - 30]
    a = SpeculativeGenerator(eager, tree).generate(p, 1000)
    b = SpeculativeGenerator(static, tree).generate(p, 1000)
    assert a.output_ids == b.output_ids and a.stop_reason == b.stop_reason


# ------------------------------------------------------------------------------------------- entry points

def test_open_models_device(models):
    engine = open_models(models["llama"], models["llama/eagle3"], device="cpu")
    assert engine.device == "cpu" and engine.backend.mode == "eager"
    engine = open_models(models["llama"], models["llama/eagle3"], device="auto", mode="static")
    assert engine.backend.mode == "static"


def test_cli_device_flags(models, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"input_ids": [3, 5, 7, 9]}) + "\n")
    out = tmp_path / "out.jsonl"
    base = ["generate", "--target", str(models["llama"]), "--draft", str(models["llama/eagle3"]), "--prompts",
            str(prompts), "--max-new-tokens", "12"]
    assert main(base + ["--device", "cpu", "--out", str(out)]) == 0
    cpu = json.loads(out.read_text())["output_ids"]
    assert main(base + ["--out", str(out)]) == 0                          # default: auto
    assert json.loads(out.read_text())["output_ids"] == cpu or not NO_CUDA
    assert main(base + ["--providers", "CPUExecutionProvider"]) == 2
    assert "--providers applies to ONNX Runtime engines" in capsys.readouterr().err
    if NO_CUDA:
        assert main(base + ["--device", "cuda"]) == 2
        assert "use --device cpu" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------- the GPU check's dry run

def _gpu_check(tmp_path, *args):
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "out"),
           "GPU_CHECK_WORK": str(tmp_path / "work")}
    proc = subprocess.run(["bash", str(repo / "tools/gpu_check.sh"), "--device", "cpu", "--quick", "--budget", "900",
                           *args], env=env, capture_output=True, text=True, timeout=1200)
    out = tmp_path / "out"
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert all(p["status"] == "ok" for p in results["phases"].values()), results["phases"]
    return results, (out / "report.txt").read_text()


def test_gpu_check_dry_run_cpu(tmp_path):
    """tools/gpu_check.sh on the CPU: models built and calibrated, the bench table, batching at 1, 4 and 16 requests
    in flight, the checks, the attention table (the equivalence phase, pytest of tests/test_gpu.py, is in the slow
    variant below)."""
    results, report = _gpu_check(tmp_path, "--no-install", "--no-peers", "--phases",
                                 "env,models,bench,batched,check,attention")
    assert abs(results["models"]["alpha"] - results["models"]["alpha_target"]) < 0.05
    rows = results["bench"]["rows"]
    assert rows[0]["method"] == "vanilla" and all(r["identical_to_vanilla"] for r in rows)
    assert any(r["method"] == "eagle3" and r["tau"] > 2 for r in rows)
    assert results["check"]["bench_target"]["prompts"] == 4
    batched = results["batched"]["rows"]                    # fp32: every request as it decodes alone, every pass
    tuned = TreeConfig.parse(results["bench"]["tuned_tree"])
    trees = ["vanilla", str(chain_for(tuned)), str(tuned) if tuned.kind != "chain" else "dynamic:16/6/4"]
    assert [(r["requests"], r["schedule"]) for r in batched] == [(b, t) for b in (1, 4, 16) for t in trees]
    assert all(r["identical"] == f"{2 * r['requests']}/{2 * r['requests']}" and r["tokens_per_s"] > 0 for r in batched)
    assert all(r["tau"] > 1.5 for r in batched if r["schedule"] != "vanilla")
    assert "goals" in report and "attention" in report


@pytest.mark.slow
def test_gpu_check_dry_run_cpu_full(tmp_path):
    """The whole dry run as the GPU machine runs it: install without dependencies, then every phase."""
    results, _ = _gpu_check(tmp_path)
    counts = results["equivalence"]["counts"]
    assert counts["failed"] == counts["error"] == 0 and counts["passed"] >= 8
    assert any(r["method"] == "hf greedy" for r in results["bench"]["rows"])
