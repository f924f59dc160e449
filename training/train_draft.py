"""`eaglex train-draft`: train an EAGLE head for any supported target from a JSONL file of prompts.

1. The last `eval_prompts` prompts are held out for the τ report; the others are cut to their last `prompt_tokens`
   tokens and continued by the target itself (selfdistill.py). `builtin-chat` instead of a file: the built-in chat
   instructions (eaglex.base.chat_prompts) through the target's chat template, held out from the instructions training
   never sees.
2. The head trains on those sequences (EAGLE-3 with training-time test, or EAGLE-1/2).
3. It is saved in the official layout, loaded back through models.eagle.load_draft, and its τ is measured on the
   held-out prompts.
`self-instruct:N` instead of a file: N instructions the target writes itself (selfinstruct.py: its chat template's
pre-query text, sampled, filtered and deduplicated, a share with a follow-up turn), in its chat template; the held-out
prompts are more of them, never trained on.
`init`: the head starts as an existing one (ours, or an official EAGLE checkpoint for this target, as the runtime
loads it) instead of fresh weights: adapting a released head to one's own prompts, at a lower learning rate.
Everything resumable lives under OUT/checkpoints/: the generated instructions and data, and the optimiser state.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from .eagle1 import Eagle1Config, save_eagle1, train_eagle1
from .eagle3 import Eagle3Config, save_eagle3, train_eagle3
from .heads import init_head
from .loop import default_threads
from .report import SHAPES, format_table, tau_table
from .selfdistill import SelfDistillConfig, SelfDistillData, generate
from .selfinstruct import SelfInstructConfig, encode_conversations, self_instruct

BUILTIN_CHAT = "builtin-chat"
SELF_INSTRUCT = "self-instruct:"


def builtin_chat(tokenizer, eval_prompts: int) -> list[list[int]]:
    """The built-in training instructions, then `eval_prompts` held-out ones, in the tokenizer's chat template."""
    from eaglex.base import chat_prompts
    from eaglex.base.errors import ModelError
    from eaglex.base.prompts import encode, has_chat_template

    if tokenizer is None or not has_chat_template(tokenizer):
        raise ModelError(f"--data {BUILTIN_CHAT} needs a tokenizer with a chat template in the target folder; "
                         "give a JSONL prompt file instead")
    texts = chat_prompts.train_prompts() + chat_prompts.heldout_prompts()[:eval_prompts]
    return [encode({"prompt": t}, tokenizer, True, f"{BUILTIN_CHAT} prompt {i}") for i, t in enumerate(texts)]


def self_instruct_count(data: str) -> int | None:
    """N of a `self-instruct:N` data spelling, None for anything else; a ModelError for a bad N."""
    from eaglex.base.errors import ModelError

    if not data.startswith(SELF_INSTRUCT):
        return None
    n = data[len(SELF_INSTRUCT):]
    if not n.isdigit() or int(n) < 1:
        raise ModelError(f"--data {data}: N in self-instruct:N must be a whole number >= 1")
    return int(n)


def self_instruct_prompts(hf_model, tokenizer, n: int, eval_prompts: int, folder: Path,
                          cfg: SelfInstructConfig) -> list[list[int]]:
    """`n` self-instruct first turns and their two-turn conversations for training, then `eval_prompts` more
    first turns (none of them continued into a two-turn conversation) to hold out; resumable from
    folder/self_instruct.jsonl."""
    from eaglex.base.errors import ModelError
    from eaglex.base.fsio import write_text
    from eaglex.base.prompts import has_chat_template

    if not has_chat_template(tokenizer):
        raise ModelError(f"--data {SELF_INSTRUCT}N needs a tokenizer with a chat template in the target folder")
    cfg = replace(cfg, count=n + eval_prompts,
                  follow_up_fraction=min(cfg.follow_up_fraction, n / (n + eval_prompts)))
    convs, stats = self_instruct(hf_model, tokenizer, cfg, store=folder / "self_instruct.jsonl")
    singles = [c for c in convs if len(c) == 1]
    if len(singles) <= eval_prompts:
        raise ModelError(f"the target wrote only {len(singles)} usable instructions ({stats}); need more than the "
                         f"{eval_prompts} held out")
    write_text(folder / "self_instruct.json", json.dumps({"stats": stats, "conversations": convs}, indent=1))
    ordered = singles[:-eval_prompts] + [c for c in convs if len(c) > 1] + singles[-eval_prompts:]
    return encode_conversations(tokenizer, ordered)


@dataclass(frozen=True)
class TrainDraftConfig:
    method: str = "eagle3"              # eagle3 | eagle1
    steps: int = 1000
    prompt_tokens: int = 64             # prompts are cut to their last prompt_tokens tokens
    min_prompt_tokens: int = 4          # shorter prompts are skipped
    eval_prompts: int = 8               # the last lines of the data file, never trained on
    eval_new_tokens: int = 128
    init: str | None = None             # a head folder (of kind `method`) to continue training from
    lr: float | None = None             # None: the method's default (2e-3, for fresh weights)
    selfdistill: SelfDistillConfig = field(default_factory=SelfDistillConfig)
    self_instruct: SelfInstructConfig = field(default_factory=SelfInstructConfig)
    eagle3: Eagle3Config = field(default_factory=Eagle3Config)
    eagle1: Eagle1Config = field(default_factory=Eagle1Config)


def train_draft(target_dir: str | Path, data_file: str | Path, out: str | Path,
                cfg: TrainDraftConfig = TrainDraftConfig(), threads: int | None = None, device: str = "cpu") -> dict:
    """Returns the report written to OUT/train_report.json. Generation, training and the τ report run on
    `device` (the target in float32 there; training under bfloat16 autocast)."""
    from eaglex.base.errors import ModelError
    from eaglex.base.prompts import load_tokenizer, read_prompts
    from eaglex.models.target import load_target

    if cfg.method not in ("eagle3", "eagle1"):
        raise ModelError(f"--method must be eagle3 or eagle1, got {cfg.method!r}")
    if cfg.steps < 1:
        raise ModelError(f"--steps must be >= 1, got {cfg.steps}")
    if cfg.lr is not None and not cfg.lr > 0:
        raise ModelError(f"--lr must be > 0, got {cfg.lr}")
    out, threads = Path(out), threads or default_threads()
    ckpt = out / "checkpoints"
    ckpt.mkdir(parents=True, exist_ok=True)
    target = load_target(target_dir, device=device)
    if cfg.init:   # a head that does not fit fails now, not after generating the data
        init_head(target, cfg.init, cfg.method)
    tokenizer = load_tokenizer(target_dir)
    n_instruct = self_instruct_count(str(data_file))
    if n_instruct:
        prompts = self_instruct_prompts(target.hf, tokenizer, n_instruct, cfg.eval_prompts, ckpt, cfg.self_instruct)
    elif str(data_file) == BUILTIN_CHAT:
        prompts = builtin_chat(tokenizer, cfg.eval_prompts)
    else:
        prompts = read_prompts(data_file, tokenizer)
    if len(prompts) <= cfg.eval_prompts:
        raise ModelError(f"{data_file} holds {len(prompts)} prompts; need more than the {cfg.eval_prompts} "
                         "held out for the τ report")
    train_prompts = [p[-cfg.prompt_tokens:] for p in prompts[:-cfg.eval_prompts] if len(p) >= cfg.min_prompt_tokens]
    eval_prompts = [p[-cfg.prompt_tokens:] for p in prompts[-cfg.eval_prompts:]]
    if not train_prompts:
        raise ModelError(f"{data_file}: no training prompt has {cfg.min_prompt_tokens} tokens or more")

    data_file_ckpt = ckpt / "selfdistill.pt"
    if data_file_ckpt.is_file():
        data = SelfDistillData.load(data_file_ckpt)
    else:
        data = generate(target.hf, train_prompts, cfg.selfdistill)
        data.save(data_file_ckpt)
    eos = target.spec.eos_ids[0] if target.spec.eos_ids else None
    if cfg.method == "eagle3":
        optim = replace(cfg.eagle3.optim, steps=cfg.steps, lr=cfg.lr or cfg.eagle3.optim.lr)
        hcfg = replace(cfg.eagle3, optim=optim, init=cfg.init)
        head, config, t2d, losses = train_eagle3(target, data, hcfg, eos, ckpt / "eagle3.pt", threads)
        save_eagle3(head, config, t2d, out)
    else:
        optim = replace(cfg.eagle1.optim, steps=cfg.steps, lr=cfg.lr or cfg.eagle1.optim.lr)
        hcfg = replace(cfg.eagle1, optim=optim, init=cfg.init)
        head, config, losses = train_eagle1(target, data, hcfg, eos, ckpt / "eagle1.pt", threads)
        save_eagle1(head, config, out)
    rows = tau_table(target_dir, {cfg.method: out}, eval_prompts, SHAPES, cfg.eval_new_tokens, device=device)
    print(format_table(rows))
    report = {"method": cfg.method, "init": cfg.init, "steps": cfg.steps,
              "train_sequences": int(data.tokens.shape[0]), "sequence_length": int(data.tokens.shape[1]),
              "first_loss": losses[0], "final_loss": losses[-1],
              "tau": [asdict(r) for r in rows], "config": asdict(cfg)}
    (out / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report
