"""The lowered function behaves like a ``jax.jit`` function."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import meshdsl as md
from helpers import assert_same

MESH = {"data": 2, "model": 4}
LAYOUT = {"batch": "data", "d_ff": "model"}


@pytest.fixture(scope="module")
def setup():
    k = jax.random.split(jax.random.key(0), 3)
    x = md.named(jax.random.normal(k[0], (8, 16)), "batch d_model")
    w1 = md.named(jax.random.normal(k[1], (16, 32)), "d_model d_ff")
    w2 = md.named(jax.random.normal(k[2], (32, 16)), "d_ff d_model")
    return md.Mesh(MESH), md.Layout(LAYOUT), x, w1, w2


def mlp(x, w1, w2):
    return md.einsum(md.relu(md.einsum(x, w1, out="batch d_ff")), w2, out="batch d_model")


def test_traced_once_per_structure_and_shapes(setup):
    mesh, layout, x, w1, w2 = setup
    traces = []

    def fn(x, w1, w2):
        traces.append(1)
        return mlp(x, w1, w2)

    f = md.lower(fn, mesh, layout)
    f(x, w1, w2)
    f(x, w1, w2)
    f(x + 1.0, w1, w2)
    assert len(traces) == 1
    f(md.named(jnp.ones((16, 16)), "batch d_model"), w1, w2)  # new shape: traced again
    assert len(traces) == 2


def test_outputs_are_global_arrays_sharded_by_the_layout(setup):
    mesh, layout, x, w1, w2 = setup
    out = md.lower(lambda x, w1: md.einsum(x, w1, out="batch d_ff"), mesh, layout)(x, w1)
    assert isinstance(out.array, jax.Array) and out.array.shape == (8, 32)
    assert out.array.sharding.spec == jax.sharding.PartitionSpec("data", "model")
    assert out.array.sharding.mesh.shape == {"data": 2, "model": 4}


def test_placed_inputs_are_not_copied(setup):
    mesh, layout, x, w1, w2 = setup
    f = md.lower(mlp, mesh, layout)
    placed = md.place((x, w1, w2), mesh, layout)
    f(*placed)  # compile outside the guard
    with jax.transfer_guard("disallow"):
        f(*placed)
    assert md.place(placed, mesh, layout)[0].array is not None
    shard = placed[0].array.addressable_shards[0].data
    again = md.place(placed, mesh, layout)[0].array.addressable_shards[0].data
    assert shard.unsafe_buffer_pointer() == again.unsafe_buffer_pointer()


def test_callable_inside_jit_and_grad(setup):
    mesh, layout, x, w1, w2 = setup
    f = md.lower(mlp, mesh, layout)

    @jax.jit
    def outer(x, w1, w2):
        return md.sum(f(x, w1, w2)).array * 2.0

    np.testing.assert_allclose(outer(x, w1, w2), md.sum(mlp(x, w1, w2)).array * 2.0, rtol=1e-5)
    g = jax.jit(jax.grad(lambda w1: md.sum(md.square(f(x, w1, w2))).array))(w1)
    expected = jax.grad(lambda w1: md.sum(md.square(mlp(x, w1, w2))).array)(w1)
    assert_same(g, expected, rtol=1e-4, atol=1e-4)


def test_lower_gives_the_jax_lowered_and_hlo(setup):
    mesh, layout, x, w1, w2 = setup
    lowered = md.lower(mlp, mesh, layout).lower(x, w1, w2)
    assert isinstance(lowered, jax.stages.Lowered)
    text = lowered.compile().as_text()
    assert "all-reduce" in text and "num_partitions=8" in text


def test_non_named_leaves_are_replicated(setup):
    mesh, layout, x, w1, w2 = setup

    def fn(x, scale, key, n):
        noise = md.random.normal(key, x.dims)
        return x * scale + noise * n, scale * 2

    f = md.lower(fn, mesh, layout)
    args = (x, jnp.float32(3.0), jax.random.key(1), 2)
    out, doubled = f(*args)
    expected, _ = fn(*args)
    assert_same(out, expected)
    assert float(doubled) == 6.0


def test_nnx_module_arguments(setup):
    mesh, layout, x, w1, _ = setup

    class Proj(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(md.param(w1))

        def __call__(self, x):
            return md.einsum(x, self.w.get_value(), out="batch d_ff")

    m = Proj()
    f = md.lower(lambda m, x: m(x), mesh, md.Layout(LAYOUT, params={"d_model": "data"}))
    assert_same(f(m, x), m(x))
    grads = md.lower(lambda m, x: nnx.grad(lambda m: md.sum(m(x)).array)(m), mesh,
                     md.Layout(LAYOUT, params={"d_model": "data"}))(m, x)
    assert grads["w"].get_value().is_param
    assert grads["w"].get_value().array.sharding.spec == jax.sharding.PartitionSpec("data", "model")


def test_param_mark_survives_grad_and_optax(setup):
    import optax
    mesh, layout, x, w1, w2 = setup
    params = {"w1": md.param(w1), "w2": md.param(w2)}
    layout = md.Layout(LAYOUT, params={"d_model": "data"})
    grads = md.lower(lambda p: jax.grad(lambda p: md.sum(mlp(x, p["w1"], p["w2"])).array)(p), mesh, layout)(params)
    assert all(g.is_param for g in grads.values())
    opt = optax.adamw(1e-3)
    state = opt.init(params)
    updates, state = opt.update(grads, state, params)
    new = optax.apply_updates(params, updates)
    assert all(p.is_param and p.dims == params[k].dims for k, p in new.items())
    assert md.lower(lambda p: p, mesh, layout)(new)["w1"].array.sharding.spec == \
        jax.sharding.PartitionSpec("data", "model")


def test_gspmd_backend_gives_the_same_results(setup):
    mesh, layout, x, w1, w2 = setup

    def step(x, w1, w2):
        return mlp(x, w1, w2), jax.grad(lambda w1: md.sum(md.square(mlp(x, w1, w2))).array)(w1)

    f = md.lower(step, mesh, layout, backend="gspmd")
    assert_same(f(x, w1, w2), step(x, w1, w2), rtol=1e-4, atol=1e-4)
    y, _ = f(x, w1, w2)
    want = jax.sharding.NamedSharding(mesh.jax_mesh, jax.sharding.PartitionSpec("data", None))
    assert y.array.sharding.is_equivalent_to(want, 2) and y.array.sharding.spec == jax.sharding.PartitionSpec("data")


def test_abstract_mesh_can_be_explained_but_not_run(setup):
    _, layout, x, w1, w2 = setup
    big = md.Mesh.abstract({"data": 64, "model": 8})
    args = [md.named(jax.ShapeDtypeStruct((512, 1024), jnp.float32), "batch d_model"),
            md.named(jax.ShapeDtypeStruct((1024, 4096), jnp.float32), "d_model d_ff"),
            md.named(jax.ShapeDtypeStruct((4096, 1024), jnp.float32), "d_ff d_model")]
    report = md.explain(mlp, big, layout, *args)
    (rec,) = report.collectives
    assert rec.kind == "all-reduce" and rec.shape == (8, 1024)
    assert rec.bytes == pytest.approx(2 * 7 / 8 * 8 * 1024 * 4)
    assert report.flops == pytest.approx(2 * 2 * 8 * 1024 * 512)
    with pytest.raises(md.MeshDSLError, match="explained"):
        md.lower(mlp, big, layout)(x, w1, w2)
