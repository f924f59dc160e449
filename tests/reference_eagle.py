"""A small, independent reference of the EAGLE draft math, for cross-checking eaglex's loaders and drafters.

Plain torch on CPU, float32, no KV cache: a draft "sequence" is run in one causal pass, and a chain is drafted by
recomputing the whole draft sequence after each appended step (a one-layer causal draft gives the same result as
its KV-cached form).

Conventions (§1.3):
- Pairing: draft row p takes (feature of target position p, token x_{p+1}) at RoPE position p, and predicts x_{p+2}.
- EAGLE-3: features = inputs of target decoder layers [2, L//2, L-3] (pre-norm), concatenated low→mid→high and
  fused by ``fc``; the pre-norm layer output is fed back as the next step's hidden input (fc is skipped then).
- EAGLE-1/2 (§2): feature = the target's final-normed last hidden state; the draft output is fed back as is.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F


# ---------------------------------------------------------------------------------------------------------------
# loading (§1.1, §1.4, §2)
# ---------------------------------------------------------------------------------------------------------------
def load_head(head_dir) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, state dict) of a head folder; ``pytorch_model.bin`` or ``model.safetensors``.

    ModelOpt/SpecForge ``layers.0.*`` names of an EAGLE-3 head are renamed to the official ``midlayer.*`` (§1.4).
    """
    head_dir = Path(head_dir)
    cfg = json.loads((head_dir / "config.json").read_text())
    if (head_dir / "model.safetensors").exists():
        from safetensors.torch import load_file
        sd = load_file(str(head_dir / "model.safetensors"))
    else:
        sd = torch.load(head_dir / "pytorch_model.bin", map_location="cpu", weights_only=True)
    if "draft_vocab_size" in cfg:  # EAGLE-3
        sd = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in sd.items()}
    return cfg, {k: v.float() if v.is_floating_point() else v for k, v in sd.items()}


# ---------------------------------------------------------------------------------------------------------------
# building blocks (LLaMA math, as in the official cnets.py / cnets1.py)
# ---------------------------------------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain RoPE (no scaling), float32 as in the official LlamaRotaryEmbedding: cos/sin = cat(freqs, freqs)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], -1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat([-x2, x1], -1)


def attention(x: torch.Tensor, sd: dict, prefix: str, cfg: dict, positions: torch.Tensor,
              theta: float) -> torch.Tensor:
    """Causal GQA self-attention over the rows of x [T, D_in]; head_dim = hidden_size // heads (§1.1)."""
    H, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads") or nh
    hd = H // nh
    T = x.shape[0]

    def proj(name):
        y = x @ sd[f"{prefix}{name}.weight"].T
        b = sd.get(f"{prefix}{name}.bias")
        return y if b is None else y + b

    q = proj("q_proj").view(T, nh, hd).transpose(0, 1)     # [nh,T,hd]
    k = proj("k_proj").view(T, nkv, hd).transpose(0, 1)    # [nkv,T,hd]
    v = proj("v_proj").view(T, nkv, hd).transpose(0, 1)
    cos, sin = rope_cos_sin(positions, hd, theta)
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    k = k.repeat_interleave(nh // nkv, 0)                  # repeat_kv: query head i uses KV head i // (nh/nkv)
    v = v.repeat_interleave(nh // nkv, 0)
    scores = q @ k.transpose(1, 2) / math.sqrt(hd)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    a = torch.softmax(scores, -1) @ v                       # [nh,T,hd]
    return a.transpose(0, 1).reshape(T, nh * hd) @ sd[f"{prefix}o_proj.weight"].T


def mlp(x: torch.Tensor, sd: dict, prefix: str) -> torch.Tensor:
    gate = x @ sd[f"{prefix}gate_proj.weight"].T
    up = x @ sd[f"{prefix}up_proj.weight"].T
    return (F.silu(gate) * up) @ sd[f"{prefix}down_proj.weight"].T


def _theta(cfg: dict) -> float:
    # §1.3: rope_theta if present, else 10000; only no scaling is supported here (the official code accepts
    # linear/dynamic, and no official head uses them).
    if cfg.get("rope_scaling"):
        raise NotImplementedError("rope_scaling in a draft config")
    return float(cfg.get("rope_theta", 10000.0))


# ---------------------------------------------------------------------------------------------------------------
# EAGLE-3 (§1.3)
# ---------------------------------------------------------------------------------------------------------------
class Eagle3Reference:
    def __init__(self, head_dir, target_embed: torch.Tensor):
        self.cfg, self.sd = load_head(head_dir)
        self.embed = target_embed.detach().float()          # embed_tokens is shared from the target (§1.1)
        self.eps = self.cfg.get("rms_norm_eps", 1e-6)
        self.theta = _theta(self.cfg)
        V, Vd = self.cfg["vocab_size"], self.cfg["draft_vocab_size"]
        # §1.1: when Vd == V the official loader drops d2t and uses draft ids directly.
        self.d2t = self.sd["d2t"] if Vd != V else torch.zeros(Vd, dtype=torch.long)

    def fuse(self, feats3: torch.Tensor) -> torch.Tensor:
        """fc on cat([low, mid, high]) target features [T, 3H] -> [T, H] (§1.2)."""
        return feats3 @ self.sd["fc.weight"].T

    def forward(self, h_in: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One draft layer over rows (h_in [T,H] already fused/fed back, token ids [T], positions [T]) -> h [T,H]."""
        sd, eps, m = self.sd, self.eps, "midlayer."
        e = self.embed[tokens]
        x = torch.cat([rms_norm(e, sd[m + "input_layernorm.weight"], eps),       # EMBEDDING FIRST
                       rms_norm(h_in, sd[m + "hidden_norm.weight"], eps)], -1)   # [T, 2H]
        h = h_in + attention(x, sd, m + "self_attn.", self.cfg, positions, self.theta)   # residual = h_in
        h = h + mlp(rms_norm(h, sd[m + "post_attention_layernorm.weight"], eps), sd, m + "mlp.")
        return h                                                                 # pre-norm: fed back

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits lm_head(norm(h)) [.., Vd]."""
        return rms_norm(h, self.sd["norm.weight"], self.eps) @ self.sd["lm_head.weight"].T

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]                                   # §1.5

    def top1(self, h: torch.Tensor) -> torch.Tensor:
        return self.to_target(self.logits(h).argmax(-1))


# ---------------------------------------------------------------------------------------------------------------
# EAGLE-1/2 (§2)
# ---------------------------------------------------------------------------------------------------------------
class Eagle1Reference:
    def __init__(self, head_dir, target_lm_head: torch.Tensor, target_embed: torch.Tensor | None = None):
        self.cfg, self.sd = load_head(head_dir)
        self.embed = self.sd["embed_tokens.weight"] if "embed_tokens.weight" in self.sd else target_embed.float()
        self.lm_head = target_lm_head.detach().float()     # draft logits use the TARGET head
        self.eps = self.cfg.get("rms_norm_eps", 1e-6)
        self.theta = _theta(self.cfg)

    def forward(self, feats: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """feats [T,H] (target final-normed hidden states, or fed-back draft outputs), token ids [T] -> h [T,H]."""
        sd, eps = self.sd, self.eps
        x = torch.cat([self.embed[tokens], feats], -1) @ sd["fc.weight"].T     # embedding first
        if "fc.bias" in sd:
            x = x + sd["fc.bias"]
        # decoder layer 0 has no input_layernorm
        h = x + attention(x, sd, "layers.0.self_attn.", self.cfg, positions, self.theta)
        h = h + mlp(rms_norm(h, sd["layers.0.post_attention_layernorm.weight"], eps), sd, "layers.0.mlp.")
        return h                                                                 # no final norm

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.lm_head.T

    def top1(self, h: torch.Tensor) -> torch.Tensor:
        return self.logits(h).argmax(-1)


# ---------------------------------------------------------------------------------------------------------------
# target side
# ---------------------------------------------------------------------------------------------------------------
def load_target(target_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()


@torch.no_grad()
def target_greedy(model, prompt: list[int], max_new: int, eos: int | None = None, use_cache: bool = True) -> list[int]:
    """Greedy continuation, stopping after EOS (included). ``use_cache=False`` recomputes the whole sequence."""
    seq = torch.tensor([list(prompt)])
    out, cache = [], None
    for _ in range(max_new):
        if use_cache:
            res = model(seq if cache is None else seq[:, -1:], past_key_values=cache, use_cache=True)
            cache = res.past_key_values
        else:
            res = model(seq)
        t = int(res.logits[0, -1].argmax())
        out.append(t)
        seq = torch.cat([seq, torch.tensor([[t]])], 1)
        if eos is not None and t == eos:
            break
    return out


def eagle3_taps(num_layers: int, head_cfg: dict | None = None) -> list[int]:
    """Decoder layers whose inputs feed fc, low→mid→high (§1.2, §9.1).

    Default [2, L//2, L-3]. A ModelOpt/SpecForge ``eagle_config.eagle_aux_hidden_state_layer_ids`` lists *output*
    layer ids, i.e. the inputs of layers id+1, taken in ascending order.
    """
    ids = ((head_cfg or {}).get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids:
        return sorted(i + 1 for i in ids)
    return [2, num_layers // 2, num_layers - 3]


@torch.no_grad()
def target_eagle3_features(model, ids: torch.Tensor,
                           taps: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(features [T, 3H] = inputs of decoder layers ``taps`` concatenated, greedy next tokens [T]) (§1.2).

    Captured with forward pre-hooks on the decoder layers, i.e. literally "the input of layer idx".
    """
    taps = taps or eagle3_taps(model.config.num_hidden_layers)
    got: dict[int, torch.Tensor] = {}
    hooks = []
    for i in taps:
        def hook(mod, args, kwargs, i=i):
            got[i] = (args[0] if args else kwargs["hidden_states"])[0]
        hooks.append(model.model.layers[i].register_forward_pre_hook(hook, with_kwargs=True))
    try:
        logits = model(ids[None]).logits[0]
    finally:
        for h in hooks:
            h.remove()
    return torch.cat([got[i] for i in taps], -1), logits.argmax(-1)


@torch.no_grad()
def target_eagle1_features(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(final-normed last hidden states [T, H], greedy next tokens [T]) (§2)."""
    hs = model.model(ids[None]).last_hidden_state[0]
    return hs, model.lm_head(hs).argmax(-1)


# ---------------------------------------------------------------------------------------------------------------
# measurements
# ---------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def teacher_forced_top1(head, kind: str, feats: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Draft top-1 target ids for rows p = 0..T-2: row p sees (feature p, token x_{p+1}) at position p and
    predicts x_{p+2}. Compare with the target's greedy token at position p+1."""
    T = ids.shape[0]
    pos = torch.arange(T - 1)
    if kind == "eagle3":
        h = head.forward(head.fuse(feats[:-1]), ids[1:], pos)
    else:
        h = head.forward(feats[:-1], ids[1:], pos)
    return head.top1(h)


@torch.no_grad()
def draft_chain(head, kind: str, feats: torch.Tensor, ids: torch.Tensor, depth: int) -> list[int]:
    """Greedy chain of `depth` draft tokens after the committed tokens ids[0..n-1] (ids[n-1] is the root).

    feats are the target features of positions 0..n-2 (the root has none yet). Each step appends a row
    (fed-back draft output, last draft token) at the next position and recomputes the causal draft pass.
    """
    n = ids.shape[0]
    assert n >= 2, "a chain needs at least one target feature"
    toks = ids[1:].clone()                                    # tokens x_1..x_{n-1}, rows 0..n-2
    if kind == "eagle3":
        hin = head.fuse(feats[: n - 1])
    else:
        hin = feats[: n - 1].clone()
    out = []
    for _ in range(depth):
        h = head.forward(hin, toks, torch.arange(toks.shape[0]))
        t = int(head.top1(h[-1]))
        out.append(t)
        hin = torch.cat([hin, h[-1:]], 0)                     # pre-norm output of the last row is fed back
        toks = torch.cat([toks, torch.tensor([t])], 0)
    return out


def accepted_length(draft: list[int], truth: list[int]) -> int:
    """Length of the longest prefix of draft matching the target's greedy tokens."""
    a = 0
    for d, t in zip(draft, truth):
        if d != t:
            break
        a += 1
    return a
