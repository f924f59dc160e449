"""The decode loops: VanillaGenerator (one token per target forward) and SpeculativeGenerator (draft a tree,
verify it in one target forward, keep the accepted path). Both run on any Backend, emit through the same stop
rules (any EOS id, max_new_tokens, the context limit) and report the same statistics, so their outputs can be
compared token for token.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from eaglex.base.errors import ModelError

from .backend import Backend
from .device import to_device
from .drafter import Drafter
from .sampling import argmax, logits_to_probs, sample
from .types import SamplingConfig, TreeConfig
from .verify import verify_greedy, verify_sampling


@dataclass
class GenerationResult:
    input_ids: list[int]
    output_ids: list[int] = field(default_factory=list)   # new tokens only
    accept_lengths: list[int] = field(default_factory=list)  # tokens emitted per verification cycle (>= 1)
    cycles: int = 0
    seconds: float = 0.0
    target_seconds: float = 0.0                            # time inside target forwards (prefill + verification)
    draft_seconds: float = 0.0                             # time inside draft forwards
    stop_reason: str = ""
    # The prefill phase (included in the totals above): the prompt's target forward and first token, and for
    # speculative decoding the draft's pass over the prompt. What follows it is the decode phase, whose cycles the
    # cost model of the benchmark predicts.
    prefill_seconds: float = 0.0
    prefill_target_seconds: float = 0.0
    prefill_draft_seconds: float = 0.0

    @property
    def tau(self) -> float:
        """Mean tokens per target verification (the prefill's first token excluded)."""
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0

    @property
    def forward_seconds(self) -> float:
        return self.target_seconds + self.draft_seconds

    @property
    def decode_seconds(self) -> float:
        """Wall time after the prefill: the decode cycles (all tokens but the first)."""
        return self.seconds - self.prefill_seconds

    @property
    def overhead_seconds(self) -> float:
        """Time outside model forwards: tree building, verification, cache compaction, bookkeeping."""
        return self.seconds - self.forward_seconds

    def to_json(self) -> dict:
        return {"input_ids": self.input_ids, "output_ids": self.output_ids, "accept_lengths": self.accept_lengths,
                "cycles": self.cycles, "seconds": round(self.seconds, 6), "tau": round(self.tau, 4),
                "overhead_seconds": round(self.overhead_seconds, 6), "stop_reason": self.stop_reason}


class _Timed:
    """Wraps a backend so that the loop can report the time spent outside model forwards.

    On the CPU a forward's time is its wall time. A CUDA backend returns before the GPU has run the forward, so
    there each forward is bracketed by CUDA events and timed on the GPU, read once when the generation ends:
    the time outside forwards is then the time the GPU waited for the host (drafting logic, the accept decision,
    launches)."""

    def __init__(self, backend: Backend):
        self.backend, self.seconds = backend, {"target_forward": 0.0, "draft_forward": 0.0}
        device = getattr(backend, "device", None)
        self.events = self.stream = self.prefill_events = None
        if device is not None and torch.device(device).type == "cuda":
            self.events = {name: [] for name in self.seconds}
            self.stream = torch.cuda.current_stream(torch.device(device))

    def __getattr__(self, name):
        fn = getattr(self.backend, name)
        if name not in self.seconds:
            return fn

        if self.events is not None:
            def timed_on_gpu(*args, **kwargs):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(self.stream)
                out = fn(*args, **kwargs)
                end.record(self.stream)
                self.events[name].append((start, end))
                return out
            return timed_on_gpu

        def timed(*args, **kwargs):
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            self.seconds[name] += time.perf_counter() - t
            return out
        return timed

    def _gpu_seconds(self, upto: dict[str, int] | None = None) -> dict[str, float]:
        self.stream.synchronize()
        return {name: sum(s.elapsed_time(e) for s, e in pairs[:None if upto is None else upto[name]]) / 1e3
                for name, pairs in self.events.items()}

    def end_prefill(self, result: "GenerationResult", t0: float) -> None:
        result.prefill_seconds = time.perf_counter() - t0
        if self.events is not None:                        # counted now, timed at the end (no extra sync here)
            self.prefill_events = {name: len(pairs) for name, pairs in self.events.items()}
            return
        result.prefill_target_seconds = self.seconds["target_forward"]
        result.prefill_draft_seconds = self.seconds["draft_forward"]

    def record(self, result: "GenerationResult", t0: float) -> "GenerationResult":
        result.seconds = time.perf_counter() - t0
        if self.events is not None:
            self.seconds = self._gpu_seconds()
            if self.prefill_events is not None:
                pre = self._gpu_seconds(self.prefill_events)
                result.prefill_target_seconds, result.prefill_draft_seconds = pre["target_forward"], \
                    pre["draft_forward"]
        result.target_seconds, result.draft_seconds = self.seconds["target_forward"], self.seconds["draft_forward"]
        return result


class _Emitter:
    """Applies the stop rules to every emitted token; vanilla and speculative share it, so they stop alike.
    `stop` (a caller's hook, e.g. a cancelled request) is asked after every emission: True ends the generation
    with stop_reason "cancelled" and its statistics intact."""

    def __init__(self, result: GenerationResult, max_new_tokens: int, eos_ids, room: int,
                 on_tokens: Callable[[list[int]], None] | None, stop: Callable[[], bool] | None = None):
        self.result, self.eos = result, set(eos_ids)
        self.limit = min(max_new_tokens, room)              # room: tokens that fit in the context after the prompt
        self.on_tokens, self.stop = on_tokens, stop
        self.done = self.limit <= 0
        if self.done:
            result.stop_reason = "length" if max_new_tokens <= room else "context"
        self.reason_at_limit = "length" if max_new_tokens <= room else "context"

    def emit(self, tokens: list[int]) -> int:
        """Append tokens until a stop rule fires; returns how many were taken."""
        out, taken = self.result.output_ids, []
        for t in tokens:
            taken.append(t)
            if t in self.eos:
                self.done, self.result.stop_reason = True, "eos"
                break
            if len(out) + len(taken) >= self.limit:
                self.done, self.result.stop_reason = True, self.reason_at_limit
                break
        out.extend(taken)
        if taken and self.on_tokens:
            self.on_tokens(taken)
        if not self.done and self.stop is not None and self.stop():
            self.done, self.result.stop_reason = True, "cancelled"
        return len(taken)


def start_request(spec, input_ids: list[int], max_new_tokens: int, on_tokens=None, stop=None
                  ) -> tuple[GenerationResult, _Emitter]:
    """Check a request against the target (ValueError says what is wrong) -> its result and emitter. Every
    generator, one request at a time or batched (batch.py), starts a request here."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    n = len(input_ids)
    if n == 0:
        raise ValueError("the prompt is empty")
    if n >= spec.max_context:
        raise ValueError(f"the prompt has {n} tokens; the target's context holds {spec.max_context}")
    if min(input_ids) < 0 or max(input_ids) >= spec.vocab_size:
        raise ValueError(f"prompt token ids must lie in [0, {spec.vocab_size})")
    result = GenerationResult(input_ids=list(input_ids))
    return result, _Emitter(result, max_new_tokens, spec.eos_ids, spec.max_context - n, on_tokens, stop)


class _Base:
    def __init__(self, backend: Backend, sampling: SamplingConfig = SamplingConfig()):
        self.backend, self.sampling = backend, sampling
        self.spec = backend.spec

    def _pick(self, logits: torch.Tensor, gen: torch.Generator) -> int:
        """logits [V] -> the next token, greedy or sampled."""
        if self.sampling.greedy:
            return int(argmax(logits))
        return int(sample(logits_to_probs(logits, self.sampling), gen))

    def _start(self, input_ids, max_new_tokens, extra_rows, on_tokens, stop):
        result, emitter = start_request(self.spec, input_ids, max_new_tokens, on_tokens, stop)
        self.backend.reset(self.spec.max_context + extra_rows)
        gen = torch.Generator().manual_seed(self.sampling.seed)
        return result, emitter, gen


class VanillaGenerator(_Base):
    def generate(self, input_ids: list[int], max_new_tokens: int = 128,
                 on_tokens: Callable[[list[int]], None] | None = None,
                 stop: Callable[[], bool] | None = None) -> GenerationResult:
        t0 = time.perf_counter()
        backend = _Timed(self.backend)
        result, emitter, gen = self._start(input_ids, max_new_tokens, 0, on_tokens, stop)
        ids = torch.tensor([input_ids])
        pos = torch.arange(ids.shape[1]).unsqueeze(0)
        prefill = True
        while not emitter.done:
            logits, _ = backend.target_forward(ids, pos, None, last_only=True)
            backend.target_commit(torch.arange(ids.shape[1]))
            token = self._pick(logits[0, -1], gen)
            emitter.emit([token])
            result.cycles += not prefill  # the prefill is not a decode cycle
            if prefill:
                backend.end_prefill(result, t0)
            prefill = False
            pos = pos[:, -1:] + 1
            ids = torch.tensor([[token]])
        result.accept_lengths = [1] * result.cycles
        return backend.record(result, t0)


class SpeculativeGenerator(_Base):
    def __init__(self, backend: Backend, tree: TreeConfig, sampling: SamplingConfig = SamplingConfig()):
        super().__init__(backend, sampling)
        if backend.draft_kind is None:
            raise ValueError("speculative decoding needs a draft head")
        if getattr(backend, "exact_trees", None) == "chain" and tree.kind != "chain":
            raise ModelError(f"this engine's output stays identical to vanilla decoding with chain trees only "
                             f"(int8 activations), not {tree}: use --tree chain:N")
        self.tree_cfg = tree

    def generate(self, input_ids: list[int], max_new_tokens: int = 128,
                 on_tokens: Callable[[list[int]], None] | None = None,
                 stop: Callable[[], bool] | None = None) -> GenerationResult:
        t0 = time.perf_counter()
        backend = _Timed(self.backend)
        drafter = Drafter(backend, self.tree_cfg)
        max_nodes = self.tree_cfg.max_nodes
        result, emitter, gen = self._start(input_ids, max_new_tokens, max_nodes, on_tokens, stop)

        if emitter.done:
            return backend.record(result, t0)
        # Prefill: the whole prompt through the target, the first token, then the draft's context.
        ids = torch.tensor([input_ids])
        n = ids.shape[1]
        logits, feats = backend.target_forward(ids, torch.arange(n).unsqueeze(0), None, last_only=True)
        backend.target_commit(torch.arange(n))
        root = self._pick(logits[0, -1], gen)
        emitter.emit([root])
        seed = drafter.extend(feats[0], torch.tensor(input_ids[1:] + [root]), 0) if not emitter.done else None
        backend.end_prefill(result, t0)
        length = n                                             # committed target rows; the root sits at `length`

        # Row-independent quantized engines are exact with trees while a call sees at most `exact_keys` keys;
        # past that, only chains (whose rows sit where vanilla decoding puts them) keep drafting.
        keys = getattr(self.backend, "exact_keys", None)
        limit = min(self.spec.max_context, keys) if keys and self.tree_cfg.kind != "chain" else self.spec.max_context
        while not emitter.done:
            if length + max_nodes > limit:    # a tree would run past the context (or that bound): finish plainly
                logits, _ = backend.target_forward(torch.tensor([[root]]), torch.tensor([[length]]), None)
                backend.target_commit(torch.arange(1))
                length += 1
                root = self._pick(logits[0, -1], gen)
                result.cycles += 1
                result.accept_lengths.append(emitter.emit([root]))
                continue
            tree = drafter.tree(root, seed, length)
            logits, feats = backend.target_forward(tree.tokens.unsqueeze(0), (tree.depths + length).unsqueeze(0),
                                                   tree.mask.unsqueeze(0))
            if self.sampling.greedy:
                verdict = verify_greedy(tree, logits[0])
            else:
                verdict = verify_sampling(tree, logits[0], self.sampling, gen)
            backend.target_commit(verdict.nodes)
            accepted = tree.tokens[verdict.nodes[1:]].tolist()
            result.cycles += 1
            result.accept_lengths.append(emitter.emit(accepted + [verdict.next_token]))
            if emitter.done:
                break
            # The draft's context grows by the accepted path: (feature of node, token after it).
            next_ids = torch.tensor(accepted + [verdict.next_token])
            seed = drafter.extend(feats[0, to_device(verdict.nodes, feats.device)], next_ids, length)
            length += verdict.nodes.shape[0]
            root = verdict.next_token
        return backend.record(result, t0)
