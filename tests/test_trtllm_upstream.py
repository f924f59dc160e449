"""TensorRT-LLM bundles judged by upstream's rules, not eaglex's own schema: the options YAML against the field lists
recorded per TensorRT-LLM version (engines/trtllm_upstream.py), the version floor derived from those records, and a
checkpoint calibrated by real ModelOpt on a seeded model read the way TensorRT-LLM's FP8 loader reads it (dtype,
tensor names, shapes).

These would have failed before: the options named no dtype and a deprecated `backend`; the FP8 checkpoint was
float32 (unquantized tensors and config); MIN_TRTLLM said 1.2 with nothing recorded for it.
"""
from __future__ import annotations

import importlib.util
import json

import pytest
import yaml

from eaglex.calibration.memory import safetensors_header
from eaglex.engines import trtllm
from eaglex.engines import trtllm_upstream as up

HAVE_MODELOPT = importlib.util.find_spec("modelopt") is not None
needs_modelopt = pytest.mark.skipif(not HAVE_MODELOPT, reason="nvidia-modelopt is not installed")


@pytest.fixture(scope="module")
def options(models, tmp_path_factory):
    """The options of a chain bundle and of a dynamic-tree bundle."""
    root = tmp_path_factory.mktemp("upstream")
    out = {}
    for name, cfg in (("chain", trtllm.TrtllmConfig()),
                      ("tree", trtllm.TrtllmConfig(tp=2, max_draft_len=4, dynamic_tree_top_k=4,
                                                   max_total_draft_tokens=10))):
        m = trtllm.build_trtllm_bundle(models["llama"], models["llama/eagle3"], root / name, cfg, progress=False)
        assert yaml.safe_load((root / name / "llm_api_options.yaml").read_text()) == m["llm_api_options"]
        out[name] = m["llm_api_options"]
    return out


def test_records_name_their_source():
    for r in up.RECORDS:
        assert r.fields and r.source and (r.source.startswith("https://nvidia.github.io/TensorRT-LLM/")
                                          or "llm_args.py @ NVIDIA/TensorRT-LLM" in r.source), r
        assert r.version == "pre-1.0" or r.version in r.source, r
    assert up.VERSIONS == ("1.3.0rc27", "1.4.0rc1", "1.4.0rc4")


def test_options_are_fields_of_every_recorded_version(options):
    for name, opts in options.items():
        assert opts["dtype"] in ("bfloat16", "float16") and "backend" not in opts
        for v in up.VERSIONS:
            verdict = up.check_options(opts, v)
            assert verdict.errors == [], (name, v, verdict.errors)
            # every speculative_config key is checked against a complete field list: nothing left unverified there
            assert not [k for k in verdict.unverified if k.startswith("speculative_config.")], (name, v)
        # the newest record has the whole top level we write, speculative_config included
        assert up.check_options(opts, "1.4.0rc4").unverified == []


def test_version_floor_is_what_the_records_support(options, tmp_path):
    """MIN_TRTLLM is derived from the records, and the pre-1.0 llm_args.py (one EAGLE class, decoding type
    "Eagle", no captured layers) rejects the options: the floor is not decoration."""
    for opts in options.values():
        assert up.floor(opts) == trtllm.MIN_TRTLLM == up.VERSIONS[0]
    errors = "\n".join(up.check_options(options["chain"], "pre-1.0").errors)
    assert "decoding_type: 'Eagle3' is not a decoding type of TensorRT-LLM pre-1.0" in errors
    assert "eagle3_layers_to_capture: not a field of EagleDecodingConfig" in errors
    trtllm.write_options(tmp_path / "o.yaml", options["chain"])
    assert f"TensorRT-LLM >= {trtllm.MIN_TRTLLM}" in (tmp_path / "o.yaml").read_text()


def test_spellings_upstream_dropped_are_caught():
    base = {"dtype": "bfloat16", "tensor_parallel_size": 1, "pipeline_parallel_size": 1,
            "speculative_config": {"decoding_type": "Eagle3", "max_draft_len": 3, "speculative_model": "./draft"}}
    assert up.check_options(base, "1.3.0rc27").errors == []
    for key, version in (("eagle3_one_model", "1.3.0rc27"), ("pytorch_weights_path", "1.3.0rc27"),
                         ("eagle_choices", "1.4.0rc1"), ("num_eagle_layers", "1.4.0rc4")):
        bad = json.loads(json.dumps(base))
        bad["speculative_config"][key] = 1
        assert [e for e in up.check_options(bad, version).errors if e.startswith(f"speculative_config.{key}:")], key
    assert up.floor(dict(base, speculative_config=dict(base["speculative_config"], num_eagle_layers=3))) is None


def test_installed_classes_check_reads_fields_and_aliases():
    """On a GPU machine the options are checked against the installed TensorRT-LLM's own pydantic classes; a
    validation alias (speculative_model_dir) counts as a field name."""
    from pydantic import AliasChoices, BaseModel, ConfigDict, Field

    class Spec(BaseModel):
        model_config = ConfigDict(extra="forbid")
        decoding_type: str = "Eagle3"
        max_draft_len: int = 0
        speculative_model: str | None = Field(default=None, validation_alias=AliasChoices("speculative_model",
                                                                                           "speculative_model_dir"))

    class Kv(BaseModel):
        enable_block_reuse: bool = True

    class Args(BaseModel):
        dtype: str = "auto"
        speculative_config: Spec | None = None
        kv_cache_config: Kv | None = None

    classes = {"TorchLlmArgs": Args, "Eagle3DecodingConfig": Spec, "KvCacheConfig": Kv}
    opts = {"dtype": "bfloat16", "speculative_config": {"decoding_type": "Eagle3", "speculative_model_dir": "d"},
            "kv_cache_config": {"enable_block_reuse": False, "free_gpu_memory_fraction": 0.8},
            "tensor_parallel_size": 1}
    assert up.installed_problems(opts, classes) == [
        "TorchLlmArgs of the installed TensorRT-LLM has no field 'tensor_parallel_size'",
        "KvCacheConfig of the installed TensorRT-LLM has no field 'free_gpu_memory_fraction'"]
    assert trtllm.installed_problems(opts) == [] or importlib.util.find_spec("tensorrt_llm") is not None


@pytest.fixture(scope="module")
def modelopt_checkpoints(models, prompts, tmp_path_factory):
    """The llama fixture calibrated by real ModelOpt with the FP8 KV cache: in bfloat16 (the default) and, as the
    defect it replaces, in float32."""
    if not HAVE_MODELOPT:
        pytest.skip("nvidia-modelopt is not installed")
    from test_trtllm import calibrated_checkpoint
    root = tmp_path_factory.mktemp("modelopt")
    return {"bfloat16": calibrated_checkpoint(models["llama"], root / "bf16", prompts),
            "float32": calibrated_checkpoint(models["llama"], root / "f32", prompts, dtype="float32")}


@needs_modelopt
def test_modelopt_checkpoint_reads_as_tensorrt_llm_loads_it(modelopt_checkpoints, models):
    ck = modelopt_checkpoints["bfloat16"]
    assert up.fp8_checkpoint_problems(ck) == []
    cfg = json.loads((ck / "config.json").read_text())
    src = json.loads((models["llama"] / "config.json").read_text())
    assert cfg["torch_dtype"] == cfg["dtype"] == "bfloat16"
    tensors = {}
    for f in ck.glob("*.safetensors"):
        tensors.update({k: v for k, v in safetensors_header(f).items() if k != "__metadata__"})
    H, nh = src["hidden_size"], src["num_attention_heads"]
    hd = src.get("head_dim") or H // nh
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    assert q == {**q, "dtype": "F8_E4M3", "shape": [nh * hd, H]}
    assert tensors["model.layers.0.self_attn.k_proj.k_scale"]["dtype"] == "F32"
    assert {t["dtype"] for k, t in tensors.items() if not k.endswith("_scale")} == {"F8_E4M3", "BF16"}
    assert tensors["lm_head.weight"]["dtype"] == tensors["model.embed_tokens.weight"]["dtype"] == "BF16"


@needs_modelopt
def test_float32_checkpoint_fails_tensorrt_llm_rules(modelopt_checkpoints):
    ck = modelopt_checkpoints["float32"]
    probs = up.fp8_checkpoint_problems(ck)
    assert probs == ["config.json dtype 'float32': TensorRT-LLM takes the model dtype from the config and its "
                     "kernels run bfloat16 or float16 (recalibrate with --dtype bfloat16)"]
    header = {}
    for f in ck.glob("*.safetensors"):
        header.update(safetensors_header(f))
    assert header["lm_head.weight"]["dtype"] == "F32"       # what calibrating without a dtype used to ship


@needs_modelopt
def test_fp8_bundle_from_modelopt_agrees_on_one_dtype(modelopt_checkpoints, models, tmp_path):
    m = trtllm.build_trtllm_bundle(models["llama"], models["llama/eagle3"], tmp_path / "b",
                                   trtllm.TrtllmConfig(quant="fp8"), modelopt_checkpoints["bfloat16"], progress=False)
    tcfg = json.loads((tmp_path / "b" / "target" / "config.json").read_text())
    dcfg = json.loads((tmp_path / "b" / "draft" / "config.json").read_text())
    assert m["dtype"] == m["llm_api_options"]["dtype"] == tcfg["torch_dtype"] == dcfg["torch_dtype"] == "bfloat16"
    assert m["quant"]["kv_cache_quant_algo"] == "FP8" and trtllm.bundle_problems(tmp_path / "b") == []
    # tampering with one scale's shape is caught by the loader rules
    f = next((tmp_path / "b" / "target").glob("*.safetensors"))
    import torch
    from safetensors.torch import load_file, save_file
    state = load_file(str(f))
    state["model.layers.1.mlp.up_proj.input_scale"] = torch.ones(2)
    f.unlink()                                  # the bundle's files are hard links into the calibrated checkpoint
    save_file(state, str(f))
    assert any("model.layers.1.mlp.up_proj.input_scale is F32 [2], expected one float32 value" in p
               for p in trtllm.bundle_problems(tmp_path / "b"))
