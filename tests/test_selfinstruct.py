"""Self-instruct data (training/selfinstruct.py, training/textfilter.py): the filters and the deduplication as
tables, the pre-query prefix of several chat templates, and generation with a fixture target: seeded, resumable
from its store (a cut-short last line included), nothing near a reserved prompt kept."""
from __future__ import annotations

import json

import pytest
import torch

from eaglex.training.selfinstruct import (
    SENTINEL,
    SelfInstructConfig,
    Store,
    encode_conversations,
    query_prefix,
    self_instruct,
    stop_ids,
)
from eaglex.training.textfilter import (
    Deduper,
    FilterConfig,
    dup_trigram_share,
    jaccard,
    longest_word_run,
    normalize,
    rejection,
    script_share,
    shingles,
    words,
)

# ------------------------------------------------------------------------------------------------ filters


@pytest.mark.parametrize("text, why", [
    ("Write a poem about the sea.", None),
    ("  Can you explain how vaccines train the immune system?  ", None),
    ("Peux-tu m'expliquer la différence entre le climat et la météo ?", None),   # Latin script, not English
    ("hi", "short"),
    ("Hello there", "short"),                         # 2 words
    ("a" * 30, "short"),                              # one word
    ("word " * 500, "long"),
    ("请解释一下光合作用的原理和过程是什么", "script"),
    ("Привет, как дела у тебя сегодня утром?", "script"),
    ("Your ENTIRE ENTIRE ENTIRE plan will include tasks", "repetitive"),
    ("tell me more tell me more tell me more tell me more about it", "repetitive"),
    ("Write code. Write code. Write code. Write code.", "repetitive"),
])
def test_rejection_table(text, why):
    assert rejection(text, FilterConfig()) == why


def test_filter_config_is_honoured():
    cfg = FilterConfig(scripts=("LATIN", "CYRILLIC"), min_words=1, min_chars=2, max_chars=20)
    assert rejection("Привет, как дела?", cfg) is None
    assert rejection("hi!", cfg) is None
    assert rejection("x" * 21, cfg) == "long"


@pytest.mark.parametrize("fn, arg, want", [
    (words, "Don't STOP, me-now!", ["don", "t", "stop", "me", "now"]),
    (normalize, "  Hello,   WORLD!! ", "hello world"),
    (script_share, "abc", 1.0),
    (script_share, "12 + 3", 1.0),
    (script_share, "ab中文", 0.5),
    (dup_trigram_share, ["a", "b", "c", "a", "b", "c"], 0.25),
    (dup_trigram_share, ["a", "b", "c"], 0.0),
    (longest_word_run, ["a", "a", "b", "b", "b", "a"], 3),
    (longest_word_run, [], 0),
    (shingles, "one two", frozenset(["one two"])),
    (shingles, "One two, three four", frozenset(["one two three", "two three four"])),
])
def test_text_helpers(fn, arg, want):
    assert fn(arg) == want


def test_jaccard():
    assert jaccard(frozenset("ab"), frozenset("bc")) == pytest.approx(1 / 3)
    assert jaccard(frozenset(), frozenset()) == 1.0


# ------------------------------------------------------------------------------------------------ dedup

BASE = "Can you provide a comprehensive guide on how to properly use a solarium at home this winter?"


@pytest.mark.parametrize("later, kept", [
    (BASE, False),                                                                      # exact
    ("can you provide a COMPREHENSIVE guide on how to properly use a solarium at home, this winter", False),
    ("Can you provide a comprehensive guide on how to properly use a sauna at home this winter?", False),  # near
    ("Can you provide a comprehensive guide on how to train a puppy to sit and stay?", True),   # shares a start
    ("What is the capital of Australia and why is it not Sydney?", True),
])
def test_dedup_table(later, kept):
    d = Deduper(threshold=0.6)
    assert d.add(BASE)
    assert d.add(later) is kept


def test_dedup_finds_near_duplicates_among_many_and_is_seeded():
    rng = torch.Generator().manual_seed(0)
    vocab = [f"w{i}" for i in range(400)]
    texts = [" ".join(vocab[j] for j in torch.randint(0, 400, (14,), generator=rng).tolist()) for _ in range(300)]
    d = Deduper(threshold=0.6)
    assert all(d.add(t) for t in texts)                     # random texts: nothing in common
    for t in texts[:50]:
        ws = t.split()
        assert not d.add(" ".join(ws[:-1] + ["changed"]))    # one word of 14 changed: Jaccard 11/13
    assert [Deduper(seed=3)._signature(shingles(BASE)).tolist()] == [Deduper(seed=3)._signature(
        shingles(BASE)).tolist()]


def test_reserved_texts_are_never_kept_nor_anything_near_them():
    d = Deduper(threshold=0.6)
    d.reserve(["Solve for x: 3(x - 4) + 7 = 2x + 5", BASE])
    assert not d.add("Solve for x: 3(x - 4) + 7 = 2x + 5")
    assert not d.add("solve for x 3 x 4 7 2x 5")
    assert not d.add(BASE.replace("winter", "summer"))
    assert d.add("Solve for y: 5y - 2 = 13, and check the answer by substitution.")


# ------------------------------------------------------------------------------------------------ templates

CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
          "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
          "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
GEMMA = ("{{ bos_token }}{% for message in messages %}{% set role = 'model' if message['role'] == 'assistant' "
         "else message['role'] %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + "
         "'<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")
SPECIAL = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
           "<|eot_id|>", "<bos>", "<start_of_turn>", "<end_of_turn>", "</s>"]


def _tokenizer(template: str, bos: str | None = None):
    """A character-level tokenizer with the templates' special tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n", "é"]
    vocab = {c: i for i, c in enumerate(["<unk>"] + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>",
                                   bos_token=bos, additional_special_tokens=[s for s in SPECIAL if s != "</s>"])
    fast.chat_template = template
    return fast


@pytest.mark.parametrize("template, bos, prefix, end_token", [
    (CHATML, None, "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                   "<|im_end|>\n<|im_start|>user\n", "<|im_end|>"),
    (LLAMA3, "<|begin_of_text|>", "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n", "<|eot_id|>"),
    (GEMMA, "<bos>", "<bos><start_of_turn>user\n", "<end_of_turn>"),                 # no system block at all
])
def test_query_prefix_from_the_chat_template(template, bos, prefix, end_token):
    tok = _tokenizer(template, bos)
    assert query_prefix(tok) == prefix
    stops = stop_ids(tok)
    assert tok.convert_tokens_to_ids(end_token) in stops and tok.eos_token_id in stops
    assert tok.convert_tokens_to_ids("\n") not in stops                    # text after the turn's end is not a stop
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    two = query_prefix(tok, history)
    full = tok.apply_chat_template(history + [{"role": "user", "content": "Next?"}], tokenize=False)
    assert full.startswith(two) and full[len(two):].startswith("Next?") and SENTINEL not in two


def test_query_prefix_needs_a_template_that_shows_the_message():
    from eaglex.base.errors import ModelError
    with pytest.raises(ModelError, match="chat template"):
        query_prefix(_tokenizer(None))
    with pytest.raises(ModelError, match="verbatim"):
        query_prefix(_tokenizer("{% for m in messages %}{{ m['content'] | upper }}{% endfor %}"))


# ------------------------------------------------------------------------------------------------ the store

def test_store_drops_a_cut_short_last_line_and_appends_after_it(tmp_path):
    path = tmp_path / "s.jsonl"
    s = Store(path)
    s.append({"phase": "first", "batch": 0, "texts": ["a"]})
    s.append({"phase": "first", "batch": 1, "texts": ["b"]})
    with open(path, "a") as f:
        f.write('{"phase": "first", "batch": 2, "te')                   # interrupted mid-write
    again = Store(path)
    assert [x["batch"] for x in again.done("first")] == [0, 1]
    again.append({"phase": "first", "batch": 2, "texts": ["c"]})
    assert [json.loads(x)["batch"] for x in path.read_text().splitlines()] == [0, 1, 2]


# ------------------------------------------------------------------------------------------------ generation

def _fixture(models):
    """The fixture target with a character tokenizer in ChatML, whose end-of-turn token is the model's EOS id
    (the fixture's vocabulary has 48 ids)."""
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers import models as tmodels
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    model = AutoModelForCausalLM.from_pretrained(models["llama"], dtype=torch.float32).eval()
    eos = model.config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    chars = iter("abcdefghijklmnopqrstuvwxyz .,?!\n'-ABCDEFGHIJKLM")
    vocab, specials = {}, {eos: "<|im_end|>", (eos + 1) % 48: "<|im_start|>"}
    for i in range(48):
        vocab[specials.get(i) or next(chars)] = i
    tok = Tokenizer(tmodels.WordLevel(vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("<\\|im_(start|end)\\|>|."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHATML.replace("You are a helpful AI assistant named SmolLM, trained by Hugging Face",
                                        "be kind")
    return model, fast


LOOSE = FilterConfig(min_chars=1, min_words=1, max_dup_trigram_share=1.0, max_word_run=10**6)


def test_generation_is_seeded_resumable_and_keeps_reserved_prompts_out(models, tmp_path):
    model, tok = _fixture(models)
    cfg = SelfInstructConfig(count=10, batch=8, follow_up_fraction=1.0, temperature=4.0, max_instruction_tokens=40,
                             max_answer_tokens=40, filters=LOOSE, near_duplicate=0.99, max_batches_per_kept=2.0)
    full, stats = self_instruct(model, tok, cfg, store=tmp_path / "a.jsonl", progress=False)
    assert stats["kept"] == len([c for c in full if len(c) == 1]) == 10 and stats["two_turn"] >= 1
    assert stats["sampled"] >= stats["kept"] + stats["unfinished"] + stats["duplicates"]
    assert all(c[-1]["role"] == "user" for c in full)
    assert all(len(c) == 3 and c[1]["role"] == "assistant" for c in full if len(c) > 1)
    texts = [c[-1]["content"] for c in full]
    assert len(set(texts)) == len(texts)

    # the same seed gives the same data; an interrupted run resumes to the same data
    again, _ = self_instruct(model, tok, cfg, store=None, progress=False)
    assert again == full
    lines = (tmp_path / "a.jsonl").read_text().splitlines()
    assert len(lines) >= 2
    (tmp_path / "b.jsonl").write_text("\n".join(lines[:1]) + "\n" + lines[1][:7])
    resumed, rstats = self_instruct(model, tok, cfg, store=tmp_path / "b.jsonl", progress=False)
    assert resumed == full and (tmp_path / "b.jsonl").read_text().splitlines() == lines

    # a reserved prompt is never kept: reserve the first kept one and it is gone
    first = full[0][0]["content"]
    other, _ = self_instruct(model, tok, cfg, reserved=[first], progress=False)
    assert first not in [c[-1]["content"] for c in other]

    ids = encode_conversations(tok, full[:2])
    assert ids[0] == tok.apply_chat_template(full[0], add_generation_prompt=True, tokenize=True)["input_ids"]


def test_train_draft_on_self_instruct_data(models, tmp_path, monkeypatch):
    """`eaglex train-draft --data self-instruct:N`: the target writes N training instructions and 2 held-out ones,
    trains a head, reports τ on the held-out ones (identical to vanilla); a bad N is one line."""
    import functools
    import shutil

    from eaglex.base.errors import ModelError
    from eaglex.cli import main
    from eaglex.runtime.types import TreeConfig
    from eaglex.training import train_draft as td
    from eaglex.training.selfdistill import SelfDistillConfig

    target = tmp_path / "target"
    shutil.copytree(models["llama"], target)
    _fixture(models)[1].save_pretrained(str(target))
    si = SelfInstructConfig(batch=8, follow_up_fraction=1.0, temperature=4.0, max_instruction_tokens=40,
                            max_answer_tokens=40, filters=LOOSE, near_duplicate=0.99, max_batches_per_kept=2.0)
    small = functools.partial(td.TrainDraftConfig, eval_prompts=2, eval_new_tokens=8, self_instruct=si,
                              selfdistill=SelfDistillConfig(new_tokens=16))
    monkeypatch.setattr(td, "TrainDraftConfig", small)
    monkeypatch.setattr(td, "SHAPES", {"chain": TreeConfig.chain(3)})
    out = tmp_path / "head"
    assert main(["train-draft", "--target", str(target), "--data", "self-instruct:6", "--out", str(out),
                 "--method", "eagle1", "--steps", "2"]) == 0
    report = json.loads((out / "train_report.json").read_text())
    assert report["tau"][0]["identical"] == report["tau"][0]["prompts"] == 2
    made = json.loads((out / "checkpoints" / "self_instruct.json").read_text())
    assert made["stats"]["kept"] == 8 and (out / "checkpoints" / "self_instruct.jsonl").is_file()
    assert report["train_sequences"] == 6 + made["stats"]["two_turn"]
    for bad in ("self-instruct:0", "self-instruct:x"):
        with pytest.raises(ModelError, match="self-instruct:N"):
            td.self_instruct_count(bad)
