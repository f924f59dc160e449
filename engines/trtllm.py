"""`eaglex build --backend tensorrt-llm`: a bundle that TensorRT-LLM's LLM API (PyTorch backend) serves with EAGLE-3.

One module of ~700 lines on purpose: the bundle's layout, the checks made on it and the serving configuration must
agree field by field, so they are written side by side.

TensorRT-LLM runs EAGLE-3 only on its PyTorch backend (its TensorRT-engine path knows EAGLE-1/2 alone and was
removed upstream), so the bundle holds no compiled engine: the GPU machine builds its kernels at load. What the
bundle fixes is everything that must be right for that load to be lossless and fast:

    BUNDLE/
      target/               the target: the HF folder (hard links), or the ModelOpt FP8 checkpoint (--quant fp8);
                            config.json also carries the pre-transformers-5 keys (rope_theta, rope_scaling,
                            torch_dtype) so that TensorRT-LLM's older transformers reads the same RoPE, and says the
                            serving dtype (a float32 target is served in bfloat16: TensorRT-LLM's kernels have no
                            float32 path, and its loader casts the stored weights when it copies them in)
      draft/                the EAGLE-3 head in the layout TensorRT-LLM loads, in the serving dtype: config.json
                            (architectures LlamaForCausalLMEagle3, draft_vocab_size, eagle_config with the captured
                            layers) and model.safetensors (fc, midlayer.*, norm, lm_head, d2t)
      llm_api_options.yaml  LLM-API options: dtype, speculative_config (decoding_type Eagle3, max_draft_len,
                            speculative_model ./draft, eagle3_layers_to_capture, dynamic-tree settings),
                            tensor/pipeline parallel sizes, KV cache settings. `trtllm-serve ./target
                            --extra_llm_api_options llm_api_options.yaml` (run inside BUNDLE) or
                            `LLM(model=..., **options)`
      manifest.json         eaglex's table of contents (format eaglex-engine, backend tensorrt-llm)

`validate_bundle` checks a bundle against the documented schemas below (pure Python, a JSON-schema subset), the
cross-file facts a schema cannot state (shapes against configs, captured layers against the target, one dtype in the
options, the configs, the manifest and the tensors), and TensorRT-LLM's own rules recorded in trtllm_upstream.py:
the options' keys against the field lists of every recorded version from MIN_TRTLLM on, and an FP8 target as
TensorRT-LLM's FP8 loader reads it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from eaglex.base.errors import ModelError
from eaglex.base.fsio import check_out, staged
from eaglex.base.prompts import TOKENIZER_FILES
from eaglex.runtime.manifest import (
    FORMAT,
    FORMAT_VERSION,
    HASH_LIMIT,
    MANIFEST,
    read_manifest,
    sha256_file,
    write_manifest,
)
from eaglex.runtime.trtllm_bundle import MIN_TRTLLM

from . import trtllm_upstream as upstream

BACKEND = "tensorrt-llm"
OPTIONS_FILE = "llm_api_options.yaml"
TARGET, DRAFT = "target", "draft"
SERVING_DTYPES = ("bfloat16", "float16")


@dataclass(frozen=True)
class TrtllmConfig:
    quant: str | None = None            # None (target as is) or "fp8" (ModelOpt FP8 checkpoint)
    tp: int = 1                         # tensor_parallel_size
    pp: int = 1                         # pipeline_parallel_size
    max_draft_len: int = 3              # draft steps (chain length / tree depth); NVIDIA's published configs use 3
    dynamic_tree_top_k: int = 0         # 0: linear chain; K > 0: EAGLE-2-style dynamic tree, K children per node
    max_total_draft_tokens: int = 0     # dynamic tree nodes (0: K * max_draft_len); in [max_draft_len, K*depth]
    free_gpu_memory_fraction: float = 0.85

    def __post_init__(self):
        problems = []
        if self.quant not in (None, "fp8"):
            problems.append(f"--quant {self.quant!r} (TensorRT-LLM bundles take fp8)")
        if self.tp < 1 or self.pp < 1:
            problems.append(f"--tp/--pp must be >= 1 (got {self.tp}, {self.pp})")
        if not 1 <= self.max_draft_len <= 64:
            problems.append(f"--max-draft-len must be in [1, 64] (got {self.max_draft_len})")
        k, total = self.dynamic_tree_top_k, self.max_total_draft_tokens
        if k < 0 or total < 0:
            problems.append("dynamic-tree sizes must be >= 0")
        elif k and total and not self.max_draft_len <= total <= k * self.max_draft_len:
            problems.append(f"max_total_draft_tokens {total} must lie in [max_draft_len, top_k * max_draft_len] = "
                            f"[{self.max_draft_len}, {k * self.max_draft_len}]")
        elif total and not k:
            problems.append("max_total_draft_tokens needs a dynamic tree (dynamic_tree_top_k > 0)")
        if not 0 < self.free_gpu_memory_fraction <= 1:
            problems.append("free_gpu_memory_fraction must be in (0, 1]")
        if problems:
            raise ModelError("; ".join(problems))


# ------------------------------------------------------------------------------------------------------ build

def build_trtllm_bundle(target_dir, draft_dir, out_dir, cfg: TrtllmConfig = TrtllmConfig(), calibrated_dir=None,
                        force: bool = False, progress: bool = True) -> dict:
    """Write the bundle `out_dir`; returns its manifest. FP8 uses `calibrated_dir` (from `eaglex calibrate`) or,
    when none is given, calibrates here with ModelOpt on the builtin text."""
    t0 = time.perf_counter()
    target_dir, out = Path(target_dir), Path(out_dir)
    if draft_dir is None:
        raise ModelError("a TensorRT-LLM bundle serves EAGLE-3: give --draft DIR (an EAGLE-3 head)")
    draft_dir = Path(draft_dir)
    check_out(out, force, (MANIFEST,), "a TensorRT-LLM bundle")
    target_cfg = _read_json(target_dir / "config.json", "target")
    arch = (target_cfg.get("architectures") or ["?"])[0]
    if arch not in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        raise ModelError(f"{target_dir}: architecture {arch} is not one eaglex bundles for TensorRT-LLM")
    _check_parallel(target_cfg, cfg)
    with staged(out) as tmp:
        quant = _write_target(target_dir, tmp / TARGET, cfg, calibrated_dir, progress)
        dtype = quant.pop("dtype")
        draft = _write_draft(draft_dir, tmp / DRAFT, target_cfg, dtype)
        options = llm_api_options(cfg, draft["eagle3_layers_to_capture"], dtype)
        write_options(tmp / OPTIONS_FILE, options)
        manifest = _manifest(tmp, target_dir, draft_dir, target_cfg, draft, quant, cfg, options)
        manifest["build_seconds"] = round(time.perf_counter() - t0, 2)
        write_manifest(tmp, manifest)
        validate_bundle(tmp)
    return manifest


def _read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise ModelError(f"{path.parent} has no config.json: pass a Hugging Face {what} folder")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelError(f"{path} is not valid JSON ({e})") from None


def _check_parallel(target_cfg: dict, cfg: TrtllmConfig) -> None:
    heads, layers = target_cfg.get("num_attention_heads", 0), target_cfg.get("num_hidden_layers", 0)
    if heads % cfg.tp:
        raise ModelError(f"--tp {cfg.tp} does not divide the target's {heads} attention heads")
    if cfg.pp > layers:
        raise ModelError(f"--pp {cfg.pp} exceeds the target's {layers} layers")


def _link(src: Path, dst: Path) -> None:
    """Hard link (no copy of the weights; the bundle stays self-contained and movable), else copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _write_target(target_dir: Path, dst: Path, cfg: TrtllmConfig, calibrated_dir, progress: bool) -> dict:
    """The target folder of the bundle; returns the quantization record for the manifest, with the serving dtype."""
    from eaglex.calibration.checkpoint import quant_config

    if cfg.quant == "fp8":
        if calibrated_dir is None:
            from eaglex.calibration.fp8 import CalibrateConfig, calibrate
            calibrate(target_dir, dst, CalibrateConfig(kv_cache="fp8"), progress=progress)
            src = dst
        else:
            src = Path(calibrated_dir)
        qc = quant_config(src)
        if qc.get("quant_algo") != "FP8":
            raise ModelError(f"{src} is not an FP8 checkpoint from `eaglex calibrate` (quant_algo "
                             f"{qc.get('quant_algo')!r})")
        _check_same_model(target_dir, src)
    else:
        src = target_dir
        qc = quant_config(src)
    src_cfg = _read_json(src / "config.json", "target")
    stored = str(src_cfg.get("torch_dtype") or src_cfg.get("dtype") or "float32")
    if cfg.quant == "fp8" and stored not in SERVING_DTYPES:
        raise ModelError(f"calibrated checkpoint {src} is {stored}: TensorRT-LLM takes the model dtype from its "
                         "config and its kernels run bfloat16 or float16; recalibrate with `eaglex calibrate "
                         "--dtype bfloat16`")
    dtype = stored if stored in SERVING_DTYPES else "bfloat16"
    if src != dst:
        dst.mkdir()
        for f in sorted(src.iterdir()):
            if f.is_file() and f.name != "config.json":
                _link(f, dst / f.name)
        if src != target_dir:             # a calibrated checkpoint may lack tokenizer files: take the target's
            for name in TOKENIZER_FILES:
                if (target_dir / name).is_file() and not (dst / name).exists():
                    _link(target_dir / name, dst / name)
    config = compat_config(src_cfg, dtype)
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if not any(dst.glob("*.safetensors")):
        raise ModelError(f"{src} holds no *.safetensors: TensorRT-LLM loads safetensors checkpoints")
    return {"method": cfg.quant, "quant_algo": qc.get("quant_algo"), "kv_cache_quant_algo": qc.get(
        "kv_cache_quant_algo"), "calibration": str(Path(calibrated_dir).resolve()) if calibrated_dir else (
        "calibrated at build time" if cfg.quant else None), "weights_dtype": stored, "dtype": dtype}


def _check_same_model(target_dir: Path, calibrated: Path) -> None:
    a, b = _read_json(target_dir / "config.json", "target"), _read_json(calibrated / "config.json", "calibrated")
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size")
    diff = [k for k in keys if a.get(k) != b.get(k)]
    if diff:
        raise ModelError(f"calibrated checkpoint {calibrated} is not of target {target_dir} (differs in "
                         f"{', '.join(diff)})")


def compat_config(cfg: dict, dtype: str | None = None) -> dict:
    """A transformers-5 config.json that transformers 4.x (TensorRT-LLM's pin) reads the same: RoPE as
    rope_theta + rope_scaling next to rope_parameters, torch_dtype next to dtype. Without this an older reader
    ignores `rope_parameters` and silently falls back to theta 10000. `dtype`, when given, becomes both dtype keys:
    the dtype TensorRT-LLM builds the model in (it casts stored weights of another dtype as it copies them in)."""
    out = dict(cfg)
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict) and "rope_theta" not in cfg:
        out["rope_theta"] = rp.get("rope_theta", 10000.0)
        scaling = {k: v for k, v in rp.items() if k != "rope_theta"}
        if scaling.get("rope_type", "default") != "default":
            out["rope_scaling"] = scaling
    if "dtype" in cfg and "torch_dtype" not in cfg:
        out["torch_dtype"] = cfg["dtype"]
    if dtype is not None:
        out["dtype"] = out["torch_dtype"] = dtype
    return out


# ------------------------------------------------------------------------------------------------------ draft

def _read_state(folder: Path) -> dict:
    import torch
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("pytorch_model*.bin"))
    if not files:
        raise ModelError(f"draft folder {folder} holds no weights (model.safetensors or pytorch_model.bin)")
    state = {}
    for f in files:
        try:
            state.update(load_file(str(f)) if f.suffix == ".safetensors"
                         else torch.load(f, map_location="cpu", weights_only=True))
        except Exception as e:  # noqa: BLE001 - any decoding failure is a corrupt or foreign file
            raise ModelError(f"cannot read {f}: {type(e).__name__}: {str(e).splitlines()[0][:200]}") from None
    return state


def _write_draft(draft_dir: Path, dst: Path, target_cfg: dict, dtype: str = "bfloat16") -> dict:
    """The head in TensorRT-LLM's EAGLE-3 layout, its float tensors in the serving `dtype`; returns the manifest's
    draft section."""
    import torch
    from safetensors.torch import save_file

    from eaglex.models.eagle import detect_kind
    from eaglex.models.target import eagle3_taps

    cfg = _read_json(draft_dir / "config.json", "EAGLE head")
    state = _read_state(draft_dir)
    if detect_kind(cfg, state) != "eagle3":
        raise ModelError(f"{draft_dir} is an EAGLE-1/2 head: TensorRT-LLM's PyTorch backend runs EAGLE-3 heads "
                         "only (its EAGLE-1/2 engine path was removed); use an EAGLE-3 head or the onnxruntime backend")
    state = {re.sub(r"^layers\.0\.", "midlayer.", k): v for k, v in state.items()}
    state = {k: v for k, v in state.items() if k != "t2d"}       # the target->draft map is for training only
    H, V = target_cfg["hidden_size"], target_cfg["vocab_size"]
    L = target_cfg["num_hidden_layers"]
    aux = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    taps = eagle3_taps(L, aux)
    capture = [t - 1 for t in taps]          # taps read layer inputs; TensorRT-LLM captures layer outputs
    Vd = cfg.get("draft_vocab_size") or V
    if cfg.get("vocab_size", V) != V or cfg.get("hidden_size") != H:
        raise ModelError(f"draft {draft_dir} (hidden {cfg.get('hidden_size')}, vocab {cfg.get('vocab_size')}) does "
                         f"not fit the target (hidden {H}, vocab {V})")
    if Vd != V and "d2t" not in state:
        raise ModelError(f"draft {draft_dir}: draft_vocab_size {Vd} < vocab {V} but no d2t map")
    if "d2t" in state:
        state["d2t"] = state["d2t"].to(torch.int64)
    weights_dtype = next((v.dtype for k, v in state.items() if k.endswith("fc.weight")), torch.float32)
    serve = getattr(torch, dtype)
    state = {k: (v.to(serve) if v.is_floating_point() else v) for k, v in state.items()}
    rope = compat_config({k: cfg[k] for k in ("rope_parameters", "rope_theta", "rope_scaling") if k in cfg})
    nh = cfg["num_attention_heads"]
    out_cfg = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": H, "intermediate_size": cfg["intermediate_size"], "num_attention_heads": nh,
        "num_key_value_heads": cfg.get("num_key_value_heads") or nh, "head_dim": cfg.get("head_dim") or H // nh,
        "num_hidden_layers": 1, "rms_norm_eps": cfg.get("rms_norm_eps", 1e-6), "hidden_act": "silu",
        "vocab_size": V, "draft_vocab_size": Vd,
        "max_position_embeddings": max(cfg.get("max_position_embeddings", 0),
                                       target_cfg.get("max_position_embeddings", 0)),
        "rope_theta": rope.get("rope_theta", 10000.0), "rope_scaling": rope.get("rope_scaling"),
        "attention_bias": False, "mlp_bias": False, "bias": bool(cfg.get("bias", False)),
        "tie_word_embeddings": False, "torch_dtype": dtype, "dtype": dtype,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": capture, "use_aux_hidden_state": True,
                         "use_input_layernorm_in_first_layer": True, "use_last_layernorm": True,
                         "next_layer_regular": True},
    }
    if cfg.get("target_hidden_size"):
        out_cfg["target_hidden_size"] = cfg["target_hidden_size"]
    dst.mkdir()
    save_file({k: v.contiguous() for k, v in sorted(state.items())}, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(out_cfg, indent=2) + "\n")
    return {"path": DRAFT, "source": str(draft_dir.resolve()), "kind": "eagle3", "draft_vocab_size": Vd,
            "has_d2t": "d2t" in state, "eagle3_layers_to_capture": capture, "dtype": dtype,
            "source_dtype": str(weights_dtype).removeprefix("torch.")}


# ---------------------------------------------------------------------------------------------------- options

def llm_api_options(cfg: TrtllmConfig, capture: list[int], dtype: str = "bfloat16") -> dict:
    """The LLM-API options (the --extra_llm_api_options YAML of trtllm-serve; keyword arguments of `LLM`). Every key
    is a field of TorchLlmArgs / Eagle3DecodingConfig / KvCacheConfig in the versions recorded in trtllm_upstream.py
    (MIN_TRTLLM on); `backend` is left out (PyTorch is the default backend, and the field is deprecated)."""
    spec = {"decoding_type": "Eagle3", "max_draft_len": cfg.max_draft_len, "speculative_model": f"./{DRAFT}",
            "eagle3_layers_to_capture": list(capture), "use_dynamic_tree": bool(cfg.dynamic_tree_top_k)}
    if cfg.dynamic_tree_top_k:
        spec["dynamic_tree_max_topK"] = cfg.dynamic_tree_top_k
        spec["max_total_draft_tokens"] = cfg.max_total_draft_tokens or cfg.dynamic_tree_top_k * cfg.max_draft_len
    return {"dtype": dtype, "tensor_parallel_size": cfg.tp, "pipeline_parallel_size": cfg.pp,
            "speculative_config": spec,
            # Block reuse off, as in NVIDIA's EAGLE examples: reused blocks hold no captured hidden states.
            "kv_cache_config": {"enable_block_reuse": False,
                                "free_gpu_memory_fraction": cfg.free_gpu_memory_fraction}}


def write_options(path: Path, options: dict) -> None:
    import yaml
    header = (f"# eaglex bundle: TensorRT-LLM LLM-API options (PyTorch backend, EAGLE-3; TensorRT-LLM >= {MIN_TRTLLM}).\n"
              "# Serve from inside the bundle folder:  trtllm-serve ./target --extra_llm_api_options "
              "llm_api_options.yaml\n")
    path.write_text(header + yaml.safe_dump(options, sort_keys=False, default_flow_style=None))


def read_options(path: Path) -> dict:
    import yaml
    try:
        return yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ModelError(f"{path} is not readable YAML ({str(e).splitlines()[0]})") from None


# --------------------------------------------------------------------------------------------------- manifest

def _manifest(tmp: Path, target_dir: Path, draft_dir: Path, target_cfg: dict, draft: dict, quant: dict,
              cfg: TrtllmConfig, options: dict) -> dict:
    from importlib import metadata

    files = {}
    for f in sorted(p for p in tmp.rglob("*") if p.is_file()):
        size = f.stat().st_size
        files[f.relative_to(tmp).as_posix()] = {"bytes": size, "sha256": sha256_file(f) if size <= HASH_LIMIT else None}
    eos = target_cfg.get("eos_token_id")
    gen = tmp / TARGET / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id", eos)
    eos_ids = eos if isinstance(eos, list) else ([] if eos is None else [eos])
    engine_id = hashlib.sha256(json.dumps([FORMAT_VERSION, BACKEND, sorted(
        (k, v["sha256"] or v["bytes"]) for k, v in files.items())]).encode()).hexdigest()[:16]
    weights = sum(v["bytes"] for k, v in files.items() if k.startswith(TARGET + "/") and k.endswith(".safetensors"))
    tools = {}
    for name in ("eaglex", "torch", "transformers", "nvidia-modelopt"):
        try:
            tools[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            tools[name] = None
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "backend": BACKEND, "engine_id": engine_id,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "dtype": options["dtype"],
        "quant": quant,
        "target": {"path": TARGET, "source": str(target_dir.resolve()), "arch": target_cfg["architectures"][0],
                   "num_layers": target_cfg["num_hidden_layers"], "hidden_size": target_cfg["hidden_size"],
                   "num_heads": target_cfg["num_attention_heads"],
                   "num_kv_heads": target_cfg.get("num_key_value_heads") or target_cfg["num_attention_heads"],
                   "vocab_size": target_cfg["vocab_size"], "eos_ids": eos_ids, "weights_bytes": weights},
        "draft": draft,
        "parallel": {"tensor_parallel_size": cfg.tp, "pipeline_parallel_size": cfg.pp, "gpus": cfg.tp * cfg.pp},
        "config": dataclasses.asdict(cfg),
        "options_file": OPTIONS_FILE, "llm_api_options": options,
        "hardware": hardware_note(cfg, weights // (2 if quant.get("weights_dtype") == "float32" else 1)),
        "run": {"serve": f"cd BUNDLE && trtllm-serve ./{TARGET} --extra_llm_api_options {OPTIONS_FILE}",
                "eaglex": "eaglex generate --engine BUNDLE --prompt ...; eaglex check --engine BUNDLE --prompts F",
                "requires": f"TensorRT-LLM >= {MIN_TRTLLM} (PyTorch backend), e.g. the NGC container "
                            "nvcr.io/nvidia/tensorrt-llm/release"},
        "files": files, "tools": tools,
    }


def hardware_note(cfg: TrtllmConfig, weight_bytes: int) -> dict:
    """What the bundle needs: GPUs = tp x pp; FP8 GEMMs need compute capability >= 8.9 (Ada, Hopper, Blackwell);
    memory: the target's weights as served (`weight_bytes`) split over the GPUs plus room for the KV cache
    (free_gpu_memory_fraction of the rest)."""
    gpus = cfg.tp * cfg.pp
    return {"gpus": gpus, "weights_gib_per_gpu": round(weight_bytes / gpus / 1024 ** 3, 2),
            "compute_capability": ">= 8.9 (Ada, Hopper, Blackwell) for FP8" if cfg.quant == "fp8"
            else ">= 8.0 (Ampere or newer)"}


# -------------------------------------------------------------------------------------------------- validation
# A JSON-schema subset (type, required, properties, additionalProperties, items, enum, const, minimum, minItems):
# enough to document the bundle's files precisely, with no dependency.

_INT, _STR, _BOOL, _NUM = {"type": "integer"}, {"type": "string"}, {"type": "boolean"}, {"type": "number"}
_POS = {"type": "integer", "minimum": 1}

OPTIONS_SCHEMA = {
    "type": "object", "required": ["dtype", "tensor_parallel_size", "pipeline_parallel_size", "speculative_config"],
    "properties": {
        "dtype": {"enum": list(SERVING_DTYPES)},
        "tensor_parallel_size": _POS, "pipeline_parallel_size": _POS,
        "speculative_config": {
            "type": "object", "additionalProperties": False,
            "required": ["decoding_type", "max_draft_len", "speculative_model", "eagle3_layers_to_capture",
                         "use_dynamic_tree"],
            "properties": {"decoding_type": {"const": "Eagle3"}, "max_draft_len": _POS,
                           "speculative_model": _STR,
                           "eagle3_layers_to_capture": {"type": "array", "items": {"type": "integer", "minimum": -1},
                                                        "minItems": 1},
                           "use_dynamic_tree": _BOOL, "dynamic_tree_max_topK": _POS, "max_total_draft_tokens": _POS}},
        "kv_cache_config": {"type": "object", "properties": {"enable_block_reuse": _BOOL,
                                                            "free_gpu_memory_fraction": _NUM,
                                                            "dtype": {"enum": ["auto", "fp8"]}}},
    },
}

DRAFT_CONFIG_SCHEMA = {
    "type": "object",
    "required": ["architectures", "model_type", "hidden_size", "intermediate_size", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "num_hidden_layers", "vocab_size", "draft_vocab_size",
                 "rms_norm_eps", "torch_dtype", "eagle_config", "attention_bias"],
    "properties": {
        "architectures": {"type": "array", "items": {"const": "LlamaForCausalLMEagle3"}, "minItems": 1},
        "model_type": {"const": "llama"}, "hidden_size": _POS, "intermediate_size": _POS,
        "num_attention_heads": _POS, "num_key_value_heads": _POS, "head_dim": _POS,
        "num_hidden_layers": {"const": 1}, "vocab_size": _POS, "draft_vocab_size": _POS, "rms_norm_eps": _NUM,
        "torch_dtype": {"enum": list(SERVING_DTYPES)}, "attention_bias": {"const": False},
        "eagle_config": {"type": "object", "required": ["eagle_aux_hidden_state_layer_ids"],
                         "properties": {"eagle_aux_hidden_state_layer_ids": {
                             "type": "array", "items": _INT, "minItems": 1}}},
    },
}

TARGET_CONFIG_SCHEMA = {
    "type": "object",
    "required": ["architectures", "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                 "rope_theta", "torch_dtype"],
    "properties": {"architectures": {"type": "array", "items": _STR, "minItems": 1}, "hidden_size": _POS,
                   "num_hidden_layers": _POS, "num_attention_heads": _POS, "vocab_size": _POS,
                   "rope_theta": _NUM, "torch_dtype": {"enum": list(SERVING_DTYPES)},
                   "quantization_config": {"type": "object", "required": ["quant_method", "quant_algo"],
                                           "properties": {"quant_method": {"const": "modelopt"},
                                                          "quant_algo": {"const": "FP8"}}}},
}

HF_QUANT_SCHEMA = {
    "type": "object", "required": ["quantization"],
    "properties": {"quantization": {"type": "object", "required": ["quant_algo"], "properties": {
        "quant_algo": {"const": "FP8"}, "kv_cache_quant_algo": {"enum": [None, "FP8"]},
        "exclude_modules": {"type": "array", "items": _STR}}}},
}

MANIFEST_SCHEMA = {
    "type": "object",
    "required": ["format", "format_version", "backend", "engine_id", "dtype", "quant", "target", "draft", "parallel",
                 "options_file", "llm_api_options", "files"],
    "properties": {
        "format": {"const": FORMAT}, "format_version": {"const": FORMAT_VERSION}, "backend": {"const": BACKEND},
        "dtype": {"enum": list(SERVING_DTYPES)},
        "engine_id": _STR, "options_file": {"const": OPTIONS_FILE}, "llm_api_options": OPTIONS_SCHEMA,
        "quant": {"type": "object", "required": ["method"], "properties": {"method": {"enum": [None, "fp8"]}}},
        "target": {"type": "object", "required": ["path", "arch", "num_layers", "hidden_size", "vocab_size"],
                   "properties": {"path": {"const": TARGET}, "num_layers": _POS, "hidden_size": _POS,
                                  "vocab_size": _POS}},
        "draft": {"type": "object", "required": ["path", "kind", "draft_vocab_size", "eagle3_layers_to_capture"],
                  "properties": {"path": {"const": DRAFT}, "kind": {"const": "eagle3"}, "draft_vocab_size": _POS,
                                 "eagle3_layers_to_capture": {"type": "array", "items": _INT, "minItems": 1}}},
        "parallel": {"type": "object", "required": ["tensor_parallel_size", "pipeline_parallel_size", "gpus"],
                     "properties": {"tensor_parallel_size": _POS, "pipeline_parallel_size": _POS, "gpus": _POS}},
        "files": {"type": "object", "additionalProperties": {
            "type": "object", "required": ["bytes", "sha256"],
            "properties": {"bytes": {"type": "integer", "minimum": 0}, "sha256": {"type": ["string", "null"]}}}},
    },
}

_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def schema_errors(value, schema: dict, where: str = "$") -> list[str]:
    """Violations of `schema` by `value`, each as 'path: problem' (empty when valid)."""
    errs = []
    if "const" in schema and value != schema["const"]:
        return [f"{where}: must be {schema['const']!r}, is {value!r}"]
    if "enum" in schema and value not in schema["enum"]:
        return [f"{where}: must be one of {schema['enum']!r}, is {value!r}"]
    types = schema.get("type")
    if types is not None:
        types = [types] if isinstance(types, str) else types
        if not any(_is(value, t) for t in types):
            return [f"{where}: must be {' or '.join(types)}, is {type(value).__name__}"]
    if "minimum" in schema and isinstance(value, (int, float)) and value < schema["minimum"]:
        errs.append(f"{where}: must be >= {schema['minimum']}, is {value}")
    if isinstance(value, dict):
        for key in schema.get("required", []):
            if key not in value:
                errs.append(f"{where}: missing {key!r}")
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties", True)
        for key, v in value.items():
            if key in props:
                errs += schema_errors(v, props[key], f"{where}.{key}")
            elif extra is False:
                errs.append(f"{where}: unexpected key {key!r}")
            elif isinstance(extra, dict):
                errs += schema_errors(v, extra, f"{where}.{key}")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            errs.append(f"{where}: needs at least {schema['minItems']} items")
        if "items" in schema:
            for i, v in enumerate(value):
                errs += schema_errors(v, schema["items"], f"{where}[{i}]")
    return errs


def _is(value, t: str) -> bool:
    if t == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if t == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _TYPES[t])


def bundle_problems(bundle) -> list[str]:
    """Every problem of a bundle folder: schema violations of its files, then cross-file facts."""
    bundle = Path(bundle)
    try:
        m = read_manifest(bundle)
    except ModelError as e:
        return [str(e)]
    probs = [f"manifest.json {e}" for e in schema_errors(m, MANIFEST_SCHEMA)]
    if probs:
        return probs
    files = []                  # reported with the rest: structural problems below stop early, these do not
    for name, info in m["files"].items():
        f = bundle / name
        if not f.is_file():
            files.append(f"{name}: missing")
        elif f.stat().st_size != info["bytes"]:
            files.append(f"{name}: {f.stat().st_size} bytes, the manifest says {info['bytes']}")
        elif info["sha256"] is not None and sha256_file(f) != info["sha256"]:
            files.append(f"{name}: sha256 differs from the manifest")
    return files + _content_problems(bundle, m)


def _content_problems(bundle: Path, m: dict) -> list[str]:
    from safetensors import safe_open

    probs = []
    opts_path = bundle / OPTIONS_FILE
    opts = read_options(opts_path) if opts_path.is_file() else None
    if opts is None:
        return [f"{OPTIONS_FILE}: missing"]
    probs += [f"{OPTIONS_FILE} {e}" for e in schema_errors(opts, OPTIONS_SCHEMA)]
    if opts != m["llm_api_options"]:
        probs.append(f"{OPTIONS_FILE} differs from manifest.json's llm_api_options")
    tcfg_path, dcfg_path = bundle / TARGET / "config.json", bundle / DRAFT / "config.json"
    if not tcfg_path.is_file() or not dcfg_path.is_file():
        return probs + ["target/config.json or draft/config.json is missing"]
    tcfg, dcfg = json.loads(tcfg_path.read_text()), json.loads(dcfg_path.read_text())
    probs += [f"target/config.json {e}" for e in schema_errors(tcfg, TARGET_CONFIG_SCHEMA)]
    probs += [f"draft/config.json {e}" for e in schema_errors(dcfg, DRAFT_CONFIG_SCHEMA)]
    if probs:
        return probs
    spec = opts["speculative_config"]
    capture = spec["eagle3_layers_to_capture"]
    L, H, V = tcfg["num_hidden_layers"], tcfg["hidden_size"], tcfg["vocab_size"]
    if spec["speculative_model"].rstrip("/") not in (f"./{DRAFT}", DRAFT):
        probs.append(f"speculative_model must point at ./{DRAFT}, is {spec['speculative_model']!r}")
    if any(not -1 <= c < L for c in capture) or len(set(capture)) != len(capture):
        probs.append(f"eagle3_layers_to_capture {capture} must be distinct layers of the target's {L}")
    if dcfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] != capture or m["draft"]["eagle3_layers_to_capture"] \
            != capture:
        probs.append("captured layers differ between the options, the draft config and the manifest")
    if spec["use_dynamic_tree"]:
        k, total = spec.get("dynamic_tree_max_topK"), spec.get("max_total_draft_tokens")
        if k is None or total is None or not spec["max_draft_len"] <= total <= k * spec["max_draft_len"]:
            probs.append("a dynamic tree needs dynamic_tree_max_topK and max_total_draft_tokens in "
                         "[max_draft_len, topK * max_draft_len]")
    if dcfg["hidden_size"] != H or dcfg["vocab_size"] != V or dcfg["draft_vocab_size"] > V:
        probs.append(f"draft (hidden {dcfg['hidden_size']}, vocab {dcfg['vocab_size']}, draft vocab "
                     f"{dcfg['draft_vocab_size']}) does not fit the target (hidden {H}, vocab {V})")
    if tcfg["num_attention_heads"] % opts["tensor_parallel_size"] or opts["pipeline_parallel_size"] > L:
        probs.append("tensor/pipeline parallel sizes do not fit the target's heads/layers")
    dtypes = {"options": opts["dtype"], "manifest": m["dtype"], "target/config.json": tcfg["torch_dtype"],
              "draft/config.json": dcfg["torch_dtype"]}
    if tcfg.get("dtype", tcfg["torch_dtype"]) != tcfg["torch_dtype"]:
        dtypes["target/config.json dtype"] = tcfg["dtype"]
    if len(set(dtypes.values())) > 1:
        probs.append("dtypes disagree: " + ", ".join(f"{k} {v}" for k, v in dtypes.items()))
    probs += upstream_problems(opts)
    quantized = m["quant"]["method"] == "fp8"
    hq = bundle / TARGET / "hf_quant_config.json"
    if quantized:
        if not hq.is_file():
            probs.append("target/hf_quant_config.json is missing for an FP8 bundle")
        else:
            probs += [f"target/hf_quant_config.json {e}" for e in schema_errors(json.loads(hq.read_text()),
                                                                                  HF_QUANT_SCHEMA)]
            probs += [f"target: {p}" for p in upstream.fp8_checkpoint_problems(bundle / TARGET)]
        if "quantization_config" not in tcfg:
            probs.append("target/config.json has no quantization_config for an FP8 bundle")
    probs += _draft_tensor_problems(bundle / DRAFT, dcfg, len(capture), H, V, safe_open)
    want = upstream.SERVING_DTYPES.get(opts["dtype"])
    draft_file = bundle / DRAFT / "model.safetensors"
    if draft_file.is_file():
        from eaglex.calibration.memory import safetensors_header
        wrong = sorted(k for k, t in safetensors_header(draft_file).items()
                       if k != "__metadata__" and t["dtype"].startswith(("F", "BF")) and t["dtype"] != want)
        if wrong:
            probs.append(f"draft/model.safetensors: {wrong[0]} (and {len(wrong) - 1} more) not in {opts['dtype']}")
    return probs


def upstream_problems(options: dict, since: str = MIN_TRTLLM) -> list[str]:
    """Keys of the options that a recorded TensorRT-LLM version from `since` on rejects (trtllm_upstream.py)."""
    probs = []
    for v in upstream.VERSIONS:
        if upstream.version_key(v) >= upstream.version_key(since):
            probs += [f"{OPTIONS_FILE} {e}" for e in upstream.check_options(options, v).errors]
    return probs


def installed_problems(options: dict) -> list[str]:
    """The options against the installed TensorRT-LLM's own classes (call where TensorRT-LLM is importable, before
    building an LLM: a rejected key then fails in one line instead of deep inside the executor); [] when it is not
    installed."""
    try:
        from tensorrt_llm.llmapi import Eagle3DecodingConfig, KvCacheConfig
        from tensorrt_llm.llmapi.llm_args import TorchLlmArgs
    except ImportError:
        return []
    return upstream.installed_problems(options, {"TorchLlmArgs": TorchLlmArgs, "KvCacheConfig": KvCacheConfig,
                                                 "Eagle3DecodingConfig": Eagle3DecodingConfig})


def _draft_tensor_problems(folder: Path, dcfg: dict, n_capture: int, H: int, V: int, safe_open) -> list[str]:
    f = folder / "model.safetensors"
    if not f.is_file():
        return ["draft/model.safetensors is missing"]
    Vd, nh, nkv, hd, inter = (dcfg["draft_vocab_size"], dcfg["num_attention_heads"], dcfg["num_key_value_heads"],
                              dcfg["head_dim"], dcfg["intermediate_size"])
    Ht = dcfg.get("target_hidden_size", H)
    want = {"fc.weight": [H, n_capture * Ht], "midlayer.self_attn.q_proj.weight": [nh * hd, 2 * H],
            "midlayer.self_attn.k_proj.weight": [nkv * hd, 2 * H],
            "midlayer.self_attn.v_proj.weight": [nkv * hd, 2 * H],
            "midlayer.self_attn.o_proj.weight": [H, nh * hd], "midlayer.mlp.gate_proj.weight": [inter, H],
            "midlayer.mlp.up_proj.weight": [inter, H], "midlayer.mlp.down_proj.weight": [H, inter],
            "midlayer.input_layernorm.weight": [H], "midlayer.hidden_norm.weight": [H],
            "midlayer.post_attention_layernorm.weight": [H], "norm.weight": [H], "lm_head.weight": [Vd, H]}
    if Vd != V:
        want["d2t"] = [Vd]
    probs = []
    with safe_open(str(f), "pt") as st:
        keys = set(st.keys())
        for k, shape in want.items():
            if k not in keys:
                probs.append(f"draft/model.safetensors: missing {k}")
            elif list(st.get_slice(k).get_shape()) != shape:
                probs.append(f"draft/model.safetensors: {k} has shape {st.get_slice(k).get_shape()}, expected {shape}")
        if "d2t" in keys and not probs:
            d2t = st.get_tensor("d2t")
            import torch
            mapped = torch.arange(d2t.shape[0]) + d2t.long()
            if mapped.min() < 0 or mapped.max() >= V:
                probs.append("draft/model.safetensors: d2t maps outside the target vocabulary")
    return probs


def validate_bundle(bundle) -> dict:
    """The bundle's manifest, or a ModelError listing every problem found."""
    probs = bundle_problems(bundle)
    if probs:
        raise ModelError(f"TensorRT-LLM bundle {bundle} is invalid: " + "; ".join(probs[:8])
                         + (f" (+{len(probs) - 8} more)" if len(probs) > 8 else ""))
    return read_manifest(bundle)


def is_bundle(folder) -> bool:
    """True for a folder whose manifest says backend tensorrt-llm (no other checks)."""
    path = Path(folder) / MANIFEST
    try:
        return json.loads(path.read_text()).get("backend") == BACKEND
    except (OSError, ValueError, AttributeError):
        return False


def summary(manifest: dict, out_dir) -> str:
    o, d = manifest["llm_api_options"], manifest["draft"]
    spec = o["speculative_config"]
    tree = (f"dynamic tree top-{spec['dynamic_tree_max_topK']}, {spec['max_total_draft_tokens']} nodes"
            if spec["use_dynamic_tree"] else "chain")
    lines = [f"TensorRT-LLM bundle {out_dir} ({manifest['quant']['method'] or 'unquantized'} target, EAGLE-3 "
             f"max_draft_len {spec['max_draft_len']}, {tree}; tp {o['tensor_parallel_size']} x pp "
             f"{o['pipeline_parallel_size']})",
             f"  target/  {manifest['target']['arch']}, {manifest['target']['num_layers']} layers, "
             f"{manifest['target']['weights_bytes'] / 1024 ** 2:.1f} MB weights",
             f"  draft/   captures layers {d['eagle3_layers_to_capture']}, draft vocab {d['draft_vocab_size']}",
             f"  {OPTIONS_FILE}; needs {manifest['hardware']['gpus']} GPU(s), compute capability "
             f"{manifest['hardware']['compute_capability']}",
             f"  serve: {manifest['run']['serve']}"]
    return "\n".join(lines)
