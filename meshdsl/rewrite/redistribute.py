"""General redistribution: move a tensor between two block placements by rounds of ``ppermute``.

The relayout table (:mod:`meshdsl.rewrite.relayout`) moves one mesh axis at a time (all-to-all, gather,
slice). Some moves are not a sequence of such steps without detours: swapping the splits of two
dims (``b:data, s:model`` -> ``b:model, s:data``) gathers one axis and then all-to-alls the
other. Here every device instead receives exactly the pieces of its target block that other
devices hold:

1. the pieces: per dim, the target block cut into chunks of ``min(source block, target block)``
   rows (blocks along a dim are aligned, so each chunk lies in one source block); the device
   holding it is the one with the source block, keeping this device's coordinates on the axes the
   source does not split (its own replica). A piece this device holds itself is a local copy.
2. the rounds: the (source, target) pairs of the other pieces, coloured so that in each round a
   device sends at most one piece and receives at most one (a bipartite edge colouring: as many
   rounds as the most pieces one device sends or receives).
3. each round is one ``ppermute`` over the axes involved (:func:`meshdsl.rewrite.collectives.ppermute`);
   what to send and where the received piece goes are static per-device tables indexed by the
   device's position.

A device sends ``rounds x piece`` bytes. :func:`plan` is ``None`` where the chunks are not of one
shape (block sizes that do not divide each other). The relayout uses a plan only when it moves
fewer bytes than the axis-by-axis steps, and only where no split is dropped (a gathered dim must
come out typed replicated; a ppermute's result varies).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from . import collectives as C
from ..platform.jaxcompat import varying_axes

__all__ = ["Plan", "plan", "piece_rounds", "run"]


@dataclasses.dataclass(frozen=True)
class Plan:
    axes: tuple          # the mesh axes involved, mesh order (ppermute's device numbering)
    piece: tuple         # the shape of every piece
    local: tuple         # per device: (source offsets, target offsets) of its own piece, or None
    rounds: tuple        # per round: (pairs, send offsets per device, receive offsets per device)

    def bytes(self, itemsize: int) -> float:
        """Bytes one device sends: one piece per round."""
        return len(self.rounds) * math.prod(self.piece) * itemsize


def plan(shape, src_axes, target, mesh_axes, sizes) -> Plan | None:
    """The rounds moving a tensor of ``shape`` from ``src_axes`` to ``target`` (axes per dim) on
    a mesh with axis names ``mesh_axes`` (mesh order) and sizes ``sizes`` (a dict)."""
    return _plan(tuple(shape), tuple(map(tuple, src_axes)), tuple(map(tuple, target)), tuple(mesh_axes),
                 tuple(sorted(sizes.items())))


def piece_rounds(shape, src_axes, target, mesh_axes, sizes) -> tuple[int, int] | None:
    """``(elements of a piece, rounds)`` of :func:`plan`'s plan, without building its tables (a
    device sends ``piece x rounds`` elements): what a relayout weighing routes needs."""
    return _piece_rounds(tuple(shape), tuple(map(tuple, src_axes)), tuple(map(tuple, target)), tuple(mesh_axes),
                         tuple(sorted(sizes.items())))


def _blocks(shape, src_axes, target, mesh_axes, sizes):
    """The mesh axes involved (mesh order), the source and target block shapes and the piece's;
    None where they do not tile."""
    used = {a for axes in src_axes + target for a in axes}
    axes = tuple(a for a in mesh_axes if a in used)
    if any(n % math.prod(sizes[a] for a in p) for placement in (src_axes, target) for n, p in zip(shape, placement)):
        return None   # a placement that cannot divide a dim (a candidate a planner weighs): no rounds
    bs = [n // math.prod(sizes[a] for a in s) for n, s in zip(shape, src_axes)]
    bt = [n // math.prod(sizes[a] for a in t) for n, t in zip(shape, target)]
    if any(max(s, t) % min(s, t) for s, t in zip(bs, bt)):
        return None
    return axes, bs, bt, tuple(min(s, t) for s, t in zip(bs, bt))


@functools.lru_cache(maxsize=4096)
def _piece_rounds(shape, src_axes, target, mesh_axes, sizes):
    """The rounds are as many as the most pieces one device sends or receives (a bipartite edge
    colouring needs no more): counted over every device at once."""
    sizes = dict(sizes)
    blocks = _blocks(shape, src_axes, target, mesh_axes, sizes)
    if blocks is None:
        return None
    axes, bs, bt, piece = blocks
    coords = np.indices([sizes[a] for a in axes]).reshape(len(axes), -1) if axes else np.zeros((0, 1), int)
    at = dict(zip(axes, coords))
    me = np.arange(coords.shape[1])
    t0 = [_block(at, t, sizes) * b for t, b in zip(target, bt)]
    sent, received = np.zeros_like(me), np.zeros_like(me)
    for chunk in itertools.product(*[range(b // p) for b, p in zip(bt, piece)]):
        src = dict(at)
        for s_axes, t, c, p, b in zip(src_axes, t0, chunk, piece, bs):
            src.update(_coords((t + c * p) // b, s_axes, sizes))
        source = (np.ravel_multi_index([np.broadcast_to(src[a], me.shape) for a in axes], [sizes[a] for a in axes])
                  if axes else me)
        away = source != me
        received += away
        sent += np.bincount(source[away], minlength=len(me))
    return math.prod(piece), int(max(sent.max(initial=0), received.max(initial=0)))


@functools.lru_cache(maxsize=256)
def _plan(shape, src_axes, target, mesh_axes, sizes):
    sizes = dict(sizes)
    blocks = _blocks(shape, src_axes, target, mesh_axes, sizes)
    if blocks is None:
        return None
    axes, bs, bt, piece = blocks
    devices = list(itertools.product(*[range(sizes[a]) for a in axes]))
    index = {coords: d for d, coords in enumerate(devices)}
    local, edges = [None] * len(devices), []
    for d, coords in enumerate(devices):
        at = dict(zip(axes, coords))
        t0 = [_block(at, t, sizes) * b for t, b in zip(target, bt)]
        for chunk in itertools.product(*[range(b // p) for b, p in zip(bt, piece)]):
            start = [t + c * p for t, c, p in zip(t0, chunk, piece)]
            src = dict(at)
            for s_axes, row, b in zip(src_axes, start, bs):
                src.update(_coords(row // b, s_axes, sizes))
            s = index[tuple(src[a] for a in axes)]
            s_off = tuple(row - _block(src, sa, sizes) * b for row, sa, b in zip(start, src_axes, bs))
            t_off = tuple(row - t for row, t in zip(start, t0))
            if s == d:
                local[d] = (s_off, t_off)
            else:
                edges.append((s, d, s_off, t_off))
    rounds = _colour(edges, len(devices))
    zero = (0,) * len(shape)
    out = []
    for group in rounds:
        send, recv = [zero] * len(devices), [zero] * len(devices)
        for s, d, s_off, t_off in group:
            send[s], recv[d] = s_off, t_off
        out.append((tuple((s, d) for s, d, _, _ in group), tuple(send), tuple(recv)))
    return Plan(axes, piece, tuple(local), tuple(out))


def _block(at, axes, sizes) -> int:
    """The block index (major first) of a device at coordinates ``at`` along ``axes``."""
    k = 0
    for a in axes:
        k = k * sizes[a] + at[a]
    return k


def _coords(block, axes, sizes) -> dict:
    out = {}
    for a in reversed(axes):
        block, out[a] = divmod(block, sizes[a])
    return out


def _colour(edges, n):
    """Split the edges (source, target, ...) into rounds where no device sends or receives twice:
    a bipartite edge colouring with as many colours as the largest degree (alternating paths)."""
    degree = max([*collections.Counter(e[0] for e in edges).values(),
                  *collections.Counter(e[1] for e in edges).values(), 0])
    send = [dict() for _ in range(n)]   # device -> colour -> edge index
    recv = [dict() for _ in range(n)]
    colour = [None] * len(edges)
    for k, (s, d, *_) in enumerate(edges):
        a = next(c for c in range(degree) if c not in send[s])
        b = next(c for c in range(degree) if c not in recv[d])
        if a not in recv[d]:
            b = a
        else:
            _flip(a, b, d, send, recv, colour, edges)
        colour[k] = a
        send[s][a], recv[d][a] = k, k
    rounds = [[] for _ in range(degree)]
    for k, c in enumerate(colour):
        rounds[c].append(edges[k])
    return [r for r in rounds if r]


def _flip(a, b, d, send, recv, colour, edges):
    """Swap colours a and b along the alternating path that starts at receiver ``d`` with an
    edge of colour ``a`` (so ``a`` becomes free at ``d``; ``b`` was free there)."""
    path, side, node, c = [], "recv", d, a
    while True:
        table = recv if side == "recv" else send
        k = table[node].get(c)
        if k is None:
            break
        path.append(k)
        s, t = edges[k][0], edges[k][1]
        node, side = (s, "send") if side == "recv" else (t, "recv")
        c = b if c == a else a
    for k in path:
        s, t = edges[k][0], edges[k][1]
        del send[s][colour[k]], recv[t][colour[k]]
    for k in path:
        s, t = edges[k][0], edges[k][1]
        colour[k] = b if colour[k] == a else a
        send[s][colour[k]], recv[t][colour[k]] = k, k


def run(ctx, x, p: Plan, target_shape, tensor: str = ""):
    """This device's target block (``target_shape``) of the local block ``x``, moved by plan ``p``."""
    me = C.axis_index(p.axes)
    vary = varying_axes(x) | set(p.axes)
    out = C.cast(ctx, jnp.zeros(target_shape, x.dtype), tuple(a for a in ctx.mesh.factor_axes if a in vary))
    if any(loc is not None for loc in p.local):
        has = jnp.asarray([loc is not None for loc in p.local])[me]
        src = jnp.asarray([loc[0] if loc else (0,) * x.ndim for loc in p.local])[me]
        dst = jnp.asarray([loc[1] if loc else (0,) * x.ndim for loc in p.local])[me]
        out = _put(out, jnp.where(has, lax.dynamic_slice(x, tuple(src), p.piece), jnp.zeros((), x.dtype)), dst)
    for k, (pairs, send, recv) in enumerate(p.rounds):
        piece = lax.dynamic_slice(x, tuple(jnp.asarray(send)[me]), p.piece)
        got = C.ppermute(ctx, piece, p.axes, pairs, f"{tensor} round {k + 1} of {len(p.rounds)}")
        out = _put(out, got, jnp.asarray(recv)[me])
    return out


def _put(out, piece, at):
    """Add ``piece`` into ``out`` at offsets ``at`` (or it in, for booleans): every target element
    is written by exactly one piece, and a device that receives nothing in a round gets zeros."""
    at = tuple(at)
    here = lax.dynamic_slice(out, at, piece.shape)
    return lax.dynamic_update_slice(out, here | piece if out.dtype == jnp.bool_ else here + piece, at)
