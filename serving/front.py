"""The HTTP front of a supervised tritonserver: a small loopback reverse proxy in front of Triton's HTTP port, and the
OpenAI API (openai.py) in front of the same models.

Triton cannot be configured to bound what its HTTP front end parses, and tritonserver 2.51 dies (SIGSEGV, nothing
logged) on one ~200 KB body of deeply nested JSON. Clients therefore talk to this front, and tritonserver's own HTTP
port is an internal loopback port. For each request the front:

- refuses bodies above `max_body` (413) and JSON nested deeper than `max_depth` (400) before anything parses them;
- checks generate-extension (and JSON /infer) values against the model's declared input types: wrong JSON types and
  integers outside the input's range (INT32 `max_tokens` 4294967297 would otherwise wrap to 1) get a 400 with the
  reason, instead of Triton's 500 or a silent wraparound;
- answers `/v2/health/live`, `/v2/health/ready` and `/v2/models/<m>[/versions/<v>]/ready` from the supervisor's
  view of the server and of each model's backend processes (Triton keeps answering 200 after a stub died);
- refuses inference with 503 + Retry-After while a model is being reloaded or the server restarted, and turns
  Triton's 400 "Stub process ... is not healthy" (a server fault) into a 503 and tells the supervisor, and a
  batching model's 400 "Exceeds maximum queue size" (its own queue is full) into a 503, as Triton's own queue says;
- refuses the administrative APIs (shared memory, model repository, logging, trace) with 403 unless the server
  was started with them open or the request carries the admin key header (Triton checks the same header);
- relays everything else byte for byte, streaming responses (generate_stream's server-sent events) as they come,
  and closes the upstream connection when the client goes away, so that Triton cancels the request;
- ends the requests the supervisor cuts (they were inside a backend process that died: Triton 2.51 never answers
  them) with a 503, or with an error event when their stream had begun, instead of leaving the client waiting;
  a request whose connection to tritonserver breaks (it died) gets a 502, or likewise an error event;
- serves `/v1/models`, `/v1/chat/completions` and `/v1/completions`: each request is checked (openai.py), sent to
  the model's generate_stream as one streamed generate request (so a client that hangs up cancels it the same
  way), and its events become OpenAI's chunks (`stream`) or one answer; errors take OpenAI's shape;
- with an API key, refuses every request but the health checks without `Authorization: Bearer <key>` (401).

Pure stdlib (asyncio); it runs in the supervisor's event loop (supervisor.py).
"""
from __future__ import annotations

import asyncio
import hmac
import json
import math
import re
import secrets
import sys
import time
import traceback
from urllib.parse import quote, unquote

from . import openai
from .openai import ApiError
from .tritonserver import ADMIN_HEADER

ADMIN_ROOTS = ("systemsharedmemory", "cudasharedmemory", "repository", "logging", "trace")
INFER_ENDPOINTS = ("infer", "generate", "generate_stream")
HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade",
              "expect", "proxy-authorization", "proxy-authenticate", "content-length"}
INT_RANGES = {f"{s}INT{b}": ((0, 2 ** b - 1) if s else (-2 ** (b - 1), 2 ** (b - 1) - 1))
              for s in ("", "U") for b in (8, 16, 32, 64)}
FLOAT_MAX = {"FP16": 65504.0, "BF16": 3.3895313892515355e38, "FP32": 3.4028234663852886e38,
             "FP64": 1.7976931348623157e308}
REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found",
           405: "Method Not Allowed", 408: "Request Timeout",
           411: "Length Required", 413: "Payload Too Large", 431: "Request Header Fields Too Large",
           500: "Internal Server Error", 501: "Not Implemented", 502: "Bad Gateway", 503: "Service Unavailable",
           505: "HTTP Version Not Supported"}

_ESCAPE = re.compile(rb"\\.", re.DOTALL)
_STRING = re.compile(rb'"[^"]*"')
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")


class HttpError(Exception):
    def __init__(self, status: int, message: str, headers: dict | None = None, close: bool = False):
        super().__init__(message)
        self.status, self.message, self.headers, self.close = status, message, headers or {}, close


class _Cut(Exception):
    """The supervisor ended a relayed request whose answer will never come (its backend process died under it)."""


class _Watch:
    """What a relay races against: `client`, a read on the client's socket (its end, or a pipelined request's
    bytes), and `cut`, a future the supervisor resolves with a message to end the request."""

    def __init__(self, client: asyncio.Future, cut: asyncio.Future):
        self.client, self.cut = client, cut


# --- body checks (pure functions, unit-tested) ---------------------------------------------------------------------
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
    """(kind, model, endpoint) of a request path; kind: admin, live, ready, model_ready, infer, other.
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


# --- HTTP plumbing ------------------------------------------------------------------------------------------------
class _Request:
    def __init__(self, method: str, target: str, version: str, headers: list[tuple[str, str]]):
        self.method, self.target, self.version, self.headers = method, target, version, headers

    def header(self, name: str) -> str | None:
        name = name.lower()
        for k, v in self.headers:
            if k.lower() == name:
                return v
        return None

    @property
    def keep_alive(self) -> bool:
        conn = (self.header("connection") or "").lower()
        return "keep-alive" in conn if self.version == "HTTP/1.0" else "close" not in conn


def response_bytes(status: int, body: bytes, headers: dict | None = None, keep_alive: bool = True) -> bytes:
    lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'Error')}"]
    hdrs = {"Content-Type": "application/json", **(headers or {}), "Content-Length": str(len(body)),
            "Connection": "keep-alive" if keep_alive else "close"}
    lines += [f"{k}: {v}" for k, v in hdrs.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def error_body(message: str) -> bytes:
    return json.dumps({"error": message}).encode()


class Front:
    """The proxy. `supervisor` provides: upstream() -> (host, port) | None, health() -> (live, ready, reason),
    model_ready(name) -> (ready: bool | None, reason) (None: not a model it knows), inputs(name) -> {input: type} |
    None, models (name -> ...), admin_key (str), admin_open (bool), on_unhealthy(model, message). `api_key`: the
    bearer key every request but the health checks must carry (None: none)."""

    def __init__(self, supervisor, host: str, port: int, max_body: int = 1 << 20, max_depth: int = 64,
                 max_connections: int = 1024, head_timeout: float = 30.0, idle_timeout: float = 75.0,
                 api_key: str | None = None):
        self.sup, self.host, self.port, self.api_key = supervisor, host, port, api_key
        self.max_body, self.max_depth, self.max_connections = max_body, max_depth, max_connections
        self.head_timeout, self.idle_timeout = head_timeout, idle_timeout
        self.server: asyncio.AbstractServer | None = None
        self.connections: set[asyncio.Task] = set()
        self.inflight: dict[str, set[asyncio.Future]] = {}     # model -> the cut futures of its relayed requests
        self.refused = {"too_large": 0, "too_deep": 0, "invalid": 0, "admin": 0, "unavailable": 0, "unauthorized": 0}

    async def start(self) -> "Front":
        self.server = await asyncio.start_server(self._client, self.host, self.port, limit=1 << 16,
                                                 reuse_address=True, backlog=512)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def close(self, drain: float = 0.0) -> None:
        """Stop accepting; after `drain` seconds, drop the connections still open."""
        if self.server is not None:
            self.server.close()
        end = time.monotonic() + drain
        while self.connections and time.monotonic() < end:
            await asyncio.sleep(0.05)
        for task in list(self.connections):
            task.cancel()
        if self.connections:
            await asyncio.gather(*self.connections, return_exceptions=True)

    def pending(self, model: str) -> list[asyncio.Future]:
        """The requests of `model` being relayed now, as handles for cut()."""
        return list(self.inflight.get(model, ()))

    @staticmethod
    def cut(requests: list[asyncio.Future], message: str) -> int:
        """End these relayed requests with `message` (those already answered are left alone); how many were ended."""
        ended = [f for f in requests if not f.done()]
        for f in ended:
            f.set_result(message)
        return len(ended)

    # --- one client connection --------------------------------------------------------------------------------
    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self.connections.add(task)
        try:
            if len(self.connections) > self.max_connections:
                self.refused["unavailable"] += 1
                writer.write(response_bytes(503, error_body("too many connections"), keep_alive=False))
                await writer.drain()
                return
            pending = bytearray()        # bytes read ahead while watching for a disconnect (pipelined requests)
            while True:
                try:
                    req = await self._read_head(reader, pending)
                except HttpError as e:
                    writer.write(response_bytes(e.status, error_body(e.message), keep_alive=False))
                    await writer.drain()
                    return await self._linger(reader, writer)
                if req is None:
                    return
                try:
                    keep = await self._handle(req, reader, writer, pending)
                except (HttpError, ApiError) as e:
                    close = getattr(e, "close", False)
                    keep = req.keep_alive and not close
                    writer.write(response_bytes(e.status, self._error_body(req, e), e.headers, keep))
                    await writer.drain()
                    if close:
                        return await self._linger(reader, writer)
                if not keep:
                    return
        except ValueError:                       # a line longer than the stream limit (64 KiB)
            try:
                writer.write(response_bytes(431, error_body("a request line or header is too long"),
                                            keep_alive=False))
                await writer.drain()
            except ConnectionError:
                pass
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
            pass
        except asyncio.CancelledError:
            pass
        except Exception as e:  # noqa: BLE001 - a bug here must cost one connection, not the front
            print(f"front: error on a connection: {e!r}\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        finally:
            self.connections.discard(task)
            writer.close()
            try:
                await asyncio.wait_for(writer.wait_closed(), 1.0)
            except (Exception, asyncio.CancelledError):  # noqa: BLE001 - the peer is gone either way
                pass

    @staticmethod
    def _error_body(req: _Request, e) -> bytes:
        """OpenAI's error shape on /v1, Triton's ({"error": message}) elsewhere."""
        if isinstance(e, ApiError):
            return e.body()
        return openai.error_body(e.status, e.message) if route(req.target)[0] == "openai" else error_body(e.message)

    @staticmethod
    async def _linger(reader, writer, seconds: float = 2.0, limit: int = 64 << 20) -> None:
        """Close after an early answer (413 before the body was read) without resetting the connection: closing a
        socket with unread input sends a RST, which can destroy the answer before the client reads it. So: end our
        side, then read and drop what the client still sends, for a bounded time."""
        try:
            if writer.can_write_eof():
                writer.write_eof()
            end, n = time.monotonic() + seconds, 0
            while n < limit and time.monotonic() < end:
                data = await asyncio.wait_for(reader.read(65536), max(0.01, end - time.monotonic()))
                if not data:
                    return
                n += len(data)
        except (OSError, asyncio.TimeoutError, TimeoutError):
            pass

    async def _readline(self, reader, pending: bytearray, timeout: float) -> bytes:
        if pending:
            i = pending.find(b"\n")
            if i >= 0:
                line = bytes(pending[:i + 1])
                del pending[:i + 1]
                return line
        line = await asyncio.wait_for(reader.readline(), timeout)
        if pending:
            line, pending[:] = bytes(pending) + line, b""
        return line

    async def _readexactly(self, reader, pending: bytearray, n: int) -> bytes:
        take = bytes(pending[:n])
        del pending[:n]
        if len(take) < n:
            take += await asyncio.wait_for(reader.readexactly(n - len(take)), self.head_timeout)
        return take

    async def _read_head(self, reader, pending: bytearray) -> _Request | None:
        try:
            line = await self._readline(reader, pending, self.idle_timeout)
        except (TimeoutError, asyncio.TimeoutError):
            return None
        while line in (b"\r\n", b"\n"):                 # tolerated before a request line (RFC 9112 2.2)
            line = await self._readline(reader, pending, self.idle_timeout)
        if not line:
            return None
        parts = line.decode("latin-1").split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            raise HttpError(400, "malformed request line")
        method, target, version = parts
        if version not in ("HTTP/1.1", "HTTP/1.0"):
            raise HttpError(505, f"{version} is not supported")
        if not target.startswith("/"):                  # absolute-form or '*': not for an origin server
            raise HttpError(400, "the request target must be a path")
        headers, size = [], len(line)
        deadline = time.monotonic() + self.head_timeout
        while True:
            line = await self._readline(reader, pending, max(0.1, deadline - time.monotonic()))
            size += len(line)
            if size > 65536 or len(headers) > 100:
                raise HttpError(431, "request headers too large")
            if line in (b"\r\n", b"\n"):
                break
            if not line.endswith(b"\n"):
                raise HttpError(400, "incomplete request headers")
            name, sep, value = line.decode("latin-1").partition(":")
            if not sep or not name or name != name.strip():
                raise HttpError(400, "malformed header line")
            headers.append((name, value.strip()))
        return _Request(method, target, version, headers)

    async def _read_body(self, req: _Request, reader, writer, pending: bytearray) -> bytes:
        length, chunked = req.header("content-length"), req.header("transfer-encoding")
        if chunked is not None and chunked.lower() != "chunked":
            raise HttpError(501, f"transfer-encoding {chunked} is not supported", close=True)
        if chunked is not None and length is not None:
            raise HttpError(400, "both content-length and transfer-encoding", close=True)
        if length is not None and not length.isdigit():
            raise HttpError(400, "invalid content-length", close=True)
        if length is not None and int(length) > self.max_body:
            self.refused["too_large"] += 1
            raise HttpError(413, f"the request body is {int(length)} bytes; this server accepts at most "
                                 f"{self.max_body}", close=True)
        if (req.header("expect") or "").lower() == "100-continue":
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        if length is not None:
            return await self._readexactly(reader, pending, int(length))
        if chunked is None:
            return b""
        body = bytearray()
        while True:
            size_line = (await self._readline(reader, pending, self.head_timeout)).split(b";")[0].strip()
            try:
                size = int(size_line, 16)
            except ValueError:
                raise HttpError(400, "malformed chunked body", close=True) from None
            if len(body) + size > self.max_body:
                self.refused["too_large"] += 1
                raise HttpError(413, f"the request body is above {self.max_body} bytes", close=True)
            if size == 0:
                while (await self._readline(reader, pending, self.head_timeout)) not in (b"\r\n", b"\n", b""):
                    pass                                  # trailers: dropped
                return bytes(body)
            body += await self._readexactly(reader, pending, size)
            await self._readexactly(reader, pending, 2)

    async def _handle(self, req: _Request, reader, writer, pending: bytearray) -> bool:
        kind, model, endpoint = route(req.target)
        body = await self._read_body(req, reader, writer, pending)
        keep = req.keep_alive
        sup = self.sup

        if kind in ("live", "ready", "model_ready") and req.method in ("GET", "HEAD"):
            if kind == "model_ready":
                ready, reason = sup.model_ready(model)
                if ready is None:                         # a model the supervisor does not know: Triton answers
                    return await self._forward(req, body, reader, writer, pending, model)
            else:
                live, ready_all, reason = sup.health()
                ready = live if kind == "live" else ready_all
            data = b"" if ready else error_body(reason)
            if req.method == "HEAD":
                data = b""
            writer.write(response_bytes(200 if ready else 503, data, None if ready else {"Retry-After": "5"}, keep))
            await writer.drain()
            return keep

        if self.api_key is not None and kind not in ("live", "ready", "model_ready", "admin"):
            given = (req.header("authorization") or "").removeprefix("Bearer ").strip()
            if not hmac.compare_digest(given.encode(), self.api_key.encode()):
                self.refused["unauthorized"] += 1
                raise HttpError(401, "missing or wrong API key: send the header Authorization: Bearer <key>",
                                {"WWW-Authenticate": "Bearer"})

        if kind == "admin" and not sup.admin_open:
            given = req.header(ADMIN_HEADER)
            if not given or not hmac.compare_digest(given.encode(), sup.admin_key.encode()):
                self.refused["admin"] += 1
                raise HttpError(403, "administrative APIs (shared memory, model repository, logging, trace) are "
                                     f"restricted: send the {ADMIN_HEADER} header, or start the server with "
                                     "--open-admin-api")

        if body:
            json_part = body
            header_len = req.header("inference-header-content-length")
            if header_len is not None:
                if not header_len.isdigit() or int(header_len) > len(body):
                    raise HttpError(400, "invalid inference-header-content-length")
                json_part = body[:int(header_len)]
            if not json_depth_ok(json_part, self.max_depth):
                self.refused["too_deep"] += 1
                raise HttpError(400, f"the request JSON nests deeper than {self.max_depth} levels")

        if kind == "openai":
            return await self._openai(req, body, reader, writer, pending)
        if kind == "infer":
            ready, reason = sup.model_ready(model)
            if ready is False:
                self.refused["unavailable"] += 1
                raise HttpError(503, reason, {"Retry-After": "5"})
            if req.method == "POST" and body:
                try:
                    parsed = json.loads(json_part)
                except (ValueError, RecursionError) as e:
                    self.refused["invalid"] += 1
                    raise HttpError(400, f"the request body is not valid JSON: {e}") from None
                err = check_infer(parsed) if endpoint == "infer" else check_generate(parsed, sup.inputs(model))
                if err is not None:
                    self.refused["invalid"] += 1
                    raise HttpError(400, err)
        return await self._forward(req, body, reader, writer, pending, model)

    # --- relaying to tritonserver -------------------------------------------------------------------------------
    async def _forward(self, req: _Request, body: bytes, reader, writer, pending: bytearray, model) -> bool:
        keep = req.keep_alive
        up_reader, up_writer = await self._connect()
        watcher, cut, sent = None, self._track(model), None   # sent: how the answer goes out
        try:
            head = [f"{req.method} {req.target} HTTP/1.1"]
            head += [f"{k}: {v}" for k, v in req.headers if k.lower() not in HOP_BY_HOP]
            if body or req.method in ("POST", "PUT", "PATCH"):
                head.append(f"Content-Length: {len(body)}")
            head.append("Connection: close")
            up_writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
            await up_writer.drain()
            # a client that hangs up while Triton works: close the upstream connection so Triton cancels
            watcher = _Watch(asyncio.ensure_future(reader.read(65536)), cut)
            status_line = await self._race(up_reader.readline(), watcher)
            parts = status_line.decode("latin-1").split(None, 2)
            if len(parts) < 2 or not parts[1].isdigit():
                raise HttpError(502, "tritonserver closed the connection without a response "
                                     "(did it crash? the supervisor restarts it)", {"Retry-After": "5"})
            status = int(parts[1])
            headers = []
            while True:
                line = await up_reader.readline()
                if line in (b"\r\n", b"\n", b""):
                    break
                name, _, value = line.decode("latin-1").partition(":")
                headers.append((name.strip(), value.strip()))
            hmap = {k.lower(): v for k, v in headers}
            no_body = req.method == "HEAD" or status in (204, 304) or 100 <= status < 200
            length = hmap.get("content-length")
            chunked = "chunked" in hmap.get("transfer-encoding", "").lower()

            if status == 400 and not no_body and (chunked or (length or "").isdigit()):
                data = await self._read_small(up_reader, int(length) if length else None, watcher)
                if b"Stub process" in data and b"is not healthy" in data:
                    self.sup.on_unhealthy(model, data.decode(errors="replace"))
                    raise HttpError(503, f"model {model} is unavailable: its backend process died; the supervisor "
                                         "is restarting it, retry shortly", {"Retry-After": "5"})
                if b"Exceeds maximum queue size" in data:     # a batching model's own queue is full: Triton says 400
                    text = data.decode(errors="replace")
                    raise HttpError(503, text[text.find("Exceeds"):].split('"')[0], {"Retry-After": "1"})
                sent = "exact"
                self._write_head(writer, status, headers, keep, len(data))
                writer.write(data)
                await writer.drain()
                return keep

            sent = "exact"
            if no_body:
                self._write_head(writer, status, headers, keep, None if length is None else int(length))
                await writer.drain()
                return keep
            if length is not None and length.isdigit():
                self._write_head(writer, status, headers, keep, int(length))
                await self._relay_exact(up_reader, writer, int(length), watcher)
                return keep
            if chunked:
                if req.version == "HTTP/1.0":
                    keep = False
                sent = "chunked" if req.version != "HTTP/1.0" else "plain"
                self._write_head(writer, status, headers, keep, None, chunked=req.version != "HTTP/1.0")
                await self._relay_chunked(up_reader, writer, watcher, raw=req.version != "HTTP/1.0")
                return keep
            self._write_head(writer, status, headers, False, None)       # delimited by the connection's end
            await self._relay_exact(up_reader, writer, None, watcher)
            return False
        except _Cut as e:
            if sent is None:
                raise HttpError(503, str(e), {"Retry-After": "5"}, close=True) from None
            await self._end_relay(writer, sent, str(e))
            return False
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            if isinstance(e, ConnectionResetError) and str(e) == "client gone":
                raise
            message = "the connection to tritonserver broke (did it crash? the supervisor restarts it)"
            if sent is None:
                raise HttpError(502, message, {"Retry-After": "5"}, close=True) from None
            await self._end_relay(writer, sent, message)    # not a second response inside the first one's body
            return False
        finally:
            self._untrack(model, cut, watcher, pending)
            up_writer.close()

    @staticmethod
    async def _end_relay(writer, sent: str, message: str) -> None:
        """A relayed answer that cannot be finished: an event stream ends with an error event (and its last chunk);
        a body of announced length is left short, the connection's end tells the client."""
        if sent == "exact":
            return
        event = b"data: " + error_body(message) + b"\n\n"
        try:
            writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(event), event) if sent == "chunked" else event)
            await writer.drain()
        except ConnectionError:
            pass

    async def _connect(self):
        target = self.sup.upstream()
        if target is None:
            raise HttpError(503, self.sup.health()[2] or "tritonserver is not running; the supervisor restarts it",
                            {"Retry-After": "5"})
        try:
            return await asyncio.wait_for(asyncio.open_connection(*target, limit=1 << 16), 5.0)
        except (OSError, TimeoutError, asyncio.TimeoutError):
            raise HttpError(503, "tritonserver is not accepting connections (restarting?)",
                            {"Retry-After": "5"}) from None

    def _track(self, model) -> asyncio.Future:
        """A relayed request of `model`: the future the supervisor may resolve to cut it."""
        cut = asyncio.get_running_loop().create_future()
        self.inflight.setdefault(model, set()).add(cut)
        return cut

    def _untrack(self, model, cut: asyncio.Future, watcher, pending: bytearray) -> None:
        cut.cancel()                                     # answered (or failed): nothing left to cut
        self.inflight[model].discard(cut)
        if not self.inflight[model]:
            del self.inflight[model]
        if watcher is not None:
            client = watcher.client
            if client.done() and not client.cancelled() and client.exception() is None:
                data = client.result()
                if data:
                    pending += data                      # a pipelined request: keep it
            else:
                client.cancel()

    # --- the OpenAI API -------------------------------------------------------------------------------------------
    async def _openai(self, req: _Request, body: bytes, reader, writer, pending: bytearray) -> bool:
        seg = [s for s in unquote(req.target.split("?", 1)[0]).split("/") if s]
        now, keep = int(time.time()), req.keep_alive
        names = [m for m, info in self.sup.models.items() if "messages" in (info.get("inputs") or {})]
        if seg[1:] == ["models"] or (len(seg) == 3 and seg[1] == "models"):
            if req.method not in ("GET", "HEAD"):
                raise ApiError(405, f"{req.method} is not allowed here: GET /v1/models")
            if len(seg) == 3 and seg[2] not in names:
                raise ApiError(404, f"The model `{seg[2]}` does not exist", "model", "model_not_found")
            data = openai.models_list(names, now) if len(seg) == 2 else openai.model_card(seg[2], now)
            writer.write(response_bytes(200, json.dumps(data).encode(), None, keep))
            await writer.drain()
            return keep
        if seg[1:] not in (["chat", "completions"], ["completions"]):
            raise ApiError(404, f"no such endpoint: {req.method} {'/' + '/'.join(seg)} (this server has /v1/models, "
                                "/v1/chat/completions and /v1/completions)", None, "unknown_url")
        if req.method != "POST":
            raise ApiError(405, f"{req.method} is not allowed here: POST {'/' + '/'.join(seg)}")
        try:
            parsed = json.loads(body)
        except (ValueError, RecursionError) as e:
            self.refused["invalid"] += 1
            raise ApiError(400, f"the request body is not valid JSON: {e}") from None
        try:
            c = openai.parse(parsed, chat=seg[1] == "chat")
        except ApiError:
            self.refused["invalid"] += 1
            raise
        ready, reason = self.sup.model_ready(c.model)
        if ready is None or c.model not in names:
            raise ApiError(404, f"The model `{c.model}` does not exist (served: {', '.join(sorted(names)) or 'none'})",
                           "model", "model_not_found")
        if ready is False:
            self.refused["unavailable"] += 1
            raise ApiError(503, reason, None, None, {"Retry-After": "5"})
        return await self._complete(req, c, reader, writer, pending)

    def _upstream_error(self, model: str, status: int, data: bytes) -> ApiError:
        """A generate_stream refusal (its body, or an error event) as the client's error."""
        text = data.decode(errors="replace")
        events = openai.Events().feed(data + b"\n\n") if text.startswith("data:") else []
        try:
            message = events[0]["error"] if events else json.loads(text)["error"]
        except (ValueError, KeyError, TypeError, IndexError):
            message = text[:500] or f"tritonserver answered {status}"
        if "Stub process" in message and "is not healthy" in message:
            self.sup.on_unhealthy(model, message)
            return ApiError(503, f"model {model} is unavailable: its backend process died; the supervisor is "
                                 "restarting it, retry shortly", None, None, {"Retry-After": "5"})
        if "Exceeds maximum queue size" in message:
            self.refused["unavailable"] += 1
            return ApiError(503, message[message.find("Exceeds"):], None, None, {"Retry-After": "1"})
        if status == 400:
            self.refused["invalid"] += 1
            return ApiError(400, message)
        return ApiError(status if status >= 500 else 500, message)

    async def _complete(self, req: _Request, c, reader, writer, pending: bytearray) -> bool:
        """Relay one completion to generate_stream; answer as one JSON object or as OpenAI's event stream."""
        keep = req.keep_alive
        chunked = req.version != "HTTP/1.0"
        up_reader, up_writer = await self._connect()
        watcher, cut, started = None, self._track(c.model), False
        rid, created = f"{'chatcmpl' if c.chat else 'cmpl'}-{secrets.token_hex(12)}", int(time.time())

        async def send(obj) -> None:
            nonlocal started
            if not started:
                started = True
                head = ["HTTP/1.1 200 OK", "Content-Type: text/event-stream", "Cache-Control: no-cache",
                        "Transfer-Encoding: chunked" if chunked else "Connection: close"]
                if chunked:
                    head.append("Connection: keep-alive" if keep else "Connection: close")
                writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1"))
                if c.chat:
                    await send(openai.chunk(c, rid, created, "", role=True))
            data = b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"
            writer.write(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
            await writer.drain()

        try:
            data = json.dumps(openai.triton_request(c)).encode()
            up_writer.write((f"POST /v2/models/{quote(c.model)}/generate_stream HTTP/1.1\r\nHost: {self.host}\r\n"
                             f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
                             "Connection: close\r\n\r\n").encode("latin-1") + data)
            await up_writer.drain()
            watcher = _Watch(asyncio.ensure_future(reader.read(65536)), cut)
            parts = (await self._race(up_reader.readline(), watcher)).decode("latin-1").split(None, 2)
            if len(parts) < 2 or not parts[1].isdigit():
                raise HttpError(502, "tritonserver closed the connection without a response "
                                     "(did it crash? the supervisor restarts it)", {"Retry-After": "5"})
            status, hmap = int(parts[1]), {}
            while (line := await self._race(up_reader.readline(), watcher)) not in (b"\r\n", b"\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                hmap[name.strip().lower()] = value.strip()
            length = hmap.get("content-length")
            length = int(length) if length and length.isdigit() else None
            if status != 200:
                raise self._upstream_error(c.model, status, await self._read_small(up_reader, length, watcher))
            events, text, tokens, final = openai.Events(), [], 0, None
            async for data in self._upstream_body(up_reader, length, "chunked" in hmap.get("transfer-encoding", ""),
                                                  watcher):
                for ev in events.feed(data):
                    if "error" in ev:
                        raise self._upstream_error(c.model, 500, json.dumps(ev).encode())
                    delta = ev.get("text_output") or ""
                    ids = ev.get("output_ids")
                    tokens += 0 if ids is None else 1 if isinstance(ids, int) else len(ids)
                    if "finish_reason" in ev:
                        final = ev
                    if c.stream and delta:
                        await send(openai.chunk(c, rid, created, delta))
                    text.append(delta)
            if final is None:
                raise HttpError(502, "tritonserver ended the stream without its final response")
            finish, usage = openai.finish_reason(final["finish_reason"]), openai.usage(final["prompt_tokens"], tokens)
            if not c.stream:
                body = json.dumps(openai.response(c, rid, created, "".join(text), finish, usage)).encode()
                writer.write(response_bytes(200, body, None, keep))
                await writer.drain()
                return keep
            await send(openai.chunk(c, rid, created, None, finish))
            if c.include_usage:
                await send(openai.usage_chunk(c, rid, created, usage))
            await send(b"[DONE]")
            if chunked:
                writer.write(b"0\r\n\r\n")
                await writer.drain()
            return keep and chunked
        except _Cut as e:
            if not started:
                raise ApiError(503, str(e), None, None, {"Retry-After": "5"}) from None
            await self._stream_error(writer, send, 503, str(e), chunked)
            return False
        except (ApiError, HttpError) as e:
            if not started:
                raise
            await self._stream_error(writer, send, e.status, e.message, chunked)
            return False
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            if isinstance(e, ConnectionResetError) and str(e) == "client gone":
                raise
            message = "the connection to tritonserver broke (did it crash? the supervisor restarts it)"
            if not started:
                raise ApiError(502, message, None, None, {"Retry-After": "5"}) from None
            await self._stream_error(writer, send, 502, message, chunked)
            return False
        finally:
            self._untrack(c.model, cut, watcher, pending)
            up_writer.close()

    @staticmethod
    async def _stream_error(writer, send, status: int, message: str, chunked: bool) -> None:
        """End an event stream under way with an error event (what OpenAI's clients raise as an APIError)."""
        try:
            await send(openai.error_body(status, message))
            if chunked:
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        except ConnectionError:
            pass

    async def _upstream_body(self, up_reader, length: int | None, chunked: bool, watcher):
        """The bytes of a response body as they come (chunked, Content-Length or until the connection ends)."""
        if chunked:
            while True:
                size_line = await self._race(up_reader.readline(), watcher)
                if not size_line:
                    raise asyncio.IncompleteReadError(b"", None)
                size = int(size_line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    return
                yield (await self._race(up_reader.readexactly(size + 2), watcher))[:-2]
        left = length
        while left is None or left > 0:
            data = await self._race(up_reader.read(65536 if left is None else min(65536, left)), watcher)
            if not data:
                if left is None:
                    return
                raise asyncio.IncompleteReadError(b"", left)
            yield data
            if left is not None:
                left -= len(data)

    @staticmethod
    def _write_head(writer, status, headers, keep, length, chunked=False) -> None:
        lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'Status')}"]
        lines += [f"{k}: {v}" for k, v in headers if k.lower() not in HOP_BY_HOP]
        if length is not None:
            lines.append(f"Content-Length: {length}")
        elif chunked:
            lines.append("Transfer-Encoding: chunked")
        lines.append("Connection: keep-alive" if keep else "Connection: close")
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))

    @staticmethod
    def _gone(client: asyncio.Future) -> bool:
        """The client closed its side (EOF or an error on its socket); `client` is done."""
        return client.exception() is not None or not client.result()

    async def _race(self, coro, watcher: _Watch):
        """Await `coro` unless the client goes away or the request is cut first. Bytes the client sends meanwhile (a
        pipelined request) stay in the client read's result and are kept for the next request."""
        task = asyncio.ensure_future(coro)
        while not task.done():
            if watcher.cut.done():
                task.cancel()
                raise _Cut(watcher.cut.result())
            if watcher.client.done() and self._gone(watcher.client):
                task.cancel()
                raise ConnectionResetError("client gone")
            waits = {task, watcher.cut} | (set() if watcher.client.done() else {watcher.client})
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        return task.result()

    async def _read_small(self, up_reader, length: int | None, watcher, limit: int = 65536) -> bytes:
        """A whole (error) response body, Content-Length or chunked; at most `limit` bytes are kept."""
        if length is not None:
            data = await self._race(up_reader.readexactly(length), watcher)
            return data[:limit]
        data = bytearray()
        while True:
            size = int((await self._race(up_reader.readline(), watcher)).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while (await up_reader.readline()) not in (b"\r\n", b"\n", b""):
                    pass
                return bytes(data)
            chunk = (await self._race(up_reader.readexactly(size + 2), watcher))[:-2]
            data += chunk[:max(0, limit - len(data))]

    async def _relay_exact(self, up_reader, writer, n: int | None, watcher) -> None:
        left = n
        while left is None or left > 0:
            data = await self._race(up_reader.read(65536 if left is None else min(65536, left)), watcher)
            if not data:
                if left is None:
                    return
                raise asyncio.IncompleteReadError(b"", left)
            writer.write(data)
            await writer.drain()
            if left is not None:
                left -= len(data)

    async def _relay_chunked(self, up_reader, writer, watcher, raw: bool) -> None:
        while True:
            size_line = await self._race(up_reader.readline(), watcher)
            if not size_line:
                raise asyncio.IncompleteReadError(b"", None)
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            data = await self._race(up_reader.readexactly(size + 2), watcher) if size else b""
            if size == 0:
                while (await up_reader.readline()) not in (b"\r\n", b"\n", b""):
                    pass
                if raw:
                    writer.write(b"0\r\n\r\n")
                    await writer.drain()
                return
            writer.write(size_line + data if raw else data[:-2])
            await writer.drain()
