"""The τ report: mean accepted tokens per target forward of trained heads on held-out prompts, per tree shape,
measured with the runtime itself (TorchBackend + SpeculativeGenerator, greedy), each output checked against
vanilla greedy decoding."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eaglex.runtime.types import TreeConfig

from . import loop

# The shapes every report measures, keyed by their spelling: chains, short CPU-sized trees (~8-16 nodes, few nodes
# expanded per level) and the official code's default (60/7/10 there, see TreeConfig).
SHAPES: dict[str, TreeConfig] = {str(t): t for t in map(TreeConfig.parse, (
    "chain:4", "chain:6", "chain:8", "dynamic:8/5/2", "dynamic:16/6/4", "dynamic:16/8/2", "dynamic:60/8/10"))}
DEFAULT_SHAPE = "dynamic:16/6/4"


@dataclass(frozen=True)
class TauRow:
    draft: str
    shape: str
    tau: float                # emitted tokens / verification cycles, over all prompts
    identical: int            # prompts whose speculative output equals vanilla greedy
    prompts: int
    seconds: float


def vanilla_outputs(target_dir: str | Path, prompts: list[list[int]], max_new_tokens: int = 128,
                    backend=None, device: str = "cpu") -> list[list[int]]:
    """Greedy continuations by the runtime without drafting: what every speculative output must equal."""
    from eaglex.runtime.generate import VanillaGenerator
    from eaglex.runtime.torch_backend import TorchBackend

    gen = VanillaGenerator(backend or TorchBackend(target_dir, device=device))
    return [gen.generate(p, max_new_tokens).output_ids for p in prompts]


def tau_table(target_dir: str | Path, drafts: dict[str, str | Path], prompts: list[list[int]],
              shapes: dict[str, TreeConfig] = SHAPES, max_new_tokens: int = 128, progress: bool = True,
              vanilla: list[list[int]] | None = None, device: str = "cpu") -> list[TauRow]:
    """One row per (draft, shape); `drafts` maps a label to a head folder. `vanilla`: vanilla_outputs of the
    prompts, when already computed. The runtime runs in float32 on `device`."""
    from tqdm import tqdm

    from eaglex.runtime.generate import SpeculativeGenerator
    from eaglex.runtime.torch_backend import TorchBackend

    rows = []
    for label, draft_dir in drafts.items():
        backend = TorchBackend(target_dir, draft_dir, device=device)
        if vanilla is None:
            vanilla = vanilla_outputs(target_dir, prompts, max_new_tokens, backend)
        for name, shape in shapes.items():
            gen = SpeculativeGenerator(backend, shape)
            emitted = cycles = same = 0
            secs = 0.0
            for p, ref in tqdm(list(zip(prompts, vanilla)), desc=f"tau {label} {name}", disable=not progress,
                               position=loop.BAR_POSITION, leave=False):
                r = gen.generate(p, max_new_tokens)
                emitted += sum(r.accept_lengths)
                cycles += len(r.accept_lengths)
                same += r.output_ids == ref
                secs += r.seconds
            rows.append(TauRow(label, name, emitted / max(cycles, 1), same, len(prompts), secs))
    return rows


def format_table(rows: list[TauRow]) -> str:
    """Markdown: one line per shape, one τ column per draft."""
    drafts = list(dict.fromkeys(r.draft for r in rows))
    shapes = list(dict.fromkeys(r.shape for r in rows))
    by = {(r.draft, r.shape): r for r in rows}
    lines = ["| tree | " + " | ".join(f"τ {d}" for d in drafts) + " | identical to vanilla |",
             "|---|" + "---|" * len(drafts) + "---|"]
    for s in shapes:
        cells = [f"{by[d, s].tau:.2f}" if (d, s) in by else "-" for d in drafts]
        ident = ", ".join(f"{by[d, s].identical}/{by[d, s].prompts}" for d in drafts if (d, s) in by)
        lines.append(f"| {s} | " + " | ".join(cells) + f" | {ident} |")
    return "\n".join(lines)
