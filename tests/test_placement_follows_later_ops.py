"""Findings of fuzz campaigns 12 to 14 (issue 9; tests/fuzz_campaign.py, replayed with
tests/fuzz_replay.py), each with the promise it broke: where an op computes depends on what later
ops do with its result (returned, so wanted in the layout's placement, or only summed into a loss:
:mod:`meshdsl.planner`), and window moves of several pieces share their ppermutes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshdsl as md

from helpers import promises_kept as _kept


# -- campaign 12 (on 48840f9) ---------------------------------------------------------------------

def test_contraction_run_where_the_parameter_is_stored_returns_typed_replicated():
    """einsum(w[d], x[d e c], out="") with w stored split on d and param_gather="auto": the
    contraction runs where w is stored and its sum is reduced when relaid to the plan; that
    scalar is replicated and typed so (it was typed varying over x and all-reduced again at the
    return: 14 B where gspmd moves 7 B)."""
    r = np.random.default_rng(0)
    w = md.param(md.named(jnp.asarray(r.standard_normal(8), jnp.float32), "d"))
    x = md.named(jnp.asarray(r.standard_normal((8, 32, 8)), jnp.float32), "d e c")
    fn = lambda w, x: md.einsum(w, x, out="")
    mesh, layout = md.Mesh({"x": 8, "y": 1}), md.Layout({"b": "x"}, params={"d": ("y", "x")})
    _kept(fn, mesh, layout, w, x, param_gather="auto", moved={"all-reduce": 7})


def test_pieces_moving_rows_opposite_ways_share_one_permute():
    """slice(concat([v, v]), start=3) of v[c:8] split on x:2: block 0 reads 3 rows of block 1 (a
    +1 move of the first piece), block 1 reads 3 rows of block 0 (a -1 move of the second). No
    device sends or receives twice, so both go in one ppermute (it was one per piece: 24 B
    where gspmd moves 20 B)."""
    v = md.param(md.named(jnp.asarray(np.random.default_rng(0).standard_normal(8), jnp.float32), "c"))
    fn = lambda v: md.slice(md.concat([v, v], "c"), "c", 3, 8)
    mesh, layout = md.Mesh({"x": 2, "y": 4}), md.Layout({"c": "x"})
    _kept(fn, mesh, layout, v, moved={"collective-permute": 12})
    # concat of two [c:8 e:3]: block 0 takes a's rows from block 1, block 1 b's rows from block 0
    a, b = (md.param(md.named(jnp.asarray(np.random.default_rng(k).standard_normal((8, 3)), jnp.float32), "c e"))
            for k in (1, 2))
    _kept(lambda a, b: md.concat([a, b], "c"), mesh, layout, a, b, moved={"collective-permute": 4 * 3 * 4})


def test_scan_and_sum_read_the_copy_gathered_for_the_return():
    """v = shift(w) of a parameter stored split on a, returned (gathered whole) and scanned over e
    with a carry started from sum(v, e): the sum and the scan read the gathered copy (they ran on
    the split v and their [d a] result was gathered again at the return: 15808 B where gspmd
    moves 15360 B). Since campaign 16 the shift itself runs on w gathered first (the same bytes
    as gathering its result, and no boundary rows to permute): 14336 B."""
    w = md.param(md.named(jnp.asarray(np.random.default_rng(0).standard_normal((32, 8, 16)), jnp.float32),
                          "e d a"))

    def fn(w):
        v = md.shift(w, "a", -1)
        step = lambda c, vi: (md.tanh(c + vi) * 0.5 + c * 0.5, None)
        carry, _ = md.scan(step, md.sum(v, "e") * 0.1, v, dim="e")
        return v, carry, md.square(v)

    mesh, layout = md.Mesh({"x": 8, "y": 1}), md.Layout({"b": ("x", "y")}, params={"a": ("y", "x")})
    _kept(fn, mesh, layout, w, param_gather="auto",
          moved={"all-gather": 32 * 8 * 16 * 4 * 7 // 8})


def test_broadcast_of_a_split_parameter_that_is_only_summed_stays_split():
    """where(a > 0, a, w) broadcasts a[b] against w[e c] stored split on e. Returned, the operands
    move to the layout's placement first (w's 896 B, not the [b e c] result's 14336 B, gspmd's
    choice). Only summed into a loss, under jax.grad, nothing needs the result whole: it stays
    split and only a's gradient is all-reduced (it was gathered anyway: 896 B where gspmd moves
    112 B)."""
    r = np.random.default_rng(0)
    a = md.param(md.named(jnp.asarray(r.standard_normal(16), jnp.float32), "b"))
    w = md.param(md.named(jnp.asarray(r.standard_normal((32, 8)), jnp.float32), "e c"))
    sel = lambda a, w: md.where(md.greater(a, 0.0), a, w)
    loss = lambda a, w: md.sum(md.tanh(sel(a, w))).array
    grad = lambda a, w: jax.grad(loss, argnums=(0, 1))(a, w)
    mesh, layout = md.Mesh({"x": 8}), md.Layout({"d": "x"}, params={"e": "x"})
    _kept(sel, mesh, layout, a, w, param_gather="auto", moved={"all-gather": 896})
    _kept(grad, mesh, layout, a, w, param_gather="auto", moved={"all-reduce": 112})


def test_pad_of_a_parameter_stored_split_moves_only_rows_unless_returned():
    """slice(pad(w, a, 3, 5), a, 7) of w[b a] stored split on a, which the layout leaves whole: a
    shift of a by 4 rows. Returned, the result is wanted whole: w's piece is gathered once (896 B;
    gspmd: 1600 B). Only summed, under jax.grad, it stays split and only the rows that change
    owner move, forward and back (it was gathered anyway: 896 B where gspmd moves 768 B)."""
    w = md.param(md.named(jnp.asarray(np.random.default_rng(0).standard_normal((16, 16)), jnp.float32), "b a"))
    fn = lambda w: md.slice(md.pad(w, "a", before=3, after=5), "a", 7, 16)
    grad = lambda w: jax.grad(lambda w: md.sum(md.tanh(fn(w))).array)(w)
    mesh, layout = md.Mesh({"x": 2, "y": 4}), md.Layout({"c": "x"}, params={"a": ("y", "x")})
    _kept(fn, mesh, layout, w, param_gather="auto", moved={"all-gather": 896})
    _kept(grad, mesh, layout, w, param_gather="auto", moved={"collective-permute": 256})


def test_returned_cumsum_along_a_stored_split_gathers_its_operand_once():
    """cumsum(w, d) of w[c d] stored split on d and returned (wanted whole): w is gathered first
    and summed whole (it summed the blocks, gathered their totals, then gathered the result at
    the return: 448 B where gspmd moves 224 B). Campaign 14."""
    w = md.param(md.named(jnp.asarray(np.random.default_rng(0).standard_normal((8, 8)), jnp.float32), "c d"))
    mesh, layout = md.Mesh({"x": 2, "y": 4}), md.Layout({"e": "x"}, params={"d": ("x", "y")})
    _kept(lambda w: md.cumsum(w, "d"), mesh, layout, w, param_gather="keep", moved={"all-gather": 224})


# -- campaign 21 (on 820a2f4) ---------------------------------------------------------------------

def test_cast_to_a_wider_type_moves_its_narrow_operand_first():
    """astype(max(v > 0, p4), float32) of v[b p4:x q4:x c] (a reshaped a:x), returned with q4
    whole: the float32 result was gathered at the return (1408 B where gspmd moves 640 B); the
    boolean it is cast from is gathered first, a quarter of the bytes."""
    v = md.named(jnp.asarray(np.random.default_rng(0).standard_normal((16, 16, 8)), jnp.float32), "b a c")
    fn = lambda v: md.astype(md.max(md.greater(md.reshape(v, "b:16 p4:4 q4:4 c:8"), 0.0), "p4"), jnp.float32)
    _kept(fn, md.Mesh({"x": 8}), md.Layout({"a": "x"}), v, moved={"all-reduce": 384, "all-gather": 256})


def test_pending_scalar_times_a_vector_is_reduced_before_the_broadcast():
    """s = v[3] of a parameter v[d] stored split (a masked local read: s is a pending sum), then
    s * v, shift(v) and sum(shift(v)), all returned: once v is gathered for the shift, s * v kept
    s's sum pending at v's size (a 56 B all-reduce of the product where the scalar's is 7 B; 84 B
    in all, gspmd 60 B). A sum pending on an operand smaller than the result is reduced first; and
    the plan reads s from the copy of v gathered for the shift: the gather alone, 28 B."""
    v = md.param(md.named(jnp.asarray(np.random.default_rng(0).standard_normal(8), jnp.float32), "d"))

    def fn(v):
        v = md.where(md.equal(md.round(v), md.round(v)), v, v)
        s = md.dynamic_slice(v, "d", jnp.int32(3), None)
        w = md.shift(v, "d", -1, wrap=True)
        return w, s * v, md.sum(w, "d")
    mesh, layout = md.Mesh({"x": 8}), md.Layout({"e": "x"}, params={"d": "x"})
    _kept(fn, mesh, layout, v, param_gather="keep", moved={"all-gather": 28})


# -- campaign 22 (on 820a2f4) ---------------------------------------------------------------------

def test_returned_function_of_a_stored_parameter_gathers_the_parameter():
    """tanh(w) returned and einsum(tanh(w), w, out="") of w[a:y b] stored split, under
    param_gather="auto": tanh ran where w is stored and its result was gathered at the return
    (512 B); the einsum then contracted where w is stored (a 4 B scalar all-reduce; gspmd moves
    512 B in all). Moving w instead costs the same 512 B and the einsum reads that copy: 512 B."""
    w = md.param(md.named(jnp.asarray(np.random.default_rng(0).standard_normal((16, 16)), jnp.float32), "a b"))

    def fn(w):
        t = md.tanh(w)
        return t, md.einsum(t, w, out="")
    mesh, layout = md.Mesh({"x": 4, "y": 2}), md.Layout({"e": "x"}, params={"a": "y"})
    _kept(fn, mesh, layout, w, param_gather="auto", moved={"all-gather": 512})


# -- campaign 23 (on 29fb3c8) ---------------------------------------------------------------------

@pytest.mark.parametrize("wrap", [False, True])
def test_cumsum_and_shift_read_the_copy_top_k_gathers(wrap):
    """top_k(v[b:x], b) gathers v whole; cumsum(v, b) then gathered its block totals and the
    shift of that moved boundary rows (88 B where gspmd moves 60 B). Both read the gathered copy
    instead: 56 B, the gather alone."""
    v = md.named(jnp.asarray(np.random.default_rng(0).standard_normal(16), jnp.float32), "b")
    fn = lambda v: (md.top_k(v, "b", 2, "k2")[0], md.shift(md.cumsum(v, "b"), "b", -15, wrap=wrap))
    _kept(fn, md.Mesh({"x": 8}), md.Layout({"b": "x"}), v, moved={"all-gather": 56})


# -- campaign 25 (on 8e36150) ---------------------------------------------------------------------

def _stored_cond_and_whole_value():
    r = np.random.default_rng(0)
    c = md.param(md.named(jnp.asarray(r.standard_normal(8), jnp.float32), "c"))
    v = md.param(md.named(jnp.asarray(r.standard_normal((16, 8, 16)), jnp.float32), "b c a"))
    return c, v, md.Mesh({"x": 2, "y": 4}), md.Layout({"d": "x"}, params={"c": ("y", "x")})


def test_where_of_one_value_twice_reads_no_condition():
    """s = sigmoid(v) returned, and where(c > 0, s, s) returned, c[c] stored split: the condition's
    values do not matter (XLA's simplifier drops them); they were still read split, so the
    result was computed split and gathered at the return (14336 B where gspmd moves 7168 B).
    Now where(c, x, x) broadcasts x over c's dims: v is gathered once, for sigmoid."""
    c, v, mesh, layout = _stored_cond_and_whole_value()

    def fn(c, v):
        s = md.sigmoid(v)
        return s, md.where(md.greater(c, 0.0), s, s)
    _kept(fn, mesh, layout, c, v, param_gather="auto", moved={"all-gather": 7168})


def test_returned_where_gathers_its_small_condition_not_its_result():
    """The same with where(c > 0, s, 2 * s): the condition holds c split, s holds it whole; the
    cheapest operands (slice s, keep c split) made a split result gathered at the return (7168 B
    more). A result that moves later counts: the boolean condition is gathered (7 B) instead."""
    c, v, mesh, layout = _stored_cond_and_whole_value()

    def fn(c, v):
        s = md.sigmoid(v)
        return s, md.where(md.greater(c, 0.0), s, s * 2.0)
    _kept(fn, mesh, layout, c, v, param_gather="auto", moved={"all-gather": 7168 + 7})


# -- campaign 24 (on 3c5e72e) ---------------------------------------------------------------------

def test_sum_carried_into_two_values_is_reduced_once_where_made():
    """rows = take(t[a:y+x], ids[d c:x]) is a pending sum over y (each device looked up the rows it
    holds); rows * 0.5 + 0.25 and rows * -1 + 0.25 each carried the sum through the product and
    reduced it for the add (384 B where gspmd moves 200 B). The plan gathers the 64 B table
    instead (a candidate of take's: its operand at the layout's placement, one collective away):
    56 B, and no sum to reduce at all."""
    r = np.random.default_rng(0)
    t = md.param(md.named(jnp.asarray(r.standard_normal(16), jnp.float32), "a"))
    ids = md.named(jnp.asarray(r.integers(0, 16, (8, 8)), jnp.int32), "d c")

    def fn(t, ids):
        rows = md.take(t, ids, "a")
        return rows * 0.5 + 0.25, rows * -1.0 + 0.25
    mesh, layout = md.Mesh({"x": 2, "y": 4}), md.Layout({"a": ("y", "x"), "c": "x"})
    _kept(fn, mesh, layout, t, ids, param_gather="regather", moved={"all-gather": 7 / 8 * 64})
