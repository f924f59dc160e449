"""The OpenAI API's requests and answers, as pure functions: a /v1/chat/completions or /v1/completions body -> its
pydantic model (`ChatRequest`, `TextRequest`) -> a validated `Completion` (or an `ApiError` with OpenAI's error
shape), -> the body of a generate_stream request to the eaglex Triton model; and the model's streamed events ->
OpenAI's chunks, final object and usage.

What is accepted: `model`, `messages` (chat: system/developer/user/assistant, string contents or lists of text
parts) or `prompt` (completions: one string), `max_tokens` / `max_completion_tokens`, `temperature` (0..2; 0 is
greedy), `top_p` (0 < p <= 1), `seed`, `stop` (a string or up to 4), `stream`, `stream_options.include_usage`,
`n` = 1, and, at their neutral values only, the knobs that would change the output distribution (penalties,
`logit_bias`, `logprobs`, `best_of` 1, `echo` false) or that eaglex does not implement (`tools`, `response_format`
other than text). `user`, `metadata` and `store` are accepted and ignored. Anything else is refused, as OpenAI
refuses unknown arguments, so that a misspelled knob is never silently ignored. The models are strict (no "5" for
5, no 2.0 for an integer): a wrong type is a client's mistake, said in the error.
"""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, create_model, model_validator
from pydantic_core import PydanticCustomError

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
MAX_TOKENS = 2 ** 31 - 1            # the model's max_tokens is INT32
# what a wrong value of these is told (instead of the type's words): they say what the field is
HINTS = {"model": "must be a string naming a served model (GET /v1/models lists them)",
         "messages": "must be a non-empty list of {\"role\", \"content\"} objects",
         "prompt": "must be one string (one prompt per request)"}
# pydantic's error types in our words: "<param> <phrase>, got <value>"
PHRASES = {"int_type": "must be an integer", "float_type": "must be a number",
           "finite_number": "must be a finite number", "bool_type": "must be true or false",
           "string_type": "must be a string", "list_type": "must be a list",
           "model_type": "must be a JSON object", "dict_type": "must be a JSON object",
           "literal_error": "must be one of {expected}", "greater_than_equal": "must be >= {ge}",
           "greater_than": "must be > {gt}", "less_than_equal": "must be <= {le}", "less_than": "must be < {lt}",
           "string_too_short": "must not be empty", "too_short": "must be a non-empty list",
           "too_long": "must have at most {max_length} items"}


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


# --- the requests' models -------------------------------------------------------------------------------------------
def _content(value):
    """A message's content: a string, or a list of text parts (joined)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        if all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in value):
            return "".join(p["text"] for p in value)
        raise PydanticCustomError("content", "must hold only text content parts ({\"type\": \"text\", \"text\": ...})")
    raise PydanticCustomError("content", "must be a string or a list of text parts")


def _stop(value):
    value = [] if value is None else [value] if isinstance(value, str) else value
    if not isinstance(value, list) or len(value) > MAX_STOP or not all(isinstance(s, str) and s for s in value):
        raise PydanticCustomError("stop", f"must be a non-empty string or a list of up to {MAX_STOP} non-empty strings")
    return tuple(value)


def _one_prompt(value):
    """A list holding one prompt is that prompt (what the SDK sends for prompt=[...])."""
    return value[0] if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str) else value


_STRICT = ConfigDict(extra="forbid", strict=True)
# the knobs accepted at their neutral values, and the ignored ones: any JSON, judged in completion()
_Knobs = create_model("_Knobs", __config__=_STRICT, **{k: (Any, None) for k in (*NEUTRAL, *IGNORED)})


class Message(BaseModel):
    model_config = _STRICT
    role: Literal[ROLES]
    content: Annotated[str, BeforeValidator(_content)]
    name: str | None = None


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _known(cls, value):
        if isinstance(value, dict) and set(value) - set(cls.model_fields):
            raise PydanticCustomError("stream_options", "must be {\"include_usage\": true|false}")
        return value


class _Request(_Knobs):
    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=-SEED_MAX - 1, le=SEED_MAX)
    stop: Annotated[tuple[str, ...], BeforeValidator(_stop)] = ()
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1, le=128)


class ChatRequest(_Request):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)


class TextRequest(_Request):
    prompt: Annotated[str, BeforeValidator(_one_prompt), Field(min_length=1)]


def _param(loc) -> str | None:
    """pydantic's location ("messages", 0, "role") as OpenAI names the parameter: messages[0].role."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out or None


def _bad(param: str | None, message: str) -> ApiError:
    return ApiError(400, message, param, "invalid_value" if "must" in message else None)


def invalid(errors: list[dict]) -> ApiError:
    """The first of pydantic's complaints (an unknown argument first, as OpenAI names those) as OpenAI's 400.
    FastAPI's locations start with "body"."""
    e = min(errors, key=lambda e: e["type"] != "extra_forbidden")
    loc, kind = tuple(e["loc"]), e["type"]
    if loc[:1] == ("body",):
        loc = loc[1:]
    if kind == "json_invalid":
        return ApiError(400, f"the request body is not valid JSON: {e.get('ctx', {}).get('error', e['msg'])}")
    if not loc:
        hint = " (send it with Content-Type: application/json)" if isinstance(e.get("input"), bytes) else ""
        return ApiError(400, f"the request body must be a JSON object{hint}")
    param, name = _param(loc), loc[-1]
    if kind == "extra_forbidden":
        if len(loc) == 1:
            return ApiError(400, f"Unrecognized request argument supplied: {name}", param, "unknown_parameter")
        return ApiError(400, f"{_param(loc[:-1])}: {name} is not supported", _param(loc[:-1]), "unknown_parameter")
    if param in HINTS and (kind == "missing" or kind.endswith("_type")):
        return _bad(param, f"{param} {HINTS[param]}")
    if kind == "missing":
        return _bad(param, f"{_param(loc[:-1])} has no {name}" if len(loc) > 1 else f"the request has no {name}")
    if kind not in PHRASES:                          # ours (PydanticCustomError) say it all; pydantic's own otherwise
        return _bad(param, f"{param} {e['msg']}" if e["msg"][:1].islower() else f"{param}: {e['msg']}")
    if kind == "too_short" and isinstance(e.get("input"), str):
        kind = "string_too_short"
    got = json.dumps(e.get("input"), default=str)
    return _bad(param, f"{param} {PHRASES[kind].format(**e.get('ctx', {}))}, got {got[:40]}")


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


def completion(req: ChatRequest | TextRequest) -> Completion:
    """A request whose types and ranges pydantic checked -> Completion; ApiError 400 for what eaglex does not do."""
    chat = isinstance(req, ChatRequest)
    for key, neutral in NEUTRAL.items():
        value = getattr(req, key)
        if key in req.model_fields_set and value not in neutral:
            raise ApiError(400, f"{key} {json.dumps(value, default=str)[:40]} is not supported by eaglex (it would "
                                "change the target's output distribution, or is not implemented): leave it out", key,
                           "unsupported_value")
    if req.n not in (None, 1):
        raise ApiError(400, f"n must be 1: eaglex returns one choice per request, got {req.n}", "n",
                       "unsupported_value")
    max_tokens = req.max_tokens
    if chat and req.max_completion_tokens is not None:
        if max_tokens is not None and req.max_completion_tokens != max_tokens:
            raise _bad("max_completion_tokens", "max_tokens and max_completion_tokens disagree: give one of them")
        max_tokens = req.max_completion_tokens
    if req.stream_options is not None and not req.stream:
        raise _bad("stream_options", "stream_options is only allowed with stream true")
    messages = tuple({"role": m.role, "content": m.content} for m in req.messages) if chat else None
    return Completion(chat, req.model, messages, None if chat else req.prompt, max_tokens,
                      1.0 if req.temperature is None else float(req.temperature),
                      1.0 if req.top_p is None else float(req.top_p), req.seed, req.stop, bool(req.stream),
                      bool(req.stream_options and req.stream_options.include_usage))


def parse(body, chat: bool) -> Completion:
    """A request body (parsed JSON) -> Completion; ApiError 400 naming the offending parameter."""
    try:
        req = (ChatRequest if chat else TextRequest).model_validate(body)
    except ValidationError as e:
        raise invalid(e.errors()) from None
    return completion(req)


# --- to the model, and back -----------------------------------------------------------------------------------------
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
