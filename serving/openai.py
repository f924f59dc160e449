"""The OpenAI API's requests and answers, as pure functions: a /v1/chat/completions or /v1/completions body ->
a validated `Completion` (or an `ApiError` with OpenAI's error shape), -> the body of a generate_stream request to
the eaglex Triton model; and the model's streamed events -> OpenAI's chunks, final object and usage.

What is accepted: `model`, `messages` (chat: system/developer/user/assistant, string contents or lists of text
parts) or `prompt` (completions: one string), `max_tokens` / `max_completion_tokens`, `temperature` (0..2; 0 is
greedy), `top_p` (0 < p <= 1), `seed`, `stop` (a string or up to 4), `stream`, `stream_options.include_usage`,
`n` = 1, and, at their neutral values only, the knobs that would change the output distribution (penalties,
`logit_bias`, `logprobs`, `best_of` 1, `echo` false) or that eaglex does not implement (`tools`, `response_format`
other than text). `user`, `metadata` and `store` are accepted and ignored. Anything else is refused, as OpenAI
refuses unknown arguments, so that a misspelled knob is never silently ignored.
"""
from __future__ import annotations

import json
import math
import secrets
from dataclasses import dataclass

TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "invalid_request_error",
         404: "invalid_request_error", 413: "invalid_request_error", 431: "invalid_request_error"}
IGNORED = ("user", "metadata", "store", "service_tier", "parallel_tool_calls")
NEUTRAL = {"frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "logit_bias": (None, {}),
           "logprobs": (False, None), "top_logprobs": (None, 0), "best_of": (1,), "echo": (False,),
           "suffix": (None, ""), "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
           "function_call": (None, "none"), "response_format": ({"type": "text"},), "modalities": (None, ["text"]),
           "reasoning_effort": (None,), "prediction": (None,)}
ROLES = ("system", "developer", "user", "assistant")
MAX_STOP = 4
SEED_MAX = 2 ** 63 - 1


class ApiError(Exception):
    """An answer in OpenAI's error shape: {"error": {"message", "type", "param", "code"}} with this HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> bytes:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> bytes:
    kind = TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return json.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}}).encode()


@dataclass(frozen=True)
class Completion:
    """One validated request. `messages` for chat, `prompt` for a text completion."""
    chat: bool
    model: str
    messages: tuple | None
    prompt: str | None
    max_tokens: int | None          # None: the model's default
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param, "invalid_value" if "must" in message else None)


def _number(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _bad(name, f"{name} must be a number, got {json.dumps(v)[:40]}")
    if v < lo or v > hi or (lo_open and v == lo):
        raise _bad(name, f"{name} must be {'>' if lo_open else '>='} {lo} and <= {hi}, got {v}")
    return float(v)


def _int(body: dict, name: str, lo: int, hi: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(name, f"{name} must be an integer, got {json.dumps(v)[:40]}")
    if not lo <= v <= hi:
        raise _bad(name, f"{name} must be >= {lo} and <= {hi}, got {v}")
    return v


def _bool(body: dict, name: str) -> bool:
    v = body.get(name, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise _bad(name, f"{name} must be true or false, got {json.dumps(v)[:40]}")
    return v


def _content(i: int, content) -> str:
    """A message's content: a string, or a list of text parts (joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad(f"messages[{i}].content", "only text content parts ({\"type\": \"text\", \"text\": "
                                                     "...}) are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise _bad(f"messages[{i}].content", f"messages[{i}].content must be a string or a list of text parts")


def _messages(value) -> tuple:
    if not isinstance(value, list) or not value:
        raise _bad("messages", "messages must be a non-empty list of {\"role\", \"content\"} objects")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}]", f"messages[{i}] must be an object with role and content")
        role = m.get("role")
        if role not in ROLES:
            raise _bad(f"messages[{i}].role", f"messages[{i}].role must be one of {', '.join(ROLES)}, got "
                                              f"{json.dumps(role)[:40]}")
        if "content" not in m or m["content"] is None:
            raise _bad(f"messages[{i}].content", f"messages[{i}] has no content")
        extra = set(m) - {"role", "content", "name"}
        if extra:
            raise _bad(f"messages[{i}]", f"messages[{i}]: {', '.join(sorted(extra))} not supported (text messages "
                                         "only)")
        out.append({"role": role, "content": _content(i, m["content"])})
    return tuple(out)


def parse(body, chat: bool, max_tokens_limit: int = 2 ** 31 - 1) -> Completion:
    """A request body (parsed JSON) -> Completion; ApiError 400 naming the offending parameter."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    allowed = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "n",
               *IGNORED, *NEUTRAL} | ({"messages", "max_completion_tokens"} if chat else {"prompt"})
    for key in body:
        if key not in allowed:
            raise ApiError(400, f"Unrecognized request argument supplied: {key}", key, "unknown_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model", "model must be a string naming a served model (GET /v1/models lists them)")
    for key, neutral in NEUTRAL.items():
        if key in body and body[key] not in neutral:
            raise ApiError(400, f"{key} {json.dumps(body[key])[:40]} is not supported by eaglex (it would change "
                                "the target's output distribution, or is not implemented): leave it out", key,
                           "unsupported_value")
    n = _int(body, "n", 1, 128)
    if n not in (None, 1):
        raise ApiError(400, f"n must be 1: eaglex returns one choice per request, got {n}", "n", "unsupported_value")
    max_tokens = _int(body, "max_tokens", 1, max_tokens_limit)
    if chat:
        mct = _int(body, "max_completion_tokens", 1, max_tokens_limit)
        if mct is not None and max_tokens is not None and mct != max_tokens:
            raise _bad("max_completion_tokens", "max_tokens and max_completion_tokens disagree: give one of them")
        max_tokens = mct if mct is not None else max_tokens
        messages, prompt = _messages(body.get("messages")), None
    else:
        prompt, messages = body.get("prompt"), None
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise _bad("prompt", "prompt must be one string (one prompt per request)")
        if not prompt:
            raise _bad("prompt", "prompt must not be empty")
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
        raise _bad("stop", f"stop must be a non-empty string or a list of up to {MAX_STOP} non-empty strings")
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise _bad("stream_options", "stream_options is only allowed with stream true")
        if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
            raise _bad("stream_options", "stream_options must be {\"include_usage\": true|false}")
    include_usage = _bool(options or {}, "include_usage")
    return Completion(chat, model, messages, prompt, max_tokens, _number(body, "temperature", 1.0, 0.0, 2.0),
                      _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True), _int(body, "seed", -SEED_MAX - 1,
                                                                                   SEED_MAX),
                      tuple(stop), stream, include_usage)


def triton_request(c: Completion) -> dict:
    """The generate_stream body for the eaglex model: always streamed (one event per verification cycle). A
    negative seed maps onto the model's unsigned seeds one to one; a sampled request without one gets a fresh random
    seed, as OpenAI's API samples anew each call (the model's own default, 0, would repeat one sample)."""
    body = {"max_tokens": c.max_tokens, "temperature": c.temperature, "top_p": c.top_p, "stream": True}
    if c.max_tokens is None:
        del body["max_tokens"]
    if c.chat:
        body["messages"] = json.dumps(list(c.messages))
    else:
        body["text_input"], body["chat_template"] = c.prompt, False
    if c.seed is not None:
        body["seed"] = c.seed % 2 ** 64
    elif c.temperature > 0:
        body["seed"] = secrets.randbits(64)
    if c.stop:
        body["stop_words"] = list(c.stop)
    return body


def finish_reason(reason: str | None) -> str:
    """The model's reasons (eos, end_id, stop_word, length, context) in OpenAI's words."""
    return "length" if reason in ("length", "context") else "stop"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chunk(c: Completion, rid: str, created: int, text: str | None, finish: str | None = None,
          role: bool = False) -> dict:
    """One streamed chunk (text None: no choice delta, e.g. the finish chunk's empty delta)."""
    if c.chat:
        delta = {"role": "assistant", "content": text or ""} if role else ({} if text is None else {"content": text})
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": c.model, "choices": [choice]}


def usage_chunk(c: Completion, rid: str, created: int, u: dict) -> dict:
    return {"id": rid, "object": "chat.completion.chunk" if c.chat else "text_completion", "created": created,
            "model": c.model, "choices": [], "usage": u}


def response(c: Completion, rid: str, created: int, text: str, finish: str, u: dict) -> dict:
    """The whole answer of a request without stream."""
    if c.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": c.model, "choices": [choice], "usage": u}


def models_list(names, created: int) -> dict:
    return {"object": "list", "data": [model_card(n, created) for n in sorted(names)]}


def model_card(name: str, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "eaglex"}


class Events:
    """Server-sent events of Triton's generate_stream, fed as bytes in any cut: `feed` returns the complete
    events' JSON objects."""

    def __init__(self):
        self.buf = b""

    def feed(self, data: bytes) -> list[dict]:
        self.buf += data
        out = []
        while True:
            end = self.buf.find(b"\n\n")
            if end < 0:
                return out
            block, self.buf = self.buf[:end], self.buf[end + 2:]
            payload = b"".join(line[5:].strip() for line in block.split(b"\n") if line.startswith(b"data:"))
            if payload:
                try:
                    out.append(json.loads(payload))
                except ValueError:
                    out.append({"error": f"tritonserver sent an event that is not JSON: {payload[:80]!r}"})
