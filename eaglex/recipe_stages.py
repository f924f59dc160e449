"""Resumable stages for the build scripts (recipe_tiny.py, recipe_smollm2.py): every stage caches its output under a key
file holding everything it depends on, written last and atomically, so an interrupted stage reruns and a finished
one is skipped."""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from eaglex.base.fsio import write_text


def cached(key_file: Path, key: dict) -> bool:
    """True when a stage's cached output was made from exactly `key`."""
    return key_file.is_file() and json.loads(key_file.read_text()) == json.loads(json.dumps(key))


def write_key(key_file: Path, key: dict) -> None:
    """Written last and atomically: a stage interrupted before it reruns, never reads half an output."""
    write_text(key_file, json.dumps(key))


def fresh(path: Path) -> Path:
    """`path`, emptied: a stage's output folder is rewritten whole."""
    if path.exists():
        shutil.rmtree(path)
    return path


def timed(fn, *args):
    """(fn(*args), seconds rounded to 0.1)."""
    t0 = time.perf_counter()
    out = fn(*args)
    return out, round(time.perf_counter() - t0, 1)
