"""The training corpus: the Python standard library sources of the running interpreter.

Every machine that runs eaglex has them, so the embedded default can be rebuilt anywhere without a download. The
file list is pinned (sorted relative paths, fixed exclusions) and split by a hash of each path, so a file is held out
on every machine where it exists, whatever else the interpreter ships. The stdlib differs between Python versions:
`fingerprint()` hashes paths and contents, and the build records it next to the models it trained.
"""
from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Directories never read: tests (not library code), third-party packages, bytecode, the pydoc topic dump (one 750 KB
# string) and the generated character-map tables of `encodings/` (hex tables, not code).
EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__",
                           "pydoc_data", "encodings"})


@dataclass(frozen=True)
class CorpusConfig:
    root: str | None = None        # None: the running interpreter's stdlib
    heldout_per_mille: int = 50    # share of files held out (by path hash), in thousandths
    max_file_bytes: int = 400_000  # larger files are skipped


@dataclass(frozen=True)
class SourceFile:
    path: str      # relative to the root, '/' separated
    text: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(path: str, per_mille: int) -> bool:
    """Deterministic by path alone: the same file is held out on every machine and Python version."""
    h = int.from_bytes(hashlib.sha256(path.encode()).digest()[:8], "big")
    return h % 1000 < per_mille


def list_files(cfg: CorpusConfig = CorpusConfig()) -> list[str]:
    """Sorted relative paths of the corpus files."""
    root = Path(cfg.root) if cfg.root else stdlib_root()
    out = []
    for f in root.rglob("*.py"):
        rel = f.relative_to(root)
        if EXCLUDED_DIRS.intersection(rel.parts[:-1]) or not f.is_file():
            continue
        if f.stat().st_size > cfg.max_file_bytes:
            continue
        out.append(rel.as_posix())
    return sorted(out)


def load(cfg: CorpusConfig = CorpusConfig(), split: str = "train") -> list[SourceFile]:
    """The files of one split ("train" or "heldout"), in sorted path order. Undecodable files are skipped."""
    assert split in ("train", "heldout")
    root = Path(cfg.root) if cfg.root else stdlib_root()
    files = []
    for rel in list_files(cfg):
        if is_heldout(rel, cfg.heldout_per_mille) != (split == "heldout"):
            continue
        try:
            text = (root / rel).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        files.append(SourceFile(rel, text))
    return files


def fingerprint(files: list[SourceFile]) -> str:
    """sha256 over (path, content) of the files, in order: identifies the exact data a model saw."""
    h = hashlib.sha256()
    for f in files:
        h.update(f.path.encode() + b"\0" + f.text.encode() + b"\0")
    return h.hexdigest()
