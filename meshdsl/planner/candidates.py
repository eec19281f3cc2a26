"""The candidates the planner explores for one op: where its operands may enter, and the other
candidates of its rule's decision points (:mod:`meshdsl.planner.record` runs each in a sandbox).

* :func:`op_tries`: an op's operands entering where they are, in the layout's placement, with their
  pending sums reduced in place, aligned with another operand, with one dim of one operand brought
  to the layout's placement or gathered, where a candidate of their producer puts them, or where
  another reader of them slices them (one copy: its gradient gathered once); a parameter stored
  split entering gathered (under ``param_gather`` keep / regather only that; under ``"auto"``
  with the others); and the rule's
  declared decision points (``rule.options``).
* :func:`loop_tries`: a loop (its body traced again per candidate): its operands' pending sums
  reduced before it, or its operands in the layout's placement.

An op reads each value in one placement (:func:`one_per_value`).
"""

from __future__ import annotations

from ..names.errors import MeshDSLError
from ..names.named import Placement

__all__ = ["op_tries", "loop_tries", "one_per_value", "valid"]

_MAX_CANDIDATES = 10


def op_tries(ctx, rule, xs, args, kwargs, upstream) -> list:
    """``(entry placements, options)`` of the op's other candidates: other entry placements, and
    the rule's other candidates at its decision points (``rule.options(*args, **kwargs)``).
    ``upstream``: per operand, the other placements its producer may give it or another reader
    slices it to."""
    here = tuple(ctx.placement(x) for x in xs)
    # an op moving data along a dim may read a copy gathered for others (outside loop bodies:
    # there the trace would carry every priced candidate as dead code into the loop's derivative)
    gathers = getattr(rule, "gathers", False) and ctx.rec.multiplier == 1
    entries = _candidates(ctx, xs, swaps=gathers and getattr(rule, "swaps", False)) if gathers or _off_layout(ctx, xs) else [here]
    if any(x.is_param and _stored(ctx, x) for x in xs):
        gathered = _gathered_tries(ctx, rule, xs, args, kwargs, upstream)
        if ctx.params.name != "auto":
            return gathered
        # "auto": where keep / regather would read the parameter, and everywhere else
        stay = [(e, {}) for e in entries[1:2 * _MAX_CANDIDATES] if one_per_value(xs, e)]
        return gathered + [t for t in stay if t not in gathered]
    for j, places in enumerate(upstream):
        for pl in places:
            moved = here[:j] + (pl,) + here[j + 1:]
            by_name = dict(zip(xs[j].names, pl.axes))
            aligned = tuple(p if i == j else Placement(tuple(by_name.get(n, a) for n, a in zip(x.names, p.axes)))
                            for i, (x, p) in enumerate(zip(xs, here)))
            entries += [e for e in (moved, aligned) if e not in entries and all(valid(q) for q in e)]
    tries = [(entry, {}) for entry in entries[1:2 * _MAX_CANDIDATES]]
    return [t for t in tries + _declared(rule, here, args, kwargs) if one_per_value(xs, t[0])]


def _gathered_tries(ctx, rule, xs, args, kwargs, upstream) -> list:
    """param_gather keep / regather: an op reading a parameter stored split gathers it, as
    ZeRO-3 is written (``"auto"`` lets the plan move the activations instead). Its candidates:
    the parameters entering gathered (the layout's placement) before the rule's own choices, its
    other operands where they are or where a candidate of their producer gives them."""
    here = tuple(ctx.placement(x) for x in xs)
    try:
        gathered = tuple(Placement(tuple(ctx.canonical(x.dims))) if x.is_param and _stored(ctx, x) else pl
                         for x, pl in zip(xs, here))
    except MeshDSLError:
        gathered = here
    tries = [(gathered, {})] if gathered != here else []
    for j, places in enumerate(upstream):
        if not (xs[j].is_param and _stored(ctx, xs[j])):
            tries += [(gathered[:j] + (pl,) + gathered[j + 1:], {}) for pl in places
                      if all(valid(q) for q in gathered[:j] + (pl,) + gathered[j + 1:])]
    return [t for t in tries + _declared(rule, here, args, kwargs) if one_per_value(xs, t[0])]


def loop_tries(ctx, rule, xs) -> list:
    """The entries of an op whose others are not explored (a loop: its body is traced again
    per candidate): its operands' pending sums reduced before it (once, not per step), and its
    operands in the layout's placement (a value the loop reads as the return needs it: one move
    for both). Its body's ops are priced as they run in the loop's default; a candidate's own
    bytes are what it moves beyond theirs (less, where the body moves less: negative). A
    parameter stack stored split stays so: each step's ops gather their slice as ``param_gather``
    says (kept for the backward pass or gathered again, the plan's choice under ``"auto"``), never
    the whole stack before the loop (held through the backward pass, outside the solve's memory)."""
    here = tuple(ctx.placement(x) for x in xs)
    tries = [tuple(Placement(pl.axes) for pl in here)]
    try:
        tries.append(tuple(pl if x.is_param and _stored(ctx, x) else Placement(tuple(ctx.canonical(x.dims)))
                           for x, pl in zip(xs, here)))
    except MeshDSLError:
        pass
    tries = [e for e in dict.fromkeys(tries) if e != here and all(valid(pl) for pl in e)
             and not _relaid_by_the_rule(ctx, rule, xs, here, e)]
    return [(e, {}) for e in tries if one_per_value(xs, e)]


def _relaid_by_the_rule(ctx, rule, xs, here, entry) -> bool:
    """Does ``entry`` move only operands the rule itself relays to the layout's placement (its
    first ``rule.relays``: a loop's carry), and only there? The rule then does the same: no
    candidate (each would trace the loop's body again)."""
    fixed = getattr(rule, "relays", 0)
    try:
        return all(k < fixed and pl == Placement(tuple(ctx.canonical(x.dims)))
                   for k, (x, h, pl) in enumerate(zip(xs, here, entry)) if pl != h)
    except MeshDSLError:
        return False


def _candidates(ctx, xs, swaps: bool = False) -> list:
    """Entry placements to explore for an op over ``xs``, the first where they are: the layout's
    placement, pending sums reduced in place, every operand aligned with one of them, one dim
    of one operand brought to the layout's placement, one dim of one operand gathered (from where
    it is or from the layout's placement), and (``swaps``: a rule declaring it, outside loop
    bodies) one mesh axis of one operand's dim swapped for one of its size no operand uses (a
    permute: ids split over ``y+z`` moved to ``x+z`` leave ``y`` to the table they are looked
    up in): every placement one collective reaches."""
    here = tuple(ctx.placement(x) for x in xs)
    out = [here]

    def add(entry):
        if len(out) < _MAX_CANDIDATES and entry not in out and all(valid(pl) for pl in entry):
            out.append(entry)

    try:
        layout = tuple(Placement(tuple(ctx.canonical(x.dims))) for x in xs)
    except MeshDSLError:
        layout = None
    if layout is not None:
        add(layout)
    reduced = tuple(Placement(pl.axes) for pl in here)
    add(reduced)
    for y, held in zip(xs, here):
        by_name = dict(zip(y.names, held.axes))
        add(tuple(Placement(tuple(by_name.get(n, a) for n, a in zip(x.names, pl.axes))) for x, pl in zip(xs, here)))
    bases = [reduced] + ([layout] if layout is not None else [])
    for j in range(len(xs)):
        for base in bases:
            for i, axes in enumerate(base[j].axes):
                if axes:
                    add(_with(base, j, i, ()))
        if layout is not None:
            for i, (axes, want) in enumerate(zip(here[j].axes, layout[j].axes)):
                if axes != want:
                    add(_with(reduced, j, i, want))
    for entry in _swapped(ctx, reduced) if swaps else ():
        add(entry)
    return out


def _swapped(ctx, entry) -> list:
    """``entry`` with one mesh axis splitting one operand's dim (all its factors there) replaced
    by an idle mesh axis of its size (one no operand is split or pending over)."""
    used = {a for pl in entry for a in pl.used_axes()}
    whole = {m: ctx.mesh.factors(m) for m in ctx.mesh.shape}
    idle = [f for f in whole.values() if not used & set(f)]
    out = []
    for j, pl in enumerate(entry):
        for i, axes in enumerate(pl.axes):
            for f in whole.values():
                for k in (k for k in range(len(axes) - len(f) + 1) if axes[k:k + len(f)] == f):
                    out += [_with(entry, j, i, axes[:k] + g + axes[k + len(f):]) for g in idle
                            if ctx.mesh.axes_size(g) == ctx.mesh.axes_size(f)]
    return out


def _declared(rule, here, args, kwargs) -> list:
    """Tries of the other candidates of the decision points the rule declares
    (``rule.options(*args, **kwargs)``: candidates per point), its operands where they are."""
    counts = getattr(rule, "options", lambda *a, **k: [])(*args, **kwargs)
    return [(here, {p: c}) for p, n in enumerate(counts) for c in range(1, n)]


def _stored(ctx, x) -> bool:
    """Does ``x`` sit elsewhere than the layout's placement (a parameter stored split)?"""
    try:
        return tuple(ctx.placement(x).axes) != tuple(ctx.canonical(x.dims))
    except MeshDSLError:
        return True


def _off_layout(ctx, xs) -> bool:
    """Does an operand hold a pending sum or sit off the layout's placement? (Else the op computes
    where the layout says, as the plan would have every op do: nothing to explore.)"""
    for x in xs:
        pl = ctx.placement(x)
        try:
            if pl.pending or tuple(pl.axes) != tuple(ctx.canonical(x.dims)):
                return True
        except MeshDSLError:
            return True
    return False


def _with(entry, j, i, axes) -> tuple:
    """``entry`` with dim ``i`` of operand ``j`` split over ``axes``."""
    pl = entry[j]
    return entry[:j] + (Placement(pl.axes[:i] + (tuple(axes),) + pl.axes[i + 1:]),) + entry[j + 1:]


def one_per_value(xs, entry) -> bool:
    """Does ``entry`` read each value in one placement? (An op reading one value twice - a
    concat of a value with itself - reads one copy of it: its rule shares the relayout. Two
    placements of one value price a read of one that hits the other's copy, which the emitted
    op, its operands relaid from where their producers put them, would not find.)"""
    seen = {}
    return all(seen.setdefault((id(x.raw), x.dims), pl) == pl for x, pl in zip(xs, entry))


def valid(pl: Placement) -> bool:
    used = [a for axes in pl.axes for a in axes]
    return len(used) == len(set(used)) and not set(used) & pl.pending
