"""A classic draft model for the Hugging Face assisted-generation peer: a 1-2 layer LlamaForCausalLM with the
target's tokenizer, trained with the plain next-token loss on the same target continuations as the EAGLE heads
(mixed with corpus windows), so the comparison with EAGLE gives both the same data."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .loop import OptimConfig, digest, seed_everything, step_generator, train
from .selfdistill import SelfDistillData
from .tiny_target import save_target
from .tokens import sample_windows


@dataclass(frozen=True)
class DraftLMConfig:
    hidden_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 768
    corpus_fraction: float = 0.5      # share of each batch drawn from corpus windows instead of target continuations
    batch: int = 16
    seed: int = 0
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(steps=300, lr=2e-3, warmup=30,
                                                                  weight_decay=0.1, grad_clip=1.0))


def build_model(cfg: DraftLMConfig, vocab_size: int, eos_id: int, max_position_embeddings: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                         num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                         num_key_value_heads=cfg.num_kv_heads, max_position_embeddings=max_position_embeddings,
                         rms_norm_eps=1e-5, tie_word_embeddings=True,
                         bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id)
    hf_cfg._attn_implementation = "sdpa"
    torch.manual_seed(cfg.seed)
    return LlamaForCausalLM(hf_cfg)


def train_draft_lm(cfg: DraftLMConfig, data: SelfDistillData, stream: torch.Tensor, vocab_size: int, eos_id: int,
                   max_position_embeddings: int = 2048, checkpoint: Path | None = None, threads: int | None = None):
    """Returns (model, per-step losses)."""
    seed_everything(cfg.seed, threads)
    model = build_model(cfg, vocab_size, eos_id, max_position_embeddings)
    T = data.tokens.shape[1]
    n_corpus = round(cfg.batch * cfg.corpus_fraction)

    def loss_fn(step: int):
        gen = step_generator(cfg.seed, step)
        idx = torch.randint(data.tokens.shape[0], (cfg.batch - n_corpus,), generator=gen)
        x = torch.cat([data.tokens[idx], sample_windows(stream, n_corpus, T, gen)])      # [B,T]
        return model(input_ids=x, labels=x).loss, {}

    losses = train(model, loss_fn, cfg.optim, checkpoint, "draft LM",
                   {"config": asdict(cfg), "data": digest(data.tokens, stream), "vocab": vocab_size})
    return model, losses


def save_draft_lm(model, out: str | Path, eos_id: int) -> None:
    save_target(model, out, eos_id)
