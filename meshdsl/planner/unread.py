"""Which ops' forward values the program never reads: found in the planning trace.

``jax.grad(loss)`` runs the loss forward and throws its value away: only the gradients leave the
program. What the forward pass computes only for that value - the sums that make the loss a
scalar, the all-reduce of its pending sum - the compiler drops. The backward pass still runs
through those ops (their transposes: a pending sum's cotangent, a cast's all-reduce). So a plan
that reduces the loss's sum in the forward pass moves nothing there, and one that keeps it
pending pays in the backward pass; priced alike, the solver could not tell them apart.

The planning trace names each outermost op's computation (the name scope
:data:`~meshdsl.planner.record.OP_SCOPE` ``<k>``). After it, :func:`unread` reads the traced
program with its dead code dropped (as the compiler drops it): a sink (an ``x.array`` read) is
unread where the block read there is; op ``k``'s forward is unread where no live forward
equation (one not under a ``transpose``) carries its scope, none of its results is read by a
live equation, and every reader of its results (ops and sinks) is unread. :func:`meshdsl.planner.plan.build` then prices such an op's strategies, and the relays
it needs, by their backward pass alone.

The default strategy's trace stands for all the op's strategies: one whose forward computes
something the backward pass reads (a copy a strategy gathers, read again for the gradient) is
priced as the default's is. A value of an inner trace (a loop body, a ``jax.checkpoint``ed
function) is never unread here: its variable is not the traced program's.
"""

from __future__ import annotations

import re

from jax.extend import core as jcore

from ..costmodel.jaxpr_stats import inner_body
from ..platform.jaxcompat import dce
from .record import OP_SCOPE

__all__ = ["unread"]

_SCOPE = re.compile(rf"{OP_SCOPE}(\d+)")


def unread(closed, recording) -> tuple[frozenset, frozenset]:
    """``(op numbers, sink indices)`` of ``recording`` (its planning trace traced to ``closed``)
    whose forward values the program never reads."""
    body = inner_body(closed)
    defined = set(body.invars).union(*(e.outvars for e in body.eqns))
    live = dce(body)
    read = {v for v in live.outvars if isinstance(v, jcore.Var)}
    computed = set()   # op numbers with a live forward equation
    for eqn in live.eqns:
        read.update(v for v in eqn.invars if isinstance(v, jcore.Var))
        stack = str(eqn.source_info.name_stack)
        if "transpose(" not in stack:
            computed.update(int(k) for k in _SCOPE.findall(stack))

    def never_read(var) -> bool:
        return var is not None and var in defined and var not in read

    sinks = frozenset(i for i, var in enumerate(recording.sink_vars) if never_read(var))
    readers: dict = {}   # value id -> whether each reader (an op, a sink) is unread
    for i, (v, _) in enumerate(recording.sinks):
        readers.setdefault(v, []).append(i in sinks)
    ops = set()
    for k in range(len(recording.ops) - 1, -1, -1):   # readers first
        op = recording.ops[k]
        dropped = bool(op.results) and not op.inner and k not in computed and \
            all(never_read(recording.vars.get(v)) and readers.get(v) and all(readers[v]) for v in op.results)
        if dropped:
            ops.add(k)
        for v in op.operands:
            readers.setdefault(v, []).append(dropped)
    return frozenset(ops), sinks
