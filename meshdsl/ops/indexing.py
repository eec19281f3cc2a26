"""Ops that index along a dim: one_hot, top_k, argmax, cumsum, shift (``take``: :mod:`.lookup`).

Over a dim split on mesh axis ``a``:

* ``one_hot``: each device builds its block of the new dim from the ids (no communication);
* ``top_k``: local top-k, all-gather of the k candidates per device only, final top-k;
* ``cumsum``: local cumsum plus the sum of the previous blocks' totals (an all-gather of one
  value per row and device);
* ``shift``: ``ppermute`` of the boundary slice only (two slices when the offset is not a multiple
  of the block, one full block when it is).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..rewrite import collectives as C
from ..names.dims import Dim, Shape
from ..names.errors import LayoutError, ShapeError
from ..names.named import NamedArray
from .common import as_named, block_offset, known_zeros, new_dims, one_dim, rows_gathered, where_, whole_copy_made
from .registry import op
from .restructure import reshape

__all__ = ["one_hot", "top_k", "argmax", "cumsum", "shift"]


@op("one_hot")
def one_hot(ctx, ids, dim, dtype=jnp.float32) -> NamedArray:
    """``out[..., v] = (ids[...] == v)`` with a new dim ``dim`` (a ``Dim`` or ``"name:size"``)."""
    ids = as_named(ctx, ids, "ids")
    (new,) = new_dims(ctx, dim, "one_hot dim")
    if new.name in ids.names:
        raise ShapeError(f"{where_(ctx)}: ids [{ids.dims}] already have a dim {new.name!r}")
    dims = Shape((*ids.dims, new))
    axes = ctx.plan(dims, [ids])
    vary = ctx.vary(axes.values(), [ids])
    local = ctx.local(ids, axes, vary)
    split = axes[new.name]
    block = new.size // ctx.axes_size(split)
    iota = jnp.arange(block, dtype=local.dtype) + block_offset(split, block).astype(local.dtype) \
        if split else jnp.arange(block, dtype=local.dtype)
    return ctx.out((local[..., None] == iota).astype(dtype), dims, axes)


@jax.custom_jvp
def _signless_zero(v):
    """``v`` with ``-0.0`` written ``0.0`` (XLA's top_k orders them); the derivative is 1."""
    return jnp.where(v == 0, jnp.zeros((), v.dtype), v)


_signless_zero.defjvp(lambda primals, tangents: (_signless_zero(primals[0]), tangents[0]))


@op("top_k", gathers=True)
def top_k(ctx, x, dim, k: int, out: str = "k") -> tuple[NamedArray, NamedArray]:
    """The ``k`` largest entries along ``dim``: ``(values, indices)`` with dim ``out`` (size k)
    in place of ``dim``; indices are global positions along ``dim`` (int32). Ties go to the
    lowest index, ``-0.0`` and ``0.0`` included."""
    x = as_named(ctx, x)
    name = one_dim(ctx, x, dim, "top_k dim")
    n = x.dims[name].size
    if not 0 < k <= n:
        raise ShapeError(f"{where_(ctx)}: k={k} is not in 1..{n} (size of {name!r})")
    if out in x.names and out != name:
        raise ShapeError(f"{where_(ctx)}: out dim {out!r} already exists in [{x.dims}]")
    axes = ctx.plan(x.dims, [x])
    vary = ctx.vary(axes.values(), [x], out_size=x.size)
    local = jnp.moveaxis(ctx.local(x, axes, vary), x.names.index(name), -1)
    if jnp.issubdtype(local.dtype, jnp.floating):
        local = _signless_zero(local)   # -0.0 and 0.0 tie: a sum a layout reassociates may give either
    split = axes[name]
    if not split:
        values, idx = jax.lax.top_k(local, k)
    elif 2 * min(k, n // ctx.axes_size(split)) >= n // ctx.axes_size(split):
        # The candidates (values and indices) would be no smaller than the blocks: gather the
        # values of the dim (positions are implicit; a relayout, so other ops reading the whole
        # value share the gather) and take the top k of the whole. A whole dim the layout splits
        # over the axes freed takes them: the split moves by all-to-all instead of a gather.
        axes = {**axes, name: (), **_taking(ctx, x, axes, name, split)}
        vary = ctx.vary(axes.values(), [x], out_size=x.size)
        whole = jnp.moveaxis(ctx.local(x, axes, vary), x.names.index(name), -1)
        values, idx = jax.lax.top_k(whole, k)
    else:
        block = n // ctx.axes_size(split)
        kk = min(k, block)
        v1, i1 = jax.lax.top_k(local, kk)
        i1 = i1 + block_offset(split, block).astype(i1.dtype)
        last = local.ndim - 1
        v_all = C.all_gather(ctx, v1, split, last, invariant=True, tensor=f"[{x.dims}] top_k candidates")
        i_all = C.all_gather(ctx, i1, split, last, invariant=True, tensor=f"[{x.dims}] top_k indices")
        values, sel = jax.lax.top_k(v_all, k)
        idx = jnp.take_along_axis(i_all, sel, axis=-1)
    pos = x.names.index(name)
    dims = Shape(Dim(out, k) if d.name == name else d for d in x.dims)
    out_axes = {(out if n_ == name else n_): a for n_, a in axes.items()}
    out_axes[out] = ()
    return (ctx.out(jnp.moveaxis(values, -1, pos), dims, out_axes),
            ctx.out(jnp.moveaxis(idx.astype(jnp.int32), -1, pos), dims, out_axes))


def _taking(ctx, x, axes, name, freed) -> dict:
    """Dims of ``x`` other than ``name``, whole in ``axes``, that the layout splits over axes in
    ``freed`` (which ``name`` gives up): their layout's axes."""
    try:
        wanted = dict(zip(x.names, ctx.canonical(x.dims))) if ctx.explicit else {}
    except LayoutError:
        return {}
    return {n: w for n, w in wanted.items() if n != name and w and not axes[n] and set(w) <= set(freed)}


def argmax(x, dim):
    """Global position of the maximum along ``dim`` (int32), without the dim."""
    _, idx = top_k(x, dim, 1, out="argmax_k_")
    return reshape(idx, [d for d in idx.dims if d.name != "argmax_k_"])


@op("cumsum", gathers=True)
def cumsum(ctx, x, dim) -> NamedArray:
    """Inclusive cumulative sum along ``dim``."""
    x = as_named(ctx, x)
    name = one_dim(ctx, x, dim, "cumsum dim")
    if known_zeros(ctx, x):   # sums of zeros: zeros where they are, no block totals
        pl = ctx.placement(x)
        return ctx.pieces(ctx.out(x.raw, x.dims, dict(zip(x.names, pl.axes)), pl.pending), name, [])
    axes = ctx.plan(x.dims, [x], keep_pending=ctx.pending(x))
    pos = x.names.index(name)
    wanted = ctx.canonical(x.dims) if ctx.explicit else None
    others = {a for n, held in axes.items() if n != name for a in held}
    if wanted is not None and axes[name] and axes[name] != wanted[pos] and not set(wanted[pos]) & others \
            and ctx.result_relaid([x], wanted):
        # split off the layout and wanted in its placement later (returned): moving x there now
        # moves as much as moving the result later, and saves the block totals
        axes[name] = wanted[pos]
    if axes[name] and x.dims[name].size == ctx.axes_size(axes[name]) or \
            not ctx.pending(x) and whole_copy_made(ctx, x, axes, name):
        # blocks of one row: a block's total is the row, so gathering the totals gathers x; gather
        # it by relayout, one copy shared with every other op gathering x (XLA would merge them).
        # Or a copy holding the dim whole is made anyway (top_k): read it, no block totals
        axes[name] = ()
    keep = ctx.pending(x) - {a for a in axes[name]}
    vary = ctx.vary(axes.values(), [x], keep, out_size=x.size)
    local = ctx.local(x, axes, vary, keep_pending=keep)
    y = jnp.cumsum(local, axis=pos)
    split = axes[name]
    if split:
        n = ctx.axes_size(split)
        last = jax.lax.slice_in_dim(y, y.shape[pos] - 1, y.shape[pos], axis=pos)
        totals = C.all_gather(ctx, last, split, pos, invariant=False, tensor=f"[{x.dims}] block totals of {name}")
        shape = [1] * y.ndim
        shape[pos] = n
        before = (jnp.arange(n) < C.axis_index(split)).reshape(shape)
        y = y + jnp.sum(jnp.where(before, totals, jnp.zeros((), totals.dtype)), axis=pos, keepdims=True)
    return ctx.out(y, x.dims, axes, keep)


def _shift_local(v, pos, offset, wrap):
    if offset == 0:   # the value itself: a copy would be one XLA folds away (and explain must see as one)
        return v
    if wrap:
        return jnp.roll(v, offset, axis=pos)
    n = v.shape[pos]
    if offset >= 0:
        body = jax.lax.slice_in_dim(v, 0, n - offset, axis=pos)
        widths = [(offset, 0) if i == pos else (0, 0) for i in range(v.ndim)]
    else:
        body = jax.lax.slice_in_dim(v, -offset, n, axis=pos)
        widths = [(0, -offset) if i == pos else (0, 0) for i in range(v.ndim)]
    return jnp.pad(body, widths)


@op("shift", gathers=True)
def shift(ctx, x, dim, offset: int, wrap: bool = False) -> NamedArray:
    """``y[i] = x[i - offset]`` along ``dim``, zero-filled (cyclic with ``wrap=True``)."""
    x = as_named(ctx, x)
    name = one_dim(ctx, x, dim, "shift dim")
    size = x.dims[name].size
    if not isinstance(offset, int):
        raise ShapeError(f"{where_(ctx)}: shift offset must be a Python int, got {offset!r}")
    if wrap:
        offset %= size
    elif abs(offset) >= size:
        raise ShapeError(f"{where_(ctx)}: shift by {offset} along {name}:{size} leaves nothing; "
                         f"use |offset| < {size}, or wrap=True for a cyclic shift")
    axes = ctx.plan(x.dims, [x], keep_pending=ctx.pending(x))
    held = dict(zip(x.names, ctx.placement(x).axes)) if ctx.explicit else axes
    if not wrap and offset and not held[name] and not axes[name] and axes != held and not ctx.pending(x) \
            and not ctx.relaid(x, tuple(axes[n] for n in x.names)):
        # x would move first because the result moves later (rule 1), but no other op reads that
        # copy: the result moves by the rows that stay (relayout's pieces), fewer bytes than x
        axes = held
    if not ctx.pending(x) and whole_copy_made(ctx, x, axes, name):
        axes[name] = ()   # a copy holding the dim whole is made anyway (top_k): read it, no rows move
    keep = ctx.pending(x) - {a for a in axes[name]}
    vary = ctx.vary(axes.values(), [x], keep, out_size=x.size)
    pos = x.names.index(name)
    kept = size - abs(offset)   # rows that stay (the rest are zeros)
    if not wrap and offset:   # the result whole, x held split: gather only the rows that stay
        rows = rows_gathered(ctx, x, axes, name, max(0, -offset), max(0, -offset) + kept, vary, keep)
        if rows is not None:
            y = ctx.out(jnp.pad(rows, [(max(offset, 0), max(-offset, 0)) if k == pos else (0, 0)
                                       for k in range(rows.ndim)]), x.dims, axes, keep)
            body = ctx.part(rows, Shape(Dim(name, kept) if d.name == name else d for d in x.dims), y)
            return ctx.pieces(y, name, [(body, max(offset, 0))])
    local = ctx.local(x, axes, vary, keep_pending=keep)
    split = axes[name]
    if not split or offset == 0:
        y = ctx.out(_shift_local(local, pos, offset, wrap), x.dims, axes, keep)
        if wrap or offset == 0:
            return y
        # the rows that stay, relaid alone (relayout's pieces)
        body = jax.lax.slice_in_dim(local, max(0, -offset), max(0, -offset) + kept, axis=pos)
        body = ctx.part(body, Shape(Dim(name, kept) if d.name == name else d for d in x.dims), y)
        return ctx.pieces(y, name, [(body, max(offset, 0))])
    n = ctx.axes_size(split)
    block = size // n
    q, r = divmod(offset, block)

    def moved(v, distance, tensor):
        pairs = [(s, (s + distance) % n if wrap else s + distance) for s in range(n)
                 if wrap or 0 <= s + distance < n]
        pairs = [(s, t) for s, t in pairs if s != t]
        if not pairs:  # every device keeps its own block, or every block leaves the dim
            keeps = distance % n == 0 if wrap else distance == 0
            return v if keeps else jnp.zeros_like(v)
        return C.ppermute(ctx, v, split, pairs, tensor)

    head = jax.lax.slice_in_dim(local, 0, block - r, axis=pos)       # goes to [r:block]
    y = moved(head, q, f"[{x.dims}] shift {name} by {offset}")
    if r:
        tail = jax.lax.slice_in_dim(local, block - r, block, axis=pos)  # goes to [0:r]
        y = jnp.concatenate([moved(tail, q + 1, f"[{x.dims}] shift {name} boundary"), y], axis=pos)
    return ctx.out(y, x.dims, axes, keep)
