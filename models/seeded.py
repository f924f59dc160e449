"""Seeded, deterministic builders of small models, written to disk in the layouts eaglex must load unchanged: the
tests' models, and the stand-in preset `make engine MODEL=tiny` builds without the trained default
(tools/seeded_preset.py).

One module of ~600 lines on purpose: every seeded builder the tests name lives in one file, each independent of the
others, so a test's model is found in one place.

Nothing here trains or downloads anything. Every builder takes a seed, uses its own ``torch.Generator`` (the global
RNG is left as it was) and writes float32 weights; the same arguments give byte-identical tensors.

Targets (Hugging Face folders: ``config.json`` with ``architectures``, ``model.safetensors``,
``generation_config.json``)

- ``make_llama_target``: LlamaForCausalLM, 8 layers, H=96, 8 query / 2 KV heads, ``head_dim`` 16 (≠ 96/8), llama3 RoPE
  scaling (θ=500000, factor 8, original context 64, so all three llama3 frequency bands occur), untied ``lm_head``.
- ``make_qwen2_target``: Qwen2ForCausalLM, 7 layers, H=96, 4 query / 2 KV heads, q/k/v biases, tied embeddings.

Both follow one construction: vocabulary V=48 ≤ H, embedding rows
``sqrt(H)·Q[:V]`` for a random orthogonal Q (orthogonal, equal norm), random attention/MLP weights whose output
projections are scaled by ε (``eps_attn`` for ``o_proj``, ``eps_mlp`` for ``down_proj``, relative to a unit-gain
init). With the residual stream ≈ e(t) the target mostly follows a fixed token map t → next(t), and the context
overrides it now and then. Two changes to the recipe make the overrides come from the *context* (other prefix →
other next token, a position or KV-cache bug → other output) rather than from the token itself:

- attention is sharp (q/k std 2/sqrt(H)) and "anti-self": the query heads of a KV group share one query direction
  and k = −q, so a token scores itself lowest and each layer reads other positions (RoPE makes that position
  dependent);
- most of the perturbation comes from attention (ε_attn 1.2 Llama / 0.8 Qwen2), little from the MLPs (ε_mlp 0.3).

- Llama (untied): ``lm_head = E[perm]``, so next = perm⁻¹.
- Qwen2 (tied): a tied head alone would give next(t) = t (a model that mostly repeats its last token, where pairing
  bugs go unnoticed). Instead, layer 0's MLP holds a lookup table (neuron t fires on e(t) and writes
  e(σ(t)) − e(t)), so the map is a random permutation σ here too.

``probe_token_map`` measures the map (the target's most frequent prediction after t over random contexts); the head
builders use it, so they need no knowledge of how a target was built.

The EOS id is chosen at build time by measurement: the token that greedy generations from seeded probe prompts reach
for about 35% of the prompts, preferably not right away (see ``_pick_eos``). It is written to ``config.json`` and
``generation_config.json``.

Heads (official layouts), built so that they agree with the
target often but not always:

- EAGLE-3 midlayer: q = k = c·[slice of norm(e) | 0] (each position attends to itself), v = [B·M1 | −B] and
  o = Bᵀ, where B is an orthonormal basis of span(E) (so GQA fits when V ≤ n_kv·head_dim) and M1 maps e(t) to
  u(t), the vector the target's head reads as next(t). The layer replaces the span(E) part of its input hidden
  state by u(token fed), so every step predicts next(token) and chains go deep. ``fc`` maps the target's high
  feature of token t to u(t) (ridge fit over the V single-token probes) plus small random low/mid blocks, so all
  three taps influence the output. The draft vocabulary is the top-Vd target tokens by frequency over greedy
  probe generations: tokens outside it can never be drafted (built-in rejections).
- EAGLE-1: ``fc = [M1 | small random] + bias``, a small random decoder layer, logits via the target head.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import random
from pathlib import Path

import torch

__all__ = [
    "LLAMA_SPEC", "QWEN2_SPEC", "EAGLE3_SPEC", "EAGLE1_SPEC",
    "make_llama_target", "make_qwen2_target", "make_eagle3_head", "make_eagle1_head", "make_prompts",
    "probe_token_map", "eagle3_tap_layers",
]

# ---------------------------------------------------------------------------------------------------------------
# Sizes and knobs. eps_attn / eps_mlp scale o_proj / down_proj relative to a unit-gain init (std 1/sqrt(fan_in));
# qk_gain sets the attention sharpness (q/k std = qk_gain/sqrt(H)); anti_self is the share of the group's query
# direction in every query head of a KV group (k = −that direction), see the module docstring.
# ---------------------------------------------------------------------------------------------------------------
LLAMA_SPEC = dict(
    vocab=48, hidden=96, intermediate=96, layers=8, heads=8, kv_heads=2, head_dim=16, max_pos=512,
    rope_theta=500000.0, rope_factor=8.0, rope_low=1.0, rope_high=4.0, rope_orig_max=64,
    eps_attn=1.2, eps_mlp=0.3, qk_gain=2.0, anti_self=0.9, norm_jitter=0.1, rms_norm_eps=1e-5,
)
QWEN2_SPEC = dict(
    vocab=48, hidden=96, intermediate=96, layers=7, heads=4, kv_heads=2, max_pos=512, rope_theta=1000000.0,
    eps_attn=0.8, eps_mlp=0.3, qk_gain=2.0, anti_self=0.9, norm_jitter=0.1, bias_std=0.1, lookup_gain=8.0,
    rms_norm_eps=1e-6,
)
EAGLE3_SPEC = dict(
    heads=4, kv_heads=2,       # GQA like the official LLaMA-3.1 head (32/8); head_dim = H // heads
    self_attn_gain=2.0,        # c in q = k = c·[slice | 0]
    mlp_scale=0.15,            # down_proj scale of the small random MLP
    noise=0.02,                # std of the random perturbation on q/k/v/o (relative to unit gain)
    fc_side_std=0.05,          # low/mid blocks of fc
    norm_jitter=0.05,
    max_pos=256,               # like the official head: smaller than the target's context (2048 vs 131072)
)
EAGLE1_SPEC = dict(eps=0.15, qk_gain=1.0, fc_feature_std=0.15, bias_std=0.02, norm_jitter=0.05)

_PROBE_PROMPTS = 24      # per length: probe generations used to pick the EOS id and the draft vocabulary
_PROBE_PROMPT_LENS = (3, 24)
_PROBE_NEW = 60


# ---------------------------------------------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------------------------------------------
def _gen(seed: int, salt: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(int(seed) * 1_000_003 + salt)
    return g


def _randn(g: torch.Generator, *shape: int, std: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=g, dtype=torch.float32) * std


def _orthogonal(g: torch.Generator, n: int) -> torch.Tensor:
    q, r = torch.linalg.qr(_randn(g, n, n).double())
    q = q * torch.sign(torch.diagonal(r))  # unique QR: sign convention independent of LAPACK
    return q.float()


def _norm_weight(g: torch.Generator, n: int, jitter: float) -> torch.Tensor:
    return 1.0 + _randn(g, n, std=jitter)


class _one_thread:
    """Run a builder on one intra-op thread (restored afterwards): tiny matmuls get far slower, not faster, with
    several threads on a shared CPU, and one thread keeps reductions in a fixed order."""

    def __call__(self, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            n = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                return fn(*args, **kwargs)
            finally:
                torch.set_num_threads(n)
        return wrapper


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def _load_target(target_dir):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32)
    return model.eval()


@torch.no_grad()
def _greedy_batch(model, prompts: torch.Tensor, n_new: int) -> torch.Tensor:
    """Greedy continuation of equal-length prompts [B, T] -> [B, n_new] (HF KV cache)."""
    out = model(prompts, use_cache=True)
    cache = out.past_key_values
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    toks = [nxt]
    for _ in range(n_new - 1):
        out = model(nxt, past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        toks.append(nxt)
    return torch.cat(toks, 1)


_PROBE_CACHE: dict[tuple[str, int], torch.Tensor] = {}


def _weights_digest(folder: Path) -> str:
    return hashlib.sha256((Path(folder) / "model.safetensors").read_bytes()).hexdigest()


@torch.no_grad()
def _probe_generations(model, seed: int, digest: str | None = None) -> torch.Tensor:
    """Greedy continuations [2·_PROBE_PROMPTS, _PROBE_NEW] of seeded random prompts, short and long.

    Memoized per (weights digest, seed) when a digest is given: head builders reuse the target's probes.
    """
    if digest is not None and (digest, seed) in _PROBE_CACHE:
        return _PROBE_CACHE[(digest, seed)].clone()
    V = model.config.vocab_size
    g = _gen(seed, 777)
    gens = torch.cat([_greedy_batch(model, torch.randint(0, V, (_PROBE_PROMPTS, n), generator=g), _PROBE_NEW)
                      for n in _PROBE_PROMPT_LENS], 0)
    if digest is not None:
        _PROBE_CACHE[(digest, seed)] = gens.clone()
    return gens


def _pick_eos(gens: torch.Tensor, target: float = 0.35, min_median: int = 10) -> int:
    """The token that about 35% of the probe generations reach, preferably not in their first few tokens.

    Score per token t: |fraction of generations containing t − target|, plus 0.5 when the median first hit is
    earlier than ``min_median`` tokens in. Ties go to the smaller id. Deterministic.
    """
    best, best_score = 0, float("inf")
    for t in range(int(gens.max()) + 1):
        hit = gens == t
        rows = hit.any(1)
        frac = rows.float().mean().item()
        if frac == 0.0 or frac == 1.0:
            continue
        median = hit.float().argmax(1)[rows].float().median().item()
        score = abs(frac - target) + (0.5 if median < min_median else 0.0)
        if score < best_score:
            best, best_score = t, score
    return best


def _finish_target(model, out: Path, seed: int, legacy_rope: bool = False) -> Path:
    """Pick EOS by measurement, then save config/weights/generation_config."""
    from transformers import GenerationConfig
    model.eval()
    gens = _probe_generations(model, seed)
    eos = _pick_eos(gens)
    model.config.eos_token_id = eos
    model.config.bos_token_id = None
    model.config.pad_token_id = None
    model.generation_config = GenerationConfig(eos_token_id=eos, do_sample=False)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    _PROBE_CACHE[(_weights_digest(out), seed)] = gens
    if legacy_rope:  # the form found in hub config.json files of LLaMA-3.1 (rope_theta + rope_scaling)
        cfg = json.loads((out / "config.json").read_text())
        rp = dict(cfg.pop("rope_parameters"))
        cfg["rope_theta"] = rp.pop("rope_theta")
        cfg["rope_scaling"] = rp
        _write_json(out / "config.json", cfg)
    return out


def _attn_mlp_weights(g, spec, H, nh, nkv, hd, I, eps_attn, eps_mlp):
    """Random unit-gain q/k/v/gate/up; o_proj scaled by eps_attn, down_proj by eps_mlp."""
    qk = spec["qk_gain"] / math.sqrt(H)
    q = _randn(g, nh * hd, H, std=qk)
    k = _randn(g, nkv * hd, H, std=qk)
    a = spec.get("anti_self", 0.0)
    if a:
        # the query heads of KV group j share one query direction and k_j = -q_j: a token scores itself lowest,
        # so the attention output comes from the other tokens of the context (context-, not token-driven)
        G = nh // nkv
        qg = q.view(nkv, G, hd, H)
        qg[:, 1:] = a * qg[:, :1] + math.sqrt(1 - a * a) * qg[:, 1:]
        k = -qg[:, 0].reshape(nkv * hd, H).clone()
    return {
        "self_attn.q_proj.weight": q,
        "self_attn.k_proj.weight": k,
        "self_attn.v_proj.weight": _randn(g, nkv * hd, H, std=1 / math.sqrt(H)),
        "self_attn.o_proj.weight": _randn(g, H, nh * hd, std=eps_attn / math.sqrt(nh * hd)),
        "mlp.gate_proj.weight": _randn(g, I, H, std=1 / math.sqrt(H)),
        "mlp.up_proj.weight": _randn(g, I, H, std=1 / math.sqrt(H)),
        "mlp.down_proj.weight": _randn(g, H, I, std=eps_mlp / math.sqrt(I)),
    }


# ---------------------------------------------------------------------------------------------------------------
# targets
# ---------------------------------------------------------------------------------------------------------------
@_one_thread()
def make_llama_target(path, seed: int = 0, legacy_rope: bool = False, **overrides) -> Path:
    """LlamaForCausalLM with GQA, head_dim ≠ H/heads, llama3 RoPE scaling and an untied lm_head = E[perm].

    ``legacy_rope=True`` writes ``rope_theta`` + ``rope_scaling`` (hub style) instead of ``rope_parameters``.
    ``overrides`` replace entries of ``LLAMA_SPEC`` (e.g. ``eps_attn``).
    """
    from transformers import LlamaConfig, LlamaForCausalLM
    s = {**LLAMA_SPEC, **overrides}
    V, H, I, L = s["vocab"], s["hidden"], s["intermediate"], s["layers"]
    nh, nkv, hd = s["heads"], s["kv_heads"], s["head_dim"]
    assert V <= H and L >= 7
    cfg = LlamaConfig(
        vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=L, num_attention_heads=nh,
        num_key_value_heads=nkv, head_dim=hd, max_position_embeddings=s["max_pos"], rms_norm_eps=s["rms_norm_eps"],
        rope_parameters={"rope_type": "llama3", "rope_theta": s["rope_theta"], "factor": s["rope_factor"],
                         "low_freq_factor": s["rope_low"], "high_freq_factor": s["rope_high"],
                         "original_max_position_embeddings": s["rope_orig_max"]},
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False, hidden_act="silu",
        bos_token_id=None, eos_token_id=None, pad_token_id=None, architectures=["LlamaForCausalLM"],
    )
    g = _gen(seed, 1)
    E = math.sqrt(H) * _orthogonal(g, H)[:V]
    perm = torch.randperm(V, generator=g)
    sd = {"model.embed_tokens.weight": E, "lm_head.weight": E[perm].clone()}
    for i in range(L):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = _norm_weight(g, H, s["norm_jitter"])
        sd[p + "post_attention_layernorm.weight"] = _norm_weight(g, H, s["norm_jitter"])
        for k, v in _attn_mlp_weights(g, s, H, nh, nkv, hd, I, s["eps_attn"], s["eps_mlp"]).items():
            sd[p + k] = v
    sd["model.norm.weight"] = _norm_weight(g, H, s["norm_jitter"])
    with torch.random.fork_rng(devices=[]):
        model = LlamaForCausalLM(cfg)
    model.load_state_dict(sd, strict=True)
    return _finish_target(model, Path(path), seed, legacy_rope=legacy_rope)


@_one_thread()
def make_qwen2_target(path, seed: int = 0, **overrides) -> Path:
    """Qwen2ForCausalLM with q/k/v biases and tied embeddings; layer 0's MLP implements a random permutation map.

    ``overrides`` replace entries of ``QWEN2_SPEC``.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM
    s = {**QWEN2_SPEC, **overrides}
    V, H, I, L, nh, nkv = s["vocab"], s["hidden"], s["intermediate"], s["layers"], s["heads"], s["kv_heads"]
    hd = H // nh
    assert V <= H and V <= I and L >= 7
    cfg = Qwen2Config(
        vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=L, num_attention_heads=nh,
        num_key_value_heads=nkv, max_position_embeddings=s["max_pos"], rms_norm_eps=s["rms_norm_eps"],
        rope_parameters={"rope_type": "default", "rope_theta": s["rope_theta"]}, tie_word_embeddings=True,
        use_sliding_window=False, hidden_act="silu", bos_token_id=None, eos_token_id=None, pad_token_id=None,
        architectures=["Qwen2ForCausalLM"],
    )
    g = _gen(seed, 2)
    E = math.sqrt(H) * _orthogonal(g, H)[:V]
    sigma = torch.randperm(V, generator=g)  # the token map: next(t) = sigma[t]
    sd = {"model.embed_tokens.weight": E, "lm_head.weight": E}
    for i in range(L):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = _norm_weight(g, H, s["norm_jitter"])
        sd[p + "post_attention_layernorm.weight"] = _norm_weight(g, H, s["norm_jitter"])
        for k, v in _attn_mlp_weights(g, s, H, nh, nkv, hd, I, s["eps_attn"], s["eps_mlp"]).items():
            sd[p + k] = v
        sd[p + "self_attn.q_proj.bias"] = _randn(g, nh * hd, std=s["bias_std"])
        sd[p + "self_attn.k_proj.bias"] = _randn(g, nkv * hd, std=s["bias_std"])
        sd[p + "self_attn.v_proj.bias"] = _randn(g, nkv * hd, std=s["bias_std"])
    # Layer 0 MLP neurons 0..V-1: a lookup table. gate_t = β·e(t)·x/H fires only on x ≈ e(t) (rows orthogonal,
    # silu(0) = 0); up_t = e(t)·x/H ≈ 1; down column t = (e(σ t) − e(t)) / silu(β).
    beta = s["lookup_gain"]
    p = "model.layers.0.mlp."
    sd["model.layers.0.post_attention_layernorm.weight"] = torch.ones(H)
    sd[p + "gate_proj.weight"][:V] = beta * E / H
    sd[p + "up_proj.weight"][:V] = E / H
    sd[p + "down_proj.weight"][:, :V] = ((E[sigma] - E) / torch.nn.functional.silu(torch.tensor(beta))).T
    sd["model.norm.weight"] = _norm_weight(g, H, s["norm_jitter"])
    with torch.random.fork_rng(devices=[]):
        model = Qwen2ForCausalLM(cfg)
    res = model.load_state_dict({k: v for k, v in sd.items() if k != "lm_head.weight"}, strict=False)
    assert not res.unexpected_keys and set(res.missing_keys) <= {"lm_head.weight"}, res
    model.tie_weights()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return _finish_target(model, Path(path), seed)


def make_prompts(n: int, vocab: int, seed: int = 0, max_len: int = 40) -> list[list[int]]:
    """n prompts of varied lengths in [1, max_len]; the first has length 1, the second max_len."""
    rng = random.Random(seed)
    lengths = [1, max_len] + [rng.randint(1, max_len) for _ in range(max(0, n - 2))]
    return [[rng.randrange(vocab) for _ in range(k)] for k in lengths[:n]]


# ---------------------------------------------------------------------------------------------------------------
# probes shared by the head builders
# ---------------------------------------------------------------------------------------------------------------
def eagle3_tap_layers(num_layers: int) -> list[int]:
    """Decoder layers whose *inputs* EAGLE-3 taps (= HF hidden_states indices)."""
    return [2, num_layers // 2, num_layers - 3]


@torch.no_grad()
def probe_token_map(model, n_prompts: int = 64, length: int = 32, seed: int = 12345) -> torch.Tensor:
    """next[t]: the token the target most often predicts right after t, over random contexts.

    One teacher-forced pass over seeded random prompts; for each token t, the mode of the greedy prediction at the
    positions holding t (ties: smallest id). Tokens never seen fall back to the one-token prompt [t].
    """
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (n_prompts, length), generator=g)
    pred = model(ids).logits.argmax(-1)
    counts = torch.zeros(V, V, dtype=torch.long)
    counts.index_put_((ids.flatten(), pred.flatten()), torch.ones(ids.numel(), dtype=torch.long), accumulate=True)
    nxt = counts.argmax(-1)  # argmax returns the first maximal index
    unseen = counts.sum(-1) == 0
    if unseen.any():
        nxt[unseen] = model(torch.arange(V)[unseen][:, None]).logits[:, -1].argmax(-1)
    return nxt


@torch.no_grad()
def _single_token_taps(model) -> list[torch.Tensor]:
    V = model.config.vocab_size
    hs = model(torch.arange(V)[:, None], output_hidden_states=True).hidden_states
    return [hs[i][:, 0] for i in eagle3_tap_layers(model.config.num_hidden_layers)]


def _state_vectors(model, nxt: torch.Tensor) -> torch.Tensor:
    """u[t]: unit-RMS vector that the target's head reads as next(t) (row next(t) of the head, rescaled)."""
    W = model.lm_head.weight.detach()
    u = W[nxt]
    return u / u.pow(2).mean(-1, keepdim=True).sqrt()


def _draft_vocab(model, gens: torch.Tensor, vd: int) -> torch.Tensor:
    """Top-vd target tokens by frequency over greedy probe generations, sorted ascending."""
    V = model.config.vocab_size
    counts = torch.bincount(gens.flatten(), minlength=V).double()
    counts = counts - torch.arange(V, dtype=torch.double) * 1e-6  # ties: smaller id first
    return torch.sort(torch.topk(counts, vd).indices).values


def _save_state_dict(sd: dict, out: Path, fmt: str) -> None:
    sd = {k: v.contiguous() for k, v in sd.items()}
    if fmt == "bin":
        torch.save(sd, out / "pytorch_model.bin")
    elif fmt == "safetensors":
        from safetensors.torch import save_file
        save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        raise ValueError(f"fmt must be 'bin' or 'safetensors', not {fmt!r}")


# ---------------------------------------------------------------------------------------------------------------
# heads
# ---------------------------------------------------------------------------------------------------------------
@_one_thread()
@torch.no_grad()
def make_eagle3_head(target_dir, out_dir, fmt: str = "bin", draft_vocab_size: int | None = None,
                     layout: str = "official", seed: int = 0) -> Path:
    """EAGLE-3 head in the official SafeAILab layout (``midlayer.*``) or the ModelOpt/SpecForge one (``layers.0.*``).

    ``draft_vocab_size=None`` means Vd = V (d2t all zeros, t2d all true, like the Vicuna head).
    """
    if layout not in ("official", "modelopt"):
        raise ValueError(f"layout must be 'official' or 'modelopt', not {layout!r}")
    s = EAGLE3_SPEC
    model = _load_target(target_dir)
    tc = model.config
    V, H, L = tc.vocab_size, tc.hidden_size, tc.num_hidden_layers
    Vd = V if draft_vocab_size is None else int(draft_vocab_size)
    assert 0 < Vd <= V
    nh, nkv = s["heads"], s["kv_heads"]
    hd = H // nh
    if nkv * hd < V:  # v = [B·M1 | −B] needs n_kv·head_dim ≥ V; fall back to MHA
        nkv = nh
    G = nh // nkv
    I = H
    g = _gen(seed, 3)

    E = model.model.embed_tokens.weight.detach()
    nxt = probe_token_map(model)
    U = _state_vectors(model, nxt)                      # [V,H]
    M1 = U.T @ E / H                                    # e(t) -> u(t)
    B = torch.zeros(nkv * hd, H)
    B[:V] = E / E.norm(dim=-1, keepdim=True)            # orthonormal rows spanning span(E)

    # fc: high tap of token t -> u(t) (ridge fit over the V one-token probes), small random low/mid blocks
    taps = _single_token_taps(model)
    F = taps[2]
    lam = 1e-3 * F.pow(2).sum(-1).mean()
    M = U.T @ torch.linalg.solve(F @ F.T + lam * torch.eye(V), F)
    side = s["fc_side_std"] / math.sqrt(H)
    fc = torch.cat([_randn(g, H, H, std=side), _randn(g, H, H, std=side), M], 1)

    # attention: every query head of KV group j reads slice j of norm(e); v/o replace the span(E) part of h_in
    c, noise = s["self_attn_gain"], s["noise"] / math.sqrt(2 * H)
    k_w = torch.zeros(nkv * hd, 2 * H)
    for j in range(nkv):
        k_w[j * hd:(j + 1) * hd, j * hd:(j + 1) * hd] = c * torch.eye(hd)
    q_w = torch.cat([k_w[(i // G) * hd:(i // G + 1) * hd] for i in range(nh)], 0)
    v_w = torch.cat([B @ M1, -B], 1)
    o_w = torch.zeros(H, nh * hd)
    for i in range(nh):
        j = i // G
        o_w[:, i * hd:(i + 1) * hd] = B[j * hd:(j + 1) * hd].T / G
    q_w = q_w + _randn(g, *q_w.shape, std=noise)
    k_w = k_w + _randn(g, *k_w.shape, std=noise)
    v_w = v_w + _randn(g, *v_w.shape, std=noise)
    o_w = o_w + _randn(g, *o_w.shape, std=s["noise"] / math.sqrt(H))

    if Vd == V:
        ids = torch.arange(V)
    else:  # probe generations of the target with this seed (the ones its build used when the seeds agree)
        ids = _draft_vocab(model, _probe_generations(model, seed, _weights_digest(target_dir)), Vd)
    d2t = (ids - torch.arange(Vd)).to(torch.int64)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True

    mid = "midlayer." if layout == "official" else "layers.0."
    sd = {
        "fc.weight": fc,
        mid + "hidden_norm.weight": _norm_weight(g, H, s["norm_jitter"]),
        mid + "input_layernorm.weight": _norm_weight(g, H, s["norm_jitter"]),
        mid + "self_attn.q_proj.weight": q_w,
        mid + "self_attn.k_proj.weight": k_w,
        mid + "self_attn.v_proj.weight": v_w,
        mid + "self_attn.o_proj.weight": o_w,
        mid + "post_attention_layernorm.weight": _norm_weight(g, H, s["norm_jitter"]),
        mid + "mlp.gate_proj.weight": _randn(g, I, H, std=1 / math.sqrt(H)),
        mid + "mlp.up_proj.weight": _randn(g, I, H, std=1 / math.sqrt(H)),
        mid + "mlp.down_proj.weight": _randn(g, H, I, std=s["mlp_scale"] / math.sqrt(I)),
        "norm.weight": _norm_weight(g, H, s["norm_jitter"]),
        "lm_head.weight": model.lm_head.weight.detach()[ids].clone(),
        "d2t": d2t,
        "t2d": t2d,
    }

    eos = tc.eos_token_id
    cfg = {
        "architectures": ["LlamaForCausalLM"] if layout == "official" else ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": H,
        "intermediate_size": I,
        "num_attention_heads": nh,
        "num_key_value_heads": nkv,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": s["max_pos"],
        "vocab_size": V,
        "draft_vocab_size": Vd,
        "pad_token_id": 0,
        "bos_token_id": tc.bos_token_id,
        "eos_token_id": eos,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "initializer_range": 0.02,
        "use_cache": True,
        "transformers_version": "4.28.1",
    }
    if layout == "modelopt":
        cfg["transformers_version"] = "4.55.4"
        cfg["head_dim"] = hd
        cfg["rope_theta"] = 10000.0  # the value the official head uses implicitly
        cfg["eagle_config"] = {
            "eagle_aux_hidden_state_layer_ids": [i - 1 for i in eagle3_tap_layers(L)],  # output-layer ids
            "use_aux_hidden_state": True,
            "use_input_layernorm_in_first_layer": True,
            "use_last_layernorm": True,
            "use_mtp_layernorm": False,
        }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "config.json", cfg)
    _save_state_dict(sd, out, fmt)
    return out


@_one_thread()
@torch.no_grad()
def make_eagle1_head(target_dir, out_dir, fmt: str = "bin", seed: int = 0, qkv_bias: bool | None = None) -> Path:
    """EAGLE-1/2 head: fc [H,2H] + bias, one decoder layer without input_layernorm, embed_tokens copy.

    ``qkv_bias=None`` follows the target: q/k/v biases and the ``qkv_bias`` config key for Qwen2 targets.
    """
    s = EAGLE1_SPEC
    model = _load_target(target_dir)
    tc = model.config
    V, H = tc.vocab_size, tc.hidden_size
    nh, nkv = tc.num_attention_heads, tc.num_key_value_heads
    hd = H // nh                                        # cnets1 ignores config.head_dim
    I = H
    if qkv_bias is None:
        qkv_bias = tc.model_type == "qwen2"
    g = _gen(seed, 4)

    E = model.model.embed_tokens.weight.detach()
    U = _state_vectors(model, probe_token_map(model))
    M1 = U.T @ E / H
    fc = torch.cat([M1, _randn(g, H, H, std=s["fc_feature_std"] / math.sqrt(H))], 1)
    sd = {
        "fc.weight": fc,
        "fc.bias": _randn(g, H, std=s["bias_std"]),
        "embed_tokens.weight": E.clone(),
    }
    spec = {"qk_gain": s["qk_gain"]}
    for k, v in _attn_mlp_weights(g, spec, H, nh, nkv, hd, I, s["eps"], s["eps"]).items():
        sd["layers.0." + k] = v
    if qkv_bias:
        sd["layers.0.self_attn.q_proj.bias"] = _randn(g, nh * hd, std=0.05)
        sd["layers.0.self_attn.k_proj.bias"] = _randn(g, nkv * hd, std=0.05)
        sd["layers.0.self_attn.v_proj.bias"] = _randn(g, nkv * hd, std=0.05)
    sd["layers.0.post_attention_layernorm.weight"] = _norm_weight(g, H, s["norm_jitter"])

    rope_theta = (tc.rope_parameters or {}).get("rope_theta", 10000.0)
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": H,
        "intermediate_size": I,
        "num_attention_heads": nh,
        "num_key_value_heads": nkv,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": tc.rms_norm_eps,
        "max_position_embeddings": tc.max_position_embeddings,
        "vocab_size": V,
        "rope_theta": float(rope_theta),
        "rope_scaling": None,
        "bias": True,
        "pad_token_id": 0,
        "bos_token_id": tc.bos_token_id,
        "eos_token_id": tc.eos_token_id,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "initializer_range": 0.02,
        "use_cache": True,
        "transformers_version": "4.28.1",
    }
    if qkv_bias:
        cfg["qkv_bias"] = True
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "config.json", cfg)
    _save_state_dict(sd, out, fmt)
    return out
