"""Chat instructions written by the target itself, without a dataset (the Magpie recipe, Xu et al. 2024): an
aligned chat model given only its chat template's text up to where a user message starts ("pre-query") writes a
user message from its own distribution. Sampled, filtered (training/textfilter.py), deduplicated against each other
and against reserved held-out prompts; a share of them gets a follow-up: the target answers the first instruction
greedily, then, given the conversation so far and the next user turn's pre-query text, writes the second.

The pre-query text is derived from the tokenizer's chat template, not written per model: the template is rendered
with a sentinel user message and cut at the sentinel.

Generation is batched (many rows per forward, KV cache, training/batchgen.py), seeded per batch (batch k draws from
seed and k only) and resumable: each finished batch is appended as one JSON line to a store file, and a rerun
replays the store through the same filters before generating the next batch.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eaglex.base.errors import ModelError
from eaglex.base.prompts import encode

from .batchgen import cut_at_stop, decode_batch
from .textfilter import Deduper, FilterConfig, rejection

SENTINEL = "EaglexQuery7f3a"   # mixed case: a template that changes case fails loudly


@dataclass(frozen=True)
class SelfInstructConfig:
    count: int = 1000                 # first-turn instructions to keep (after filtering and deduplication)
    follow_up_fraction: float = 0.25  # of them get an answer and a follow-up instruction (a second training prompt)
    temperature: float = 1.0          # Magpie samples at 1.0: the model's own distribution of requests
    max_instruction_tokens: int = 96  # an instruction not finished by then is dropped
    max_answer_tokens: int = 160      # first answers of two-turn conversations; unfinished ones are dropped
    batch: int = 64
    near_duplicate: float = 0.6       # word 3-gram Jaccard at or above which two instructions are one
    max_batches_per_kept: float = 0.2  # give up after count * this batches (a model that only repeats itself)
    filters: FilterConfig = field(default_factory=FilterConfig)
    seed: int = 0


# ------------------------------------------------------------------------------------------------ templates

def render(tokenizer, messages: list[dict], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def query_prefix(tokenizer, history: list[dict] = ()) -> str:
    """The chat template's text up to where the next user message's content starts, after `history` (system
    block and default system prompt included where the template adds them)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ModelError("self-instruct data needs a tokenizer with a chat template")
    text = render(tokenizer, [*history, {"role": "user", "content": SENTINEL}], False)
    if text.count(SENTINEL) != 1:
        raise ModelError("the chat template does not render a user message verbatim; cannot find where it starts")
    return text[:text.index(SENTINEL)]


def turn_end(tokenizer) -> str:
    """What the template writes right after a user message's content (e.g. '<|im_end|>\\n')."""
    text = render(tokenizer, [{"role": "user", "content": SENTINEL}], False)
    return text[text.index(SENTINEL) + len(SENTINEL):]


def stop_ids(tokenizer) -> frozenset[int]:
    """Tokens that end a user (or assistant) message: the special tokens the template writes after a message's
    content, and the tokenizer's end-of-sequence tokens."""
    special = set(tokenizer.all_special_ids)
    end = tokenizer(turn_end(tokenizer), add_special_tokens=False)["input_ids"]
    out = {i for i in end if i in special}
    if tokenizer.eos_token_id is not None:
        out.add(tokenizer.eos_token_id)
    return frozenset(out)


def encode_prefix(tokenizer, history: list[dict] = ()) -> list[int]:
    # the rendered text already holds the template's BOS where it has one
    return tokenizer(query_prefix(tokenizer, history), add_special_tokens=False)["input_ids"]


def decode_message(tokenizer, row: list[int], stops: frozenset[int]) -> tuple[str, bool]:
    """The text before the first stop token (whitespace stripped), and whether the message ended there."""
    ids, ended = cut_at_stop(row, stops)
    return tokenizer.decode(ids, skip_special_tokens=True).strip(), ended


# ------------------------------------------------------------------------------------------------ the store

class Store:
    """Append-only JSONL, one line per finished batch. A line cut short by an interruption is dropped on reading
    (and truncated away before the next append), so the resume point is the last complete line."""

    def __init__(self, path: str | Path | None):
        self.path = Path(path) if path else None
        self.lines: list[dict] = []
        if self.path and self.path.is_file():
            raw = self.path.read_bytes()
            good = 0
            for line in raw.split(b"\n"):
                if not line.endswith(b"}"):
                    break
                try:
                    self.lines.append(json.loads(line))
                except json.JSONDecodeError:
                    break
                good += len(line) + 1
            if good != len(raw):
                with open(self.path, "r+b") as f:
                    f.truncate(good)

    def done(self, phase: str) -> list[dict]:
        return [x for x in self.lines if x["phase"] == phase]

    def append(self, record: dict) -> None:
        self.lines.append(record)
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
                f.flush()
                os.fsync(f.fileno())


# ------------------------------------------------------------------------------------------------ generation

@dataclass
class Tally:
    """What happened to the sampled instructions."""
    sampled: int = 0
    unfinished: int = 0
    duplicate: int = 0
    rejected: dict[str, int] = field(default_factory=dict)

    def judge(self, text: str, ended: bool, dedup: Deduper, filters: FilterConfig) -> bool:
        self.sampled += 1
        if not ended:
            self.unfinished += 1
            return False
        why = rejection(text, filters)
        if why:
            self.rejected[why] = self.rejected.get(why, 0) + 1
            return False
        if not dedup.add(text):
            self.duplicate += 1
            return False
        return True


def _pad_id(model) -> int:
    return model.config.pad_token_id if model.config.pad_token_id is not None else 0


def _generator(model, seed: int, phase: int, k: int) -> torch.Generator:
    return torch.Generator(device=model.device).manual_seed(seed * 1_000_003 + phase * 100_003 + k)


def self_instruct(model, tokenizer, cfg: SelfInstructConfig = SelfInstructConfig(), reserved=(),
                  store: str | Path | None = None, progress: bool = True) -> tuple[list[list[dict]], dict]:
    """(conversations, stats). Each conversation is a list of messages ending with a user message: `cfg.count`
    single instructions (fewer if the model gives up, see max_batches_per_kept), then the two-turn ones. Nothing
    kept is a near duplicate of another or of a `reserved` text. `store`: the resumable JSONL file."""
    from tqdm import tqdm

    model.eval()
    st, stops, pad = Store(store), stop_ids(tokenizer), _pad_id(model)
    dedup = Deduper(cfg.near_duplicate, seed=cfg.seed)
    dedup.reserve(reserved)
    tally, kept = Tally(), []
    t0, made = time.perf_counter(), 0

    def take(texts, ended):
        for text, end in zip(texts, ended):
            if len(kept) < cfg.count and tally.judge(text, end, dedup, cfg.filters):
                kept.append(text)

    for rec in st.done("first"):
        take(rec["texts"], rec["ended"])
    prefix = encode_prefix(tokenizer)
    max_batches = max(1, round(cfg.count * cfg.max_batches_per_kept))
    bar = tqdm(total=cfg.count, initial=len(kept), desc="self-instruct", disable=not progress, mininterval=5.0)
    k = len(st.done("first"))
    while len(kept) < cfg.count and k < max_batches:
        rows = decode_batch(model, [prefix] * cfg.batch, [cfg.temperature] * cfg.batch, cfg.max_instruction_tokens,
                            pad, _generator(model, cfg.seed, 0, k), stops).tolist()
        texts, ended = zip(*(decode_message(tokenizer, r, stops) for r in rows))
        st.append({"phase": "first", "batch": k, "texts": list(texts), "ended": list(ended)})
        before = len(kept)
        take(texts, ended)
        made += cfg.batch
        bar.update(len(kept) - before)
        bar.set_postfix(per_min=f"{made / (time.perf_counter() - t0) * 60:.0f} sampled")
        k += 1
    bar.close()

    follow = _follow_ups(model, tokenizer, cfg, kept, st, dedup, tally, stops, pad, progress)
    convs = [[{"role": "user", "content": t}] for t in kept] + follow
    secs = time.perf_counter() - t0
    stats = {"kept": len(kept), "two_turn": len(follow), "sampled": tally.sampled, "unfinished": tally.unfinished,
             "duplicates": tally.duplicate, "rejected": tally.rejected, "batches": k,
             "seconds_this_run": round(secs, 1)}
    return convs, stats


def _follow_ups(model, tokenizer, cfg, kept, st, dedup, tally, stops, pad, progress) -> list[list[dict]]:
    """Two-turn conversations for the first `follow_up_fraction` of the kept instructions: the target's greedy
    answer (dropped when unfinished), then a sampled follow-up instruction, judged like the first ones."""
    from tqdm import tqdm

    chosen = kept[:round(len(kept) * cfg.follow_up_fraction)]
    batches = [chosen[i:i + cfg.batch] for i in range(0, len(chosen), cfg.batch)]
    done = {r["batch"]: r for r in st.done("follow-up")}
    out = []
    for k, firsts in enumerate(tqdm(batches, desc="self-instruct follow-ups", disable=not progress,
                                    mininterval=5.0)):
        rec = done.get(k)
        if rec is None or rec["firsts"] != firsts:
            asks = [tokenizer(render(tokenizer, [{"role": "user", "content": u}], True),
                              add_special_tokens=False)["input_ids"] for u in firsts]
            rows = decode_batch(model, asks, [0.0] * len(asks), cfg.max_answer_tokens, pad,
                                _generator(model, cfg.seed, 1, k), stops).tolist()
            answers = [decode_message(tokenizer, r, stops) for r in rows]
            convs = [[{"role": "user", "content": u}, {"role": "assistant", "content": a}]
                     for u, (a, end) in zip(firsts, answers) if end and a]
            texts, ended = [], []
            if convs:
                rows = decode_batch(model, [encode_prefix(tokenizer, c) for c in convs],
                                    [cfg.temperature] * len(convs), cfg.max_instruction_tokens, pad,
                                    _generator(model, cfg.seed, 2, k), stops).tolist()
                texts, ended = map(list, zip(*(decode_message(tokenizer, r, stops) for r in rows)))
            rec = {"phase": "follow-up", "batch": k, "firsts": firsts, "conversations": convs, "texts": texts,
                   "ended": ended}
            st.append(rec)
        for conv, text, end in zip(rec["conversations"], rec["texts"], rec["ended"]):
            if tally.judge(text, end, dedup, cfg.filters):
                out.append(conv + [{"role": "user", "content": text}])
    return out


def encode_conversations(tokenizer, conversations: list[list[dict]]) -> list[list[int]]:
    """Each conversation in the chat template, ready for the assistant's answer (as eaglex.base.prompts encodes a
    prompt line)."""
    return [encode({"messages": c}, tokenizer, True, f"self-instruct conversation {i}")
            for i, c in enumerate(conversations)]
