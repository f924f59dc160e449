"""Fixed-shape forwards over the preallocated KV cache: the form CUDA graphs capture.

A graph replays fixed kernels on fixed buffers, so nothing of a captured forward may depend on Python values that
change between calls. In "static" mode (runtime/torch_backend.py) a forward of N rows therefore
- writes its keys and values at slots `length + pending + arange(N)` computed on the device (index_copy_), and
- attends over a fixed *window* of the cache, the first `window` rows (a power of two >= 256, capped at the
  capacity), with a mask built on the device from `length` and the mask over the uncommitted rows;
so one captured graph serves every call with the same (N, mask width, window), whatever the committed length.
Rows of the window past the forward's own rows are masked, which adds exact zeros to the attention sums.

The same functions run eagerly on any device ("static" mode without graphs), so the CPU tests run the code a GPU
captures. `CudaGraphs` captures a function the second time it is called with a given key (one-off shapes such as a
prefill never are) and replays it afterwards.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from eaglex.models.target import causal_mask

from .device import to_device

MIN_WINDOW = 256
MAX_GRAPHS = 256         # graphs kept; the least recently replayed one goes first (each holds its own activations)


def window_for(end: int, capacity: int) -> int:
    """The attention window of a forward whose rows end at `end`: a power of two >= MIN_WINDOW, <= capacity."""
    w = MIN_WINDOW
    while w < end:
        w *= 2
    return min(w, capacity)


def window_mask(local: torch.Tensor, length: torch.Tensor, window: int) -> torch.Tensor:
    """[B,1,N,window] bool attention mask: each row's `length` committed rows, then `local` [B,N,W] (True = attend)
    over the W uncommitted rows (pending, then the N new ones) that follow them; the rest of the window is hidden.
    `length` is a [B] (or [1]: every row) int64 tensor on the mask's device, so that a graph can take it as an
    input."""
    B, N, W = local.shape
    cols = torch.arange(window, device=local.device)
    rel = cols - length[:, None]                                          # [B,window] column relative to `length`
    inside = (rel >= 0) & (rel < W)
    picked = local.gather(2, rel.clamp(0, W - 1)[:, None, :].expand(B, N, window))   # [B,N,window]
    return ((picked & inside[:, None]) | (cols < length[:, None])[:, None]).unsqueeze(1)


def local_mask(mask: torch.Tensor | None, batch: int, n: int, pending: int) -> torch.Tensor:
    """[B,N,pending+N] bool mask over the uncommitted rows (None = every pending row, then causal)."""
    if mask is not None:
        return mask
    return causal_mask(n, pending, batch)[:, 0]


class WindowView:
    """models.target.LayerCache over preallocated [layers, B, Hkv, capacity, D] buffers for one static forward: new
    rows go to `slots` (device int64: [N], the same rows of every batch row, or [B,N], each row its own), attention
    reads the first `window` rows of every layer. Holds no counters (a graph replays it)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, window: int):
        self.k, self.v, self.slots, self.window = k, v, slots, window

    def update(self, layer, k, v):
        if self.slots.dim() == 1:
            self.k[layer].index_copy_(2, self.slots, k)
            self.v[layer].index_copy_(2, self.slots, v)
        else:                                # [B,Hkv,C,D] viewed as [B,C,Hkv,D]: each row's N keys at its columns
            b = torch.arange(k.shape[0], device=k.device)[:, None]
            self.k[layer].permute(0, 2, 1, 3)[b, self.slots] = k.transpose(1, 2)
            self.v[layer].permute(0, 2, 1, 3)[b, self.slots] = v.transpose(1, 2)
        return self.k[layer, :, :, :self.window], self.v[layer, :, :, :self.window]


def slots_for(length: torch.Tensor, pending: int, n: int) -> torch.Tensor:
    """Cache rows of a forward's new rows: length + pending + arange(N), on `length`'s device; [N] for a [1]
    length, [B,N] for a [B] one (each row after its own committed rows)."""
    new = pending + torch.arange(n, device=length.device)
    return length + new if length.shape[0] == 1 else length[:, None] + new


def run_static(graphs: CudaGraphs | None, device: torch.device, key: tuple, fn, inputs: tuple[torch.Tensor, ...]):
    """fn(*inputs) on `device`: replayed from a CUDA graph captured per key when `graphs`, else eagerly."""
    if graphs is not None:
        return graphs.run(key, fn, inputs)
    return fn(*(to_device(x, device) for x in inputs))


@dataclass
class _Graph:
    graph: object                        # torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor, ...]     # static input buffers: copy new inputs in, then replay
    outputs: tuple[torch.Tensor, ...]    # static outputs, overwritten by every replay


class CudaGraphs:
    """Captured forwards by key. `run(key, fn, inputs)` calls fn(*inputs) -> tuple of tensors: eagerly the first
    time a key is seen, captured the second time, replayed from then on; at most `max_graphs` are kept, the least
    recently replayed dropped first (tuning tries many tree shapes, then one runs). Outputs are returned as fresh
    tensors (clones), so that a later replay of the same graph never changes what a caller holds."""

    def __init__(self, device: torch.device, max_graphs: int = MAX_GRAPHS):
        self.device, self.max_graphs = device, max_graphs
        self.graphs: dict[tuple, _Graph] = {}
        self.seen: set[tuple] = set()
        self.failed: dict[tuple, str] = {}   # keys whose capture failed (they run eagerly), with the reason

    def clear(self) -> None:
        """Forget every graph (their buffers are stale once the caches they captured are reallocated)."""
        self.graphs.clear()
        self.seen.clear()

    def run(self, key: tuple, fn: Callable[..., tuple], inputs: tuple[torch.Tensor, ...]) -> tuple:
        g = self.graphs.get(key)
        if g is None:
            inputs = tuple(x.to(self.device, non_blocking=True) for x in inputs)
            if key not in self.seen or key in self.failed:
                self.seen.add(key)
                return fn(*inputs)
            while len(self.graphs) >= self.max_graphs:
                del self.graphs[next(iter(self.graphs))]
            g = self._capture(key, fn, inputs)
            if g is None:
                return fn(*inputs)
        else:
            self.graphs[key] = self.graphs.pop(key)          # most recently used last
        for buf, x in zip(g.inputs, inputs):     # host inputs are queued without waiting (staged by the driver)
            buf.copy_(x, non_blocking=True)
        g.graph.replay()
        return tuple(o.clone() for o in g.outputs)

    def _capture(self, key, fn, inputs) -> _Graph | None:
        static = tuple(x.clone() for x in inputs)
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                fn(*static)                                  # warm-up on a side stream, as capture requires
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outputs = fn(*static)
        except RuntimeError as e:                            # an op that cannot be captured: stay eager for this key
            self.failed[key] = (str(e).splitlines() or [""])[0][:200]
            torch.cuda.synchronize(self.device)
            return None
        g = self.graphs[key] = _Graph(graph, static, tuple(outputs))
        return g
