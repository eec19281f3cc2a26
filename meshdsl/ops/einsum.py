"""``md.einsum``: contraction by dim name.

``md.einsum(x, w, out="batch d_ff")``: dims of the operands missing from ``out`` are summed over.
Per mesh axis ``a`` of the iteration space (see :mod:`meshdsl.placement`):

* a kept dim split on ``a`` in every operand that has it: local, the result stays split;
* an operand holding that dim whole: it is sliced locally (no communication);
* a contracted dim split on ``a``: local einsum of the blocks, the result is a *pending* partial
  sum over ``a``; the next op that needs whole values reduces it (psum), or a reduce-scatter when
  the value is wanted split over ``a``;
* a contracted and a kept dim both mapped to ``a`` by the layout: the contracted dim keeps the
  split (the result is pending), so the sum is later reduce-scattered onto the kept dim.

Pending sums of the operands are reduced before the contraction.
"""

from __future__ import annotations

import jax.numpy as jnp

from ..dims import Shape, parse_dims
from ..errors import ShapeError, suggest
from .common import as_named, union_dims, where_
from .registry import op

__all__ = ["einsum"]

_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


@op("einsum")
def einsum(ctx, *operands, out, preferred_element_type=None):
    """Contract ``operands`` by name into dims ``out`` (a string of names, Dims or a list)."""
    if not operands:
        raise ShapeError(f"{where_(ctx)}: no operands")
    xs = [as_named(ctx, x, f"operand {i + 1}") for i, x in enumerate(operands)]
    dims = union_dims(ctx, xs)
    out_names = []
    for name, size in parse_dims(out, what=f"{where_(ctx)}: out"):
        if name not in dims:
            raise ShapeError(f"{where_(ctx)}: out names {name!r}, which no operand has; operands have "
                             f"{' '.join(dims.names)}{suggest(name, dims.names)}")
        if size is not None and size != dims[name].size:
            raise ShapeError(f"{where_(ctx)}: out writes {name}:{size} but the operands have "
                             f"{name}:{dims[name].size}")
        if name in out_names:
            raise ShapeError(f"{where_(ctx)}: out names {name!r} twice")
        out_names.append(name)
    out_dims = Shape(dims[n] for n in out_names)
    contracted = tuple(d.name for d in dims if d.name not in out_names)

    axes = ctx.plan(dims, xs, prefer=contracted)
    vary = ctx.vary(axes.values(), xs)
    local = [ctx.local(x, axes, vary) for x in xs]
    letter = {d.name: _LETTERS[i] for i, d in enumerate(dims)}
    spec = ",".join("".join(letter[n] for n in x.names) for x in xs) + "->" + "".join(letter[n] for n in out_names)
    result = jnp.einsum(spec, *local, preferred_element_type=preferred_element_type)
    pending = frozenset(a for n in contracted for a in axes[n])
    return ctx.out(result, out_dims, axes, pending)
