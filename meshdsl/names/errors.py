"""Errors of meshdsl, and where in the user's code they happened.

Every mistake in dims, meshes or layouts raises a subclass of :class:`MeshDSLError` (itself a
``ValueError``) while the program is traced, before anything compiles. Messages name the op, the
dims and sizes, the mesh axes and their sizes, the user's source line, and say what to change.

:func:`user_line` finds that source line: the innermost stack frame outside meshdsl's core package
and outside the libraries it runs on (jax, flax, ...). Model code in ``meshdsl.layers`` and
``meshdsl.models`` counts as user code: a line there is what a reader wants to see.
"""

from __future__ import annotations

import difflib
import os
import sys
from collections.abc import Iterable

__all__ = ["MeshDSLError", "LayoutError", "MemoryBudgetError", "ShapeError", "MeshError", "user_line", "suggest"]


class MeshDSLError(ValueError):
    """Base class of every meshdsl error (a ``ValueError``): catch this to catch them all."""


class LayoutError(MeshDSLError):
    """A layout that cannot mean what was written.

    Raised before compiling when two dims of one tensor map to one mesh axis, a dim's size is not
    divisible by the product of its axes' sizes, a rule names an axis the mesh lacks, one dim maps
    to one axis twice, or a rule is malformed.
    """


class MemoryBudgetError(LayoutError):
    """No plan of the program under the layout holds at most ``memory_budget`` bytes per device
    (the message says the least found, and what to change)."""


class ShapeError(MeshDSLError):
    """Dims that do not fit.

    One dim name with two sizes in one op, duplicate names in one tensor, a name count that does
    not match the array's rank, unknown dims in ``out=`` or in a reduction, a malformed dims string.
    """


class MeshError(MeshDSLError):
    """A mesh that does not fit the devices (sizes whose product is not the device count), a
    malformed mesh spec, or an unknown mesh axis."""


_CORE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_LIBRARY_MARKERS = tuple(
    os.sep + name + os.sep
    for name in ("jax", "jaxlib", "flax", "optax", "orbax", "treescope", "contextlib.py", "functools.py")
)


def _is_library(filename: str) -> bool:
    if filename.startswith(_CORE_DIR) or filename.startswith("<"):
        return True
    return any(marker in filename for marker in _LIBRARY_MARKERS) or filename.endswith(
        ("contextlib.py", "functools.py")
    )


def user_line(skip: int = 1) -> str:
    """``file.py:123`` of the innermost frame that is user code (``?`` when none is found)."""
    frame = sys._getframe(skip)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not _is_library(filename):
            return f"{os.path.basename(filename)}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def suggest(name: str, candidates: Iterable[str], cutoff: float = 0.6) -> str:
    """`` (did you mean 'x'?)`` when ``name`` is close to one of ``candidates``, else ``''``.

    Example:
        >>> from meshdsl.names.errors import suggest
        >>> suggest("dta", ["data", "model"])
        " (did you mean 'data'?)"
        >>> suggest("pipe", ["data", "model"])
        ''
    """
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=cutoff)
    return f" (did you mean {close[0]!r}?)" if close else ""
