"""Elementwise ops, broadcasting by name.

The result has the union of the operands' dims (first appearance order). It is computed where the
operands already are (see :mod:`meshdsl.rewrite.placement`): ``x * scale`` of a split ``x`` is local.

Pending partial sums stay pending through linear ops, so they are reduced once, late:

* ``a + b`` / ``a - b`` of two partial sums over the same axes is a partial sum (one psum for
  the two einsums that produced them, not two); of a partial sum and a whole value, the planner
  may have the whole value join the sum from one device of its group (a candidate: a loss summed
  from a split and a replicated term then moves nothing forward);
* ``a * c``, ``c * a`` and ``a / c`` with only ``a`` pending scale each partial sum;
* ``-a``, ``astype`` between float types and ``stop_gradient`` keep it;
* but not through a broadcast: pending operands smaller than the result (a scalar times a
  vector) are reduced first, at their own size.

Every other elementwise op needs whole values: pending sums are reduced first (psum, or a
reduce-scatter when the result is split over the same axis).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from ..costmodel.cost import array_bytes, moved_bytes
from ..platform.jaxcompat import differentiated, varying_axes
from ..rewrite import collectives as C
from .common import align, as_named, union_dims
from .creation import full
from ..names.named import NamedArray
from .registry import op

__all__ = [
    "add", "subtract", "multiply", "divide", "power", "negative", "maximum", "minimum",
    "exp", "log", "log1p", "expm1", "sqrt", "rsqrt", "square", "abs", "sign", "tanh", "sigmoid",
    "relu", "gelu", "silu", "softplus", "erf", "sin", "cos", "floor", "round", "isfinite",
    "less", "less_equal", "greater", "greater_equal", "equal", "not_equal",
    "logical_and", "logical_or", "logical_not", "where", "astype", "stop_gradient", "clip",
]


@functools.lru_cache(maxsize=None)
def _result_dtype(fn, dtypes: tuple):
    """The dtype ``fn`` gives operands of ``dtypes`` (its placement compares bytes), traced once
    per op and dtypes: ``fn`` is a module-level function (a closure passes ``out_dtype`` instead)."""
    return jax.eval_shape(fn, *(jax.ShapeDtypeStruct((), d) for d in dtypes)).dtype


def _apply(ctx, fn, args, pending_rule: str = "resolve", out_dtype=None):
    xs = [as_named(ctx, a, f"operand {i + 1}") for i, a in enumerate(args)]
    dims = union_dims(ctx, xs)
    pend = [ctx.pending(x) for x in xs]
    keep, join = frozenset(), False
    if pending_rule == "additive" and pend[0] and all(p == pend[0] for p in pend):
        keep = pend[0]
    elif pending_rule == "additive" and len({p for p in pend if p}) == 1 and ctx.rec.multiplier == 1 and ctx.option(2):
        # candidate 1: the others join the pending sum from one device of its group (no reduction;
        # where the sum is only read by the backward pass - a loss - nothing moves at all). Not
        # in a loop body: a carry left pending there settles the loop's types, priced apart
        keep, join = next(p for p in pend if p), True
    elif pending_rule in ("scale", "product"):
        holders = [i for i, p in enumerate(pend) if p]
        if len(holders) == 1 and (pending_rule == "product" or holders == [0]):
            keep = pend[holders[0]]
    if keep and not join and sum(x.size for x, p in zip(xs, pend) if p) < math.prod(dims.sizes):
        keep = frozenset()   # a broadcast: reducing the smaller operands' sums moves fewer bytes
    out_dtype = out_dtype or _result_dtype(fn, tuple(x.dtype for x in xs))
    axes = ctx.plan(dims, xs, keep_pending=keep, cheapest=True, out_dtype=out_dtype)
    keep = keep - {a for ax in axes.values() for a in ax}
    vary = ctx.vary(axes.values(), xs, keep, out_size=math.prod(dims.sizes))
    local = [align(ctx.local(x, axes, vary, keep_pending=keep), x.dims, dims) for x in xs]
    if join and keep:
        for x, p, arr in zip(xs, pend, local):   # read as typed varying: a plan leaving it otherwise casts it
            if not p and ctx.planner is not None and keep <= varying_axes(x.raw) and differentiated(x.raw):
                nbytes = array_bytes(arr.shape, arr.dtype, ctx.mesh.platform)
                ctx.planner.varies(ctx, x, keep, moved_bytes("all-reduce", nbytes, nbytes, ctx.axes_size(tuple(keep)))
                                   * ctx.rec.multiplier)
        first = C.axis_index(tuple(a for a in ctx.mesh.factor_axes if a in keep)) == 0
        local = [arr if pend[i] else jnp.where(first, arr, jnp.zeros((), arr.dtype)) for i, arr in enumerate(local)]
    return ctx.out(fn(*local), dims, axes, keep)


def _unary(name, fn, pending_rule="resolve"):
    @op(name)
    def rule(ctx, x) -> NamedArray:
        return _apply(ctx, fn, (x,), pending_rule)

    rule.__doc__ = f"Elementwise ``{name}``."
    return rule


def _binary(name, fn, pending_rule="resolve"):
    @op(name)
    def rule(ctx, x, y) -> NamedArray:
        return _apply(ctx, fn, (x, y), pending_rule)

    rule.__doc__ = f"Elementwise ``{name}``, broadcasting by dim name."
    return rule


add = _binary("add", jnp.add, "additive")
subtract = _binary("subtract", jnp.subtract, "additive")
multiply = _binary("multiply", jnp.multiply, "product")
divide = _binary("divide", jnp.divide, "scale")
power = _binary("power", jnp.power)
maximum = _binary("maximum", jnp.maximum)
minimum = _binary("minimum", jnp.minimum)
less = _binary("less", jnp.less)
less_equal = _binary("less_equal", jnp.less_equal)
greater = _binary("greater", jnp.greater)
greater_equal = _binary("greater_equal", jnp.greater_equal)
equal = _binary("equal", jnp.equal)
not_equal = _binary("not_equal", jnp.not_equal)
logical_and = _binary("logical_and", jnp.logical_and)
logical_or = _binary("logical_or", jnp.logical_or)

negative = _unary("negative", jnp.negative, "scale")
stop_gradient = _unary("stop_gradient", jax.lax.stop_gradient, "scale")
exp = _unary("exp", jnp.exp)
log = _unary("log", jnp.log)
log1p = _unary("log1p", jnp.log1p)
expm1 = _unary("expm1", jnp.expm1)
sqrt = _unary("sqrt", jnp.sqrt)
rsqrt = _unary("rsqrt", jax.lax.rsqrt)
square = _unary("square", jnp.square)
abs = _unary("abs", jnp.abs)  # noqa: A001 - the op's name
sign = _unary("sign", jnp.sign)
tanh = _unary("tanh", jnp.tanh)
sigmoid = _unary("sigmoid", jax.nn.sigmoid)
relu = _unary("relu", jax.nn.relu)
silu = _unary("silu", jax.nn.silu)
softplus = _unary("softplus", jax.nn.softplus)
erf = _unary("erf", jax.scipy.special.erf)
sin = _unary("sin", jnp.sin)
cos = _unary("cos", jnp.cos)
floor = _unary("floor", jnp.floor)
round = _unary("round", jnp.round)  # noqa: A001 - the op's name
isfinite = _unary("isfinite", jnp.isfinite)
logical_not = _unary("logical_not", jnp.logical_not)


@op("gelu")
def gelu(ctx, x, approximate: bool = True) -> NamedArray:
    """GELU; ``approximate=True`` is the tanh form (T5's ``gelu_new``)."""
    x = as_named(ctx, x)
    return _apply(ctx, lambda v: jax.nn.gelu(v, approximate=approximate), (x,),
                  out_dtype=_result_dtype(jax.nn.gelu, (x.dtype,)))


@op("where")
def where(ctx, cond, x, y) -> NamedArray:
    """``x`` where ``cond`` else ``y``, broadcasting by name. ``where(c, x, x)`` is ``x`` broadcast
    over ``c``'s dims: the condition's values are not read, so they never move (XLA's simplifier
    drops them too)."""
    if x is y and isinstance(cond, NamedArray):
        cond = full(cond.dims, True, jnp.bool_)
    return _apply(ctx, jnp.where, (cond, x, y))


@op("clip")
def clip(ctx, x, lo=None, hi=None) -> NamedArray:
    x = as_named(ctx, x)
    fn = lambda v: jnp.clip(v, lo, hi)  # noqa: E731
    return _apply(ctx, fn, (x,), out_dtype=jax.eval_shape(fn, jax.ShapeDtypeStruct((), x.dtype)).dtype)


@op("astype")
def astype(ctx, x, dtype) -> NamedArray:
    """Cast to ``dtype``; a pending sum stays pending between floating types."""
    x = as_named(ctx, x)
    linear = jnp.issubdtype(x.dtype, jnp.floating) and jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
    return _apply(ctx, lambda v: v.astype(dtype), (x,), "scale" if linear else "resolve",
                  out_dtype=jax.eval_shape(lambda v: v.astype(dtype), jax.ShapeDtypeStruct((), x.dtype)).dtype)
