"""Findings of fuzz campaign 16 (issue 9; tests/fuzz_campaign.py) about which contraction an
einsum does first.

An operand's own contracted dims (dims no other operand has) may be summed first, leaving a small
pending sum, and the rest contracted after. Whether that moves fewer bytes depends on the plan of
the second contraction: with the summed dim gone, dims that gave a mesh axis up to it keep their
split there; and under ``jax.grad``, on whether the other operands' gradients read a reduced sum
or a partial one to reduce again."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import meshdsl as md

from helpers import promises_kept as _kept


def test_summing_a_dim_first_frees_the_axes_other_dims_gave_up_to_it():
    """einsum(v1[c:x+y a], reshape(v0[d:x a] -> p2 q4 a), out="p2") on x:4, y:2: c claims all of x,
    so p2 (x:(1)2) and q4 (x:(2)2), not placed by the layout, gave their axes up and v0 was
    gathered (398 B where gspmd moves 240 B). Summing c first leaves [a] pending over x+y; the
    contraction of that sum with v4 keeps p2 and q4 where they are: the [a] sum and two scalars
    move, 106 B."""
    r = np.random.default_rng(0)
    v0 = md.named(jnp.asarray(r.standard_normal((8, 16)), jnp.float32), "d a")
    v1 = md.param(md.named(jnp.asarray(r.standard_normal((8, 16)), jnp.float32), "c a"))
    fn = lambda v0, v1: md.einsum(v1, md.reshape(v0, "p2:2 q4:4 a:16"), out="p2")
    mesh, layout = md.Mesh({"x": 4, "y": 2}), md.Layout({"c": ("x", "y"), "d": "x"})
    _kept(fn, mesh, layout, v0, v1, param_gather="regather", moved={"all-reduce": 102, "all-gather": 4})


def test_summing_first_counts_the_gradient_of_an_operand_reduced_for_the_contraction():
    """v1 = einsum(v0, v0, out="d"); v3 = einsum(v1, v0, out="") with v0[c d:y a:x], both returned,
    under jax.grad: v1's pending sum over x is reduced for the contraction (a is split on x), so
    its gradient - v0 summed over a, partial over x - was all-reduced backward (55 B where gspmd
    moves 52 B). Summing v0 over a first reduces that [d] once, forward, and the backward pass
    reads it: 52 B."""
    v0 = md.param(md.named(jnp.asarray(np.random.default_rng(0).standard_normal((8, 8, 16)), jnp.float32), "c d a"))

    def fn(v0):
        v1 = md.einsum(v0, v0, out="d")
        return v1, md.einsum(v1, v0, out="")

    def grad(v0):
        return jax.grad(lambda v: sum(md.sum(md.tanh(y) * (0.5 + 0.25 * k)) for k, y in enumerate(fn(v))).array)(v0)

    mesh, layout = md.Mesh({"x": 4, "y": 2}), md.Layout({"a": "x", "d": "y"})
    _kept(grad, mesh, layout, v0, param_gather="regather", moved={"all-reduce": 52})


def test_weight_stored_split_is_gathered_under_keep_and_left_split_under_auto():
    """einsum(w[b e], v[e c], out="b c") with w stored e:x (params=), x:8, v whole: "keep" and
    "regather" gather w where the einsum reads it (ZeRO-3 as written: 1792 B), where gspmd slices
    v and all-reduces the [b c] result (896 B). "auto" compares both and leaves w split: 896 B."""
    r = np.random.default_rng(0)
    w = md.param(md.named(jnp.asarray(r.standard_normal((16, 32)), jnp.float32), "b e"))
    v = md.named(jnp.asarray(r.standard_normal((32, 8)), jnp.float32), "e c")
    fn = lambda w, v: md.einsum(w, v, out="b c")
    mesh, layout = md.Mesh({"x": 8}), md.Layout({}, params={"e": "x"})
    for policy in ("keep", "regather"):
        report = md.explain(fn, mesh, layout, w, v, param_gather=policy)
        assert {k: s["bytes"] for k, s in report.summary().items() if s["bytes"]} == {"all-gather": 1792}
    _kept(fn, mesh, layout, w, v, param_gather="auto", moved={"all-reduce": 896})


def test_an_operands_own_dims_split_off_the_plan_are_summed_where_they_are():
    """einsum(v[d:x c e], reshape(v -> p2 q4 c e), out="d") under jax.grad on x:8: d keeps x, so
    p2 (x:(1)2) and q4 (x:(2)4), contracted and held by the reshaped operand alone, gave x up and
    that operand was gathered (7168 B forward, 8960 B in all where gspmd moves 4352 B). Summing
    them first where they are split leaves a pending [c e] to all-reduce: 1792 B each way."""
    v = md.named(jnp.asarray(np.random.default_rng(0).standard_normal((8, 8, 32)), jnp.float32), "d c e")
    loss = lambda v: md.sum(md.tanh(md.einsum(v, md.reshape(v, "p2:2 q4:4 c e"), out="d"))).array
    _kept(jax.grad(loss), md.Mesh({"x": 8}), md.Layout({"d": "x"}), v, moved={"all-reduce": 3584})


# -- campaign 22 (on 820a2f4) ---------------------------------------------------------------------

def test_dim_one_operand_holds_split_off_the_layout_stays_split():
    """w = einsum(u[e a], u, out="a") with u whole and v = rename(x[b:y] -> a), then
    einsum(v, einsum(u, v, out="a"), out=""): a is held split (y) by v alone, the layout places
    it nowhere, so v was gathered for each einsum (48 B where gspmd moves 12 B). Slicing the
    whole operand instead: the kept a stays split (not returned, nothing to gather later), the
    contracted a leaves a scalar to all-reduce."""
    r = np.random.default_rng(0)
    u = md.named(jnp.asarray(r.standard_normal((32, 16)), jnp.float32), "e a")
    x = md.named(jnp.asarray(r.standard_normal(16), jnp.float32), "b")

    def fn(u, x):
        v = md.rename(x, {"b": "a"})
        return md.einsum(v, md.einsum(u, v, out="a"), out="")
    mesh, layout = md.Mesh({"x": 2, "y": 4}), md.Layout({"b": "y"})
    _kept(fn, mesh, layout, u, x, moved={"all-reduce": 6})
    _kept(jax.grad(lambda u, x: fn(u, x).array, argnums=(0, 1)), mesh, layout, u, x)
