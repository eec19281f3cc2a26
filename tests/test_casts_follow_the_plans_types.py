"""A cast an op makes because one operand is typed varying (its other operands cast to vary too,
their gradients then summed over the axis) is priced only where the plan leaves that operand
typed so (meshdsl/planner/copies.py, follow_types): a producer's strategy that makes it invariant spares the
cast, and the plan sees it."""

import jax
import jax.numpy as jnp
import numpy as np

import meshdsl as md
from helpers import promises_kept


def _normal(shape, names, seed, param=False):
    x = md.named(jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32), names)
    return md.param(x) if param else x


def test_a_sum_reduced_before_an_outer_product_spares_the_cast_of_the_where_beside_it():
    """where(w > 0, einsum(v, v, x), w) with x[d c e]'s summed dim c split over the mesh, under
    grad. The einsum all at once leaves [a d e] a pending sum that the where reduces (28 KiB) or,
    reduced, typed varying: the where then casts w to vary and the backward pass all-reduces its
    gradient (28 KiB). Summing x over c first and reducing that [d e] (1.75 KiB) leaves the product
    invariant and the where casts nothing - gspmd's program. The plan priced the where's cast
    whatever the einsum did, and took 28784 B (16x gspmd)."""
    w = _normal((32, 8, 16), "e d a", 0, param=True)
    v = _normal((16,), "a", 1, param=True)
    ids = md.named(jnp.asarray(np.random.default_rng(2).integers(0, 32, (8, 16)), jnp.int32), "d c")

    def step(w, v, ids):
        def loss(w, v):
            x = md.shift(md.one_hot(ids, "e:32"), "d", 2)
            y = md.where(md.greater(w, 0.0), md.einsum(v, v, x, out="a d e"), w)
            return md.sum(md.tanh(y)).array
        return jax.grad(loss, argnums=(0, 1))(w, v)
    promises_kept(step, md.Mesh({"x": 8}), md.Layout({"c": "x"}), w, v, ids, moved={"all-reduce": 1792})
