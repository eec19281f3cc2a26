"""Reshapes as the long fuzz campaigns found them (tests/fuzz_campaign.py, replayed with
tests/fuzz_replay.py): a split spread over the new dims or parts of axes, a pending sum reshaped
onto its axis, a copy gathered for the return read again; each with the property the contract
promises (the unsharded values, explicit bytes <= gspmd bytes, explain == HLO)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshdsl as md

from helpers import assert_same, explain_vs_hlo, moved_by_backend, promises_kept, same_unsharded

_moved, _explain_vs_hlo, _same, _kept = moved_by_backend, explain_vs_hlo, same_unsharded, promises_kept


def _vector(n, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(n), jnp.float32)


def test_reshape_of_a_dim_split_finer_than_its_leading_part():
    """d split over x:4 reshaped to p2 q4 (x does not divide p2): p takes the major half of x and
    q its minor half (factor axes, meshdsl.names.mesh) - before them it gathered d, 24 B where gspmd
    moves 16 B."""
    v = md.param(md.named(jnp.asarray(np.random.default_rng(0).standard_normal(8), jnp.float32), "d"))
    moved = _moved(lambda v: md.reshape(v, "p2:2 q4:4"), md.Mesh({"x": 4, "y": 2}),
                   md.Layout({"d": "x", "q4": "y"}), v)
    assert moved["explicit"] <= moved["gspmd"], moved


def test_reshape_into_dims_the_layout_cannot_place_is_a_layout_error():
    """A layout placing p2 on x+y and q4 on x: [p2 q4] has no valid placement. The reshape's
    choice between placements must not reach it first (it raised an AssertionError)."""
    c = md.named(jnp.arange(8.0), "c")
    layout = md.Layout({"c": ("y", "x"), "p2": ("x", "y"), "q4": "x"})
    with pytest.raises(md.LayoutError, match="reshape"):
        md.lower(lambda c: md.reshape(c, "p2:2 q4:4"), md.Mesh({"x": 4, "y": 2}), layout)(c)


def test_reshape_spreads_a_split_finer_than_both_new_dims_over_parts_of_axes():
    """[d c:y+x a] -> [d p2 q4 a]: c's 8-way split fits neither p2 nor q4 whole. It was moved to
    the whole kept dim d first (ppermute rounds, 448 B, plus a 112 B gather: 560 B where gspmd
    moves 128 B); with factor axes p2 takes y:(1)2 and q4 y:(2)2+x, nothing moves for the reshape,
    and the einsum moves what gspmd's does."""
    v = md.param(md.named(jnp.asarray(np.random.default_rng(0).standard_normal((8, 8, 16)), jnp.float32), "d c a"))
    def fn(v):
        w = md.reshape(v, "d:8 p2:2 q4:4 a:16")
        return md.einsum(w, w, out="d q4")
    mesh, layout = md.Mesh({"x": 2, "y": 4}), md.Layout({"c": ("y", "x")})
    e, h = _explain_vs_hlo(fn, mesh, layout, v, objective="bytes")
    assert e == h == {"all-reduce": 32, "all-gather": 96}
    assert _moved(fn, mesh, layout, v) == {"explicit": 128, "gspmd": 128}
    assert_same(md.lower(fn, mesh, layout)(v), fn(v), rtol=1e-5, atol=1e-4)


def test_reshape_spreads_a_two_axis_split_over_the_new_dims():
    """[c:y+x] -> [p2 q4] on x:4 y:2: p takes y and q takes x, every element stays where it is (it
    was gathered: 28 B where gspmd moves nothing); merging back keeps (y, x) on c. The gradient of
    an elementwise function of the reshaped value moves nothing either."""
    v = md.param(md.named(_vector(8), "c"))
    mesh, layout = md.Mesh({"x": 4, "y": 2}), md.Layout({"c": ("y", "x"), "p2": "y", "q4": "x"})
    split = lambda v: md.reshape(v, "p2:2 q4:4")
    _kept(split, mesh, layout, v, moved={})
    _kept(lambda v: md.reshape(split(v) * 2.0, "c:8"), mesh, layout, v, moved={})
    grad = lambda v: jax.grad(lambda v: md.sum(md.tanh(md.reshape(v, "p2:2 q4:4"))).array)(v)
    e, h = _explain_vs_hlo(grad, mesh, md.Layout({"c": ("y", "x")}), v)
    assert e == h == {}
    assert_same(md.lower(grad, mesh, md.Layout({"c": ("y", "x")}))(v), grad(v))


def test_reshape_spread_needs_whole_axes():
    """[c:y+x] on y:4 x:2 into p2 q4: y (4 devices) cannot split p (2 entries), so the split is not
    spread (it would put elements on the wrong devices); the values stay right."""
    v = md.param(md.named(_vector(8), "c"))
    _same(lambda v: md.reshape(v, "p2:2 q4:4") * 3.0, {"x": 2, "y": 4}, {"c": ("y", "x")}, v)
    _same(lambda v: md.reshape(v, "p4:4 q2:2") * 3.0, {"x": 2, "y": 4}, {"c": ("y", "x"), "p4": "y"}, v)


def test_reshape_reads_the_copy_gathered_for_the_return():
    """y (a parameter stored split on d) is returned whole, and so is a reshape of it: the reshape
    reads the copy gathered for the return instead of reshaping where y is stored and gathering its
    result again (7168 B, two gathers, where gspmd moves 3808)."""
    v = md.param(md.named(jnp.asarray(np.random.default_rng(0).standard_normal((8, 16, 8)), jnp.float32),
                          "d a c"))

    def fn(v):
        y = v * 2.0
        return y, md.reshape(y, "d:8 p4:4 q4:4 c:8")

    _kept(fn, md.Mesh({"x": 8}), md.Layout({}, params={"d": "x"}), v, moved={"all-gather": 3584})


def test_reshape_of_a_pending_sum_onto_its_axis_is_costed():
    """A dynamic read along a split dim leaves a sum pending over its axis; a reshape whose result
    the layout splits over that axis priced moving to a placement that kept the sum pending there
    (an internal AssertionError, a raw error for a valid program). The sum is reduced where the
    result takes the axis."""
    v = md.named(jnp.asarray(np.random.default_rng(0).standard_normal((8, 16, 16)), jnp.float32), "c b a")

    def fn(v):
        row = md.dynamic_slice(v, "a", jnp.int32(0), None)
        return row, md.reshape(row, "m128:128")

    _kept(fn, md.Mesh({"x": 4, "y": 2}), md.Layout({"a": "x", "m128": ("y", "x")}), v)


def test_reshape_weighs_no_placement_that_cannot_divide_a_dim():
    """d:8 split over x*y reshaped into p2:2 q4:4 (q4 over x): a candidate placed p2 over both
    axes (8 > 2), and pricing it divided by a block of 0 rows (a raw ZeroDivisionError). Such a
    candidate is no option; the program gives the unsharded values and explain equals the HLO."""
    v = md.named(jnp.asarray(np.random.default_rng(0).standard_normal(8), jnp.float32), "d")

    def fn(v):
        s = md.cumsum(v, "d")
        w = md.where(s > 0, v, s)
        return s, w, md.rename(md.reshape(w, "p2:2 q4:4"), {"p2": "k2"})

    mesh, layout = md.Mesh({"x": 2, "y": 4}), md.Layout({"d": ("x", "y"), "q4": "x"})
    _same(fn, {"x": 2, "y": 4}, {"d": ("x", "y"), "q4": "x"}, v)
    e, h = _explain_vs_hlo(fn, mesh, layout, v)
    assert e == h


def test_reshape_into_two_axes_moves_the_dim_onto_them_first():
    """[b d:x e] -> [b p2:y q4:x e] on x:4 y:2 (d = 4 p2 + q4): redistributing d onto y then x
    before splitting makes each element of the result where the layout wants it, one permute
    (2048 B, gspmd's). The rule had no such option: it redistributed d elsewhere and moved the
    result again (3584 B)."""
    v = md.named(jnp.asarray(np.random.default_rng(0).standard_normal((16, 8, 32)), jnp.float32), "b d e")
    mesh, layout = md.Mesh({"x": 4, "y": 2}), md.Layout({"d": "x", "p2": "y", "q4": "x"})
    _kept(lambda v: md.reshape(v, "b p2:2 q4:4 e"), mesh, layout, v, moved={"collective-permute": 2048.0})
