"""Cost figures read off a traced (not compiled) program: matmul FLOPs, buffers, collectives.

``md.explain`` traces the per-device program (the body of ``shard_map``) to a jaxpr. From it:

* **FLOPs**: ``2 * prod(result) * prod(contracted)`` per ``dot_general``, times loop trip counts
  (``scan`` lengths); the backward pass is included when ``fn`` takes gradients.
* which values XLA keeps in memory (:func:`materialized`; the memory model: :mod:`.liveness`)."""

from __future__ import annotations

import functools
import math
import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from ..platform.jaxcompat import MATMULS, called_jaxpr, dce, dot_dims, matmul_groups, scan_parts

__all__ = ["ALIASES", "CALLS", "FUSIBLE", "bytes_accessed", "matmul_flops", "materialized", "nbytes", "sub_jaxprs", "inner_body", "live", "name_scopes"]

SCOPES = r"mdc\d+"   # the name scopes of recorded collectives (meshdsl.rewrite.collectives)


def sub_jaxprs(eqn):
    for value in eqn.params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, (jcore.ClosedJaxpr, jcore.Jaxpr)):
                yield v.jaxpr if isinstance(v, jcore.ClosedJaxpr) else v


def _trip_count(eqn) -> int:
    return scan_parts(eqn).length if eqn.primitive.name == "scan" else 1


def nbytes(aval) -> int:
    shape, dtype = getattr(aval, "shape", None), getattr(aval, "dtype", None)
    if shape is None or dtype is None:
        return 0
    return math.prod(shape) * (8 if jnp.issubdtype(dtype, jax.dtypes.extended) else np.dtype(dtype).itemsize)   # (PRNG keys: 8)


def matmul_flops(jaxpr) -> float:
    """Matmul FLOPs of one execution of ``jaxpr`` (per device inside shard_map)."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    total = 0.0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in MATMULS:
            (lc, _), _ = dot_dims(eqn)
            lhs = eqn.invars[0].aval.shape
            out = eqn.outvars[0].aval.shape
            total += 2.0 * math.prod(out) * math.prod(lhs[i] for i in lc) * matmul_groups(eqn)
        elif eqn.primitive.name == "cond":
            total += max((matmul_flops(j) for j in sub_jaxprs(eqn)), default=0.0)
        else:
            total += _trip_count(eqn) * sum(matmul_flops(j) for j in sub_jaxprs(eqn))
    return total


# ops whose result is their operand's buffer (no copy)
ALIASES = frozenset(("pvary", "name", "reshape", "squeeze", "expand_dims", "stop_gradient", "optimization_barrier"))
_READS_PART = frozenset(("dynamic_slice", "slice", "gather"))
_WRITES_PART = frozenset(("dynamic_update_slice", "scatter", "scatter-add", "scatter_add"))


def bytes_accessed(jaxpr) -> float:
    """HBM bytes one execution of ``jaxpr`` reads and writes (per device inside shard_map): every
    op reads its operands that are buffers (arguments, materialized values: :func:`materialized`)
    and writes its results that are; the inside of a fused elementwise chain is neither. A loop's
    body counts once per iteration, a ``cond`` its costliest branch."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    kept = materialized(jaxpr) | {v for v in jaxpr.invars}
    total = 0.0
    for eqn in jaxpr.eqns:
        subs = list(sub_jaxprs(eqn))
        if subs:
            inner = [bytes_accessed(j) for j in subs]
            total += max(inner) if eqn.primitive.name == "cond" else _trip_count(eqn) * sum(inner)
            continue
        if eqn.primitive.name in ALIASES:
            continue
        if eqn.primitive.name in _READS_PART:   # reads the part it returns
            total += 2 * sum(nbytes(v.aval) for v in eqn.outvars if v in kept)
        elif eqn.primitive.name in _WRITES_PART:   # in place: reads and writes the update's rows
            total += 2 * nbytes(eqn.invars[-1].aval)
        else:
            total += sum(nbytes(v.aval) for v in (*eqn.invars, *eqn.outvars) if isinstance(v, jcore.Var) and v in kept)
    return total


FUSIBLE = frozenset("""
    add sub mul div max min neg abs sign floor ceil round exp exp2 log log1p expm1 tanh logistic sqrt
    rsqrt cbrt pow integer_pow square erf erf_inv sin cos select_n convert_element_type eq ne lt le gt ge
    and or not xor shift_left shift_right_logical shift_right_arithmetic broadcast_in_dim reshape squeeze
    expand_dims iota pvary stop_gradient copy copy_p clamp nextafter is_finite threefry2x32 random_bits
    """.split())


def materialized(jaxpr) -> set:
    """Values XLA keeps in memory: everything except the inside of elementwise chains it fuses
    (an elementwise result read once, by another elementwise op)."""
    consumers: dict = {}
    for eqn in jaxpr.eqns:
        for v in eqn.invars:
            if isinstance(v, jcore.Var):
                consumers.setdefault(v, []).append(eqn)
    outs = {v for v in jaxpr.outvars if isinstance(v, jcore.Var)}
    kept = set()
    for eqn in jaxpr.eqns:
        fusible = eqn.primitive.name in FUSIBLE
        for v in eqn.outvars:
            users = consumers.get(v, [])
            if v in outs or not fusible or len(users) != 1 or users[0].primitive.name not in FUSIBLE:
                kept.add(v)
    return kept


def inner_body(closed):
    """The per-device program: the body of the outermost ``shard_map``, else the jaxpr itself."""
    jaxpr = getattr(closed, "jaxpr", closed)
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "shard_map":
            return called_jaxpr(eqn)
        for sub in sub_jaxprs(eqn):
            found = inner_body(sub)
            if found is not sub:
                return found
    return jaxpr


def live(jaxpr, platform: str | None = None):
    """``jaxpr`` without what is never used and without repeats (the compiler's DCE and CSE, on
    ``platform``: :func:`cse`). Dead code goes first: a computation repeated by an aborted trace
    (``md.scan`` retrying a step) must not stand in for the live one (explain matches collectives by
    name scope). Cached (the latest)."""
    return _live(getattr(jaxpr, "jaxpr", jaxpr), platform != "cpu")   # (XLA:CPU: bf16 math runs in f32)


@functools.lru_cache(maxsize=1)   # a jaxpr is immutable and hashed by identity
def _live(jaxpr, folds_bf16: bool = True):
    merged, predicates_dropped = _cse(dce(inline(jaxpr)), folds_bf16)
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


def cse(jaxpr, folds_bf16: bool = True):
    """``jaxpr`` with each pure equation that repeats an earlier one (same primitive, parameters and
    inputs) replaced by the earlier one's results: a program that computes one value twice (two
    identical einsums and their all-reduces) runs it once once XLA has merged them. A select
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

    for eqn in jaxpr.eqns:
        invars = [v if isinstance(v, jcore.Literal) else subst.get(v, v) for v in eqn.invars]
        if _side_effects(eqn):  # real side effects stay
            eqns.append(eqn.replace(invars=invars))
            continue
        cases = eqn.invars[1:]
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


def name_scopes(jaxpr, pattern: str = SCOPES, multiplier: int = 1, forms=None) -> Counter:
    """How many times each name scope matching ``pattern`` runs: every equation carrying it, times
    the trip counts of the loops around it (sub-programs included; jax wraps scopes, e.g.
    ``transpose(jvp(mdc3))``, and a rematerialized equation appears twice). An equation in a scan
    body that depends on neither the carry nor the scanned inputs runs once: XLA hoists it. A
    gather or sum XLA folds (:func:`_constant_forms`) does not run."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    out = Counter()
    forms, folded = _constant_forms(jaxpr, forms or {})
    for eqn in jaxpr.eqns:
        if id(eqn) in folded:
            continue
        for tag in set(re.findall(pattern, str(eqn.source_info.name_stack))):
            out[tag] += multiplier
        if eqn.primitive.name == "scan":
            out.update(_scan_body_scopes(eqn, pattern, multiplier, forms))
            continue
        for sub in sub_jaxprs(eqn):
            out.update(name_scopes(sub, pattern, multiplier, _inner_forms(eqn, sub, forms)))
    return out


def _inner_forms(eqn, sub, forms) -> dict:
    """The forms (:func:`_constant_forms`) of a called program's inputs (pjit, custom_vjp_call, ...)."""
    if len(sub.invars) != len(eqn.invars):
        return {}
    return {s: _form(v, forms) for s, v in zip(sub.invars, eqn.invars) if _form(v, forms)}


_GATHER_REDUCE = ("all_gather", "all_gather_invariant", "psum", "psum_invariant", "pmax", "pmin")
# Ops that keep a broadcast constant a broadcast constant, as XLA's simplifier rewrites them (an
# elementwise op of broadcasts is a broadcast; so are a reshape, slice or reduction of one).
_KEEPS_BROADCAST = frozenset((
    "broadcast_in_dim", "reshape", "transpose", "squeeze", "expand_dims", "slice", "dynamic_slice", "rev",
    "concatenate", "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "convert_element_type", "pvary", "copy", "copy_p",
    "neg", "add", "sub", "mul", "div", "max", "min", "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic",
    "sqrt", "rsqrt", "abs", "sign", "floor", "ceil", "round", "sin", "cos", "erf", "integer_pow", "pow", "square",
    "select_n", "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not", "stop_gradient"))
CALLS = ("pjit", "jit", "closed_call", "custom_vjp_call", "custom_jvp_call", "remat", "checkpoint")


def _form(v, forms):
    if isinstance(v, jcore.Literal):
        return "scalar" if math.prod(np.shape(v.val)) == 1 else None
    return forms.get(v)


def _constant_forms(jaxpr, forms):
    """Which variables XLA sees as constants, and the ids of the gathers and sums it folds. A
    value computed from constants alone is a ``"scalar"`` constant (one element) or, broadcast to
    more than one element and carried through ops that keep it so (:data:`_KEEPS_BROADCAST`), a
    ``"broadcast"`` constant. XLA folds a gather or sum of a broadcast constant (it is the same on
    every device: a constant cotangent, the gradient of ``sum(x)``, gathered in the backward pass;
    a max or min of one, as a logsumexp of a pad's zeros takes it),
    but not of a one-element constant, an iota, a pad or a matmul of constants (measured on the
    CPU backend: ``psum`` of a zero-filled ``[4, 2]`` folds, of ``0.0``, ``[1]`` or ``arange(4)``
    does not)."""
    forms, folded = dict(forms), set()
    for eqn in jaxpr.eqns:
        # a slice of a broadcast at any (traced) position is that broadcast
        ins = [_form(v, forms) for v in (eqn.invars[:1] if eqn.primitive.name == "dynamic_slice" else eqn.invars)]
        if not all(ins) or any(type(e).__name__ != "NamedAxisEffect" for e in eqn.effects):
            continue
        name = eqn.primitive.name
        if name in _GATHER_REDUCE:
            if all(f == "broadcast" for f in ins):
                folded.add(id(eqn))
                forms.update((v, "broadcast") for v in eqn.outvars)
            continue
        if name in CALLS:
            subs = list(sub_jaxprs(eqn))
            if len(subs) == 1:
                inner, _ = _constant_forms(subs[0], _inner_forms(eqn, subs[0], forms))
                forms.update((o, _form(i, inner)) for o, i in zip(eqn.outvars, subs[0].outvars) if _form(i, inner))
            continue
        if name in _KEEPS_BROADCAST:
            for v in eqn.outvars:
                forms[v] = "broadcast" if math.prod(v.aval.shape) > 1 else "scalar"
    return forms, folded


def _scan_body_scopes(eqn, pattern, multiplier, outer_forms) -> Counter:
    scan = scan_parts(eqn)
    body, length, n_consts, n_carry = scan.body, scan.length, scan.n_consts, scan.n_carry
    # A carry the body passes through unchanged is loop-invariant too (XLA hoists what reads it).
    passed = {v for k, v in enumerate(body.invars[n_consts:n_consts + n_carry])
              if k < len(body.outvars) and body.outvars[k] is v}
    variant = set(body.invars[n_consts:]) - passed
    outer = [_form(v, outer_forms) for v in eqn.invars]
    forms, folded = _constant_forms(body, {b: outer[k] for k, b in enumerate(body.invars[:n_consts + n_carry])
                                           if outer[k] and (k < n_consts or b in passed)})
    out = Counter()
    for inner in body.eqns:
        loop_variant = any(isinstance(v, jcore.Var) and v in variant for v in inner.invars)
        if loop_variant:
            variant.update(inner.outvars)
        if id(inner) in folded:
            continue
        m = multiplier * length if loop_variant else multiplier
        for tag in set(re.findall(pattern, str(inner.source_info.name_stack))):
            out[tag] += m
        if inner.primitive.name == "scan":
            out.update(_scan_body_scopes(inner, pattern, m, forms))
        else:
            for sub in sub_jaxprs(inner):
                out.update(name_scopes(sub, pattern, m, _inner_forms(inner, sub, forms)))
    return out
