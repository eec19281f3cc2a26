"""``md.scan(..., remat="auto")``: the planner weighs the step's remat policy (none, dots, full)
with the placements, in one solve: the fastest that fits the memory budget. Recomputing is priced
(the step's forward collectives run again), what each policy keeps is in the solve's memory rows,
``decisions()`` shows the policy taken and the next best, and the values are the unsharded ones."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import meshdsl as md
from helpers import gated_mlp_grads, gated_mlp_stack
from meshdsl.models.families.family import model_class, objective
from meshdsl.models.llama_configs import LLAMA_CONFIGS

L, B, S, D, F = 4, 8, 64, 128, 512
MESH = md.Mesh({"data": 8})


def _inputs():
    return gated_mlp_stack(L, B, S, D, F)


def _grads(remat):
    return gated_mlp_grads(remat)


def _close(got, want):
    for g, w in zip(got, want):
        w = np.asarray(w.array)
        np.testing.assert_allclose(np.asarray(g.array), w, rtol=2e-4, atol=2e-4 * float(np.abs(w).max()))


def _peak(compiled) -> float:
    m = compiled.memory_analysis()
    return m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes


def _policy(report) -> str:
    (scan,) = [d for d in report.decisions() if d["op"].startswith("scan")]
    return scan["chosen"].rsplit("remat ", 1)[1]


def _peaks():
    args, layout = _inputs(), md.Layout({"batch": "data"})
    return {p: _peak(md.lower(_grads(p), MESH, layout).lower(*args).compile()) for p in ("none", "full")}


def test_with_room_for_every_activation_the_plan_keeps_them():
    args = _inputs()
    report = md.explain(_grads("auto"), MESH, md.Layout({"batch": "data"}), *args)
    assert _policy(report) == "none"


def test_a_budget_between_keeping_all_and_recomputing_all_makes_the_solve_recompute_and_the_compiled_peak_fits():
    peaks = _peaks()
    assert peaks["full"] < 0.9 * peaks["none"], peaks
    budget = (peaks["full"] + peaks["none"]) / 2
    args, layout = _inputs(), md.Layout({"batch": "data"})
    lowered = md.lower(_grads("auto"), MESH, layout, memory_budget=budget)
    assert _peak(lowered.lower(*args).compile()) <= budget
    report = md.explain(_grads("auto"), MESH, layout, *args, memory_budget=budget)
    assert _policy(report) in ("dots", "full")
    _close(lowered(*args), _grads("none")(*args))


def test_recomputing_a_step_that_communicates_is_priced_with_its_collectives_run_again():
    args = _inputs()
    report = md.explain(_grads("auto"), md.Mesh({"data": 2, "model": 4}),
                        md.Layout({"batch": "data", "d_ff": "model"}), *args)
    (scan,) = [d for d in report.decisions() if d["op"].startswith("scan")]
    assert scan["chosen"].endswith("remat none")
    assert scan["next"].rsplit("remat ", 1)[1] in ("dots", "full")
    assert scan["next_seconds"] > scan["seconds"] and scan["next_bytes"] > scan["bytes"]
    assert scan["next_memory"] < scan["memory"]


def test_auto_runs_as_none_outside_a_planned_lowering():
    args = _inputs()
    want = _grads("none")(*args)
    _close(md.lower(_grads("auto"), MESH, md.Layout({"batch": "data"}), backend="gspmd")(*args), want)
    _close(_grads("auto")(*args), want)


def test_an_unknown_remat_policy_is_refused_naming_the_policies():
    args = _inputs()
    with pytest.raises(md.MeshDSLError, match=r"remat policy must be one of .*'auto'.*got 'sometimes'"):
        _grads("sometimes")(*args)


def test_a_llama_stack_under_a_budget_keeping_the_matmuls_fits_recomputes_only_the_rest():
    """``scan_layers(..., remat="auto")`` in a Llama decoder (tensor parallel): with a budget
    between the peaks of keeping everything and keeping the matmuls, the plan keeps the matmuls
    (dots): the fastest policy that fits, not the one that recomputes most."""
    config = LLAMA_CONFIGS["llama-tiny"].replace(layers=4, d_model=128, d_ff=512, vocab=1024)
    model = model_class(config)(config, rngs=nnx.Rngs(0))
    ids = md.named(jnp.asarray(np.random.default_rng(0).integers(0, 1024, (16, 256)), jnp.int32), "batch targets")
    batch = {"decoder_input_tokens": ids, "decoder_target_tokens": ids,
             "decoder_loss_weights": md.named(jnp.ones((16, 256), jnp.float32), "batch targets")}
    loss = objective(config)

    def step(remat):
        return lambda m, b: nnx.value_and_grad(lambda m: loss(m, b, train=True, remat=remat)[0].array)(m)
    mesh = md.Mesh({"data": 4, "model": 2})
    layout = md.Layout({"batch": "data", "heads": "model", "kv_heads": "model", "d_ff": "model"})
    peaks = {p: _peak(md.lower(step(p), mesh, layout).lower(model, batch).compile()) for p in ("none", "dots")}
    assert peaks["dots"] < 0.8 * peaks["none"], peaks
    budget = (peaks["none"] + peaks["dots"]) / 2
    assert _policy(md.explain(step("auto"), mesh, layout, model, batch, memory_budget=budget)) == "dots"
    assert _peak(md.lower(step("auto"), mesh, layout, memory_budget=budget).lower(model, batch).compile()) <= budget


def test_a_search_of_a_stack_left_to_the_planner_screens_by_recomputing_and_finds_layouts_only_that_fits():
    """``md.search`` of a step scanned with ``remat="auto"``: its memory screen bounds each layout
    by the policy that holds least (full), so a budget that only recomputing meets rejects no
    layout before costing; the best layout's plan recomputes."""
    config = LLAMA_CONFIGS["llama-tiny"].replace(layers=4, d_model=128, d_ff=512, vocab=1024)
    model = nnx.eval_shape(lambda: model_class(config)(config, rngs=nnx.Rngs(0)))
    tokens = md.named(jax.ShapeDtypeStruct((16, 256), jnp.int32), "batch targets")
    batch = {"decoder_input_tokens": tokens, "decoder_target_tokens": tokens,
             "decoder_loss_weights": md.named(jax.ShapeDtypeStruct((16, 256), jnp.float32), "batch targets")}
    loss = objective(config)
    step = lambda m, b: nnx.value_and_grad(lambda m: loss(m, b, train=True, remat="auto")[0].array)(m)  # noqa: E731
    result = md.search(step, 8, model, batch, memory_budget="40MiB", hardware="cpu", top=3,
                       dims=["batch", "kv_heads", "d_ff"])
    assert result.candidates, [c.why for c in result.rejected]
    assert _policy(result.best.report) == "full"
