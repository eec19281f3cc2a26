"""ZeRO-3 inside ``md.scan``: each parameter a step gathers is kept for the backward pass or
gathered there again, and under ``param_gather="auto"`` that is the plan's choice, per parameter,
by the step's time under the memory budget (one solve with the placements and the remat policy).
What keeping holds is in the solve's memory, what gathering again moves in its bytes, and the
values stay the unsharded ones."""

import numpy as np
import pytest

import meshdsl as md
from helpers import gated_mlp_grads, gated_mlp_stack

L, B, S, D, F = 4, 8, 64, 128, 512
MESH = md.Mesh({"data": 8})
LAYOUT = md.Layout({"batch": "data"}, params={"d_model": "data"})
GATHERED = L * D * F * 4   # one weight's gathered blocks over the steps, per device (float32)


def _inputs():
    return gated_mlp_stack(L, B, S, D, F)


def _grads(remat="none"):
    return gated_mlp_grads(remat)


def _peak(compiled) -> float:
    m = compiled.memory_analysis()
    return m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes


def _scan(report) -> dict:
    (scan,) = [d for d in report.decisions() if d["op"].startswith("scan")]
    return scan


@pytest.fixture(scope="module")
def peaks():
    args = _inputs()
    return {p: _peak(md.lower(_grads(), MESH, LAYOUT, param_gather=p).lower(*args).compile())
            for p in ("keep", "regather")}


def test_keeping_the_gathered_weights_is_in_the_plans_memory_and_gathering_again_in_its_bytes():
    args = _inputs()
    keep = md.explain(_grads(), MESH, LAYOUT, *args, param_gather="keep")
    again = md.explain(_grads(), MESH, LAYOUT, *args, param_gather="regather")
    assert keep.planned["memory"] - again.planned["memory"] == 2 * GATHERED
    # the backward's second gathers are priced: the plan's bytes are what the program moves
    assert abs(again.planned["bytes"] - again.total_bytes) < 64, (again.planned["bytes"], again.total_bytes)
    assert again.total_bytes - keep.total_bytes == 2 * GATHERED * 7 // 8


def test_without_a_budget_the_plan_keeps_every_gathered_weight():
    args = _inputs()
    report = md.explain(_grads(), MESH, LAYOUT, *args, param_gather="auto")
    assert "gathered again" not in _scan(report)["chosen"]
    assert "1 parameter gathered again" in _scan(report)["next"]   # the next best, with its time and memory
    assert _scan(report)["next_memory"] < _scan(report)["memory"]
    assert report.total_bytes == md.explain(_grads(), MESH, LAYOUT, *args, param_gather="keep").total_bytes


def test_a_budget_between_keeping_all_and_none_gathers_again_only_as_many_weights_as_it_must(peaks):
    args = _inputs()
    assert peaks["regather"] < peaks["keep"] - GATHERED
    budget = peaks["keep"] - GATHERED / 2   # one weight gathered again fits, keeping both does not
    report = md.explain(_grads(), MESH, LAYOUT, *args, param_gather="auto", memory_budget=budget)
    assert "; 1 parameter gathered again; remat none" in _scan(report)["chosen"], _scan(report)
    f = md.lower(_grads(), MESH, LAYOUT, param_gather="auto", memory_budget=budget)
    assert _peak(f.lower(*args).compile()) <= budget
    got, want = f(*md.place(args, MESH, LAYOUT)), _grads()(*args)
    for g, w in zip(got, want):
        w = np.asarray(w.array)
        np.testing.assert_allclose(np.asarray(g.array), w, rtol=2e-4, atol=2e-4 * float(np.abs(w).max()))


def test_gathering_again_and_recomputing_are_weighed_in_one_solve(peaks):
    """With the remat policy left to the plan too, a budget under gathering every weight again
    takes a policy that recomputes; one above it takes no recompute."""
    args = _inputs()
    low = md.explain(_grads("auto"), MESH, LAYOUT, *args, param_gather="auto", memory_budget=peaks["regather"] * 0.8)
    assert "remat none" not in _scan(low)["chosen"], _scan(low)
    high = md.explain(_grads("auto"), MESH, LAYOUT, *args, param_gather="auto",
                      memory_budget=peaks["keep"] - GATHERED / 2)
    assert _scan(high)["chosen"].endswith("remat none"), _scan(high)
