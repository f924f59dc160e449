"""Head training data: the target's own continuations of training prompts (EAGLE-3 §5.1: target-regenerated
responses), so the heads learn what the target actually says, not what the corpus says.

Each record is one fixed-length sequence, prompt + continuation, and a loss mask over it. Generation does not stop
at EOS (the target simply starts a new file), so all sequences have the same length and batch without padding.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SelfDistillConfig:
    new_tokens: int = 192           # continuation length
    sampled_fraction: float = 0.25  # this share of the prompts continues by sampling, the rest greedily
    temperature: float = 0.8
    batch: int = 64
    seed: int = 0


@dataclass
class SelfDistillData:
    tokens: torch.Tensor        # [N, T] int64 prompt + continuation
    prompt_len: torch.Tensor    # [N] int64 where each continuation starts

    def loss_mask(self, on_prompt: bool) -> torch.Tensor:
        """[N, T] bool: every position, or the continuation only."""
        n, t = self.tokens.shape
        if on_prompt:
            return torch.ones(n, t, dtype=torch.bool)
        return torch.arange(t)[None, :] >= self.prompt_len[:, None]

    def token_counts(self, vocab_size: int, mask: torch.Tensor) -> torch.Tensor:
        """[V] int64 occurrences of each token id over the masked positions (for the EAGLE-3 draft vocabulary)."""
        return torch.bincount(self.tokens[mask], minlength=vocab_size)

    def save(self, path) -> None:
        torch.save({"tokens": self.tokens, "prompt_len": self.prompt_len}, path)

    @classmethod
    def load(cls, path) -> "SelfDistillData":
        d = torch.load(path, map_location="cpu", weights_only=True)
        return cls(d["tokens"], d["prompt_len"])


@torch.no_grad()
def continue_batch(hf_model, prompts: torch.Tensor, new_tokens: int, temperature: float,
                   gen: torch.Generator | None) -> torch.Tensor:
    """prompts [B, P] int64 (equal lengths) -> [B, P + new_tokens]; greedy when temperature == 0."""
    out = hf_model(input_ids=prompts, use_cache=True)
    past, seq = out.past_key_values, [prompts]
    logits = out.logits[:, -1].float()                     # [B, V]
    for i in range(new_tokens):
        if temperature > 0:
            nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen)   # [B, 1]
        else:
            nxt = logits.argmax(-1, keepdim=True)
        seq.append(nxt)
        if i + 1 < new_tokens:
            out = hf_model(input_ids=nxt, past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[:, -1].float()
    return torch.cat(seq, 1)


def generate(hf_model, prompts: list[list[int]], cfg: SelfDistillConfig) -> SelfDistillData:
    """Continue every prompt (grouped by length, `cfg.batch` at a time); the first prompts of each group are greedy,
    a `sampled_fraction` of them sampled. Sequences are cut to the shortest prompt length + new_tokens."""
    from tqdm import tqdm

    hf_model.eval()
    dev = hf_model.device
    gen = torch.Generator(device=dev).manual_seed(cfg.seed)   # sampling happens where the model runs
    n_sampled = round(len(prompts) * cfg.sampled_fraction)
    order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
    length = min(len(p) for p in prompts) + cfg.new_tokens
    tokens = torch.zeros(len(prompts), length, dtype=torch.long)
    prompt_len = torch.zeros(len(prompts), dtype=torch.long)
    jobs = []   # (indices, temperature): equal-length prompts, one sampling mode per batch
    for temp, pick in ((0.0, lambda i: i >= n_sampled), (cfg.temperature, lambda i: i < n_sampled)):
        group: list[int] = []
        for i in order:
            if not pick(i):
                continue
            if group and (len(prompts[group[0]]) != len(prompts[i]) or len(group) == cfg.batch):
                jobs.append((group, temp))
                group = []
            group.append(i)
        if group:
            jobs.append((group, temp))
    for idx, temp in tqdm(jobs, desc="self-distillation data", mininterval=5.0):
        p = torch.tensor([prompts[i] for i in idx], device=dev)
        seq = continue_batch(hf_model, p, cfg.new_tokens, temp, gen)
        start = seq.shape[1] - length                        # drop the front of longer prompts
        tokens[idx] = seq[:, start:].cpu()
        prompt_len[idx] = p.shape[1] - start
    return SelfDistillData(tokens, prompt_len)
