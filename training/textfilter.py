"""Quality filters and deduplication for generated instructions: pure functions over strings.

- `rejection(text, cfg)`: why a text is not kept (too short or long, mostly outside the allowed scripts, degenerate
  repetition), or None.
- `Deduper`: exact duplicates (after normalising case, punctuation and spacing) and near duplicates (Jaccard
  similarity of word 3-gram sets, found through MinHash with locality-sensitive banding, then confirmed on the sets
  themselves). Texts can be reserved (held-out prompts): anything near them is refused and they are never kept.
"""
from __future__ import annotations

import re
import unicodedata
import zlib
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class FilterConfig:
    min_chars: int = 12
    max_chars: int = 2000
    min_words: int = 3
    scripts: tuple[str, ...] = ("LATIN",)    # Unicode script names letters must come from (unicodedata.name prefix)
    min_script_share: float = 0.9            # of the letters
    max_dup_trigram_share: float = 0.3       # word 3-grams that repeat an earlier one
    max_word_run: int = 3                    # the same word this many times in a row


_WORD = re.compile(r"\w+", re.UNICODE)


def words(text: str) -> list[str]:
    return _WORD.findall(text.casefold())


def script_share(text: str, scripts: tuple[str, ...] = ("LATIN",)) -> float:
    """Share of the letters whose Unicode name starts with one of `scripts` (1.0 for a text without letters)."""
    letters = [c for c in text if c.isalpha()]
    if not letters:
        return 1.0
    ok = sum(unicodedata.name(c, "").startswith(scripts) for c in letters)
    return ok / len(letters)


def dup_trigram_share(ws: list[str]) -> float:
    """Share of word 3-grams that already occurred earlier in the text (0 for fewer than 4 words)."""
    grams = list(zip(ws, ws[1:], ws[2:]))
    if len(grams) < 2:
        return 0.0
    return (len(grams) - len(set(grams))) / len(grams)


def longest_word_run(ws: list[str]) -> int:
    best = run = 0
    for i, w in enumerate(ws):
        run = run + 1 if i and w == ws[i - 1] else 1
        best = max(best, run)
    return best


def rejection(text: str, cfg: FilterConfig = FilterConfig()) -> str | None:
    """The first rule `text` breaks (script, short, long, repetitive), or None when it is kept."""
    t = text.strip()
    ws = words(t)
    if script_share(t, cfg.scripts) < cfg.min_script_share:
        return "script"
    if len(t) < cfg.min_chars or len(ws) < cfg.min_words:
        return "short"
    if len(t) > cfg.max_chars:
        return "long"
    if longest_word_run(ws) >= cfg.max_word_run or dup_trigram_share(ws) > cfg.max_dup_trigram_share:
        return "repetitive"
    return None


def normalize(text: str) -> str:
    """What exact deduplication compares: case-folded words, single spaces, no punctuation."""
    return " ".join(words(text))


def shingles(text: str, n: int = 3) -> frozenset[str]:
    """Word n-grams of the normalised text; a text of fewer than n words is its one shingle."""
    ws = words(text)
    if len(ws) < n:
        return frozenset([" ".join(ws)])
    return frozenset(" ".join(ws[i:i + n]) for i in range(len(ws) - n + 1))


def jaccard(a: frozenset, b: frozenset) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


_PRIME = (1 << 61) - 1


class Deduper:
    """Keeps the first of each group of (near) duplicates, in the order texts are offered. MinHash with `bands`
    bands of `rows` hashes: a pair at Jaccard s shares a band with probability 1 - (1 - s^rows)^bands (20 x 3:
    0.99 at s = 0.6, 0.15 at 0.2), and a shared band only nominates a candidate; the exact Jaccard of the shingle
    sets decides. Deterministic: the hash functions come from `seed`."""

    def __init__(self, threshold: float = 0.6, bands: int = 20, rows: int = 3, seed: int = 0):
        rng = np.random.default_rng(seed)
        k = bands * rows
        self.threshold, self.bands, self.rows = threshold, bands, rows
        self._a = rng.integers(1, _PRIME, k, dtype=np.uint64)
        self._b = rng.integers(0, _PRIME, k, dtype=np.uint64)
        self._exact: set[str] = set()
        self._sets: list[frozenset[str]] = []
        self._buckets: dict[tuple, list[int]] = {}

    def _signature(self, sh: frozenset[str]) -> np.ndarray:
        h = np.array(sorted(zlib.crc32(s.encode()) for s in sh), dtype=np.uint64)
        # (a*h + b) mod p with 64-bit wraparound is a fine hash family here: h < 2^32 and only the order matters
        return ((self._a[:, None] * h[None, :] + self._b[:, None]) % np.uint64(_PRIME)).min(axis=1)

    def _band_keys(self, sig: np.ndarray) -> list[tuple]:
        return [(i, *sig[i * self.rows:(i + 1) * self.rows].tolist()) for i in range(self.bands)]

    def duplicate_of_seen(self, text: str) -> bool:
        """Whether `text` duplicates (exactly or nearly) a text already added or reserved."""
        if normalize(text) in self._exact:
            return True
        sh = shingles(text)
        seen: set[int] = set()
        for key in self._band_keys(self._signature(sh)):
            for j in self._buckets.get(key, ()):
                if j not in seen:
                    seen.add(j)
                    if jaccard(sh, self._sets[j]) >= self.threshold:
                        return True
        return False

    def add(self, text: str) -> bool:
        """Record `text`; True when it is new (kept), False when it duplicates an earlier or reserved text."""
        if self.duplicate_of_seen(text):
            return False
        norm, sh = normalize(text), shingles(text)
        self._exact.add(norm)
        self._sets.append(sh)
        for key in self._band_keys(self._signature(sh)):
            self._buckets.setdefault(key, []).append(len(self._sets) - 1)
        return True

    def reserve(self, texts) -> None:
        """Texts nothing kept may duplicate (held-out prompts); they count as seen."""
        for t in texts:
            self.add(t)
