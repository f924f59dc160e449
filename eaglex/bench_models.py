"""The benchmark's big target: a seeded ~0.5B Llama whose one-token forward is memory-bound on a CPU, with an
EAGLE-3 head built to agree with it at a measured rate (`make bench`).

Same construction as models/seeded.py, changed where it does not scale:

- Vocabulary V=32000 > H=1536, so the embedding rows cannot be orthogonal. They are random Gaussian rows of norm
  sqrt(H): nearly orthogonal (|cos| ~ 1/sqrt(H) = 0.026), which is all the argmax needs.
- The token map lives on a "frequent" subset S of 8000 tokens (the draft vocabulary, Vd=8000 as in official
  EAGLE-3 heads): next() is one random cycle through S, and lm_head row next(t) = e(t) for t in S. Rows of the other
  24000 tokens are zero, so greedy generation never leaves S (a real model's reduced draft vocabulary covers almost
  all of what it generates). The EOS id is one of those dead tokens: generations run to max_new_tokens.
- Layers: the fixtures' anti-self attention (a token reads *other* positions, so an override depends on the
  context and a cache/position bug changes the output) with o_proj scaled by eps_attn and down_proj by eps_mlp.
  eps sets how often the context overrides the map; at H=1536 and 16 layers the values are larger than the
  fixtures' because the margin of the right logit grows with sqrt(H).
- EAGLE-3 head with the target's width, intermediate size and attention shape (24 query / 6 KV heads of 64), as
  a real EAGLE-3 head, so its draft steps cost what a real head's do. The fixtures' recipe
  (q = k = c·[slice of norm(e) | 0], v = [I | -I], o = I) is applied to the first R = 6·64 = 384 coordinates,
  all that 6 KV heads can carry: they become norm(e(token fed)), and the draft lm_head (the target's rows of S,
  restricted to those coordinates) reads them, so its argmax is next(token fed): every draft step predicts the
  map, and the draft is rejected exactly when the target's context overrides the map. `fc` is random with a
  unit-RMS output (all three taps feed it; the layer cancels it on those coordinates).

So the acceptance rate is known by construction: alpha = P(target follows the map), measured by
`measure_alpha` on greedy generations; a chain drafting L tokens then commits about sum_{i<=L} alpha^i per cycle.

Building writes 2.0 GB (target, 494.7M parameters) + 0.2 GB (head) of float32 safetensors in about a minute
(alpha probe included), the engine in about 40 s more (peak RSS 4.4 GB). Nothing is trained or downloaded; the
same seed gives byte-identical tensors.

Command line (used by `make bench`):  python -m eaglex.bench_models OUT_DIR [--engine ENGINE_DIR] [--force]
writes OUT_DIR/target, OUT_DIR/eagle3, OUT_DIR/prompts.jsonl, OUT_DIR/agreement.json and builds the ONNX Runtime
engine ENGINE_DIR; every step is skipped when its output exists (a stamp file marks a finished step).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from eaglex.models.seeded import _gen, _norm_weight, _randn

BIG_SPEC = dict(
    vocab=32000, hidden=1536, intermediate=4096, layers=16, heads=24, kv_heads=6, head_dim=64, frequent=8000,
    max_pos=2048, rope_theta=500000.0, rms_norm_eps=1e-5,
    eps_attn=2.7, eps_mlp=0.4, qk_gain=2.0, anti_self=0.9, norm_jitter=0.1,
)
BIG_HEAD_SPEC = dict(self_attn_gain=3.0, noise=0.02, mlp_scale=0.15, norm_jitter=0.05, max_pos=2048)


def _attn_mlp(g, s):
    """One decoder layer: anti-self GQA attention (seeded._attn_mlp_weights' construction, without its draw of a k
    that anti-self replaces: the generator's stream, and so every bench model, stays as recorded), o_proj/down_proj
    scaled by eps."""
    H, nh, nkv, hd, I = s["hidden"], s["heads"], s["kv_heads"], s["head_dim"], s["intermediate"]
    qk = s["qk_gain"] / math.sqrt(H)
    q = _randn(g, nh * hd, H, std=qk)
    a, G = s["anti_self"], nh // nkv
    qg = q.view(nkv, G, hd, H)
    qg[:, 1:] = a * qg[:, :1] + math.sqrt(1 - a * a) * qg[:, 1:]
    k = -qg[:, 0].reshape(nkv * hd, H).clone()
    return {
        "self_attn.q_proj.weight": q,
        "self_attn.k_proj.weight": k,
        "self_attn.v_proj.weight": _randn(g, nkv * hd, H, std=1 / math.sqrt(H)),
        "self_attn.o_proj.weight": _randn(g, H, nh * hd, std=s["eps_attn"] / math.sqrt(nh * hd)),
        "mlp.gate_proj.weight": _randn(g, I, H, std=1 / math.sqrt(H)),
        "mlp.up_proj.weight": _randn(g, I, H, std=1 / math.sqrt(H)),
        "mlp.down_proj.weight": _randn(g, H, I, std=s["eps_mlp"] / math.sqrt(I)),
    }


def token_map(seed: int = 0, **overrides) -> tuple[torch.Tensor, torch.Tensor]:
    """(S sorted [F], next [V]): next(t) for t in S is one cycle through S; -1 for tokens outside S."""
    s = {**BIG_SPEC, **overrides}
    V, F = s["vocab"], s["frequent"]
    g = _gen(seed, 11)
    S = torch.sort(torch.randperm(V, generator=g)[:F]).values
    order = S[torch.randperm(F, generator=g)]
    nxt = torch.full((V,), -1, dtype=torch.long)
    nxt[order] = torch.roll(order, -1)
    return S, nxt


def target_config(s: dict, eos: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": s["vocab"],
        "hidden_size": s["hidden"], "intermediate_size": s["intermediate"], "num_hidden_layers": s["layers"],
        "num_attention_heads": s["heads"], "num_key_value_heads": s["kv_heads"], "head_dim": s["head_dim"],
        "max_position_embeddings": s["max_pos"], "rms_norm_eps": s["rms_norm_eps"], "rope_theta": s["rope_theta"],
        "rope_scaling": None, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": False, "bos_token_id": None, "eos_token_id": eos, "pad_token_id": None,
        "torch_dtype": "float32", "use_cache": True,
    }


def target_state_dict(seed: int = 0, **overrides) -> tuple[dict, dict]:
    """(state dict, config) of the big target; deterministic in (seed, overrides)."""
    s = {**BIG_SPEC, **overrides}
    V, H, L = s["vocab"], s["hidden"], s["layers"]
    g = _gen(seed, 1)
    E = _randn(g, V, H)
    E *= math.sqrt(H) / E.norm(dim=-1, keepdim=True)
    S, nxt = token_map(seed, **overrides)
    head = torch.zeros(V, H)
    head[nxt[S]] = E[S]                           # logits of h ~ e(t) peak at next(t)
    eos = int(next(t for t in range(V - 1, -1, -1) if nxt[t] < 0))    # a dead token: never generated
    sd = {"model.embed_tokens.weight": E, "lm_head.weight": head}
    for i in range(L):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = _norm_weight(g, H, s["norm_jitter"])
        sd[p + "post_attention_layernorm.weight"] = _norm_weight(g, H, s["norm_jitter"])
        for k, v in _attn_mlp(g, s).items():
            sd[p + k] = v
    sd["model.norm.weight"] = _norm_weight(g, H, s["norm_jitter"])
    return sd, target_config(s, eos)


def _write_folder(out: Path, sd: dict, cfg: dict, extra: dict[str, dict] | None = None) -> None:
    from safetensors.torch import save_file
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for name, obj in (extra or {}).items():
        (out / name).write_text(json.dumps(obj, indent=2) + "\n")


def make_big_target(path, seed: int = 0, **overrides) -> Path:
    sd, cfg = target_state_dict(seed, **overrides)
    _write_folder(Path(path), sd, cfg, {"generation_config.json": {"eos_token_id": cfg["eos_token_id"],
                                                                     "do_sample": False}})
    return Path(path)


def head_state_dict(target_sd: dict, target_cfg: dict, seed: int = 0, **overrides) -> tuple[dict, dict]:
    """EAGLE-3 head (official `midlayer.*` layout) for the big target; see the module docstring."""
    s = {**BIG_HEAD_SPEC, **overrides}
    H, V, L = target_cfg["hidden_size"], target_cfg["vocab_size"], target_cfg["num_hidden_layers"]
    I, nh = target_cfg["intermediate_size"], target_cfg["num_attention_heads"]
    hd = H // nh
    assert nh * hd == H
    g = _gen(seed, 3)
    head = target_sd["lm_head.weight"]
    ids = (head.abs().sum(-1) > 0).nonzero().flatten()          # the frequent set S (rows the map uses)
    Vd = ids.shape[0]
    d2t = ids - torch.arange(Vd)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    # fc: unit-RMS output from all three taps; the layer subtracts norm(h) from the residual, leaving e(token)
    taps = [2, L // 2, L - 3]
    tap_rms = _tap_rms(target_sd, target_cfg, taps)
    fc = torch.cat([_randn(g, H, H, std=1 / (math.sqrt(3 * H) * r)) for r in tap_rms], 1)
    # GQA like the target (24 query / 6 KV heads of 64): the layer works on the first R = n_kv*head_dim = 384
    # coordinates only. KV head j (and its 4 query heads) reads slice j of norm(e) (q = k = c*I there: every
    # position attends to itself), v_j = slice j of (norm(e) - norm(h)), o puts it back on those coordinates:
    # the residual's first R coordinates become norm(e(token fed)). The draft lm_head reads those R coordinates.
    nkv = target_cfg["num_key_value_heads"]
    G, R = nh // nkv, nkv * hd
    c, noise = s["self_attn_gain"], s["noise"] / math.sqrt(2 * H)
    k_w = torch.zeros(R, 2 * H)
    k_w[:, :R] = c * torch.eye(R)
    q_w = k_w.view(nkv, 1, hd, 2 * H).expand(nkv, G, hd, 2 * H).reshape(nh * hd, 2 * H).clone()
    v_w = torch.zeros(R, 2 * H)
    v_w[:, :R], v_w[:, H:H + R] = torch.eye(R), -torch.eye(R)
    o_w = torch.zeros(H, nh * hd)
    for i in range(nh):
        j = i // G
        o_w[j * hd:(j + 1) * hd, i * hd:(i + 1) * hd] = torch.eye(hd) / G
    q_w += _randn(g, *q_w.shape, std=noise)
    k_w += _randn(g, *k_w.shape, std=noise)
    v_w += _randn(g, *v_w.shape, std=noise)
    o_w += _randn(g, *o_w.shape, std=s["noise"] / math.sqrt(H))
    lm = head[ids].clone()
    lm[:, R:] = 0.0
    sd = {
        "fc.weight": fc,
        "midlayer.hidden_norm.weight": _norm_weight(g, H, s["norm_jitter"]),
        "midlayer.input_layernorm.weight": _norm_weight(g, H, s["norm_jitter"]),
        "midlayer.self_attn.q_proj.weight": q_w,
        "midlayer.self_attn.k_proj.weight": k_w,
        "midlayer.self_attn.v_proj.weight": v_w,
        "midlayer.self_attn.o_proj.weight": o_w,
        "midlayer.post_attention_layernorm.weight": _norm_weight(g, H, s["norm_jitter"]),
        "midlayer.mlp.gate_proj.weight": _randn(g, I, H, std=1 / math.sqrt(H)),
        "midlayer.mlp.up_proj.weight": _randn(g, I, H, std=1 / math.sqrt(H)),
        "midlayer.mlp.down_proj.weight": _randn(g, H, I, std=s["mlp_scale"] / math.sqrt(I)),
        "norm.weight": _norm_weight(g, H, s["norm_jitter"]),
        "lm_head.weight": lm,
        "d2t": d2t.to(torch.int64),
        "t2d": t2d,
    }
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H, "intermediate_size": I,
        "num_attention_heads": nh, "num_key_value_heads": nkv, "num_hidden_layers": 1, "hidden_act": "silu",
        "rms_norm_eps": 1e-5, "max_position_embeddings": s["max_pos"], "vocab_size": V, "draft_vocab_size": Vd,
        "pad_token_id": 0, "bos_token_id": None, "eos_token_id": target_cfg["eos_token_id"],
        "tie_word_embeddings": False, "torch_dtype": "float32", "initializer_range": 0.02, "use_cache": True,
        "transformers_version": "4.28.1",
    }
    return sd, cfg


def _tap_rms(sd: dict, cfg: dict, taps: list[int], n: int = 64) -> list[float]:
    """Mean RMS of the target's EAGLE-3 taps over a few seeded single-token-free contexts (one forward)."""
    model = _hf_model(sd, cfg)
    g = _gen(0, 99)
    ids = torch.randint(0, cfg["vocab_size"], (2, n), generator=g)
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states
    return [float(f"{float(hs[i].pow(2).mean().sqrt()):.3g}") for i in taps]   # rounded: thread-count independent


def _hf_model(sd: dict, cfg: dict):
    """LlamaForCausalLM sharing `sd`'s tensors (built on the meta device: no random init of 0.5B weights)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    c = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "torch_dtype")})
    c._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = LlamaForCausalLM(c)
    model.load_state_dict(sd, strict=True, assign=True)
    model.model.rotary_emb = type(model.model.rotary_emb)(c)     # its inv_freq buffer was created on meta
    return model.eval()


@torch.no_grad()
def _greedy_batch(model, prompts: torch.Tensor, n_new: int) -> torch.Tensor:
    """Greedy continuation [B, n_new] of equal-length prompts [B, T] (HF KV cache)."""
    out = model(prompts, use_cache=True)
    cache, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    toks = [tok]
    for _ in range(n_new - 1):
        out = model(tok, past_key_values=cache, use_cache=True)
        cache, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        toks.append(tok)
    return torch.cat(toks, 1)


@torch.no_grad()
def measure_alpha(sd: dict, cfg: dict, prompts: list[list[int]], n_new: int = 64, seed: int = 0) -> dict:
    """Greedy generations of the target; alpha = share of generated tokens that follow the map."""
    _, nxt = token_map(seed)
    model = _hf_model(sd, cfg)
    follow = total = 0
    for p in prompts:
        ids = torch.tensor([p])
        out = model(ids, use_cache=True)
        cache, prev = out.past_key_values, p[-1]
        tok = int(out.logits[0, -1].argmax())
        for _ in range(n_new):
            follow += int(nxt[prev] == tok)
            total += 1
            out = model(torch.tensor([[tok]]), past_key_values=cache, use_cache=True)
            cache, prev, tok = out.past_key_values, tok, int(out.logits[0, -1].argmax())
    a = follow / total
    chain = {f"chain d{d}": round(sum(a ** i for i in range(d + 2)), 3) for d in (1, 2, 3, 4, 5, 6)}
    return {"alpha": round(a, 4), "positions": total, "expected_tau": chain,
            "note": "tau of a chain drafting d+1 tokens if the map is followed independently at rate alpha"}


def make_prompts(n: int = 12, seed: int = 0, lengths=(64, 256)) -> list[list[int]]:
    """Prompts of random frequent tokens (the set the target generates from), lengths in [64, 256]."""
    S, _ = token_map(seed)
    g = _gen(seed, 21)
    out = []
    for i in range(n):
        k = int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=g))
        out.append(S[torch.randint(0, S.shape[0], (k,), generator=g)].tolist())
    return out


def build_all(out: Path, engine: Path | None, seed: int = 0, force: bool = False, alpha_prompts: int = 6) -> dict:
    """Target, head, prompts, agreement report and (optionally) the ORT engine; finished steps are skipped."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = out / "models.done"
    t0 = time.perf_counter()
    if force or not stamp.is_file():
        stamp.unlink(missing_ok=True)
        sd, cfg = target_state_dict(seed)
        print(f"target: {sum(v.numel() for v in sd.values()) / 1e6:.1f}M parameters", file=sys.stderr)
        _write_folder(out / "target", sd, cfg, {"generation_config.json": {"eos_token_id": cfg["eos_token_id"],
                                                                            "do_sample": False}})
        hsd, hcfg = head_state_dict(sd, cfg, seed)
        _write_folder(out / "eagle3", hsd, hcfg)
        prompts = make_prompts(seed=seed)
        with open(out / "prompts.jsonl", "w") as f:
            for p in prompts:
                f.write(json.dumps({"input_ids": p}) + "\n")
        agree = measure_alpha(sd, cfg, prompts[:alpha_prompts], seed=seed)
        agree.update(target_params=sum(v.numel() for k, v in sd.items()),
                     draft_params=sum(v.numel() for k, v in hsd.items() if k not in ("d2t", "t2d")),
                     spec=BIG_SPEC, head_spec=BIG_HEAD_SPEC, seed=seed)
        (out / "agreement.json").write_text(json.dumps(agree, indent=1) + "\n")
        del sd, hsd
        stamp.write_text(f"built in {time.perf_counter() - t0:.1f} s\n")
        print(f"models: alpha {agree['alpha']} ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    if engine is not None and (force or not (Path(engine) / "manifest.json").is_file()):
        from eaglex.engines.build import build_engine, summary
        manifest = build_engine(out / "target", out / "eagle3", engine, "onnxruntime", "float32", force=True)
        print(summary(manifest, engine), file=sys.stderr)
    return json.loads((out / "agreement.json").read_text())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eaglex.bench_models", description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--engine", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true")
    a = ap.parse_args(argv)
    agree = build_all(a.out, a.engine, a.seed, a.force)
    print(f"{a.out}: alpha {agree['alpha']}, expected tau {agree['expected_tau']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
