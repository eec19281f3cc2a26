"""md.reshape: adding or removing a size-1 dim moves no data (the other dims keep their split)."""

import jax
import jax.numpy as jnp
import numpy as np

import meshdsl as md
from helpers import assert_same

MESH = md.Mesh({"data": 2, "model": 4})


def test_dropping_and_adding_a_size_one_dim_keeps_the_other_splits():
    x = md.named(jnp.arange(2 * 1 * 8 * 4, dtype=jnp.float32).reshape(2, 1, 8, 4), "batch seq heads d_kv")
    layout = md.Layout({"batch": "data", "heads": "model"})
    drop = lambda x: md.reshape(x, "batch heads d_kv")
    add = lambda x: md.reshape(md.reshape(x, "batch heads d_kv"), "batch heads one:1 d_kv")
    for fn in (drop, add):
        assert md.explain(fn, MESH, layout, x).collectives == []
        assert_same(md.lower(fn, MESH, layout)(x), fn(x), rtol=0, atol=0)
    # a real merge next to a size-1 dim still works
    merge = lambda x: md.reshape(x, "batch seq hd:32")
    assert_same(md.lower(merge, MESH, layout)(x), merge(x), rtol=0, atol=0)
    np.testing.assert_array_equal(drop(x).array, np.asarray(x.array)[:, 0])
