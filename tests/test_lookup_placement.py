"""Findings of fuzz campaign 16 (issue 9; tests/fuzz_campaign.py): where a lookup runs, where an
op over its one operand's dims runs when its result is wanted in the layout's placement, and how
a split leaves a dim that must become whole.

``md.take`` of a table split along the looked-up dim by ids split over the same axis: gathering
the table is one plan; gathering the (few) ids, looking up the rows each device holds and
reduce-scattering the rows where the layout wants them is another, often much cheaper."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import meshdsl as md

from helpers import promises_kept as _kept


def _table_and_ids():
    r = np.random.default_rng(0)
    table = md.param(md.named(jnp.asarray(r.standard_normal((16, 32)), jnp.float32), "a e"))
    ids = md.named(jnp.asarray(r.integers(-40, 40, 8), jnp.int32), "c")   # negative and outside ids too
    return table, ids


def test_few_ids_into_a_table_split_along_the_lookup_dim_move_instead_of_the_table():
    """take(softplus(t)[a e:x], ids[c:x]) on x:8: the table was gathered along e (1792 B where
    gspmd moves 924 B); now the 8 ids are gathered (28 B), each device looks up the rows it
    holds, and the [c a] rows are reduce-scattered onto c (448 B)."""
    table, ids = _table_and_ids()
    fn = lambda t, i: (md.softplus(t), md.take(md.softplus(t), i, "e"))
    mesh, layout = md.Mesh({"x": 8}), md.Layout({"c": "x", "e": "x"})
    _kept(fn, mesh, layout, table, ids, moved={"all-gather": 28, "reduce-scatter": 448})


def test_lookup_gradient_with_the_table_kept_split():
    """The same lookup under jax.grad (of the table): the rows' cotangent is gathered back to every
    device that looked up, and each scatters into the rows it holds."""
    table, ids = _table_and_ids()
    loss = lambda t, i: md.sum(md.tanh(md.take(md.softplus(t), i, "e"))).array
    grad = lambda t, i: jax.grad(loss)(t, i)
    _kept(grad, md.Mesh({"x": 8}), md.Layout({"c": "x", "e": "x"}), table, ids)


def test_cache_write_and_shift_of_one_stored_parameter_gather_it_once():
    """dynamic_update_slice(w, sum(w, d) / 2, d, -1) and shift(w, d, 0) of w[b:x a d] stored split
    on b (params=), both returned whole: each result was gathered at the return (14336 B where
    gspmd moves 8064 B). Moving w whole first costs what moving a result does, and both ops share
    that copy: one gather of w (the written column, once one gathered too, is summed from that
    copy: the plan shares that relay between the three ops)."""
    w = md.param(md.named(jnp.asarray(np.random.default_rng(0).standard_normal((16, 16, 8)), jnp.float32), "b a d"))
    fn = lambda w: (md.dynamic_update_slice(w, md.sum(w, "d") * 0.5, "d", jnp.int32(-1)),
                    md.shift(w, "d", 0, wrap=True))
    mesh, layout = md.Mesh({"x": 8}), md.Layout({"m": "x"}, params={"b": "x"})
    _kept(fn, mesh, layout, w, moved={"all-gather": 7168})


def test_lookup_into_a_table_split_on_its_other_dim_moves_the_ids_and_rows():
    """take(v[b:y+x a], ids[c:x+y], a) under jax.grad, v a copy of a parameter stored split on b:
    the table was gathered along b and its gradient reduce-scattered back (1792 B where gspmd moves
    268 B); now the 8 ids are gathered and each device looks up its b-columns of every row, which
    the loss sums where they are: only the ids move."""
    r = np.random.default_rng(0)
    w = md.param(md.named(jnp.asarray(r.standard_normal((16, 16)), jnp.float32), "b a"))
    ids = md.named(jnp.asarray(r.integers(0, 16, 8), jnp.int32), "c")
    loss = lambda w, i: md.sum(md.tanh(md.take(md.shift(w, "a", 0), i, "a"))).array
    grad = lambda w, i: jax.grad(loss)(w, i)
    mesh = md.Mesh({"x": 4, "y": 2})
    layout = md.Layout({"c": ("x", "y")}, params={"b": ("y", "x")})
    _kept(grad, mesh, layout, w, ids, moved={"all-gather": 28})


def _swapped():
    v = md.named(jnp.asarray(np.random.default_rng(0).standard_normal((16, 16, 8)), jnp.float32), "b a d")
    return v, md.Mesh({"x": 2, "y": 4}), md.Layout({"b": ("y", "x")})


def test_returned_cumsum_of_a_swapped_split_moves_it_by_all_to_all():
    """v[b:y+x a d] with b and a swapped by a rename (a now holds the split), then cumsum along a,
    returned: the operand moves to the layout's placement first, every dim of it - a's split goes
    to b by one all-to-all (896 B), and the cumsum and top_k along a run locally. (The plan moved
    only a there: it gathered a, 7168 B.)"""
    v, mesh, layout = _swapped()

    def fn(v):
        c = md.cumsum(md.rename(v, {"b": "a", "a": "b"}), "a")
        return c, md.top_k(c, "a", 2, out="k2")[0]
    _kept(fn, mesh, layout, v, moved={"all-to-all": 896})


def test_top_k_along_a_split_dim_hands_the_split_to_the_dim_the_layout_splits():
    """Campaign 16 under jax.grad: top_k along a (split over y+x, off the layout) with b whole, which
    the layout splits over y+x: the values gather a's blocks - a's split moves to b by all-to-all
    instead (14336 B where gspmd moves 8960 B; now 1792 B, both ways)."""
    v, mesh, layout = _swapped()
    loss = lambda v: md.sum(md.top_k(md.cumsum(md.rename(v, {"b": "a", "a": "b"}), "a"), "a", 2, out="k2")[0]).array
    _kept(lambda v: jax.grad(loss)(v), mesh, layout, v, moved={"all-to-all": 1792})


def test_cumsum_over_blocks_of_one_row_shares_the_gather_of_its_operand():
    """cumsum(w, d) and local_map(fn, w, keep="") of w[d:y+x] (x:8, y:1: one row per device),
    both returned (campaign 18): the cumsum gathered its block totals, the local_map gathered w -
    the same 28 B, which XLA merged into one all-gather while md.explain counted two. A block of
    one row is its own total: the cumsum gathers w by relayout, one copy both ops read."""
    w = md.param(md.named(jnp.asarray(np.arange(8.0), jnp.float32), "d"))
    fn = lambda w: (md.cumsum(w, "d"),
                    md.local_map(lambda a: jnp.tanh(a) + jnp.cumsum(a, axis=-1) * 0.1, w, out="d", keep=""))
    mesh, layout = md.Mesh({"x": 8, "y": 1}), md.Layout({"d": ("y", "x")})
    _kept(fn, mesh, layout, w, moved={"all-gather": 28})
    grad = lambda w: jax.grad(lambda w: sum(md.sum(md.tanh(y)) for y in fn(w)).array)(w)
    _kept(grad, mesh, layout, w)


def test_lookup_gathers_the_table_only_over_the_axes_the_ids_are_split_on():
    """take(t[a:x+y], ids[b:x]) on x:4, y:2 (campaign 18): the table was gathered whole, 56 B,
    where gspmd gathers it over x only and sums the rows found over y, 48 B. Gathered over x, each
    device holds every y-th block of rows (x is the major axis): it looks up the ids whose block
    is on its y, and the rows are summed over y: 24 + 16 B. Ids negative and out of range too."""
    r = np.random.default_rng(0)
    t = md.named(jnp.asarray(r.standard_normal(16), jnp.float32), "a")
    ids = md.named(jnp.asarray(r.integers(-20, 20, 16), jnp.int32), "b")
    fn = lambda t, i: md.gelu(md.take(t, i, "a"))
    mesh = md.Mesh({"x": 4, "y": 2})
    _kept(fn, mesh, md.Layout({"a": ("x", "y"), "b": "x"}), t, ids, moved={"all-gather": 24, "all-reduce": 16})
    grad = lambda t, i: jax.grad(lambda t: md.sum(md.tanh(md.take(md.softplus(t), i, "a")) * t.shape["a"]).array)(t)
    for rules in ({"a": ("x", "y"), "b": "x"}, {"a": ("y", "x"), "b": "x"}, {"a": ("x", "y"), "b": "y"}):
        _kept(grad, mesh, md.Layout(rules), t, ids)


def test_lookup_over_part_of_the_table_keeps_its_other_dims_split():
    """A [a e] table split a:x+y, ids [c d] split c:x: the table is gathered over x only (96 B, not
    224 B whole), each device looks up its ids' rows of [c d e] in every y-th block, and the rows
    are summed over y (64 B). Values and gradients as unsharded."""
    r = np.random.default_rng(1)
    t = md.named(jnp.asarray(r.standard_normal((16, 4)), jnp.float32), "a e")
    ids = md.named(jnp.asarray(r.integers(-16, 16, (8, 2)), jnp.int32), "c d")
    mesh, layout = md.Mesh({"x": 4, "y": 2}), md.Layout({"a": ("x", "y"), "c": "x"})
    fn = lambda t, i: md.take(md.tanh(t), i, "a")
    _kept(fn, mesh, layout, t, ids, moved={"all-gather": 96, "all-reduce": 64})
    _kept(lambda t, i: jax.grad(lambda t: md.sum(md.sin(fn(t, i))).array)(t), mesh, layout, t, ids)


def test_shift_of_a_stored_parameter_moves_only_the_rows_that_stay():
    """shift(w, e, -2) of w[a e] stored a:x (params=), returned with its negation (campaign 19):
    w was gathered before the shift (its result is gathered at the return), 1792 B, where gspmd
    gathers the 30 columns that stay, 1680 B. No other op reads that copy of w: the shift runs
    where w is stored and its result moves by the rows that stay (relayout's pieces)."""
    w = md.param(md.named(jnp.asarray(np.random.default_rng(0).standard_normal((16, 32)), jnp.float32), "a e"))

    def fn(w):
        v = md.shift(w, "e", -2)
        return v, -v

    mesh, layout = md.Mesh({"x": 8}), md.Layout({}, params={"a": "x"})
    _kept(fn, mesh, layout, w, moved={"all-gather": 1680})
    _kept(lambda w: jax.grad(lambda w: sum(md.sum(md.sin(y)) for y in fn(w)).array)(w), mesh, layout, w)
