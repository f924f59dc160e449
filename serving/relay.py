"""What the front's relays to tritonserver share (front.py: Triton's API, v1.py: the OpenAI API): `Watch`, one
relayed request raced against the supervisor cutting it and the client hanging up; `Relay`, the streamed answer that
releases the upstream response when it is done; `answering`, the errors of a request not answered yet as error
responses; `sse`, one server-sent event.
"""
from __future__ import annotations

import asyncio
import contextlib
import json

import httpx
from starlette.responses import StreamingResponse

from .openai import ApiError

RETRY = {"Retry-After": "5"}
BROKE = "the connection to tritonserver broke (did it crash? the supervisor restarts it)"


class Cut(Exception):
    """The supervisor ended a relayed request whose answer will never come (its backend process died under it)."""


class Gone(Exception):
    """The client hung up."""


class Watch:
    """One relayed request of `model`, until close(): `cut`, a future in `inflight[model]` that the supervisor may
    resolve with a message to end it (Front.pending, Front.cut), and a task that ends when the client hangs up (ASGI's
    http.disconnect, once the body has been read)."""

    def __init__(self, inflight: dict, model: str | None, receive):
        self.inflight, self.model = inflight, model
        self.cut = asyncio.get_running_loop().create_future()
        inflight.setdefault(model, set()).add(self.cut)
        self.gone = asyncio.ensure_future(self._disconnect(receive))

    @staticmethod
    async def _disconnect(receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    async def race(self, awaitable):
        """`awaitable`'s result, unless the request is cut (Cut) or the client hangs up (Gone) first: it is then
        cancelled, and an httpx request cancelled closes its connection, so that Triton cancels the request."""
        task = asyncio.ensure_future(awaitable)
        try:
            await asyncio.wait({task, self.cut, self.gone}, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                return task.result()
        finally:
            task.cancel()                       # no-op when done; also when this coroutine is cancelled
        if self.cut.done():
            raise Cut(self.cut.result())
        raise Gone()

    async def each(self, chunks):
        """The items of the async iterator `chunks`, each raced as by `race`."""
        it = chunks.__aiter__()
        while (data := await self.race(_next(it))) is not None:
            yield data

    def close(self) -> None:
        """Answered (or failed): nothing left to cut. Idempotent."""
        self.cut.cancel()
        self.gone.cancel()
        cuts = self.inflight.get(self.model)
        if cuts is not None:
            cuts.discard(self.cut)
            if not cuts:
                del self.inflight[self.model]


async def _next(it):
    try:
        return await it.__anext__()
    except StopAsyncIteration:                 # as None: a task must not raise StopAsyncIteration
        return None


class Relay(StreamingResponse):
    """A streamed answer with headers of its own (`raw_headers`: (name, value) bytes, upstream's as they are) that
    runs `cleanup` once it is sent, cut or failed: the upstream response is closed and the request untracked."""

    def __init__(self, content, status_code: int, raw_headers: list, cleanup):
        super().__init__(content, status_code)
        self.raw_headers += raw_headers
        self.cleanup = cleanup

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.cleanup()


@contextlib.contextmanager
def answering():
    """Around what comes before a request's answer begins: a cut request, or tritonserver out of reach, as an error
    response (503 or 502, with Retry-After)."""
    try:
        yield
    except Cut as e:
        raise ApiError(503, str(e), headers=RETRY) from None
    except (httpx.ConnectError, httpx.ConnectTimeout):
        raise ApiError(503, "tritonserver is not accepting connections (restarting?)", headers=RETRY) from None
    except httpx.TransportError:
        raise ApiError(502, BROKE, headers=RETRY) from None


def sse(obj) -> bytes:
    """One server-sent event: a JSON object, or bytes as they are ([DONE])."""
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"
