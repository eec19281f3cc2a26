"""The 1F1B schedule: ``md.scan(..., head=loss)`` over a split ``layers`` dim with
``schedule="1f1b"`` equals the unsharded program (loss and gradients), keeps its temp memory flat
as the microbatches grow (GPipe's grows), sends as many shifts as GPipe, computes nothing on idle
ticks, is explained exactly, and refuses what it cannot run."""

import jax
import jax.extend
import numpy as np
import pytest

import meshdsl as md
from meshdsl.costmodel import hlo_comm
from helpers import assert_same, bytes_by_kind, explain_summary, hlo_summary

MESH = md.Mesh({"pipe": 4, "data": 2})


def inputs(batch=16, layers=8, d=32):
    k = jax.random.split(jax.random.key(0), 4)
    x = md.named(jax.random.normal(k[0], (batch, d)), "batch d_model")
    w1 = md.param(md.named(jax.random.normal(k[1], (layers, d, 2 * d)) * 0.1, "layers d_model d_ff"))
    w2 = md.param(md.named(jax.random.normal(k[2], (layers, 2 * d, d)) * 0.1, "layers d_ff d_model"))
    v = md.param(md.named(jax.random.normal(k[3], (d,)), "d_model"))
    return x, w1, w2, v


def step(v):
    def run(h, w):
        f = md.relu(md.einsum(h, w["w1"], out="batch d_ff"))
        return h + md.einsum(f, w["w2"], out="batch d_model") * v, None   # v: a weight read from outside
    return run


def model(x, w1, w2, v):
    """The head (summed over the rows) also reads ``v`` from outside: its gradient has three uses."""
    loss, _ = md.scan(step(v), x, {"w1": w1, "w2": w2}, dim="layers", head=lambda h: md.sum(md.square(h - v)))
    return loss


def loss_and_grads(x, w1, w2, v):
    return jax.value_and_grad(lambda *a: model(*a).array, argnums=(0, 1, 2, 3))(x, w1, w2, v)


LAYOUTS = {
    "pipe only, one microbatch": md.Layout({"layers": "pipe"}),
    "pipe x data, 4 microbatches": md.Layout({"layers": "pipe", "batch": "data"}, microbatches={"batch": 4}),
    "pipe x Megatron": md.Layout({"layers": "pipe", "d_ff": "data"}, microbatches={"batch": 2}),
    "pipe x data x ZeRO-3": md.Layout({"layers": "pipe", "batch": "data"}, params={"d_model": "data"},
                                      microbatches={"batch": 2}),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "pipe only, one microbatch" else n
                                  for n in LAYOUTS])   # one microbatch: also drawn by the random pipelines
def test_loss_and_gradients_equal_the_unsharded_program(name):
    """Float32 against float32: the loss is ~2e3 and the gradients ~5e2, so atol 5e-5 is a relative
    1e-7 (the float32 reference itself is 1.7e-4 off a float64 run on the loss)."""
    args = inputs()
    f = md.lower(model, MESH, LAYOUTS[name], schedule="1f1b")
    assert_same(f(*args), model(*args), rtol=1e-6, atol=1e-3)
    g = md.lower(loss_and_grads, MESH, LAYOUTS[name], schedule="1f1b")
    assert_same(g(*args), loss_and_grads(*args), rtol=1e-6, atol=5e-5)


def test_a_head_without_a_pipeline_is_applied_to_the_final_carry():
    args = inputs()
    expected = md.sum(md.square(md.scan(step(args[3]), args[0], {"w1": args[1], "w2": args[2]},
                                        dim="layers")[0] - args[3]))
    assert_same(model(*args), expected)
    assert_same(md.lower(model, MESH, md.Layout({"batch": "data"}))(*args), expected, atol=1e-3)
    gpipe = md.lower(model, MESH, LAYOUTS["pipe x data, 4 microbatches"], schedule="gpipe")
    assert_same(gpipe(*args), expected, atol=1e-3)


def test_explain_reports_the_schedule_and_equals_the_compiled_bytes():
    args, layout = inputs(), LAYOUTS["pipe x data, 4 microbatches"]
    report = md.explain(loss_and_grads, MESH, layout, *args, schedule="1f1b")
    p = report.to_dict()["pipeline"]
    assert {k: p[k] for k in ("stages", "microbatches", "schedule", "ticks", "in_flight")} == \
        {"stages": 4, "microbatches": 4, "schedule": "1f1b", "ticks": 4 + 2 * 4 - 2, "in_flight": 7}
    assert p["bubble_fraction"] == pytest.approx(3 / 7)      # GPipe's: idle phases compute nothing
    assert "pipeline (1f1b) over pipe: 4 stages, 4 microbatches, 10 ticks, bubble 43%; at most 7 microbatch " \
           "inputs kept per stage" in report.to_markdown()
    measured = hlo_summary(md.lower(loss_and_grads, MESH, layout, schedule="1f1b"), *args)
    assert bytes_by_kind(measured) == bytes_by_kind(explain_summary(report))
    # M + S - 2 shifts each way (GPipe: M + S - 1), each one microbatch's activations [16/2/4 rows, 32] f32
    permutes = [r for r in report.collectives if r.kind == "collective-permute"]
    assert sum(r.count for r in permutes) == 2 * (4 + 4 - 2)
    assert all(r.bytes == 2 * 32 * 4 for r in permutes)
    gpipe = md.explain(loss_and_grads, MESH, layout, *args, schedule="gpipe")
    assert explain_summary(gpipe)["collective-permute"][0] == 2 * (4 + 4 - 1)
    # gradients are summed over data once per step, not once per microbatch (v's with its sum over
    # pipe: it is read by every stage and by the head)
    over_data = [r for r in report.collectives if r.kind == "all-reduce" and "data" in r.axes and r.phase == "backward"]
    assert sorted((r.axes, r.count) for r in over_data) == [(("data",), 1), (("data",), 1), (("pipe", "data"), 1)]



def test_explain_reports_each_pipeline_of_a_program():
    """Two stacks (T5's encoder and decoder): the first pipeline's keys, how many, and each one."""
    args, layout = inputs(), LAYOUTS["pipe x data, 4 microbatches"]

    def two_stacks(x, w1, w2, v):
        h, _ = md.scan(step(v), x, {"w1": w1, "w2": w2}, dim="layers", schedule="gpipe")
        return model(h, w1, w2, v)

    p = md.explain(two_stacks, MESH, layout, *args, schedule="1f1b").to_dict()["pipeline"]
    assert p["count"] == 2 and p["schedule"] == "gpipe"          # the first stack has no head
    assert [(e["schedule"], e["ticks"]) for e in p["each"]] == [("gpipe", 4 + 4 - 1), ("1f1b", 4 + 2 * 4 - 2)]

def _temp(schedule, m):
    args = inputs(batch=2 * 2 * m, d=64)      # 2 rows per device and microbatch, whatever M
    layout = md.Layout({"layers": "pipe", "batch": "data"}, microbatches={"batch": m})
    f = md.lower(loss_and_grads, MESH, layout, schedule=schedule)
    return f.lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_temp_memory_is_flat_in_microbatches_where_gpipes_grows():
    """Microbatches of a fixed size: GPipe keeps every tick's activations for its backward pass
    (M + S - 1 microbatches); 1F1B keeps at most 2S - 1 microbatch inputs."""
    gpipe = {m: _temp("gpipe", m) for m in (2, 8)}
    one = {m: _temp("1f1b", m) for m in (2, 8)}
    assert gpipe[8] > 1.1 * gpipe[2]
    assert one[8] < 1.02 * one[2]
    assert one[8] < gpipe[8]


def _subjaxprs(params):
    for v in params.values():
        for item in v if isinstance(v, (tuple, list)) else (v,):
            if isinstance(item, jax.extend.core.ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, jax.extend.core.Jaxpr):
                yield item


def _eqns(jaxpr, inside_cond=False):
    for e in jaxpr.eqns:
        yield e, inside_cond
        for sub in _subjaxprs(e.params):
            yield from _eqns(sub, inside_cond or e.primitive.name == "cond")


def test_idle_ticks_compute_nothing():
    """Every matmul of the step runs inside a ``cond`` of the tick loop: a stage with no
    microbatch at hand skips its layers (both in the forward and in the backward phase)."""
    args, layout = inputs(), LAYOUTS["pipe x data, 4 microbatches"]
    closed, _, _ = md.lower(loss_and_grads, MESH, layout, schedule="1f1b").trace(*args)
    dots = [inside for e, inside in _eqns(closed.jaxpr) if e.primitive.name == "dot_general"]
    assert dots and all(dots)


def test_errors():
    x, w1, w2, v = inputs()
    layout = LAYOUTS["pipe x data, 4 microbatches"]
    with pytest.raises(md.LayoutError, match=r"schedule '1f1b' runs each microbatch's backward pass inside the "
                                             r"pipeline.*pass md.scan\(\.\.\., head=loss_fn\)"):
        md.lower(lambda x, w1, w2, v: md.scan(step(v), x, {"w1": w1, "w2": w2}, dim="layers")[0], MESH, layout,
                 schedule="1f1b")(x, w1, w2, v)
    with pytest.raises(md.LayoutError, match=r"head must return a NamedArray with no dims.*got \[batch:4\]"):
        md.lower(lambda x, w1, w2, v: md.scan(step(v), x, {"w1": w1, "w2": w2}, dim="layers",
                                              head=lambda h: md.sum(h, "d_model"))[0], MESH, layout,
                 schedule="1f1b")(x, w1, w2, v)
    with pytest.raises(md.LayoutError, match=r"head must return a NamedArray with no dims.*got \[batch:16\]"):
        md.scan(step(v), x, {"w1": w1, "w2": w2}, dim="layers", head=lambda h: md.sum(h, "d_model"))

    aux_rows = lambda h: (md.sum(md.square(h)), {"rows": md.sum(h, "d_model")})  # noqa: E731
    with pytest.raises(md.LayoutError, match=r"head returned \[batch:4\], with the microbatch dim 'batch': the "
                                             r"head's values are summed over the microbatches; sum over 'batch'"):
        md.lower(lambda x, w1, w2, v: md.scan(step(v), x, {"w1": w1, "w2": w2}, dim="layers", head=aux_rows)[0],
                 MESH, layout, schedule="1f1b")(x, w1, w2, v)

    def with_ys(x, w1, w2, v):
        return md.scan(lambda h, w: (step(v)(h, w)[0], md.sum(h, "d_model")), x, {"w1": w1, "w2": w2},
                       dim="layers", head=md.sum)[0]
    with pytest.raises(md.LayoutError, match=r"schedule '1f1b' runs a step that returns no scan outputs"):
        md.lower(with_ys, MESH, layout, schedule="1f1b")(x, w1, w2, v)


def test_a_head_dividing_by_a_pending_sum_made_outside():
    """The head divides by a sum over the batch made outside the pipeline (pending over data where
    it is read, as T5's token count): reduced where it is made, not inside the stage (reduced
    inside, the gradients came out wrong by up to 55%)."""
    args = inputs()

    def fn(x, w1, w2, v):
        total = md.sum(md.square(md.stop_gradient(x)))
        return md.scan(step(v), x, {"w1": w1, "w2": w2}, dim="layers",
                       head=lambda h: md.sum(md.square(h - v)) / total)[0]

    def grads(*a):
        return jax.value_and_grad(lambda *b: fn(*b).array, argnums=(1, 2, 3))(*a)
    g = md.lower(grads, MESH, LAYOUTS["pipe x data, 4 microbatches"], schedule="1f1b")
    assert_same(g(*args), grads(*args), rtol=1e-5, atol=1e-6)


def test_aux_values_of_the_head_are_summed_and_not_differentiated():
    """head -> (loss, aux): the aux values (metrics) come back summed over the microbatches under
    every schedule, and carry no gradient."""
    args = inputs()

    def fn(x, w1, w2, v):
        def head(h):
            return md.sum(md.square(h - v)), {"norm": md.sum(md.square(h)), "count": md.sum(md.ones(h.dims))}
        return md.scan(step(v), x, {"w1": w1, "w2": w2}, dim="layers", head=head)[0]

    def grads(*a):
        (loss, aux), g = jax.value_and_grad(lambda *b: (fn(*b)[0].array, fn(*b)), argnums=(1, 2, 3),
                                            has_aux=True)(*a)
        return loss, aux[1], g
    expected = grads(*args)
    assert float(expected[1]["count"].array) == 16 * 32
    for schedule in ("gpipe", "1f1b"):
        assert_same(md.lower(grads, MESH, LAYOUTS["pipe x data, 4 microbatches"], schedule=schedule)(*args),
                    expected, rtol=1e-6, atol=1e-3)
    aux_grad = jax.grad(lambda v: fn(args[0], args[1], args[2], v)[1]["norm"].array)(args[3])
    assert not np.any(np.asarray(aux_grad.array))


def test_a_scan_may_keep_gpipe_under_a_1f1b_program():
    """md.scan(..., schedule="gpipe") overrides md.lower's schedule for that scan (an encoder whose
    output a 1F1B decoder reads); explain's first pipeline entry is that scan's."""
    args = inputs()

    def fn(x, w1, w2, v):
        encoded, _ = md.scan(step(v), x, {"w1": w1, "w2": w2}, dim="layers", schedule="gpipe")
        return md.scan(lambda h, w: step(v)(h + encoded, w), x, {"w1": w1, "w2": w2}, dim="layers",
                       head=lambda h: md.sum(md.square(h)))[0]

    def grads(*a):
        return jax.value_and_grad(lambda *b: fn(*b).array, argnums=(0, 1, 2, 3))(*a)
    layout = LAYOUTS["pipe x data, 4 microbatches"]
    # values up to 2.5e5 (two stacks of residual layers): atol 1e-2 is a relative 4e-8 of the largest
    assert_same(md.lower(grads, MESH, layout, schedule="1f1b")(*args), grads(*args), rtol=1e-5, atol=1e-2)
    report = md.explain(grads, MESH, layout, *args, schedule="1f1b")
    assert report.pipeline["schedule"] == "gpipe" and report.pipeline["count"] == 2
    with pytest.raises(md.MeshDSLError, match="schedule 'zigzag' is not lowered yet"):
        md.lower(lambda x, w1, w2, v: md.scan(step(v), x, {"w1": w1, "w2": w2}, dim="layers",
                                              schedule="zigzag")[0], MESH, layout)(*args)


def test_head_aux_values_with_dims_are_summed_over_microbatches():
    """The head's aux values may keep dims other than the microbatch dim (MoE-T5's expert load per
    expert): summed over the microbatches, equal to the head on the whole carry; not differentiated."""
    x, w1, w2, v = inputs()

    def fn(x, w1, w2, v):
        head = lambda h: (md.sum(md.square(h)), {"per_feature": md.sum(md.square(h), "batch")})  # noqa: E731
        loss, aux = md.scan(step(v), x, {"w1": w1, "w2": w2}, dim="layers", head=head)[0]
        return loss, aux

    f = md.lower(fn, MESH, LAYOUTS["pipe x data, 4 microbatches"], schedule="1f1b")
    got, want = f(x, w1, w2, v), fn(x, w1, w2, v)
    assert got[1]["per_feature"].dims == want[1]["per_feature"].dims
    assert_same(got, want, rtol=1e-5, atol=1e-3)
    grad = lambda *a: jax.grad(lambda *b: fn(*b)[0].array, argnums=(1, 2))(*a)  # noqa: E731
    assert_same(md.lower(grad, MESH, LAYOUTS["pipe x data, 4 microbatches"], schedule="1f1b")(x, w1, w2, v),
                grad(x, w1, w2, v), rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("schedule", [pytest.param("gpipe", marks=pytest.mark.slow), "1f1b"])   # ~25 s each
def test_zero3_gathers_once_per_step_or_per_microbatch(schedule):
    """ZeRO-3 storage (d_model split over data) inside a pipeline: ``param_gather="keep"`` gathers
    a stage's weights once per step, before the ticks, and reduce-scatters their gradient once
    (2 x 16 KiB here, whatever M); ``"regather"`` gathers what each tick reads (per microbatch,
    again in the backward pass): more bytes, growing with M, and less memory. Both equal the
    unsharded program and explain equals the compiled HLO."""
    args = inputs()
    stage_weights = 2 * (8 // 4) * 32 * 64 * 4 * (2 - 1) // 2   # w1 and w2 of 2 layers, the half not held
    moved, temp = {}, {}
    for m in (2, 4):
        layout = md.Layout({"layers": "pipe", "batch": "data"}, params={"d_model": "data"}, microbatches={"batch": m})
        for policy in ("keep", "regather"):
            f = md.lower(loss_and_grads, MESH, layout, schedule=schedule, param_gather=policy)
            report = md.explain(loss_and_grads, MESH, layout, *args, schedule=schedule, param_gather=policy)
            compiled = f.lower(*args).compile()       # once: its collectives and its memory
            measured = {k: (v["count"], v["moved_bytes"]) for k, v in hlo_comm.analyze(compiled).summary().items()}
            assert bytes_by_kind(measured) == bytes_by_kind(explain_summary(report))
            moved[m, policy] = report.summary()["all-gather"]["bytes"], report.summary()["reduce-scatter"]["bytes"]
            temp[m, policy] = (report.to_dict()["memory_per_device"]["temporaries"],
                               compiled.memory_analysis().temp_size_in_bytes)
            if m == 2:
                assert_same(f(*args), loss_and_grads(*args), rtol=1e-5, atol=1e-3)
    # v (a d_model vector, also stored split) is gathered once: 64 B. Its gradient is reduce-scattered
    # once under 1F1B (the loss head reads v inside the pipeline too); under GPipe the stages' part
    # is reduce-scattered un-gathered before its sum over pipe (collectives.cast_gathered: a smaller
    # all-reduce than summing the gathered copy) and the head's part apart: 64 B more
    scattered = stage_weights + 64 * (2 if schedule == "gpipe" else 1)
    assert moved[2, "keep"] == moved[4, "keep"] == (stage_weights + 64, scattered)
    assert moved[2, "regather"][0] > moved[2, "keep"][0] and moved[4, "regather"][0] > moved[2, "regather"][0]
    for m in (2, 4):   # the memory side of the trade, in explain's estimate and in the compiled program
        assert temp[m, "regather"][0] < temp[m, "keep"][0] and temp[m, "regather"][1] < temp[m, "keep"][1]
