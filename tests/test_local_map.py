"""Foreign code inside md.lower: ``md.named`` refuses a device's block; ``md.local_map`` runs plain
jax / flax code on named values and reproduces the unsharded program under every layout."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import meshdsl as md
from helpers import assert_same

MESH = md.Mesh({"data": 2, "model": 4})
LAYOUTS = [md.Layout({}), md.Layout({"batch": "data"}), md.Layout({"batch": ("model", "data")}),
           md.Layout({"batch": "data", "d_model": "model"})]


def x_and_linear():
    x = md.named(jax.random.normal(jax.random.key(0), (8, 16)), "batch d_model")
    return x, nnx.Linear(16, 32, rngs=nnx.Rngs(1))


def test_md_named_on_a_local_block_is_refused():
    x, lin = x_and_linear()

    def fn(x):
        return md.named(lin(x.array), "batch d_ff")      # x.array is this device's rows

    assert fn(x).shape == {"batch": 8, "d_ff": 32}          # fine unsharded
    with pytest.raises(md.LayoutError, match=r"varies over mesh axes data\).*md.local_map"):
        md.lower(fn, MESH, md.Layout({"batch": "data"}))(x)


def test_md_named_on_a_whole_value_inside_lower_is_fine():
    x, _ = x_and_linear()

    def fn(x):
        return x + md.named(jnp.ones(16), "d_model")

    assert_same(md.lower(fn, MESH, md.Layout({"batch": "data"}))(x), fn(x))


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("keep", ["", "batch"])
def test_local_map_of_a_flax_module_equals_the_unsharded_program(layout, keep):
    x, lin = x_and_linear()

    def fn(x):
        h = md.local_map(lin, x, out="batch d_ff", keep=keep)
        return md.sum(md.tanh(h) * 2.0, "d_ff")

    assert_same(md.lower(fn, MESH, layout)(x), fn(x))
    grad = lambda x: jax.grad(lambda x: md.sum(fn(x)).array)(x)
    assert_same(md.lower(grad, MESH, layout)(x), grad(x))


def test_local_map_keeps_the_split_of_kept_dims_and_gathers_the_rest():
    x, lin = x_and_linear()
    layout = md.Layout({"batch": "data", "d_model": "model"})
    fn = lambda x: md.local_map(lin, x, out="batch d_ff", keep="batch")
    report = md.explain(fn, MESH, layout, x)
    # d_model (split on model) is gathered for the function; batch stays split on data
    assert report.counts() == {"all-gather": 1}
    assert report.collectives[0].axes == ("model",)


def test_local_map_errors():
    x, lin = x_and_linear()
    with pytest.raises(md.ShapeError, match="keep names 'd_ff'"):
        md.local_map(lin, x, out="batch d_ff", keep="d_ff")
    with pytest.raises(md.ShapeError, match=r"returned an array of shape \(8, 32\) for 1 dims"):
        md.local_map(lin, x, out="d_ff")
    with pytest.raises(md.ShapeError, match="out writes d_ff:16 but the function returned d_ff:32"):
        md.local_map(lin, x, out="batch d_ff:16")
    with pytest.raises(md.ShapeError, match="first argument must be a function"):
        md.local_map(x, x, out="batch d_model")
    with pytest.raises(md.ShapeError, match="changed the size of kept dim 'batch'"):
        md.lower(lambda x: md.local_map(lambda a: a[:2], x, out="batch d_model", keep="batch"),
                 MESH, md.Layout({"batch": "data"}))(x)
    np.testing.assert_allclose(md.local_map(jnp.tanh, x, out="batch d_model").array, jnp.tanh(x.array))
