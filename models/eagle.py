"""EAGLE draft heads: EAGLE-3 (fused low/mid/high features, own reduced vocabulary) and EAGLE-1/2.

Loads the official SafeAILab layouts unchanged (`pytorch_model.bin` or safetensors) and the ModelOpt/SpecForge
variant (`layers.0.*`, `LlamaForCausalLMEagle3`). Formats and math follow the official EAGLE code (SafeAILab/EAGLE).
A head computes one draft step; trees, caches and scoring live in runtime/.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

from eaglex.base.errors import ModelError

from .target import Target, eagle3_taps, rope


@dataclass(frozen=True)
class DraftSpec:
    kind: str                 # "eagle3" | "eagle1"
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int           # the target's vocabulary
    draft_vocab_size: int     # rows of the draft's own lm_head (EAGLE-3); = vocab_size for EAGLE-1
    rms_eps: float
    fc_bias: bool             # EAGLE-1: `bias` key, default True
    qkv_bias: bool            # EAGLE-1 Qwen2 heads
    taps: tuple[int, ...]     # EAGLE-3 target layers (HF hidden_states indices); () for EAGLE-1


class DraftAttention(nn.Module):
    def __init__(self, spec: DraftSpec, in_features: int):
        super().__init__()
        s = spec
        self.spec = s
        self.q_proj = nn.Linear(in_features, s.num_heads * s.head_dim, bias=s.qkv_bias)
        self.k_proj = nn.Linear(in_features, s.num_kv_heads * s.head_dim, bias=s.qkv_bias)
        self.v_proj = nn.Linear(in_features, s.num_kv_heads * s.head_dim, bias=s.qkv_bias)
        self.o_proj = nn.Linear(s.num_heads * s.head_dim, s.hidden_size, bias=False)

    def forward(self, x, cos, sin, attn_mask, cache):
        s, (B, N, _) = self.spec, x.shape
        q = self.q_proj(x).view(B, N, s.num_heads, s.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, N, s.num_kv_heads, s.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, N, s.num_kv_heads, s.head_dim).transpose(1, 2)
        k_all, v_all = cache.update(0, rope(k, cos, sin), v)
        o = F.scaled_dot_product_attention(rope(q, cos, sin), k_all, v_all, attn_mask=attn_mask,
                                           enable_gqa=s.num_heads != s.num_kv_heads)  # MHA: the exporter's
        # opset-23 SDPA lowering refuses enable_gqa with equal head counts (EAGLE-3 heads of Vicuna are MHA)
        return self.o_proj(o.transpose(1, 2).reshape(B, N, s.num_heads * s.head_dim))


class DraftMLP(nn.Module):
    def __init__(self, spec: DraftSpec):
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    """EAGLE-3 `midlayer` (attention over [norm(embedding), norm(hidden)], 2H wide) or EAGLE-1 `layers.0`
    (attention over fc's output, no input_layernorm)."""

    def __init__(self, spec: DraftSpec):
        super().__init__()
        H, eps = spec.hidden_size, spec.rms_eps
        if spec.kind == "eagle3":
            self.input_layernorm = LlamaRMSNorm(H, eps)   # normalises the token embedding, despite its name
            self.hidden_norm = LlamaRMSNorm(H, eps)
        self.self_attn = DraftAttention(spec, 2 * H if spec.kind == "eagle3" else H)
        self.post_attention_layernorm = LlamaRMSNorm(H, eps)
        self.mlp = DraftMLP(spec)


class DraftHead(nn.Module):
    """One draft step: (hidden [B,N,Fin], next tokens [B,N]) -> pre-norm hidden [B,N,H] fed back to the next step.

    `project=True` on the first step of a cycle, whose hidden input is the target's features (EAGLE-3: 3H wide,
    through `fc`; EAGLE-1: H wide, fused with the embedding by `fc` on every step).
    """

    def __init__(self, spec: DraftSpec, rope_config: LlamaConfig, embed: nn.Embedding, target_lm_head: nn.Module):
        super().__init__()
        self.spec = spec
        H = spec.hidden_size
        self._embed = [embed]                                # shared, frozen target embedding (not a submodule)
        if spec.kind == "eagle3":
            self.fc = nn.Linear(len(spec.taps) * H, H, bias=False)
            self.midlayer = DraftLayer(spec)
            self.norm = LlamaRMSNorm(H, spec.rms_eps)
            self.lm_head = nn.Linear(H, spec.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(spec.draft_vocab_size, dtype=torch.long))
        else:
            self.fc = nn.Linear(2 * H, H, bias=spec.fc_bias)
            self.layers = nn.ModuleList([DraftLayer(spec)])
            self.target_lm_head = [target_lm_head]           # a list keeps it out of this module's parameters
        self.rotary = LlamaRotaryEmbedding(rope_config)

    @property
    def layer(self) -> DraftLayer:
        return self.midlayer if self.spec.kind == "eagle3" else self.layers[0]

    def forward(self, hidden, input_ids, position_ids, attn_mask, cache, project: bool):
        e = self._embed[0](input_ids)                                      # [B,N,H]
        if self.spec.kind == "eagle3":
            if project:
                hidden = self.fc(hidden)
            layer = self.midlayer
            x = torch.cat([layer.input_layernorm(e), layer.hidden_norm(hidden)], -1)   # embedding first
            residual = hidden
        else:
            layer = self.layers[0]
            x = residual = self.fc(torch.cat([e, hidden], -1))            # embedding first
        cos, sin = self.rotary(x, position_ids)
        h = residual + layer.self_attn(x, cos, sin, attn_mask, cache)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def log_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] pre-norm hidden -> [..., Vd] float32 log-probabilities over the draft vocabulary."""
        if self.spec.kind == "eagle3":
            logits = self.lm_head(self.norm(hidden))
        else:
            logits = self.target_lm_head[0](hidden)
        return torch.log_softmax(logits.float(), -1)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        if self.spec.kind == "eagle3":
            return draft_ids + self.d2t[draft_ids]
        return draft_ids


# ---------------------------------------------------------------------------------------------------- loading

def _read_state(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors")) or sorted(path.glob("pytorch_model*.bin"))
    if not files:
        raise ModelError(f"draft folder {path} holds no weights (model.safetensors or pytorch_model.bin)")
    state = {}
    for f in files:
        try:
            if f.suffix == ".safetensors":
                from safetensors.torch import load_file
                state.update(load_file(str(f)))
            else:   # a pickle is code: never unpickle arbitrary objects
                state.update(torch.load(f, map_location="cpu", weights_only=True))
        except Exception as e:  # noqa: BLE001 - any decoding failure means a corrupt or foreign file
            raise ModelError(f"cannot read {f}: {type(e).__name__}: {str(e).splitlines()[0][:200]}") from None
    return state


def detect_kind(cfg: dict, state: dict[str, torch.Tensor]) -> str:
    if any(k.startswith("midlayer.") or "hidden_norm" in k for k in state) or "LlamaForCausalLMEagle3" in (
            cfg.get("architectures") or []):
        return "eagle3"
    if "fc.weight" in state:
        return "eagle1"
    raise ModelError("the draft folder is neither an EAGLE-3 head (midlayer.*, fc [H,3H]) nor an EAGLE-1/2 head "
                     "(fc [H,2H], layers.0.*)")


def config_taps(cfg: dict, num_layers: int) -> tuple[int, ...]:
    """The target layers (HF hidden_states indices, i.e. layer inputs) an EAGLE-3 head with config `cfg` reads."""
    return eagle3_taps(num_layers, (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"))


def load_draft(path: str | Path, target: Target, kind: str | None = None) -> DraftHead:
    """Load an EAGLE head folder for `target`; `kind` forces eagle3/eagle1 instead of detecting it."""
    path = Path(path)
    if not path.is_dir():
        raise ModelError(f"draft folder {path} does not exist")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelError(f"{path} has no config.json: pass an EAGLE head folder")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ModelError(f"{cfg_file} is not valid JSON ({e})") from None
    state = _read_state(path)
    kind = kind or detect_kind(cfg, state)
    if kind == "eagle3":   # ModelOpt/SpecForge name the EAGLE-3 layer layers.0.*, the official code midlayer.*
        state = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v
                 for k, v in state.items()}
    t = target.spec
    H = cfg.get("hidden_size")
    if H is None or "num_attention_heads" not in cfg:
        raise ModelError(f"{cfg_file} lacks hidden_size/num_attention_heads")
    target_h = cfg.get("target_hidden_size", H)
    if target_h != t.hidden_size or H != t.hidden_size:
        raise ModelError(f"draft {path} has hidden size {H} (target_hidden_size {target_h}) but the target's is "
                         f"{t.hidden_size}: this head was trained for another model")
    vocab = cfg.get("vocab_size", t.vocab_size)
    if vocab != t.vocab_size:
        raise ModelError(f"draft {path} has vocab_size {vocab} but the target has {t.vocab_size}: "
                         "this head was trained for another tokenizer")
    nh = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or H // nh
    taps = config_taps(cfg, t.num_layers) if kind == "eagle3" else ()
    spec = DraftSpec(kind=kind, hidden_size=H, num_heads=nh, num_kv_heads=cfg.get("num_key_value_heads") or nh,
                     head_dim=head_dim, intermediate_size=cfg["intermediate_size"], vocab_size=vocab,
                     draft_vocab_size=cfg.get("draft_vocab_size") or vocab, rms_eps=cfg.get("rms_norm_eps", 1e-6),
                     fc_bias=bool(cfg.get("bias", True)), qkv_bias=bool(cfg.get("qkv_bias", False)), taps=taps)
    rope_keys = ("rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings")
    rope_cfg = LlamaConfig(hidden_size=H, num_attention_heads=nh, head_dim=head_dim,
                           **{k: cfg[k] for k in rope_keys if cfg.get(k) is not None})
    rope_cfg.max_position_embeddings = max(rope_cfg.max_position_embeddings, t.max_context)

    embed = target.inner.embed_tokens
    if kind == "eagle1" and "embed_tokens.weight" in state:   # EAGLE-1 files carry their own copy; the official
        if state["embed_tokens.weight"].shape != embed.weight.shape:   # loader lets it win over the target's
            raise ModelError(f"draft {path}: embed_tokens.weight has shape "
                             f"{tuple(state['embed_tokens.weight'].shape)}, the target's is {tuple(embed.weight.shape)}")
        embed = nn.Embedding.from_pretrained(state["embed_tokens.weight"].to(embed.weight.device, embed.weight.dtype),
                                             freeze=True)      # not a submodule: placed on the target's device
    head = DraftHead(spec, rope_cfg, embed, target.lm_head)
    expected = set(head.state_dict())
    optional = {"d2t", "t2d", "embed_tokens.weight"}
    missing = sorted(expected - set(state) - optional)
    unexpected = sorted(set(state) - expected - optional)
    if missing or unexpected:
        raise ModelError(f"draft {path} does not match an {kind} head: missing {missing or 'none'}, "
                         f"unexpected {unexpected or 'none'}")
    for name, want in head.state_dict().items():
        if name in state and state[name].shape != want.shape:
            raise ModelError(f"draft {path}: tensor {name} has shape {tuple(state[name].shape)}, expected "
                             f"{tuple(want.shape)} for a target with hidden size {t.hidden_size}, "
                             f"{t.num_layers} layers")
    if kind == "eagle3":
        Vd = spec.draft_vocab_size
        if "d2t" not in state:
            if Vd != vocab:
                raise ModelError(f"draft {path}: draft_vocab_size {Vd} < vocab {vocab} but no d2t map")
            state["d2t"] = torch.zeros(Vd, dtype=torch.long)
        # Equal vocabularies use draft ids directly (the official code deletes d2t then; Vicuna's is all zeros).
        d2t = state["d2t"].long() if Vd != vocab else torch.zeros(Vd, dtype=torch.long)
        mapped = torch.arange(Vd) + d2t
        if mapped.min() < 0 or mapped.max() >= vocab:
            raise ModelError(f"draft {path}: d2t maps draft ids outside the target vocabulary [0, {vocab})")
        state["d2t"] = d2t
    dtype = target.embed_weight.dtype
    head.load_state_dict({k: v for k, v in state.items() if k in expected}, strict=False)
    return head.to(dtype).eval().requires_grad_(False)
