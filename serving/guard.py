"""What the front refuses before anything parses a request, and the checks it makes on Triton's JSON.

- `Guard`, the ASGI middleware in front of the whole app (front.py): request headers above 64 KiB (or more than 100
  of them) get 431; a request target that is not a path (absolute-form, `*`) gets 400; with an API key, every
  request but the health checks and the administrative APIs needs `Authorization: Bearer <key>` (401); a body above
  `max_body` gets 413, from its Content-Length or while a chunked body comes in; JSON nested deeper than `max_depth`
  gets 400; a body not arrived `head_timeout` s after its head gets 408. All of this happens before any JSON parser
  (Triton's, pydantic's) sees the body: tritonserver 2.51 dies (SIGSEGV) on one ~200 KB body of nested JSON.
- Pure functions, unit-tested: `json_depth_ok`; `check_value` / `check_generate` / `check_infer`, a generate-extension
  or JSON /infer body against the declared input types (Triton would answer 500 for a wrong JSON type, and wrap
  INT32 `max_tokens` 4294967297 around to 1); `route`, what a path is, for the admin and health rules.
- `error_response`: an `ApiError` as OpenAI's error shape on /v1, Triton's (`{"error": message}`) elsewhere.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import math
import re
import time
from urllib.parse import unquote

from starlette.datastructures import Headers
from starlette.responses import Response

from .openai import ApiError

ADMIN_ROOTS = ("systemsharedmemory", "cudasharedmemory", "repository", "logging", "trace")
INFER_ENDPOINTS = ("infer", "generate", "generate_stream")
OPEN_KINDS = ("live", "ready", "model_ready", "admin")     # no API key needed (admin APIs have their own key)
INT_RANGES = {f"{s}INT{b}": ((0, 2 ** b - 1) if s else (-2 ** (b - 1), 2 ** (b - 1) - 1))
              for s in ("", "U") for b in (8, 16, 32, 64)}
FLOAT_MAX = {"FP16": 65504.0, "BF16": 3.3895313892515355e38, "FP32": 3.4028234663852886e38,
             "FP64": 1.7976931348623157e308}
MAX_HEAD, MAX_HEADERS = 1 << 16, 100                  # request headers: bytes, count
LINGER_S, LINGER_BYTES = 2.0, 64 << 20               # reading and dropping what follows an early answer

_ESCAPE = re.compile(rb"\\.", re.DOTALL)
_STRING = re.compile(rb'"[^"]*"')
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")


def error_response(path: str, e: ApiError) -> Response:
    """OpenAI's error shape on /v1, Triton's ({"error": message}) elsewhere."""
    body = e.body() if route(path)[0] == "openai" else json.dumps({"error": e.message}).encode()
    return Response(body, e.status, e.headers, media_type="application/json")


class Guard:
    """The ASGI middleware (see the module docstring). `front` gives max_body, max_depth, api_key and the `refused`
    counters. The body, once read and checked, is handed on to the app as one message."""

    def __init__(self, app, front):
        self.app, self.front = app, front

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        front, headers, path = self.front, Headers(scope=scope), scope["raw_path"].decode("latin-1")
        length = headers.get("content-length")          # h11 has checked that it is a number
        body_coming = "transfer-encoding" in headers or (length or "0") != "0"
        # h11 bounds only a request head that is still incomplete; one that came whole is bounded here
        if len(scope["headers"]) > MAX_HEADERS or sum(len(k) + len(v) + 4 for k, v in scope["headers"]) > MAX_HEAD:
            return await self._refuse(scope, receive, send, ApiError(431, "request headers too large"),
                                      unread=body_coming)
        if not path.startswith("/"):                  # absolute-form or '*': not for an origin server
            return await self._refuse(scope, receive, send, ApiError(400, "the request target must be a path"),
                                      unread=body_coming)
        if front.api_key is not None and route(path)[0] not in OPEN_KINDS:
            given = headers.get("authorization", "").removeprefix("Bearer ").strip()
            if not hmac.compare_digest(given.encode(), front.api_key.encode()):
                front.refused["unauthorized"] += 1
                return await self._refuse(scope, receive, send, ApiError(
                    401, "missing or wrong API key: send the header Authorization: Bearer <key>",
                    headers={"WWW-Authenticate": "Bearer"}), unread=body_coming)
        if length is not None and int(length) > front.max_body:
            front.refused["too_large"] += 1
            return await self._refuse(scope, receive, send, ApiError(
                413, f"the request body is {int(length)} bytes; this server accepts at most {front.max_body}"),
                unread=True)
        body, more = bytearray(), True
        end = time.monotonic() + front.head_timeout       # the whole body, as the head: no trickling (slow loris)
        while more:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, end - time.monotonic()))
            except asyncio.TimeoutError:
                return await self._refuse(scope, receive, send, ApiError(
                    408, f"the request body did not arrive within {front.head_timeout:g} s"), unread=True)
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > front.max_body:
                front.refused["too_large"] += 1
                return await self._refuse(scope, receive, send, ApiError(
                    413, f"the request body is above {front.max_body} bytes"), unread=more)
        if body:
            json_part = bytes(body)
            header_len = headers.get("inference-header-content-length")    # binary tensors follow the JSON
            if header_len is not None:
                if not header_len.isdigit() or int(header_len) > len(body):
                    return await self._refuse(scope, receive, send,
                                              ApiError(400, "invalid inference-header-content-length"), unread=False)
                json_part = json_part[:int(header_len)]
            if not json_depth_ok(json_part, front.max_depth):
                front.refused["too_deep"] += 1
                return await self._refuse(scope, receive, send, ApiError(
                    400, f"the request JSON nests deeper than {front.max_depth} levels"), unread=False)

        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()               # after the body: the client's disconnect
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)

    @staticmethod
    async def _refuse(scope, receive, send, e: ApiError, unread: bool) -> None:
        """Answer `e`. With the body still `unread`, the connection then closes, but only after reading and dropping
        what the client still sends, for a bounded time: closing a socket with unread input sends a RST, which can
        destroy the answer before the client reads it."""
        response = error_response(scope["raw_path"].decode("latin-1"), e)
        expects = Headers(scope=scope).get("expect", "").lower() == "100-continue"
        if unread:
            response.headers["Connection"] = "close"
        await send({"type": "http.response.start", "status": response.status_code, "headers": response.raw_headers})
        await send({"type": "http.response.body", "body": response.body, "more_body": True})
        end, n, more = time.monotonic() + LINGER_S, 0, unread and not expects   # 100-continue: nothing will come
        while more and n < LINGER_BYTES and time.monotonic() < end:
            try:
                message = await asyncio.wait_for(receive(), end - time.monotonic())
            except asyncio.TimeoutError:
                break
            n += len(message.get("body", b""))
            more = message["type"] == "http.request" and message.get("more_body", False)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


# --- the checks (pure functions) ------------------------------------------------------------------------------------
def json_depth_ok(data: bytes, limit: int) -> bool:
    """False when the JSON text nests arrays/objects deeper than `limit`. Linear time, no parsing: escapes and
    strings are removed with two regular expressions (neither can backtrack), then brackets are counted."""
    if data.count(b"[") + data.count(b"{") <= limit:
        return True
    text = _STRING.sub(b"", _ESCAPE.sub(b"_", data))
    quote = text.find(b'"')                          # an unterminated string: what follows it is not structure
    if quote >= 0:
        text = text[:quote]
    depth = 0
    for c in text.translate(None, _NOT_BRACKET):
        if c == 91 or c == 123:                      # [ {
            depth += 1
            if depth > limit:
                return False
        else:
            depth -= 1
    return True


def _leaves(value, depth: int = 0):
    if isinstance(value, list):
        for v in value:
            yield from _leaves(v, depth + 1)
    else:
        yield value


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_value(name: str, value, datatype: str) -> str | None:
    """Why `value` (a JSON scalar or nested list) cannot be `datatype` (Triton's name: INT32, FP32, BYTES, ...)."""
    dt = datatype.upper().removeprefix("TYPE_")
    for v in _leaves(value):
        if dt in ("BYTES", "STRING"):
            if not isinstance(v, str):
                return f"{name} must be a string (BYTES), got {_short(v)}"
        elif dt == "BOOL":
            if not isinstance(v, bool):
                return f"{name} must be true or false (BOOL), got {_short(v)}"
        elif dt in INT_RANGES:
            lo, hi = INT_RANGES[dt]
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                return f"{name} must be an integer in [{lo}, {hi}] ({dt}), got {_short(v)}"
        elif dt in FLOAT_MAX:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or abs(v) > FLOAT_MAX[dt]:
                return f"{name} must be a finite number within {dt}'s range, got {_short(v)}"
    return None


def check_parameter(name: str, value) -> str | None:
    """Request parameters: a string, a boolean, a finite number or an int64 integer (what Triton stores)."""
    if isinstance(value, (str, bool)):
        return None
    if isinstance(value, int):
        lo, hi = INT_RANGES["INT64"]
        return None if lo <= value <= hi else f"parameter {name} must fit in int64, got {_short(value)}"
    if isinstance(value, float):
        return None if math.isfinite(value) else f"parameter {name} must be finite, got {_short(value)}"
    return f"parameter {name} must be a string, a number or a boolean, got {_short(value)}"


def check_generate(body, inputs: dict | None) -> str | None:
    """A generate-extension body: a JSON object whose keys are input names (checked against their declared types),
    `parameters` (an object of parameters) or anything else (a parameter, as Triton treats it)."""
    if not isinstance(body, dict):
        return "the request body must be a JSON object"
    for key, value in body.items():
        if key == "parameters":
            if not isinstance(value, dict):
                return "parameters must be a JSON object"
            for k, v in value.items():
                if (err := check_parameter(k, v)) is not None:
                    return err
        elif key == "id":
            if not isinstance(value, str):
                return f"id must be a string, got {_short(value)}"
        elif inputs and key in inputs:
            if (err := check_value(key, value, inputs[key])) is not None:
                return err
        elif (err := check_parameter(key, value)) is not None:
            return err
    return None


def check_infer(body) -> str | None:
    """A JSON /infer body (KServe v2): each input's `data` against the datatype the request declares."""
    if not isinstance(body, dict):
        return "the request body must be a JSON object"
    inputs = body.get("inputs", [])
    if not isinstance(inputs, list):
        return "inputs must be a list"
    for item in inputs:
        if not isinstance(item, dict):
            return "each input must be a JSON object"
        name, datatype = item.get("name"), item.get("datatype")
        if not isinstance(name, str) or not isinstance(datatype, str):
            return "each input needs a string name and datatype"
        if "data" in item and (err := check_value(name, item["data"], datatype)) is not None:
            return err
        shape = item.get("shape", [])
        if not isinstance(shape, list) or check_value(f"{name}'s shape", shape, "INT64") is not None:
            return f"{name}'s shape must be a list of int64 integers"
        for k, v in (item.get("parameters") or {}).items():
            if (err := check_parameter(k, v)) is not None:
                return err
    for k, v in (body.get("parameters") or {}).items():
        if (err := check_parameter(k, v)) is not None:
            return err
    return None


def route(path: str) -> tuple[str, str | None, str | None]:
    """(kind, model, endpoint) of a request path; kind: openai, admin, live, ready, model_ready, infer, other.
    The path is percent-decoded and its empty segments dropped first, so that no spelling reaches an admin API."""
    seg = [s for s in unquote(path.split("?", 1)[0]).lower().split("/") if s]
    if seg[:1] == ["v1"]:
        return "openai", None, None
    if seg[:1] != ["v2"]:
        return "other", None, None
    rest = seg[1:]
    if rest[:1] and rest[0] in ADMIN_ROOTS:
        return "admin", None, None
    if rest == ["health", "live"]:
        return "live", None, None
    if rest == ["health", "ready"]:
        return "ready", None, None
    if rest[:1] == ["models"] and len(rest) >= 2:
        original = [s for s in unquote(path.split("?", 1)[0]).split("/") if s]
        model, tail = original[2], rest[2:]
        if tail[:1] == ["versions"]:
            tail = tail[2:]
        if "trace" in tail:
            return "admin", model, None
        if tail == ["ready"]:
            return "model_ready", model, None
        if len(tail) == 1 and tail[0] in INFER_ENDPOINTS:
            return "infer", model, tail[0]
        return "other", model, None
    return "other", None, None
