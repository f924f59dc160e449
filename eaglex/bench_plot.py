"""The picture of an `eaglex bench` run (`--plot`): tokens/s of every row, and each eaglex row over each llama.cpp
row as the bench anchors it (eaglex/bench.py `anchor`). Needs matplotlib (pip install -e '.[bench]').

Replot a saved run: python -m eaglex.bench_plot bench.json bench.png
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from eaglex.bench_row import anchored_table, peer_label

COLORS = {"llama.cpp": "tab:orange", "transformers": "tab:gray"}     # eaglex rows: tab:blue


def row_label(r: dict) -> str:
    """`engine method tree` without what a reader does not need (the ort: prefix, vanilla's '-'); llama.cpp rows by
    their short name and draft setting (n-max/p-min)."""
    tree = "" if r["tree"] in ("-", "") else " " + r["tree"]
    if r["engine"] == "llama.cpp":
        return "llama.cpp " + peer_label(r) + tree.replace("n-max ", "").replace(" / p-min ", "/")
    return f"{r['engine'].removeprefix('ort:')} {r['method']}{tree}"


def plot(rows: list[dict], path: Path, title: str = "") -> None:
    """Left: tokens/s per row (τ beside the bar where drafted). Right, where the run had llama.cpp rows: the
    anchored ratios, eaglex rows down, llama.cpp rows across."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.get("tokens_per_s")]
    mine, cols = anchored_table(rows)
    fig, axes = plt.subplots(1, 2 if cols else 1, figsize=(15 if cols else 8, 0.32 * len(rows) + 1.6),
                             squeeze=False)
    a = axes[0][0]
    y = range(len(rows))[::-1]
    a.barh(list(y), [r["tokens_per_s"] for r in rows], color=[COLORS.get(r["engine"], "tab:blue") for r in rows])
    for yi, r in zip(y, rows):
        tau = r.get("tau")
        note = f"{r['tokens_per_s']:.1f}" + (f"  τ {tau:.2f}" if tau and tau != 1 else "")
        a.text(r["tokens_per_s"], yi, " " + note, va="center", fontsize=7)
    a.set_yticks(list(y), [row_label(r) for r in rows], fontsize=7)
    a.set_xlabel("tokens/s (whole requests, prefill included)")
    a.set_xlim(0, 1.25 * max(r["tokens_per_s"] for r in rows))
    a.grid(axis="x", alpha=0.3)
    if cols:
        b = axes[0][1]
        grid = [[r["vs_llamacpp_anchored"].get(c, float("nan")) for c in cols] for r in mine]
        im = b.imshow(grid, cmap="RdYlGn", vmin=0.5, vmax=1.5, aspect="auto")
        for i, line in enumerate(grid):
            for j, v in enumerate(line):
                if v == v:          # not NaN
                    b.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7)
        b.set_xticks(range(len(cols)), cols, rotation=40, ha="right", fontsize=7)
        b.set_yticks(range(len(mine)), [row_label(r) for r in mine], fontsize=7)
        b.set_title("eaglex row / llama.cpp row, anchored on the engine's vanilla beside llama.cpp", fontsize=9)
        fig.colorbar(im, ax=b, shrink=0.8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)


def plot_file(json_path: Path, png: Path) -> None:
    """Plot a bench JSON file (`eaglex bench --out`); ValueError in one line if it is not one."""
    try:
        run = json.loads(Path(json_path).read_text())
        run["rows"][0]["tokens_per_s"]
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
        raise ValueError(f"{json_path}: not an `eaglex bench --out` file ({type(e).__name__}: {e})") from None
    m = run.get("machine", {})
    plot(run["rows"], Path(png), f"{run.get('prompts')} prompts × {run.get('max_new_tokens')} tokens, "
                                 f"{m.get('cpu', m.get('processor', ''))}".strip(", "))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m eaglex.bench_plot BENCH.json OUT.png")
    try:
        plot_file(Path(sys.argv[1]), Path(sys.argv[2]))
    except ValueError as e:
        sys.exit(f"error: {e}")
