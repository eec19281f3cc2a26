"""What the compiler removes from a traced program before it runs: explain counts what is left.

* :func:`inline`: nested jits of plain equations spliced in (XLA sees through them);
* :func:`cse`: an equation repeating an earlier one is the earlier one (two identical gathers are
  one), with the simplifier's folds (a select between a value and itself, or on a constant
  predicate; ``max(x, x)``);
* :func:`meshdsl.costmodel.constants.fold`: constants folded (an index computed from literals, a
  slice reading only a pad's fill);
* :func:`live`: dead code dropped, then repeats merged - the program :mod:`meshdsl.views.explain`
  and the planner count collectives, memory and FLOPs on.
"""

from __future__ import annotations

import functools
import re

import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from ..platform.jaxcompat import called_jaxpr, dce, dot_dims
from .constants import fold
from .jaxpr_stats import SCOPES, sub_jaxprs

__all__ = ["live", "cse", "inline"]


def live(jaxpr, platform: str | None = None):
    """``jaxpr`` without what is never used and without repeats (the compiler's DCE and CSE, on
    ``platform``: :func:`cse`). Dead code goes first: a computation repeated by an aborted trace
    (``md.scan`` retrying a step) must not stand in for the live one (explain matches collectives by
    name scope). Cached (the latest)."""
    return _live(getattr(jaxpr, "jaxpr", jaxpr), platform != "cpu")   # (XLA:CPU: bf16 math runs in f32)


@functools.lru_cache(maxsize=1)   # a jaxpr is immutable and hashed by identity
def _live(jaxpr, folds_bf16: bool = True):
    merged, predicates_dropped = _cse(dce(fold(inline(jaxpr))), folds_bf16)
    return dce(merged) if predicates_dropped else merged   # else merging left nothing dead


_GATHER_PARAMS = ("all_gather_dimension", "axis_name", "axis_size", "tiled")


def _as_xla_sees(text: str) -> str:
    """A printed jaxpr without what XLA does not see: the varying-axes types, and the difference
    between a gather typed varying and one typed invariant (one all-gather to XLA)."""
    text = re.sub(r"\{V:[^}]*\}", "", text).replace("all_gather_invariant", "all_gather")
    return re.sub(r"\s*axis_index_groups=None", "", text)


def _as_xla_names(name: str) -> str:
    """A primitive's name as :func:`_as_xla_sees` prints it (an invariant gather is a gather)."""
    return "all_gather" if name == "all_gather_invariant" else name


class _ProgramKey:
    """A sub-program as :func:`cse` compares it: hashed by its equations' primitives and its
    inputs' types, equal where the programs print alike (:func:`_as_xla_sees`); printed only
    when two hash alike (printing every loop body was most of CSE's time)."""

    __slots__ = ("program", "_hash", "_text")

    def __init__(self, program):
        jaxpr = getattr(program, "jaxpr", program)
        self.program, self._text = program, None
        self._hash = hash((len(jaxpr.eqns), tuple(_as_xla_names(e.primitive.name) for e in jaxpr.eqns),
                           tuple((getattr(v.aval, "shape", None), str(getattr(v.aval, "dtype", ""))) for v in jaxpr.invars)))

    def text(self) -> str:
        if self._text is None:
            self._text = _as_xla_sees(str(self.program))
        return self._text

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return isinstance(other, _ProgramKey) and self._hash == other._hash and \
            (self.program is other.program or self.text() == other.text())

    def __repr__(self) -> str:
        return f"program#{self._hash}"


def _canonical(eqn, keys, params):
    """The CSE key of ``eqn``: its primitive, operands and parameters, with the two sides of a
    ``dot_general`` whose result does not depend on their order (one side has no free dims) in a
    fixed order: ``einsum(a, b, out="")`` and ``einsum(b, a, out="")`` are one value to XLA; so are
    an ``all_gather`` and an ``all_gather_invariant`` of one value."""
    if eqn.primitive.name in ("all_gather", "all_gather_invariant") and params.get("axis_index_groups") is None:
        return "all_gather", tuple(keys), tuple((k, params[k]) for k in _GATHER_PARAMS)
    if eqn.primitive.name == "dot_general":
        (lc, rc), (lb, rb) = dot_dims(eqn)
        free = [len(v.aval.shape) - len(c) - len(b) for v, c, b in zip(eqn.invars, (lc, rc), (lb, rb))]
        if free == [0, 0]:
            sides = sorted([(keys[0], tuple(lc), tuple(lb)), (keys[1], tuple(rc), tuple(rb))], key=repr)
            params = {**params, "dimension_numbers": tuple(sides)}
            keys = []
    return eqn.primitive, tuple(keys), tuple(sorted(params.items()))


_IDEMPOTENT = frozenset(("max", "min", "and", "or"))   # op(x, x) is x to XLA's simplifier


def _side_effects(eqn) -> bool:   # (a collective's named-axis effect is none)
    return any(type(e).__name__ != "NamedAxisEffect" for e in eqn.effects)


_KEEPS_FILL = frozenset(("broadcast_in_dim", "pvary", "copy", "copy_p", "reshape"))   # a filled value stays filled


def _filled(v, filled):
    """The constant every element of ``v`` holds (a literal, or a broadcast of one), else None."""
    if isinstance(v, jcore.Literal):
        return np.asarray(v.val).item() if np.size(v.val) == 1 else None
    return filled.get(v)


def cse(jaxpr, folds_bf16: bool = True):
    """``jaxpr`` with each pure equation that repeats an earlier one (same primitive, parameters and
    inputs) replaced by the earlier one's results: a program that computes one value twice (two
    identical einsums and their all-reduces) runs it once once XLA has merged them. A select on a
    constant predicate (a broadcast literal) is the case it picks, in every dtype; a select
    between one value and itself is that value (XLA's simplifier: the predicate, and whatever only
    it needed, is dropped); so is ``max``/``min``/``and``/``or`` of it and itself, or its
    ``stop_gradient`` - but in bfloat16 under ``folds_bf16=False`` (XLA:CPU keeps them)."""
    return _cse(jaxpr, folds_bf16)[0]


def _cse(jaxpr, folds_bf16: bool = True):
    """:func:`cse`, and whether a select's predicate went unused (else merging leaves none dead)."""
    subst, seen, eqns, selects = {}, {}, [], False

    def key_of(v):
        if isinstance(v, jcore.Literal):
            return ("literal", repr(v.val), str(v.aval))
        v = subst.get(v, v)
        return ("var", id(v))

    def param_key(value):
        if isinstance(value, (jcore.Jaxpr, jcore.ClosedJaxpr)):
            return _ProgramKey(value)  # structure, not name scopes: tags differ, programs do not
        if callable(value) or type(value).__name__ == "WrappedFun":  # rules (custom_vjp's fwd / bwd): the program is already differentiated
            return "callable"
        if isinstance(value, (tuple, list)):
            return tuple(param_key(x) for x in value)
        try:
            hash(value)
            return value
        except TypeError:
            return ("id", id(value))

    filled: dict = {}   # variable -> the constant every element of it holds (a broadcast literal)
    for eqn in jaxpr.eqns:
        invars = [v if isinstance(v, jcore.Literal) else subst.get(v, v) for v in eqn.invars]
        if _side_effects(eqn):  # real side effects stay
            eqns.append(eqn.replace(invars=invars))
            continue
        fill = _filled(invars[0], filled) if invars else None
        if fill is not None and eqn.primitive.name in _KEEPS_FILL:
            filled[eqn.outvars[0]] = fill
        cases = eqn.invars[1:]
        if eqn.primitive.name == "select_n" and fill is not None and 0 <= int(fill) < len(cases) and \
                not isinstance(cases[int(fill)], jcore.Literal):
            subst[eqn.outvars[0]] = subst.get(cases[int(fill)], cases[int(fill)])   # a constant predicate
            selects = True
            continue
        folds = folds_bf16 or eqn.outvars[0].aval.dtype != jnp.bfloat16
        if folds and eqn.primitive.name == "select_n" and len({key_of(v) for v in cases}) == 1 and \
                not isinstance(cases[0], jcore.Literal):
            subst[eqn.outvars[0]] = subst.get(cases[0], cases[0])  # where(p, x, x) is x: p unused
            selects = True
            continue
        if (folds and eqn.primitive.name in _IDEMPOTENT and len({key_of(v) for v in eqn.invars}) == 1 or
                eqn.primitive.name == "stop_gradient") and not isinstance(eqn.invars[0], jcore.Literal):   # (no op to XLA)
            subst[eqn.outvars[0]] = subst.get(eqn.invars[0], eqn.invars[0])   # max(x, x) is x
            continue
        key = _canonical(eqn, [key_of(v) for v in eqn.invars],
                         {k: param_key(v) for k, v in eqn.params.items()})
        first = seen.get(key)
        if first is not None and len(first.outvars) == len(eqn.outvars):
            subst.update(zip(eqn.outvars, first.outvars))
            continue
        new = eqn.replace(invars=invars)
        seen[key] = new
        eqns.append(new)
    if not subst:
        return jaxpr, False
    outvars = [v if isinstance(v, jcore.Literal) else subst.get(v, v) for v in jaxpr.outvars]
    return jaxpr.replace(eqns=eqns, outvars=outvars), selects


_JITS, _CUSTOM_CALLS = ("pjit", "jit"), ("custom_vjp_call", "custom_jvp_call")


def inline(jaxpr):
    """``jaxpr`` with its nested jits of plain equations, and custom-derivative calls of one (their
    primal: a recorded collective's), spliced in, so that :func:`cse` sees through them as XLA does
    (a gather in a custom_vjp and one outside it are one). Other calls stay (the liveness model is
    measured on them)."""
    subst, eqns, changed = {}, [], False
    for eqn in jaxpr.eqns:
        invars = [v if isinstance(v, jcore.Literal) else subst.get(v, v) for v in eqn.invars]
        closed = called_jaxpr(eqn) if eqn.primitive.name in _JITS + _CUSTOM_CALLS else None
        if eqn.primitive.name in _CUSTOM_CALLS and closed is not None and len(closed.jaxpr.eqns) != 1:
            closed = None
        if not isinstance(closed, jcore.ClosedJaxpr) or closed.consts or _side_effects(eqn) or \
                re.search(SCOPES, str(eqn.source_info.name_stack)) or any(next(sub_jaxprs(e), None) is not None for e in closed.jaxpr.eqns):
            eqns.append(eqn.replace(invars=invars))
            continue
        changed = True
        inner = inline(closed.jaxpr)
        names = dict(zip(inner.invars, invars))
        for e in inner.eqns:  # fresh variables: one jit (one jaxpr) may be called twice
            outvars = [v if type(v).__name__ == "DropVar" else jcore.Var(v.aval) for v in e.outvars]
            names.update(zip(e.outvars, outvars))
            eqns.append(e.replace(invars=[v if isinstance(v, jcore.Literal) else names.get(v, v) for v in e.invars],
                                  outvars=outvars))
        for out, v in zip(eqn.outvars, inner.outvars):
            subst[out] = v if isinstance(v, jcore.Literal) else names.get(v, v)
    if not changed:
        return jaxpr
    outvars = [v if isinstance(v, jcore.Literal) else subst.get(v, v) for v in jaxpr.outvars]
    return jaxpr.replace(eqns=eqns, outvars=outvars)
