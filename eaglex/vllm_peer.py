"""vLLM's CPU build as a peer in `eaglex bench`: vLLM vanilla and vLLM's own EAGLE-3 with our head, on the target's
float32 weights.

vLLM lives in a venv of its own (`make vllm-venv`: it needs a newer transformers than eaglex pins), so each system
is one worker process (eaglex/vllm_worker.py, run by that venv's python) speaking JSON lines over stdin/stdout;
the libraries vLLM wants preloaded come from eaglex/vllm_env.py. The target is the Hugging Face folder eaglex runs
(a GGUF target's cached conversion), copied as float32 under build/vllm/ (`vllm_target`); the head folder is
loaded as it is (speculative_config method "eagle3").

Measured like the llama.cpp peers: the prompts' token ids as they are, eaglex's token budget and EOS ids, greedy,
one request at a time with no prefix cache (every request prefills in full), wall time per request, on the cores
of the eaglex rows (vLLM's OpenMP threads bound to that many cores). EAGLE-3 runs at its fastest K
(num_speculative_tokens): a short sweep over `ks` on the first prompts, each K interleaved prompt by prompt with
vLLM vanilla, keeps the fastest (stated in the row). Then vanilla and the chosen K run in the bench's seeded
shuffled order together with eaglex vanilla of every engine (`baselines`): rows record those rates (`alongside`)
and their e2e speedup is against the first, else against vLLM vanilla. τ is vLLM's own mean acceptance length
(1 + accepted / drafts). After each reply a worker rests SETTLE_S, untimed, so that vLLM's polling after a request
does not slow the row that runs next.

Outputs: EAGLE-3's are compared with vLLM vanilla's (greedy speculative decoding should reproduce them; the counts
are in the row) and vanilla's with eaglex vanilla's (other kernels, expected to drift). Both are reported, never
failing the run. A missing python or a vLLM that does not start leaves the rows out with one line.
"""
from __future__ import annotations

import hashlib
import json
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from eaglex.base.errors import ModelError
from eaglex.bench_row import Alongside, Row, eos_stop, interleaved
from eaglex.vllm_env import ld_preload, preloads

WORKER = Path(__file__).with_name("vllm_worker.py")
INSTALL = "make vllm-venv"
DEFAULT_PYTHON = Path("build/vllm-venv/bin/python")
DEFAULT_KS = "1,2,3,4"
CACHE = Path("build/vllm")
START_TIMEOUT = 1800        # first start on 2 busy cores: ~2 min (torch.compile), more while others run
REQUEST_TIMEOUT = 600
# After a request vLLM's processes keep polling their shared-memory queues for 1 s (sched_yield in a loop,
# vllm/distributed/device_communicators/shm_broadcast.py, busy_loop_s) before they sleep. Interleaved with other
# rows, that polling ran into the next row's request: eaglex vanilla measured beside vLLM ran at a third of its own
# section's rate on 2 cores. So a worker rests this long after each reply, outside every timed window.
SETTLE_S = 1.5


class WorkerError(ModelError):
    """A vLLM worker that did not start, died or answered with an error: its rows are left out."""


@dataclass(frozen=True)
class VllmConfig:
    python: Path                        # the vLLM venv's python
    target: Path                        # Hugging Face folder of the target (float32, see vllm_target)
    head: Path | None = None            # EAGLE-3 head folder; None: vanilla only
    ks: tuple[int, ...] = (1, 2, 3, 4)  # num_speculative_tokens swept; one: no sweep
    sweep_prompts: int = 4
    sweep_tokens: int = 64
    logs: Path = CACHE / "logs"
    worker: Path = WORKER               # the worker script (the tests run a fake that speaks its protocol)
    lib_dirs: tuple[str, ...] | None = None     # where tcmalloc is looked for (None: the system's folders)
    enforce_eager: bool = False
    settle_s: float = SETTLE_S          # rest after each reply (see SETTLE_S)


def parse_ks(text: str | None) -> tuple[int, ...]:
    """"1,2,3,4" as (1, 2, 3, 4) (None: DEFAULT_KS); a ModelError naming the bad item."""
    out = []
    for item in filter(None, (t.strip() for t in (DEFAULT_KS if text is None else text).split(","))):
        if not item.isdigit() or int(item) < 1:
            raise ModelError(f"vLLM speculative tokens {item!r}: write K,K,... with each K >= 1")
        out.append(int(item))
    if not out:
        raise ModelError("no vLLM speculative token counts given (write K,K,...)")
    return tuple(dict.fromkeys(out))


def find_python(option: str | os.PathLike | None, log=lambda line: print(line, file=sys.stderr)) -> Path | None:
    """`--vllm PYTHON` as a path, or None (with one `log` line when it was given but is not there)."""
    if option is None:
        return None
    path = Path(option)
    if not (path.is_file() and os.access(path, os.X_OK)):
        log(f"vLLM peers: skipped (no python at {path}; build vLLM's venv with `{INSTALL}`)")
        return None
    return path


def is_eagle3(head: Path) -> bool:
    """Whether `head` is an EAGLE-3 head (vLLM's eagle3 method): its config says so, or its weights are named
    midlayer.* (the layout eaglex and the official code write)."""
    cfg = json.loads((head / "config.json").read_text()) if (head / "config.json").is_file() else {}
    if any("eagle3" in a.lower() for a in cfg.get("architectures") or []):
        return True
    return any(k.startswith("midlayer.") for f in head.glob("*.safetensors") for k in _safetensors_header(f))


def _safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file: {tensor name: {"dtype", "shape", "data_offsets"}, "__metadata__"}."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n))


def _folder_key(target: Path) -> tuple[str, str]:
    """(name, key) of the cached copy: the GGUF file's name and sha256 when the folder was converted from one
    (models/gguf.py's marker), else the folder's name and its files' paths, sizes and times."""
    from eaglex.models.gguf import MARKER
    marker = target / MARKER
    if marker.is_file():
        m = json.loads(marker.read_text())
        return Path(m["source"]).stem, m["sha256"][:16]
    h = hashlib.sha256(str(target.resolve()).encode())
    for f in sorted(p for p in target.iterdir() if p.is_file()):
        st = f.stat()
        h.update(f"\0{f.name}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return target.name, h.hexdigest()[:16]


def _to_float32(src: Path, dst: Path) -> None:
    """A safetensors file as float32: linked (else copied) when it already is, else every floating tensor cast."""
    dtypes = {v["dtype"] for k, v in _safetensors_header(src).items() if k != "__metadata__"}
    if dtypes <= {"F32", "I64", "I32", "BOOL", "U8", "I8"}:
        try:
            os.link(src, dst)                  # same file system: no second copy of the weights
        except OSError:
            shutil.copy2(src, dst)
        return
    from safetensors.torch import load_file, save_file
    state = load_file(str(src))
    save_file({k: v.float() if v.is_floating_point() else v for k, v in state.items()}, str(dst),
              metadata={"format": "pt"})


def vllm_target(target: Path, cache: Path = CACHE) -> Path:
    """The float32 Hugging Face folder vLLM loads for the eaglex target folder `target`: a copy under
    `cache`/targets/ (safetensors cast to float32 where they are not, config.json saying float32), written once and
    atomically (a hidden sibling, renamed when complete), so that vLLM never sees a half-written folder."""
    target = Path(target)
    if not (target / "config.json").is_file():
        raise ModelError(f"vLLM peers: {target} is not a Hugging Face model folder (no config.json)")
    name, key = _folder_key(target)
    out = cache / "targets" / f"{name}-{key}"
    if out.is_dir():
        return out
    stage = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    try:
        for f in sorted(p for p in target.iterdir() if p.is_file()):
            if f.suffix == ".safetensors":
                _to_float32(f, stage / f.name)
            elif f.name == "config.json":
                cfg = json.loads(f.read_text())
                cfg.pop("torch_dtype", None)
                (stage / f.name).write_text(json.dumps({**cfg, "dtype": "float32"}, indent=2) + "\n")
            else:
                shutil.copy2(f, stage / f.name)
        try:
            os.rename(stage, out)
        except OSError:
            if not out.is_dir():               # else another run finished the same copy first
                raise
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return out


def pick_cpus(threads: int, allowed=None, core_of=None) -> list[int]:
    """`threads` logical CPUs for vLLM's OpenMP threads, one per physical core first (as eaglex counts its threads
    in cores), from this process's affinity. `allowed` / `core_of(cpu)` -> (package, core): for the tests."""
    allowed = sorted(os.sched_getaffinity(0) if allowed is None else allowed)

    def sysfs_core(c):
        topo = Path(f"/sys/devices/system/cpu/cpu{c}/topology")
        try:
            return tuple(topo.joinpath(f).read_text().strip() for f in ("physical_package_id", "core_id"))
        except OSError:
            return c
    core_of = core_of or sysfs_core
    first, rest, seen = [], [], set()
    for c in allowed:
        (rest if core_of(c) in seen else first).append(c)
        seen.add(core_of(c))
    return (first + rest)[:max(1, threads)]


def worker_command(cfg: VllmConfig, model: Path, eos_ids, max_model_len: int, k: int | None = None) -> list[str]:
    """The worker's command line: vanilla, or EAGLE-3 with `k` speculative tokens."""
    cmd = [str(cfg.python), str(cfg.worker), "--model", str(model), "--eos", ",".join(str(int(i)) for i in eos_ids),
           "--max-model-len", str(max_model_len)]
    if k is not None:
        cmd += ["--head", str(cfg.head), "--k", str(k)]
    if cfg.enforce_eager:
        cmd.append("--enforce-eager")
    return cmd


def worker_env(cfg: VllmConfig, threads: int, base: dict | None = None, cpus: list[int] | None = None) \
        -> tuple[dict, list[Path]]:
    """The worker's environment and what it preloads: Intel OpenMP and tcmalloc (eaglex/vllm_env.py), OpenMP bound
    to `threads` cores (vLLM's "auto" would keep one of them for its scheduler), no network (the folders are
    local; vLLM's usage statistics off)."""
    env = dict(os.environ if base is None else base)
    found = preloads(cfg.python, cfg.lib_dirs)
    if found:
        env["LD_PRELOAD"] = ld_preload(found, env.get("LD_PRELOAD"))
    cpus = pick_cpus(threads) if cpus is None else cpus
    env.update({"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus)), "OMP_NUM_THREADS": str(len(cpus)),
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"})
    env.pop("PYTHONPATH", None)         # eaglex's paths must not shadow the vLLM venv's packages
    return env, found


def request_line(ids: list[int], max_new_tokens: int) -> str:
    return json.dumps({"ids": [int(i) for i in ids], "max_new_tokens": int(max_new_tokens)}) + "\n"


def parse_reply(line: str) -> dict:
    """One line from the worker as a dict; a WorkerError for an error reply or a line that is not the protocol."""
    try:
        obj = json.loads(line)
    except ValueError:
        raise WorkerError(f"the vLLM worker wrote {line.strip()[:120]!r}, not a JSON line") from None
    if not isinstance(obj, dict):
        raise WorkerError(f"the vLLM worker wrote {line.strip()[:120]!r}, not a JSON object")
    if "error" in obj:
        raise WorkerError(str(obj["error"]))
    if "ready" not in obj and not (isinstance(obj.get("ids"), list) and isinstance(obj.get("seconds"), (int, float))):
        raise WorkerError(f"the vLLM worker's reply has no ids and seconds: {line.strip()[:120]}")
    return obj


class Worker:
    """One vLLM worker process, started on enter (waiting for its ready line) and stopped on exit."""

    def __init__(self, cmd: list[str], env: dict, log: Path, start_timeout: float = START_TIMEOUT,
                 settle_s: float = 0.0):
        self.cmd, self.env, self.log, self.start_timeout, self.settle_s = cmd, env, log, start_timeout, settle_s
        self.proc = None
        self.info: dict = {}
        self.lines: queue.Queue = queue.Queue()

    def __enter__(self) -> "Worker":
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "w") as f:
            # its own session: vLLM's engine processes go with it when it is stopped
            self.proc = subprocess.Popen(self.cmd, env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=f, text=True, bufsize=1, start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()
        try:
            self.info = parse_reply(self._line(self.start_timeout))
        except WorkerError as e:
            self.__exit__()
            raise WorkerError(f"vLLM did not start ({e}; log {self.log})") from None
        return self

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)                    # end of output: the worker exited

    def _line(self, timeout: float) -> str:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise WorkerError(f"no answer in {timeout:.0f} s") from None
        if line is None:
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            raise WorkerError(f"the worker exited with status {self.proc.returncode}: {self._last_log_line()}")
        return line

    def _last_log_line(self) -> str:
        lines = [x for x in self.log.read_text(errors="replace").splitlines() if x.strip()] if self.log.is_file() \
            else []
        return lines[-1].strip()[:200] if lines else "no output"

    def __exit__(self, *exc) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            self.proc.stdin.close()             # end of requests: the worker shuts vLLM down and exits
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, None)):
                try:
                    os.killpg(self.proc.pid, sig)
                    self.proc.wait(timeout=wait)
                    break
                except (OSError, subprocess.TimeoutExpired):
                    pass

    def generate(self, ids: list[int], n: int) -> dict:
        """One request: {"ids", "seconds", and "drafts" / "accepted" for EAGLE-3}."""
        try:
            self.proc.stdin.write(request_line(ids, n))
            self.proc.stdin.flush()
        except OSError:
            raise WorkerError(f"the vLLM worker is gone ({self._last_log_line()}; log {self.log})") from None
        try:
            reply = parse_reply(self._line(REQUEST_TIMEOUT))
        except WorkerError as e:
            raise WorkerError(f"{e} (log {self.log})") from None
        time.sleep(self.settle_s)               # let vLLM's queue polling end before anything else runs
        return reply


@dataclass
class _Tally:
    """One vLLM system's requests: time, tokens, speculative counts, and agreement with the references."""
    seconds: float = 0.0
    base_seconds: float = 0.0
    tokens: int = 0
    drafts: int = 0
    accepted: int = 0
    same: int = 0                   # identical to its reference (vanilla: eaglex's; EAGLE-3: vLLM vanilla's)
    same_eaglex: int = 0            # EAGLE-3: identical to eaglex vanilla
    requests: int = 0


def _sweep(cfg, make, vanilla: Worker, prompts, tokens, log) -> tuple[int, Worker, str]:
    """The fastest K (speedup over vLLM vanilla, the pair interleaved per prompt in a seeded order), its worker
    (kept running) and a summary of the sweep."""
    results, best, best_worker = {}, None, None
    for k in cfg.ks:
        try:
            w = make(k).__enter__()
        except WorkerError as e:
            log(f"vLLM EAGLE-3 sweep: K={k} dropped ({e})")
            continue
        try:
            w.generate(prompts[0], 8)                        # warm-up
            t_van = t_spec = 0.0
            for i, p in enumerate(prompts):
                pair = [("v", vanilla), ("s", w)]
                random.Random(i).shuffle(pair)
                got = {key: s.generate(p, tokens)["seconds"] for key, s in pair}
                t_van, t_spec = t_van + got["v"], t_spec + got["s"]
            results[k] = t_van / t_spec if t_spec else 0.0
        except WorkerError as e:
            w.__exit__()
            log(f"vLLM EAGLE-3 sweep: K={k} dropped ({e})")
            continue
        if best is None or results[k] > results[best]:
            if best_worker is not None:
                best_worker.__exit__()
            best, best_worker = k, w
        else:
            w.__exit__()
    if best is None:
        raise WorkerError("no K ran")
    return best, best_worker, ", ".join(f"K={k} {s:.2f}x" for k, s in results.items())


def run_vllm_peers(cfg: VllmConfig, prompts: list[list[int]], max_new_tokens: int, threads: int, eos_ids,
                   max_context: int, reference: list[list[int]] | None = None, baselines=None,
                   log=lambda line: print(line, file=sys.stderr)) -> list[Row]:
    """vLLM vanilla and EAGLE-3 rows (see the module docstring) on `threads` cores. `baselines`: {engine name:
    (prompt, n) -> (ids, seconds)}, eaglex vanilla, run in the same shuffled order. `reference`: eaglex vanilla's
    outputs. A worker that fails leaves its rows out with one `log` line; the bench goes on."""
    try:
        return _run(cfg, prompts, max_new_tokens, threads, eos_ids, max_context, reference, baselines, log)
    except WorkerError as e:
        log(f"vLLM peers: rows left out ({e})")
        return []


def _run(cfg, prompts, max_new_tokens, threads, eos_ids, max_context, reference, baselines, log) -> list[Row]:
    eos = set(eos_ids)
    cpus = pick_cpus(threads)
    env, found = worker_env(cfg, threads, cpus=cpus)
    spec = cfg.head is not None
    if spec and not is_eagle3(cfg.head):
        log(f"vLLM EAGLE-3: left out ({cfg.head} is not an EAGLE-3 head); vLLM vanilla only")
        spec = False

    def make(k=None):
        name = f"eagle3-k{k}" if k is not None else "vanilla"
        return Worker(worker_command(cfg, cfg.target, eos_ids, max_context, k), env, cfg.logs / f"vllm-{name}.log",
                      settle_s=cfg.settle_s)

    with make() as vanilla:
        vanilla.generate(prompts[0], 8)                      # warm-up: allocations, page-in of the weights
        workers, chosen, sweep = {"vanilla": vanilla}, None, ""
        if spec:
            try:
                if len(cfg.ks) > 1:
                    sweep_set = prompts[: cfg.sweep_prompts]
                    log(f"vLLM EAGLE-3: sweeping K in {','.join(map(str, cfg.ks))} on {len(sweep_set)} prompts")
                    chosen, w, sweep = _sweep(cfg, make, vanilla, sweep_set, min(cfg.sweep_tokens, max_new_tokens),
                                              log)
                else:
                    chosen, sweep = cfg.ks[0], None
                    w = make(chosen).__enter__()
                workers["eagle3"] = w
            except WorkerError as e:
                log(f"vLLM EAGLE-3: rows left out ({e})")
        try:
            return _measure(cfg, workers, chosen, sweep, found, prompts, max_new_tokens, threads, cpus, eos,
                            max_context, reference, baselines)
        finally:
            if "eagle3" in workers:
                workers["eagle3"].__exit__()


def _measure(cfg, workers, chosen, sweep, found, prompts, max_new_tokens, threads, cpus, eos, max_context,
             reference, baselines) -> list[Row]:
    """The measured run: every vLLM worker and eaglex vanilla per prompt, in a seeded shuffled order."""
    calls = {k: (lambda p, n, w=w: w.generate(p, n)) for k, w in workers.items()}
    for name, b in (baselines or {}).items():
        calls[("eaglex", name)] = b
    first = ("eaglex", next(iter(baselines))) if baselines else None
    for key, call in calls.items():
        if key != "vanilla":                                # vanilla warmed up before the sweep
            call(prompts[0], 8)
    alongside = Alongside()
    tallies = {k: _Tally() for k in workers}
    for i, limit, got in interleaved(calls, prompts, max_new_tokens, max_context, alongside, baselines):
        vanilla_ids = eos_stop(got["vanilla"]["ids"], limit, eos)
        for k, t in tallies.items():
            ids = eos_stop(got[k]["ids"], limit, eos)
            t.requests += 1
            t.tokens += len(ids)
            t.seconds += got[k]["seconds"]
            t.base_seconds += got[first][1] if first else got["vanilla"]["seconds"]
            t.drafts += int(got[k].get("drafts", 0))
            t.accepted += int(got[k].get("accepted", 0))
            ours = reference is not None and ids == reference[i]
            t.same += ours if k == "vanilla" else ids == vanilla_ids
            t.same_eaglex += ours
    info = workers["vanilla"].info
    version = f"vllm {info.get('vllm', '?')} (torch {info.get('torch', '?')})"
    preload = "LD_PRELOAD " + (" ".join(p.name for p in found) if found else "none")
    vs = "eaglex vanilla, run alongside" if baselines else "vLLM vanilla"
    rows = []
    for k, t in tallies.items():
        e3 = k == "eagle3"
        r = Row("vLLM", "eagle3" if e3 else "vanilla", f"K={chosen}" if e3 else "-",
                threads=f"vLLM {threads}", device="cpu float32" + (" +float32 head" if e3 else ""), enforced=False)
        r.requests, r.tokens, r.seconds, r.baseline_seconds = t.requests, t.tokens, t.seconds, t.base_seconds
        r.tau = round((t.drafts + t.accepted) / t.drafts, 3) if e3 and t.drafts else None if e3 else 1.0
        r.alongside = alongside.rates()
        r.build = f"{version}; {preload}; OpenMP on cpus {','.join(map(str, cpus))}"
        ours = f"{t.same_eaglex}/{t.requests} identical to eaglex vanilla" if reference is not None else ""
        if e3:
            own = tallies["vanilla"]
            r.identical = t.same == t.requests
            r.note = "; ".join(filter(None, (
                f"vLLM EAGLE-3 K={chosen}: {t.same}/{t.requests} prompts identical to vLLM vanilla", ours,
                f"{own.seconds / t.seconds:.2f}x its vanilla" if t.seconds else "",
                f"K sweep ({cfg.sweep_prompts} prompts, speedup over vLLM vanilla): {sweep}" if sweep else
                f"K={chosen} given (no sweep)", f"e2e: vs {vs}")))
        else:
            r.identical = reference is None or t.same == t.requests
            r.note = "; ".join(filter(None, (f"vLLM vanilla: {ours} (other kernels: expected to drift)" if ours
                                             else "", f"e2e: vs {vs}")))
        rows.append(r)
    return rows
