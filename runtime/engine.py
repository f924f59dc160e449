"""open_engine(): the one answer to "what does this folder mean, and how does it decode by default".

Every entry point (the CLI, the Triton model, the benchmark, the trainers' reports) opens models through here, so
an engine runs the same method and tree wherever it is used. Accepted layouts:

- ``engine``: an ONNX Runtime engine folder written by `eaglex build` (manifest.json); its method and `tree` come
  from the manifest, where tuning (`eaglex tune`, `eaglex engine`) stores the shape it measured as fastest; when
  tuning measured vanilla faster than every tree, the engine runs vanilla unless a method or tree is asked for, and
  keeps the best tree (`Engine.kept_tree`) for that;
- ``bundle``: a TensorRT-LLM bundle (manifest.json with backend tensorrt-llm), run by runtime/trtllm_bundle.py;
- ``checkpoint``: a folder with ``target/`` (Hugging Face model) and optionally ``draft/`` (EAGLE head): the
  PyTorch backend, for deployments straight from checkpoints;
- ``hf``: a bare Hugging Face model folder (config.json): the PyTorch backend, vanilla decoding.

`open_models(target, draft)` opens a pair of model folders the same way (the CLI's --target/--draft).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from eaglex.base.errors import ModelError
from eaglex.base.methods import METHODS
from eaglex.base.prompts import has_tokenizer, load_tokenizer

from .batch import BatchedGenerator, Schedule, chain_for
from .device import device_of, resolve_device
from .generate import GenerationResult, SpeculativeGenerator, VanillaGenerator
from .manifest import MANIFEST, default_method, manifest_tree, tuned_vanilla
from .manifest import head_method as manifest_head_method
from .sampling import prompt_sampling
from .types import SamplingConfig, TreeConfig


@dataclass
class Engine:
    """A ready-to-decode model: backend (target + optional head), tokenizer, and the method and tree it runs."""
    backend: object                 # a runtime Backend
    tokenizer: object | None        # Hugging Face tokenizer, None when the folder has none
    method: str                     # "eagle3" | "eagle2" | "eagle1" | "vanilla"
    tree: TreeConfig | None         # None for vanilla
    layout: str                     # "engine" | "checkpoint" | "hf" | "models"
    path: Path | None = None        # the engine folder (layout "engine"): where tuning writes its result
    kept_tree: TreeConfig | None = None     # method "vanilla" because tuning measured it faster than every tree:
                                            # the head's best tree, which speculative() and an explicit method run

    @property
    def spec(self):
        return self.backend.spec

    @property
    def draft_kind(self) -> str | None:
        return self.backend.draft_kind

    @property
    def device(self) -> str:
        """Where the models run: "cpu" or "cuda:N"."""
        return device_of(self.backend)

    @property
    def manifest(self) -> dict | None:
        return getattr(self.backend, "manifest", None)

    @property
    def head_method(self) -> str:
        """The method the head runs when drafting: the manifest's, else the one the head's kind implies."""
        return manifest_head_method(self.manifest, self.draft_kind)

    def speculative(self) -> Engine:
        """This engine drafting with its head: itself, unless tuning chose vanilla (kept_tree set); then the same
        models on the head's method and kept tree, for what concerns the head whatever runs by default (the
        check against vanilla, the bench's tree row)."""
        if self.kept_tree is None:
            return self
        return replace(self, method=self.head_method, tree=self.kept_tree, kept_tree=None)

    def generator(self, sampling: SamplingConfig = SamplingConfig()):
        """A generator for one request at a time (generators hold the sampling config; the backend is shared)."""
        if self.method == "vanilla":
            return VanillaGenerator(self.backend, sampling)
        return SpeculativeGenerator(self.backend, self.tree, sampling)

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig = SamplingConfig(),
                 max_new_tokens: int = 128, seeds: list[int | None] | None = None,
                 stop: Callable[[], bool] | None = None,
                 on_tokens: Callable[[int, list[int]], None] | None = None,
                 batch: int = 1) -> list[GenerationResult]:
        """One result per prompt. Prompt i samples from its own stream: `seeds[i]` when given, else one derived
        from (sampling.seed, i), so a prompt's output never depends on the other prompts. Up to `batch` prompts
        decode at once through the in-flight batcher (runtime/batch.py), with the same outputs; batch 1 decodes
        them in turn on the engine's own backend."""
        # slots as long as the longest request needs, not the model's whole context (each slot holds that much KV)
        gen = self.batcher(batch, context=max(len(p) for p in prompts) + max_new_tokens if prompts else None)
        reqs = []
        for i, ids in enumerate(prompts):
            cfg = prompt_sampling(sampling, i, seeds[i] if seeds is not None else None)
            emit = (lambda tokens, i=i: on_tokens(i, tokens)) if on_tokens else None
            try:
                reqs.append(gen.submit(ids, max_new_tokens, cfg, emit, stop))
            except ValueError as e:             # a prompt that does not fit this model: one line for the user
                raise ModelError(f"prompt {i}: {e}") from None
        gen.run()
        for r in reqs:
            if r.error is not None:
                raise r.error
        return [r.result for r in reqs]

    def batch_schedule(self):
        """The batch schedule this engine runs: the manifest's measured `batch_schedule` (engines/tune.py), else
        the engine's own tree as a chain at every batch size (see batch.chain_for), or vanilla batching."""
        stored = (self.manifest or {}).get("batch_schedule")
        if self.method == "vanilla":
            return Schedule.fixed(None)
        return Schedule.parse(stored) if stored else Schedule.fixed(chain_for(self.tree))

    def kv_bytes_per_token(self) -> int:
        """KV memory one token of context takes in a batch slot (target + draft)."""
        return self.backend.with_slots(1, context=1).slot_bytes

    def batch_exact(self, context: int | None = None, schedule=None) -> bool:
        """Whether requests of up to `context` tokens (default: the model's) batched on `schedule` decode exactly as
        alone: not under FP8's exactness rules, and within a row-independent engine's keys per call."""
        keys = getattr(self.backend, "exact_keys", None)
        span = (context or self.backend.spec.max_context) + (schedule or self.batch_schedule()).max_nodes
        return getattr(self.backend, "batch_exact", True) and (keys is None or span <= keys)

    def batcher(self, max_batch: int, schedule=None, context: int | None = None):
        """A BatchedGenerator with `max_batch` KV slots over this engine's models (no second copy of the weights).
        `schedule`: default the engine's batch schedule, with the engine's own tree for a request alone (as
        `generator` decodes it, bit-identically). `context`: the longest prompt + new tokens a request may have
        (default: the model's context); every slot holds that much KV, so a server sizes it to its memory.
        One slot (max_batch 1, or an engine whose rows are not exact when batched) is the engine's own backend:
        requests take turns exactly as one request at a time does."""
        if self.device != "cpu" and self.layout == "engine" and max_batch > 1:
            raise ModelError(f"batched decoding of an ONNX Runtime engine runs on the CPU, and this one runs on "
                             f"{self.device}: decode one request at a time (batch 1), or open the model folders on "
                             "the PyTorch backend")
        schedule = schedule or self.batch_schedule().alone(self.tree)
        if not self.batch_exact(context, schedule):
            # an FP8 engine (manifest `exactness`), or a longer context than an int8 engine's rows stay independent
            # for: rows padded together in one forward could round differently from a request decoded alone, so
            # requests take turns on the engine's own backend
            max_batch = 1
        if max_batch == 1:
            return BatchedGenerator(self.backend, schedule)
        if context is not None and context < 1:
            raise ModelError(f"the context must be at least 1 token, got {context}")
        return BatchedGenerator(self.backend.with_slots(max_batch, schedule.max_nodes, context), schedule)


def layout(path: str | Path) -> str:
    """What kind of folder `path` is, or a ModelError saying what was expected."""
    p = Path(path)
    if not p.is_dir():
        raise ModelError(f"engine folder {p} does not exist: build one with `eaglex build` (or `make engine`)")
    if (p / MANIFEST).is_file():
        try:
            backend = json.loads((p / MANIFEST).read_text()).get("backend")
        except (ValueError, AttributeError, UnicodeDecodeError):
            backend = None                      # read_manifest says what is wrong with it
        return "bundle" if backend == "tensorrt-llm" else "engine"
    if (p / "target" / "config.json").is_file():
        return "checkpoint"
    if (p / "config.json").is_file():
        return "hf"
    raise ModelError(f"{p} is neither an engine folder (manifest.json), a folder with target/ (and draft/) model "
                     "folders, nor a Hugging Face model folder (config.json)")


def open_engine(path: str | Path, *, method: str | None = None, tree: TreeConfig | None = None,
                dtype: str = "float32", draft_kind: str | None = None, device: str | None = None, providers: str | list[str] | None = None, mode: str | None = None):
    """Open any layout above. Overrides: `method` ("vanilla" turns drafting off; a speculative method or a `tree`
    drafts even where tuning chose vanilla, on the kept tree unless `tree`), `tree` (else the engine's own),
    `dtype` (PyTorch layouts), `draft_kind` (must match the head), `device` ("cpu" by default; "auto", "cuda", "cuda:N": runtime/device.py), `providers` (ONNX Runtime engines:
    execution providers instead of the device's), `mode` (PyTorch layouts: eager, static or graphs).
    Returns an Engine, or for a TensorRT-LLM bundle a TrtllmEngine with the same generate/check interface."""
    p = Path(path)
    kind = layout(p)
    if kind == "bundle":
        from .trtllm_bundle import TrtllmEngine
        return TrtllmEngine(p, method=method)
    if kind == "engine":
        from .ort_backend import OrtBackend
        from .ort_session import choose_providers
        backend = OrtBackend(p, draft_kind=draft_kind, providers=choose_providers(device, providers))
        m = backend.manifest
        return _engine(backend, p, m.get("method") or m.get("default_method"), manifest_tree(m), method, tree,
                       "engine", p, tuned_vanilla(m), m.get("tokenizer_class"))
    target = p / "target" if kind == "checkpoint" else p
    draft = p / "draft" if kind == "checkpoint" and (p / "draft").is_dir() else None
    if providers:
        raise ModelError(f"{p} runs on the PyTorch backend: --providers applies to ONNX Runtime engines only")
    return open_models(target, draft, method=method, tree=tree, dtype=dtype, draft_kind=draft_kind, layout=kind,
                       device=device, mode=mode)


def open_models(target: str | Path, draft: str | Path | None = None, *, method: str | None = None,
                tree: TreeConfig | None = None, dtype: str = "float32", draft_kind: str | None = None,
                layout: str = "models", device: str | None = None, mode: str | None = None) -> Engine:
    """A target folder (+ EAGLE head folder) on the PyTorch backend, on `device` (default "cpu")."""
    from .torch_backend import TorchBackend
    backend = TorchBackend(target, draft, dtype, draft_kind, resolve_device(device or "cpu"), mode)
    tok_dir = Path(target)
    if not has_tokenizer(tok_dir) and layout == "checkpoint":
        tok_dir = tok_dir.parent
    return _engine(backend, tok_dir, None, TreeConfig(), method, tree, layout, None)


def _engine(backend, tok_dir: Path, own_method: str | None, own_tree: TreeConfig | None, method: str | None,
            tree: TreeConfig | None, kind: str, path: Path | None, own_vanilla: bool = False,
            tokenizer_class: str | None = None) -> Engine:
    """Resolve the method and tree: the caller's overrides, else the model's own. `own_vanilla`: tuning measured
    vanilla faster than every tree, so vanilla is the model's own unless the caller asks for a method or a tree.
    `tokenizer_class`: the class the build resolved for the folder's tokenizer (base.prompts.load_tokenizer)."""
    head = backend.draft_kind
    if method is not None and method not in METHODS:
        raise ModelError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    if own_vanilla and method is None and tree is None and head is not None:
        return Engine(backend, load_tokenizer(tok_dir, tokenizer_class), "vanilla", None, kind, path,
                      own_tree or TreeConfig())
    chosen = method or own_method or default_method(head)
    if chosen != "vanilla":
        if head is None:
            raise ModelError(f"method {chosen} needs a draft head, and this model has none")
        want = "eagle3" if chosen == "eagle3" else "eagle1"
        if head != want:
            raise ModelError(f"method {chosen} needs an {_head_name(want)} head, but the draft is an "
                             f"{_head_name(head)} head: use method {'eagle3' if head == 'eagle3' else 'eagle2'}")
    if chosen == "vanilla":
        return Engine(backend, load_tokenizer(tok_dir, tokenizer_class), "vanilla", None, kind, path)
    if tree is None:
        tree = TreeConfig.parse("static") if chosen == "eagle1" and method == "eagle1" else own_tree or TreeConfig()
    return Engine(backend, load_tokenizer(tok_dir, tokenizer_class), chosen, tree, kind, path)


def _head_name(kind: str) -> str:
    return "EAGLE-3" if kind == "eagle3" else "EAGLE-1/2"
