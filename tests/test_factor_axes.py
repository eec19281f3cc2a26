"""Factor axes (meshdsl.names.mesh): inside the rewriter every mesh axis is cut into its prime factors,
so a value can be split over part of an axis. The sub-axis reshapes fuzz campaigns 13 to 15 found
(a dim split over more devices than the new leading dim has) now move what gspmd moves."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshdsl as md

from helpers import promises_kept as _kept


def test_each_axis_is_cut_into_its_prime_factors_major_first():
    mesh = md.Mesh.abstract({"x": 8, "y": 3, "z": 1, "w": 12})
    assert mesh.factors("x") == ("x.0", "x.1", "x.2")
    assert mesh.factors("y") == ("y",) and mesh.factors("z") == ("z",)
    assert [mesh.axis_size(f) for f in mesh.factors("w")] == [2, 2, 3]
    assert mesh.factor_axes[:4] == ("x.0", "x.1", "x.2", "y")
    assert mesh.expand(("z", "x")) == ("x.0", "x.1", "x.2")          # a size-1 axis splits nothing
    assert mesh.collapse(mesh.expand(("y", "x"))) == ("y", "x")
    assert mesh.axes_size(mesh.expand(("x", "w"))) == 96
    assert mesh.shape == {"x": 8, "y": 3, "z": 1, "w": 12}            # the user's axes are unchanged


def test_a_part_of_an_axis_is_written_with_the_factors_before_it():
    mesh = md.Mesh.abstract({"x": 8, "y": 2})
    assert mesh.parts(("x.0", "x.1")) == [("x:(1)4", 4)]
    assert mesh.parts(("x.2", "y")) == [("x:(4)2", 2), ("y", 2)]
    assert mesh.axes_text(("x.1", "x.2")) == "x:(2)4"
    assert mesh.axes_text(("x.0", "x.1", "x.2")) == "x"


def test_explain_shows_a_gather_over_part_of_an_axis():
    """p:4 q:4 from a:16 split over x:8: p over x:(1)4, q over x:(4)2; summing q leaves a pending
    sum over x:(4)2 and gathering p for the return gathers over x:(1)4 (the plan of fewest bytes:
    the step's time takes one all-gather over x, one collective's latency, over the two)."""
    v = md.named(jnp.arange(16.0), "a:16")
    fn = lambda v: md.sum(md.reshape(v, "p:4 q:4") ** 2, "q")
    mesh, layout = md.Mesh({"x": 8}), md.Layout({"a": "x"})
    rows = {(r.kind, r.axes) for r in md.explain(fn, mesh, layout, v, objective="bytes").collectives}
    assert rows == {("all-reduce", ("x:(4)2",)), ("all-gather", ("x:(1)4",))}
    _kept(fn, mesh, layout, v, moved={"all-reduce": 4, "all-gather": 12})


def test_reshape_into_a_leading_dim_smaller_than_its_split_moves_nothing():
    """Campaign 15: a:16 split over x:8 reshaped to p4:4 q4:4 under jax.grad. p4 cannot be split
    over all of x, so the group was gathered: 63 B where gspmd moves 7 B. With factor axes p4 takes
    x:(1)4 and q4 x:(4)2, every element stays where it is, and only the loss is reduced."""
    r = np.random.default_rng(0)
    a = md.param(md.named(jnp.asarray(r.standard_normal(16), jnp.float32), "a:16"))
    loss = lambda a: md.sum(md.tanh(md.reshape(a, "p4:4 q4:4"))).array
    grad = lambda a: jax.grad(loss)(a)
    mesh, layout = md.Mesh({"x": 8}), md.Layout({"a": "x"})
    _kept(grad, mesh, layout, a, moved={})


@pytest.mark.parametrize("mesh, layout, new", [
    ({"x": 4, "y": 2}, {"d": ("x", "y")}, "p:2 q:8"),          # over two axes, the first cut
    ({"x": 8}, {"d": "x", "q": "x"}, "p:2 q:8"),               # the layout wants q over x later
    ({"x": 2, "y": 4}, {"d": "y", "p": "x"}, "p:2 q:8"),       # the layout wants p elsewhere
    ({"x": 8}, {"d": "x"}, "p:2 q:2 r:4"),                     # three new dims, each a part
])
def test_reshapes_over_parts_of_axes_keep_the_promises(mesh, layout, new):
    r = np.random.default_rng(1)
    d = md.named(jnp.asarray(r.standard_normal(16), jnp.float32), "d:16")
    fn = lambda d: md.reshape(md.exp(d), new)
    _kept(fn, md.Mesh(mesh), md.Layout(layout), d)
    loss = lambda d: md.sum(md.tanh(fn(d)) * md.reshape(d, new)).array
    _kept(lambda d: jax.grad(loss)(d), md.Mesh(mesh), md.Layout(layout), d)


def test_merging_dims_split_over_parts_gives_back_the_whole_axis():
    """reshape there and back: [p over x:(1)4, q over x:(4)2] merge into d over x, no move."""
    d = md.named(jnp.arange(16.0), "d:16")
    fn = lambda d: md.reshape(md.reshape(d, "p:4 q:4") * 2.0, "d:16")
    _kept(fn, md.Mesh({"x": 8}), md.Layout({"d": "x"}), d, moved={})
