"""Python operators of :class:`~meshdsl.names.named.NamedArray`, installed here (as jax installs its
array methods): ``x + y``, ``x * 2``, ``-x``, ``x < y``, ``m & n``, ``~m``, ``x.astype(...)`` run
the named ops and broadcast by name. ``==`` is not overloaded (NamedArrays hash by identity):
use ``md.equal``."""

from __future__ import annotations

from ..names.named import NamedArray
from .elementwise import (
    add, astype, divide, greater, greater_equal, less, less_equal, logical_and, logical_not, logical_or,
    multiply, negative, power, subtract,
)

__all__ = ["install"]


def _swapped(fn):
    return lambda self, other: fn(other, self)


_METHODS = {
    "__add__": add, "__radd__": _swapped(add),
    "__sub__": subtract, "__rsub__": _swapped(subtract),
    "__mul__": multiply, "__rmul__": _swapped(multiply),
    "__truediv__": divide, "__rtruediv__": _swapped(divide),
    "__pow__": power,
    "__neg__": negative,
    "__lt__": less, "__le__": less_equal, "__gt__": greater, "__ge__": greater_equal,
    "__and__": logical_and, "__or__": logical_or, "__invert__": logical_not,
    "astype": astype,
}


def install() -> None:
    """Attach the operators to NamedArray."""
    for name, fn in _METHODS.items():
        setattr(NamedArray, name, fn)
