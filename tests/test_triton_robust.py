"""What must not take the Triton deployment down, against the real tritonserver on loopback, started and stopped
through the command line `make serve` / `make serve-stop` use (`eaglex serve`):

- a ~200 KB body of nested JSON (it kills tritonserver 2.51 itself) and oversized bodies: refused by the front;
- integers beyond their input's type (max_tokens 2^32+1 would wrap to 1) and wrong JSON types: 400, not 500;
- the administrative APIs: 403 without the admin key, through the front, on Triton's own HTTP port and over gRPC;
- tokens of cancelled requests in the metrics;
- kill -9 of the model's stub process: readiness says so at once, requests get 503, the model is reloaded and the
  next request is served correctly within 30 s;
- kill -9 of tritonserver: the same, through a restart, and its shared-memory files are removed;
- a stop that is quick, says what happened and leaves no process or shared-memory file behind.

Every loop is bounded. The unit tests of the front (no server) are in test_triton_front.py.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_triton import checkpoint, ids_of, metrics, needs_triton, post, stop_served  # noqa: F401

from eaglex.serving import control
from eaglex.serving.config import ServeConfig
from eaglex.serving.processes import alive, group_pids, stubs
from eaglex.serving.repository import write_repository
from eaglex.serving.tritonserver import http as http_call

SERVE = [sys.executable, "-m", "eaglex.cli", "serve"]
RECOVERY_S = 30.0                     # a valid request is served again within this after a kill
pytestmark = needs_triton


def http(srv, method: str, path: str, body: bytes | None = None, headers: dict | None = None, url=None):
    status, data = http_call(method, f"{url or srv.url}{path}", headers or {}, body, timeout=60)
    try:
        return status, json.loads(data) if data else {}
    except ValueError:
        return status, {"raw": data.decode(errors="replace")}


def raw(srv, request: bytes, port: int | None = None) -> bytes:
    """Send raw bytes, return the whole answer (the server closes or the answer is complete)."""
    with socket.create_connection(("127.0.0.1", port or srv.http_port), timeout=30) as s:
        s.sendall(request)
        out = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return out
            out += chunk


@pytest.fixture(scope="module")
def served(checkpoint, tmp_path_factory):  # noqa: F811
    """One instance, started and stopped with the command line (what `make serve` / `make serve-stop` run)."""
    work = tmp_path_factory.mktemp("triton-robust")
    write_repository(checkpoint, work / "repo", "eaglex", instances=1, threads=1, max_queue_size=8)
    start = SERVE + ["start", "--repo", str(work / "repo"), "--dir", str(work), "--http-port", "0", "--grpc-port",
                     "0", "--metrics-port", "0", "--exit-timeout", "20", "--timeout", "150", "--max-body-bytes",
                     "300000"]
    out = subprocess.run(start, capture_output=True, text=True, timeout=200)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ready in" in out.stdout and "admin APIs restricted" in out.stdout, out.stdout
    again = subprocess.run(start, capture_output=True, text=True, timeout=30)
    assert again.returncode == 2 and "already running" in again.stderr, again.stderr
    srv = control.Served(work)
    srv.expected = {}                 # prompt -> output ids, measured while nothing had been killed yet
    try:
        yield srv
    finally:
        if control.running(work) is not None:
            stop_served(srv)


def generate_ok(srv, text: str = "hello world", max_tokens: int = 12) -> list[int] | None:
    status, out = http(srv, "POST", "/v2/models/eaglex/generate",
                       json.dumps({"text_input": text, "max_tokens": max_tokens}).encode())
    return ids_of(out["output_ids"]) if status == 200 else None


def wait_for(predicate, timeout: float, step: float = 0.1):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    return None


def test_expected_output(served):
    served.expected["hello world"] = generate_ok(served)
    assert served.expected["hello world"] and len(served.expected["hello world"]) == 12


def test_nested_json_and_oversized_bodies_are_refused_before_triton(served):
    pid = served.server_pid
    nested = b'{"text_input": ' + b"[" * 100000 + b"]" * 100000 + b"}"          # kills tritonserver 2.51 itself
    status, out = http(served, "POST", "/v2/models/eaglex/generate", nested)
    assert status == 400 and "nests deeper than 64" in out["error"], out
    for endpoint in ("generate_stream", "infer"):
        status, _ = http(served, "POST", f"/v2/models/eaglex/{endpoint}", b"[" * 65 + b"]" * 65)
        assert status == 400
    # above --max-body-bytes: refused from the Content-Length, or while a chunked body comes in
    status, out = http(served, "POST", "/v2/models/eaglex/generate", b'{"text_input": "' + b"a" * 300001 + b'"}')
    assert status == 413 and "at most 300000" in out["error"]
    chunk = b"a" * 100000
    body = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(4)) + b"0\r\n\r\n"
    answer = raw(served, b"POST /v2/models/eaglex/generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                         b"Connection: close\r\n\r\n" + body)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    # a chunked body within the limits is forwarded (Triton gets a Content-Length)
    body = json.dumps({"text_input": "hello world", "max_tokens": 12}).encode()
    answer = raw(served, b"POST /v2/models/eaglex/generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                         b"Connection: close\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
    assert served.server_pid == pid and served.ready()
    assert generate_ok(served) == served.expected["hello world"]


WRAPAROUND = [
    ({"max_tokens": 2 ** 32 + 1}, "max_tokens must be an integer in [-2147483648, 2147483647] (INT32)"),
    ({"max_tokens": -(2 ** 31) - 1}, "max_tokens must be an integer"),
    ({"max_tokens": 99999999999}, "max_tokens must be an integer"),
    ({"top_k": 2 ** 31}, "top_k must be an integer"),
    ({"end_id": 2 ** 32 + 3}, "end_id must be an integer"),
    ({"seed": 2 ** 64}, "seed must be an integer in [0, 18446744073709551615] (UINT64)"),
    ({"seed": -1}, "seed must be an integer in [0,"),
    ({"random_seed": 2 ** 64 + 5}, "random_seed must be an integer"),
    ({"temperature": 1e39}, "temperature must be a finite number within FP32's range"),
    ({"parameters": {"x": 2 ** 63}}, "parameter x must fit in int64"),
]
WRONG_TYPES = [
    {"max_tokens": "ten"}, {"max_tokens": 5.5}, {"max_tokens": True}, {"max_tokens": None}, {"max_tokens": [1.5]},
    {"max_tokens": {"n": 1}}, {"temperature": "hot"}, {"temperature": False}, {"top_p": "0.9"}, {"top_k": 2.0},
    {"seed": "7"}, {"stream": 1}, {"stream": "true"}, {"stop_words": [1, 2]}, {"end_id": [[None]]},
]


@pytest.mark.parametrize("endpoint", ["generate", "generate_stream"])
def test_integer_wraparound_and_wrong_types_are_400(served, endpoint):
    for extra, message in WRAPAROUND:
        status, out = http(served, "POST", f"/v2/models/eaglex/{endpoint}",
                           json.dumps({"text_input": "hello", **extra}).encode())
        assert status == 400 and message in out["error"], (extra, status, out)
    for extra in WRONG_TYPES:
        status, out = http(served, "POST", f"/v2/models/eaglex/{endpoint}",
                           json.dumps({"text_input": "hello", **extra}).encode())
        name = next(iter(extra))
        assert status == 400 and out["error"].startswith(name), (extra, status, out)
    for body in (b"{not json", b'"a string"', b'{"text_input": 5}', b'{"input_ids": [1, 4294967296]}'):
        status, out = http(served, "POST", f"/v2/models/eaglex/{endpoint}", body)
        assert status == 400, (body, status, out)
    # the limits themselves are accepted by the front, and the model answers with its own rule
    status, out = post(served, endpoint, {"text_input": "hello", "max_tokens": 2 ** 31 - 1})
    assert status == 400 and "beyond the context" in (out[0] if isinstance(out, list) else out)["error"]
    assert served.ready()


ADMIN = [
    ("POST", "/v2/systemsharedmemory/region/x/register", b'{"key": "triton_python_backend_shm_region_x", '
                                                          b'"offset": 0, "byte_size": 16}'),
    ("GET", "/v2/systemsharedmemory/status", None),
    ("POST", "/v2/cudasharedmemory/region/x/unregister", b"{}"),
    ("POST", "/v2/repository/index", b"{}"),
    ("POST", "/v2/repository/models/eaglex/unload", b"{}"),
    ("GET", "/v2/logging", None),
    ("POST", "/v2/logging", b'{"log_verbose_level": 1}'),
    ("GET", "/v2/trace/setting", None),
    ("POST", "/v2/models/eaglex/trace/setting", b'{"trace_level": ["TIMESTAMPS"]}'),
    ("POST", "/v2//%72epository/index", b"{}"),                    # no spelling gets through
]


def test_admin_endpoints_are_restricted(served):
    for method, path, body in ADMIN:
        status, out = http(served, method, path, body)
        assert status == 403 and "restricted" in out.get("error", ""), (path, status, out)
    # Triton's own HTTP port (internal, loopback) and gRPC refuse them too: the same header is required
    for method, path, body in ADMIN[:2] + ADMIN[5:7]:
        status, _ = http(served, method, path, body, url=served.internal_url)
        assert status == 403, (path, status)
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{served.grpc_port}")
    try:
        for call in (client.get_log_settings, client.get_system_shared_memory_status,
                     lambda: client.unload_model("eaglex")):
            with pytest.raises(InferenceServerException, match="restricted"):
                call()
        key = served.admin_key()                       # the operator's way in: the key the supervisor wrote
        # (Triton prefixes the gRPC header: triton-grpc-protocol-<name>)
        assert client.get_log_settings(headers={"triton-grpc-protocol-triton-admin-key": key}) is not None
    finally:
        client.close()
    status, out = http(served, "POST", "/v2/repository/index", b"{}", {"triton-admin-key": served.admin_key()})
    assert status == 200 and out[0]["state"] == "READY"
    status, _ = http(served, "POST", "/v2/repository/index", b"{}", {"triton-admin-key": "guess"})
    assert status == 403
    assert served.ready() and generate_ok(served) == served.expected["hello world"]


def test_cancelled_requests_count_their_tokens(served):
    key = 'eaglex_requests_total{model="eaglex",outcome="cancelled"}'
    before = metrics(served)
    body = json.dumps({"text_input": "hello", "max_tokens": 400, "stream": True, "temperature": 1.0}).encode()
    received = 0
    with socket.create_connection(("127.0.0.1", served.http_port), timeout=30) as s:
        s.sendall(b"POST /v2/models/eaglex/generate_stream HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        got = b""
        while got.count(b"data:") < 2:               # two events (the prefill's token, one cycle), then hang up
            chunk = s.recv(4096)
            assert chunk, got
            got += chunk
        for line in got.decode().splitlines():
            if line.startswith("data:"):
                event = json.loads(line[5:])
                assert "finish_reason" not in event, f"the request ended before the client hung up: {event}"
                received += len(ids_of(event.get("output_ids")))
    after = wait_for(lambda: (m := metrics(served)).get(key, 0) > before.get(key, 0) and m, 30)
    assert after, "the cancelled request was not counted"
    tokens = 'eaglex_output_tokens_total{model="eaglex"}'
    assert after[tokens] - before.get(tokens, 0) >= received > 0
    cycles = 'eaglex_cycles_total{model="eaglex"}'
    assert after[cycles] > before.get(cycles, 0)


def test_killed_stub_is_reloaded(served):
    stub_map = stubs(served.server_pid)
    assert len(stub_map) == 1, stub_map
    stub_pid, = stub_map
    t0 = time.monotonic()
    os.kill(stub_pid, signal.SIGKILL)
    # readiness says so at once (the supervisor looks every 0.25 s), and requests get 503, not 400
    assert wait_for(lambda: http(served, "GET", "/v2/health/ready")[0] == 503, 5, 0.05), "still ready"
    status, out = http(served, "GET", "/v2/models/eaglex/ready")
    if status == 503:                                  # (unless the reload is already done)
        assert "eaglex" in out["error"]
        status, out = http(served, "POST", "/v2/models/eaglex/generate", b'{"text_input": "hi", "max_tokens": 2}')
        assert status in (200, 503), out
    ids = wait_for(lambda: generate_ok(served), RECOVERY_S, 0.2)
    seconds = time.monotonic() - t0
    assert ids == served.expected["hello world"], f"not served again within {RECOVERY_S} s"
    assert served.ready() and http(served, "GET", "/v2/health/live")[0] == 200
    st = served.state()
    assert st["reloads"] + st["restarts"] >= 1 and stub_pid not in stubs(served.server_pid)
    print(f"\n[triton] stub killed: served again after {seconds:.1f} s ({st['reloads']} reload(s), "
          f"{st['restarts']} restart(s))", file=sys.stderr)


def test_killed_server_is_restarted(served):
    old = served.server_pid
    shm = served.state()["shm"]
    assert shm
    t0 = time.monotonic()
    os.kill(old, signal.SIGKILL)
    assert wait_for(lambda: http(served, "GET", "/v2/health/ready")[0] == 503, 5, 0.05), "still ready"
    status, out = http(served, "POST", "/v2/models/eaglex/generate", b'{"text_input": "hi", "max_tokens": 2}')
    assert status in (200, 503), out
    ids = wait_for(lambda: generate_ok(served), RECOVERY_S, 0.2)
    seconds = time.monotonic() - t0
    assert ids == served.expected["hello world"], f"not served again within {RECOVERY_S} s"
    st = served.state()
    assert st["server_pid"] != old and st["restarts"] >= 1 and served.ready()
    assert any("killed by SIGKILL" in e["event"] for e in st["events"])
    assert not [n for n in shm if Path(f"/dev/shm/{n}").exists()], "the dead server's shared memory is left"
    print(f"\n[triton] tritonserver killed: served again after {seconds:.1f} s", file=sys.stderr)


@pytest.mark.slow
def test_upstream_crash_on_nested_json_still_exists_and_is_survived(served):
    """The reproduction in docs/triton.md, sent to tritonserver's own (internal) HTTP port, which has no front:
    tritonserver 2.51 dies of SIGSEGV; the supervisor restarts it and removes its shared memory."""
    old, shm = served.server_pid, served.state()["shm"]
    nested = b'{"text_input": ' + b"[" * 100000 + b"]" * 100000 + b"}"
    t0 = time.monotonic()
    status, _ = http(served, "POST", "/v2/models/eaglex/generate", nested, url=served.internal_url)
    assert status == 0                                   # no answer: the connection died with the server
    assert wait_for(lambda: any("killed by SIGSEGV" in e["event"] for e in served.state()["events"]), 10)
    assert wait_for(lambda: generate_ok(served), RECOVERY_S, 0.2) == served.expected["hello world"]
    print(f"\n[triton] nested JSON on the internal port: SIGSEGV, served again after {time.monotonic() - t0:.1f} s",
          file=sys.stderr)
    assert served.server_pid != old and not [n for n in shm if Path(f"/dev/shm/{n}").exists()]


def test_status_and_a_quick_stop_that_says_what_happened(served):
    out = subprocess.run(SERVE + ["status", "--dir", str(served.folder)],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "ready True" in out.stdout, out.stdout + out.stderr
    pgid, shm = served.server_pid, served.state()["shm"]
    t0 = time.monotonic()
    out = subprocess.run(SERVE + ["stop", "--dir", str(served.folder)], capture_output=True, text=True, timeout=120)
    seconds = time.monotonic() - t0
    assert out.returncode == 0, out.stdout + out.stderr
    assert "exited cleanly" in out.stdout and "server restart(s)" in out.stdout, out.stdout
    assert seconds < 20, f"stop took {seconds:.1f} s"
    assert not group_pids(pgid) and not alive(served.pid)
    assert not [n for n in shm if Path(f"/dev/shm/{n}").exists()]
    assert not (served.folder / "server.pid").exists()
    print(f"\n[triton] stop: {out.stdout.strip()} ({seconds:.1f} s)", file=sys.stderr)


@pytest.mark.slow
def test_a_stub_that_died_under_a_request_is_replaced_and_the_stop_stays_quick(checkpoint, tmp_path):  # noqa: F811
    """The worst case of a dead stub: a request reached it before the supervisor noticed (here: the supervisor is
    paused meanwhile). Triton 2.51 then never finishes unloading that instance, and on SIGTERM it would wait its
    whole exit timeout; the supervisor reloads the model anyway, notices the stuck instance, and stops quickly."""
    write_repository(checkpoint, tmp_path / "repo", "eaglex", instances=1, threads=1)
    srv = control.start(ServeConfig(str(tmp_path / "repo"), str(tmp_path), http_port=0, grpc_port=0, metrics_port=0,
                                    exit_timeout=30, ready_timeout=150))
    try:
        expected = generate_ok(srv)
        stub_pid, = stubs(srv.server_pid)
        os.kill(srv.pid, signal.SIGSTOP)
        try:
            os.kill(stub_pid, signal.SIGKILL)
            status, out = http(srv, "POST", "/v2/models/eaglex/generate", b'{"text_input": "hi"}',
                               url=srv.internal_url)
            assert status == 400 and "is not healthy" in out["error"]        # Triton's own answer
        finally:
            os.kill(srv.pid, signal.SIGCONT)
        assert wait_for(lambda: generate_ok(srv), RECOVERY_S, 0.2) == expected
        assert wait_for(lambda: any("did not finish unloading" in e["event"] for e in srv.state()["events"]), 30)
        shm = srv.state()["shm"]
        t0 = time.monotonic()
        st = srv.stop()
        assert time.monotonic() - t0 < 12, st["stopped"]           # not Triton's 30 s exit timeout
        assert not [n for n in shm if Path(f"/dev/shm/{n}").exists()]
        assert not group_pids(st["stopped"]["server_pid"])
    finally:
        if control.running(tmp_path) is not None:
            srv.stop()
