"""Calibration text: chat models are calibrated on chat-formatted instructions by default (builtin-chat, from
eaglex.base.chat_prompts: training part for the scales, held-out part for the quality report), other models on the
held-out stdlib corpus; Hugging Face datasets and JSONL files are read the same way. A small fake tokenizer stands in
for a real one (its chat template marks turns with ids 1 and 2)."""
from __future__ import annotations

import importlib.util

import pytest

from eaglex.base import chat_prompts
from eaglex.base.errors import ModelError
from eaglex.calibration import windows

V = 1000


class FakeTokenizer:
    """Words -> ids by a stable hash; the chat template wraps a turn as [1, role, ...content..., 2]."""

    def __init__(self, chat: bool = True):
        self.chat_template = "{{ fake }}" if chat else None
        self.seen: list[str] = []

    def _ids(self, text: str) -> list[int]:
        self.seen.append(text)
        return [10 + sum(map(ord, w)) % (V - 10) for w in text.split()]

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": self._ids(text)}

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True):
        out = []
        for m in messages:
            out += [1, {"system": 3, "user": 4, "assistant": 5}[m["role"]]] + self._ids(m["content"]) + [2]
        if add_generation_prompt:
            out += [1, 5]
        return {"input_ids": out}           # transformers 5 returns a mapping


def test_auto_picks_chat_data_for_chat_models():
    assert windows.resolve_source("auto", FakeTokenizer(chat=True)) == "builtin-chat"
    assert windows.resolve_source("auto", FakeTokenizer(chat=False)) == "builtin"
    assert windows.resolve_source("auto", None) == "builtin"


def test_builtin_chat_windows_use_the_chat_template_and_keep_held_out_prompts_apart():
    tok = FakeTokenizer()
    w = windows.load_windows("auto", tok, V, eos_id=7, samples=6, seq_len=32, eval_samples=2)
    assert w.source.startswith("auto -> builtin-chat: ") and "chat template applied" in w.source
    train, held = set(chat_prompts.train_prompts()), set(chat_prompts.heldout_prompts())
    assert tok.seen and set(tok.seen) <= train | held
    calib_texts = [t for t in tok.seen if t in train]
    assert calib_texts == chat_prompts.train_prompts()[:len(calib_texts)]       # in the seeded order
    assert len(w.calibration) == 6 and all(len(x) == 32 for x in w.calibration) and len(w.evaluation) == 2
    stream = [t for x in w.calibration for t in x]
    assert stream.count(1) >= 2 * 6 and 7 not in stream       # turn markers, no EOS stitched between chat documents
    # the held-out windows are built only from held-out prompts
    held_ids = {i for t in held for i in FakeTokenizer()._ids(t)} | {1, 2, 4, 5}
    assert {t for x in w.evaluation for t in x} <= held_ids


def test_builtin_chat_without_a_template_is_plain_text():
    w = windows.load_windows("builtin-chat", FakeTokenizer(chat=False), V, eos_id=7, samples=2, seq_len=16,
                          eval_samples=1)
    assert "no chat template: plain text" in w.source and 7 in [t for x in w.calibration for t in x]
    with pytest.raises(ModelError, match="builtin-chat is text and needs a tokenizer"):
        windows.load_windows("builtin-chat", None, V, None, 2, 16, 1)


def test_hf_dataset_records():
    records = [{"messages": [{"role": "user", "content": f"question {i}"},
                             {"role": "assistant", "content": f"answer {i} " * 5}]} for i in range(8)]
    records += [{"conversations": [{"from": "human", "value": "hi there"}, {"from": "gpt", "value": "hello"}]},
                {"prompt": "write a poem"}, {"text": "plain text document here"}, {"unrelated": 1}]
    calls = []

    def loader(name, split):
        calls.append((name, split))
        return iter(records)

    tok = FakeTokenizer()
    w = windows.load_windows("hf:org/chat-set:train_sft", tok, V, eos_id=7, samples=4, seq_len=8, eval_samples=1,
                          dataset_loader=loader)
    assert calls == [("org/chat-set", "train_sft")]
    assert w.source == "hf:org/chat-set:train_sft (9 records calibration, 2 held out)"
    assert "answer 3" in " ".join(tok.seen) and "hello" in tok.seen and "write a poem" in tok.seen
    assert windows.record_messages({"conversations": [{"from": "robot", "value": "x"}]}) is None


def test_hf_dataset_errors():
    def offline(name, split):
        raise ConnectionError("hub unreachable\nsecond line")
    with pytest.raises(ModelError) as e:
        windows.load_windows("hf:org/x", FakeTokenizer(), V, None, 2, 8, 1, dataset_loader=offline)
    assert str(e.value) == ("cannot read the Hugging Face dataset org/x (split train): ConnectionError: hub unreachable; "
                            "give a JSONL file instead when the hub is unreachable")
    with pytest.raises(ModelError, match="gave 1 usable record"):
        windows.load_windows("hf:org/x", FakeTokenizer(), V, None, 2, 8, 1,
                          dataset_loader=lambda n, s: [{"text": "only one"}, {"nothing": 2}])
    if importlib.util.find_spec("datasets") is None:
        with pytest.raises(ModelError, match="needs the `datasets` package: pip install datasets"):
            windows.load_windows("hf:org/x", FakeTokenizer(), V, None, 2, 8, 1)


def test_unknown_source_and_jsonl(tmp_path):
    with pytest.raises(ModelError, match=r"--data 'nope.jsonl': not a file; choose auto, builtin-chat, builtin, "
                                         r"hf:NAME\[:SPLIT\]"):
        windows.load_windows("nope.jsonl", FakeTokenizer(), V, None, 2, 8, 1)
    f = tmp_path / "d.jsonl"
    f.write_text("".join(f'{{"input_ids": [{i}, {i + 1}, {i + 2}]}}\n' for i in range(10, 20)))
    w = windows.load_windows(str(f), None, V, 7, 4, 4, 1)
    assert w.source.endswith("(8 lines calibration, 2 held out)")


def test_builtin_corpus_split_matches_training():
    """calibration/windows.py repeats the held-out rule of training/corpus.py (calibration does not import training)."""
    from eaglex.training import corpus
    assert windows.HELDOUT_PER_MILLE == corpus.CorpusConfig().heldout_per_mille
    assert windows.MAX_FILE_BYTES == corpus.CorpusConfig().max_file_bytes
    assert windows.EXCLUDED_DIRS == corpus.EXCLUDED_DIRS
    assert windows.heldout_files() == [f.path for f in corpus.load(split="heldout")]
