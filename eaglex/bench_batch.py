"""The batched rows of `eaglex bench --batch-sizes 1,4,16`: what `eaglex generate --batch B` delivers, beside what
batch tuning measured for the same engine.

At each B every prompt is decoded through Engine.generate(batch=B), the path `generate --batch` and the server
run (B requests in flight, a finished one replaced by the next prompt), twice: vanilla batching, and the engine's
batch schedule (its own tree for a request alone). At B = 1 that is one request at a time. The runs are timed end to
end (prefills included), interleaved in a seeded order over `rounds` passes, and every output is compared with the
one-at-a-time vanilla output. Each row carries the tuning's own figures for the same B (manifest tuning.batch), so
a gap between the product and the measurement that chose the schedule shows in the table.
"""
from __future__ import annotations

import random
import time
from dataclasses import replace

from eaglex.runtime.autotune import BATCH_TOKENS


def _vanilla(engine):
    return replace(engine, method="vanilla", tree=None, kept_tree=None)


def run_batched(name: str, engine, prompts: list[list[int]], sizes: tuple[int, ...], max_new_tokens: int,
                rounds: int = 1) -> list[dict]:
    """One row per B in `sizes` (see the module docstring) for `engine` (an opened Engine with a head)."""
    spec, plain = engine.speculative(), _vanilla(engine)
    want = [r.output_ids for r in plain.generate(prompts, max_new_tokens=max_new_tokens)]
    schedule = spec.batch_schedule().alone(spec.tree)
    runs = {(b, kind): {"tokens": 0, "seconds": 0.0, "same": 0, "lengths": []}
            for b in sizes for kind in ("vanilla", "schedule")}
    for e in (plain, spec):                              # warm-up: each batch shape allocates on its first call
        e.generate(prompts[:max(sizes)], max_new_tokens=4, batch=max(sizes))
    order = random.Random(0)
    for _ in range(rounds):
        keys = list(runs)
        order.shuffle(keys)
        for b, kind in keys:
            t = time.perf_counter()
            got = (plain if kind == "vanilla" else spec).generate(prompts, max_new_tokens=max_new_tokens, batch=b)
            run = runs[(b, kind)]
            run["seconds"] += time.perf_counter() - t
            run["tokens"] += sum(len(r.output_ids) for r in got)
            run["same"] += sum(r.output_ids == w for r, w in zip(got, want))
            run["lengths"] += [n for r in got for n in r.accept_lengths]
    tuning = ((engine.manifest or {}).get("tuning") or {}).get("batch") or {}
    rate = lambda run: round(run["tokens"] / run["seconds"], 2) if run["seconds"] else None  # noqa: E731
    one = rate(runs[(sizes[0], "schedule")]) if sizes[0] == 1 else None
    rows = []
    for b in sizes:
        v, s = runs[(b, "vanilla")], runs[(b, "schedule")]
        tree = schedule.tree(b)
        measured = tuning.get(str(b), {})
        rows.append({
            "engine": name, "requests": b, "schedule": str(schedule), "tree": str(tree or "vanilla"),
            "vanilla_tokens_per_s": rate(v), "schedule_tokens_per_s": rate(s),
            "schedule_over_vanilla": round(rate(s) / rate(v), 3) if rate(v) and rate(s) else None,
            "over_one_at_a_time": round(rate(s) / one, 3) if one and rate(s) else None,
            "tau": round(sum(s["lengths"]) / len(s["lengths"]), 3) if s["lengths"] else 1.0,
            "identical": f"{s['same'] + v['same']}/{2 * rounds * len(prompts)}",
            "tuning_tokens_per_s": {k: measured[k] for k in ("vanilla", str(tree or "vanilla")) if k in measured},
        })
    return rows


def print_batched(rows: list[dict], prompts: int, max_new_tokens: int) -> None:
    if not rows:
        return
    print(f"\nin-flight batching: every prompt through generate --batch B ({prompts} prompts x {max_new_tokens} "
          f"tokens, end to end, interleaved); tuning: what batch tuning measured at B ({BATCH_TOKENS}-token requests)")
    head = (f"{'engine':<22} {'B':>3} {'tree at B':<16} {'vanilla':>8} {'schedule':>9} {'sched/van':>9} "
            f"{'vs B=1':>7} {'tau':>5} {'same':>7}  tuning (vanilla / tree)")
    print(head)
    print("-" * len(head))
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    for r in rows:
        t = r["tuning_tokens_per_s"]
        tuned = " / ".join(f"{t[k]:.0f}" for k in dict.fromkeys(("vanilla", r["tree"])) if k in t) or "-"
        print(f"{r['engine']:<22} {r['requests']:>3} {r['tree']:<16} {fmt(r['vanilla_tokens_per_s'], '8.1f')} "
              f"{fmt(r['schedule_tokens_per_s'], '9.1f')} {fmt(r['schedule_over_vanilla'], '8.2f')}x "
              f"{fmt(r['over_one_at_a_time'], '6.2f')}x {r['tau']:5.2f} {r['identical']:>7}  {tuned}")
