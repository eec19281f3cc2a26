"""Parameters and their gradients: a value of parameters alone stays replicated (never all-reduced
to fix its type), pending sums are reduced where they are smallest, a stored split is gathered
once, and the optimizer's update moves nothing beyond the gradient's reduction."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshdsl as md
from meshdsl.costmodel import hlo_comm

from helpers import assert_same, explain_vs_hlo, moved_by_backend, promises_kept, same_unsharded

_moved, _explain_vs_hlo, _same, _kept = moved_by_backend, explain_vs_hlo, same_unsharded, promises_kept


def test_grad_around_a_lowered_function_after_another_mesh_shape():
    code = textwrap.dedent("""
        import os; os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
        import jax, jax.numpy as jnp, meshdsl as md
        x = md.named(jnp.ones((32, 8, 32)), "h f d")
        w = jnp.ones((32, 8, 32))
        for mesh, layout in [({"data": 2, "model": 4}, {"f": "data"}), ({"data": 4, "model": 2}, {"d": "data"})]:
            f = md.lower(md.tanh, md.Mesh(mesh), md.Layout(layout))
            f(x)
            g = jax.grad(lambda x: jnp.sum(f(x).array * w))(x)
            assert abs(float(jnp.sum(g.array)) - float(jnp.sum(1 - jnp.tanh(1.0) ** 2) * 32 * 8 * 32)) < 1
        print("OK")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stderr[-2000:]


def test_a_reshaped_parameter_stays_a_parameter_unsharded_and_lowered():
    w = md.param(md.named(jnp.ones((8, 16)), "a b"))
    fn = lambda w: (md.reshape(w, "ab:128"), md.rename(w, {"a": "c"}), md.transpose(w, "b a"))
    ref = fn(w)
    got = md.lower(fn, md.Mesh({"data": 8}), md.Layout({}))(w)
    assert [r.is_param for r in ref] == [True, True, True]
    assert [g.is_param for g in got] == [r.is_param for r in ref]


def test_an_optimizer_update_is_never_all_reduced_to_fix_its_type():
    x = md.named(jnp.ones((16, 64)), "batch d")
    w = md.param(md.named(jnp.ones((64, 128)) * 0.01, "d f"))

    def step(x, w):
        g = jax.grad(lambda w: md.sum(md.square(md.einsum(x, w, out="batch f"))).array)(w)
        return w - 0.1 * g, md.tanh(w)

    mesh, layout = md.Mesh({"data": 8}), md.Layout({"batch": "data"})
    moved = _moved(step, mesh, layout, x, w)
    assert moved["explicit"] <= moved["gspmd"]
    assert moved["explicit"] == 2 * 7 / 8 * 64 * 128 * 4  # the gradient all-reduce, nothing else


def _adam_problem():
    r = np.random.default_rng(0)
    x = md.named(jnp.asarray(r.standard_normal((16, 32)), jnp.float32), "batch d")
    y = md.named(jnp.asarray(r.standard_normal((16, 8)), jnp.float32), "batch o")
    w1 = md.param(md.named(jnp.asarray(r.standard_normal((32, 64)) * 0.1, jnp.float32), "d f"))
    w2 = md.param(md.named(jnp.asarray(r.standard_normal((64, 8)) * 0.1, jnp.float32), "f o"))

    def loss(params, x, y):
        w1, w2 = params
        h = md.relu(md.einsum(x, w1, out="batch f"))
        return md.mean(md.square(md.einsum(h, w2, out="batch o") - y)).array

    def step(params, m, v, x, y):
        """A fused Adam step in named ops: gradients inside, the update in named ops, all returned
        (re-marked as parameters so they stay stored by the storage rules)."""
        g = jax.grad(loss)(params, x, y)
        m = [0.9 * mi + 0.1 * gi for mi, gi in zip(m, g)]
        v = [0.99 * vi + 0.01 * gi * gi for vi, gi in zip(v, g)]
        p = [pi - 0.01 * mi / (md.sqrt(vi) + 1e-8) for pi, mi, vi in zip(params, m, v)]
        return [md.param(t) for t in p], [md.param(t) for t in m], [md.param(t) for t in v]

    params = [w1, w2]
    zeros = [md.param(w * 0.0) for w in params]
    return step, (params, zeros, zeros, x, y), 32 * 64 + 64 * 8


@pytest.mark.parametrize("zero", [False, True])
def test_a_fused_training_step_moves_the_gradient_reduction_alone(zero):
    """Data parallel: exactly the gradient all-reduce, 2(n-1)/n * 4 Psi bytes. Parameters and
    optimizer state stored split (params=): a reduce-scatter of the gradients and an all-gather of
    the parameters at use, (n-1)/n * 4 Psi each - never more than gspmd."""
    step, args, psi = _adam_problem()
    mesh = md.Mesh({"data": 8})
    layout = md.Layout({"batch": "data"}, params={"d": "data", "o": "data"} if zero else None)
    got = hlo_comm.analyze(md.lower(step, mesh, layout).lower(*args).compile()).summary()
    got = {k: v["moved_bytes"] for k, v in got.items() if v["moved_bytes"]}
    one = 7 / 8 * 4 * psi
    assert got == ({"reduce-scatter": one, "all-gather": one} if zero else {"all-reduce": 2 * one})
    assert sum(got.values()) <= _moved(step, mesh, layout, *args)["gspmd"]
    assert_same(md.lower(step, mesh, layout)(*args), step(*args), rtol=1e-4, atol=1e-6)


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


def _vector(n, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(n), jnp.float32)


@pytest.mark.parametrize("op", ["logsumexp", "softmax", "cumsum", "shift", "top_k", "slice", "reshape"])
def test_a_value_of_parameters_alone_is_never_all_reduced_to_fix_its_type(op):
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


def test_an_einsum_of_a_split_parameter_gathered_again_backward():
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
