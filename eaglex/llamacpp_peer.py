"""llama.cpp as a peer in `eaglex bench` (llama-cpp-python), on the weights of the GGUF file the target came from.

Rows: greedy decoding with that file as it is (e.g. Q4_1), with F32 and Q8_0 copies of its weights
(eaglex.models.gguf_derive), and llama-cpp-python's prompt lookup (LlamaPromptLookupDecoding as `draft_model`) on
the F32 copy. Measured like the transformers peers: the same prompt token ids (fed as ids, never re-tokenized), the
same max_new_tokens and stop rules (any EOS id of the target, the context limit), greedy sampling, wall time per
prompt including the prefill (every prompt starts from an empty KV cache), all rows interleaved per prompt in a seeded
order, on the cores of the eaglex rows (n_threads and n_threads_batch). With `baselines` (eaglex vanilla of each
engine, which the bench passes) they run in that same shuffled order, every row records each one's tokens/s
(`alongside`) and a row's speedup is against the first: llama.cpp and eaglex then see the same drifting load of a
shared machine; without them, against llama.cpp's F32 greedy run of the same prompt.

Outputs are compared with eaglex vanilla. The comparison is reported, not enforced: llama.cpp's kernels round
differently from eaglex's, and Q8_0/Q4_x are other weights, so their tokens are expected to drift apart.
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from eaglex.base.errors import ModelError
from eaglex.bench_row import Alongside, Row, interleaved
from eaglex.llamacpp_build import compiled_features
from eaglex.models.gguf import MARKER, default_cache_dir, file_sha256, inspect_gguf, is_gguf_path

INSTALL = 'CMAKE_ARGS="$(python -m eaglex.llamacpp_build)" pip install llama-cpp-python==0.3.36'
NO_AMX = ("CMAKE_ARGS='-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON "
          "-DGGML_AVX512_VNNI=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF' pip install "
          "--force-reinstall --no-cache-dir llama-cpp-python==0.3.36")
# Loads a file and decodes a batch and one token: what the rows do, in a child process (see _crash)
PROBE = ("import sys; from llama_cpp import Llama; n = int(sys.argv[2]); "
         "m = Llama(sys.argv[1], n_ctx=64, n_threads=n, n_threads_batch=n, verbose=False); m.eval([1, 2, 3, 4]); "
         "m.eval([5])")


@dataclass(frozen=True)
class LlamaCppConfig:
    source: Path                        # the GGUF file; its own encoding is one row
    cache_dir: Path                     # where the F32 / Q8_0 copies are kept
    encodings: tuple[str, ...] = ("F32", "Q8_0")
    lookup_tokens: int = 10             # draft tokens per lookup, as the transformers prompt-lookup row
    lookup_ngram: int = 2               # longest n-gram matched (llama-cpp-python's default)


def available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def _marker(target_dir: Path | None) -> dict | None:
    if target_dir is None or not (Path(target_dir) / MARKER).is_file():
        return None
    return json.loads((Path(target_dir) / MARKER).read_text())


def cache_dir(target_dir: Path | None) -> Path:
    """Beside the target folder (`TARGET.llamacpp/`), else the eaglex cache."""
    if target_dir is not None:
        target_dir = Path(target_dir).resolve()
        return target_dir.with_name(target_dir.name + ".llamacpp")
    return default_cache_dir() / "llamacpp"


def resolve(option: str, target_dir: Path | None, gguf_hint: Path | None = None,
            log=lambda line: print(line, file=sys.stderr)) -> LlamaCppConfig | None:
    """The `--llamacpp` option as a config, or None (with one `log` line saying why) when there are no rows to run:
    "off", no GGUF file found (see find_source), or llama_cpp not importable."""
    source = find_source(option, target_dir, gguf_hint, lambda why: log(f"llama.cpp peers: skipped ({why})"))
    if source is None:
        return None
    if not available():
        log(f"llama.cpp peers: skipped (llama-cpp-python is not installed: {INSTALL})")
        return None
    return LlamaCppConfig(source=source, cache_dir=cache_dir(target_dir))


def find_source(option: str, target_dir: Path | None, gguf_hint: Path | None = None, skip=lambda why: None):
    """The GGUF file the llama.cpp rows run, or None (after calling `skip` with the reason) when there is none.

    "off": none. "auto": the file `target_dir` was converted from, found with the marker's sha256: `gguf_hint` (the
    path given on the command line), the marker's file name beside the folder or one level up, or inside the pip
    package of a preset that ships it (eaglex.presets). A FILE.gguf: that file; it must hold the target's weights
    when the marker says which.
    """
    if option == "off":
        return None
    marker = _marker(target_dir)
    if option == "auto":
        if marker is None:
            skip(f"the target {target_dir or '(none)'} was not converted from a GGUF file; pass --llamacpp FILE.gguf")
            return None
        candidates = [gguf_hint] if gguf_hint is not None else []
        folder = Path(target_dir).resolve()
        candidates += [folder.parent / marker["source"], folder.parent.parent / marker["source"]]
        candidates += _packaged(marker["source"])
        found = next((c for c in candidates if c is not None and Path(c).is_file()
                      and Path(c).stat().st_size == marker["size"] and file_sha256(c) == marker["sha256"]), None)
        if found is None:
            skip(f"the target's GGUF file {marker['source']} is not beside {target_dir}; pass --llamacpp FILE.gguf")
            return None
        return Path(found)
    source = Path(option)
    if not is_gguf_path(source):
        raise ModelError(f"--llamacpp takes auto, off or a .gguf file, got {option!r}")
    inspect_gguf(source)
    if marker is not None and file_sha256(source) != marker["sha256"]:
        raise ModelError(f"--llamacpp {source}: not the file {target_dir} was converted from "
                         f"({marker['source']}, sha256 {marker['sha256'][:16]}...)")
    return source


def _packaged(name: str) -> list[Path]:
    """`name` inside the installed pip package of every preset whose target is that file."""
    from eaglex.presets import PRESETS, packaged_file
    out = []
    for p in PRESETS.values():
        if p.package and p.target_repo == name:
            try:
                out.append(packaged_file(*p.package, name))
            except ModelError:                            # the package is not installed
                pass
    return out


def _encoding(path: Path) -> str:
    """The file's encoding as llama.cpp names it (F32, F16, Q8_0, Q4_1, ...), from general.file_type; "source" for
    a file that does not say."""
    from gguf import GGUFReader, Keys, LlamaFileType
    f = GGUFReader(path).fields.get(Keys.General.FILE_TYPE)
    try:
        name = LlamaFileType(int(f.contents())).name if f is not None else "source"
    except ValueError:                                    # a file type newer than the gguf package
        return "source"
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")


def _load(path: Path, n_ctx: int, threads: int, draft=None):
    from llama_cpp import Llama
    # With a draft model llama-cpp-python keeps logits for every row but sizes its score buffer by `logits_all`
    # (n_batch = 512 rows when False): past 512 tokens of context Llama.eval overflows it. logits_all=True sizes it
    # to the context.
    return Llama(str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_gpu_layers=0,
                 draft_model=draft, logits_all=draft is not None, verbose=False)


def _generate(llm, prompt: list[int], limit: int, eos: set[int]) -> tuple[list[int], float]:
    """Greedy tokens after `prompt` (stopping as eaglex does: an EOS id is kept and ends it) and the wall time."""
    t = time.perf_counter()
    llm.reset()     # n_tokens = 0: no KV prefix reuse from the previous prompt (generate would otherwise skip a
    out = []        # shared chat-template prefix), so the prefill is measured in full, like eaglex's
    if limit > 0:
        for tok in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(int(tok))
            if tok in eos or len(out) >= limit:
                break
    return out, time.perf_counter() - t


def _crash(path: Path, threads: int) -> str | None:
    """How llama.cpp died decoding with `path` in a child process, or None when it did not. Some builds crash on
    quantized weights (ggml's AMX kernels on Intel CPUs with AMX, compiled in by -DGGML_NATIVE=ON: an invalid tile
    config, llama.cpp PR #26954); probing first keeps such a crash from taking the whole benchmark down."""
    try:
        r = subprocess.run([sys.executable, "-c", PROBE, str(path), str(threads)], capture_output=True, text=True,
                           timeout=600)
    except subprocess.TimeoutExpired:
        return "no answer in 600 s"
    if r.returncode == 0:
        return None
    if r.returncode < 0:
        return f"killed by signal {-r.returncode}"
    lines = r.stderr.strip().splitlines()
    return lines[-1] if lines else f"exit status {r.returncode}"


def run_llamacpp_peers(cfg: LlamaCppConfig, prompts: list[list[int]], max_new_tokens: int, threads: int,
                       eos_ids, max_context: int, reference: list[list[int]] | None = None,
                       log=lambda line: print(line, file=sys.stderr), baselines=None) -> list[Row]:
    """The llama.cpp rows (see the module docstring) on `threads` cores; outputs compared with `reference`.
    `baselines`: {engine name: (prompt, max_new_tokens) -> (token ids, seconds)}, eaglex vanilla run alongside (see
    the module docstring). A file llama.cpp cannot decode here (see _crash) loses its rows, with one `log` line."""
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    from eaglex.models.gguf_derive import derived_gguf

    sha = file_sha256(cfg.source)
    own = _encoding(cfg.source)
    files = {e: derived_gguf(cfg.source, e, cfg.cache_dir, sha) for e in cfg.encodings if e != own}
    files[own] = cfg.source
    for e, path in list(files.items()):
        why = _crash(path, threads)
        if why is not None:
            log(f"llama.cpp peers: {e} rows skipped (llama.cpp died decoding {path.name}: {why}; if this CPU has "
                f"AMX, rebuild without it: {NO_AMX})")
            del files[e]
    if not files:
        return []
    # prompt lookup evaluates up to lookup_tokens + 1 rows past what it has yielded, and may hold accepted rows it
    # has not yielded yet: room for three such steps past the answer
    n_ctx = max(len(p) for p in prompts) + max_new_tokens + 3 * (cfg.lookup_tokens + 1)
    runs = {("greedy", e): _load(path, n_ctx, threads) for e, path in files.items()}
    base = ("greedy", "F32" if "F32" in files else next(iter(files)))
    lookup = LlamaPromptLookupDecoding(max_ngram_size=cfg.lookup_ngram, num_pred_tokens=cfg.lookup_tokens)
    runs[("prompt-lookup", base[1])] = _load(files[base[1]], n_ctx, threads, draft=lookup)
    eos = set(eos_ids)
    rows = {k: Row("llama.cpp", k[0], "-" if k[0] == "greedy" else f"lookup:{cfg.lookup_tokens}",
                   threads=f"llama.cpp {threads}", device=f"cpu {k[1]}", enforced=False) for k in runs}
    same = {k: 0 for k in runs}
    calls = {k: (lambda p, n, llm=llm: _generate(llm, p, n, eos)) for k, llm in runs.items()}
    for name, call in (baselines or {}).items():
        calls[("eaglex", name)] = call
    if baselines:
        base = ("eaglex", next(iter(baselines)))
    alongside = Alongside()
    for call in calls.values():
        call(prompts[0], 8)                                 # warm-up: allocations, page-in of the weights
    for i, _, results in interleaved(calls, prompts, max_new_tokens, max_context, alongside, baselines):
        for k, r in rows.items():
            ids, sec = results[k]
            r.requests += 1
            r.tokens += len(ids)
            r.seconds += sec
            r.baseline_seconds += results[base][1]
            if reference is not None:
                r.identical &= ids == reference[i]
                same[k] += ids == reference[i]
    if reference is not None:
        for k, r in rows.items():
            why = "" if k[1] == "F32" else f" ({k[1]} weights: expected to differ)"
            r.note = f"{same[k]}/{len(prompts)} prompts identical to eaglex vanilla{why}"
    import llama_cpp
    build = " ".join(compiled_features("system_info: " + llama_cpp.llama_print_system_info().decode(errors="replace")))
    for r in rows.values():
        r.alongside = alongside.rates()
        r.build = build
        vs = "eaglex vanilla, run alongside" if baselines else "llama.cpp greedy " + base[1]
        r.note = "; ".join(filter(None, (r.note, f"e2e: vs {vs}")))
    return list(rows.values())
