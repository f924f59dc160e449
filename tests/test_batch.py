"""In-flight batching (runtime/batch.py): every request decodes exactly what it decodes alone, whatever else is in
the batch, with requests joining and leaving between steps, cancellations and failing callbacks mixed in.

Also the measurement behind torch_backend.py's note on numerics: whether a row's logits inside a batched forward
are bit-identical to the row alone (they are not on PyTorch CPU; on ONNX Runtime only for an unpadded row), and
how far apart they are.
"""
from __future__ import annotations

import random

import pytest
import torch

from eaglex.runtime import autotune as tune_mod
from eaglex.runtime import batch as batch_mod
from eaglex.runtime.autotune import SCHEDULE_MARGIN, schedule_from
from eaglex.runtime.batch import BatchedGenerator, Schedule
from eaglex.runtime.cost import CostCurve
from eaglex.runtime.generate import SpeculativeGenerator, VanillaGenerator
from eaglex.runtime.torch_backend import TorchBackend
from eaglex.runtime.types import SamplingConfig, TreeConfig
from eaglex.runtime.verify import verify_rows

MAX_NEW = 40
# vanilla, chains and dynamic trees, mixed by batch size (with slots=5 every batch size up to 5 occurs)
MIXED = "1:dynamic:8/4/3,2:dynamic:6/3/2,4:chain:2"
# what batch tuning picks when trees win at small batches (engines/tune.batch_trees: the engine's tree, a smaller one)
TUNED = "1:dynamic:12/6/4,3:dynamic:6/4/2,5:vanilla"
# cost trees: one size per step for all its requests, chosen by the backend's measured curve
COST = "1:cost:6/4,3:cost:4/3"
SCHEDULES = ("1:vanilla", "1:chain:3", "1:chain:5,3:chain:2,6:vanilla", MIXED, "1:dynamic:12/5/4", TUNED, COST)


@pytest.fixture(scope="module")
def backends(models):
    return {name: TorchBackend(models[name.split("/")[0]], models[name]) for name in ("llama/eagle3", "qwen2/eagle1")}


@pytest.fixture(scope="module")
def alone(backends, prompts):
    """Each prompt decoded alone by vanilla decoding: what every batched run must reproduce."""
    return {name: [VanillaGenerator(b).generate(p, MAX_NEW).output_ids for p in prompts]
            for name, b in backends.items()}


def _staggered(gen: BatchedGenerator, prompts, max_new, rng, **kw):
    """Submit the prompts a few at a time between steps (requests join a running batch); run to the end."""
    reqs, todo = [], list(enumerate(prompts))
    while todo or gen.active or gen.queue:
        for _ in range(rng.randint(0, 3)):
            if todo:
                i, p = todo.pop(0)
                reqs.append(gen.submit(p, max_new[i], **kw))
        gen.step()
    return reqs


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("name", ["llama/eagle3", "qwen2/eagle1"])
def test_batched_greedy_equals_alone_vanilla(name, schedule, backends, alone, prompts):
    rng = random.Random(f"{name}{schedule}")
    max_new = [rng.choice([1, 7, MAX_NEW]) for _ in prompts]
    s = Schedule.parse(schedule)
    gen = BatchedGenerator(backends[name].with_slots(5, s.max_nodes), s)
    ran, step = set(), gen.step

    def step_and_record():
        out = step()
        ran.add(gen.last_tree)
        return out
    gen.step = step_and_record
    reqs = _staggered(gen, prompts, max_new, rng)
    assert [r.index for r in reqs] == list(range(len(prompts)))
    for r, want, n in zip(reqs, alone[name], max_new):
        assert r.done and r.error is None
        assert r.result.output_ids == want[:n], (r.index, schedule)
    assert set(s.trees) <= ran, ran                         # every tree of the schedule decoded some steps
    if None not in {s.tree(b) for b in range(1, 6)}:        # speculating at every batch size up to the 5 slots
        assert sum(sum(r.result.accept_lengths) for r in reqs) > 1.5 * sum(r.result.cycles for r in reqs)


@pytest.mark.parametrize("schedule", ["1:chain:3", MIXED])
def test_static_slots_decode_exactly(schedule, models, alone, prompts):
    """The fixed-shape forwards CUDA graphs capture per batch size (mode "static", run eagerly on the CPU): every
    batched output equals the prompt decoded alone, and a request alone in the slots gives the single-request static
    path's output, cycles and accepted lengths bit-identically."""
    b = TorchBackend(models["llama"], models["llama/eagle3"], mode="static")
    s = Schedule.parse(schedule)
    rng = random.Random(schedule)
    max_new = [rng.choice([1, 7, MAX_NEW]) for _ in prompts]
    reqs = _staggered(BatchedGenerator(b.with_slots(5, s.max_nodes), s), prompts, max_new, rng)
    for r, want, n in zip(reqs, alone["llama/eagle3"], max_new):
        assert r.error is None and r.result.output_ids == want[:n], r.index
    tree = s.tree(1)
    gen = BatchedGenerator(b.with_slots(4, tree.max_nodes), Schedule.fixed(tree))
    for p in prompts[:6]:
        w = SpeculativeGenerator(b, tree).generate(p, MAX_NEW)
        r = gen.submit(p, MAX_NEW)
        gen.run()
        assert (r.result.output_ids, r.result.cycles, r.result.accept_lengths) == \
            (w.output_ids, w.cycles, w.accept_lengths)


def test_cancelled_and_failing_requests_leave_the_others_exact(backends, alone, prompts):
    name = "llama/eagle3"
    gen = BatchedGenerator(backends[name].with_slots(6, 4), Schedule.parse("1:chain:3"))
    seen = {"n": 0}

    def boom(tokens):
        raise RuntimeError("client went away")

    def cancel_after_two():
        seen["n"] += 1
        return seen["n"] >= 2

    reqs = []
    for i, p in enumerate(prompts):
        kw = {"on_tokens": boom} if i % 5 == 1 else {"stop": cancel_after_two} if i == 3 else {}
        reqs.append(gen.submit(p, MAX_NEW, **kw))
        if i % 4 == 0:
            gen.step()
    with pytest.raises(ValueError):
        gen.submit([], MAX_NEW)                       # refused at the door, nothing queued
    with pytest.raises(ValueError):
        gen.submit([10**6], MAX_NEW)
    gen.run()
    for i, r in enumerate(reqs):
        if i % 5 == 1:
            assert r.result.stop_reason == "error" and isinstance(r.error, RuntimeError)
        elif i == 3:
            assert r.result.stop_reason == "cancelled"
            assert r.result.output_ids == alone[name][i][:len(r.result.output_ids)]
        else:
            assert r.error is None and r.result.output_ids == alone[name][i], i


@pytest.mark.parametrize("schedule", ["1:vanilla", "1:chain:3", "1:dynamic:8/4/3"])
def test_sampling_is_reproducible_from_the_seed_whatever_the_batch(schedule, backends, prompts):
    """A request's sampled output depends on its seed only: it is vanilla's sample for that seed, decoded alone
    with the schedule's tree, in a small batch and in a full one with other requests (other seeds, settings)."""
    name = "llama/eagle3"
    b = backends[name]
    cfg = SamplingConfig(temperature=0.9, top_p=0.95, seed=1234)
    tree = Schedule.parse(schedule).tree(1)
    solo = VanillaGenerator(b, cfg).generate(prompts[5], MAX_NEW)
    if tree is not None:
        assert SpeculativeGenerator(b, tree, cfg).generate(prompts[5], MAX_NEW).output_ids == solo.output_ids
    outs = []
    for others in (0, 3, 9):
        gen = BatchedGenerator(b.with_slots(8, 8), Schedule.parse(schedule))
        rng = random.Random(others)
        for j in range(others):
            gen.submit(prompts[j + 6], MAX_NEW, SamplingConfig(temperature=rng.choice([0.0, 0.7, 1.3]), seed=j))
        req = gen.submit(prompts[5], MAX_NEW, cfg)
        gen.run()
        outs.append(req.result.output_ids)
    assert outs == [solo.output_ids] * 3
    assert len(set(map(tuple, outs))) == 1


def test_schedule_grammar():
    s = Schedule.parse("1:chain:4,4:chain:2,8:vanilla")
    assert str(s) == "1:chain:4,4:chain:2,8:vanilla" and Schedule.parse(str(s)) == s
    assert [str(s.tree(b) or "vanilla") for b in (1, 3, 4, 7, 8, 32)] == ["chain:4"] * 2 + ["chain:2"] * 2 + \
        ["vanilla"] * 2
    assert (s.max_nodes, s.draft_rows, s.top_k) == (5, 5, 1)
    d = Schedule.parse("1:dynamic:16/6/4,2:chain:3,4:vanilla")
    assert str(d) == "1:dynamic:16/6/4,2:chain:3,4:vanilla" and d.tree(3) == TreeConfig.chain(3)
    assert (d.max_nodes, d.draft_rows, d.top_k) == (16, 20, 4)    # 5 draft levels of 4 rows after the first
    t = Schedule.parse(TUNED)
    assert str(t) == TUNED and Schedule.parse(str(t)) == t
    assert [str(t.tree(b) or "vanilla") for b in (1, 2, 3, 4, 5, 16)] == ["dynamic:12/6/4"] * 2 + \
        ["dynamic:6/4/2"] * 2 + ["vanilla"] * 2
    assert (t.max_nodes, t.top_k) == (12, 4)
    mixed = Schedule.parse("1:static,2:dynamic:6/4/2,4:chain:1,8:vanilla")
    assert Schedule.parse(str(mixed)) == mixed and mixed.trees == [TreeConfig("static"),
                                                                   TreeConfig.parse("dynamic:6/4/2"),
                                                                   TreeConfig.chain(1)]
    st = Schedule.parse("1:static")           # mc_sim_7b_63: 26 nodes, ranks 0-3, 10 rows expanded below the root
    assert (st.max_nodes, st.draft_rows, st.top_k) == (26, 10, 4)
    for bad in ("2:chain:3", "1:chain:3,1:vanilla", "x", "1:chain"):
        with pytest.raises(ValueError):
            Schedule.parse(bad)


@pytest.mark.parametrize("table, expected", [
    ({1: {"vanilla": 40, "chain:2": 50}, 2: {"vanilla": 74, "chain:2": 91}, 4: {"vanilla": 124, "chain:1": 121}},
     "1:chain:2,4:vanilla"),
    # a tree "winning" again after vanilla won is noise: vanilla from the first loss on
    ({1: {"vanilla": 40, "chain:2": 50}, 4: {"vanilla": 124, "chain:1": 121}, 8: {"vanilla": 188, "chain:1": 200}},
     "1:chain:2,4:vanilla"),
    ({1: {"vanilla": 40, "chain:3": 50}, 2: {"vanilla": 70, "chain:3": 80, "chain:1": 85}},
     "1:chain:3,2:chain:1"),
    ({1: {"vanilla": 50, "chain:2": 40}, 2: {"vanilla": 70, "chain:2": 90}}, "1:vanilla"),
    ({1: {"vanilla": 40, "chain:2": 50}, 2: {"vanilla": 70, "chain:2": 90}}, "1:chain:2"),
    # a lead within the margin (5 %) is not a win: 204 against 201 at 8 requests runs vanilla, from where chain:2's
    # lead (1.25x at 1, 1.01x at 8), linear in log(requests), falls to the margin: 1.05 = 1.25 - 0.24 x at x = 0.83
    ({1: {"vanilla": 40, "chain:2": 50}, 8: {"vanilla": 201, "chain:1": 204, "chain:2": 203}}, "1:chain:2,6:vanilla"),
    # the default's fp32 tuning (2026-12-06): each change starts between the sizes that measured it
    ({1: {"vanilla": 45.09, "chain:1": 67.76, "chain:2": 79.51, "dynamic:6/4/2": 96.96},
      2: {"vanilla": 83.84, "chain:1": 119.52, "chain:2": 123.7, "dynamic:6/4/2": 135.59},
      4: {"vanilla": 150.82, "chain:1": 187.43, "chain:2": 203.69, "dynamic:6/4/2": 177.09},
      8: {"vanilla": 252.28, "chain:1": 281.45, "chain:2": 266.18},
      16: {"vanilla": 355.86, "chain:1": 311.98, "chain:2": 280.12}},
     "1:dynamic:6/4/2,3:chain:2,6:chain:1,10:vanilla"),
    ({1: {"vanilla": 100, "chain:2": 105}}, "1:vanilla"),
    ({1: {"vanilla": 100, "chain:2": 105.1}}, "1:chain:2"),
    ({1: {"vanilla": 40}}, "1:vanilla"),
])
def test_schedule_from_a_measured_table(table, expected):
    assert str(schedule_from(table)) == expected


@pytest.mark.parametrize("table, b0, b1, old, new, expected", [
    # new overtakes old halfway in log(requests) between 4 and 16: from 8
    ({4: {"chain:2": 100, "chain:1": 90}, 16: {"chain:2": 100, "chain:1": 110}}, 4, 16, "chain:2", "chain:1", 8),
    # vanilla takes over where the tree's lead falls to the margin: q = 1.05 v / tree, 0.75 at 8, 1.25 at 16
    ({8: {"vanilla": 100, "chain:1": 140}, 16: {"vanilla": 100, "chain:1": 84}}, 8, 16, "chain:1", None, 12),
    ({8: {"vanilla": 100, "chain:1": 105.01}, 16: {"vanilla": 100, "chain:1": 50}}, 8, 16, "chain:1", None, 9),
    ({1: {"vanilla": 40, "chain:2": 50}, 2: {"vanilla": 90, "chain:2": 80}}, 1, 2, "chain:2", None, 2),
    # a rate not measured at one of the sizes (a wide tree after it lost): the larger size, as measured
    ({4: {"vanilla": 100, "dynamic:6/4/2": 140}, 8: {"vanilla": 100, "chain:1": 90}}, 4, 8, "dynamic:6/4/2", None, 8),
    ({4: {"chain:2": 100}, 8: {"chain:2": 100, "chain:1": 120}}, 4, 8, "chain:2", "chain:1", 8),
])
def test_a_new_choice_starts_where_it_overtakes_the_old(table, b0, b1, old, new, expected):
    from eaglex.runtime.autotune import switch_point
    got = switch_point(table, b0, b1, TreeConfig.parse(old), TreeConfig.parse(new) if new else None)
    assert got == expected and b0 < got <= b1


WIDE = tuple(TreeConfig.parse(t) for t in ("dynamic:12/6/4", "dynamic:6/4/2"))


@pytest.mark.parametrize("speeds, exact_trees, measured, expected", [
    # a dynamic tree fastest at 1 and 2: the trees are measured again at 2 and 4; a chain fastest at 4: not at 8
    ({1: {"vanilla": 40, "chain:2": 50, "dynamic:12/6/4": 60, "dynamic:6/4/2": 55},
      2: {"vanilla": 70, "chain:2": 90, "dynamic:12/6/4": 80, "dynamic:6/4/2": 95},
      4: {"vanilla": 120, "chain:2": 150, "dynamic:12/6/4": 100, "dynamic:6/4/2": 140},
      8: {"vanilla": 200, "chain:2": 240}, 16: {"vanilla": 300, "chain:2": 290}},
     None, {1: 4, 2: 4, 4: 4, 8: 2, 16: 2}, "1:dynamic:12/6/4,2:dynamic:6/4/2,3:chain:2,13:vanilla"),
    # a chain fastest alone: the trees are measured with one request only
    ({1: {"vanilla": 40, "chain:2": 60, "dynamic:12/6/4": 50, "dynamic:6/4/2": 55},
      2: {"vanilla": 70, "chain:2": 90}, 4: {"vanilla": 120, "chain:2": 110}},
     None, {1: 4, 2: 2, 4: 2}, "1:chain:2,3:vanilla"),
    # vanilla fastest alone: nothing larger is measured
    ({1: {"vanilla": 60, "chain:2": 50, "dynamic:12/6/4": 40, "dynamic:6/4/2": 45}}, None, {1: 4}, "1:vanilla"),
    # an engine exact with chains only never runs the dynamic trees
    ({1: {"vanilla": 40, "chain:2": 50}, 2: {"vanilla": 70, "chain:2": 72}}, "chain", {1: 2, 2: 2},
     "1:chain:2,2:vanilla"),
])
def test_tuning_measures_wide_trees_only_while_they_win(speeds, exact_trees, measured, expected, monkeypatch):
    """tune_schedule's candidates, with measured speeds replaced by a table: vanilla and the chains at every size
    until vanilla wins, the wider trees at the first size and then only where one of them was fastest at the size
    before."""
    runs = []

    def fake(batcher, tree, prompts, size, max_new_tokens, first=0):
        runs.append((str(tree or "vanilla"), max_new_tokens, size, first))
        return speeds[size][str(tree or "vanilla")], 1.0, []
    monkeypatch.setattr(tune_mod, "run_batch", fake)
    schedule, table = tune_mod.tune_schedule(None, [[1]], chains=(2,), trees=WIDE, chain_only=exact_trees == "chain")
    assert str(schedule) == expected and table == {b: speeds[b] for b in measured}
    assert {b: len(row) for b, row in table.items()} == measured
    warm = len(speeds[1])                                      # first every candidate once, for 4 tokens
    assert [r[:2] for r in runs[:warm]] == [(t, 4) for t in speeds[1]]
    assert all(n == tune_mod.BATCH_TOKENS for _, n, _, _ in runs[warm:])
    for b, row in table.items():      # rounds of b requests, prompts rotated, every candidate once per round
        rounds = -(-tune_mod.BATCH_MIN_REQUESTS // b)
        assert [(t, f) for t, _, size, f in runs[warm:] if size == b] == [(t, r * b) for r in range(rounds)
                                                                             for t in row]


def test_tuning_rates_over_rounds_are_tokens_over_seconds(monkeypatch):
    """A batch of one runs BATCH_MIN_REQUESTS rounds, one prompt each: a candidate that flies on one prompt and
    crawls on three is rated by its tokens over its time, not by its fast round; a round cut short by EOS counts the
    tokens it decoded, and one that decoded none only its time."""
    rounds = {"vanilla": [(40, 1.0), (40, 1.0), (40, 1.0), (40, 1.0)],
              "chain:2": [(24, 0.15), (32, 1.0), (32, 1.0), (0, 0.01)]}     # 160, 32, 32 tokens/s, nothing
    monkeypatch.setattr(tune_mod, "run_batch",
                        lambda batcher, tree, prompts, size, n, first=0: (*rounds[str(tree or "vanilla")][first], []))
    schedule, table = tune_mod.tune_schedule(None, [[1], [2], [3], [4]], sizes=(1,), chains=(2,), trees=(),
                                              chain_only=True)
    assert table == {1: {"vanilla": 40.0, "chain:2": round(88 / 2.16, 2)}} and str(schedule) == "1:vanilla"


def test_chain_only_engines_refuse_dynamic_schedules(backends):
    bb = backends["llama/eagle3"].with_slots(2, 8)
    bb.exact_trees = "chain"                      # what an int8 engine's exactness rules say
    BatchedGenerator(bb, Schedule.parse("1:chain:3"))
    with pytest.raises(ValueError, match="chain trees only"):
        BatchedGenerator(bb, Schedule.parse("1:chain:3,2:dynamic:8/4/3"))


def test_slot_memory_is_reported(backends):
    bb = backends["llama/eagle3"].with_slots(3, 4)
    s = bb.spec
    target = 2 * s.num_layers * s.num_kv_heads * (s.max_context + 4) * s.head_dim * 4
    assert bb.slot_bytes > target and bb.tcache.slot_bytes == target


# ------------------------------------------------------------------------------------------------ dynamic trees

def _swap_two_best(draft_forward):
    """A draft whose two best guesses trade places (scores stay in order): where the real draft is right, the
    target's token is now a second child, so accepted paths run through side branches of the trees."""
    def swapped(*args):
        h, logp, ids = draft_forward(*args)
        return h, logp, ids[..., [1, 0] + list(range(2, ids.shape[-1]))]
    return swapped


@pytest.mark.parametrize("name", ["llama/eagle3", "qwen2/eagle1", "ort"])
def test_tree_steps_accept_side_branches_and_commit_exactly_the_accepted_path(name, backends, prompts, monkeypatch,
                                                                              request):
    """Every cached target row of every request equals that row of its own context decoded alone, after every
    step, and every output is the vanilla one; the accepted paths leave the draft's top-1 line and skip node
    indices, so a wrong ancestor mask or a commit of the wrong rows fails here. Torch over both fixtures, and
    the ONNX Runtime engine."""
    single = request.getfixturevalue("ort_engine").backend if name == "ort" else backends[name]
    verdicts = []

    def recording(trees, logits, *args):
        vs = verify_rows(trees, logits, *args)
        verdicts.extend(zip(trees, vs))
        return vs
    monkeypatch.setattr(batch_mod, "verify_rows", recording)
    s = Schedule.parse("1:dynamic:8/4/3,3:dynamic:10/3/4")
    bb = single.with_slots(4, s.max_nodes)
    bb.draft_forward = _swap_two_best(bb.draft_forward)
    gen = BatchedGenerator(bb, s)
    rng = random.Random(0)
    todo = list(enumerate(prompts[:10]))
    reqs, max_new = [], [rng.choice([5, 20, MAX_NEW]) for _ in todo]
    want = [VanillaGenerator(single).generate(p, n).output_ids for (_, p), n in zip(todo, max_new)]
    while todo or not gen.idle:
        if todo and rng.random() < 0.5:
            i, p = todo.pop(0)
            reqs.append(gen.submit(p, max_new[i]))
        gen.step()
        for slot, r in enumerate(gen.active):
            context = r.input_ids + r.result.output_ids[:r.length - len(r.input_ids)]
            assert len(context) == r.length == bb.tcache.length[slot]
            one = single.with_slots(1)        # the context decoded alone in one forward: its keys and values
            one.target_forward(slice(0, 1), torch.tensor([context]), torch.arange(len(context))[None])
            for mine, ref in zip(bb.tcache.rows(slot, r.length), one.tcache.rows(0, r.length)):
                assert torch.allclose(mine, ref, atol=1e-4), r.index
    for r in reqs:
        assert r.error is None and r.result.output_ids == want[r.index], r.index
    assert all(not torch.equal(t.parents[1:], torch.arange(t.size - 1)) for t, _ in verdicts)   # real trees
    first_child = lambda t, n: int((t.parents == t.parents[n]).nonzero()[0]) == n
    side = [v for t, v in verdicts if any(not first_child(t, int(n)) for n in v.nodes[1:])]
    gaps = [v for _, v in verdicts if not torch.equal(v.nodes, torch.arange(v.nodes.shape[0]))]
    assert len(side) >= 10 and len(gaps) >= 10, (len(side), len(gaps), len(verdicts))


@pytest.mark.parametrize("name", ["llama/eagle3", "ort"])
def test_a_tree_in_the_slots_drafts_what_the_single_request_drafter_drafts(name, backends, prompts, monkeypatch,
                                                                          request):
    """The batched draft levels (each row masked to its own request's tree) grow, cycle by cycle, the very trees
    Drafter grows for the request alone (tokens and shape), for a request alone in the slots and inside a batch."""
    b = request.getfixturevalue("ort_engine").backend if name == "ort" else backends[name]
    tree = TreeConfig.parse("dynamic:10/4/3")
    picks = prompts[:4]
    rows = []                                  # the requests of the verification being recorded, in row order

    def recording(trees, logits, *args):
        assert len(trees) == len(rows[0])
        for log, t in zip(rows[0], trees):
            log.append((t.tokens.tolist(), t.parents.tolist()))
        return verify_rows(trees, logits, *args)
    monkeypatch.setattr(batch_mod, "verify_rows", recording)
    alone = []
    for p in picks:
        log = []
        rows[:] = [[log]]
        alone.append((SpeculativeGenerator(b, tree).generate(p, MAX_NEW), log))
    for size in (1, 4):
        logs = {}
        gen = BatchedGenerator(b.with_slots(size, tree.max_nodes), Schedule.fixed(tree))
        reqs = [gen.submit(p, MAX_NEW) for p in picks]
        while not gen.idle:
            gen._admit()
            rows[:] = [[logs.setdefault(r.index, []) for r in gen.active]]
            gen.step()
        for r, (w, log) in zip(reqs, alone):
            assert r.result.output_ids == w.output_ids
            assert r.result.accept_lengths == w.accept_lengths, (size, r.index)
            assert logs.get(r.index, []) == log, (size, r.index)


@pytest.mark.parametrize("schedule", ["1:dynamic:4/4/3", "1:cost:4/3"])
def test_a_dynamic_tree_near_the_context_end(schedule, backends):
    """Draft levels write more rows than the verified tree has nodes (dynamic:4/4/3: 9 draft rows, 4 nodes; a cost
    tree shrunk to the room left): the draft cache makes room past the context, and requests still stop where
    vanilla decoding stops."""
    b = backends["qwen2/eagle1"]
    ctx = b.spec.max_context
    g = torch.Generator().manual_seed(3)
    picks = [torch.randint(0, b.spec.vocab_size, (n,), generator=g).tolist() for n in (ctx - 9, ctx - 4, 30)]
    s = Schedule.parse(schedule)
    gen = BatchedGenerator(b.with_slots(3, s.max_nodes), s)
    reqs = [gen.submit(p, 20) for p in picks]
    gen.run()
    for r, p in zip(reqs, picks):
        assert r.error is None and r.result.output_ids == VanillaGenerator(b).generate(p, 20).output_ids


def test_a_cost_tree_shrinks_to_the_room_left(backends, alone, prompts, monkeypatch):
    """Slots sized to the requests (Engine.batcher's context: prompt + new tokens) leave less room than a cost
    tree's cap (64 nodes): its trees shrink to fit, rather than the requests decoding plainly, and stay exact."""
    flat = CostCurve(((1, 10.0), (64, 10.0)), ((1, 1.0), (64, 1.0)), 256)       # every candidate pays: the cap
    monkeypatch.setattr(batch_mod, "cost_curve", lambda b: flat)
    b, s = backends["llama/eagle3"], Schedule.parse("1:cost:6/4")
    context = max(len(p) for p in prompts[:4]) + MAX_NEW
    gen = BatchedGenerator(b.with_slots(4, s.max_nodes, context), s)
    reqs = [gen.submit(p, MAX_NEW) for p in prompts[:4]]
    gen.run()
    for r, want in zip(reqs, alone["llama/eagle3"]):
        assert r.error is None and r.result.output_ids == want
    assert sum(sum(r.result.accept_lengths) for r in reqs) > 1.5 * sum(r.result.cycles for r in reqs)


# ------------------------------------------------------------------------------------------------ numerics

LENS = (5, 17, 30, 64, 9, 41, 3, 22)


def test_torch_rows_in_a_batch_round_like_rows_alone_up_to_1e_5(backends):
    """Measured: not bit-identical (PyTorch CPU GEMMs round a row differently for different row counts M), but
    within 1e-4 of the row alone, for decode (N=1) and verification (N=4) widths."""
    target = backends["llama/eagle3"].target
    s = target.spec
    g = torch.Generator().manual_seed(0)
    for N in (1, 4):
        prompts = [torch.randint(0, s.vocab_size, (L,), generator=g) for L in LENS]
        new = torch.randint(0, s.vocab_size, (len(LENS), N), generator=g)
        bb = backends["llama/eagle3"].with_slots(len(LENS))
        solo = []
        for i, (p, L) in enumerate(zip(prompts, LENS)):
            one = backends["llama/eagle3"].with_slots(1)
            one.target_forward(slice(0, 1), p[None], torch.arange(L)[None])
            one.target_commit(0, torch.arange(L))
            solo.append(one.target_forward(slice(0, 1), new[i:i + 1], torch.arange(L, L + N)[None])[0][0])
            bb.target_forward(slice(i, i + 1), p[None], torch.arange(L)[None])
            bb.tcache.commit(i, torch.arange(L))
        pos = torch.tensor(LENS)[:, None] + torch.arange(N)
        batched = bb.target_forward(slice(0, len(LENS)), new, pos)[0]
        for i in range(len(LENS)):
            assert (batched[i] - solo[i]).abs().max() < 1e-4, (N, i)
            assert torch.equal(batched[i].argmax(-1), solo[i].argmax(-1))


# ------------------------------------------------------------------------------------------------ ONNX Runtime

@pytest.fixture(scope="module")
def ort_engine(models, tmp_path_factory):
    from eaglex.engines.build import build_engine
    from eaglex.runtime.engine import open_engine
    out = tmp_path_factory.mktemp("batch-engine") / "llama-eagle3"
    build_engine(models["llama"], models["llama/eagle3"], out, progress=False)
    return open_engine(out)


@pytest.mark.parametrize("schedule", ["1:chain:3", "1:chain:5,3:chain:2,6:vanilla", MIXED, TUNED])
def test_ort_batched_greedy_equals_ort_alone_vanilla(schedule, ort_engine, prompts):
    want = [VanillaGenerator(ort_engine.backend).generate(p, MAX_NEW).output_ids for p in prompts]
    rng = random.Random(schedule)
    max_new = [rng.choice([1, 7, MAX_NEW]) for _ in prompts]
    reqs = _staggered(ort_engine.batcher(5, Schedule.parse(schedule)), prompts, max_new, rng)
    for r, w, n in zip(reqs, want, max_new):
        assert r.error is None and r.result.output_ids == w[:n], r.index


def test_ort_sampling_through_dynamic_trees_is_reproducible_whatever_the_batch(ort_engine, prompts):
    """A sampled request drawing through a dynamic tree decodes vanilla's sample for its seed, alone (single-request
    generator) and batched with other requests of other seeds and settings."""
    tree = TreeConfig.parse("dynamic:8/4/3")
    cfg = SamplingConfig(temperature=0.9, top_p=0.95, seed=99)
    want = VanillaGenerator(ort_engine.backend, cfg).generate(prompts[7], MAX_NEW).output_ids
    assert SpeculativeGenerator(ort_engine.backend, tree, cfg).generate(prompts[7], MAX_NEW).output_ids == want
    for others in (0, 4):
        gen = ort_engine.batcher(6, Schedule.fixed(tree))
        for j in range(others):
            gen.submit(prompts[j + 8], MAX_NEW, SamplingConfig(temperature=[0.0, 0.7][j % 2], seed=j))
        req = gen.submit(prompts[7], MAX_NEW, cfg)
        gen.run()
        assert req.result.output_ids == want, others


def test_engine_generate_batch_matches_one_at_a_time(ort_engine, prompts):
    cfg = SamplingConfig(temperature=0.8, seed=7)
    for sampling in (SamplingConfig(), cfg):
        one = [r.output_ids for r in ort_engine.generate(prompts[:10], sampling, MAX_NEW)]
        many = [r.output_ids for r in ort_engine.generate(prompts[:10], sampling, MAX_NEW, batch=4)]
        assert many == one      # sampled too: the batch drafts chains, the engine alone its own tree, same draws


def test_ort_rows_bit_identical_padded_or_not(ort_engine):
    """MLAS GEMMs are row-invariant and the engine's attention is row-independent (export/row_attention.py: masked
    padding columns add exact zeros), so every row of a batch is bit-identical to the row alone, the longest and
    the padded ones."""
    s = ort_engine.spec
    g = torch.Generator().manual_seed(0)
    N = 4
    prompts = [torch.randint(0, s.vocab_size, (L,), generator=g) for L in LENS]
    new = torch.randint(0, s.vocab_size, (len(LENS), N), generator=g)
    bb = ort_engine.backend.with_slots(len(LENS))
    solo = []
    for i, (p, L) in enumerate(zip(prompts, LENS)):
        one = ort_engine.backend.with_slots(1)
        one.target_forward(slice(0, 1), p[None], torch.arange(L)[None])
        one.tcache.commit(0, torch.arange(L))
        solo.append(one.target_forward(slice(0, 1), new[i:i + 1], torch.arange(L, L + N)[None])[0][0])
        bb.target_forward(slice(i, i + 1), p[None], torch.arange(L)[None])
        bb.tcache.commit(i, torch.arange(L))
    batched = bb.target_forward(slice(0, len(LENS)), new, torch.tensor(LENS)[:, None] + torch.arange(N))[0]
    for i in range(len(LENS)):
        assert torch.equal(batched[i], solo[i]), i


def test_cli_generate_batch(models, prompts, tmp_path):
    import json

    from eaglex.cli import main
    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in prompts[:8]))
    outs = {}
    for batch in (1, 3):
        out = tmp_path / f"out{batch}.jsonl"
        assert main(["generate", "--target", str(models["qwen2"]), "--draft", str(models["qwen2/eagle1"]),
                     "--prompts", str(src), "--max-new-tokens", "24", "--batch", str(batch), "--out", str(out)]) == 0
        outs[batch] = [json.loads(line)["output_ids"] for line in out.read_text().splitlines()]
    assert outs[3] == outs[1] and len(outs[1]) == 8
    assert main(["generate", "--target", str(models["qwen2"]), "--prompts", str(src), "--batch", "0"]) != 0


def test_tuning_stores_a_batch_schedule_the_engine_runs(ort_engine, prompts):
    from eaglex.engines.tune import batch_trees, tune_batching
    from eaglex.runtime.manifest import read_manifest
    manifest = read_manifest(ort_engine.path)
    lines = []
    tune_batching(ort_engine, prompts[:8], manifest, log=lines.append)
    stored = read_manifest(ort_engine.path)
    schedule = Schedule.parse(stored["batch_schedule"])
    assert ort_engine.batch_schedule() == schedule
    measured = stored["tuning"]["batch"]
    sizes = [int(b) for b in measured]
    assert sizes == [1, 2, 4, 8, 16][:len(sizes)]              # ascending, stopped at most at the last size
    for size, row in measured.items():     # the fastest measured tree where it beats vanilla by the margin, or vanilla
        pick = str(schedule.tree(int(size)) or "vanilla")
        best = max(row.values())
        assert row[pick] == best or (pick == "vanilla" and best <= (1 + SCHEDULE_MARGIN) * row["vanilla"]), (size, row)
    if len(sizes) < 5:                                        # measuring stopped where vanilla won: vanilla beyond
        assert max(row.values()) <= (1 + SCHEDULE_MARGIN) * row["vanilla"] and schedule.tree(10 ** 6) is None
    # beside the chains, the engine's own tree and a smaller dynamic one, measured where a tree can still win
    wide = [str(t) for t in batch_trees(ort_engine.tree)]
    assert wide == [str(ort_engine.tree), "dynamic:6/4/2"] and all(t in measured["1"] for t in wide)
    for before, size in zip(sizes, sizes[1:]):
        last = measured[str(before)]
        assert (max(last, key=last.get) in wide) == all(t in measured[str(size)] for t in wide), measured
    # whatever it picked runs every request exactly, a request alone on the engine's own tree
    want = [VanillaGenerator(ort_engine.backend).generate(p, MAX_NEW).output_ids for p in prompts[:12]]
    gen = ort_engine.batcher(5)
    reqs = [gen.submit(p, MAX_NEW) for p in prompts[:12]]
    gen.run()
    assert [r.result.output_ids for r in reqs] == want, stored["batch_schedule"]


# ------------------------------------------------------------------------------------------------ admission and width

@pytest.mark.parametrize("lengths, kw, groups", [
    ([], {}, []),
    ([10, 10, 10], {}, [[0, 1, 2]]),
    ([100, 10], {}, [[0], [1]]),                               # 200 padded rows for 110 real ones: apart
    ([90, 100, 95], {}, [[1, 2, 0]]),                          # longest first; 300 rows for 285 real ones
    ([33, 30, 27, 12], {}, [[0, 1, 2], [3]]),                  # the 12 would pad 4 x 33 over 102 real rows
    ([2000, 2000], {"max_keys": 1024}, [[0], [1]]),           # past the row-independent keys: alone
    ([1000] * 5, {"max_rows": 4096}, [[0, 1, 2, 3], [4]]),     # rows per forward bounded
    ([8, 8, 8], {"slack": 1.0}, [[0, 1, 2]]),                  # no padding at all still groups
])
def test_prefill_groups(lengths, kw, groups):
    assert batch_mod.prefill_groups(lengths, **kw) == groups


def test_left_pad():
    pad, offsets, mask = batch_mod.left_pad([3, 1])
    assert pad.tolist() == [0, 2] and offsets.tolist() == [[0, 1, 2], [0, 0, 0]]
    assert mask[0].tolist() == [[True, False, False], [True, True, False], [True, True, True]]   # causal
    assert mask[1].tolist() == [[True, False, False], [False, True, False], [False, False, True]]  # pads: itself
    pad, offsets, mask = batch_mod.left_pad([2, 2])
    assert pad.tolist() == [0, 0] and offsets.tolist() == [[0, 1], [0, 1]] and mask is None


def _rows(backend, prompt):
    """A prompt prefilled alone on one slot: its target and draft KV rows."""
    gen = BatchedGenerator(backend.with_slots(1, 4), Schedule.parse("1:chain:3"))
    gen.submit(prompt, 2)
    gen._admit()
    n = len(prompt)
    c = gen.backend
    return c.tcache.rows(0, n), c.dcache.rows(0, n)


@pytest.mark.parametrize("name", ["ort", "llama/eagle3"])
def test_requests_joining_together_prefill_in_one_forward(name, backends, request, monkeypatch):
    """Four prompts queued together prefill in the forwards prefill_groups gives (2 here, not 4): ONNX Runtime's
    rows bit-identical to each prompt prefilled alone (row-independent attention, left padding masked), PyTorch's
    within its batch rounding, and every output the alone-vanilla one."""
    b = request.getfixturevalue("ort_engine").backend if name == "ort" else backends[name]
    g = torch.Generator().manual_seed(1)
    picks = [torch.randint(0, b.spec.vocab_size, (n,), generator=g).tolist() for n in (33, 30, 27, 12)]
    gen = BatchedGenerator(b.with_slots(4, 4), Schedule.parse("1:chain:3"))
    calls = []
    forward = gen.backend.target_forward

    def counting(rows, ids, *args):
        calls.append(ids.shape)
        return forward(rows, ids, *args)
    monkeypatch.setattr(gen.backend, "target_forward", counting)
    reqs = [gen.submit(p, MAX_NEW) for p in picks]
    gen._admit()
    assert calls == [(3, 33), (1, 12)]
    for slot, r in enumerate(gen.active):
        for mine, alone in zip((gen.backend.tcache, gen.backend.dcache), _rows(b, r.input_ids)):
            for x, y in zip(mine.rows(slot, len(r.input_ids)), alone):
                assert torch.equal(x, y) if name == "ort" else torch.allclose(x, y, atol=1e-4), (slot, r.index)
    gen.run()
    for r, p in zip(reqs, picks):
        assert r.error is None and r.result.output_ids == VanillaGenerator(b).generate(p, MAX_NEW).output_ids


def test_ort_empty_trailing_slots_ride_along_until_half_the_width(ort_engine):
    """A forward over the first slots with the last ones empty runs in place over all of them (the buffers keep
    their width: no copy of every row), bit-identical to the same forward in buffers as narrow as its rows; at
    half the width (NARROW) the buffers narrow."""
    from eaglex.runtime.ort_cache import NARROW
    s = ort_engine.spec
    g = torch.Generator().manual_seed(2)
    L, N = (20, 9, 31, 14), 3
    prompts = [torch.randint(0, s.vocab_size, (n,), generator=g) for n in L]
    new = torch.randint(0, s.vocab_size, (len(L), N), generator=g)

    def filled(slots):
        bb = ort_engine.backend.with_slots(slots)
        for i in range(slots):
            bb.target_forward(slice(i, i + 1), prompts[i][None], torch.arange(L[i])[None])
            bb.tcache.commit(i, torch.arange(L[i]))
        bb.target_forward(slice(0, slots), new[:slots], torch.tensor(L[:slots])[:, None] + torch.arange(N))  # widen
        bb.tcache.rollback(slice(0, slots))
        return bb
    wide = filled(4)
    wide.clear(3)
    pos = torch.tensor(L[:3])[:, None] + torch.arange(N)
    got = wide.target_forward(slice(0, 3), new[:3], pos)
    assert wide.tcache.width == 4 and wide.tcache.pending[3] == 0 and 3 > 4 * NARROW
    narrow = filled(3)
    want = narrow.target_forward(slice(0, 3), new[:3], pos)
    assert narrow.tcache.width == 3
    for x, y in zip(got, want):
        assert torch.equal(x, y)
    wide.tcache.rollback(slice(0, 3))
    wide.clear(2)
    wide.target_forward(slice(0, 2), new[:2], pos[:2])
    assert wide.tcache.width == 2                  # 2 <= 4 * NARROW: narrowed


def test_slots_sized_to_the_requests_draft_to_their_last_token(ort_engine, prompts, monkeypatch):
    """Engine.batcher sizes slots to prompt + new tokens; trees may still run past a request's end into the rows
    its slot keeps beyond it, so no request finishes with plain steps (which would split a step's batch), and
    every output is the alone-vanilla one."""
    picks = prompts[:4]
    context = max(len(p) for p in picks) + MAX_NEW
    gen = ort_engine.batcher(4, Schedule.parse("1:chain:4"), context=context)
    plain = []
    monkeypatch.setattr(gen, "_vanilla", lambda rows: plain.append(rows))
    reqs = [gen.submit(p, MAX_NEW) for p in picks]
    gen.run()
    assert plain == []
    for r, p in zip(reqs, picks):
        assert r.result.output_ids == VanillaGenerator(ort_engine.backend).generate(p, MAX_NEW).output_ids


# ------------------------------------------------------------------------------------------------ alone in flight

def test_a_request_alone_runs_the_single_request_path_bit_identically(ort_engine, prompts):
    """One request at a time through the batcher (max batch 4: a batch of one in the slots; max batch 1 with
    requests queued behind: the engine's own backend) decodes what the single-request generator decodes with the
    same tree: the same tokens, cycles and accepted lengths, greedy and sampled; by default with the engine's own
    tree; sampled, it is also what the same request decodes batched."""
    schedule = Schedule.parse("1:chain:3")          # fixed: the engine's stored one may change with the tuning test
    for sampling in (SamplingConfig(), SamplingConfig(temperature=0.8, top_p=0.9, seed=11)):
        for given, alone in ((schedule, SpeculativeGenerator(ort_engine.backend, schedule.tree(1), sampling)),
                             (None, ort_engine.generator(sampling))):
            want = [alone.generate(p, MAX_NEW) for p in prompts[:4]]
            gen = ort_engine.batcher(4, given)
            got = []
            for p in prompts[:4]:
                got.append(gen.submit(p, MAX_NEW, sampling))
                gen.step()
                assert len(gen.active) <= 1                 # alone: a batch of one
                gen.run()
            one = ort_engine.batcher(1, given)
            queued = [one.submit(p, MAX_NEW, sampling) for p in prompts[:4]]
            while not one.idle:
                one.step()
                assert one.in_flight <= 1
            for w, r, q in zip(want, got, queued):
                for x in (r, q):
                    assert x.error is None and x.result.output_ids == w.output_ids
                    assert (x.result.cycles, x.result.accept_lengths) == (w.cycles, w.accept_lengths)
        if not sampling.greedy:
            want = [SpeculativeGenerator(ort_engine.backend, schedule.tree(1), sampling).generate(p, MAX_NEW)
                    for p in prompts[:4]]
            many = ort_engine.batcher(4, schedule)
            batched = [many.submit(p, MAX_NEW, sampling) for p in prompts[:4]]
            many.run()
            assert [r.result.output_ids for r in batched] == [w.output_ids for w in want]


@pytest.mark.parametrize("name", ["llama/eagle3", "qwen2/eagle1", "ort"])
def test_a_lone_request_in_the_slots_is_bit_identical_to_the_single_request_path(name, backends, prompts, request):
    """A request decoded alone in a batched backend's slots gives the output, cycles and accepted lengths the
    single-request generator gives on the single-request backend, for every tree kind, greedy and sampled; greedy,
    both equal vanilla decoding (itself checked against transformers in test_exactness)."""
    b = request.getfixturevalue("ort_engine").backend if name == "ort" else backends[name]
    trees = ["chain:3", "dynamic:10/4/3", "dynamic:16/6/4", "cost:6/4"] + (["static"] if name != "ort" else [])
    for sampling in (SamplingConfig(), SamplingConfig(temperature=0.9, top_p=0.95, seed=5)):
        vanilla = [VanillaGenerator(b, sampling).generate(p, MAX_NEW) for p in prompts[:6]]
        for text in trees:
            tree = TreeConfig.parse(text)
            single = [SpeculativeGenerator(b, tree, sampling).generate(p, MAX_NEW) for p in prompts[:6]]
            gen = BatchedGenerator(b.with_slots(4, tree.max_nodes), Schedule.fixed(tree))
            for p, w, v in zip(prompts[:6], single, vanilla):
                r = gen.submit(p, MAX_NEW, sampling)
                gen.run()
                assert r.error is None and r.result.output_ids == w.output_ids, (text, sampling)
                assert (r.result.cycles, r.result.accept_lengths) == (w.cycles, w.accept_lengths), (text, sampling)
                if sampling.greedy:
                    assert w.output_ids == v.output_ids, text


def test_requests_joining_a_request_alone_batch_next_to_it(ort_engine, prompts):
    """The first request runs alone; the others join while it decodes and batch in the slots; a cancelled one and
    one whose callback fails (in either lane) end alone; every other output is the alone-vanilla one."""
    want = [VanillaGenerator(ort_engine.backend).generate(p, MAX_NEW).output_ids for p in prompts]
    gen = ort_engine.batcher(4)

    def boom(tokens):
        raise RuntimeError("client went away")
    calls = {"n": 0}

    def cancel_soon():
        calls["n"] += 1
        return calls["n"] >= 3

    first = gen.submit(prompts[0], MAX_NEW)
    gen.step()
    assert len(gen.active) == 1 and not first.done, "a longer first prompt is needed for this test"
    reqs = [first]
    for i, p in enumerate(prompts[1:], 1):
        kw = {"on_tokens": boom} if i == 2 else {"stop": cancel_soon} if i == 3 else {}
        reqs.append(gen.submit(p, MAX_NEW, **kw))
        gen.step()
        assert gen.in_flight <= 4
    gen.run()
    for i, r in enumerate(reqs):
        assert r.done
        if i == 2:
            assert isinstance(r.error, RuntimeError) and r.result.stop_reason == "error"
        elif i == 3:
            assert r.error is None and r.result.stop_reason == "cancelled"
            assert r.result.output_ids == want[i][:len(r.result.output_ids)]
        else:
            assert r.error is None and r.result.output_ids == want[i], i
    solo_fail = gen.submit(prompts[1], MAX_NEW, on_tokens=boom)
    gen.run()
    assert isinstance(solo_fail.error, RuntimeError) and solo_fail.result.stop_reason == "error"
    assert gen.idle


def test_bench_batched_rows_run_generate_batch_and_match_vanilla(ort_engine, prompts):
    """`eaglex bench --batch-sizes`: per B, vanilla batching and the engine's schedule through Engine.generate(batch=B),
    every output the one-at-a-time vanilla one, the tree the schedule runs at B named, B=1 the reference."""
    from eaglex.bench_batch import run_batched
    rows = run_batched("ort", ort_engine, prompts[:6], (1, 3), 12)
    schedule = ort_engine.speculative().batch_schedule().alone(ort_engine.speculative().tree)
    assert [r["requests"] for r in rows] == [1, 3]
    assert [r["tree"] for r in rows] == [str(schedule.tree(1)), str(schedule.tree(3) or "vanilla")]
    assert all(r["identical"] == "12/12" and r["vanilla_tokens_per_s"] > 0 and r["schedule_tokens_per_s"] > 0
               for r in rows)
    assert rows[0]["over_one_at_a_time"] == 1.0


@pytest.mark.parametrize("text, sizes", [("1,4,16", (1, 4, 16)), ("16, 4,4", (4, 16)), (None, ()), ("0", None),
                                         ("a,b", None), (",", None)])
def test_bench_batch_sizes_option(text, sizes):
    from eaglex.base.errors import ModelError
    from eaglex.cli import _batch_sizes
    if sizes is None:
        with pytest.raises(ModelError, match="--batch-sizes"):
            _batch_sizes(text)
    else:
        assert _batch_sizes(text) == sizes
