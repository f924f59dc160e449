"""Files written safely: atomic output folders and JSON files, and file hashes.

Everything eaglex writes (engines, bundles, calibrated checkpoints) is built in a hidden sibling folder and renamed
into place at the end, so a crash never leaves a folder that looks complete, and an existing result is replaced only
when asked and only if it is one of ours."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from eaglex.base.errors import ModelError


def check_out(out: Path, force: bool, marker: tuple[str, ...], what: str) -> None:
    """Refuse to overwrite `out` unless `force`, and never replace a non-empty folder holding none of `marker`."""
    if not out.exists():
        return
    if not force:
        raise ModelError(f"{out} already exists: pass --force to replace it")
    if not out.is_dir() or (any(out.iterdir()) and not any((out / m).is_file() for m in marker)):
        raise ModelError(f"{out} exists and is not {what}: refusing to replace it, even with --force")


def swap_in(tmp: Path, out: Path) -> None:
    """Rename the finished folder into place; an old result is moved aside first and deleted last."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def staged(out: Path) -> Iterator[Path]:
    """Yield an empty hidden sibling of `out` to write into; on success it replaces `out`, on failure it vanishes."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.building-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        swap_in(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def write_text(path: Path, text: str) -> None:
    """Atomic: a crash leaves the old file or the new one, never half of one (the temp name is per process, so
    two writers never share it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)      # e.g. build/ on a fresh clone
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_json(path: Path, data) -> None:
    write_text(path, json.dumps(data, indent=2) + "\n")
