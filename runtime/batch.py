"""The generator core: one model copy decodes one request or many, which join and leave between steps.

A lone request is a batch of one: the single-request generators (generate.py) run this core over a backend with
one slot, the in-flight batcher over the same models with many (Backend.with_slots), so both decode with the same
code. Each request has its own KV slot (target and draft), sampling settings, seed stream, stop rules
(request.Emitter) and GenerationResult. A step runs one cycle for every active request, in one of two ways, picked by
a `Schedule` from the number of active requests (so that speculation is turned down as the batch grows):
- vanilla: one token for every request in one target forward;
- a tree (chain:K, dynamic:TOTAL/DEPTH/TOPK, cost:DEPTH/TOPK or static): every request's draft context catches up
  with what it accepted, every request grows its own tree (drafter.py: one batched draft forward per level), one
  target forward verifies all of them (each request's rows under its own ancestor mask), one verification decides
  all of them (verify.verify_rows), and each request commits its own accepted path into its slot and emits it.
  The trees of one step have one size (the forward's [B, N] rows): a cost tree's size is chosen per step for all
  its requests together (drafter.Drafter._cost_nodes).
A request whose tree would run past the model's positions or its slot's rows (or past a quantized engine's exact
bound) decodes its last tokens one at a time, as vanilla decoding does; a cost tree first shrinks to the room left.

The draft's context catches up lazily: a joining request's prompt is read as part of its prefill, and what a
request accepted is read at the start of its next tree step (rows that fell behind by more than one cycle, e.g.
after vanilla steps, alone; the others in one forward, left-padded to the longest, so each row's last real row is
the forward's last row).

Requests that join together prefill together: their prompts run in one target forward (and one draft forward),
left-padded to the longest in groups whose padding and keys stay bounded (prefill_groups), so that a batch of
arrivals costs a few forwards, not one per request, and the KV buffers widen once. A long prompt still runs alone.

Exactness: a request's greedy tokens are the target's argmax given its own context, whatever else is in the
batch; a sampled request's token at output position t is the target's draw there under its seed (sampling.draw),
whatever the tree or the batch, so it is the token vanilla decoding alone draws with that seed. Batched forwards
round differently from a request alone at the 1e-5 level (see torch_backend.py): near a tie that can change which
tokens the draft proposes, never what the target emits, unless the target's own choice is tied within that.
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from eaglex.base.errors import ModelError

from .cost import cost_curve
from .device import to_device
from .drafter import Drafter
from .request import Clock, Request, start_request
from .sampling import argmax, draw, logits_to_probs
from .types import DraftTip, SamplingConfig, TreeConfig
from .verify import verify_rows

PREFILL_KEYS = 1024    # the longest prompt a grouped prefill takes: within the one key block in which the engines'
                       # attention rows are bit-identical to the same row alone (export/row_attention.py)
PREFILL_ROWS = 4096    # rows (padding included) per grouped prefill forward: bounds its activations
PREFILL_SLACK = 1.25   # padded rows per real row a group may cost


def prefill_groups(lengths: list[int], max_keys: int = PREFILL_KEYS, max_rows: int = PREFILL_ROWS,
                   slack: float = PREFILL_SLACK) -> list[list[int]]:
    """Indices of prompts of `lengths`, longest first, in the groups that prefill together: a group grows while its
    longest prompt fits `max_keys`, its padded rows `max_rows` and `slack` times its real rows."""
    groups: list[list[int]] = []
    real = 0
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        n = lengths[i]
        g = groups[-1] if groups else None
        if g and lengths[g[0]] <= max_keys and (len(g) + 1) * lengths[g[0]] <= min(max_rows, slack * (real + n)):
            g.append(i)
            real += n
        else:
            groups.append([i])
            real = n
    return groups


def left_pad(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Rows of `lengths` tokens in one forward of M = max(lengths) columns, each row's tokens in its last columns (so
    every row ends at the forward's last row) -> (padding per row [B], each column's offset within its row [B, M] (0
    on padding), the mask [B, M, M]: a real column sees its row's real columns up to itself, a padding column only
    itself (rows must see something; nothing sees them and they are never committed); None when no row is padded)."""
    M = max(lengths)
    pad = torch.tensor([M - n for n in lengths])
    col = torch.arange(M)
    offsets = (col - pad[:, None]).clamp(min=0)
    if not pad.any():
        return pad, offsets, None
    mask = ((col[None, None, :] <= col[None, :, None]) & (col[None, None, :] >= pad[:, None, None])) \
        | torch.eye(M, dtype=torch.bool)
    return pad, offsets, mask


@dataclass(frozen=True)
class Schedule:
    """Tree by number of active requests: `steps` ((from_active, tree or None = vanilla), ...) ascending; the last
    step whose from_active <= active applies. Spelled "1:dynamic:8/4/3,2:chain:4,4:chain:2,8:vanilla" (parse /
    str). Every tree kind gives every request a tree of the same size (a cost tree: one size per step, chosen for
    the step's requests together), which is what lets one target forward verify them all."""
    steps: tuple[tuple[int, TreeConfig | None], ...]

    def __post_init__(self):
        if not self.steps or self.steps[0][0] != 1:
            raise ValueError("a schedule starts at 1 active request")
        if [a for a, _ in self.steps] != sorted({a for a, _ in self.steps}):
            raise ValueError("schedule steps must be strictly ascending")

    @classmethod
    def fixed(cls, tree: TreeConfig | None) -> Schedule:
        return cls(((1, tree),))

    @classmethod
    def parse(cls, text: str) -> Schedule:
        steps = []
        for part in str(text).split(","):
            active, sep, tree = part.strip().partition(":")
            if not sep or not active.isdigit():
                raise ValueError(f"bad schedule {text!r}: use ACTIVE:TREE,... e.g. 1:chain:4,4:chain:2,8:vanilla")
            steps.append((int(active), None if tree == "vanilla" else TreeConfig.parse(tree)))
        return cls(tuple(steps))

    def __str__(self) -> str:
        return ",".join(f"{a}:{t or 'vanilla'}" for a, t in self.steps)

    def tree(self, active: int) -> TreeConfig | None:
        return [t for a, t in self.steps if a <= active][-1]

    @property
    def max_nodes(self) -> int:
        return max((t.max_nodes for _, t in self.steps if t is not None), default=1)

    @property
    def draft_rows(self) -> int:
        """Most draft-cache rows a step writes past a slot's committed ones: a tree's draft levels (TOPK rows per
        level after the first) or a catch-up left-padded to the longest accepted path."""
        return max((max(d.max_path, d.draft_rows) for d in map(Drafter, self.trees)), default=1)

    @property
    def top_k(self) -> int:
        """Candidates the draft keeps after each request's last context row: the widest tree's first level."""
        return max((d.tip_k for d in map(Drafter, self.trees)), default=1)

    @property
    def trees(self) -> list[TreeConfig]:
        return list(dict.fromkeys(t for _, t in self.steps if t is not None))

    def alone(self, tree: TreeConfig | None) -> Schedule:
        """This schedule with `tree` for a request alone in flight (from 2 requests on, what it was)."""
        rest = [(a, t) for a, t in self.steps if a > 1]
        if not rest or rest[0][0] > 2:
            rest.insert(0, (2, self.tree(1)))
        steps: list[tuple[int, TreeConfig | None]] = []
        for a, t in [(1, tree)] + rest:
            if not steps or steps[-1][1] != t:
                steps.append((a, t))
        return Schedule(tuple(steps))


def chain_for(tree: TreeConfig | None) -> TreeConfig | None:
    """The chain a batch drafts for an engine whose single-request tree is `tree` (its depth, at most 4)."""
    if tree is None:
        return None
    return tree if tree.kind == "chain" else TreeConfig.chain(min(tree.depth, 4))


class BatchedGenerator:
    """submit() requests at any time; step() admits queued requests into free slots, runs one cycle for every
    active request and returns the requests that finished. run() steps until nothing is left."""

    def __init__(self, backend, schedule: Schedule | None = None):
        """`backend`: any Backend (runtime/backend.py; one slot: one request at a time); `schedule`: None =
        vanilla."""
        self.backend, self.spec = backend, backend.spec
        self.schedule = schedule or Schedule.fixed(None)
        trees = self.schedule.trees
        if trees and backend.draft_kind is None:
            raise ValueError("speculative decoding needs a draft head")
        if getattr(backend, "exact_trees", None) == "chain" and any(t.kind != "chain" for t in trees):
            raise ModelError(f"this engine's output stays identical to vanilla decoding with chain trees only "
                             f"(int8 activations), not {self.schedule}: use --tree chain:N")
        cost = cost_curve(backend) if any(t.kind == "cost" for t in trees) else None
        self.drafters = {t: Drafter(t, cost if t.kind == "cost" else None) for t in trees}
        self.top_k = self.schedule.top_k
        nodes = self.schedule.max_nodes if trees else 0
        # A tree grows only while it fits the context (a cost tree: its depth), so its draft rows end within
        # the draft rows its levels write past it.
        ctx = self.spec.max_context
        backend.reset(ctx + nodes, ctx + max(nodes, self.schedule.draft_rows))
        # Where trees stop: a request never holds more than `ctx` tokens, so its tree's rows may run past that into
        # the rows each slot keeps beyond it (what they draft past its end is never emitted), but never past the
        # positions the model has. A server or batch sized below the model's context thus drafts to its last token.
        self.room = min((backend.source or backend).spec.max_context, ctx + nodes)
        self.clock = Clock(getattr(backend, "device", None))
        self.queue: deque[Request] = deque()
        self.active: list[Request] = []           # active[i] owns slot i
        self.submitted = 0
        self.steps = 0
        self.last_tree: TreeConfig | None = None   # what the last step ran

    @property
    def in_flight(self) -> int:
        """Requests decoding now."""
        return len(self.active)

    @property
    def queue_depth(self) -> int:
        return len(self.queue)

    def submit(self, input_ids: list[int], max_new_tokens: int = 128, sampling: SamplingConfig = SamplingConfig(),
               on_tokens: Callable[[list[int]], None] | None = None,
               stop: Callable[[], bool] | None = None) -> Request:
        """Queue a request (ValueError when it does not fit the target; nothing is queued then)."""
        result, emitter = start_request(self.spec, input_ids, max_new_tokens, on_tokens, stop)
        req = Request(self.submitted, list(input_ids), sampling, result, emitter, time.perf_counter(),
                      max_new_tokens)
        self.submitted += 1
        self.queue.append(req)
        return req

    @property
    def idle(self) -> bool:
        """Nothing queued and nothing decoding."""
        return not (self.queue or self.active)

    def run(self) -> None:
        while not self.idle:
            self.step()

    # ------------------------------------------------------------------------------------------------ one step

    def step(self) -> list[Request]:
        finished = self._admit()
        if self.active:
            tree = self.schedule.tree(len(self.active))
            self.last_tree = tree
            self.steps += 1
            if tree is None:
                self._vanilla(slice(0, len(self.active)))
            else:
                # rows whose tree would not fit finish plainly; each contiguous run of rows is one batch. A cost
                # tree shrinks to the room left instead, while its draft levels' positions still fit.
                limit = self._limit(tree)
                need = tree.depth + 1 if tree.kind == "cost" else tree.max_nodes
                plain = [r.length + need > limit for r in self.active]
                i = 0
                for is_plain, run in itertools.groupby(plain):
                    n = len(list(run))
                    if is_plain:
                        self._vanilla(slice(i, i + n))
                    else:
                        self._speculate(slice(i, i + n), tree, limit)
                    i += n
            finished += self._retire()
        return finished

    def _limit(self, tree: TreeConfig) -> int:
        """Where trees stop: `room`, or for row-independent quantized engines the keys a call may see while staying
        exact (past that, only chains, whose rows sit where vanilla decoding puts them, keep drafting)."""
        keys = getattr(self.backend, "exact_keys", None)
        return min(self.room, keys) if keys and tree.kind != "chain" else self.room

    def _admit(self) -> list[Request]:
        """Queued requests into the free slots, prefilled together (prefill_groups); -> those already finished."""
        finished = []
        keys = min(getattr(self.backend, "exact_keys", None) or PREFILL_KEYS, PREFILL_KEYS)
        while self.queue and len(self.active) < self.backend.slots:    # again when some finish at their prefill
            joining = []
            while self.queue and len(self.active) + len(joining) < self.backend.slots:
                req = self.queue.popleft()
                if req.emitter.done:                # max_new_tokens 0 or no room: finished before it started
                    finished.append(self._finish(req))
                    continue
                req.admitted = time.perf_counter()
                joining.append(req)
            for group in prefill_groups([len(r.input_ids) for r in joining], keys):
                self._prefill([joining[i] for i in group])
            finished += self._retire()
        return finished

    def _prefill(self, reqs: list[Request]) -> None:
        """One target forward over the prompts of `reqs` in the slots after the active ones (left-padded: every
        prompt's last token in the forward's last row, each at its own positions), the first token of each, and the
        draft's read of the prompts in one forward."""
        first = len(self.active)
        rows = slice(first, first + len(reqs))
        pad, pos, mask = left_pad([len(r.input_ids) for r in reqs])
        M = pos.shape[1]
        ids = torch.zeros(len(reqs), M, dtype=torch.long)
        for j, r in enumerate(reqs):
            ids[j, int(pad[j]):] = torch.tensor(r.input_ids)
        logits, feats = self.clock.run("target", reqs, self.backend.target_forward, rows, ids, pos, mask, True)
        for j, r in enumerate(reqs):
            p = int(pad[j])
            self.backend.target_commit(first + j, torch.arange(p, M))
            r.length = M - p
            self._emit(r, [self._pick(r, logits[j, -1])])
            if not r.done and self.drafters:        # the draft reads the prompt as part of the prefill
                r.behind_feats, r.behind_ids = [feats[j, p:]], r.input_ids[1:] + [r.root]
        self.active += reqs
        if any(r.behind_feats for r in reqs):
            self._extend(rows, reqs)
        for r in reqs:
            self.clock.end_prefill(r)

    def _vanilla(self, rows: slice) -> None:
        """One token for every request of `rows`."""
        reqs = self.active[rows]
        ids = torch.tensor([[r.root] for r in reqs])
        pos = torch.tensor([[r.length] for r in reqs])
        logits, feats = self.clock.run("target", reqs, self.backend.target_forward, rows, ids, pos, None, True)
        keep = torch.arange(1)
        for i, r in enumerate(reqs):
            self.backend.target_commit(rows.start + i, keep)
            r.length += 1
            token = self._pick(r, logits[i, -1])
            if self.drafters:                       # the draft reads these when speculation resumes
                r.behind_feats.append(feats[i])
                r.behind_ids.append(token)
            r.result.cycles += 1
            r.result.verified_nodes += 1
            r.result.accept_lengths.append(self._emit(r, [token]))

    def _speculate(self, rows: slice, cfg: TreeConfig, limit: int) -> None:
        """Draft a tree for every request of `rows`, verify them all in one target forward, commit and emit; no
        tree runs past `limit` rows."""
        self._catch_up(rows, cfg.depth)
        reqs, backend = self.active[rows], self.backend
        base = torch.tensor([r.length for r in reqs])                               # [B] root positions

        def forward(*args):
            return self.clock.run("draft", reqs, backend.draft_forward, rows, *args)
        try:
            trees = self.drafters[cfg].grow(forward, DraftTip.stack([r.tip for r in reqs]), [r.root for r in reqs],
                                            base, limit - int(base.max()))
        finally:
            backend.draft_rollback(rows)
        logits, feats = self.clock.run("target", reqs, backend.target_forward, rows,
                                       torch.stack([t.tokens for t in trees]),
                                       base[:, None] + torch.stack([t.depths for t in trees]),
                                       torch.stack([t.mask for t in trees]))
        verdicts = verify_rows(trees, logits, [r.sampling for r in reqs], [len(r.result.output_ids) for r in reqs])
        for i, (r, tree, verdict) in enumerate(zip(reqs, trees, verdicts)):
            backend.target_commit(rows.start + i, verdict.nodes)
            accepted = tree.tokens[verdict.nodes[1:]].tolist()
            r.result.cycles += 1
            r.result.verified_nodes += tree.size
            r.result.accept_lengths.append(self._emit(r, accepted + [verdict.next_token]))
            # The draft's context grows by the accepted path: (feature of node, token after it).
            r.behind_feats = [feats[i, to_device(verdict.nodes, feats.device)]]
            r.behind_ids = accepted + [verdict.next_token]
            r.length += int(verdict.nodes.shape[0])

    def _catch_up(self, rows: slice, depth: int) -> None:
        """Extend every row's draft context by what it has not read: rows more than one cycle of a tree `depth`
        deep behind alone, the others in one forward."""
        short = False
        for i, r in enumerate(self.active[rows], rows.start):
            n = sum(len(f) for f in r.behind_feats)
            if n > depth + 1:
                self._extend(slice(i, i + 1), [r])
            elif n:
                short = True
        if short:
            self._extend(rows, self.active[rows])

    def _extend(self, rows: slice, reqs: list[Request]) -> None:
        """One draft forward over `rows` reading each request's pending context pairs; rows shorter than the longest
        are left-padded (padding rows see only themselves, nobody sees them, and they are never committed), so
        that every row's last real row is the forward's last, whose top-k becomes the row's tip."""
        feats = [torch.cat(r.behind_feats) if r.behind_feats else None for r in reqs]
        lens = [0 if f is None else f.shape[0] for f in feats]
        M = max(lens)
        _, offsets, mask = left_pad(lens)
        pos = torch.tensor([r.drafted for r in reqs])[:, None] + offsets
        ids = torch.zeros(len(reqs), M, dtype=torch.long)
        if mask is None:                            # nothing to pad (a lone request always): the plain causal forward
            hidden = torch.stack(feats)
            for j, r in enumerate(reqs):
                ids[j] = torch.tensor(r.behind_ids)
        else:
            some = feats[lens.index(M)]
            hidden = some.new_zeros(len(reqs), M, some.shape[1])
            for j, (r, f, n) in enumerate(zip(reqs, feats, lens)):
                if n:
                    hidden[j, M - n:], ids[j, M - n:] = f, torch.tensor(r.behind_ids)
        h, logp, top = self.clock.run("draft", reqs, self.backend.draft_forward, rows, hidden, ids, pos, mask, True,
                                      self.top_k, True)
        for j, (r, n) in enumerate(zip(reqs, lens)):
            self.backend.draft_commit(rows.start + j, torch.arange(M - n, M))
            if n:
                r.tip = DraftTip(h[j, -1], logp[j, 0], top[j, 0])
                r.drafted += n
                r.behind_feats, r.behind_ids = [], []

    # ------------------------------------------------------------------------------------------------ helpers

    @staticmethod
    def _pick(req: Request, logits: torch.Tensor) -> int:
        if req.sampling.greedy:
            return int(argmax(logits))
        return draw(logits_to_probs(logits, req.sampling), req.sampling.seed, len(req.result.output_ids))

    def _emit(self, req: Request, tokens: list[int]) -> int:
        """Emit through the request's stop rules; a callback that raises ends that request alone."""
        try:
            taken = req.emitter.emit(tokens)
        except Exception as e:  # noqa: BLE001 - a caller's hook failing must not take the batch down
            req.error, req.done = e, True
            req.result.stop_reason = "error"
            return len(tokens)
        if req.first_token_at is None:
            req.first_token_at = time.perf_counter()
        req.root = tokens[taken - 1] if taken else req.root
        req.done = req.emitter.done
        return taken

    def _retire(self) -> list[Request]:
        finished = []
        for i in range(len(self.active) - 1, -1, -1):
            req = self.active[i]
            if not req.done:
                continue
            last = len(self.active) - 1
            if i != last:                                   # keep slots contiguous: the last row moves in
                self.backend.move(last, i)
                self.active[i] = self.active[last]
            else:
                self.backend.clear(i)
            self.active.pop()
            finished.append(self._finish(req))
        return finished

    def _finish(self, req: Request) -> Request:
        req.done = True
        req.finished_at = time.perf_counter()
        req.result.seconds = req.finished_at - (req.admitted or req.finished_at)
        self.clock.settle(req)
        return req
