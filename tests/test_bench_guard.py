"""The bench guard compares ratios only, prints what fell, and never fails."""
from __future__ import annotations

import json

import pytest

from eaglex.bench_guard import compare, main, ratios

RUN = {"rows": [
    {"engine": "ort:e", "method": "vanilla", "tree": "-", "speedup": 1.0},
    {"engine": "ort:e", "method": "eagle3", "tree": "chain:3 (tuned)", "speedup": 1.8},
    {"engine": "ort:e", "method": "eagle3", "tree": "chain:4", "speedup": 1.7},
    {"engine": "llama.cpp", "method": "eagle3", "tree": "8/0.5", "speedup": 1.2},       # peers: not ours to guard
], "batched": [
    {"engine": "ort:e", "requests": 1, "schedule_over_vanilla": 1.8, "over_one_at_a_time": 1.0},
    {"engine": "ort:e", "requests": 16, "schedule_over_vanilla": 1.3, "over_one_at_a_time": 2.5},
]}


def test_ratios_of_a_run():
    assert ratios(RUN) == {"ort:e eagle3 tuned tree: speedup": 1.8, "ort:e eagle3 chain:4: speedup": 1.7,
                           "ort:e batch 1: schedule/vanilla": 1.8, "ort:e batch 16: schedule/vanilla": 1.3,
                           "ort:e batch 16: vs one at a time": 2.5}


@pytest.mark.parametrize("now, record, expected", [
    ({"a": 1.0}, {"a": 1.0}, ["held  a: 1.00 (recorded 1.00)"]),
    ({"a": 0.91}, {"a": 1.0}, ["held  a: 0.91 (recorded 1.00)"]),          # within 10 %
    ({"a": 0.89}, {"a": 1.0}, ["FELL  a: 0.89 (recorded 1.00)"]),
    ({"a": 2.0, "b": 1.0}, {"a": 1.0, "c": 3.0}, ["held  a: 2.00 (recorded 1.00)"]),   # only what both have
])
def test_compare(now, record, expected):
    assert compare(now, record, 0.10) == expected


def test_a_fallen_ratio_is_printed_and_never_fails(tmp_path, capsys):
    run, rec = tmp_path / "run.json", tmp_path / "rec.json"
    run.write_text(json.dumps(RUN))
    assert main([str(run), "--record-file", str(rec), "--record"]) == 0
    worse = json.loads(json.dumps(RUN))
    worse["batched"][1]["over_one_at_a_time"] = 1.5
    run.write_text(json.dumps(worse))
    assert main([str(run), "--record-file", str(rec)]) == 0
    out = capsys.readouterr().out
    assert "1 fell by more than 10%" in out and "FELL  ort:e batch 16: vs one at a time: 1.50 (recorded 2.50)" in out
    (tmp_path / "bad.json").write_text("not json")
    assert main([str(tmp_path / "bad.json"), "--record-file", str(rec)]) == 0
    assert "is not a bench JSON" in capsys.readouterr().err
