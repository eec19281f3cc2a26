"""A scan over a dim the layout splits is a GPipe pipeline: equal to the unsharded program
(forward and gradients, tight tolerance), composed with data / tensor parallelism and ZeRO-3
storage, explained exactly (ticks, bubble, bytes = HLO), and refused clearly where it cannot run.
T5 trained under a pipeline, and the training CLI's pipeline options: test_pipeline_training.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshdsl as md
from helpers import assert_same, bytes_by_kind, explain_summary, hlo_summary

MESH = md.Mesh({"pipe": 4, "data": 2})


def inputs(batch=16, layers=8, d=32):
    k = jax.random.split(jax.random.key(0), 3)
    x = md.named(jax.random.normal(k[0], (batch, d)), "batch d_model")
    w1 = md.param(md.named(jax.random.normal(k[1], (layers, d, 2 * d)) * 0.1, "layers d_model d_ff"))
    w2 = md.param(md.named(jax.random.normal(k[2], (layers, 2 * d, d)) * 0.1, "layers d_ff d_model"))
    return x, w1, w2


def model(x, w1, w2):
    def step(h, w):
        f = md.relu(md.einsum(h, w["w1"], out="batch d_ff"))
        return h + md.einsum(f, w["w2"], out="batch d_model"), None
    h, _ = md.scan(step, x, {"w1": w1, "w2": w2}, dim="layers")
    return md.sum(md.square(h), "d_model")


def loss_and_grads(x, w1, w2):
    loss = lambda w1, w2: md.mean(model(x, w1, w2)).array
    return jax.value_and_grad(loss, argnums=(0, 1))(w1, w2)


LAYOUTS = {
    "pipe only, one microbatch": md.Layout({"layers": "pipe"}),
    "pipe x data, 4 microbatches": md.Layout({"layers": "pipe", "batch": "data"}, microbatches={"batch": 4}),
    "pipe x data, 8 microbatches": md.Layout({"layers": "pipe", "batch": "data"}, microbatches={"batch": 8}),
    "pipe x Megatron": md.Layout({"layers": "pipe", "d_ff": "data"}, microbatches={"batch": 2}),
    "pipe x data x ZeRO-3": md.Layout({"layers": "pipe", "batch": "data"}, params={"d_model": "data"},
                                      microbatches={"batch": 2}),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_forward_and_gradients_equal_the_unsharded_program(name):
    args = inputs()
    f = md.lower(model, MESH, LAYOUTS[name])
    assert_same(f(*args), model(*args), rtol=1e-5, atol=1e-5)
    g = md.lower(loss_and_grads, MESH, LAYOUTS[name])
    assert_same(g(*args), loss_and_grads(*args), rtol=1e-5, atol=1e-6)


def model_with_ys(x, w1, w2):
    """The step also returns per-example values (``[batch]``) and an activation ``[batch, d_ff]``."""
    def step(h, w):
        f = md.relu(md.einsum(h, w["w1"], out="batch d_ff"))
        h = h + md.einsum(f, w["w2"], out="batch d_model")
        return h, {"energy": md.sum(md.square(h), "d_model"), "hidden": f}
    h, ys = md.scan(step, x, {"w1": w1, "w2": w2}, dim="layers")
    return md.mean(md.square(h)) + 0.1 * md.mean(ys["energy"]) + md.mean(md.square(ys["hidden"])), ys


def loss_and_grads_with_ys(x, w1, w2):
    return jax.value_and_grad(lambda w1, w2: model_with_ys(x, w1, w2)[0].array, argnums=(0, 1))(w1, w2)


@pytest.mark.parametrize("name", ["pipe x data, 4 microbatches", "pipe x Megatron", "pipe x data x ZeRO-3"])
def test_scan_outputs_of_a_pipeline_equal_the_unsharded_scan(name):
    """ys come back stacked along layers for the whole batch (values and gradients through them),
    split over pipe like the xs: the stacking moves nothing, and explain equals the HLO."""
    args, layout = inputs(), LAYOUTS[name]
    f = md.lower(model_with_ys, MESH, layout)
    loss, ys = f(*args)
    assert ys["energy"].names == ("layers", "batch") and ys["hidden"].names == ("layers", "batch", "d_ff")
    assert ys["energy"].array.sharding.spec[0] == "pipe"      # each stage holds its own layers' ys
    assert_same((loss, ys), model_with_ys(*args), rtol=1e-5, atol=1e-5)
    g = md.lower(loss_and_grads_with_ys, MESH, layout)
    assert_same(g(*args), loss_and_grads_with_ys(*args), rtol=1e-5, atol=1e-6)
    report = md.explain(loss_and_grads_with_ys, MESH, layout, *args)
    assert bytes_by_kind(hlo_summary(g, *args)) == bytes_by_kind(explain_summary(report))
    # returning the ys moves nothing over pipe (only the ticks' ppermutes); the rest is the layers' own
    # communication, as in the same pipeline returning its carry (less that carry's sum over pipe)
    forward = md.explain(lambda x, w1, w2: model_with_ys(x, w1, w2)[1]["energy"], MESH, layout, *args)
    without = md.explain(model, MESH, layout, *args)
    assert all(r.kind == "collective-permute" for r in forward.collectives if "pipe" in r.axes)

    def layers_own(report):
        return sorted((r.kind, r.axes, r.shape, r.count) for r in report.collectives if "pipe" not in r.axes)
    assert layers_own(forward) == layers_own(without)
    assert sum(r.count for r in forward.collectives if r.kind == "collective-permute") == forward.pipeline["ticks"]


def test_a_whole_batch_scan_output_is_exact_with_one_microbatch():
    """A per-layer value over the whole batch (a mean) is refused with microbatches > 1 (in
    test_errors) and exact with one microbatch."""
    def means(x, w1, w2):
        def step(h, w):
            h = md.tanh(md.einsum(h, w, out="batch d_ff"))
            return md.einsum(h, w, out="batch d_model"), md.mean(md.square(h))
        return md.scan(step, x, w1, dim="layers")[1]
    args = inputs()
    assert_same(md.lower(means, MESH, md.Layout({"layers": "pipe", "batch": "data"}))(*args), means(*args),
                rtol=1e-5, atol=1e-6)


def test_explain_reports_the_pipeline_and_equals_the_compiled_bytes():
    args = inputs()
    layout = LAYOUTS["pipe x data, 4 microbatches"]
    report = md.explain(loss_and_grads, MESH, layout, *args, schedule="gpipe")
    p = report.to_dict()["pipeline"]
    assert {k: p[k] for k in ("stages", "microbatches", "schedule", "ticks")} == \
        {"stages": 4, "microbatches": 4, "schedule": "gpipe", "ticks": 7}
    assert p["bubble_fraction"] == pytest.approx(3 / 7)
    assert "4 stages, 4 microbatches, 7 ticks, bubble 43%" in report.to_markdown()
    measured = hlo_summary(md.lower(loss_and_grads, MESH, layout), *args)
    assert bytes_by_kind(measured) == bytes_by_kind(explain_summary(report))
    # one ppermute per tick each way, of one microbatch's activations [16/2/4 rows, 32] f32
    permutes = [r for r in report.collectives if r.kind == "collective-permute"]
    assert sum(r.count for r in permutes) == 2 * 7
    assert all(r.bytes == 2 * 32 * 4 for r in permutes)
    # gradients are reduced over data once per step, not once per microbatch
    over_data = [r for r in report.collectives
                 if r.kind == "all-reduce" and r.axes == ("data",) and r.phase == "backward"]
    assert sum(r.count for r in over_data) == 2          # w1 and w2
    assert {r.op for r in permutes} == {"scan"}


def encoder_decoder(x, w1, w2):
    """A second pipeline whose step captures the first's output (pending over pipe), as T5's
    decoder captures the encoder output."""
    def step(h, w):
        f = md.relu(md.einsum(h, w["w1"], out="batch d_ff"))
        return h + md.einsum(f, w["w2"], out="batch d_model"), None
    encoded, _ = md.scan(step, x, {"w1": w1, "w2": w2}, dim="layers")
    h, _ = md.scan(lambda h, w: step(h + encoded, w), x, {"w1": w1, "w2": w2}, dim="layers")
    return md.mean(md.square(h))


def test_a_captured_pipeline_output_is_cast_once_and_explained():
    """The captured value's rows are cut per tick at a stage-dependent offset: it is cast to vary
    over pipe once, before the ticks, so its gradient is summed over pipe once (found by the
    benchmark: jax's implicit cast inside the tick summed it once per tick, unexplained)."""
    args, layout = inputs(), LAYOUTS["pipe x data, 4 microbatches"]
    g = md.lower(jax.grad(lambda x, w1, w2: encoder_decoder(x, w1, w2).array, argnums=(0, 1, 2)), MESH, layout)
    assert_same(g(*args), jax.grad(lambda x, w1, w2: encoder_decoder(x, w1, w2).array, argnums=(0, 1, 2))(*args),
                rtol=1e-5, atol=1e-5)
    report = md.explain(jax.grad(lambda x, w1, w2: encoder_decoder(x, w1, w2).array, argnums=(0, 1, 2)), MESH,
                        layout, *args)
    assert bytes_by_kind(hlo_summary(g, *args)) == bytes_by_kind(explain_summary(report))
    over_pipe = [r for r in report.collectives if r.kind == "all-reduce" and r.axes == ("pipe",)]
    assert all(r.count == 1 for r in over_pipe)


def test_one_microbatch_is_all_bubble_and_says_so():
    report = md.explain(model, MESH, LAYOUTS["pipe only, one microbatch"], *inputs())
    assert report.pipeline["microbatches"] == 1 and report.pipeline["bubble_fraction"] == pytest.approx(0.75)
    assert "all bubble" in report.to_markdown()


def test_more_microbatches_shrink_the_bubble():
    fractions = [md.explain(model, MESH, md.Layout({"layers": "pipe"}, microbatches={"batch": m}),
                            *inputs()).pipeline["bubble_fraction"] for m in (1, 2, 4, 8)]
    assert fractions == pytest.approx([3 / 4, 3 / 5, 3 / 7, 3 / 11])


def test_errors():
    x, w1, w2 = inputs()
    with pytest.raises(md.LayoutError, match=r"'layers' of size 6 is split over pipe\(4\).*make 'layers' a multiple of 4"):
        x6, a, b = inputs(layers=6)
        md.lower(model, MESH, md.Layout({"layers": "pipe"}))(x6, a, b)
    with pytest.raises(md.LayoutError, match="leaves 8 rows per device, which 3 microbatches cannot divide"):
        md.lower(model, MESH, md.Layout({"layers": "pipe", "batch": "data"}, microbatches={"batch": 3}))(x, w1, w2)
    with pytest.raises(md.LayoutError, match="a pipeline runs over one mesh axis"):
        md.lower(model, MESH, md.Layout({"layers": ("pipe", "data")}))(x, w1, w2)
    with pytest.raises(md.MeshDSLError, match="schedule must be one of"):
        md.lower(model, MESH, md.Layout({"layers": "pipe"}), schedule="interleaved")

    def with_ys(x, w1, w2):
        return md.scan(lambda h, w: (h, md.sum(h)), x, w1, dim="layers")[1]
    with pytest.raises(md.LayoutError, match=r"ys entry 0 \[layers:2\] has no microbatch dim 'batch'.*"
                                             r"cannot be recombined exactly from 2 microbatches.*keep the 'batch' dim"):
        md.lower(with_ys, MESH, md.Layout({"layers": "pipe"}, microbatches={"batch": 2}))(x, w1, w2)
    with pytest.raises(md.LayoutError, match="scan outputs must be NamedArrays"):
        md.lower(lambda x, w1, w2: md.scan(lambda h, w: (h, h.raw), x, w1, dim="layers")[1], MESH,
                 md.Layout({"layers": "pipe"}))(x, w1, w2)

    def no_batch(x, w1, w2):
        return md.scan(lambda h, w: (h, None), md.sum(x, "batch"), w1, dim="layers")[0]
    with pytest.raises(md.LayoutError, match="has no such dim"):
        md.lower(no_batch, MESH, md.Layout({"layers": "pipe"}, microbatches={"batch": 2}))(x, w1, w2)
    with pytest.raises(md.LayoutError, match="runs forward only"):
        md.lower(lambda x, w1, w2: md.scan(lambda h, w: (h, None), x, w1, dim="layers", reverse=True)[0],
                 MESH, md.Layout({"layers": "pipe"}))(x, w1, w2)


def test_layout_microbatches_are_checked_and_shown():
    assert str(md.Layout({"layers": "pipe"}, microbatches={"batch": 8})) == "layers:pipe | microbatches batch:8"
    assert md.Layout(microbatches={"batch": 2}) != md.Layout(microbatches={"batch": 4})
    with pytest.raises(md.LayoutError, match="must be a count >= 1"):
        md.Layout(microbatches={"batch": 0})
    with pytest.raises(md.LayoutError, match="dict of one dim name"):
        md.Layout(microbatches={"batch": 2, "seq": 2})


def test_random_numbers_over_a_dim_cut_like_the_microbatches():
    """Inside a pipeline stage, a dim made from the microbatch dim (a rename, the leading dim of a
    reshape: MoE's ``[batch, seq] -> [group, group_size]``) numbers its rows within the whole batch,
    however it is placed (split like the carry, or whole): the unsharded program's draws."""
    x = md.named(jnp.asarray(np.random.default_rng(0).standard_normal((8, 8, 4)), jnp.float32), "batch seq d")
    w = md.named(jnp.ones((2, 4)), "layers d")
    key = jax.random.key(0)

    def fn(x, w):
        def step(h, wl):
            g = md.reshape(h, [md.Dim("group", h.dims["batch"].size), md.Dim("group_size", 8), md.Dim("d", 4)])
            g = md.rename(g, {"group": "group_all"})
            g = md.rename(g * md.random.uniform(key, g.dims), {"group_all": "group"})
            return md.reshape(g, f"batch:{h.dims['batch'].size} seq:8 d:4") * wl, None
        return md.scan(step, x, w, dim="layers")[0]

    for rules in ({"batch": "data", "layers": "pipe"}, {"batch": "data", "layers": "pipe", "group_all": "data"},
                  {"layers": "pipe"}):
        assert_same(md.lower(fn, md.Mesh({"pipe": 2, "data": 4}), md.Layout(rules, microbatches={"batch": 2}))(x, w),
                    fn(x, w))


# -- the fuzzer's share: random pipelines ------------------------------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import os  # noqa: E402

FUZZ_EXAMPLES = 60 if os.environ.get("MESHDSL_FUZZ") == "long" else 3


def _random_pipeline(body, key, ys="none"):
    def step(h, xs):
        w, layer = xs["w"], xs["layer"]
        f = md.einsum(h, w["w1"], out="batch d_ff")
        if body == "softmax":
            f = md.softmax(f, "d_ff")
        else:
            f = md.relu(f)
        y = md.einsum(f, w["w2"], out="batch d_model")
        if body == "captured":
            y = y + xs["c"] if "c" in xs else y
        if body == "dropout":
            keep = md.random.bernoulli(jax.random.fold_in(key, layer.raw), 0.8, y.dims)
            y = md.where(keep, y / 0.8, 0.0)
        if body == "merged dropout":   # random numbers over a dim merged from the microbatch dim (MoE's groups)
            flat = md.reshape(y, "tokens")
            keep = md.random.bernoulli(jax.random.fold_in(key, layer.raw), 0.8, flat.dims)
            y = md.reshape(md.where(keep, flat / 0.8, 0.0), list(y.dims))
        out = {"none": None, "per-example": {"y": md.sum(y * y, "d_model"), "f": f},
               "whole batch": md.mean(f)}[ys]      # 'whole batch' only with one microbatch
        return h + y * 0.5, out
    return step


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=os.environ.get("MESHDSL_FUZZ") != "long")
@given(st.data())
def test_random_pipelines_equal_the_unsharded_program(data):
    """Random schedules (GPipe; 1F1B, with the loss as the scan's head; circular with 2 or 3
    repeats), stage counts,
    microbatches, layouts inside the stage, storage rules with each param_gather policy (ZeRO-3
    gathered once per step or per microbatch), step bodies (captured values, softmax, dropout,
    dropout over a dim merged from the microbatch dim) and scan outputs (GPipe: none, per example, over the whole batch with one
    microbatch): values and gradients equal the unsharded program and md.explain's bytes equal
    the compiled program's, per collective kind."""
    schedule = data.draw(st.sampled_from(["gpipe", "1f1b", "circular"]), "schedule")
    stages = data.draw(st.sampled_from([2, 4]), "stages")
    mesh = md.Mesh({"pipe": stages, "data": 8 // stages})
    repeats = data.draw(st.sampled_from([2, 3]), "repeats") if schedule == "circular" else 1
    # circular: a microbatch waits at the first stage for its next repeat (M >= S)
    micro = data.draw(st.sampled_from([m for m in (1, 2, 4) if repeats == 1 or m >= stages]), "microbatches")
    inner = data.draw(st.sampled_from([{}, {"batch": "data"}, {"d_ff": "data"}, {"d_model": "data"}]), "inner rules")
    # a d_ff:data storage rule would meet an inner d_ff or d_model rule on the same axis (an invalid layout)
    params = data.draw(st.sampled_from([None, {"d_ff": "data"}]), "params") if not {"d_ff", "d_model"} & set(inner) \
        else None
    body = data.draw(st.sampled_from(["mlp", "softmax", "captured", "dropout", "merged dropout"]), "body")
    gather = data.draw(st.sampled_from(["keep", "regather", "auto"]), "param_gather") if params else "keep"
    ys = "none" if schedule != "gpipe" else \
        data.draw(st.sampled_from(["none", "per-example"] + ["whole batch"] * (micro == 1)), "scan outputs")
    layers = stages * repeats * data.draw(st.sampled_from([1, 2]), "layers per chunk")
    x, w1, w2 = inputs(batch=16, layers=layers, d=16)
    c = md.named(jax.random.normal(jax.random.key(7), (16, 16)), "batch d_model")
    key = jax.random.key(3)
    step = _random_pipeline(body, key, ys)

    def loss(x, w1, w2, c):
        xs = {"w": {"w1": w1, "w2": w2}, "layer": md.arange(md.Dim("layers", layers))}
        run = step if body != "captured" else (lambda h, s: step(h, {**s, "c": c}))
        if schedule == "1f1b":   # the loss inside the pipeline: the mean of squares, as a sum over the rows
            return md.scan(run, x, xs, dim="layers", head=lambda h: md.sum(md.square(h)) / (16 * 16))[0]
        h, out = md.scan(run, x, xs, dim="layers")
        extra = [md.mean(v * md.arange(v.dims["layers"]).astype(v.dtype)) for v in jax.tree_util.tree_leaves(
            out, is_leaf=lambda v: isinstance(v, md.NamedArray))]     # weighted by layer: the order counts
        return md.mean(md.square(h)) + sum(extra[1:], extra[0]) * 0.1 if extra else md.mean(md.square(h))

    def program(x, w1, w2, c):
        return jax.value_and_grad(lambda x, w1: loss(x, w1, w2, c).array, argnums=(0, 1))(x, w1)

    layout = md.Layout({"layers": "pipe", **inner}, params=params, microbatches={"batch": micro})
    f = md.lower(program, mesh, layout, schedule=schedule, param_gather=gather, repeats=repeats)
    assert_same(f(x, w1, w2, c), program(x, w1, w2, c), rtol=1e-4, atol=1e-6)
    report = md.explain(program, mesh, layout, x, w1, w2, c, schedule=schedule, param_gather=gather, repeats=repeats)
    assert report.pipeline["microbatches"] == micro and report.pipeline["stages"] == stages
    assert report.pipeline["schedule"] == schedule
    if schedule != "1f1b":
        assert report.pipeline["ticks"] == repeats * micro + stages - 1
    assert bytes_by_kind(hlo_summary(f, x, w1, w2, c)) == bytes_by_kind(explain_summary(report))
