"""``md.einsum``: contraction by dim name.

``md.einsum(x, w, out="batch d_ff")``: dims of the operands missing from ``out`` are summed over.
Per mesh axis ``a`` of the iteration space (see :mod:`meshdsl.rewrite.placement`):

* a kept dim split on ``a`` in every operand that has it: local, the result stays split;
* an operand holding that dim whole: it is sliced locally (no communication);
* a contracted dim split on ``a``: local einsum of the blocks, the result is a *pending* partial
  sum over ``a``; the next op that needs whole values reduces it (psum), or a reduce-scatter when
  the value is wanted split over ``a``;
* a contracted and a kept dim both mapped to ``a`` by the layout: the contracted dim keeps the
  split (the result is pending), so the sum is later reduce-scattered onto the kept dim.


Where it computes and which dims it sums first is chosen by bytes: :mod:`meshdsl.ops.contraction`.

Parameters stored split (``params=`` rules) are all-gathered for the contraction and their
gradients reduce-scattered, unless the ``param_gather`` policy (:mod:`meshdsl.rewrite.param_gather`)
decides otherwise: ``"auto"`` may run the contraction where the parameter is stored and relay the
result to the planned placement; ``"regather"`` gathers the parameter again in the backward pass
instead of keeping the gathered value.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from ..names.dims import Shape, parse_dims
from ..names.errors import ShapeError, suggest
from ..names.named import NamedArray, Placement
from ..rewrite.relayout import relayout_bytes
from .common import as_named, union_dims, where_
from .contraction import choose, linear_pending
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
    if len(xs) >= 3 and (pick := ctx.option(1 + len(_pairs(len(xs))))):
        return _pair_first(ctx, xs, _pairs(len(xs))[pick - 1], out_names, preferred_element_type)
    xs = [_copy_made_anyway(ctx, x, contracted) for x in xs]

    linear = linear_pending(ctx, xs, out_dims)

    def kept(plan):
        return linear - {a for ax in plan.values() for a in ax}

    def pending_of(plan):
        return frozenset(a for n in contracted for a in plan[n]) | kept(plan)

    itemsize = jnp.dtype(preferred_element_type or jnp.result_type(*[x.dtype for x in xs])).itemsize
    target, solo = choose(ctx, dims, xs, contracted, out_names, out_dims, itemsize, linear, pending_of)
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
        return _computed(ctx, xs, local, jnp.einsum(spec, *local, preferred_element_type=preferred_element_type))

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


def _computed(ctx, xs, local, out):
    """``out``, the local contraction of blocks ``local``, its work recorded
    (:meth:`meshdsl.rewrite.recorder.Recorder.computed`): 2 FLOPs a point of its local iteration
    space, its blocks read and its result written once; backward, twice both (the gradient of each
    operand is a contraction as large)."""
    size = {n: s for x, a in zip(xs, local) for n, s in zip(x.names, a.shape)}
    flops = 2.0 * math.prod(size.values())
    moved = float(sum(a.size * a.dtype.itemsize for a in (*local, out)))
    ctx.rec.computed(flops, moved, 2 * flops, 2 * moved)
    return out


def _pairs(n: int) -> list:
    return [(i, j) for i in range(n) for j in range(i + 1, n)]


def _options(*operands, out, preferred_element_type=None) -> list:
    """The candidates of einsum's one decision point (:mod:`meshdsl.planner`): with three or more
    operands, all at once, or any pair first, its sum reduced, then the rest."""
    return [1 + len(_pairs(len(operands)))] if len(operands) >= 3 else []


def _pair_first(ctx, xs, pair, out_names, preferred_element_type):
    """Contract ``xs[i]`` and ``xs[j]`` first over the dims no other operand nor ``out`` has,
    reduce that partial sum where it is (one all-reduce of the smaller value, which the backward
    pass then reads whole), then contract the rest: gspmd's order for ``einsum(x, w, v)`` whose
    pair ``x, w`` shares a split dim."""
    i, j = pair
    rest = [x for k, x in enumerate(xs) if k not in pair]
    needed = set(out_names).union(*(x.names for x in rest))
    inner = [d.name for d in union_dims(ctx, [xs[i], xs[j]]) if d.name in needed]
    part = einsum(xs[i], xs[j], out=inner, preferred_element_type=preferred_element_type)
    pl = ctx.placement(part)
    if pl.pending:
        part = NamedArray(ctx.local(part, dict(zip(part.names, pl.axes))), part.dims, placement=Placement(pl.axes))
    return einsum(part, *rest, out=out_names, preferred_element_type=preferred_element_type)


einsum.rule.options = _options


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
