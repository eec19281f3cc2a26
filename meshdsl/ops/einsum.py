"""``md.einsum``: contraction by dim name.

``md.einsum(x, w, out="batch d_ff")``: dims of the operands missing from ``out`` are summed over.
Per mesh axis ``a`` of the iteration space (see :mod:`meshdsl.placement`):

* a kept dim split on ``a`` in every operand that has it: local, the result stays split;
* an operand holding that dim whole: it is sliced locally (no communication);
* a contracted dim split on ``a``: local einsum of the blocks, the result is a *pending* partial
  sum over ``a``; the next op that needs whole values reduces it (psum), or a reduce-scatter when
  the value is wanted split over ``a``;
* a contracted and a kept dim both mapped to ``a`` by the layout: the contracted dim keeps the
  split (the result is pending), so the sum is later reduce-scattered onto the kept dim.

An einsum is linear in each operand: when only one operand holds a pending sum over an axis the
contraction does not split, and the result is smaller than that operand, the sum stays pending
through the einsum and is reduced later, on the smaller result (MoE's combine after a split-d_ff
expert FFN). Other pending sums are reduced before the contraction.

An operand's own contracted dims (no other operand has them) may be summed first, locally, and the
rest contracted after: chosen where that moves no more bytes, the gradients included. The second
contraction is planned anew for that estimate: a dim that gave a mesh axis up to a summed dim
keeps its split there (``einsum(v[c a], u[p q a], out="p")`` with ``c`` over all of ``x`` and
``p``, ``q`` over parts of it: ``u`` stays where it is and the small ``[a]`` sum moves, not ``u``).

Parameters stored split (``params=`` rules) are all-gathered for the contraction and their
gradients reduce-scattered, unless the ``param_gather`` policy (:mod:`meshdsl.param_gather`)
decides otherwise: ``"auto"`` may run the contraction where the parameter is stored and relay the
result to the planned placement; ``"regather"`` gathers the parameter again in the backward pass
instead of keeping the gathered value.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from ..dims import Shape, parse_dims
from ..errors import ShapeError, suggest
from ..jaxcompat import differentiated
from ..named import NamedArray, Placement
from ..placement import propose
from ..relayout import relayout_bytes
from .common import as_named, union_dims, where_
from .reductions import sum as reduce_sum
from .registry import op

__all__ = ["einsum"]

_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


@op("einsum")
def einsum(ctx, *operands, out, preferred_element_type=None) -> NamedArray:
    """Contract ``operands`` by name into dims ``out`` (a string of names, Dims or a list)."""
    if not operands:
        raise ShapeError(f"{where_(ctx)}: no operands")
    xs = [as_named(ctx, x, f"operand {i + 1}") for i, x in enumerate(operands)]
    dims = union_dims(ctx, xs)
    out_names = []
    for name, size in parse_dims(out, what=f"{where_(ctx)}: out"):
        if name not in dims:
            raise ShapeError(f"{where_(ctx)}: out names {name!r}, which no operand has; operands have "
                             f"{' '.join(dims.names)}{suggest(name, dims.names)}")
        if size is not None and size != dims[name].size:
            raise ShapeError(f"{where_(ctx)}: out writes {name}:{size} but the operands have "
                             f"{name}:{dims[name].size}")
        if name in out_names:
            raise ShapeError(f"{where_(ctx)}: out names {name!r} twice")
        out_names.append(name)
    out_dims = Shape(dims[n] for n in out_names)
    contracted = tuple(d.name for d in dims if d.name not in out_names)
    xs = [_copy_made_anyway(ctx, x, contracted) for x in xs]

    linear = _linear_pending(ctx, xs, out_dims)

    def kept(plan):
        return linear - {a for ax in plan.values() for a in ax}

    def pending_of(plan):
        return frozenset(a for n in contracted for a in plan[n]) | kept(plan)

    target = ctx.plan(dims, xs, prefer=contracted, keep_pending=linear)
    itemsize = jnp.dtype(preferred_element_type or jnp.result_type(*[x.dtype for x in xs])).itemsize
    solo = _whole_own_dims(ctx, xs, contracted, target) or \
        _sum_first(ctx, xs, contracted, out_names, out_dims, target, itemsize, pending_of(target), linear)
    if solo:  # cheaper: sum those dims locally first (a pending sum), then contract the rest
        return einsum(*[reduce_sum(x, s) if s else x for x, s in zip(xs, solo)], out=out_names,
                      preferred_element_type=preferred_element_type)
    out_axes = [target[n] for n in out_names]
    axes = ctx.params.place(ctx, dims, xs, target, lambda p: relayout_bytes(
        ctx, out_dims, itemsize, [p[n] for n in out_names], pending_of(p), out_axes, pending_of(target)))
    keep = kept(axes)
    vary = ctx.vary(axes.values(), xs, keep, out_size=math.prod(out_dims.sizes))
    letter = {d.name: _LETTERS[i] for i, d in enumerate(dims)}
    spec = ",".join("".join(letter[n] for n in x.names) for x in xs) + "->" + "".join(letter[n] for n in out_names)

    def relay(i, a):
        x = xs[i]
        return ctx.local(NamedArray(a, x.dims, is_param=x.is_param, placement=x.placement), axes, vary,
                         keep_pending=keep)

    def contract(*local):
        return jnp.einsum(spec, *local, preferred_element_type=preferred_element_type)

    result = ctx.params.compute(ctx, relay, contract, [x.raw for x in xs], xs, axes)
    result = checkpoint_name(result, "einsum")  # remat policies keep or recompute einsums by name
    result = ctx.out(result, out_dims, axes, pending_of(axes))
    if axes is target:
        return result
    # Parameters stayed where they are stored: bring the result where the plan puts it, typed
    # as the plan types it (a sum reduced there is replicated, not varying over the stored split).
    vary = ctx.vary(target.values(), xs, kept(target), out_size=math.prod(out_dims.sizes))
    local = ctx.local(result, target, vary, keep_pending=pending_of(target))
    return ctx.out(local, out_dims, target, pending_of(target))


def _copy_made_anyway(ctx, x, contracted):
    """``x``, or its copy in the layout's placement when ``x`` holds a contracted dim split where
    the layout does not split it and that copy is made anyway (a value the program returns,
    gathered at the return): reading it moves nothing more, and contracting the dim whole leaves
    no partial sum to reduce (``einsum(x, h)`` with ``h`` split off the layout and returned:
    gspmd's choice too)."""
    pl = ctx.placement(x) if ctx.explicit else None
    if pl is None or x.is_param:
        return x
    target = ctx.canonical(x.dims)
    off = [n for d, axes, want in zip(x.dims, pl.axes, target) if (n := d.name) in contracted and axes and axes != want]
    if not off or not ctx.relaid(x, target):
        return x
    split = frozenset(a for axes in target for a in axes)
    copy = ctx.local(x, dict(zip(x.names, target)), split)
    return NamedArray(copy, x.dims, placement=Placement(tuple(target)))


def _whole_own_dims(ctx, xs, contracted, target):
    """Per operand, the contracted dims only it has and that are whole (in the plan and on this
    device), or ``None``: summed locally first, they never reach a relayout, a cast or, backward,
    the all-reduce of that operand's gradient (a parameter [a, e] contracted with data over a and
    e: its gradient is reduced as [a], not [a, e]). Local work only: never more bytes."""
    if not ctx.explicit or len(xs) < 2:
        return None
    solo = [[n for n in x.names if n in contracted and not target[n] and not ctx.placement(x).of(x.dims, n)
             and sum(n in y.names for y in xs) == 1] for x in xs]
    return solo if any(solo) else None


def _sum_first(ctx, xs, contracted, out_names, out_dims, target, itemsize, pending, linear):
    """Per operand, the contracted dims only it has, to be summed before the contraction, or
    ``None``: summing an operand's own split contracted dims first leaves a small pending sum
    (reduced before it meets a larger operand) instead of a pending sum of the larger result, or
    of a kept dim gathered because the contracted dim keeps the split. Chosen unless it moves more
    bytes (ring estimates); on a tie it is the better choice for the gradient: the other operands'
    gradients then read the reduced sum, not a partial one to reduce again (``einsum(w[a], x[c],
    out="")`` with ``c`` split: one scalar all-reduce in the forward pass, none backward). Under
    ``jax.grad`` the backward reductions count too: without summing first, each differentiated
    other operand's gradient is reduced again (``einsum(w[a], x[b a], out="")``, b split: the
    forward scalar and w's gradient [a] backward; summed first, x's [a] once, forward)."""
    if not ctx.explicit or len(xs) < 2:
        return None
    solo = [[n for n in x.names if n in contracted and target[n] and sum(n in y.names for y in xs) == 1]
            for x in xs]
    if not any(solo):
        return None
    canon = {d.name: ctx.layout_axes(d.name) for x in xs for d in x.dims}

    def moved(x, dims, src, pend, to):
        return relayout_bytes(ctx, dims, x.dtype.itemsize, src, pend, tuple(to.get(d.name, ()) for d in dims))

    now = sum(moved(x, x.dims, ctx.placement(x).axes, ctx.pending(x), target) for x in xs)
    now += relayout_bytes(ctx, out_dims, itemsize, [target[n] for n in out_names], pending,
                          [canon.get(n, ()) for n in out_names])
    rests = [(x, s, [d for d in x.dims if d.name not in s],
               [a for d, a in zip(x.dims, ctx.placement(x).axes) if d.name not in s]) for x, s in zip(xs, solo)]
    # The contraction of the sums is planned anew: dims that gave an axis up to a summed dim (rule
    # 4) keep their split there, and those operands move to that plan, not the layout's.
    rest = Shape(d for d in union_dims(ctx, xs) if not any(d.name in s for s in solo))
    after = propose(ctx, rest, [([d.name for d in dims], src) for _, _, dims, src in rests],
                    prefer=[n for n in contracted if n in rest.names])
    left = frozenset(a for n in contracted if n in after for a in after[n])
    first = relayout_bytes(ctx, out_dims, itemsize, [after[n] for n in out_names], left,
                           [canon.get(n, ()) for n in out_names])
    for x, s, dims, src in rests:
        pend = ctx.pending(x) | {a for d, a in zip(x.dims, ctx.placement(x).axes) if d.name in s for a in a}
        first += moved(x, dims, src, pend, canon if s else after)
        # Backward, without summing first, the gradient of each other operand being
        # differentiated holds x's sum over those dims as a partial sum: one more reduction.
        summed = frozenset(a for n in s for a in target[n])
        for y in xs:
            if y is not x and differentiated(y.raw) and summed - _used_after(ctx, y, target, linear):
                axes = ctx.placement(y).axes
                now += relayout_bytes(ctx, y.dims, y.dtype.itemsize, axes, summed, axes)
    return solo if first <= now else None


def _used_after(ctx, y, target, linear) -> frozenset:
    """The axes ``y`` is split or pending over once relaid to ``target`` for the contraction: a
    pending sum is reduced there first unless it stays pending (``linear``, over no axis the
    contraction splits)."""
    split = frozenset(a for axes in target.values() for a in axes)
    return frozenset(a for n in y.names for a in target[n]) | (ctx.pending(y) & (linear - split))


def _linear_pending(ctx, xs, out_dims) -> frozenset:
    """Pending axes that may stay pending: held by exactly one operand, larger than the result plus,
    under ``jax.grad``, the other operands being differentiated (their gradients read the partial
    sums and are reduced again backward). Otherwise reducing first moves no more, and the other
    operands' gradients read the reduced value."""
    pend = [ctx.pending(x) for x in xs]
    keep = set()
    for a in set().union(*pend):
        holders = [x for x, p in zip(xs, pend) if a in p]
        if len(holders) != 1:
            continue
        # Kept, the sum is reduced on the result, and backward on the gradient of each other
        # operand being differentiated (it reads the partial sums); reduced now, on the operand.
        backward = sum(y.size for y in xs if y is not holders[0] and differentiated(y.raw)
                       and a not in ctx.placement(y).used_axes())
        if math.prod(d.size for d in out_dims) + backward < holders[0].size:
            keep.add(a)
    return frozenset(keep)
