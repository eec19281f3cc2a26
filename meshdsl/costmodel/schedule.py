"""The order XLA's memory scheduler may run a program's ops in: a list schedule.

jax writes a backward pass in the order it transposed the forward one: each layer's weight
gradients, then its input's gradient. XLA's scheduler (``hlo_memory_scheduler``: the least
peak of a list scheduler, a depth-first and a post-order one) runs the ops in another order
where that holds less: the input's gradient first, so a weight gathered for the layer (ZeRO-3)
dies before the weight-gradient matmuls make their results. :mod:`meshdsl.costmodel.liveness`
takes the lesser peak of jaxpr's order and :func:`scheduled`'s in sub-programs (a loop's body).

:func:`scheduled` is a list scheduler as XLA's: of the ops whose operands are made, run next the
one that frees the most bytes less what it makes (ties to the earliest in program order). A
value's buffer is freed when its last reader runs (an alias's readers are its buffer's), unless
it is an argument or a result; values an elementwise chain fuses are no buffers
(:func:`meshdsl.costmodel.jaxpr_stats.materialized`). Ops with side effects keep their order.

Example (two independent chains: each value dies as soon as it may):

    >>> import jax, jax.numpy as jnp
    >>> from meshdsl.costmodel.schedule import scheduled
    >>> def f(a, b):
    ...     x, y = a @ a, b @ b          # jax: both made, then both read
    ...     return jnp.sum(x @ a), jnp.sum(y @ b)
    >>> jaxpr = jax.make_jaxpr(f)(jnp.ones((4, 4)), jnp.ones((4, 4))).jaxpr
    >>> before = [str(e.outvars[0]) for e in jaxpr.eqns]
    >>> [before.index(str(e.outvars[0])) for e in scheduled(jaxpr).eqns]
    [0, 2, 3, 1, 4, 5]
"""

from __future__ import annotations

from collections import Counter

from jax.extend import core as jcore

from ..platform.jaxcompat import in_host_memory
from .jaxpr_stats import ALIASES, materialized
from .jaxpr_stats import nbytes as _bytes

__all__ = ["scheduled"]


def _effectful(eqn) -> bool:   # (a collective's named-axis effect orders nothing)
    return any(type(e).__name__ != "NamedAxisEffect" for e in eqn.effects)


def _graph(eqns) -> tuple[list, list]:
    """Per op, how many ops it waits for, and the ops waiting for it."""
    maker = {v: k for k, eqn in enumerate(eqns) for v in eqn.outvars}
    waits, users, before = [0] * len(eqns), [[] for _ in eqns], None
    for k, eqn in enumerate(eqns):
        deps = {maker[v] for v in eqn.invars if isinstance(v, jcore.Var) and v in maker}
        if _effectful(eqn):
            if before is not None:
                deps.add(before)
            before = k
        waits[k] = len(deps)
        for d in deps:
            users[d].append(k)
    return waits, users


def scheduled(jaxpr):
    """``jaxpr`` with its ops in the order of the list scheduler of the module doc."""
    eqns = jaxpr.eqns
    if len(eqns) < 3:
        return jaxpr
    owner = {}
    for eqn in eqns:
        if eqn.primitive.name in ALIASES and len(eqn.invars) == 1 and isinstance(eqn.invars[0], jcore.Var):
            owner[eqn.outvars[0]] = owner.get(eqn.invars[0], eqn.invars[0])
    held = {owner.get(v, v) for v in (*jaxpr.invars, *jaxpr.constvars, *jaxpr.outvars) if isinstance(v, jcore.Var)}
    kept = materialized(jaxpr)
    size = lambda v: 0 if in_host_memory(v.aval) or v not in kept else _bytes(v.aval)   # noqa: E731
    reads = [Counter(owner.get(v, v) for v in eqn.invars if isinstance(v, jcore.Var)) for eqn in eqns]
    made = [sum(size(v) for v in eqn.outvars if isinstance(v, jcore.Var) and v not in owner) for eqn in eqns]
    left = Counter()   # buffer -> readers not yet run
    for r in reads:
        left.update(r)

    def gain(k):
        return sum(size(b) for b, n in reads[k].items() if left[b] == n and b not in held) - made[k]

    waits, users = _graph(eqns)
    ready, order = {k for k, w in enumerate(waits) if not w}, []
    while ready:
        k = max(ready, key=lambda k: (gain(k), -k))
        ready.remove(k)
        order.append(k)
        left.subtract(reads[k])
        for u in users[k]:
            waits[u] -= 1
            if not waits[u]:
                ready.add(u)
    return jaxpr.replace(eqns=[eqns[k] for k in order])
