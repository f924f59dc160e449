"""The engine contract: an engine folder's manifest `tree` (written at build, overwritten by tuning) is what every
entry point runs unless told otherwise (generate, check, bench, the Triton loader); old manifests still open; per-line
seed streams give independent, reproducible samples that follow the target's distribution."""
from __future__ import annotations

import json

import pytest
from helpers import write_prompt_file

from eaglex.base.errors import ModelError
from eaglex.cli import main
from eaglex.engines.build import build_engine
from eaglex.engines.tune import tune_engine
from eaglex.runtime.engine import open_engine, open_models
from eaglex.runtime.equivalence import chi2_sf, chi_square
from eaglex.runtime.manifest import read_manifest, write_manifest
from eaglex.runtime.sampling import derive_seed
from eaglex.runtime.types import SamplingConfig, TreeConfig
from eaglex.serving.loader import load

TUNED = TreeConfig.parse("chain:2")


@pytest.fixture(scope="module")
def engine_dir(models, tmp_path_factory):
    out = tmp_path_factory.mktemp("engine") / "llama-eagle3"
    build_engine(models["llama"], models["llama/eagle3"], out, progress=False)
    return out


@pytest.fixture()
def tuned(engine_dir, monkeypatch, prompts):
    """The engine after `eaglex engine`'s tuning, with the measurement replaced by a fixed answer (chain:2, which
    no default uses) so that the tree an entry point runs tells where it came from."""
    import eaglex.engines.tune as tune_mod
    from eaglex.runtime.autotune import TuneRow
    rows = [TuneRow(None, 1.0, 10, 1.0, True), TuneRow(TUNED, 0.5, 10, 2.0, True)]
    monkeypatch.setattr(tune_mod, "autotune", lambda *a, **k: (TUNED, rows))
    m = read_manifest(engine_dir)
    m.pop("tuning", None)
    write_manifest(engine_dir, m)
    tune_engine(open_engine(engine_dir), prompts[:2], log=lambda _: None)
    return engine_dir


def test_build_writes_a_default_tree_and_tuning_overwrites_it(engine_dir, tuned):
    m = read_manifest(tuned)
    assert m["tree"] == "chain:2" and m["method"] == "eagle3"
    assert m["tuning"]["tokens_per_s"] == {"vanilla": 10.0, "chain:2": 20.0}
    assert open_engine(tuned).tree == TUNED


def test_generate_runs_the_tuned_tree(tuned, trees_run, tmp_path, prompts):
    assert main(["generate", "--engine", str(tuned), "--prompts", str(write_prompt_file(tmp_path, prompts, 3)),
                 "--max-new-tokens", "8", "--out", str(tmp_path / "o.jsonl")]) == 0
    assert trees_run and set(trees_run) == {TUNED}


def test_check_runs_the_tuned_tree(tuned, trees_run, tmp_path, prompts, capsys):
    assert main(["check", "--engine", str(tuned), "--prompts", str(write_prompt_file(tmp_path, prompts, 3)),
                 "--max-new-tokens", "8"]) == 0
    assert set(trees_run) == {TUNED} and "tree chain:2" in capsys.readouterr().out


def test_triton_loader_runs_the_tuned_tree(tuned):
    engine = load(tuned)
    assert (engine.method, engine.tree) == ("eagle3", TUNED)
    assert load(tuned, tree="dynamic:8/4/3").tree == TreeConfig.parse("dynamic:8/4/3")    # an explicit override
    assert load(tuned, method="vanilla").tree is None
    assert load(tuned, method="eagle3").method == "eagle3"          # any method of eaglex.base.methods
    with pytest.raises(ModelError, match="method must be default or one of eagle3, eagle2, eagle1, vanilla"):
        load(tuned, method="fast")


def test_bench_auto_is_the_tuned_tree(tuned, tmp_path, prompts, capsys):
    assert main(["bench", "--engine", str(tuned), "--prompts", str(write_prompt_file(tmp_path, prompts, 2)), "--trees",
                 "auto", "--max-new-tokens", "6", "--out", str(tmp_path / "b.json")]) == 0
    rows = json.loads((tmp_path / "b.json").read_text())["rows"]
    assert [r["tree"] for r in rows] == ["-", "chain:2 (tuned)"]
    assert all(r["threads"] for r in rows)


def test_explicit_tree_wins(tuned, trees_run, tmp_path, prompts):
    assert main(["generate", "--engine", str(tuned), "--prompts", str(write_prompt_file(tmp_path, prompts, 3)),
                 "--tree", "dynamic:8/4/3", "--max-new-tokens", "4", "--out", str(tmp_path / "o.jsonl")]) == 0
    assert set(trees_run) == {TreeConfig.parse("dynamic:8/4/3")}


def test_manifests_of_older_engines_still_open(engine_dir, tmp_path):
    """Before the `tree` field: `tuned_tree` / `default_tree` dicts whose depth counted draft forwards after the
    first one (the official convention), so depth 1 was a chain of two tokens."""
    import shutil
    old = tmp_path / "old"
    shutil.copytree(engine_dir, old)
    m = read_manifest(old)
    del m["tree"], m["method"]
    m["default_method"] = "eagle3"
    m["default_tree"] = {"kind": "dynamic", "total_tokens": 60, "depth": 7, "top_k": 10, "choices": None}
    write_manifest(old, m)
    assert open_engine(old).tree == TreeConfig.parse("dynamic:60/8/10")
    m["tuned_tree"] = {"tree": {"kind": "chain", "total_tokens": 60, "depth": 1, "top_k": 10, "choices": None},
                       "label": "chain d1"}
    write_manifest(old, m)
    assert open_engine(old).tree == TUNED


@pytest.mark.parametrize("text,tree", [
    ("chain:3", TreeConfig("chain", depth=3)),
    ("dynamic:16/6/4", TreeConfig("dynamic", total_tokens=16, depth=6, top_k=4)),
    ("cost:6/4", TreeConfig("cost", depth=6, top_k=4)),
    ("cost:3/1", TreeConfig("cost", depth=3, top_k=1)),
    ("static", TreeConfig("static")),
    ("auto", None),
])
def test_tree_grammar_round_trips(text, tree):
    assert TreeConfig.parse(text) == tree
    if tree is not None:
        assert str(tree) == text and TreeConfig.parse(str(tree)) == tree


@pytest.mark.parametrize("text", ["chain", "chain:0", "chain:x", "dynamic:16/6", "dynamic:1/3/3", "static:3",
                                  "tree", "chain d3", "chain-4", "cost", "cost:6", "cost:0/4", "cost:6/0",
                                  "cost:64/6/4"])
def test_tree_grammar_refuses(text):
    with pytest.raises(ValueError, match="bad tree"):
        TreeConfig.parse(text)


@pytest.mark.parametrize("text,max_nodes", [("cost:6/4", 64), ("cost:3/3", 22), ("cost:3/1", 4), ("cost:1/2", 3)])
def test_cost_tree_verifies_at_most_its_pool_up_to_the_cap(text, max_nodes):
    """The root + every candidate the levels draft (top_k + (depth - 1) * top_k^2), at most COST_MAX_NODES."""
    assert TreeConfig.parse(text).max_nodes == max_nodes


def test_chain_length_is_what_it_drafts(models, prompts):
    """chain:N verifies N draft tokens per cycle (a cycle can emit at most N + 1 tokens)."""
    engine = open_models(models["llama"], models["llama/eagle3"], tree=TreeConfig.parse("chain:3"))
    r = engine.generate(prompts, max_new_tokens=40)
    lengths = [n for x in r for n in x.accept_lengths]
    assert max(lengths) == 4 and TreeConfig.parse("chain:3").max_nodes == 4


def test_seed_streams_are_derived_not_added():
    seeds = {derive_seed(s, i) for s in range(20) for i in range(20)}
    assert len(seeds) == 400                                  # seed + i would give 39 distinct values
    assert derive_seed(3, 5) == derive_seed(3, 5)


def test_copies_of_one_prompt_sample_independently_from_the_target(models, prompts, tmp_path):
    """96 copies of one prompt at temperature > 0: the first two tokens follow the target's exact distribution
    (chi-square), a run is reproducible, a line's output does not depend on the other lines, and a line's own
    "seed" field sets its stream."""
    p = prompts[0]
    f = tmp_path / "copies.jsonl"
    f.write_text(json.dumps({"input_ids": p}) + "\n" * 1 + "".join(json.dumps({"input_ids": p}) + "\n"
                                                                   for _ in range(95)))
    out = tmp_path / "o.jsonl"
    args = ["generate", "--target", str(models["llama"]), "--draft", str(models["llama/eagle3"]), "--prompts",
            str(f), "--temperature", "5", "--seed", "11", "--max-new-tokens", "2", "--out", str(out)]
    assert main(args) == 0
    outputs = [json.loads(line)["output_ids"] for line in out.read_text().splitlines()]
    assert len(outputs) == 96 and len({tuple(o) for o in outputs}) > 20
    engine = open_models(models["llama"], models["llama/eagle3"])
    sampling = SamplingConfig(temperature=5.0, seed=11)
    for position in (0, 1):
        chi2, dof, n = chi_square(engine.backend, sampling, p, outputs, position)
        assert n == 96 and dof > 0 and chi2_sf(chi2, dof) > 1e-3, (position, chi2, dof)
    assert main(args) == 0                                                    # reproducible
    assert [json.loads(line)["output_ids"] for line in out.read_text().splitlines()] == outputs
    alone = engine.generate([p], sampling, 2, seeds=None)[0].output_ids
    assert alone == outputs[0]                                                # line 0 alone == line 0 of 96
    f.write_text(json.dumps({"input_ids": p, "seed": derive_seed(11, 7)}) + "\n")
    assert main(args) == 0
    assert json.loads(out.read_text())["output_ids"] == outputs[7]           # a line's own seed sets its stream
