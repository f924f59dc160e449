"""Load benchmark of the deployment (`make bench-serve`): a loopback client against the supervised server
(eaglex.serving, what `eaglex serve start` runs), closed-loop at fixed concurrencies with a fixed number of
requests per row, for each deployment (all started at once; at each concurrency the deployments take turns, each
`--repeats` times, so that drift on a busy machine hits them alike, and each row reports its median run):

- vanilla: in-flight batching without drafting (`eaglex triton --vanilla --max-batch N`);
- eagle:   in-flight batching with the engine's batch schedule (`eaglex triton --max-batch N`, the default);
- single:  one instance serving one request at a time (`--max-batch 0`, the deployment before batching).

Every request streams (generate_stream, token ids in, greedy, fp32 engine) so that time to first token and time per
output token are measured per request; every output is compared with the prompt decoded alone by vanilla decoding
in this process (column `exact`: the fraction equal, which lossless decoding makes 1.0). Mixed in (unless
--no-mix): per 8 requests of a row, one bad request (empty text, top_p 1.5, a token id outside the vocabulary,
negative max_tokens), which must be refused with no tokens, and one client that hangs up after its first tokens,
which the server must cancel; neither counts in the row's figures, and neither may change another request's output.

Per row: aggregate tokens/s (the median of the repeats; every repeat's figure is kept in the JSON), per-request
tokens/s (mean), TTFT and TPOT p50/p99, request latency p99, mean accepted length (tokens per target verification),
the speculation the server runs at that concurrency, errors, bad requests refused, hang-ups. Writes JSON and a PNG
(tokens/s and p99 latency against concurrency; needs matplotlib: pip install -e '.[bench]') and prints a markdown
table with the speedup of eagle over vanilla batching at each concurrency. Exit 1 when an output differs, a normal
request fails or a bad one is not refused.

With --aiperf PATH (NVIDIA's AIPerf, `make bench-serve` installs it in a venv of its own), each row is also measured
by AIPerf against the OpenAI API (/v1/chat/completions, streaming, greedy through `--extra-inputs temperature:0`,
synthetic prompts of --aiperf-input-tokens, --max-tokens per answer), right after our client's runs of that row and
taking the same turns between deployments: its TTFT p99, inter-token latency (mean, p99), output tokens/s and
requests/s go into the row next to ours (columns aiperf_*). Both count the tokens the server generated (AIPerf with
--use-server-token-count: the answer's `usage`, since re-tokenizing text cannot see the chat template the server
applies). They still differ in what they send and time: AIPerf's prompts are its own synthetic text through the
chat template (longer than ours, which are token ids without a template), its requests go through the OpenAI front's
conversion, its throughput divides by its whole benchmark window, and it runs one pass per row (ours: the median of
--repeats).

With --llamacpp-server and --vllm (need --aiperf; `make bench-serve` passes both when they are built), the peers'
own servers take their turn after eaglex's deployments at each concurrency, measured by AIPerf alone in the same
settings (eaglex/serve_peers.py: llama-server with as many slots as the largest concurrency, F32 target, vanilla
and its EAGLE-3 with the engine's head; `vllm serve` vanilla and EAGLE-3): rows of their own (column `peer`), a
table of eaglex's best row over the best peer row per concurrency (JSON `vs_peers`). A peer's failure is reported
in its row and does not fail the run.

With --chaos (needs --aiperf; `make bench-serve` runs it last, --chaos-only runs nothing else), the EAGLE-batched
deployment is hurt under load, twice: an AIPerf run (streamed chat, --chaos-concurrency 16, request timeout
--chaos-deadline) with our client's greedy streams alongside (--chaos-clients, each output compared token by token
with vanilla decoding); once AIPerf's requests are in the server (its batch gauges show more than ours) and
--chaos-delay seconds more, `kill -9` of tritonserver (the supervisor restarts it), then in a second run of the
model's Python stub (the supervisor reloads the model). The goal: every request completes exactly or fails with a
clean 5xx / error event, none hangs (longer than the deadline), and a short greedy probe, sent one at a time from the
kill on, is served exactly within 30 s. Per run the JSON (`chaos`) keeps AIPerf's completed / errored / hung requests
and its distinct errors (read from its per-request export, profile_export.jsonl, in --chaos-dir), whether and how
AIPerf exited, our client's outcomes, the recovery seconds and the supervisor's restarts, reloads and events; a
table is printed, and a hang, a wrong or unclean answer, a recovery over 30 s or an AIPerf that does not exit makes
the exit status 1.

    python -m eaglex.bench_serve --engine engines/tiny [--concurrency 1,2,4,8,16,32] [--requests 2x] \
        [--max-tokens 64] [--repeats 3] [--no-mix] [--modes vanilla,eagle,single] [--out build/bench_serve.json] \
        [--plot build/bench_serve.png] [--aiperf build/aiperf-venv/bin/aiperf [--chaos | --chaos-only]
        [--llamacpp-server build/llama.cpp/bin] [--vllm build/vllm-venv/bin/python]]

One module of ~890 lines on purpose: the deployments it starts (the peers' come from eaglex/serve_peers.py), the
AIPerf driver and the chaos phase share one run's processes and one table; nothing imports it but its tests.
"""
from __future__ import annotations

import argparse
import http.client
import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from datetime import datetime, timezone
from pathlib import Path

from eaglex.base.errors import ModelError
from eaglex.engines.tune import tune_batching
from eaglex.llamacpp_peer import cache_dir as llamacpp_cache
from eaglex.llamacpp_peer import find_source
from eaglex.llamacpp_server import find_bin, parse_drafts
from eaglex.runtime.batch import Schedule
from eaglex.runtime.engine import open_engine
from eaglex.runtime.manifest import MANIFEST, read_manifest
from eaglex.runtime.ort_session import physical_cores
from eaglex.serve_peers import (
    LLAMACPP_DRAFT,
    VLLM_K,
    PeerServer,
    left_out,
    llamacpp_peers,
    peers_markdown,
    str_draft,
    vllm_peers,
    vs_peers,
)
from eaglex.serving import control
from eaglex.serving.config import SERVER_LOG, SUPERVISOR_LOG, ServeConfig
from eaglex.serving.processes import stubs
from eaglex.serving.repository import write_repository

TEXTS = ["The quick brown fox", "Once upon a time there was a", "In the beginning", "Write a story about a cat",
         "Explain gravity to a child:", "The best way to learn is", "Speculative decoding works by",
         "My favourite food is", "The history of the city", "How do computers work?", "A poem about the sea:",
         "Tomorrow the weather will be"]
MODES = ("vanilla", "eagle", "single")


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(q / 100 * (len(v) - 1))))]


def stream_request(port: int, model: str, body: dict, timeout: float = 300, hang_up: bool = False) -> dict:
    """One generate_stream request through the front -> times, tokens, stats or error. `hang_up`: close the
    connection after the first tokens arrive, as a client that goes away (the server must cancel the request).
    How it ended: `status` (the HTTP status; None when no answer came), `finish` (the final event's finish_reason),
    `error_event` (an error event ended the stream), `timed_out` (no byte for `timeout` seconds)."""
    body = json.dumps({**body, "stream": True}).encode()
    out = {"ids": [], "t0": time.perf_counter(), "first": None, "end": None, "error": None, "cycles": 0,
           "status": None, "finish": None, "error_event": False, "timed_out": False}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", f"/v2/models/{model}/generate_stream", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        out["status"] = r.status
        if r.status != 200:
            out["error"] = f"{r.status} {r.read().decode(errors='replace')[:200]}"
            return out
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            if "error" in event:
                out["error"], out["error_event"] = event["error"], True
                break
            if event.get("finish_reason"):
                out["finish"] = event["finish_reason"]
            ids_ = event.get("output_ids")
            if ids_ is not None:
                got = [ids_] if isinstance(ids_, int) else list(ids_)
                if got and out["first"] is None:
                    out["first"] = time.perf_counter()
                out["ids"] += got
                if hang_up and out["ids"]:
                    break
            if "cycles" in event:
                out["cycles"] = int(event["cycles"])
    except (OSError, http.client.HTTPException, ValueError) as e:
        out["error"], out["timed_out"] = f"{type(e).__name__}: {e}", isinstance(e, TimeoutError)
    finally:
        out["end"] = time.perf_counter()
        conn.close()
    return out


# Requests the server must refuse with an error and no tokens, whatever else it is decoding.
BAD_BODIES = ({"text_input": "", "max_tokens": 8}, {"input_ids": [1, 2, 3], "max_tokens": 8, "top_p": 1.5},
              {"input_ids": [10 ** 9], "max_tokens": 8}, {"input_ids": [1, 2, 3], "max_tokens": -1})


def request_kinds(n: int, mix: bool) -> list[str]:
    """The row's request sequence: n normal requests, and with `mix` one bad request and one client that hangs
    up after its first tokens per 8 normal ones (at least one each), spread among them."""
    kinds = ["ok"] * n
    if mix:
        extra = max(1, n // 8)
        for j in range(extra):                      # from the back, so that earlier insert positions hold
            at = (extra - j) * n // (extra + 1)
            kinds[at:at] = ["bad", "hangup"]
    return kinds


def run_row(port: int, model: str, prompts: list[list[int]], want: list[list[int]], concurrency: int, n: int,
            max_tokens: int, mix: bool = True) -> dict:
    """n requests, `concurrency` clients each sending its next request when the last one finished (and with `mix`,
    bad requests and hang-ups among them: request_kinds). Throughput, latency and exactness count the n."""
    kinds, lock, records, extras = request_kinds(n, mix), threading.Lock(), [], []
    todo = iter(enumerate(kinds))
    normal = itertools.count()

    def client():
        while True:
            with lock:
                j, kind = next(todo, (None, None))
                i = next(normal) if kind == "ok" else j
            if kind is None:
                return
            if kind == "ok":
                rec = stream_request(port, model, {"input_ids": prompts[i % len(prompts)], "max_tokens": max_tokens})
            elif kind == "bad":
                rec = stream_request(port, model, BAD_BODIES[j % len(BAD_BODIES)])
            else:
                rec = stream_request(port, model, {"input_ids": prompts[j % len(prompts)], "max_tokens": max_tokens},
                                     hang_up=True)
            rec["index"], rec["kind"] = i, kind
            with lock:
                (records if kind == "ok" else extras).append(rec)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(client) for _ in range(concurrency)]:
            f.result()
    wall = time.perf_counter() - t0
    ok = [r for r in records if r["error"] is None]
    tokens = sum(len(r["ids"]) for r in ok)
    ttft = [r["first"] - r["t0"] for r in ok if r["first"] is not None]
    tpot = [(r["end"] - r["first"]) / (len(r["ids"]) - 1) for r in ok if r["first"] is not None and len(r["ids"]) > 1]
    latency = [r["end"] - r["t0"] for r in ok]
    cycles = sum(r["cycles"] for r in ok)
    exact = sum(r["ids"] == want[r["index"] % len(want)] for r in ok)
    ms = lambda v: None if v is None else round(1000 * v, 2)  # noqa: E731
    bad = [r for r in extras if r["kind"] == "bad"]
    return {"concurrency": concurrency, "requests": n, "served": len(ok), "errors": len(records) - len(ok),
            "bad_requests": len(bad), "bad_refused": sum(r["error"] is not None and not r["ids"] for r in bad),
            "hangups": sum(r["kind"] == "hangup" for r in extras),
            "error_sample": next((r["error"] for r in records if r["error"]), None),
            "tokens": tokens, "seconds": round(wall, 3), "tokens_per_s": round(tokens / wall, 1),
            "per_request_tokens_per_s": round(statistics.mean(len(r["ids"]) / (r["end"] - r["t0"]) for r in ok), 1)
            if ok else None,
            "ttft_p50_ms": ms(percentile(ttft, 50)), "ttft_p99_ms": ms(percentile(ttft, 99)),
            "tpot_p50_ms": ms(percentile(tpot, 50)), "tpot_p99_ms": ms(percentile(tpot, 99)),
            "latency_p99_s": None if not latency else round(percentile(latency, 99), 3),
            # tokens per target verification; the prefill's first token is not a cycle's
            "mean_accepted": round((tokens - len(ok)) / cycles, 3) if cycles else None,
            "exact": round(exact / len(ok), 4) if ok else None}


def speculation(engine, mode: str, concurrency: int, max_batch: int) -> str:
    """What the server decodes with at this concurrency (the schedule's pick; alone: the engine's own tree)."""
    if mode == "vanilla":
        return "off"
    if mode == "single" or concurrency == 1:
        return f"on ({engine.tree})" if engine.tree is not None else "off"
    tree = engine.batch_schedule().tree(min(concurrency, max_batch))
    return f"on ({tree})" if tree is not None else "off"


def serve_mode(args, mode: str, work: Path):
    repo = work / mode / "repo"
    write_repository(args.engine, repo, "eaglex", instances=1, threads=args.threads,
                     max_queue_size=max(64, 2 * max(args.concurrency + [args.chaos_concurrency])),
                     method="vanilla" if mode == "vanilla" else "default",
                     max_batch=0 if mode == "single" else args.max_batch, max_context=args.max_context,
                     force=True)
    return control.start(ServeConfig(str(repo), str(work / mode), http_port=0, grpc_port=0, metrics_port=0,
                                     exit_timeout=20, ready_timeout=300))


AIPERF_METRICS = {"time_to_first_token": ("ttft", ("p99", "avg")), "inter_token_latency": ("itl", ("avg", "p99")),
                  "output_token_throughput": ("output_tokens_per_s", ("avg",)),
                  "request_throughput": ("requests_per_s", ("avg",)),
                  "request_latency": ("latency", ("p99",))}


def aiperf_command(aiperf: str, tokenizer: Path, port: int, concurrency: int, n: int, args, out: Path,
                   warmup: int = 1) -> list[str]:
    """AIPerf's command line: n streamed greedy chat requests at `concurrency`, artifacts in `out`. Without AIPerf's
    scraping of the server's /metrics (we read our own): one service fewer on a small host, whose missed heartbeats
    under load void a whole run ("ProducerReaped")."""
    out.mkdir(parents=True, exist_ok=True)
    return [aiperf, "profile", "-m", "eaglex", "--tokenizer", str(tokenizer), "--endpoint-type", "chat",
            "--no-server-metrics",
            "--streaming", "--url", f"127.0.0.1:{port}", "--concurrency", str(concurrency), "--request-count", str(n),
            "--random-seed", "123", "--synthetic-input-tokens-mean", str(args.aiperf_input_tokens),
            "--synthetic-input-tokens-stddev", "0", "--output-tokens-mean", str(args.max_tokens),
            "--output-tokens-stddev", "0", "--extra-inputs", "temperature:0", "--use-server-token-count",
            "--artifact-dir", str(out)] + (["--warmup-request-count", str(warmup)] if warmup else [])


def aiperf_row(aiperf: str, tokenizer: Path, port: int, concurrency: int, n: int, args, out: Path) -> dict:
    """One AIPerf run against /v1/chat/completions -> {aiperf_ttft_p99_ms, aiperf_itl_avg_ms, ...} (or
    aiperf_error)."""
    cmd = aiperf_command(aiperf, tokenizer, port, concurrency, n, args, out)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    try:
        data = json.loads((out / "profile_export_aiperf.json").read_text())
    except (OSError, ValueError):
        data = None
    if r.returncode != 0 or data is None:
        return {"aiperf_error": (r.stderr or r.stdout)[-800:] or f"exit {r.returncode}"}
    metrics = data.get("records", data) if isinstance(data, dict) else {}
    row = {}
    for key, (name, stats) in AIPERF_METRICS.items():
        m = metrics.get(key) or {}
        unit = m.get("unit", "")
        for stat in stats:
            v = m.get(stat)
            if v is None:
                continue
            suffix = "_ms" if unit == "ms" else "_s" if unit in ("s", "sec") else ""
            row[f"aiperf_{name}_{stat}{suffix}" if name in ("ttft", "itl", "latency") else f"aiperf_{name}"] = \
                round(float(v), 2)
    row["aiperf_requests"] = n
    return row


def peer_deployments(args, manifest: dict) -> list:
    """The peers asked for (--llamacpp-server, --vllm) on the engine's own target and head (its manifest's
    sources), each left out with one line when what it needs is not here."""
    sources = manifest.get("sources") or {}
    target = Path(sources["target"]["path"]) if sources.get("target") else None
    head = Path(sources["draft"]["path"]) if sources.get("draft") else None
    slots, threads, out = max(args.concurrency), args.threads or physical_cores(), []
    if args.llamacpp_server != "off":
        bin_dir = find_bin(args.llamacpp_server, lambda line: left_out("llama-server", line))
        gguf = find_source("auto", target, skip=lambda why: left_out("llama-server", why)) if bin_dir else None
        if gguf is not None and head is None:
            left_out("llama-server", "the engine has no draft head")
        elif gguf is not None:
            out += llamacpp_peers(bin_dir, gguf, head, llamacpp_cache(target), slots, threads, args.max_context,
                                  args.llamacpp_draft[0])
    if args.vllm:
        if target is None or not Path(args.vllm).is_file():
            left_out("vLLM", f"no python at {args.vllm}" if target else "the engine names no Hugging Face target")
        else:
            out += vllm_peers(Path(args.vllm), target, head, slots, threads, args.max_context,
                              Path(args.out).with_name("bench_serve_peers"), args.vllm_k)
    return out


def peer_row(peer, server, tokenizer: Path, concurrency: int, n: int, args, out: Path) -> dict | None:
    """AIPerf's row for one peer at one concurrency: on `server` (a peer kept up for the run, after it rested), else
    on a server of its own started for this row; None when that does not start."""
    try:
        with ExitStack() as stack:
            if server is None:
                server = stack.enter_context(PeerServer(peer))
            time.sleep(peer.settle_s)
            got = aiperf_row(args.aiperf, tokenizer, server.port, concurrency, n, args, out)
    except ModelError as e:
        left_out(peer.name, e)
        return None
    return {"mode": peer.name, "concurrency": concurrency, "peer": True, "setting": peer.setting} | got


# --- the chaos phase (--chaos): kill -9 under load ---------------------------------------------------------------
CHAOS_KILLS = ("tritonserver", "stub")
CLEAN = ("exact", "5xx", "stream error")             # what the goal allows a request to end as under a kill
UNCLEAN = ("wrong", "cut", "4xx", "hung")
RECOVERY_S = 30.0                                     # the goal: a request is served again this soon after a kill


def outcome(rec: dict, want: list[int], deadline: float) -> str:
    """How one of our client's requests (stream_request's record) ended: `exact` (the final event came and the
    tokens are vanilla decoding's), `5xx` (refused or cut with a server-error status), `stream error` (an error
    event ended the stream); or not clean: `wrong` (completed with other tokens), `4xx` (a server fault blamed on
    the request), `cut` (the connection ended with neither the final event nor an error), `hung` (longer than
    `deadline` seconds, or no byte for that long)."""
    if rec["timed_out"] or rec["end"] - rec["t0"] > deadline:
        return "hung"
    if rec["error"] is None:
        if rec["finish"] is None:
            return "cut"
        return "exact" if rec["ids"] == want else "wrong"
    if rec["status"] is not None and rec["status"] != 200:
        return "5xx" if rec["status"] >= 500 else "4xx"
    return "stream error" if rec["error_event"] else "cut"


def aiperf_outcomes(records: list[dict], deadline: float) -> dict:
    """AIPerf's per-request export (profile_export.jsonl: one {metadata, metrics, error} per request) -> completed,
    errored, hung (an error of a timeout type, or a request that took `deadline`, AIPerf's request timeout), the
    distinct errors with their counts (code, type, message). `completed_without_usage`: requests AIPerf counts as
    completed that got no `usage` from the server (AIPerf asks for it): streams the front ended with an error event
    (`data: {"error": ...}`, OpenAI's shape), which AIPerf 0.13 takes for an ordinary chunk (it only recognizes SSE
    `event: error`)."""
    errors: dict[tuple, int] = {}
    completed = hung = no_usage = 0
    for r in records:
        meta, err = r.get("metadata") or {}, r.get("error")
        seconds = (meta.get("request_end_ns", 0) - meta.get("request_start_ns", 0)) / 1e9
        if (err and "timeout" in str(err.get("type") or "").lower()) or seconds >= deadline - 0.5:
            hung += 1
        if not err:
            completed += 1
            no_usage += (r.get("metrics") or {}).get("usage_completion_tokens") is None
            continue
        key = (err.get("code"), err.get("type"), " ".join(str(err.get("message") or "").split())[:160])
        errors[key] = errors.get(key, 0) + 1
    return {"requests": len(records), "completed": completed, "completed_without_usage": no_usage,
            "errored": len(records) - completed, "hung": hung,
            "errors": [{"code": c, "type": t, "message": m, "count": n}
                       for (c, t, m), n in sorted(errors.items(), key=lambda kv: -kv[1])]}


def server_metrics(port: int) -> dict[str, float]:
    """The eaglex_* series of Triton's metrics endpoint ({} while it does not answer)."""
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", "/metrics")
        lines = conn.getresponse().read().decode(errors="replace").splitlines()
        conn.close()
    except (OSError, http.client.HTTPException):
        return {}
    return {ln.rsplit(" ", 1)[0].split("{")[0]: float(ln.rsplit(" ", 1)[1]) for ln in lines
            if ln.startswith("eaglex_")}


def chaos_run(srv, kill: str, aiperf: str, tokenizer: Path, prompts, want, probe_want, args, out: Path) -> dict:
    """One AIPerf run (streamed chat at --chaos-concurrency) with our client's greedy streams alongside; once
    AIPerf's requests are in the server, and --chaos-delay seconds more, `kill -9` of tritonserver or of the
    model's stub. A probe then sends a short greedy request (one at a time) until one comes back exact: the
    seconds from the kill to its end are the recovery. Returns what happened and the problems found."""
    deadline, ours_n = args.chaos_deadline, args.chaos_clients
    before = srv.state()
    cmd = aiperf_command(aiperf, tokenizer, srv.http_port, args.chaos_concurrency,
                         args.chaos_requests * args.chaos_concurrency, args, out, warmup=0)
    cmd += ["--request-timeout-seconds", str(deadline)]
    log = open(out / "aiperf.log", "wb")
    t_start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    stop, lock, ours = threading.Event(), threading.Lock(), []

    def client(k: int):
        for i in itertools.count(k):
            if stop.is_set():
                return
            j = i % len(prompts)
            rec = stream_request(srv.http_port, "eaglex", {"input_ids": prompts[j], "max_tokens": args.max_tokens},
                                 timeout=deadline)
            rec["outcome"] = outcome(rec, want[j], deadline)
            with lock:
                ours.append(rec)
            if rec["outcome"] != "exact":
                time.sleep(0.5)                       # a client that backs off while the server is away

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(ours_n)]
    for t in threads:
        t.start()
    problems, killed, t_kill, in_server = [], None, None, None
    while time.perf_counter() - t_start < args.chaos_start_timeout and proc.poll() is None:
        m = server_metrics(srv.metrics_port)          # AIPerf's requests are in: more than ours decoding/waiting
        if m.get("eaglex_active_requests", 0) + m.get("eaglex_queue_depth", 0) > ours_n:
            in_server = time.perf_counter() - t_start
            break
        time.sleep(0.2)
    if in_server is None:
        problems.append("AIPerf's requests never reached the server" if proc.poll() is None
                        else f"AIPerf exited (code {proc.returncode}) before its requests reached the server")
    else:
        time.sleep(args.chaos_delay)
        if proc.poll() is not None:
            problems.append("AIPerf finished before the kill: raise --chaos-requests")
        if kill == "tritonserver":
            killed = srv.server_pid
        else:
            killed = next((pid for pid, s in stubs(srv.server_pid).items() if s["model"] == "eaglex"), None)
        if killed is None:
            problems.append(f"no {kill} process to kill")
        else:
            os.kill(killed, signal.SIGKILL)
            t_kill, wall_kill = time.perf_counter(), time.time()
    recovery, probes = None, []
    if t_kill is not None:                            # the probe: served again, exactly, how soon?
        while time.perf_counter() - t_kill < deadline:
            rec = stream_request(srv.http_port, "eaglex", {"input_ids": prompts[0], "max_tokens": len(probe_want)},
                                 timeout=deadline)
            rec["outcome"] = outcome(rec, probe_want, deadline)
            probes.append(rec)
            if rec["outcome"] == "exact":
                recovery = round(rec["end"] - t_kill, 2)
                break
            time.sleep(0.2)
    try:                                               # AIPerf must finish its run (its requests time out at deadline)
        proc.wait(timeout=max(10.0, deadline * 2 + 60 - (time.perf_counter() - (t_kill or t_start))))
        exited = True
    except subprocess.TimeoutExpired:
        exited = False
        os.killpg(proc.pid, signal.SIGKILL)            # the session AIPerf was started in (ours)
        proc.wait()
    log.close()
    stop.set()
    for t in threads:
        t.join(deadline + 10)
    seconds = round(time.perf_counter() - t_start, 1)
    try:
        records = [json.loads(line) for line in (out / "profile_export.jsonl").read_text().splitlines() if line]
    except (OSError, ValueError):
        records = None
    counts = {o: sum(r["outcome"] == o for r in ours) for o in CLEAN + UNCLEAN}
    probe_counts = {o: sum(r["outcome"] == o for r in probes) for o in CLEAN + UNCLEAN if any(
        r["outcome"] == o for r in probes)}
    after = srv.state()
    result = {"kill": kill, "pid": killed, "seconds": seconds,
              "aiperf_in_server_after_s": None if in_server is None else round(in_server, 1),
              "killed_after_s": None if t_kill is None else round(t_kill - t_start, 1),
              "recovery_s": recovery, "probes": probe_counts,
              "aiperf_exited": exited, "aiperf_exit_code": proc.returncode if exited else None,
              "aiperf": aiperf_outcomes(records, deadline) if records is not None else None,
              "ours": {"requests": len(ours), **counts, "alive_after_join": sum(t.is_alive() for t in threads),
                       "error_samples": sorted({f"{r['outcome']}: {str(r['error'])[:160]}" if r["error"] else
                                                f"{r['outcome']}: status {r['status']}, {len(r['ids'])} tokens, no "
                                                "final event" for r in ours if r["outcome"] != "exact"})[:8]},
              "restarts": after.get("restarts", 0) - before.get("restarts", 0),
              "reloads": after.get("reloads", 0) - before.get("reloads", 0),
              "events": [e["event"] for e in after.get("events", []) if t_kill is not None
                         and e["time"] >= wall_kill - 1]}
    a = result["aiperf"]
    if records is None:
        problems.append(f"AIPerf wrote no per-request export ({out / 'profile_export.jsonl'}); its log: "
                        f"{control.tail(out / 'aiperf.log', 5)}")
    elif a["hung"]:
        problems.append(f"{a['hung']} AIPerf request(s) hung (over {deadline:.0f} s)")
    if not exited:
        problems.append(f"AIPerf did not exit (killed {deadline * 2 + 60:.0f} s after the kill)")
    unclean = {o: counts[o] for o in UNCLEAN if counts[o]} | {o: n for o, n in probe_counts.items() if o in UNCLEAN}
    if unclean:
        problems.append(f"requests of ours (the probe's included) that did not end cleanly: {unclean}")
    if result["ours"]["alive_after_join"]:
        problems.append(f"{result['ours']['alive_after_join']} of our client's streams still running at the end")
    if not counts["exact"]:
        problems.append("our client: no request completed exactly")
    if t_kill is not None and (recovery is None or recovery > RECOVERY_S):
        problems.append(f"not served again within {RECOVERY_S:.0f} s of the kill (recovery {recovery} s)")
    if t_kill is not None and not result["restarts"] + result["reloads"]:
        problems.append("the supervisor reports no restart or reload")
    result["problems"] = problems
    return result


def chaos(srv, aiperf: str, tokenizer: Path, prompts, want, args, out: Path) -> list[dict]:
    """The chaos phase against a running deployment: one run per kind of kill (CHAOS_KILLS), in turn."""
    probe_want = want[0][:args.chaos_probe_tokens]
    runs = []
    for kill in CHAOS_KILLS:
        r = chaos_run(srv, kill, aiperf, tokenizer, prompts, want, probe_want, args, out / kill)
        runs.append(r)
        a, o = r["aiperf"] or {}, r["ours"]
        print(f"[chaos] kill -9 {kill} (pid {r['pid']}) {r['killed_after_s']} s in: served again after "
              f"{r['recovery_s']} s; AIPerf {a.get('completed')} completed / {a.get('errored')} errored, "
              f"exit {r['aiperf_exit_code']}; ours {o['exact']} exact / {o['5xx']} 5xx / {o['stream error']} "
              f"stream errors / {sum(o[k] for k in UNCLEAN)} not clean; {r['restarts']} restart(s), "
              f"{r['reloads']} reload(s){'; PROBLEMS: ' + '; '.join(r['problems']) if r['problems'] else ''}",
              flush=True)
        if not srv.ready() and not wait_ready(srv, RECOVERY_S * 2):
            break                                     # the next run needs a server
    for log in (SUPERVISOR_LOG, SERVER_LOG):          # what the supervisor saw, kept with AIPerf's artifacts
        if (srv.folder / log).is_file():
            shutil.copy(srv.folder / log, out / log)
    return runs


def wait_ready(srv, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if srv.ready():
            return True
        time.sleep(0.5)
    return False


def chaos_markdown(runs: list[dict]) -> str:
    lines = ["| kill -9 | killed after s | AIPerf completed / errored / hung | AIPerf exited (code) | AIPerf errors | "
             "ours exact / 5xx / stream error | ours wrong / cut / 4xx / hung | served again after s | "
             "restarts / reloads |", "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        a, o = r["aiperf"] or {}, r["ours"]
        errs = "; ".join(f"{e['count']}× {e['code']} {e['type']}" for e in a.get("errors", [])) or "none"
        lines.append(f"| {r['kill']} | {r['killed_after_s']} | {a.get('completed')} ({a.get('completed_without_usage')} "
                     f"without usage) / {a.get('errored')} / "
                     f"{a.get('hung')} | {r['aiperf_exited']} ({r['aiperf_exit_code']}) | {errs} | {o['exact']} / "
                     f"{o['5xx']} / {o['stream error']} | {o['wrong']} / {o['cut']} / {o['4xx']} / {o['hung']} | "
                     f"{r['recovery_s']} | {r['restarts']} / {r['reloads']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eaglex.bench_serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", type=Path, default=Path("engines/tiny"))
    ap.add_argument("--concurrency", default="1,2,4,8,16,32", help="comma-separated client counts")
    ap.add_argument("--requests", default="2x",
                    help="requests per row: a number, or Nx = N times the concurrency (at least --min-requests)")
    ap.add_argument("--min-requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3,
                    help="runs of each row, taking turns between deployments; a row reports its median run (a "
                         "short run on a small machine varies by 10 %% or more from one to the next)")
    ap.add_argument("--max-batch", type=int, default=32, help="slots of the batching deployments")
    ap.add_argument("--max-context", type=int, default=0,
                    help="context per request of the deployments (0: the longest prompt + --max-tokens; the three "
                         "deployments start at once, so each sizing its slots to the free memory would overcommit)")
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads of the server (0: backend default)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"some of {','.join(MODES)}")
    ap.add_argument("--no-mix", dest="mix", action="store_false",
                    help="leave out the bad requests and the clients that hang up (by default one of each per 8 "
                         "requests of a row, which the server must refuse or cancel without disturbing the others)")
    ap.add_argument("--schedule", default="auto",
                    help="batch schedule to serve (e.g. 1:chain:4,4:chain:2,8:vanilla); auto: the engine's stored "
                         "one, else one measured here as `eaglex engine` does (on a copy of the engine)")
    ap.add_argument("--aiperf", help="AIPerf's executable: also measure each row with AIPerf on the OpenAI API")
    ap.add_argument("--aiperf-input-tokens", type=int, default=64, help="AIPerf's synthetic prompt length")
    ap.add_argument("--aiperf-requests", default="2x", help="AIPerf's requests per row (like --requests)")
    ap.add_argument("--llamacpp-server", default="off", metavar="auto|off|DIR",
                    help="with --aiperf: also llama-server (-np of the largest concurrency, F32 target, vanilla and "
                         "its EAGLE-3 with the engine's head) in the same AIPerf turns; DIR holds llama-server "
                         "(auto: build/llama.cpp/bin, else PATH)")
    ap.add_argument("--llamacpp-draft", default=str_draft(LLAMACPP_DRAFT), metavar="N/P",
                    help="llama-server's EAGLE-3 setting: --spec-draft-n-max N --spec-draft-p-min P")
    ap.add_argument("--vllm", metavar="PYTHON",
                    help="with --aiperf: also `vllm serve` (vanilla and EAGLE-3 with the head) run by the python of "
                         "vLLM's venv (make vllm-venv)")
    ap.add_argument("--vllm-k", type=int, default=VLLM_K, help="vLLM's num_speculative_tokens")
    ap.add_argument("--chaos", action="store_true",
                    help="after the rows, the chaos phase (needs --aiperf): kill -9 of tritonserver, then of the "
                         "model's stub, each during an AIPerf run on the EAGLE-batched deployment with our client "
                         "alongside; every request must end exactly or with a clean 5xx / error event, nothing may "
                         "hang and a request must be served again within 30 s")
    ap.add_argument("--chaos-only", action="store_true",
                    help="only the chaos phase (implies --chaos and --modes eagle; no rows, no plot)")
    ap.add_argument("--chaos-concurrency", type=int, default=16, help="AIPerf's concurrency in the chaos phase")
    ap.add_argument("--chaos-requests", type=int, default=3,
                    help="AIPerf's requests per run of the chaos phase, per concurrent client")
    ap.add_argument("--chaos-clients", type=int, default=4, help="our client's concurrent streams alongside AIPerf")
    ap.add_argument("--chaos-delay", type=float, default=3.0,
                    help="seconds between AIPerf's requests reaching the server and the kill")
    ap.add_argument("--chaos-deadline", type=float, default=60.0,
                    help="a request that takes longer (or gets no byte for as long) hangs: AIPerf's request "
                         "timeout, our client's, and the probe's time to find the server back")
    ap.add_argument("--chaos-start-timeout", type=float, default=240.0,
                    help="seconds for AIPerf to start and get its requests into the server")
    ap.add_argument("--chaos-probe-tokens", type=int, default=8, help="tokens of the recovery probe's request")
    ap.add_argument("--chaos-dir", type=Path,
                    help="where the chaos phase's AIPerf artifacts go (default: next to --out, NAME_chaos/)")
    ap.add_argument("--out", type=Path, default=Path("build/bench_serve.json"))
    ap.add_argument("--plot", default="build/bench_serve.png", help="PNG to write ('' for none)")
    args = ap.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    if args.chaos_only:
        args.chaos, modes, args.concurrency, args.plot = True, ["eagle"], [], ""
    if args.chaos and not args.aiperf:
        ap.error("--chaos: needs --aiperf (the phase kills the server during AIPerf runs)")
    if args.chaos and "eagle" not in modes:
        ap.error("--chaos: runs against the eagle deployment; keep it in --modes")
    args.chaos_dir = args.chaos_dir or args.out.with_name(args.out.stem + "_chaos")
    if not set(modes) <= set(MODES):
        ap.error(f"--modes: use {', '.join(MODES)}")
    if args.repeats < 1:
        ap.error("--repeats: at least 1")
    if (args.llamacpp_server != "off" or args.vllm) and not args.aiperf:
        ap.error("--llamacpp-server / --vllm: the peers are measured by AIPerf; give --aiperf")
    try:
        args.llamacpp_draft = parse_drafts(args.llamacpp_draft)
    except ModelError as e:
        ap.error(f"--llamacpp-draft: {e}")
    if len(args.llamacpp_draft) != 1 or args.vllm_k < 1:
        ap.error("--llamacpp-draft takes one N/P; --vllm-k at least 1")

    def count(c: int, r: str | None = None) -> int:
        r = r or args.requests
        return max(args.min_requests, int(r[:-1]) * c if r.endswith("x") else int(r))

    tmp = tempfile.TemporaryDirectory(prefix="bench-serve-")
    engine_name = str(args.engine)
    engine = open_engine(args.engine)
    if engine.tokenizer is None:
        raise SystemExit(f"{args.engine} has no tokenizer")
    prompts = [list(engine.tokenizer(t)["input_ids"]) for t in TEXTS]
    # AIPerf's prompts go through the chat template: room for its tokens beyond the synthetic prompt
    longest = max(max(len(p) for p in prompts), 2 * args.aiperf_input_tokens + 64 if args.aiperf else 0)
    args.max_context = args.max_context or longest + args.max_tokens
    tokenizer_dir = Path(tmp.name) / "tokenizer"
    engine.tokenizer.save_pretrained(str(tokenizer_dir))          # AIPerf needs a local tokenizer folder
    stored = (engine.manifest or {}).get("batch_schedule")
    schedule_from = "engine"
    if engine.layout == "engine" and engine.method != "vanilla" and (args.schedule != "auto" or not stored):
        copy = Path(tmp.name) / "engine"               # the engine folder itself is left as it is
        shutil.copytree(args.engine, copy)
        manifest = read_manifest(copy)
        if args.schedule == "auto":
            engine = open_engine(copy)
            tune_batching(engine, prompts, manifest, log=print)
            schedule_from = "measured here"
        else:
            manifest["batch_schedule"] = str(Schedule.parse(args.schedule))
            (copy / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
            schedule_from = "--schedule"
        args.engine, engine = copy, open_engine(copy)
    ref = open_engine(args.engine, method="vanilla")
    want = [ref.generator().generate(p, args.max_tokens).output_ids for p in prompts]
    print(f"bench-serve: {engine_name} ({engine.method}, tree {engine.tree}, batch schedule "
          f"{engine.batch_schedule()}), {args.max_tokens} tokens per request, greedy; references decoded alone")

    peers = peer_deployments(args, engine.manifest or {}) if args.concurrency else []
    rows, servers, chaos_runs, chaos_seconds = [], {}, [], None
    with tmp, ExitStack() as running:
        kept = {}                           # peers that serve the whole run: started once, here
        for p in peers:
            if not p.fresh:
                try:
                    kept[p] = running.enter_context(PeerServer(p))
                except ModelError as e:
                    left_out(p.name, e)
        peers = [p for p in peers if p.fresh or p in kept]
        try:
            for mode in modes:              # every deployment up at once (idle ones wait without using the CPU)
                t0 = time.monotonic()
                servers[mode] = srv = serve_mode(args, mode, Path(tmp.name))
                print(f"[{mode}] server ready in {time.monotonic() - t0:.1f} s")
                # warm-up (not recorded): every prompt once, a few at a time, so first-run costs stay out of rows
                run_row(srv.http_port, "eaglex", prompts, want, min(4, len(prompts)), len(prompts), args.max_tokens,
                        mix=False)
            for c in args.concurrency:      # modes take turns per row: a busy machine's drift hits them alike
                runs = {mode: [] for mode in servers}
                for rep in range(args.repeats):
                    for mode, srv in servers.items():
                        row = run_row(srv.http_port, "eaglex", prompts, want, c, count(c), args.max_tokens,
                                      args.mix)
                        runs[mode].append(row)
                        print(f"[{mode}] c={c:3d} run {rep + 1}/{args.repeats} {row['tokens_per_s']:8.1f} tok/s  "
                              f"ttft p99 {row['ttft_p99_ms']} ms  tpot p99 {row['tpot_p99_ms']} ms  "
                              f"exact {row['exact']}  errors {row['errors']}  bad refused "
                              f"{row['bad_refused']}/{row['bad_requests']}  hang-ups {row['hangups']}", flush=True)
                extra = {mode: {} for mode in servers}
                if args.aiperf:             # AIPerf on the OpenAI API: the same turns
                    for mode, srv in servers.items():
                        extra[mode] = aiperf_row(args.aiperf, tokenizer_dir, srv.http_port, c,
                                                 count(c, args.aiperf_requests), args,
                                                 Path(tmp.name) / "aiperf" / f"{mode}-c{c}")
                        a = extra[mode]
                        print(f"[{mode}] c={c:3d} aiperf  {a.get('aiperf_output_tokens_per_s')} tok/s  ttft p99 "
                              f"{a.get('aiperf_ttft_p99_ms')} ms  itl {a.get('aiperf_itl_avg_ms')} ms  "
                              f"{a.get('aiperf_requests_per_s')} req/s{'  ERROR ' + a['aiperf_error'] if 'aiperf_error' in a else ''}",
                              flush=True)
                for mode, rs in runs.items():
                    rows.append(median_row(rs) | {"mode": mode,
                                                  "speculation": speculation(engine, mode, c, args.max_batch)}
                                | extra[mode])
                for p in peers:             # then the peers' servers, in the same AIPerf settings
                    got = peer_row(p, kept.get(p), tokenizer_dir, c, count(c, args.aiperf_requests), args,
                                   Path(tmp.name) / "aiperf" / f"{p.name.replace(' ', '_')}-c{c}")
                    if got is not None:
                        rows.append(got)
                        print(f"[{p.name}] c={c:3d} aiperf  {got.get('aiperf_output_tokens_per_s')} tok/s  ttft p99 "
                              f"{got.get('aiperf_ttft_p99_ms')} ms  itl {got.get('aiperf_itl_avg_ms')} ms"
                              f"{'  ERROR ' + got['aiperf_error'] if 'aiperf_error' in got else ''}", flush=True)
            if args.chaos:                  # last: it kills the eagle deployment's processes
                t0 = time.monotonic()
                chaos_runs = chaos(servers["eagle"], args.aiperf, tokenizer_dir, prompts, want, args,
                                   args.chaos_dir)
                chaos_seconds = round(time.monotonic() - t0, 1)
        finally:
            for srv in servers.values():
                srv.stop()
    order = modes + [p.name for p in peers]
    rows.sort(key=lambda r: (order.index(r["mode"]), r["concurrency"]))
    ours = [r for r in rows if not r.get("peer")]

    table = summary(ours, args.concurrency)
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "engine": engine_name,
              "method": engine.method, "tree": str(engine.tree), "batch_schedule": str(engine.batch_schedule()),
              "batch_schedule_from": schedule_from,
              "max_tokens": args.max_tokens, "max_batch": args.max_batch, "threads": args.threads,
              "repeats": args.repeats, "mix": args.mix, "aiperf": bool(args.aiperf),
              "aiperf_input_tokens": args.aiperf_input_tokens if args.aiperf else None,
              "rows": rows, "summary": table, "vs_peers": vs_peers(rows, args.concurrency)}
    if args.chaos:
        result["chaos"] = {"seconds": chaos_seconds, "aiperf_concurrency": args.chaos_concurrency,
                           "aiperf_requests": args.chaos_requests * args.chaos_concurrency,
                           "our_clients": args.chaos_clients, "deadline_s": args.chaos_deadline,
                           "recovery_limit_s": RECOVERY_S, "artifacts": str(args.chaos_dir), "runs": chaos_runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    if rows:
        print(markdown(rows, table))
    if peers:
        print("\n" + peers_markdown(result["vs_peers"]))
    if args.chaos:
        print(f"\nchaos phase ({chaos_seconds} s; AIPerf artifacts in {args.chaos_dir}):\n{chaos_markdown(chaos_runs)}")
        for r in chaos_runs:
            for e in (r["aiperf"] or {}).get("errors", []):
                print(f"  {r['kill']}: AIPerf {e['count']}× {e['code']} {e['type']}: {e['message']}")
    print(f"wrote {args.out}")
    if args.plot and rows:
        try:
            plot(ours, Path(args.plot))
            print(f"wrote {args.plot}")
        except ImportError:
            print("no plot: matplotlib is not installed (pip install -e '.[bench]')", file=sys.stderr)
    bad = [r for r in ours if r["errors"] or r["exact"] != 1.0 or r["bad_refused"] != r["bad_requests"]
           or "aiperf_error" in r]             # a peer's failure is reported in its row, not ours to fail on
    bad += [r for r in chaos_runs if r["problems"]] + ([{}] if args.chaos and len(chaos_runs) < len(CHAOS_KILLS)
                                                       else [])
    return 1 if bad else 0


def median_row(runs: list[dict]) -> dict:
    """The run of median aggregate tokens/s (the lower middle one of an even count), with every run's tokens/s,
    and errors and exactness over all runs (a wrong output in any run must show)."""
    ranked = sorted(runs, key=lambda r: r["tokens_per_s"])
    row = dict(ranked[(len(ranked) - 1) // 2])
    row["tokens_per_s_runs"] = [r["tokens_per_s"] for r in runs]
    row["errors"] = sum(r["errors"] for r in runs)
    row["error_sample"] = next((r["error_sample"] for r in runs if r["error_sample"]), None)
    for key in ("bad_requests", "bad_refused", "hangups"):
        row[key] = sum(r[key] for r in runs)
    served = sum(r["served"] for r in runs)
    row["exact"] = round(sum(r["exact"] * r["served"] for r in runs if r["exact"] is not None) / served, 4) \
        if served else None
    return row


def summary(rows: list[dict], concurrency: list[int]) -> list[dict]:
    by = {(r["mode"], r["concurrency"]): r for r in rows}
    out = []
    for c in concurrency:
        v, e, s = by.get(("vanilla", c)), by.get(("eagle", c)), by.get(("single", c))
        out.append({"concurrency": c,
                    "vanilla_tokens_per_s": v and v["tokens_per_s"], "eagle_tokens_per_s": e and e["tokens_per_s"],
                    "single_tokens_per_s": s and s["tokens_per_s"],
                    "speedup_vs_vanilla": round(e["tokens_per_s"] / v["tokens_per_s"], 2) if v and e else None,
                    "speedup_vs_single": round(e["tokens_per_s"] / s["tokens_per_s"], 2) if s and e else None})
    return out


def markdown(rows: list[dict], table: list[dict]) -> str:
    lines = ["| mode | conc. | requests | tokens/s (median; runs' range) | per-request tok/s | TTFT p50/p99 ms | "
             "TPOT p50/p99 ms | mean accepted | speculation | exact | bad refused | hang-ups |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in (r for r in rows if not r.get("peer")):
        spread = r.get("tokens_per_s_runs") or [r["tokens_per_s"]]
        lines.append(f"| {r['mode']} | {r['concurrency']} | {r['served']}/{r['requests']} | {r['tokens_per_s']} "
                     f"({min(spread)}–{max(spread)}) | "
                     f"{r['per_request_tokens_per_s']} | {r['ttft_p50_ms']} / {r['ttft_p99_ms']} | "
                     f"{r['tpot_p50_ms']} / {r['tpot_p99_ms']} | {r['mean_accepted']} | {r['speculation']} | "
                     f"{r['exact']} | {r.get('bad_refused', 0)}/{r.get('bad_requests', 0)} | {r.get('hangups', 0)} |")
    if any("aiperf_output_tokens_per_s" in r or "aiperf_error" in r for r in rows):
        lines += ["", "| mode | conc. | AIPerf output tok/s | ours tok/s | AIPerf req/s | AIPerf TTFT p99 ms | "
                  "AIPerf ITL mean / p99 ms |", "|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['mode']} | {r['concurrency']} | {r.get('aiperf_output_tokens_per_s', 'error')} | "
                         f"{r.get('tokens_per_s', '–')} | {r.get('aiperf_requests_per_s')} | {r.get('aiperf_ttft_p99_ms')} | "
                         f"{r.get('aiperf_itl_avg_ms')} / {r.get('aiperf_itl_p99_ms')} |")
    lines += ["", "| conc. | vanilla batched tok/s | EAGLE batched tok/s | speedup | one-at-a-time tok/s | "
              "EAGLE batched / one-at-a-time |", "|---|---|---|---|---|---|"]
    for t in table:
        lines.append(f"| {t['concurrency']} | {t['vanilla_tokens_per_s']} | {t['eagle_tokens_per_s']} | "
                     f"{t['speedup_vs_vanilla']} | {t['single_tokens_per_s']} | {t['speedup_vs_single']} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for mode, color in zip(MODES, ("tab:blue", "tab:orange", "tab:gray")):
        rs = [r for r in rows if r["mode"] == mode]
        if not rs:
            continue
        c = [r["concurrency"] for r in rs]
        y = [r["tokens_per_s"] for r in rs]
        runs = [r.get("tokens_per_s_runs") or [r["tokens_per_s"]] for r in rs]      # bars: the repeats' range
        a.errorbar(c, y, yerr=[[v - min(x) for v, x in zip(y, runs)], [max(x) - v for v, x in zip(y, runs)]],
                   marker="o", color=color, label=mode, capsize=3)
        b.plot(c, [r["tpot_p99_ms"] for r in rs], marker="o", color=color, label=f"{mode} TPOT p99")
        b.plot(c, [r["ttft_p99_ms"] for r in rs], marker="x", color=color, linestyle="--", label=f"{mode} TTFT p99")
        if any("aiperf_output_tokens_per_s" in r for r in rs):            # AIPerf on the OpenAI API: dotted
            a.plot(c, [r.get("aiperf_output_tokens_per_s") for r in rs], marker=".", color=color, linestyle=":",
                   label=f"{mode} (AIPerf)")
            b.plot(c, [r.get("aiperf_ttft_p99_ms") for r in rs], marker=".", color=color, linestyle=":",
                   label=f"{mode} AIPerf TTFT p99")
    for ax, title in ((a, "aggregate tokens/s (median, range of repeats)"), (b, "p99 latency (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    b.set_yscale("log")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
