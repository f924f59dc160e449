"""EAGLE-3 heads as GGUF files for llama.cpp (`llama-server -m TARGET.gguf -md HEAD.gguf --spec-type draft-eagle3`).

The file has the layout llama.cpp's own converter writes for an EAGLE-3 head (convert_hf_to_gguf.py, architecture
"eagle3"): the decoder layer under llama's tensor names with Q/K rows permuted for ggml's rotary layout, `fc`,
`output` (the head's own lm_head over the draft vocabulary), `d2t` as absolute target ids (I64), and the
`eagle3.target_layers` / `eagle3.target_hidden_size` keys. Two choices differ from that converter on purpose:
- the tokenizer fields are copied from the target's GGUF file, so the draft's vocabulary is the target's by
  construction (llama.cpp checks that the two match);
- `target_layers` are the layers whose *input* the head reads, as eaglex runs the head (models.eagle.config_taps;
  llama.cpp extracts layer inputs too), including heads that name their layers in `eagle_config`.
Heads with features eaglex does not run (norm_before_fc / norm_before_residual, rope scaling) are refused.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from eaglex.base.errors import ModelError
from eaglex.models.eagle import _read_state, config_taps, detect_kind

ARCH = "eagle3"
DTYPES = ("F32", "F16")
# the head's tensors (after layers.0.* -> midlayer.*) under llama.cpp's names
NAMES = {
    "fc.weight": "fc.weight",
    "lm_head.weight": "output.weight",
    "norm.weight": "output_norm.weight",
    "midlayer.input_layernorm.weight": "blk.0.attn_norm.weight",      # normalises the token embedding
    "midlayer.hidden_norm.weight": "blk.0.attn_norm_2.weight",
    "midlayer.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "midlayer.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "midlayer.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "midlayer.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "midlayer.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "midlayer.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "midlayer.mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "midlayer.mlp.down_proj.weight": "blk.0.ffn_down.weight",
}


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Q/K rows from Hugging Face's rotate-half layout to ggml's interleaved pairs (the converter's
    LlamaModel.permute): per head, rows [0..d/2) and [d/2..d) become alternating pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _target_info(target_gguf: Path) -> tuple[dict, list]:
    """The target's shape ({layers, hidden, vocab}) and its tokenizer fields, from its GGUF file (any architecture
    llama.cpp runs: the keys read are `ARCH.block_count` and `ARCH.embedding_length`)."""
    from gguf import GGUFReader
    if not target_gguf.is_file():
        raise ModelError(f"{target_gguf}: no such GGUF file")
    try:
        fields = GGUFReader(target_gguf).fields
    except Exception as e:  # noqa: BLE001 - the reader raises whatever numpy/struct raise on a foreign file
        raise ModelError(f"{target_gguf}: not a readable GGUF file ({type(e).__name__})") from None
    arch = fields["general.architecture"].contents() if "general.architecture" in fields else None

    def get(key):
        f = fields.get(f"{arch}.{key}")
        if f is None:
            raise ModelError(f"{target_gguf}: no {arch}.{key} in its metadata: not a model llama.cpp runs")
        return int(f.contents())
    if "tokenizer.ggml.tokens" not in fields:
        raise ModelError(f"{target_gguf}: the GGUF file holds no tokenizer (tokenizer.ggml.tokens)")
    shape = {"layers": get("block_count"), "hidden": get("embedding_length"),
             "vocab": len(fields["tokenizer.ggml.tokens"].contents())}
    return shape, [f for name, f in fields.items() if name.startswith("tokenizer.")]


def _head_config(cfg: dict, path: Path) -> dict:
    """The hyper-parameters llama.cpp reads, from the head's config.json; a ModelError for what it cannot run."""
    for key in ("norm_before_fc", "norm_before_residual"):
        if cfg.get(key):
            raise ModelError(f"{path}: {key} heads are not run by eaglex, so not exported")
    rope = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if scaling:
        raise ModelError(f"{path}: rope scaling {scaling} is not written to GGUF yet (plain RoPE heads only)")
    H, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    return {"hidden": H, "heads": nh, "kv_heads": cfg.get("num_key_value_heads") or nh,
            "head_dim": cfg.get("head_dim") or H // nh, "ffn": cfg["intermediate_size"],
            "eps": cfg.get("rms_norm_eps", 1e-6), "context": cfg.get("max_position_embeddings", 2048),
            "rope_theta": cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0}


def head_tensors(state: dict, hp: dict, vocab: int, dtype: str) -> dict[str, np.ndarray]:
    """llama.cpp's tensors of an EAGLE-3 head `state` (midlayer.* names): matrices in `dtype`, norms F32, d2t as
    absolute target ids (int64; left out when the draft vocabulary is the target's)."""
    out = {}
    for src, dst in NAMES.items():
        w = state[src].float().numpy()
        if src.endswith("q_proj.weight"):
            w = permute_rows(w, hp["heads"])
        elif src.endswith("k_proj.weight"):
            w = permute_rows(w, hp["kv_heads"])
        out[dst] = w.astype(np.float16 if dtype == "F16" and w.ndim == 2 else np.float32)
    draft_vocab = state["lm_head.weight"].shape[0]
    if draft_vocab != vocab:
        if "d2t" not in state:
            raise ModelError(f"the head's draft vocabulary ({draft_vocab}) is smaller than the target's ({vocab}) "
                             "but it has no d2t map")
        ids = state["d2t"].long().numpy() + np.arange(draft_vocab, dtype=np.int64)
        if ids.min() < 0 or ids.max() >= vocab or len(np.unique(ids)) != len(ids):
            raise ModelError(f"the head's d2t maps draft ids outside [0, {vocab}) or twice onto one target id")
        out["d2t"] = ids
    return out


def write_eagle3_gguf(head_dir: str | os.PathLike, target_gguf: str | os.PathLike, out: str | os.PathLike,
                      dtype: str = "F32") -> Path:
    """Write the EAGLE-3 head in `head_dir` (official or ModelOpt/SpecForge layout) as a llama.cpp GGUF file `out`
    for the target in `target_gguf`; `dtype` F32 or F16 for its matrices. `out` appears complete or not at all."""
    from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

    head_dir, target_gguf, out = Path(head_dir), Path(target_gguf), Path(out)
    if dtype not in DTYPES:
        raise ModelError(f"GGUF head dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    if not (head_dir / "config.json").is_file():
        raise ModelError(f"{head_dir} has no config.json: pass an EAGLE-3 head folder")
    cfg = json.loads((head_dir / "config.json").read_text())
    state = _read_state(head_dir)
    if detect_kind(cfg, state) != "eagle3":
        raise ModelError(f"{head_dir} is an EAGLE-1/2 head: llama.cpp runs EAGLE-3 heads only")
    state = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in state.items()}
    missing = sorted(set(NAMES) - set(state))
    if missing:
        raise ModelError(f"{head_dir} lacks the EAGLE-3 tensors {missing}")
    hp = _head_config(cfg, head_dir)
    target, tokenizer = _target_info(target_gguf)
    if hp["hidden"] != target["hidden"] or cfg.get("target_hidden_size", hp["hidden"]) != target["hidden"]:
        raise ModelError(f"{head_dir} has hidden size {hp['hidden']} but {target_gguf.name}'s is {target['hidden']}: "
                         "this head was trained for another model")
    if cfg.get("vocab_size", target["vocab"]) != target["vocab"]:
        raise ModelError(f"{head_dir} has vocab_size {cfg['vocab_size']} but {target_gguf.name} has "
                         f"{target['vocab']} tokens: this head was trained for another tokenizer")
    tensors = head_tensors(state, hp, target["vocab"], dtype)

    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    out.parent.mkdir(parents=True, exist_ok=True)
    w = GGUFWriter(tmp, ARCH)
    try:
        w.add_type("model")
        w.add_name(head_dir.resolve().name)
        w.add_array(f"{ARCH}.target_layers", list(config_taps(cfg, target["layers"])))
        w.add_uint32(f"{ARCH}.target_hidden_size", target["hidden"])
        w.add_bool(f"{ARCH}.norm_before_residual", False)
        w.add_bool(f"{ARCH}.norm_before_fc", False)
        w.add_block_count(1)
        w.add_context_length(hp["context"])
        w.add_embedding_length(hp["hidden"])
        w.add_feed_forward_length(hp["ffn"])
        w.add_head_count(hp["heads"])
        w.add_head_count_kv(hp["kv_heads"])
        w.add_rope_freq_base(float(hp["rope_theta"]))
        w.add_layer_norm_rms_eps(float(hp["eps"]))
        w.add_key_length(hp["head_dim"])
        w.add_value_length(hp["head_dim"])
        w.add_vocab_size(target["vocab"])
        w.add_rope_dimension_count(hp["head_dim"])
        w.add_file_type(0 if dtype == "F32" else 1)
        w.add_quantization_version(2)
        for f in tokenizer:                            # the target's vocabulary, byte for byte
            vtype = f.types[0]
            w.add_key_value(f.name, f.contents(), vtype,
                            sub_type=f.types[-1] if vtype == GGUFValueType.ARRAY else None)
        for name, data in tensors.items():
            w.add_tensor(name, data, raw_dtype=GGMLQuantizationType.I64 if data.dtype == np.int64 else None)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, out)
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
    return out
