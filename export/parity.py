"""Every exported graph is run in ONNX Runtime against the torch module it came from, at several (P, N).

Cases cover P = 0 (prefill into an empty cache), N = 1 (a decode step), tree masks (each new row sees the whole past,
itself and a random subset of earlier new rows), batch 2, and logits for the last row only. The error of an output
is max |ort - torch| / max |torch| (relative to the output's scale, so logits of any magnitude compare alike); the
build fails when any output of any case exceeds the tolerance of its dtype.

Two phases, so that torch's and ORT's copies of the weights never coexist: `reference_cases` runs torch and keeps
only inputs and outputs (small), the caller frees the torch model, then `compare` opens the ORT session.

Draft top-k ids are compared through log-probabilities (torch's log-prob of each id ORT picked must equal ORT's),
since near-ties may legitimately come out in another order.

The torch modules take and return [B,Hkv,P,D] KV tensors, the engine graphs rows-first buffers
(export/row_attention.py): `ort_feeds` and `torch_outputs` convert between the two, for this check and for any
caller that feeds an engine graph torch-style tensors.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from eaglex.models.target import ConcatCache

from .graphs import GraphSpec
from .onnx_export import ExportError
from .row_attention import from_buffer, to_buffer

TOLERANCE = {"float32": 1e-4, "float16": 2e-2}
# (past P, new rows N, batch B, logits for the last row only)
CASES = [(0, 1, 1, False), (0, 6, 1, True), (13, 1, 1, False), (9, 5, 2, False), (40, 12, 1, False),
         (3, 1, 2, True)]


@dataclass
class Case:
    feeds: dict[str, np.ndarray]
    ref: dict[str, np.ndarray]


@dataclass
class ParityReport:
    graph: str
    cases: int = 0
    errors: dict[str, float] = field(default_factory=dict)     # output -> worst relative error over the cases

    @property
    def worst(self) -> float:
        return max(self.errors.values(), default=0.0)

    @property
    def logits(self) -> float:
        """The headline number: logits for the target, top-k log-probs for the draft, hidden for draft_fc."""
        return self.errors.get("logits", self.errors.get("top_logp", self.worst))

    def add(self, name: str, err: float) -> None:
        self.errors[name] = max(self.errors.get(name, 0.0), err)

    def to_json(self) -> dict:
        return {"cases": self.cases, "worst": self.worst, "errors": self.errors}


def _tree_mask(g: torch.Generator, B: int, N: int, P: int) -> torch.Tensor:
    """[B,1,N,P+N] bool: all of the past, the row itself and random earlier rows (a token tree's ancestors)."""
    new = torch.rand(B, N, N, generator=g) < 0.4
    new = (new & torch.ones(N, N, dtype=torch.bool).tril(-1)) | torch.eye(N, dtype=torch.bool)
    return torch.cat([torch.ones(B, N, P, dtype=torch.bool), new], -1).unsqueeze(1)


def _inputs(spec: GraphSpec, g: torch.Generator, P: int, N: int, B: int, last: bool) -> tuple:
    """Inputs named and typed like spec.args, with the case's sizes."""
    out = []
    for name, ex in zip(spec.input_names, spec.args):
        if name == "input_ids":
            out.append(torch.randint(0, spec.vocab_size, (B, N), generator=g))
        elif name == "position_ids":                  # tree depths: non-decreasing from P
            out.append(P + torch.randint(0, N, (B, N), generator=g).sort(-1).values)
        elif name == "attn_mask":
            out.append(_tree_mask(g, B, N, P))
        elif name == "logits_rows":
            out.append(torch.tensor([N - 1]) if last else torch.arange(N))
        elif name == "top_k":
            out.append(torch.tensor(min(5, spec.top_k_max)))
        elif name.startswith("past_"):
            out.append(torch.randn(B, ex.shape[1], P, ex.shape[3], generator=g).to(ex.dtype))
        else:                                         # hidden / features [B,N,F]
            out.append(torch.randn(B, N, ex.shape[2], generator=g).to(ex.dtype))
    return tuple(out)


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy().copy()


def reference_cases(spec: GraphSpec, cases=CASES) -> list[Case]:
    """Torch outputs for every case (the draft_fc graph, a per-row projection, needs only one)."""
    g = torch.Generator().manual_seed(1234)
    out = []
    for P, N, B, last in cases if spec.name != "draft_fc" else cases[3:4]:
        args = _inputs(spec, g, P, N, B, last)
        with torch.inference_mode():
            ref = spec.module(*args)
            ref = ref if isinstance(ref, tuple) else (ref,)
            outs = {n: _np(r) for n, r in zip(spec.output_names, ref)}
            if "top_ids" in outs:                      # keep torch's log-probs over the *target* vocabulary
                outs["logp_target"] = _draft_logp_over_target(spec.module.head, dict(zip(spec.input_names, args)))
        out.append(Case({n: _np(a) for n, a in zip(spec.input_names, args)}, outs))
    return out


def _draft_logp_over_target(head, a: dict) -> np.ndarray:
    """[B,R,V] torch log-probs placed at target ids (-inf outside the draft vocabulary)."""
    cache = ConcatCache([(a["past_key_0"], a["past_value_0"])])
    h = head(a["hidden"], a["input_ids"], a["position_ids"], a["attn_mask"], cache, project=False)
    logp = head.log_probs(h.index_select(1, a["logits_rows"]))                  # [B,R,Vd]
    Vd = logp.shape[-1]
    target_ids = head.to_target_ids(torch.arange(Vd))
    full = torch.full(logp.shape[:-1] + (head.spec.vocab_size,), float("-inf"))
    full[..., target_ids] = logp
    return _np(full)


def _rel(got: np.ndarray, ref: np.ndarray) -> float:
    if ref.size == 0:
        return 0.0
    ref, got = ref.astype(np.float64), np.asarray(got).astype(np.float64)
    return float(np.abs(got - ref).max() / (np.abs(ref).max() or 1.0))


def ort_feeds(feeds: dict[str, np.ndarray], n: int) -> dict[str, np.ndarray]:
    """Feeds with the torch modules' [B,Hkv,P,D] pasts as the engine graph's rows-first buffers for `n` new rows."""
    return {k: to_buffer(v, n) if k.startswith("past_") else v for k, v in feeds.items()}


def torch_outputs(outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """An engine graph's outputs with its present buffers as the torch modules' [B,Hkv,P+N,D]."""
    return {k: from_buffer(v) if k.startswith("present_") else v for k, v in outputs.items()}


def compare(name: str, session, cases: list[Case], dtype: str, progress=None) -> ParityReport:
    """Run the cases in an ORT session; raise ExportError above the tolerance of `dtype`."""
    report = ParityReport(name)
    names = [o.name for o in session.get_outputs()]
    for case in cases:
        n = case.feeds["input_ids"].shape[1] if "input_ids" in case.feeds else 0
        got = torch_outputs(dict(zip(names, session.run(names, ort_feeds(case.feeds, n)))))
        for out in names:
            if out == "top_ids":                       # the log-prob torch gives each id ORT chose
                picked = np.take_along_axis(case.ref["logp_target"], got["top_ids"], -1)
                report.add("top_ids", _rel(got["top_logp"], picked))
            else:
                report.add(out, _rel(got[out], case.ref[out]))
        report.cases += 1
        if progress is not None:
            progress.update(1)
    tol = TOLERANCE[dtype]
    bad = {k: v for k, v in report.errors.items() if not v <= tol}      # NaN fails too
    if bad:
        worst = max(bad, key=lambda k: bad[k] if bad[k] == bad[k] else float("inf"))
        raise ExportError(f"{name}.onnx differs from PyTorch: {worst} relative error {bad[worst]:.2e} > "
                          f"{tol:.0e} ({dtype}); the export is wrong, not the model")
    return report
