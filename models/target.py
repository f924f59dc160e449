"""The target: a Hugging Face Llama-family causal LM, run by one functional forward over its own weights.

Transformers loads the folder (every file format, sharding, tied embeddings, dtypes, RoPE variants); this module
only re-wires the forward so that it takes an explicit tree mask and a caller-owned KV cache, and returns the
features an EAGLE head reads. The same forward is what `export/` traces to ONNX.

It owns no cache and knows nothing about trees beyond the mask.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from eaglex.base.errors import ModelError

SUPPORTED_ARCHS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class TargetSpec:
    arch: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_context: int
    eos_ids: tuple[int, ...]


class LayerCache(Protocol):
    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new keys/values [B, Hkv, N, D] of `layer`; return all keys/values to attend over."""


class ConcatCache:
    """Functional cache: past tensors in, past+new out. Used by the ONNX export (present_* outputs)."""

    def __init__(self, past: list[tuple[torch.Tensor, torch.Tensor]]):
        self.past, self.present = past, [None] * len(past)

    def update(self, layer, k, v):
        pk, pv = self.past[layer]
        self.present[layer] = (torch.cat([pk, k], 2), torch.cat([pv, v], 2))
        return self.present[layer]


def causal_mask(n: int, past: int = 0, batch: int = 1, device=None) -> torch.Tensor:
    """[batch, 1, n, past + n] bool attention mask (True = attend): every one of `past` cached rows, then causal
    over the `n` new rows. The one place masks are built; tree masks replace the last n columns (runtime)."""
    mask = torch.ones(batch, 1, n, past + n, dtype=torch.bool, device=device)
    mask[..., past:] = torch.ones(n, n, dtype=torch.bool, device=device).tril_()
    return mask


def eagle3_taps(num_layers: int, aux_layer_ids: list[int] | None = None) -> tuple[int, ...]:
    """Decoder layers whose *input* (HF hidden_states index) EAGLE-3 reads, low -> mid -> high.

    Official: {2, L//2, L-3}. `eagle_config.eagle_aux_hidden_state_layer_ids` names layer *outputs*, hence +1.
    """
    taps = [i + 1 for i in aux_layer_ids] if aux_layer_ids else [2, num_layers // 2, num_layers - 3]
    taps = sorted(taps)  # ModelOpt may store them as an unordered set; features are concatenated in layer order
    if len(set(taps)) != len(taps) or taps[0] < 0 or taps[-1] >= num_layers:
        raise ModelError(f"EAGLE-3 feature layers {taps} do not fit a target with {num_layers} layers "
                         f"(they must be distinct and < {num_layers}); use a target with at least 7 layers")
    return tuple(taps)


class Target(nn.Module):
    """features='eagle3': cat of the inputs of layers `taps` [B,N,3H]; 'eagle1': final-normed hidden [B,N,H]."""

    def __init__(self, hf_model: nn.Module, spec: TargetSpec):
        super().__init__()
        self.hf, self.spec = hf_model, spec
        self.inner = hf_model.model
        self.features, self.taps = "none", ()

    def with_features(self, kind: str, taps: tuple[int, ...] = ()) -> "Target":
        """A view of this target (same weights, nothing copied) whose forward also returns the features a head of
        `kind` reads; the target itself is left as it was, so models shared between users never change under them."""
        assert kind in ("none", "eagle1", "eagle3")
        view = copy.copy(self)
        view.features, view.taps = kind, tuple(taps)
        return view

    @property
    def embed_weight(self) -> torch.Tensor:
        return self.inner.embed_tokens.weight

    @property
    def lm_head(self) -> nn.Module:
        return self.hf.lm_head

    @property
    def feature_size(self) -> int:
        return {"none": 0, "eagle1": 1, "eagle3": len(self.taps)}[self.features] * self.spec.hidden_size

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attn_mask: torch.Tensor,
                cache: LayerCache, logits_rows: str | torch.Tensor = "all"):
        """input_ids, position_ids [B,N] int64; attn_mask [B,1,N,T] bool (True = attend), T = cached + N.

        Returns logits [B,N,V] float32 (or [B,1,V] when logits_rows == "last", [B,R,V] for a tensor of R row
        indices) and features [B,N,F].
        """
        x = self.inner.embed_tokens(input_ids)                             # [B,N,H]
        cos, sin = self.inner.rotary_emb(x, position_ids)                  # [B,N,D] each
        taps = []
        for i, layer in enumerate(self.inner.layers):
            if i in self.taps:
                taps.append(x)
            x = x + self._attention(layer, i, layer.input_layernorm(x), cos, sin, attn_mask, cache)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        x = self.inner.norm(x)
        if self.features == "eagle3":
            feats = torch.cat(taps, -1)
        elif self.features == "eagle1":
            feats = x
        else:
            feats = x[..., :0]
        if isinstance(logits_rows, torch.Tensor):   # the ONNX graphs take the rows as an input
            x = x.index_select(1, logits_rows)
        elif logits_rows == "last":
            x = x[:, -1:]
        return self.hf.lm_head(x).float(), feats

    def _attention(self, layer, index, h, cos, sin, attn_mask, cache):
        attn, spec = layer.self_attn, self.spec
        B, N, _ = h.shape
        q = attn.q_proj(h).view(B, N, spec.num_heads, spec.head_dim)
        k = attn.k_proj(h).view(B, N, spec.num_kv_heads, spec.head_dim)
        v = attn.v_proj(h).view(B, N, spec.num_kv_heads, spec.head_dim).transpose(1, 2)
        if hasattr(attn, "q_norm"):                                        # Qwen3: per-head RMSNorm before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)                        # [B,heads,N,D]
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        k_all, v_all = cache.update(index, k, v)                           # [B,Hkv,T,D]
        o = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=attn_mask,
                                           enable_gqa=spec.num_heads != spec.num_kv_heads)  # MHA: see eagle.py
        return attn.o_proj(o.transpose(1, 2).reshape(B, N, spec.num_heads * spec.head_dim))


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE as in HF Llama; x [B,heads,N,D], cos/sin [B,N,D]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def read_config(path: Path) -> dict:
    cfg_file = path / "config.json"
    if not path.is_dir():
        raise ModelError(f"target folder {path} does not exist")
    if not cfg_file.is_file():
        raise ModelError(f"{path} has no config.json: pass a Hugging Face model folder")
    try:
        return json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ModelError(f"{cfg_file} is not valid JSON ({e})") from None


def _has_weights(path: Path) -> bool:
    return any(path.glob("*.safetensors")) or any(path.glob("pytorch_model*.bin"))


def load_target(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> Target:
    """Load a local Hugging Face folder (no remote code) as a Target on `device`."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()   # our own commands show progress where it matters
    path = Path(path)
    raw = read_config(path)
    arch = (raw.get("architectures") or ["?"])[0]
    if arch not in SUPPORTED_ARCHS:
        raise ModelError(f"{path}: architecture {arch} is not supported; eaglex runs {', '.join(SUPPORTED_ARCHS)}")
    if not _has_weights(path):
        raise ModelError(f"{path} holds no weights (*.safetensors or pytorch_model*.bin)")
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=False)
        config._attn_implementation = "sdpa"
        model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - any failure to decode the user's files is bad input, said in one line
        raise load_error(path, e) from None
    model.eval().requires_grad_(False)
    if torch.device(device).type != "cpu":
        model.to(device)
    return Target(model, spec_from_config(config, path))


def target_from_model(model: nn.Module, path: str | Path | None = None) -> Target:
    """A Target over a Hugging Face causal LM already in memory (its weights, device and dtype used as they are);
    `path`: its folder, for the EOS ids of generation_config.json, else those of the model's own configs."""
    config = model.config
    arch = (getattr(config, "architectures", None) or [type(model).__name__])[0]
    if arch not in SUPPORTED_ARCHS:
        raise ModelError(f"architecture {arch} is not supported; eaglex runs {', '.join(SUPPORTED_ARCHS)}")
    model.eval().requires_grad_(False)
    spec = replace(spec_from_config(config, Path(path) if path is not None else None), arch=arch)
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if path is None and eos is not None:
        spec = replace(spec, eos_ids=tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),))
    return Target(model, spec)


def load_error(path: Path, e: Exception) -> ModelError:
    """One line for a model folder transformers could not load."""
    return ModelError(f"cannot load the target from {path}: {type(e).__name__}: "
                      f"{(str(e).splitlines() or [''])[0][:200]}")


def spec_from_config(config, path: Path | None) -> TargetSpec:
    """The TargetSpec of a loaded Hugging Face config; EOS ids from the folder's generation config when it has one."""
    from transformers import GenerationConfig

    eos = config.eos_token_id
    try:
        gen = GenerationConfig.from_pretrained(path) if path is not None else None
        eos = gen.eos_token_id if gen is not None and gen.eos_token_id is not None else eos
    except OSError:
        pass
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
    max_ctx = config.max_position_embeddings
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        max_ctx = min(max_ctx, config.sliding_window)   # beyond the window Mistral attends differently
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return TargetSpec(arch=(getattr(config, "architectures", None) or ["?"])[0], num_layers=config.num_hidden_layers,
                      hidden_size=config.hidden_size, num_heads=config.num_attention_heads,
                      num_kv_heads=config.num_key_value_heads or config.num_attention_heads,
                      head_dim=head_dim, vocab_size=config.vocab_size, max_context=max_ctx, eos_ids=eos_ids)
