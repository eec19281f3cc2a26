"""Reductions, lookups and selections over split dims: min and max in every dtype, take by ids
(negative, out of range, split like the table), where and mean: the unsharded values, no more
bytes than the compiler."""

from __future__ import annotations


import jax.numpy as jnp
import numpy as np
import pytest

import meshdsl as md

from helpers import explain_vs_hlo, moved_by_backend, promises_kept, same_unsharded

_moved, _explain_vs_hlo, _same, _kept = moved_by_backend, explain_vs_hlo, same_unsharded, promises_kept


def test_min_of_ints_over_a_split_dim():
    f = md.lower(lambda a: md.min(a, "s"), md.Mesh({"data": 8}), md.Layout({"s": "data"}))
    for arr in (np.array([[5, 6, 7, 8, 0, 9, 10, 11]], np.uint32),
                np.array([[5, 6, 7, 8, np.iinfo(np.int32).min, 9, 10, 11]], np.int32)):
        x = md.named(jnp.asarray(arr), "b s")
        np.testing.assert_array_equal(np.asarray(f(x).array), np.asarray(md.min(x, "s").array))


def test_min_of_bools_over_a_split_dim():
    mask = md.named(jnp.asarray(np.array([[True] * 7 + [False], [True] * 8])), "b s")
    for reduce in (md.min, md.max):
        got = md.lower(lambda m: reduce(m, "s"), md.Mesh({"data": 8}), md.Layout({"s": "data"}))(mask)
        assert got.dtype == jnp.bool_
        np.testing.assert_array_equal(np.asarray(got.array), np.asarray(reduce(mask, "s").array))


@pytest.mark.parametrize("dtype", [np.uint8, np.uint32, np.int8, np.int32, np.float32, np.bool_])
@pytest.mark.parametrize("reduce", ["min", "max"])
def test_min_and_max_over_a_split_dim_in_every_dtype(dtype, reduce):
    r = np.random.default_rng(1)
    if dtype == np.bool_:
        arr = r.random((4, 16)) < 0.8
    elif np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        arr = r.integers(info.min, info.max, (4, 16), dtype=np.int64, endpoint=True).astype(dtype)
        arr[0, 3], arr[1, 9] = info.min, info.max
    else:
        arr = r.standard_normal((4, 16)).astype(dtype)
    x = md.named(jnp.asarray(arr), "b s")
    op = getattr(md, reduce)
    for layout in ({"s": "data"}, {"s": ("model", "data"), "b": ()}, {"b": "model", "s": "data"}):
        got = md.lower(lambda x: op(x, "s"), md.Mesh({"data": 2, "model": 4}), md.Layout(layout))(x)
        np.testing.assert_array_equal(np.asarray(got.array), np.asarray(op(x, "s").array))


def test_take_of_negative_and_out_of_range_ids_from_a_split_vocabulary():
    table = md.named(jnp.arange(32.0).reshape(8, 4), "vocab d")
    ids = md.named(jnp.array([-1, 2, -8, 7, 8, -9, 100, 0]), "b")
    fn = lambda t, i: md.take(t, i, "vocab")
    want = np.asarray(fn(table, ids).array)
    np.testing.assert_array_equal(want[0], np.arange(28.0, 32.0))   # -1: the last row
    np.testing.assert_array_equal(want[2], np.arange(0.0, 4.0))     # -8: the first row
    np.testing.assert_array_equal(want[[4, 5, 6]], 0.0)             # outside [-8, 8): zeros
    for layout in ({"vocab": "model"}, {"vocab": ("model", "data")}, {"b": "data", "vocab": "model"}, {}):
        got = md.lower(fn, md.Mesh({"data": 2, "model": 4}), md.Layout(layout))(table, ids)
        np.testing.assert_array_equal(np.asarray(got.array), want)


def test_take_with_ids_carrying_a_dim_named_like_the_take_dim_is_refused():
    table = md.named(jnp.arange(64.0).reshape(16, 4), "v e")
    ids = md.named(jnp.asarray(np.random.default_rng(0).integers(0, 16, (8, 16)), jnp.int32), "b v")
    fn = lambda t, i: md.take(t, i, "v")
    want = fn(table, ids)
    assert want.names == ("b", "v", "e")
    np.testing.assert_array_equal(np.asarray(want.array), np.asarray(table.array)[np.asarray(ids.array)])
    for layout in ({"v": "model"}, {"v": "model", "b": "data"}, {"e": "model", "v": "data"}):
        _same(fn, {"data": 2, "model": 4}, layout, table, ids)


def test_mean_over_no_dims_is_the_value_itself():
    """mean(s) of a scalar s over no dims is s: two reads of one pending scalar (one through mean)
    are one all-reduce in the compiled program, and explain counts one (it counted two)."""
    w = md.param(md.named(jnp.asarray(np.random.default_rng(0).standard_normal(16), jnp.float32), "a"))
    fn = lambda w: (md.sin(md.einsum(w, w, out="") - w), md.mean(md.einsum(w, w, out="")))
    mesh, layout = md.Mesh({"x": 2, "y": 4}), md.Layout({"a": ("y", "x")})
    e, h = _explain_vs_hlo(fn, mesh, layout, w, param_gather="auto")
    assert e == h == {"all-reduce": 7.0}
    _same(fn, {"x": 2, "y": 4}, {"a": ("y", "x")}, w)


def test_where_between_a_value_and_itself_drops_the_predicate():
    """where(logsumexp(x, d) > 0, y, y) with d split: XLA simplifies the select to y and drops the
    predicate's two all-reduces; explain dropped them too (it claimed 4 KiB where the compiled
    program moves nothing): jnp.where's jit is seen through."""
    r = np.random.default_rng(0)
    x = md.named(jnp.asarray(r.standard_normal((16, 8, 32)), jnp.float32), "a d e")
    y = md.named(jnp.asarray(r.standard_normal((16, 32)), jnp.float32), "a e")
    fn = lambda x, y: md.where(md.greater(md.logsumexp(x, "d"), 0.0), y, y)
    e, h = _explain_vs_hlo(fn, md.Mesh({"x": 4, "y": 2}), md.Layout({"d": "y"}), x, y)
    assert e == h == {}


def test_take_along_a_split_dim_by_ids_split_the_same_way():
    """take(x[b:x c d], ids[b:x], "b"): gathering the table once (3584 B, as gspmd) beats gathering
    the ids and reduce-scattering the looked-up rows (3640 B)."""
    r = np.random.default_rng(0)
    x = md.named(jnp.asarray(r.standard_normal((16, 8, 8)), jnp.float32), "b c d")
    ids = md.named(jnp.asarray(r.integers(-3, 19, 16), jnp.int32), "b")
    fn = lambda x, ids: md.take(x, ids, "b")
    mesh, layout = md.Mesh({"x": 8}), md.Layout({"b": "x"})
    _kept(fn, mesh, layout, x, ids, moved={"all-gather": 3584})


def test_axis_of_size_one_splits_nothing():
    """A merge whose result is split over ('y', 'x') with y of size 1 is placed exactly like its
    major dim split over x: no communication (it all-gathered 14336 B; gspmd: none). Found by the
    long campaign (tests/fuzz_campaign.py)."""
    x = md.named(jnp.asarray(np.random.default_rng(0).standard_normal((32, 8, 16)), jnp.float32), "e d b")
    fn = lambda x: md.reshape(x, "e:32 m128:128")
    mesh, layout = md.Mesh({"x": 8, "y": 1}), md.Layout({"d": "x", "m128": ("y", "x")})
    assert _moved(fn, mesh, layout, x) == {"explicit": 0.0, "gspmd": 0.0}
    assert md.explain(fn, mesh, layout, x).summary() == {}
    _same(fn, {"x": 8, "y": 1}, {"d": "x", "m128": ("y", "x")}, x)


def test_a_lookup_moves_its_ids_onto_an_idle_axis_to_sum_the_rows_over_the_table_split():
    """take(w[d a:y], ids[c:y+z], "a") on x:2 y:2 z:2: the ids move onto the idle axis x (a
    permute and a gather over y, 8 B), so the devices holding the two halves of the table hold
    the same ids; the looked-up rows are summed over y (64 B) and moved back to c:y+z (a permute
    and a gather, 64 B): 136 B, as gspmd. Gathering the ids over both axes and reduce-scattering
    the rows moved 152 B. Found by the campaign (tests/fuzz_campaign.py, seed 58)."""
    r = np.random.default_rng(0)
    w = md.param(md.named(jnp.asarray(r.standard_normal((8, 16)), jnp.float32), "d a"))
    ids = md.named(jnp.asarray(r.integers(0, 16, 8), jnp.int32), "c")
    fn = lambda w, ids: md.take(w, ids, "a")
    mesh, layout = md.Mesh({"x": 2, "y": 2, "z": 2}), md.Layout({"a": "y", "c": ("y", "z")})
    _kept(fn, mesh, layout, w, ids, moved={"all-reduce": 64, "all-gather": 36, "collective-permute": 36})
