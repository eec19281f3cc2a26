"""Copies and redistributions: a copy another op makes (for the return, for top_k) is read, not
made again; one made only by dead code is not counted; two splits swap by permutes; a scan
carry returns in any dim order."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshdsl as md

from helpers import explain_vs_hlo, moved_by_backend, promises_kept, same_unsharded

_moved, _explain_vs_hlo, _same, _kept = moved_by_backend, explain_vs_hlo, same_unsharded, promises_kept


def _vector(n, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(n), jnp.float32)



def test_an_operand_local_map_gathers_is_one_copy_with_another_readers():
    """``local_map`` gathers its operand whole; a cumsum of the same value may read that copy
    (then sum locally) instead of exchanging block totals: one all-gather, 24 B, gspmd's plan
    too (local_map's entry placements are the planner's, as any op's: fuzz seed 45)."""
    x = md.named(_vector(8), "d")
    mesh, layout = md.Mesh({"x": 2, "y": 4}), md.Layout({"d": "y"})

    def fn(x):
        s = md.sin(x)
        total = md.cumsum(s, "d")   # (first: the copy local_map makes later is its to read)
        return md.local_map(lambda a: a * 2.0, s, out="d"), md.sigmoid(total)
    _kept(fn, mesh, layout, x, moved={"all-gather": 3 / 4 * 8 * 4})   # the 8 floats gathered over y:4


def test_a_slice_of_a_concat_reads_the_reduced_copy_of_a_pending_piece():
    """``v`` is a pending sum (a mean over ``d`` split on ``x+y``); an einsum reduces it, and a
    slice of ``concat(einsum, v)`` then reads ``v``'s rows: from the reduced copy, which moves
    nothing more, not from ``v`` reduced again after the slice. Two all-reduces of 32 floats
    over 8 devices, gspmd's plan too (fuzz seed 46)."""
    r = np.random.default_rng(0)
    w = md.named(jnp.asarray(r.standard_normal((32, 16, 8)), jnp.float32), "e a d")
    x = md.named(jnp.asarray(r.standard_normal((32, 8)), jnp.float32), "e d")
    mesh, layout = md.Mesh({"x": 2, "y": 4}), md.Layout({"d": ("x", "y")})

    def fn(w, x):
        v = md.mean(x, "d")
        y = md.einsum(w, v, out="e")
        return y, md.slice(md.concat([y, v], "e"), "e", 18, 32)
    _kept(fn, mesh, layout, w, x, moved={"all-reduce": 2 * 2 * 7 / 8 * 32 * 4})


def test_swapping_two_splits_is_a_redistribution_not_a_gather():
    """A swap of two splits is a redistribution by two ppermute rounds of half blocks (2048 B;
    gspmd: all-to-all + permute, 3072 B), not a gather and an all-to-all (5120 B)."""
    x = md.named(jnp.asarray(np.random.default_rng(0).standard_normal((8, 32, 16)), jnp.float32), "b s d")
    mesh, layout = md.Mesh({"data": 2, "model": 4}), md.Layout({"b": "data", "s": "model"})
    fn = lambda x: md.rename(x, {"b": "s", "s": "b"})
    moved = _moved(fn, mesh, layout, x)
    assert moved == {"explicit": 2048.0, "gspmd": 3072.0}, moved
    assert md.explain(fn, mesh, layout, x).counts() == {"collective-permute": 2}
    _same(fn, {"data": 2, "model": 4}, {"b": "data", "s": "model"}, x)
    grad = lambda x: jax.grad(lambda x: md.sum(md.sin(fn(x)) * md.arange(md.Dim("b", 32))).array)(x)
    _same(grad, {"data": 2, "model": 4}, {"b": "data", "s": "model"}, x)
    e, h = _explain_vs_hlo(grad, mesh, layout, x)
    assert e == h


def test_an_einsum_whose_contracted_and_kept_dims_share_an_axis_moves_no_more_than_the_compiler():
    r = np.random.default_rng(0)
    x = md.named(jnp.asarray(r.standard_normal((8, 8, 16)), jnp.float32), "f s d")
    y = md.named(jnp.asarray(r.standard_normal((32, 8, 8)), jnp.float32), "b s f")
    mesh, layout = md.Mesh({"data": 8}), md.Layout({"d": "data", "b": "data"})
    fn = lambda x, y: md.einsum(x, y, out="d")
    moved = _moved(fn, mesh, layout, x, y)
    assert moved["explicit"] <= moved["gspmd"], moved
    f = md.lower(fn, mesh, layout)
    np.testing.assert_allclose(np.asarray(f(x, y).array), np.asarray(fn(x, y).array), rtol=1e-4, atol=1e-3)


def test_a_scan_carry_returned_with_its_dims_in_another_order():
    h = md.named(jnp.arange(32.0).reshape(4, 8), "b d")
    bias = md.named(jnp.arange(24.0).reshape(3, 8), "layers d")

    def fn(h, bias):
        out, _ = md.scan(lambda h, b: (b + h, None), h, bias, dim="layers")
        return out

    want = fn(h, bias)
    assert want.names == ("b", "d")
    np.testing.assert_allclose(np.asarray(want.array), np.asarray(h.array) + np.asarray(bias.array).sum(0))
    for layout in ({"b": "data"}, {"d": "model", "b": "data"}):
        _same(fn, {"data": 2, "model": 4}, layout, h, bias)


@pytest.mark.parametrize("name, out, moved", [("full contraction", "", 7.0), ("batch dims only", "a", 28.0),
                                              ("one side with free dims", "a", 56.0)])
def test_einsum_with_its_operands_swapped(name, out, moved):
    """einsum(v, w) next to einsum(w, v): where neither side has a free dim XLA computes one value
    (one all-reduce); where one has, it computes both (the all-reduces combined, twice the bytes).
    Explain counted two all-reduces of the full contraction (8 B where XLA moved 4)."""
    w = md.named(jnp.arange(64.0).reshape(4, 16), "a c")
    one_side = name == "one side with free dims"
    v = md.named(jnp.arange(16.0), "c") if one_side else md.named(jnp.arange(64.0).reshape(4, 16), "a c")
    fn = lambda w, v: (md.einsum(w, v, out=out), md.einsum(v, w, out=out))
    mesh, layout = md.Mesh({"x": 8}), md.Layout({"c": "x"})
    e, h = _explain_vs_hlo(fn, mesh, layout, w, v)
    assert e == h == {"all-reduce": moved}
    _same(fn, {"x": 8}, {"c": "x"}, w, v)


def test_returned_reshape_is_gathered_once_not_parked_first():
    """[d:x e] -> [p2 q4 e], returned whole: gathering d (896 B, gspmd's move) beats parking x on e
    with an all-to-all first and gathering e at the return (1008 B). The plan prices both answers
    to whether the result is relaid later (``ctx.result_relaid``)."""
    v = md.named(jnp.asarray(np.random.default_rng(0).standard_normal((8, 32)), jnp.float32), "d e")
    _kept(lambda v: md.reshape(v, "p2:2 q4:4 e:32"), md.Mesh({"x": 8}), md.Layout({"d": "x"}), v,
          moved={"all-gather": 896})


def test_einsum_reads_the_copy_gathered_for_the_return():
    """h = einsum(x, w[c a:x]) keeps a split (w stored split), and h is returned whole; a second
    einsum contracting a reads the copy gathered for the return: no partial sum over x to
    all-reduce (it did: 14392 B where gspmd moves 14336 B). Since campaign 33 the first einsum
    gathers w's [c a] (448 B) instead: the layout's placement of its kept a is a candidate, and
    h, returned, is sure to move."""
    r = np.random.default_rng(0)
    x = md.named(jnp.asarray(r.standard_normal((32, 8)), jnp.float32), "e c")
    w = md.param(md.named(jnp.asarray(r.standard_normal((8, 16)), jnp.float32), "c a"))
    def fn(x, w):
        h = md.einsum(x, w, out="e c a")
        return h, md.einsum(x, h, out="c")
    mesh, layout = md.Mesh({"x": 8}), md.Layout({"d": "x"}, params={"a": "x"})
    _kept(fn, mesh, layout, x, w, param_gather="regather", moved={"all-gather": 448})


def test_dynamic_slice_reads_the_copy_top_k_gathers():
    """top_k(v) gathers v's split dim; a dynamic_slice of v reads that copy instead of a masked
    block and an all-reduce (35 B where gspmd moves 28 B)."""
    v = md.named(_vector(8), "d")
    fn = lambda v: (md.top_k(v, "d", k=2, out="k2")[0], md.dynamic_slice(v, "d", jnp.int32(1), None))
    _kept(fn, md.Mesh({"x": 8}), md.Layout({"d": "x"}), v, moved={"all-gather": 28})


def test_copy_made_only_by_dead_code_is_not_read():
    """An einsum gathers m (its result is never used: the compiler drops it); tanh(m) read that
    copy, making the gather live: 448 B where gspmd moves 14. The trace that reads no copy made by
    another op moves less and is kept."""
    x = md.named(jnp.asarray(np.random.default_rng(0).standard_normal((16, 8)), jnp.float32), "b d")

    def fn(x):
        m = md.reshape(x, "m128:128")
        md.einsum(md.local_map(lambda a: jnp.cumsum(a), m, out="m128", keep=""), m, out="")   # dead
        return md.sum(md.tanh(m)) + md.logsumexp(m, "m128")

    grad = lambda x: jax.grad(lambda x: fn(x).array)(x)
    _kept(grad, md.Mesh({"x": 8}), md.Layout({"b": "x"}), x, moved={"all-reduce": 14})


def test_self_attention_reads_the_whole_value_it_sliced_its_keys_from():
    """attention(v, v, v) over a length split over x, v a reshape of [e c a:x]: gathering v once
    and slicing the keys and values from it (each device attends with all queries to its
    block) computes where gspmd does (14336 B). The plan priced that at one gather - the keys'
    whole copy is the queries' - but in the program the reshape gives v whole, the keys are a
    slice of it, and the attention rule did not know a slice of v gathered is v: it took partial
    sums (29.75 KiB) and the plan was dropped for the rules' own 30464 B. A block sliced from a
    value is now gathered back as that value, nothing moved."""
    v1 = md.named(jnp.asarray(np.random.default_rng(0).standard_normal((32, 8, 16)), jnp.float32), "e c a")
    mesh = md.Mesh({"x": 8, "y": 1})
    layout = md.Layout({"a": ("x", "y")})

    def fn(v1):
        v = md.reshape(v1, "e:32 m128:128")
        kv = md.rename(v, {"m128": "kv"})
        return md.attention(v, kv, kv, over="kv", length="m128", features="e", causal=False, block=3, scale=0.5)
    _kept(fn, mesh, layout, v1, moved={"all-gather": 14336.0})
    grad = lambda v1: jax.grad(lambda v1: md.sum(md.tanh(fn(v1))).array)(v1)
    _kept(grad, mesh, layout, v1)
