"""The thread policy, applied once by each entry point (the CLI, the Triton model, the benchmark per section).

Nothing else in eaglex changes thread counts: constructing a backend never does.
- ONNX Runtime engines: ORT's process-wide pool gets the cores, torch gets one thread. The decode loop's own torch
  ops (top-k, tree algebra, index tables) are tiny, and torch's idle OpenMP workers spinning between them steal time
  from ORT's pool (2-3x slower draft steps were measured on 2 cores with both pools at full size).
- PyTorch backends and transformers: torch gets the cores.
"""
from __future__ import annotations

import torch

from .ort_session import physical_cores, use_global_pool


def set_threads(threads: int | None, onnxruntime: bool) -> dict[str, int]:
    """`threads`: cores to use (None/0: the physical cores). Returns what each library got."""
    n = threads or physical_cores()
    if onnxruntime:
        got = use_global_pool(n)
        torch.set_num_threads(1)
        return {"onnxruntime": got, "torch": 1}
    torch.set_num_threads(n)
    return {"torch": n}
