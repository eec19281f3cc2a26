"""A loop's remat policy as strategies of the loop: what its steps keep for the backward pass,
and what recomputing the rest costs.

A ``md.scan(..., remat=...)`` step whose backward pass jax runs keeps, per step and until then,
the residuals of its policy (:mod:`meshdsl.ops.remat`), as the planner counts them from the ops
its body ran (each value at its per-device size where the rule put it, as often as it runs):

* ``"none"``: every value made in the step that a body op other than a linear one (a sum, a move,
  a cast) reads (autodiff keeps such an op's operands or its result, which the next op reads),
  and the carry entering each step;
* ``"dots"``: the results of the step's einsums without batch dims (no dim in both operands and
  the result: a layer's projections) and the carry entering each step;
* ``"full"``: the carry entering each step;
* ``"offload"`` / ``"offload-dots"``: the carry on the device, and ``"none"``'s / ``"dots"``'
  residuals in host memory: moved there in the forward pass and back in the backward (``host``
  bytes each way), each way priced beyond the compute of its pass (``beside``), which it overlaps.

What a policy recomputes runs again in the backward pass: ``"full"`` the step's forward compute,
``"dots"`` all of it but those einsums; both run the step's forward collectives again (what they
moved is recomputed from what was kept). Under ``remat="auto"`` the loop takes one strategy per
policy of :data:`meshdsl.ops.remat.CHOICES`: its decision point's candidate, the residuals it
keeps (``held``), the forward compute (``again``) and collectives it runs again; the solver
weighs them with the placements, by the step's time under the memory budget. Under a named policy
(``"none"``, ``"dots"``, ``"full"``) the loop's one strategy keeps that policy's residuals.
"""

from __future__ import annotations

import dataclasses
import math

from ..costmodel.cost import element_bytes
from ..ops import remat as remats
from ..platform.jaxcompat import differentiated

__all__ = ["value_bytes", "strategies", "ACCOUNTED"]

ACCOUNTED = ("none", "dots", "full", *remats.OFFLOADS)   # the policies whose residuals the planner counts


def value_bytes(ctx, recording, v, pl) -> float:
    """Bytes per device value ``v`` holds in placement ``pl``."""
    dims, dtype, _, _ = recording.values[v]
    return element_bytes(dtype, ctx.mesh.platform) * math.prod(dims.sizes) / ctx.mesh.axes_size(tuple(pl.split_axes()))


def _batchless_einsum(recording, op) -> bool:
    """An einsum of two operands no dim of which is in both and in its result (``x[b s d] w[d f]``):
    jax's ``dots_with_no_batch_dims_saveable`` keeps its result."""
    if op.name != "einsum" or len(op.operands) != 2 or len(op.results) != 1:
        return False
    a, b = (set(recording.values[v][0].names) for v in op.operands)
    return not (a & b & set(recording.values[op.results[0]][0].names))


# ops whose backward reads none of their operands (a sum's, a move's, a cast's): autodiff keeps none
_LINEAR = frozenset(("add", "subtract", "negative", "sum", "rename", "transpose", "reshape", "concat", "slice",
                     "pad", "shift", "astype", "stop_gradient", "dynamic_slice", "cumsum"))


def _residuals(ctx, recording, body, carry_bytes: float) -> dict:
    """Bytes per device each policy of :data:`ACCOUNTED` keeps until the backward pass."""
    made = {v for op in body for v in op.results}

    def total(values):
        return sum(value_bytes(ctx, recording, v, recording.placed[v]) * recording.values[v][2] for v in values)
    read = {v for op in body if op.name not in _LINEAR for v in op.operands if v in made}
    dots = {op.results[0] for op in body if _batchless_einsum(recording, op)}
    return {"none": total(read) + carry_bytes, "dots": total(dots) + carry_bytes, "full": carry_bytes}


def _again(recording, body, policy: str):
    """``(forward FLOPs, HBM bytes, collectives, runs)`` the backward pass runs again under
    ``policy``: the recomputed ops' forward contractions, and the step's forward collectives."""
    policy = remats.OFFLOADS.get(policy, policy)   # offloaded: recomputed as its base policy
    if policy == "none":
        return (), (), ()
    recomputed = [op for op in body if policy == "full" or not _batchless_einsum(recording, op)]
    works = [op.strategies[0].work for op in recomputed if op.strategies[0].work]
    again = (sum(w[0] for w in works), sum(w[1] for w in works)) if works else ()
    collectives = tuple(c for op in body for c in op.strategies[0].collectives)
    runs = tuple((axes, n, 0) for op in body for axes, n, _ in op.strategies[0].runs if n)
    return again, collectives, runs


def _gathers(body) -> list:
    """``(body index, (kept, moved, axes, runs, again))`` of each parameter stored split that the
    body's ops gather (as their default strategy does), in program order."""
    return [(j, g) for j, op in enumerate(body) for g in op.strategies[0].gathers]


def _gathered_again(f, entries, regathered: int = 0):
    """``f`` with the backward pass gathering the parameters of ``entries`` again: their bytes
    on their links, each run's latency."""
    moved = sum(g[1] for _, g in entries)
    if not moved:
        return f
    return dataclasses.replace(f, backward=f.backward + moved, duals=f.duals + tuple((g[2], g[1]) for _, g in entries),
                               runs=f.runs + tuple((g[2], 0, g[3]) for _, g in entries), regathered=regathered)


def strategies(ctx, recording, rule, body, operands, found: list, xs) -> list:
    """The loop's strategies ``found`` (its rule's, default first), each under the policies
    ``rule.remat`` leaves open: with the residuals each keeps, and what it runs again. ``body``:
    the op records of the loop's step; ``operands``: the value ids of the loop's operands (the
    carry first, ``rule.relays`` of them), ``xs`` those operands (a policy matters only where one
    is differentiated). Parameters the step gathers (ZeRO-3) are kept with the residuals of
    ``"none"``, or gathered again in the backward pass; under ``param_gather="auto"`` that is the
    loop's decision too: its candidate ``c`` gathers again those of its body's first ``c - 1``
    ops (:func:`meshdsl.rewrite.param_gather.regathering_below`), one strategy per op that
    gathers, each holding less and moving more than the last."""
    name = getattr(rule, "remat", None)
    if name not in ACCOUNTED + (remats.AUTO,) or not any(differentiated(x.raw) for x in xs):
        return found
    length, carry = getattr(rule, "length", 1), operands[:getattr(rule, "relays", 0)]
    carry_bytes = sum(value_bytes(ctx, recording, v, recording.placed[v]) * recording.values[v][2]
                      for v in carry) * length
    kept = _residuals(ctx, recording, body, carry_bytes)
    gathers = _gathers(body)
    kept["none"] += sum(g[0] for _, g in gathers if not g[4])
    # an offloading policy keeps its base policy's residuals in host memory: the carry on the device
    host = {p: kept[base] - carry_bytes for p, base in remats.OFFLOADS.items()}
    kept.update({p: carry_bytes for p in remats.OFFLOADS})
    works = [op.strategies[0].work for op in body if op.strategies[0].work]
    beside = tuple(map(sum, zip(*works))) if works else ()   # the body's compute, which a transfer overlaps
    policies = remats.choices(ctx.mesh.platform) if name == remats.AUTO else (name,)
    point = 1 if name == remats.AUTO else 0   # the regather decision point follows remat's
    choosing = ctx.params.name == "auto"
    out = []
    for f in found:
        working = f.held[1] if f.held else 0.0
        for i, policy in enumerate(policies):
            again, collectives, runs = _again(recording, body, policy)
            moved = sum(b for *_, b in collectives)
            options = tuple(sorted({**dict(f.options), 0: i}.items())) if name == remats.AUTO and i else f.options
            g = dataclasses.replace(
                f, options=options, held=(kept[policy], working), again=again, forward=f.forward + moved,
                collectives=f.collectives + collectives, runs=f.runs + runs, remat=policy, host=host.get(policy, 0.0),
                beside=beside if policy in host else ())
            out.append(_gathered_again(g, [e for e in gathers if e[1][4]]))
            if policy == "none" and choosing:
                out += _regather_chain(g, gathers, point)
    return out


def _regather_chain(f, gathers, point: int) -> list:
    """Strategy ``f`` (remat none, keeping what its body gathers) with the backward pass gathering
    again the parameters of its body's first ops: one strategy per op that gathers."""
    out = []
    for j in sorted({j for j, _ in gathers}):
        entries = [e for e in gathers if e[0] <= j]
        options = tuple(sorted({**dict(f.options), point: j + 2}.items()))
        held = (f.held[0] - sum(g[0] for _, g in entries), f.held[1])
        out.append(_gathered_again(dataclasses.replace(f, options=options, held=held), entries, len(entries)))
    return out
