"""A scan over a dim the layout splits is a pipeline over that mesh axis (GPipe).

With ``md.Layout({"batch": "data", "layers": "pipe"}, microbatches={"batch": M})``, an
``md.scan(step, carry, xs, dim="layers")`` inside ``md.lower`` runs as a pipeline of ``S`` stages
(the size of ``pipe``): each device holds its ``layers / S`` layers (its block of ``xs``), the carry
is cut into ``M`` microbatches along ``batch``, and ``T = M + S - 1`` ticks each

1. let stage 0 take the next microbatch,
2. run the stage's layers on the microbatch at hand (an ordinary loop, :mod:`meshdsl.ops.loop`),
3. let the last stage keep its finished microbatch,
4. shift every stage's microbatch one stage on: one ``ppermute`` over ``pipe``
   (:func:`meshdsl.collectives.ppermute`), the ``shift`` rule of the rewriter table.

The finished carry lives on the last stage; the others hold zeros, so the result is a *pending*
sum over ``pipe``: the next op that needs whole values reduces it (or reduce-scatters it where the
layout splits it over ``pipe``). Gradients come from autodiff through the tick loop (the reverse
pipeline: each ``ppermute`` transposes to the inverse shift). Bubble ticks compute on zeros that
never reach a finished microbatch, so they add nothing to the gradients.

The step must treat microbatch rows independently (true of layers over a batch of examples).
Without ``microbatches=`` the pipeline runs one microbatch (correct, all bubble). Schedules other
than GPipe, scan outputs (``ys``) and values the step captures with the microbatch dim are not
lowered as pipelines yet: they are refused with a LayoutError.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import collectives as C
from ..dims import Dim, Shape
from ..errors import LayoutError, MeshDSLError
from ..jaxcompat import varying_axes
from ..named import NamedArray, Placement, is_named
from . import loop

__all__ = ["run", "SCHEDULES"]

SCHEDULES = ("gpipe",)


def run(ctx, step, dim, length, x_leaves, x_tree, c_leaves, c_tree, where):
    """``(carry, ys)`` of ``md.scan`` over ``dim`` split by the layout: a GPipe pipeline."""
    axis, stages = _pipe_axis(ctx, dim, length, where)
    if ctx.schedule not in SCHEDULES:
        raise MeshDSLError(f"{where}: schedule {ctx.schedule!r} is not lowered yet; use one of {SCHEDULES}")
    micro, m = _microbatches(ctx, c_leaves, dim, axis, where)
    inputs, templates = _cut(ctx, c_leaves, axis, micro, m, where)
    xs = [_local_stack(ctx, leaf, dim, axis) for leaf in x_leaves]
    ticks = m + stages - 1
    line = ctx.op[1] if ctx.op else "?"
    ctx.pipelines.append({"dim": dim, "axis": axis, "stages": stages, "microbatches": m, "schedule": ctx.schedule,
                          "ticks": ticks, "bubble_fraction": (stages - 1) / ticks, "line": line})
    widen = frozenset()
    mark = ctx.checkpoint()
    while True:
        try:
            outs = _ticks(ctx, step, dim, length // stages, xs, x_tree, c_tree, inputs, templates,
                          axis, stages, m, widen, where, line)
            break
        except loop.Widen as w:
            widen |= w.axes
            ctx.rollback(mark)
    carry = [_join(ctx, o, t, micro, axis) for o, t in zip(outs, templates)]
    return jax.tree_util.tree_unflatten(c_tree, carry), None


def _pipe_axis(ctx, dim, length, where):
    axes = ctx.layout_axes(dim)
    if len(axes) != 1:
        raise LayoutError(f"{where}: the layout splits {dim!r} over {'+'.join(axes)}; a pipeline runs over one "
                          f"mesh axis: map {dim!r} to a single axis (e.g. '{dim}': 'pipe')")
    stages = ctx.axes_size(axes)
    if length % stages:
        raise LayoutError(f"{where}: {dim}:{length} cannot be cut into {stages} pipeline stages "
                          f"({axes[0]} has size {stages}); use a multiple of {stages} layers or a smaller axis")
    return axes[0], stages


def _microbatches(ctx, c_leaves, dim, axis, where):
    micro = dict(ctx.layout.microbatches)
    if not micro:
        names = [leaf.names for leaf in c_leaves if is_named(leaf)]
        if names and all("batch" in ns for ns in names):
            return "batch", 1
        raise LayoutError(f"{where}: the layout splits {dim!r} over {axis!r}: a pipeline, which cuts its carry "
                          "into microbatches; name the dim to cut with md.Layout(..., microbatches={'batch': M}), "
                          f"or remove the rule for {dim!r}")
    ((name, m),) = micro.items()
    return name, m


def _cut(ctx, c_leaves, axis, micro, m, where):
    """Each carry leaf's local block as ``[M, rows per microbatch, ...]`` (the microbatch dim
    first), and templates (dims and placement of one microbatch) to rebuild NamedArrays."""
    inputs, templates = [], []
    for i, leaf in enumerate(c_leaves):
        if not is_named(leaf) or micro not in leaf.names:
            got = f"[{leaf.dims}]" if is_named(leaf) else type(leaf).__name__
            raise LayoutError(f"{where}: a pipeline cuts its carry into microbatches along {micro!r}; carry "
                              f"entry {i} {got} has no such dim")
        axes = ctx.canonical(leaf.dims)
        if any(axis in a for a in axes):
            raise LayoutError(f"{where}: carry entry {i} [{leaf.dims}] is split over the pipeline axis "
                              f"{axis!r}; the layout may not map its dims to {axis!r}")
        arr = ctx.local(leaf, dict(zip(leaf.names, axes)), frozenset(a for ax in axes for a in ax))
        pos = leaf.names.index(micro)
        rows = arr.shape[pos]
        if rows % m:
            raise LayoutError(
                f"{where}: {micro}:{leaf.dims[micro].size} leaves {rows} rows per device, which "
                f"{m} microbatches cannot divide; choose microbatches={{'{micro}': k}} with k dividing {rows}")
        arr = jnp.moveaxis(arr, pos, 0)
        inputs.append(arr.reshape((m, rows // m) + arr.shape[1:]))
        first = [pos] + [k for k in range(len(axes)) if k != pos]   # the microbatch dim first
        dims = Shape(Dim(micro, leaf.dims[k].size // m) if k == pos else leaf.dims[k] for k in first)
        templates.append((dims, leaf.is_param, Placement(tuple(axes[k] for k in first)), leaf.dims, axes, pos))
    return inputs, templates


def _local_stack(ctx, leaf, dim, axis):
    """This stage's layers of a stacked ``xs`` leaf, as a NamedArray whose ``dim`` is whole."""
    pl = ctx.placement(leaf)
    axes = {d.name: a for d, a in zip(leaf.dims, pl.axes)}
    axes[dim] = (axis,)
    vary = ctx.vary(axes.values(), [leaf], pl.pending)
    arr = ctx.local(leaf, axes, vary, keep_pending=pl.pending)
    n = arr.shape[leaf.names.index(dim)]
    dims = Shape(Dim(dim, n) if d.name == dim else d for d in leaf.dims)
    inner = Placement(tuple(() if d.name == dim else a for d, a in zip(leaf.dims, pl.axes)), pl.pending)
    return NamedArray(arr, dims, is_param=leaf.is_param, placement=inner)


def _ticks(ctx, step, dim, per_stage, xs, x_tree, c_tree, inputs, templates, axis, stages, m, widen, where,
           line):
    """Run the ``M + S - 1`` ticks; returns each carry leaf's ``[M, ...]`` finished microbatches
    (zeros except on the last stage)."""
    stage = C.axis_index((axis,))
    vary = [frozenset(a for ax in t[2].axes for a in ax) | {axis} | widen for t in templates]
    bufs = [C.cast(ctx, jnp.zeros(i.shape[1:], i.dtype), loop.order(ctx, v)) for i, v in zip(inputs, vary)]
    outs = [C.cast(ctx, jnp.zeros_like(i), loop.order(ctx, v)) for i, v in zip(inputs, vary)]
    inputs = [C.cast(ctx, i, loop.order(ctx, varying_axes(i) | {axis})) for i in inputs]
    shift = [(s, s + 1) for s in range(stages - 1)]

    def tick(state, t):
        bufs, outs = state
        take = (stage == 0) & (t < m)
        bufs = [jnp.where(take, jax.lax.dynamic_index_in_dim(i, jnp.minimum(t, m - 1), 0, keepdims=False), b)
                for i, b in zip(inputs, bufs)]
        carry = [NamedArray(b, t_[0], is_param=t_[1], placement=t_[2]) for b, t_ in zip(bufs, templates)]
        carry, ys = loop.run(ctx, step, dim, per_stage, xs, x_tree, carry, c_tree, False, 1, where)
        if jax.tree_util.tree_leaves(ys):
            raise LayoutError(f"{where}: a pipeline does not return scan outputs (ys) yet; return None "
                              "from the step, or remove the layout rule that splits the scanned dim")
        new = [ctx.local(c, dict(zip(c.names, t_[2].axes)), v) for c, t_, v in
               zip(jax.tree_util.tree_leaves(carry, is_leaf=is_named), templates, vary)]
        for k, (a, v) in enumerate(zip(new, vary)):
            if varying_axes(a) - v:
                raise loop.Widen(k, varying_axes(a) - v)
        done = t - (stages - 1)
        keep = (stage == stages - 1) & (done >= 0)
        slot = jnp.clip(done, 0, m - 1)
        outs = [jax.lax.dynamic_update_index_in_dim(
            o, jnp.where(keep, a, jax.lax.dynamic_index_in_dim(o, slot, 0, keepdims=False)), slot, 0)
            for o, a in zip(outs, new)]
        if stages > 1:
            with ctx.at("scan", line):
                new = [C.ppermute(ctx, a, (axis,), shift, f"[{t_[0]}] microbatch to the next stage")
                       for a, t_ in zip(new, templates)]
        return (new, outs), None

    with ctx.rec.loop(m + stages - 1):
        (_, outs), _ = jax.lax.scan(tick, (bufs, outs), jnp.arange(m + stages - 1))
    return outs


def _join(ctx, out, template, micro, axis):
    """``[M, rows, ...]`` back to the carry's local block, pending over the pipeline axis."""
    _, is_param, _, dims, axes, pos = template
    arr = jnp.moveaxis(out.reshape((out.shape[0] * out.shape[1],) + out.shape[2:]), 0, pos)
    return ctx.out(arr, dims, dict(zip(dims.names, axes)), frozenset({axis}), is_param=is_param)
