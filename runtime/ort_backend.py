"""ONNX Runtime backend: runs an engine folder written by `eaglex build` behind the Backend protocol.

Same contract as TorchBackend (runtime/backend.py): forwards over a slice of slots append pending rows, the loop
commits or rolls back, masks cover the uncommitted rows. The engine's own graphs run every batch (batch is their
leading axis, masks are per row); logits and features are ORT-allocated through IOBinding, and the graphs write
their new KV rows in place into the cache's per-slot rows (runtime/ort_cache.py). Rows are bit-identical whatever
else is in the batch: MLAS GEMMs are row-invariant and the attention is row-independent, masked padding columns
included (export/row_attention.py).

On a GPU provider (`providers`, see ort_session.choose_providers) the graphs run on the device and the KV rows stay
in host memory, crossing the bus on every call; the tensors this backend returns are always on the CPU (`device`).

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
import torch

from eaglex.base.errors import ModelError

from . import kernels
from .backend import SlotBackend
from .manifest import HASH_LIMIT, read_manifest, target_spec, verify_files
from .ort_cache import NP_DTYPES, SlotRows, kv_names
from .ort_session import open_session, outputs, provider_device, u8s8_saturates


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


class OrtBackend(SlotBackend):
    device = torch.device("cpu")            # where the tensors it returns live

    def __init__(self, engine_dir: str | Path, draft_kind: str | None = None, hash_limit: int = HASH_LIMIT,
                 providers: list | None = None):
        """`draft_kind`, if given, must match the engine's head; `providers`: ONNX Runtime execution providers
        (default: the CPU). The sessions run on the process-wide pool an entry point sized (runtime/threads.py).
        One slot; with_slots() gives more over the same sessions."""
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
        if m.get("kernels"):
            kernels.require(f"engine {engine_dir} runs on eaglex's kernels")
            if m["kernels"]["version"] != kernels.VERSION:
                raise ModelError(f"engine {engine_dir} was built for version {m['kernels']['version']} of eaglex's "
                                 f"kernels, this eaglex has version {kernels.VERSION}: rebuild it with `eaglex build "
                                 "--force`")
        open_ = {name: open_session(self.engine_dir / g["file"], m["engine_id"], name, self.providers)
                 for name, g in m["graphs"].items()}
        self.target_sess = open_["target"]
        self.draft_sess = open_.get("draft")
        self.fc_sess = open_.get("draft_fc")
        self._check_graphs()
        self.features = m["target"]["features"] != "none"
        rules = m.get("exactness") or {}
        self.min_rows = int(rules.get("min_rows", 1))
        self.exact_trees = rules.get("trees")            # None: any tree; "chain": chains only
        self.batch_exact = bool(rules.get("batching", True))
        self.exact_keys = rules.get("row_independent_keys")  # None: no bound (float engines, FP8's rules)
        self._target_out = [o.name for o in self.target_sess.get_outputs() if not o.name.startswith("present_")]
        self._allocate(1, 0)

    def _caches(self, slots: int, capacity: int) -> tuple:
        s, draft = self.spec, self.manifest["draft"]
        tcache = SlotRows(kv_names(s.num_layers), slots, s.num_kv_heads, s.head_dim, capacity, self.dtype)
        d = draft["spec"] if draft else None
        dcache = SlotRows(kv_names(1), slots, d["num_kv_heads"], d["head_dim"], capacity, self.dtype) if d else None
        return tcache, dcache

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

    def _run(self, sess, io, cache: SlotRows, rows: slice, input_ids, position_ids, mask, last_only, n_out: int,
             n: int | None = None, hidden: np.ndarray | None = None):
        """Bind ids, positions, `hidden` (the draft's), the mask, the logits rows (the last of the first `n` rows, or
        all of them; default every row) and the KV rows of slots `rows`, run, place the new rows -> the first `n_out`
        outputs (bound before the call) as arrays."""
        B, N = input_ids.shape
        own = cache.own(rows)
        P = max(own)
        if P + N > cache.capacity:
            raise RuntimeError(f"KV cache overflow: {P + N} rows > capacity {cache.capacity}")
        dummies = cache.fit(rows)
        if dummies is None:
            view = cache._empty(P + N, B)
            view[:, :P] = cache.kv[:, :P, rows]
        else:
            view = cache.kv
        attn = cache.mask(rows, own, P, N, mask, dummies or 0)
        if dummies:                         # empty slots after `rows`, run in place with them: token 0 at position 0
            input_ids = torch.cat([input_ids, input_ids.new_zeros(dummies, N)])
            position_ids = torch.cat([position_ids, position_ids.new_zeros(dummies, N)])
            if hidden is not None:
                hidden = np.concatenate([hidden, np.zeros((dummies, *hidden.shape[1:]), hidden.dtype)])
            rows, own = slice(rows.start, rows.stop + dummies), own + [0] * dummies
        feeds = {"input_ids": input_ids.numpy().astype(np.int64), "position_ids": position_ids.numpy().astype(np.int64),
                 "attn_mask": attn,
                 "logits_rows": np.array([(n or N) - 1] if last_only else range(n or N), dtype=np.int64)}
        if hidden is not None:
            feeds["hidden"] = np.ascontiguousarray(hidden)
        for name, a in feeds.items():
            io.bind_cpu_input(name, a)
        cache.bind(io, view, P + N)
        sess.run_with_iobinding(io)
        values = outputs(io)
        out = [values[i].numpy()[:B] for i in range(n_out)]
        cache.place(rows, view, own, P, N)
        if dummies:
            cache.rollback(slice(rows.stop - dummies, rows.stop))
        return out

    def target_forward(self, rows: slice, input_ids, position_ids, mask=None, last_only=False):
        n = input_ids.shape[1]                   # the caller's rows; padding rows (min_rows) follow them
        if n < self.min_rows:
            input_ids, position_ids, mask = _pad_rows(input_ids, position_ids, mask, self.tcache.pending[rows.start],
                                                      self.min_rows - n)
        io = self.target_sess.io_binding()
        for name in self._target_out:            # logits (+ features), bound first so they come out first
            io.bind_output(name)
        out = self._run(self.target_sess, io, self.tcache, rows, input_ids, position_ids, mask, last_only,
                        len(self._target_out), n)
        feats = out[1][:, :n] if self.features else np.zeros((input_ids.shape[0], n, 0), np.float32)
        return torch.from_numpy(out[0]), torch.from_numpy(feats)

    def draft_forward(self, rows: slice, hidden, input_ids, position_ids, mask, project: bool, top_k: int,
                      last_only: bool = False):
        if self.draft_sess is None:
            raise RuntimeError("this engine has no draft head")
        if not 1 <= top_k <= self.manifest["draft"]["draft_vocab_size"]:
            raise ValueError(f"top_k must be in [1, {self.manifest['draft']['draft_vocab_size']}], got {top_k}")
        h = hidden.detach().numpy().astype(self.np_dtype, copy=False)
        if project and self.fc_sess is not None:                   # EAGLE-3 first step: fc(3H features) -> H
            h = self.fc_sess.run(["hidden"], {"features": np.ascontiguousarray(h)})[0]
        io = self.draft_sess.io_binding()
        for name in ("hidden_out", "top_logp", "top_ids"):
            io.bind_output(name)
        top = np.array(top_k, dtype=np.int64)
        io.bind_cpu_input("top_k", top)
        h_out, logp, ids = self._run(self.draft_sess, io, self.dcache, rows, input_ids, position_ids, mask,
                                     last_only, 3, hidden=h)
        return torch.from_numpy(h_out), torch.from_numpy(logp), torch.from_numpy(ids)
