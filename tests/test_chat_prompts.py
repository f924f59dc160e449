"""The built-in chat instruction set: deterministic, diverse, and split without leaks."""
import subprocess
import sys

from eaglex.base import chat_prompts


def test_split_is_disjoint_and_sized():
    train, held = chat_prompts.train_prompts(), chat_prompts.heldout_prompts()
    assert 300 <= len(train) + len(held) <= 1000
    assert len(held) >= 32 and len(train) >= 8 * len(held)
    assert len(set(train)) == len(train) and len(set(held)) == len(held)
    assert not set(train) & set(held)


def test_no_template_topic_pair_is_shared():
    pairs = {tpl.format(t=topic): (tpl, topic) for _, tpl, topic in chat_prompts._pairs()}
    train = {pairs[p] for p in chat_prompts.train_prompts()}
    held = {pairs[p] for p in chat_prompts.heldout_prompts()}
    assert not train & held


def test_every_category_in_both_halves():
    cat = {tpl.format(t=topic): c for c, tpl, topic in chat_prompts._pairs()}
    for part in (chat_prompts.train_prompts(), chat_prompts.heldout_prompts()):
        assert {cat[p] for p in part} >= set(chat_prompts.CATEGORIES)


def test_deterministic_across_processes():
    code = "from eaglex.base import chat_prompts as c; print(hash(tuple(c.train_prompts() + c.heldout_prompts())))"
    env = {"PYTHONHASHSEED": "0"}
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**__import__("os").environ, **env}).stdout for _ in range(2)}
    assert len(runs) == 1
    mine = chat_prompts.train_prompts()
    assert mine == chat_prompts.train_prompts() and mine is not chat_prompts.train_prompts()


def _chat_tokenizer(template=True):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = ["<unk>", "<|user|>", "<|assistant|>", "<|end|>", "hello", "world", "write", "a", "poem", "\n"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|end|>",
                                   additional_special_tokens=["<|user|>", "<|assistant|>"])
    if template:
        fast.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
                              "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    return fast


def test_chat_encoding_returns_token_ids(tmp_path):
    import pytest

    from eaglex.base.errors import ModelError
    from eaglex.base.prompts import encode, read_prompts
    tok = _chat_tokenizer()
    ids = encode({"prompt": "write a poem"}, tok, True, "x")
    assert ids == [1, 6, 7, 8, 3, 2] and all(type(i) is int for i in ids)
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hello world"}\n{"input_ids": [4, 5]}\n')
    assert read_prompts(f, tok, chat=True) == [[1, 4, 5, 3, 2], [4, 5]]
    assert read_prompts(f, tok, chat=False) == [[4, 5], [4, 5]]
    with pytest.raises(ModelError, match="chat template"):
        encode({"prompt": "hello"}, _chat_tokenizer(template=False), True, "x")


def test_honest_prompts_cover_the_categories_and_share_nothing_with_the_built_in_set():
    """The hand-written held-out set: 32-48 conversations ending with a user turn, every category present, and no
    user turn near (word 3-gram Jaccard >= 0.5) any built-in instruction, held out or not, nor near another."""
    from collections import Counter

    from eaglex.base import chat_prompts, honest_prompts
    from eaglex.training.textfilter import Deduper

    items = honest_prompts.honest_prompts()
    assert 32 <= len(items) <= 48
    cats = Counter(c for c, _ in items)
    assert set(cats) == {"coding", "code-explain", "explanation", "advice", "writing", "math", "long", "multi-turn",
                         "non-english"} and min(cats.values()) >= 4
    assert all(m[-1]["role"] == "user" and [x["role"] for x in m] == ["user", "assistant"] * (len(m) // 2) + ["user"]
               for _, m in items)
    assert any(len(m[0]["content"]) > 600 for c, m in items if c == "long")
    d = Deduper(threshold=0.5)
    d.reserve(chat_prompts.train_prompts() + chat_prompts.heldout_prompts())
    assert all(d.add(t) for t in honest_prompts.user_texts())


def test_tuning_prompts_cover_the_bench_categories_from_the_start_and_are_kept_from_training():
    """The tuning set: the five categories the bench measures first, all of them among its first five prompts (tuning
    measures the whole ladder on its first few); its user turns are among those training must stay away from (and the
    test above keeps them from the held-out set and the built-in one)."""
    from eaglex.base import honest_prompts

    items = honest_prompts.tuning_prompts()
    bench = {"coding", "code-explain", "explanation", "advice", "writing"}
    assert len(items) >= 8 and {c for c, _ in items} == bench == {c for c, _ in items[:5]}
    assert all(m[-1]["content"] in honest_prompts.user_texts() for _, m in items)
