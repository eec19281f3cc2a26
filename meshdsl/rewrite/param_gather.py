"""The ``param_gather`` policy: what happens to a parameter stored split where an op needs it.

A parameter stored split by ``params=`` rules (ZeRO-3 / FSDP) is all-gathered where an op needs
it whole. ``md.lower(..., param_gather=...)`` chooses how; rules that read parameters (einsum,
take) ask the context's policy through one hook each and have no backend branches:

* ``policy.place(ctx, dims, operands, target, result_bytes)``: the placement the op computes in
  (``target``, or a plan that leaves the parameters where they are stored);
* ``policy.compute(ctx, contract, arrays, operands, axes)``: run the op's local computation
  (possibly so that the backward pass gathers the parameters again).

Policies:

* ``"keep"`` (ZeRO-3 as written): gather at use; inside ``md.scan`` the gathered value is kept
  for the backward pass (the minimum bytes, more memory).
* ``"regather"``: inside ``md.scan`` the backward pass gathers the parameters again instead of
  keeping them (ZeRO-3's memory saving; GSPMD gives no such choice inside a scan). Outside a loop
  the compiler would merge the second gather with the first, so the gathered value is kept there
  (as with ``"keep"``) and ``md.explain`` claims no re-gather.
* ``"auto"``: gather a parameter, or leave it where it is stored and move the activations, as the
  planner's solver finds the step faster (a decision point of each op reading it): a tied
  embedding [vocab, d_model] stored ``d_model:data`` is not gathered for a small batch's lookups
  or logits; its ids, rows and logits move instead. A copy one op gathers is free to the others,
  so the solve gathers a parameter once for all its ops or leaves it for all of them. Inside
  ``md.scan`` each parameter gathered is kept for the backward pass or gathered there again, as
  the plan chooses by the step's time under the memory budget (the loop's decision point,
  weighed with its remat policy: :mod:`meshdsl.planner.remat`). No trace of its own: the
  planning trace prices every choice.

Inside a loop every policy tells the recorder what each gather keeps and what gathering it again
would move (:meth:`meshdsl.rewrite.recorder.Recorder.param_gathered`): keeping is in the plan's
memory, gathering again in its bytes.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax

from ..costmodel.cost import array_bytes
from . import collectives as C
from .relayout import needs_gather, relayout_bytes

__all__ = ["POLICIES", "Keep", "Regather", "Auto", "make", "regathering_below"]


class Keep:
    """Gather at use and keep the gathered value for the backward pass."""

    name = "keep"

    def place(self, ctx, dims, operands, target, result_bytes):
        return target

    def again(self, ctx) -> bool:
        """Does the backward pass of the op running now (in a loop) gather its parameters again?"""
        return False

    def compute(self, ctx, relay, contract, arrays, operands, axes):
        """``contract`` of the operands' local blocks; ``relay(i, array)`` places operand ``i``.
        Inside a loop each parameter gathered is kept for the backward pass, or gathered there
        again (:meth:`again`): the planner is told which, and what each holds and moves."""
        local = [relay(i, a) for i, a in enumerate(arrays)]  # one forward gather per value, shared
        gathered = [i for i, x in enumerate(operands) if x.is_param and needs_gather(ctx, x, axes)] \
            if ctx.explicit else []
        if not gathered or ctx.rec.multiplier == 1:
            # Outside a loop XLA merges a backward re-gather with the forward gather (CSE; its
            # barriers are expanded first on CPU): keep the gathered value, and explain says so.
            return contract(*local)
        again = self.again(ctx)
        for i in gathered:
            _tell(ctx, operands[i], local[i], axes, again)
        if not again:
            return contract(*local)
        stored = tuple(arrays[i] for i in gathered)

        def forward(stored, *local):
            kept = tuple(None if i in gathered else v for i, v in enumerate(local))
            return contract(*local), (stored, kept)  # the gathered blocks are not residuals

        def backward(res, ct):
            stored, kept = res
            # The barrier keeps XLA from reusing the forward's gather: the backward gathers again.
            stored = jax.lax.optimization_barrier(stored)
            again = list(kept)
            for k, i in enumerate(gathered):
                again[i] = relay(i, stored[k])
            cts = _vjp(contract, again, ct)
            return (tuple(jax.numpy.zeros_like(s) for s in stored), *cts)

        return C.attributed_vjp(ctx, forward, backward)(stored, *local)

    def finish(self) -> None:
        """Called when the trace is over."""


class Regather(Keep):
    """Gather at use; inside a loop the backward pass gathers again instead of keeping the
    gathered value."""

    name = "regather"

    def again(self, ctx) -> bool:
        return True


def _tell(ctx, x, block, axes, again: bool) -> None:
    """Tell the recorder parameter ``x`` was gathered to ``block`` (placed by ``axes``)."""
    pl = ctx.placement(x)
    target = tuple(tuple(axes.get(d.name, ())) for d in x.dims)
    over = tuple(a for held, want in zip(pl.axes, target) for a in held if a not in want)
    moved = relayout_bytes(ctx, x.dims, x.dtype.itemsize, pl.axes, frozenset(), target)
    ctx.rec.param_gathered(array_bytes(block.shape, block.dtype, ctx.mesh.platform), moved, over, again)


def _vjp(fn, primals, ct):
    return jax.vjp(fn, *primals)[1](ct)


class Auto(Keep):
    """Gather a parameter, or leave it where it is stored and move the activations: a decision
    point of the op reading it (:meth:`meshdsl.rewrite.explicit.ExplicitContext.option`), which
    the planner's solver decides with the whole program's time (a copy one op gathers is read
    free by the others: a parameter is gathered once for all its ops, or stays for all). The
    rule's own choice, where no planner decides: gather where that moves no more bytes than
    staying at this op. Inside a loop, whether the backward gathers a parameter again or keeps it
    is the loop's decision (:func:`regathering_below`), which the planner makes by the step's
    time under the memory budget."""

    name = "auto"

    def again(self, ctx) -> bool:
        return ctx.planner is not None and ctx.planner.current < _BELOW.get()

    def place(self, ctx, dims, operands, target, result_bytes):
        return self._stationary(ctx, operands, target, result_bytes) or target

    def _stationary(self, ctx, operands, axes, result_bytes):
        """A plan that leaves the parameters ``axes`` would gather where they are stored, or
        ``None`` to gather them. Dims of the parameters keep their stored split; other dims give
        up the mesh axes those use. ``result_bytes(alt)``: bytes to bring the op's result from
        plan ``alt`` to where ``axes`` puts it. Backward passes mirror forward ones (gather /
        reduce-scatter, all-to-all both ways), so comparing forward bytes compares the step."""
        params = [x for x in operands if x.is_param and needs_gather(ctx, x, axes)]
        if not params:
            return None
        alt = _stored_plan(ctx, params, axes)
        if alt is None:
            return None

        def moved(x, p):
            return relayout_bytes(ctx, x.dims, x.dtype.itemsize, ctx.placement(x).axes, frozenset(),
                                  tuple(p.get(d.name, ()) for d in x.dims))

        # gathered anyway (by another op, or for the return): reading that copy is free
        copied = all(ctx.relaid(x, tuple(axes.get(d.name, ()) for d in x.dims)) for x in params)
        others = [x for x in operands if not any(x is q for q in params)]
        gather = 0.0 if copied else sum(moved(x, axes) * ctx.rec.executions_of(x.raw) for x in params)
        stay = (sum(moved(x, alt) for x in operands) + result_bytes(alt) - sum(moved(x, axes) for x in others)) \
            * ctx.rec.multiplier
        own = 0 if gather <= stay else 1
        return None if ctx.option(2) == own else alt   # candidate 1: the other choice


def _stored_plan(ctx, params, axes):
    """``axes`` with the parameters' dims where they are stored and the other dims giving up the
    mesh axes those use; ``None`` when two parameters are stored differently."""
    alt = dict(axes)
    fixed = {}
    for p in params:
        for d, held in zip(p.dims, ctx.placement(p).axes):
            if fixed.setdefault(d.name, held) != held:
                return None
            alt[d.name] = held
    used = {a for held in fixed.values() for a in held}
    for name, held in alt.items():
        if name not in fixed:
            cut = next((i for i, a in enumerate(held) if a in used), len(held))
            alt[name] = held[:cut]
    return alt


_BELOW: contextvars.ContextVar = contextvars.ContextVar("regather_below", default=-1)


@contextlib.contextmanager
def regathering_below(number: int):
    """Under ``param_gather="auto"``, inside: the backward pass gathers again the parameters
    that the ops numbered below ``number`` (the planner's op numbers) gather, instead of keeping
    them. A loop sets it around its step from its decision point (the planner declares the
    candidates: :mod:`meshdsl.planner.remat`)."""
    token = _BELOW.set(number)
    try:
        yield
    finally:
        _BELOW.reset(token)


POLICIES = {"keep": Keep, "regather": Regather, "auto": Auto}

KEEP = Keep()


def make(name: str, **kwargs) -> Keep:
    """The policy called ``name`` (``"keep"``, ``"regather"`` or ``"auto"``)."""
    return POLICIES[name](**kwargs)
