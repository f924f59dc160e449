"""The cost curve behind cost trees (runtime/cost.py): interpolation, the manifest round trip, where a backend's
curve comes from (stored by tuning, else measured once per set of models), and how a drafter sizes a step's trees
from it (one size for a batch)."""
from __future__ import annotations

import numpy as np
import pytest

from eaglex.runtime import cost as cost_mod
from eaglex.runtime.cost import COST_SIZES, CostCurve, cost_curve, interp, measure_curve
from eaglex.runtime.drafter import Drafter
from eaglex.runtime.torch_backend import TorchBackend
from eaglex.runtime.types import TreeConfig

TABLE = {1: 10.0, 2: 12.0, 4: 20.0, 8: 20.0}


@pytest.mark.parametrize("n,want", [
    (1, 10.0), (0, 10.0),            # at and below the smallest size: its value
    (2, 12.0), (3, 16.0),            # measured, and linear between
    (6, 20.0), (8, 20.0),            # a flat stretch stays flat
    (16, 20.0),                      # past the largest: along the last two points (flat here)
])
def test_interp(n, want):
    assert interp(TABLE, n) == pytest.approx(want)


@pytest.mark.parametrize("table,n,want", [
    ({1: 10.0, 64: 73.0}, 128, 137.0),        # extrapolated along the last slope (1 ms a row): B trees at once
    ({1: 10.0, 64: 5.0}, 128, 5.0),           # a falling last stretch is not extrapolated downwards
    ({"1": 3.0}, 50, 3.0),                    # one point (JSON keys are strings)
])
def test_interp_past_the_table(table, n, want):
    assert interp(table, n) == pytest.approx(want)


def test_curve_round_trips_through_the_manifest():
    curve = CostCurve(((1, 10.0), (64, 70.5)), ((1, 1.0), (4, 1.5)), 256)
    tuning = {"cpu": "x", **curve.to_tuning()}
    assert tuning["verify_ms"] == {"1": 10.0, "64": 70.5}
    assert CostCurve.from_tuning(tuning) == curve
    assert curve.verify(32.5) == pytest.approx(40.25) and curve.draft(2) == pytest.approx(1 + 0.5 / 3)
    for old in (None, {}, {"cpu": "x", "tokens_per_s": {}}, {"verify_ms": {"1": 1.0}}):   # tuned before: none
        assert CostCurve.from_tuning(old) is None


class Stored:
    """A backend whose engine manifest holds a tuned curve."""
    def __init__(self, curve):
        self.manifest = {"tuning": curve.to_tuning()}


class Wrapper:
    """A backend over the same models (with_slots)."""
    def __init__(self, source):
        self.source = source


def test_a_stored_curve_is_used_as_it_is(monkeypatch):
    monkeypatch.setattr(cost_mod, "measure_curve", lambda b: pytest.fail("a stored curve must not be re-measured"))
    curve = CostCurve(((1, 5.0), (64, 9.0)), ((1, 1.0),), 100)
    backend = Stored(curve)
    assert cost_curve(backend) == curve and cost_curve(Wrapper(Wrapper(backend))) == curve


def test_a_curve_is_measured_once_per_set_of_models(models, monkeypatch):
    calls = []
    real = measure_curve

    def counted(backend):
        calls.append(backend)
        return real(backend)
    monkeypatch.setattr(cost_mod, "measure_curve", counted)
    backend = TorchBackend(models["llama"], models["llama/eagle3"])
    first = cost_curve(backend)
    assert calls == [backend]                       # timed on the models' own backend, at its full context
    assert [n for n, _ in first.verify_ms] == list(COST_SIZES) == [n for n, _ in first.draft_ms]
    assert first.context == 256 and all(ms > 0 for _, ms in first.verify_ms + first.draft_ms)
    bounded = backend.with_slots(2, context=100)
    assert cost_curve(backend) is first and cost_curve(bounded) is first
    assert cost_curve(bounded.with_slots(3)) is first and len(calls) == 1
    other = TorchBackend(models["llama"], models["llama/eagle3"])
    assert cost_curve(other) is not first and len(calls) == 2


FLAT = CostCurve(((1, 10.0), (64, 10.0)), ((1, 1.0), (64, 1.0)), 256)
STEEP = CostCurve(((1, 10.0), (64, 640.0)), ((1, 1.0), (64, 1.0)), 256)


@pytest.mark.parametrize("curve,scores,want", [
    (FLAT, [[-0.1, -0.2, -0.3, -0.4]], 5),                       # every candidate (root + 4)
    # fixed: 2 draft forwards of 1 ms; (1 + .90) / (2 + 20) beats 1 / (2 + 10) and (1 + .90 + .82) / (2 + 30)
    (STEEP, [[-0.1, -0.2, -0.3, -0.4]], 2),
    (STEEP, [[-5.0, -6.0, -7.0, -8.0]], 1),                      # the draft is unsure: the root alone
    # a batch of two, one size for both: [2, n] rows cost t(2n), so the steep curve keeps the trees small
    (STEEP, [[-0.1, -0.2, -0.3, -0.4], [-5.0, -6.0, -7.0, -8.0]], 1),      # 2 / 22 beats 2.91 / 42
    (FLAT, [[-0.1, -0.2, -0.3, -0.4], [-5.0, -6.0, -7.0, -8.0]], 5),
])
def test_drafter_sizes_a_step_by_the_curve(curve, scores, want):
    d = Drafter(TreeConfig.parse("cost:2/2"), curve)              # pool: 2 + 4 candidates, at most 7 nodes
    assert d._cost_nodes(np.array(scores)) == want


def test_a_cost_tree_needs_its_curve_to_grow():
    d = Drafter(TreeConfig.parse("cost:2/2"))                     # its shape alone (Schedule.draft_rows, top_k)
    assert (d.draft_rows, d.tip_k, d.max_path) == (2, 2, 3)
    with pytest.raises(ValueError, match="needs the cost curve"):
        d._cost_nodes(np.zeros((1, 6)))
