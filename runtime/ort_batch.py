"""Batched execution of an ONNX Runtime engine for the in-flight batcher: the engine's own graphs (batch is their
leading axis, masks are per row), with per-slot KV buffers as in batch_backend.SlotCache.

The graphs take each KV tensor as a rows-first buffer [P+N, B, Hkv, D] (export/row_attention.py), P = the longest
row's committed + pending rows: row r attends over its own valid columns [0, length[r] + pending[r]) of the past
and the N new rows the graph writes at P. Each forward gathers the active past into such a buffer (one copy of it),
binds it as both the graph's input and output so that the new rows are written into it in place, then copies the
new rows into each row's own columns of the slots, where a request decoded alone would keep them.
"""
from __future__ import annotations

import numpy as np
import torch

from .batch_backend import SlotBackend, SlotCache
from .ort_session import outputs


class OrtBatchBackend(SlotBackend):
    def __init__(self, backend, slots: int, extra_rows: int = 0):
        """`backend`: an opened runtime.ort_backend.OrtBackend (its sessions are shared, not copied)."""
        self.ort = backend
        d = backend.manifest["draft"]["spec"] if backend.draft_sess is not None else None
        self._allocate(backend, slots, extra_rows, (d["num_kv_heads"], d["head_dim"]) if d is not None else None)

    def _bind(self, io, cache: SlotCache, rows: slice, input_ids, position_ids, mask, last_only) -> tuple[list, int]:
        """Binds ids, positions, masks, logits rows and the KV buffers; -> (the buffers [P+N,B,Hkv,D] per KV tensor
        and what else must outlive the run, P)."""
        B, N = input_ids.shape
        own = torch.tensor([cache.length[s] + cache.pending[s] for s in range(rows.start, rows.stop)])
        length = torch.tensor(cache.length[rows])
        P = int(own.max())
        if P + N > cache.capacity:
            raise RuntimeError(f"KV cache overflow: {P + N} rows > capacity {cache.capacity}")
        cols = torch.arange(P)
        attn = np.zeros((B, 1, N, P + N), dtype=bool)
        if mask is None:
            attn[:, 0, :, :P] = (cols < own[:, None])[:, None, :].numpy()
            attn[:, 0, :, P:] = np.tril(np.ones((N, N), dtype=bool))
        else:                                     # mask [B,N,pending+N]: the same pending count in every row
            pend = mask.shape[-1] - N
            attn[:, 0, :, :P] = (cols < length[:, None])[:, None, :].numpy()
            for b in range(B):
                attn[b, 0, :, length[b]:length[b] + pend] = mask[b, :, :pend].numpy()
            attn[:, 0, :, P:] = mask[:, :, pend:].numpy()
        feeds = {"input_ids": input_ids.numpy().astype(np.int64), "position_ids": position_ids.numpy().astype(np.int64),
                 "attn_mask": attn, "logits_rows": np.array([N - 1] if last_only else range(N), dtype=np.int64)}
        for name, a in feeds.items():
            io.bind_cpu_input(name, a)
        buffers = []
        for layer in range(cache.layers):
            for kind, kv in (("key", cache.k), ("value", cache.v)):     # kv [layers, slots, Hkv, capacity, D]
                buf = torch.empty((P + N, B, kv.shape[2], kv.shape[4]), dtype=kv.dtype)
                buf[:P] = kv[layer, rows, :, :P].permute(2, 0, 1, 3)
                a = buf.numpy()
                io.bind_input(f"past_{kind}_{layer}", "cpu", 0, a.dtype, a.shape, a.ctypes.data)
                io.bind_output(f"present_{kind}_{layer}", "cpu", 0, a.dtype, a.shape, a.ctypes.data)
                buffers.append(buf)
        return buffers + list(feeds.values()), P

    @staticmethod
    def _store(cache: SlotCache, rows: slice, buffers: list[torch.Tensor], P: int, N: int) -> None:
        """Copy the N new rows (rows P.. of each buffer) to each row's own columns."""
        cache.begin(rows, N)
        for layer in range(cache.layers):
            k, v = (buffers[2 * layer + i][P:].permute(1, 2, 0, 3) for i in (0, 1))      # [B,Hkv,N,D]
            cache.update(layer, k, v)

    def target_forward(self, rows: slice, input_ids, position_ids, mask=None, last_only=False):
        o, N = self.ort, input_ids.shape[1]
        io = o.target_sess.io_binding()
        for name in o._target_out:                   # logits (+ features), bound first so they come out first
            io.bind_output(name)
        keep, P = self._bind(io, self.tcache, rows, input_ids, position_ids, mask, last_only)
        o.target_sess.run_with_iobinding(io)
        out = outputs(io)
        logits = out[0].numpy()
        feats = out[1].numpy() if o.features else np.zeros((input_ids.shape[0], N, 0), np.float32)
        self._store(self.tcache, rows, keep, P, N)
        return torch.from_numpy(logits), torch.from_numpy(feats)

    def draft_forward(self, rows: slice, hidden, input_ids, position_ids, mask, project: bool, top_k: int,
                      last_only: bool = False):
        o, N = self.ort, input_ids.shape[1]
        h = hidden.detach().numpy().astype(o.np_dtype, copy=False)
        if project and o.fc_sess is not None:
            h = o.fc_sess.run(["hidden"], {"features": np.ascontiguousarray(h)})[0]
        io = o.draft_sess.io_binding()
        for name in ("hidden_out", "top_logp", "top_ids"):
            io.bind_output(name)
        keep, P = self._bind(io, self.dcache, rows, input_ids, position_ids, mask, last_only)
        h = np.ascontiguousarray(h)
        io.bind_cpu_input("hidden", h)
        top = np.array(top_k, dtype=np.int64)
        io.bind_cpu_input("top_k", top)
        o.draft_sess.run_with_iobinding(io)
        out = outputs(io)
        h_out, logp, ids = (out[i].numpy() for i in range(3))
        self._store(self.dcache, rows, keep, P, N)
        return torch.from_numpy(h_out), torch.from_numpy(logp), torch.from_numpy(ids)
