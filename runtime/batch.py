"""In-flight batching: one model copy decodes many requests, which join and leave between steps.

Each request has its own KV slot (target and draft, runtime/batch_backend.py), sampling settings, seed stream,
stop rules (generate.start_request: the same emitter as the single-request loops) and GenerationResult. A step
runs one cycle for every active request, in one of three ways, picked by a `Schedule` from the number of active
requests (so that speculation is turned down as the batch grows):
- vanilla: one token for every request in one target forward;
- chain:K: K draft tokens for every request (one batched draft forward per level), verified in one target
  forward of B x (K + 1) rows, each request keeping its accepted prefix;
- dynamic:TOTAL/DEPTH/TOPK (EAGLE-2): every request grows its own tree, exactly as the single-request Drafter does
  (expand the TOPK best nodes of each level by cumulative draft log-prob, keep the best TOTAL - 1 candidates and
  the root: tree.next_frontier / select_dynamic). Each level is one batched draft forward of B x TOPK rows, each
  row masked to its own request's draft context and its own ancestors among that request's tree rows; all trees
  have the same size, so verification is one target forward of B x TOTAL rows with each request's ancestor mask,
  and each request commits its own accepted path (arbitrary node indices) into its slot.
Verification is per request: verify_greedy, or verify_sampling with the request's own generator.

Prefill stays out of the batched forwards: a joining request's prompt runs alone on its slot, and the draft's
context catches up lazily (rows that fell behind by more than one cycle, e.g. after vanilla steps or a prefill,
extend alone; the others extend together, padded to the longest).

Alone in flight: a request that arrives while nothing else is decoding runs on a single-request generator
(`solo`; Engine.batcher gives greedy requests the engine's own method and tree, sampled ones the schedule's tree at
one request, so that their draws are those of a batch) over the Backend's own KV cache, one cycle per step, so
concurrency 1 costs what one request alone costs and a greedy output is bit-identical to the single-request path.
It keeps that lane until it finishes; requests arriving meanwhile batch in the slots next to it (one extra forward
per step while both run). The lane counts against the batch's capacity (`slots`), so max batch 1 is exactly the
single-request path. The single-request loop runs in a helper thread that holds the baton for one cycle per step
(its stop hook hands the baton back), so it is the same code as one request alone, never run concurrently with
the batched forwards.

Exactness: a request's greedy tokens are the target's argmax given its own context, whatever else is in the
batch; sampling draws from the request's own torch.Generator (seeded by its SamplingConfig.seed), through the same
verify_sampling as one request alone. The batched forwards round differently from a request alone at the 1e-5
level (see batch_backend.py), as the single-request speculative path already does. Near a tie that can change
which tokens the draft proposes (never what the target accepts for a greedy request); a sampled request's draws
depend on the tree it is offered, so its output is fixed by its seed and the schedule, and equals the request
decoded alone with the same tree unless such a tie falls differently.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .generate import GenerationResult, start_request
from .sampling import argmax, logits_to_probs, sample
from .tree import chain_tree, next_frontier, select_dynamic
from .types import SamplingConfig, TreeConfig
from .verify import verify_greedy, verify_sampling


@dataclass(frozen=True)
class Schedule:
    """Tree by number of active requests: `steps` ((from_active, tree or None = vanilla), ...) ascending; the last
    step whose from_active <= active applies. Spelled "1:dynamic:8/4/3,2:chain:4,4:chain:2,8:vanilla" (parse /
    str). Trees are chains or dynamic trees: both give every request a tree of the same size, which is what lets
    one target forward verify them all (a static tree would too, but nothing batches it yet)."""
    steps: tuple[tuple[int, TreeConfig | None], ...]

    def __post_init__(self):
        if not self.steps or self.steps[0][0] != 1:
            raise ValueError("a schedule starts at 1 active request")
        if [a for a, _ in self.steps] != sorted({a for a, _ in self.steps}):
            raise ValueError("schedule steps must be strictly ascending")
        for _, tree in self.steps:
            if tree is not None and tree.kind not in ("chain", "dynamic"):
                raise ValueError(f"batched decoding drafts chains or dynamic trees, not {tree}")

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
        level after the first) or a catch-up padded to the longest accepted path (depth + 1)."""
        return max((max(t.depth + 1, (t.depth - 1) * t.top_k) for _, t in self.steps if t is not None), default=1)

    @property
    def top_k(self) -> int:
        """Candidates the draft keeps after each request's last context row: the widest tree's TOPK."""
        return max((t.top_k for _, t in self.steps if t is not None), default=1)


def chain_for(tree: TreeConfig | None) -> TreeConfig | None:
    """The chain a batch drafts for an engine whose single-request tree is `tree` (its depth, at most 4)."""
    if tree is None:
        return None
    return tree if tree.kind == "chain" else TreeConfig.chain(min(tree.depth, 4))


@dataclass(eq=False)
class Request:
    """One request inside the batcher; `result` fills as it decodes, `done` once it left the batch."""
    index: int
    input_ids: list[int]
    sampling: SamplingConfig
    result: GenerationResult
    emitter: object
    submitted: float
    generator: torch.Generator = None
    max_new_tokens: int = 0
    admitted: float | None = None          # perf_counter time its prefill started
    first_token_at: float | None = None   # perf_counter time of the first token (TTFT = first_token_at - submitted)
    finished_at: float | None = None
    error: BaseException | None = None
    done: bool = False
    # decoding state
    root: int = 0                          # last emitted token, not yet in the target's cache
    length: int = 0                        # committed target rows = position of the root
    behind_feats: list = field(default_factory=list)   # target features the draft has not read yet ([n,F] each)
    behind_ids: list = field(default_factory=list)     # the token after each of those positions
    seed: tuple | None = None              # the draft's (hidden [H], top log-probs [k], top ids [k]) after its
    #                                        last committed row (k = the schedule's widest TOPK)


class _Solo:
    """One request on the single-request generator, run one cycle at a time: the engine thread calls cycle(),
    the helper thread runs until the generator's next emission (its stop hook) or its end, then hands back."""

    def __init__(self, req: Request, generator):
        self.req, self.finished, self.error, self.result = req, False, None, None
        self._turn, self._back = threading.Semaphore(0), threading.Semaphore(0)
        user_tokens, user_stop = req.emitter.on_tokens, req.emitter.stop

        def on_tokens(tokens: list[int]) -> None:
            req.result.output_ids.extend(tokens)        # a live view while it runs; replaced by the result at the end
            if req.first_token_at is None:
                req.first_token_at = time.perf_counter()
            if user_tokens is not None:
                user_tokens(tokens)

        def stop() -> bool:                             # asked after every emission: one cycle done
            self._back.release()
            self._turn.acquire()
            return bool(user_stop()) if user_stop is not None else False

        def run() -> None:
            self._turn.acquire()
            try:
                self.result = generator.generate(req.input_ids, req.max_new_tokens, on_tokens, stop)
            except Exception as e:  # noqa: BLE001 - a caller's hook failing ends this request alone
                self.error = e
            finally:
                self.finished = True
                self._back.release()

        self._thread = threading.Thread(target=run, name=f"eaglex-solo-{req.index}", daemon=True)
        self._thread.start()

    def cycle(self) -> bool:
        """Run one cycle (the first one is the prefill); True once the request finished."""
        self._turn.release()
        self._back.acquire()
        if self.finished:
            self._thread.join()
        return self.finished


class BatchedGenerator:
    """submit() requests at any time; step() admits queued requests into free slots, runs one cycle for every
    active request and returns the requests that finished. run() steps until nothing is left."""

    def __init__(self, backend, schedule: Schedule | None = None, solo: Callable[[SamplingConfig], object] | None = None):
        """`backend`: a TorchBatchBackend; `schedule`: None = vanilla batching; `solo`: sampling -> a single-request
        generator over the same models (None: every request decodes in the slots)."""
        if schedule is not None and any(t is not None for _, t in schedule.steps) and backend.draft_kind is None:
            raise ValueError("speculative decoding needs a draft head")
        self.backend, self.spec = backend, backend.spec
        self.schedule = schedule or Schedule.fixed(None)
        if any(t is not None and t.kind == "dynamic" for _, t in self.schedule.steps):
            if getattr(backend, "exact_trees", None) == "chain":
                raise ValueError(f"this engine's output stays identical to vanilla decoding with chain trees only, "
                                 f"not the schedule {self.schedule}")
            backend.reserve_draft_rows(self.schedule.draft_rows)
        self.queue: deque[Request] = deque()
        self.active: list[Request] = []           # active[i] owns slot i
        self.submitted = 0
        self.steps = 0
        self.last_tree: TreeConfig | None = None   # what the last step ran
        self.solo_factory, self.solo = solo, None  # the single-request lane (_Solo) while a request runs there

    @property
    def in_flight(self) -> int:
        """Requests decoding now: the batch's rows and the single-request lane."""
        return len(self.active) + (self.solo is not None)

    @property
    def queue_depth(self) -> int:
        return len(self.queue)

    def submit(self, input_ids: list[int], max_new_tokens: int = 128, sampling: SamplingConfig = SamplingConfig(),
               on_tokens: Callable[[list[int]], None] | None = None,
               stop: Callable[[], bool] | None = None) -> Request:
        """Queue a request (ValueError when it does not fit the target; nothing is queued then)."""
        result, emitter = start_request(self.spec, input_ids, max_new_tokens, on_tokens, stop)
        req = Request(self.submitted, list(input_ids), sampling, result, emitter, time.perf_counter(),
                      torch.Generator().manual_seed(sampling.seed), max_new_tokens)
        self.submitted += 1
        self.queue.append(req)
        return req

    @property
    def idle(self) -> bool:
        """Nothing queued and nothing decoding."""
        return not (self.queue or self.active or self.solo)

    def run(self) -> None:
        while not self.idle:
            self.step()

    # ------------------------------------------------------------------------------------------------ one step

    def step(self) -> list[Request]:
        finished = self._admit()
        if self.solo is not None and self.solo.cycle():
            finished.append(self._finish_solo())
        if self.active:
            tree = self.schedule.tree(len(self.active))
            self.last_tree = tree
            self.steps += 1
            if tree is None:
                self._vanilla_step()
            elif tree.top_k == 1:           # a chain, or a dynamic tree that is one (as Drafter.tree decides)
                self._chain_step(tree.depth)
            else:
                self._tree_step(tree)
            finished += self._retire()
        return finished

    def _admit(self) -> list[Request]:
        finished = []
        while self.queue and self.in_flight < self.backend.slots:
            req = self.queue.popleft()
            slot = len(self.active)
            if req.emitter.done:                    # max_new_tokens 0 or no room: finished before it started
                finished.append(self._finish(req))
                continue
            t0 = time.perf_counter()
            req.admitted = t0
            if self.solo_factory is not None and not self.active and self.solo is None and \
                    (not self.queue or self.backend.slots == 1):
                self.solo = _Solo(req, self.solo_factory(req.sampling))   # alone: the single-request path
                continue
            ids = torch.tensor([req.input_ids])
            n = ids.shape[1]
            logits, feats = self._timed("target", [req], self.backend.target_forward, slice(slot, slot + 1), ids,
                                        torch.arange(n).unsqueeze(0), None, True)
            self.backend.tcache.commit(slot, torch.arange(n))
            req.length = n
            self._emit(req, [self._pick(req, logits[0, -1])])
            req.result.prefill_seconds = time.perf_counter() - t0
            req.result.prefill_target_seconds = req.result.target_seconds
            if req.done:
                self._clear(slot)
                finished.append(self._finish(req))
                continue
            if self.backend.draft_kind is not None:
                req.behind_feats, req.behind_ids = [feats[0]], req.input_ids[1:] + [req.root]
            self.active.append(req)
        return finished

    def _vanilla_step(self) -> None:
        rows, B = self.active, len(self.active)
        ids = torch.tensor([[r.root] for r in rows])
        pos = torch.tensor([[r.length] for r in rows])
        logits, feats = self._timed("target", rows, self.backend.target_forward, slice(0, B), ids, pos, None, True)
        keep = torch.arange(1)
        for i, r in enumerate(rows):
            self.backend.tcache.commit(i, keep)
            r.length += 1
            token = self._pick(r, logits[i, -1])
            if self.backend.draft_kind is not None:    # the draft reads these when speculation resumes
                r.behind_feats.append(feats[i])
                r.behind_ids.append(token)
            r.result.cycles += 1
            r.result.accept_lengths.append(self._emit(r, [token]))

    def _chain_step(self, K: int) -> None:
        rows, B = self.active, len(self.active)
        self._catch_up(K)
        backend = self.backend
        tokens = torch.empty(B, K + 1, dtype=torch.long)
        tokens[:, 0] = torch.tensor([r.root for r in rows])
        tokens[:, 1] = torch.stack([r.seed[2][0] for r in rows])
        hidden = torch.stack([r.seed[0] for r in rows]).unsqueeze(1)                 # [B,1,H]
        base = torch.tensor([[r.length] for r in rows])                              # [B,1] root positions
        for i in range(K - 1):
            h, _, top = self._timed("draft", rows, backend.draft_forward, slice(0, B), hidden,
                                    tokens[:, i + 1:i + 2], base + i, None, False, 1)
            hidden, tokens[:, i + 2] = h, top[:, 0, 0]
        backend.dcache.rollback(slice(0, B))
        logits, feats = self._timed("target", rows, backend.target_forward, slice(0, B), tokens,
                                    base + torch.arange(K + 1), None)
        self._accept([chain_tree(t) for t in tokens], logits, feats)

    def _tree_step(self, cfg: TreeConfig) -> None:
        """Every request grows its own dynamic tree (Drafter._dynamic, one request per batch row), then one target
        forward verifies all of them. All requests expand the same number of nodes per level and keep the same
        number of candidates, so the draft rows of a level and the verified trees line up without padding."""
        rows, B = self.active, len(self.active)
        self._catch_up(cfg.depth)
        backend, K = self.backend, cfg.top_k
        base = torch.tensor([[r.length] for r in rows])                              # [B,1] root positions
        hidden = torch.stack([r.seed[0] for r in rows])                              # [B,H]
        logp = torch.stack([r.seed[1][:K] for r in rows])                            # [B,K]
        # Flat candidate pool per request, appended level by level: K children of the root, then K*K per level.
        size = K + (cfg.depth - 1) * K * K
        scores = torch.empty(B, size, dtype=logp.dtype)
        tokens = torch.empty(B, size, dtype=torch.long)
        parents = torch.empty(B, size, dtype=torch.long)
        scores[:, :K], tokens[:, :K], parents[:, :K] = logp, torch.stack([r.seed[2][:K] for r in rows]), -1
        n = K
        front = torch.stack([next_frontier(s, K) for s in logp])                    # [B,F] candidates to expand
        F = front.shape[1]
        front_h = hidden[:, None].expand(B, F, hidden.shape[-1])                    # [B,F,H] output they came from
        # [B,F,processed+F]: each frontier row sees its own ancestors among its request's tree rows (and its
        # request's committed draft context, which every row sees)
        mask = torch.eye(F, dtype=torch.bool).expand(B, F, F)
        for i in range(cfg.depth - 1):
            h, lp, tk = self._timed("draft", rows, backend.draft_forward, slice(0, B), front_h,
                                    tokens.gather(1, front), (base + i).expand(B, F), mask.contiguous(), False, K)
            cu = (scores.gather(1, front)[:, :, None] + lp).reshape(B, F * K)       # cumulative log-probs
            scores[:, n:n + F * K], tokens[:, n:n + F * K] = cu, tk.reshape(B, F * K)
            parents[:, n:n + F * K] = front.repeat_interleave(K, dim=1)
            pick = torch.stack([next_frontier(c, K) for c in cu])                   # best K children per request
            came = pick // K                                                        # the frontier row of each
            front, n = pick + n, n + F * K
            F = front.shape[1]
            front_h = h.gather(1, came[..., None].expand(B, F, h.shape[-1]))
            mask = torch.cat([mask.gather(1, came[..., None].expand(B, F, mask.shape[-1])),
                              torch.eye(F, dtype=torch.bool).expand(B, F, F)], 2)
        backend.dcache.rollback(slice(0, B))
        trees = [select_dynamic(scores[b, :n], tokens[b, :n], parents[b, :n], r.root, cfg.total_tokens)
                 for b, r in enumerate(rows)]
        logits, feats = self._timed("target", rows, backend.target_forward, slice(0, B),
                                    torch.stack([t.tokens for t in trees]),
                                    base + torch.stack([t.depths for t in trees]),
                                    torch.stack([t.mask for t in trees]))
        self._accept(trees, logits, feats)

    def _accept(self, trees: list, logits: torch.Tensor, feats: torch.Tensor) -> None:
        """Verify each request's tree against its rows of the target forward (logits [B,N,V], feats [B,N,F]) as
        SpeculativeGenerator does, commit its accepted nodes into its slot and emit them."""
        backend = self.backend
        for i, (r, tree) in enumerate(zip(self.active, trees)):
            if r.sampling.greedy:
                verdict = verify_greedy(tree, logits[i])
            else:
                verdict = verify_sampling(tree, logits[i], r.sampling, r.generator)
            backend.tcache.commit(i, verdict.nodes)
            accepted = tree.tokens[verdict.nodes[1:]].tolist()
            r.result.cycles += 1
            r.result.accept_lengths.append(self._emit(r, accepted + [verdict.next_token]))
            r.behind_feats, r.behind_ids = [feats[i, verdict.nodes]], accepted + [verdict.next_token]
            r.length += int(verdict.nodes.shape[0])

    def _catch_up(self, depth: int) -> None:
        """Extend every row's draft context by what it has not read: rows more than one cycle of a tree `depth`
        deep behind alone, the others in one forward padded to the longest (padding rows are written as pending and
        never committed)."""
        rows = self.active
        short = []
        for i, r in enumerate(rows):
            n = sum(len(f) for f in r.behind_feats)
            if n > depth + 1:
                self._extend(slice(i, i + 1), [r])
            elif n:
                short.append(i)
        if short:
            self._extend(slice(0, len(rows)), rows)

    def _extend(self, sl: slice, rows: list[Request]) -> None:
        backend = self.backend
        feats = [torch.cat(r.behind_feats) if r.behind_feats else None for r in rows]
        lens = [0 if f is None else f.shape[0] for f in feats]
        M, F = max(lens), next(f for f in feats if f is not None).shape[1]
        hidden = torch.zeros(len(rows), M, F, dtype=feats[lens.index(M)].dtype)
        ids = torch.zeros(len(rows), M, dtype=torch.long)
        for j, (r, f, n) in enumerate(zip(rows, feats, lens)):
            if n:
                hidden[j, :n], ids[j, :n] = f, torch.tensor(r.behind_ids)
        start = torch.tensor([[backend.dcache.length[sl.start + j]] for j in range(len(rows))])
        h, logp, top = self._timed("draft", rows, backend.draft_forward, sl, hidden, ids, start + torch.arange(M),
                                   None, True, self.schedule.top_k)
        for j, (r, n) in enumerate(zip(rows, lens)):
            backend.dcache.commit(sl.start + j, torch.arange(n))
            if n:
                r.seed = (h[j, n - 1], logp[j, n - 1], top[j, n - 1])
                r.behind_feats, r.behind_ids = [], []

    # ------------------------------------------------------------------------------------------------ helpers

    def _timed(self, kind: str, rows: list[Request], fn, *args):
        t = time.perf_counter()
        out = fn(*args)
        dt = time.perf_counter() - t
        for r in rows:
            if kind == "target":
                r.result.target_seconds += dt
            else:
                r.result.draft_seconds += dt
        return out

    @staticmethod
    def _pick(req: Request, logits: torch.Tensor) -> int:
        if req.sampling.greedy:
            return int(argmax(logits))
        return int(sample(logits_to_probs(logits, req.sampling), req.generator))

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
                for c in self.backend.caches():
                    c.move(last, i)
                self.active[i] = self.active[last]
            else:
                self._clear(i)
            self.active.pop()
            finished.append(self._finish(req))
        return finished

    def _clear(self, slot: int) -> None:
        for c in self.backend.caches():
            c.clear(slot)

    def _finish_solo(self) -> Request:
        solo, self.solo = self.solo, None
        req = solo.req
        if solo.error is not None:
            req.error, req.result.stop_reason = solo.error, "error"
        else:
            req.result = solo.result
        return self._finish(req)

    @staticmethod
    def _finish(req: Request) -> Request:
        req.done = True
        req.finished_at = time.perf_counter()
        req.result.seconds = req.finished_at - (req.admitted or req.finished_at)
        return req


BATCH_SIZES = (1, 2, 4, 8, 16)
BATCH_CHAINS = (1, 2, 3, 4)
BATCH_TOKENS = 24              # new tokens per request while tuning


def tune_schedule(backend, prompts: list[list[int]], sizes: tuple[int, ...] = BATCH_SIZES,
                  chains: tuple[int, ...] = BATCH_CHAINS, max_new_tokens: int = BATCH_TOKENS
                  ) -> tuple[Schedule, dict[int, dict[str, float]]]:
    """Measure, for each batch size B in ascending order, aggregate tokens/s of vanilla batching and of each chain
    with B requests in flight (prompts cycled; candidates interleaved per size) and pick the schedule from the
    table (schedule_from). Once vanilla batching wins at some B, larger sizes are not measured: the schedule runs
    vanilla there anyway. Dynamic trees are not among the candidates: each would add a full pass over every size to
    the tuning time, and a schedule with one can be given by hand (Schedule.parse).
    `backend`: a batched backend with at least max(sizes) slots. -> (schedule, {B: {tree: tokens/s}})."""
    candidates = [None] + [TreeConfig.chain(k) for k in chains] if backend.draft_kind else [None]
    table: dict[int, dict[str, float]] = {}
    warm = BatchedGenerator(backend, Schedule.fixed(candidates[-1]))
    warm.submit(prompts[0], 4)
    warm.run()
    for B in sizes:
        rates = {}
        for tree in candidates:
            gen = BatchedGenerator(backend, Schedule.fixed(tree))
            for i in range(B):
                gen.submit(prompts[i % len(prompts)], max_new_tokens)
            gen.step()                      # admission (prefills) is the same for every candidate: not timed
            t = time.perf_counter()
            tokens = -sum(len(r.result.output_ids) for r in gen.active)
            done = []
            while gen.active:
                done += gen.step()
            tokens += sum(len(r.result.output_ids) for r in done)
            rates[str(tree or "vanilla")] = round(tokens / max(time.perf_counter() - t, 1e-9), 2)
        table[B] = rates
        if schedule_from({B: rates}).tree(B) is None:      # vanilla here: the schedule stays vanilla beyond
            break
    return schedule_from(table), table


SCHEDULE_MARGIN = 0.05         # a tree must beat vanilla batching by this much: interleaved tuning runs differ ~±5 %


def schedule_from(table: dict[int, dict[str, float]], margin: float = SCHEDULE_MARGIN) -> Schedule:
    """{B: {"vanilla" | tree: tokens/s}} -> the schedule: at each measured B (ascending) the fastest tree if it beats
    vanilla batching by more than `margin` (a smaller lead is within the measurement's noise, and speculation that
    does not clearly pay only risks running slower than vanilla), else vanilla, and vanilla from the first such B
    on at every larger size. Verification grows compute-bound with the batch, so a tree that lost to vanilla at B
    requests does not win at more; a later "win" in the table is noise, and following it would flip speculation on
    and off as load moves."""
    steps: list[tuple[int, TreeConfig | None]] = []
    for B in sorted(table):
        rates = table[B]
        trees = {k: v for k, v in rates.items() if k != "vanilla"}
        best = max(trees, key=trees.get, default=None)
        win = best is not None and trees[best] > (1 + margin) * rates.get("vanilla", 0.0)
        tree = TreeConfig.parse(best) if win else None
        if not steps or steps[-1][1] != tree:
            steps.append((1 if not steps else B, tree))
        if tree is None:
            break
    return Schedule(tuple(steps) or ((1, None),))
