"""Side-by-side speed benchmark (`eaglex bench`, `make bench`): speed is reported as ratios measured in one
process, with baseline and speculative runs interleaved prompt by prompt so that the drifting load of a shared
machine hits every candidate alike, and every speculative output is checked against vanilla.

Also measures the cost model of ../shared/reference/cpu-cost-model.md on the backend at hand: t(N) of a target
forward over N new tokens after P cached ones, and a draft step, and the speedup that model predicts for the τ
actually measured, so a gap between prediction and measurement shows runtime overhead.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import time
from dataclasses import dataclass, field

import torch

from eaglex.runtime.generate import SpeculativeGenerator, VanillaGenerator
from eaglex.runtime.types import TreeConfig


@dataclass
class Row:
    engine: str
    method: str
    tree: str
    tokens: int = 0
    seconds: float = 0.0
    baseline_seconds: float = 0.0
    identical: bool = True
    accept_lengths: list[int] = field(default_factory=list)
    cycles: int = 0
    target_seconds: float = 0.0
    draft_seconds: float = 0.0
    predicted_speedup: float | None = None

    def as_dict(self) -> dict:
        tau = statistics.fmean(self.accept_lengths) if self.accept_lengths else 1.0
        hist = {str(k): self.accept_lengths.count(k) for k in sorted(set(self.accept_lengths))}
        per_cycle = lambda s: round(1e3 * s / self.cycles, 3) if self.cycles else None  # noqa: E731
        other = self.seconds - self.target_seconds - self.draft_seconds
        return {"engine": self.engine, "method": self.method, "tree": self.tree, "tokens": self.tokens,
                "tokens_per_s": round(self.tokens / self.seconds, 2) if self.seconds else None,
                "speedup": round(self.baseline_seconds / self.seconds, 3) if self.seconds else None,
                "identical_to_vanilla": self.identical, "tau": round(tau, 3), "tau_histogram": hist,
                "cycles": self.cycles, "draft_ms_per_cycle": per_cycle(self.draft_seconds),
                "verify_ms_per_cycle": per_cycle(self.target_seconds), "other_ms_per_cycle": per_cycle(other),
                "predicted_speedup": self.predicted_speedup}


def tree_label(t: TreeConfig) -> str:
    if t.kind == "chain":
        return f"chain d{t.depth}"
    if t.kind == "static":
        return "static mc_sim_7b_63"
    return f"dynamic {t.total_tokens}/{t.depth}/{t.top_k}"


def machine() -> dict:
    return {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "load_average": [round(x, 2) for x in os.getloadavg()],
            "python": platform.python_version(), "torch": torch.__version__}


def run_backend(name: str, backend, trees: list[TreeConfig], prompts: list[list[int]], max_new_tokens: int,
                method: str) -> list[Row]:
    """Vanilla and every tree on one backend, interleaved per prompt; outputs checked against vanilla."""
    vanilla = VanillaGenerator(backend)
    specs = [SpeculativeGenerator(backend, t) for t in trees]
    base = Row(name, "vanilla", "-")
    rows = [Row(name, method, tree_label(t)) for t in trees]
    vanilla.generate(prompts[0], 8)                      # warm-up: allocations, lazy inits, caches
    for s in specs:
        s.generate(prompts[0], 8)
    for p in prompts:
        v = vanilla.generate(p, max_new_tokens)
        base.tokens += len(v.output_ids)
        base.seconds += v.seconds
        base.target_seconds += v.target_seconds
        base.cycles += v.cycles
        for row, s in zip(rows, specs):
            r = s.generate(p, max_new_tokens)
            row.identical &= r.output_ids == v.output_ids
            row.tokens += len(r.output_ids)
            row.seconds += r.seconds
            row.baseline_seconds += v.seconds
            row.accept_lengths += r.accept_lengths
            row.cycles += r.cycles
            row.target_seconds += r.target_seconds
            row.draft_seconds += r.draft_seconds
    base.baseline_seconds = base.seconds
    return [base, *rows]


def run_hf_peers(target_dir, prompts: list[list[int]], max_new_tokens: int, draft_lm_dir=None,
                 reference: list[list[int]] | None = None) -> list[Row]:
    """Hugging Face transformers on the same target and prompts: plain greedy, assisted generation with a small
    draft LM, and prompt lookup. Outputs are checked against `reference` (eaglex vanilla) when given."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    eos = target.generation_config.eos_token_id
    peers = {"hf greedy": {}, "hf prompt-lookup": {"prompt_lookup_num_tokens": 10}}
    if draft_lm_dir is not None:
        peers["hf assisted"] = {"assistant_model": AutoModelForCausalLM.from_pretrained(
            draft_lm_dir, dtype=torch.float32).eval()}
    rows = {name: Row("transformers", name, "-") for name in peers}

    def run(p, kw):
        t = time.perf_counter()
        with torch.no_grad():
            out = target.generate(torch.tensor([p]), do_sample=False, max_new_tokens=max_new_tokens,
                                  pad_token_id=eos, **kw)
        return out[0, len(p):].tolist(), time.perf_counter() - t

    for kw in peers.values():
        run(prompts[0], kw)                                  # warm-up
    for i, p in enumerate(prompts):
        results = {name: run(p, kw) for name, kw in peers.items()}
        base_s = results["hf greedy"][1]
        for name, (ids, sec) in results.items():
            r = rows[name]
            r.tokens += len(ids)
            r.seconds += sec
            r.baseline_seconds += base_s
            if reference is not None:
                r.identical &= ids == reference[i]
    return list(rows.values())


def _time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def cost_model(backend, context: int = 256, sizes=(1, 2, 4, 8, 16, 32, 60, 64), top_k: int = 10,
               repeats: int = 10) -> dict:
    """Median seconds of a target forward over N new tokens after `context` cached ones, and of draft steps."""
    spec = backend.spec
    context = min(context, spec.max_context - max(sizes) - 1)
    backend.reset(context + max(sizes) + 1)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, spec.vocab_size, (1, context), generator=g)
    _, feats = backend.target_forward(prompt, torch.arange(context)[None], None, last_only=True)
    backend.target_commit(torch.arange(context))
    out = {"context": context, "target_ms": {}}
    for n in sizes:
        ids = torch.randint(0, spec.vocab_size, (1, n), generator=g)
        pos = torch.arange(context, context + n)[None]
        mask = torch.ones(n, n, dtype=torch.bool).tril()[None]

        def step():
            backend.target_forward(ids, pos, mask)
            backend.target_commit(torch.arange(0))          # commit nothing: the next call starts from `context`
        out["target_ms"][n] = round(1e3 * _time(step, repeats), 3)
    if backend.draft_kind is not None:
        backend.draft_forward(feats, prompt, torch.arange(context)[None], None, project=True, top_k=top_k,
                              last_only=True)   # token ids do not matter for timing
        backend.draft_commit(torch.arange(context))
        H = spec.hidden_size
        for n, name in ((top_k, "draft_step_ms"), (1, "draft_chain_step_ms")):
            hid = torch.randn(1, n, H, generator=g).to(feats.dtype)
            ids = torch.randint(0, spec.vocab_size, (1, n), generator=g)
            pos = torch.full((1, n), context)
            mask = torch.eye(n, dtype=torch.bool)[None]

            def dstep():
                backend.draft_forward(hid, ids, pos, mask, project=False, top_k=top_k)
                backend.draft_rollback()
            out[name] = round(1e3 * _time(dstep, repeats), 3)
        f4 = feats[:, -4:]

        def first():
            backend.draft_forward(f4, prompt[:, -4:], torch.arange(context - 4, context)[None], None, project=True,
                                  top_k=top_k, last_only=True)
            backend.draft_rollback()
        out["draft_first_ms"] = round(1e3 * _time(first, repeats), 3)
    return out


def predicted_speedup(cm: dict, tree: TreeConfig, tau: float) -> float | None:
    """S = τ·t(1) / (t(N_tree) + depth·t_draft + t_first), interpolating t(N) between measured sizes."""
    if "draft_step_ms" not in cm:
        return None
    t = {int(k): v for k, v in cm["target_ms"].items()}
    n = tree.max_nodes
    sizes = sorted(t)
    lo = max([s for s in sizes if s <= n], default=sizes[0])
    hi = min([s for s in sizes if s >= n], default=sizes[-1])
    tn = t[lo] if hi == lo else t[lo] + (t[hi] - t[lo]) * (n - lo) / (hi - lo)
    if tree.kind == "chain":
        steps, step = tree.depth, cm["draft_chain_step_ms"]
    elif tree.kind == "static":
        steps, step = 4, cm["draft_step_ms"]                # mc_sim_7b_63 expands 4 levels after the first step
    else:
        steps, step = tree.depth, cm["draft_step_ms"]
    return round(tau * t[1] / (tn + steps * step + cm["draft_first_ms"]), 3)


def print_table(rows: list[dict]) -> None:
    head = f"{'engine':<14} {'method':<8} {'tree':<20} {'tok/s':>8} {'speedup':>8} {'pred.':>6} {'tau':>5} " \
           f"{'same':>5} {'draft ms':>9} {'verify ms':>9} {'other ms':>9}"
    print(head)
    print("-" * len(head))
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    for r in rows:
        print(f"{r['engine']:<14} {r['method']:<8} {r['tree']:<20} {fmt(r['tokens_per_s'], '8.1f')} "
              f"{fmt(r['speedup'], '7.2f')}x {fmt(r.get('predicted_speedup'), '6.2f')} {r['tau']:>5.2f} "
              f"{'yes' if r['identical_to_vanilla'] else 'NO':>5} {fmt(r.get('draft_ms_per_cycle'), '9.2f')} "
              f"{fmt(r.get('verify_ms_per_cycle'), '9.2f')} {fmt(r.get('other_ms_per_cycle'), '9.2f')}")


def write_json(path, payload: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1)
    os.replace(tmp, path)
