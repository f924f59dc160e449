"""The chaos phase's verdicts (eaglex/bench_serve.py --chaos), table-driven, no server: how one of our client's
requests ended under a kill, and what AIPerf's per-request export says. The kills themselves run in
tests/test_openai.py and tests/test_triton_robust.py; the phase under AIPerf load runs in `make bench-serve`."""
from __future__ import annotations

import pytest

from eaglex import bench_serve

WANT = [5, 6, 7]


def rec(**kw) -> dict:
    """stream_request's record of a request that took 2 s, with `kw` changed."""
    return {"ids": [], "t0": 10.0, "end": 12.0, "error": None, "status": 200, "finish": None, "error_event": False,
            "timed_out": False} | kw


@pytest.mark.parametrize("record, expected", [
    (rec(ids=WANT, finish="length"), "exact"),
    (rec(ids=[5, 6, 8], finish="length"), "wrong"),                     # completed, other tokens
    (rec(ids=WANT[:2], finish="stop"), "wrong"),                         # ended early, said it was done
    (rec(ids=WANT[:2]), "cut"),                                          # no final event, no error: truncated
    (rec(ids=WANT, finish="length", end=80.0), "hung"),                  # exact but past the deadline
    (rec(error="503 unavailable", status=503), "5xx"),
    (rec(error="502 bad gateway", status=502), "5xx"),
    (rec(error="400 Stub process is not healthy", status=400), "4xx"),   # a server fault blamed on the request
    (rec(ids=WANT[:1], error="model eaglex is unavailable", error_event=True), "stream error"),
    (rec(ids=WANT[:1], error="ConnectionResetError: reset"), "cut"),     # 200, then the connection died
    (rec(error="ConnectionRefusedError: refused", status=None), "cut"),
    (rec(error="TimeoutError: timed out", timed_out=True, status=None), "hung"),
])
def test_outcome(record, expected):
    assert bench_serve.outcome(record, WANT, deadline=60.0) == expected
    assert (expected in bench_serve.CLEAN) != (expected in bench_serve.UNCLEAN)


def aiperf_record(seconds: float = 2.0, error: dict | None = None, usage: bool = True) -> dict:
    metrics = {"usage_completion_tokens": {"value": 48, "unit": "tokens"}} if usage and not error else {}
    return {"metadata": {"request_start_ns": 0, "request_end_ns": int(seconds * 1e9)}, "metrics": metrics,
            "error": error}


def test_aiperf_outcomes_count_errors_and_hangs():
    unavailable = {"code": 503, "type": "Service Unavailable", "message": '{"error": {"message": "model\n away"}}'}
    stream = {"code": 502, "type": "SSEResponseError", "message": "Error occurred in SSE response"}
    records = [aiperf_record(), aiperf_record(), aiperf_record(error=unavailable), aiperf_record(error=unavailable),
               aiperf_record(error=stream), aiperf_record(61.0, {"code": 0, "type": "TimeoutError", "message": "t"}),
               aiperf_record(70.0),                                     # completed, but past the deadline
               aiperf_record(usage=False)]                              # "completed": our error event, unseen
    got = bench_serve.aiperf_outcomes(records, deadline=60.0)
    assert (got["requests"], got["completed"], got["errored"], got["hung"]) == (8, 4, 4, 2)
    assert got["completed_without_usage"] == 1
    assert got["errors"][0] == {"code": 503, "type": "Service Unavailable", "count": 2,
                                "message": '{"error": {"message": "model away"}}'}
    assert sorted(e["count"] for e in got["errors"]) == [1, 1, 2]
