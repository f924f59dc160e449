"""EAGLE-1/2 head training, as the official `eagle/train`: feature regression plus a token loss.

The head reads the target's final-normed last hidden state f_t with the next token x_{t+1} (fc over
[embedding, feature]) and regresses f_{t+1} through one causal decoder layer. Loss = SmoothL1(pred, f_{t+1}) +
0.1 · CE(softmax(lm_head(f_{t+1})), log_softmax(lm_head(pred))), both averaged over the loss mask, with uniform
noise (U - 0.5) · 0.2 · 512 / T on the input features. The target's lm_head is frozen and shared, not saved.

Saved in the official EAGLE-1 layout: LlamaConfig-style config.json (target vocab, the target's rope_theta, no
draft_vocab_size) and pytorch_model.bin in float16 with fc (+ bias), layers.0.* (no input_layernorm) and a copy
of the target's embed_tokens, as the released heads carry. With `init`, training continues from an existing head.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from eaglex.models.eagle import DraftHead
from eaglex.models.target import Target, causal_mask

from .heads import Teacher, causal_cache, init_head, layer_config, new_head, save_head
from .loop import OptimConfig, digest, seed_everything, step_generator, train
from .selfdistill import SelfDistillData


@dataclass(frozen=True)
class Eagle1Config:
    intermediate_size: int | None = None   # None: the target's
    num_heads: int | None = None           # None: the target's
    num_kv_heads: int | None = None
    noise: float = 0.2                     # uniform feature noise amplitude, scaled by 512 / T (official)
    value_weight: float = 1.0
    token_weight: float = 0.1
    loss_on_prompt: bool = True
    teacher_cache_gb: float = 4.0          # compute the target's outputs once when they fit (heads.Teacher)
    batch: int = 8
    seed: int = 0
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(steps=300, lr=2e-3, warmup=30))
    init: str | None = None                # a head folder to continue training; its shape replaces the sizes above


def head_config(target: Target, cfg: Eagle1Config, eos_id: int | None) -> dict:
    t, hf = target.spec, target.hf.config
    rope_theta = (getattr(hf, "rope_parameters", None) or {}).get("rope_theta") or getattr(hf, "rope_theta", 10000.0)
    return {
        **layer_config(target, cfg, eos_id),
        "max_position_embeddings": t.max_context,
        "rope_theta": float(rope_theta),
        "rope_scaling": None,
        "bias": True,
    }


def eagle1_loss(head: DraftHead, logits: torch.Tensor, feats: torch.Tensor, tokens: torch.Tensor,
                loss_mask: torch.Tensor, cfg: Eagle1Config, gen: torch.Generator) -> tuple[torch.Tensor, dict]:
    """The teacher's logits [B,T,V] and final-normed features [B,T,H] for tokens [B,T], loss_mask [B,T] bool (per
    predicted feature position) -> (loss, metrics)."""
    B, T = tokens.shape
    n = T - 1
    x = feats[:, :n].float()
    dev = x.device
    x = x + (torch.rand(x.shape, generator=gen).to(dev) - 0.5) * cfg.noise * 512 / n   # drawn on the host: seeded
    d = head.spec
    cache = causal_cache((1, d.num_kv_heads, d.head_dim), B, torch.float32, dev)
    pred = head(x, tokens[:, 1:], torch.arange(n, device=dev).expand(B, n), causal_mask(n, 0, B, dev), cache,
                project=True)
    m = loss_mask[:, 1:].float()                                         # [B,n]: the position of f_{t+1}
    denom = m.sum() + 1e-5
    target_f = feats[:, 1:].float()
    vloss = (F.smooth_l1_loss(pred.float(), target_f, reduction="none").mean(-1) * m).sum() / denom
    p = torch.softmax(logits[:, 1:], -1)                                 # = softmax(lm_head(f_{t+1}))
    logq = torch.log_softmax(head.target_lm_head[0](pred).float(), -1)
    ploss = -((p * logq).sum(-1) * m).sum() / denom
    with torch.no_grad():
        acc = ((logq.argmax(-1) == p.argmax(-1)).float() * m).sum() / denom
    return cfg.value_weight * vloss + cfg.token_weight * ploss, {"vloss": vloss.item(), "acc0": acc.item()}


def train_eagle1(target: Target, data: SelfDistillData, cfg: Eagle1Config, eos_id: int | None = None,
                 checkpoint: Path | None = None, threads: int | None = None):
    """Returns (head, config dict, per-step losses)."""
    seed_everything(cfg.seed, threads)
    target = target.with_features("eagle1")
    mask = data.loss_mask(cfg.loss_on_prompt)
    if cfg.init:
        head, config = init_head(target, cfg.init, "eagle1")
        run_key = {"init": digest(*head.parameters())}
    else:
        config = head_config(target, cfg, eos_id)
        head, run_key = new_head(target, config, "eagle1"), {}
    teach = Teacher(target, data.tokens, None, cfg.teacher_cache_gb, cfg.batch)

    def loss_fn(step: int):
        gen = step_generator(cfg.seed, step)
        idx = torch.randint(data.tokens.shape[0], (cfg.batch,), generator=gen)
        logits, _, feats = teach(idx)
        return eagle1_loss(head, logits, feats, data.tokens[idx].to(feats.device), mask[idx].to(feats.device), cfg,
                           gen)

    losses = train(head, loss_fn, cfg.optim, checkpoint, "eagle1",
                   {"config": asdict(cfg), "data": digest(data.tokens, data.prompt_len),
                    "target": digest(target.embed_weight, target.lm_head.weight), **run_key})
    return head, config, losses


def save_eagle1(head: DraftHead, config: dict, out: str | Path) -> None:
    # the embedding the head read: the target's, or the copy an --init head's file carried (the loader lets it win)
    save_head(head, config, out, {"embed_tokens.weight": head._embed[0].weight})
