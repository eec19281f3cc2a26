"""Per-device memory from the traced program: which buffers exist, when, and where XLA puts them.

``md.explain(...).memory`` is a liveness walk over the per-device jaxpr (the body of
``shard_map``) in program order, with what XLA's buffer assignment does that changes the answer
(each rule measured against ``memory_analysis()`` on the CPU backend):

* an elementwise chain fuses: only its ends are buffers (:func:`meshdsl.jaxpr_stats.materialized`);
* **aliases**: the result of a ``pvary``, ``reshape``, ``squeeze``, ``expand_dims``, ``name`` or
  ``stop_gradient`` is its operand's buffer; so is a call's result that passes an input through;
* **in place**: a ``scatter``, a ``dynamic_update_slice`` or an elementwise op writes into an
  operand of its size where that operand dies; a transpose read only by matmuls is folded into
  them (no copy); ``add(x, scatter(0, i, u))`` (a row lookup's gradient added to another) is
  ``scatter(x, i, u)``: no buffer of zeros;
* **outputs host temporaries**: the program's results are allocated first, and a temporary that
  dies before a result is written lives in that result's buffer (the backward pass's activations
  in the gradients' buffers). Results written by all-reduces count from the first of them: XLA
  combines those all-reduces into one (but a scalar's, a loss: XLA reduces it on its own);
* a sub-program (a loop body, a called function) adds its own peak while it runs.

Not modelled: XLA's scheduler reordering ops (program order is kept), layout copies XLA inserts
for a ``dot`` (a transposed copy of a gathered embedding table), fragmentation of the temporary
heap, rematerialisation. ``docs/cost_model.md`` lists the measured errors.
"""

from __future__ import annotations

import dataclasses

from jax.extend import core as jcore

from .jaxpr_stats import ALIASES as _ALIASES, CALLS as _CALLS, materialized, nbytes, sub_jaxprs

__all__ = ["memory", "at_peak", "Buffer"]

_IN_PLACE = frozenset(("scatter-add", "scatter_add", "scatter", "dynamic_update_slice", "add_any", "add", "sub",
                       "mul", "div", "max", "min", "neg", "abs", "exp", "log", "tanh", "logistic", "sqrt",
                       "rsqrt", "square", "integer_pow", "select_n", "convert_element_type"))
_REDUCES = frozenset(("psum", "psum_invariant", "psum_scatter", "reduce_scatter"))
_SCALAR = 64   # bytes: a result this small (a loss) is all-reduced on its own, not combined
_COLLECTIVES = _REDUCES | {"all_gather", "all_gather_invariant", "all_to_all", "ppermute", "pmax", "pmin"}


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One buffer of a program: its bytes, the ops (by index) it lives from and to, what made it
    (``collective``, ``loop`` state, ``matmul`` result, ``other``) and its shape (``None`` for a
    sub-program's peak)."""

    size: int
    start: int
    end: int
    kind: str
    shape: tuple | None = None
    parts: tuple = ()      # a sub-program's peak: its buffers live there


def memory(jaxpr) -> dict:
    """Per-device bytes of one run of ``jaxpr``: ``arguments``, ``outputs``, ``temporaries`` (the
    peak of the buffers neither, as ``memory_analysis`` splits them), ``peak`` (their sum), and
    ``breakdown``: the temporaries live at the peak by what made them."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    args = sum(nbytes(v.aval) for v in jaxpr.invars)
    outs = sum(nbytes(v.aval) for v in jaxpr.outvars if isinstance(v, jcore.Var))
    temps, live = _temporaries(jaxpr)
    breakdown = {}
    for b in live:
        breakdown[b.kind] = breakdown.get(b.kind, 0) + b.size
    return {"arguments": args, "outputs": outs, "temporaries": temps, "peak": args + outs + temps,
            "breakdown": dict(sorted(breakdown.items(), key=lambda kv: -kv[1]))}


def at_peak(jaxpr) -> list:
    """The temporary buffers (:class:`Buffer`) live at ``jaxpr``'s peak, a sub-program's peak
    as its own buffers live there."""
    def flat(buffers):
        return [x for b in buffers for x in (flat(b.parts) if b.parts else [b])]
    return flat(_temporaries(getattr(jaxpr, "jaxpr", jaxpr))[1])


def _temporaries(jaxpr) -> tuple[int, list]:
    """The peak bytes of ``jaxpr``'s temporaries and the buffers live there."""
    temps, outputs, n = _buffers(jaxpr)
    heap = _host(temps, outputs, n)
    delta = [0] * (n + 2)
    for b in heap:
        delta[b.start] += b.size
        delta[b.end + 1] -= b.size
    peak, at, size = 0, 0, 0
    for k, d in enumerate(delta):
        size += d
        if size > peak:
            peak, at = size, k
    return peak, [b for b in heap if b.start <= at <= b.end]


def _host(temps, outputs, n) -> list:
    """The temporaries left on the heap once each, largest first, has moved into an output's
    buffer that is at least its size and free while it lives (XLA's buffer assignment)."""
    slots = [(size, [(start, n)]) for size, start in outputs]
    heap = []
    for b in sorted(temps, key=lambda b: -b.size):
        for size, busy in slots:
            if size >= b.size and all(b.end < s or b.start > e for s, e in busy):
                busy.append((b.start, b.end))
                break
        else:
            heap.append(b)
    return heap


def _buffers(jaxpr):
    """``(temporaries, outputs, ops)``: the temporary buffers (:class:`Buffer`), the outputs'
    buffers ``(size, op writing it)``, and the number of ops."""
    owner, zeros = _owners(jaxpr)
    root = lambda v: owner.get(v, v)   # noqa: E731
    kept = materialized(jaxpr)
    outs = {v for v in jaxpr.outvars if isinstance(v, jcore.Var)}
    last, is_kept, is_out = {}, set(), set()
    for k, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if isinstance(v, jcore.Var):
                last[root(v)] = max(last.get(root(v), -1), k)
        for v in eqn.outvars:
            if isinstance(v, jcore.Var) and v in kept:
                is_kept.add(root(v))
            if isinstance(v, jcore.Var) and v in outs:
                is_out.add(root(v))
    temps, outputs, reduced = [], [], []
    for k, eqn in enumerate(jaxpr.eqns):
        inner, parts = max((_temporaries(j) for j in sub_jaxprs(eqn)), default=(0, []), key=lambda t: t[0])
        if inner:
            temps.append(Buffer(inner, k, k, _kind(eqn), None, tuple(parts)))
        for v in eqn.outvars:
            if not isinstance(v, jcore.Var) or v in owner:
                continue
            if v in is_out:
                outputs.append((nbytes(v.aval), k))
                reduced.append(_reduces(eqn))
            elif v in is_kept and v in last and v not in zeros:
                temps.append(Buffer(nbytes(v.aval), k, last[v], _kind(eqn), tuple(v.aval.shape)))
    first = min((k for (size, k), red in zip(outputs, reduced) if red and size > _SCALAR), default=None)
    outputs = [(size, first if red and size > _SCALAR else k) for (size, k), red in zip(outputs, reduced)]
    return temps, outputs, len(jaxpr.eqns)


def _owners(jaxpr) -> tuple[dict, set]:
    """Value -> the value whose buffer it is (aliases, in-place updates, calls passing an input
    through), and the zero-filled scatters an add made in place (no buffer of their own)."""
    owner: dict = {}
    zeros: set = set()
    root = lambda v: owner.get(v, v)   # noqa: E731
    uses, readers = {}, {}
    for k, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if isinstance(v, jcore.Var):
                uses[v] = k
                readers.setdefault(v, set()).add(eqn.primitive.name)
    ends: dict = {}   # root -> last use of any value in its buffer
    params = set(jaxpr.invars) | set(jaxpr.constvars)
    kept = materialized(jaxpr)
    scattered = set()

    def share(out, v):
        r = root(v)
        owner[out] = r
        ends[r] = max(ends.get(r, uses.get(r, -1)), uses.get(out, -1))

    def dies_here(v, k):
        r = root(v)
        return r not in params and ends.get(r, uses.get(r, -1)) == k

    for k, eqn in enumerate(jaxpr.eqns):
        name, ins = eqn.primitive.name, [v for v in eqn.invars if isinstance(v, jcore.Var)]
        folded = name == "transpose" and readers.get(eqn.outvars[0]) == {"dot_general"}
        if (name in _ALIASES or folded) and len(eqn.invars) == 1 and ins and \
                nbytes(ins[0].aval) == nbytes(eqn.outvars[0].aval):
            share(eqn.outvars[0], ins[0])
            continue
        for i, v in _passed_through(eqn).items():
            share(eqn.outvars[i], v)
        if name == "add_any":
            scatters = [v for v in ins if v in scattered]
            other = [v for v in ins if v not in scattered]
            if scatters and other and dies_here(other[0], k):
                zeros.add(root(scatters[0]))
                share(eqn.outvars[0], other[0])
                continue
        if _zero_scatter(eqn):
            scattered.add(eqn.outvars[0])
        if name in _IN_PLACE and len(eqn.outvars) == 1:
            dying = [v for v in ins if nbytes(v.aval) == nbytes(eqn.outvars[0].aval) and dies_here(v, k)]
            # a buffer first: an operand fused into this op (an elementwise intermediate) is none
            dying.sort(key=lambda v: root(v) not in kept)
            if dying:
                share(eqn.outvars[0], dying[0])
    return owner, zeros


def _passed_through(eqn) -> dict:
    """Output index -> the input a call returns as it is (through aliases)."""
    subs = list(sub_jaxprs(eqn))
    if eqn.primitive.name not in _CALLS or len(subs) != 1 or len(subs[0].invars) != len(eqn.invars):
        return {}
    sub = subs[0]
    origin = {v: i for i, v in enumerate(sub.invars)}
    for e in sub.eqns:
        if e.primitive.name in _ALIASES and len(e.invars) == 1 and isinstance(e.invars[0], jcore.Var) \
                and e.invars[0] in origin:
            origin[e.outvars[0]] = origin[e.invars[0]]
    return {i: eqn.invars[origin[v]] for i, v in enumerate(sub.outvars)
            if isinstance(v, jcore.Var) and v in origin and isinstance(eqn.invars[origin[v]], jcore.Var)}


def _zero_scatter(eqn) -> bool:
    """A scatter-add into zeros (a row lookup's gradient), or a call computing one."""
    if eqn.primitive.name in ("scatter-add", "scatter_add"):
        return True
    subs = list(sub_jaxprs(eqn))
    if eqn.primitive.name not in _CALLS or len(subs) != 1 or len(eqn.outvars) != 1:
        return False
    names = {e.primitive.name for e in subs[0].eqns}
    return bool(names & {"scatter-add", "scatter_add"}) and "broadcast_in_dim" in names


def _calls(eqn, names) -> bool:
    """Is ``eqn`` one of ``names``, or a call of one program containing one?"""
    if eqn.primitive.name in names:
        return True
    subs = list(sub_jaxprs(eqn))
    return eqn.primitive.name in _CALLS and len(subs) == 1 and any(e.primitive.name in names for e in subs[0].eqns)


def _reduces(eqn) -> bool:
    return _calls(eqn, _REDUCES)


def _kind(eqn) -> str:
    if _calls(eqn, _COLLECTIVES):
        return "collective buffers"
    if eqn.primitive.name in ("scan", "while"):
        return "loop state (activations kept for the backward pass, stacked outputs)"
    if eqn.primitive.name == "dot_general":
        return "matmul results"
    return "other temporaries"
