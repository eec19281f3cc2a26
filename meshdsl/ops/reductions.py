"""Reductions over named dims: sum, mean, max, min, softmax, logsumexp.

Over a dim split on mesh axis ``a``:

* ``sum`` / ``mean``: local sum, the result is a pending partial sum over ``a`` (reduced once,
  by whichever op first needs whole values);
* ``max`` / ``min``: local reduction, then an all-reduce (max/min) of the small result;
* ``softmax`` / ``logsumexp``: local part plus ``pmax`` of the row maxima and ``psum`` of the row
  sums: small statistics, never a gather of the dim.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from ..rewrite import collectives as C
from ..names.dims import Shape
from ..names.errors import ShapeError
from .common import as_named, names_in, where_
from .elementwise import divide
from ..names.named import NamedArray
from .registry import op

__all__ = ["sum", "mean", "max", "min", "softmax", "logsumexp"]


def _reduce_setup(ctx, x, dims, what, linear=False):
    x = as_named(ctx, x)
    names = x.names if dims is None else names_in(ctx, x, dims, what)
    axes = ctx.plan(x.dims, [x], keep_pending=ctx.pending(x) if linear else frozenset())
    return x, names, axes


@op("sum")
def sum(ctx, x, dims=None) -> NamedArray:  # noqa: A001 - the op's name
    """Sum over ``dims`` (all when None). Split dims leave a pending partial sum."""
    x, names, axes = _reduce_setup(ctx, x, dims, "dims to sum", linear=True)
    planned = {a for ax in axes.values() for a in ax}
    keep = ctx.pending(x) - planned
    vary = ctx.vary(axes.values(), [x], keep, out_size=math.prod(d.size for d in x.dims if d.name not in names))
    local = ctx.local(x, axes, vary, keep_pending=keep)
    # Over no dims a float sum is the value itself (no op: two such sums of one value are one value)
    y = local if not names and jnp.issubdtype(local.dtype, jnp.inexact) else \
        jnp.sum(local, axis=tuple(x.names.index(n) for n in names))
    out_dims = Shape(d for d in x.dims if d.name not in names)
    reduced = frozenset(a for n in names for a in axes[n])
    return ctx.out(y, out_dims, axes, keep | reduced)


def mean(x, dims=None) -> NamedArray:
    """Mean over ``dims`` (all when None): a sum, then a scale (a pending sum stays pending)."""
    total = sum(x, dims)
    if total.size == x.size and jnp.issubdtype(total.dtype, jnp.inexact):
        return total   # over no dims: the value itself
    return divide(total, x.size // total.size if total.size else 1)


def _extreme(ctx, x, dims, what, is_max: bool):
    x, names, axes = _reduce_setup(ctx, x, dims, what)
    vary = ctx.vary(axes.values(), [x], out_size=math.prod(d.size for d in x.dims if d.name not in names))
    local = ctx.local(x, axes, vary)
    pos = tuple(x.names.index(n) for n in names)
    split = tuple(a for n in names for a in axes[n])
    reducer = jnp.max if is_max else jnp.min
    out_dims = Shape(d for d in x.dims if d.name not in names)
    if not split:
        floating = jnp.issubdtype(local.dtype, jnp.floating)
        return ctx.out(_local_extreme(reducer, local, pos) if floating else reducer(local, axis=pos), out_dims, axes)
    split = tuple(a for a in ctx.mesh.factor_axes if a in split)

    def combine(v):
        m = reducer(v, axis=pos)
        if m.dtype == jnp.bool_:  # any / all: the collective runs on 0/1
            m = m.astype(jnp.uint8)
            return (C.pmax if is_max else C.pmin)(ctx, m, split).astype(jnp.bool_)
        # pmin, not -pmax(-m): negation is wrong for unsigned ints and the int minimum
        return (C.pmax if is_max else C.pmin)(ctx, m, split)

    def forward(v):
        v = jax.lax.optimization_barrier(v)   # the mask reads the buffer the extreme came from
        m = combine(v)
        return m, (v, m)

    def backward(res, ct):
        v, m = res
        ct, m = C.cast(ctx, ct, split), C.cast(ctx, m, split)
        mask = v == jnp.expand_dims(m, pos)
        count = C.psum(ctx, jnp.sum(mask, axis=pos).astype(v.dtype), split, f"[{x.dims}] tie count")
        count = C.cast(ctx, count, split)  # ties share the gradient, as jnp.max's do
        return (jnp.where(mask, jnp.expand_dims(ct / count, pos), 0).astype(v.dtype),)

    if not jnp.issubdtype(local.dtype, jnp.floating):
        return ctx.out(combine(local), out_dims, axes)
    return ctx.out(C.attributed_vjp(ctx, forward, backward, primal=combine)(local), out_dims, axes)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 2))
def _local_extreme(reducer, v, pos):
    return reducer(v, axis=pos)


@_local_extreme.defjvp
def _local_extreme_jvp(reducer, pos, primals, tangents):
    """jnp.max's derivative (ties share it), with the mask and the extreme read from one buffer.
    Without the barrier XLA may compute ``v`` again for each reader, rounded differently (the CPU
    backend at -O0 does: no element then equals the maximum, the tie count is 0 and the gradient
    inf; jax-ml/jax#40564 is the same class on GPU, in jnp.maximum's rule). A JVP, so forward-mode
    autodiff (jax.jvp, jax.hessian) still works where the dim is whole."""
    (v,), (t,) = primals, tangents
    v = jax.lax.optimization_barrier(v)
    m = reducer(v, axis=pos)
    mask = v == jnp.expand_dims(m, pos)
    count = jnp.sum(mask, axis=pos).astype(v.dtype)
    return m, jnp.sum(jnp.where(mask, t, jnp.zeros((), t.dtype)), axis=pos) / count


@op("max")
def max(ctx, x, dims=None) -> NamedArray:  # noqa: A001 - the op's name
    """Maximum over ``dims``; over a split dim, local max then an all-reduce (max) of the result."""
    return _extreme(ctx, x, dims, "dims of max", True)


@op("min")
def min(ctx, x, dims=None) -> NamedArray:  # noqa: A001 - the op's name
    """Minimum over ``dims``; over a split dim, local min then an all-reduce (min) of the result."""
    return _extreme(ctx, x, dims, "dims of min", False)


def _one_dim(ctx, x, dim, what) -> str:
    names = names_in(ctx, x, dim, what)
    if len(names) != 1:
        raise ShapeError(f"{where_(ctx)}: {what} must be one dim, got {names}")
    return names[0]


def _stats(ctx, x, dim, what):
    """Local block, the row max over ``dim`` (no gradient; typed invariant) and the split axes."""
    x = as_named(ctx, x)
    name = _one_dim(ctx, x, dim, what)
    axes = ctx.plan(x.dims, [x])
    vary = ctx.vary(axes.values(), [x], out_size=x.size)  # no larger than x: a parameter stays invariant
    local = ctx.local(x, axes, vary)
    pos = x.names.index(name)
    split = axes[name]
    m = jax.lax.stop_gradient(jnp.max(local, axis=pos, keepdims=True))
    if split:
        m = C.pmax(ctx, m, split, f"[{x.dims}] max over {name}")
    return x, name, axes, local, pos, split, m


def _row_sum(ctx, e, pos, split, text):
    """Row sums over the (possibly split) dim at ``pos``: a psum of the local sums."""
    s = jnp.sum(e, axis=pos, keepdims=True)
    return C.psum(ctx, s, split, text) if split else s


@op("softmax")
def softmax(ctx, x, dim) -> NamedArray:
    """``exp(x) / sum(exp(x))`` over ``dim``; a split dim costs two all-reduces of row statistics."""
    x, name, axes, local, pos, split, m = _stats(ctx, x, dim, "softmax dim")
    e = jnp.exp(local - C.cast(ctx, m, split, grad=False))
    s = _row_sum(ctx, e, pos, split, f"[{x.dims}] row sums over {name}")
    return ctx.out(e / C.cast(ctx, s, split), x.dims, axes)


@op("logsumexp")
def logsumexp(ctx, x, dim) -> NamedArray:
    """``log(sum(exp(x)))`` over ``dim``, without gathering a split dim."""
    x, name, axes, local, pos, split, m = _stats(ctx, x, dim, "logsumexp dim")
    s = _row_sum(ctx, jnp.exp(local - C.cast(ctx, m, split, grad=False)), pos, split, f"[{x.dims}] row sums over {name}")
    y = jnp.squeeze(jnp.log(s) + m, axis=pos)
    return ctx.out(y, Shape(d for d in x.dims if d.name != name), axes)
