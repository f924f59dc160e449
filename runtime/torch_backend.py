"""PyTorch backend: the reference execution of target and draft, in float32, bfloat16 or float16."""
from __future__ import annotations

from pathlib import Path

import torch

from eaglex.models.eagle import load_draft
from eaglex.models.target import DTYPES, load_target

from .backend import CachedBackend, full_mask
from .kv_cache import TorchKVCache


class TorchBackend(CachedBackend):
    def __init__(self, target_dir: str | Path, draft_dir: str | Path | None = None, dtype: str = "float32",
                 draft_kind: str | None = None):
        self.dtype = dtype
        self.target = load_target(target_dir, DTYPES[dtype])
        self.spec = self.target.spec
        self.draft = load_draft(draft_dir, self.target, draft_kind) if draft_dir else None
        self.draft_kind = self.draft.spec.kind if self.draft else None
        if self.draft is not None:
            self.target = self.target.with_features(self.draft.spec.kind, self.draft.spec.taps)
        s, torch_dtype = self.spec, DTYPES[dtype]
        self.tcache = TorchKVCache(s.num_layers, 1, s.num_kv_heads, s.head_dim, torch_dtype)
        self.dcache = None
        if self.draft is not None:
            d = self.draft.spec
            self.dcache = TorchKVCache(1, 1, d.num_kv_heads, d.head_dim, torch_dtype)

    @torch.inference_mode()
    def target_forward(self, input_ids, position_ids, mask, last_only=False):
        c = self.tcache
        B, N = input_ids.shape
        attn = full_mask(mask, B, N, c.length, c.pending)
        return self.target(input_ids, position_ids, attn, c, "last" if last_only else "all")

    @torch.inference_mode()
    def draft_forward(self, hidden, input_ids, position_ids, mask, project, top_k, last_only=False):
        c = self.dcache
        B, N = input_ids.shape
        attn = full_mask(mask, B, N, c.length, c.pending)
        h = self.draft(hidden.to(self.draft.fc.weight.dtype), input_ids, position_ids, attn, c, project)
        logp, ids = self.draft.log_probs(h[:, -1:] if last_only else h).topk(top_k, dim=-1)
        return h, logp, self.draft.to_target_ids(ids)
