"""EAGLE-3 head training with training-time test (TTT), as the official `eagle/traineagle3`.

The head is the inference module itself (models.eagle.DraftHead); only its attention is re-run here in the TTT
form. For a sequence x_0..x_{T-1}, slot t of step s feeds token x_{t+1+s} at RoPE position t+s; step 0's hidden
input is fc(target features at t), step s > 0's is the head's own pre-norm output of step s-1 at the same slot. A
query of step s attends to step-0 keys at slots <= t (the real-feature context) and to the keys of steps 1..s at
slot t only (its own draft chain): exactly what a depth-(s+1) draft node sees at inference. The loss of step s is
the soft cross-entropy against the target's softmax restricted to the draft vocabulary at position t+1+s,
masked where the target's argmax lies outside it, averaged over B·(T-1) slots, and weighted 0.8^s.
One departure, in initialisation only: lm_head and the final norm start as the target's rows of the draft vocabulary
and its final norm (the official code starts them at random), which a small training budget needs. With `init`, the
head instead starts as an existing head (fine-tuning): its shape, feature taps and draft vocabulary are kept.

Saved in the official layout: config.json like `yuhuili/EAGLE3-LLaMA3.1-Instruct-8B` (plus draft_vocab_size) and
pytorch_model.bin in float16 with fc / midlayer.* / norm / lm_head / d2t / t2d and no embed_tokens.
"""
from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from eaglex.models.eagle import DraftHead
from eaglex.models.target import Target, eagle3_taps, rope

from .heads import Teacher, init_head, layer_config, new_head, save_head
from .loop import OptimConfig, digest, logged, seed_everything, step_generator, train
from .selfdistill import SelfDistillData


@dataclass(frozen=True)
class Eagle3Config:
    draft_vocab_size: int = 1024
    intermediate_size: int | None = None   # None: the target's
    num_heads: int | None = None           # None: the target's (head_dim = hidden // heads, as the official code)
    num_kv_heads: int | None = None
    ttt_steps: int = 7                     # the official code unrolls 7 (the paper says 5)
    step_weight: float = 0.8               # loss weight of step s: step_weight ** s
    loss_on_prompt: bool = True            # False: only continuation tokens count (official: assistant tokens)
    init_from_target: bool = True          # lm_head/norm start as the target's rows of the draft vocabulary
    precondition_fc: bool = True           # train fc on per-dimension normalised features, fold the scale in
    teacher_cache_gb: float = 4.0          # compute the target's outputs once when they fit (heads.Teacher)
    batch: int = 8
    seed: int = 0
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(steps=300, lr=2e-3, warmup=30))
    # A head folder to continue training instead of fresh weights; its own shape and draft vocabulary replace
    # draft_vocab_size, intermediate_size, num_heads, num_kv_heads and init_from_target.
    init: str | None = None


# ------------------------------------------------------------------------------------------------ vocabulary

def vocab_map(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Official d2t/t2d: the Vd most frequent target ids (ties: lower id first), sorted ascending.

    counts [V] int64 -> d2t [Vd] int64 offsets (target id = draft id + d2t[draft id]), t2d [V] bool membership.
    """
    V = counts.shape[0]
    if not 0 < draft_vocab_size <= V:
        raise ValueError(f"draft_vocab_size must be in [1, {V}], got {draft_vocab_size}")
    order = sorted(range(V), key=lambda v: (-int(counts[v]), v))
    used = torch.tensor(sorted(order[:draft_vocab_size]), dtype=torch.long)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[used] = True
    return used - torch.arange(draft_vocab_size), t2d


# ------------------------------------------------------------------------------------------------ the head

def head_config(target: Target, cfg: Eagle3Config, eos_id: int | None) -> dict:
    """config.json of the official LLaMA-3.1 EAGLE-3 head, sized for `target` (no rope_theta: θ = 10000)."""
    return {
        **layer_config(target, cfg, eos_id),
        "max_position_embeddings": 2048,
        "draft_vocab_size": cfg.draft_vocab_size,
    }


def ttt_layer(head: DraftHead, hidden: torch.Tensor, input_ids: torch.Tensor, step: int,
              kv: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """One TTT step of the midlayer over all slots: hidden [B,n,H] (pre-fc'd), input_ids [B,n] -> [B,n,H].

    kv collects each step's (keys, values), already repeated to the query heads (GQA: query head i reads kv head
    i // rep) [B,nh,n,D]; keys of step 0 are attended causally, those of later steps only on the diagonal
    (as the official trainer).
    """
    s, layer = head.spec, head.midlayer
    attn = layer.self_attn
    B, n, _ = hidden.shape
    rep = s.num_heads // s.num_kv_heads
    e = head._embed[0](input_ids)                                         # [B,n,H], frozen
    x = torch.cat([layer.input_layernorm(e), layer.hidden_norm(hidden)], -1)   # [B,n,2H], embedding first
    pos = (torch.arange(n, device=hidden.device) + step).unsqueeze(0)
    cos, sin = head.rotary(x, pos)
    q = rope(attn.q_proj(x).view(B, n, s.num_heads, s.head_dim).transpose(1, 2), cos, sin)       # [B,nh,n,D]
    k = rope(attn.k_proj(x).view(B, n, s.num_kv_heads, s.head_dim).transpose(1, 2), cos, sin)    # [B,Hkv,n,D]
    v = attn.v_proj(x).view(B, n, s.num_kv_heads, s.head_dim).transpose(1, 2)
    kv.append((k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)))   # once per step, not once per use
    (k0, v0), diag = kv[0], kv[1:]
    scale = 1.0 / math.sqrt(s.head_dim)
    future = _future(n, q.device)
    scores = [(q @ k0.transpose(-1, -2)).float().mul_(scale).masked_fill_(future, float("-inf"))]  # [B,nh,n,n]
    scores += [(q * kj).sum(-1, keepdim=True).float() * scale for kj, _ in diag]                  # [B,nh,n,1]
    p = torch.softmax(torch.cat(scores, -1), -1)                          # [B,nh,n,n+step]
    o = p[..., :n].to(v0.dtype) @ v0
    for j, (_, vj) in enumerate(diag):
        o = o + p[..., n + j:n + j + 1].to(vj.dtype) * vj
    h = hidden + attn.o_proj(o.transpose(1, 2).reshape(B, n, s.num_heads * s.head_dim))
    return h + layer.mlp(layer.post_attention_layernorm(h))


@functools.lru_cache(maxsize=4)
def _future(n: int, device: torch.device) -> torch.Tensor:
    """[n,n] bool, True above the diagonal: the keys a causal query must not see (built once per length)."""
    return torch.ones(n, n, dtype=torch.bool, device=device).triu_(1)


def ttt_loss(head: DraftHead, logits: torch.Tensor, top: torch.Tensor, feats: torch.Tensor, tokens: torch.Tensor,
             loss_mask: torch.Tensor, t2d: torch.Tensor, steps: int, step_weight: float,
             fscale: torch.Tensor | None = None, with_metrics: bool = True) -> tuple[torch.Tensor, dict]:
    """The teacher's outputs for tokens [B,T] (heads.Teacher: logits [B,T,Vd] over the draft vocabulary, full
    argmax [B,T], features [B,T,3H]) and loss_mask [B,T] bool (per input token, official convention) ->
    (weighted loss, metrics: per-step accuracies, only computed `with_metrics`).

    fscale [3H]: multiplies the target features before fc (training-time preconditioning, see feature_scale());
    None feeds them raw, as inference does.
    """
    B, T = tokens.shape
    n = T - 1                                                            # slots 0..T-2
    # The teacher at position j: softmax over the draft vocabulary, zeroed where the target's argmax is not in it
    # (masked once here, so each step's loss is one dot product).
    m_all = loss_mask[:, 1:] & t2d[top[:, 1:]]                           # [B,n] (position j = slot + 1)
    pm_all = torch.softmax(logits[:, 1:], -1) * m_all.unsqueeze(-1)      # [B,n,Vd]
    x = feats[:, :n] if fscale is None else feats[:, :n] * fscale
    hidden = head.fc(x)
    kv: list = []
    total, metrics = 0.0, {}
    for s in range(steps):
        valid = n - s                                                    # slots t <= T-2-s have token and teacher
        if valid <= 0:
            break
        ids = torch.zeros(B, n, dtype=torch.long, device=tokens.device)
        ids[:, :valid] = tokens[:, 1 + s:]                               # x_{t+1+s}
        hidden = ttt_layer(head, hidden, ids, s, kv)                     # [B,n,H]
        pm = pm_all[:, s:]                                               # target at t+1+s: predicts x_{t+2+s}
        logq = torch.log_softmax(head.lm_head(head.norm(hidden[:, :valid])).float(), -1)   # [B,valid,Vd]
        loss = -torch.dot(pm.reshape(-1), logq.reshape(-1)) / (B * n)
        total = total + step_weight ** s * loss
        if with_metrics and s in (0, 1, steps - 1):
            with torch.no_grad():
                m = m_all[:, s:]
                acc = ((logq.argmax(-1) == pm.argmax(-1)) & m).sum() / m.sum().clamp(min=1)
            metrics[f"acc{s}"] = acc.item()
    return total, metrics


# ------------------------------------------------------------------------------------------------ train / save

def prepare_teacher(target: Target, data: SelfDistillData, cfg: Eagle3Config
                    ) -> tuple[Target, torch.Tensor, torch.Tensor]:
    """(the target viewed with EAGLE-3's feature taps, d2t, t2d): the draft vocabulary from the frequencies of the
    tokens the head will be asked to predict (t2d's ids are the Teacher's `keep`)."""
    mask = data.loss_mask(cfg.loss_on_prompt)
    d2t, t2d = vocab_map(data.token_counts(target.spec.vocab_size, mask), cfg.draft_vocab_size)
    return target.with_features("eagle3", eagle3_taps(target.spec.num_layers)), d2t, t2d


def train_eagle3(target: Target, data: SelfDistillData, cfg: Eagle3Config, eos_id: int | None = None,
                 checkpoint: Path | None = None, threads: int | None = None, teacher_cache: tuple | None = None):
    """Returns (head, config dict, t2d, per-step losses). `teacher_cache`: heads.teacher_outputs of the data for
    prepare_teacher's vocabulary, computed elsewhere (make tiny splits it over two processes)."""
    seed_everything(cfg.seed, threads)
    run_key = {}
    if cfg.init:
        head, config = init_head(target, cfg.init, "eagle3")
        d2t = head.d2t.cpu()
        target = target.with_features("eagle3", head.spec.taps)
        run_key["init"] = digest(*head.parameters(), d2t)
    else:
        target, d2t, _ = prepare_teacher(target, data, cfg)
        config = head_config(target, cfg, eos_id)
        head = new_head(target, config, "eagle3")
        head.d2t.copy_(d2t)
    # The target id of each draft id in lm_head's row order (prepare_teacher's vocabulary lists them ascending;
    # a loaded head's d2t need not).
    keep = torch.arange(d2t.numel()) + d2t
    t2d = torch.zeros(target.spec.vocab_size, dtype=torch.bool)
    t2d[keep] = True
    mask = data.loss_mask(cfg.loss_on_prompt)
    if cfg.init_from_target and not cfg.init:   # the official code starts lm_head at random; the target's rows
        with torch.no_grad():                   # train much faster
            head.lm_head.weight.copy_(target.lm_head.weight[keep])
            head.norm.weight.copy_(target.inner.norm.weight)
    teach = Teacher(target, data.tokens, keep, cfg.teacher_cache_gb, cfg.batch, teacher_cache)
    dev = target.embed_weight.device   # the head trains where the target runs; batches are drawn on the host
    t2d_dev = t2d.to(dev)
    scale = feature_scale(teach, data, cfg) if cfg.precondition_fc else None
    if scale is not None and cfg.init:   # fc(x * scale) with weight / scale is the loaded head's fc(x)
        with torch.no_grad():
            head.fc.weight.div_(scale)
    coverage = float(data.token_counts(target.spec.vocab_size, mask)[t2d].sum()) / max(1, int(mask.sum()))
    print(f"eagle3: draft vocabulary {d2t.numel()} of {target.spec.vocab_size} covers "
          f"{100 * coverage:.1f}% of the training tokens")

    def loss_fn(step: int):
        idx = torch.randint(data.tokens.shape[0], (cfg.batch,), generator=step_generator(cfg.seed, step))
        return ttt_loss(head, *teach(idx), data.tokens[idx].to(dev), mask[idx].to(dev), t2d_dev, cfg.ttt_steps,
                        cfg.step_weight, scale, logged(step, cfg.optim.steps))

    losses = train(head, loss_fn, cfg.optim, checkpoint, "eagle3 (TTT)",
                   {"config": asdict(cfg), "data": digest(data.tokens, data.prompt_len),
                    "target": digest(target.embed_weight, target.lm_head.weight), **run_key})
    if scale is not None:   # fc(x * scale) == (fc.weight * scale) x: the saved head is a plain official fc
        with torch.no_grad():
            head.fc.weight.mul_(scale)
    return head, config, t2d, losses


@torch.no_grad()
def feature_scale(teach: Teacher, data: SelfDistillData, cfg: Eagle3Config, batches: int = 4) -> torch.Tensor:
    """[3H] 1 / RMS of each fused-feature dimension over a few batches.

    The target's residual stream carries a few huge dimensions (RMS ~ 100 against ~ 1 for most), and Adam moves
    every weight by about the learning rate whatever its input's size, so an fc fed raw features is driven by the
    outliers and barely learns from the rest. Training fc on normalised inputs and folding the scale into its
    weight afterwards conditions the problem without changing the head's architecture or file format.
    """
    gen = step_generator(cfg.seed, -1)
    sq = 0.0
    for _ in range(batches):
        idx = torch.randint(data.tokens.shape[0], (cfg.batch,), generator=gen)
        sq = sq + teach(idx)[2].double().pow(2).mean((0, 1))
    return (sq / batches).sqrt().clamp(min=1e-3).reciprocal().float()


def save_eagle3(head: DraftHead, config: dict, t2d: torch.Tensor, out: str | Path) -> None:
    """Official layout: config.json + pytorch_model.bin (float16 weights, int64 d2t, bool t2d, no embed_tokens)."""
    save_head(head, config, out, {"t2d": t2d})
