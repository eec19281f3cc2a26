"""Every use of jax internals (``jax._src``) in meshdsl, in one small module.

The rewriter needs four things public jax does not offer: the trace being built now and the
traces enclosing it (to hoist the relayout of a value a ``md.scan`` step captures out of the
loop), running code in an enclosing trace, dead-code elimination of a jaxpr (``md.explain``
drops collectives the compiler drops), and whether a value is being differentiated (an einsum
weighs its backward collectives too). A jax upgrade that moves them breaks this file only.

Public-API helpers that belong with them: :func:`varying_axes` (the ``shard_map`` type of a value).
"""

from __future__ import annotations

import contextlib

import jax
from jax._src import core as _core
from jax._src.interpreters import ad as _ad
from jax._src.interpreters import partial_eval as _pe

__all__ = ["current_trace", "parent_trace", "enclosing_trace", "in_trace", "dce", "varying_axes", "differentiated"]


def varying_axes(array) -> frozenset:
    """Mesh axes jax's type system says ``array`` varies over (empty outside ``shard_map``)."""
    try:
        return frozenset(jax.typeof(array).mat.varying)
    except (AttributeError, TypeError):
        return frozenset()


def differentiated(value) -> bool:
    """Is ``value`` being differentiated (a tracer of ``jax.grad``'s forward pass)? Its
    operations then also run backward, and their backward collectives count."""
    return isinstance(getattr(value, "_trace", None), (_ad.JVPTrace, _ad.LinearizeTrace))


def current_trace():
    """The jax trace being built now."""
    return _core.trace_ctx.trace


def parent_trace(trace):
    """The trace enclosing ``trace`` (``None`` at the top)."""
    return getattr(trace, "parent_trace", None)


def enclosing_trace(value, trace):
    """The trace owning tracer ``value`` if it strictly encloses ``trace``, else ``trace``."""
    owner = getattr(value, "_trace", None)
    if owner is None or owner is trace:
        return trace
    t = parent_trace(trace)
    while t is not None:
        if t is owner:
            return owner
        t = parent_trace(t)
    return trace


@contextlib.contextmanager
def in_trace(trace):
    """Build what runs inside into ``trace`` (an enclosing trace) instead of the current one."""
    with _core.set_current_trace(trace):
        yield


def dce(jaxpr):
    """``jaxpr`` without the computations whose results are never used (as XLA drops them)."""
    return _pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))[0]
