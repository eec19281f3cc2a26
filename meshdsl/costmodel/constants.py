"""Constants the compiler folds before it runs a traced program, so that explain drops what it drops.

XLA's algebraic simplifier evaluates small computations on constants (an index clipped into
range, a comparison of two literals) and folds a slice that reads only a pad's fill into a
broadcast of the fill, after which whatever computed the padded value may be dead - an
all-reduce included. :func:`fold` does the same on a jaxpr's own equations (not inside its loop
bodies or calls), one pass in program order:

* a result of at most :data:`SMALL` elements whose operands are all literals or such results is
  evaluated (:data:`_NUMPY`, ``convert_element_type``, ``select_n``);
* a ``pad`` by a constant (no interior padding) records, per padded axis, the interval its
  operand fills; a unit-stride ``slice`` of it shifts those intervals;
* a ``slice`` or a ``dynamic_slice`` at constant starts (clamped as jax clamps them) whose
  window lies outside such an interval on one axis reads only the fill: it becomes a
  broadcast of the fill.

Example (the pad's operand is dead after the fold):

    >>> import jax, jax.numpy as jnp
    >>> from meshdsl.costmodel.constants import fold
    >>> from meshdsl.costmodel.simplify import inline
    >>> from meshdsl.platform.jaxcompat import dce
    >>> f = lambda x: jax.lax.dynamic_slice(jnp.pad(jnp.exp(x), (0, 4)), (jnp.minimum(9, 6),), (2,))
    >>> [e.primitive.name for e in dce(fold(inline(jax.make_jaxpr(f)(jnp.ones(4)).jaxpr))).eqns]
    ['broadcast_in_dim']
"""

from __future__ import annotations

import functools
import math

import jax
import numpy as np
from jax.extend import core as jcore

from ..platform.jaxcompat import pad_config, slice_window

__all__ = ["fold", "SMALL"]

SMALL = 64   # elements: the largest result evaluated (indices and flags, not tensors)

_NUMPY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "max": np.maximum, "min": np.minimum,
          "neg": np.negative, "lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal,
          "eq": np.equal, "ne": np.not_equal, "and": np.bitwise_and, "or": np.bitwise_or, "not": np.invert}


def _evaluate(eqn, values):
    """The result of ``eqn`` on constant operands ``values``, or ``None`` where not evaluated."""
    name, aval = eqn.primitive.name, eqn.outvars[0].aval
    if name in _NUMPY:
        result = _NUMPY[name](*values)
    elif name == "convert_element_type":
        result = values[0]
    elif name == "select_n":
        result = np.choose(np.asarray(values[0]).astype(np.int64), values[1:])
    else:
        return None
    return np.broadcast_to(np.asarray(result).astype(aval.dtype), aval.shape)


@functools.lru_cache(maxsize=256)
def _full(shape: tuple, dtype, fill):
    """The equation of ``lax.full(shape, fill, dtype)`` (its result a fresh variable), or ``None``."""
    closed = jax.make_jaxpr(lambda: jax.lax.full(shape, fill, dtype))()
    eqns = closed.jaxpr.eqns
    if closed.consts or len(eqns) != 1 or any(isinstance(v, jcore.Var) for v in eqns[0].invars):
        return None
    return eqns[0]


def _window(eqn, values) -> tuple | None:
    """``(starts, sizes)`` of a slice or a dynamic slice at constant starts, clamped as jax clamps
    them (into the operand), else ``None``."""
    window = slice_window(eqn)
    if window is None:
        return None
    starts, sizes = window
    if starts is None:
        if any(v is None or np.size(v) != 1 for v in values[1:]):
            return None
        shape = eqn.invars[0].aval.shape
        starts = tuple(min(max(int(np.asarray(v).item()), 0), n - s) for v, n, s in zip(values[1:], shape, sizes))
    return starts, sizes


def _padded(eqn, values):
    """``(fill, ((axis, low, high), ...))`` of a pad by a constant: on each padded axis, the
    interval its operand fills; the rest holds ``fill``. ``None`` for interior or negative padding."""
    fill, config = values[1], pad_config(eqn)
    if fill is None or any(i or lo < 0 or hi < 0 for lo, hi, i in config):
        return None
    shape = eqn.invars[0].aval.shape
    kept = tuple((a, lo, lo + n) for a, ((lo, hi, _), n) in enumerate(zip(config, shape)) if lo or hi)
    return (np.asarray(fill).item(), kept) if kept else None


def fold(jaxpr):
    """``jaxpr`` with the folds of the module doc applied (dead code left for the caller's DCE)."""
    consts, regions, eqns, changed = {}, {}, [], False
    for eqn in jaxpr.eqns:
        if len(eqn.outvars) != 1:
            eqns.append(eqn)
            continue
        name, out = eqn.primitive.name, eqn.outvars[0]
        values = [np.asarray(v.val) if isinstance(v, jcore.Literal) else consts.get(v) for v in eqn.invars]
        if values and all(v is not None for v in values) and \
                math.prod(out.aval.shape) <= SMALL and (result := _evaluate(eqn, values)) is not None:
            consts[out] = result
        if name == "pad" and (padded := _padded(eqn, values)) is not None:
            regions[out] = padded
        elif name in ("slice", "dynamic_slice") and isinstance(eqn.invars[0], jcore.Var) and \
                eqn.invars[0] in regions and (window := _window(eqn, values)) is not None:
            fill, kept = regions[eqn.invars[0]]
            starts, sizes = window
            if any(starts[a] + sizes[a] <= lo or starts[a] >= hi for a, lo, hi in kept) and \
                    (full := _full(tuple(out.aval.shape), out.aval.dtype, fill)) is not None:
                eqns.append(full.replace(outvars=[out]))   # reads only the fill
                changed = True
                continue
            regions[out] = (fill, tuple((a, lo - starts[a], hi - starts[a]) for a, lo, hi in kept))
        eqns.append(eqn)
    return jaxpr.replace(eqns=eqns) if changed else jaxpr
