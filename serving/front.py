"""The HTTP front of a supervised tritonserver: a FastAPI app on uvicorn, in the supervisor's event loop, in front
of Triton's HTTP port (an internal loopback port), serving Triton's HTTP API and the OpenAI API (v1.py).

Triton cannot be configured to bound what its HTTP front end parses, and tritonserver 2.51 dies (SIGSEGV, nothing
logged) on one ~200 KB body of deeply nested JSON. Clients therefore talk to this front. For each request it:

- refuses bodies above `max_body` (413) and JSON nested deeper than `max_depth` (400) before anything parses them,
  and, with an API key, every request but the health checks without `Authorization: Bearer <key>` (401): guard.py;
- checks generate-extension (and JSON /infer) values against the model's declared input types (guard.py): wrong
  JSON types and integers outside the input's range get a 400 with the reason, instead of Triton's 500 or a silent
  wraparound;
- answers `/v2/health/live`, `/v2/health/ready` and `/v2/models/<m>[/versions/<v>]/ready` from the supervisor's
  view of the server and of each model's backend processes (Triton keeps answering 200 after a stub died);
- refuses inference with 503 + Retry-After while a model is being reloaded or the server restarted, and turns
  Triton's 400 "Stub process ... is not healthy" (a server fault) into a 503 and tells the supervisor, and a
  batching model's 400 "Exceeds maximum queue size" (its own queue is full) into a 503, as Triton's own queue says;
- refuses the administrative APIs (shared memory, model repository, logging, trace) with 403 unless the server
  was started with them open or the request carries the admin key header (Triton checks the same header);
- relays everything else (httpx), streaming responses (generate_stream's server-sent events) as they come, and
  closes the upstream connection when the client goes away, so that Triton cancels the request;
- ends the requests the supervisor cuts (they were inside a backend process that died: Triton 2.51 never answers
  them) with a 503, or with an error event when their stream had begun, instead of leaving the client waiting;
  a request whose connection to tritonserver breaks (it died) gets a 502, or likewise an error event.

Errors take Triton's shape (`{"error": message}`) on /v2 and OpenAI's on /v1 (guard.error_response).
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import socket

import h11
import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response
from uvicorn.protocols.http.h11_impl import H11Protocol

from . import openai, v1
from .guard import Guard, check_generate, check_infer, error_response, route
from .openai import ApiError
from .relay import BROKE, RETRY, Cut, Gone, Relay, Watch, answering, sse
from .tritonserver import ADMIN_HEADER

# not relayed: they describe one connection (the front frames its own), or they are httpx's to set
HOP_BY_HOP = {b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"te", b"trailer", b"upgrade",
              b"expect", b"proxy-authorization", b"proxy-authenticate", b"content-length", b"host"}
METHODS = ["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]


class _HeadDeadline(H11Protocol):
    """uvicorn's h11 connection with a deadline on every request head: a client that connects, or starts a request,
    and has not sent its request line and headers `head_timeout` seconds later is disconnected. uvicorn times out
    only idle keep-alive connections, so a client trickling header bytes (slow loris) would hold its connection,
    and with enough of them every slot of `limit_concurrency`, forever."""

    def __init__(self, *args, head_timeout: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.head_timeout, self.head_timer = head_timeout, None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:       # still before (or inside) a request head
            self._arm()
        elif self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def connection_lost(self, exc) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self.head_timer is None:
            self.head_timer = asyncio.get_running_loop().call_later(self.head_timeout, self._expired)

    def _expired(self) -> None:
        self.head_timer = None
        if self.conn.their_state is h11.IDLE and (self.cycle is None or self.cycle.response_complete):
            self.transport.close()


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield                                   # SIGTERM and SIGINT are the supervisor's (its loop's handlers)


class Front:
    """The front. `supervisor` provides: upstream() -> (host, port) | None, health() -> (live, ready, reason),
    model_ready(name) -> (ready: bool | None, reason) (None: not a model it knows), inputs(name) -> {input: type} |
    None, models (name -> {"inputs": ...}), admin_key (str), admin_open (bool), on_unhealthy(model, message).
    `api_key`: the bearer key every request but the health checks must carry (None: none)."""

    def __init__(self, supervisor, host: str, port: int, max_body: int = 1 << 20, max_depth: int = 64,
                 max_connections: int = 1024, head_timeout: float = 30.0, idle_timeout: float = 75.0,
                 api_key: str | None = None):
        self.sup, self.host, self.port, self.api_key = supervisor, host, port, api_key
        self.max_body, self.max_depth, self.max_connections = max_body, max_depth, max_connections
        self.head_timeout, self.idle_timeout = head_timeout, idle_timeout
        self.server: uvicorn.Server | None = None
        self.client: httpx.AsyncClient | None = None
        self.inflight: dict[str | None, set[asyncio.Future]] = {}  # model -> the cut futures of its relayed requests
        self.refused = {"too_large": 0, "too_deep": 0, "invalid": 0, "admin": 0, "unavailable": 0, "unauthorized": 0}
        self.app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
        self.app.include_router(v1.router(self))
        self.app.add_api_route("/{path:path}", self._triton, methods=METHODS, include_in_schema=False)
        for exc in (ApiError, RequestValidationError, HTTPException, Gone):
            self.app.add_exception_handler(exc, self._error)
        self.app.add_middleware(Guard, front=self)

    # --- life -----------------------------------------------------------------------------------------------------
    async def start(self) -> Front:
        """Listen (OSError when the port is taken) and serve in this event loop."""
        sock = socket.create_server((self.host, self.port), backlog=512)
        self.port = sock.getsockname()[1]
        http = functools.partial(_HeadDeadline, head_timeout=self.head_timeout)
        config = uvicorn.Config(self.app, http=http, ws="none", lifespan="off", interface="asgi3", log_config=None,
                                access_log=False, proxy_headers=False, server_header=False, date_header=False,
                                timeout_keep_alive=self.idle_timeout, limit_concurrency=self.max_connections,
                                h11_max_incomplete_event_size=1 << 16, backlog=512)
        self.server = _Server(config)
        # the forwarded request carries the client's headers, not httpx's defaults (Accept-Encoding: gzip would
        # have Triton compress answers the client did not ask to be compressed)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))
        self.client.headers.clear()
        self._serving = asyncio.ensure_future(self.server.serve(sockets=[sock]))
        while not self.server.started:
            if self._serving.done():
                self._serving.result()
                raise OSError(f"the front did not start on {self.host}:{self.port}")
            await asyncio.sleep(0.01)
        return self

    def stop_accepting(self) -> None:
        """Close the listening socket (the supervisor's stop: no new requests while tritonserver stops)."""
        for server in getattr(self.server, "servers", []):
            server.close()

    async def close(self, drain: float = 0.0) -> None:
        """Stop accepting; after `drain` seconds, end the requests still running."""
        if self.server is None:
            return
        self.server.config.timeout_graceful_shutdown = drain
        self.server.should_exit = True
        await self._serving
        await self.client.aclose()

    # --- the requests being relayed, for the supervisor ------------------------------------------------------------
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

    @contextlib.contextmanager
    def track(self, model: str | None, request: Request):
        """A relayed request of `model`, while it lasts: its Watch, whose cut future pending() hands out."""
        watch = Watch(self.inflight, model, request.receive)
        try:
            yield watch
        finally:
            watch.close()

    # --- tritonserver ---------------------------------------------------------------------------------------------
    async def triton(self, watch: Watch, method: str, path: str, headers: list, content: bytes) -> httpx.Response:
        """Send one request to tritonserver; its response once its head has come (the body is read by the caller,
        who closes it). Errors as `answering` turns them into answers."""
        target = self.sup.upstream()
        if target is None:
            raise ApiError(503, self.sup.health()[2] or "tritonserver is not running; the supervisor restarts it",
                           headers=RETRY)
        request = self.client.build_request(method, f"http://{target[0]}:{target[1]}{path}", headers=headers,
                                            content=content)
        return await watch.race(self.client.send(request, stream=True))

    def refusal(self, model: str | None, message: str) -> ApiError | None:
        """Triton's 400s that are no client mistake, as 503s: a dead stub (the supervisor is told) and a batching
        model's full queue."""
        if "Stub process" in message and "is not healthy" in message:
            self.sup.on_unhealthy(model, message)
            return ApiError(503, f"model {model} is unavailable: its backend process died; the supervisor is "
                                 "restarting it, retry shortly", headers=RETRY)
        if "Exceeds maximum queue size" in message:
            self.refused["unavailable"] += 1
            return ApiError(503, message[message.find("Exceeds"):].split('"')[0], headers={"Retry-After": "1"})
        return None

    # --- Triton's HTTP API ----------------------------------------------------------------------------------------
    async def _triton(self, request: Request) -> Response:
        """Every path but the OpenAI API's: health answered here, the rest relayed after its checks."""
        query = request.scope["query_string"].decode("latin-1")
        target = request.scope["raw_path"].decode("latin-1") + (f"?{query}" if query else "")
        kind, model, endpoint = route(target)
        if kind == "openai":                       # a /v1 path none of v1's routes took
            raise v1.unknown(request.method, target)
        if kind in ("live", "ready", "model_ready") and request.method in ("GET", "HEAD"):
            if (answer := self._health(target, kind, model)) is not None:
                return answer
        if kind == "admin" and not self.sup.admin_open:
            given = request.headers.get(ADMIN_HEADER)
            if not given or not hmac.compare_digest(given.encode(), self.sup.admin_key.encode()):
                self.refused["admin"] += 1
                raise ApiError(403, "administrative APIs (shared memory, model repository, logging, trace) are "
                                    f"restricted: send the {ADMIN_HEADER} header, or start the server with "
                                    "--open-admin-api")
        body = await request.body()
        if kind == "infer":
            ready, reason = self.sup.model_ready(model)
            if ready is False:
                self.refused["unavailable"] += 1
                raise ApiError(503, reason, headers=RETRY)
            if request.method == "POST" and body:
                self._check(endpoint, model, body, request.headers.get("inference-header-content-length"))
        return await self._forward(request, target, body, model)

    def _health(self, target: str, kind: str, model: str | None) -> Response | None:
        """The supervisor's answer to a health check; None for a model it does not know (Triton answers)."""
        if kind == "model_ready":
            ready, reason = self.sup.model_ready(model)
            if ready is None:
                return None
        else:
            live, ready_all, reason = self.sup.health()
            ready = live if kind == "live" else ready_all
        if ready:
            return Response(b"", 200, media_type="application/json")
        return error_response(target, ApiError(503, reason, headers=RETRY))

    def _check(self, endpoint: str, model: str, body: bytes, header_len: str | None) -> None:
        """A generate-extension or JSON /infer body against the model's inputs (the guard checked header_len)."""
        try:
            parsed = json.loads(body[:int(header_len)] if header_len is not None else body)
        except (ValueError, RecursionError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}") from None
        err = check_infer(parsed) if endpoint == "infer" else check_generate(parsed, self.sup.inputs(model))
        if err is not None:
            raise ApiError(400, err)

    async def _forward(self, request: Request, target: str, body: bytes, model: str | None) -> Response:
        headers = [(k, v) for k, v in request.headers.raw if k not in HOP_BY_HOP] + [(b"connection", b"close")]
        async with contextlib.AsyncExitStack() as stack:
            with answering():
                watch = stack.enter_context(self.track(model, request))
                up = await self.triton(watch, request.method, target, headers, body)
                stack.push_async_callback(up.aclose)
                relayed = [(k.lower(), v) for k, v in up.headers.raw if k.lower() not in HOP_BY_HOP]
                length = up.headers.get("content-length")
                if length is not None or up.status_code == 400:
                    # an answer of known length (or an error) is read whole: a broken connection is then still a
                    # 502, and the request is untracked before the client can have its answer
                    data = b"".join([d async for d in watch.each(up.aiter_raw())])
                    if up.status_code == 400 and (refusal := self.refusal(model, data.decode(errors="replace"))):
                        raise refusal
                    response = Response(data, up.status_code)
                    if length is not None:      # Triton's, also for HEAD (no body, the length of the GET's)
                        response.raw_headers = [(k, v) for k, v in response.raw_headers if k != b"content-length"]
                        relayed.append((b"content-length", length.encode()))
                    response.raw_headers += relayed
                    return response
            # a stream: its connection is not reused, so that a stream that cannot be finished can always end with an
            # error event, and then the connection's end
            relayed.append((b"connection", b"close"))
            return Relay(self._relay(up, watch), up.status_code, relayed, stack.pop_all().aclose)

    @staticmethod
    async def _relay(up: httpx.Response, watch: Watch):
        """Triton's streamed answer as it comes, byte for byte. A stream that cannot be finished ends with an error
        event (not a second response inside the first one's body)."""
        try:
            async for data in watch.each(up.aiter_raw()):
                yield data
        except Gone:
            return
        except (Cut, httpx.TransportError) as e:
            yield sse({"error": str(e) if isinstance(e, Cut) else BROKE})
        watch.close()                           # before the stream's end goes out: nothing is left to cut

    async def _error(self, request: Request, exc: Exception) -> Response:
        """The one exception handler: each refusal in its path's error shape."""
        if isinstance(exc, Gone):
            return Response(status_code=499)    # nobody reads it: the client hung up
        if isinstance(exc, RequestValidationError):
            exc = openai.invalid(exc.errors())
        elif isinstance(exc, HTTPException):
            exc = ApiError(exc.status_code, str(exc.detail), headers=exc.headers)
        if exc.status == 400:
            self.refused["invalid"] += 1
        return error_response(request.scope["raw_path"].decode("latin-1"), exc)
