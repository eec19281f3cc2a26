"""The circular schedule (``schedule="circular"``, ``repeats=R``): each stage runs ``R`` chunks of
the stack, microbatches go round the ring of stages ``R`` times; ``R M + S - 1`` ticks, a bubble of
``(S-1)/(R M + S - 1)``. Equal to the unsharded program (forward and gradients, tight tolerance),
composed with data / tensor parallelism and ZeRO-3 storage, explained exactly, refused clearly."""

import jax
import pytest

import meshdsl as md
from helpers import assert_same, bytes_by_kind, explain_summary, hlo_summary
from meshdsl.ops.pipeline_circular import rounds
from test_pipeline import MESH, inputs, loss_and_grads, model, model_with_ys

LAYOUTS = {
    "pipe x data": md.Layout({"layers": "pipe", "batch": "data"}, microbatches={"batch": 4}),
    "pipe x Megatron": md.Layout({"layers": "pipe", "d_ff": "data"}, microbatches={"batch": 4}),
    "pipe x data x ZeRO-3": md.Layout({"layers": "pipe", "batch": "data"}, params={"d_model": "data"},
                                      microbatches={"batch": 8}),
}


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("repeats", [2, 3])
def test_forward_and_gradients_equal_the_unsharded_program(name, repeats):
    args = inputs(layers=4 * repeats)     # one layer per chunk
    f = md.lower(model, MESH, LAYOUTS[name], schedule="circular", repeats=repeats)
    assert_same(f(*args), model(*args), rtol=1e-5, atol=1e-5)
    g = md.lower(loss_and_grads, MESH, LAYOUTS[name], schedule="circular", repeats=repeats)
    assert_same(g(*args), loss_and_grads(*args), rtol=1e-4, atol=1e-5)


def test_explain_reports_the_ring_and_equals_the_compiled_bytes():
    """Ticks R*M + S - 1, the bubble (S-1)/(R*M + S - 1) (GPipe's with R*M microbatches); bytes:
    GPipe's ppermutes (one per tick, the ring's pair S-1 -> 0 among them), the chunks moved to
    their stage once per step (and their gradients back), and the gradient all-reduce over data
    once per step, not per tick: explain equals the compiled HLO."""
    args, layout = inputs(layers=16), LAYOUTS["pipe x data"]
    gpipe = md.explain(loss_and_grads, MESH, layout, *args)
    report = md.explain(loss_and_grads, MESH, layout, *args, schedule="circular", repeats=2)
    p = report.pipeline
    assert (p["schedule"], p["repeats"], p["stages"], p["microbatches"], p["ticks"]) == ("circular", 2, 4, 4, 11)
    assert p["bubble_fraction"] == pytest.approx(3 / 11) and gpipe.pipeline["bubble_fraction"] == pytest.approx(3 / 7)
    assert report.to_dict()["pipeline"]["repeats"] == 2
    g = md.lower(loss_and_grads, MESH, layout, schedule="circular", repeats=2)
    assert bytes_by_kind(hlo_summary(g, *args)) == bytes_by_kind(explain_summary(report))
    chunk = 2 * 32 * 64 * 4                        # 2 layers of w1 (or w2), float32
    moves = [r for r in report.collectives if "circular stage" in r.tensor]
    assert sum(r.bytes * r.count for r in moves) == 2 * 2 * 2 * chunk   # 2 rounds x w1, w2 x forward, backward
    summary, before = report.summary(), gpipe.summary()
    assert summary["all-reduce"] == before["all-reduce"]      # the gradient sum: once per step, as GPipe
    ticks = [r for r in report.collectives if "next stage" in r.tensor]
    assert sum(r.count for r in ticks) == 2 * 11 and "circular" in report.to_markdown()


def test_the_chunk_moves_take_the_block_placement_to_the_cyclic_one():
    for stages, repeats in [(2, 2), (4, 2), (4, 3), (4, 4), (8, 2)]:
        plan = rounds(stages, repeats)
        moves = [m for r in plan for m in r]
        assert sorted((a * repeats + q) for a, q, _, _ in moves) == list(range(stages * repeats))
        for a, q, b, r in moves:
            c = a * repeats + q
            assert (b, r) == (c % stages, c // stages)
        for r in plan:   # a round sends one chunk per stage and receives one per stage
            assert len({m[0] for m in r}) == len(r) == len({m[2] for m in r})
        assert len(plan) <= repeats + 1


def test_errors_say_what_to_change():
    args = inputs(layers=8)
    with pytest.raises(md.LayoutError, match=r"layers:8 cannot be cut into 4 stages x 3 repeats = 12 chunks"):
        md.lower(model, MESH, LAYOUTS["pipe x data"], schedule="circular", repeats=3)(*args)
    few = md.Layout({"layers": "pipe", "batch": "data"}, microbatches={"batch": 2})
    with pytest.raises(md.LayoutError, match=r"at least as many microbatches as stages \(2 < 4\)"):
        md.lower(model, MESH, few, schedule="circular", repeats=2)(*args)
    with pytest.raises(md.MeshDSLError, match="repeats=2 is the circular schedule's; pass schedule='circular'"):
        md.lower(model, MESH, few, repeats=2)
    with pytest.raises(md.MeshDSLError, match="repeats must be a positive int"):
        md.lower(model, MESH, few, schedule="circular", repeats=0)
    with pytest.raises(md.LayoutError, match="circular schedule does not return scan outputs"):
        md.lower(model_with_ys, MESH, LAYOUTS["pipe x data"], schedule="circular", repeats=2)(*args)


def test_one_repeat_is_gpipe():
    args, layout = inputs(), LAYOUTS["pipe x data"]
    circular = md.explain(loss_and_grads, MESH, layout, *args, schedule="circular", repeats=1)
    gpipe = md.explain(loss_and_grads, MESH, layout, *args)
    assert circular.summary() == gpipe.summary() and circular.pipeline["ticks"] == gpipe.pipeline["ticks"]
    assert_same(md.lower(loss_and_grads, MESH, layout, schedule="circular")(*args), loss_and_grads(*args),
                rtol=1e-5, atol=1e-6)


def test_temp_memory_does_not_keep_a_chunk_of_weights_per_tick():
    """A tick cuts its chunk of weights from the stack; the backward pass cuts it again rather than
    keeping one per tick (which grew the compiled temp memory by a chunk per tick: 24 ticks x
    256 KiB from M=4 to M=16 here). Activations per tick shrink as M grows, so the total may not grow."""
    args = inputs(batch=64, layers=8, d=128)
    temp = {}
    for m in (4, 16):
        layout = md.Layout({"layers": "pipe", "batch": "data"}, microbatches={"batch": m})
        g = md.lower(loss_and_grads, MESH, layout, schedule="circular", repeats=2)
        temp[m] = g.lower(*args).compile().memory_analysis().temp_size_in_bytes
    assert temp[16] <= temp[4], temp


def test_the_training_cli_prints_each_stack_s_schedule():
    """T5 under --schedule circular: the encoder stack stays GPipe, the decoder's is circular; the
    CLI's explain lines show both (the first pipeline alone hid the repeats)."""
    from types import SimpleNamespace

    from meshdsl.models.training.runinfo import explain_text

    gpipe = {"schedule": "gpipe", "axis": "pipe", "stages": 2, "microbatches": 2, "ticks": 3, "bubble_fraction": 1 / 3}
    ring = {**gpipe, "schedule": "circular", "repeats": 2, "ticks": 5, "bubble_fraction": 1 / 5}
    report = SimpleNamespace(total_bytes=0, flops=0, memory={"peak": 0}, summary=dict,
                             pipeline={**gpipe, "count": 2, "each": [gpipe, ring]})
    text = explain_text(report, 1)
    assert "pipeline (gpipe) over pipe: 2 stages, 2 microbatches, 3 ticks, bubble 33%" in text
    assert "pipeline (circular, 2 repeats) over pipe: 2 stages, 2 microbatches, 5 ticks, bubble 20%" in text
