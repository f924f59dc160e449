"""llama.cpp's own EAGLE-3 as a peer in `eaglex bench`: llama-server with and without the head, per target encoding.

Targets: the GGUF file the eaglex target came from (e.g. the packaged Q4_1), an F32 copy of its weights
(eaglex.models.gguf_derive) and a Q8_0 file made from that F32 copy by llama-quantize; the head is written by
`eaglex export --to llama.cpp` (export/llamacpp.py): F32 for the F32 target, Q8_0 (llama-quantize) for the
quantized ones, as eaglex's int8 engine quantizes its head too. Every server runs on loopback with the eaglex
rows' thread count (-t/-tb, and -td/-tbd for the draft), one slot, no prompt cache; every request is
`POST /completion` with the prompt as eaglex's token ids, temperature 0 and eaglex's token budget.

EAGLE-3 runs at its best measured draft settings: per encoding, a short sweep over DRAFT n-max / p-min settings
(--spec-draft-n-max / --spec-draft-p-min), each interleaved prompt by prompt with that encoding's vanilla server,
keeps the fastest; then the measured run interleaves every server with eaglex vanilla of each engine (the
`baselines`; every row records their tokens/s as `alongside`), prompt by prompt in a seeded order. τ is tokens per
target forward, from llama.cpp's per-request timings (see `tau`).
Outputs are compared, not enforced: a vanilla row with eaglex vanilla, an EAGLE-3 row with its own vanilla.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from eaglex import loopback
from eaglex.base.errors import ModelError
from eaglex.bench_row import Alongside, Row, eos_stop, interleaved
from eaglex.llamacpp_build import compiled_features

BUILD = "tools/build_llamacpp.sh"
DEFAULT_BIN = Path("build/llama.cpp/bin")
# n-max 2..8 x p-min 0 / 0.5 / 0.75: where llama.cpp's EAGLE-3 peaked on this model's targets
DEFAULT_SWEEP = "2/0,4/0,8/0,2/0.5,4/0.5,8/0.5,2/0.75,4/0.75,8/0.75"


@dataclass(frozen=True)
class Draft:
    n_max: int          # --spec-draft-n-max: longest chain drafted per target forward
    p_min: float        # --spec-draft-p-min: drafting stops below this draft probability

    def __str__(self) -> str:
        return f"n-max {self.n_max} / p-min {self.p_min:g}"


@dataclass(frozen=True)
class ServerPeerConfig:
    bin_dir: Path                       # holds llama-server and llama-quantize
    source: Path                        # the target's GGUF file; its own encoding is one target
    head: Path                          # EAGLE-3 head folder
    cache_dir: Path                     # derived targets, GGUF heads, server logs
    encodings: tuple[str, ...] = ("F32", "Q8_0")
    drafts: tuple[Draft, ...] = ()      # the sweep; one setting: no sweep
    sweep_prompts: int = 4
    sweep_tokens: int = 64


def parse_drafts(text: str | None) -> tuple[Draft, ...]:
    """"N/P,N/P,..." (n-max / p-min) as Drafts, None: DEFAULT_SWEEP; a ModelError naming the bad item."""
    out = []
    for item in filter(None, (t.strip() for t in (DEFAULT_SWEEP if text is None else text).split(","))):
        n, sep, p = item.partition("/")
        try:
            d = Draft(int(n), float(p) if sep else 0.0)
        except ValueError:
            d = None
        if d is None or d.n_max < 1 or not 0.0 <= d.p_min <= 1.0:
            raise ModelError(f"llama.cpp draft setting {item!r}: write N/P, n-max N >= 1 and p-min 0 <= P <= 1")
        out.append(d)
    if not out:
        raise ModelError("no llama.cpp draft settings given (write N/P,N/P,...)")
    return tuple(dict.fromkeys(out))


def tau(generated: int, accepted: int) -> float:
    """Tokens per target forward of one request: the prefill yields the first token; each later forward yields
    one token plus the draft tokens it accepted (a forward without a draft accepts none), so the forwards after
    the prefill number generated - 1 - accepted."""
    forwards = generated - 1 - accepted
    return (generated - 1) / forwards if forwards > 0 else 1.0


def find_bin(option: str, log=lambda line: print(line, file=sys.stderr)) -> Path | None:
    """The folder holding llama-server and llama-quantize: `option` "auto" (build/llama.cpp/bin, else PATH), a
    folder, or "off" (None). None with one `log` line when they are not there."""
    if option == "off":
        return None
    if option == "auto":
        on_path = shutil.which("llama-server")
        folder = DEFAULT_BIN if (DEFAULT_BIN / "llama-server").is_file() else Path(on_path).parent if on_path else None
    else:
        folder = Path(option)
    if folder is None or not all((folder / b).is_file() for b in ("llama-server", "llama-quantize")):
        log(f"llama.cpp EAGLE-3 peers: skipped (no llama-server and llama-quantize in {folder or option}; build them "
            f"with {BUILD}, about 15 minutes once)")
        return None
    return folder


def _quantize(bin_dir: Path, src: Path, out: Path, kind: str) -> Path:
    """`src` as `kind` (e.g. Q8_0) by llama-quantize, cached at `out` and written atomically."""
    if out.is_file():
        return out
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    r = subprocess.run([str(bin_dir / "llama-quantize"), str(src), str(tmp), kind], capture_output=True, text=True)
    if r.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        lines = (r.stderr or r.stdout).strip().splitlines()
        raise ModelError(f"llama-quantize {src.name} {kind} failed: {lines[-1] if lines else r.returncode}")
    os.replace(tmp, out)
    return out


class Server:
    """One llama-server on loopback, started on enter and stopped on exit; `complete` runs one request."""

    def __init__(self, bin_dir: Path, target: Path, threads: int, n_ctx: int, log: Path,
                 head: Path | None = None, draft: Draft | None = None):
        self.port = loopback.free_port()
        self.cmd = [str(bin_dir / "llama-server"), "-m", str(target), "--host", "127.0.0.1", "--port",
                    str(self.port), "-t", str(threads), "-tb", str(threads), "-c", str(n_ctx), "-np", "1"]
        if head is not None:
            self.cmd += ["-md", str(head), "--spec-type", "draft-eagle3", "--spec-draft-n-max", str(draft.n_max),
                         "--spec-draft-p-min", str(draft.p_min), "-td", str(threads), "-tbd", str(threads)]
        self.log = log
        self.proc = None

    def __enter__(self) -> "Server":
        self.proc = loopback.start(self.cmd, self.port, self.log, "llama-server", 300)
        return self

    def __exit__(self, *exc) -> None:
        loopback.stop(self.proc)

    def complete(self, prompt: list[int], limit: int) -> tuple[list[int], float, dict]:
        """Greedy tokens after the token ids `prompt` (at most `limit`), the request's wall time, its timings."""
        body = {"prompt": prompt, "n_predict": limit, "temperature": 0.0, "cache_prompt": False,
                "return_tokens": True, "stream": False}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        t = time.perf_counter()
        with urllib.request.urlopen(req, timeout=600) as r:
            out = json.loads(r.read())
        return [int(i) for i in out["tokens"]], time.perf_counter() - t, out.get("timings", {})


@dataclass
class _Tally:
    """One server's requests: time, tokens, draft counts, and agreement with its reference."""
    seconds: float = 0.0
    base_seconds: float = 0.0
    tokens: int = 0
    after_first: int = 0            # generated - 1, summed
    accepted: int = 0
    same: int = 0
    requests: int = 0

    def add(self, ids, sec, timings, base_sec, reference) -> None:
        self.seconds += sec
        self.base_seconds += base_sec
        self.tokens += len(ids)
        n = int(timings.get("predicted_n", len(ids)))
        self.after_first += max(n - 1, 0)
        self.accepted += int(timings.get("draft_n_accepted", 0))
        self.same += reference is not None and ids == reference
        self.requests += 1

    @property
    def tau(self) -> float:
        return tau(self.after_first + 1, self.accepted)


def _sweep(bin_dir, target, head, drafts, prompts, tokens, threads, n_ctx, logs, log) -> tuple[Draft, str]:
    """The fastest draft setting on `target` (speedup over its vanilla, interleaved per prompt) and a summary."""
    if len(drafts) == 1:
        return drafts[0], f"{drafts[0]} (given)"
    results = {}
    with Server(bin_dir, target, threads, n_ctx, logs / f"{target.stem}-vanilla-sweep.log") as vanilla:
        vanilla.complete(prompts[0], 8)
        for d in drafts:
            try:
                with Server(bin_dir, target, threads, n_ctx, logs / f"{target.stem}-{d.n_max}-{d.p_min:g}.log",
                            head, d) as spec:
                    spec.complete(prompts[0], 8)
                    t_van = t_spec = 0.0
                    for i, p in enumerate(prompts):
                        pair = [("v", vanilla), ("s", spec)]
                        random.Random(i).shuffle(pair)
                        got = {k: s.complete(p, tokens)[1] for k, s in pair}
                        t_van, t_spec = t_van + got["v"], t_spec + got["s"]
                    results[d] = t_van / t_spec
            except ModelError as e:
                log(f"llama.cpp EAGLE-3 sweep on {target.name}: {d} dropped ({e})")
    if not results:
        raise ModelError(f"no EAGLE-3 draft setting ran on {target.name}")
    best = max(results, key=results.get)
    return best, ", ".join(f"{d.n_max}/{d.p_min:g} {s:.2f}x" for d, s in results.items())


def run_server_peers(cfg: ServerPeerConfig, prompts: list[list[int]], max_new_tokens: int, threads: int,
                     eos_ids, max_context: int, reference: list[list[int]] | None = None, baselines=None,
                     log=lambda line: print(line, file=sys.stderr)) -> list[Row]:
    """Vanilla and EAGLE-3 rows per target encoding (see the module docstring). `baselines`: {engine name:
    (prompt, n) -> (ids, seconds)}, eaglex vanilla, run in the same interleaved order; rows' speedups are against
    the first (else against each encoding's llama.cpp vanilla). `reference`: eaglex vanilla's outputs."""
    from gguf import GGUFReader, Keys, LlamaFileType

    from eaglex.export.llamacpp import write_eagle3_gguf
    from eaglex.models.gguf import file_sha256
    from eaglex.models.gguf_derive import derived_gguf

    f = GGUFReader(cfg.source).fields.get(Keys.General.FILE_TYPE)
    own = LlamaFileType(int(f.contents())).name.removeprefix("MOSTLY_").removeprefix("ALL_") if f else "source"
    sha = file_sha256(cfg.source)
    targets = {}
    if "F32" in cfg.encodings or "Q8_0" in cfg.encodings:
        f32 = cfg.source if own == "F32" else derived_gguf(cfg.source, "F32", cfg.cache_dir, sha)
        targets["F32"] = f32
        if "Q8_0" in cfg.encodings and own != "Q8_0":
            targets["Q8_0"] = _quantize(cfg.bin_dir, f32, cfg.cache_dir / f"{f32.stem}.llama-quantize.Q8_0.gguf",
                                        "Q8_0")
    targets[own] = cfg.source
    targets = {e: p for e, p in targets.items() if e in cfg.encodings or e == own}
    head32 = write_eagle3_gguf(cfg.head, cfg.source, cfg.cache_dir / f"{cfg.head.resolve().name}.eagle3.F32.gguf")
    head8 = _quantize(cfg.bin_dir, head32, cfg.cache_dir / f"{head32.stem.removesuffix('.F32')}.Q8_0.gguf", "Q8_0")
    heads = {e: head32 if e == "F32" else head8 for e in targets}

    eos = set(eos_ids)
    n_ctx = max(len(p) for p in prompts) + max_new_tokens + max(d.n_max for d in cfg.drafts) + 16
    logs = cfg.cache_dir / "logs"
    sweep_set = prompts[: cfg.sweep_prompts]
    chosen, sweeps = {}, {}
    for e, path in targets.items():
        if len(cfg.drafts) > 1:
            log(f"llama.cpp EAGLE-3 on {e}: sweeping {len(cfg.drafts)} draft settings on {len(sweep_set)} prompts")
        try:
            chosen[e], sweeps[e] = _sweep(cfg.bin_dir, path, heads[e], cfg.drafts, sweep_set,
                                          min(cfg.sweep_tokens, max_new_tokens), threads, n_ctx, logs, log)
        except ModelError as err:
            log(f"llama.cpp EAGLE-3 on {e}: rows left out ({err})")
    rows: dict[tuple[str, str], Row] = {}
    tallies: dict[tuple[str, str], _Tally] = {}
    with ExitStack() as stack:
        servers = {}
        for e, path in targets.items():
            try:
                servers[(e, "vanilla")] = stack.enter_context(
                    Server(cfg.bin_dir, path, threads, n_ctx, logs / f"{path.stem}-vanilla.log"))
                if e in chosen:
                    servers[(e, "eagle3")] = stack.enter_context(
                        Server(cfg.bin_dir, path, threads, n_ctx, logs / f"{path.stem}-eagle3.log", heads[e],
                               chosen[e]))
            except ModelError as err:
                log(f"llama.cpp {e}: rows left out ({err})")
        calls = {k: (lambda p, n, s=s: s.complete(p, n)) for k, s in servers.items()}
        for name, b in (baselines or {}).items():
            calls[("eaglex", name)] = lambda p, n, b=b: (*b(p, n), {})
        first = ("eaglex", next(iter(baselines))) if baselines else None
        alongside = Alongside()
        for call in calls.values():
            call(prompts[0], 8)                              # warm-up: allocations, page-in of the weights
        tallies = {k: _Tally() for k in servers}
        for i, limit, got in interleaved(calls, prompts, max_new_tokens, max_context, alongside, baselines):
            for (e, method), t in tallies.items():
                ids, sec, timings = got[(e, method)]
                ids = eos_stop(ids, limit, eos)
                base = got[first][1] if first else got[(e, "vanilla")][1]
                ref = (reference[i] if reference is not None else None) if method == "vanilla" else \
                    eos_stop(got[(e, "vanilla")][0], limit, eos)
                t.add(ids, sec, timings, base, ref)
    # llama-server logs its system_info only at higher verbosity; else the cmake flags tools/build_llamacpp.sh stored
    flags = cfg.bin_dir / "flags"
    built = f"cmake {flags.read_text().strip()}" if flags.is_file() else ""
    builds = {k: " ".join(compiled_features(s.log.read_text(errors="replace"))) or built for k, s in servers.items()}
    for (e, method), t in tallies.items():
        spec = method == "eagle3"
        r = Row("llama.cpp", "eagle3" if spec else "vanilla", str(chosen[e]) if spec else "-",
                threads=f"llama.cpp {threads}", device=f"cpu {e}" + (f" +{'F32' if e == 'F32' else 'Q8_0'} head"
                                                                      if spec else ""), enforced=False)
        r.requests, r.tokens, r.seconds, r.baseline_seconds = t.requests, t.tokens, t.seconds, t.base_seconds
        r.tau = round(t.tau, 3) if spec else 1.0
        r.alongside = alongside.rates()
        r.build = builds.get((e, method), "")
        vs = "eaglex vanilla, run alongside" if baselines else f"llama.cpp vanilla {e}"
        if spec:
            own_v = tallies[(e, "vanilla")]
            r.identical = t.same == t.requests
            r.note = (f"llama-server; {t.same}/{t.requests} prompts identical to llama.cpp vanilla {e}; "
                      f"{own_v.seconds / t.seconds:.2f}x its vanilla; draft sweep ({cfg.sweep_prompts} prompts, "
                      f"speedup over its vanilla): {sweeps[e]}; e2e: vs {vs}")
        else:
            why = "" if e == "F32" else f" ({e} weights: expected to differ)"
            same = f"{t.same}/{t.requests} prompts identical to eaglex vanilla{why}; " if reference is not None else ""
            r.identical = reference is None or t.same == t.requests
            r.note = f"llama-server; {same}e2e: vs {vs}"
        rows[(e, method)] = r
    return list(rows.values())
