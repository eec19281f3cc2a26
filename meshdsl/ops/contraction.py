"""Which contraction an einsum runs: where it computes, which dims it sums first, which pending
sums it carries through. Each choice compares bytes (the ring estimates of
:func:`meshdsl.rewrite.relayout.relayout_bytes`), the gradients included where they differ.

Where: the plan (:mod:`meshdsl.rewrite.placement`) gives a dim the operands disagree on the layout's
placement. A dim one operand holds split where the layout does not split it may instead stay
split there, the operands holding it whole sliced locally: a contracted dim leaves a (small)
pending result, a kept dim a result split off the layout, charged for its move to the layout's
placement only where it is sure to move (returned: the previous trace tells).

An einsum is linear in each operand: when only one operand holds a pending sum over an axis the
contraction does not split, and the result is smaller than that operand, the sum stays pending
through the einsum and is reduced later, on the smaller result (MoE's combine after a split-d_ff
expert FFN). Other pending sums are reduced before the contraction.

An operand's own contracted dims (no other operand has them) may be summed first, locally, and the
rest contracted after: chosen where that moves no more bytes, the gradients included. The second
contraction is planned anew for that estimate: a dim that gave a mesh axis up to a summed dim
keeps its split there (``einsum(v[c a], u[p q a], out="p")`` with ``c`` over all of ``x`` and
``p``, ``q`` over parts of it: ``u`` stays where it is and the small ``[a]`` sum moves, not ``u``).
Own dims the plan gathers because they gave their axis up to a kept dim are candidates too, summed
where they are split (``einsum(v[d:x c], u[p q c], out="d")`` with ``p``, ``q`` over parts of
``x``: the ``[c]`` sum is all-reduced, ``u`` is not gathered).
"""

from __future__ import annotations

import math

from ..names.dims import Shape
from ..platform.jaxcompat import differentiated
from ..rewrite.placement import propose, settle
from ..rewrite.relayout import relayout_bytes
from .common import decided, union_dims

__all__ = ["choose", "linear_pending"]


def choose(ctx, dims, xs, contracted, out_names, out_dims, itemsize, linear, pending_of):
    """``(plan, solo)``: axes per dim of the iteration space ``dims``, and per operand the dims to
    sum before contracting (or ``None``). ``pending_of(plan)``: the axes the result is pending over."""
    target = ctx.plan(dims, xs, prefer=contracted, keep_pending=linear)
    target = _where_held(ctx, dims, xs, contracted, out_names, out_dims, target, itemsize, pending_of)
    solo = _whole_own_dims(ctx, xs, contracted, target) or \
        _sum_first(ctx, xs, contracted, out_names, out_dims, target, itemsize, pending_of(target), linear)
    return target, solo


def _where_held(ctx, dims, xs, contracted, out_names, out_dims, target, itemsize, pending_of):
    """``target``, or a plan that keeps a dim split where an operand holds it (off the layout's
    placement) when that moves fewer bytes: the operands holding it whole are sliced locally. A
    contracted dim leaves the (small) result pending (``einsum(v[a:y], w[a], out="")``: a scalar
    all-reduce, not a gather of ``v``); a kept dim leaves the result split there, charged for its
    move to the layout's placement only where it is sure to move (returned: the previous trace
    tells, as for a reshape). Rule 2 of :mod:`meshdsl.rewrite.placement` for einsums, by bytes, as
    the rule's own choice: each plan is a candidate the planner weighs by time; a parameter stored
    split is left to the ``param_gather`` policy."""
    if not ctx.explicit or len(xs) < 2:
        return target
    canonical = {d.name: ctx.layout_axes(d.name) for d in dims}
    options = [target]
    for n in dims.names:
        held = {ctx.placement(x).of(x.dims, n) for x in xs if n in x.names and not x.is_param}
        # and the layout's placement of a kept dim the plan leaves where an operand holds it
        # (einsum(w[c e:x], v[a], out="e a") returned: gather the [e] sum, not the [e a] result)
        wanted_too = {canonical[n]} if n in out_names and target[n] != canonical[n] else set()
        for axes in sorted((held | wanted_too) - {target[n]} - ({()} - wanted_too)):
            alt = settle({**target, n: axes}, canonical, list(dims.names), contracted)
            if alt not in options:
                options.append(alt)
    if len(options) == 1:
        return target
    wanted = ctx.canonical(out_dims)   # a result the layout cannot place is the user's error, first

    def cost(plan, certain):
        placed = [plan[n] for n in out_names]
        later = list(wanted) if certain else [w or p for w, p in zip(wanted, placed)]
        if len({a for axes in later for a in axes}) != sum(len(axes) for axes in later):
            later = list(wanted)
        return _contract_bytes(ctx, xs, out_names, out_dims, plan, itemsize, pending_of(plan), later)
    hopeful = min(options, key=lambda o: cost(o, False))
    sure = min(options, key=lambda o: cost(o, True))
    own = hopeful if hopeful is sure or not ctx.result_relaid(xs, wanted) else sure
    return decided(ctx, [own] + [o for o in options if o is not own])   # every plan a candidate


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

    def own(n, x, held: bool):
        split = target[n] or held and ctx.placement(x).of(x.dims, n)
        return bool(split) and n in contracted and sum(n in y.names for y in xs) == 1
    # The own dims the plan splits; or also those the operand holds split where the plan gathers
    # them (they gave their axis up to a kept dim: summed where they are, no gather): the cheaper.
    options = []
    for held in (False, True):
        solo = [[n for n in x.names if own(n, x, held)] for x in xs]
        if any(solo) and solo not in options:
            options.append(solo)
    if not options:
        return None
    ctx.canonical(out_dims)   # a result the layout cannot place is the user's error (LayoutError), first
    now = _contract_bytes(ctx, xs, out_names, out_dims, target, itemsize, pending)
    best, least = None, math.inf
    for solo in options:
        first, backward = _sum_first_bytes(ctx, xs, solo, contracted, out_dims, out_names, target, itemsize, linear)
        if first <= now + backward and first < least:
            best, least = solo, first
    return decided(ctx, [best] + [o for o in (None, *options) if o is not best])   # or not, or the other way


def _contract_bytes(ctx, xs, out_names, out_dims, target, itemsize, pending, later=None):
    """Bytes of contracting ``xs`` at ``target`` as they are: moving them there, and the result
    (pending over ``pending``) to ``later``, the axes per result dim it moves to after (by default
    the layout's placement)."""
    if later is None:
        canon = {d.name: ctx.layout_axes(d.name) for x in xs for d in x.dims}
        later = [canon.get(n, ()) for n in out_names]
    now = sum(_moved(ctx, x, x.dims, ctx.placement(x).axes, ctx.pending(x), target) for x in xs)
    return now + relayout_bytes(ctx, out_dims, itemsize, [target[n] for n in out_names], pending, later)


def _moved(ctx, x, dims, src, pend, to):
    return relayout_bytes(ctx, dims, x.dtype.itemsize, src, pend, tuple(to.get(d.name, ()) for d in dims))


def _sum_first_bytes(ctx, xs, solo, contracted, out_dims, out_names, target, itemsize, linear):
    """``(bytes, backward)``: the bytes of summing ``solo`` first, then contracting the rest; and
    the backward reductions that contracting at ``target`` directly would add (charged to that)."""
    canon = {d.name: ctx.layout_axes(d.name) for x in xs for d in x.dims}
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
    backward = 0.0
    for x, s, dims, src in rests:
        pend = ctx.pending(x) | {a for d, a in zip(x.dims, ctx.placement(x).axes) if d.name in s for a in a}
        first += _moved(ctx, x, dims, src, pend, canon if s else after)
        # Backward, without summing first, the gradient of each other operand being
        # differentiated holds x's sum over those dims as a partial sum: one more reduction.
        summed = frozenset(a for n in s for a in target[n])
        for y in xs:
            if y is not x and differentiated(y.raw) and summed - _used_after(ctx, y, target, linear):
                axes = ctx.placement(y).axes
                backward += relayout_bytes(ctx, y.dims, y.dtype.itemsize, axes, summed, axes)
    return first, backward


def _used_after(ctx, y, target, linear) -> frozenset:
    """The axes ``y`` is split or pending over once relaid to ``target`` for the contraction: a
    pending sum is reduced there first unless it stays pending (``linear``, over no axis the
    contraction splits)."""
    split = frozenset(a for axes in target.values() for a in axes)
    return frozenset(a for n in y.names for a in target[n]) | (ctx.pending(y) & (linear - split))


def linear_pending(ctx, xs, out_dims) -> frozenset:
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
