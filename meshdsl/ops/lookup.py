"""``md.take``: rows of a table picked by integer ids (an embedding lookup).

Over a table dim split on mesh axis ``a`` each device looks up the rows it holds, zeros
elsewhere: a pending partial sum over ``a`` (Megatron's vocab-parallel embedding). Where the
lookup runs is chosen by bytes, the result brought to the layout's placement included, among:

* the plan (``ctx.plan``: the layout decides where operands disagree);
* the ids keep their splits and the table's dim gives those axes up (the table is gathered);
* the table stays where it is and the ids give its axes up (few ids into a large table: the ids
  are gathered, each device looks up the rows it holds, the rows are reduce-scattered; a table
  split on another dim looks up its columns of every row, and the rows move by all-to-all);
* the table is gathered over the axes the ids are split on and stays split over the others,
  whatever their order: ``take(t[a:x+y], ids[b:x])`` gathers ``t`` over ``x`` only (each device
  then holds every ``y``-th block) and the rows found are summed over ``y`` (gspmd's choice).

With ``param_gather="auto"`` a table stored split on its other dim (ZeRO-3's ``d_model:data``) is
not gathered when moving the ids and rows is cheaper: the ids are gathered, each device looks up
its columns of every row, and one all-to-all moves the rows where the plan wants them.
"""

from __future__ import annotations

import jax.numpy as jnp

from ..rewrite import collectives as C
from ..names.dims import Dim, Shape
from ..names.errors import LayoutError, ShapeError
from ..names.named import NamedArray
from ..rewrite.relayout import relayout_bytes
from .common import align, as_named, block_offset, decided, one_dim, where_
from .registry import op
from .restructure import rename

__all__ = ["take"]


@op("take", gathers=True, swaps=True)
def take(ctx, table, ids, dim) -> NamedArray:
    """Rows of ``table`` along ``dim`` picked by integer ``ids``: dims are ids' dims, then the
    table's other dims. Over a split ``dim`` the result is a pending partial sum.

    Ids index numpy-style: an id in ``[-size, 0)`` counts from the end (``-1`` is the last row);
    an id outside ``[-size, size)`` gives a row of zeros. Every layout, and the unsharded run,
    gives the same values. ``ids`` may carry a dim named like ``dim`` (``out[b, v, e] =
    table[ids[b, v], e]``)."""
    table = as_named(ctx, table, "table")
    ids = as_named(ctx, ids, "ids")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ShapeError(f"{where_(ctx)}: ids [{ids.dims}] are {ids.dtype}; take needs integer ids "
                         "(ids.astype(jnp.int32))")
    name = one_dim(ctx, table, dim, "take dim")
    if name in ids.names:  # the ids' own dim of that name: look up under another name, rename back
        inner = f"{name}_ids_"
        while inner in ids.names or inner in table.names:
            inner += "_"
        return rename(_lookup(ctx, table, rename(ids, {name: inner}), name, {inner: name}), {inner: name})
    return _lookup(ctx, table, ids, name, {})


def _lookup(ctx, table, ids, name, renamed) -> NamedArray:
    """``take`` along ``name``; ``renamed``: dims of the result to be renamed afterwards (placed
    by the layout as their new names)."""
    rest = [d for d in table.dims if d.name != name]
    clash = [d.name for d in rest if d.name in ids.names]
    if clash:
        raise ShapeError(f"{where_(ctx)}: ids [{ids.dims}] and table [{table.dims}] share dims {clash}; "
                         "rename one side")
    out = Shape((*ids.dims, *rest))
    space = Shape((*out, table.dims[name]))
    cost = _cost(ctx, table, ids, name, out, renamed)
    plans, part = [ctx.plan(space, [table, ids])], None
    if cost is not None:   # fewest bytes first (the rule's own choice), the layout's first of equals
        plans = _lookup_plans(ctx, table, ids, name, plans[0])
        part = _gathered_part(ctx, table, ids, name)
        plans = [p for _, _, p in sorted([(cost(p), k, p) for k, p in enumerate(plans)] +
                                         ([(cost(part[0], part[1]), len(plans), part)] if part is not None else []),
                                         key=lambda t: t[:2])]
    target = decided(ctx, plans)
    if target is part:
        return _lookup_part(ctx, table, ids, name, out, *part)
    out_axes = [target[d.name] for d in out]
    # A table stored split on a row dim may stay there (param_gather="auto"): look up there, move the rows.
    axes = ctx.params.place(ctx, space, [table, ids], target, lambda p: relayout_bytes(
        ctx, out, table.dtype.itemsize, [p[d.name] for d in out], frozenset(p[name]), out_axes,
        frozenset(target[name])))
    vary = ctx.vary(axes.values(), [table, ids])
    t_local = ctx.local(table, axes, vary)
    i_local = ctx.local(ids, axes, vary)
    split = axes[name]
    size = table.dims[name].size
    i_local = jnp.where(i_local < 0, i_local + size, i_local)  # numpy-style negative ids
    block = size // ctx.axes_size(split)
    rel = i_local - block_offset(split, block).astype(i_local.dtype) if split else i_local
    inside = (rel >= 0) & (rel < block)  # rows this device holds; ids out of range: zeros
    result = ctx.out(_rows(table, ids, name, out, t_local, rel, inside, block), out, axes, frozenset(split))
    if axes is target:
        return result
    pending = frozenset(target[name])
    return ctx.out(ctx.local(result, target, vary, keep_pending=pending), out, target, pending)


def _rows(table, ids, name, out, t_local, rel, inside, block):
    """The rows at local positions ``rel`` of ``t_local`` where ``inside``, zeros elsewhere, as
    ``out``'s local block."""
    pos = table.names.index(name)
    rows = jnp.take(t_local, jnp.clip(rel, 0, block - 1), axis=pos)
    rest = len(table.dims) - 1
    mask = jnp.expand_dims(inside, tuple(range(pos)) + tuple(range(pos + ids.ndim, rest + ids.ndim)))
    rows = jnp.where(mask, rows, jnp.zeros((), rows.dtype))
    got = Shape((*table.dims[:pos], *ids.dims, *table.dims[pos + 1:]))
    return align(rows, got, out)


def _gathered_part(ctx, table, ids, name):
    """The fourth plan, or ``None``: the ids keep their splits, the table is gathered along
    ``name`` over the axes the ids are split on and stays split over the others, whatever their
    order (``t[a:x+y]``, ``ids[b:x]``: gathered over x, each device holds every y-th block).
    ``(plan, bytes the gather moves, axes gathered, axes kept)``."""
    tp, ip = ctx.placement(table), ctx.placement(ids)
    if table.is_param or tp.pending or ip.pending:
        return None
    held = dict(zip(ids.names, ip.axes))
    taken = {a for axes in held.values() for a in axes}
    have = tp.of(table.dims, name)
    gathered = tuple(a for a in have if a in taken)
    kept = tuple(a for a in have if a not in taken)
    if not gathered or not kept:
        return None   # all or nothing gathered: one of the other plans
    plan = {**dict(zip(table.names, tp.axes)), **held, name: kept}
    if not _distinct(plan):
        return None
    local = table.size * table.dtype.itemsize / ctx.axes_size(tp.split_axes())
    return plan, local * (ctx.axes_size(gathered) - 1), gathered, kept


def _lookup_part(ctx, table, ids, name, out, plan, moved, gathered, kept) -> NamedArray:
    """``take`` with the table gathered over ``gathered`` only (:func:`_gathered_part`): a row
    is on this device if its block's index digits on the ``kept`` axes are this device's; its
    local position is its block's digits on the ``gathered`` axes, then its offset in the block.
    The rows are a pending sum over ``kept``."""
    vary = ctx.vary(plan.values(), [table, ids])
    here = dict(zip(table.names, ctx.placement(table).axes))
    pos = table.names.index(name)
    t_local = C.all_gather(ctx, ctx.local(table, here, vary), gathered, pos, invariant=False,
                           tensor=f"[{table.dims}] gather {name} over the ids' axes")
    ids_local = ctx.local(ids, plan, vary)
    size = table.dims[name].size
    block = size // ctx.axes_size(here[name])
    g = jnp.where(ids_local < 0, ids_local + size, ids_local)  # numpy-style negative ids
    inside = (g >= 0) & (g < size)
    q, lin, stride = g // block, jnp.zeros_like(g), 1
    for a in reversed(here[name]):   # the block index's digits, minor first
        n = ctx.axes_size((a,))
        q, digit = q // n, q % n
        if a in kept:
            inside = inside & (digit == C.axis_index((a,)))
        else:
            lin, stride = lin + digit * stride, stride * n
    rel = lin * block + g % block
    rows = _rows(table, ids, name, out, t_local, rel, inside, block * ctx.axes_size(gathered))
    return ctx.out(rows, out, plan, frozenset(kept))


def _cost(ctx, table, ids, name, out, renamed):
    """Bytes of a lookup plan, the result brought to the layout's placement included:
    ``cost(plan)``, or ``cost(plan, table_bytes)`` where the table moves otherwise than by
    relayout. ``None`` where no plan is chosen by bytes (gspmd; no valid placement of the result:
    the error comes where the result is made)."""
    if not ctx.explicit:
        return None
    try:   # the layout's placement of the result, under the names it will have
        wanted = ctx.canonical(Shape(Dim(renamed.get(d.name, d.name), d.size) for d in out))
    except LayoutError:
        return None

    def cost(p, table_bytes=None):
        relaid = (table, ids) if table_bytes is None else (ids,)
        moved = sum(relayout_bytes(ctx, x.dims, x.dtype.itemsize, ctx.placement(x).axes, ctx.pending(x),
                                   [p[d.name] for d in x.dims]) for x in relaid)
        return (moved + (table_bytes or 0.0) + relayout_bytes(
            ctx, out, table.dtype.itemsize, [p[d.name] for d in out], frozenset(p[name]), wanted))
    return cost


def _lookup_plans(ctx, table, ids, name, target) -> list:
    """The plans a lookup may take (with the gathered part of :func:`_gathered_part`, one decision
    point the planner takes by the step's time; the rule's own: fewest bytes): ``target``; the ids keep their splits and the
    table's dim gives those mesh axes up (gathered: ``take(table[b:x], ids[b:x])`` gathers the
    table once rather than gathering the ids and reduce-scattering the rows); or the table stays
    where it is and the ids give its axes up (``take(table[e:x], ids[c:x])`` with few ids: the ids
    are gathered, each device looks up the rows it holds, and the rows are reduce-scattered onto
    ``c``; a table split on another dim looks up its columns of every row, and the rows move by
    all-to-all)."""
    held = {d.name: a for d, a in zip(ids.dims, ctx.placement(ids).axes)}
    alt = {**target, **held}
    taken = {a for axes in held.values() for a in axes}
    alt[name] = tuple(a for a in target[name] if a not in taken)
    try:   # where the table is (a parameter: where the layout computes with it; the policy moves it)
        tab = dict(zip(table.names, ctx.canonical(table.dims) if table.is_param else ctx.placement(table).axes))
    except LayoutError:
        tab = {}
    used = {a for axes in tab.values() for a in axes}
    stay = {n: tab[n] if n in tab else _before(axes, used) for n, axes in target.items()} if tab else target
    return [target, *(o for o in (alt, stay) if o != target and _distinct(o))]


def _before(axes, taken):
    """``axes`` up to the first one in ``taken`` (a dim split over a prefix of its axes)."""
    for k, a in enumerate(axes):
        if a in taken:
            return tuple(axes[:k])
    return tuple(axes)


def _distinct(plan) -> bool:
    used = [a for axes in plan.values() for a in axes]
    return len(used) == len(set(used))
