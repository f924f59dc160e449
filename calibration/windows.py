"""Calibration and evaluation text for `eaglex calibrate`, as fixed-length token windows.

Sources (`--data`):
- `auto` (the default): `builtin-chat` when the target's tokenizer has a chat template (a chat model), else
  `builtin`. FP8 activation scales are maxima over what the calibration text makes the model compute, so a chat
  model is calibrated on chat-formatted instructions, not on source code.
- `builtin-chat`: the seeded chat instructions of eaglex.base.chat_prompts (training part for calibration, held-out part
  for the quality report), each formatted with the tokenizer's chat template (user turn + generation prompt); plain
  text when the tokenizer has no template.
- `builtin`: Python standard-library sources of the running interpreter, the files held out from the embedded
  default's training corpus (same path-hash rule as training/corpus.py). Files alternate between calibration and
  evaluation, so the quality report never scores text the scales were fitted on.
- `hf:NAME[:SPLIT]`: a Hugging Face dataset, streamed with the `datasets` library where the hub is reachable.
  Records with `messages`/`conversations` (lists of {role, content}) are formatted with the chat template; records
  with `text`, `prompt`, `instruction` or `question` are taken as text. Every fifth record is held out.
- a JSONL file: {"prompt": "..."} (needs the target's tokenizer) or {"input_ids": [...]} per line, as for
  `eaglex generate --prompts`; the last fifth of the lines (at least one) is held out for evaluation.

Each part is joined into one token stream (EOS between plain documents when the model has one; chat-formatted
documents carry their own special tokens) and cut into non-overlapping windows of `seq_len` tokens; `samples` windows
are taken evenly spread over the stream, so a long document cannot crowd the others out. Deterministic: the same
inputs give the same windows.
"""
from __future__ import annotations

import hashlib
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from eaglex.base.errors import ModelError
from eaglex.base.prompts import has_chat_template, read_prompts

SOURCES = ("auto", "builtin-chat", "builtin")
HF_PREFIX = "hf:"
HOLDOUT_FRACTION = 5          # JSONL / datasets: one record in five is held out
MAX_BUILTIN_FILES = 400       # builtin: stop tokenizing once this many files are read
MAX_HF_RECORDS = 4096         # hf: records read from the stream at most
# The held-out split of the embedded default's corpus (training/corpus.py: CorpusConfig and EXCLUDED_DIRS). Repeated
# here so that calibration does not import training; tests/test_calibration_data.py pins that both agree.
HELDOUT_PER_MILLE = 50
MAX_FILE_BYTES = 400_000
EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__",
                           "pydoc_data", "encodings"})
INSTRUCTION_FIELDS = ("prompt", "instruction", "question")    # formatted as a user turn
TEXT_FIELDS = ("text",) + INSTRUCTION_FIELDS
CHAT_FIELDS = ("messages", "conversations", "conversation")


@dataclass(frozen=True)
class TextWindows:
    calibration: tuple[tuple[int, ...], ...]
    evaluation: tuple[tuple[int, ...], ...]
    source: str                            # what the windows came from, for the report

    @property
    def calibration_tokens(self) -> int:
        return sum(map(len, self.calibration))

    @property
    def evaluation_tokens(self) -> int:
        return sum(map(len, self.evaluation))


def resolve_source(data: str, tokenizer) -> str:
    """The concrete source `data` stands for: `auto` becomes builtin-chat for chat models, builtin otherwise."""
    if data == "auto":
        return "builtin-chat" if has_chat_template(tokenizer) else "builtin"
    return data


def load_windows(data: str, tokenizer, vocab_size: int, eos_id: int | None, samples: int, seq_len: int,
                 eval_samples: int, dataset_loader=None) -> TextWindows:
    """Windows from `data` (see the module docstring); token ids are checked against the target's vocabulary.
    `dataset_loader(name, split)` replaces `datasets.load_dataset` (tests)."""
    if samples < 1 or seq_len < 2 or eval_samples < 1:
        raise ModelError(f"--samples, --eval-samples must be >= 1 and --seq-len >= 2 (got {samples}, "
                         f"{eval_samples}, {seq_len})")
    source = resolve_source(data, tokenizer)
    separate = True                      # EOS between documents
    if source == "builtin":
        calib_docs, eval_docs, desc = _builtin(tokenizer, samples, eval_samples, seq_len)
    elif source == "builtin-chat":
        calib_docs, eval_docs, desc = _builtin_chat(tokenizer, samples, eval_samples, seq_len)
        separate = not has_chat_template(tokenizer)
    elif source.startswith(HF_PREFIX):
        calib_docs, eval_docs, desc = _hf_dataset(source[len(HF_PREFIX):], tokenizer, dataset_loader)
        separate = not has_chat_template(tokenizer)
    else:
        path = Path(source)
        if not path.is_file():
            raise ModelError(f"--data {data!r}: not a file; choose {', '.join(SOURCES)}, hf:NAME[:SPLIT] (a Hugging "
                             "Face dataset) or a JSONL file")
        calib_docs, eval_docs, desc = _jsonl(path, tokenizer)
    if data == "auto":
        desc = f"auto -> {desc}"
    for docs in (calib_docs, eval_docs):
        for ids in docs:
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ModelError(f"calibration data ({desc}) holds token id {bad[0]} outside the target's "
                                 f"vocabulary [0, {vocab_size})")
    sep = eos_id if separate else None
    calib = _windows(calib_docs, sep, seq_len, samples)
    evaluation = _windows(eval_docs, sep, seq_len, eval_samples)
    if not calib or not evaluation:
        raise ModelError(f"calibration data ({desc}) is too short: it needs at least 2 tokens for calibration "
                         "and 2 for evaluation")
    return TextWindows(tuple(calib), tuple(evaluation), desc)


def _windows(docs: list[list[int]], eos_id: int | None, seq_len: int, count: int) -> list[tuple[int, ...]]:
    stream: list[int] = []
    for ids in docs:
        if stream and eos_id is not None:
            stream.append(eos_id)
        stream.extend(ids)
    if len(stream) < 2:
        return []
    n = max(1, len(stream) // seq_len)
    if n == 1:                                        # shorter than one window: the whole stream is the window
        return [tuple(stream[:seq_len])]
    k = min(count, n)
    picks = sorted({round(i * (n - 1) / max(k - 1, 1)) for i in range(k)})
    return [tuple(stream[i * seq_len:(i + 1) * seq_len]) for i in picks]


# ------------------------------------------------------------------------------------------------------ chat

def chat_ids(tokenizer, messages: list[dict], generation_prompt: bool) -> list[int]:
    """Token ids of `messages` through the tokenizer's chat template (transformers 4 returns a list, 5 a mapping)."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    return [int(t) for t in out]


def _encode_instruction(tokenizer, text: str) -> list[int]:
    if has_chat_template(tokenizer):
        return chat_ids(tokenizer, [{"role": "user", "content": text}], generation_prompt=True)
    return list(tokenizer(text)["input_ids"])


def _builtin_chat(tokenizer, samples: int, eval_samples: int, seq_len: int):
    from eaglex.base import chat_prompts

    if tokenizer is None:
        raise ModelError("--data builtin-chat is text and needs a tokenizer in the target folder; give --data "
                         'FILE.jsonl with {"input_ids": [...]} lines instead')
    train, held = chat_prompts.train_prompts(), chat_prompts.heldout_prompts()
    calib = _take(train, lambda t: _encode_instruction(tokenizer, t), samples * seq_len)
    evaluation = _take(held, lambda t: _encode_instruction(tokenizer, t), eval_samples * seq_len)
    how = "chat template applied" if has_chat_template(tokenizer) else "no chat template: plain text"
    return calib, evaluation, (f"builtin-chat: {len(calib)} of {len(train)} chat instructions for calibration, "
                               f"{len(evaluation)} of {len(held)} held out ({how})")


def _take(texts, encode, tokens_needed: int) -> list[list[int]]:
    """Encode texts in order until `tokens_needed` tokens are collected (all of them if they fall short)."""
    out, got = [], 0
    for t in texts:
        if got >= tokens_needed:
            break
        ids = encode(t)
        out.append(ids)
        got += len(ids)
    return out


# ---------------------------------------------------------------------------------------------- hf datasets

def record_messages(record: dict) -> list[dict] | None:
    """A record's conversation as [{role, content}], when it has one (messages / conversations; ShareGPT's
    from/value spelling is accepted)."""
    for key in CHAT_FIELDS:
        conv = record.get(key)
        if isinstance(conv, list) and conv and all(isinstance(m, dict) for m in conv):
            roles = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                     "system": "system"}
            out = []
            for m in conv:
                role = roles.get(str(m.get("role", m.get("from", ""))).lower())
                content = m.get("content", m.get("value"))
                if role is None or not isinstance(content, str):
                    return None
                out.append({"role": role, "content": content})
            return out
    return None


def record_text(record: dict) -> tuple[str, bool] | None:
    """(text, is_instruction) of a record without a conversation: `text` is plain text, the other fields are
    instructions (formatted as a user turn when the tokenizer has a chat template)."""
    for key in TEXT_FIELDS:
        if isinstance(record.get(key), str) and record[key].strip():
            return record[key], key in INSTRUCTION_FIELDS
    return None


def _hf_dataset(spec: str, tokenizer, dataset_loader=None):
    if tokenizer is None:
        raise ModelError("--data hf:... is text and needs a tokenizer in the target folder")
    name, _, split = spec.partition(":")
    split = split or "train"
    if not name:
        raise ModelError("--data hf:NAME[:SPLIT] needs a dataset name, e.g. hf:HuggingFaceH4/ultrachat_200k:train_sft")
    if dataset_loader is None:
        try:
            from datasets import load_dataset
        except ImportError:
            raise ModelError("--data hf:... needs the `datasets` package: pip install datasets") from None

        def dataset_loader(n, s):
            return load_dataset(n, split=s, streaming=True)
    try:
        records = dataset_loader(name, split)
        docs = []
        for i, rec in enumerate(records):
            if i >= MAX_HF_RECORDS:
                break
            msgs = record_messages(rec)
            if msgs is not None and has_chat_template(tokenizer):
                docs.append(chat_ids(tokenizer, msgs, generation_prompt=False))
            elif msgs is not None:
                docs.append(list(tokenizer("\n".join(m["content"] for m in msgs))["input_ids"]))
            elif (found := record_text(rec)) is not None:
                text, instruction = found
                docs.append(_encode_instruction(tokenizer, text) if instruction else
                            list(tokenizer(text)["input_ids"]))
    except ModelError:
        raise
    except Exception as e:  # noqa: BLE001 - network, auth, missing dataset or split: said in one line
        raise ModelError(f"cannot read the Hugging Face dataset {name} (split {split}): {type(e).__name__}: "
                         f"{(str(e).splitlines() or [''])[0][:200]}; give a JSONL file instead when the hub is "
                         "unreachable") from None
    if len(docs) < 2:
        raise ModelError(f"dataset {name} (split {split}) gave {len(docs)} usable record(s); it needs at least 2 with "
                         f"one of the fields {', '.join(CHAT_FIELDS + TEXT_FIELDS)}")
    held = [d for i, d in enumerate(docs) if i % HOLDOUT_FRACTION == HOLDOUT_FRACTION - 1]
    calib = [d for i, d in enumerate(docs) if i % HOLDOUT_FRACTION != HOLDOUT_FRACTION - 1]
    if not held:
        held, calib = calib[-1:], calib[:-1]
    return calib, held, f"hf:{name}:{split} ({len(calib)} records calibration, {len(held)} held out)"


# ---------------------------------------------------------------------------------------------------- jsonl

def _jsonl(path: Path, tokenizer) -> tuple[list[list[int]], list[list[int]], str]:
    docs = read_prompts(path, tokenizer)
    if len(docs) < 2:
        raise ModelError(f"{path} holds {len(docs)} line(s); calibration needs at least 2 (one is held out for "
                         "the quality report)")
    held = max(1, len(docs) // HOLDOUT_FRACTION)
    return docs[:-held], docs[-held:], f"{path} ({len(docs) - held} lines calibration, {held} held out)"


# -------------------------------------------------------------------------------------------------- builtin

def _builtin(tokenizer, samples: int, eval_samples: int, seq_len: int):
    if tokenizer is None:
        raise ModelError("--data builtin is text and needs a tokenizer in the target folder; give --data FILE.jsonl "
                         'with {"input_ids": [...]} lines instead')
    texts, source = builtin_texts()
    # Alternate files between the two parts, tokenizing only as many as the windows need.
    need = {0: samples * seq_len, 1: eval_samples * seq_len}
    got = {0: 0, 1: 0}
    docs: dict[int, list[list[int]]] = {0: [], 1: []}
    for i, text in enumerate(texts):
        part = i % 2
        if got[part] >= need[part]:
            if all(got[p] >= need[p] for p in got):
                break
            continue
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        docs[part].append(ids)
        got[part] += len(ids)
    return docs[0], docs[1], source


def is_heldout(path: str, per_mille: int = HELDOUT_PER_MILLE) -> bool:
    """The corpus split rule: by a hash of the relative path alone, the same on every machine."""
    h = int.from_bytes(hashlib.sha256(path.encode()).digest()[:8], "big")
    return h % 1000 < per_mille


def heldout_files(root: Path | None = None) -> list[str]:
    """Sorted relative paths of the held-out stdlib files (those the embedded default never trained on)."""
    root = Path(root) if root else Path(sysconfig.get_paths()["stdlib"])
    out = []
    for f in root.rglob("*.py"):
        rel = f.relative_to(root)
        if EXCLUDED_DIRS.intersection(rel.parts[:-1]) or not f.is_file() or f.stat().st_size > MAX_FILE_BYTES:
            continue
        if is_heldout(rel.as_posix()):
            out.append(rel.as_posix())
    return sorted(out)


def builtin_texts() -> tuple[list[str], str]:
    """Texts of the held-out files, in a fixed shuffled order (one seed), so that a prefix of the list is spread over
    the whole library rather than its first directory."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts, h = [], hashlib.sha256()
    for rel in heldout_files(root):
        try:
            text = (root / rel).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts.append(text)
        h.update(rel.encode() + b"\0" + text.encode() + b"\0")
    source = f"builtin: held-out corpus of the embedded default ({len(texts)} stdlib files, " \
             f"fingerprint {h.hexdigest()[:12]})"
    order = list(range(len(texts)))
    random.Random(0).shuffle(order)
    return [texts[i] for i in order[:MAX_BUILTIN_FILES]], source
