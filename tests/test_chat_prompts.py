"""The built-in chat instruction set: deterministic, diverse, and split without leaks."""
import subprocess
import sys

from eaglex import chat_prompts


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
    code = "from eaglex import chat_prompts as c; print(hash(tuple(c.train_prompts() + c.heldout_prompts())))"
    env = {"PYTHONHASHSEED": "0"}
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**__import__("os").environ, **env}).stdout for _ in range(2)}
    assert len(runs) == 1
    mine = chat_prompts.train_prompts()
    assert mine == chat_prompts.train_prompts() and mine is not chat_prompts.train_prompts()
