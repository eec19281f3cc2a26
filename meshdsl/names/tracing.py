"""The tracing protocol: which lowering context is active, and what every context answers.

A named op is written once, as a *rule* (see :mod:`meshdsl.ops`), against the
:class:`LoweringContext` protocol below. Three contexts implement it
(:mod:`meshdsl.rewrite.contexts` for the unsharded reference and the ``gspmd`` backend,
:mod:`meshdsl.rewrite.explicit` for the rewriter); ``md.lower`` pushes one for the duration of a trace.
Outside ``md.lower`` no context is active and :func:`current` returns ``None``: values are global.

This module sits at the bottom of the import graph (it imports nothing from meshdsl), so values
(:mod:`meshdsl.names.named`) can ask "am I inside a lowering?" without knowing who answers.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Protocol

__all__ = ["current", "using", "LoweringContext"]

_local = threading.local()


def current() -> LoweringContext | None:
    """The innermost active lowering context, or ``None`` outside ``md.lower``."""
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def using(ctx: LoweringContext):
    """Make ``ctx`` the active context while the block runs (nestable, per thread)."""
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    stack.append(ctx)
    try:
        yield ctx
    finally:
        stack.pop()


class LoweringContext(Protocol):
    """What a lowering rule may ask. ``x`` are NamedArrays; ``axes_by_name`` maps dim names to
    tuples of mesh axes (major first); ``vary`` / ``keep_pending`` are sets of mesh axes."""

    explicit: bool          # True inside the explicit rewriter (local blocks, recorded collectives)
    mesh: Any               # md.Mesh, or None for the unsharded reference
    layout: Any             # md.Layout, or None
    op: tuple | None        # (op name, user source line) of the outermost named op being lowered
    params: Any             # the param-gather policy (see meshdsl.rewrite.param_gather)

    def at(self, name: str, line: str):
        """Context manager: attribute what runs inside to op ``name`` at ``line`` (unless an
        outer op is already being lowered: a rule calling other ops is one op)."""

    def whole_placement(self, dims): ...

    def placement(self, x): ...

    def pending(self, x) -> frozenset: ...

    def layout_axes(self, name: str) -> tuple: ...

    def axes_size(self, axes) -> int: ...

    def plan(self, dims, operands, *, prefer=(), keep_pending=frozenset(), cheapest=False) -> dict:
        """Mesh axes per dim of an op's iteration space (see :mod:`meshdsl.rewrite.placement`)."""

    def vary(self, planned, operands=(), keep_pending=frozenset(), out_size=None) -> frozenset:
        """Mesh axes the op's local computation varies over."""

    def local(self, x, axes_by_name=None, vary=frozenset(), *, keep_pending=frozenset()):
        """``x``'s local block placed as ``axes_by_name`` (all data movement happens here)."""

    def out(self, array, dims, axes_by_name=None, pending=frozenset(), *, is_param=False):
        """Wrap a rule's local result as a NamedArray with its placement."""

    def read(self, x):
        """``x.array`` inside the lowering: the block typed exactly, pending sums reduced."""

    def adopt(self, array, dims, where: str):
        """Placement of a value ``md.named`` makes inside the lowering (a whole value)."""
