"""Small helpers shared by the tests."""
from __future__ import annotations

import json
from pathlib import Path


def write_prompt_file(tmp_path: Path, prompts: list[list[int]], n: int) -> Path:
    """The first `n` prompts as an `--prompts` JSONL file ({"input_ids": [...]} per line) in tmp_path."""
    f = Path(tmp_path) / "prompts.jsonl"
    f.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in prompts[:n]))
    return f


def one_slot_cache(layers: int, heads: int, dim: int, capacity: int):
    """A float32 PyTorch KV cache with one slot (what a model called directly reads and writes)."""
    import torch

    from eaglex.runtime.torch_cache import SlotCache
    return SlotCache(layers, 1, heads, dim, capacity, torch.float32)


def attend(cache, n: int, mask=None):
    """Prepare `cache`'s one slot for a forward of n rows -> its [1,1,N,T] attention mask (committed and pending rows,
    then `mask` [1,N,pending+N] over the uncommitted ones, None = causal)."""
    rows = slice(0, 1)
    starts, end = cache.begin(rows, n)
    return cache.mask(rows, starts, end, mask, n)
