"""Ops that cut or join values along a dim: concat, slice, pad.

Along a dim split on mesh axes, each is the cheapest by bytes of: moving only the rows that change
owner (a window), or gathering the dim (see :func:`_cheapest_along`). A slice of a pad or concat
reads the pieces it came from. Renaming, transposing and reshaping dims: :mod:`.restructure`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from ..rewrite import collectives as C
from ..names.dims import Dim, Shape
from ..names.errors import ShapeError
from ..rewrite.relayout import relayout_bytes
from .common import align, as_named, names_in, rows_gathered, where_
from .elementwise import add
from ..names.named import NamedArray, Placement
from .registry import op

__all__ = ["concat", "slice", "pad"]


def _whole_along(ctx, x, name, keep_pending, out_size=None):
    """Plan for ``x`` with dim ``name`` whole (other dims stay where they are)."""
    axes = ctx.plan(x.dims, [x], keep_pending=keep_pending)
    axes[name] = ()
    return axes, ctx.vary(axes.values(), [x], keep_pending, out_size=out_size)


def _split_along(ctx, xs, name, keep_pending, out=None):
    """Plan keeping dim ``name`` split where every operand holds it (as the layout places it), or
    ``None``: then slice / pad / concat can move only the rows that change owner (``_window``).
    Given the result's dims ``out``, a split the layout does not make (a parameter stored split)
    is kept too - unless the previous trace says the result moves to the layout's placement
    later (returned): gathering the operand now is then the cheaper move."""
    if not ctx.explicit:
        return None
    held = {ctx.placement(x).of(x.dims, name) for x in xs}
    split = held.pop() if len(held) == 1 else ()
    if not split or split != ctx.layout_axes(name) and (out is None or ctx.result_relaid(xs, ctx.canonical(out))):
        return None
    axes = ctx.plan(xs[0].dims, xs, keep_pending=keep_pending)
    return axes if axes[name] == split else None


@functools.lru_cache(maxsize=None)
def _window_plan(n, in_size, out_size, c):
    """Static plan of ``y[j] = x[j + c]`` (``0 <= j + c < in_size``) for blocks over ``n`` devices:
    per block distance ``d``, the (source, target) pairs and the rows a source sends (as many as
    the largest piece of that distance); plus, per target block, the global row each of its rows
    reads (``g``), its source block (``src``, -1 outside ``x``) and whether it is in range."""
    ib, ob = in_size // n, out_size // n
    g = np.arange(n)[:, None] * ob + np.arange(ob)[None, :] + c
    valid = (g >= 0) & (g < in_size)
    src = np.where(valid, g // max(ib, 1), -1)
    moves = []
    for d in sorted(set((src - np.arange(n)[:, None])[valid].tolist())):
        pairs = [(s, s - d) for s in range(n) if 0 <= s - d < n and (src[s - d] == s).any()]
        moves.append((d, max(int((src[t] == s).sum()) for s, t in pairs), pairs))
    for a in (valid, g, src):
        a.setflags(write=False)   # cached: shared by every caller
    return moves, valid, g, src


def _merged(n, parts):
    """The moves of every part (``(in_size, c)`` each: ``y += x_k[j + c_k]``), grouped into as few
    ``ppermute``s as possible: moves of different distances or parts share one when no device
    sends or receives twice in it and the widest fits every member's block (a slice of a concat
    whose two pieces each move a few rows, one to the left, one to the right: one permute).
    Each group: its width and members ``(part, d, pairs)``; a group of distance 0 moves nothing."""
    plans = [_window_plan(n, size, out, c) for size, out, c in parts]
    groups = []
    for k, (moves, *_) in enumerate(plans):
        for d, width, pairs in moves:
            for grp in groups:
                members = grp[1]
                sends = {s for _, _, ps in members for s, _ in ps}
                gets = {t for _, _, ps in members for _, t in ps}
                w = max(width, grp[0])
                if d and members[0][1] and not sends & {s for s, _ in pairs} and \
                        not gets & {t for _, t in pairs} and \
                        all(w <= parts[j][0] // n for j in {k} | {m[0] for m in members}):
                    grp[0] = w
                    members.append((k, d, pairs))
                    break
            else:
                groups.append([width, [(k, d, pairs)]])
    return groups, plans


def _window_bytes(ctx, xs, name, split, out_size, shifts):
    n = ctx.axes_size(split)
    groups, _ = _merged(n, [(x.dims[name].size, out_size, c) for x, c in zip(xs, shifts)])
    x = xs[0]
    row = x.size * x.dtype.itemsize / max(1, ctx.axes_size(ctx.placement(x).split_axes())) \
        / (x.dims[name].size // n)
    return sum(width * row for width, members in groups if members[0][1])


def _gather_bytes(ctx, x, name, split):
    local = x.size * x.dtype.itemsize / max(1, ctx.axes_size(ctx.placement(x).split_axes()))
    return (ctx.axes_size(split) - 1) * local


def _cheapest_along(ctx, xs, name, keep, out_size, shifts, out=None):
    """How slice / pad / concat (``y[j] = x_k[j + shifts[k]]``) handle a dim ``name`` split over
    axes ``A``, the cheapest by bytes: ``("window", axes)``: move only the rows that change owner
    (ppermutes); ``("move", axes)``: move the split to another dim (all-to-all), work along the
    whole dim, and the result goes back by all-to-all; ``None``: gather the dim (the rule table)."""
    axes = _split_along(ctx, xs, name, keep, out)
    if axes is None:
        return None
    split = axes[name]
    n = ctx.axes_size(split)
    options = [(sum(_gather_bytes(ctx, x, name, split) for x in xs), 2, None)]
    if all(x.dims[name].size % n == 0 for x in xs) and out_size % n == 0 and out_size:
        options.append((_window_bytes(ctx, xs, name, split, out_size, shifts), 0, ("window", axes)))
    for d in xs[0].dims:
        if d.name == name or set(axes[d.name]) & set(split) or d.size % (ctx.axes_size(axes[d.name]) * n):
            continue
        alt = dict(axes, **{name: (), d.name: axes[d.name] + split})
        out_dims = Shape(Dim(name, out_size) if e.name == name else e for e in xs[0].dims)
        cost = sum(relayout_bytes(ctx, x.dims, x.dtype.itemsize, ctx.placement(x).axes, frozenset(),
                                  tuple(alt[e.name] for e in x.dims)) for x in xs)
        cost += relayout_bytes(ctx, out_dims, xs[0].dtype.itemsize, tuple(alt[e.name] for e in out_dims),
                               frozenset(), tuple(axes[e.name] for e in out_dims))
        options.append((cost, 1, ("move", alt)))
        break
    return min(options, key=lambda o: (o[0], o[1]))[2]


def _window(ctx, local, pos, split, in_size, out_size, c, tensor):
    """Local block of ``y`` (dim at ``pos`` of size ``out_size``, split over ``split`` as ``x``
    is) with ``y[j] = x[j + c]`` where ``0 <= j + c < in_size``, else 0, and the mask of those
    rows. Rows that change owner move by ``ppermute``, one per block distance (fewer where
    :func:`_merged` can share one), of only the rows the receiver needs (never the whole dim)."""
    y = _windows(ctx, [(local, in_size, c)], pos, split, out_size, tensor)
    _, valid, _, _ = _window_plan(ctx.axes_size(split), in_size, out_size, c)
    shape = [1] * local.ndim
    shape[pos] = out_size // ctx.axes_size(split)
    return y, jnp.asarray(valid)[C.axis_index(split)].reshape(shape)


def _windows(ctx, parts, pos, split, out_size, tensor):
    """``y = sum_k window(x_k)`` for parts ``(local block of x_k, its size, c_k)``, all split over
    ``split`` along ``pos``: the moves of all parts grouped into as few ppermutes as
    :func:`_merged` allows."""
    n = ctx.axes_size(split)
    me = C.axis_index(split)
    ob = out_size // n
    shape = [1] * parts[0][0].ndim
    shape[pos] = ob
    groups, plans = _merged(n, [(size, out_size, c) for _, size, c in parts])
    out = None
    for width, members in groups:
        lo = np.zeros(n, np.int32)
        part_of = np.zeros(n, np.int32)
        idx = np.zeros((n, ob), np.int32)
        mask = np.zeros((n, ob), bool)
        for k, d, pairs in members:
            ib = parts[k][1] // n
            _, _, g, src = plans[k]
            for s, t in pairs:
                sel = src[t] == s
                lo[s] = min(g[t][sel].min() - s * ib, ib - width)
                part_of[s] = k
                idx[t][sel] = g[t][sel] - s * ib - lo[s]
                mask[t][sel] = True
        win = None
        for k in sorted({m[0] for m in members}):
            w = jax.lax.dynamic_slice_in_dim(parts[k][0], jnp.asarray(lo)[me], width, axis=pos)
            win = w if win is None else jnp.where(jnp.asarray(part_of)[me] == k, w, win)
        if members[0][1]:
            ds = sorted({d for _, d, _ in members})
            win = C.ppermute(ctx, win, split, [p for *_, ps in members for p in ps],
                             f"{tensor} rows from {' and '.join(f'{d:+d}' for d in ds)} blocks")
        rows = jnp.take(win, jnp.asarray(idx)[me], axis=pos)
        rows = jnp.where(jnp.asarray(mask)[me].reshape(shape), rows, jnp.zeros((), rows.dtype))
        out = rows if out is None else out + rows
    if out is None:
        full = list(parts[0][0].shape)
        full[pos] = ob
        out = jnp.zeros(full, parts[0][0].dtype)
    return out


def _placed_along(ctx, x, name, keep, how, out_size):
    """Plan and varying axes of a slice/pad along ``name``: the cheapest option's placement
    (``how`` from :func:`_cheapest_along`), or ``name`` whole."""
    if how is None:
        return _whole_along(ctx, x, name, keep, out_size)
    axes = how[1]
    return axes, ctx.vary(axes.values(), [x], keep, out_size=out_size)


@op("concat", gathers=True)
def concat(ctx, xs, dim) -> NamedArray:
    """Concatenate along ``dim`` (same name in every operand; other dims must agree)."""
    xs = [as_named(ctx, x, f"operand {i + 1}") for i, x in enumerate(xs)]
    if not xs:
        raise ShapeError(f"{where_(ctx)}: nothing to concatenate")
    (name,) = names_in(ctx, xs[0], dim, "concat dim")
    first = xs[0]
    for i, x in enumerate(xs[1:], 2):
        if name not in x.names or {d for d in x.dims if d.name != name} != {d for d in first.dims if d.name != name}:
            raise ShapeError(f"{where_(ctx)}: operand {i} [{x.dims}] does not match operand 1 [{first.dims}] "
                             f"apart from {name!r}")
    out = Shape(Dim(name, sum(x.dims[name].size for x in xs)) if d.name == name else d for d in first.dims)
    pend = {ctx.pending(x) for x in xs}
    keep = pend.pop() if len(pend) == 1 else frozenset()
    offsets = [sum(x.dims[name].size for x in xs[:k]) for k in range(len(xs))]
    how = _cheapest_along(ctx, xs, name, keep, out[name].size, [-o for o in offsets])
    if how is not None and how[0] == "window":
        axes = how[1]
        split = axes[name]
        keep = keep - {a for ax in axes.values() for a in ax}
        vary = ctx.vary(axes.values(), xs, keep, out_size=math.prod(out.sizes))
        parts = [(align(ctx.local(x, axes, vary, keep_pending=keep), x.dims, first.dims), x.dims[name].size, -o)
                 for x, o in zip(xs, offsets)]
        y = _windows(ctx, parts, first.names.index(name), split, out[name].size, f"[{first.dims}] concat along {name}")
        return _pieces(ctx, ctx.out(y, out, axes, keep), name, list(zip(xs, offsets)))
    if how is not None:  # the split moves to another dim and back
        axes = how[1]
        keep = keep - {a for ax in axes.values() for a in ax}
        vary = ctx.vary(axes.values(), xs, keep, out_size=math.prod(out.sizes))
        local = [align(ctx.local(x, axes, vary, keep_pending=keep), x.dims, first.dims) for x in xs]
        return _pieces(ctx, ctx.out(jnp.concatenate(local, axis=first.names.index(name)), out, axes, keep), name,
                       list(zip(xs, offsets)))
    axes = ctx.plan(Shape(d for d in first.dims if d.name != name), xs, keep_pending=keep)
    axes[name] = ()
    keep = keep - {a for ax in axes.values() for a in ax}  # a dim planned over a pending axis: reduce-scatter
    vary = ctx.vary(axes.values(), xs, keep, out_size=math.prod(out.sizes))
    local = [align(ctx.local(x, axes, vary, keep_pending=keep), x.dims, first.dims) for x in xs]
    return _pieces(ctx, ctx.out(jnp.concatenate(local, axis=first.names.index(name)), out, axes, keep), name,
                   list(zip(xs, offsets)))


@op("slice", gathers=True)
def slice(ctx, x, dim, start: int, size: int) -> NamedArray:  # noqa: A001 - the op's name
    """``size`` entries of ``dim`` from ``start``; the dim keeps its name (a new size)."""
    x = as_named(ctx, x)
    (name,) = names_in(ctx, x, dim, "slice dim")
    n = x.dims[name].size
    if not (0 <= start and size >= 0 and start + size <= n):
        raise ShapeError(f"{where_(ctx)}: slice [{start}:{start + size}] is outside {name}:{n}")
    parts = ctx.padded_from(x)
    if parts is not None and parts[0] == name:
        # slice(pad(x0, before)) / slice(concat(...)) reads each piece from where it lies: one
        # window of each piece, not a move of the pieces' rows by one op and again by the slice
        pieces = [(p, o) for p, o in parts[1] if o < start + size and start < o + p.dims[name].size]
        if not pieces:   # only padding: zeros, nothing to read
            out = Shape(Dim(name, size) if d.name == name else d for d in x.dims)
            axes = ctx.canonical(out)
            local = [n // ctx.axes_size(a) for n, a in zip(out.sizes, axes)]
            return _pieces(ctx, ctx.out(jnp.zeros(local, x.dtype), out, dict(zip(out.names, axes))), name, [])
        return _windows_of(ctx, [(p, start - o) for p, o in pieces], name, size, "slice of a pad or concat")
    return _windows_of(ctx, [(x, start)], name, size, "slice")


def _windows_of(ctx, pieces, name, size, what):
    """The sum over ``pieces`` ``(x, start)`` of entries ``start .. start + size`` of ``dim``
    (zeros outside ``x``), each placed cheaply; pieces that move rows the same way share their
    ppermutes (:func:`_windows`)."""
    results, windowed = [], {}
    for x, start in pieces:
        x = _reduced_copy(ctx, x)
        n = x.dims[name].size
        keep = ctx.pending(x)
        out = Shape(Dim(name, size) if d.name == name else d for d in x.dims)
        # a split off the layout kept only where this piece's result is the op's (asked of the next result)
        how = _cheapest_along(ctx, [x], name, keep, size, [start], out if len(pieces) == 1 else None)
        axes, vary = _placed_along(ctx, x, name, keep, how, math.prod(out.sizes))
        lo, hi = max(0, start), min(n, start + size)
        rows = rows_gathered(ctx, x, axes, name, lo, hi, vary, keep) if how is None and hi > lo else None
        if rows is not None:   # the dim whole, x held split: only the rows read move
            rows = jnp.pad(rows, [(lo - start, start + size - hi) if d.name == name else (0, 0) for d in x.dims])
            results.append(ctx.out(rows, out, axes, keep))
            continue
        local = ctx.local(x, axes, vary, keep_pending=keep)
        pos = x.names.index(name)
        if how is not None and how[0] == "window":
            windowed.setdefault((tuple(sorted(axes.items())), keep), []).append((x, local, start, out))
            continue
        lo, hi = max(0, -start), max(0, start + size - n)
        if lo or hi:
            local = jnp.pad(local, [(lo, hi) if k == pos else (0, 0) for k in range(local.ndim)])
        y = jax.lax.slice_in_dim(local, start + lo, start + lo + size, axis=pos)
        results.append(ctx.out(y, out, axes, keep))
    for (placed, keep), group in windowed.items():
        axes, (first, _, _, out) = dict(placed), group[0]
        parts = [(align(local, x.dims, first.dims), x.dims[name].size, start) for x, local, start, _ in group]
        y = _windows(ctx, parts, first.names.index(name), axes[name], size, f"[{first.dims}] {what} of {name}")
        results.append(ctx.out(y, out, axes, keep))
    return functools.reduce(add, results)


def _reduced_copy(ctx, x):
    """``x``, or its copy with its pending sums reduced where this trace made that copy already
    (another reader reduced it): reading the copy moves nothing, where the window read from ``x``
    would be reduced again downstream."""
    pl = ctx.placement(x) if ctx.explicit else None
    if pl is None or not pl.pending or not ctx.relaid(x, pl.axes):
        return x
    copy = ctx.local(x, dict(zip(x.names, pl.axes)), frozenset(a for ax in pl.axes for a in ax))
    return NamedArray(copy, x.dims, is_param=x.is_param, placement=Placement(pl.axes))


@op("pad", gathers=True)
def pad(ctx, x, dim, before: int = 0, after: int = 0, value=0) -> NamedArray:
    """Pad ``dim`` with ``before``/``after`` entries of ``value``; the dim keeps its name."""
    x = as_named(ctx, x)
    (name,) = names_in(ctx, x, dim, "pad dim")
    if before < 0 or after < 0:
        raise ShapeError(f"{where_(ctx)}: pad widths must be >= 0, got {before}, {after}")
    keep = ctx.pending(x) if value == 0 else frozenset()
    widths = [(before, after) if d.name == name else (0, 0) for d in x.dims]
    out = Shape(Dim(name, d.size + before + after) if d.name == name else d for d in x.dims)
    how = _cheapest_along(ctx, [x], name, keep, out[name].size, [-before], out)
    axes, vary = _placed_along(ctx, x, name, keep, how, math.prod(out.sizes))
    local = ctx.local(x, axes, vary, keep_pending=keep)
    if how is not None and how[0] == "window":
        y, inside = _window(ctx, local, x.names.index(name), axes[name], x.dims[name].size, out[name].size,
                            -before, f"[{x.dims}] pad of {name}")
        if value != 0:
            y = jnp.where(inside, y, jnp.asarray(value, y.dtype))
        return _pieces(ctx, ctx.out(y, out, axes, keep), name, [(x, before)], value)
    return _pieces(ctx, ctx.out(jnp.pad(local, widths, constant_values=value), out, axes, keep), name,
                   [(x, before)], value)


def _pieces(ctx, y, name, pieces, value=0):
    """Remember that ``y`` is ``pieces`` ((operand, offset) along ``name``), zeros elsewhere."""
    return ctx.pieces(y, name, pieces) if isinstance(value, (int, float)) and value == 0 else y
