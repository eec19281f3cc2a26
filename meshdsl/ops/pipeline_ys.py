"""Scan outputs (``ys``) of a pipeline: each stage's layers' outputs, per microbatch, assembled.

Inside a tick, stage ``s`` runs its ``layers / S`` layers on microbatch ``t - s``; the step's
``ys`` come back stacked along the scanned dim for those layers (:mod:`meshdsl.ops.loop`). Per tick
each ``ys`` leaf is brought to its layout placement (:func:`per_tick`), and ``lax.scan`` stacks the
ticks. After the loop, stage ``s`` keeps ticks ``s .. s + M - 1`` (its microbatches in order; the
bubble ticks' outputs are dropped, so they never reach the result nor receive a gradient) and
joins them along the microbatch dim (:func:`assemble`). The result is the unsharded scan's ``ys``,
stacked along the scanned dim, split over the pipeline axis like the stacked ``xs``: each device
holds its own layers' outputs, no communication.

A ``ys`` leaf must carry the microbatch dim (``batch``) whenever there is more than one microbatch:
a value over the whole batch (a mean of a loss over the examples) cannot be recombined exactly
from its microbatches' values (a mean of products is not a product of means). Return per-example
values and reduce them after the scan.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..rewrite import collectives as C
from ..names.dims import Dim, Shape
from ..names.errors import LayoutError
from ..names.named import is_named
from . import loop

__all__ = ["per_tick", "assemble"]


def per_tick(ctx, ys, micro, micro_axes, m, axis, where):
    """Local arrays of one tick's ``ys`` leaves (layout placement, pending sums kept), and their
    templates ``(dims, is_param, axes, pending, position of the microbatch dim or None)``."""
    arrays, templates = [], []
    for i, y in enumerate(jax.tree_util.tree_leaves(ys, is_leaf=is_named)):
        if not is_named(y):
            raise LayoutError(f"{where}: a pipeline's scan outputs must be NamedArrays (with the microbatch dim "
                              f"{micro!r}); ys entry {i} is a {type(y).__name__}")
        pl = ctx.placement(y)
        if set(axis) & pl.pending:
            raise LayoutError(f"internal: {where}: ys entry {i} [{y.dims}] is a pending sum over the pipeline axis")
        pos = y.names.index(micro) if micro in y.names else None
        if pos is None and m > 1:
            raise LayoutError(
                f"{where}: ys entry {i} [{y.dims}] has no microbatch dim {micro!r}: a value over the whole "
                f"microbatch cannot be recombined exactly from {m} microbatches (a mean of products is not a "
                f"product of means); return per-example values (keep the {micro!r} dim) and reduce them after "
                f"the scan, or use microbatches={{'{micro}': 1}}")
        axes = dict(zip(y.names[1:], ctx.canonical(Shape(y.dims[1:]))))
        axes[y.names[0]] = ()                       # the stage's own layers, whole on the stage
        if pos is not None and axes[micro] != micro_axes:
            text = ctx.mesh.axes_text
            raise LayoutError(
                f"{where}: ys entry {i} [{y.dims}] would place {micro!r} over {text(axes[micro]) or 'no axis'}, "
                f"the carry's microbatches over {text(micro_axes) or 'no axis'}; map the other dims of this "
                f"output to other mesh axes than {text(micro_axes)}")
        keep = pl.pending - {a for ax in axes.values() for a in ax}   # a sum wanted split: reduce-scattered
        vary = ctx.vary(axes.values(), [y], keep) | set(axis)
        arr = ctx.local(y, axes, vary, keep_pending=keep)
        arrays.append(C.cast(ctx, arr, loop.order(ctx, vary)))
        templates.append((y.dims, y.is_param, tuple(axes[n] for n in y.names), keep, pos))
    return arrays, templates


def assemble(ctx, stacked, templates, m, stage, axis):
    """The ``ys`` leaves from their per-tick stacks ``[ticks, layers / S, ...]``: this stage's
    ``M`` microbatches joined along the microbatch dim, the scanned dim split over ``axis``."""
    out = []
    stages = ctx.axes_size(axis)
    for arr, (dims, is_param, axes, pending, pos) in zip(stacked, templates):
        mine = jax.lax.dynamic_slice_in_dim(arr, stage, m, axis=0)   # ticks s .. s + M - 1
        if pos is None:
            local, sizes = mine[0], {}
        else:
            moved = jnp.moveaxis(mine, 0, pos)                       # [..., M, rows, ...]
            local = moved.reshape(moved.shape[:pos] + (m * moved.shape[pos + 1],) + moved.shape[pos + 2:])
            sizes = {dims.names[pos]: dims[pos].size * m}
        first = dims.names[0]
        sizes[first] = dims[0].size * stages
        full = Shape(Dim(d.name, sizes.get(d.name, d.size)) for d in dims)
        by_name = dict(zip(dims.names, axes))
        by_name[first] = tuple(axis)
        out.append(ctx.out(local, full, by_name, pending, is_param=is_param))
    return out
