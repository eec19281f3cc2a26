"""A strategy a rule shows (:class:`Found`), and running a rule to show one: its operands relaid
to an entry placement, its decision points at chosen candidates, what it emitted counted
(:func:`run`); in a sandbox the trace rolls back, for a candidate (:func:`sandboxed_run`).
:mod:`meshdsl.planner.record` runs each op's rule so in the planning trace, and where the plan
puts it in the emitting trace.
"""

from __future__ import annotations

import collections
import dataclasses

import jax
import jax.numpy as jnp

from ..costmodel.cost import dual_bytes
from ..names.errors import MeshDSLError
from ..platform.jaxcompat import apart, varying_axes
from ..names.named import NamedArray, Placement, is_named
from ..rewrite import collectives as C

__all__ = ["Found", "run", "runs_of", "less", "sliced", "distinct", "relay", "sandboxed_run", "try_all"]


@dataclasses.dataclass(frozen=True)
class Found:
    """A strategy the rule showed: entry placements, result placements, own bytes, options."""

    entry: tuple
    gives: tuple
    forward: float
    backward: float
    options: tuple = ()    # (decision point, candidate) pairs
    vary: tuple = ()       # per result: mesh axes it varies over beyond its placement (typed so)
    points: tuple = ()     # candidates of each decision point the rule met, in order
    reads: tuple = ()      # (op number, bytes, copy) of the copies other ops made that the rule read
    collectives: tuple = ()   # (kind, mesh axes, bytes) of each collective the rule emitted, forward
    duals: tuple = ()         # (mesh axes, bytes) of what its backward moves (the part priced ahead)
    runs: tuple = ()          # (mesh axes, forward runs, backward runs) of each collective it emits
    work: tuple = ()          # (forward FLOPs, HBM bytes, backward FLOPs, HBM bytes) of its local
    #                           contractions, per device (empty: it emitted none)
    held: tuple = ()          # (kept, working) bytes per device it holds beyond its operands and
    #                           results (empty: none declared)
    again: tuple = ()         # (forward FLOPs, HBM bytes) a loop's remat policy recomputes
    remat: str = ""           # a loop's remat policy (meshdsl.planner.remat), for reports
    gathers: tuple = ()       # (kept, moved, mesh axes, executions, again) of each parameter it
    #                           gathered inside a loop (Recorder.param_gathered)
    regathered: int = 0       # a loop's: parameters its backward gathers again by the plan's choice
    host: float = 0.0         # a loop's: bytes per device its remat policy moves to host memory and back
    beside: tuple = ()        # a loop's: its body's work (as ``work``), which those moves overlap
    made: tuple = ()          # (copy key, bytes) of each copy the rule made
    stepped: tuple = ()       # a loop's: where its step reads its carry's and slices' named leaves

    @property
    def makes(self) -> frozenset:
        """The copies (keys) the rule made."""
        return frozenset(c for c, _ in self.made)


def run(ctx, rule, leaves, tree, named, xs, entry, options):
    """``rule`` on the operands relaid to ``entry``, its decision points taking ``options``:
    ``(result, Found)``."""
    leaves = list(leaves)
    for i, x, pl in zip(named, xs, entry):
        leaves[i] = relay(ctx, x, pl)
    entry = tuple(ctx.placement(leaves[i]) for i in named)   # as relaid: a pending sum x does not carry is not claimed
    args, kwargs = jax.tree_util.tree_unflatten(tree, leaves)
    start = len(ctx.rec.records), len(ctx.rec.casts), len(ctx.rec.work), len(ctx.rec.held), len(ctx.rec.gathers)
    met: list = []
    reads: list = []
    makes: list = []
    ctx._narrowing = False
    ctx.planner._forced.append((dict(options), met, reads, makes))
    saved, ctx.entry = ctx.entry, frozenset(id(leaves[i].raw) for i in named)
    k = ctx.planner.current
    try:
        result = rule(ctx, *args, **kwargs)
    finally:
        ctx.planner._forced.pop()
        ctx.entry = saved
    outs = [y for y in jax.tree_util.tree_leaves(result, is_leaf=is_named) if is_named(y)]
    records = ctx.rec.records[start[0]:]
    carried = ctx.planner.carry_in.pop(k, None) if hasattr(rule, "relays") else None
    stepped = ()
    if carried is not None:   # a loop relaid its carry where it enters: the plan's move (an edge), not the loop's
        stepped, (first, end) = carried
        entry = stepped[:rule.relays] + entry[rule.relays:]
        records = ctx.rec.records[start[0]:first] + ctx.rec.records[end:]
    forward = sum(r.total_bytes for r in records)
    vary = tuple(frozenset(varying_axes(y.raw)) - ctx.placement(y).used_axes() for y in outs)
    emitted = tuple((r.kind, r.axes, r.total_bytes) for r in records)
    duals = tuple((r.axes, dual_bytes([r])) for r in records) + \
        tuple((axes, b) for b, axes, _ in ctx.rec.casts[start[1]:])
    runs = runs_of(records, ctx.rec.casts[start[1]:])
    return result, Found(tuple(entry), tuple(ctx.placement(y) for y in outs), forward,
                         dual_bytes(records) + sum(b for b, *_ in ctx.rec.casts[start[1]:]),
                         tuple(sorted(dict(options).items())), vary, tuple(met),
                         tuple(reads), emitted, duals, runs,
                         tuple(map(sum, zip(*ctx.rec.work[start[2]:]))), tuple(map(sum, zip(*ctx.rec.held[start[3]:]))),
                         gathers=tuple(ctx.rec.gathers[start[4]:]), made=tuple(makes), stepped=stepped)


def runs_of(records, casts) -> tuple:
    """``(mesh axes, forward runs, backward runs)`` of each collective of ``records`` (a gather's
    backward reduce-scatter runs as often as it) and of each cast's backward psum: each pays its
    link's latency each run."""
    return tuple((r.axes, r.count, r.count if dual_bytes([r]) else 0) for r in records) + \
        tuple((axes, 0, n) for _, axes, n in casts)


def less(runs, minus) -> tuple:
    """``runs`` less the entries of ``minus`` (a loop body's collectives, priced by its own ops)."""
    left = collections.Counter(minus)
    out = []
    for run in runs:
        if left[run]:
            left[run] -= 1
        else:
            out.append(run)
    return tuple(out)


def sliced(held: Placement, entry: Placement) -> bool:
    """Is ``entry`` ``held`` with more of its dims split (a local slice of it, nothing moved)?"""
    return entry != held and entry.pending == held.pending and held.sliced_to(entry.axes)


def distinct(strategies) -> list:
    """``strategies`` less those that compute like an earlier one (entry, results, bytes and
    types alike: another decision point's candidate that changed nothing)."""
    seen, out = set(), []
    for f in strategies:
        key = (f.entry, f.gives, f.forward, f.backward, f.vary)
        if key not in seen:
            seen.add(key)
            out.append(f)
    return out


def relay(ctx, x: NamedArray, pl: Placement) -> NamedArray:
    """``x`` relaid to placement ``pl`` (pending sums outside ``pl.pending`` reduced). A sum
    ``pl`` keeps pending that ``x`` does not hold (a candidate of its producer leaves it pending,
    the trace's reduced it) is, in a sandbox, made so: the block on the first device of the sum's
    group, zeros elsewhere (what the consumer computes from, and moves, is then what it would
    from the producer's candidate). Outside a sandbox it stays reduced: a placement never claims
    a sum its block does not carry."""
    made = pl.pending - ctx.pending(x) if ctx.rec.sandbox is not None else frozenset()
    if made & ctx.placement(x).split_axes() or made & {a for axes in pl.axes for a in axes}:
        made = frozenset()
    pl = Placement(pl.axes, pl.pending & (ctx.pending(x) | made))
    if ctx.placement(x) == pl:
        return x
    arr = ctx.local(x, dict(zip(x.names, pl.axes)), keep_pending=pl.pending - made)
    if made:
        first = C.axis_index(tuple(a for a in ctx.mesh.factor_axes if a in made)) == 0
        arr = jnp.where(first, arr, jnp.zeros((), arr.dtype))
    return NamedArray(arr, x.dims, is_param=x.is_param, placement=pl)


def sandboxed_run(ctx, rule, leaves, tree, named, xs, entry, options):
    """:func:`_run` in a sandbox the trace then rolls back (records, relayout cache): the strategy
    it shows, or None if the rule refuses it with a :class:`MeshDSLError` (what it would tell a
    user who placed the operands there). Any other exception is a bug in the rule: it surfaces."""
    mark = ctx.checkpoint()
    try:
        with ctx.rec.sandboxed(), apart():
            return run(ctx, rule, leaves, tree, named, xs, entry, options)[1]
    except MeshDSLError:   # the rule refuses that entry: not a candidate
        return None
    finally:
        ctx.rollback(mark)


def try_all(ctx, rule, leaves, tree, named, xs, tries) -> list:
    """The strategies the rule shows for ``tries`` (entry placements, options), each in a sandbox."""
    found = (sandboxed_run(ctx, rule, leaves, tree, named, xs, entry, options) for entry, options in tries)
    return [f for f in found if f is not None]
