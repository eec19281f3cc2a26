"""Regression tests for the findings of the long fuzz campaigns of issue 9 (tests/fuzz_campaign.py,
replayed with tests/fuzz_replay.py): each program as the campaign found it, with the property the
contract promises (the unsharded values, explicit bytes <= gspmd bytes, explain == HLO)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshdsl as md

from helpers import assert_same, explain_vs_hlo, moved_by_backend, promises_kept, same_unsharded

_moved, _explain_vs_hlo, _same, _kept = moved_by_backend, explain_vs_hlo, same_unsharded, promises_kept


# -- found by the long campaign (tests/fuzz_campaign.py), replayed with tests/fuzz_replay.py -------

def test_cache_write_into_a_parameter_stays_replicated():
    """A KV-cache style write into a replicated parameter, next to an input split over the mesh:
    the written entry (sum(w) / 2) comes from the parameter alone, so the result stays typed
    replicated (it was all-reduced at the output: 7168 B where gspmd moves 0)."""
    w = md.param(md.named(jnp.asarray(np.random.default_rng(0).standard_normal((8, 16, 8)), jnp.float32), "c a d"))
    ids = md.named(jnp.arange(16), "b")
    fn = lambda w, ids: md.dynamic_update_slice(w, md.sum(w, "d") * 0.5, "d", jnp.int32(5))
    mesh, layout = md.Mesh({"x": 8}), md.Layout({"b": "x"})
    assert _moved(fn, mesh, layout, w, ids) == {"explicit": 0.0, "gspmd": 0.0}
    _same(fn, {"x": 8}, {"b": "x"}, w, ids)


def test_scalar_pending_sum_reduced_before_it_meets_a_larger_operand():
    """einsum(v[c], w[b e d]) with c split: v is summed over c first and the scalar all-reduced
    (4 B), not the [b d] result (128 B; gspmd: the scalar)."""
    r = np.random.default_rng(0)
    v = md.param(md.named(jnp.asarray(r.standard_normal(8), jnp.float32), "c"))
    w = md.param(md.named(jnp.asarray(r.standard_normal((16, 32, 8)), jnp.float32), "b e d"))
    fn = lambda v, w: md.einsum(v, w, out="b d")
    mesh, layout = md.Mesh({"x": 4, "y": 2}), md.Layout({"c": "y"}, params={"d": "x"})
    moved = _moved(fn, mesh, layout, v, w, param_gather="auto")
    assert moved["explicit"] <= moved["gspmd"], moved
    e, h = _explain_vs_hlo(fn, mesh, layout, v, w, param_gather="auto")
    assert e == h
    _same(fn, {"x": 4, "y": 2}, {"c": "y"}, v, w)


def test_mean_over_no_dims_is_the_value_itself():
    """mean(s) of a scalar s over no dims is s: two reads of one pending scalar (one through mean)
    are one all-reduce in the compiled program, and explain counts one (it counted two)."""
    w = md.param(md.named(jnp.asarray(np.random.default_rng(0).standard_normal(16), jnp.float32), "a"))
    fn = lambda w: (md.sin(md.einsum(w, w, out="") - w), md.mean(md.einsum(w, w, out="")))
    mesh, layout = md.Mesh({"x": 2, "y": 4}), md.Layout({"a": ("y", "x")})
    e, h = _explain_vs_hlo(fn, mesh, layout, w, param_gather="auto")
    assert e == h == {"all-reduce": 7.0}
    _same(fn, {"x": 2, "y": 4}, {"a": ("y", "x")}, w)


def test_elementwise_on_a_split_parameter_before_it_is_gathered():
    """erf(v) of a parameter stored split that top_k gathers - before or after - reads the
    gathered copy (it ran where v is stored and its result was gathered again: 48 B where gspmd
    moves 24 B). Now: erf's candidate with v entering gathered shares top_k's gather in the plan."""
    v = md.param(md.named(jnp.asarray(np.random.default_rng(0).standard_normal(8), jnp.float32), "d"))
    top = lambda v: md.top_k(v, "d", k=4, out="k4")[0]
    mesh, layout = md.Mesh({"x": 4, "y": 2}), md.Layout({"k4": "y"}, params={"d": "x"})
    for fn in (lambda v: (top(v), md.erf(v) / top(v)), lambda v: (md.erf(v), top(v), md.erf(v) / top(v))):
        _kept(fn, mesh, layout, v, param_gather="auto", moved={"all-gather": 24})


def test_linear_op_on_a_pending_value_that_is_also_returned():
    """A shift of a take over a split table dim that is also returned: the take's pending sum is
    reduced once, where the take makes it, and shifted reduced (it was reduced twice, once for the
    take's result and once for the shifted copy: 3328 B where gspmd moves 2304 B)."""
    r = np.random.default_rng(0)
    table = md.param(md.named(jnp.asarray(r.standard_normal((16, 32)), jnp.float32), "b e"))
    ids = md.named(jnp.asarray(r.integers(0, 32, (8, 8)), jnp.int32), "c d")
    def fn(t, i):
        rows = md.take(t, i, "e")
        return rows, md.shift(rows, "c", 1)

    mesh = md.Mesh({"x": 4, "y": 2})
    layout = md.Layout({"c": "x", "e": ("y", "x")}, params={"c": "y"})
    _kept(fn, mesh, layout, table, ids, param_gather="auto")


def test_contraction_whose_partial_sum_serves_the_gradient_too():
    """s = einsum(w[e b], a[b]) with e split, under jax.grad: w's own dim e is summed first and the
    [b] sum reduced once, in the forward pass; a's gradient reads it (the scalar s was all-reduced
    and, backward, a's gradient [b] too: 119 B where gspmd moves 112 B)."""
    r = np.random.default_rng(0)
    a = md.param(md.named(jnp.asarray(r.standard_normal(16), jnp.float32), "b"))
    w = md.param(md.named(jnp.asarray(r.standard_normal((32, 16)), jnp.float32), "e b"))
    loss = lambda a, w: md.sum(md.tanh(md.einsum(w, a, out=""))).array
    grad = lambda a, w: jax.grad(loss, argnums=(0, 1))(a, w)
    mesh, layout = md.Mesh({"x": 8}), md.Layout({"e": "x"})
    _kept(grad, mesh, layout, a, w, moved={"all-reduce": 112})


def test_scalar_contraction_reduces_once_for_value_and_gradient():
    """einsum(w[a], x[c], out="") with c split, and w's gradient: x's sum over c is reduced once,
    in the forward pass, and the gradient reads it (the product's sum stayed pending through the
    einsum and w's gradient was all-reduced again in the backward pass: 14 B where gspmd moves 7)."""
    r = np.random.default_rng(0)
    w = md.param(md.named(jnp.asarray(r.standard_normal(4), jnp.float32), "a"))
    x = md.named(jnp.asarray(r.standard_normal(16), jnp.float32), "c")
    loss = lambda w, x: md.sum(md.tanh(md.einsum(w, x, out=""))).array
    grad = lambda w, x: jax.grad(loss)(w, x)
    mesh, layout = md.Mesh({"x": 8}), md.Layout({"c": "x"})
    _kept(grad, mesh, layout, w, x, moved={"all-reduce": 7})


def test_replicated_data_meeting_a_parameter_is_not_all_reduced_at_the_output():
    """where(logical_not(w > v), w, v) of a parameter w [c] and replicated data v [e], in a program
    whose other input is split (so ops reading parameters and data vary over x, for the
    parameters' gradients): the returned [c e] value was all-reduced only to type it replicated
    (1792 B where gspmd moves 0). Widening is a decision point: the plan leaves it out, and
    the ops reading what it computed follow."""
    r = np.random.default_rng(0)
    v = md.named(jnp.asarray(r.standard_normal(32), jnp.float32), "e")
    w = md.param(md.named(jnp.asarray(r.standard_normal(8), jnp.float32), "c"))
    ids = md.named(jnp.asarray(r.integers(0, 5, (8, 8)), jnp.int32), "d c")
    fn = lambda v, w, ids: md.where(md.logical_not(md.greater(w, v)), w, v)
    grad = lambda v, w, ids: jax.grad(lambda w: md.sum(md.tanh(fn(v, w, ids))).array)(w)
    mesh, layout = md.Mesh({"x": 8}), md.Layout({"d": "x"})
    for f in (fn, grad):
        _kept(f, mesh, layout, v, w, ids)


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


def test_explain_sees_through_the_same_jit_called_twice():
    """Two md.where (one jitted jnp.where, called twice) on predicates that each need all-reduces,
    two md.cumsum:
    explain splices each call in with its own variables and counts both (a shared variable would
    merge the two and drop one's collectives)."""
    r = np.random.default_rng(1)
    x = md.named(jnp.asarray(r.standard_normal((16, 8, 32)), jnp.float32), "a d e")
    y = md.named(jnp.asarray(r.standard_normal((16, 32)), jnp.float32), "a e")
    fn = lambda x, y: (md.where(md.greater(md.logsumexp(x, "d"), 0.0), y, -y),
                       md.where(md.greater(md.logsumexp(x * 2.0, "d"), 0.0), y, 2.0 * y))
    e, h = _explain_vs_hlo(fn, md.Mesh({"x": 4, "y": 2}), md.Layout({"d": "y"}), x, y)
    assert e == h and e["all-reduce"] > 0
    c = md.named(jnp.asarray(r.standard_normal(64), jnp.float32), "c")
    fn = lambda c: (md.cumsum(c, "c"), md.cumsum(c * 2.0, "c"))   # jnp.cumsum's jit, twice
    e, h = _explain_vs_hlo(fn, md.Mesh({"x": 8}), md.Layout({"c": "x"}), c)
    assert e == h == {"all-gather": 2 * 7 * 4}


def test_position_bias_gradient_is_summed_at_the_table_size():
    """A bias looked up from a parameter table by positions (arange: no parameter in them) and
    added to data: the table's gradient is all-reduced at the table's size [buckets heads], not
    at the bias's [heads q k] (positions count as data, not as parameter-derived values)."""
    r = np.random.default_rng(0)
    table = md.param(md.named(jnp.asarray(r.standard_normal((32, 8)), jnp.float32), "buckets heads"))
    scores = md.named(jnp.asarray(r.standard_normal((16, 8, 16, 16)), jnp.float32), "batch heads q k")

    def step(table, scores):
        def loss(table):
            q, k = md.arange(md.Dim("q", 16)), md.arange(md.Dim("k", 16))
            bucket = md.clip(k - q + 16, 0, 31)
            return md.sum(md.softmax(scores + md.take(table, bucket, "buckets"), "k") * scores).array
        return jax.grad(loss)(table)

    mesh, layout = md.Mesh({"data": 8}), md.Layout({"batch": "data"})
    e, h = _explain_vs_hlo(step, mesh, layout, table, scores)
    assert e == h == {"all-reduce": 2 * 7 / 8 * 32 * 8 * 4}
    _same(step, {"data": 8}, {"batch": "data"}, table, scores)


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


def test_parameter_gathered_typed_varying_and_typed_invariant_is_one_gather():
    """param_gather="regather": where(p, v, w) with the result split elsewhere gathers v typed
    varying, returning v gathers it typed invariant; XLA compiles one all-gather (explain counted
    two: 126 B where XLA moved 70). The whole-program plan computes the where on v1 gathered, the
    copy the return needs anyway: 56 B."""
    v0 = md.param(md.named(jnp.ones((4, 8)), "a c"))
    v1 = md.param(md.named(jnp.arange(16.0) - 8, "b"))

    def fn(v0, v1):
        v3 = md.maximum(v1, v1)
        return v3, md.where(v1 > 0, v3, v0)
    mesh, layout = md.Mesh({"x": 8}), md.Layout({"c": "x"}, params={"b": "x"})
    e, h = _explain_vs_hlo(fn, mesh, layout, v0, v1, param_gather="regather")
    assert e == h == {"all-gather": 7 / 8 * 64}
    assert_same(md.lower(fn, mesh, layout, param_gather="regather")(v0, v1), fn(v0, v1))


# -- campaign 9 (65 minutes on 2778b2c), replayed on the fixes ----------------------------------

def _vector(n, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(n), jnp.float32)


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


# -- campaign 10 (62 minutes on dee7d3e: 3620 cases, 13 over gspmd's bytes, none wrong) ---------

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


# -- campaign 11 (on 6f3db4a) ---------------------------------------------------------------------

def test_renamed_shift_is_no_longer_pieces_along_the_old_name():
    """shift(shift(v)) renamed c -> d and returned split over d: the rename's result is the same
    local array, remembered as pieces along c; relaying it looked c up in [d] (a raw ValueError)."""
    v = md.named(jnp.asarray(np.random.default_rng(0).standard_normal(16), jnp.float32), "c")
    fn = lambda v: md.rename(md.shift(md.shift(v, "c", -2), "c", 6), {"c": "d"})
    _kept(fn, md.Mesh({"x": 2, "y": 4}), md.Layout({"d": ("x", "y")}), v, moved={})


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
