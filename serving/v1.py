"""The OpenAI API of the front: `/v1/models`, `/v1/chat/completions` and `/v1/completions`, for the models that take
eaglex's `messages` input. A request body is validated by openai.py's pydantic models, then sent to the model's
generate_stream as one streamed generate request (so a client that hangs up cancels it, as on Triton's own API);
its events become OpenAI's chunks (`stream`) or one answer.
"""
from __future__ import annotations

import contextlib
import json
import secrets
import time
from urllib.parse import quote, unquote

import httpx
from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from . import openai
from .openai import ApiError, Completion
from .relay import BROKE, RETRY, Cut, Gone, Relay, Watch, answering, sse

ENDPOINTS = {("models",): "GET", ("chat", "completions"): "POST", ("completions",): "POST"}


def router(front) -> APIRouter:
    """The routes, for `front` (front.Front: the supervisor, the relay to tritonserver)."""
    api = APIRouter(prefix="/v1")

    def served() -> list[str]:
        return [m for m, info in front.sup.models.items() if "messages" in (info.get("inputs") or {})]

    @api.api_route("/models", methods=["GET", "HEAD"])
    async def models() -> Response:
        return JSONResponse(openai.models_list(served(), int(time.time())))

    @api.api_route("/models/{name}", methods=["GET", "HEAD"])
    async def model(name: str) -> Response:
        if name not in served():
            raise ApiError(404, f"The model `{name}` does not exist", "model", "model_not_found")
        return JSONResponse(openai.model_card(name, int(time.time())))

    @api.post("/chat/completions")
    async def chat(body: openai.ChatRequest, request: Request) -> Response:
        return await complete(front, request, openai.completion(body), served())

    @api.post("/completions")
    async def text(body: openai.TextRequest, request: Request) -> Response:
        return await complete(front, request, openai.completion(body), served())

    return api


def unknown(method: str, path: str) -> ApiError:
    """A /v1 path or method none of the routes takes: 405 for a known endpoint, 404 otherwise."""
    seg = tuple(s for s in unquote(path.split("?", 1)[0]).split("/") if s)[1:]
    allowed = ENDPOINTS.get(seg) or ("GET" if len(seg) == 2 and seg[0] == "models" else None)
    where = "/v1/" + "/".join(seg)
    if allowed is not None and method not in (allowed, "HEAD" if allowed == "GET" else allowed):
        return ApiError(405, f"{method} is not allowed here: {allowed} {where}")
    return ApiError(404, f"no such endpoint: {method} {where} (this server has /v1/models, /v1/chat/completions and "
                         "/v1/completions)", None, "unknown_url")


async def complete(front, request: Request, c: Completion, names: list[str]) -> Response:
    """Relay one completion to generate_stream; answer as one JSON object or as OpenAI's event stream."""
    ready, reason = front.sup.model_ready(c.model)
    if ready is None or c.model not in names:
        raise ApiError(404, f"The model `{c.model}` does not exist (served: {', '.join(sorted(names)) or 'none'})",
                       "model", "model_not_found")
    if ready is False:
        front.refused["unavailable"] += 1
        raise ApiError(503, reason, headers=RETRY)
    rid, created = f"{'chatcmpl' if c.chat else 'cmpl'}-{secrets.token_hex(12)}", int(time.time())
    headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
    async with contextlib.AsyncExitStack() as stack:
        with answering():
            watch = stack.enter_context(front.track(c.model, request))
            up = await front.triton(watch, "POST", f"/v2/models/{quote(c.model)}/generate_stream", headers,
                                    json.dumps(openai.triton_request(c)).encode())
            stack.push_async_callback(up.aclose)
            if up.status_code != 200:
                data = b"".join([d async for d in watch.each(up.aiter_bytes())])
                raise refused(front, c.model, up.status_code, message(up.status_code, data))
            result: dict = {}
            deltas = _deltas(front, c, up, watch, result)
            if not c.stream:
                text = "".join([d async for d in deltas])
                return JSONResponse(openai.response(c, rid, created, text, result["finish"], result["usage"]))
            chunks = _chunks(c, deltas, result, rid, created)
            first = await anext(chunks)         # the answer begins with its first chunk: errors before it get a status
        return Relay(_begun(first, chunks, watch), 200, [(b"content-type", b"text/event-stream"),
                                                  (b"cache-control", b"no-cache"), (b"connection", b"close")],
                     stack.pop_all().aclose)


def message(status: int, data: bytes) -> str:
    """The message of a generate_stream refusal: its JSON body, or its error event."""
    text = data.decode(errors="replace")
    events = openai.Events().feed(data + b"\n\n") if text.startswith("data:") else []
    try:
        return events[0]["error"] if events else json.loads(text)["error"]
    except (ValueError, KeyError, TypeError, IndexError):
        return text[:500] or f"tritonserver answered {status}"


def refused(front, model: str, status: int, text: str) -> ApiError:
    """A generate_stream refusal (its message) as the client's error."""
    if (e := front.refusal(model, text)) is not None:
        return e
    return ApiError(400, text) if status == 400 else ApiError(status if status >= 500 else 500, text)


async def _deltas(front, c: Completion, up: httpx.Response, watch: Watch, result: dict):
    """The text of the model's events as it comes; at the end `result` holds the finish reason and the usage."""
    events, tokens, final = openai.Events(), 0, None
    async for data in watch.each(up.aiter_bytes()):
        for ev in events.feed(data):
            if "error" in ev:
                raise refused(front, c.model, 500, ev["error"])
            ids = ev.get("output_ids")
            tokens += 0 if ids is None else 1 if isinstance(ids, int) else len(ids)
            if "finish_reason" in ev:
                final = ev
            if ev.get("text_output"):
                yield ev["text_output"]
    if final is None:
        raise ApiError(502, "tritonserver ended the stream without its final response")
    result.update(finish=openai.finish_reason(final["finish_reason"]),
                  usage=openai.usage(final["prompt_tokens"], tokens))


async def _chunks(c: Completion, deltas, result: dict, rid: str, created: int):
    """OpenAI's event stream: (chat) the role, a chunk per delta, the finish, (include_usage) the usage, [DONE]."""
    head = sse(openai.chunk(c, rid, created, "", role=True)) if c.chat else b""
    async for delta in deltas:
        yield head + sse(openai.chunk(c, rid, created, delta))
        head = b""
    tail = sse(openai.chunk(c, rid, created, None, result["finish"]))
    if c.include_usage:
        tail += sse(openai.usage_chunk(c, rid, created, result["usage"]))
    yield head + tail + sse(b"[DONE]")


async def _begun(first: bytes, chunks, watch: Watch):
    """An event stream under way: an error ends it with an error event (what OpenAI's clients raise as APIError)."""
    yield first
    try:
        async for piece in chunks:
            yield piece
    except Gone:
        return
    except Cut as e:
        yield sse(openai.error_body(503, str(e)))
    except ApiError as e:
        yield sse(openai.error_body(e.status, e.message))
    except httpx.TransportError:
        yield sse(openai.error_body(502, BROKE))
    watch.close()                           # before the stream's end goes out: nothing is left to cut
