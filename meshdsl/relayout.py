"""Relayout: move a tensor's local block from its current placement to the one an op needs.

This is where the rewriter table of DESIGN.md lives. For each mesh axis ``a``:

======================================  =============================================
current placement -> needed             emitted
======================================  =============================================
``a`` unused -> splits dim ``e``          local slice (``take_block``), no communication
pending sum over ``a`` -> splits ``e``    ``psum_scatter`` (reduce-scatter), not psum + slice
pending sum over ``a`` -> whole           ``psum`` (all-reduce)
splits ``d`` -> splits ``e``              ``all_to_all``
splits ``d`` -> unused                    ``all_gather``
======================================  =============================================

Steps run in the order that moves the fewest bytes: local slices first (less data), then pending
sums are reduced, then splits move (all-to-all), then dims are gathered, then the remaining local
slices. Gathers produce a value typed *invariant* over the axis unless the consuming op varies over
it anyway (``vary``), which decides whether the backward pass reduce-scatters or only slices.

Results are cached per (source value, target) for the current jax trace: three einsums reading one
activation relay it once, and its cotangent is reduced once.
"""

from __future__ import annotations

from . import collectives as C
from .context import varying_axes

__all__ = ["relayout", "relayout_bytes"]


def relayout(ctx, x, target, vary, keep_pending):
    """Local block of NamedArray ``x`` with dim ``i`` split over ``target[i]``, the pending sums
    outside ``keep_pending`` resolved, and typed varying over ``vary``."""
    src = ctx.placement(x)
    vary = vary | {a for axes in target for a in axes} | (src.pending & keep_pending)
    if src.axes == tuple(target) and src.pending <= keep_pending and vary <= varying_axes(x._array):
        return x._array
    key = ("relayout", src, tuple(target), vary, keep_pending)
    return ctx.cached(x._array, key, lambda: _relayout(ctx, x, src, tuple(target), vary, keep_pending))


def _relayout(ctx, x, src, target, vary, keep_pending):
    arr = x._array
    cur = [list(axes) for axes in src.axes]
    pend = set(src.pending) - set(keep_pending)
    names = x.names
    source = ctx.made_by(x._array)
    shape_txt = f"[{x.dims}]" + (f" from {source}" if source else "")

    def owner(a):
        for i, axes in enumerate(cur):
            if a in axes:
                return i
        return None

    def next_axis(i):
        """The axis dim ``i`` gains next, if its current axes are a prefix of its target."""
        k = len(cur[i])
        if cur[i] == list(target[i][:k]) and k < len(target[i]):
            return target[i][k]
        return None

    def slice_free_axes():
        nonlocal arr
        progress = True
        while progress:
            progress = False
            for i in range(len(cur)):
                a = next_axis(i)
                if a is not None and owner(a) is None and a not in pend and a not in keep_pending:
                    arr = C.take_block(ctx, arr, (a,), i, f"{shape_txt} slice {names[i]}")
                    cur[i].append(a)
                    progress = True

    # 1. Local slices that are possible now: less data for everything after.
    slice_free_axes()

    # 2. Pending sums: reduce-scatter onto a dim that needs the axis next, else all-reduce.
    for i in range(len(cur)):
        run = []
        k = len(cur[i])
        if cur[i] == list(target[i][:k]):
            while k < len(target[i]) and target[i][k] in pend and owner(target[i][k]) is None:
                run.append(target[i][k])
                k += 1
        if run:
            arr = C.psum_scatter(ctx, arr, tuple(run), i, f"{shape_txt} reduce-scatter onto {names[i]}")
            cur[i].extend(run)
            pend -= set(run)
    if pend:
        rest = tuple(a for a in ctx.mesh.axis_names if a in pend)
        arr = C.psum(ctx, arr, rest, f"{shape_txt} pending sum")
        pend.clear()

    # 3. Splits that must leave a dim: all-to-all where another dim takes the axis next, else gather.
    for i in range(len(cur)):
        while cur[i] != list(target[i][:len(cur[i])]):
            a = cur[i][-1]
            dest = next((j for j in range(len(cur)) if j != i and next_axis(j) == a), None)
            if dest is not None:
                arr = C.all_to_all(ctx, arr, (a,), dest, i, f"{shape_txt} move {a} {names[i]}->{names[dest]}")
                cur[i].pop()
                cur[dest].append(a)
                continue
            # Gather the longest run of trailing axes that nobody takes next, in one collective.
            p = 0
            while p < len(cur[i]) and p < len(target[i]) and cur[i][p] == target[i][p]:
                p += 1
            run = cur[i][p:]
            while len(run) > 1 and any(next_axis(j) == run[0] for j in range(len(cur)) if j != i):
                run = run[1:]
            # A run whose axes differ in type (one varying, one not) is gathered axis by axis.
            if len({a in vary for a in run}) > 1:
                run = run[-1:]
            arr = C.all_gather(ctx, arr, tuple(run), i, invariant=run[0] not in vary,
                               tensor=f"{shape_txt} gather {names[i]}")
            del cur[i][len(cur[i]) - len(run):]

    # 4. The remaining local slices.
    slice_free_axes()
    assert [tuple(c) for c in cur] == list(target), (cur, target)

    # 5. Type the block as varying over every axis the consuming op varies over.
    return C.cast(ctx, arr, tuple(a for a in ctx.mesh.axis_names if a in vary), f"{shape_txt}")


def needs_gather(ctx, x, axes_by_name) -> bool:
    """Would relaying ``x`` to ``axes_by_name`` gather some dim (a split it has that the target lacks)?"""
    pl = ctx.placement(x)
    return any(tuple(axes_by_name.get(d.name, ()))[:len(a)] != a for d, a in zip(x.dims, pl.axes))


def relayout_bytes(ctx, dims, itemsize, src_axes, src_pending, target, keep_pending=frozenset()) -> float:
    """Estimated bytes one device moves to relay a tensor of ``dims`` from ``src_axes`` (axes per
    dim, with pending sums ``src_pending``) to ``target`` (axes per dim), keeping ``keep_pending``.
    Used to choose between plans before emitting anything (ring formulas of :mod:`meshdsl.cost`)."""
    from .cost import moved_bytes
    total = itemsize
    for d in dims:
        total *= d.size
    local = total / max(1, ctx.axes_size([a for axes in src_axes for a in axes]))
    where_src = {a: i for i, axes in enumerate(src_axes) for a in axes}
    where_tgt = {a: i for i, axes in enumerate(target) for a in axes}
    moved = 0.0
    for a in ctx.mesh.axis_names:
        n = ctx.axes_size((a,))
        if a in src_pending and a not in keep_pending:
            moved += moved_bytes("reduce-scatter" if a in where_tgt else "all-reduce", local, local / n, n)
        elif a in where_src and where_tgt.get(a) != where_src[a]:
            if a in where_tgt:
                moved += moved_bytes("all-to-all", local, local, n)
            else:
                moved += moved_bytes("all-gather", local, local * n, n)
    return moved
