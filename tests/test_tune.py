"""Tuning decides what an engine runs by default: its best tree, or vanilla when vanilla measured faster than every
tree (then the best tree is kept for an explicit method, and every entry point says so). The measurements are
replaced by fixed answers so that the decision, not the machine's load, is under test."""
from __future__ import annotations

import json
import shutil

import pytest
from helpers import write_prompt_file

import eaglex.engines.tune as tune_mod
from eaglex.cli import main
from eaglex.engines.build import build_engine
from eaglex.engines.tune import tune_engine
from eaglex.runtime.autotune import TuneRow
from eaglex.runtime.batch import Schedule
from eaglex.runtime.cost import COST_SIZES, CostCurve, cost_curve
from eaglex.runtime.engine import open_engine, open_models
from eaglex.runtime.generate import SpeculativeGenerator, VanillaGenerator
from eaglex.runtime.manifest import MANIFEST, read_manifest, write_manifest
from eaglex.runtime.types import TreeConfig
from eaglex.serving.loader import load

BEST = TreeConfig.parse("chain:2")           # no default uses it: the tree an entry point runs says where it came from
OTHER = TreeConfig.parse("dynamic:8/4/3")
SCHEDULE = Schedule.parse("1:chain:2,4:vanilla")

# name: (vanilla tokens/s, best tree's tokens/s, the method open_engine runs by default)
CASES = {
    "vanilla faster": (20.0, 10.0, "vanilla"),
    "tree faster": (10.0, 20.0, "eagle3"),
    "a tie keeps the tree": (10.0, 10.0, "eagle3"),
}


@pytest.fixture(scope="module")
def built(models, tmp_path_factory):
    out = tmp_path_factory.mktemp("tune") / "llama-eagle3"
    build_engine(models["llama"], models["llama/eagle3"], out, progress=False)
    return out


@pytest.fixture()
def measured(monkeypatch):
    """measured(vanilla, tree): autotune answers these tokens/s (BEST the fastest tree, OTHER slower) and the batch
    tuning a fixed schedule, so a tuning run takes no time."""
    def set_speeds(vanilla: float, tree: float):
        rows = [TuneRow(None, 10 / vanilla, 10, 1.0, True), TuneRow(BEST, 10 / tree, 10, 2.0, True),
                TuneRow(OTHER, 10 / (tree / 2), 10, 2.5, True)]
        monkeypatch.setattr(tune_mod, "autotune", lambda *a, **k: (BEST, rows))
    monkeypatch.setattr(tune_mod, "tune_schedule", lambda batcher, prompts, **kw: (SCHEDULE, {1: {"vanilla": 1.0}}))
    return set_speeds


@pytest.fixture()
def fresh(built, tmp_path):
    """A copy of the built engine that was never tuned."""
    out = tmp_path / "engine"
    shutil.copytree(built, out)
    return out


def _tune(folder, prompts, **kw) -> list[str]:
    lines = []
    tune_engine(open_engine(folder), prompts[:2], log=lines.append, **kw)
    return lines


@pytest.mark.parametrize("case", CASES)
def test_tuning_stores_the_fastest_as_the_default(case, fresh, measured, prompts):
    vanilla, tree, want = CASES[case]
    measured(vanilla, tree)
    decision = next(line for line in _tune(fresh, prompts) if line.startswith("  -> "))   # the tree's, not batching's
    m = read_manifest(fresh)
    assert m["tree"] == "chain:2" and m["method"] == "eagle3"             # the head's method and best tree stay
    assert m["tuning"]["method"] == want and m["batch_schedule"] == str(SCHEDULE)
    curve = CostCurve.from_tuning(m["tuning"])            # the cost trees' curve, measured while tuning
    assert [n for n, _ in curve.verify_ms] == list(COST_SIZES) == [n for n, _ in curve.draft_ms]
    engine = open_engine(fresh)
    assert cost_curve(engine.backend) == curve
    assert engine.method == want
    if want == "vanilla":
        assert engine.tree is None and engine.kept_tree == BEST
        assert isinstance(engine.generator(), VanillaGenerator)
        assert engine.batch_schedule() == Schedule.fixed(None)
        assert decision == "  -> vanilla (fastest here; the best tree, chain:2, is kept for --method eagle3)"
    else:
        assert engine.tree == BEST and engine.kept_tree is None
        assert isinstance(engine.generator(), SpeculativeGenerator)
        assert engine.batch_schedule() == SCHEDULE
        assert decision == "  -> chain:2"
    # whatever the default, asking for the head runs its best tree, and asking for vanilla runs vanilla
    assert (open_engine(fresh, method="eagle3").method, open_engine(fresh, method="eagle3").tree) == ("eagle3", BEST)
    assert (engine.speculative().method, engine.speculative().tree) == ("eagle3", BEST)
    explicit = open_engine(fresh, method="vanilla")
    assert (explicit.method, explicit.kept_tree) == ("vanilla", None)
    assert (open_engine(fresh, tree=OTHER).method, open_engine(fresh, tree=OTHER).tree) == ("eagle3", OTHER)


def test_the_open_engine_runs_the_decision_at_once_and_a_forced_retune_can_reverse_it(fresh, measured, prompts):
    measured(20.0, 10.0)
    engine = open_engine(fresh)
    tune_engine(engine, prompts[:2], log=lambda _: None)
    assert (engine.method, engine.tree, engine.kept_tree) == ("vanilla", None, BEST)
    lines = []
    tune_engine(open_engine(fresh), prompts[:2], log=lines.append)      # tuned before: says what it runs
    assert len(lines) == 1 and lines[0].startswith("vanilla (tuned on ") and "chain:2" in lines[0]
    measured(10.0, 20.0)
    engine = open_engine(fresh)
    tune_engine(engine, prompts[:2], force=True, log=lambda _: None)
    assert (engine.method, engine.tree, engine.kept_tree) == ("eagle3", BEST, None)
    assert read_manifest(fresh)["tuning"]["method"] == "eagle3"
    assert open_engine(fresh).method == "eagle3"


def test_engines_tuned_before_the_decision_was_recorded_run_their_tree(fresh):
    m = read_manifest(fresh)
    m["tree"], m["tuning"] = "chain:2", {"cpu": "x", "cores": 2, "tokens_per_s": {"vanilla": 20.0, "chain:2": 10.0}}
    write_manifest(fresh, m)
    engine = open_engine(fresh)
    assert (engine.method, engine.tree, engine.kept_tree) == ("eagle3", BEST, None)


def test_model_folders_tuned_in_process_keep_the_heads_method(models, measured, prompts):
    """No manifest: the decision lives in the open Engine; an EAGLE-1/2 head's method is eagle2."""
    measured(20.0, 10.0)
    engine = open_models(models["llama"], models["llama/eagle1"])
    tune_engine(engine, prompts[:2], log=lambda _: None)
    assert (engine.method, engine.kept_tree) == ("vanilla", BEST)
    assert (engine.speculative().method, engine.speculative().tree) == ("eagle2", BEST)


# ------------------------------------------------------------------------------------------------ entry points

@pytest.fixture()
def vanilla_tuned(fresh, measured, prompts):
    measured(20.0, 10.0)
    _tune(fresh, prompts)
    return fresh


@pytest.mark.parametrize("flags,trees", [([], set()), (["--method", "eagle3"], {BEST}), (["--tree", "chain:3"],
                                                                                         {TreeConfig.chain(3)})])
def test_generate_runs_vanilla_unless_told_otherwise(flags, trees, vanilla_tuned, trees_run, tmp_path, prompts):
    assert main(["generate", "--engine", str(vanilla_tuned), "--prompts", str(write_prompt_file(tmp_path, prompts, 2)),
                 "--max-new-tokens", "4", "--out", str(tmp_path / "o.jsonl"), *flags]) == 0
    assert set(trees_run) == trees


def test_check_still_checks_the_heads_tree(vanilla_tuned, trees_run, tmp_path, prompts, capsys):
    assert main(["check", "--engine", str(vanilla_tuned), "--prompts", str(write_prompt_file(tmp_path, prompts, 2)),
                 "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr()
    assert set(trees_run) == {BEST} and "eagle3, tree chain:2" in out.out and "runs vanilla by default" in out.err
    assert main(["check", "--engine", str(vanilla_tuned), "--prompts", str(write_prompt_file(tmp_path, prompts, 2)),
                 "--method", "vanilla"]) != 0                               # vanilla asked for: nothing to check


def test_triton_loader_runs_vanilla(vanilla_tuned):
    assert (load(vanilla_tuned).method, load(vanilla_tuned).tree) == ("vanilla", None)
    assert (load(vanilla_tuned, tree="chain:3").method, load(vanilla_tuned, tree="chain:3").tree) == \
        ("eagle3", TreeConfig.chain(3))


def test_bench_shows_vanilla_and_the_kept_tree(vanilla_tuned, tmp_path, prompts):
    assert main(["bench", "--engine", str(vanilla_tuned), "--prompts", str(write_prompt_file(tmp_path, prompts, 2)),
                 "--trees", "auto", "--max-new-tokens", "4", "--out", str(tmp_path / "b.json")]) == 0
    rows = json.loads((tmp_path / "b.json").read_text())["rows"]
    assert [(r["method"], r["tree"]) for r in rows] == [("vanilla", "-"), ("eagle3", "chain:2 (tuned: vanilla faster)")]


def test_reading_commands_never_write_the_engine(fresh, measured, trees_run, tmp_path, prompts, capsys):
    """--tree auto (and bench's auto) on an engine never tuned: measured for this run only, and says how to store it."""
    measured(10.0, 20.0)
    before = (fresh / MANIFEST).read_bytes()
    f = write_prompt_file(tmp_path, prompts, 2)
    assert main(["check", "--engine", str(fresh), "--prompts", str(f), "--tree", "auto", "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr()
    assert set(trees_run) == {BEST} and "eagle3, tree chain:2" in out.out
    assert f"--tree auto: measured for this run only: `eaglex tune --engine {fresh} --prompts FILE`" in out.err
    assert main(["bench", "--engine", str(fresh), "--prompts", str(f), "--trees", "auto", "--max-new-tokens", "4",
                 "--out", str(tmp_path / "b.json")]) == 0
    assert [r["tree"] for r in json.loads((tmp_path / "b.json").read_text())["rows"]] == ["-", "chain:2 (tuned)"]
    assert (fresh / MANIFEST).read_bytes() == before


def test_eaglex_tune_stores_the_decision(fresh, measured, tmp_path, prompts, capsys):
    f = write_prompt_file(tmp_path, prompts, 2)
    measured(20.0, 10.0)
    assert main(["tune", "--engine", str(fresh), "--prompts", str(f)]) == 0
    assert read_manifest(fresh)["tuning"]["method"] == "vanilla" and read_manifest(fresh)["tree"] == "chain:2"
    assert open_engine(fresh).method == "vanilla"
    capsys.readouterr()
    assert main(["tune", "--engine", str(fresh), "--prompts", str(f)]) == 0      # tuned before: says so, no change
    assert capsys.readouterr().out.startswith("vanilla (tuned on ")
    measured(10.0, 20.0)
    assert main(["tune", "--engine", str(fresh), "--prompts", str(f), "--force"]) == 0
    assert read_manifest(fresh)["tuning"]["method"] == "eagle3" and open_engine(fresh).tree == BEST


def test_eaglex_tune_refuses_what_it_cannot_store_in(models, tmp_path, prompts, capsys):
    f = write_prompt_file(tmp_path, prompts, 2)
    assert main(["tune", "--engine", str(models["llama"]), "--prompts", str(f)]) == 2
    assert "is not an engine folder" in capsys.readouterr().err


def test_engine_demo_says_tuning_chose_vanilla(vanilla_tuned, prompts, capsys):
    from eaglex.make_engine import demo
    demo(open_engine(vanilla_tuned), prompts[1], 6)
    lines = capsys.readouterr().out.splitlines()
    assert "head eagle3 chain:2" in lines[-2] and "identical: yes" in lines[-2]
    assert lines[-1].startswith("tuning measured vanilla faster than every tree") and "--method eagle3" in lines[-1]


def test_autotune_alternates_the_ladder_and_brackets_it_with_vanilla(monkeypatch):
    """The host's speed drifts during tuning: even prompts run the ladder forwards, odd ones backwards, vanilla runs
    before and after each prompt's ladder and counts as the mean of the two; outputs that differ disqualify."""
    from types import SimpleNamespace

    import eaglex.runtime.autotune as at

    calls = []

    class Fake:
        def __init__(self, backend, tree=None):
            self.tree = tree

        def generate(self, prompt, n):
            calls.append((str(self.tree or "vanilla"), prompt[0]))
            seconds = {None: 2.0 if sum(c[0] == "vanilla" for c in calls) % 2 else 4.0}.get(self.tree, 1.0)
            out = [7] * n if str(self.tree) != "chain:2" else [8] * n
            return SimpleNamespace(seconds=seconds, output_ids=out, accept_lengths=[2])

    monkeypatch.setattr(at, "VanillaGenerator", Fake)
    monkeypatch.setattr(at, "SpeculativeGenerator", Fake)
    trees = tuple(TreeConfig.parse(t) for t in ("chain:1", "chain:2", "dynamic:6/4/2"))
    best, rows = at.autotune(SimpleNamespace(), [[10], [11]], max_new_tokens=3, candidates=trees)
    timed = calls[1 + len(trees):]                        # after the warm-ups
    assert timed == [("vanilla", 10), ("chain:1", 10), ("chain:2", 10), ("dynamic:6/4/2", 10), ("vanilla", 10),
                     ("vanilla", 11), ("dynamic:6/4/2", 11), ("chain:2", 11), ("chain:1", 11), ("vanilla", 11)]
    assert rows[0].seconds == pytest.approx(6.0)          # (2 + 4) / 2 per prompt
    assert [r.identical for r in rows[1:]] == [True, False, True]
    assert best == trees[0]                               # ties go to the first identical shape


def test_autotune_runoff_reruns_the_fastest_shapes_and_decides_over_all_prompts(monkeypatch):
    """With more prompts than the ladder's first ones, the `runoff` fastest identical shapes run again with vanilla on
    the rest, and the winner is the fastest over every prompt it ran: here chain:1 leads on the first two prompts
    but chain:2 wins on the next two by more; dynamic:6/4/2 (slowest at first) never runs again."""
    from types import SimpleNamespace

    import eaglex.runtime.autotune as at

    calls = []
    speed = {"chain:1": {10: 1.0, 11: 1.0, 12: 3.0, 13: 3.0}, "chain:2": {10: 1.5, 11: 1.5, 12: 1.0, 13: 1.0},
             "dynamic:6/4/2": {10: 2.5, 11: 2.5, 12: 0.1, 13: 0.1}, "vanilla": {10: 4.0, 11: 4.0, 12: 4.0, 13: 4.0}}

    class Fake:
        def __init__(self, backend, tree=None):
            self.tree = str(tree or "vanilla")

        def generate(self, prompt, n):
            calls.append((self.tree, prompt[0]))
            return SimpleNamespace(seconds=speed[self.tree].get(prompt[0], 1.0), output_ids=[7] * n,
                                   accept_lengths=[2])

    monkeypatch.setattr(at, "VanillaGenerator", Fake)
    monkeypatch.setattr(at, "SpeculativeGenerator", Fake)
    trees = tuple(TreeConfig.parse(t) for t in ("chain:1", "chain:2", "dynamic:6/4/2"))
    best, rows = at.autotune(SimpleNamespace(), [[10], [11], [12], [13]], max_new_tokens=3, candidates=trees,
                             first=2, runoff=2)
    assert {c for c in calls if c[1] in (12, 13)} == {("vanilla", 12), ("chain:1", 12), ("chain:2", 12),
                                                     ("vanilla", 13), ("chain:1", 13), ("chain:2", 13)}
    assert best == trees[1]                                # 4.0 s over 4 prompts against chain:1's 8.0
    assert [r.tokens for r in rows] == [12, 12, 12, 6]     # vanilla and the finalists: all 4 prompts
    assert rows[0].seconds == pytest.approx(16.0)
    # without more prompts than `first`, no runoff: chain:1 leads the two it ran
    calls.clear()
    assert at.autotune(SimpleNamespace(), [[10], [11]], max_new_tokens=3, candidates=trees, first=2)[0] == trees[0]


@pytest.mark.parametrize("own, expected", [
    ("dynamic:12/6/4", ["dynamic:12/6/4", "dynamic:6/4/2"]),        # the engine's own tree and the smaller one
    ("dynamic:6/4/2", ["dynamic:6/4/2"]),                           # nothing smaller to add
    ("dynamic:4/4/1", ["dynamic:4/4/1"]),
    ("static", ["static", "dynamic:6/4/2"]),
    ("chain:5", ["chain:5"]),               # a chain won alone: the dynamic trees lost to it already
    ("chain:2", ["chain:2"]),               # (one of tune_schedule's chains: measured once)
    (None, ["dynamic:6/4/2"]),
])
def test_batch_tuning_tries_the_engines_tree_and_smaller_dynamic_ones(own, expected):
    from eaglex.engines.tune import batch_trees
    assert [str(t) for t in batch_trees(TreeConfig.parse(own) if own else None)] == expected


def test_batch_tuning_decodes_through_the_engines_batcher(fresh, prompts, monkeypatch):
    """The rounds batch tuning times run the generator `generate --batch` and the server run (Engine.batcher,
    with slots sized to the tuning requests), so the stored schedule is a measurement of the product; every
    request a round decodes is vanilla's output."""
    from eaglex.runtime.engine import Engine
    engine = open_engine(fresh, tree=BEST)
    calls, reqs = [], []
    real = Engine.batcher

    def spy(self, max_batch, schedule=None, context=None):
        calls.append((max_batch, str(schedule), context))
        gen = real(self, max_batch, schedule, context)
        submit = gen.submit
        gen.submit = lambda *a, **k: reqs.append(submit(*a, **k)) or reqs[-1]
        return gen
    monkeypatch.setattr(Engine, "batcher", spy)
    manifest = {}
    tune_mod.tune_batching(engine, prompts[:4], manifest, log=lambda *_: None, write=False)
    context = max(len(p) for p in prompts[:4]) + tune_mod.BATCH_TOKENS
    assert calls and all(c == context for _, _, c in calls)
    assert {s for b, s, _ in calls if b == 1} == {f"1:{t}" for t in ("vanilla", "chain:1", "chain:2", "chain:3",
                                                                     "chain:4")}
    assert manifest["batch_schedule"] and set(manifest["tuning"]["batch"]) <= {"1", "2", "4", "8", "16"}
    alone = VanillaGenerator(engine.backend)
    want = {}
    for r in reqs:
        key = (tuple(r.input_ids), r.max_new_tokens)
        if key not in want:
            want[key] = alone.generate(r.input_ids, r.max_new_tokens).output_ids
        assert r.done and r.error is None and r.result.output_ids == want[key]
