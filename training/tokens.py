"""Token data: the corpus as one token stream, fixed-length windows drawn from it, prompts cut at line starts, and
JSONL prompt files.

Every sampler takes a torch.Generator, so the batches of a step depend on (seed, step) only (loop.step_generator).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .corpus import SourceFile


def encode_files(files: list[SourceFile], tokenizer, eos_id: int) -> torch.Tensor:
    """[N] int64: each file's tokens followed by EOS, files in order."""
    out: list[int] = []
    for f, enc in zip(files, tokenizer.encode_batch([f.text for f in files])):
        out.extend(enc.ids)
        out.append(eos_id)
    return torch.tensor(out, dtype=torch.long)


def sample_windows(stream: torch.Tensor, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """[batch, length] int64 windows at uniform random offsets of the stream."""
    starts = torch.randint(0, stream.shape[0] - length, (batch,), generator=gen)
    return torch.stack([stream[s:s + length] for s in starts.tolist()])


def line_start_prompts(files: list[SourceFile], tokenizer, count: int, length: int, gen: torch.Generator,
                       min_lines: int = 4) -> list[list[int]]:
    """`count` prompts of exactly `length` tokens, each starting at the beginning of a source line.

    Files are drawn uniformly (with replacement), then a line; a prompt too short at that spot is redrawn.
    """
    encoded, starts = [], []   # per file: its tokens, and the token indices where a source line begins
    for f, enc in zip(files, tokenizer.encode_batch([f.text for f in files])):
        encoded.append(enc.ids)
        offs = [i for i, (a, _) in enumerate(enc.offsets) if a == 0 or f.text[a - 1] == "\n"]
        starts.append(offs[min_lines:] if len(offs) > min_lines else offs)
    prompts: list[list[int]] = []
    tries = 0
    while len(prompts) < count:
        tries += 1
        if tries > 100 * count:
            raise ValueError(f"could not cut {count} prompts of {length} tokens from {len(files)} files")
        i = int(torch.randint(len(files), (1,), generator=gen))
        if not starts[i]:
            continue
        s = starts[i][int(torch.randint(len(starts[i]), (1,), generator=gen))]
        if s + length <= len(encoded[i]):
            prompts.append(encoded[i][s:s + length])
    return prompts


def write_jsonl_prompts(path: str | Path, prompts: list[list[int]], tokenizer=None) -> None:
    """One {"input_ids": [...]} line per prompt, with its text under "prompt" when a tokenizer is given (readers
    take input_ids first: re-encoding the text need not give the same ids)."""
    with open(path, "w") as f:
        for ids in prompts:
            rec = {"prompt": tokenizer.decode(ids)} if tokenizer is not None else {}
            rec["input_ids"] = list(ids)
            f.write(json.dumps(rec) + "\n")
