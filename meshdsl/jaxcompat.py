"""Every use of jax internals (``jax._src``) in meshdsl, in one small module.

The rewriter needs five things public jax does not offer: the trace being built now and the
traces enclosing it (to hoist the relayout of a value a ``md.scan`` step captures out of the
loop), running code in an enclosing trace, a trace built apart and thrown away (the planner
prices a candidate there, undifferentiated), dead-code elimination of a jaxpr (``md.explain``
drops collectives the compiler drops), and whether a value is being differentiated (an einsum
weighs its backward collectives too). A jax upgrade that moves them breaks this file only.

Public-API helpers that belong with them: :func:`varying_axes` (the ``shard_map`` type of a value).
"""

from __future__ import annotations

import contextlib
import itertools

import jax
from jax._src import config as _config
from jax._src import core as _core
from jax._src.interpreters import ad as _ad
from jax._src.interpreters import partial_eval as _pe

__all__ = ["current_trace", "parent_trace", "enclosing_trace", "in_trace", "apart", "fresh", "dce",
           "varying_axes", "differentiated"]

_APART: dict = {}   # id(trace built apart) -> the trace it stands in for

# Part of jax's trace context: jax caches what it traces (a jax.checkpoint'ed function, a loop
# body) by function, argument types and this context. The rewriter's rules are not pure (what
# they emit is recorded; the plan answers their questions), so each of its traces takes a new
# value: a function traced again by another candidate or trace runs the rules again.
_EPOCH = _config.string_or_object_state(
    "meshdsl_trace_epoch", None, help="meshdsl: which of the rewriter's traces is running (see jaxcompat)",
    include_in_trace_context=True)
_epochs = itertools.count()


def varying_axes(array) -> frozenset:
    """Mesh axes jax's type system says ``array`` varies over (empty outside ``shard_map``)."""
    try:
        return frozenset(jax.typeof(array).mat.varying)
    except (AttributeError, TypeError):
        return frozenset()


def differentiated(value) -> bool:
    """Is ``value`` being differentiated (a tracer of ``jax.grad``'s forward pass)? Its
    operations then also run backward, and their backward collectives count. In a trace built
    :func:`apart`, a value computed from one is."""
    trace = getattr(value, "_trace", None)
    if isinstance(trace, (_ad.JVPTrace, _ad.LinearizeTrace)):
        return True
    if id(trace) not in _APART:
        return False
    stack, seen = [value], set()
    while stack:   # back through what the apart trace computed it from, to the values it read
        t = stack.pop()
        if id(t) in seen:
            continue
        seen.add(id(t))
        if getattr(t, "_trace", None) is not trace:
            if differentiated(t):
                return True
            continue
        read = trace.frame.constvar_to_val.get(t.val) if isinstance(t.val, _core.Var) else None
        if read is not None:
            if differentiated(read):
                return True
        elif t.parent is not None:
            stack.extend(t.parent.in_tracers)
    return False


def current_trace():
    """The jax trace being built now."""
    return _core.trace_ctx.trace


def parent_trace(trace):
    """The trace enclosing ``trace`` (``None`` at the top)."""
    return getattr(trace, "parent_trace", None)


def enclosing_trace(value, trace):
    """The trace owning tracer ``value`` if it strictly encloses ``trace``, else ``trace``. A
    trace built :func:`apart` stands in for the trace it was opened in: a value of that trace is
    owned by it."""
    owner = getattr(value, "_trace", None)
    if owner is None or owner is trace:
        return trace
    below, t = trace, parent_trace(trace)
    while t is not None:
        if t is owner:
            return below if id(below) in _APART else owner
        below, t = t, parent_trace(t)
    return trace


def stands_for(trace):
    """The trace ``trace`` stands in for (itself, or the trace one built :func:`apart` was opened in)."""
    return _APART.get(id(trace), trace)


def fresh():
    """A context in which jax traces again what it traced before (its caches keyed apart): one of
    the rewriter's traces, or a candidate's, runs the rules of every function it calls."""
    return _EPOCH(next(_epochs))


@contextlib.contextmanager
def apart(own_context: bool = False):
    """Build what runs inside into a fresh trace thrown away after (a candidate the planner
    prices): it reads the values of the traces around it as constants and differentiates nothing,
    so it costs what tracing the forward alone costs, and leaves no dead code behind.
    ``own_context``: a candidate tracing the user's functions (a loop body) traces them as a trace
    of its own (:func:`fresh`); other candidates share jax's caches with the trace around them."""
    parent = current_trace()
    trace = _pe.DynamicJaxprTrace(None, parent_trace=parent)
    _APART[id(trace)] = parent
    try:
        with _core.set_current_trace(trace), (fresh() if own_context else contextlib.nullcontext()):
            yield
    finally:
        del _APART[id(trace)]
        trace.invalidate()


@contextlib.contextmanager
def in_trace(trace):
    """Build what runs inside into ``trace`` (an enclosing trace) instead of the current one."""
    with _core.set_current_trace(trace):
        yield


def dce(jaxpr):
    """``jaxpr`` without the computations whose results are never used (as XLA drops them)."""
    return _pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))[0]
