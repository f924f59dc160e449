"""An engine folder -> a ready-to-decode Engine (backend, tokenizer, method, tree). The one place the Triton model
(and `eaglex triton`, to check its argument early) learns what a folder holds.

Accepted layouts:
- an engine folder written by `eaglex build` (manifest.json, ONNX graphs, tokenizer files): loaded through
  `eaglex.engines.load_backend` when that exists, else `eaglex.runtime.ort_backend.OrtBackend`;
- a folder with `target/` (Hugging Face model) and optionally `draft/` (EAGLE head): the PyTorch backend, for
  deployments straight from checkpoints and for tests that must not wait for an engine build;
- a bare Hugging Face model folder (config.json): the PyTorch backend, vanilla decoding.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from eaglex.models.errors import ModelError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
METHODS = ("default", "vanilla")


@dataclass
class Engine:
    backend: object                 # a runtime Backend
    tokenizer: object | None        # Hugging Face tokenizer, None when the folder has none
    method: str                     # "eagle3" | "eagle2" | "eagle1" | "vanilla"
    tree: object | None             # TreeConfig, None for vanilla
    layout: str                     # "engine" | "checkpoint" | "hf"

    @property
    def spec(self):
        return self.backend.spec

    def generator(self, sampling):
        """A fresh generator for one request (generators hold the sampling config; the backend is shared)."""
        from eaglex.runtime.generate import SpeculativeGenerator, VanillaGenerator
        if self.method == "vanilla":
            return VanillaGenerator(self.backend, sampling)
        return SpeculativeGenerator(self.backend, self.tree, sampling)


def layout(path: str | Path) -> str:
    """What kind of folder `path` is, or a ModelError saying what was expected."""
    p = Path(path)
    if not p.is_dir():
        raise ModelError(f"engine folder {p} does not exist: build one with `eaglex build` (or `make engine`)")
    if (p / "manifest.json").is_file():
        return "engine"
    if (p / "target" / "config.json").is_file():
        return "checkpoint"
    if (p / "config.json").is_file():
        return "hf"
    raise ModelError(f"{p} is neither an engine folder (manifest.json), a folder with target/ (and draft/) model "
                     "folders, nor a Hugging Face model folder (config.json)")


def load(path: str | Path, method: str = "default", tree_overrides: dict | None = None,
         dtype: str = "float32", threads: int = 0) -> Engine:
    """Load the folder. `method` "vanilla" turns drafting off; `tree_overrides` replace TreeConfig fields;
    `threads` > 0 caps the backend's intra-op threads (several instances share the cores)."""
    from eaglex.prompts import load_tokenizer
    from eaglex.runtime.types import TreeConfig

    if method not in METHODS:
        raise ModelError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    p = Path(path)
    kind = layout(p)
    default_tree = None
    if kind == "engine":
        backend = _engine_backend(p, threads)
        manifest = json.loads((p / "manifest.json").read_text())
        default_method = manifest.get("default_method") or _method_for(backend.draft_kind)
        default_tree = manifest.get("default_tree")
        tok_dir = getattr(backend, "tokenizer_dir", None) or p
    else:
        import torch

        from eaglex.runtime.torch_backend import TorchBackend
        if threads > 0:
            torch.set_num_threads(threads)
        target = p / "target" if kind == "checkpoint" else p
        draft = p / "draft" if kind == "checkpoint" and (p / "draft").is_dir() else None
        backend = TorchBackend(target, draft, dtype)
        default_method = _method_for(backend.draft_kind)
        tok_dir = target if any((target / f).is_file() for f in TOKENIZER_FILES) else p
    chosen = "vanilla" if method == "vanilla" or backend.draft_kind is None else default_method
    tree = None
    if chosen != "vanilla":
        fields = dict(default_tree or {})
        if fields.get("choices") is not None:          # JSON lists -> the tuples TreeConfig is hashed with
            fields["choices"] = tuple(tuple(c) for c in fields["choices"])
        fields.setdefault("kind", "static" if chosen == "eagle1" else "dynamic")
        fields.update({k: v for k, v in (tree_overrides or {}).items() if v is not None})
        try:
            tree = TreeConfig(**fields)
        except (TypeError, ValueError) as e:
            raise ModelError(f"bad tree settings {fields}: {e}") from None
    return Engine(backend, load_tokenizer(tok_dir), chosen, tree, kind)


def _method_for(draft_kind: str | None) -> str:
    return {"eagle3": "eagle3", "eagle1": "eagle2", None: "vanilla"}[draft_kind]


def _engine_backend(path: Path, threads: int):
    """The engines package's loader when it has one (it knows every backend an engine can be built for)."""
    try:
        from eaglex.engines import load_backend
    except ImportError:
        load_backend = None
    if load_backend is not None:
        return load_backend(path)
    try:
        from eaglex.runtime.ort_backend import OrtBackend
    except ImportError as e:
        raise ModelError(f"{path} is an engine folder, but this eaglex cannot run engines ({e})") from None
    return OrtBackend(path, threads=threads or None)
