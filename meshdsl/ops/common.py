"""Helpers shared by the lowering rules: operand checks, dim unions, local axis alignment."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..rewrite import collectives as C
from ..names.dims import Dim, Shape, parse_dims
from ..names.errors import ShapeError, suggest
from ..names.named import NamedArray

__all__ = ["where_", "as_named", "union_dims", "names_in", "one_dim", "align", "new_dims", "axis_of", "block_offset",
           "whole_copy_made", "rows_gathered"]


def where_(ctx) -> str:
    """``"einsum at model.py:12"``: the op being lowered, for messages."""
    return f"{ctx.op[0]} at {ctx.op[1]}" if ctx.op else "op"


def as_named(ctx, x, role: str = "operand") -> NamedArray:
    """NamedArrays pass (as the context presents them, see ``ctx.operand``); scalars (Python
    numbers, 0-d arrays) become 0-dim NamedArrays."""
    if isinstance(x, NamedArray):
        return ctx.operand(x)
    if isinstance(x, (bool, int, float, complex, np.number)) or getattr(x, "ndim", None) == 0:
        arr = jnp.asarray(x)
        return NamedArray(arr, Shape(()), placement=ctx.whole_placement(()))
    shape = getattr(x, "shape", None)
    kind = "jax Array" if isinstance(x, jax.Array) else type(x).__name__
    raise ShapeError(f"{where_(ctx)}: {role} is a {kind}"
                     f"{'' if shape is None else f' of shape {tuple(shape)}'}, not a NamedArray; "
                     "wrap arrays with md.named(array, 'dim names') so dims are matched by name")


def union_dims(ctx, xs) -> Shape:
    """Ordered union of the operands' dims; one name must have one size within an op."""
    seen: dict[str, tuple[Dim, int]] = {}
    for i, x in enumerate(xs):
        for d in x.dims:
            if d.name in seen and seen[d.name][0].size != d.size:
                j = seen[d.name][1]
                raise ShapeError(
                    f"{where_(ctx)}: dim {d.name!r} has size {seen[d.name][0].size} in operand {j + 1} "
                    f"[{xs[j].dims}] but {d.size} in operand {i + 1} [{x.dims}]; a name means one size "
                    "within an op: rename one of them or fix the sizes")
            seen.setdefault(d.name, (d, i))
    return Shape(v[0] for v in seen.values())


def names_in(ctx, x: NamedArray, spec, what: str = "dims") -> tuple[str, ...]:
    """Names in ``spec`` that must all be dims of ``x`` (sizes, if written, must agree)."""
    out = []
    for name, size in parse_dims(spec, what=f"{where_(ctx)}: {what}"):
        if name not in x.names:
            raise ShapeError(f"{where_(ctx)}: {what} names {name!r}, which is not a dim of "
                             f"[{x.dims}]{suggest(name, x.names)}")
        if size is not None and size != x.dims[name].size:
            raise ShapeError(f"{where_(ctx)}: {what} writes {name}:{size} but the tensor has "
                             f"{name}:{x.dims[name].size}")
        if name in out:
            raise ShapeError(f"{where_(ctx)}: {what} names {name!r} twice")
        out.append(name)
    return tuple(out)


def one_dim(ctx, x: NamedArray, dim, what: str) -> str:
    """The name of the one dim of ``x`` that ``dim`` names (a ShapeError otherwise)."""
    names = names_in(ctx, x, dim, what)
    if len(names) != 1:
        raise ShapeError(f"{where_(ctx)}: {what} must be exactly one dim, got {list(names)}")
    return names[0]


def block_offset(axes, block: int):
    """Global index of this device's first element of a dim split over ``axes`` in blocks of
    ``block`` (0 when whole)."""
    return C.axis_index(axes) * block if axes else 0


def new_dims(ctx, spec, what: str) -> Shape:
    """Dims whose sizes must all be written (``Dim`` s or ``name:size``)."""
    dims = []
    for name, size in parse_dims(spec, what=f"{where_(ctx)}: {what}"):
        if size is None:
            raise ShapeError(f"{where_(ctx)}: {what} needs the size of {name!r}: write {name}:<size> "
                             "or pass md.Dim(name, size)")
        dims.append(Dim(name, size))
    return Shape(dims)


def axis_of(x: NamedArray, name: str) -> int:
    return x.names.index(name)


def whole_copy_made(ctx, x: NamedArray, axes, name: str) -> bool:
    """Is a copy of ``x`` holding ``name`` whole, its other dims placed by ``axes``, made anyway
    (gathered by another op, or for the return)? An op that would communicate along a split
    ``name`` (block totals, boundary rows, a masked read) reads that copy: nothing more moves."""
    return bool(axes[name]) and ctx.relaid(x, tuple(() if n == name else axes[n] for n in x.names))


def known_zeros(ctx, x: NamedArray) -> bool:
    """Is ``x`` zeros throughout, as the rewriter knows (a slice of a pad reading only its
    padding: made of no pieces)? A linear op on it computes zeros and moves nothing."""
    parts = ctx.padded_from(x)
    return parts is not None and not parts[1]


def align(local, from_dims, to_dims):
    """Transpose a local block from ``from_dims`` order to ``to_dims`` order, with size-1 axes for
    dims it lacks, so that it broadcasts against the result."""
    src = [d.name for d in from_dims]
    dst = [d.name for d in to_dims]
    present = [n for n in dst if n in src]
    if present != src:
        local = jnp.transpose(local, [src.index(n) for n in present])
    if len(present) != len(dst):
        shape = list(local.shape)
        full = []
        it = iter(shape)
        for n in dst:
            full.append(next(it) if n in src else 1)
        local = jnp.reshape(local, full)
    return local


def decided(ctx, candidates: list):
    """The candidate of ``candidates`` (the rule's own choice first) that a decision point of the
    rule takes: the planner's, by the step's time; the first outside a planned lowering."""
    return candidates[ctx.option(len(candidates))] if len(candidates) > 1 else candidates[0]


def rows_gathered(ctx, x: NamedArray, axes, name: str, lo: int, hi: int, vary, keep):
    """The local array of ``x`` holding rows ``lo .. hi`` of ``name`` whole (its other dims placed
    by ``axes``), where ``x`` holds ``name`` split and one collective of only those rows moves
    fewer bytes than gathering the dim: each device's part of them (padded to the widest part)
    all-gathered, or - where few devices hold them - the rows zero-filled elsewhere and summed
    (an all-reduce of ``hi - lo`` rows). Which of those, or the whole gather, is a decision point
    the planner takes by the step's time (the rule's own: fewest bytes). A shift or slice whose result holds
    the dim whole needs only the rows it keeps (a shift by ``-28`` of 32 rows on 2 devices: 4 rows,
    not 16). None where neither moves fewer bytes than the gather, where ``x`` holds a pending
    sum, or where a copy of ``x`` holding the dim whole is made anyway."""
    split = ctx.placement(x).of(x.dims, name) if ctx.explicit else ()
    if not split or ctx.pending(x) or axes[name] or set(split) & {a for d in x.names for a in axes[d]}:
        return None   # (the plan places another dim on an axis of the split: no such placement)
    n, size = ctx.axes_size(split), x.dims[name].size
    block = size // n
    starts = [min(max(lo, d * block), (d + 1) * block) for d in range(n)]
    ends = [max(min(hi, (d + 1) * block), s) for d, s in enumerate(starts)]
    width = max(e - s for s, e in zip(starts, ends))
    summed = 2 * (hi - lo) / n   # an all-reduce's rows per device, against (n - 1) per row gathered
    # the ways that move fewer rows than the gather, fewest first, then the gather: a decision
    # point the planner decides by the step's time (its default, fewest bytes, where none does)
    ways = [way for rows, _, way in sorted([(summed, 1, "sum"), (width, 0, "window")]) if rows < block] + ["whole"]
    if len(ways) == 1 or ctx.relaid(x, tuple(axes[d] for d in x.names)):
        return None
    way = decided(ctx, ways)
    if way == "whole":
        return None
    pos = x.names.index(name)
    local = ctx.local(x, {**axes, name: split}, frozenset(vary) | set(split), keep_pending=keep)
    tensor = f"[{x.dims}] rows {lo}..{hi} of {name}"
    me = C.axis_index(split)
    if way == "sum":
        rows = np.arange(lo, hi)
        owner = rows // block
        mine = jnp.asarray(owner[None, :] == np.arange(n)[:, None])[me]
        shape = [1] * local.ndim
        shape[pos] = hi - lo
        picked = jnp.take(local, jnp.asarray(rows - owner * block, jnp.int32), axis=pos)
        return C.psum(ctx, jnp.where(mine.reshape(shape), picked, jnp.zeros((), local.dtype)), split, tensor)
    offsets = [min(s - d * block, block - width) for d, s in enumerate(starts)]
    part = jax.lax.dynamic_slice_in_dim(local, jnp.asarray(offsets, jnp.int32)[me], width, axis=pos)
    parts = C.all_gather(ctx, part, split, pos, invariant=True, tensor=tensor)
    rows = [d * width + s - d * block - offsets[d] + j for d, (s, e) in enumerate(zip(starts, ends)) for j in range(e - s)]
    return jnp.take(parts, jnp.asarray(rows, jnp.int32), axis=pos)
