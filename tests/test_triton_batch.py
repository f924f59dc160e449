"""The Triton model in batching mode (`eaglex triton --max-batch N`, the default): one instance whose engine thread
decodes every request in flight, against the real tritonserver on loopback through the supervised server
(eaglex serve), serving the Llama fixture with its EAGLE-3 head.

- concurrent requests, greedy and sampled, one-shot and streamed, with bad requests and clients that hang up
  mid-stream mixed in: every greedy output is the alone-vanilla one, streamed chunks join to it, equal seeds give
  equal outputs, the bad ones get their 400 and the others never notice;
- more requests than slots + queue: the excess is refused with 503 and every accepted one is still exact; the
  gauges show the batch full and requests waiting;
- a request cancelled while it waits behind a full batch leaves the queue at once, and the others are exact: the
  model in this process (test_triton's stand-in for Triton's Python-backend module), driven without timing;
- `eaglex triton` batches by default with one instance, and refuses batching over several instances.

kill -9 under a full batch is in test_triton_batch_robust.py (a server of its own).
"""
from __future__ import annotations

import json
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from test_triton import (  # noqa: F401
    GREEDY_PROMPTS,
    FakeRequest,
    checkpoint,
    counter,
    ids_of,
    load_in_process,
    metrics,
    model_module,
    needs_triton,
    post,
    reference,
    serve,
    stop_served,
)

from eaglex.serving.repository import write_repository

MAX_BATCH, MAX_QUEUE = 4, 24


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):  # noqa: F811
    work = tmp_path_factory.mktemp("triton-batch")
    write_repository(checkpoint, work / "repo", "eaglex", instances=1, threads=1, max_queue_size=MAX_QUEUE,
                     max_batch=MAX_BATCH)
    assert 'key: "max_batch" value: { string_value: "4" }' in (work / "repo" / "eaglex" / "config.pbtxt").read_text()
    srv = serve(work / "repo", work)
    try:
        yield srv
    finally:
        st = stop_served(srv)
        print(f"\n[triton batch] ready in {srv.startup_seconds:.1f} s, stopped in {st['stop_seconds']:.1f} s",
              file=sys.stderr)


def hang_up_mid_stream(srv, text: str) -> str:
    """An HTTP client that reads the first event of a long stream and disconnects."""
    body = json.dumps({"text_input": text, "max_tokens": 400, "stream": True, "temperature": 1.0, "seed": 3}).encode()
    with socket.create_connection(("127.0.0.1", srv.http_port), timeout=60) as s:
        s.sendall(b"POST /v2/models/eaglex/generate_stream HTTP/1.1\r\nHost: localhost\r\n"
                  b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        got = b""
        while b"data:" not in got:
            chunk = s.recv(4096)
            if not chunk:
                return "closed"
            got += chunk
    return "hung up"


@needs_triton
def test_mixed_load_every_request_exact(server, reference):  # noqa: F811
    run_vanilla, tok = reference
    before = metrics(server)
    jobs = []                                  # (kind, body)
    for i, text in enumerate(GREEDY_PROMPTS * 2):                  # 16 greedy, short and long, half streamed
        body = {"text_input": text, "max_tokens": (6, 40, 150, 17)[i % 4]}
        jobs.append(("stream" if i % 2 else "one", body))
    for seed in (7, 8):                                           # sampled, each sent twice
        body = {"text_input": "draft then verify", "max_tokens": 60, "temperature": 0.9, "top_p": 0.95,
                "seed": seed}
        jobs += [("one", body), ("one", dict(body))]
    jobs += [("bad", {"text_input": "", "max_tokens": 5}), ("bad", {"text_input": "hi", "top_p": 1.5}),
             ("bad", {"input_ids": [1, 99]}), ("hangup", "hello"), ("hangup", "eagle")]
    order = list(range(len(jobs)))
    order = order[::3] + order[1::3] + order[2::3]                 # bad and hang-ups spread among the others

    def run(k):
        kind, body = jobs[k]
        if kind == "hangup":
            return hang_up_mid_stream(server, body)
        if kind == "stream":
            return post(server, "generate_stream", {**body, "stream": True})
        return post(server, "generate", body)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(jobs)) as pool:
        done = dict(zip(order, pool.map(run, order)))
    wall = time.perf_counter() - t0

    tokens = 0
    for k, (kind, body) in enumerate(jobs):
        out = done[k]
        if kind == "hangup":
            assert out == "hung up"
            continue
        status, res = out
        if kind == "bad":
            assert status == 400, (body, res)
            continue
        assert status == 200, (body, res)
        if kind == "stream":
            *chunks, final = res
            ids = [i for c in chunks for i in ids_of(c["output_ids"])]
            assert "".join(c["text_output"] for c in res) == tok.decode(ids, skip_special_tokens=True)
            assert final["finish_reason"] in ("eos", "length")
        else:
            ids = ids_of(res["output_ids"])
        tokens += len(ids)
        if "temperature" not in body:
            assert ids == run_vanilla(body["text_input"], body["max_tokens"]), body
    sampled = [ids_of(done[k][1]["output_ids"]) for k in range(16, 20)]
    assert sampled[0] == sampled[1] and sampled[2] == sampled[3]
    print(f"\n[triton batch] {len(jobs)} concurrent requests (max batch {MAX_BATCH}): {wall:.2f} s wall, "
          f"{tokens} tokens, {tokens / wall:.0f} tokens/s", file=sys.stderr)

    key = 'eaglex_requests_total{model="eaglex",outcome="%s"}'
    deadline = time.monotonic() + 30
    while metrics(server).get(key % "cancelled", 0) < before.get(key % "cancelled", 0) + 2:
        assert time.monotonic() < deadline, "the hung-up streams were not stopped"
        time.sleep(0.2)
    m = metrics(server)
    assert m[key % "success"] - before.get(key % "success", 0) == 20
    assert m[key % "invalid"] - before.get(key % "invalid", 0) == 3
    assert m['eaglex_kv_slot_bytes{model="eaglex"}'] > 0
    assert m['eaglex_active_requests{model="eaglex"}'] == 0 and m['eaglex_queue_depth{model="eaglex"}'] == 0
    assert server.ready()


@needs_triton
def test_beyond_slots_and_queue_is_refused_with_503(server, reference):  # noqa: F811
    run_vanilla, _ = reference
    n, body = 2 * (MAX_BATCH + MAX_QUEUE), {"text_input": "triton server", "max_tokens": 120}
    seen = {"active": 0, "waiting": 0}

    def watch():
        end = time.monotonic() + 60
        while time.monotonic() < end and not stop:
            m = metrics(server)
            seen["active"] = max(seen["active"], m.get('eaglex_active_requests{model="eaglex"}', 0))
            seen["waiting"] = max(seen["waiting"], m.get('eaglex_queue_depth{model="eaglex"}', 0))
            time.sleep(0.05)

    stop = False
    with ThreadPoolExecutor(n + 1) as pool:
        watcher = pool.submit(watch)
        # all n clients post at once: started one by one on a loaded host, they trickled in slower than the
        # server drained them and the queue never filled
        ready = threading.Barrier(n)
        results = list(pool.map(lambda _: (ready.wait(), post(server, "generate", body))[1], range(n)))
        stop = True
        watcher.result()
    codes = [s for s, _ in results]
    assert set(codes) <= {200, 503} and codes.count(503) > 0 and codes.count(200) >= MAX_BATCH + MAX_QUEUE // 2
    assert all("queue" in out["error"] for s, out in results if s == 503)
    want = run_vanilla(body["text_input"], body["max_tokens"])
    assert all(ids_of(out["output_ids"]) == want for s, out in results if s == 200)
    # sampled every 50 ms: never above the slots, several at once, requests waiting (the exact peak can be missed)
    assert 2 <= seen["active"] <= MAX_BATCH and 0 < seen["waiting"] <= MAX_QUEUE, seen
    print(f"\n[triton batch] {n} at once: {codes.count(200)} served, {codes.count(503)} refused (503); "
          f"gauges peaked at {seen}", file=sys.stderr)
    assert server.ready()


def test_cli_batches_by_default_with_one_instance(checkpoint, tmp_path):  # noqa: F811
    from eaglex.cli import main
    cfg = lambda: (tmp_path / "r" / "eaglex" / "config.pbtxt").read_text()  # noqa: E731
    assert main(["triton", "--engine", str(checkpoint), "--out", str(tmp_path / "r")]) == 0
    assert 'key: "max_batch" value: { string_value: "16" }' in cfg() and "count: 1 kind" in cfg()
    assert main(["triton", "--engine", str(checkpoint), "--out", str(tmp_path / "r"), "--instances", "2",
                 "--force"]) == 0
    assert 'key: "max_batch" value: { string_value: "0" }' in cfg() and "count: 2 kind" in cfg()
    assert main(["triton", "--engine", str(checkpoint), "--out", str(tmp_path / "r"), "--instances", "2",
                 "--max-batch", "8", "--force"]) == 2


def test_a_request_cancelled_while_waiting_for_a_slot_leaves_the_others_exact(  # noqa: F811
        checkpoint, reference, tmp_path, monkeypatch):  # noqa: F811
    """The batching model in this process, driven without timing: MAX_BATCH long requests and one more reach the
    engine thread in one go (the test holds its lock while they are enqueued), so the batch fills and the last one
    waits. Once every slot is decoding (seen from the engine thread's own cancellation checks) the waiting request is
    cancelled: it must leave the queue with CANCELLED before any other request finishes (it was never admitted),
    and the others are exact."""
    run_vanilla, _ = reference
    body = {"text_input": "hello world", "max_tokens": 400}
    want = run_vanilla(body["text_input"], body["max_tokens"])
    assert len(want) > 20, "the busy requests must decode for several cycles"
    monkeypatch.setattr(model_module(), "QUEUE_CHECK_S", 0.0)    # the queue is asked every step, not every 0.2 s
    model = load_in_process(write_repository(checkpoint, tmp_path / "repo", threads=1, max_batch=MAX_BATCH,
                                             max_queue_size=MAX_QUEUE))
    b, cancel, seen = model.batching, threading.Event(), {}

    def busy_cancelled() -> bool:
        """Asked on the engine thread after each cycle of a decoding request: raise the flag once all slots are."""
        if len(b.gen.active) == MAX_BATCH and not cancel.is_set():
            seen["waiting when cancelled"] = len(b.gen.queue)
            cancel.set()
        return False

    def waiting_cancelled() -> bool:
        if cancel.is_set():
            seen.setdefault("in flight when dropped", b.gen.in_flight)
        return cancel.is_set()

    busy = [FakeRequest(cancelled=busy_cancelled, **body) for _ in range(MAX_BATCH)]
    waiting = FakeRequest(cancelled=waiting_cancelled, text_input="draft", max_tokens=400, stream=True)
    cancelled, success = counter("cancelled"), counter("success")
    try:
        with b.lock:
            model.execute(busy + [waiting])
        got = [r.result() for r in busy]
        dropped = waiting.result()
    finally:
        model.finalize()
    assert seen == {"waiting when cancelled": 1, "in flight when dropped": MAX_BATCH}, seen
    assert dropped["error"] == "CANCELLED" and dropped["ids"] == [] and len(waiting.responses) == 1
    assert waiting.final_at < min(r.final_at for r in busy), "the cancelled request was not dropped from the queue"
    assert all(g["error"] is None and g["ids"] == want for g in got)
    assert counter("cancelled") == cancelled + 1 and counter("success") == success + MAX_BATCH

