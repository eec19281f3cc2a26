"""The circular schedule: each stage holds ``R`` chunks of the stack, microbatches go round ``R`` times.

With ``md.lower(..., schedule="circular", repeats=R)`` the ``L`` layers of a pipelined
``md.scan`` are cut into ``S * R`` chunks of ``L / (S R)`` layers; chunk ``c`` runs on stage
``c mod S``, so a microbatch goes through stages ``0 .. S-1`` once per repeat, and the last stage
hands it back to the first (the ring: one ``ppermute`` over the pipeline axis per tick, as GPipe's
line of stages, plus the pair ``S-1 -> 0``). At tick ``t`` stage ``s`` works on item
``k = t - s`` (repeat ``k // M`` of microbatch ``k mod M``): ``R M + S - 1`` ticks, a bubble of
``(S-1) / (R M + S - 1)`` (GPipe's: ``(S-1) / (M + S - 1)``). A microbatch leaving the last stage
waits at the first in a buffer of ``M`` microbatches until its next repeat (``M >= S``).

The layout stores the stack split over the pipeline axis in blocks: stage ``s`` holds layers
``s L/S .. (s+1) L/S``, the chunks ``s R .. s R + R - 1``. :func:`cyclic` moves each chunk to the
stage that runs it (``ppermute`` rounds, once per step, outside the ticks; the gradients go back
the same way): the price of the smaller bubble, ``md.explain`` counts it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..rewrite import collectives as C
from ..names.errors import LayoutError
from ..platform.jaxcompat import varying_axes
from ..names.named import NamedArray
from . import loop

__all__ = ["check", "cyclic", "rounds", "entering", "wait"]


def check(ctx, dim, length, stages, repeats, m, where):
    """The layout errors of a circular pipeline: layers per chunk, microbatches per stage
    (``repeats`` itself is checked by md.lower)."""
    if length % (stages * repeats):
        raise LayoutError(f"{where}: {dim}:{length} cannot be cut into {stages} stages x {repeats} repeats "
                          f"= {stages * repeats} chunks; use a multiple of {stages * repeats} layers or "
                          f"fewer repeats")
    if repeats > 1 and m < stages:
        raise LayoutError(f"{where}: the circular schedule needs at least as many microbatches as stages "
                          f"({m} < {stages}): a microbatch leaving the last stage waits at the first for its "
                          f"next repeat; use microbatches >= {stages}, or schedule='gpipe'")


def rounds(stages: int, repeats: int) -> list[list[tuple[int, int, int, int]]]:
    """The moves ``(source stage, source slot, target stage, target slot)`` that take the block
    placement of ``S R`` chunks (stage ``c // R``, slot ``c mod R``) to the cyclic one (stage
    ``c mod S``, slot ``c // S``), in rounds where no stage sends or receives twice."""
    todo = [(c // repeats, c % repeats, c % stages, c // stages) for c in range(stages * repeats)]
    out = []
    while todo:
        sent, got, now, later = set(), set(), [], []
        for move in todo:
            a, _, b, _ = move
            if a in sent or b in got:
                later.append(move)
            else:
                sent.add(a)
                got.add(b)
                now.append(move)
        out.append(now)
        todo = later
    return out


def cyclic(ctx, xs, dim, axis, stages, repeats, carry_axes):
    """Each stacked ``xs`` leaf (this stage's block of layers, ``dim`` whole on the stage) with its
    chunks replaced by the chunks this stage runs under the circular schedule, in repeat order.
    Float leaves are typed varying over the carry's axes here, once: a tick reads its chunk inside
    the loop, and a cast there would sum the chunk's gradient over the data axes in every tick."""
    if repeats == 1:
        return xs
    stage = C.axis_index(axis)
    plan = rounds(stages, repeats)
    out = []
    for x in xs:
        pos = x.names.index(dim)
        chunk = x.dims[dim].size // repeats
        local, moved = x.raw, x.raw
        for moves in plan:
            src, dst, receives, stays = [0] * stages, [0] * stages, [False] * stages, [False] * stages
            for a, q, b, r in moves:
                src[a], dst[b], receives[b], stays[b] = q, r, True, a == b
            mine = jax.lax.dynamic_slice_in_dim(local, jnp.asarray(src)[stage] * chunk, chunk, axis=pos)
            pairs = [(a, b) for a, _, b, _ in moves if a != b]
            piece = mine
            if pairs:
                piece = C.ppermute(ctx, mine, axis, pairs, f"[{x.dims}] chunks to their circular stage")
                piece = jnp.where(jnp.asarray(stays)[stage], mine, piece)
            at = jnp.asarray(dst)[stage] * chunk
            old = jax.lax.dynamic_slice_in_dim(moved, at, chunk, axis=pos)
            moved = jax.lax.dynamic_update_slice_in_dim(
                moved, jnp.where(jnp.asarray(receives)[stage], piece, old), at, axis=pos)
        need = carry_axes - varying_axes(moved)
        if need and jnp.issubdtype(moved.dtype, jnp.inexact):
            moved = C.cast(ctx, moved, loop.order(ctx, need), f"[{x.dims}] typed like the carry")
        out.append(NamedArray(moved, x.dims, is_param=x.is_param, placement=ctx.placement(x)))
    return out


def _at(a, k):
    return jax.lax.dynamic_index_in_dim(a, k, 0, keepdims=False)


def entering(fresh, waiting, item, index, m):
    """What the first stage takes at a tick: microbatch ``index``'s input on its first repeat
    (``fresh``), later where the last stage left it (``waiting``; GPipe: none)."""
    return [jnp.where(item < m, f, _at(w, index)) for f, w in zip(fresh, waiting)] if waiting else fresh


def wait(waiting, arrived, stage, back, items, m):
    """The first stage keeps what just arrived from the last stage (item ``back``: a repeat before
    the last) in microbatch ``back mod M``'s slot, until that microbatch's next repeat."""
    if not waiting:
        return waiting
    keep, slot = (stage == 0) & (back >= 0) & (back < items - m), jnp.clip(back, 0, items - 1) % m
    return [jax.lax.dynamic_update_index_in_dim(w, jnp.where(keep, a, _at(w, slot)), slot, 0)
            for w, a in zip(waiting, arrived)]
