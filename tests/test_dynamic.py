"""md.dynamic_slice / md.dynamic_update_slice (KV caches): equal to the unsharded program under
every layout, forward and backward; a cache split along the written dim is never gathered and a
read moves only the slice (explain == HLO); one test per error message."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshdsl as md
from helpers import assert_same, bytes_by_kind, explain_summary, hlo_summary

MESH = md.Mesh({"data": 2, "model": 4})
LAYOUTS = [md.Layout({}), md.Layout({"kv_length": "model"}), md.Layout({"kv_length": ("model", "data")}),
           md.Layout({"kv_length": ("data", "model")}), md.Layout({"batch": "data", "kv_length": "model"}),
           md.Layout({"d": "model", "batch": "data"})]


def cache_and_update():
    cache = md.named(jnp.arange(2 * 16 * 4, dtype=jnp.float32).reshape(2, 16, 4), "batch kv_length d")
    new = md.named(-jnp.arange(1, 9, dtype=jnp.float32).reshape(2, 4), "batch d")   # one position
    block = md.named(-jnp.ones((2, 8, 4)), "batch kv_length d")                    # several
    return cache, new, block


def step(cache, new, block, t):
    return (md.dynamic_update_slice(cache, new, "kv_length", t),
            md.dynamic_update_slice(cache, block, "kv_length", t),
            md.dynamic_slice(cache, "kv_length", t, 8),
            md.dynamic_slice(cache, "kv_length", t, None))


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_values_and_clamping_equal_the_unsharded_program(layout):
    args = cache_and_update()
    f = md.lower(step, MESH, layout)
    for t in (0, 5, 15, 20, -3):      # 15 and 20 clamp to 8 for 8 entries, as jax.lax does
        assert_same(f(*args, jnp.int32(t)), step(*args, t), rtol=0, atol=0)
    ref = jax.lax.dynamic_update_slice_in_dim(args[0].array, args[1].array[:, None], 15, axis=1)
    np.testing.assert_array_equal(f(*args, jnp.int32(15))[0].array, ref)


@pytest.mark.parametrize("layout", LAYOUTS[:3], ids=str)
def test_gradients_equal_the_unsharded_program(layout):
    cache, new, _ = cache_and_update()

    def grads(cache, new, t):
        def loss(cache, new):
            written = md.dynamic_update_slice(cache, new, "kv_length", t)
            read = md.dynamic_slice(written, "kv_length", t + 1, 8)
            return md.sum(md.square(written)).array + md.sum(read * read * 3.0).array
        return jax.grad(loss, argnums=(0, 1))(cache, new)

    assert_same(md.lower(grads, MESH, layout)(cache, new, jnp.int32(6)), grads(cache, new, 6))


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.uint8, jnp.bool_])
def test_integer_and_bool_caches(dtype):
    cache = md.named((jnp.arange(32).reshape(2, 16) % 3).astype(dtype), "batch kv_length")
    new = md.named(jnp.ones((2,), dtype), "batch")
    fn = lambda c, u, t: (md.dynamic_update_slice(c, u, "kv_length", t), md.dynamic_slice(c, "kv_length", t, 4))
    got = md.lower(fn, MESH, md.Layout({"kv_length": "model"}))(cache, new, jnp.int32(5))
    assert_same(got, fn(cache, new, 5), rtol=0, atol=0)
    assert got[0].dtype == dtype


def test_a_write_into_a_split_cache_moves_nothing_and_a_read_moves_only_the_slice():
    cache, new, _ = cache_and_update()
    layout = md.Layout({"batch": "data", "kv_length": "model"})
    write = lambda c, u, t: md.dynamic_update_slice(c, u, "kv_length", t)
    assert md.explain(write, MESH, layout, cache, new, jnp.int32(3)).collectives == []
    assert hlo_summary(md.lower(write, MESH, layout), cache, new, jnp.int32(3)) == {}

    read = lambda c, t: md.dynamic_slice(c, "kv_length", t, None)   # [batch d], batch split on data
    report = md.explain(read, MESH, layout, cache, jnp.int32(3))
    assert explain_summary(report) == {"all-reduce": (1, 2 * 3 / 4 * (1 * 4 * 4))}   # the slice only
    measured = hlo_summary(md.lower(read, MESH, layout), cache, jnp.int32(3))
    assert bytes_by_kind(measured) == bytes_by_kind(explain_summary(report))


def test_a_read_of_a_pending_sum_reduces_only_the_slice():
    """A read is linear: an operand carrying a pending sum (an einsum contracting a split dim)
    is read where it is and the sum reduced on the slice, not on the whole operand first."""
    r = np.random.default_rng(0)
    q = md.named(jnp.asarray(r.standard_normal((16, 8)), jnp.float32), "kv_length d")
    w = md.named(jnp.asarray(r.standard_normal((8, 4)), jnp.float32), "d e")
    fn = lambda q, w, t: md.dynamic_slice(md.einsum(q, w, out="kv_length e"), "kv_length", t, None)
    layout = md.Layout({"d": "model"})
    report = md.explain(fn, MESH, layout, q, w, jnp.int32(5))
    assert explain_summary(report) == {"all-reduce": (1, 2 * 3 / 4 * (4 * 4))}   # [e:4], not [kv_length e]
    measured = hlo_summary(md.lower(fn, MESH, layout), q, w, jnp.int32(5))
    assert bytes_by_kind(measured) == bytes_by_kind(explain_summary(report))
    assert_same(md.lower(fn, MESH, layout)(q, w, jnp.int32(5)), fn(q, w, 5), rtol=1e-5, atol=1e-5)


def test_start_may_be_a_named_scalar():
    cache, new, _ = cache_and_update()
    fn = lambda c, u, t: md.dynamic_update_slice(c, u, "kv_length", t)
    t = md.named(jnp.int32(4), "")
    assert_same(md.lower(fn, MESH, md.Layout({"kv_length": "model"}))(cache, new, t), fn(cache, new, t))


def test_errors():
    cache, new, block = cache_and_update()
    with pytest.raises(md.ShapeError, match="dynamic_slice dim must be one dim"):
        md.dynamic_slice(cache, "kv_length d", 0, 1)
    with pytest.raises(md.ShapeError, match="size 17 must be a Python int in 0..16"):
        md.dynamic_slice(cache, "kv_length", 0, 17)
    with pytest.raises(md.ShapeError, match="start must be a 0-d integer"):
        md.dynamic_slice(cache, "kv_length", 1.5, 2)
    with pytest.raises(md.ShapeError, match=r"start must be a 0-d integer, got \[batch:2"):
        md.dynamic_slice(cache, "kv_length", md.named(jnp.zeros((2,), jnp.int32), "batch"), 2)
    with pytest.raises(md.ShapeError, match="must have the dims of"):
        md.dynamic_update_slice(cache, md.named(jnp.ones(4), "d"), "kv_length", 0)
    with pytest.raises(md.ShapeError, match="only 'kv_length' may differ"):
        md.dynamic_update_slice(cache, md.named(jnp.ones((2, 3)), "batch d"), "kv_length", 0)
    with pytest.raises(md.ShapeError, match="larger than x's kv_length:16"):
        md.dynamic_update_slice(cache, md.named(jnp.ones((2, 17, 4)), "batch kv_length d"), "kv_length", 0)
