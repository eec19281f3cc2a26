"""Where an op computes: the iteration-space placement.

Rule of thumb, applied by every op the same way so that communication is predictable:

1. A dim keeps the split its operands already agree on (no data moves) - unless an elementwise
   op's result is larger in bytes than those operands (a broadcast, a cast to a wider type), the
   layout places the dim otherwise and the result moves there later (returned:
   a decision point of the planner, ``ctx.result_relaid``): the operands move there first.
   An op over its one operand's dims (a shift, a cache write, a unary elementwise op) does the
   same when its result moves there later and is no smaller: the same bytes, and the moved copy is
   shared by every op reading it.
2. Where operands disagree on a dim, or hold it nowhere, the layout decides (``Layout.axes``);
   elementwise ops (``cheapest=True``) instead take the operands' placement that moves the fewest
   bytes (a replicated gradient meeting optimizer state stored split is sliced, not the state
   gathered: ZeRO-1/2 updates stay in the storage layout).
3. A pending sum the op must reduce goes where the layout wants it: a dim the layout splits over
   the pending axis takes the layout's placement, so the sum is reduce-scattered, not all-reduced.
4. Where two dims claim one mesh axis, dims not placed by the layout give way first; if two dims
   the layout places both claim it (only possible inside an op, e.g. a contracted and a kept dim
   of an einsum), the op's ``prefer`` order decides and the others are left whole on that axis.

5. An op whose operands all have a copy in the layout's placement already (a parameter stored
   split that another op gathered, a value gathered for the return) computes there: nothing moves
   now or later.

6. A parameter stored split (``params=`` rules) is all-gathered where an op needs it whole; the
   ``param_gather`` policy (:mod:`meshdsl.rewrite.param_gather`) may instead leave it where it is stored
   and move the other operands and the result.

Operands are then relaid (:mod:`meshdsl.rewrite.relayout`) to the chosen placement. A value keeps its
current placement as long as no op needs it elsewhere; at the end of ``md.lower`` every output is
brought to the layout's placement.
"""

from __future__ import annotations

from collections import defaultdict

__all__ = ["plan", "propose", "settle"]


def plan(ctx, dims, operands, *, prefer=(), keep_pending=frozenset(), cheapest=False,
         out_dtype=None) -> dict[str, tuple]:
    """Mesh axes per dim name of the iteration space ``dims`` for an op over ``operands`` that
    keeps the pending sums over ``keep_pending`` (linear ops) and reduces the others; the result
    is of ``out_dtype`` (default: the widest operand's)."""
    canonical = {d.name: ctx.layout_axes(d.name) for d in dims}
    resolving = set().union(*(ctx.pending(x) for x in operands)) - set(keep_pending)
    proposal, whole_now = {}, []
    for d in dims:
        holders = [x for x in operands if d.name in x.names]
        held = {ctx.placement(x).of(x.dims, d.name) for x in holders}
        if len(held) == 1:
            proposal[d.name] = held.pop()
            if (cheapest or _in_place(dims, operands)) and _cheaper_whole_now(
                    ctx, dims, holders, proposal[d.name], canonical[d.name], out_dtype,
                    strict=not _in_place(dims, operands)):
                whole_now.append(d.name)
        elif cheapest and held:
            options = [canonical[d.name], *sorted(held - {canonical[d.name]})]
            cost = {c: sum(_gather_bytes(ctx, x, d.name, c) for x in holders) for c in options}
            proposal[d.name] = min(options, key=cost.get)
            if cost[canonical[d.name]] - cost[proposal[d.name]] < _result_move_bytes(
                    ctx, dims, operands, out_dtype, proposal[d.name], canonical[d.name]):
                whole_now.append(d.name)   # the few bytes now, if the larger result would move later
        else:
            proposal[d.name] = canonical[d.name]
        if resolving & set(canonical[d.name]):
            proposal[d.name] = canonical[d.name]
    # Moving the operands now is cheaper than moving the (larger) result later - if the result
    # does move to the layout's placement later (returned, say), as the previous trace tells. A
    # result only summed (a loss) never moves: it stays where its operands are.
    # Every dim then: the others only slice locally, and a split leaving one dim for another that
    # the layout splits moves by all-to-all, not by a gather.
    if whole_now and ctx.result_relaid(operands, tuple(canonical[d.name] for d in dims)):
        proposal = dict(canonical)
    if proposal != canonical and _free_at(ctx, operands, canonical, keep_pending):
        return canonical
    return settle(proposal, canonical, [d.name for d in dims], prefer)


def propose(ctx, dims, placed, *, prefer=()) -> dict[str, tuple]:
    """Rules 1, 2 and 4 alone, for operands given as ``(dims, axes per dim)`` pairs that need not
    exist yet: where an op over them would compute, decision points aside. A cost estimate of another
    plan (an einsum summing an operand first plans its contraction over the sum)."""
    canonical = {d.name: ctx.layout_axes(d.name) for d in dims}
    proposal = {}
    for d in dims:
        held = {axes for names, placement in placed for n, axes in zip(names, placement) if n == d.name}
        proposal[d.name] = held.pop() if len(held) == 1 else canonical[d.name]
    return settle(proposal, canonical, [d.name for d in dims], prefer)


def settle(proposal, canonical, names, prefer=()) -> dict[str, tuple]:
    """Rule 4: where dims of ``proposal`` claim one mesh axis, those off the layout's placement
    return to it; then the ``prefer`` order (then ``names`` order) decides, and the others are
    left whole from that axis on."""
    proposal = dict(proposal)
    order = {n: i for i, n in enumerate(names)}
    while True:
        owners = defaultdict(list)
        for name, axes in proposal.items():
            for a in axes:
                owners[a].append(name)
        clashes = [names for names in owners.values() if len(names) > 1]
        if not clashes:
            return proposal
        changed = False
        for names in clashes:
            for n in names:
                if proposal[n] != canonical[n]:
                    proposal[n] = canonical[n]
                    changed = True
        if changed:
            continue
        for axis, names in owners.items():
            if len(names) < 2:
                continue
            ranked = sorted(names, key=lambda n: (n not in prefer, order[n]))
            for n in ranked[1:]:
                axes = proposal[n]
                if axis in axes:
                    proposal[n] = axes[:axes.index(axis)]


def _free_at(ctx, operands, canonical, keep_pending) -> bool:
    """Can every operand be read in the layout's placement without moving anything: already
    there, or a copy placed so already made (a parameter stored split that another op gathered)?
    The op then computes there: the result needs no move later either."""
    moved = False
    if any(n not in canonical for x in operands for n in x.names):
        return False   # the op plans only some of its operands' dims (concat: not the joined one)
    for x in operands:
        target = tuple(canonical[d.name] for d in x.dims)
        pl = ctx.placement(x)
        if pl.axes == target and pl.pending <= set(keep_pending):
            continue
        if not ctx.relaid(x, target):
            return False
        moved = True
    return moved


def _in_place(dims, operands) -> bool:
    """One operand over the op's own dims (a shift, a cache write, a cumsum): the result is the
    operand's size."""
    return len(operands) == 1 and set(operands[0].names) == {d.name for d in dims}


def _cheaper_whole_now(ctx, dims, holders, held, canonical, out_dtype, *, strict=True) -> bool:
    """An elementwise op whose result is larger than the operands holding a dim split off the
    layout's placement (a parameter stored split broadcast against another value, a boolean cast
    to float): moving those operands to the layout's placement now moves fewer bytes than moving
    the result there later.
    ``strict=False`` (an op over its one operand's dims): the same bytes, and the copy moved now
    is shared by every op reading it (a cache write and a shift of one parameter, both returned:
    one gather, not two)."""
    if tuple(canonical[:len(held)]) == held:
        return False   # the layout's placement only splits further: a local slice
    itemsize = out_dtype.itemsize if out_dtype is not None else max(x.dtype.itemsize for x in holders)
    result = itemsize
    for d in dims:
        result *= d.size
    moved = sum(x.size * x.dtype.itemsize for x in holders)
    return moved < result if strict else moved <= result


def _result_move_bytes(ctx, dims, operands, out_dtype, held, canonical) -> float:
    """Bytes the result of an elementwise op over ``dims`` gathers when a dim computed split on
    ``held`` moves to the layout's ``canonical`` axes later (0 if that only slices)."""
    if tuple(canonical[:len(held)]) == held:
        return 0.0
    itemsize = out_dtype.itemsize if out_dtype is not None else max(x.dtype.itemsize for x in operands)
    result = itemsize
    for d in dims:
        result *= d.size
    lost = [a for a in held if a not in canonical]
    return (ctx.axes_size(lost) - 1) * result / ctx.axes_size(held)


def _gather_bytes(ctx, x, name, target) -> float:
    """Bytes ``x`` would all-gather to hold dim ``name`` split over ``target`` (0 if it only slices)."""
    have = ctx.placement(x).of(x.dims, name)
    if tuple(target[:len(have)]) == have:
        return 0.0
    lost = [a for a in have if a not in target]
    local = x.size * x.dtype.itemsize / max(1, ctx.axes_size(ctx.placement(x).split_axes()))
    return (ctx.axes_size(lost) - 1) * local
