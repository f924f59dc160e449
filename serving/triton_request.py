"""One Triton request -> a validated GenerateRequest, or a RequestError that becomes a 4xx response.

Pure Python + numpy (no Triton import), so the rules are unit-testable without a server. The tensor names follow
tensorrtllm_backend's ensemble (`text_input`, `max_tokens`, `temperature`, `top_p`, `top_k`, `random_seed`/`seed`,
`end_id`, `stream`, `stop_words`, `bad_words`, `beam_width`, `pad_id`), so clients written for TensorRT-LLM on Triton
send the same request. What eaglex cannot honour without changing the output distribution (bad_words, beam search,
log-prob outputs) is refused with a clear message instead of being ignored.

Triton's own front end checks tensor names, shapes and data types before the model sees a request; what arrives here
is already typed. (Triton's JSON conversion wraps integers around to the input's type: the HTTP front of the
supervised server, front.py with guard.py, refuses out-of-range JSON values before that.) Keys of a generate-extension
body that match no input arrive as request *parameters*; those are refused as unknown, apart from Triton's reserved
`triton_*` keys, TensorRT-LLM's harmless flags and eaglex's own `chat_template` (true: text_input is the user's
message, wrapped with the tokenizer's chat template; it overrides the model parameter of the same name, whose
default, false, keeps TensorRT-LLM's meaning of text_input: raw text). `messages` (eaglex's own input, what the
OpenAI front sends for /v1/chat/completions) is a conversation as JSON, `[{"role": ..., "content": ...}, ...]`, put
through the tokenizer's chat template with the assistant's generation prompt.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import numpy as np

from eaglex.base.errors import ModelError
from eaglex.base.prompts import chat_ids, encode
from eaglex.runtime.types import SamplingConfig

# request parameters TensorRT-LLM clients send that need no action: stats are always returned, and the flags asking
# for logits/log-probs are accepted only when false (eaglex does not compute them)
PERF_FLAGS = ("return_perf_metrics", "exclude_input_in_output")
FALSE_ONLY_FLAGS = ("return_log_probs", "return_context_logits", "return_generation_logits")


class RequestError(ValueError):
    """A client mistake. `code` names the pb_utils.TritonError code: INVALID_ARG -> HTTP 400, UNSUPPORTED -> 400."""

    def __init__(self, message: str, code: str = "INVALID_ARG"):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Limits:
    """What this deployment accepts; set from the engine and the model's config.pbtxt parameters."""
    vocab_size: int
    max_context: int            # prompt + new tokens must fit
    max_input_bytes: int        # text_input longer than this is refused before tokenizing
    default_max_tokens: int     # when the request has no max_tokens (clipped to the room left)
    has_tokenizer: bool
    chat_template: bool = False         # the model's default: wrap text_input with the chat template
    has_chat_template: bool = False     # the engine's tokenizer has one

    @classmethod
    def from_parameters(cls, params: dict, vocab_size: int, max_context: int, tokenizer) -> Limits:
        """The limits of a model: its config.pbtxt parameters (name -> string) and its engine's tokenizer.
        A bad parameter raises a one-line ModelError (the model does not load)."""
        chat = params.get("chat_template") or "false"
        if chat not in ("true", "false"):
            raise ModelError(f"model parameter chat_template must be true or false, got {chat!r}")
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if chat == "true" and not has_template:
            raise ModelError("model parameter chat_template is true, but the engine's tokenizer has no chat template: "
                             "set it to false (clients then send raw text)")
        return cls(vocab_size, max_context, int(params.get("max_input_bytes") or 65536),
                   int(params.get("default_max_tokens") or 128), tokenizer is not None, chat == "true", has_template)


@dataclass
class GenerateRequest:
    input_ids: list[int]
    max_tokens: int
    sampling: SamplingConfig
    stream: bool = False
    end_id: int | None = None
    stop_words: list[str] = field(default_factory=list)


def _one(arrays: dict, name: str):
    """The single element of a [1] or [1, 1] tensor, None when absent."""
    a = arrays.get(name)
    if a is None:
        return None
    if a.size != 1:
        raise RequestError(f"{name} must hold exactly one value (shape [1] or [1, 1]), got shape {list(a.shape)}; "
                           "send one prompt per request")
    return a.reshape(-1)[0]


def _text(value, name: str) -> str:
    if isinstance(value, (bytes, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as e:
            raise RequestError(f"{name} is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    if isinstance(value, str):
        return value
    raise RequestError(f"{name} must be a string (BYTES), got {type(value).__name__}")


def _int(arrays: dict, name: str, lo: int | None = None, hi: int | None = None) -> int | None:
    """An integer input, range-checked on its exact value (never truncated or wrapped around)."""
    v = _one(arrays, name)
    if v is None:
        return None
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise RequestError(f"{name} must be an integer, got {v!r}")
    v = int(v)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        bounds = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise RequestError(f"{name} must be {bounds}, got {v}")
    return v


def _float(arrays: dict, name: str) -> float | None:
    v = _one(arrays, name)
    if v is None:
        return None
    v = float(v)
    if not math.isfinite(v):
        raise RequestError(f"{name} must be a finite number, got {v}")
    return v


def check_parameters(raw: str | dict | None) -> dict:
    """Refuse unknown request parameters (misspelled knobs would otherwise be silently ignored); returns eaglex's own
    ones (chat_template), type-checked."""
    params = json.loads(raw) if isinstance(raw, str) and raw else (raw or {})
    own = {}
    for key, value in params.items():
        if key.startswith("triton_"):            # reserved by Triton itself (e.g. triton_enable_empty_final_response)
            continue
        if key in PERF_FLAGS:
            continue
        if key in FALSE_ONLY_FLAGS:
            if value not in (False, 0, "false", "False"):
                raise RequestError(f"{key} is not supported by eaglex (it returns no logits or log-probs)",
                                   "UNSUPPORTED")
            continue
        if key == "chat_template":
            if not isinstance(value, bool):     # "false" would be truthy: only JSON true/false are accepted
                raise RequestError(f"parameter chat_template must be true or false (a boolean), got {value!r}")
            own[key] = value
            continue
        raise RequestError(f"unknown parameter {key!r}: this model's inputs are text_input or input_ids, "
                           "max_tokens, temperature, top_p, top_k, seed/random_seed, end_id, stream, stop_words "
                           "(and the parameter chat_template)")
    return own


def tokenize(tokenizer, text: str | list[dict], chat: bool) -> list[int]:
    """text -> ids; `chat`: as the user's message, wrapped with the tokenizer's chat template and its generation
    prompt (eaglex.base.prompts.encode, as `eaglex generate --chat` does). A list of messages is a whole conversation."""
    if isinstance(text, list):
        return chat_ids(tokenizer, text)
    return [int(i) for i in encode({"prompt": text}, tokenizer, chat, "text_input")]


def parse(arrays: dict[str, np.ndarray], parameters, limits: Limits, tokenize) -> GenerateRequest:
    """Validate one request. `arrays`: input name -> numpy array as Triton delivers it; `tokenize`: (text, chat) ->
    ids, chat meaning "apply the chat template"."""
    chat = check_parameters(parameters).get("chat_template")
    ids = _prompt(arrays, limits, tokenize, chat)
    room = limits.max_context - len(ids)
    if room <= 0:
        raise RequestError(f"the prompt has {len(ids)} tokens; the model's context holds {limits.max_context}, "
                           "so no token can be generated: shorten the prompt")

    max_tokens = _int(arrays, "max_tokens")
    if max_tokens is None:
        max_tokens = min(limits.default_max_tokens, room)
    elif max_tokens <= 0:
        raise RequestError(f"max_tokens must be >= 1, got {max_tokens}")
    elif max_tokens > room:
        raise RequestError(f"max_tokens {max_tokens} is beyond the context: the prompt has {len(ids)} tokens and the "
                           f"context holds {limits.max_context}, so at most {room} new tokens fit")

    beam = _int(arrays, "beam_width")
    if beam is not None and beam != 1:
        raise RequestError(f"beam_width {beam} is not supported: eaglex decodes one sequence (beam_width 1)",
                           "UNSUPPORTED")
    bad = [w for w in _words(arrays, "bad_words") if w]
    if bad:
        raise RequestError("bad_words is not supported: it would change the target's output distribution",
                           "UNSUPPORTED")
    stop_words = [w for w in _words(arrays, "stop_words") if w]
    if stop_words and not limits.has_tokenizer:
        raise RequestError("stop_words needs a tokenizer, and this engine has none: use end_id instead")
    _int(arrays, "pad_id", 0, limits.vocab_size - 1)     # checked, then unused: one sequence needs no padding
    end_id = _int(arrays, "end_id", 0, limits.vocab_size - 1)
    return GenerateRequest(ids, max_tokens, _sampling(arrays), bool(_one(arrays, "stream") or False), end_id,
                           stop_words)


def _prompt(arrays: dict, limits: Limits, tokenize, chat: bool | None) -> list[int]:
    """The prompt's ids; `chat`: the request's chat_template parameter (None: the model's default)."""
    text, ids, messages = arrays.get("text_input"), arrays.get("input_ids"), arrays.get("messages")
    if sum(a is not None for a in (text, ids, messages)) > 1:
        raise RequestError("give one prompt, text_input, input_ids or messages, not both")
    if text is None and ids is None and messages is None:
        raise RequestError("the request has no prompt: give text_input (or input_ids, or messages)")
    if messages is not None:
        if chat is False:
            raise RequestError("messages always go through the chat template: chat_template false contradicts them")
        return _check_length(_conversation(messages, limits, tokenize), limits)
    if ids is not None:
        if chat:
            raise RequestError("chat_template applies to text_input: input_ids are used as they are")
        flat = ids.reshape(-1)
        if flat.size == 0:
            raise RequestError("the prompt is empty: input_ids holds no token")
        if flat.size >= limits.max_context:
            raise RequestError(f"input_ids has {flat.size} tokens; the model's context holds {limits.max_context}")
        if int(flat.min()) < 0 or int(flat.max()) >= limits.vocab_size:
            raise RequestError(f"input_ids must lie in [0, {limits.vocab_size})")
        return [int(i) for i in flat]
    value = _one(arrays, "text_input")
    raw = bytes(value) if isinstance(value, (bytes, np.bytes_)) else None
    if raw is not None and len(raw) > limits.max_input_bytes:     # before decoding or tokenizing megabytes
        raise RequestError(f"text_input is {len(raw)} bytes; this model accepts at most {limits.max_input_bytes}")
    prompt = _text(value, "text_input")
    if not prompt:
        raise RequestError("the prompt is empty: text_input is an empty string")
    if not limits.has_tokenizer:
        raise RequestError("this engine has no tokenizer: send input_ids (INT32 token ids) instead of text_input")
    chat = limits.chat_template if chat is None else chat
    if chat and not limits.has_chat_template:
        raise RequestError("chat_template is true, but this engine's tokenizer has no chat template: send the "
                           "prompt as raw text (chat_template false)")
    out = tokenize(prompt, chat)
    if not out:
        raise RequestError("the prompt is empty: text_input tokenizes to no tokens")
    return _check_length(out, limits)


def _check_length(ids: list[int], limits: Limits) -> list[int]:
    if len(ids) >= limits.max_context:
        raise RequestError(f"the prompt has {len(ids)} tokens; the model's context holds {limits.max_context}: "
                           "shorten it")
    return ids


ROLES = ("system", "developer", "user", "assistant")


def _conversation(array, limits: Limits, tokenize) -> list[int]:
    """The `messages` input: a JSON list of {"role", "content"} with string contents, through the chat template."""
    value = _one({"messages": array}, "messages")
    raw = bytes(value) if isinstance(value, (bytes, np.bytes_)) else _text(value, "messages").encode()
    if len(raw) > limits.max_input_bytes:
        raise RequestError(f"messages is {len(raw)} bytes; this model accepts at most {limits.max_input_bytes}")
    try:
        messages = json.loads(_text(value, "messages"))
    except ValueError as e:
        raise RequestError(f"messages is not valid JSON: {e}") from None
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty JSON list of {\"role\", \"content\"} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) != {"role", "content"} or m["role"] not in ROLES \
                or not isinstance(m["content"], str):
            raise RequestError(f"messages[{i}] must be {{\"role\": one of {', '.join(ROLES)}, \"content\": a "
                               f"string}}, got {json.dumps(m)[:80]}")
    if not limits.has_tokenizer:
        raise RequestError("this engine has no tokenizer: send input_ids instead of messages")
    if not limits.has_chat_template:
        raise RequestError("this engine's tokenizer has no chat template: send text_input (raw text) instead")
    try:
        out = tokenize(messages, True)
    except RequestError:
        raise
    except Exception as e:  # noqa: BLE001 - a template that refuses a conversation (roles out of order, ...)
        raise RequestError(f"the chat template refused these messages: {e}") from None
    if not out:
        raise RequestError("the prompt is empty: messages tokenize to no tokens")
    return out


def _words(arrays: dict, name: str) -> list[str]:
    a = arrays.get(name)
    return [] if a is None else [_text(v, name) for v in a.reshape(-1)]


def _sampling(arrays: dict) -> SamplingConfig:
    """TensorRT-LLM's knobs -> SamplingConfig. Absent or 0 temperature is greedy; top_p 0 means "off" (TRT-LLM)."""
    temperature = _float(arrays, "temperature") or 0.0
    top_p = _float(arrays, "top_p")
    top_k = _int(arrays, "top_k", 0)
    seed = _int(arrays, "seed", 0, 2 ** 64 - 1)
    random_seed = _int(arrays, "random_seed", 0, 2 ** 64 - 1)
    if seed is not None and random_seed is not None and seed != random_seed:
        raise RequestError(f"seed ({seed}) and random_seed ({random_seed}) disagree: give one of them")
    try:
        return SamplingConfig(temperature, 1.0 if not top_p else top_p, top_k or 0,
                              seed if seed is not None else (random_seed or 0))
    except ValueError as e:                     # SamplingConfig's own range checks
        raise RequestError(str(e)) from None
