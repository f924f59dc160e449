"""The embedded target: a small LlamaForCausalLM trained from scratch on the corpus token stream.

At least 7 layers, so that the EAGLE-3 feature layers {2, L//2, L-3} are distinct; GQA like LLaMA-3. Saved with
`save_pretrained` (float16 safetensors: half the bytes, and float32 runs load it exactly) plus a generation config
naming the EOS token, and the tokenizer files in the same folder.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .loop import OptimConfig, digest, seed_everything, step_generator, train
from .tokens import sample_windows


@dataclass(frozen=True)
class TargetConfig:
    hidden_size: int = 256
    num_layers: int = 8
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 768
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    seq_len: int = 256
    batch: int = 16
    seed: int = 0
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(steps=300, lr=2e-3, warmup=30,
                                                                  weight_decay=0.1, grad_clip=1.0))


def build_model(cfg: TargetConfig, vocab_size: int, eos_id: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    if cfg.num_layers < 7:
        raise ValueError("the target needs >= 7 layers: EAGLE-3 reads layers 2, L//2 and L-3, which must differ")
    hf_cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                         num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                         num_key_value_heads=cfg.num_kv_heads, max_position_embeddings=cfg.max_position_embeddings,
                         rope_theta=cfg.rope_theta, rms_norm_eps=1e-5, tie_word_embeddings=False,
                         bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id)
    hf_cfg._attn_implementation = "sdpa"
    torch.manual_seed(cfg.seed)
    return LlamaForCausalLM(hf_cfg)


TRAIN_ATTENTION = "eaglex_sdpa_float32"


def _sdpa_float32(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention, run in float32 inside the trainer's bfloat16 autocast: at this size (head_dim
    40, 256 tokens) the CPU flash kernel is faster in float32 than in bfloat16 (a target step ~15 % faster on two
    cores, mostly in the backward), and more precise."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    with torch.autocast("cpu", enabled=False):
        return sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask, **kwargs)


def train_target(cfg: TargetConfig, stream: torch.Tensor, vocab_size: int, eos_id: int,
                 checkpoint: Path | None = None, threads: int | None = None):
    """Train on random windows of `stream` [N] int64; returns (model, per-step losses)."""
    from transformers import AttentionInterface

    AttentionInterface.register(TRAIN_ATTENTION, _sdpa_float32)
    seed_everything(cfg.seed, threads)
    model = build_model(cfg, vocab_size, eos_id)

    def loss_fn(step: int):
        x = sample_windows(stream, cfg.batch, cfg.seq_len, step_generator(cfg.seed, step))   # [B,T]
        return model(input_ids=x, labels=x).loss, {}

    inference_attention = model.config._attn_implementation
    model.config._attn_implementation = TRAIN_ATTENTION
    try:
        losses = train(model, loss_fn, cfg.optim, checkpoint, "target",
                       {"config": asdict(cfg), "data": digest(stream), "vocab": vocab_size,
                        "attention": TRAIN_ATTENTION})
    finally:
        model.config._attn_implementation = inference_attention   # what the saved model and later forwards use
    return model, losses


@torch.no_grad()
def eval_loss(model, stream: torch.Tensor, seq_len: int, max_windows: int = 64) -> float:
    """Mean next-token loss over consecutive windows of a (held-out) stream."""
    n = min(max_windows, (stream.shape[0] - 1) // seq_len)
    x = stream[:n * seq_len].view(n, seq_len)
    total = 0.0
    for i in range(0, n, 16):
        total += float(model(input_ids=x[i:i + 16], labels=x[i:i + 16]).loss) * x[i:i + 16].shape[0]
    return total / n


def save_target(model, out: str | Path, eos_id: int) -> None:
    """save_pretrained in float16 + generation_config.json (eos). The tokenizer is saved next to it separately."""
    import copy

    from transformers import GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = model.state_dict()
    big = max(float(t.abs().max()) for t in state.values())
    if big > 6e4:
        raise ValueError(f"a target weight ({big:.3g}) does not fit float16")
    copy.deepcopy(model).to(torch.float16).save_pretrained(str(out), safe_serialization=True)
    GenerationConfig(bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id,
                     do_sample=False).save_pretrained(str(out))
