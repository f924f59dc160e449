"""The OpenAI API of `eaglex serve`, driven by the official `openai` client (sync, async, streaming) against one
supervised server (in-flight batching, the Llama fixture with its EAGLE-3 head and a character tokenizer with a chat
template, an API key): greedy answers equal vanilla decoding of the same conversation (`eaglex generate --chat
--method vanilla`), streamed deltas join to the same text, concurrent requests are all exact, usage counts the
tokens, bad requests get 4xx in OpenAI's error shape while the server stays ready, a client that hangs up cancels
its request, and a killed backend process under load ends each request exactly or with a clean error.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
import threading
import time
import urllib.request
from pathlib import Path

import openai
import pytest
from test_triton import CHAT_TEMPLATE, checkpoint, metrics, needs_triton, serve, stop_served  # noqa: F401

from eaglex.base.prompts import chat_ids
from eaglex.cli import main
from eaglex.serving.processes import group_pids, stop_group, stubs
from eaglex.serving.repository import write_repository

pytestmark = needs_triton
KEY = "sk-eaglex-test"
CONVERSATIONS = [
    [{"role": "user", "content": "hello world"}],
    [{"role": "system", "content": "be brief."}, {"role": "user", "content": "the quick brown fox"}],
    [{"role": "user", "content": "eagle"}, {"role": "assistant", "content": "speculative decoding"},
     {"role": "user", "content": "draft then verify"}],
    [{"role": "user", "content": "zz top"}],
]


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):  # noqa: F811
    work = tmp_path_factory.mktemp("openai")
    write_repository(checkpoint, work / "repo", "eaglex", threads=1, max_batch=4, max_queue_size=32)
    srv = serve(work / "repo", work, api_key=KEY)
    srv.killed = False
    try:
        yield srv
    finally:
        if not srv.killed:
            stop_served(srv)
        else:           # an old version Triton cannot unload (its stub died under requests): stopped quickly, by kill
            pgid, shm, t0 = srv.server_pid, srv.state().get("shm", []), time.monotonic()
            srv.stop()
            left = group_pids(pgid) if pgid else []
            if left:
                stop_group(pgid, 1)
            assert time.monotonic() - t0 < 15 and not left, left
            assert not [n for n in shm if Path(f"/dev/shm/{n}").exists()], shm


@pytest.fixture(scope="module")
def vanilla(checkpoint):  # noqa: F811
    """(ids -> vanilla greedy output ids, tokenizer): the reference, in this process."""
    from transformers import AutoTokenizer

    from eaglex.runtime.generate import VanillaGenerator
    from eaglex.runtime.torch_backend import TorchBackend

    tok = AutoTokenizer.from_pretrained(checkpoint / "target")
    gen = VanillaGenerator(TorchBackend(checkpoint / "target"))
    return (lambda ids, n: gen.generate(ids, n).output_ids), tok


def client(srv, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0, timeout=120, **kw)


def expected(vanilla, messages, n):
    run, tok = vanilla
    ids = chat_ids(tok, messages)
    out = run(ids, n)
    return tok.decode(out, skip_special_tokens=True), len(ids), len(out)


def test_models(server):
    assert [m.id for m in client(server).models.list()] == ["eaglex"]
    assert client(server).models.retrieve("eaglex").id == "eaglex"


@pytest.mark.parametrize("i", range(len(CONVERSATIONS)))
def test_chat_greedy_equals_vanilla_with_usage(server, vanilla, i):
    messages, n = CONVERSATIONS[i], 60 if i % 2 else 200
    text, prompt_tokens, completion_tokens = expected(vanilla, messages, n)
    r = client(server).chat.completions.create(model="eaglex", messages=messages, max_tokens=n, temperature=0)
    assert r.choices[0].message.content == text and r.choices[0].message.role == "assistant"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (prompt_tokens, completion_tokens)
    assert r.usage.total_tokens == prompt_tokens + completion_tokens
    assert r.choices[0].finish_reason == ("length" if completion_tokens == n else "stop")
    assert r.object == "chat.completion" and r.model == "eaglex" and len(r.choices) == 1


def test_chat_equals_eaglex_generate_chat_vanilla(server, checkpoint, vanilla, tmp_path):  # noqa: F811
    """The goal's own words: the answer of `eaglex generate --chat --method vanilla` on the same engine."""
    _, tok = vanilla
    out = tmp_path / "out.jsonl"
    assert main(["generate", "--engine", str(checkpoint), "--method", "vanilla", "--chat", "--prompt", "lossless: 42!",
                 "--max-new-tokens", "80", "--out", str(out)]) == 0
    ids = json.loads(out.read_text())["output_ids"]
    r = client(server).chat.completions.create(model="eaglex", max_completion_tokens=80, temperature=0,
                                               messages=[{"role": "user", "content": "lossless: 42!"}])
    assert r.choices[0].message.content == tok.decode(ids, skip_special_tokens=True)
    assert r.usage.completion_tokens == len(ids)


def test_completions_take_raw_text(server, vanilla):
    run, tok = vanilla
    ids = run(tok("the quick brown fox")["input_ids"], 50)
    r = client(server).completions.create(model="eaglex", prompt="the quick brown fox", max_tokens=50, temperature=0)
    assert r.choices[0].text == tok.decode(ids, skip_special_tokens=True) and r.usage.completion_tokens == len(ids)
    assert r.object == "text_completion"
    chunks = list(client(server).completions.create(model="eaglex", prompt="the quick brown fox", max_tokens=50,
                                                    temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text


@pytest.mark.parametrize("sampled", [False, True])
def test_stream_deltas_join_to_the_same_text(server, vanilla, sampled):
    messages = CONVERSATIONS[2]
    kw = dict(temperature=0.9, top_p=0.95, seed=7) if sampled else dict(temperature=0)
    whole = client(server).chat.completions.create(model="eaglex", messages=messages, max_tokens=150, **kw)
    stream = client(server).chat.completions.create(model="eaglex", messages=messages, max_tokens=150, stream=True,
                                                    stream_options={"include_usage": True}, **kw)
    chunks = list(stream)
    *deltas, last = chunks
    assert deltas[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in deltas) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in deltas][-1] == whole.choices[0].finish_reason
    assert last.choices == [] and last.usage == whole.usage            # include_usage: the last chunk
    assert len(deltas) > 3                                               # one chunk per cycle, not one at the end
    if not sampled:
        assert whole.choices[0].message.content == expected(vanilla, messages, 150)[0]


def test_concurrent_async_requests_are_all_exact(server, vanilla):
    jobs = [(m, n) for m in CONVERSATIONS for n in (40, 160)]
    want = [expected(vanilla, m, n) for m, n in jobs]

    async def run():
        c = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)

        async def one(m, n, stream):
            if not stream:
                r = await c.chat.completions.create(model="eaglex", messages=m, max_tokens=n, temperature=0)
                return r.choices[0].message.content, r.usage.completion_tokens
            s = await c.chat.completions.create(model="eaglex", messages=m, max_tokens=n, temperature=0,
                                                stream=True, stream_options={"include_usage": True})
            text, usage = "", None
            async for ch in s:
                text += "".join(x.delta.content or "" for x in ch.choices)
                usage = ch.usage or usage
            return text, usage.completion_tokens
        try:
            return await asyncio.gather(*(one(m, n, i % 2) for i, (m, n) in enumerate(jobs)))
        finally:
            await c.close()
    got = asyncio.run(run())
    assert got == [(text, completion) for text, _, completion in want]


BAD = [
    # (endpoint, request, status, param, part of the message)
    ("chat", {"model": "nope"}, 404, "model", "does not exist"),
    ("chat", {"temperature": 3}, 400, "temperature", "temperature must be"),
    ("chat", {"temperature": "hot"}, 400, "temperature", "must be a number"),
    ("chat", {"top_p": 0}, 400, "top_p", "top_p must be > 0"),
    ("chat", {"n": 2}, 400, "n", "n must be 1"),
    ("chat", {"max_tokens": 0}, 400, "max_tokens", "max_tokens must be >= 1"),
    ("chat", {"max_tokens": 1.5}, 400, "max_tokens", "must be an integer"),
    ("chat", {"max_tokens": 100000}, 400, None, "beyond the context"),
    ("chat", {"messages": []}, 400, "messages", "non-empty list"),
    ("chat", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role", "must be one of"),
    ("chat", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", "string or a list"),
    ("chat", {"stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "up to 4"),
    ("chat", {"seed": "x"}, 400, "seed", "must be an integer"),
    ("chat", {"logprobs": True}, 400, "logprobs", "not supported"),
    ("chat", {"presence_penalty": 1.0}, 400, "presence_penalty", "not supported"),
    ("chat", {"stream": "yes"}, 400, "stream", "true or false"),
    ("chat", {"stream_options": {"include_usage": True}}, 400, "stream_options", "only allowed with stream"),
    ("chat", {"extra_knob": 1}, 400, "extra_knob", "Unrecognized request argument"),
    ("chat", {"messages": [{"role": "user", "content": "a" * 70000}]}, 400, None, "at most 65536"),
    ("text", {"prompt": ["one", "two"]}, 400, "prompt", "one string"),
    ("text", {"prompt": ""}, 400, "prompt", "must not be empty"),
]


def _post(srv, path: str, body: bytes, key: str | None = KEY) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(f"{srv.url}{path}", data=body, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _error_shape(body: dict) -> dict:
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def test_bad_requests_get_4xx_in_openai_shape_and_the_server_stays_ready(server):
    c = client(server)
    for endpoint, change, status, param, message in BAD:
        base = ({"model": "eaglex", "messages": [{"role": "user", "content": "hi"}]} if endpoint == "chat" else
                {"model": "eaglex", "prompt": "hi"})
        kwargs = {**base, **change}
        create = c.chat.completions.create if endpoint == "chat" else c.completions.create
        model, rest = kwargs.pop("model"), kwargs
        known = {k: rest.pop(k) for k in list(rest) if k in ("messages", "prompt")}
        with pytest.raises(openai.APIStatusError) as e:
            create(model=model, **known, extra_body=rest)
        err = _error_shape(e.value.response.json())
        assert e.value.status_code == status and message in err["message"], (change, err)
        assert err["param"] == param and err["type"] == "invalid_request_error", (change, err)
        assert server.ready()
    # what the SDK would never send: bodies that are not JSON, too deep, too large
    for body, status, message in ((b"{not json", 400, "not valid JSON"),
                                  (b'{"model": ' + b"[" * 100 + b"]" * 100 + b"}", 400, "nests deeper than 64"),
                                  (b'{"model": "' + b"a" * (1 << 20) + b'"}', 413, "accepts at most"),
                                  (b"[1, 2]", 400, "JSON object")):
        got, out = _post(server, "/v1/chat/completions", body)
        assert got == status and message in _error_shape(out)["message"], (status, out)
    assert _post(server, "/v1/nothing", b"{}")[0] == 404
    r = c.chat.completions.create(model="eaglex", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert r.usage.completion_tokens == 4 and server.ready()


def test_the_api_key_is_required_but_not_for_health_checks(server):
    with pytest.raises(openai.AuthenticationError) as e:
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-wrong", max_retries=0).models.list()
    assert e.value.status_code == 401 and "API key" in _error_shape(e.value.response.json())["message"]
    status, out = _post(server, "/v1/chat/completions", b'{"model": "eaglex"}', key=None)
    assert status == 401 and "API key" in _error_shape(out)["message"]
    assert _post(server, "/v2/models/eaglex/generate", b'{"text_input": "hi"}', key=None)[0] == 401
    assert server.ready()                                           # /v2/health/ready needs no key


def test_a_client_that_hangs_up_cancels_its_request(server):
    before = metrics(server).get('eaglex_requests_total{model="eaglex",outcome="cancelled"}', 0)
    body = json.dumps({"model": "eaglex", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 450,
                       "temperature": 1.0, "seed": 3, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
                  b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        got = b""
        while got.count(b"data:") < 2:
            chunk = s.recv(4096)
            assert chunk, got
            got += chunk
    deadline = time.monotonic() + 30
    while metrics(server).get('eaglex_requests_total{model="eaglex",outcome="cancelled"}', 0) < before + 1:
        assert time.monotonic() < deadline, "the request of the client that hung up was not cancelled"
        time.sleep(0.2)


def test_a_killed_backend_under_load_ends_requests_exactly_or_cleanly(server, vanilla):
    """kill -9 of the model's stub while streamed and plain requests run: each completes with the exact answer or
    fails with a 5xx / an error event (never a wrong or truncated answer presented as complete), nothing hangs, and
    the next request is served within 30 s. Last in this module: the server reloads its model."""
    jobs = [(CONVERSATIONS[i % 4], 300, bool(i % 2)) for i in range(8)]
    want = {i: expected(vanilla, m, n)[0] for i, (m, n, _) in enumerate(jobs)}
    results: dict[int, tuple[str, str]] = {}

    def one(i):
        m, n, stream = jobs[i]
        c = client(server)
        try:
            if stream:
                text = ""
                for ch in c.chat.completions.create(model="eaglex", messages=m, max_tokens=n, temperature=0,
                                                    stream=True):
                    text += "".join(x.delta.content or "" for x in ch.choices)
                results[i] = ("ok", text)
            else:
                r = c.chat.completions.create(model="eaglex", messages=m, max_tokens=n, temperature=0)
                results[i] = ("ok", r.choices[0].message.content)
        except openai.APIStatusError as e:
            results[i] = ("error", f"{e.status_code}")
        except openai.APIError as e:                # an error event inside a stream
            results[i] = ("stream-error", str(e))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    time.sleep(1.0)
    stub_pid, = stubs(server.server_pid)
    server.killed = True
    os.kill(stub_pid, signal.SIGKILL)
    t0 = time.monotonic()
    for t in threads:
        t.join(90)
    assert not any(t.is_alive() for t in threads), "a request hung"
    for i, (how, what) in results.items():
        if how == "ok":
            assert what == want[i], i
        elif how == "error":
            assert what.startswith("5"), (i, what)
    assert len(results) == len(jobs)
    deadline = t0 + 30
    while True:
        try:
            r = client(server).chat.completions.create(model="eaglex", messages=CONVERSATIONS[0], max_tokens=20,
                                                       temperature=0)
            assert r.choices[0].message.content == expected(vanilla, CONVERSATIONS[0], 20)[0]
            break
        except openai.APIStatusError as e:
            assert e.status_code >= 500 and time.monotonic() < deadline, e
            time.sleep(0.3)
    print(f"\n[openai] stub killed under 8 requests: {sum(h == 'ok' for h, _ in results.values())} exact, "
          f"{sum(h != 'ok' for h, _ in results.values())} clean errors; served again after "
          f"{time.monotonic() - t0:.1f} s", file=sys.stderr)
