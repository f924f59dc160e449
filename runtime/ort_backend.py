"""ONNX Runtime backend: runs an engine folder written by `eaglex build` behind the Backend protocol.

Same contract as TorchBackend (runtime/backend.py): forwards append pending rows, the loop commits or rolls back,
masks cover the uncommitted rows. Inputs are wrapped as OrtValues without copies, logits and features are
ORT-allocated through IOBinding, and the graphs write their new KV rows in place into the cache's preallocated
buffers (runtime/ort_cache.py). EAGLE-3's first draft step runs draft_fc and binds its output straight into the
draft graph.

On a GPU provider (`providers`, see ort_session.choose_providers) the KV buffers and draft_fc's output live in
device memory and stay there; logits, features and the draft's top-k come back to the host, where the loop reads
them (the tensors this backend returns are always on the CPU: `device`).

An engine may carry `exactness` rules in its manifest (quantized engines: engines/quantize.py). Int8/int4 engines
compute every row independently of the call up to `row_independent_keys` keys per call (`exact_keys`); the cache
keeps every committed row at its position, as vanilla decoding does, and the generators keep trees other than
chains and batches within that bound. FP8 engines carry the older rules: `min_rows` pads every target call to that
many rows (extra rows repeat the last token one position further and are never committed), `trees` names the only
tree kind whose output stays exact (`exact_trees`, checked by the generator), `batching: false` keeps requests
apart (their `kv_holes: false` holds by construction: the cache never keeps rejected rows).

Loading validates the engine: manifest format version, every file's size (and sha256 up to 2 GiB), each graph's
engine id, and that the graphs' shapes fit the manifest and each other. Any failure is one ModelError line.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from eaglex.base.errors import ModelError

from .backend import CachedBackend
from .manifest import HASH_LIMIT, read_manifest, target_spec, verify_files
from .ort_batch import OrtBatchBackend
from .ort_cache import NP_DTYPES, OrtKVCache, kv_names
from .ort_session import open_session, outputs, provider_device, u8s8_saturates


def _ov(a: np.ndarray) -> ort.OrtValue:
    return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(a))


def _torch(v) -> torch.Tensor:
    return torch.from_numpy(v.numpy())              # zero copy; the array keeps the OrtValue alive


def _pad_rows(input_ids, position_ids, mask, pending: int, extra: int):
    """`extra` rows after the caller's: the last token again at the next positions. The caller's rows never see
    them (they come last: causal); they see everything. The loop never commits them (its indices stop before)."""
    B, n = input_ids.shape
    ids = torch.cat([input_ids, input_ids[:, -1:].expand(B, extra)], 1)
    pos = torch.cat([position_ids, position_ids[:, -1:] + torch.arange(1, extra + 1)], 1)
    if mask is not None:
        full = torch.ones(B, n + extra, pending + n + extra, dtype=torch.bool)
        full[:, :n, :pending + n] = mask
        full[:, :n, pending + n:] = False
        full[:, n:, pending + n:] = torch.tril(full[:, n:, pending + n:])
        mask = full
    return ids, pos, mask


class OrtBackend(CachedBackend):
    device = torch.device("cpu")            # where the tensors it returns live
    batched = OrtBatchBackend               # the same sessions with many slots (batch_backend.batch_backend)

    def __init__(self, engine_dir: str | Path, draft_kind: str | None = None, hash_limit: int = HASH_LIMIT,
                 providers: list | None = None):
        """`draft_kind`, if given, must match the engine's head; `providers`: ONNX Runtime execution providers
        (default: the CPU). The sessions run on the process-wide pool an entry point sized (runtime/threads.py)."""
        self.engine_dir = self.tokenizer_dir = Path(engine_dir)
        m = read_manifest(self.engine_dir)
        if m.get("backend") != "onnxruntime":
            raise ModelError(f"engine {engine_dir} was built for {m.get('backend')}, not onnxruntime")
        verify_files(self.engine_dir, m, hash_limit)
        self.manifest = m
        self.spec = target_spec(m)
        self.dtype = m["dtype"]
        self.np_dtype = NP_DTYPES[self.dtype]
        draft = m["draft"]
        self.draft_kind = draft["kind"] if draft else None
        if draft_kind is not None and draft_kind != self.draft_kind:
            raise ModelError(f"engine {engine_dir} holds {'an ' + self.draft_kind if self.draft_kind else 'no'} "
                             f"draft head, not {draft_kind}")
        self.providers = providers or ["CPUExecutionProvider"]
        if (m.get("quant") or {}).get("method") == "w8a8" and self.providers[0] == "CPUExecutionProvider" \
                and u8s8_saturates():
            warnings.warn(f"engine {engine_dir} is w8a8, and this CPU has no VNNI or AMX: ONNX Runtime's integer "
                          "GEMM saturates here, so its quality is lower than measured and its exactness untested "
                          "(run `eaglex check`); an int8 engine (--quant int8) is safe on any CPU",
                          RuntimeWarning, stacklevel=2)
        self.kv_device = provider_device(self.providers)
        open_ = {name: open_session(self.engine_dir / g["file"], m["engine_id"], name, self.providers)
                 for name, g in m["graphs"].items()}
        self.target_sess = open_["target"]
        self.draft_sess = open_.get("draft")
        self.fc_sess = open_.get("draft_fc")
        self._check_graphs()
        s = self.spec
        self.features = m["target"]["features"] != "none"
        rules = m.get("exactness") or {}
        self.min_rows = int(rules.get("min_rows", 1))
        self.exact_trees = rules.get("trees")            # None: any tree; "chain": chains only
        self.batch_exact = bool(rules.get("batching", True))
        self.exact_keys = rules.get("row_independent_keys")  # None: no bound (float engines, FP8's rules)
        self.tcache = OrtKVCache(kv_names(s.num_layers), s.num_kv_heads, s.head_dim, self.dtype, self.providers)
        self.dcache = None
        if draft:
            d = draft["spec"]
            self.dcache = OrtKVCache(kv_names(1), d["num_kv_heads"], d["head_dim"], self.dtype, self.providers)
        self._target_out = [o.name for o in self.target_sess.get_outputs() if not o.name.startswith("present_")]

    def _check_graphs(self) -> None:
        """The graphs' fixed dims against the manifest, so a mismatched draft fails here, not mid-generation."""
        m, s = self.manifest, self.spec

        def dims(sess, name, outputs=False):
            vals = sess.get_outputs() if outputs else sess.get_inputs()
            return next(v.shape for v in vals if v.name == name)

        problems = []
        if dims(self.target_sess, "logits", True)[-1] != s.vocab_size:
            problems.append(f"target logits width {dims(self.target_sess, 'logits', True)[-1]} != vocab "
                            f"{s.vocab_size}")
        if dims(self.target_sess, "past_key_0")[2] != s.num_kv_heads:            # [P+N, B, Hkv, D]
            problems.append("target KV heads differ from the manifest")
        if self.draft_sess is not None:
            d = m["draft"]["spec"]
            F = m["target"]["feature_size"]
            first = self.fc_sess if self.fc_sess is not None else self.draft_sess
            first_in = "features" if self.fc_sess is not None else "hidden"
            if dims(first, first_in)[-1] != F:
                problems.append(f"the draft reads features of width {dims(first, first_in)[-1]} but the target "
                                f"gives {F}")
            if dims(self.draft_sess, "hidden")[-1] != d["hidden_size"]:
                problems.append("draft hidden width differs from the manifest")
            if d["vocab_size"] != s.vocab_size:
                problems.append(f"the draft maps to a vocabulary of {d['vocab_size']}, the target has {s.vocab_size}")
        if problems:
            raise ModelError(f"engine {self.engine_dir}: the draft does not match the target ({'; '.join(problems)})"
                             ": rebuild it with `eaglex build --force`")

    # ------------------------------------------------------------------------------------------ Backend protocol

    def _common(self, io, cache: OrtKVCache, input_ids, position_ids, mask, rows, keep: list):
        """Binds ids, positions, the full mask and logits rows; `keep` holds the numpy buffers alive."""
        B, N = input_ids.shape
        attn = cache.attention_mask(mask, B, N)                                    # [B,1,N,T] bool
        rows = np.asarray(rows, dtype=np.int64)
        feeds = {"input_ids": input_ids.numpy().astype(np.int64, copy=False),
                 "position_ids": position_ids.numpy().astype(np.int64, copy=False),
                 "attn_mask": attn, "logits_rows": rows}
        for name, a in feeds.items():
            v = _ov(a)
            keep.append(v)
            io.bind_ortvalue_input(name, v)
        return N

    def target_forward(self, rows, input_ids, position_ids, mask=None, last_only=False):
        self.check_rows(rows)
        n = input_ids.shape[1]                   # the caller's rows; padding rows (min_rows) follow them
        if n < self.min_rows:
            input_ids, position_ids, mask = _pad_rows(input_ids, position_ids, mask, self.tcache.pending,
                                                      self.min_rows - n)
        io, keep = self.target_sess.io_binding(), []
        N = self._common(io, self.tcache, input_ids, position_ids, mask, [n - 1] if last_only else range(n), keep)
        for name in self._target_out:                 # logits (+ features): bound first, so they come out first
            io.bind_output(name)
        self.tcache.bind(io, N)
        self.target_sess.run_with_iobinding(io)
        self.tcache.appended(N)
        out = outputs(io)
        logits = _torch(out[0])
        feats = _torch(out[1])[:, :n] if self.features else torch.empty(input_ids.shape[0], n, 0)
        return logits, feats

    def draft_forward(self, rows, hidden, input_ids, position_ids, mask, project, top_k, last_only=False):
        self.check_rows(rows)
        if self.draft_sess is None:
            raise RuntimeError("this engine has no draft head")
        if not 1 <= top_k <= self.manifest["draft"]["draft_vocab_size"]:
            raise ValueError(f"top_k must be in [1, {self.manifest['draft']['draft_vocab_size']}], got {top_k}")
        h_in = _ov(hidden.detach().numpy().astype(self.np_dtype, copy=False))
        if project and self.fc_sess is not None:                   # EAGLE-3 first step: fc(3H features) -> H
            fio = self.fc_sess.io_binding()
            fio.bind_ortvalue_input("features", h_in)
            fio.bind_output("hidden", *self.kv_device)
            self.fc_sess.run_with_iobinding(fio)
            h_in = fio.get_outputs()[0]
        io, keep = self.draft_sess.io_binding(), [h_in]
        N = input_ids.shape[1]
        self._common(io, self.dcache, input_ids, position_ids, mask, [N - 1] if last_only else range(N), keep)
        io.bind_ortvalue_input("hidden", h_in)
        k = _ov(np.array(top_k, dtype=np.int64))
        keep.append(k)
        io.bind_ortvalue_input("top_k", k)
        for name in ("hidden_out", "top_logp", "top_ids"):
            io.bind_output(name)
        self.dcache.bind(io, N)
        self.draft_sess.run_with_iobinding(io)
        self.dcache.appended(N)
        out = outputs(io)
        return _torch(out[0]), _torch(out[1]), _torch(out[2])
