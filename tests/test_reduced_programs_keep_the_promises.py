"""Regression tests for the defects the fuzzer found (tests/test_fuzz.py, and the long campaign,
tests/fuzz_campaign.py), one test per finding, each reduced to the smallest program. Each asserts
the property the contract promises: the lowered value equals the unsharded one, explicit bytes <=
gspmd bytes, explain == HLO. The defects found from outside (issue 9): test_outside_programs_keep_the_promises.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshdsl as md
from helpers import explain_vs_hlo as _explain_vs_hlo
from helpers import moved_by_backend as _moved
from helpers import same_unsharded as _same


# -- new bugs found by the fuzzer (tests/test_fuzz.py) ------------------------------------------------

@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_top_k_candidates_larger_than_blocks(k):
    """top_k over a split dim gathered k candidates and their indices per device even when that
    is more than the blocks themselves (k=4 over blocks of 2: 2x gspmd's bytes)."""
    x = md.named(jnp.asarray(np.random.default_rng(0).standard_normal((3, 16)), jnp.float32), "r b")
    fn = lambda x: md.top_k(x, "b", k=k, out="k")
    mesh, layout = md.Mesh({"data": 8}), md.Layout({"b": "data"})
    moved = _moved(fn, mesh, layout, x)
    assert moved["explicit"] <= moved["gspmd"], moved
    _same(fn, {"data": 8}, {"b": "data"}, x)


@pytest.mark.parametrize("op", ["logsumexp", "softmax", "cumsum", "shift", "top_k", "slice", "reshape"])
def test_parameter_only_value_all_reduced_to_fix_its_type(op):
    """A value computed from a replicated parameter alone (logsumexp(w) next to an input split
    over the mesh) was typed varying and all-reduced at the output (gspmd: no communication)."""
    x = md.named(jnp.ones((8, 4)), "c d")
    w = md.param(md.named(jnp.asarray(np.random.default_rng(0).standard_normal(16), jnp.float32), "e"))
    f = {"logsumexp": lambda w: md.logsumexp(w, "e"), "softmax": lambda w: md.softmax(w, "e"),
         "cumsum": lambda w: md.cumsum(w, "e"), "shift": lambda w: md.shift(w, "e", 3),
         "top_k": lambda w: md.top_k(w, "e", k=2)[0], "slice": lambda w: md.slice(w, "e", 2, 5),
         "reshape": lambda w: md.reshape(w, "p:4 q:4")}[op]
    fn = lambda x, w: (x * 2.0, f(w))
    mesh, layout = md.Mesh({"x": 4, "y": 2}), md.Layout({"c": ("y", "x")})
    assert _moved(fn, mesh, layout, x, w) == {"explicit": 0.0, "gspmd": 0.0}
    _same(fn, {"x": 4, "y": 2}, {"c": ("y", "x")}, x, w)


def test_explain_counts_a_computation_the_program_repeats():
    """Two identical einsums (and their all-reduces) in one program: XLA merges them (CSE), so
    explain must count the all-reduce once, forward and backward."""
    x = md.named(jnp.asarray(np.random.default_rng(0).standard_normal((16, 8)), jnp.float32), "b d")
    fn = lambda v: (md.einsum(v, v, out=""), md.einsum(v, v, out=""))
    grads = lambda x: jax.grad(lambda x: md.sum(md.tanh(fn(x)[0]) + md.tanh(fn(x)[1])).array)(x)
    mesh, layout = md.Mesh({"x": 4, "y": 2}), md.Layout({"b": "y"})
    for f in (fn, grads):
        e, h = _explain_vs_hlo(f, mesh, layout, x)
        assert e == h and e


def test_pad_then_slice_of_a_split_dim():
    """slice(pad(x)) along a split dim reads x through one window (a 2-row shift, as gspmd fuses them), not
    pad rows moved by +1 block and then by -1 block."""
    x = md.named(jnp.asarray(np.random.default_rng(0).standard_normal(8), jnp.float32), "c")
    fn = lambda x: md.slice(md.pad(x, "c", 7, 9), "c", 5, 8)
    moved = _moved(fn, md.Mesh({"x": 2, "y": 4}), md.Layout({"c": "x"}), x)
    assert moved["explicit"] <= moved["gspmd"], moved


def test_parameters_broadcast_together_stay_replicated():
    """w0[a b] + w1[a] (parameters only, replicated) next to an input split over the mesh was
    typed varying and all-reduced at the output (1536 B/device; gspmd: none)."""
    r = np.random.default_rng(0)
    w0 = md.param(md.named(jnp.asarray(r.standard_normal((16, 16)), jnp.float32), "a b"))
    w1 = md.param(md.named(jnp.asarray(r.standard_normal(16), jnp.float32), "a"))
    ids = md.named(jnp.arange(8), "c")
    fn = lambda w0, w1, ids: (w0 + w1, md.one_hot(ids, md.Dim("a", 16)))
    mesh, layout = md.Mesh({"x": 4, "y": 2}), md.Layout({"c": "x"})
    assert _moved(fn, mesh, layout, w0, w1, ids)["explicit"] == 0.0
    _same(fn, {"x": 4, "y": 2}, {"c": "x"}, w0, w1, ids)


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


def test_regather_einsum_split_parameter():
    """einsum(w[a b d], x[c]) with a split: w's own contracted dims are summed first (a small
    pending sum), not carried into the larger result (it was 8x gspmd's bytes)."""
    r = np.random.default_rng(0)
    x = md.named(jnp.asarray(r.standard_normal(8), jnp.float32), "c")
    w = md.param(md.named(jnp.asarray(r.standard_normal((16, 16, 8)), jnp.float32), "a b d"))
    fn = lambda x, w: md.softmax(md.einsum(w, x, out="d c"), "d")
    mesh, layout = md.Mesh({"x": 8}), md.Layout({"a": "x"})
    moved = _moved(fn, mesh, layout, x, w, param_gather="regather")
    assert moved["explicit"] <= moved["gspmd"], moved


def test_concat_of_values_computed_from_a_parameter_alone():
    """A value computed from a parameter alone (slice of concat of w) stays free of the data axes:
    the next op meeting it and the parameter does not vary over them (it all-reduced the
    replicated output: 64 B where gspmd moves 0)."""
    r = np.random.default_rng(0)
    w = md.param(md.named(jnp.asarray(r.standard_normal(16), jnp.float32), "b"))
    ids = md.named(jnp.asarray(r.integers(0, 16, 8), jnp.int32), "d")
    fn = lambda w, ids: (md.one_hot(ids, md.Dim("b", 16)),
                         md.slice(md.concat([md.slice(md.concat([w, w], "b"), "b", 14, 16), w], "b"), "b", 14, 16))
    mesh = md.Mesh({"x": 4, "y": 2})
    layout = md.Layout({"a": ("y", "x"), "d": ("y",)})
    moved = _moved(fn, mesh, layout, w, ids, param_gather="auto")
    assert moved["explicit"] <= moved["gspmd"], moved


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
