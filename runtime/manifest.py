"""manifest.json of an engine folder: what was built from what, and the checks a loader runs before trusting it.

The manifest is the engine's table of contents: format version, backend, dtype, opset, the target's TargetSpec, the
draft head (kind, feature layers, draft vocabulary and whether a d2t map is applied), the head's method and the
`tree` every entry point runs by default (written at build, overwritten by tuning: `tuning` records what was
measured, and `tuning.method` is "vanilla" when vanilla measured faster than every tree, so that the engine runs
vanilla by default and keeps its best tree for an explicit method), every file with its size and sha256, the sha256
of the source weights, tool versions and the parity errors measured at build time. Every graph also carries the
engine's id in its ONNX metadata, so a graph copied over from another engine is caught even when its file is too big
to hash on every load.
"""
from __future__ import annotations

import json
from pathlib import Path

from eaglex.base.errors import ModelError
from eaglex.base.fsio import sha256_file, write_json
from eaglex.models.target import TargetSpec

from .types import TreeConfig

FORMAT = "eaglex-engine"
FORMAT_VERSION = 2          # 2: ONNX graphs take rows-first KV buffers written in place (export/row_attention.py)
MANIFEST = "manifest.json"
HASH_LIMIT = 2 * 1024 ** 3      # files up to this size are hashed on load; bigger ones are checked by size + id


__all__ = ["FORMAT", "FORMAT_VERSION", "MANIFEST", "HASH_LIMIT", "sha256_file", "write_manifest", "read_manifest",
           "verify_files", "target_spec", "manifest_tree", "default_method", "head_method", "tuned_vanilla"]


def write_manifest(folder: Path, manifest: dict) -> None:
    write_json(Path(folder) / MANIFEST, manifest)


def read_manifest(folder: str | Path) -> dict:
    """The manifest of an engine folder, or a ModelError saying why the folder is not a usable engine."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelError(f"engine folder {folder} does not exist: build it with `eaglex build --out {folder}`")
    path = folder / MANIFEST
    if not path.is_file():
        raise ModelError(f"{folder} is not an engine folder (no {MANIFEST}): build one with `eaglex build`")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelError(f"{path} is corrupt ({e}): rebuild the engine with `eaglex build --force`") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ModelError(f"{path} is not an eaglex engine manifest: rebuild the engine with `eaglex build --force`")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise ModelError(f"engine {folder} has format version {version}, this eaglex reads version "
                         f"{FORMAT_VERSION}: rebuild it with `eaglex build --force`")
    return manifest


def verify_files(folder: str | Path, manifest: dict, hash_limit: int = HASH_LIMIT) -> None:
    """Every listed file exists with its size; files up to `hash_limit` bytes also match their sha256."""
    folder = Path(folder)
    for name, info in manifest["files"].items():
        path = folder / name
        if not path.is_file():
            raise ModelError(f"engine {folder} is missing {name}: rebuild it with `eaglex build --force`")
        size = path.stat().st_size
        if size != info["bytes"]:
            raise ModelError(f"engine file {path} is corrupt ({size} bytes, the manifest says {info['bytes']}): "
                             "rebuild the engine with `eaglex build --force`")
        if size <= hash_limit and sha256_file(path) != info["sha256"]:
            raise ModelError(f"engine file {path} is corrupt or comes from another engine (sha256 differs from "
                             "the manifest): rebuild the engine with `eaglex build --force`")


def target_spec(manifest: dict) -> TargetSpec:
    s = dict(manifest["target"]["spec"])
    s["eos_ids"] = tuple(s["eos_ids"])
    return TargetSpec(**s)


def default_method(draft_kind: str | None) -> str:
    """The method a head implies: EAGLE-3 heads run eagle3, EAGLE-1/2 heads EAGLE-2's dynamic trees."""
    return {"eagle3": "eagle3", "eagle1": "eagle2", None: "vanilla"}[draft_kind]


def head_method(manifest: dict | None, draft_kind: str | None) -> str:
    """The speculative method an engine's head runs: the manifest's `method` (older engines: `default_method`),
    else the one the head's kind implies (model folders have no manifest)."""
    m = manifest or {}
    return m.get("method") or m.get("default_method") or default_method(draft_kind)


def tuned_vanilla(manifest: dict | None) -> bool:
    """Whether tuning measured vanilla faster than every tree on its machine (`tuning.method` "vanilla"): the
    engine then runs vanilla by default. Engines tuned before that decision was recorded say nothing: False."""
    return ((manifest or {}).get("tuning") or {}).get("method") == "vanilla"


def manifest_tree(manifest: dict) -> TreeConfig | None:
    """The head's tree, which the engine runs by default unless tuning chose vanilla (tuned_vanilla): the `tree`
    field (the tuned shape once `eaglex engine` or `--tree auto` measured one). Engines written before that field
    keep working: their `tuned_tree`, else `default_tree`."""
    if manifest.get("tree"):
        try:
            return TreeConfig.parse(manifest["tree"])
        except ValueError as e:
            raise ModelError(f"engine manifest: {e}: rebuild the engine with `eaglex build --force`") from None
    old = (manifest.get("tuned_tree") or {}).get("tree") or manifest.get("default_tree")
    if not old:
        return None
    # the old dicts counted `depth` as draft forwards after the first one (the official code's convention)
    fields = {k: old[k] for k in ("kind", "total_tokens", "depth", "top_k") if k in old}
    fields["depth"] = fields.get("depth", 0) + 1
    if old.get("choices") is not None:
        fields["choices"] = tuple(tuple(c) for c in old["choices"])
    return TreeConfig(**fields)
