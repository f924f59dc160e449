"""No-regression check of a bench run against the ratios recorded in docs/bench_ratios.json: `make bench` runs it
after each of its tables, `python -m eaglex.bench_guard RUN.json [--record]` by hand.

Only ratios are compared, never tokens/s (a host's speed drifts; a ratio measured within one interleaved run does
not): each speculative row's speedup over its own vanilla, and each batched row's schedule over vanilla batching and
over one request at a time. A ratio more than `--tolerance` below its record is printed as fallen; the check never
fails (exit 0 on any result), since one noisy run must not stop a build. `--record` stores the run's ratios as the
new record for its engines (other engines' records are kept).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from eaglex.base.fsio import write_json

RECORD = Path(__file__).resolve().parent.parent / "docs" / "bench_ratios.json"


def ratios(run: dict) -> dict[str, float]:
    """{name: ratio} of one bench JSON: `engine method tree: speedup` for the eaglex speculative rows, and
    `engine batch B: schedule/vanilla` and `... : vs one at a time` for the batched rows."""
    out = {}
    for r in run.get("rows", []):
        if r.get("engine", "").startswith(("ort:", "torch")) and r.get("method") != "vanilla" and r.get("speedup"):
            tree = "tuned tree" if "(tuned" in r["tree"] else r["tree"]     # the tuned row, whatever tree won
            out[f"{r['engine']} {r['method']} {tree}: speedup"] = r["speedup"]
    for r in run.get("batched", []):
        if r.get("schedule_over_vanilla"):
            out[f"{r['engine']} batch {r['requests']}: schedule/vanilla"] = r["schedule_over_vanilla"]
        if r.get("over_one_at_a_time") and r["requests"] > 1:
            out[f"{r['engine']} batch {r['requests']}: vs one at a time"] = r["over_one_at_a_time"]
    return out


def compare(now: dict[str, float], record: dict[str, float], tolerance: float) -> list[str]:
    """One line per recorded ratio this run measured: fallen (more than `tolerance` below), or held."""
    lines = []
    for name in sorted(set(now) & set(record)):
        fell = now[name] < (1 - tolerance) * record[name]
        lines.append(f"{'FELL' if fell else 'held'}  {name}: {now[name]:.2f} (recorded {record[name]:.2f})")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eaglex.bench_guard", description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="bench JSON files (eaglex bench --out)")
    ap.add_argument("--record-file", type=Path, default=RECORD, help=f"the recorded ratios (default {RECORD})")
    ap.add_argument("--tolerance", type=float, default=0.10, help="fraction a ratio may fall before it is printed "
                                                                  "as fallen (default 0.10)")
    ap.add_argument("--record", action="store_true", help="store these runs' ratios as the record")
    args = ap.parse_args(argv)
    now = {}
    for path in args.runs:
        try:
            now.update(ratios(json.loads(path.read_text())))
        except (OSError, ValueError, AttributeError) as e:
            print(f"bench guard: {path} is not a bench JSON ({e}): skipped", file=sys.stderr)
    try:
        record = json.loads(args.record_file.read_text())
    except (OSError, ValueError):
        record = {}
    if args.record:
        write_json(args.record_file, {**record, **now})
        print(f"bench guard: recorded {len(now)} ratios in {args.record_file}")
        return 0
    lines = compare(now, record, args.tolerance)
    fallen = sum(line.startswith("FELL") for line in lines)
    print(f"bench guard: {len(lines)} recorded ratios measured, {fallen} fell by more than "
          f"{args.tolerance:.0%} ({args.record_file})")
    for line in lines:
        print("  " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
