"""TensorRT-LLM's own rules for what eaglex hands it, recorded from upstream and checked without TensorRT-LLM.

Two kinds of facts, each with the version and the file it was read from:
- field lists of the LLM-API classes the options YAML is parsed into (`TorchLlmArgs`, `Eagle3DecodingConfig`,
  `KvCacheConfig`; pydantic models that forbid extra fields, so a key that is not a field fails the load). Taken
  from the API reference TensorRT-LLM publishes per version (nvidia.github.io/TensorRT-LLM/<version>/llm-api/
  reference/<Class>.html, generated from tensorrt_llm/llmapi/llm_args.py) and, for one pre-1.0 record, from
  tensorrt_llm/llmapi/llm_args.py itself. A record is `complete` when the whole signature was read; for a partial
  record (a prefix of the signature) a key that is not listed is "unverified", not wrong.
- how the PyTorch backend reads a ModelOpt FP8 checkpoint (tensorrt_llm/_torch/modules/linear.py,
  FP8QDQLinearMethod): weight float8_e4m3fn of shape (out_features, in_features); weight_scale and input_scale one
  float32 value each (read with .reshape([])); k_scale / v_scale one value each on k_proj / v_proj; everything
  not quantized is created in the model dtype, which comes from config.json (torch_dtype), and copy_weight (same
  file) casts a stored tensor of another dtype to the parameter's dtype as it copies it in.

No record exists here for TensorRT-LLM 1.0-1.2: their field lists could not be read from upstream when this was
written, so the version floor is the earliest version whose Eagle3DecodingConfig is recorded complete and accepts
the bundle's speculative_config (`floor`). On a GPU machine `installed_problems` checks the options against the
installed TensorRT-LLM's own classes, which settles any version.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

DOCS = "https://nvidia.github.io/TensorRT-LLM/{version}/llm-api/reference/{cls}.html"
LLM_ARGS = "tensorrt_llm/llmapi/llm_args.py"


@dataclass(frozen=True)
class Record:
    cls: str
    version: str
    fields: frozenset[str]
    complete: bool
    source: str
    decoding_types: frozenset[str] = frozenset()   # values `decoding_type` may take (speculative configs)


def _r(cls, version, fields, complete=True, source=None, decoding_types=()):
    return Record(cls, version, frozenset(fields.split()), complete,
                  source or DOCS.format(version=version, cls=cls), frozenset(decoding_types))


_DECODING_BASE_13 = ("max_draft_len max_total_draft_tokens speculative_model max_concurrency draft_len_schedule "
                     "load_format acceptance_rate_window_size acceptance_rate_threshold use_rejection_sampling "
                     "allow_advanced_sampling advanced_sampling_mode enable_penalty decoding_type ")
_DECODING_BASE_14 = _DECODING_BASE_13 + "moe_backend spec_dec_variant "
_KV_13 = ("enable_block_reuse max_tokens max_attention_window sink_token_length free_gpu_memory_fraction "
          "host_cache_size disk_cache_size disk_cache_path cross_kv_cache_fraction secondary_offload_min_priority "
          "event_buffer_max_size attention_dp_events_gather_period_ms kv_events_config enable_partial_reuse "
          "copy_on_partial_reuse use_uvm max_gpu_total_bytes iteration_stats_interval dtype")
_TORCH_ARGS_PREFIX = ("model tokenizer tokenizer_mode custom_tokenizer post_processor_hook skip_tokenizer_init "
                      "trust_remote_code tensor_parallel_size dtype revision tokenizer_revision model_kwargs "
                      "pipeline_parallel_size context_parallel_size gpus_per_node moe_cluster_parallel_size "
                      "moe_tensor_parallel_size moe_expert_parallel_size enable_attention_dp enable_lm_head_tp_in_adp "
                      "pp_partition cp_config load_format enable_lora lora_config kv_cache_config "
                      "enable_chunked_prefill guided_decoding_backend batched_logits_processor")
_LLM_SIGNATURE = ("model tokenizer tokenizer_mode skip_tokenizer_init trust_remote_code tensor_parallel_size dtype "
                  "revision tokenizer_revision")

RECORDS: tuple[Record, ...] = (
    # A pre-1.0 main-branch llm_args.py (NVIDIA/TensorRT-LLM commit fcd3f31): EAGLE is one class with decoding type
    # "Eagle", the draft is `speculative_model` or `pytorch_weights_path`, no Eagle3 type and no captured layers.
    _r("EagleDecodingConfig", "pre-1.0", "max_draft_len speculative_model eagle_choices greedy_sampling "
       "posterior_threshold use_dynamic_tree dynamic_tree_max_topK num_eagle_layers max_non_leaves_per_layer "
       "pytorch_weights_path eagle3_one_model", source=f"{LLM_ARGS} @ NVIDIA/TensorRT-LLM fcd3f31",
       decoding_types=("Eagle",)),
    _r("Eagle3DecodingConfig", "1.3.0rc27", _DECODING_BASE_13 + "eagle_choices use_dynamic_tree dynamic_tree_max_topK "
       "num_eagle_layers max_non_leaves_per_layer eagle3_layers_to_capture eagle3_model_arch sa_config",
       decoding_types=("Eagle3",)),
    _r("Eagle3DecodingConfig", "1.4.0rc1", _DECODING_BASE_14 + "use_dynamic_tree dynamic_tree_max_topK "
       "num_eagle_layers max_non_leaves_per_layer eagle3_layers_to_capture eagle3_model_arch sa_config",
       decoding_types=("Eagle3",)),
    _r("Eagle3DecodingConfig", "1.4.0rc4", _DECODING_BASE_14 + "moe_tactic use_dynamic_tree dynamic_tree_max_topK "
       "max_non_leaves_per_layer eagle3_layers_to_capture eagle3_model_arch sa_config", decoding_types=("Eagle3",)),
    _r("KvCacheConfig", "1.3.0rc27", _KV_13, complete=False),
    _r("KvCacheConfig", "1.4.0rc4", _KV_13 + " host_cache_bind_to_gpu_numa_node disk_io_threads "
       "disk_keep_copy_after_restore disk_write_through disk_protected_copy_fraction cold_tier_offload_min_priority",
       complete=False),
    # The LLM class signature (its explicit arguments; the rest are TorchLlmArgs fields passed as **kwargs).
    _r("TorchLlmArgs", "1.4.0rc1", _LLM_SIGNATURE, complete=False, source=DOCS.format(version="1.4.0rc1", cls="LLM")),
    _r("TorchLlmArgs", "1.4.0rc4", _TORCH_ARGS_PREFIX, complete=False),
)

# BaseLlmArgs (TorchLlmArgs' base) declares `speculative_config` in every llm_args.py read for this file, 1.0 on;
# upstream's own EAGLE-3 examples (trtllm-serve --extra_llm_api_options, the Triton llmapi model.yaml) pass it as a
# top-level YAML key. It is not in the partial signature prefixes above, so it is recorded here.
ALWAYS_FIELDS = {"TorchLlmArgs": frozenset({"speculative_config"})}


def version_key(v: str) -> tuple:
    if v == "pre-1.0":
        return (0,)
    m = re.match(r"(\d+)\.(\d+)\.(\d+)(?:rc(\d+))?", v)
    if m is None:
        raise ValueError(f"not a TensorRT-LLM version: {v!r}")
    major, minor, patch, rc = m.groups()
    return (int(major), int(minor), int(patch), int(rc) if rc is not None else 10 ** 6)


#: Versions with a complete Eagle3DecodingConfig record, oldest first.
VERSIONS = tuple(sorted({r.version for r in RECORDS if r.cls == "Eagle3DecodingConfig" and r.complete},
                        key=version_key))


def record(cls: str, version: str) -> Record | None:
    return next((r for r in RECORDS if r.cls == cls and r.version == version), None)


@dataclass
class Verdict:
    version: str
    errors: list[str]
    unverified: list[str]


def check_options(options: dict, version: str) -> Verdict:
    """The options YAML (a dict) against the recorded classes of `version`: errors are keys that version rejects
    (or a decoding_type it does not know); unverified are keys no record of that version covers."""
    errors, unverified = [], []
    spec_cls = "Eagle3DecodingConfig" if record("Eagle3DecodingConfig", version) else "EagleDecodingConfig"

    def check(cls: str, keys, where: str):
        rec = record(cls, version)
        for k in keys:
            if (rec is not None and k in rec.fields) or k in ALWAYS_FIELDS.get(cls, ()):
                continue
            if rec is not None and rec.complete:
                errors.append(f"{where}{k}: not a field of {cls} in TensorRT-LLM {version} ({rec.source})")
            else:
                unverified.append(f"{where}{k}")

    check("TorchLlmArgs", options.keys(), "")
    spec = options.get("speculative_config")
    if isinstance(spec, dict):
        rec = record(spec_cls, version)
        if rec is not None and spec.get("decoding_type") not in rec.decoding_types:
            errors.append(f"speculative_config.decoding_type: {spec.get('decoding_type')!r} is not a decoding type of "
                          f"TensorRT-LLM {version} (it has {', '.join(sorted(rec.decoding_types))}; {rec.source})")
        check(spec_cls, [k for k in spec if k != "decoding_type"], "speculative_config.")
    kv = options.get("kv_cache_config")
    if isinstance(kv, dict):
        check("KvCacheConfig", kv.keys(), "kv_cache_config.")
    return Verdict(version, errors, unverified)


def floor(options: dict) -> str | None:
    """The oldest recorded version from which on every recorded version (with a complete speculative-config record)
    accepts `options`; None when the newest does not."""
    ok = None
    versions = {r.version for r in RECORDS if r.cls in ("Eagle3DecodingConfig", "EagleDecodingConfig") and r.complete}
    for v in sorted(versions, key=version_key, reverse=True):
        if check_options(options, v).errors:
            break
        ok = v
    return ok


def installed_problems(options: dict, classes: dict) -> list[str]:
    """The options against the installed TensorRT-LLM's own pydantic classes ({"TorchLlmArgs": cls,
    "Eagle3DecodingConfig": cls, "KvCacheConfig": cls}); a key counts when it is a field name or a validation alias
    of one (speculative_model_dir for speculative_model)."""
    def names(cls) -> set[str]:
        out = set()
        for name, f in getattr(cls, "model_fields", {}).items():
            out.add(name)
            alias = getattr(f, "validation_alias", None)
            for choice in getattr(alias, "choices", ()) or ((alias,) if isinstance(alias, str) else ()):
                out.add(str(choice))
        return out

    probs = []
    for cls_name, keys in (("TorchLlmArgs", options.keys()),
                           ("Eagle3DecodingConfig", (options.get("speculative_config") or {}).keys()),
                           ("KvCacheConfig", (options.get("kv_cache_config") or {}).keys())):
        cls = classes.get(cls_name)
        if cls is None:
            probs.append(f"the installed TensorRT-LLM has no {cls_name}")
            continue
        known = names(cls)
        if not known:
            continue
        probs += [f"{cls_name} of the installed TensorRT-LLM has no field {k!r}" for k in keys if k not in known]
    return probs


# ------------------------------------------------------------------------------------------------ FP8 checkpoint

LINEAR_SHAPES = {       # (out_features, in_features) of each Llama-family Linear from (H, nh, nkv, hd, I)
    "self_attn.q_proj": lambda H, nh, nkv, hd, I: (nh * hd, H),
    "self_attn.k_proj": lambda H, nh, nkv, hd, I: (nkv * hd, H),
    "self_attn.v_proj": lambda H, nh, nkv, hd, I: (nkv * hd, H),
    "self_attn.o_proj": lambda H, nh, nkv, hd, I: (H, nh * hd),
    "mlp.gate_proj": lambda H, nh, nkv, hd, I: (I, H),
    "mlp.up_proj": lambda H, nh, nkv, hd, I: (I, H),
    "mlp.down_proj": lambda H, nh, nkv, hd, I: (H, I),
}
SERVING_DTYPES = {"bfloat16": "BF16", "float16": "F16"}
SCALE_SUFFIXES = (".weight_scale", ".input_scale", ".k_scale", ".v_scale")


def fp8_checkpoint_problems(folder) -> list[str]:
    """A ModelOpt FP8 checkpoint folder as TensorRT-LLM's PyTorch backend loads it (FP8QDQLinearMethod): every
    Linear of every layer present as float8_e4m3fn (out, in) with one-value float32 weight_scale and input_scale,
    k_scale/v_scale one value each when the KV cache is FP8, lm_head and embeddings unquantized, every unquantized
    tensor in the config's dtype, and that dtype one TensorRT-LLM's kernels run (bfloat16 or float16)."""
    from eaglex.calibration.memory import safetensors_header

    folder = Path(folder)
    probs = []
    try:
        cfg = json.loads((folder / "config.json").read_text())
        hq = json.loads((folder / "hf_quant_config.json").read_text()).get("quantization") or {}
    except (OSError, ValueError) as e:
        return [f"{folder}: config.json or hf_quant_config.json unreadable ({e})"]
    dtype = cfg.get("torch_dtype") or cfg.get("dtype")
    if dtype not in SERVING_DTYPES:
        probs.append(f"config.json dtype {dtype!r}: TensorRT-LLM takes the model dtype from the config and its "
                     "kernels run bfloat16 or float16 (recalibrate with --dtype bfloat16)")
    if cfg.get("torch_dtype") and cfg.get("dtype") and cfg["torch_dtype"] != cfg["dtype"]:
        probs.append(f"config.json says torch_dtype {cfg['torch_dtype']} but dtype {cfg['dtype']}")
    qc = cfg.get("quantization_config") or {}
    if qc.get("quant_method") != "modelopt" or qc.get("quant_algo") != "FP8":
        probs.append(f"config.json quantization_config is {qc.get('quant_method')}/{qc.get('quant_algo')}, "
                     "expected modelopt/FP8")
    if hq.get("quant_algo") != "FP8":
        probs.append(f"hf_quant_config.json quant_algo is {hq.get('quant_algo')!r}, expected 'FP8'")
    if "lm_head" not in (hq.get("exclude_modules") or []):
        probs.append("hf_quant_config.json does not exclude lm_head (TensorRT-LLM would load it as FP8)")
    kv_fp8 = hq.get("kv_cache_quant_algo") == "FP8"
    tensors: dict[str, dict] = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update({k: v for k, v in safetensors_header(f).items() if k != "__metadata__"})
    if not tensors:
        return probs + [f"{folder} holds no *.safetensors"]
    H, L = cfg["hidden_size"], cfg["num_hidden_layers"]
    nh = cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads") or nh
    hd = cfg.get("head_dim") or H // nh
    inter, V = cfg["intermediate_size"], cfg["vocab_size"]
    want_float = SERVING_DTYPES.get(dtype)

    def one_value(name):
        t = tensors.get(name)
        if t is None:
            return f"missing {name}"
        n = 1
        for d in t["shape"]:
            n *= d
        if t["dtype"] != "F32" or n != 1:
            return f"{name} is {t['dtype']} {t['shape']}, expected one float32 value"
        return None

    for i in range(L):
        for lin, shape_of in LINEAR_SHAPES.items():
            m = f"model.layers.{i}.{lin}"
            w = tensors.get(m + ".weight")
            if w is None:
                probs.append(f"missing {m}.weight")
                continue
            shape = list(shape_of(H, nh, nkv, hd, inter))
            if w["dtype"] != "F8_E4M3" or w["shape"] != shape:
                probs.append(f"{m}.weight is {w['dtype']} {w['shape']}, expected F8_E4M3 {shape}")
            probs += [p for p in (one_value(m + ".weight_scale"), one_value(m + ".input_scale")) if p]
        if kv_fp8:
            probs += [p for p in (one_value(f"model.layers.{i}.self_attn.k_proj.k_scale"),
                                  one_value(f"model.layers.{i}.self_attn.v_proj.v_scale")) if p]
    unquantized = [("model.embed_tokens.weight", [V, H]), ("model.norm.weight", [H])]
    if not cfg.get("tie_word_embeddings"):
        unquantized.append(("lm_head.weight", [V, H]))
    for name, shape in unquantized:
        t = tensors.get(name)
        if t is None or t["shape"] != shape or t["dtype"] == "F8_E4M3":
            probs.append(f"{name}: {t and (t['dtype'], t['shape'])}, expected an unquantized {shape}")
    for name, t in sorted(tensors.items()):
        if name.endswith(SCALE_SUFFIXES) or t["dtype"] == "F8_E4M3" or not t["dtype"].startswith(("F", "BF")):
            continue
        if want_float and t["dtype"] != want_float:
            probs.append(f"{name} is {t['dtype']}, the config says {dtype}")
    return probs


# --------------------------------------------------------------------------------------- Triton llmapi model

#: triton_backend/all_models/llmapi/tensorrt_llm/1/model.py (NVIDIA/TensorRT-LLM): model.yaml is read from the
#: model's version folder (pb_utils.get_model_dir(), file name from $LLM_CONFIG_PATH or "model.yaml");
#: `triton_config` must hold max_batch_size and decoupled (cancellation_check_period_ms is optional) and every
#: other key is passed to LLM(**kwargs) through update_llm_args_with_extra_dict.
LLMAPI_MODEL_YAML = "model.yaml"
LLMAPI_TRITON_KEYS = frozenset({"max_batch_size", "decoupled", "cancellation_check_period_ms"})
LLMAPI_TRITON_REQUIRED = ("max_batch_size", "decoupled")
LLMAPI_SOURCE = "triton_backend/all_models/llmapi/tensorrt_llm/1/model.py @ NVIDIA/TensorRT-LLM"
