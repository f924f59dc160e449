"""The Triton model's view of its engine folder: runtime.engine.open_engine with the model's parameters, so a
deployment runs the same method and tuned tree as `eaglex generate --engine` on the same folder."""
from __future__ import annotations

from pathlib import Path

from eaglex.base.errors import ModelError
from eaglex.base.methods import METHODS
from eaglex.runtime.engine import Engine, layout, open_engine
from eaglex.runtime.threads import set_threads
from eaglex.runtime.types import TreeConfig

__all__ = ["Engine", "check_method", "layout", "load"]


def check_method(method: str) -> None:
    """A deployment's method: "default" (the engine's own) or one of the methods, as `eaglex generate --method`."""
    if method != "default" and method not in METHODS:
        raise ModelError(f"method must be default or one of {', '.join(METHODS)}, got {method!r}")


def load(path: str | Path, method: str = "default", tree: str | dict | None = None, dtype: str = "float32",
         threads: int = 0) -> Engine:
    """`method` "default" runs the engine's own method, another replaces it ("vanilla" turns drafting off); `tree`
    (one spelling: "chain:3", "dynamic:16/6/4", ...) replaces the engine's own tree;
    `threads` > 0 sizes the backend's thread pool (several instances share the cores)."""
    check_method(method)
    if isinstance(tree, dict):          # the per-field parameters of older repositories
        if any(v is not None for v in tree.values()):
            raise ModelError("the model parameters kind/total_tokens/depth/top_k are gone: set the parameter "
                             "`tree` (e.g. chain:3 or dynamic:16/6/4), or rewrite the repository with eaglex triton")
        tree = None
    try:
        parsed = TreeConfig.parse(tree) if tree else None
    except ValueError as e:
        raise ModelError(f"model parameter tree: {e}") from None
    kind = layout(path)
    if kind == "bundle":
        raise ModelError(f"{path} is a TensorRT-LLM bundle: serve it with TensorRT-LLM's own Triton backend")
    set_threads(threads or None, onnxruntime=kind == "engine")     # the Triton model is its process's entry point
    return open_engine(path, method=None if method == "default" else method, tree=parsed, dtype=dtype)
