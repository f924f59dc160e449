"""kill -9 of the batching model's stub while a full batch decodes, against the real tritonserver through the
supervised server (eaglex serve), on a server of its own (it ends with an old model version that Triton
cannot unload, so its stop is the quick one for that case): the requests that were inside the dead stub end with the
front's error event instead of waiting forever, the supervisor reloads the model, the next batched requests are
exact, and the stop leaves no process or shared-memory file behind."""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from test_triton import GREEDY_PROMPTS, checkpoint, ids_of, needs_triton, post, reference, serve  # noqa: F401

from eaglex.serving.processes import group_pids, stop_group, stubs
from eaglex.serving.repository import write_repository

MAX_BATCH, MAX_QUEUE = 4, 24
LONG = ["hello world", "a", "draft then verify", "the quick brown fox"]   # 300-400 greedy tokens each: one per slot
RECOVERY_S = 30.0                     # a valid request is served again within this after a kill


def open_stream(srv, body: dict) -> tuple[socket.socket, bytes]:
    """A streamed generate request on a raw connection, once its first event arrived: (the socket, what came)."""
    data = json.dumps({**body, "stream": True}).encode()
    s = socket.create_connection(("127.0.0.1", srv.http_port), timeout=60)
    s.sendall(b"POST /v2/models/eaglex/generate_stream HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(data) + data)
    got = b""
    while b"data:" not in got:
        chunk = s.recv(4096)
        assert chunk, f"closed before the first event: {got!r}"
        got += chunk
    return s, got


def end_of_stream(s: socket.socket, got: bytes, timeout: float) -> tuple[str, bytes]:
    """How a stream ended: "final" (its last event came), "error" (an error event), "closed" (the connection
    ended without either) or "silent" (nothing more within `timeout`); and all that came."""
    s.settimeout(timeout)
    try:
        while b"finish_reason" not in got and b'"error"' not in got:
            chunk = s.recv(65536)
            if not chunk:
                return "closed", got
            got += chunk
    except (TimeoutError, ConnectionResetError):
        return "silent", got
    finally:
        s.close()
    return ("final" if b"finish_reason" in got else "error"), got


def wait_for(predicate, timeout: float, step: float = 0.2):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if value := predicate():
            return value
        time.sleep(step)
    return None


@needs_triton
def test_killed_stub_under_batched_requests_is_replaced_and_serves_exactly(  # noqa: F811
        checkpoint, reference, tmp_path):  # noqa: F811
    """kill -9 of the stub while MAX_BATCH streamed requests decode together: each of them ends with an error event
    (Triton never answers a request inside a dead stub: the front ends them), the supervisor replaces the stub, and
    the next requests, batched, are exact; the stop stays quick and leaves no process or shared-memory file
    behind."""
    run_vanilla, _ = reference
    write_repository(checkpoint, tmp_path / "repo", "eaglex", threads=1, max_batch=MAX_BATCH,
                     max_queue_size=MAX_QUEUE)
    srv = serve(tmp_path / "repo", tmp_path)
    try:
        stub_pid, = stubs(srv.server_pid)
        streams = [open_stream(srv, {"text_input": text, "max_tokens": 400}) for text in LONG]
        t0 = time.monotonic()
        os.kill(stub_pid, signal.SIGKILL)
        with ThreadPoolExecutor(len(streams)) as pool:
            ends = list(pool.map(lambda sg: end_of_stream(*sg, RECOVERY_S), streams))
        cut = time.monotonic() - t0
        # none had finished; each gets the front's error event (Triton itself never answers them)
        assert [how for how, _ in ends] == ["error"] * len(LONG), ends
        assert all(b"backend process died under this request" in got for _, got in ends)
        body = {"text_input": "hello world", "max_tokens": 12}
        assert wait_for(lambda: (r := post(srv, "generate", body))[0] == 200 and r, RECOVERY_S), \
            f"not served again within {RECOVERY_S} s:\n{srv.log_tail()}"
        recovered = time.monotonic() - t0
        bodies = [{"text_input": text, "max_tokens": 40} for text in GREEDY_PROMPTS]
        with ThreadPoolExecutor(len(bodies)) as pool:                  # batched again: every one exact
            results = list(pool.map(lambda b: post(srv, "generate", b), bodies))
        for b, (status, out) in zip(bodies, results):
            assert status == 200 and ids_of(out["output_ids"]) == run_vanilla(b["text_input"], 40), (b, out)
        st = srv.state()
        assert st["reloads"] + st["restarts"] >= 1 and stub_pid not in stubs(srv.server_pid)
        assert any(f"ended {len(LONG)} request(s) that were inside the dead backend process" in e["event"]
                   for e in st["events"])
        print(f"\n[triton batch] stub killed under {len(LONG)} batched streams: they ended after {cut:.1f} s, "
              f"served again after {recovered:.1f} s ({st['reloads']} reload(s), {st['restarts']} restart(s))",
              file=sys.stderr)
    finally:
        pgid, shm, t0 = srv.server_pid, srv.state().get("shm", []), time.monotonic()
        st = srv.stop()
        seconds = time.monotonic() - t0
        left = group_pids(pgid) if pgid else []
        if left:
            stop_group(pgid, 1)
    assert seconds < 15, f"stop took {seconds:.1f} s: {st['stopped']}"
    assert not left and not [n for n in shm if Path(f"/dev/shm/{n}").exists()], (left, shm)
