"""Batched execution of an ONNX Runtime engine for the in-flight batcher: the engine's own graphs (batch is their
leading axis, masks are per row), with per-slot KV buffers as in batch_backend.SlotCache.

The graphs append a forward's N new rows after the past they are given ([B,Hkv,P,D], P = the longest row's
committed + pending rows), so row r attends over its own valid columns [0, length[r] + pending[r]) of the past and
the N new columns at P; after the run the new rows are copied from present_* into each row's own columns, where a
request decoded alone would keep them. Costs one copy of the active past per forward (the graph's Concat copies it
once more); a per-row-append graph would avoid it.
"""
from __future__ import annotations

import numpy as np
import torch

from .batch_backend import SlotBackend, SlotCache


class OrtBatchBackend(SlotBackend):
    def __init__(self, backend, slots: int, extra_rows: int = 0):
        """`backend`: an opened runtime.ort_backend.OrtBackend (its sessions are shared, not copied)."""
        self.ort = backend
        d = backend.manifest["draft"]["spec"] if backend.draft_sess is not None else None
        self._allocate(backend, slots, extra_rows, (d["num_kv_heads"], d["head_dim"]) if d is not None else None)

    def _feeds(self, cache: SlotCache, rows: slice, input_ids, position_ids, mask, last_only) -> tuple[dict, int]:
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
        for layer in range(cache.layers):
            feeds[f"past_key_{layer}"] = np.ascontiguousarray(cache.k[layer, rows, :, :P].numpy())
            feeds[f"past_value_{layer}"] = np.ascontiguousarray(cache.v[layer, rows, :, :P].numpy())
        return feeds, P

    @staticmethod
    def _store(cache: SlotCache, rows: slice, presents: list[np.ndarray], P: int, N: int) -> None:
        """Copy the N new rows (columns P.. of present_*) to each row's own columns."""
        cache.begin(rows, N)
        for layer in range(cache.layers):
            cache.update(layer, torch.from_numpy(presents[2 * layer][:, :, P:]),
                         torch.from_numpy(presents[2 * layer + 1][:, :, P:]))

    def target_forward(self, rows: slice, input_ids, position_ids, mask=None, last_only=False):
        sess, N = self.ort.target_sess, input_ids.shape[1]
        feeds, P = self._feeds(self.tcache, rows, input_ids, position_ids, mask, last_only)
        out = sess.run(self.ort._target_out, feeds)
        if self.ort.features:
            logits, feats, presents = out[0], out[1], out[2:]
        else:
            logits, feats, presents = out[0], np.zeros((input_ids.shape[0], N, 0), np.float32), out[1:]
        self._store(self.tcache, rows, presents, P, N)
        return torch.from_numpy(logits), torch.from_numpy(feats)

    def draft_forward(self, rows: slice, hidden, input_ids, position_ids, mask, project: bool, top_k: int,
                      last_only: bool = False):
        o, N = self.ort, input_ids.shape[1]
        h = hidden.detach().numpy().astype(o.np_dtype, copy=False)
        if project and o.fc_sess is not None:
            h = o.fc_sess.run(["hidden"], {"features": np.ascontiguousarray(h)})[0]
        feeds, P = self._feeds(self.dcache, rows, input_ids, position_ids, mask, last_only)
        feeds["hidden"], feeds["top_k"] = np.ascontiguousarray(h), np.array(top_k, dtype=np.int64)
        h_out, logp, ids, pk, pv = o.draft_sess.run(
            ["hidden_out", "top_logp", "top_ids", "present_key_0", "present_value_0"], feeds)
        self._store(self.dcache, rows, [pk, pv], P, N)
        return torch.from_numpy(h_out), torch.from_numpy(logp), torch.from_numpy(ids)
