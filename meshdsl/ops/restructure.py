"""Ops that put the same elements under other dims: rename, transpose, reshape.

``rename`` and the name-keeping parts of ``reshape`` move no data: a split travels with its dim to
the new name. If the layout places the new name elsewhere, the next op that needs it there moves
it: a split moving from one dim to another is one ``all_to_all`` (MoE dispatch), a split that must
go is an ``all_gather`` (sequence parallel entering attention), and a pending sum meeting a split
name is a reduce-scatter (sequence parallel leaving the MLP).

``reshape`` merges and splits dims in row-major order (Mesh-TF semantics). A merged or split group
is split on the mesh axes of its first dim: those of the first old dim (no move now) or those the
layout gives the first new dim (a move now instead of later), whichever moves fewer bytes; where
neither divides the sizes, the group is gathered first. A dim split over several axes spreads
them over the dims it is split into, and dims merged keep their axes, when every element stays
where it is (:func:`_spread`). Axes are factor axes (:mod:`meshdsl.names.mesh`), so a dim split over more
devices than a new leading dim has - ``d`` over ``x:8`` into ``p:2 q:4`` - spreads too: ``p`` over
the major factor of ``x``, ``q`` over the other two; nothing moves.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from ..names.dims import Dim, Shape, parse_dims
from ..names.errors import ShapeError, suggest
from ..names.named import NamedArray
from ..rewrite.relayout import relayout_bytes
from .common import align, as_named, decided, names_in, where_
from .registry import op

__all__ = ["rename", "transpose", "reshape"]


def _renamed_axes(ctx, x, mapping):
    pl = ctx.placement(x)
    if pl is None:
        return None, frozenset()
    return {mapping.get(d.name, d.name): a for d, a in zip(x.dims, pl.axes)}, pl.pending


@op("rename", gathers=True)
def rename(ctx, x, mapping, new=None) -> NamedArray:
    """Rename dims: ``md.rename(x, {"seq": "kv_seq", ...})`` (or ``md.rename(x, "seq", "kv_seq")``)."""
    x = as_named(ctx, x)
    if isinstance(mapping, str) and new is not None:
        mapping = {mapping: new}
    if not isinstance(mapping, dict):
        raise ShapeError(f"{where_(ctx)}: expected a dict {{old: new}}, got {mapping!r}")
    for old, new_name in mapping.items():
        if old not in x.names:
            raise ShapeError(f"{where_(ctx)}: cannot rename {old!r}: not a dim of [{x.dims}]{suggest(old, x.names)}")
        if not isinstance(new_name, str) or not new_name.isidentifier():
            raise ShapeError(f"{where_(ctx)}: new name {new_name!r} for {old!r} is not an identifier")
    names = [mapping.get(n, n) for n in x.names]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ShapeError(f"{where_(ctx)}: renaming [{x.dims}] with {mapping} gives two dims named {dupes[0]!r}")
    dims = Shape(Dim(mapping.get(d.name, d.name), d.size) for d in x.dims)
    for old, d in zip(x.dims, dims):
        ctx.same_rows(old, d)
    axes, pending = _renamed_axes(ctx, x, mapping)
    return ctx.out(x.raw, dims, axes, pending, is_param=x.is_param)


@op("transpose", gathers=True)
def transpose(ctx, x, dims) -> NamedArray:
    """Reorder the dims of ``x`` (every dim listed once); no data moves between devices."""
    x = as_named(ctx, x)
    order = names_in(ctx, x, dims, "new dim order")
    if set(order) != set(x.names):
        missing = [n for n in x.names if n not in order]
        raise ShapeError(f"{where_(ctx)}: new dim order {list(order)} misses {missing} of [{x.dims}]")
    new = Shape(x.dims[n] for n in order)
    axes, pending = _renamed_axes(ctx, x, {})
    return ctx.out(align(x.raw, x.dims, new), new, axes, pending, is_param=x.is_param)


def _groups(old, new):
    """Pair runs of old and new dims whose sizes multiply to the same total (row-major). A dim of
    size 1 (added or removed) is a group of its own: it moves no data, and the dims around it keep
    their placement (dropping a decode step's ``seq:1`` gathers nothing)."""
    groups, i, j = [], 0, 0
    while i < len(old) or j < len(new):
        if i < len(old) and old[i].size == 1 and not (j < len(new) and new[j].name == old[i].name):
            groups.append(([old[i]], []))
            i += 1
            continue
        if j < len(new) and new[j].size == 1 and not (i < len(old) and old[i].name == new[j].name):
            groups.append(([], [new[j]]))
            j += 1
            continue
        gi, gj, po, pn = [], [], 1, 1
        if i < len(old):
            gi.append(old[i])
            po, i = po * old[i].size, i + 1
        if j < len(new):
            gj.append(new[j])
            pn, j = pn * new[j].size, j + 1
        while po != pn:
            if po < pn and i < len(old):
                gi.append(old[i])
                po, i = po * old[i].size, i + 1
            elif pn < po and j < len(new):
                gj.append(new[j])
                pn, j = pn * new[j].size, j + 1
            else:
                break
        groups.append((gi, gj))
    return groups


@op("reshape", gathers=True)
def reshape(ctx, x, dims) -> NamedArray:
    """Merge/split dims in row-major order: ``md.reshape(x, "batch seq heads:8 d_kv")``.

    A name already in ``x`` keeps its size unless written; at most one size may be left to infer.
    """
    x = as_named(ctx, x)
    specs = parse_dims(dims, what=f"{where_(ctx)}: new dims")
    sizes = [s if s is not None else (x.dims[n].size if n in x.names else None) for n, s in specs]
    unknown = [n for (n, _), s in zip(specs, sizes) if s is None]
    known = math.prod(s for s in sizes if s is not None)
    if len(unknown) > 1:
        raise ShapeError(f"{where_(ctx)}: cannot infer the sizes of {unknown}; write all but one as name:size")
    if unknown:
        if known == 0 or x.size % known:
            raise ShapeError(f"{where_(ctx)}: cannot infer {unknown[0]!r}: {x.size} elements of [{x.dims}] are "
                             f"not a multiple of {known}")
        sizes = [s if s is not None else x.size // known for s in sizes]
    new = Shape(Dim(n, s) for (n, _), s in zip(specs, sizes))
    if math.prod(sizes) != x.size:
        raise ShapeError(f"{where_(ctx)}: cannot reshape [{x.dims}] ({x.size} elements) to [{new}] "
                         f"({math.prod(sizes)} elements)")
    groups = _groups(list(x.dims), list(new))
    for old_g, new_g in groups:
        if old_g and new_g:
            ctx.same_rows(old_g[0], new_g[0])
    pl = ctx.placement(x)
    if pl is None:
        return ctx.out(jnp.reshape(x.raw, new.sizes), new, is_param=x.is_param)
    current = dict(zip(x.names, pl.axes))
    src_target, out_axes = _reshape_plan(ctx, x, new, groups, current, pl.pending)
    keep = pl.pending - {a for axes in src_target.values() for a in axes}   # reduced where a dim takes the axis
    vary = ctx.vary(src_target.values(), [x], keep, out_size=x.size)
    local = ctx.local(x, src_target, vary, keep_pending=keep)
    local_shape = [d.size // ctx.axes_size(out_axes[d.name]) for d in new]
    return ctx.out(jnp.reshape(local, local_shape), new, out_axes, keep, is_param=x.is_param)


def _reshape_plan(ctx, x, new, groups, current, pending):
    """``(axes of x's dims before, axes of the new dims after)``: a dim kept as it is keeps its
    split; a merged or split group is split on the axes of its first dim, which either stay those
    of the first old dim (no move now) or become those the layout gives the first new dim (a move
    now, none later: ``[d, b:x] -> [m:x]`` is an all-to-all of d and b, not a gather of b) or
    those of a later dim of the group, moved onto the first (``[a, b:x] -> [m]``: m split over x
    where it is made; it moves later only if it must); axes that fit none may move to a whole kept
    dim (:func:`_parked`). The rule's own choice is the cheapest by bytes, counting the result's
    move to the layout's; the others are candidates (:func:`_candidates`)."""
    def plan(layout_first, spread=False, current=current, to_first=False):
        return _plan(ctx, groups, current, layout_first, spread, to_first)

    wanted = ctx.canonical(new)   # the layout's placement of the result (a LayoutError if none)
    made: dict = {}

    def copy_made(src) -> bool:
        # a copy of x placed by src made anyway (gathered for the return, say): reading it is free
        key = tuple(src[n] for n in x.names)
        if key not in made:
            made[key] = key != tuple(current[n] for n in x.names) and not pending and ctx.relaid(x, key)
        return made[key]

    def cost(option, certain):
        # The move now, and the move of the result to the splits the layout wants (a split the
        # layout does not want is not charged, unless certain: the next ops may well use it,
        # einsums keep it).
        src, out = option
        placed = [out[d.name] for d in new]
        later = wanted if certain else [w or p for w, p in zip(wanted, placed)]
        if len({a for axes in later for a in axes}) != sum(len(axes) for axes in later):
            later = wanted
        def kept(axes):   # a pending sum over an axis the target splits a dim over is reduced there
            return pending - {a for ax in axes for a in ax}
        before = [src[n] for n in x.names]
        if any(d.size % ctx.axes_size(a) for dims, axes in ((x.dims, before), (new, placed), (new, later))
               for d, a in zip(dims, axes)):
            return math.inf   # a placement that cannot divide a dim: not an option
        now = 0 if copy_made(src) else relayout_bytes(ctx, x.dims, x.dtype.itemsize, [current[n] for n in x.names],
                                                       pending, before, kept(before))
        return now + relayout_bytes(ctx, new, x.dtype.itemsize, placed, kept(before), later, kept(later))

    def with_parked(options):
        options = options + [o for o in (_parked(ctx, x, groups, current, o) for o in options) if o is not None]
        whole = dict(zip(x.names, ctx.canonical(x.dims)))   # x as the layout places it: a copy made anyway?
        if copy_made(whole):
            options += [o for o in (plan(False, current=whole), plan(False, spread=True, current=whole)) if o is not None]
        return options

    safe = [o for o in (plan(False), plan(True), plan(False, spread=True), _into_layout(ctx, groups, current)) if o]
    bet = plan(False, to_first=True)   # see _plan
    options = with_parked(safe + ([bet] if bet is not None and bet not in safe else []))
    # Ties: hoping, the option leaving less to move if the result moves (reading a copy of x made
    # anyway); sure, the one moving x now: other ops reading x share that copy.
    hoping = lambda options: min(options, key=lambda o: (cost(o, False), cost(o, True)))  # noqa: E731
    hopeful = hoping(options)
    sure = min(options, key=lambda o: (cost(o, True), all(o[0][n] == current[n] for n in x.names)))
    # Relaid later (returned)? A split the layout does not want then moves; betting it stays is a decision point.
    own = sure if hopeful is not sure and ctx.result_relaid([x], wanted) else \
        hoping(with_parked(safe)) if hopeful is bet and ctx.option(2) else hopeful
    return decided(ctx, _candidates(own, options, cost))


def _candidates(own, options, cost) -> list:
    """``own`` (the rule's choice), then each other of ``options`` that divides the dims: the
    candidates of a decision point the planner takes by the step's time."""
    ranked = [own]
    for o in options:
        if o not in ranked and cost(o, True) < math.inf:
            ranked.append(o)
    return ranked


def _plan(ctx, groups, current, layout_first, spread, to_first=False):
    """One candidate of :func:`_reshape_plan` starting from ``current`` (axes per dim of x).
    ``to_first``: a merged group whose first dim is whole takes the axes of the first of its dims
    that is split (``[a, b:x] -> [m]``: an all-to-all of b's split onto a, then m is split over x
    where it is made, instead of a gather of b)."""
    src, out = {}, {}
    for old_g, new_g in groups:
        if len(old_g) == 1 and len(new_g) == 1:
            src[old_g[0].name] = out[new_g[0].name] = current[old_g[0].name]
            continue
        spreads = _spread(ctx, old_g, new_g, current) if spread else None
        if spreads is not None:
            src.update((d.name, current[d.name]) for d in old_g)
            out.update((d.name, axes) for d, axes in zip(new_g, spreads))
            continue
        major = current[old_g[0].name] if old_g else ()
        if to_first and not major:
            major = next((current[d.name] for d in old_g if current[d.name]), ())
        if layout_first and old_g and new_g:
            major = ctx.layout_axes(new_g[0].name)
        if major and (not new_g or not old_g or new_g[0].size % ctx.axes_size(major)
                      or old_g[0].size % ctx.axes_size(major)):
            major = ()
        for k, d in enumerate(old_g):
            src[d.name] = major if k == 0 else ()
        for k, d in enumerate(new_g):
            out[d.name] = major if k == 0 else ()
    used = [a for axes in src.values() for a in axes]
    return (src, out) if len(used) == len(set(used)) else None


def _spread(ctx, old_g, new_g, current):
    """Axes per new dim that keep every element where it is, or ``None``. Splitting one dim:
    its axes, in order, go to the new dims, each taking the next axes while they divide what is
    left of it (``c`` over ``y:2, x:4`` into ``p:2 q:4``: ``p`` over ``y``, ``q`` over ``x``); a
    dim left partly split takes no more. Merging: leading dims split whole, then one split dim,
    then whole ones (``[p:y q:x] -> [c]``: ``c`` over ``y, x``)."""
    if len(old_g) == 1 and new_g:
        rest, spread = list(current[old_g[0].name]), []
        for d in new_g:
            taken, left = [], d.size
            while rest and left % ctx.axes_size([rest[0]]) == 0:
                left //= ctx.axes_size([rest[0]])
                taken.append(rest.pop(0))
            if rest and left != 1:
                return None   # the next axis would need part of this dim's elements
            spread.append(tuple(taken))
        return None if rest else spread
    if len(new_g) == 1 and old_g:
        merged = []
        for k, d in enumerate(old_g):
            axes = current[d.name]
            if axes and any(e.size != ctx.axes_size(current[e.name]) for e in old_g[:k]):
                return None   # a split after a dim not split whole: not one block per device
            merged += axes
        return [tuple(merged)]
    return None


def _into_layout(ctx, groups, current):
    """The result made where the layout places it, each dim split into several taking the
    layout's axes of the new dims, in order, beforehand (``d:x`` into ``p2:y q4:x``: ``d`` over
    ``y, x`` first, one redistribution, then each element is where the result wants it: the
    inverse of :func:`_spread`); dims kept stay where they are. ``None`` where a group merges."""
    src, out = {}, {}
    for old_g, new_g in groups:
        if len(old_g) != 1 or not new_g:
            return None
        if len(new_g) == 1:
            src[old_g[0].name] = out[new_g[0].name] = current[old_g[0].name]
            continue
        want = [tuple(ctx.layout_axes(d.name)) for d in new_g]
        axes = tuple(a for w in want for a in w)
        if not axes or _spread(ctx, old_g, new_g, {old_g[0].name: axes}) != want:
            return None
        src[old_g[0].name] = axes
        out.update((d.name, w) for d, w in zip(new_g, want))
    used = [a for axes in src.values() for a in axes]
    return (src, out) if len(used) == len(set(used)) else None


def _parked(ctx, x, groups, current, option):
    """``option`` with the axes a merged or split group loses (its split fits no new first dim:
    ``c`` over 8 devices into ``p:2 q:4``) moved to a dim kept as it is that is whole and
    divisible (an all-to-all before the reshape instead of a gather), or ``None``."""
    src, out = dict(option[0]), dict(option[1])
    lost = [a for old_g, new_g in groups if len(old_g) > 1 or len(new_g) > 1
            for a in (current[old_g[0].name] if old_g else ()) if a not in src[old_g[0].name]]
    if not lost:
        return None
    used = {a for axes in src.values() for a in axes}
    if used & set(lost):
        return None
    n = ctx.axes_size(lost)
    for old_g, new_g in groups:
        if len(old_g) == 1 and len(new_g) == 1 and not src[old_g[0].name] and old_g[0].size % n == 0:
            src[old_g[0].name] = out[new_g[0].name] = tuple(lost)
            return src, out
    return None
