"""The OpenAI API's rules without a server (eaglex.serving.openai): request validation, the generate_stream body it
becomes, finish reasons, chunks and the event parser. tests/test_openai.py drives the real server with the SDK."""
from __future__ import annotations

import json

import pytest

from eaglex.serving.openai import ApiError, Events, chunk, finish_reason, parse, response, triton_request, usage

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("change,want", [
    ({}, dict(max_tokens=None, temperature=1.0, top_p=1.0, seed=None, stop=(), stream=False, include_usage=False)),
    ({"max_tokens": 5, "temperature": 0, "top_p": 0.5, "seed": -1, "stop": "x"},
     dict(max_tokens=5, temperature=0.0, top_p=0.5, seed=-1, stop=("x",))),
    ({"max_completion_tokens": 7}, dict(max_tokens=7)),
    ({"stream": True, "stream_options": {"include_usage": True}}, dict(stream=True, include_usage=True)),
    ({"n": 1, "user": "u", "frequency_penalty": 0, "logprobs": False, "response_format": {"type": "text"}}, {}),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]},
     dict(messages=({"role": "user", "content": "ab"},))),
])
def test_parse_accepts(change, want):
    c = parse({**CHAT, **change}, chat=True)
    for k, v in want.items():
        assert getattr(c, k) == v, k


@pytest.mark.parametrize("body,chat,param,message", [
    ([], True, None, "JSON object"),
    ({"messages": CHAT["messages"]}, True, "model", "model must be"),
    ({**CHAT, "foo": 1}, True, "foo", "Unrecognized"),
    ({**CHAT, "prompt": "x"}, True, "prompt", "Unrecognized"),
    ({"model": "m", "prompt": "x", "messages": []}, False, "messages", "Unrecognized"),
    ({**CHAT, "temperature": 2.5}, True, "temperature", "<= 2"),
    ({**CHAT, "temperature": True}, True, "temperature", "number"),
    ({**CHAT, "top_p": 0}, True, "top_p", "> 0"),
    ({**CHAT, "n": 3}, True, "n", "n must be 1"),
    ({**CHAT, "max_tokens": 0}, True, "max_tokens", ">= 1"),
    ({**CHAT, "max_tokens": 3, "max_completion_tokens": 4}, True, "max_completion_tokens", "disagree"),
    ({**CHAT, "seed": 2 ** 63}, True, "seed", "<="),
    ({**CHAT, "stop": ["a"] * 5}, True, "stop", "up to 4"),
    ({**CHAT, "stop": [""]}, True, "stop", "non-empty"),
    ({**CHAT, "stream_options": {"include_usage": True}}, True, "stream_options", "only allowed"),
    ({**CHAT, "stream": True, "stream_options": {"x": 1}}, True, "stream_options", "include_usage"),
    ({**CHAT, "logit_bias": {"1": 5}}, True, "logit_bias", "not supported"),
    ({**CHAT, "tools": [{"type": "function"}]}, True, "tools", "not supported"),
    ({**CHAT, "messages": "hi"}, True, "messages", "non-empty list"),
    ({**CHAT, "messages": [{"role": "tool", "content": "x"}]}, True, "messages[0].role", "one of"),
    ({**CHAT, "messages": [{"role": "user"}]}, True, "messages[0].content", "no content"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, True, "messages[0].content",
     "text content"),
    ({**CHAT, "messages": [{"role": "user", "content": "x", "tool_calls": []}]}, True, "messages[0]", "tool_calls"),
    ({"model": "m", "prompt": ["a", "b"]}, False, "prompt", "one string"),
    ({"model": "m", "prompt": [1, 2]}, False, "prompt", "one string"),
    ({"model": "m", "prompt": ""}, False, "prompt", "empty"),
])
def test_parse_refuses_with_the_parameter(body, chat, param, message):
    with pytest.raises(ApiError) as e:
        parse(body, chat=chat)
    err = json.loads(e.value.body())["error"]
    assert e.value.status == 400 and err["param"] == param and message in err["message"], err
    assert err["type"] == "invalid_request_error" and set(err) == {"message", "type", "param", "code"}


def test_unseeded_sampled_requests_get_fresh_seeds():
    """OpenAI samples anew on each call without a seed; greedy requests need none."""
    seeds = {triton_request(parse({**CHAT, "temperature": 0.8}, chat=True))["seed"] for _ in range(20)}
    assert len(seeds) == 20 and all(0 <= s < 2 ** 64 for s in seeds)
    assert "seed" not in triton_request(parse({**CHAT, "temperature": 0}, chat=True))


def test_triton_request():
    c = parse({**CHAT, "max_tokens": 9, "temperature": 0, "seed": -1, "stop": ["a", "b"]}, chat=True)
    body = triton_request(c)
    assert json.loads(body.pop("messages")) == CHAT["messages"]
    assert body == {"max_tokens": 9, "temperature": 0.0, "top_p": 1.0, "stream": True, "seed": 2 ** 64 - 1,
                    "stop_words": ["a", "b"]}
    body = triton_request(parse({"model": "m", "prompt": ["raw"]}, chat=False))
    assert isinstance(body.pop("seed"), int)                  # sampled (OpenAI's default temperature 1), unseeded
    assert body == {"temperature": 1.0, "top_p": 1.0, "stream": True, "text_input": "raw", "chat_template": False}


@pytest.mark.parametrize("reason,want", [("eos", "stop"), ("end_id", "stop"), ("stop_word", "stop"),
                                         ("length", "length"), ("context", "length")])
def test_finish_reason(reason, want):
    assert finish_reason(reason) == want


def test_chunks_and_response():
    chat, text = parse(CHAT, chat=True), parse({"model": "m", "prompt": "p"}, chat=False)
    assert chunk(chat, "id", 1, "", role=True)["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunk(chat, "id", 1, None, "stop")["choices"][0] == {"index": 0, "delta": {}, "logprobs": None,
                                                              "finish_reason": "stop"}
    assert chunk(text, "id", 1, "ab")["choices"][0]["text"] == "ab"
    r = response(chat, "id", 1, "out", "length", usage(3, 4))
    assert r["choices"][0]["message"] == {"role": "assistant", "content": "out"}
    assert r["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}


def test_events_across_cuts():
    e = Events()
    data = b'data: {"a": 1}\n\ndata: {"b": "x\\ny"}\n\ndata: {"c"'
    assert e.feed(data[:5]) == [] and e.feed(data[5:]) == [{"a": 1}, {"b": "x\ny"}]
    assert e.feed(b': 2}\n\n') == [{"c": 2}]
    assert "not JSON" in e.feed(b"data: {oops\n\n")[0]["error"]
