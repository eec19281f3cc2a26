"""Per-device memory from the traced program: which buffers exist, when, and where XLA puts them.

``md.explain(...).memory`` is a liveness walk over the per-device jaxpr (the body of
``shard_map``) in program order, with what XLA's buffer assignment does that changes the answer
(each rule measured against ``memory_analysis()`` on the CPU backend):

* **one clock**: a sub-program's ops (a loop body's, a called function's) tick between its call's
  start and end, as XLA's live ranges flatten the schedule; its buffers are the program's, and a
  loop's state (its carry, its stacked results) lives from before the loop runs;
* an elementwise chain fuses: only its ends are buffers (:func:`meshdsl.costmodel.jaxpr_stats.materialized`);
  a loop's slice of a stacked operand is a buffer where a matmul (not an elementwise op) reads it;
* **aliases**: the result of a ``pvary``, ``reshape``, ``squeeze``, ``expand_dims``, ``name`` or
  ``stop_gradient`` is its operand's buffer; so is a call's result that passes an input through;
* **in place**: a ``scatter``, a ``dynamic_update_slice`` or an elementwise op writes into an
  operand of its size where that operand dies (never an argument or a result: those hold their
  values to the end); a transpose read only by matmuls is folded into them (no copy), but a
  matmul reads a transposed copy of an operand whose dims are not batch dims first, then its
  free and contracted dims one group after the other (:func:`_copied`);
  ``add(x, scatter(0, i, u))`` (a row lookup's gradient added to another) is
  ``scatter(x, i, u)``: no buffer of zeros;
* **outputs host temporaries**: the program's results are allocated first, and each temporary,
  largest first, lives in the smallest result buffer at least its size that is free while it
  lives (of equal sizes, the one written last);
* **all-reduces combine**: XLA combines the all-reduces writing results (a scalar's, a loss,
  apart) into one, run after the last of them: their operands live until then, their results
  from then.

* **the schedule**: the lesser peak of the program's order and one where each sub-program (a
  loop's body, a call in it) runs its ops in a list schedule's order
  (:mod:`meshdsl.costmodel.schedule`), as XLA's memory scheduler picks the least of its own. The
  top level keeps the program's order: scheduled too, T5's ZeRO-3 training steps came out 17-21%
  under the compiled peak (XLA's schedule of them does not reach that).

Not modelled: XLA's other schedulers (depth-first, post-order), XLA recomputing a cheap
elementwise op in each of its consumers, how XLA's heap packs buffers (fragmentation),
rematerialisation. ``docs/cost_model.md`` lists the measured errors.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from jax.extend import core as jcore

from ..platform import jaxcompat
from ..platform.jaxcompat import in_host_memory, scan_parts
from .jaxpr_stats import ALIASES as _ALIASES, CALLS as _CALLS, FUSIBLE, materialized, sub_jaxprs
from .jaxpr_stats import nbytes as _bytes
from .schedule import scheduled

__all__ = ["memory", "at_peak", "Buffer"]

_IN_PLACE = frozenset(("scatter-add", "scatter_add", "scatter", "dynamic_update_slice", "add_any", "add", "sub",
                       "mul", "div", "max", "min", "neg", "abs", "exp", "log", "tanh", "logistic", "sqrt",
                       "rsqrt", "square", "integer_pow", "select_n", "convert_element_type"))
_REDUCES = frozenset(("psum", "psum_invariant", "psum_scatter", "reduce_scatter"))
_LOOPS = frozenset(("scan", "while"))
_SCALAR = 64   # bytes: a result this small (a loss) is all-reduced on its own, not combined
_COLLECTIVES = _REDUCES | {"all_gather", "all_gather_invariant", "all_to_all", "ppermute", "pmax", "pmin"}


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One buffer of a program: its bytes, the ticks it lives from and to (one clock for the
    program and its sub-programs: a loop body's ops tick between the loop's start and end), what
    made it (``collective``, ``loop`` state, ``loop slices``, ``layout copies``, ``matmul`` result,
    ``other``) and its shape."""

    size: int
    start: int
    end: int
    kind: str
    shape: tuple | None = None


def nbytes(aval) -> int:
    """Device memory bytes of a value: none for one in host memory."""
    return 0 if in_host_memory(aval) else _bytes(aval)


def memory(jaxpr) -> dict:
    """Per-device bytes of one run of ``jaxpr``: ``arguments``, ``outputs``, ``temporaries`` (the
    peak of the buffers neither, as ``memory_analysis`` splits them), ``peak`` (their sum), and
    ``breakdown``: the temporaries live at the peak by what made them; all in device memory.
    ``host``: what it holds in host memory: its arguments there (offloaded parameters) and the
    values it puts there (their gradients, the residuals an offloading remat policy keeps)."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    args = sum(nbytes(v.aval) for v in jaxpr.invars)
    outs = sum(nbytes(v.aval) for v in jaxpr.outvars if isinstance(v, jcore.Var))
    temps, live = _temporaries(jaxpr)
    breakdown = {}
    for b in live:
        breakdown[b.kind] = breakdown.get(b.kind, 0) + b.size
    return {"arguments": args, "outputs": outs, "temporaries": temps, "peak": args + outs + temps,
            "breakdown": dict(sorted(breakdown.items(), key=lambda kv: -kv[1])),
            "host": sum(_bytes(v.aval) for v in jaxpr.invars if in_host_memory(v.aval)) + _host_held(jaxpr)}


def host_transfers(rows) -> dict:
    """Bytes per device the transfers ``rows`` (:func:`host_transfer_rows`) move between device
    and host memory, ``{"to host": .., "to device": ..}``."""
    out = {"to host": 0.0, "to device": 0.0}
    for row in rows:
        out[row["direction"]] += row["total"]
    return out


def host_transfer_rows(jaxpr) -> list[dict]:
    """Each host <-> device transfer of one run of ``jaxpr``, alike ones together: ``direction``
    ("to device", "to host"), ``phase`` (forward, backward), ``line`` (the user's code that made
    it), ``count`` (times per run), ``bytes`` (per device, each) and ``total``."""
    rows: dict = {}
    for direction, phase, line, nbytes, times in _moves(getattr(jaxpr, "jaxpr", jaxpr), 1):
        row = rows.setdefault((direction, phase, line, nbytes), {"direction": direction, "phase": phase, "line": line,
                                                                 "count": 0, "bytes": nbytes, "total": 0.0})
        row["count"] += times
        row["total"] += times * nbytes
    return list(rows.values())


def _moves(jaxpr, times: int, outer: str = ""):
    """``(direction, phase, line, bytes, times)`` of each transfer between memories in ``jaxpr``
    (a loop's as often as it runs; ``outer``: the name scopes of the equations calling it)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "device_put":
            for a, b in zip(eqn.invars, eqn.outvars):
                if in_host_memory(a.aval) != in_host_memory(b.aval):
                    yield ("to device" if in_host_memory(a.aval) else "to host",
                           "backward" if jaxcompat.backward(eqn, outer) else "forward",
                           jaxcompat.scoped_line(eqn, outer), _bytes(b.aval), times)
        trips = scan_parts(eqn).length if eqn.primitive.name == "scan" else 1
        for sub in sub_jaxprs(eqn):
            yield from _moves(sub, times * trips, jaxcompat.name_stack(eqn, outer))


_HOST_VIEWS = ("dynamic_slice", "slice", "squeeze", "reshape")


def _host_held(jaxpr) -> int:
    """Bytes of the values ``jaxpr`` (and the calls in it) holds in host memory, each counted
    once: all live at once between the forward pass that offloads them and the backward that
    brings them back."""
    seen, total = set(), 0
    for eqn in jaxpr.eqns:
        # a call's results are counted where it makes them; a slice of a host value read by a
        # transfer to the device is not a buffer of its own (a DMA of that part of the value)
        made = () if eqn.primitive.name in _CALLS or eqn.primitive.name in _HOST_VIEWS else eqn.outvars
        for v in made:
            if isinstance(v, jcore.Var) and in_host_memory(v.aval) and v not in seen:
                seen.add(v)
                total += _bytes(v.aval)
        for sub in sub_jaxprs(eqn) if eqn.primitive.name in _CALLS else ():
            total += _host_held(getattr(sub, "jaxpr", sub))
    return total


def at_peak(jaxpr) -> list:
    """The temporary buffers (:class:`Buffer`) live at ``jaxpr``'s peak, a loop body's among them."""
    return _temporaries(getattr(jaxpr, "jaxpr", jaxpr))[1]


def _temporaries(jaxpr) -> tuple[int, list]:
    """The peak bytes of ``jaxpr``'s temporaries and the buffers live there: the lesser of the
    program's order and a list schedule's (:mod:`meshdsl.costmodel.schedule`), as XLA's memory
    scheduler takes the least of its schedulers' (one order where it calls no sub-program)."""
    orders = (False, True) if any(next(sub_jaxprs(e), None) is not None for e in jaxpr.eqns) else (False,)
    return min((_peak(_host(*_timeline(jaxpr, 0, (), order))) for order in orders), key=lambda p: p[0])


def _peak(buffers) -> tuple[int, list]:
    """The most bytes of ``buffers`` live at one tick, and those buffers."""
    events = sorted([(b.start, b.size) for b in buffers] + [(b.end + 1, -b.size) for b in buffers])
    peak, at, size = 0, 0, 0
    for tick, d in events:
        size += d
        if size > peak:
            peak, at = size, tick
    return peak, [b for b in buffers if b.start <= at <= b.end]


def _host(temps, outputs, ticks) -> list:
    """The temporaries left on the heap once each has moved into an output's buffer at least
    its size and free while it lives, as XLA's buffer assignment does: temporaries largest
    first, each into the smallest such buffer (of equal sizes, the one written last)."""
    slots = sorted(((b.size, b.start, [(b.start, ticks)]) for b in outputs), key=lambda s: (s[0], -s[1]))
    heap = []
    for b in sorted(temps, key=lambda b: -b.size):
        for size, _, busy in slots:
            if size >= b.size and all(b.end < s or b.start > e for s, e in busy):
                busy.append((b.start, b.end))
                break
        else:
            heap.append(b)
    return heap


def _clock(jaxpr, t0, order=False):
    """Each op's first and last tick from ``t0`` (a sub-program's ops tick in between), the
    buffers of the sub-programs (of alternatives, a ``cond``'s branches, the one with the highest
    peak; a body's results live until it ends), and the tick after the last op."""
    first, last, inner, t = [], [], [], t0
    for eqn in jaxpr.eqns:
        sliced = _sliced(eqn)
        subs = [_timeline(j, t + 1, sliced, order) for j in sub_jaxprs(eqn)]
        first.append(t)
        if subs:
            temps, outs, t = subs[0] if len(subs) == 1 else max(subs, key=lambda s: _peak(s[0] + s[1])[0])
            inner.extend(temps + [dataclasses.replace(b, end=t - 1) for b in outs])
        last.append(t)
        t += 1
    return first, last, inner, t


def _sliced(eqn) -> tuple:
    """A ``scan``'s body's inputs that are one slice of a stacked operand (``xs``) per step."""
    if eqn.primitive.name != "scan":
        return ()
    return jaxcompat.scan_parts(eqn).xs


def _copied(eqn) -> list:
    """Per operand of a ``dot_general``: does the matmul read a transposed copy of it? Its dims,
    in order (size-1 dims aside), are not batch dims first and then its free and contracted dims
    one group after the other (either way round: a matmul reads a transposed block as it is)."""
    (lc, rc), (lb, rb) = jaxcompat.dot_dims(eqn)
    out = []
    for v, contracted, batch in ((eqn.invars[0], lc, lb), (eqn.invars[1], rc, rb)):
        shape = v.aval.shape
        free = [d for d in range(len(shape)) if d not in contracted and d not in batch]
        dims = [d for d in range(len(shape)) if shape[d] != 1]
        orders = (list(batch) + free + list(contracted), list(batch) + list(contracted) + free)
        out.append(all([d for d in order if shape[d] != 1] != dims for order in orders))
    return out


def _timeline(jaxpr, t0, sliced=(), order=False):
    """``(temporaries, outputs, ticks)``: the temporary buffers (:class:`Buffer`) of ``jaxpr``
    and of its sub-programs, its outputs' buffers (from the tick writing them), and the tick
    after its last op. ``sliced``: inputs that are a slice of a loop's stacked operand (a buffer
    of their own where an op other than an elementwise one reads them). ``order``: its ops (and
    its sub-programs') in the list schedule's order (:func:`meshdsl.costmodel.schedule.scheduled`)
    where it is a sub-program (``t0`` > 0), else in the program's."""
    jaxpr = scheduled(jaxpr) if order and t0 else jaxpr
    owner, zeros = _owners(jaxpr)
    root = lambda v: owner.get(v, v)   # noqa: E731
    kept = materialized(jaxpr)
    outs = {v for v in jaxpr.outvars if isinstance(v, jcore.Var)}
    first, done, temps, ticks = _clock(jaxpr, t0, order)
    last, is_kept, is_out, unfused = {}, set(), set(), set()
    for k, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if isinstance(v, jcore.Var):
                last[root(v)] = max(last.get(root(v), -1), done[k])
                if eqn.primitive.name not in FUSIBLE:
                    unfused.add(v)
        for v in eqn.outvars:
            if isinstance(v, jcore.Var) and v in kept:
                is_kept.add(root(v))
            if isinstance(v, jcore.Var) and v in outs:
                is_out.add(root(v))
    combined = _combined(jaxpr, root, is_out)
    together = done[max(combined)] if combined else None   # the tick XLA's combined all-reduce ends
    for k in combined:   # operands of the all-reduces combined live until then
        for v in jaxpr.eqns[k].invars:
            if isinstance(v, jcore.Var):
                last[root(v)] = max(last[root(v)], together)
    temps.extend(Buffer(nbytes(v.aval), t0, last[v], "loop slices", tuple(v.aval.shape))
                 for v in sliced if v in unfused)
    temps.extend(_layout_copies(jaxpr, t0, done))
    outputs = []
    for k, eqn in enumerate(jaxpr.eqns):
        # a loop's state is allocated before it runs; another op's result when the op ends;
        # a combined all-reduce's results when the last of them ends
        born = together if k in combined else first[k] if eqn.primitive.name in _LOOPS else done[k]
        for v in eqn.outvars:
            if not isinstance(v, jcore.Var) or v in owner:
                continue
            if v in is_out:
                outputs.append(Buffer(nbytes(v.aval), born, ticks, _kind(eqn), tuple(v.aval.shape)))
            elif v in is_kept and v in last and v not in zeros:
                temps.append(Buffer(nbytes(v.aval), born, last[v], _kind(eqn), tuple(v.aval.shape)))
    return temps, outputs, ticks


def _layout_copies(jaxpr, t0, done) -> list:
    """The transposed copies matmuls read (:func:`_copied`), each live from the tick its operand
    is made (XLA writes the copy beside it) to the matmul's; none where an elementwise op makes
    the operand for this matmul alone (XLA writes its result transposed: one buffer)."""
    made = {v: (t0, None) for v in jaxpr.invars}   # value -> (tick made, primitive making it)
    reads = Counter(v for eqn in jaxpr.eqns for v in eqn.invars if isinstance(v, jcore.Var))
    copies = []
    for k, eqn in enumerate(jaxpr.eqns):
        if eqn.primitive.name == "dot_general":
            for v, copied in zip(eqn.invars, _copied(eqn)):
                if not copied or not isinstance(v, jcore.Var):
                    continue
                born, maker = made.get(v, (t0, None))
                if not (maker in FUSIBLE - _ALIASES and reads[v] == 1):
                    copies.append(Buffer(nbytes(v.aval), born, done[k], "layout copies", tuple(v.aval.shape)))
        made.update((v, (done[k], eqn.primitive.name)) for v in eqn.outvars)
    return copies


def _combined(jaxpr, root, is_out) -> set:
    """The ops (by index) whose all-reduces write results larger than a scalar (XLA combines
    them; a loss's it reduces on its own)."""
    return {k for k, eqn in enumerate(jaxpr.eqns) if _reduces(eqn) and any(
        isinstance(v, jcore.Var) and root(v) in is_out and nbytes(v.aval) > _SCALAR for v in eqn.outvars)}


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
    # arguments and the program's results are never overwritten (a result's buffer holds it to the end)
    results = {v for v in jaxpr.outvars if isinstance(v, jcore.Var)}
    held = set(jaxpr.invars) | set(jaxpr.constvars) | results
    kept = materialized(jaxpr)
    scattered = set()

    def share(out, v):
        r = root(v)
        owner[out] = r
        ends[r] = max(ends.get(r, uses.get(r, -1)), uses.get(out, -1))
        if out in held:
            held.add(r)

    def dies_here(v, k):
        r = root(v)
        return r not in held and ends.get(r, uses.get(r, -1)) == k

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
