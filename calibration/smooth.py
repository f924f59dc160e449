"""Per-channel activation maxima of a target's Linear layers, the statistics w8a8 engines smooth with.

An int8 activation quantized per row (export/quant_graphs.rowwise_int8) loses the small channels of a row that one
outlier channel stretches. SmoothQuant (Xiao et al. 2023) moves that range into the weights: input channel j is
divided by s_j = max|x_j|^alpha / max|w_j|^(1 - alpha) and the weight's row j multiplied by it, which changes no
float product. The maxima come from running the float target on calibration text (calibration/windows.py: chat
instructions for a chat model), never on the evaluation windows.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from .windows import load_windows

SMOOTH_SAMPLES = 32          # calibration windows of SMOOTH_SEQ_LEN tokens (~8k tokens: a few seconds on 2 cores)
SMOOTH_SEQ_LEN = 256


def activation_max(target_dir, samples: int = SMOOTH_SAMPLES, seq_len: int = SMOOTH_SEQ_LEN, data: str = "auto",
                   progress: bool = True) -> dict[str, np.ndarray]:
    """{Hugging Face module name: [in_features] max |input| over the calibration windows} for every nn.Linear of
    the Hugging Face model folder `target_dir`. `data`: calibration/windows.py's sources (text ones need the folder's
    tokenizer; a JSONL of input_ids does not)."""
    from eaglex.base.prompts import has_tokenizer, load_tokenizer

    from .fp8 import load_for_calibration
    from .memory import Placement

    target = load_for_calibration(Path(target_dir), "float32", Placement("cpu"))
    model, spec = target.hf, target.spec
    tok = load_tokenizer(Path(target_dir)) if has_tokenizer(Path(target_dir)) else None
    windows = load_windows(data, tok, spec.vocab_size, (spec.eos_ids or [None])[0], samples, seq_len, 1)
    stats: dict[str, torch.Tensor] = {}

    def hook(name):
        def record(_module, args):
            m = args[0].detach().abs().reshape(-1, args[0].shape[-1]).amax(0).float()
            stats[name] = m if name not in stats else torch.maximum(stats[name], m)
        return record
    handles = [mod.register_forward_pre_hook(hook(name)) for name, mod in model.named_modules()
               if isinstance(mod, torch.nn.Linear)]
    try:
        with torch.inference_mode():
            for ids in tqdm(windows.calibration, desc="activation ranges", unit="window", disable=not progress):
                model(torch.tensor([ids]))
    finally:
        for h in handles:
            h.remove()
    return {k: v.numpy() for k, v in stats.items()}
