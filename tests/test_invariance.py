"""Layout invariance: every valid layout reproduces the unsharded program.

Each program runs once on global arrays (the reference) and once lowered under each layout, on 1-D,
2-D and 3-D meshes of 8 devices, dims over two mesh axes included; forward values, ``jax.grad``
inside the program, and ``jax.grad`` around the lowered function must all agree.
"""

import jax
import jax.numpy as jnp
import pytest

import meshdsl as md
from helpers import assert_same, check_layout

B, S, D, F, H, K, V = 8, 16, 32, 64, 8, 4, 32

MESH_2D = {"data": 2, "model": 4}
LAYOUTS = {
    "replicated": (MESH_2D, {}, None),
    "data": (MESH_2D, {"batch": "data"}, None),
    "megatron": (MESH_2D, {"batch": "data", "d_ff": "model", "heads": "model", "vocab": "model"}, None),
    "sequence": (MESH_2D, {"batch": "data", "seq": "model"}, None),
    "2d-weights": (MESH_2D, {"d_model": "data", "d_ff": "model", "heads": "model"}, None),
    "zero3": (MESH_2D, {"batch": "data", "heads": "model"}, {"d_model": "data"}),
    "1d-model": ({"x": 8}, {"d_ff": "x", "heads": "x", "vocab": "x"}, None),
    "1d-sequence": ({"x": 8}, {"seq": "x"}, None),
    "two-axes": ({"pod": 2, "data": 2, "model": 2}, {"batch": ("pod", "data"), "d_ff": "model", "kv_seq": "model"},
                 None),
}


def layout_case(name):
    mesh, rules, params = LAYOUTS[name]
    return md.Mesh(mesh), md.Layout(rules, params=params)


@pytest.fixture(scope="module")
def data():
    k = iter(jax.random.split(jax.random.key(42), 16))
    normal = lambda shape, scale=1.0: jax.random.normal(next(k), shape) * scale  # noqa: E731
    params = {
        "w1": md.param(md.named(normal((D, F), 0.2), "d_model d_ff")),
        "w2": md.param(md.named(normal((F, D), 0.2), "d_ff d_model")),
        "wq": md.param(md.named(normal((D, H, K), 0.2), "d_model heads d_kv")),
        "wk": md.param(md.named(normal((D, H, K), 0.2), "d_model heads d_kv")),
        "wv": md.param(md.named(normal((D, H, K), 0.2), "d_model heads d_kv")),
        "wo": md.param(md.named(normal((H, K, D), 0.2), "heads d_kv d_model")),
        "emb": md.param(md.named(normal((V, D)), "vocab d_model")),
        "scale": md.param(md.named(1.0 + normal((D,), 0.1), "d_model")),
    }
    x = md.named(normal((B, S, D)), "batch seq d_model")
    ids = md.named(jax.random.randint(next(k), (B, S), 0, V), "batch seq")
    return params, x, ids


def rms_norm(x, scale):
    var = md.mean(md.square(x), "d_model")
    return x * md.rsqrt(var + 1e-6) * scale


def block(p, x):
    """A pre-norm transformer block: attention, then a ReLU MLP, both residual."""
    h = rms_norm(x, p["scale"])
    q = md.einsum(h, p["wq"], out="batch seq heads d_kv")
    kv_in = md.rename(h, {"seq": "kv_seq"})
    k = md.einsum(kv_in, p["wk"], out="batch kv_seq heads d_kv")
    v = md.einsum(kv_in, p["wv"], out="batch kv_seq heads d_kv")
    w = md.softmax(md.einsum(q, k, out="batch heads seq kv_seq"), "kv_seq")
    o = md.einsum(md.einsum(w, v, out="batch seq heads d_kv"), p["wo"], out="batch seq d_model")
    x = x + o
    h = md.relu(md.einsum(rms_norm(x, p["scale"]), p["w1"], out="batch seq d_ff"))
    return x + md.einsum(h, p["w2"], out="batch seq d_model")


def lm_loss(p, x, ids):
    """Block, tied-embedding logits, cross-entropy against ``ids``: a scalar NamedArray."""
    x = x + md.take(p["emb"], ids, "vocab")
    logits = md.einsum(block(p, x), p["emb"], out="batch seq vocab")
    target = md.sum(logits * md.one_hot(ids, md.Dim("vocab", V)), "vocab")
    return md.mean(md.logsumexp(logits, "vocab") - target)


ALL = list(LAYOUTS)


@pytest.mark.parametrize("name", ALL)
def test_forward(name, data):
    params, x, ids = data
    mesh, layout = layout_case(name)
    check_layout(lambda p, x, ids: (block(p, x), lm_loss(p, x, ids)), mesh, layout, params, x, ids,
                 rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("name", ALL)
def test_grad_inside(name, data):
    params, x, ids = data
    mesh, layout = layout_case(name)

    def step(p, x, ids):
        loss, grads = jax.value_and_grad(lambda p: lm_loss(p, x, ids).array)(p)
        return loss, grads

    expected_loss, expected = step(params, x, ids)
    loss, grads = md.lower(step, mesh, layout)(params, x, ids)
    assert jnp.allclose(loss, expected_loss, rtol=1e-5)
    assert_same(grads, expected, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("name", ["megatron", "zero3", "two-axes", "1d-model"])
def test_grad_around_lowered_function(name, data):
    params, x, ids = data
    mesh, layout = layout_case(name)
    f = md.lower(lm_loss, mesh, layout)
    expected = jax.grad(lambda p: lm_loss(p, x, ids).array)(params)
    got = jax.grad(lambda p: f(p, x, ids).array)(params)
    assert_same(got, expected, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("name", ["sequence", "megatron", "two-axes"])
def test_indexing_ops(name, data):
    _, x, ids = data
    mesh, layout = layout_case(name)

    def f(x, ids):
        values, idx = md.top_k(x, "seq", k=3, out="top")
        return (values, idx, md.cumsum(x, "seq"), md.shift(x, "seq", 3), md.shift(x, "seq", -6, wrap=True),
                md.argmax(x, "d_model"), md.max(x, "seq"), md.min(x, "batch"),
                md.one_hot(ids, md.Dim("vocab", V)), md.sum(x, "batch seq"), md.mean(x))

    check_layout(f, mesh, layout, x, ids, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["sequence", "megatron", "2d-weights", "two-axes"])
def test_shaping_ops(name, data):
    params, x, _ = data
    mesh, layout = layout_case(name)

    def f(x, wq):
        heads = md.reshape(x, "batch seq heads:8 d_kv:4")
        merged = md.reshape(heads, "batch seq d_model:32")
        both = md.concat([x, md.slice(x, "seq", 4, 8)], "seq")
        return (heads, merged, both, md.pad(x, "seq", 1, 3), md.transpose(x, "d_model batch seq"),
                md.rename(md.einsum(x, wq, out="batch seq heads d_kv"), {"seq": "kv_seq", "heads": "h"}))

    check_layout(f, mesh, layout, x, params["wq"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["sequence", "two-axes", "1d-sequence"])
def test_gradients_of_communicating_ops(name, data):
    """Every op whose lowering communicates, differentiated through (inside the program)."""
    _, x, _ = data
    mesh, layout = layout_case(name)

    def loss(x):
        values, _ = md.top_k(x, "seq", k=2, out="top")
        y = (md.sum(values) + md.sum(md.cumsum(x, "seq") * 0.1) + md.sum(md.shift(x, "seq", 5) * x)
             + md.sum(md.max(x, "seq")) + md.sum(md.logsumexp(x, "seq")) + md.sum(md.softmax(x, "seq") * x))
        return y.array

    expected = jax.grad(loss)(x)
    got = md.lower(lambda x: jax.grad(loss)(x), mesh, layout)(x)
    assert_same(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["sequence", "megatron", "two-axes"])
def test_random_numbers_are_layout_invariant(name):
    mesh, layout = layout_case(name)

    def draw(key):
        dims = "batch:8 seq:16 d_ff:64"
        return (md.random.normal(key, dims), md.random.uniform(key, dims, minval=-2.0, maxval=3.0),
                md.random.bernoulli(key, 0.3, dims), md.arange(md.Dim("seq", 16)), md.ones("batch:8 d_ff:64"))

    check_layout(draw, mesh, layout, jax.random.key(3), rtol=1e-6, atol=1e-6)  # fused float rounding


def test_random_matches_jax_random_on_the_global_shape():
    key = jax.random.key(7)
    got = md.random.normal(key, "batch:8 seq:16 d_ff:64").array
    assert jnp.array_equal(got, jax.random.normal(key, (8, 16, 64)))
    got = md.random.uniform(key, "a:4 b:6").array
    assert jnp.array_equal(got, jax.random.uniform(key, (4, 6)))
    got = md.random.bernoulli(key, 0.25, "a:40").array
    assert jnp.array_equal(got, jax.random.bernoulli(key, 0.25, (40,)))


@pytest.mark.parametrize("name", ["data", "zero3", "megatron"])
def test_loss_with_a_term_of_parameters_only(name, data):
    """An L2 penalty is computed identically on every data-parallel device: its gradient must be
    counted once, not once per device (values replicated but typed varying are made invariant)."""
    params, x, ids = data
    mesh, layout = layout_case(name)

    def grads(p, x, ids):
        def loss(p):
            penalty = md.sum(md.square(p["w1"])) + md.sum(md.square(p["emb"]))
            return (lm_loss(p, x, ids) + 0.01 * penalty).array
        return jax.grad(loss)(p)

    assert_same(md.lower(grads, mesh, layout)(params, x, ids), grads(params, x, ids), rtol=2e-4, atol=2e-4)
