"""The HTTP front of the supervised Triton server (eaglex.serving.front), without Triton: its body checks, its
routing, and the proxy itself against a fake upstream on loopback (keep-alive, chunked bodies, 100-continue,
streamed responses relayed as they come, a client hanging up, Triton's "Stub process ... is not healthy" turned into
a 503, readiness answers, admin APIs, limits), and its OpenAI API through the official `openai` client.
test_triton_robust.py runs it in front of the real server."""
from __future__ import annotations

import asyncio
import json
import time

import pytest

from eaglex.serving.front import Front
from eaglex.serving.guard import check_generate, check_infer, check_value, json_depth_ok, route

INPUTS = {"text_input": "TYPE_STRING", "max_tokens": "TYPE_INT32", "temperature": "TYPE_FP32",
          "seed": "TYPE_UINT64", "stream": "TYPE_BOOL", "input_ids": "TYPE_INT32"}


def test_json_depth():
    assert json_depth_ok(b'{"a": [[1, 2], {"b": [3]}]}', 4)          # { [ { [
    assert not json_depth_ok(b'{"a": [[1, 2], {"b": [3]}]}', 3)
    assert json_depth_ok(b'{"a": "[[[[[[[[[[[[", "b": "\\"[[[[[[[["}', 2)      # brackets inside strings
    assert not json_depth_ok(b"[" * 100000 + b"]" * 100000, 64)
    assert json_depth_ok(b"[]" * 100000, 1)                                    # many, but shallow
    assert json_depth_ok(b'["' + b"[" * 1000, 2)                               # an unterminated string
    t0 = time.perf_counter()                                                   # linear on adversarial input
    for data in (b'"\\"' * 300000, b'"' + b"\\\\" * 500000, b"[" * 1000000):
        json_depth_ok(data, 64)
    assert time.perf_counter() - t0 < 2.0


@pytest.mark.parametrize("name,value,datatype,ok", [
    ("max_tokens", 2 ** 31 - 1, "TYPE_INT32", True),
    ("max_tokens", 2 ** 31, "TYPE_INT32", False),
    ("max_tokens", 2 ** 32 + 1, "INT32", False),
    ("max_tokens", -(2 ** 31), "INT32", True),
    ("max_tokens", 5.0, "INT32", False),
    ("max_tokens", True, "INT32", False),
    ("seed", 2 ** 64 - 1, "UINT64", True),
    ("seed", -1, "UINT64", False),
    ("input_ids", [[1, 2], [3, 2 ** 31]], "INT32", False),
    ("input_ids", [[1, 2], [3, 4]], "INT32", True),
    ("temperature", 0, "FP32", True),
    ("temperature", 1e39, "FP32", False),
    ("temperature", 1e39, "FP64", True),
    ("temperature", float("nan"), "FP64", False),
    ("temperature", "0.5", "FP32", False),
    ("text_input", ["a", "b"], "TYPE_STRING", True),
    ("text_input", 5, "BYTES", False),
    ("stream", 1, "BOOL", False),
    ("stream", False, "BOOL", True),
])
def test_check_value(name, value, datatype, ok):
    err = check_value(name, value, datatype)
    assert (err is None) == ok, err
    if not ok:
        assert err.startswith(name)


def test_check_generate_and_infer():
    assert check_generate({"text_input": "hi", "max_tokens": 5, "parameters": {"a": 1}, "id": "r1",
                           "return_log_probs": False}, INPUTS) is None
    assert "must be a JSON object" in check_generate([1], INPUTS)
    assert "max_tokens" in check_generate({"max_tokens": 2 ** 32 + 1}, INPUTS)
    assert "parameters must be" in check_generate({"parameters": [1]}, INPUTS)
    assert "int64" in check_generate({"unknown": 2 ** 64}, INPUTS)              # a parameter, as Triton reads it
    assert "id must be a string" in check_generate({"id": 5}, INPUTS)
    assert check_generate({"max_tokens": "x"}, None) is None                   # no schema: only parameter rules
    ok = {"inputs": [{"name": "x", "datatype": "INT32", "shape": [1, 2], "data": [1, 2]}]}
    assert check_infer(ok) is None
    bad = {"inputs": [{"name": "x", "datatype": "INT32", "shape": [1, 1], "data": [2 ** 32 + 1]}]}
    assert "x must be an integer" in check_infer(bad)
    assert "shape" in check_infer({"inputs": [{"name": "x", "datatype": "INT32", "shape": ["a"]}]})


@pytest.mark.parametrize("path,kind,model,endpoint", [
    ("/v2/models/m/generate", "infer", "m", "generate"),
    ("/v2/models/M1/versions/2/generate_stream?x=1", "infer", "M1", "generate_stream"),
    ("/v2/models/m/infer", "infer", "m", "infer"),
    ("/v2/models/m/ready", "model_ready", "m", None),
    ("/v2/models/m/versions/1/ready", "model_ready", "m", None),
    ("/v2/models/m", "other", "m", None),
    ("/v2/models/m/config", "other", "m", None),
    ("/v2/health/ready", "ready", None, None),
    ("/v2/health/live", "live", None, None),
    ("/v2", "other", None, None),
    ("/metrics", "other", None, None),
    ("/v2/repository/index", "admin", None, None),
    ("//v2//repository/models/m/load", "admin", None, None),
    ("/v2/%72epository/index", "admin", None, None),
    ("/V2/Logging", "admin", None, None),
    ("/v2/systemsharedmemory/status", "admin", None, None),
    ("/v2/cudasharedmemory/region/x/register", "admin", None, None),
    ("/v2/trace/setting", "admin", None, None),
    ("/v2/models/m/trace/setting", "admin", "m", None),
    ("/v2/models/m/versions/1/trace/setting", "admin", "m", None),
])
def test_route(path, kind, model, endpoint):
    assert route(path) == (kind, model, endpoint)


# --- the proxy against a fake upstream ---------------------------------------------------------------------------
class FakeSupervisor:
    def __init__(self, upstream_port: int):
        self.port, self.admin_key, self.admin_open = upstream_port, "k3y", False
        self.ready, self.reported = True, []
        self.models = {"m": {"inputs": INPUTS}, "chat": {"inputs": {"messages": "TYPE_STRING"}}}

    def upstream(self):
        return ("127.0.0.1", self.port) if self.ready else None

    def health(self):
        return (True, True, "") if self.ready else (False, False, "restarting")

    def model_ready(self, name):
        if name not in ("m", "sick", "crash", "chat"):
            return None, ""
        return (True, "") if self.ready else (False, f"model {name} is not ready: restarting")

    def inputs(self, name):
        return INPUTS if name == "m" else None

    def on_unhealthy(self, model, message):
        self.reported.append((model, message))


class FakeTriton:
    """Answers like tritonserver's HTTP front end would, and records what it received."""

    def __init__(self):
        self.requests, self.closed = [], asyncio.Event()

    async def handle(self, reader, writer):
        head = b""
        while not head.endswith(b"\r\n\r\n"):
            line = await reader.readline()
            if not line:
                return
            head += line
        lines = head.decode().split("\r\n")
        method, path, _ = lines[0].split(" ")
        headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
        body = await reader.readexactly(int(headers.get("content-length", 0)))
        self.requests.append((method, path, headers, body))
        if path == "/v2/models/chat/generate_stream":          # the OpenAI API's model: text by events
            return await self.chat(json.loads(body), reader, writer)
        if path.startswith("/v2/models/crash/"):             # tritonserver killed mid-stream: no last chunk
            event = b'data: {"n": 0}\n\n'
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                         b"%x\r\n%s\r\n" % (len(event), event))
        elif path.endswith("/generate_stream"):
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
            for i in range(50):
                event = b"data: {\"n\": %d}\n\n" % i
                writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                try:
                    await writer.drain()
                except ConnectionError:
                    break
                await asyncio.sleep(0.1)
                if reader.at_eof() or writer.transport.is_closing():
                    break
                try:                                  # the proxy closed the connection: the client is gone
                    if await asyncio.wait_for(reader.read(1), 0.001) == b"":
                        break
                except asyncio.TimeoutError:
                    pass
            else:
                writer.write(b"0\r\n\r\n")
            self.closed.set()
        elif path.startswith("/v2/models/hang/"):              # a request inside a dead stub: never answered
            await reader.read()                                # (until the proxy closes the connection)
            self.closed.set()
        elif path.startswith("/v2/models/sick/"):
            msg = b'{"error":"Stub process \'sick_0_0\' is not healthy."}'
            writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked"
                         b"\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(msg), msg))
        else:
            out = json.dumps({"path": path, "body": body.decode()}).encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(out)
                         + out)
        await writer.drain()
        writer.close()

    async def chat(self, body, reader, writer):
        """generate_stream of a chat model: one event per character of "abc" (or of 40 "x"s, slowly, for "slow"), then
        the final response; "refuse": a 400 (as Triton sends a first response that is an error), "fail": an error
        event after the first character."""
        prompt = body["text_input"] if "text_input" in body else json.loads(body["messages"])[-1]["content"]
        if prompt == "refuse":
            event = b'data: {"error": "max_tokens 9 is beyond the context"}\n\n'
            writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n"
                         % len(event) + event)
        else:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
            text = "x" * 40 if prompt == "slow" else "abc"
            events = [{"text_output": t, "output_ids": [i]} for i, t in enumerate(text)]
            if prompt == "fail":
                events.insert(1, {"error": "boom"})
            events.append({"finish_reason": "length", "prompt_tokens": 2})
            for ev in events:
                data = b"data: " + json.dumps(ev).encode() + b"\n\n"
                writer.write(b"%x\r\n%s\r\n" % (len(data), data))
                try:
                    await writer.drain()
                    await asyncio.sleep(0.1 if prompt == "slow" else 0.01)
                except ConnectionError:
                    break
                if writer.transport.is_closing() or reader.at_eof():
                    break
            else:
                writer.write(b"0\r\n\r\n")
            self.closed.set()
        await writer.drain()
        writer.close()


async def read_response(reader) -> tuple[int, dict, bytes]:
    status_line = await reader.readline()
    while status_line.startswith(b"HTTP/1.1 100"):
        await reader.readline()
        status_line = await reader.readline()
    status = int(status_line.split()[1])
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        k, _, v = line.decode().partition(":")
        headers[k.strip().lower()] = v.strip()
    if "content-length" in headers:
        return status, headers, await reader.readexactly(int(headers["content-length"]))
    body = b""
    while True:
        size = int((await reader.readline()).strip(), 16)
        if size == 0:
            await reader.readline()
            return status, headers, body
        body += (await reader.readexactly(size + 2))[:-2]


def run(scenario, **options):
    async def main():
        fake = FakeTriton()
        upstream = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
        sup = FakeSupervisor(upstream.sockets[0].getsockname()[1])
        front = await Front(sup, "127.0.0.1", 0, max_body=1000, max_depth=8, **options).start()
        try:
            await asyncio.wait_for(scenario(front, sup, fake), 30)
        finally:
            await front.close()
            upstream.close()
    asyncio.run(main())


def request(method: str, path: str, body: bytes = b"", headers: str = "") -> bytes:
    return (f"{method} {path} HTTP/1.1\r\nHost: x\r\n{headers}Content-Length: {len(body)}\r\n\r\n").encode() + body


def test_proxy_keep_alive_chunked_and_100_continue():
    async def scenario(front, sup, fake):
        r, w = await asyncio.open_connection("127.0.0.1", front.port)
        body = json.dumps({"text_input": "hi", "max_tokens": 3}).encode()
        w.write(request("POST", "/v2/models/m/generate", body, "X-Trace: 1\r\n"))
        status, headers, data = await read_response(r)
        # HTTP/1.1 keeps the connection unless the answer says close (uvicorn sends no Connection: keep-alive)
        assert status == 200 and json.loads(data)["body"] == body.decode()
        assert "close" not in headers.get("connection", "")
        # the same connection: a chunked body (re-framed with a Content-Length), then 100-continue
        w.write(b"POST /v2/models/m/generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
        status, _, data = await read_response(r)
        assert status == 200 and json.loads(data)["body"] == body.decode()
        w.write(request("POST", "/v2/models/m/generate", b"", "Expect: 100-continue\r\n")[:-4].replace(
            b"Content-Length: 0", b"Content-Length: %d" % len(body)) + b"\r\n\r\n")
        assert (await r.readline()).startswith(b"HTTP/1.1 100")
        await r.readline()
        w.write(body)
        status, _, _ = await read_response(r)
        assert status == 200
        w.close()
        method, path, headers, _ = fake.requests[0]
        assert headers["connection"] == "close" and headers["x-trace"] == "1" and "expect" not in fake.requests[2][2]
        assert fake.requests[1][2]["content-length"] == str(len(body))
    run(scenario)


def test_a_request_head_that_trickles_in_is_cut():
    """Slow loris: a connection that sends nothing, or half a request head a byte at a time, is closed once the
    head deadline passes; a request sent whole on a kept-alive connection after an idle pause is still answered."""
    async def scenario(front, sup, fake):
        t0 = time.monotonic()
        silent = await asyncio.open_connection("127.0.0.1", front.port)
        r, w = await asyncio.open_connection("127.0.0.1", front.port)
        for byte in b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Slow: ":
            w.write(bytes([byte]))
            await asyncio.sleep(0.02)
        assert await asyncio.wait_for(r.read(), 5) == b"" and await asyncio.wait_for(silent[0].read(), 5) == b""
        assert time.monotonic() - t0 < 4
        r, w = await asyncio.open_connection("127.0.0.1", front.port)
        w.write(request("GET", "/v2/health/live"))
        assert (await read_response(r))[0] == 200
        await asyncio.sleep(1.5)                           # longer than the head deadline, idle between requests
        w.write(request("GET", "/v2/health/live"))
        assert (await read_response(r))[0] == 200
        w.write(request("POST", "/v2/models/m/generate", b'{"text_input": "hi"}')[:-8])    # the body stops short
        status, _, data = await asyncio.wait_for(read_response(r), 5)
        assert status == 408 and b"did not arrive" in data and not fake.requests
        w.close()
    run(scenario, head_timeout=1.0)


def test_proxy_streams_and_cancels_when_the_client_goes():
    async def scenario(front, sup, fake):
        r, w = await asyncio.open_connection("127.0.0.1", front.port)
        w.write(request("POST", "/v2/models/m/generate_stream", b'{"text_input": "hi", "stream": true}'))
        t0 = time.monotonic()
        head = b""
        while b"data:" not in head:                        # the first event arrives long before the last
            head += await r.read(1024)
        assert time.monotonic() - t0 < 2.0 and b"Transfer-Encoding: chunked" in head
        w.close()                                          # hang up: the proxy closes the upstream connection
        await asyncio.wait_for(fake.closed.wait(), 5)
        assert time.monotonic() - t0 < 4.0                 # not the 5 s the whole stream would take
    run(scenario)


def test_cut_requests_end_with_503_or_an_error_event():
    """What the supervisor does for requests inside a dead stub: a request not answered yet gets 503 + Retry-After,
    a stream under way an error event that ends it; other models' requests and later ones are untouched."""
    async def scenario(front, sup, fake):
        waiting_r, waiting_w = await asyncio.open_connection("127.0.0.1", front.port)
        waiting_w.write(request("POST", "/v2/models/hang/generate", b'{"text_input": "hi"}'))
        stream_r, stream_w = await asyncio.open_connection("127.0.0.1", front.port)
        stream_w.write(request("POST", "/v2/models/m/generate_stream", b'{"text_input": "hi", "stream": true}'))
        head = b""
        while b"data:" not in head:
            head += await stream_r.read(1024)
        while not front.pending("hang"):
            await asyncio.sleep(0.01)
        assert front.cut(front.pending("hang"), "hang died") == 1
        status, headers, data = await read_response(waiting_r)
        assert status == 503 and json.loads(data) == {"error": "hang died"} and headers["retry-after"] == "5"
        await asyncio.wait_for(fake.closed.wait(), 5)          # and the upstream connection was closed
        assert not front.pending("hang")
        assert len(front.pending("m")) == 1                   # the stream of another model goes on
        stranded = front.pending("m")
        assert front.cut(stranded, "m died") == 1 and front.cut(stranded, "again") == 0
        rest = await asyncio.wait_for(stream_r.read(), 5)     # the stream ends, then the connection
        assert rest.endswith(b'data: {"error": "m died"}\n\n\r\n0\r\n\r\n'), rest[-200:]
        assert b"0\r\n\r\n" not in head + rest[:-5]
        r, w = await asyncio.open_connection("127.0.0.1", front.port)
        w.write(request("POST", "/v2/models/m/generate", b'{"text_input": "hi"}'))
        assert (await read_response(r))[0] == 200 and not front.inflight
        # a request that ended otherwise (here its client hung up) is not counted as cut afterwards
        gone_r, gone_w = await asyncio.open_connection("127.0.0.1", front.port)
        gone_w.write(request("POST", "/v2/models/m/generate_stream", b'{"text_input": "hi", "stream": true}'))
        head = b""
        while b"data:" not in head:
            head += await gone_r.read(1024)
        handles = front.pending("m")
        gone_w.close()
        while front.pending("m"):
            await asyncio.sleep(0.01)
        assert len(handles) == 1 and front.cut(handles, "late") == 0
        for writer in (waiting_w, stream_w, w):
            writer.close()
    run(scenario)


def test_a_stream_whose_upstream_dies_ends_with_an_error_event():
    """tritonserver killed mid-stream (its connection ends without the last chunk): the client's stream ends with an
    error event and its own last chunk, not with a second HTTP response written inside the body; the connection
    then closes."""
    async def scenario(front, sup, fake):
        r, w = await asyncio.open_connection("127.0.0.1", front.port)
        w.write(request("POST", "/v2/models/crash/generate_stream", b'{"text_input": "hi", "stream": true}'))
        status, _, body = await read_response(r)
        events = [json.loads(e[5:]) for e in body.decode().split("\n\n") if e.startswith("data:")]
        assert status == 200 and events[0] == {"n": 0} and "tritonserver broke" in events[-1]["error"], body
        assert len(events) == 2 and await asyncio.wait_for(r.read(), 5) == b""
        w.close()
    run(scenario)


def test_proxy_refusals_and_health():
    async def scenario(front, sup, fake):
        async def ask(raw: bytes):
            r, w = await asyncio.open_connection("127.0.0.1", front.port)
            w.write(raw)
            out = await read_response(r)
            w.close()
            return out

        status, _, data = await ask(request("POST", "/v2/models/sick/generate", b'{"text_input": "x"}'))
        assert status == 503 and b"backend process died" in data and sup.reported[0][0] == "sick"
        assert (await ask(request("POST", "/v2/models/m/generate", b"[" * 9 + b"]" * 9)))[0] == 400
        status, _, data = await ask(request("POST", "/v2/models/m/generate", b'{"max_tokens": 4294967297}'))
        assert status == 400 and b"INT32" in data
        status, headers, data = await ask(request("POST", "/v2/models/m/generate", b"x" * 1001))
        assert status == 413 and headers["connection"] == "close"
        assert (await ask(request("POST", "/v2/repository/index", b"{}")))[0] == 403
        assert (await ask(request("POST", "/v2/repository/index", b"{}", "triton-admin-key: no\r\n")))[0] == 403
        assert (await ask(request("POST", "/v2/repository/index", b"{}", "triton-admin-key: k3y\r\n")))[0] == 200
        sup.admin_open = True
        assert (await ask(request("GET", "/v2/logging")))[0] == 200
        for path in ("/v2/health/ready", "/v2/health/live", "/v2/models/m/ready"):
            assert (await ask(request("GET", path)))[0] == 200
        assert json.loads((await ask(request("GET", "/v2/models/other/ready")))[2])["path"].endswith("/ready")
        sup.ready = False
        for path in ("/v2/health/ready", "/v2/health/live", "/v2/models/m/ready"):
            status, headers, _ = await ask(request("GET", path))
            assert status == 503 and headers["retry-after"]
        status, _, data = await ask(request("POST", "/v2/models/m/generate", b'{"text_input": "x"}'))
        assert status == 503 and b"restarting" in data
        assert (await ask(request("GET", "/v2/models/m/config")))[0] == 503
        # what the HTTP server (uvicorn, h11) cannot parse gets 400 and the connection's end (no framing to read)
        async def status_of(raw: bytes) -> bytes:
            r, w = await asyncio.open_connection("127.0.0.1", front.port)
            w.write(raw)
            out = await asyncio.wait_for(r.read(), 5)
            w.close()
            return out.split(b"\r\n", 1)[0]
        assert await status_of(b"GARBAGE\r\n\r\n") == b"HTTP/1.1 400 Bad Request"
        # (a Host header: without one h11 refuses an HTTP/1.1 request with 400 before its size matters)
        assert (await ask(b"GET /v2/models/m HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 70000 + b"\r\n\r\n"))[0] == 431
        assert (await ask(b"GET http://x/v2/repository/index HTTP/1.1\r\nHost: x\r\n\r\n"))[0] == 400
    run(scenario)


def test_openai_api_through_the_official_client():
    """The OpenAI API (v1.py) over a fake generate_stream, driven by the `openai` client: models, an answer, its
    stream (the role, one chunk per event, the finish, the usage), refusals in OpenAI's shape with their status
    (pydantic's checks, the model's 400 before the first chunk), an error event mid-stream, a cut stream, and a
    client that hangs up (the upstream connection is closed)."""
    openai = pytest.importorskip("openai")

    async def scenario(front, sup, fake):
        c = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{front.port}/v1", api_key="none", max_retries=0)
        hi = [{"role": "user", "content": "hi"}]
        try:
            assert [m.id for m in (await c.models.list()).data] == ["chat"]
            assert (await c.models.retrieve("chat")).id == "chat"
            r = await c.chat.completions.create(model="chat", messages=hi, max_tokens=3, temperature=0)
            assert r.choices[0].message.content == "abc" and r.choices[0].finish_reason == "length"
            assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (2, 3) and not front.inflight
            sent = json.loads(fake.requests[-1][3])
            assert json.loads(sent.pop("messages")) == hi and sent == {"max_tokens": 3, "temperature": 0.0,
                                                                       "top_p": 1.0, "stream": True}
            chunks = [ch async for ch in await c.chat.completions.create(
                model="chat", messages=hi, temperature=0, stream=True, stream_options={"include_usage": True})]
            assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].usage.completion_tokens == 3
            assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == "abc"
            text = await c.completions.create(model="chat", prompt="p", temperature=0)
            assert text.choices[0].text == "abc" and text.object == "text_completion"
            for kwargs, status, param in (({"temperature": 5}, 400, "temperature"), ({"model": "nope"}, 404, "model"),
                                          ({"extra_body": {"knob": 1}}, 400, "knob"),
                                          ({"messages": [{"role": "user", "content": "refuse"}]}, 400, None)):
                with pytest.raises(openai.APIStatusError) as e:
                    await c.chat.completions.create(**{"model": "chat", "messages": hi, **kwargs})
                err = e.value.response.json()["error"]
                assert e.value.status_code == status and err["param"] == param and set(err) == {
                    "message", "type", "param", "code"}, err
            with pytest.raises(openai.APIStatusError) as e:                 # refused before the first chunk
                await c.chat.completions.create(model="chat", stream=True, messages=[{"role": "user",
                                                                                      "content": "refuse"}])
            assert e.value.status_code == 400 and "beyond the context" in e.value.message
            with pytest.raises(openai.APIError, match="boom"):              # an error event after the first chunk
                async for _ in await c.chat.completions.create(model="chat", stream=True, messages=[
                        {"role": "user", "content": "fail"}]):
                    pass
            stream = await c.chat.completions.create(model="chat", stream=True, messages=[{"role": "user",
                                                                                          "content": "slow"}])
            first = await anext(stream.__aiter__())
            assert first.choices[0].delta.role == "assistant"
            assert front.cut(front.pending("chat"), "chat died") == 1
            with pytest.raises(openai.APIError, match="chat died"):
                async for _ in stream:
                    pass
        finally:
            await c.close()
        fake.closed.clear()                                               # a client that hangs up mid-stream
        r, w = await asyncio.open_connection("127.0.0.1", front.port)
        w.write(request("POST", "/v1/chat/completions", json.dumps(
            {"model": "chat", "stream": True, "messages": [{"role": "user", "content": "slow"}]}).encode(),
            "Content-Type: application/json\r\n"))
        head = b""
        while head.count(b"data:") < 2:
            head += await r.read(1024)
        t0 = time.monotonic()
        w.close()
        await asyncio.wait_for(fake.closed.wait(), 3)
        assert time.monotonic() - t0 < 2.0                                  # not the 4 s the whole stream takes
        while front.inflight:
            await asyncio.sleep(0.01)
    run(scenario)
