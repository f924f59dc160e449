"""PyTorch backend: the reference execution of target and draft, in float32, bfloat16 or float16, on the CPU or a
CUDA GPU.

Weights, both KV caches and every forward's outputs live on `device`; inputs may come from the host (token ids,
positions, tree masks: a few hundred bytes) and are queued to the device without waiting. Three modes:
- "eager": each forward attends over exactly its rows (the CPU default, the reference);
- "static": fixed-shape forwards over a window of the preallocated cache (runtime/static.py), run eagerly: the
  code CUDA graphs capture, runnable (and tested) on the CPU;
- "graphs": static forwards captured as CUDA graphs and replayed (the CUDA default): at batch 1 a forward's
  hundreds of kernel launches cost more host time than the GPU needs to run them.
"""
from __future__ import annotations

from pathlib import Path

import torch

from eaglex.base.errors import ModelError
from eaglex.models.eagle import DraftHead, load_draft
from eaglex.models.target import DTYPES, Target, load_target

from .backend import CachedBackend, full_mask
from .batch_backend import TorchBatchBackend
from .device import to_device
from .kv_cache import TorchKVCache
from .static import CudaGraphs, WindowView, local_mask, run_static, slots_for, window_for, window_mask

MODES = ("eager", "static", "graphs")


def default_mode(device: torch.device) -> str:
    return "graphs" if torch.device(device).type == "cuda" else "eager"


class TorchBackend(CachedBackend):
    batched = TorchBatchBackend          # the same models with many slots (batch_backend.batch_backend)

    def __init__(self, target: str | Path | Target, draft: str | Path | DraftHead | None = None,
                 dtype: str = "float32", draft_kind: str | None = None, device: str | torch.device = "cpu",
                 mode: str | None = None):
        """`target`: a Hugging Face folder, or a loaded Target (its weights used as they are: on `device`, in
        `dtype`); `draft`: an EAGLE head folder or a loaded DraftHead of that target; `mode`: see the module
        docstring (default: graphs on CUDA, eager elsewhere)."""
        self.dtype = dtype
        self.device = torch.device(device)
        self.mode = mode or default_mode(self.device)
        if self.mode not in MODES:
            raise ModelError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.mode == "graphs" and self.device.type != "cuda":
            raise ModelError(f"CUDA graphs need a CUDA device, not {self.device}: use mode static or eager")
        if isinstance(target, Target):
            if target.embed_weight.dtype != DTYPES[dtype] or target.embed_weight.device.type != self.device.type:
                raise ModelError(f"the target is {target.embed_weight.dtype} on {target.embed_weight.device}, "
                                 f"not {dtype} on {self.device}")
            self.target = target
        else:
            self.target = load_target(target, DTYPES[dtype], self.device)
        self.spec = self.target.spec
        if isinstance(draft, DraftHead):
            self.draft = draft
        else:
            self.draft = load_draft(draft, self.target, draft_kind) if draft else None
        if self.draft is not None and self.device.type != "cpu":
            self.draft.to(self.device)
        self.draft_kind = self.draft.spec.kind if self.draft else None
        if self.draft is not None:
            self.target = self.target.with_features(self.draft.spec.kind, self.draft.spec.taps)
        s, torch_dtype = self.spec, DTYPES[dtype]
        self.tcache = TorchKVCache(s.num_layers, 1, s.num_kv_heads, s.head_dim, torch_dtype, self.device)
        self.dcache = None
        if self.draft is not None:
            d = self.draft.spec
            self.dcache = TorchKVCache(1, 1, d.num_kv_heads, d.head_dim, torch_dtype, self.device)
        self.graphs = CudaGraphs(self.device) if self.mode == "graphs" else None

    def reset(self, capacity: int, draft_capacity: int | None = None) -> None:
        grown = capacity > self.tcache.capacity or \
            (self.dcache is not None and (draft_capacity or capacity) > self.dcache.capacity)
        super().reset(capacity, draft_capacity)
        if grown and self.graphs is not None:       # the captured graphs point at the old buffers
            self.graphs.clear()

    @torch.inference_mode()
    def target_forward(self, rows, input_ids, position_ids, mask=None, last_only=False):
        self.check_rows(rows)
        c = self.tcache
        B, N = input_ids.shape
        out_rows = "last" if last_only else "all"
        if self.mode == "eager":
            if self.device.type != "cpu":
                input_ids, position_ids = to_device(input_ids, self.device), to_device(position_ids, self.device)
            attn = full_mask(mask, B, N, c.length, c.pending, self.device)
            return self.target(input_ids, position_ids, attn, c, out_rows)
        local = local_mask(mask, B, N, c.pending)
        window = window_for(c.length + c.pending + N, c.capacity)
        c.reserve(N)

        def forward(ids, pos, loc, length):
            view = WindowView(c.k, c.v, slots_for(length, loc.shape[2] - ids.shape[1], ids.shape[1]), window)
            return self.target(ids, pos, window_mask(loc, length, window), view, out_rows)

        out = run_static(self.graphs, self.device, ("target", B, N, local.shape[2], window, out_rows), forward,
                         (input_ids, position_ids, local, torch.tensor([c.length])))
        c.appended(N)
        return out

    @torch.inference_mode()
    def draft_forward(self, rows, hidden, input_ids, position_ids, mask, project, top_k, last_only=False):
        self.check_rows(rows)
        c, draft = self.dcache, self.draft
        B, N = input_ids.shape
        dtype = draft.fc.weight.dtype
        if self.mode == "eager":
            if self.device.type != "cpu":
                hidden, input_ids, position_ids = (to_device(t, self.device) for t in (hidden, input_ids,
                                                                                          position_ids))
            attn = full_mask(mask, B, N, c.length, c.pending, self.device)
            h = draft(hidden.to(dtype), input_ids, position_ids, attn, c, project)
            logp, ids = draft.log_probs(h[:, -1:] if last_only else h).topk(top_k, dim=-1)
            return h, logp, draft.to_target_ids(ids)
        local = local_mask(mask, B, N, c.pending)
        window = window_for(c.length + c.pending + N, c.capacity)
        c.reserve(N)

        def forward(hid, ids, pos, loc, length):
            view = WindowView(c.k, c.v, slots_for(length, loc.shape[2] - ids.shape[1], ids.shape[1]), window)
            h = draft(hid.to(dtype), ids, pos, window_mask(loc, length, window), view, project)
            logp, top = draft.log_probs(h[:, -1:] if last_only else h).topk(top_k, dim=-1)
            return h, logp, draft.to_target_ids(top)

        key = ("draft", B, N, local.shape[2], window, bool(project), top_k, bool(last_only), hidden.shape[-1],
               hidden.dtype)
        out = run_static(self.graphs, self.device, key, forward,
                         (hidden, input_ids, position_ids, local, torch.tensor([c.length])))
        c.appended(N)
        return out
