"""PyTorch backend: the reference execution of target and draft, in float32, bfloat16 or float16, on the CPU or a
CUDA GPU.

Weights, both KV caches (runtime/torch_cache.py, one slot per request) and every forward's outputs live on `device`;
inputs may come from the host (token ids, positions, tree masks: a few hundred bytes) and are queued to the device
without waiting. Three modes:
- "eager": each forward attends over exactly its rows' columns (the CPU default, the reference);
- "static": fixed-shape forwards over a window of the preallocated cache (runtime/static.py), run eagerly: the
  code CUDA graphs capture, runnable (and tested) on the CPU;
- "graphs": static forwards captured as CUDA graphs and replayed (the CUDA default): at batch 1 a forward's
  hundreds of kernel launches cost more host time than the GPU needs to run them.
Static forwards take every row's committed length as a device input, so one shape serves a batch size whatever the
rows' lengths, and "graphs" captures them per batch size (and forward width, window, rows).

Numerics (fp32, measured on the embedded default model): a row's logits inside a batched forward are not
bit-identical to the same row decoded alone: CPU GEMMs pick kernels by the number of rows M (M = 1, 2-6 and >= 7
give three different roundings of the same row). The differences are ~1e-5 on logits of magnitude ~10, the same
order as between a speculative tree verification and a one-token decode of the same request, which the
single-request path already accepts: greedy output is equal unless two logits tie within that (ONNX Runtime
engines give bit-identical rows: runtime/ort_backend.py). tests/test_batch.py measures both and checks the outputs.
"""
from __future__ import annotations

from pathlib import Path

import torch

from eaglex.base.errors import ModelError
from eaglex.models.eagle import DraftHead, load_draft
from eaglex.models.target import DTYPES, Target, load_target

from .backend import SlotBackend
from .device import to_device
from .static import CudaGraphs, WindowView, local_mask, run_static, slots_for, window_for, window_mask
from .torch_cache import SlotCache

MODES = ("eager", "static", "graphs")


def default_mode(device: torch.device) -> str:
    return "graphs" if torch.device(device).type == "cuda" else "eager"


class TorchBackend(SlotBackend):
    def __init__(self, target: str | Path | Target, draft: str | Path | DraftHead | None = None,
                 dtype: str = "float32", draft_kind: str | None = None, device: str | torch.device = "cpu",
                 mode: str | None = None):
        """`target`: a Hugging Face folder, or a loaded Target (its weights used as they are: on `device`, in
        `dtype`); `draft`: an EAGLE head folder or a loaded DraftHead of that target; `mode`: see the module
        docstring (default: graphs on CUDA, eager elsewhere). One slot; with_slots() gives more."""
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
        self._allocate(1, 0)

    def _caches(self, slots: int, capacity: int) -> tuple:
        s, dt = self.spec, DTYPES[self.dtype]
        self.graphs = CudaGraphs(self.device) if self.mode == "graphs" else None    # they point at the buffers
        tcache = SlotCache(s.num_layers, slots, s.num_kv_heads, s.head_dim, capacity, dt, self.device)
        d = self.draft.spec if self.draft is not None else None
        dcache = SlotCache(1, slots, d.num_kv_heads, d.head_dim, capacity, dt, self.device) if d else None
        return tcache, dcache

    def reset(self, capacity: int, draft_capacity: int | None = None) -> bool:
        grown = super().reset(capacity, draft_capacity)
        if grown and self.graphs is not None:       # the captured graphs point at the old buffers
            self.graphs.clear()
        return grown

    @torch.inference_mode()
    def target_forward(self, rows: slice, input_ids, position_ids, mask=None, last_only=False):
        c, (B, N) = self.tcache, input_ids.shape
        out_rows = "last" if last_only else "all"
        if self.mode == "eager":
            starts, end = c.begin(rows, N)
            attn = c.mask(rows, starts, end, mask, N)
            return self.target(to_device(input_ids, self.device), to_device(position_ids, self.device), attn, c,
                               out_rows)
        pending = c.uniform_pending(rows, N)
        local = local_mask(mask, B, N, pending)
        window = window_for(max(c.length[rows]) + pending + N, c.capacity)
        k, v = c.k[:, rows], c.v[:, rows]

        def forward(ids, pos, loc, length):
            view = WindowView(k, v, slots_for(length, pending, N), window)
            return self.target(ids, pos, window_mask(loc, length, window), view, out_rows)

        out = run_static(self.graphs, self.device, ("target", rows.start, B, N, local.shape[2], window, out_rows),
                         forward, (input_ids, position_ids, local, torch.tensor(c.length[rows])))
        c.appended(rows, N)
        return out

    @torch.inference_mode()
    def draft_forward(self, rows: slice, hidden, input_ids, position_ids, mask, project: bool, top_k: int,
                      last_only: bool = False):
        c, draft, (B, N) = self.dcache, self.draft, input_ids.shape
        dtype = draft.fc.weight.dtype
        if self.mode == "eager":
            starts, end = c.begin(rows, N)
            attn = c.mask(rows, starts, end, mask, N)
            h = draft(to_device(hidden, self.device).to(dtype), to_device(input_ids, self.device),
                      to_device(position_ids, self.device), attn, c, project)
            logp, ids = draft.log_probs(h[:, -1:] if last_only else h).topk(top_k, dim=-1)
            return h, logp, draft.to_target_ids(ids)
        pending = c.uniform_pending(rows, N)
        local = local_mask(mask, B, N, pending)
        window = window_for(max(c.length[rows]) + pending + N, c.capacity)
        k, v = c.k[:, rows], c.v[:, rows]

        def forward(hid, ids, pos, loc, length):
            view = WindowView(k, v, slots_for(length, pending, N), window)
            h = draft(hid.to(dtype), ids, pos, window_mask(loc, length, window), view, project)
            logp, top = draft.log_probs(h[:, -1:] if last_only else h).topk(top_k, dim=-1)
            return h, logp, draft.to_target_ids(top)

        key = ("draft", rows.start, B, N, local.shape[2], window, bool(project), top_k, bool(last_only),
               hidden.shape[-1], hidden.dtype)
        out = run_static(self.graphs, self.device, key, forward,
                         (hidden, input_ids, position_ids, local, torch.tensor(c.length[rows])))
        c.appended(rows, N)
        return out
