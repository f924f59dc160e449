"""TensorRT-LLM bundles: generated bundles validate against the documented schema and TensorRT-LLM's recorded rules
(engines/trtllm_upstream.py), the validator catches broken ones, one dtype runs through options, configs, manifest
and tensors, and `eaglex generate/check --engine BUNDLE` stops with one clear line where TensorRT-LLM is missing.

The FP8 bundle takes a checkpoint calibrated by real ModelOpt (`eaglex calibrate`) when nvidia-modelopt is installed,
else one written in ModelOpt's unified layout by the helper below (per-tensor amax/448 scales, bfloat16 elsewhere).
The one test that runs TensorRT-LLM skips unless it is importable and a CUDA GPU is present.
"""
from __future__ import annotations

import importlib.util
import json
import shutil

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eaglex.base.errors import ModelError
from eaglex.cli import main
from eaglex.engines import trtllm
from eaglex.runtime.manifest import MANIFEST

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


HAVE_MODELOPT = importlib.util.find_spec("modelopt") is not None


def fp8_checkpoint(target_dir, out, dtype=torch.bfloat16):
    """The target in ModelOpt's unified FP8 layout (weights float8_e4m3fn, weight/input scales, the rest in `dtype`),
    no calibration."""
    out.mkdir()
    state = load_file(str(target_dir / "model.safetensors"))
    tensors = {}
    for k, v in state.items():
        if k.endswith(".weight") and k.rsplit(".", 2)[-2] in LINEAR:
            m = k[: -len(".weight")]
            scale = v.abs().max() / 448
            tensors[k] = (v / scale).to(torch.float8_e4m3fn)
            tensors[m + ".weight_scale"] = scale.float()
            tensors[m + ".input_scale"] = torch.tensor(10 / 448)
        else:
            tensors[k] = v.to(dtype)
    save_file(tensors, str(out / "model.safetensors"))
    cfg = json.loads((target_dir / "config.json").read_text())
    cfg["dtype"] = cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "FP8", "ignore": ["lm_head"]}
    (out / "config.json").write_text(json.dumps(cfg))
    (out / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "test"}, "quantization": {
        "quant_algo": "FP8", "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]}}))
    return out


def calibrated_checkpoint(target_dir, out, prompts, **cfg):
    """`eaglex calibrate` (real ModelOpt, bfloat16 unless asked) of a fixture target on its own token ids."""
    from eaglex.calibration.fp8 import CalibrateConfig, calibrate
    data = out.with_name(out.name + ".jsonl")
    data.write_text("".join(json.dumps({"input_ids": p * 4}) + "\n" for p in prompts if len(p) > 4))
    calibrate(target_dir, out, CalibrateConfig(data=str(data), samples=6, seq_len=32, eval_samples=2,
                                               **{"kv_cache": "fp8", **cfg}), progress=False)
    return out


@pytest.fixture(scope="module")
def bundles(models, prompts, tmp_path_factory):
    root = tmp_path_factory.mktemp("bundles")
    plain = trtllm.build_trtllm_bundle(models["llama"], models["llama/eagle3"], root / "plain", progress=False)
    ckpt = (calibrated_checkpoint(models["llama"], root / "llama-fp8", prompts) if HAVE_MODELOPT
            else fp8_checkpoint(models["llama"], root / "llama-fp8"))
    cfg = trtllm.TrtllmConfig(quant="fp8", tp=2, max_draft_len=4, dynamic_tree_top_k=4, max_total_draft_tokens=10)
    fp8 = trtllm.build_trtllm_bundle(models["llama"], models["llama/eagle3"], root / "fp8", cfg, ckpt,
                                     progress=False)
    return {"plain": (root / "plain", plain), "fp8": (root / "fp8", fp8)}


def _capture(target_dir) -> list[int]:
    """TensorRT-LLM's default (and eaglex's) EAGLE-3 capture layers of a target: {1, L//2 - 1, L - 4}."""
    L = json.loads((target_dir / "config.json").read_text())["num_hidden_layers"]
    return sorted({1, L // 2 - 1, L - 4})


def test_plain_bundle_layout(bundles, models):
    b, m = bundles["plain"]
    capture = _capture(models["llama"])
    assert trtllm.bundle_problems(b) == []
    assert trtllm.is_bundle(b) and m["backend"] == "tensorrt-llm" and m["quant"]["method"] is None
    opts = yaml.safe_load((b / "llm_api_options.yaml").read_text())
    assert opts == m["llm_api_options"]
    # the float32 fixture is served in bfloat16 (TensorRT-LLM's kernels have no float32 path): one dtype everywhere
    assert opts["dtype"] == m["dtype"] == "bfloat16" and m["quant"]["weights_dtype"] == "float32"
    assert "backend" not in opts                 # deprecated field; PyTorch is TensorRT-LLM's default backend
    spec = opts["speculative_config"]
    assert spec == {"decoding_type": "Eagle3", "max_draft_len": 3, "speculative_model": "./draft",
                    "eagle3_layers_to_capture": capture, "use_dynamic_tree": False}
    assert opts["tensor_parallel_size"] == 1 and opts["pipeline_parallel_size"] == 1
    assert opts["kv_cache_config"]["enable_block_reuse"] is False
    # EAGLE-3 reads the inputs of layers {2, L//2, L-3}: the outputs TensorRT-LLM captures, one layer lower
    dcfg = json.loads((b / "draft" / "config.json").read_text())
    assert dcfg["architectures"] == ["LlamaForCausalLMEagle3"] and dcfg["draft_vocab_size"] == 40
    assert dcfg["torch_dtype"] == "bfloat16"
    assert dcfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == capture
    with safe_open(str(b / "draft" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("d2t").dtype == torch.int64
        assert {f.get_slice(k).get_dtype() for k in keys if k != "d2t"} == {"BF16"}
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.hidden_norm.weight", "norm.weight",
            "lm_head.weight", "d2t"} <= keys and not any(k.startswith("layers.") for k in keys)
    tcfg = json.loads((b / "target" / "config.json").read_text())
    src = json.loads((models["llama"] / "config.json").read_text())
    # the pre-transformers-5 RoPE keys TensorRT-LLM's transformers reads, equal to the new-style ones
    assert tcfg["rope_theta"] == src["rope_parameters"]["rope_theta"] == 500000.0
    assert tcfg["rope_scaling"]["rope_type"] == "llama3" and tcfg["torch_dtype"] == tcfg["dtype"] == "bfloat16"
    assert (b / "target" / "model.safetensors").read_bytes() == (models["llama"] / "model.safetensors").read_bytes()


def test_fp8_bundle_layout(bundles):
    b, m = bundles["fp8"]
    assert trtllm.bundle_problems(b) == []
    assert m["quant"]["method"] == "fp8" and m["quant"]["quant_algo"] == "FP8"
    assert (b / "target" / "hf_quant_config.json").is_file()
    tcfg = json.loads((b / "target" / "config.json").read_text())
    assert m["dtype"] == m["llm_api_options"]["dtype"] == tcfg["torch_dtype"] == "bfloat16"
    for f in sorted((b / "target").glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            dtypes = {k: st.get_slice(k).get_dtype() for k in st.keys()}
        assert dtypes.get("model.layers.0.self_attn.q_proj.weight", "F8_E4M3") == "F8_E4M3"
        assert {d for k, d in dtypes.items() if not k.endswith("_scale")} <= {"F8_E4M3", "BF16"}
    spec = m["llm_api_options"]["speculative_config"]
    assert spec["use_dynamic_tree"] and spec["dynamic_tree_max_topK"] == 4 and spec["max_total_draft_tokens"] == 10
    assert m["llm_api_options"]["tensor_parallel_size"] == 2 and m["hardware"]["gpus"] == 2
    assert "8.9" in m["hardware"]["compute_capability"]


def _copy(bundles, tmp_path, name="plain"):
    dst = tmp_path / name
    shutil.copytree(bundles[name][0], dst)
    return dst


def _rewrite_options(b, fn):
    m = json.loads((b / MANIFEST).read_text())
    fn(m["llm_api_options"])
    (b / MANIFEST).write_text(json.dumps(m))
    trtllm.write_options(b / "llm_api_options.yaml", m["llm_api_options"])


def test_validator_catches_broken_bundles(bundles, models, tmp_path):
    b = _copy(bundles, tmp_path)
    _rewrite_options(b, lambda o: o["speculative_config"].update(decoding_type="Eagle", max_draft_len=0))
    probs = "\n".join(trtllm.bundle_problems(b))
    assert "decoding_type: must be 'Eagle3'" in probs and "max_draft_len: must be >= 1" in probs

    b = _copy(bundles, tmp_path / "2")
    L = json.loads((models["llama"] / "config.json").read_text())["num_hidden_layers"]
    _rewrite_options(b, lambda o: o["speculative_config"].update(eagle3_layers_to_capture=[1, 3, L + 1]))
    probs = "\n".join(trtllm.bundle_problems(b))
    assert f"distinct layers of the target's {L}" in probs and "captured layers differ" in probs

    b = _copy(bundles, tmp_path / "3")
    (b / "llm_api_options.yaml").write_text((b / "llm_api_options.yaml").read_text().replace("max_draft_len: 3",
                                                                                          "max_draft_len: 5"))
    assert any("differs from manifest.json" in p for p in trtllm.bundle_problems(b))

    b = _copy(bundles, tmp_path / "4")
    state = load_file(str(b / "draft" / "model.safetensors"))
    del state["d2t"]
    save_file(state, str(b / "draft" / "model.safetensors"))
    probs = "\n".join(trtllm.bundle_problems(b))
    assert "draft/model.safetensors: missing d2t" in probs and "bytes, the manifest says" in probs

    b = _copy(bundles, tmp_path / "5")
    cfg = json.loads((b / "draft" / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (b / "draft" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match=r"invalid: .*architectures\[0\]: must be 'LlamaForCausalLMEagle3'"):
        trtllm.validate_bundle(b)

    b = _copy(bundles, tmp_path / "6", name="fp8")
    (b / "target" / "hf_quant_config.json").unlink()
    assert any("hf_quant_config.json is missing" in p for p in trtllm.bundle_problems(b))

    # one dtype everywhere: a draft config saying float16 while the options say bfloat16 is caught
    b = _copy(bundles, tmp_path / "7")
    cfg = json.loads((b / "draft" / "config.json").read_text())
    cfg["torch_dtype"] = "float16"
    (b / "draft" / "config.json").write_text(json.dumps(cfg))
    assert any(p.startswith("dtypes disagree:") for p in trtllm.bundle_problems(b))

    # a key no recorded TensorRT-LLM version from the floor on takes (eagle3_one_model is gone from 1.3) is rejected
    # by upstream's rules as well as by the bundle schema
    opts = json.loads(json.dumps(bundles["plain"][1]["llm_api_options"]))
    opts["speculative_config"]["eagle3_one_model"] = True
    assert trtllm.upstream_problems(bundles["plain"][1]["llm_api_options"]) == []
    assert "eagle3_one_model: not a field of Eagle3DecodingConfig in TensorRT-LLM 1.3.0rc27" in \
        "\n".join(trtllm.upstream_problems(opts))


def test_schema_subset():
    s = {"type": "object", "required": ["a"], "additionalProperties": False,
         "properties": {"a": {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
                        "b": {"enum": [None, "x"]}, "c": {"type": ["string", "null"]}}}
    assert trtllm.schema_errors({"a": [0, 2], "b": None, "c": None}, s) == []
    errs = trtllm.schema_errors({"a": [True, -1], "b": "y", "d": 1}, s)
    assert errs == ["$.a[0]: must be integer, is bool", "$.a[1]: must be >= 0, is -1",
                    "$.b: must be one of [None, 'x'], is 'y'", "$: unexpected key 'd'"]
    assert trtllm.schema_errors({}, s) == ["$: missing 'a'"]


def test_bundle_errors(models, tmp_path):
    with pytest.raises(ModelError, match="EAGLE-1/2 head: TensorRT-LLM's PyTorch backend runs EAGLE-3 heads only"):
        trtllm.build_trtllm_bundle(models["llama"], models["llama/eagle1"], tmp_path / "a", progress=False)
    heads = json.loads((models["llama"] / "config.json").read_text())["num_attention_heads"]
    with pytest.raises(ModelError, match=f"--tp {heads + 1} does not divide the target's {heads} attention heads"):
        trtllm.build_trtllm_bundle(models["llama"], models["llama/eagle3"], tmp_path / "a",
                                   trtllm.TrtllmConfig(tp=heads + 1))
    with pytest.raises(ModelError, match=r"max_total_draft_tokens 20 must lie in .* = \[3, 12\]"):
        trtllm.TrtllmConfig(dynamic_tree_top_k=4, max_total_draft_tokens=20)
    with pytest.raises(ModelError, match="not an FP8 checkpoint"):
        trtllm.build_trtllm_bundle(models["llama"], models["llama/eagle3"], tmp_path / "a",
                                   trtllm.TrtllmConfig(quant="fp8"), models["llama"])
    with pytest.raises(ModelError, match="is not of target"):
        trtllm.build_trtllm_bundle(models["llama"], models["llama/eagle3"], tmp_path / "a",
                                   trtllm.TrtllmConfig(quant="fp8"), fp8_checkpoint(models["qwen2"], tmp_path / "q"))
    # a float32 FP8 checkpoint (what calibrating without a dtype used to write) is refused in one line
    with pytest.raises(ModelError, match=r"is float32: TensorRT-LLM takes the model dtype from its config .* "
                                         r"--dtype bfloat16"):
        trtllm.build_trtllm_bundle(models["llama"], models["llama/eagle3"], tmp_path / "a",
                                   trtllm.TrtllmConfig(quant="fp8"),
                                   fp8_checkpoint(models["llama"], tmp_path / "f32", torch.float32))
    assert not (tmp_path / "a").exists() and not list(tmp_path.glob(".a.*"))


def test_cli_build_and_run_without_trtllm(models, bundles, tmp_path, capsys):
    out = tmp_path / "cli"
    assert main(["build", "--backend", "tensorrt-llm", "--target", str(models["llama"]), "--draft",
                 str(models["llama/eagle3"]), "--out", str(out), "--tree", "chain:5"]) == 0
    assert "TensorRT-LLM bundle" in capsys.readouterr().out
    assert trtllm.validate_bundle(out)["llm_api_options"]["speculative_config"]["max_draft_len"] == 5
    if importlib.util.find_spec("tensorrt_llm") is not None:
        pytest.skip("TensorRT-LLM is installed here: the missing-library message is not reachable")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"input_ids": [1, 2, 3]}\n')
    for cmd in (["generate", "--engine", str(out), "--prompts", str(prompts)],
                ["check", "--engine", str(out), "--prompts", str(prompts)]):
        assert main(cmd) == 2
        err = capsys.readouterr().err
        assert err.startswith("eaglex: error: TensorRT-LLM is not installed on this machine; this bundle runs on a "
                              "GPU machine") and len(err.strip().splitlines()) == 1


def _gpu_trtllm() -> str | None:
    if importlib.util.find_spec("tensorrt_llm") is None:
        return "TensorRT-LLM is not installed (GPU machines only)"
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    return None


@pytest.mark.skipif(_gpu_trtllm() is not None, reason=_gpu_trtllm() or "")
def test_trtllm_eagle3_matches_vanilla_on_gpu(bundles, prompts):
    """On a GPU machine: TensorRT-LLM's EAGLE-3 over the bundle gives the same greedy tokens as its vanilla run."""
    from eaglex.runtime.trtllm_bundle import TrtllmRunner
    runner = TrtllmRunner(bundles["plain"][0])
    rows = runner.check(prompts[:4], 24)
    assert all(r["identical"] for r in rows), rows
