"""Relayout: move a tensor's local block from its current placement to the one an op needs.

This is where the rewriter table (``docs/rewriter.md``) lives. For each mesh axis ``a``:

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

A value made of pieces along a dim and zeros elsewhere (a pad, a concat, a non-wrapping shift),
with that dim whole before and after, is relaid piece by piece where that moves fewer bytes: the
pieces move, the zeros are placed afterwards.

Results are cached per (source value, target) for the current jax trace: three einsums reading one
activation relay it once, and its cotangent is reduced once.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from . import collectives as C
from . import redistribute
from ..costmodel.cost import moved_bytes
from ..platform.jaxcompat import host_resident, varying_axes
from ..names.named import NamedArray, Placement

__all__ = ["relayout", "relayout_bytes", "needs_gather"]


def relayout(ctx, x, target, vary, keep_pending):
    """Local block of NamedArray ``x`` with dim ``i`` split over ``target[i]``, the pending sums
    outside ``keep_pending`` resolved, and typed varying over ``vary``."""
    if host_resident(x.raw):   # a value kept in host memory (offloaded parameters) computes on the device
        x = NamedArray(ctx.cached(x.raw, ("to device",), lambda: ctx.fetch(x.raw)), x.dims,
                       is_param=x.is_param, placement=x.placement)
    src = ctx.placement(x)
    vary = vary | {a for axes in target for a in axes} | (src.pending & keep_pending)
    if src.axes == tuple(target) and src.pending <= keep_pending and vary <= varying_axes(x.raw):
        return x.raw
    # The collectives depend on ``vary`` only where a split leaves a dim (a gather's type): ops
    # that differ elsewhere share them, so one value's collective is emitted once, however many
    # ops read it (XLA would merge the copies; explain must not count them twice).
    # A block sliced from a value placed at ``target`` is gathered back as that value: nothing moves
    whole = ctx.unsliced(x.raw, tuple(target)) if not src.pending else None
    if whole is not None:
        moved = whole
    else:
        leaving = {a for i, axes in enumerate(src.axes) for a in axes if a not in target[i]}
        key = ("relayout", src, tuple(target), frozenset(vary & leaving), keep_pending)
        moved = ctx.cached(x.raw, key, lambda: _relayout_value(ctx, x, src, tuple(target), vary, keep_pending))
        if moved is not x.raw and not src.pending and src.sliced_to(target):
            ctx.note_slice(moved, x.raw, src.axes)
    # Type the block as varying over every axis the consuming op varies over (once per value).
    cast = tuple(a for a in ctx.mesh.factor_axes if a in vary and a not in varying_axes(moved))
    if not cast:
        return moved
    # A gathered value: its cotangent is summed over ``cast`` once un-gathered (smaller), not before
    gathers = ctx.cached(moved, ("gathers",), lambda: None) if moved is not x.raw and whole is None else None
    if gathers:
        text = f"[{x.dims}] gradient of a gathered copy, un-gathered"
        return ctx.cached(moved, ("cast", cast), lambda: C.cast_gathered(
            ctx, x.raw, moved, cast, lambda ct: _ungather(ctx, ct, gathers, text), f"[{x.dims}]"))
    return ctx.cached(moved, ("cast", cast), lambda: C.cast(ctx, moved, cast, f"[{x.dims}]"))


def _ungather(ctx, ct, gathers, tensor):
    """The transpose of the gathers ``(axes, dim, invariant)`` a relayout made, on a cotangent:
    a reduce-scatter for a gather typed varying, this device's block for one typed invariant."""
    for axes, i, invariant in reversed(gathers):
        ct = C.take_block(ctx, ct, axes, i, tensor) if invariant else C.psum_scatter(ctx, ct, axes, i, tensor)
    return ct


def _relayout_value(ctx, x, src, target, vary, keep_pending):
    pieces = _by_pieces(ctx, x, src, target, vary, keep_pending)
    return _relayout(ctx, x, src, target, vary, keep_pending) if pieces is None else pieces


def _by_pieces(ctx, x, src, target, vary, keep_pending):
    """``x`` made of pieces along a dim whole here and in ``target``, zeros elsewhere (a pad's
    operand, a concat's operands, the rows a shift keeps): relay the pieces and place them, where
    that moves fewer bytes than relaying the zeros too (a pad gathered is its operand gathered,
    then padded); else None."""
    parts = ctx.padded_from(x)
    if parts is None:
        return None
    name, pieces = parts
    others = {d for d in x.dims if d.name != name}
    if name not in x.names or any({d for d in p.dims if d.name != name} != others or name not in p.names or
                                  not 0 <= o <= x.dims[name].size - p.dims[name].size for p, o in pieces):
        return None   # renamed or reshaped since (the same local array under other dims)
    i = x.names.index(name)
    by_name = dict(zip(x.names, target))
    if src.axes[i] or target[i] or any(ctx.pending(p) & keep_pending != src.pending & keep_pending
                                       for p, _ in pieces):
        return None

    def cost(y):
        pl = ctx.placement(y)
        return relayout_bytes(ctx, y.dims, y.dtype.itemsize, pl.axes, pl.pending,
                              tuple(by_name[d.name] for d in y.dims), keep_pending)
    if sum(cost(p) for p, _ in pieces) >= cost(x):
        return None
    if not pieces:   # zeros alone (a slice of a pad's padding): placed, nothing moves
        return jnp.zeros([d.size // ctx.axes_size(axes) for d, axes in zip(x.dims, target)], x.dtype)
    out = None
    for p, offset in pieces:
        local = relayout(ctx, p, tuple(by_name[d.name] for d in p.dims), vary, keep_pending)
        order = [p.names.index(n) for n in x.names]
        widths = [(0, 0)] * len(order)
        widths[i] = (offset, x.dims[name].size - offset - p.dims[name].size)
        local = jnp.pad(local.transpose(order).astype(x.dtype), widths)
        out = local if out is None else out + local
    return out


def _relayout(ctx, x, src, target, vary, keep_pending):
    shape = tuple(d.size for d in x.dims)
    if _reduce_then_route(ctx, shape, src.axes, src.pending, target, keep_pending) is not None:
        first = _Move(ctx, x, src, target, vary, keep_pending)
        first.slice_free_axes()
        first.reduce_pending()   # the sums reduced where they are (or onto a dim taking the axis)
        after = Placement(tuple(map(tuple, first.cur)), src.pending & keep_pending)
        return _relayout(ctx, NamedArray(first.arr, x.dims, is_param=x.is_param, placement=after), after, target,
                         vary, keep_pending)
    route = _route(ctx, shape, src.axes, src.pending, target, keep_pending)
    if route is None:
        move = _Move(ctx, x, src, target, vary, keep_pending).run()
        if move.gathers and not move.others:   # only gathers: relayout may cast the result so
            ctx.cached(move.arr, ("gathers",), lambda: tuple(move.gathers))
        return move.arr
    sizes, pre, mid = route
    p = redistribute.plan(shape, pre, mid, ctx.mesh.factor_axes, sizes)
    move = _Move(ctx, x, src, pre, vary, keep_pending | src.pending)
    local = tuple(n // ctx.axes_size(t) for n, t in zip(shape, mid))
    arr = redistribute.run(ctx, move.run().arr, p, local, f"[{x.dims}] redistribute")
    move = _Move(ctx, x, Placement(mid, src.pending), target, vary, keep_pending)
    move.arr = arr
    return move.run().arr


class _Move:
    """The state of one relayout: the block so far and the axes each dim is split over now.

    ``dry=True`` emits nothing: it only adds up the bytes each step would move (``self.bytes``,
    ring formulas of :mod:`meshdsl.costmodel.cost`), so plans are compared by what they really emit."""

    def __init__(self, ctx, x, src, target, vary, keep_pending, *, dry=False, names=(), local=0.0, price=None):
        self.ctx, self.target, self.vary, self.dry, self.price = ctx, target, vary, dry, price
        self.keep_pending = keep_pending
        self.cur = [list(axes) for axes in src.axes]
        self.pend = set(src.pending) - set(keep_pending)
        self.bytes, self.local = 0.0, local   # dry run: bytes so far, local block bytes now
        self.gathers, self.others = [], 0     # the gathers made (axes, dim, invariant); other steps
        if dry:
            self.arr, self.names, self.shape_txt = None, names, ""
            return
        self.arr, self.names, self.source = x.raw, x.names, x.raw
        source = x.facts.made_by
        self.shape_txt = f"[{x.dims}]" + (f" from {source}" if source else "")

    def emit(self, kind, axes, grow, collective):
        """Account one step (``grow``: the local block's size factor) or run ``collective``."""
        n = self.ctx.axes_size(axes)
        if self.dry:
            if kind:
                moved = moved_bytes(kind, self.local, self.local * grow, n)
                self.bytes += self.price(kind, axes, moved) if self.price else moved
            self.local *= grow
        else:
            self.others += kind != "all-gather"
            self.arr = collective()

    def owner(self, a):
        for i, axes in enumerate(self.cur):
            if a in axes:
                return i
        return None

    def next_axis(self, i):
        """The axis dim ``i`` gains next, if its current axes are a prefix of its target."""
        k = len(self.cur[i])
        if self.cur[i] == list(self.target[i][:k]) and k < len(self.target[i]):
            return self.target[i][k]
        return None

    def slice_free_axes(self):
        progress = True
        while progress:
            progress = False
            for i in range(len(self.cur)):
                a = self.next_axis(i)
                if a is not None and self.owner(a) is None and a not in self.pend and a not in self.keep_pending:
                    self.emit(None, (a,), 1 / self.ctx.axes_size((a,)), lambda: C.take_block(
                        self.ctx, self.arr, (a,), i, f"{self.shape_txt} slice {self.names[i]}"))
                    self.cur[i].append(a)
                    progress = True

    def reduce_pending(self):
        """Reduce-scatter onto a dim that needs the axis next, else all-reduce."""
        for i in range(len(self.cur)):
            run = []
            k = len(self.cur[i])
            if self.cur[i] == list(self.target[i][:k]):
                while (k < len(self.target[i]) and self.target[i][k] in self.pend
                       and self.owner(self.target[i][k]) is None):
                    run.append(self.target[i][k])
                    k += 1
            if run:
                self.emit("reduce-scatter", tuple(run), 1 / self.ctx.axes_size(tuple(run)), lambda: C.psum_scatter(
                    self.ctx, self.arr, tuple(run), i, f"{self.shape_txt} reduce-scatter onto {self.names[i]}"))
                self.cur[i].extend(run)
                self.pend -= set(run)
        if self.pend:
            rest = tuple(a for a in self.ctx.mesh.factor_axes if a in self.pend)
            self.emit("all-reduce", rest, 1, lambda: C.psum(self.ctx, self.arr, rest, f"{self.shape_txt} pending sum"))
            self.pend.clear()

    def move_splits(self):
        """All-to-all where another dim takes the axes next, else gather."""
        for i in range(len(self.cur)):
            while self.cur[i] != list(self.target[i][:len(self.cur[i])]):
                dest, run = self.moving_run(i)
                if dest is not None:
                    self.emit("all-to-all", run, 1, lambda: C.all_to_all(
                        self.ctx, self.arr, run, dest, i,
                        f"{self.shape_txt} move {self.ctx.mesh.axes_text(run)} {self.names[i]}->{self.names[dest]}"))
                    del self.cur[i][len(self.cur[i]) - len(run):]
                    self.cur[dest].extend(run)
                else:
                    self.gather_trailing(i)

    def moving_run(self, i):
        """``(dim, axes)``: the longest run of dim ``i``'s trailing axes that another dim takes
        next, in order (all the factor axes of ``model`` moving from ``batch`` to ``experts``: one
        all-to-all), or ``(None, ())``."""
        cur, best = self.cur[i], (None, ())
        for j in range(len(self.cur)):
            k = len(self.cur[j])
            if j == i or self.cur[j] != list(self.target[j][:k]):
                continue
            want = tuple(self.target[j][k:])
            for r in range(min(len(cur), len(want)), len(best[1]), -1):
                if tuple(cur[-r:]) == want[:r]:
                    best = (j, want[:r])
                    break
        return best

    def gather_trailing(self, i):
        """Gather the longest run of trailing axes of dim ``i`` that nobody takes next, in one
        collective (axis by axis where their types differ: one varying, one not)."""
        cur, target = self.cur[i], self.target[i]
        p = 0
        while p < len(cur) and p < len(target) and cur[p] == target[p]:
            p += 1
        run = cur[p:]
        while len(run) > 1 and any(self.next_axis(j) == run[0] for j in range(len(self.cur)) if j != i):
            run = run[1:]
        if len({a in self.vary for a in run}) > 1:
            run = run[-1:]
        self.emit("all-gather", tuple(run), self.ctx.axes_size(tuple(run)), lambda: C.all_gather(
            self.ctx, self.arr, tuple(run), i, invariant=run[0] not in self.vary,
            tensor=f"{self.shape_txt} gather {self.names[i]}"))
        self.gathers.append((tuple(run), i, run[0] not in self.vary))
        del cur[len(cur) - len(run):]

    def run(self):
        self.slice_free_axes()     # 1. local slices possible now: less data for everything after
        self.reduce_pending()      # 2. pending sums: reduce-scatter onto a dim that takes the axis, else psum
        self.move_splits()         # 3. splits that must leave a dim: all-to-all, else all-gather
        self.slice_free_axes()     # 4. the remaining local slices
        assert [tuple(c) for c in self.cur] == list(self.target), (self.cur, self.target)
        return self


def _route(ctx, shape, src_axes, src_pending, target, keep_pending):
    """``(axis sizes, pre, mid)``: local slices to ``pre`` (the source's splits, then the target's axes
    the source does not use: less data, and no replicated source whose gradient would need a
    psum), ppermute rounds (:mod:`meshdsl.rewrite.redistribute`) to ``mid``, then the axis-by-axis steps
    to ``target``, where that moves fewer bytes than the steps alone; else None. ``mid`` is the
    target, then the source's splits the target drops, trailing (the steps gather them): on their
    own dims, or one moved to another dim (:func:`_mids`). Only for moves that resolve no pending
    sum."""
    used_src = {a for axes in src_axes for a in axes}
    used_tgt = {a for axes in target for a in axes}
    if src_pending - keep_pending or src_pending & (used_src | used_tgt):
        return None
    pre = tuple(tuple(s) + tuple(a for a in t if a not in used_src) for s, t in zip(src_axes, target))
    # a dim the extra slices would not divide evenly is not sliced first
    pre = tuple(p if n % ctx.axes_size(p) == 0 else tuple(s) for p, s, n in zip(pre, src_axes, shape))
    sizes = {a: ctx.axes_size((a,)) for a in used_src | used_tgt}
    best, best_bytes = None, _steps_bytes(ctx, shape, src_axes, target)
    for mid in _mids(src_axes, target, used_tgt):
        rounds = None if mid == pre else redistribute.piece_rounds(shape, pre, mid, ctx.mesh.factor_axes, sizes)
        if rounds is not None:
            via = math.prod(rounds) + _steps_bytes(ctx, shape, mid, target)
            if via < best_bytes:
                best, best_bytes = (sizes, pre, mid), via
    return best


def _mids(src_axes, target, used_tgt):
    """Placements a redistribution may route through: the target, then each source split the
    target drops, trailing on its own dim; and the same with one of those splits on another dim
    instead (``[p2:y q4:x] -> [q4:y]`` on a mesh ``x:4`` (factors ``x.0, x.1``): through
    ``[p2:x.0 q4:y+x.1]``, one piece per device, where ``q4`` cannot hold all three)."""
    dropped = [(i, a) for i, s in enumerate(src_axes) for a in s if a not in used_tgt]
    base = [tuple(t) + tuple(a for a in s if a not in used_tgt) for s, t in zip(src_axes, target)]
    yield tuple(base)
    for i, a in dropped:
        for j in range(len(target)):
            if j != i:
                mid = [tuple(b for b in axes if b != a) for axes in base]
                mid[j] += (a,)
                yield tuple(mid)


def needs_gather(ctx, x, axes_by_name) -> bool:
    """Would relaying ``x`` to ``axes_by_name`` gather some dim (a split it has that the target lacks)?"""
    pl = ctx.placement(x)
    return any(tuple(axes_by_name.get(d.name, ()))[:len(a)] != a for d, a in zip(x.dims, pl.axes))


def _reduce_then_route(ctx, shape, src_axes, src_pending, target, keep_pending):
    """A source holding pending sums the target resolves, whose splits a redistribution would
    then move for fewer bytes than the steps (``[b f:model] pending over data -> [b f:data]``:
    the sum reduced in place, then ``f`` moved from ``model`` to ``data`` by collective-permutes
    and a gather over half the devices, not gathered whole): the placement the reduction leaves
    (decided by bytes, as every route is), where that route moves fewer bytes; else None."""
    if not set(src_pending) - set(keep_pending):
        return None
    first = _reduced(ctx, shape, 1, src_axes, src_pending, target, keep_pending)
    after, pending = tuple(map(tuple, first.cur)), frozenset(src_pending) & frozenset(keep_pending)
    if _route(ctx, shape, after, pending, target, keep_pending) is None:
        return None
    via = first.bytes + _shape_bytes(ctx, shape, 1, after, pending, target, keep_pending)
    return after if via < _steps_bytes(ctx, shape, src_axes, target, 1, src_pending, keep_pending) else None


def _reduced(ctx, shape, itemsize, src_axes, src_pending, target, keep_pending, price=None):
    """A dry :class:`_Move` that has only sliced and reduced the pending sums (its ``bytes``)."""
    local = float(itemsize) * math.prod(shape) / max(1, ctx.axes_size([a for axes in src_axes for a in axes]))
    first = _Move(ctx, None, Placement(tuple(map(tuple, src_axes)), frozenset(src_pending)), tuple(map(tuple, target)),
                  frozenset(), frozenset(keep_pending), dry=True, names=("",) * len(shape), local=local, price=price)
    first.slice_free_axes()
    first.reduce_pending()
    return first


def relayout_bytes(ctx, dims, itemsize, src_axes, src_pending, target, keep_pending=frozenset(), price=None) -> float:
    """Estimated bytes one device moves to relay a tensor of ``dims`` from ``src_axes`` (axes per
    dim, with pending sums ``src_pending``) to ``target`` (axes per dim), keeping ``keep_pending``.
    Used to choose between plans before emitting anything (ring formulas of :mod:`meshdsl.costmodel.cost`).
    ``price(kind, factor axes, bytes)``: what each collective step costs instead of its bytes (the
    planner's time objective: its seconds on the link of its axes, :mod:`meshdsl.planner.plan`)."""
    return _shape_bytes(ctx, tuple(d.size for d in dims), itemsize, src_axes, src_pending, target, keep_pending, price)


def _shape_bytes(ctx, shape, itemsize, src_axes, src_pending, target, keep_pending=frozenset(), price=None) -> float:
    """:func:`relayout_bytes` of a tensor of ``shape``."""
    after = _reduce_then_route(ctx, shape, src_axes, src_pending, target, keep_pending)
    if after is not None:
        first = _reduced(ctx, shape, itemsize, src_axes, src_pending, target, keep_pending, price)
        return first.bytes + _shape_bytes(ctx, shape, itemsize, after, frozenset(src_pending) & frozenset(keep_pending),
                                          target, keep_pending, price)
    route = _route(ctx, shape, src_axes, src_pending, target, keep_pending)
    if route is not None:
        sizes, pre, mid = route
        rounds = itemsize * math.prod(redistribute.piece_rounds(shape, pre, mid, ctx.mesh.factor_axes, sizes))
        if price:
            rounds = price("permute", tuple(a for a in ctx.mesh.factor_axes if a in sizes), rounds)
        return rounds + _steps_bytes(ctx, shape, mid, target, itemsize, price=price)
    return _steps_bytes(ctx, shape, src_axes, target, itemsize, src_pending, keep_pending, price)


def _steps_bytes(ctx, shape, src_axes, target, itemsize=1, src_pending=frozenset(), keep_pending=frozenset(),
                 price=None):
    """Bytes the axis-by-axis steps (:class:`_Move`) move (or what ``price`` makes of each): a dry run of them."""
    local = float(itemsize)
    for n in shape:
        local *= n
    local /= max(1, ctx.axes_size([a for axes in src_axes for a in axes]))
    src = Placement(tuple(map(tuple, src_axes)), frozenset(src_pending))
    move = _Move(ctx, None, src, tuple(map(tuple, target)), frozenset(), frozenset(keep_pending), dry=True,
                 names=("",) * len(shape), local=local, price=price)
    return move.run().bytes
