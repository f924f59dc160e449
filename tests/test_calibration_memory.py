"""Memory: what a calibration needs is known before a weight is read, placed on CPU or spread over GPUs, refused in one
line when the machine lacks it, and measured: calibrating a seeded ~600 MB bfloat16 target on the CPU peaks at no more
than 1.3 x its weights (slow test, in a fresh process). Presets state their needs per stage, computed from exact
parameter counts, and `eaglex engine --model llama3-70b` stops at once on a machine without the GPUs."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from eaglex.base.errors import ModelError
from eaglex.calibration import memory
from eaglex.calibration.memory import GIB, Machine
from eaglex.presets import LLAMA3_70B, PRESETS, Arch, get_preset, memory_table, require_resources, stage_needs

HAVE_MODELOPT = importlib.util.find_spec("modelopt") is not None
H100 = (84_500_000_000, 85_500_000_000)          # free, total bytes of an idle H100 80 GB


def test_weights_bytes_from_safetensors_headers(models):
    from safetensors import safe_open
    with safe_open(str(models["llama"] / "model.safetensors"), "pt") as f:
        n = sum(f.get_slice(k).get_shape().__len__() and torch.Size(f.get_slice(k).get_shape()).numel()
                for k in f.keys())
    assert memory.checkpoint_params(models["llama"]) == {"F32": n}
    assert memory.weights_bytes(models["llama"], "bfloat16") == 2 * n
    assert memory.weights_bytes(models["llama"], "float32") == 4 * n


def test_plan_cpu_and_its_refusal():
    w = 10 * GIB
    p = memory.plan(w, "auto", Machine((), 64 * GIB))
    assert p.kind == "cpu" and p.device_map is None
    with pytest.raises(ModelError) as e:
        memory.plan(w, "auto", Machine((), 8 * GIB))
    msg = str(e.value)
    assert msg == (f"calibrating on the CPU (no CUDA GPU here) needs about {(w * 1.3 + 2 * GIB) / 1e9:.1f} GB of RAM "
                   f"(1.3 x the {w / 1e9:.1f} GB of bfloat16 weights + {2 * GIB / 1e9:.1f} GB); this machine has "
                   f"{8 * GIB / 1e9:.1f} GB available")
    assert "\n" not in msg


def test_plan_over_gpus():
    w = 141_100_000_000                                       # Llama-3.3-70B in bfloat16
    one = memory.plan(10 * GIB, "auto", Machine((H100, H100), 64 * GIB))
    assert one.kind == "gpu" and one.device_map == {"": 0}
    two = memory.plan(w, "auto", Machine((H100, H100), 64 * GIB))
    assert two.device_map == "auto" and two.offloaded == 0
    assert two.max_memory == {0: int(H100[0] * 0.9), 1: int(H100[0] * 0.9)}
    spill = memory.plan(w, "cuda", Machine((H100,), 96 * GIB))          # one GPU + 65 GB offloaded to RAM
    assert spill.offloaded == w - int(H100[0] * 0.9) and spill.max_memory["cpu"] == 94 * GIB
    assert "offloaded to CPU RAM" in spill.note
    with pytest.raises(ModelError, match=r"1 GPU\(s\) take 76.0 GB .* and 15.0 GB of RAM is left for the other 65.0 GB"):
        memory.plan(w, "auto", Machine((H100,), 16 * GIB))
    with pytest.raises(ModelError, match="--device cuda:1: this machine has 1 CUDA GPU"):
        memory.plan(w, "cuda:1", Machine((H100,), 16 * GIB))
    with pytest.raises(ModelError, match=r"calibrating on cuda:0 needs 141.1 GB .* \(use --device cuda to spread"):
        memory.plan(w, "cuda:0", Machine((H100,), 16 * GIB))
    with pytest.raises(ModelError, match="--device cuda: this machine has no CUDA GPU"):
        memory.plan(w, "cuda", Machine((), 16 * GIB))


@pytest.mark.skipif(not HAVE_MODELOPT, reason="nvidia-modelopt is not installed")
def test_calibrate_refuses_before_reading_weights(models, tmp_path):
    from eaglex.calibration.fp8 import CalibrateConfig, calibrate
    t = time.perf_counter()
    with pytest.raises(ModelError, match=r"calibrating on the CPU \(no CUDA GPU here\) needs about .* GB of RAM"):
        calibrate(models["llama"], tmp_path / "out", CalibrateConfig(), progress=False, machine=Machine((), 1000))
    assert time.perf_counter() - t < 2 and not (tmp_path / "out").exists() and not list(tmp_path.iterdir())


def test_parameter_counts_are_exact():
    """Arch.params against transformers' own count for a small Llama of the same shape (tied and untied)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    for tied in (False, True):
        a = Arch(vocab=96, hidden=64, layers=3, intermediate=160, heads=8, kv_heads=2, tied=tied)
        cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, num_hidden_layers=a.layers,
                          intermediate_size=a.intermediate, num_attention_heads=a.heads,
                          num_key_value_heads=a.kv_heads, tie_word_embeddings=tied)
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg)
        assert a.params == sum(p.numel() for p in model.parameters())
    # the published Llama-3.3-70B config: 70,553,706,496 parameters
    assert LLAMA3_70B.params == 70_553_706_496 and LLAMA3_70B.bytes() == 141_107_412_992


def test_presets_state_memory_per_stage():
    n = stage_needs(get_preset("llama3-70b"))
    assert n["weights_bf16"] == LLAMA3_70B.bytes() and n["calibrate_gpu"] == int(LLAMA3_70B.bytes() / 0.9)
    assert 70e9 < n["serve_weights"] < 80e9 and n["serve_gpu_per_gpu"] < 80e9     # fits 2x 80 GB at tp 2
    assert stage_needs(get_preset("llama3-8b"))["export_ram"] == int(get_preset("llama3-8b").arch.bytes("float32")
                                                                     * 1.25)
    table = memory_table()
    assert all(f"| {name} |" in table for name in PRESETS)
    assert "| llama3-70b | tensorrt-llm | 70.55 B + 1.40 B | 144 GB | FP8 calibration: 157 GB GPU memory" in table


def test_llama3_70b_stops_at_once_without_gpus():
    p = get_preset("llama3-70b")
    with pytest.raises(ModelError) as e:
        require_resources(p, machine=Machine((), 23 * GIB))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("llama3-70b needs NVIDIA GPUs: 156.8 GB of GPU memory to calibrate FP8 "
                                              "(141.1 GB of bfloat16 weights at 90 % of each GPU, e.g. 2x H100/H200 "
                                              "80 GB), then 2 GPU(s) with 44.4 GB each to serve; this machine has no "
                                              "CUDA GPU and 24.7 GB of available RAM")
    with pytest.raises(ModelError, match="this machine has 1 GPU"):
        require_resources(p, machine=Machine((H100,), 32 * GIB))
    require_resources(p, machine=Machine((H100, H100), 32 * GIB))          # the advertised setup fits
    require_resources(p, machine=Machine((), 23 * GIB), calibrated=True)    # a checkpoint calibrated elsewhere
    with pytest.raises(ModelError, match="llama3-8b needs 40.2 GB of RAM for the float32 ONNX export"):
        require_resources(get_preset("llama3-8b"), machine=Machine((), 16 * GIB))
    require_resources(get_preset("tiny"), machine=Machine((), 0))


# ------------------------------------------------------------------------------------------- measured peak

def _seeded_target(path, vocab=32000, hidden=1024, inter=4096, layers=16, heads=16, kv=4):
    """A random Llama in bfloat16 written tensor by tensor (never a whole model in memory): ~600 MB."""
    from safetensors.torch import save_file
    path.mkdir()
    g = torch.Generator().manual_seed(0)
    hd = hidden // heads

    def r(*s):
        return (torch.randn(*s, generator=g) * 0.02).to(torch.bfloat16)

    t = {"model.embed_tokens.weight": r(vocab, hidden), "lm_head.weight": r(vocab, hidden),
         "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t |= {p + "self_attn.q_proj.weight": r(heads * hd, hidden), p + "self_attn.k_proj.weight": r(kv * hd, hidden),
              p + "self_attn.v_proj.weight": r(kv * hd, hidden), p + "self_attn.o_proj.weight": r(hidden, heads * hd),
              p + "mlp.gate_proj.weight": r(inter, hidden), p + "mlp.up_proj.weight": r(inter, hidden),
              p + "mlp.down_proj.weight": r(hidden, inter),
              p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
              p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    save_file(t, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv, "head_dim": hd, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
        "hidden_act": "silu", "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "tie_word_embeddings": False, "dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}))
    return sum(v.numel() * v.element_size() for v in t.values())


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_MODELOPT, reason="nvidia-modelopt is not installed")
def test_cpu_calibration_peaks_near_one_copy_of_the_weights(tmp_path):
    weights = _seeded_target(tmp_path / "target")
    assert 550e6 < weights < 700e6
    rng = torch.Generator().manual_seed(1)
    (tmp_path / "data.jsonl").write_text("".join(
        json.dumps({"input_ids": torch.randint(0, 32000, (128,), generator=rng).tolist()}) + "\n" for _ in range(10)))
    code = ("import json, sys, torch\n"
            "torch.set_num_threads(2)\n"
            "from eaglex.calibration.fp8 import CalibrateConfig, calibrate\n"
            f"r = calibrate({str(tmp_path / 'target')!r}, {str(tmp_path / 'out')!r}, CalibrateConfig(kv_cache='fp8', "
            f"data={str(tmp_path / 'data.jsonl')!r}, samples=8, seq_len=64, eval_samples=2, device='cpu'), "
            "progress=False)\n"
            "print(json.dumps(r['memory']))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    mem = json.loads(out.stdout.strip().splitlines()[-1])
    assert mem["weights_bytes"] == weights and mem["peak_is_lifetime"] is False
    ratio = (mem["rss_peak_bytes"] - mem["rss_baseline_bytes"]) / weights
    print(f"peak {ratio:.3f} x the bf16 weights ({weights / 1e6:.0f} MB)")
    assert ratio <= 1.3, ratio


def test_docs_table_is_the_computed_one():
    REPO_ROOT = Path(__file__).resolve().parents[1]
    assert memory_table() in (REPO_ROOT / "docs" / "nvidia.md").read_text()
