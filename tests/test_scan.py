"""``md.scan`` over stacked layers: layout invariance, gradients, and counted communication."""

import jax
import jax.numpy as jnp
import pytest

import meshdsl as md
from helpers import assert_same, bytes_by_kind, check_layout, explain_summary, hlo_summary, promises_kept

L, B, S, D, F = 4, 8, 8, 16, 32


@pytest.fixture(scope="module")
def stack():
    k = jax.random.split(jax.random.key(5), 4)
    params = {
        "w1": md.param(md.named(jax.random.normal(k[0], (L, D, F)) * 0.3, "layers d_model d_ff")),
        "w2": md.param(md.named(jax.random.normal(k[1], (L, F, D)) * 0.3, "layers d_ff d_model")),
        "scale": md.param(md.named(1 + 0.1 * jax.random.normal(k[2], (L, D)), "layers d_model")),
    }
    x = md.named(jax.random.normal(k[3], (B, S, D)), "batch seq d_model")
    return params, x


def layer(x, p):
    h = x * md.rsqrt(md.mean(md.square(x), "d_model") + 1e-6) * p["scale"]
    h = md.relu(md.einsum(h, p["w1"], out="batch seq d_ff"))
    return x + md.einsum(h, p["w2"], out="batch seq d_model"), md.mean(h, "d_ff seq")


def net(params, x):
    return md.scan(layer, x, params, dim="layers")


def loss(params, x):
    y, aux = net(params, x)
    return md.mean(md.square(y)) + md.mean(aux)


MESH = {"data": 2, "model": 4}
CASES = {
    "data": {"batch": "data"},
    "megatron": {"batch": "data", "d_ff": "model"},
    "sequence": {"batch": "data", "seq": "model"},
}


@pytest.mark.parametrize("name", list(CASES))
def test_scan_forward_and_stacked_outputs(name, stack):
    params, x = stack
    check_layout(net, md.Mesh(MESH), md.Layout(CASES[name]), params, x, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name, params_rule", [("megatron", None), ("data", {"d_model": "data"}),
                                                ("sequence", {"layers": "model"})])
def test_scan_gradients_inside_and_around(name, params_rule, stack):
    params, x = stack
    mesh, layout = md.Mesh(MESH), md.Layout(CASES[name], params=params_rule)
    expected = jax.grad(lambda p: loss(p, x).array)(params)
    inside = md.lower(lambda p, x: jax.grad(lambda p: loss(p, x).array)(p), mesh, layout)(params, x)
    assert_same(inside, expected, rtol=1e-4, atol=1e-4)
    f = md.lower(loss, mesh, layout)
    around = jax.grad(lambda p: f(p, x).array)(params)
    assert_same(around, expected, rtol=1e-4, atol=1e-4)


def test_collectives_in_the_body_count_once_per_layer(stack):
    params, x = stack
    mesh, layout = md.Mesh(MESH), md.Layout(CASES["megatron"])
    f = md.lower(net, mesh, layout)
    hlo = hlo_summary(f, params, x)
    report = md.explain(net, mesh, layout, params, x)
    per_layer = 2 * 3 / 4 * (B // 2 * S * D * 4)  # one all-reduce of the layer output over model
    aux = 2 * 3 / 4 * (L * B // 2 * 4)  # the stacked per-layer means over d_ff: pending until the end
    assert hlo["all-reduce"] == (L + 1, pytest.approx(L * per_layer + aux))
    assert explain_summary(report)["all-reduce"] == (L + 1, pytest.approx(L * per_layer + aux))


def fsdp_report(policy, matrix_gathers, stack):
    """ZeRO-3 inside a scan: gather once and keep for the backward pass (fewest bytes), or gather
    the einsum weights again in the backward pass (less memory). GSPMD gives no choice; md.explain
    shows both, bytes and memory."""
    params, x = stack
    mesh = md.Mesh(MESH)
    layout = md.Layout({"batch": "data"}, params={"d_model": "data"})

    def grads(p, x):
        return jax.grad(lambda p: loss(p, x).array)(p)

    f = md.lower(grads, mesh, layout, param_gather=policy)
    assert_same(f(params, x), grads(params, x), rtol=1e-4, atol=1e-4)
    hlo = hlo_summary(f, params, x)
    matrices, scale = 1 / 2 * (D * F * 4) * 2, 1 / 2 * (D * 4)  # w1 + w2, and the norm scale, per layer
    assert hlo["all-gather"][1] == pytest.approx(L * (matrix_gathers * matrices + scale))
    assert hlo["reduce-scatter"][1] == pytest.approx(L * (matrices + scale))
    report = md.explain(grads, mesh, layout, params, x, param_gather=policy)
    assert bytes_by_kind(explain_summary(report)) == pytest.approx(bytes_by_kind(hlo))
    return report


@pytest.mark.parametrize("policy, matrix_gathers", [("keep", 1), ("regather", 2)])
def test_fsdp_in_scan_keeps_or_regathers_the_weights(policy, matrix_gathers, stack):
    fsdp_report(policy, matrix_gathers, stack)


def test_regather_trades_bytes_for_memory(stack):
    reports = {p: fsdp_report(p, g, stack) for p, g in [("keep", 1), ("regather", 2)]}
    assert reports["regather"].total_bytes > reports["keep"].total_bytes
    assert reports["regather"].memory["temporaries"] < reports["keep"].memory["temporaries"]


def test_scan_keeps_carry_dims_and_type(stack):
    _, x = stack

    def bad(x):
        return md.scan(lambda c, p: (md.sum(c, "seq"), None), x, md.zeros("layers:2 d_model:16"))

    with pytest.raises(md.ShapeError, match="carry entry 0 entered as"):
        bad(x)
    with pytest.raises(md.ShapeError, match="no dim 'layers'"):
        md.scan(lambda c, p: (c, None), x, md.zeros("d_model:16"))


def test_scan_over_a_split_dim_is_a_pipeline_with_its_scan_outputs(stack):
    """net's step returns per-layer outputs with the batch dim (a mean over d_ff and seq): the
    pipeline returns them, stacked along layers, with one microbatch or several."""
    params, x = stack
    for micro in (1, 2):
        f = md.lower(net, md.Mesh(MESH), md.Layout({"layers": "model"}, microbatches={"batch": micro}))
        assert_same(f(params, x), net(params, x), rtol=1e-4, atol=1e-5)


def test_plain_array_carry_and_reverse(stack):
    params, x = stack

    def count(params, x):
        def step(c, p):
            y, n = c
            y, _ = layer(y, p)
            return (y, n + 1), md.sum(p["scale"])
        return md.scan(step, (x, jnp.zeros((), jnp.int32)), params, dim="layers", reverse=True)

    check_layout(count, md.Mesh(MESH), md.Layout(CASES["megatron"]), params, x, rtol=1e-4, atol=1e-4)


def test_values_captured_by_the_step_are_relaid_once_outside_the_loop(stack):
    """A decoder stack reading the encoder output: its cast to 'varying over model' (for the
    Megatron einsums) happens once before the loop, so the backward pass adds the L layers'
    cotangents locally and all-reduces them once, not once per layer."""
    params, x = stack
    mesh, layout = md.Mesh(MESH), md.Layout(CASES["megatron"])
    context = md.rename(x, {"seq": "kv_seq"})

    def grad_of_context(params, context):
        def loss(context):
            def step(c, p):
                h = md.relu(md.einsum(context, p["w1"], out="batch kv_seq d_ff"))
                return c + md.sum(md.einsum(h, p["w2"], out="batch kv_seq d_model"), "kv_seq"), None
            out, _ = md.scan(step, md.zeros("batch:8 d_model:16"), params, dim="layers")
            return md.sum(md.square(out)).array
        return jax.grad(loss)(context)

    f = check_layout(grad_of_context, mesh, layout, params, context, rtol=1e-4, atol=1e-4)
    report = md.explain(grad_of_context, mesh, layout, params, context)
    backward = [r for r in report.collectives if r.phase == "backward" and r.axes == ("model",)]
    assert [(r.kind, r.count) for r in backward] == [("all-reduce", 1)]
    assert bytes_by_kind(explain_summary(report)) == pytest.approx(bytes_by_kind(hlo_summary(f, params, context)))


def test_a_carry_the_step_leaves_split_enters_split():
    """A running sum over a parameter stored split (d: x): the step leaves the carry split like
    the parameter. Bringing it back whole would gather it every step (8 x 896 B); the loop is
    traced again with the carry entering split, and only the result is gathered, once (as gspmd)."""
    w = md.param(md.named(jax.random.normal(jax.random.key(0), (8, 8, 32)), "c d e"))

    def run(w):
        step = lambda c, wi: (md.tanh(c + wi) * 0.5 + c * 0.5, None)
        return md.scan(step, md.sum(w, "c") * 0.1, w, dim="c")[0]

    mesh, layout = md.Mesh({"x": 8}), md.Layout({}, params={"d": "x"})
    f = md.lower(run, mesh, layout)
    assert_same(f(w), run(w), rtol=1e-5, atol=1e-5)
    assert hlo_summary(f, w) == explain_summary(md.explain(run, mesh, layout, w)) == {"all-gather": (1, 896)}
    assert bytes_by_kind(hlo_summary(md.lower(run, mesh, layout, backend="gspmd"), w))["all-gather"] >= 896


@jax.checkpoint   # defined once: jax caches its trace by function and argument types
def _remat_layer(h, w):
    return md.rename(md.tanh(md.einsum(h, w, out="b f")), {"f": "d"})


@pytest.mark.parametrize("layout", [{"e": "model", "f": "model"}, {"e": "model", "f": "data"}])
def test_a_rematerialised_step_traced_by_several_candidates_runs_its_rules_in_each(layout):
    """A step jax.checkpoint'ed once, scanned over a carry entering as a pending sum: the planner
    traces the loop once per candidate, and jax would hand each later trace the first one's
    program (its cache), with none of this trace's collectives recorded (explain 48 B where the
    program moved 2736). Each trace of the rewriter is a trace of its own to jax."""
    keys = jax.random.split(jax.random.key(0), 3)
    x = md.named(jax.random.normal(keys[0], (8, 16)), "b d")
    y = md.named(jax.random.normal(keys[1], (8, 16)), "b e")
    w = md.named(jax.random.normal(keys[2], (2, 16, 16)), "L d f")

    def fn(x, y, w):
        h = md.einsum(md.einsum(x, y, out="b d"), x, out="b d")
        h, _ = md.scan(lambda h, w: (_remat_layer(h, w), None), h, w, dim="L")
        return md.sum(h * h)

    def grads(x, y, w):
        return jax.grad(lambda w: fn(x, y, w).array)(w)

    promises_kept(grads, md.Mesh({"data": 2, "model": 4}), md.Layout(layout), x, y, w)
