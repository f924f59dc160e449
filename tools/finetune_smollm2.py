"""Fine-tune the committed SmolLM2-135M-Instruct EAGLE-3 head on the CPU, on instructions the target writes itself.

    python tools/finetune_smollm2.py [--out build/ft] [--init models/smollm2-135m/eagle3] [--self-instruct 200]
                                     [--builtin 128] [--steps 300] [--lr 4e-4]

The committed head was trained on a GPU on the target's answers to the built-in template instructions only; a CPU
cannot afford that recipe from scratch, but it can continue it. The data stages are eaglex/recipe_smollm2.py's, cached and
resumable under OUT/work/ (target, prompts, instructions, selfdistill): `--self-instruct` instructions the target
writes (a quarter of them continued into a follow-up turn; none near a held-out prompt of either file), mixed with
the first `--builtin` built-in training instructions so the template split is not forgotten, each answered greedily
to `seq_len` tokens. Then training/eagle3.py continues from `--init` (its draft vocabulary and shape kept) at a low
learning rate, resumable from OUT/work/eagle3-ft.pt. Output: OUT/eagle3/ (official layout), OUT/eagle3-st/
(safetensors, as models/smollm2-135m keeps heads), OUT/finetune.json (data sizes, steps, losses, times) and
OUT/audit.json (how near the training instructions come to the held-out prompts).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from eaglex.base import chat_prompts, honest_prompts
from eaglex.base.fsio import write_text
from eaglex.presets import preset_target_file
from eaglex.recipe_smollm2 import PRESETS, Paths, build
from eaglex.training.eagle3 import save_eagle3, train_eagle3
from eaglex.training.loop import OptimConfig
from eaglex.training.selfdistill import SelfDistillData
from eaglex.training.textfilter import jaccard, shingles


def nearest(trained: list[str], held: list[str]) -> dict:
    """The closest pair (word 3-gram Jaccard) between texts trained on and held-out texts."""
    held_sh = [(h, shingles(h)) for h in held]
    best = {"jaccard": 0.0, "trained": "", "heldout": ""}
    for t in trained:
        sh = shingles(t)
        for h, hs in held_sh:
            j = jaccard(sh, hs)
            if j > best["jaccard"]:
                best = {"jaccard": round(j, 3), "trained": t, "heldout": h}
    return best


def audit(p: Paths, builtin: int) -> dict:
    """How near the user turns trained on come to the held-out ones. The hand-written set must stay unseen (the
    self-instruct stage refuses anything at Jaccard 0.6 or above, and no built-in template is like them); the
    template split shares templates, never (template, topic) pairs, with the built-in training instructions."""
    builtin_texts = chat_prompts.train_prompts()[:builtin]
    convs = p.work / "instructions.json"
    written = [m["content"] for c in json.loads(convs.read_text()) for m in c if m["role"] == "user"] \
        if convs.is_file() else []
    honest = honest_prompts.user_texts()
    exact = {" ".join(h.lower().split()) for h in honest}
    return {"honest": nearest(builtin_texts + written, honest),
            "honest_exact_copies": sum(" ".join(t.lower().split()) in exact for t in builtin_texts + written),
            "template_split": {"self_instruct": nearest(written, chat_prompts.heldout_prompts()),
                               "builtin": nearest(builtin_texts, chat_prompts.heldout_prompts())}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python tools/finetune_smollm2.py", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("build/ft"))
    ap.add_argument("--init", type=Path, default=Path("models/smollm2-135m/eagle3"))
    ap.add_argument("--self-instruct", type=int, default=200, help="first-turn instructions the target writes")
    ap.add_argument("--builtin", type=int, default=128, help="built-in template instructions mixed in")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--until", choices=("selfdistill", "eagle3"), default="eagle3")
    args = ap.parse_args(argv)

    full = PRESETS["full"]
    cfg = replace(full, train_prompts=args.builtin, sampled_fraction=0.0,
                  self_instruct=replace(full.self_instruct, count=args.self_instruct),
                  eagle3=replace(full.eagle3, init=str(args.init), batch=args.batch,
                                 optim=OptimConfig(steps=args.steps, lr=args.lr, warmup=20, checkpoint_every=20)))
    p = Paths(args.out)
    t0 = time.perf_counter()
    data_info = build(args.out, preset_target_file("smollm2-135m"), cfg, lanes=2, until="selfdistill")
    data_seconds = round(time.perf_counter() - t0, 1)
    checked = audit(p, args.builtin)
    write_text(args.out / "audit.json", json.dumps(checked, indent=2, ensure_ascii=False) + "\n")
    print(f"[finetune] nearest hand-written held-out prompt to any training user turn: Jaccard "
          f"{checked['honest']['jaccard']:.2f}, {checked['honest_exact_copies']} exact copies (OUT/audit.json)")
    if args.until == "selfdistill":
        return 0

    from eaglex.models.target import load_target

    torch.set_num_threads(2)
    data = SelfDistillData.load(p.work / "selfdistill.pt")
    target = load_target(p.target)
    t1 = time.perf_counter()
    head, config, t2d, losses = train_eagle3(target, data, cfg.eagle3, checkpoint=p.work / "eagle3-ft.pt",
                                             threads=2)
    train_seconds = round(time.perf_counter() - t1, 1)
    save_eagle3(head, config, t2d, args.out / "eagle3")
    write_safetensors(args.out / "eagle3", args.out / "eagle3-st")
    tail = losses[-20:]
    report = {"init": str(args.init), "data": data_info, "data_seconds": data_seconds,
              "steps": args.steps, "batch": args.batch, "lr": args.lr, "first_loss": round(losses[0], 4),
              "final_loss": round(sum(tail) / len(tail), 4), "train_seconds": train_seconds,
              "config": asdict(cfg.eagle3)}
    write_text(args.out / "finetune.json", json.dumps(report, indent=2) + "\n")
    print(f"[finetune] {args.steps} steps, loss {losses[0]:.4f} -> {report['final_loss']:.4f}, "
          f"{train_seconds:.0f} s; head in {args.out / 'eagle3-st'}")
    return 0


def write_safetensors(src: Path, dest: Path) -> None:
    """The head as models/smollm2-135m keeps it (eaglex/recipe_smollm2.py's publish): the same tensors (float16 weights,
    d2t, t2d) in model.safetensors, and config.json."""
    from safetensors.torch import save_file

    state = torch.load(src / "pytorch_model.bin", map_location="cpu", weights_only=True)
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(dest / "model.safetensors"))
    shutil.copy(src / "config.json", dest / "config.json")


if __name__ == "__main__":
    sys.exit(main())
