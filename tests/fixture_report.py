"""Acceptance and per-cycle overhead of every exactness case on the seeded fixtures (the README table).

Run: .venv/bin/python tests/fixture_report.py   (not a test; prints a markdown table)
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

from eaglex.models.seeded import make_eagle1_head, make_eagle3_head, make_llama_target, make_prompts, make_qwen2_target

sys.path.insert(0, str(Path(__file__).parent))
from test_exactness import CASES, MAX_NEW  # noqa: E402

from eaglex.runtime.generate import SpeculativeGenerator, VanillaGenerator  # noqa: E402
from eaglex.runtime.torch_backend import TorchBackend  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    prompts = make_prompts(24, 48, seed=1)
    print("| target | case | tree | τ | accept-length histogram | identical | overhead ms/cycle | forwards ms/cycle |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        for name, make in (("llama", make_llama_target), ("qwen2", make_qwen2_target)):
            t = make(root / name)
            heads = {"eagle3": make_eagle3_head(t, root / f"{name}-e3", draft_vocab_size=40),
                     "eagle1": make_eagle1_head(t, root / f"{name}-e1")}
            vanilla = [VanillaGenerator(TorchBackend(t)).generate(p, MAX_NEW).output_ids for p in prompts]
            for case, head, tree, _ in CASES:
                gen = SpeculativeGenerator(TorchBackend(t, heads[head]), tree)
                gen.generate(prompts[0], 4)
                rs = [gen.generate(p, MAX_NEW) for p in prompts]
                lengths = [a for r in rs for a in r.accept_lengths]
                cycles = sum(r.cycles for r in rs)
                hist = " ".join(f"{k}:{lengths.count(k)}" for k in sorted(set(lengths)))
                same = all(r.output_ids == v for r, v in zip(rs, vanilla))
                over = 1e3 * sum(r.overhead_seconds for r in rs) / cycles
                fwd = 1e3 * sum(r.forward_seconds for r in rs) / cycles
                print(f"| {name} | {case} | {tree} | {sum(lengths) / len(lengths):.2f} | {hist} | "
                      f"{'yes' if same else 'NO'} | {over:.2f} | {fwd:.2f} |")


if __name__ == "__main__":
    main()
