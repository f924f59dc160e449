"""A/B speed of two eaglex versions on one engine, interleaved prompt by prompt: "did this change cost speed?".

    python tools/ab_speed.py --base REV --engine engines/smollm2-135m --prompts FILE
                             [--num-prompts 8] [--max-new-tokens 128] [--runs vanilla,eagle:1,eagle:16]
                             [--threads 2] [--json build/ab_speed.json]

The base revision is exported with `git archive` and installed (no dependencies) under build/ab/REV; the working
tree's eaglex is the other side. Each side runs in its own worker process that keeps the engine open, so both pay
the same warm caches; for every prompt (or batch of prompts) and every run, the two sides run one after the other,
in alternating order. A run is METHOD[:BATCH]: `vanilla` (no drafting) or `eagle` (the engine's own tree and batch
schedule), BATCH prompts decoded at once through the in-flight batcher (default 1, one at a time). Printed: tokens/s
of each side, the median of the per-item ratios with its spread, and whether both sides' outputs are identical.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def worker() -> None:
    """Serve requests from stdin, one JSON per line: {"engine", "method", "prompts", "max_new_tokens", "batch"}."""
    import eaglex
    from eaglex.runtime.engine import open_engine
    from eaglex.runtime.threads import set_threads
    set_threads(int(os.environ.get("AB_THREADS", "0")) or None, onnxruntime=True)
    print(json.dumps({"eaglex": str(Path(eaglex.__file__).parent)}), flush=True)
    engines = {}
    for line in sys.stdin:
        req = json.loads(line)
        key = (req["engine"], req["method"])
        if key not in engines:
            engines[key] = open_engine(req["engine"], method="vanilla" if req["method"] == "vanilla" else None)
        t = time.perf_counter()
        results = engines[key].generate(req["prompts"], max_new_tokens=req["max_new_tokens"], batch=req["batch"])
        seconds = time.perf_counter() - t
        print(json.dumps({"seconds": seconds, "outputs": [r.output_ids for r in results],
                          "cycles": sum(r.cycles for r in results)}), flush=True)


class Side:
    def __init__(self, name: str, pythonpath: str | None, threads: int):
        env = dict(os.environ, AB_THREADS=str(threads))
        if pythonpath:
            env["PYTHONPATH"] = pythonpath
        # not the repository root as the working directory: its eaglex/ folder would shadow the installed one
        self.name = name
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker"], env=env,
                                     cwd=tempfile.gettempdir(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        self.where = json.loads(self.proc.stdout.readline())["eaglex"]

    def ask(self, **req) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"ab_speed: the {self.name} worker died (see its error above)")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def install_base(rev: str) -> Path:
    """`git archive REV` installed without dependencies under build/ab/SHA/site (reused when present)."""
    sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", rev], check=True, capture_output=True,
                         text=True).stdout.strip()
    root = REPO / "build" / "ab" / sha
    site = root / "site"
    if (site / "eaglex").is_dir():
        return site
    src = root / "src"
    src.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", sha], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    print(f"ab_speed: installing {rev} ({sha}) into {site} ...", flush=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--no-index", "--target", str(site), str(src)], check=True)
    return site


def read_prompt_ids(path: Path, engine: Path, n: int, chat: bool) -> list[list[int]]:
    from eaglex.base.prompts import load_tokenizer, read_prompts
    return read_prompts(path, load_tokenizer(engine), chat)[:n]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="the git revision to compare with (e.g. HEAD~1, a commit)")
    ap.add_argument("--engine", required=True, type=Path)
    ap.add_argument("--prompts", required=True, type=Path, help="a prompt file (.jsonl or .txt) as eaglex reads it")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--chat", action="store_true", help="wrap plain-text prompts in the model's chat template")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--runs", default="vanilla,eagle:1,eagle:16", help="METHOD[:BATCH],... (vanilla | eagle)")
    ap.add_argument("--threads", type=int, default=0, help="ONNX Runtime threads (default: the physical cores)")
    ap.add_argument("--json", type=Path, default=REPO / "build" / "ab_speed.json")
    args = ap.parse_args(argv)
    runs = []
    for r in args.runs.split(","):
        method, _, batch = r.partition(":")
        if method not in ("vanilla", "eagle") or (batch and not batch.isdigit()):
            ap.error(f"bad run {r!r}: use vanilla[:B] or eagle[:B]")
        runs.append((method, int(batch or 1)))
    engine = str(args.engine.resolve())
    prompts = read_prompt_ids(args.prompts, args.engine, args.num_prompts, args.chat)
    if not prompts:
        ap.error(f"no prompts in {args.prompts}")

    base = Side(f"base {args.base}", str(install_base(args.base)), args.threads)
    head = Side("working tree", None, args.threads)
    sides = (base, head)
    print(f"ab_speed: base eaglex from {base.where}\n          this eaglex from {head.where}", flush=True)
    for method, batch in runs:                      # warm-up: sessions, caches, the first shapes
        for s in sides:
            s.ask(engine=engine, method=method, prompts=prompts[:batch], max_new_tokens=8, batch=batch)

    rows = {}
    for method, batch in runs:      # an item: the prompts one request (batch 1) or one batched call decodes
        items = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
        rows[(method, batch)] = {"tokens": [0, 0], "seconds": [0.0, 0.0], "ratios": [], "identical": 0,
                                 "items": items}
    for i in range(len(prompts)):
        for method, batch in runs:
            row = rows[(method, batch)]
            items = row["items"]
            if i >= len(items):
                continue
            order = sides if i % 2 == 0 else sides[::-1]
            got = {}
            for s in order:
                got[s.name] = s.ask(engine=engine, method=method, prompts=items[i],
                                    max_new_tokens=args.max_new_tokens, batch=batch)
            a, b = got[base.name], got[head.name]
            for k, r in enumerate((a, b)):
                row["tokens"][k] += sum(len(o) for o in r["outputs"])
                row["seconds"][k] += r["seconds"]
            rate = lambda r: sum(len(o) for o in r["outputs"]) / r["seconds"]   # noqa: E731
            row["ratios"].append(rate(b) / rate(a))
            row["identical"] += a["outputs"] == b["outputs"]
        print(f"ab_speed: {i + 1}/{len(prompts)} prompts", flush=True)
    for s in sides:
        s.close()

    print(f"\n{'run':<12} {'base tok/s':>10} {'this tok/s':>10} {'ratio':>7} {'per-item ratios (min-med-max)':>30} "
          f"{'identical':>9}")
    report = {"base": args.base, "engine": engine, "prompts": str(args.prompts), "num_prompts": len(prompts),
              "max_new_tokens": args.max_new_tokens, "threads": args.threads or "physical cores", "runs": {}}
    for (method, batch), row in rows.items():
        base_rate, head_rate = (t / s for t, s in zip(row["tokens"], row["seconds"]))
        rs = sorted(row["ratios"])
        name = f"{method}:{batch}"
        print(f"{name:<12} {base_rate:>10.1f} {head_rate:>10.1f} {head_rate / base_rate:>6.3f}x "
              f"{f'{rs[0]:.3f} {statistics.median(rs):.3f} {rs[-1]:.3f}':>30} "
              f"{row['identical']:>5}/{len(row['items'])}")
        report["runs"][name] = {"base_tokens_per_s": round(base_rate, 2), "tokens_per_s": round(head_rate, 2),
                                "ratio": round(head_rate / base_rate, 4), "item_ratios": [round(r, 4) for r in rs],
                                "identical": row["identical"], "items": len(row["items"])}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1))
    print(f"\nab_speed: wrote {args.json}")
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        worker()
    else:
        sys.exit(main())
