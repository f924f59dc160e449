"""In-flight batching (runtime/batch.py): every request decodes exactly what it decodes alone, whatever else is in
the batch, with requests joining and leaving between steps, cancellations and failing callbacks mixed in.

Also the measurement behind batch_backend.py's note on numerics: whether a row's logits inside a batched forward
are bit-identical to the row alone (they are not on PyTorch CPU; on ONNX Runtime only for an unpadded row), and
how far apart they are.
"""
from __future__ import annotations

import random

import pytest
import torch
from eaglex.models.target import causal_mask
from eaglex.runtime.batch import BatchedGenerator, Schedule
from eaglex.runtime.batch_backend import TorchBatchBackend
from eaglex.runtime.generate import SpeculativeGenerator, VanillaGenerator
from eaglex.runtime.kv_cache import new_cache
from eaglex.runtime.torch_backend import TorchBackend
from eaglex.runtime.types import SamplingConfig

MAX_NEW = 40
SCHEDULES = ("1:vanilla", "1:chain:3", "1:chain:5,3:chain:2,6:vanilla")


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
    gen = BatchedGenerator(TorchBatchBackend(backends[name], slots=5, extra_rows=8), Schedule.parse(schedule))
    reqs = _staggered(gen, prompts, max_new, rng)
    assert [r.index for r in reqs] == list(range(len(prompts)))
    for r, want, n in zip(reqs, alone[name], max_new):
        assert r.done and r.error is None
        assert r.result.output_ids == want[:n], (r.index, schedule)
    if "chain" in schedule:
        assert sum(sum(r.result.accept_lengths) for r in reqs) > 1.5 * sum(r.result.cycles for r in reqs)


def test_cancelled_and_failing_requests_leave_the_others_exact(backends, alone, prompts):
    name = "llama/eagle3"
    gen = BatchedGenerator(TorchBatchBackend(backends[name], slots=6, extra_rows=4), Schedule.parse("1:chain:3"))
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


@pytest.mark.parametrize("schedule", ["1:vanilla", "1:chain:3"])
def test_sampling_is_reproducible_from_the_seed_whatever_the_batch(schedule, backends, prompts):
    """A request's sampled output depends on its seed only: alone (single-request generator), in a small batch and
    in a full one with other requests (other seeds, other settings) it is the same."""
    name = "llama/eagle3"
    b = backends[name]
    cfg = SamplingConfig(temperature=0.9, top_p=0.95, seed=1234)
    tree = Schedule.parse(schedule).tree(1)
    solo = (VanillaGenerator(b, cfg) if tree is None else SpeculativeGenerator(b, tree, cfg)).generate(prompts[5],
                                                                                                        MAX_NEW)
    outs = []
    for others in (0, 3, 9):
        gen = BatchedGenerator(TorchBatchBackend(b, slots=8, extra_rows=4), Schedule.parse(schedule))
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
    assert s.max_nodes == 5
    for bad in ("2:chain:3", "1:chain:3,1:vanilla", "1:dynamic:16/6/4", "x", "1:chain"):
        with pytest.raises(ValueError):
            Schedule.parse(bad)


def test_slot_memory_is_reported(backends):
    bb = TorchBatchBackend(backends["llama/eagle3"], slots=3, extra_rows=4)
    s = bb.spec
    target = 2 * s.num_layers * s.num_kv_heads * (s.max_context + 4) * s.head_dim * 4
    assert bb.slot_bytes > target and bb.tcache.slot_bytes == target


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
        bb = TorchBatchBackend(backends["llama/eagle3"], slots=len(LENS))
        solo = []
        for i, (p, L) in enumerate(zip(prompts, LENS)):
            c = new_cache(s.num_layers, 1, s.num_kv_heads, s.head_dim, 128, torch.float32)
            with torch.inference_mode():
                target(p[None], torch.arange(L)[None], causal_mask(L), c)
                c.commit(torch.arange(L))
                solo.append(target(new[i:i + 1], torch.arange(L, L + N)[None], causal_mask(N, L), c)[0][0])
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


@pytest.mark.parametrize("schedule", ["1:chain:3", "1:chain:5,3:chain:2,6:vanilla"])
def test_ort_batched_greedy_equals_ort_alone_vanilla(schedule, ort_engine, prompts):
    want = [VanillaGenerator(ort_engine.backend).generate(p, MAX_NEW).output_ids for p in prompts]
    rng = random.Random(schedule)
    max_new = [rng.choice([1, 7, MAX_NEW]) for _ in prompts]
    reqs = _staggered(ort_engine.batcher(5, Schedule.parse(schedule)), prompts, max_new, rng)
    for r, w, n in zip(reqs, want, max_new):
        assert r.error is None and r.result.output_ids == w[:n], r.index


def test_engine_generate_batch_matches_one_at_a_time(ort_engine, prompts):
    cfg = SamplingConfig(temperature=0.8, seed=7)
    for sampling in (SamplingConfig(), cfg):
        one = [r.output_ids for r in ort_engine.generate(prompts[:10], sampling, MAX_NEW)]
        many = [r.output_ids for r in ort_engine.generate(prompts[:10], sampling, MAX_NEW, batch=4)]
        if sampling.greedy:
            assert many == one
        else:            # same seed streams; the batch drafts chains, the engine alone its own tree
            assert many == [r.output_ids for r in ort_engine.generate(prompts[:10], sampling, MAX_NEW, batch=4)]


def test_ort_rows_bit_identical_only_when_unpadded(ort_engine):
    """Measured: MLAS GEMMs are row-invariant, so the row as long as the batch's longest is bit-identical to the
    row alone; shorter rows (masked padding columns in attention) round differently, within 1e-4."""
    from eaglex.runtime.batch_backend import batch_backend
    s = ort_engine.spec
    g = torch.Generator().manual_seed(0)
    N = 4
    prompts = [torch.randint(0, s.vocab_size, (L,), generator=g) for L in LENS]
    new = torch.randint(0, s.vocab_size, (len(LENS), N), generator=g)
    bb = batch_backend(ort_engine.backend, len(LENS))
    solo = []
    for i, (p, L) in enumerate(zip(prompts, LENS)):
        one = batch_backend(ort_engine.backend, 1)
        one.target_forward(slice(0, 1), p[None], torch.arange(L)[None])
        one.tcache.commit(0, torch.arange(L))
        solo.append(one.target_forward(slice(0, 1), new[i:i + 1], torch.arange(L, L + N)[None])[0][0])
        bb.target_forward(slice(i, i + 1), p[None], torch.arange(L)[None])
        bb.tcache.commit(i, torch.arange(L))
    batched = bb.target_forward(slice(0, len(LENS)), new, torch.tensor(LENS)[:, None] + torch.arange(N))[0]
    longest = LENS.index(max(LENS))
    assert torch.equal(batched[longest], solo[longest])
    for i in range(len(LENS)):
        assert (batched[i] - solo[i]).abs().max() < 1e-4, i


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
    from eaglex.engines.tune import tune_batching
    from eaglex.runtime.manifest import read_manifest
    manifest = read_manifest(ort_engine.path)
    lines = []
    tune_batching(ort_engine, prompts[:8], manifest, log=lines.append)
    stored = read_manifest(ort_engine.path)
    schedule = Schedule.parse(stored["batch_schedule"])
    assert ort_engine.batch_schedule() == schedule
    assert set(stored["tuning"]["batch"]) == {"1", "2", "4", "8", "16"}
    for size, row in stored["tuning"]["batch"].items():     # the schedule runs the fastest measured candidate
        pick = str(schedule.tree(int(size)) or "vanilla")
        assert row[pick] == max(row.values()), (size, row)


# ------------------------------------------------------------------------------------------------ alone in flight

def test_a_request_alone_runs_the_single_request_path_bit_identically(ort_engine, prompts):
    """One request at a time through the batcher (max batch 4, and max batch 1 with requests queued behind) is the
    single-request generator itself: the same tokens, cycles and accepted lengths, greedy and sampled; sampled, it
    is also what the same request decodes batched."""
    schedule = Schedule.parse("1:chain:3")          # fixed: the engine's stored one may change with the tuning test
    for sampling in (SamplingConfig(), SamplingConfig(temperature=0.8, top_p=0.9, seed=11)):
        # greedy: the engine's own generator; sampled: the schedule's tree at one request (the draws of a batch)
        alone = ort_engine.generator(sampling) if sampling.greedy else \
            SpeculativeGenerator(ort_engine.backend, schedule.tree(1), sampling)
        want = [alone.generate(p, MAX_NEW) for p in prompts[:4]]
        gen = ort_engine.batcher(4, schedule)
        got = []
        for p in prompts[:4]:
            got.append(gen.submit(p, MAX_NEW, sampling))
            gen.step()
            assert not gen.active and (gen.solo is not None or got[-1].done)   # alone: the single-request lane
            gen.run()
        one = ort_engine.batcher(1, schedule)
        queued = [one.submit(p, MAX_NEW, sampling) for p in prompts[:4]]
        while not one.idle:
            one.step()
            assert one.in_flight <= 1 and not one.active
        for w, r, q in zip(want, got, queued):
            for x in (r, q):
                assert x.error is None and x.result.output_ids == w.output_ids
                assert (x.result.cycles, x.result.accept_lengths) == (w.cycles, w.accept_lengths)
        if not sampling.greedy:
            many = ort_engine.batcher(4, schedule)
            batched = [many.submit(p, MAX_NEW, sampling) for p in prompts[:4]]
            many.run()
            assert [r.result.output_ids for r in batched] == [w.output_ids for w in want]


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
    assert not gen.active and gen.solo is not None, "a longer first prompt is needed for this test"
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
    assert gen.idle and gen.solo is None
