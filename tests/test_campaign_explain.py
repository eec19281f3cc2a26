"""Findings of fuzz campaigns 28 and 29 and of a bf16 bytes probe (issue 9; tests/fuzz_campaign.py,
replayed with tests/fuzz_replay.py), each with the promise it broke: which collectives XLA folds
or merges (explain must predict exactly the compiled ones), and a pending sum carried into values
of other dims (:mod:`meshdsl.foresight`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import meshdsl as md

from helpers import promises_kept as _kept


def _normal(shape, names, seed=0):
    return md.named(jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32), names)


def test_campaign_a_sum_of_a_one_element_constant_is_not_folded():
    """slice(pad(v, q4, 8, 8), q4, 16, 4) reads padding only: zeros, split on q4 over x. Its
    einsum with v sums the zeros on each device and all-reduces the scalar. XLA folds a sum of a
    broadcast constant (the same on every device) but not of a one-element constant: explain
    counted no collective where the compiled program moves 4 B."""
    v = _normal(16, "b")

    def fn(v):
        zeros = md.slice(md.pad(md.reshape(v, "p4:4 q4:4"), "q4", 8, 8), "q4", 16, 4)
        return md.einsum(zeros, v, out="")
    _kept(fn, md.Mesh({"x": 2, "y": 4}), md.Layout({"q4": "x"}), v, moved={"all-reduce": 4})


def test_campaign_a_scan_retry_does_not_hide_the_live_collectives():
    """A scan over p2 of reshape(v[d:x]) under jax.grad: md.scan retried its step (the carry left
    wider than it entered) and rolled the first try's records back, but that try's collectives
    stayed in the trace, dead, identical to the live ones. Explain merged identical computations
    before dropping dead ones, so the dead copies stood in for the live ones and their records
    were never matched: explain {} where the compiled program moves 4 B + 4 B."""
    v = _normal(8, "d")

    def loss(v):
        w = md.reshape(v, "p2:2 q4:4")
        step = lambda c, wi: (md.tanh(c + wi) * 0.5 + c * 0.5, None)
        carry, _ = md.scan(step, md.sum(w, "p2") * 0.1, w, dim="p2")
        return (md.sum(md.tanh(w)) + md.sum(md.tanh(carry))).array

    _kept(jax.grad(loss), md.Mesh({"x": 8}), md.Layout({"d": "x"}), v,
          moved={"all-reduce": 4, "all-gather": 4})


def test_campaign_a_sum_carried_into_a_reduction_and_a_shift_is_reduced_once():
    """m = mean(v, d) of v[e c d:x] is a pending sum over x; sum(m, e) and shift(m, c, 0), both
    returned, each carried it on and reduced it: [c] (56 B) and [e c] (1792 B), where gspmd reduces
    m once (1792 B) and sums it locally. The values the sum reached are larger together than m:
    reduced once where m is made."""
    v = _normal((32, 8, 8), "e c d")

    def fn(v):
        m = md.mean(v, "d")
        return md.sum(m, "e"), md.shift(m, "c", 0)
    _kept(fn, md.Mesh({"x": 8, "y": 1}), md.Layout({"d": ("x", "y")}), v, moved={"all-reduce": 1792})


def test_campaign_a_merge_moves_a_later_dims_split_onto_its_first():
    """reshape(rename(v[b a:x d], a <-> b), "m256 d") under jax.grad: the merged group [a b] had
    its split on b, its second dim, and the first was whole, so the reshape gathered b (7168 B)
    where gspmd moves the split onto a (an all-to-all, 896 B each way: 1792 B) and merges a
    result split over x (only summed into the loss: it never moves again). That is a candidate
    now. Returned, the merged result must be whole and the gather stays the cheapest."""
    v = md.param(_normal((16, 16, 8), "b a d"))
    mesh, layout = md.Mesh({"x": 8, "y": 1}), md.Layout({"a": ("x", "y")})

    def loss(v):
        w = md.rename(v * v, {"b": "a", "a": "b"})
        return (md.sum(md.tanh(w)) + md.sum(md.tanh(md.reshape(w, "m256:256 d:8")))).array

    _kept(jax.grad(loss), mesh, layout, v, moved={"all-to-all": 1792})
    merged = lambda v: md.reshape(md.rename(v, {"b": "a", "a": "b"}), "m256:256 d:8")
    _kept(merged, mesh, layout, v, moved={"all-gather": 7168})


def test_campaign_a_read_before_a_merge_shares_the_gathered_operand():
    """dynamic_slice(v[d:y+x a], d, 6) and reshape(v, "m128"), both returned: the reshape kept d's
    split on m128 and the return gathered m128 (448 B), while the read summed its masked row on
    its own (a 112 B all-reduce). gspmd gathers v once and reads the row from it. Gathering v or
    the result is a tie for the reshape: it now gathers v (the copy other readers can share), and
    the next trace's read reads that copy."""
    v = _normal((8, 16), "d a")

    def fn(v):
        return md.dynamic_slice(v, "d", jnp.int32(6), None), md.reshape(v, "m128:128")
    _kept(fn, md.Mesh({"x": 4, "y": 2}), md.Layout({"d": ("y", "x")}), v, moved={"all-gather": 448})


def test_campaign_a_returned_outer_product_gathers_the_small_sum():
    """einsum(w[c e], v[a], out="e a") with w stored split on e, returned: c is w's own dim,
    summed first, and the [e] sum met v where w holds e, so the [e a] result was gathered at the
    return (1792 B; under every param_gather mode). gspmd gathers the [e] sum (112 B). The
    layout's placement of a kept dim is a candidate too, chosen when the result is sure to move."""
    r = np.random.default_rng(0)
    w = md.param(md.named(jnp.asarray(r.standard_normal((8, 32)), jnp.float32), "c e"))
    v = _normal(16, "a", seed=1)
    for mode in ("keep", "regather", "auto"):
        _kept(lambda w, v: md.einsum(w, v, out="e a"), md.Mesh({"x": 8}), md.Layout({}, params={"e": "x"}),
              w, v, param_gather=mode, moved={"all-gather": 112})


def test_campaign_a_merge_bet_on_staying_split_is_checked_against_none():
    """relu(reshape(w[c e:x], "m256")) * 2 + 0.25 returned: the merge moved e's split onto c (a
    112 B all-to-all, the candidate added for campaign 31) hoping m256 stays split; it did not,
    the returned value was gathered (896 B) after the elementwise ops (1008 B where gspmd moves
    896 B). A trace that made such a bet is now compared with one that makes none (the fewer
    bytes kept); campaign 31's program keeps its 1792 B."""
    w = md.param(_normal((8, 32), "c e"))

    def fn(w):
        return md.relu(md.reshape(w, "m256:256")) * 2.0 + 0.25, md.reshape(w, "p2:2 q4:4 e:32")
    _kept(fn, md.Mesh({"x": 8}), md.Layout({"d": "x", "e": "x", "m128": "x"}), w, param_gather="regather",
          moved={"all-gather": 896})
