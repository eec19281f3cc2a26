"""Cost figures read off a traced (not compiled) program: matmul FLOPs, buffers, collectives.

``md.explain`` traces the per-device program (the body of ``shard_map``) to a jaxpr. From it:

* **FLOPs**: ``2 * prod(result) * prod(contracted)`` per ``dot_general``, times loop trip counts
  (``scan`` lengths); the backward pass is included when ``fn`` takes gradients.
* which values XLA keeps in memory (:func:`materialized`; the memory model: :mod:`.liveness`)."""

from __future__ import annotations

import math
import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from ..platform.jaxcompat import MATMULS, called_jaxpr, dot_dims, matmul_groups, scan_parts

__all__ = ["ALIASES", "CALLS", "FUSIBLE", "SCOPES", "bytes_accessed", "matmul_flops", "materialized", "nbytes", "sub_jaxprs", "inner_body", "name_scopes"]

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
