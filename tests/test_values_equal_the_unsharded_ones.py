"""Findings of fuzz campaigns 20, 27, 34 and 43 (issue 9; tests/fuzz_campaign.py) about values,
not bytes: a gradient that must read the buffer its maximum came from, top_k ties that a layout's
reassociated sums must not break differently (-0.0 against 0.0), the fuzzer's reference for a
saturated tanh, and a value's pieces read under names a rename gave it since."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshdsl as md

from helpers import assert_same


# -- campaign 20 (on 0c49b59) ---------------------------------------------------------------------

@pytest.mark.parametrize("layout", [{"c": ("y", "x")}, {"e": "x"}], ids=["max-local", "max-split"])
def test_max_gradient_reads_the_value_its_maximum_came_from(layout):
    """grad of einsum(max(v + 0.01 * arange(e), e), -v, out="c"): the tie mask compares v with its
    maximum bit for bit. XLA's CPU backend at -O0 (the suite's flags) computed v + 0.01 * i once
    for the maximum and once for the mask, rounded differently: no element matched, the tie
    count was 0 and the gradient inf (plain jax.jit(jax.grad(...)) does the same). Now both read
    one buffer, inside the lowered function and around it."""
    v = md.param(md.named(jnp.asarray(np.random.default_rng(0).standard_normal((16, 8, 32)), jnp.float32), "b c e"))

    def loss(v):
        shifted = v + md.astype(md.arange(md.Dim("e", 32)), jnp.float32) * 0.01
        return md.sum(md.tanh(md.einsum(md.max(shifted, "e"), -v, out="c"))).array
    mesh, lay = md.Mesh({"x": 8, "y": 1}), md.Layout(layout)
    want = jax.grad(loss)(v)
    assert_same(md.lower(jax.grad(loss), mesh, lay)(v), want)
    assert_same(jax.grad(md.lower(loss, mesh, lay))(v), want)
    assert np.isfinite(np.asarray(want.array)).all()


def test_max_over_a_whole_dim_keeps_forward_mode_autodiff():
    """The max rule that reads one buffer is a JVP where the dim is whole: jax.jvp and
    jax.hessian through md.max work as through jnp.max, unsharded and lowered (ties share)."""
    v = jnp.asarray([[1.0, 3.0, 3.0, 0.0], [2.0, -1.0, 0.5, 2.0]], jnp.float32)
    fn = lambda a: md.max(md.named(a, "a b"), "b").array
    lowered = md.lower(fn, md.Mesh({"x": 2, "y": 4}), md.Layout({"a": "x"}))
    for f in (fn, lowered):
        y, t = jax.jvp(f, (v,), (jnp.ones_like(v),))
        np.testing.assert_allclose(t, [1.0, 1.0])
        np.testing.assert_allclose(jax.grad(lambda a: f(a).sum())(v), [[0, 0.5, 0.5, 0], [0.5, 0, 0, 0.5]])
    np.testing.assert_allclose(jax.hessian(lambda a: (fn(a) ** 2).sum())(v),
                               jax.hessian(lambda a: (jnp.max(a, axis=1) ** 2).sum())(v))


# -- campaign 27 (on 8fde770) ---------------------------------------------------------------------

def test_top_k_ties_minus_zero_and_zero():
    """top_k(einsum(one_hot(ids, c), v[d a c], out="b c a"), c): off the hot entry the product is
    0 * sum_d v, which is -0.0 where the lowered einsum sums d first (a whole own dim) and 0.0 where
    the unsharded one sums the products. XLA's top_k orders -0.0 below 0.0, so the indices of the
    tied zeros differed (205 of 512 entries of values + 0.01 * indices, with the campaign's
    values). Now -0.0 and 0.0 tie: lowest index first, everywhere. The program is checked with
    these values; the four-value case pins the rule (it fails without it)."""
    r = np.random.default_rng(0)
    v = md.param(md.named(jnp.asarray(r.standard_normal((8, 16, 8)), jnp.float32), "d a c"))
    ids = md.named(jnp.asarray(r.integers(-3, 19, 16), jnp.int32), "b")

    def fn(v, ids):
        scores = md.einsum(md.one_hot(ids, md.Dim("c", 8)), v, out="b c a") * 2.0
        values, index = md.top_k(scores, "c", 2, "k2")
        return values, index
    mesh, layout = md.Mesh({"x": 2, "y": 4}), md.Layout({"m": "x"}, params={"e": "x"})
    assert_same(md.lower(fn, mesh, layout)(v, ids), fn(v, ids))
    x = jnp.asarray([-0.0, 0.0, -1.0, 3.0], jnp.float32)
    top = lambda a: md.top_k(md.named(a, "c"), "c", 2, "k")[1].array
    for f in (top, md.lower(top, md.Mesh({"x": 2, "y": 4}), md.Layout({"c": "x"}))):
        np.testing.assert_array_equal(f(x), [3, 0])


# -- campaign 34 (on 3efe521) ---------------------------------------------------------------------

def test_saturated_tanh_gradient_is_the_compiled_unsharded_programs():
    """tanh(v1 + sum(v0 * v0)) with the sum near 13.5: every tanh is saturated, and its derivative
    1 - tanh(x)**2 is 0 run op by op but 1.2e-7 per element compiled (XLA's fused tanh), so the
    gradient of v0 differs 1500-fold between two runs of the unsharded program. The lowered one
    is jax.jit's exactly: the fuzzer accepts either run of the unsharded program."""
    r = np.random.default_rng(0)
    u = r.standard_normal(16)
    v0 = md.named(jnp.asarray(u * np.sqrt(13.5 / (u @ u)), jnp.float32), "b")   # sum(v0 * v0) = 13.5
    v1 = md.param(md.named(jnp.asarray(r.standard_normal((8, 16, 8)), jnp.float32), "c a d"))

    def loss(v0, v1):
        s = md.einsum(v0, v0, out="")
        return (md.sum(md.tanh(s)) * 0.5 + md.sum(md.tanh(v1 + s)) * 0.75).array
    grad = jax.grad(loss, argnums=(0, 1))
    lowered = md.lower(grad, md.Mesh({"x": 8, "y": 1}), md.Layout({"b": ("x", "y")}))(v0, v1)
    compiled = jax.jit(grad)(v0, v1)
    assert np.abs(np.asarray(compiled[0].array)).max() > 1e-6   # saturated, yet not 0 compiled
    assert_same(lowered, compiled, rtol=1e-5, atol=1e-12)


# -- campaign 43 (on f0c4148) ---------------------------------------------------------------------

def _swapped_pad_cases():
    v = md.named(jnp.asarray(np.random.default_rng(0).standard_normal((16, 8, 8)), jnp.float32), "b c d")
    w = md.named(jnp.asarray(np.random.default_rng(1).standard_normal((4, 8, 12)), jnp.float32), "b c d")

    def shifted_then_swapped(v):   # campaign 43's program, its int8 min left out
        s = md.rename(md.shift(v, "b", -3), {"c": "d", "d": "c"})
        return md.local_map(lambda a: jnp.tanh(a) + jnp.cumsum(a, axis=-1) * 0.1, s, out="b d c", keep="d")

    def padded_swapped_sliced(w):
        s = md.rename(md.pad(w, "c", 2, 2), {"c": "d", "d": "c"})
        return md.slice(s, "c", 2, 8)
    return [(shifted_then_swapped, v, {"x": 8}, {"d": "x"}), (padded_swapped_sliced, w, {"x": 2, "y": 4}, {"d": "x"}),
            (padded_swapped_sliced, w, {"x": 2, "y": 4}, {})]


@pytest.mark.parametrize("case", range(3), ids=["shift-rename-local_map", "pad-rename-slice", "pad-rename-slice-whole"])
def test_pieces_of_a_value_renamed_since_are_not_read_under_new_names(case):
    """A zero-filled shift, a pad or a concat remembers its pieces (relayout moves them and not
    the zeros; a slice reads them where they lie). A rename swapping two dims of one size gives
    the same local array other dims, and the pieces were read under the new names: the gathered
    value of shift(v, b, -3) swapped c <-> d held 803 of 1024 wrong entries (campaign 43), and a
    slice along the swapped c of a pad along c came out [b c d] sized as [b d c]. The pieces now
    count only under the dims the value was made with."""
    fn, x, mesh, layout = _swapped_pad_cases()[case]
    assert_same(md.lower(fn, md.Mesh(mesh), md.Layout(layout))(x), fn(x))
