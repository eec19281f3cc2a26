"""``md.local_map``: run plain jax / flax code on named values.

Inside ``md.lower`` a NamedArray's ``.array`` is a device's block, so code that takes arrays (a
flax ``nnx.Linear``, a jax.numpy routine) cannot be handed ``x.array`` and re-wrapped with
``md.named``: that would treat a block as the whole value (``md.named`` refuses it).
``md.local_map(fn, *xs, out="batch d_ff", keep="batch")`` is the way: ``fn`` receives the arrays of
``xs`` (axes in each value's dim order) and returns one array with dims ``out``.

The rule: ``fn`` sees every dim whole - an operand split on it is all-gathered first - except the
dims named in ``keep``, which stay where they are split (or where the layout splits them): ``fn``
then runs on each device's block of them, so it must treat them independently, entry by entry
(a batch dim under a row-wise function), as ``jax.vmap`` would. Unsharded, ``fn`` runs on the
global arrays: that is the reference every layout reproduces, and gradients flow through ``fn``.
"""

from __future__ import annotations

from ..names.dims import Dim, Shape, parse_dims
from ..names.errors import ShapeError
from .common import as_named, union_dims, where_
from ..names.named import NamedArray
from .registry import op

__all__ = ["local_map"]


@op("local_map", gathers=True)
def local_map(ctx, fn, *xs, out, keep=()) -> NamedArray:
    """``fn(*arrays) -> array`` with dims ``out``; dims in ``keep`` may stay split (see module doc)."""
    if not callable(fn):
        raise ShapeError(f"{where_(ctx)}: the first argument must be a function of arrays, got "
                         f"{type(fn).__name__}")
    xs = [as_named(ctx, x, f"operand {i + 1}") for i, x in enumerate(xs)]
    dims = union_dims(ctx, xs)
    kept = [n for n, _ in parse_dims(keep, what=f"{where_(ctx)}: keep")]
    out_specs = parse_dims(out, what=f"{where_(ctx)}: out")
    out_names = [n for n, _ in out_specs]
    for name in kept:
        if name not in dims.names or name not in out_names:
            raise ShapeError(f"{where_(ctx)}: keep names {name!r}, which must be a dim of the operands "
                             f"({' '.join(dims.names)}) and of out ({' '.join(out_names)})")
    plan = ctx.plan(dims, xs)
    axes = {d.name: (plan[d.name] if d.name in kept else ()) for d in dims}
    vary = ctx.vary(axes.values(), xs)
    result = fn(*[ctx.local(x, axes, vary) for x in xs])
    shape = tuple(getattr(result, "shape", ()))
    if len(shape) != len(out_specs):
        raise ShapeError(f"{where_(ctx)}: the function returned an array of shape {shape} for "
                         f"{len(out_specs)} dims out={out!r}; give one name per axis")
    out_dims = []
    for (name, size), n in zip(out_specs, shape):
        whole = n * ctx.axes_size(axes.get(name, ())) if name in kept else n
        if name in kept and name in dims.names and whole != dims[name].size:
            raise ShapeError(f"{where_(ctx)}: the function changed the size of kept dim {name!r} "
                             f"({dims[name].size} -> {whole}); a kept dim is processed entry by entry")
        if size is not None and size != whole:
            raise ShapeError(f"{where_(ctx)}: out writes {name}:{size} but the function returned "
                             f"{name}:{whole}")
        out_dims.append(Dim(name, int(whole)))
    return ctx.out(result, Shape(out_dims), {n: axes[n] for n in kept})
