"""Calibration and evaluation text for `eaglex calibrate`, as fixed-length token windows.

Sources:
- `builtin`: the held-out corpus of the embedded default model (eaglex.training.corpus, split "heldout": Python
  standard-library files the tiny model never trained on). Files alternate between calibration and evaluation, so
  the quality report never scores text the scales were fitted on. If the corpus module is missing, every stdlib
  source file of the running interpreter is used (sorted paths), and the source string says so.
- a JSONL file: {"prompt": "..."} (needs the target's tokenizer) or {"input_ids": [...]} per line, as for
  `eaglex generate --prompts`; the last fifth of the lines (at least one) is held out for evaluation.

Each part is joined into one token stream (EOS between documents when the model has one) and cut into
non-overlapping windows of `seq_len` tokens; `samples` windows are taken evenly spread over the stream, so a long
file cannot crowd the others out. Deterministic: the same inputs give the same windows.
"""
from __future__ import annotations

import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from eaglex.models.errors import ModelError

HOLDOUT_FRACTION = 5          # JSONL: one line in five is held out (the last ones)
MAX_BUILTIN_FILES = 400       # builtin: stop tokenizing once this many files are read


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


def load_windows(data: str, tokenizer, vocab_size: int, eos_id: int | None, samples: int, seq_len: int,
                 eval_samples: int) -> TextWindows:
    """Windows from `data` ("builtin" or a JSONL path); token ids are checked against the target's vocabulary."""
    if samples < 1 or seq_len < 2 or eval_samples < 1:
        raise ModelError(f"--samples, --eval-samples must be >= 1 and --seq-len >= 2 (got {samples}, "
                         f"{eval_samples}, {seq_len})")
    if data == "builtin":
        calib_docs, eval_docs, source = _builtin(tokenizer, samples, eval_samples, seq_len)
    else:
        calib_docs, eval_docs, source = _jsonl(Path(data), tokenizer)
    for docs in (calib_docs, eval_docs):
        for ids in docs:
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ModelError(f"calibration data ({source}) holds token id {bad[0]} outside the target's "
                                 f"vocabulary [0, {vocab_size})")
    calib = _windows(calib_docs, eos_id, seq_len, samples)
    evaluation = _windows(eval_docs, eos_id, seq_len, eval_samples)
    if not calib or not evaluation:
        raise ModelError(f"calibration data ({source}) is too short: it needs at least 2 tokens for calibration "
                         "and 2 for evaluation")
    return TextWindows(tuple(calib), tuple(evaluation), source)


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


def _jsonl(path: Path, tokenizer) -> tuple[list[list[int]], list[list[int]], str]:
    from eaglex.prompts import read_prompts
    docs = read_prompts(path, tokenizer)
    if len(docs) < 2:
        raise ModelError(f"{path} holds {len(docs)} line(s); calibration needs at least 2 (one is held out for "
                         "the quality report)")
    held = max(1, len(docs) // HOLDOUT_FRACTION)
    return docs[:-held], docs[-held:], f"{path} ({len(docs) - held} lines calibration, {held} held out)"


def _builtin(tokenizer, samples: int, eval_samples: int, seq_len: int):
    if tokenizer is None:
        raise ModelError("--data builtin is text and needs a tokenizer in the target folder; give --data FILE.jsonl "
                         'with {"input_ids": [...]} lines instead')
    texts, source = _builtin_texts()
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


def _builtin_texts() -> tuple[list[str], str]:
    """Texts of the held-out corpus, in a fixed shuffled order (one seed), so that a prefix of the list is spread
    over the whole library rather than its first directory."""
    try:
        from eaglex.training import corpus
    except ImportError:
        corpus = None
    if corpus is not None:
        files = corpus.load(corpus.CorpusConfig(), split="heldout")
        texts = [f.text for f in files]
        source = f"builtin: held-out corpus of the embedded default ({len(files)} stdlib files, " \
                 f"fingerprint {corpus.fingerprint(files)[:12]})"
    else:
        root = Path(sysconfig.get_paths()["stdlib"])
        paths = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)
        texts = []
        for p in paths[: MAX_BUILTIN_FILES * 4]:
            try:
                texts.append(p.read_text(encoding="utf-8"))
            except (UnicodeDecodeError, OSError):
                continue
        source = f"builtin fallback: stdlib sources of {root} (eaglex.training.corpus is not available)"
    order = list(range(len(texts)))
    random.Random(0).shuffle(order)
    return [texts[i] for i in order[:MAX_BUILTIN_FILES]], source
