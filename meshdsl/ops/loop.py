"""The loop under ``md.scan``: ``lax.scan`` of a step over NamedArrays, inside a lowering.

* The carry enters in its layout placement and leaves each step in the same placement and type
  (if the step makes it vary over more mesh axes, the loop is traced again, wider). Where the step
  leaves a carry split otherwise and bringing it back would move data every step, the loop is
  traced again with the carry entering split as the step leaves it: moved once, not per step.
  A trace following a plan enters the carry where the plan's strategy for the loop says
  (:mod:`meshdsl.planner.carries`) and relays it back there at the end of each step, as priced.
* The stacked ``xs`` are cast, once and before the loop, to vary over the axes the carry varies
  over (casting per step inside the loop would make jax keep every layer's weights as residuals).
* Collectives traced in the body are recorded with the trip count as their count. A stacked xs
  entry with a pending sum enters the loop pending; where the steps reduce its slices and other
  readers reduce it again, the planner prices the loop with it reduced before (once, where made).
* Values the step captures from outside are relaid and cast outside the loop, once.
* Stacked xs kept in host memory (offloaded parameters) make the loop :mod:`meshdsl.ops.streamed`'s:
  each step's slice fetched during the step before.

:mod:`meshdsl.ops.scan` (a plain scan) and :mod:`meshdsl.ops.pipeline` (a scan over a split dim)
run their steps through :func:`run`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ..rewrite import collectives as C
from ..platform import jaxcompat
from ..names.dims import Dim, Shape
from ..names.errors import ShapeError
from ..platform.jaxcompat import host_resident, to_memory, varying_axes
from ..names.named import NamedArray, Placement, is_named as _is_named
from ..rewrite.relayout import relayout_bytes
from . import streamed
from .restructure import transpose

__all__ = ["run", "Widen", "order"]


class _Planned(NamedTuple):
    """How the planner sees one run of a loop: ``loop``, its op number; ``fixed``, its carry may
    not enter elsewhere than it is told (a trace following a plan, a pinned candidate); ``emit``,
    the trace follows a plan (it records nothing)."""

    loop: int | None
    fixed: bool
    emit: bool


class Replace(Exception):
    """The step left a carry placed otherwise than it entered, and moving it back costs bytes."""

    def __init__(self, index, axes):
        super().__init__(index, axes)
        self.index, self.axes = index, axes


class Widen(Exception):
    """The step made a carry vary over more mesh axes than it entered with: retry wider."""

    def __init__(self, index, axes):
        super().__init__(index, axes)
        self.index, self.axes = index, axes


def order(ctx, axes):
    """``axes`` in mesh order."""
    return tuple(a for a in ctx.mesh.factor_axes if a in axes)


def run(ctx, step, dim, length, x_leaves, x_tree, c_leaves, c_tree, reverse, unroll, where):
    """``(carry, ys)`` of scanning ``step`` over ``length`` entries of ``dim`` of ``x_leaves``."""
    widen: dict[int, frozenset] = {}
    planner = ctx.planner if ctx.explicit else None
    loop = planner.current if planner is not None else None   # the op number the planner knows it by
    # carry index -> axes per dim it enters with (else the layout's); a trace following a plan
    # enters as the plan says, and a candidate the planner pins where it is pinned: there each
    # step's carry is relaid back, as the plan priced it
    emit = planner is not None and planner.emit
    pin = planner.pinned.get(loop) if planner is not None and not emit else None
    placed: dict = dict(planner.carries.get(loop, {}) if emit else pin or {})
    fixed = emit or pin is not None
    mark = ctx.checkpoint() if ctx.explicit else None
    while True:
        try:
            out = _scan_once(ctx, step, dim, length, x_leaves, x_tree, c_leaves, c_tree, widen, placed,
                             reverse, unroll, where, _Planned(loop, fixed, emit))
            if planner is not None and not fixed:   # the planning trace's (its latest run: the rule's own)
                planner.carries[loop] = dict(placed)
            return out
        except Widen as w:  # forget the aborted trace's records and try again
            widen[w.index] = widen.get(w.index, frozenset()) | w.axes
            ctx.rollback(mark)
        except Replace as r:
            placed[r.index] = r.axes
            ctx.rollback(mark)


def _scan_once(ctx, step, dim, length, x_leaves, x_tree, c_leaves, c_tree, widen, placed, reverse, unroll, where,
               planned):
    start = len(ctx.rec.records)
    c_arrays, c_templates = _enter_carry(ctx, c_leaves, widen, placed)
    carried = len(ctx.rec.records)
    carry_vary = frozenset().union(*(varying_axes(a) for a in c_arrays)) if ctx.explicit else frozenset()
    x_arrays, x_templates = _enter_xs(ctx, x_leaves, dim, carry_vary)
    y_templates = []
    planning = ctx.explicit and ctx.planner is not None and not planned.emit
    if planning:   # where the step reads its carry and slices (the carry relaid there: a move the plan prices)
        ctx.planner.carry_in[planned.loop] = (tuple(t[2] for t in c_templates + x_templates if t is not None),
                                            (start, carried))

    def body(c_arrs, x_arrs):
        carry = _rebuild(c_tree, c_arrs, c_templates)
        x_arrs = [to_memory(a, "device") if host_resident(a) else a for a in x_arrs]   # this step's slice
        xs = _rebuild(x_tree, x_arrs, x_templates)
        with ctx.rec.loop(length):
            if planning:   # (read as often as the step runs)
                ctx.planner.stepping(ctx, planned.loop, [x for tree in (carry, xs)
                                                       for x in jax.tree_util.tree_leaves(tree, is_leaf=_is_named)
                                                       if _is_named(x)])
            new_carry, ys = step(carry, xs)
            new_leaves, new_tree = jax.tree_util.tree_flatten(new_carry, is_leaf=_is_named)
            if new_tree != c_tree:
                raise ShapeError(f"{where}: the step returned a carry of structure {new_tree}, "
                                 f"but it entered as {c_tree}")
            named = {i: n for n, i in enumerate(i for i, t in enumerate(c_templates) if t is not None)}
            out_c = [_carry_out(ctx, (i, named.get(i)), leaf, old, t, where, i not in placed and not planned.fixed,
                                planned.loop) for i, (leaf, old, t) in enumerate(zip(new_leaves, c_arrs, c_templates))]
            y_leaves, y_tree = jax.tree_util.tree_flatten(ys, is_leaf=_is_named)
            y_templates[:] = [(y.dims, y.is_param, y.placement) if _is_named(y) else None for y in y_leaves]
            y_templates.append(y_tree)
            return out_c, [y.raw if _is_named(y) else y for y in y_leaves]

    with jaxcompat.fresh():   # a step traced again (a retry, another candidate) runs its rules again
        if any(map(host_resident, x_arrays)):   # slices in host memory: fetched one step ahead, and again
            c_out, y_arrays = streamed.scan(body, c_arrays, x_arrays, reverse, unroll)   # for the backward pass
        else:
            c_out, y_arrays = jax.lax.scan(body, c_arrays, x_arrays, reverse=reverse, unroll=unroll)
    y_tree = y_templates.pop()
    return _rebuild(c_tree, c_out, c_templates), _stack_ys(dim, length, y_tree, y_arrays, y_templates)




def _rebuild(tree, arrays, templates):
    """NamedArrays (where a template says so) from local arrays."""
    return jax.tree_util.tree_unflatten(
        tree, [a if t is None else NamedArray(a, t[0], is_param=t[1], placement=t[2])
               for a, t in zip(arrays, templates)])


def _enter_carry(ctx, c_leaves, widen, placed):
    """The carry in its layout placement (or where a previous try found the step leaves it),
    typed varying over its splits (and whatever a previous try needed); templates to rebuild it."""
    arrays, templates = [], []
    for i, leaf in enumerate(c_leaves):
        if _is_named(leaf):
            if ctx.explicit:
                axes = placed.get(i) or ctx.canonical(leaf.dims)
                vary = frozenset(a for ax in axes for a in ax) | widen.get(i, frozenset())
                arr = ctx.local(leaf, dict(zip(leaf.names, axes)), vary)
                templates.append((leaf.dims, leaf.is_param, Placement(axes)))
            else:
                arr = leaf.raw
                templates.append((leaf.dims, leaf.is_param, None))
        else:
            arr = jnp.asarray(leaf)
            if ctx.explicit and widen.get(i):
                arr = C.cast(ctx, arr, order(ctx, widen[i]))
            templates.append(None)
        arrays.append(arr)
    return arrays, templates


def _enter_xs(ctx, x_leaves, dim, carry_vary):
    """The stacked xs with the scanned dim whole and first, cast once (before the loop) to vary
    like the carry; templates of one step's slices. An xs entry held off the layout's placement
    whose copy in that placement is made anyway is read from that copy."""
    arrays, templates = [], []
    for leaf in x_leaves:
        pos = leaf.names.index(dim)
        inner = Shape(d for d in leaf.dims if d.name != dim)
        if ctx.explicit and host_resident(leaf.raw) and not ctx.placement(leaf).of(leaf.dims, dim):
            # kept in host memory (offloaded parameters): each step brings its own slice to the
            # device (the body), where its ops relay it as they need - never the whole stack
            arr, pl = leaf.raw, ctx.placement(leaf)
            inner_pl = Placement(tuple(a for d, a in zip(leaf.dims, pl.axes) if d.name != dim), pl.pending)
        elif ctx.explicit:
            pl = ctx.placement(leaf)
            canonical = None if ctx.layout_axes(dim) else ctx.canonical(leaf.dims)
            if canonical is not None and pl.axes != canonical and ctx.relaid(leaf, canonical):
                pl = Placement(canonical)   # a copy made anyway (returned, say): reading it moves nothing more
            axes = {d.name: a for d, a in zip(leaf.dims, pl.axes)}
            axes[dim] = ()
            vary = ctx.vary(axes.values(), [leaf], pl.pending) | carry_vary
            arr = ctx.local(leaf, axes, vary, keep_pending=pl.pending)
            inner_pl = Placement(tuple(a for d, a in zip(leaf.dims, pl.axes) if d.name != dim), pl.pending)
        else:
            arr, inner_pl = leaf.raw, None
        arrays.append(jnp.moveaxis(arr, pos, 0))
        templates.append((inner, leaf.is_param, inner_pl))
    return arrays, templates


def _stack_ys(dim, length, y_tree, y_arrays, y_templates):
    """The steps' outputs as NamedArrays stacked along ``dim`` (first)."""
    ys = []
    for a, t in zip(y_arrays, y_templates):
        if t is None:
            ys.append(a)
            continue
        dims, is_param, pl = t
        stacked = Shape((Dim(dim, length), *dims))
        ys.append(NamedArray(a, stacked, is_param=is_param,
                             placement=None if pl is None else Placement(((), *pl.axes), pl.pending)))
    return jax.tree_util.tree_unflatten(y_tree, ys)


def _carry_out(ctx, index, leaf, old, template, where, may_replace, loop):
    """Bring carry leaf ``index`` (its index among the leaves, and among the named ones) back to
    the placement and type it entered the step with (or, where that moves bytes every step, ask
    for a try with the carry entering as the step leaves it). The planner (loop op number
    ``loop``) prices that relay where its plan moves the step's ops, and where the carry enters."""
    i = index[0]
    if template is None:
        if _is_named(leaf):
            raise ShapeError(f"{where}: carry entry {i} entered as a plain array and left as a NamedArray")
        arr = jnp.asarray(leaf)
    else:
        dims, _, pl = template
        if _is_named(leaf) and leaf.dims != dims and set(leaf.dims) == set(dims) and len(leaf.dims) == len(dims):
            leaf = transpose(leaf, dims.names)   # the same dims in another order: matched by name
        if not _is_named(leaf) or leaf.dims != dims:
            got = f"[{leaf.dims}]" if _is_named(leaf) else type(leaf).__name__
            raise ShapeError(f"{where}: carry entry {i} entered as [{dims}] and left as {got}; "
                             "a step must return the carry with the same dims")
        if leaf.dtype != old.dtype:
            raise ShapeError(f"{where}: carry entry {i} [{dims}] entered as {old.dtype} and left as "
                             f"{leaf.dtype}; cast it back (x.astype(...)) before returning it")
        if not ctx.explicit:
            return leaf.raw
        now = ctx.placement(leaf)
        if may_replace and not now.pending and now.axes != pl.axes and relayout_bytes(
                ctx, dims, leaf.dtype.itemsize, now.axes, frozenset(), pl.axes):
            raise Replace(i, now.axes)
        if ctx.planner is not None:
            ctx.planner.carried(ctx, leaf, loop, index)
        arr = ctx.local(leaf, dict(zip(leaf.names, pl.axes)), varying_axes(old))
    if ctx.explicit:
        extra = varying_axes(arr) - varying_axes(old)
        if extra:
            raise Widen(i, extra)
        arr = C.cast(ctx, arr, order(ctx, varying_axes(old) - varying_axes(arr)))
    return arr
