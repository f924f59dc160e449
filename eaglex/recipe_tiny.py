"""`make tiny`: rebuild the embedded default models/tiny/ from the running interpreter's standard library.

    python -m eaglex.recipe_tiny [--out models/tiny] [--work build/tiny]

The target trains on both cores (two threads), then two lanes of one thread each use both cores. Every stage has
a fixed thread count, so the build is deterministic (a CPU kernel's result can depend on the thread count, never
on the machine's load):

    main lane:  tokenizer -> target (2 threads) -> self-distillation (half) -> EAGLE-3 teacher outputs (half)
                -> EAGLE-3 head ------------------------------------------------------------> τ EAGLE-3 (half)
    side lane:  self-distillation (half) -> EAGLE-3 teacher outputs (half) -> draft LM -> EAGLE-1/2 head
                -> τ EAGLE-1/2 (and the vanilla outputs every τ stage compares with) ----> τ EAGLE-3 (half)

Every stage caches its output in WORK/ under a key of everything it depends on, so an interrupted build resumes
(trainers from their last checkpoint) and a finished one reruns in seconds. The same interpreter (the corpus),
library versions give the same batches and initialisation; CPU kernels may round differently from one machine to
another, and training amplifies that, so weights can differ slightly. manifest.json records what went in and what
came out.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from multiprocessing import get_context
from pathlib import Path

import torch

from eaglex.base.fsio import write_text
from eaglex.recipe_stages import cached, fresh, timed, write_key
from eaglex.training import corpus, loop, tokenizer, tokens
from eaglex.training.draft_lm import DraftLMConfig, save_draft_lm, train_draft_lm
from eaglex.training.eagle1 import Eagle1Config, save_eagle1, train_eagle1
from eaglex.training.eagle3 import Eagle3Config, prepare_teacher, save_eagle3, train_eagle3
from eaglex.training.loop import OptimConfig, digest
from eaglex.training.report import DEFAULT_SHAPE, SHAPES, TauRow, format_table, tau_table, vanilla_outputs
from eaglex.training.selfdistill import SelfDistillConfig, SelfDistillData, generate
from eaglex.training.tiny_target import TargetConfig, eval_loss, save_target, train_target


@dataclass(frozen=True)
class TinyConfig:
    corpus: corpus.CorpusConfig = field(default_factory=corpus.CorpusConfig)
    tokenizer: tokenizer.TokenizerConfig = field(default_factory=lambda: tokenizer.TokenizerConfig(vocab_size=2048))
    target: TargetConfig = field(default_factory=lambda: TargetConfig(
        hidden_size=160, num_layers=16, num_heads=4, num_kv_heads=2, intermediate_size=448,
        seq_len=256, batch=4, optim=OptimConfig(steps=2500, lr=2e-3, warmup=50, weight_decay=0.1, grad_clip=1.0,
                                                checkpoint_every=200)))
    target_threads: int = 2              # 1.5-1.8x faster than one thread; the time saved goes to the τ report
    train_prompts: int = 1024
    prompt_tokens: int = 64
    selfdistill: SelfDistillConfig = field(default_factory=lambda: SelfDistillConfig(new_tokens=192, batch=128))
    # Both heads see the same batches for the same number of steps (an EAGLE-3 step costs ~3x an EAGLE-1 step).
    eagle3: Eagle3Config = field(default_factory=lambda: Eagle3Config(
        draft_vocab_size=1024, optim=OptimConfig(steps=800, lr=3e-3, warmup=30)))
    eagle1: Eagle1Config = field(default_factory=lambda: Eagle1Config(
        optim=OptimConfig(steps=800, lr=2e-3, warmup=30)))
    draft_lm: DraftLMConfig = field(default_factory=lambda: DraftLMConfig(
        hidden_size=160, intermediate_size=448, corpus_fraction=1.0, batch=4,
        optim=OptimConfig(steps=2000, lr=3e-3, warmup=50, weight_decay=0.1, grad_clip=1.0, checkpoint_every=200)))
    eval_prompts: int = 48               # 12 prompts left τ differences of ±0.15 between heads to chance
    eval_new_tokens: int = 64
    seed: int = 0


# ------------------------------------------------------------------------------------------------ stages
# Each stage reads its inputs from disk and writes its outputs there, so that it can run in either lane.

@dataclass(frozen=True)
class Paths:
    out: Path
    work: Path

    @property
    def target(self) -> Path:
        return self.out / "target"






def _tokenizer(p: Paths):
    hf = tokenizer.load_tokenizer(p.work / "tokenizer")
    return hf.backend_tokenizer, hf.eos_token_id


def stage_tokenizer(p: Paths, cfg: TinyConfig) -> dict:
    """Train the tokenizer and encode both splits (work/tokenizer/, work/streams.pt)."""
    train_files = corpus.load(cfg.corpus, "train")
    heldout_files = corpus.load(cfg.corpus, "heldout")
    key = {"train": corpus.fingerprint(train_files), "heldout": corpus.fingerprint(heldout_files),
           "config": asdict(cfg.tokenizer)}
    tok_dir = p.work / "tokenizer"
    if not cached(p.work / "tokenizer.json", key):
        tokenizer.save_tokenizer(tokenizer.train_tokenizer([f.text for f in train_files], cfg.tokenizer), tok_dir)
        raw, eos = _tokenizer(p)
        torch.save({"train": tokens.encode_files(train_files, raw, eos),
                    "heldout": tokens.encode_files(heldout_files, raw, eos)}, p.work / "streams.pt")
        write_key(p.work / "tokenizer.json", key)
    streams = torch.load(p.work / "streams.pt", weights_only=True)
    return {"train_files": len(train_files), "heldout_files": len(heldout_files), **key,
            "vocab_size": _tokenizer(p)[0].get_vocab_size(),
            "train_tokens": int(streams["train"].shape[0]), "heldout_tokens": int(streams["heldout"].shape[0])}


def stage_target(p: Paths, cfg: TinyConfig) -> dict:
    raw, eos = _tokenizer(p)
    streams = torch.load(p.work / "streams.pt", weights_only=True)
    model, losses = train_target(cfg.target, streams["train"], raw.get_vocab_size(), eos, p.work / "target.pt",
                                 cfg.target_threads)
    torch.set_num_threads(1)   # the lanes that follow run one thread each
    heldout = eval_loss(model, streams["heldout"], cfg.target.seq_len)
    print(f"[tiny] target: held-out loss {heldout:.3f} nats/token")
    save_target(model, fresh(p.target), eos)
    tokenizer.save_tokenizer(raw, p.target)
    return {"final_loss": _tail(losses), "heldout_loss": round(heldout, 4),
            "params": sum(t.numel() for t in model.parameters())}


def stage_selfdistill(p: Paths, cfg: TinyConfig, shard: int, shards: int = 2) -> dict:
    """Shard `shard` of the target's own continuations of training prompts (from the saved float16 weights, run in
    float32): prompts shard, shard + shards, ... Shards are generated in parallel lanes and merged in order."""
    from eaglex.models.target import load_target

    target = load_target(p.target)
    raw, _ = _tokenizer(p)
    key = {"target": _target_digest(p.target), "prompts": [cfg.train_prompts, cfg.prompt_tokens],
           "config": asdict(cfg.selfdistill), "seed": cfg.seed, "shard": [shard, shards]}
    key_file, data_file = p.work / f"selfdistill{shard}.json", p.work / f"selfdistill{shard}.pt"
    if not cached(key_file, key):
        torch.set_num_threads(1)
        prompts = tokens.line_start_prompts(corpus.load(cfg.corpus, "train"), raw, cfg.train_prompts,
                                          cfg.prompt_tokens, torch.Generator().manual_seed(cfg.seed))
        sd_cfg = replace(cfg.selfdistill, seed=cfg.selfdistill.seed + shard)
        generate(target.hf, prompts[shard::shards], sd_cfg).save(data_file)
        write_key(key_file, key)
    return {"sequences": list(SelfDistillData.load(data_file).tokens.shape)}


def merge_selfdistill(p: Paths, shards: int = 2) -> dict:
    parts = [SelfDistillData.load(p.work / f"selfdistill{i}.pt") for i in range(shards)]
    SelfDistillData(torch.cat([d.tokens for d in parts]), torch.cat([d.prompt_len for d in parts])).save(
        p.work / "selfdistill.pt")
    return {"sequences": [sum(d.tokens.shape[0] for d in parts), parts[0].tokens.shape[1]]}


def _teacher_rows(n: int, batch: int, half: int) -> tuple[int, int]:
    mid = (n // 2 + batch - 1) // batch * batch   # a batch boundary: the halves see the whole's batches
    return (0, mid) if half == 0 else (mid, n)


def stage_teacher3(p: Paths, cfg: TinyConfig, half: int) -> None:
    """Half the EAGLE-3 teacher cache (heads.teacher_outputs): both lanes compute one half, and the EAGLE-3 stage
    reads them instead of spending a minute of the critical path on the whole."""
    from eaglex.models.target import load_target
    from eaglex.training.heads import teacher_outputs

    sd = SelfDistillData.load(p.work / "selfdistill.pt")
    e3 = cfg.eagle3
    a, b = _teacher_rows(sd.tokens.shape[0], e3.batch, half)
    key = {"target": _target_digest(p.target), "data": digest(sd.tokens, sd.prompt_len), "rows": [a, b],
           "vocab": [e3.draft_vocab_size, e3.loss_on_prompt], "batch": e3.batch}
    key_file = p.work / f"teacher3_{half}.json"
    if cached(key_file, key):
        return
    target = load_target(p.target)
    target, _, t2d = prepare_teacher(target, sd, e3)
    keep = t2d.nonzero().squeeze(1)
    tmp = p.work / f"teacher3_{half}.tmp"
    torch.save(teacher_outputs(target, sd.tokens[a:b], keep, e3.batch), tmp)
    tmp.replace(p.work / f"teacher3_{half}.pt")
    write_key(key_file, key)


def stage_eagle3(p: Paths, cfg: TinyConfig) -> dict:
    from eaglex.models.target import load_target

    target = load_target(p.target)
    sd = SelfDistillData.load(p.work / "selfdistill.pt")
    halves = [torch.load(p.work / f"teacher3_{h}.pt", weights_only=True) for h in (0, 1)]
    cache = tuple(torch.cat(parts) for parts in zip(*halves))
    del halves
    head, config, t2d, losses = train_eagle3(target, sd, cfg.eagle3, target.spec.eos_ids[0], p.work / "eagle3.pt", 1,
                                             cache)
    save_eagle3(head, config, t2d, fresh(p.out / "eagle3"))
    return {"final_loss": _tail(losses)}


def stage_eagle1(p: Paths, cfg: TinyConfig) -> dict:
    from eaglex.models.target import load_target

    target = load_target(p.target)
    sd = SelfDistillData.load(p.work / "selfdistill.pt")
    head, config, losses = train_eagle1(target, sd, cfg.eagle1, target.spec.eos_ids[0], p.work / "eagle1.pt", 1)
    save_eagle1(head, config, fresh(p.out / "eagle1"))
    return {"final_loss": _tail(losses)}


def stage_draft_lm(p: Paths, cfg: TinyConfig) -> dict:
    """The classic draft model: trained on the corpus like the target (corpus_fraction 1: needs no target)."""
    raw, eos = _tokenizer(p)
    streams = torch.load(p.work / "streams.pt", weights_only=True)
    T = cfg.target.seq_len
    sd = (SelfDistillData.load(p.work / "selfdistill.pt") if cfg.draft_lm.corpus_fraction < 1
          else SelfDistillData(torch.zeros(1, T, dtype=torch.long), torch.zeros(1, dtype=torch.long)))
    model, losses = train_draft_lm(cfg.draft_lm, sd, streams["train"], raw.get_vocab_size(), eos,
                                   cfg.target.max_position_embeddings, p.work / "draft_lm.pt", 1)
    save_draft_lm(model, fresh(p.out / "draft_lm"), eos)
    tokenizer.save_tokenizer(raw, p.out / "draft_lm")
    return {"final_loss": _tail(losses), "heldout_loss": round(eval_loss(model, streams["heldout"], 128), 4)}


def stage_tau(p: Paths, cfg: TinyConfig, head: str, shapes: tuple[str, ...] = tuple(SHAPES)) -> list[dict]:
    """τ rows of `head`. The vanilla outputs are computed once per target and prompts and kept in WORK/vanilla.json
    (the first τ stage writes them; the EAGLE-3 halves, which are on the critical path, read them)."""
    prompts = [json.loads(line)["input_ids"] for line in (p.out / "prompts.jsonl").read_text().splitlines()]
    torch.set_num_threads(1)
    key = {"target": _target_digest(p.target), "prompts": prompts, "new_tokens": cfg.eval_new_tokens}
    key_file, vfile = p.work / "vanilla_key.json", p.work / "vanilla.json"
    if cached(key_file, key):
        vanilla = json.loads(vfile.read_text())
    else:
        vanilla = vanilla_outputs(p.target, prompts, cfg.eval_new_tokens)
        write_text(vfile, json.dumps(vanilla))
        write_key(key_file, key)
    rows = tau_table(p.target, {head: p.out / head}, prompts, {s: SHAPES[s] for s in shapes}, cfg.eval_new_tokens,
                     vanilla=vanilla)
    return [asdict(r) for r in rows]


def _target_digest(target_dir: Path) -> str:
    import hashlib
    h = hashlib.sha256()
    for f in sorted(target_dir.glob("*.safetensors")) + [target_dir / "config.json"]:
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def stage_prompts(p: Paths, cfg: TinyConfig) -> None:
    """Held-out prompts (files never trained on), cut at line starts: models/tiny/prompts.jsonl."""
    raw, _ = _tokenizer(p)
    prompts = tokens.line_start_prompts(corpus.load(cfg.corpus, "heldout"), raw, cfg.eval_prompts, cfg.prompt_tokens,
                                      torch.Generator().manual_seed(cfg.seed + 1))
    tokens.write_jsonl_prompts(p.out / "prompts.jsonl", prompts, raw)


def _side_lane_init() -> None:
    torch.set_num_threads(1)
    loop.BAR_POSITION = 1



# ------------------------------------------------------------------------------------------------ the build

def build(out: Path, work: Path, cfg: TinyConfig = TinyConfig()) -> dict:
    p = Paths(out, work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    t_all = time.perf_counter()
    seconds: dict[str, float] = {}
    info: dict[str, object] = {}

    info["corpus"], seconds["tokenizer"] = timed(stage_tokenizer, p, cfg)
    stage_prompts(p, cfg)
    with ProcessPoolExecutor(1, mp_context=get_context("spawn"), initializer=_side_lane_init) as side:
        info["target"], seconds["target"] = timed(stage_target, p, cfg)
        shard1 = side.submit(timed, stage_selfdistill, p, cfg, 1)
        _, seconds["selfdistill"] = timed(stage_selfdistill, p, cfg, 0)
        shard1.result()
        info["selfdistill"] = merge_selfdistill(p)
        teacher3 = side.submit(stage_teacher3, p, cfg, 1)
        _, seconds["teacher_eagle3"] = timed(stage_teacher3, p, cfg, 0)
        teacher3.result()
        draft_lm = side.submit(timed, stage_draft_lm, p, cfg)
        eagle1 = side.submit(timed, stage_eagle1, p, cfg)
        tau1 = side.submit(timed, stage_tau, p, cfg, "eagle1")
        info["eagle3"], seconds["eagle3"] = timed(stage_eagle3, p, cfg)
        # EAGLE-3's τ: the shapes in two halves of about equal cost (the side lane is idle by now)
        shapes = tuple(SHAPES)
        main_half = ("chain:4", "dynamic:16/8/2", "dynamic:60/8/10")
        tau3_side = side.submit(timed, stage_tau, p, cfg, "eagle3", tuple(s for s in shapes if s not in main_half))
        tau3, seconds["tau_eagle3"] = timed(stage_tau, p, cfg, "eagle3", main_half)
        tau3 = sorted(tau3 + tau3_side.result()[0], key=lambda r: shapes.index(r["shape"]))
        info["draft_lm"], seconds["draft_lm (side lane)"] = draft_lm.result()
        info["eagle1"], seconds["eagle1 (side lane)"] = eagle1.result()
        tau1, seconds["tau_eagle1 (side lane)"] = tau1.result()
    rows = [TauRow(**r) for r in tau3 + tau1]
    table = format_table(rows)
    print(table)
    prompt = json.loads((out / "prompts.jsonl").read_text().splitlines()[0])
    sample = _sample(p.target, prompt["input_ids"], cfg.eval_new_tokens)
    seconds["total"] = round(time.perf_counter() - t_all, 1)
    manifest = {
        "python": sys.version.split()[0], "platform": platform.platform(), "cpu": _cpu(),
        "torch": torch.__version__, "threads_per_lane": 1, "target_threads": cfg.target_threads,
        "stdlib": cfg.corpus.root or str(corpus.stdlib_root()),
        **info, "default_tree": DEFAULT_SHAPE,
        "tau": [asdict(r) for r in rows], "tau_table": table,
        "sample": {"prompt": prompt["prompt"], "greedy_continuation": sample},
        "seconds": seconds, "config": asdict(cfg),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    (out / "README.md").write_text(model_card(manifest))
    return manifest


def model_card(m: dict) -> str:
    """models/tiny/README.md from the manifest."""
    t, c, cfg = m["target"], m["corpus"], m["config"]
    tc, e3, e1, lm = cfg["target"], cfg["eagle3"], cfg["eagle1"], cfg["draft_lm"]
    sec = m["seconds"]
    rows = [
        ("target/", f"LlamaForCausalLM: {tc['num_layers']} layers, hidden {tc['hidden_size']}, "
                    f"{tc['num_heads']}/{tc['num_kv_heads']} heads, FFN {tc['intermediate_size']}, "
                    f"{t['params'] / 1e6:.1f} M parameters, byte-level BPE vocabulary {c['vocab_size']}; "
                    f"held-out loss {t['heldout_loss']:.2f} nats/token",
         "save_pretrained (float16 safetensors) + tokenizer"),
        ("eagle3/", f"EAGLE-3 head, training-time test ({e3['ttt_steps']} unrolled steps), draft vocabulary "
                    f"{e3['draft_vocab_size']}; {e3['optim']['steps']} steps × {e3['batch']} sequences "
                    f"({sec['eagle3']:.0f} s)", "official (fc, midlayer.*, norm, lm_head, d2t, t2d)"),
        ("eagle1/", f"EAGLE-1/2 head (feature regression + token loss); {e1['optim']['steps']} steps × "
                    f"{e1['batch']} sequences ({sec['eagle1 (side lane)']:.0f} s)",
         "official (fc, layers.0.*, embed_tokens)"),
        ("draft_lm/", f"{lm['num_layers']}-layer LlamaForCausalLM, same tokenizer, for HF assisted generation",
         "save_pretrained"),
        ("prompts.jsonl", f"{cfg['eval_prompts']} held-out prompts of {cfg['prompt_tokens']} tokens", "eaglex JSONL"),
    ]
    table = "\n".join(["| folder | what | format |", "|---|---|---|"] + [f"| {a} | {b} | {f} |" for a, b, f in rows])
    return f"""# models/tiny: the embedded default (generated by `make tiny`; do not edit)

Trained from the Python {m["python"]} standard library sources ({c["train_files"]} files, {c["train_tokens"]:,}
tokens; {c["heldout_files"]} files held out by path hash, never trained on), seeded, in
{m["seconds"]["total"] / 60:.1f} minutes on 2 CPU cores (the target on two threads, then two one-thread lanes;
torch {m["torch"]}, CPU "{m["cpu"]["model"]}").
Every batch and initialisation is seeded, but the weights are not guaranteed bit for bit across machines (CPU
kernels are chosen by CPU features and round differently, and training amplifies that), so τ can move by about
±0.1 on a rerun elsewhere.

{table}

τ = tokens per target forward, greedy, {cfg["eval_new_tokens"]} new tokens on each held-out prompt; the last column
counts outputs identical to vanilla greedy decoding:

{m["tau_table"]}

Default tree for this model: `{m["default_tree"]}`.

What it shows: real acceptance of heads trained by eaglex's own trainers on a target's own outputs, end to end on
CPU. What it cannot: the target is a {t["params"] / 1e6:.0f} M-parameter model trained for minutes; its greedy text
is Python-like but repetitive, which makes drafting easier than on a real model. Real speedups need real weights.
"""


def _cpu() -> dict:
    """The CPU model and a digest of its feature flags: kernels (hence the last bits of the weights) depend on them."""
    import hashlib
    info = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return {"model": info.get("model name", platform.processor()),
            "flags_sha256": hashlib.sha256(info.get("flags", "").encode()).hexdigest()[:16]}


def _tail(losses: list[float], n: int = 20) -> float:
    return round(sum(losses[-n:]) / len(losses[-n:]), 4)


def _sample(target_dir: Path, prompt: list[int], n: int) -> str:
    """The greedy continuation of `prompt`, decoded, as `eaglex generate` prints it."""
    from eaglex.base.prompts import load_tokenizer
    from eaglex.runtime.generate import VanillaGenerator
    from eaglex.runtime.torch_backend import TorchBackend

    ids = VanillaGenerator(TorchBackend(target_dir)).generate(prompt, n).output_ids
    return load_tokenizer(target_dir).decode(ids)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eaglex.recipe_tiny", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("models/tiny"))
    ap.add_argument("--work", type=Path, default=Path("build/tiny"), help="checkpoints and cached stage outputs")
    args = ap.parse_args(argv)
    m = build(args.out, args.work)
    print(f"[tiny] done in {m['seconds']['total']:.0f} s ({m['seconds']}); models in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
