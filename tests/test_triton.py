"""Triton deployment: request rules and repository writing (no server), then the real tritonserver that
nvidia-pytriton bundles, on loopback ports, serving a repository written by `eaglex triton` for the Llama fixture
with its EAGLE-3 head and a character-level tokenizer.

Server tests, through the supervised server `eaglex serve` runs (eaglex.serving: its HTTP front, then
tritonserver): 16 concurrent requests (greedy and sampling, short and long) whose greedy outputs equal vanilla
decoding; streamed chunks that join to the one-shot output; every bad input answered with its error while the
server stays ready; cancelled and disconnected clients; custom metrics; a clean stop that leaves no process and no
shared-memory file behind. test_triton_robust.py covers what must not take the deployment down. They are skipped only
when tritonserver is not installed (pip install -e '.[triton]').
"""
from __future__ import annotations

import json
import queue
import shutil
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import numpy as np
import pytest

from eaglex.base.errors import ModelError
from eaglex.cli import main
from eaglex.serving import control, processes, tritonserver
from eaglex.serving.config import ServeConfig
from eaglex.serving.repository import write_repository
from eaglex.serving.textstream import TextStream
from eaglex.serving.triton_request import Limits, RequestError, parse, tokenize

CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 .,!?'-:;()"      # 47 characters + the EOS token = the 48 ids

try:
    tritonserver.triton_root()
    NO_TRITON = None
except tritonserver.TritonUnavailable as e:
    NO_TRITON = str(e)
needs_triton = pytest.mark.skipif(NO_TRITON is not None, reason=f"tritonserver cannot be used: {NO_TRITON}")


# a chat template written in the characters the char tokenizer knows: "hi" -> "user: hi assistant:"
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def char_tokenizer(eos_id: int, vocab_size: int = 48, chat_template: str | None = None):
    """A character-level tokenizer over the fixtures' vocabulary: one id per character, EOS at the model's id."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = iter(CHARS)
    vocab = {("</s>" if i == eos_id else next(chars)): i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()              # characters join without spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")
    if chat_template:
        fast.chat_template = chat_template
    return fast


def write_char_tokenizer(folder, eos_id: int, vocab_size: int = 48, chat_template: str | None = None) -> None:
    char_tokenizer(eos_id, vocab_size, chat_template).save_pretrained(str(folder))


# ---------------------------------------------------------------------------------------------------------------
# request rules, text streaming, repository writing: no server needed
# ---------------------------------------------------------------------------------------------------------------
LIMITS = Limits(vocab_size=48, max_context=64, max_input_bytes=100, default_max_tokens=16, has_tokenizer=True)


def _arrays(**arrays) -> dict:
    """Tensors as Triton delivers them: [1, 1] scalars and strings, [1, n] lists."""
    def arr(v):
        if isinstance(v, str):
            return np.array([[v.encode()]], dtype=object)
        return np.array([v]) if isinstance(v, list) else np.array([[v]])
    return {k: arr(v) for k, v in arrays.items()}


def _parse(params=None, **arrays):
    return parse(_arrays(**arrays), params, LIMITS, lambda s, chat: [CHARS.index(c) for c in s])


def test_parse_defaults_and_trtllm_conventions():
    r = _parse(text_input="abc")
    assert r.input_ids == [0, 1, 2] and r.max_tokens == 16 and r.sampling.greedy and not r.stream
    r = _parse(text_input="abc", max_tokens=61, temperature=0.5, top_p=0.0, top_k=5, random_seed=7, stream=True,
               end_id=3, stop_words=["x"], bad_words=[""], beam_width=1)
    assert r.max_tokens == 61 and r.sampling.top_p == 1.0 and r.sampling.seed == 7 and r.stream and r.end_id == 3
    assert _parse('{"triton_enable_empty_final_response": true}', input_ids=[1, 2]).input_ids == [1, 2]


@pytest.mark.parametrize("arrays,params,message,code", [
    ({"text_input": ""}, None, "empty", "INVALID_ARG"),
    ({"input_ids": []}, None, "empty", "INVALID_ARG"),
    ({}, None, "no prompt", "INVALID_ARG"),
    ({"text_input": "ab", "input_ids": [1]}, None, "not both", "INVALID_ARG"),
    ({"text_input": "ab", "max_tokens": 0}, None, ">= 1", "INVALID_ARG"),
    ({"text_input": "ab", "max_tokens": 63}, None, "beyond the context", "INVALID_ARG"),
    ({"text_input": "a" * 64}, None, "context holds 64", "INVALID_ARG"),
    ({"text_input": "a" * 101}, None, "at most 100", "INVALID_ARG"),
    ({"input_ids": [1, 48]}, None, "[0, 48)", "INVALID_ARG"),
    ({"text_input": "ab"}, '{"temprature": 0.5}', "unknown parameter 'temprature'", "INVALID_ARG"),
    ({"text_input": "ab"}, '{"return_log_probs": true}', "not supported", "UNSUPPORTED"),
    ({"text_input": "ab", "top_p": 1.5}, None, "top_p", "INVALID_ARG"),
    ({"text_input": "ab", "temperature": -1.0}, None, "temperature", "INVALID_ARG"),
    ({"text_input": "ab", "seed": 1, "random_seed": 2}, None, "disagree", "INVALID_ARG"),
    ({"text_input": "ab", "beam_width": 4}, None, "beam_width", "UNSUPPORTED"),
    ({"text_input": "ab", "bad_words": ["x"]}, None, "bad_words", "UNSUPPORTED"),
    ({"text_input": "ab", "end_id": 48}, None, "end_id", "INVALID_ARG"),
    ({"text_input": "ab", "max_tokens": 5.5}, None, "max_tokens must be an integer", "INVALID_ARG"),
    ({"text_input": "ab", "top_k": True}, None, "top_k must be an integer", "INVALID_ARG"),
    ({"text_input": "ab", "seed": 2 ** 64}, None, "seed must be", "INVALID_ARG"),
])
def test_parse_refuses(arrays, params, message, code):
    with pytest.raises(RequestError) as e:
        _parse(params, **arrays)
    assert message in str(e.value) and e.value.code == code


def test_chat_template_from_the_model_parameter_or_the_request():
    """Off by default (text_input is raw text, as for TensorRT-LLM); the model parameter turns it on, a request's
    chat_template parameter overrides the model's either way; input_ids are never wrapped."""
    tok = char_tokenizer(47, chat_template=CHAT_TEMPLATE)
    raw, chat = tok("hello")["input_ids"], tok("user: hello assistant:")["input_ids"]
    assert tokenize(tok, "hello", True) == chat and tokenize(tok, "hello", False) == raw
    off = Limits.from_parameters({"max_input_bytes": "100"}, 48, 64, tok)
    on = Limits.from_parameters({"chat_template": "true"}, 48, 64, tok)
    assert not off.chat_template and off.has_chat_template and off.max_input_bytes == 100 and on.chat_template
    for limits, params, want in ((off, None, raw), (off, '{"chat_template": true}', chat), (on, None, chat),
                                 (on, '{"chat_template": false}', raw), (on, {"chat_template": True}, chat)):
        assert parse(_arrays(text_input="hello"), params, limits, partial(tokenize, tok)).input_ids == want, params
    assert parse(_arrays(input_ids=[4, 5]), None, on, partial(tokenize, tok)).input_ids == [4, 5]


@pytest.mark.parametrize("params,arrays,template,message", [
    ('{"chat_template": "true"}', {"text_input": "hi"}, True, "chat_template must be true or false (a boolean)"),
    ('{"chat_template": 1}', {"text_input": "hi"}, True, "chat_template must be true or false"),
    ('{"chat_template": null}', {"text_input": "hi"}, True, "chat_template must be true or false"),
    ('{"chat_template": true}', {"input_ids": [1, 2]}, True, "chat_template applies to text_input"),
    ('{"chat_template": true}', {"text_input": "hi"}, False, "tokenizer has no chat template"),
])
def test_chat_template_request_errors_are_400(params, arrays, template, message):
    tok = char_tokenizer(47, chat_template=CHAT_TEMPLATE if template else None)
    limits = Limits.from_parameters({}, 48, 64, tok)
    with pytest.raises(RequestError) as e:
        parse(_arrays(**arrays), params, limits, partial(tokenize, tok))
    assert message in str(e.value) and e.value.code == "INVALID_ARG"


def test_chat_template_model_parameter_errors_stop_the_load():
    with pytest.raises(ModelError, match="chat_template must be true or false, got 'yes'"):
        Limits.from_parameters({"chat_template": "yes"}, 48, 64, char_tokenizer(47, chat_template=CHAT_TEMPLATE))
    with pytest.raises(ModelError, match="has no chat template: set it to false"):
        Limits.from_parameters({"chat_template": "true"}, 48, 64, char_tokenizer(47))
    assert not Limits.from_parameters({"chat_template": "false"}, 48, 64, None).has_tokenizer


def test_parse_refuses_bad_utf8_and_batches():
    with pytest.raises(RequestError, match="UTF-8"):
        parse({"text_input": np.array([[b"\xff\xfe"]], dtype=object)}, None, LIMITS, list)
    with pytest.raises(RequestError, match="one prompt per request"):
        parse({"text_input": np.array([[b"a"], [b"b"]], dtype=object)}, None, LIMITS, list)


class _ByteTok:
    """Decodes ids as UTF-8 bytes (id = byte), like byte-level BPE: a character may span several ids."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_text_stream_holds_split_characters_and_stops_at_stop_words():
    s = TextStream(_ByteTok())
    e = "é".encode()
    chunks = [s.push([ord("a"), e[0]]), s.push([e[1], ord("b")]), s.finish()]
    assert chunks == ["a", "éb", ""] and "".join(chunks) == "aéb"
    s = TextStream(_ByteTok(), ["cd"])
    assert s.push(list(b"abc")) == "ab"            # "c" may begin the stop word: held back
    assert s.push(list(b"x")) == "cx"              # it did not
    assert s.push(list(b"ycde")) == "y" and s.stopped and s.finish() == "" and s.text == "abcxy"


def test_write_repository(tmp_path, models):
    engine = tmp_path / "ck"
    (engine / "target").mkdir(parents=True)
    shutil.copy(models["llama"] / "config.json", engine / "target")
    model = write_repository(engine, tmp_path / "repo", "m1", instances=3, max_queue_size=5)
    cfg = (model / "config.pbtxt").read_text()
    for s in ('name: "m1"', 'backend: "python"', "decoupled: true", "count: 3 kind: KIND_CPU", "max_queue_size: 5",
              'name: "text_input" data_type: TYPE_STRING', 'name: "max_tokens" data_type: TYPE_INT32',
              'name: "temperature" data_type: TYPE_FP32', 'name: "seed" data_type: TYPE_UINT64',
              'name: "stream" data_type: TYPE_BOOL', 'name: "text_output" data_type: TYPE_STRING',
              f'string_value: "{engine.resolve()}"'):
        assert s in cfg, s
    assert "TritonPythonModel" in (model / "1" / "model.py").read_text()
    with pytest.raises(ModelError, match="--force"):
        write_repository(engine, tmp_path / "repo", "m1")
    write_repository(engine, tmp_path / "repo", "m1", force=True)
    with pytest.raises(ModelError, match="does not exist"):
        write_repository(tmp_path / "missing", tmp_path / "repo", "m2")
    with pytest.raises(ModelError, match="neither an engine"):
        write_repository(tmp_path / "repo", tmp_path / "repo2", "m2")


def test_write_repository_chat_template(tmp_path, models, capsys):
    """Off by default; --chat sets the model parameter, and only for an engine whose tokenizer has a template."""
    engine = tmp_path / "ck"
    (engine / "target").mkdir(parents=True)
    shutil.copy(models["llama"] / "config.json", engine / "target")
    cfg = lambda: (tmp_path / "repo" / "eaglex" / "config.pbtxt").read_text()  # noqa: E731
    write_repository(engine, tmp_path / "repo")
    assert 'key: "chat_template" value: { string_value: "false" }' in cfg()
    with pytest.raises(ModelError, match="has no tokenizer"):
        write_repository(engine, tmp_path / "repo", force=True, chat_template=True)
    write_char_tokenizer(engine / "target", 47)
    with pytest.raises(ModelError, match="has no chat template"):
        write_repository(engine, tmp_path / "repo", force=True, chat_template=True)
    for f in (engine / "target").iterdir():                  # the folder's own tokenizer, as for target/ + draft/
        if f.name != "config.json":
            f.unlink()
    write_char_tokenizer(engine, 47, chat_template=CHAT_TEMPLATE)
    assert main(["triton", "--engine", str(engine), "--out", str(tmp_path / "repo"), "--chat", "--force"]) == 0
    assert 'key: "chat_template" value: { string_value: "true" }' in cfg()
    assert "chat template on text_input" in capsys.readouterr().out
    assert main(["triton", "--engine", str(engine), "--out", str(tmp_path / "r2"), "--backend", "tensorrt-llm",
                 "--chat"]) == 2
    assert "--chat applies to --backend eaglex only" in capsys.readouterr().err


def test_layouts(tmp_path, models):
    from eaglex.serving.loader import layout
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "manifest.json").write_text("{}")
    assert layout(tmp_path / "engine") == "engine" and layout(models["llama"]) == "hf"
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "target").symlink_to(models["llama"])
    assert layout(tmp_path / "ck") == "checkpoint"


def test_cli_triton(tmp_path, capsys):
    assert main(["triton", "--engine", str(tmp_path / "nope"), "--out", str(tmp_path / "r")]) == 2
    assert "does not exist" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------
# the model in this process, with a stand-in for triton_python_backend_utils (only Triton's stub has the real one):
# what depends on the model's own logic and not on Triton is tested here, without timing
# ---------------------------------------------------------------------------------------------------------------
class _Metric:
    def __init__(self):
        self.value = 0.0

    def increment(self, n):
        self.value += n

    def set(self, v):
        self.value = v


class _Family:
    COUNTER, GAUGE = "counter", "gauge"

    def __init__(self, name, description, kind):
        self.name = name

    def Metric(self, labels):  # noqa: N802 - pb_utils' spelling
        metric = _Metric()
        FAKE_PB.metrics[self.name + json.dumps(labels, sort_keys=True)] = metric
        return metric


class _Error:
    INVALID_ARG, UNSUPPORTED, INTERNAL, CANCELLED, UNAVAILABLE = ("INVALID_ARG", "UNSUPPORTED", "INTERNAL",
                                                                  "CANCELLED", "UNAVAILABLE")

    def __init__(self, message, code="INTERNAL"):
        self.text, self.code = message, code

    def message(self):
        return self.text


class _Tensor:
    def __init__(self, name, array):
        self._name, self._array = name, array

    def name(self):
        return self._name

    def as_numpy(self):
        return self._array


class _Response:
    def __init__(self, output_tensors, error=None):
        self.outputs, self.error = {t.name(): t.as_numpy() for t in output_tensors}, error


class _Logger:
    @staticmethod
    def log_info(msg):
        FAKE_PB.log.append(msg)

    log_warn = log_error = log_info


FAKE_PB = type(sys)("triton_python_backend_utils")
FAKE_PB.__dict__.update(Tensor=_Tensor, InferenceResponse=_Response, TritonError=_Error, Logger=_Logger,
                        MetricFamily=_Family, TRITONSERVER_RESPONSE_COMPLETE_FINAL=1, metrics={}, log=[])


def model_module():
    """serving/model.py, importing FAKE_PB as triton_python_backend_utils."""
    sys.modules.setdefault("triton_python_backend_utils", FAKE_PB)
    from eaglex.serving import model
    assert model.pb_utils is FAKE_PB, "a real triton_python_backend_utils was imported first"
    return model


def counter(outcome: str) -> float:
    """eaglex_requests_total of the in-process model (summed over every model loaded in this process)."""
    return sum(m.value for k, m in FAKE_PB.metrics.items()
               if k.startswith("eaglex_requests_total") and f'"outcome": "{outcome}"' in k)


class FakeRequest:
    """A Triton request: its tensors, its parameters, a cancellation flag (a function) and a sender that records
    the responses; `final` is set by the last one."""

    def __init__(self, params: dict | None = None, cancelled=lambda: False, **arrays):
        self.arrays, self.params, self.cancelled = _arrays(**arrays), json.dumps(params or {}), cancelled
        self.responses: list = []
        self.final = threading.Event()
        self.final_at: float | None = None           # time.monotonic() of the last response

    def inputs(self):
        return [_Tensor(k, v) for k, v in self.arrays.items()]

    def parameters(self):
        return self.params

    def is_cancelled(self):
        return self.cancelled()

    def get_response_sender(self):
        return self

    def send(self, response, flags=0):            # the sender's method
        self.responses.append(response)
        if flags & FAKE_PB.TRITONSERVER_RESPONSE_COMPLETE_FINAL:
            self.final_at = time.monotonic()
            self.final.set()

    def result(self, timeout: float = 120.0) -> dict:
        """The joined output once the request ended: {"ids", "text", "error" (code or None), "reason"}."""
        assert self.final.wait(timeout), "no final response"
        errors = [r.error for r in self.responses if r.error is not None]
        out = {"ids": [], "text": "", "error": errors[0].code if errors else None, "reason": None}
        for r in self.responses:
            out["ids"] += [int(i) for i in r.outputs.get("output_ids", np.zeros((1, 0))).reshape(-1)]
            out["text"] += r.outputs["text_output"].reshape(-1)[0].decode() if "text_output" in r.outputs else ""
            out["reason"] = r.outputs["finish_reason"].reshape(-1)[0].decode() if "finish_reason" in r.outputs \
                else out["reason"]
        return out


def load_in_process(model_dir: Path):
    """TritonPythonModel.initialize on a folder written by write_repository, with the arguments Triton passes (the
    config's parameters as Triton turns config.pbtxt into JSON). The caller finalizes it."""
    import re

    import torch
    cfg = (model_dir / "config.pbtxt").read_text()
    params = {k: {"string_value": v} for k, v in re.findall(r'key: "(\w+)" value: \{ string_value: "([^"]*)" \}', cfg)}
    model = model_module().TritonPythonModel()
    threads = torch.get_num_threads()
    try:
        model.initialize({"model_config": json.dumps({"parameters": params}), "model_name": model_dir.name,
                          "model_repository": str(model_dir), "model_version": "1",
                          "model_instance_name": f"{model_dir.name}_0"})
    finally:
        torch.set_num_threads(threads)        # the model's thread policy is its process's: not this one's
    return model


def test_model_applies_the_chat_template_by_default_or_per_request(checkpoint, reference, tmp_path):
    """A repository written with chat_template true, through TritonPythonModel itself: text_input is wrapped by
    default, a request may turn it off, a bad value is refused; greedy outputs equal vanilla on the same ids."""
    run_vanilla, tok = reference
    model = load_in_process(write_repository(checkpoint, tmp_path / "repo", threads=1, max_batch=0,
                                             chat_template=True))
    try:
        assert model.limits.chat_template and model.limits.has_chat_template
        assert "chat template on text_input on by default" in FAKE_PB.log[-1]
        chat = tok.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True,
                                       tokenize=False)
        assert chat == "user: hello assistant:"
        requests = [FakeRequest(text_input="hello", max_tokens=20),
                    FakeRequest({"chat_template": False}, text_input="hello", max_tokens=20),
                    FakeRequest({"chat_template": "yes"}, text_input="hello", max_tokens=20)]
        before = counter("invalid")
        model.execute(requests)
        wrapped, raw, bad = (r.result() for r in requests)
        assert wrapped["error"] is None and wrapped["ids"] == run_vanilla(chat, 20)
        assert wrapped["text"] == tok.decode(wrapped["ids"], skip_special_tokens=True)
        assert raw["error"] is None and raw["ids"] == run_vanilla("hello", 20) != wrapped["ids"]
        assert bad["error"] == "INVALID_ARG" and "chat_template must be true or false" in bad_message(requests[2])
        assert counter("invalid") == before + 1
    finally:
        model.finalize()


def bad_message(request: FakeRequest) -> str:
    return next(r.error.message() for r in request.responses if r.error is not None)


# ---------------------------------------------------------------------------------------------------------------
# the real server
# ---------------------------------------------------------------------------------------------------------------
GREEDY_PROMPTS = ["hello world", "the quick brown fox", "eagle speculative decoding", "a", "lossless: 42!",
                  "draft then verify", "triton server", "zz top"]


def test_max_context_sizes_the_batch_slots_and_the_requests(checkpoint, reference, tmp_path, monkeypatch):
    """Batch slots hold KV for the whole context up front (SmolLM2's 8192 tokens x 32 slots: 12 GB, killed by the
    OOM killer in a load benchmark): `max_context` bounds the slots and the requests; unset, the slots take at most
    half the memory available at load; a request longer than the context is refused, not cut or overflowed."""
    run_vanilla, tok = reference
    mod = model_module()
    model = load_in_process(write_repository(checkpoint, tmp_path / "repo", threads=1, max_batch=4, max_context=40))
    try:
        engine, per_token = model.engine, model.engine.kv_bytes_per_token()
        assert model.limits.max_context == 40 and "context 40 tokens" in FAKE_PB.log[-1]
        assert model.batching.slot_bytes == per_token * (40 + model.batching.schedule.max_nodes)
        ok, long = FakeRequest(text_input="hello", max_tokens=20), FakeRequest(text_input="hello", max_tokens=40)
        model.execute([ok, long])
        assert ok.result()["error"] is None and ok.result()["ids"] == run_vanilla("hello", 20)
        assert long.result()["error"] == "INVALID_ARG"
    finally:
        model.finalize()
    spec_context = engine.spec.max_context
    assert mod.serving_context(engine, 0, 0) == spec_context                 # one request at a time: the model's
    assert mod.serving_context(engine, 10 ** 9, 4) == spec_context           # capped at the model's
    half = spec_context // 2
    assert half >= 256
    pages = {"SC_AVPHYS_PAGES": half * per_token * 4 * 2 // 4096, "SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(mod.os, "sysconf", lambda k: pages[k])
    assert half - 1 <= mod.serving_context(engine, 0, 4) <= half              # half the free memory over 4 slots
    with pytest.raises(ModelError, match="lower max_batch, or set max_context"):
        mod.serving_context(engine, 0, 400)


def test_a_failed_step_restarts_with_slots_of_the_same_context(checkpoint, reference, tmp_path, monkeypatch):
    """After a batch step fails, the fresh batcher's slots keep the serving context (max_context), not the model's
    whole context (which would escape the memory cap the slots were sized by); the next request decodes as before."""
    run_vanilla, _ = reference
    model = load_in_process(write_repository(checkpoint, tmp_path / "repo", threads=1, max_batch=4, max_context=40))
    try:
        batching = model.batching
        before = batching.gen.backend.spec.max_context
        assert before == 40

        def failing():
            raise RuntimeError("boom")
        monkeypatch.setattr(batching.gen, "step", failing)
        broken = FakeRequest(text_input="hello", max_tokens=5)
        model.execute([broken])
        assert broken.result()["error"] == "INTERNAL"
        deadline = time.monotonic() + 30          # the engine thread answers the jobs, then starts over
        while batching.gen.step is failing and time.monotonic() < deadline:
            time.sleep(0.01)
        assert batching.gen.step is not failing and batching.gen.backend.spec.max_context == 40
        ok = FakeRequest(text_input="hello", max_tokens=20)
        model.execute([ok])
        assert ok.result()["error"] is None and ok.result()["ids"] == run_vanilla("hello", 20)
    finally:
        model.finalize()


@pytest.fixture(scope="module")
def checkpoint(models, tmp_path_factory):
    """target/ (Llama fixture + char tokenizer with a chat template) and draft/ (EAGLE-3 head): the layout the model
    loads directly."""
    root = tmp_path_factory.mktemp("triton-ck")
    shutil.copytree(models["llama"], root / "target")
    shutil.copytree(models["llama/eagle3"], root / "draft")
    eos = json.loads((root / "target" / "config.json").read_text())["eos_token_id"]
    write_char_tokenizer(root / "target", eos, chat_template=CHAT_TEMPLATE)   # raw text unless asked
    return root


def serve(repo, work, api_key=None, **kw) -> control.Served:
    """The supervised server on free loopback ports, as `eaglex serve start` starts it; `stop_served` stops it."""
    t0 = time.monotonic()
    srv = control.start(ServeConfig(str(repo), str(work), http_port=0, grpc_port=0, metrics_port=0, exit_timeout=20,
                                    ready_timeout=150, **kw), api_key)
    srv.startup_seconds = time.monotonic() - t0
    return srv


def stop_served(srv) -> dict:
    """Stop it and check that nothing is left behind: no process of the server's group, no shared-memory file."""
    pgid, shm, t0 = srv.server_pid, srv.state().get("shm", []), time.monotonic()
    st = srv.stop()
    seconds = time.monotonic() - t0
    left = processes.group_pids(pgid) if pgid else []
    if left:                                          # never leave a process behind, even when the test fails
        processes.stop_group(pgid, 1)
    assert not left, f"processes left behind: {left}"
    assert not processes.alive(srv.pid), "the supervisor is still running"
    assert not [n for n in shm if Path(f"/dev/shm/{n}").exists()], "shared-memory files left behind"
    stopped = st.get("stopped", {})
    assert stopped.get("how") == "exited cleanly", f"{stopped}:\n{srv.log_tail()}"
    st["stop_seconds"] = seconds
    return st


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    work = tmp_path_factory.mktemp("triton")
    write_repository(checkpoint, work / "repo", "eaglex", instances=2, threads=1, max_queue_size=32)
    srv = serve(work / "repo", work)
    try:
        yield srv
    finally:
        st = stop_served(srv)
        print(f"\n[triton] 2 instances: ready in {srv.startup_seconds:.1f} s, stopped in {st['stop_seconds']:.1f} s",
              file=sys.stderr)


@pytest.fixture(scope="module")
def reference(checkpoint):
    """Vanilla greedy decoding of the same target in this process, and its tokenizer."""
    from transformers import AutoTokenizer

    from eaglex.runtime.generate import VanillaGenerator
    from eaglex.runtime.torch_backend import TorchBackend

    tok = AutoTokenizer.from_pretrained(checkpoint / "target")
    gen = VanillaGenerator(TorchBackend(checkpoint / "target"))

    def run(text: str, max_tokens: int) -> list[int]:
        return gen.generate(tok(text)["input_ids"], max_tokens).output_ids
    return run, tok


def post(srv, endpoint: str, body: dict | bytes, model: str = "eaglex"):
    """(status, parsed JSON or list of SSE events) of POST /v2/models/<model>/<endpoint>."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(f"{srv.url}/v2/models/{model}/{endpoint}", data=data,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    if endpoint == "generate_stream" and text.startswith("data:"):
        return status, [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")]
    return status, json.loads(text)


def ids_of(value) -> list[int]:
    """output_ids as the generate extension writes it: a scalar for one element, else a list."""
    return [] if value is None else ([value] if isinstance(value, int) else list(value))


def metrics(srv) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    return {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in lines if ln.startswith("eaglex_")}


@needs_triton
def test_concurrent_requests_match_vanilla(server, reference):
    run_vanilla, tok = reference
    jobs = []
    for i, text in enumerate(GREEDY_PROMPTS):                       # 8 greedy: short and long
        jobs.append({"text_input": text, "max_tokens": 8 if i % 2 else 200})
    for i, text in enumerate(GREEDY_PROMPTS[:4]):                   # 8 sampling: 4 seeds, each sent twice
        job = {"text_input": text, "max_tokens": 12 if i % 2 else 150, "temperature": 0.9, "top_p": 0.95,
               "top_k": 20, "seed": 100 + i}
        jobs += [job, dict(job)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda b: post(server, "generate", b), jobs))
    wall = time.perf_counter() - t0

    for body, (status, out) in zip(jobs, results):
        assert status == 200, (body, out)
        ids = ids_of(out["output_ids"])
        assert 1 <= len(ids) <= body["max_tokens"] and out["text_output"] == tok.decode(ids, skip_special_tokens=True)
        assert out["finish_reason"] in ("eos", "length")
        if "temperature" not in body:
            assert ids == run_vanilla(body["text_input"], body["max_tokens"]), body
            assert out["cycles"] >= 1 or len(ids) == 1
    for a in range(8, 16, 2):                                        # same seed, same request: same output
        assert results[a][1]["output_ids"] == results[a + 1][1]["output_ids"]
    tokens = sum(len(ids_of(out["output_ids"])) for _, out in results)
    taus = [out["tau"] for _, out in results if out["cycles"]]
    print(f"\n[triton] 16 concurrent requests, 2 instances: {wall:.2f} s wall, {tokens} tokens, "
          f"{tokens / wall:.0f} tokens/s, mean tau {sum(taus) / len(taus):.2f}; server ready in "
          f"{server.startup_seconds:.1f} s", file=sys.stderr)

    m = metrics(server)
    assert m['eaglex_requests_total{model="eaglex",outcome="success"}'] >= 16
    assert m['eaglex_output_tokens_total{model="eaglex"}'] >= tokens
    assert m['eaglex_cycles_total{model="eaglex"}'] > 0 and m['eaglex_accepted_draft_tokens_total{model="eaglex"}'] > 0
    assert 'eaglex_tau{model="eaglex"}' in m


@needs_triton
@pytest.mark.parametrize("body", [
    {"text_input": "hello world", "max_tokens": 120},
    {"text_input": "eagle speculative decoding", "max_tokens": 60, "temperature": 1.0, "seed": 5},
])
def test_stream_chunks_join_to_the_full_output(server, body):
    status, whole = post(server, "generate", body)
    assert status == 200, whole
    status, events = post(server, "generate_stream", {**body, "stream": True})
    assert status == 200 and events, events
    *chunks, final = events
    assert "tau" in final and "output_ids" not in final                 # the final response: statistics
    assert len(chunks) == final["cycles"] + 1 == whole["cycles"] + 1     # the prefill's token, then each cycle
    assert [i for c in chunks for i in ids_of(c["output_ids"])] == ids_of(whole["output_ids"])
    assert "".join(c["text_output"] for c in events) == whole["text_output"]
    assert final["tau"] == pytest.approx(whole["tau"])


BAD_INPUTS = [
    # (body, status, part of the message)
    ({"text_input": "", "max_tokens": 5}, 400, "prompt is empty"),
    ({"input_ids": [], "max_tokens": 5}, 400, "prompt is empty"),
    ({"max_tokens": 5}, 400, "no prompt"),
    ({"text_input": "hi", "max_tokens": 0}, 400, "max_tokens must be >= 1"),
    ({"text_input": "hi", "max_tokens": -3}, 400, "max_tokens must be >= 1"),
    ({"text_input": "hi", "max_tokens": 511}, 400, "beyond the context"),
    ({"text_input": "hi", "temprature": 0.5}, 400, "unknown parameter 'temprature'"),
    ({"text_input": "hi", "parameters": {"foo": 1}}, 400, "unknown parameter 'foo'"),
    ({"text_input": "hi", "top_p": 1.5}, 400, "top_p"),
    ({"text_input": "hi", "beam_width": 2}, 400, "beam_width"),
    ({"text_input": ["one", "two"]}, 400, "batch-size"),              # Triton's own shape check
    ({"input_ids": [1, 99]}, 400, "input_ids must lie in"),
    ({"text_input": "a" * 600}, 400, "context holds 512"),             # oversized: more tokens than the context
    ({"text_input": "a" * 70000}, 400, "at most 65536"),               # oversized: refused before tokenizing
]


@needs_triton
@pytest.mark.parametrize("endpoint", ["generate", "generate_stream"])
def test_bad_inputs_get_4xx_and_the_server_stays_ready(server, endpoint):
    for body, code, message in BAD_INPUTS:
        status, out = post(server, endpoint, body)
        err = out[0]["error"] if isinstance(out, list) else out["error"]
        assert status == code and message in err, (body, status, out)
        assert server.ready()
    # A JSON value of the wrong type for a declared input: the front refuses it (Triton 2.51 itself answers 500)
    for body, message in (({"text_input": "hi", "max_tokens": "ten"}, "max_tokens must be an integer"),
                          ({"text_input": "hi", "temperature": "hot"}, "temperature must be a finite number"),
                          ({"text_input": 5}, "text_input must be a string")):
        status, out = post(server, endpoint, body)
        assert status == 400 and message in out["error"], out
        assert server.ready()
    status, out = post(server, endpoint, {"text_input": "hi", "max_tokens": 4})
    assert status == 200


@needs_triton
def test_chat_template_per_request(server, reference):
    """The served model's default is raw text; `chat_template: true` (a generate-extension key, or a gRPC request
    parameter as TensorRT-LLM clients send them) wraps text_input with the tokenizer's chat template."""
    import tritonclient.grpc as grpcclient

    run_vanilla, _ = reference
    chat = run_vanilla("user: hello assistant:", 16)
    status, out = post(server, "generate", {"text_input": "hello", "max_tokens": 16, "chat_template": True})
    assert status == 200 and ids_of(out["output_ids"]) == chat, out
    status, out = post(server, "generate", {"text_input": "hello", "max_tokens": 16})
    assert status == 200 and ids_of(out["output_ids"]) == run_vanilla("hello", 16) != chat
    status, out = post(server, "generate", {"text_input": "hello", "chat_template": "yes"})
    assert status == 400 and "chat_template must be true or false" in out["error"], out

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    got: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    try:
        inputs = [grpcclient.InferInput("text_input", [1, 1], "BYTES"),
                  grpcclient.InferInput("max_tokens", [1, 1], "INT32")]
        inputs[0].set_data_from_numpy(np.array([["hello"]], dtype=object))
        inputs[1].set_data_from_numpy(np.array([[16]], np.int32))
        client.async_stream_infer("eaglex", inputs, parameters={"chat_template": True})
        result, err = got.get(timeout=60)
        assert err is None and result.as_numpy("output_ids").reshape(-1).tolist() == chat
    finally:
        client.stop_stream()
        client.close()


@needs_triton
def test_wrong_types_through_the_tensor_api_are_invalid_argument(server):
    """gRPC (what TensorRT-LLM's clients use): tensors of the wrong type get INVALID_ARGUMENT from Triton, value
    errors get the model's own message; the stream keeps working."""
    import tritonclient.grpc as grpcclient

    def tensor(name, value, dtype):
        t = grpcclient.InferInput(name, list(value.shape), dtype)
        t.set_data_from_numpy(value)
        return t

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        prompt = tensor("text_input", np.array([["hello"]], dtype=object), "BYTES")
        client.async_stream_infer("eaglex", [prompt, tensor("max_tokens", np.array([[5.0]], np.float32), "FP32")])
        _, err = results.get(timeout=30)
        assert err is not None and "expects 'INT32'" in err.message()
        client.async_stream_infer("eaglex", [prompt, tensor("max_tokens", np.array([[0]], np.int32), "INT32")])
        _, err = results.get(timeout=30)
        assert err is not None and "max_tokens must be >= 1" in err.message()
        client.async_stream_infer("eaglex", [prompt, tensor("max_tokens", np.array([[4]], np.int32), "INT32")])
        result, err = results.get(timeout=30)
        assert err is None and result.as_numpy("output_ids").size == 4
    finally:
        client.stop_stream()
        client.close()


@needs_triton
def test_cancelled_and_disconnected_clients_do_not_hurt_others(server, reference):
    import tritonclient.grpc as grpcclient

    run_vanilla, _ = reference
    before = metrics(server).get('eaglex_requests_total{model="eaglex",outcome="cancelled"}', 0)
    long_stream = {"text_input": "hello", "max_tokens": 500, "stream": True, "temperature": 1.0, "seed": 1}

    # an HTTP client that reads the first chunk of a long stream and hangs up
    body = json.dumps(long_stream).encode()
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as s:
        s.sendall(b"POST /v2/models/eaglex/generate_stream HTTP/1.1\r\nHost: localhost\r\n"
                  b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        got = b""
        while b"data:" not in got:          # headers and the first event may arrive in separate segments
            chunk = s.recv(4096)
            assert chunk, f"connection closed before the first event: {got!r}"
            got += chunk
    # a gRPC client that cancels its stream after the first response
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    first: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: first.put((result, error)))
    inputs = []
    for name, value, dtype in (("text_input", np.array([["draft"]], dtype=object), "BYTES"),
                               ("max_tokens", np.array([[500]], np.int32), "INT32"),
                               ("temperature", np.array([[1.0]], np.float32), "FP32"),
                               ("stream", np.array([[True]]), "BOOL")):
        inputs.append(grpcclient.InferInput(name, [1, 1], dtype))
        inputs[-1].set_data_from_numpy(value)
    client.async_stream_infer("eaglex", inputs)
    assert first.get(timeout=30)[1] is None
    client.stop_stream(cancel_requests=True)
    client.close()

    # meanwhile and afterwards, other requests are served correctly
    status, out = post(server, "generate", {"text_input": "triton server", "max_tokens": 40})
    assert status == 200 and ids_of(out["output_ids"]) == run_vanilla("triton server", 40)
    deadline = time.monotonic() + 30
    while metrics(server).get('eaglex_requests_total{model="eaglex",outcome="cancelled"}', 0) < before + 2:
        assert time.monotonic() < deadline, "the cancelled requests were not stopped"
        time.sleep(0.2)
    assert server.ready()
