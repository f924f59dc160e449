"""The single-request generators: VanillaGenerator (one token per target forward) and SpeculativeGenerator (draft a
tree, verify it in one target forward, keep the accepted path). Each runs one request as a batch of one through
the generator core (runtime/batch.py) on its backend's one slot, with the core's stop rules (any EOS id,
max_new_tokens, the context limit) and statistics, so their outputs can be compared token for token with each
other and with the same request batched among others.
"""
from __future__ import annotations

from typing import Callable

from .backend import Backend
from .batch import BatchedGenerator, Schedule
from .request import GenerationResult
from .types import SamplingConfig, TreeConfig

__all__ = ["GenerationResult", "SpeculativeGenerator", "VanillaGenerator"]


class _OneRequest:
    tree: TreeConfig | None = None     # None: vanilla

    def __init__(self, backend: Backend, sampling: SamplingConfig = SamplingConfig()):
        self.backend, self.sampling = backend, sampling
        self.spec = backend.spec

    def generate(self, input_ids: list[int], max_new_tokens: int = 128,
                 on_tokens: Callable[[list[int]], None] | None = None,
                 stop: Callable[[], bool] | None = None) -> GenerationResult:
        """Decode one request; a callback that raises ends it and raises here."""
        core = BatchedGenerator(self.backend, Schedule.fixed(self.tree))
        req = core.submit(input_ids, max_new_tokens, self.sampling, on_tokens, stop)
        core.run()
        if req.error is not None:
            raise req.error
        return req.result


class VanillaGenerator(_OneRequest):
    pass


class SpeculativeGenerator(_OneRequest):
    def __init__(self, backend: Backend, tree: TreeConfig, sampling: SamplingConfig = SamplingConfig()):
        super().__init__(backend, sampling)
        if backend.draft_kind is None:
            raise ValueError("speculative decoding needs a draft head")
        self.tree = tree
