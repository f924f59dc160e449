"""One request's life in the generator core (runtime/batch.py): its checks on arrival, its stop rules, its result,
and the timing of the forwards it took part in.

Vocabulary (runtime/types.py): the *root* is the last token emitted, not yet in the target's KV cache; the request
has `length` committed target rows, so the root sits at position `length`.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .types import DraftTip, SamplingConfig


@dataclass
class GenerationResult:
    input_ids: list[int]
    output_ids: list[int] = field(default_factory=list)   # new tokens only
    accept_lengths: list[int] = field(default_factory=list)  # tokens emitted per verification cycle (>= 1)
    cycles: int = 0
    verified_nodes: int = 0                                # tree nodes the target verified over the cycles, roots
                                                           # included (a vanilla step: 1)
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


class Emitter:
    """Applies the stop rules to every emitted token: any EOS id, max_new_tokens, the context limit. `stop` (a
    caller's hook, e.g. a cancelled request) is asked after every emission: True ends the generation with
    stop_reason "cancelled" and its statistics intact."""

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
                  ) -> tuple[GenerationResult, Emitter]:
    """Check a request against the target (ValueError says what is wrong) -> its result and emitter."""
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
    return result, Emitter(result, max_new_tokens, spec.eos_ids, spec.max_context - n, on_tokens, stop)


@dataclass(eq=False)
class Request:
    """One request inside the core; `result` fills as it decodes, `done` once it left the batch."""
    index: int
    input_ids: list[int]
    sampling: SamplingConfig
    result: GenerationResult
    emitter: Emitter
    submitted: float
    max_new_tokens: int = 0
    admitted: float | None = None          # perf_counter time its prefill started
    first_token_at: float | None = None   # perf_counter time of the first token (TTFT = first_token_at - submitted)
    finished_at: float | None = None
    error: BaseException | None = None
    done: bool = False
    # decoding state
    root: int = 0                          # last emitted token, not yet in the target's cache
    length: int = 0                        # committed target rows = position of the root
    drafted: int = 0                       # committed draft rows (context pairs the draft has read)
    behind_feats: list = field(default_factory=list)   # target features the draft has not read yet ([n,F] each)
    behind_ids: list = field(default_factory=list)     # the token after each of those positions
    tip: DraftTip | None = None            # the draft's output after its last committed row (k = the widest top-k)
    events: list = field(default_factory=list)         # CUDA: (kind, start, end) of each forward it took part in
    prefill_events: int = 0


class Clock:
    """Times forwards and charges each to the requests it ran for (a batched forward to each of its rows).

    On the CPU a forward's time is its wall time. A CUDA backend returns before the GPU has run the forward, so
    there each forward is bracketed by CUDA events, read once when the request ends: the time outside forwards is
    then the time the GPU waited for the host (drafting logic, the accept decision, launches)."""

    def __init__(self, device=None):
        self.cuda = device is not None and torch.device(device).type == "cuda"
        self.stream = torch.cuda.current_stream(torch.device(device)) if self.cuda else None

    def run(self, kind: str, reqs: list[Request], fn, *args):
        """kind "target" or "draft": fn(*args), timed."""
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(self.stream)
            out = fn(*args)
            end.record(self.stream)
            for r in reqs:
                r.events.append((kind, start, end))
            return out
        t = time.perf_counter()
        out = fn(*args)
        dt = time.perf_counter() - t
        for r in reqs:
            if kind == "target":
                r.result.target_seconds += dt
            else:
                r.result.draft_seconds += dt
        return out

    def end_prefill(self, req: Request) -> None:
        req.result.prefill_seconds = time.perf_counter() - req.admitted
        if self.cuda:                                      # counted now, timed at the end (no extra sync here)
            req.prefill_events = len(req.events)
            return
        req.result.prefill_target_seconds = req.result.target_seconds
        req.result.prefill_draft_seconds = req.result.draft_seconds

    def settle(self, req: Request) -> None:
        """At the request's end: the GPU times of its forwards."""
        if not self.cuda or not req.events:
            return
        self.stream.synchronize()
        r = req.result
        for i, (kind, start, end) in enumerate(req.events):
            dt = start.elapsed_time(end) / 1e3
            if kind == "target":
                r.target_seconds += dt
                r.prefill_target_seconds += dt if i < req.prefill_events else 0.0
            else:
                r.draft_seconds += dt
                r.prefill_draft_seconds += dt if i < req.prefill_events else 0.0
        req.events = []
