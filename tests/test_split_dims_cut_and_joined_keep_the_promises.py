"""Shift, slice, pad, concat and top_k along a split dim: each computes the unsharded value, moves
no more bytes than the compiler (the plan of fewest bytes), and explain counts what XLA runs."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshdsl as md

from helpers import explain_vs_hlo, moved_by_backend, promises_kept, same_unsharded

_moved, _explain_vs_hlo, _same, _kept = moved_by_backend, explain_vs_hlo, same_unsharded, promises_kept


@pytest.mark.parametrize("offset,wrap", [(1, False), (-3, False), (5, False), (9, True), (-1, True)])
def test_shift_of_a_dim_split_over_two_axes_in_either_mesh_order(offset, wrap):
    x = md.named(jnp.arange(32.0).reshape(1, 32), "b s")
    fn = lambda x: md.shift(x, "s", offset, wrap=wrap)
    for axes in (("data", "model"), ("model", "data")):
        _same(fn, {"data": 2, "model": 4}, {"s": axes}, x)


@pytest.mark.parametrize("axes", [("model", "data"), ("data", "model")])
def test_every_block_index_of_a_dim_split_over_two_axes_in_either_mesh_order(axes):
    """Every op that computes a device's block index over a multi-axis split."""
    mesh, layout = {"data": 2, "model": 4}, {"v": axes}
    ids = md.named(jnp.array([0, 3, 9, 15, 12, 7, 1, 8]), "b")
    table = md.named(jnp.arange(64.0).reshape(16, 4), "v e")
    x = md.named(jnp.arange(48.0).reshape(3, 16) % 7, "r v")
    key = jax.random.key(3)
    _same(lambda i: md.one_hot(i, md.Dim("v", 16)), mesh, layout, ids)
    _same(lambda t, i: md.take(t, i, "v"), mesh, layout, table, ids)
    _same(lambda x: md.cumsum(x, "v"), mesh, layout, x)
    _same(lambda x: md.top_k(x, "v", k=3), mesh, layout, x)
    _same(lambda: md.arange("v:16"), mesh, layout)
    _same(lambda: md.random.normal(key, "r:3 v:16"), mesh, layout)
    _same(lambda: md.random.bernoulli(key, 0.3, "r:3 v:16"), mesh, layout)


@pytest.mark.parametrize("mesh,axes,off", [
    ({"data": 2, "model": 4}, "model", 31), ({"data": 2, "model": 4}, "model", -25),
    ({"data": 8, "model": 1}, "model", 1), ({"data": 8, "model": 1}, "model", -5),
    ({"data": 2, "model": 4}, ("data", "model"), 29), ({"data": 2, "model": 4}, ("model", "data"), -30),
    ({"data": 8}, "data", 8), ({"data": 8}, "data", -24)])
def test_shift_by_far_offsets_over_size_one_axes_is_zero_filled(mesh, axes, off):
    x = md.named(jnp.arange(1.0, 33.0).reshape(1, 32), "b s")
    for wrap in (False, True):
        _same(lambda x: md.shift(x, "s", off, wrap=wrap), mesh, {"s": axes}, x)


def test_concat_of_pending_sums_whose_other_dims_are_placed_differently():
    r = np.random.default_rng(0)
    x = md.named(jnp.asarray(r.standard_normal((8, 16)), jnp.float32), "b d")
    w = md.named(jnp.asarray(r.standard_normal((16, 32)), jnp.float32), "d e")
    w3 = md.named(jnp.asarray(r.standard_normal((16, 32)), jnp.float32), "d g")

    def fn(x, w, w3):
        y1 = md.rename(md.einsum(x, w, out="b e"), {"e": "f"})
        y2 = md.rename(md.einsum(x, w3, out="b g"), {"g": "f"})
        return md.concat([y1, y2], "b")

    for layout in ({"d": "model", "g": "data", "f": "model"}, {"d": "model", "g": "data"},
                   {"d": ("model", "data"), "f": "data"}):
        f = md.lower(fn, md.Mesh({"data": 2, "model": 4}), md.Layout(layout))
        np.testing.assert_allclose(np.asarray(f(x, w, w3).array), np.asarray(fn(x, w, w3).array), atol=1e-4)


@pytest.mark.parametrize("case", ["slice", "pad", "concat"])
def test_slice_pad_and_concat_of_a_split_dim_move_no_more_than_the_compiler(case):
    r = np.random.default_rng(0)
    x = md.named(jnp.asarray(r.standard_normal((32, 16)), jnp.float32), "b f")
    y = md.named(jnp.asarray(r.standard_normal((8, 16)), jnp.float32), "b f")
    fn = {"slice": lambda x, y: md.slice(x, "b", 19, 8),
          "pad": lambda x, y: md.pad(md.slice(x, "b", 0, 24), "b", 3, 5),
          "concat": lambda x, y: md.concat([x, y], "b")}[case]
    mesh, layout = md.Mesh({"data": 8}), md.Layout({"b": "data"})
    moved = _moved(fn, mesh, layout, x, y)
    assert moved["explicit"] <= moved["gspmd"], moved
    _same(fn, {"data": 8}, {"b": "data"}, x, y)


def test_slice_of_only_padding_reads_nothing():
    """slice(pad(w, 2, 14), 13, 8) along a split dim is all padding: zeros, no communication (the
    rows were moved by the pad and by the slice: 896 B where gspmd moves 0)."""
    w = md.param(md.named(jnp.asarray(np.random.default_rng(0).standard_normal((4, 16, 8)), jnp.float32), "a b c"))
    fn = lambda w: md.slice(md.pad(w, "c", 2, 14), "c", 13, 8)
    mesh, layout = md.Mesh({"x": 2, "y": 4}), md.Layout({"c": ("y", "x")})
    assert _moved(fn, mesh, layout, w) == {"explicit": 0.0, "gspmd": 0.0}
    _same(fn, {"x": 2, "y": 4}, {"c": ("y", "x")}, w)
    grad = lambda w: jax.grad(lambda w: md.sum(md.sin(fn(w) + w)).array)(w)
    _same(grad, {"x": 2, "y": 4}, {"c": ("y", "x")}, w)


def test_zeros_of_a_slice_of_padding_are_placed_anywhere_without_moving():
    """The zeros a slice of only padding makes, reshaped into dims the layout leaves whole, are
    made whole where they are needed: nothing is gathered (XLA folds a gather of zeros away, so
    explain counting one was 384 B off the compiled program; long fuzz, seed 7)."""
    v1 = md.named(jnp.asarray(np.random.default_rng(0).standard_normal((8, 16)), jnp.float32), "c a")

    def fn(v1):
        return md.reshape(md.slice(md.pad(v1, "a", 0, 16), "a", 16, 16), "p2:2 q4:4 a:16")
    mesh, layout = md.Mesh({"x": 8}), md.Layout({"c": "x"})
    promises_kept(fn, mesh, layout, v1, moved={})
    grad = lambda v1: jax.grad(lambda v1: md.sum(md.tanh(fn(v1)) + md.sum(v1, "c")).array)(v1)
    promises_kept(grad, mesh, layout, v1)


def test_a_cumulative_sum_of_only_padding_moves_no_block_totals():
    """cumsum over e (split over z) of slice(pad(v, c, 0, 16), c, 10, 8), all padding: zeros,
    summed to zeros where they are. The block totals were gathered (512 B; gspmd folds the
    constant and moves nothing: fuzz seed 56)."""
    v = md.named(jnp.asarray(np.random.default_rng(0).standard_normal((8, 16, 32)), jnp.float32), "c a e")

    def fn(v):
        return md.transpose(md.log(md.cumsum(md.slice(md.pad(v, "c", 0, 16), "c", 10, 8), "e")), "a e c")
    mesh, layout = md.Mesh({"x": 2, "y": 2, "z": 2}), md.Layout({"e": "z"})
    promises_kept(fn, mesh, layout, v, moved={})


def test_shift_or_pad_returned_whole_moves_only_the_rows_kept():
    """A parameter stored split on a, shifted along b (or padded) and returned
    whole: the rows the shift keeps (the pad's operand) are gathered, then
    placed among zeros. Gathering the result moved its zeros too (campaign 10: 14784 B where gspmd
    moves 8960; the shift's share 7168 B where gspmd gathers the 3 rows kept, 1344 B)."""
    w = md.param(md.named(jnp.asarray(np.random.default_rng(0).standard_normal((16, 8, 8)), jnp.float32),
                          "b a c"))
    mesh, layout = md.Mesh({"x": 8}), md.Layout({}, params={"a": "x"})
    row = 8 * 8 * 4 * 7 // 8                      # one b row of w: the 7/8 of it a device gathers
    _kept(lambda w: md.shift(w, "b", 13), mesh, layout, w, moved={"all-gather": 3 * row})
    _kept(lambda w: md.shift(w, "b", -5), mesh, layout, w, moved={"all-gather": 11 * row})
    _kept(lambda w: md.pad(w, "b", before=2, after=6), mesh, layout, w, moved={"all-gather": 16 * row})


def test_renamed_shift_is_no_longer_pieces_along_the_old_name():
    """shift(shift(v)) renamed c -> d and returned split over d: the rename's result is the same
    local array, remembered as pieces along c; relaying it looked c up in [d] (a raw ValueError)."""
    v = md.named(jnp.asarray(np.random.default_rng(0).standard_normal(16), jnp.float32), "c")
    fn = lambda v: md.rename(md.shift(md.shift(v, "c", -2), "c", 6), {"c": "d"})
    _kept(fn, md.Mesh({"x": 2, "y": 4}), md.Layout({"d": ("x", "y")}), v, moved={})


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_top_k_with_more_candidates_than_a_block_holds(k):
    """top_k over a split dim gathered k candidates and their indices per device even when that
    is more than the blocks themselves (k=4 over blocks of 2: 2x gspmd's bytes)."""
    x = md.named(jnp.asarray(np.random.default_rng(0).standard_normal((3, 16)), jnp.float32), "r b")
    fn = lambda x: md.top_k(x, "b", k=k, out="k")
    mesh, layout = md.Mesh({"data": 8}), md.Layout({"b": "data"})
    moved = _moved(fn, mesh, layout, x)
    assert moved["explicit"] <= moved["gspmd"], moved
    _same(fn, {"data": 8}, {"b": "data"}, x)


def test_pad_then_slice_of_a_split_dim():
    """slice(pad(x)) along a split dim reads x through one window (a 2-row shift, as gspmd fuses them), not
    pad rows moved by +1 block and then by -1 block."""
    x = md.named(jnp.asarray(np.random.default_rng(0).standard_normal(8), jnp.float32), "c")
    fn = lambda x: md.slice(md.pad(x, "c", 7, 9), "c", 5, 8)
    moved = _moved(fn, md.Mesh({"x": 2, "y": 4}), md.Layout({"c": "x"}), x)
    assert moved["explicit"] <= moved["gspmd"], moved


def test_concat_then_slice_of_a_split_dim():
    """slice(concat([x, w])) reads each piece through its own window: no all-to-all of the parts the
    slice never reads (explain counted 288 B, XLA moved 192 B)."""
    r = np.random.default_rng(0)
    x = md.named(jnp.asarray(r.standard_normal((16, 8)), jnp.float32), "a c")
    w = md.param(md.named(jnp.asarray(r.standard_normal((16, 8)), jnp.float32), "a c"))
    fn = lambda x, w: md.slice(md.concat([x, w], "a"), "a", 0, 16)
    mesh, layout = md.Mesh({"x": 2, "y": 4}), md.Layout({"a": "y"})
    e, h = _explain_vs_hlo(fn, mesh, layout, x, w, param_gather="auto")
    moved = _moved(fn, mesh, layout, x, w, param_gather="auto")
    assert e == h and moved["explicit"] <= moved["gspmd"], (e, h, moved)
