"""Slices at a traced position: ``dynamic_slice`` and ``dynamic_update_slice`` (KV caches).

``md.dynamic_slice(x, dim, start, size)`` reads ``size`` entries of ``dim`` from ``start``
(``size=None``: one entry, without the dim); ``md.dynamic_update_slice(x, update, dim, start)``
writes ``update`` there (an ``update`` without ``dim`` is one entry: a decode step's new keys).
``start`` is a traced integer (a Python int, a 0-d jax array or a 0-d NamedArray); as in
``jax.lax``, it is clamped so the slice lies inside the dim.

Over a dim whole on every device both are local. Over a dim split on mesh axes:

* ``dynamic_update_slice``: each device writes the entries of ``update`` that fall into its block
  and keeps the rest; no communication, the cache is never gathered (``update`` is whole along
  ``dim``: a decode step's one new position);
* ``dynamic_slice``: each device reads the entries that fall into its block, zeros elsewhere: the
  result is a *pending* partial sum over the split axes, so only the slice moves (one all-reduce
  of the slice when a whole value is needed, a reduce-scatter if the layout splits the result).
  Booleans cannot be summed: they are read from the gathered dim; so is a value another op
  gathers along ``dim`` anyway (nothing more moves). A pending sum ``x`` carries stays pending
  (a read is linear): it is reduced on the slice, not on ``x``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..rewrite import collectives as C
from ..names.dims import Dim, Shape
from ..names.errors import ShapeError
from ..names.named import NamedArray
from .common import align, as_named, names_in, where_, whole_copy_made
from .registry import op

__all__ = ["dynamic_slice", "dynamic_update_slice"]


def _dim(ctx, x, dim, what) -> str:
    names = names_in(ctx, x, dim, what)
    if len(names) != 1:
        raise ShapeError(f"{where_(ctx)}: {what} must be one dim of [{x.dims}], got {list(names)}")
    return names[0]


def _start(ctx, start, n: int, size: int, vary):
    """``start`` as a local int32 scalar, clamped to ``[0, n - size]``."""
    if isinstance(start, NamedArray):
        if start.ndim:
            raise ShapeError(f"{where_(ctx)}: start must be a 0-d integer, got [{start.dims}]")
        start = ctx.local(start, {}, vary)
    start = jnp.asarray(start)
    if start.ndim or not jnp.issubdtype(start.dtype, jnp.integer):
        raise ShapeError(f"{where_(ctx)}: start must be a 0-d integer (a traced position), got "
                         f"{start.dtype}{tuple(start.shape)}")
    return jnp.clip(start.astype(jnp.int32), 0, n - size)


def _block_offset(ctx, split, block):
    return (C.axis_index(split) * block).astype(jnp.int32) if split else jnp.int32(0)


@op("dynamic_slice", gathers=True)
def dynamic_slice(ctx, x, dim, start, size: int | None) -> NamedArray:
    """``size`` entries of ``dim`` from the traced position ``start`` (clamped into the dim);
    ``size=None``: the one entry at ``start``, without ``dim``."""
    x = as_named(ctx, x)
    name = _dim(ctx, x, dim, "dynamic_slice dim")
    n = x.dims[name].size
    if size is not None and (not isinstance(size, int) or not 0 <= size <= n):
        raise ShapeError(f"{where_(ctx)}: size {size!r} must be a Python int in 0..{n} (the size of "
                         f"{name!r}), or None for one entry without the dim")
    axes = ctx.plan(x.dims, [x], keep_pending=ctx.pending(x))
    if jnp.issubdtype(x.dtype, jnp.bool_) or whole_copy_made(ctx, x, axes, name):
        axes[name] = ()  # booleans; or a copy holding the dim whole is made anyway (top_k): read it
    keep = ctx.pending(x) - {a for ax in axes.values() for a in ax}   # a read is linear: sums stay pending
    vary = ctx.vary(axes.values(), [x], keep)
    local = ctx.local(x, axes, vary, keep_pending=keep)
    s = _start(ctx, start, n, size or 1, vary)
    pos = x.names.index(name)
    split = axes.pop(name)
    if not split:
        rows = jax.lax.dynamic_slice_in_dim(local, s, size or 1, axis=pos)
    else:
        block = local.shape[pos]
        idx = s + jnp.arange(size or 1, dtype=jnp.int32) - _block_offset(ctx, split, block)
        inside = (idx >= 0) & (idx < block)
        rows = jnp.take(local, jnp.clip(idx, 0, block - 1), axis=pos)
        mask = inside.reshape([size or 1 if i == pos else 1 for i in range(local.ndim)])
        rows = jnp.where(mask, rows, jnp.zeros((), rows.dtype))
    if size is None:
        out = Shape(d for d in x.dims if d.name != name)
        rows = jnp.squeeze(rows, pos)
    else:
        out = Shape(Dim(name, size) if d.name == name else d for d in x.dims)
        axes[name] = ()
    return ctx.out(rows, out, axes, keep | frozenset(split))


@op("dynamic_update_slice", gathers=True)
def dynamic_update_slice(ctx, x, update, dim, start) -> NamedArray:
    """``x`` with ``update`` written along ``dim`` from the traced position ``start`` (clamped).
    ``update`` has the dims of ``x`` (any order), ``dim`` of any size up to ``x``'s, or no ``dim``
    (one entry)."""
    x = as_named(ctx, x)
    update = as_named(ctx, update, "update")
    name = _dim(ctx, x, dim, "dynamic_update_slice dim")
    if set(update.names) | {name} != set(x.names):
        raise ShapeError(f"{where_(ctx)}: update [{update.dims}] must have the dims of [{x.dims}] "
                         f"(with or without {name!r})")
    for d in update.dims:
        if d.name != name and d.size != x.dims[d.name].size:
            raise ShapeError(f"{where_(ctx)}: update has {d} but x has {x.dims[d.name]}; only {name!r} may differ")
    n = x.dims[name].size
    size = update.dims[name].size if name in update.names else 1
    if size > n:
        raise ShapeError(f"{where_(ctx)}: update has {name}:{size}, larger than x's {name}:{n}")
    if update.dtype != x.dtype:
        update = update.astype(x.dtype)
    axes = ctx.plan(x.dims, [x])
    vary = ctx.vary(axes.values(), [x, update])
    local = ctx.local(x, axes, vary)
    upd = align(ctx.local(update, {**axes, name: ()}, vary), update.dims, x.dims)  # size-1 axis if absent
    s = _start(ctx, start, n, size, vary)
    pos = x.names.index(name)
    split = axes[name]
    if not split:
        return ctx.out(jax.lax.dynamic_update_slice_in_dim(local, upd, s, axis=pos), x.dims, axes)
    block = local.shape[pos]
    j = _block_offset(ctx, split, block) + jnp.arange(block, dtype=jnp.int32) - s
    inside = (j >= 0) & (j < size)
    written = jnp.take(upd, jnp.clip(j, 0, size - 1), axis=pos)
    mask = inside.reshape([block if i == pos else 1 for i in range(local.ndim)])
    return ctx.out(jnp.where(mask, written, local), x.dims, axes)
