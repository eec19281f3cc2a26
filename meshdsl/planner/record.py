"""The planning trace and the emitting trace, as the rewriter's context sees them.

A :class:`Recording` rides on the explicit context (``ctx.planner``) for one trace:

* **record** (the planning trace): every outermost named op is a node. Its default strategy is
  what its rule does with its operands where they are (the placement each operand enters in, the
  results' placements, the bytes the rule itself emitted). Its other strategies come from the
  same rule: for each other placement its operands could enter in (the layout's placement, their
  pending sums reduced in place, every operand aligned with one of them, one dim brought to the
  layout's placement), the rule runs on operands relaid there, in a sandbox the trace rolls back
  (records and relayout cache), and what it emitted and where its
  results came out is that strategy. Values first met as operands (inputs, values made outside
  the named ops) enter pinned where they are; outputs and ``x.array`` reads need their placement.
* **emit**: every op the plan moved (``choice``: op number -> entry placements) gets its operands
  relaid there first and then runs its rule as is: it decides what it decided in the sandbox.

Op numbers are the order of outermost named ops in the trace; both traces run the user's
function alike, so they agree (a ``md.scan`` body traced twice rolls its numbers back).
"""

from __future__ import annotations

import collections
import dataclasses

import jax
import jax.numpy as jnp

from ..costmodel.cost import dual_bytes
from ..names.errors import MeshDSLError
from ..platform.jaxcompat import apart, differentiated, pricing, primal_var, varying_axes
from ..names.named import NamedArray, Placement, is_named
from ..rewrite import collectives as C
from . import remat
from .candidates import loop_tries, op_tries

__all__ = ["Recording", "OpRecord", "Found", "OP_SCOPE"]

OP_SCOPE = "mdop"   # the name scope of outermost op number k in the planning trace: mdop<k>

_PINNED = {"scan"}   # ops whose candidates the planner does not explore (its loop_tries instead)


@dataclasses.dataclass
class OpRecord:
    """One outermost named op of the planning trace."""

    name: str
    line: str
    operands: list          # value ids
    results: list           # value ids
    strategies: list        # Found, the rule's default first
    grad: bool = False      # an operand is differentiated
    inner: range = range(0)  # numbers of the ops run inside it (a md.scan body)


class Recording:
    """What the planning trace records (``choice is None``), or the plan an emitting trace follows."""

    def __init__(self, choice=None, sinks=()):
        self.emit = choice is not None
        self.choice = dict(choice or {})
        self.planned_sinks = list(sinks)   # emitting: where each output and x.array read is read, as planned
        self.ops: list[OpRecord] = []
        self.values: dict = {}     # value id -> (dims, dtype, executions, differentiated)
        self.entered: dict = {}    # value id -> placement where first met (not made by an op)
        self.placed: dict = {}     # value id -> placement where made or first met
        self.gives: dict = {}      # value id -> the other placements its op's strategies give it
        self.read_at: dict = {}    # value id -> the placements the ops reading it so far may read it in
        self.sinks: list = []      # (value id, placement needed): outputs and x.array reads
        self.sink_vars: list = []  # per sink: the jaxpr variable the block read there is (or None)
        self.vars: dict = {}       # value id -> the jaxpr variable it is in the planning trace (or None)
        self.unread = (frozenset(), frozenset())   # (op numbers, sink indices) whose forward values the
        #                            program never reads (:mod:`meshdsl.planner.unread`), once traced
        self.count = 0             # outermost ops so far
        self.ended = 0             # records made when the latest op recorded ended
        self._forced: list = []    # (options, candidates per decision point met, copies read, copies made) of the rules running now
        self._ids: dict = {}       # id(local array) -> value id
        self._keep: list = []

    # -- values ----------------------------------------------------------------------------------

    def vid(self, ctx, x: NamedArray, *, made: bool = False) -> int:
        """``x``'s value id; a value first met here (not made by an op) enters where it is."""
        key = (id(x.raw), x.dims)
        v = None if made else self._ids.get(key)
        if v is None:
            v = self._ids[key] = len(self.values)
            self._keep.append(x.raw)
            self.values[v] = (x.dims, x.dtype, ctx.rec.executions_of(x.raw), differentiated(x.raw))
            self.vars[v] = primal_var(x.raw)
            self.placed[v] = ctx.placement(x)
            if not made:
                self.entered[v] = self.placed[v]
        return v

    def sink(self, ctx, x: NamedArray, axes):
        """``x`` leaves the named program placed by ``axes`` (an output, an ``x.array`` read): the
        axes it leaves by. Emitting, an ``x.array`` read reads where the planning trace read it
        (the user's code sees the block it saw there, whatever the plan moved)."""
        if ctx.frame is not None:
            return axes
        if self.emit:
            return self.planned_sinks.pop(0).axes if self.planned_sinks else axes
        self.sinks.append((self.vid(ctx, x), Placement(tuple(map(tuple, axes)))))
        self.sink_vars.append(None)
        return axes

    def sank(self, ctx, block) -> None:
        """``block`` is what the latest sink reads (its placement's block, sums reduced)."""
        if ctx.frame is None and not self.emit and self.sink_vars:
            self.sink_vars[-1] = primal_var(block)

    # -- ops -------------------------------------------------------------------------------------

    def checkpoint(self):
        return self.count, len(self.ops), len(self.sinks)

    def rollback(self, mark) -> None:
        self.count, n_ops, n_sinks = mark
        del self.ops[n_ops:]
        del self.sinks[n_sinks:]
        del self.sink_vars[n_sinks:]

    def apply(self, ctx, name, rule, args, kwargs):
        """Run ``rule`` for the outermost op ``name``: recorded (with its other strategies
        explored), or with its operands first relaid where the plan puts them."""
        k, self.count = self.count, self.count + 1
        leaves, tree = jax.tree_util.tree_flatten((args, kwargs), is_leaf=is_named)
        named = [i for i, leaf in enumerate(leaves) if is_named(leaf)]
        xs = [leaves[i] for i in named]
        if self.emit:
            found = self.choice.get(k) if ctx.frame is None else None
            if found is None:
                return rule(ctx, *args, **kwargs)
            return _run(ctx, rule, leaves, tree, named, xs, found.entry, found.options)[0]
        if pricing():   # an op of a loop body a candidate of the loop traces again: its own choices
            self._forced.append(({}, [], [], []))   # (its decision points are its own, not the loop's)
            try:
                return rule(ctx, *args, **kwargs)
            finally:
                self._forced.pop()
        explore = xs and name not in _PINNED and ctx.frame is None
        operands = [self.vid(ctx, x) for x in xs]
        # where its producer may give each operand, or another reader may read it (one copy for both)
        upstream = [tuple(dict.fromkeys(self.gives.get(v, ()) + self.read_at.get(v, ()))) for v in operands]
        tries = op_tries(ctx, rule, xs, args, kwargs, upstream) if explore else \
            loop_tries(ctx, rule, xs) if xs and ctx.frame is None else []
        others = _try_all(ctx, rule, leaves, tree, named, xs, tries)
        before = ctx.checkpoint()
        with jax.named_scope(f"{OP_SCOPE}{k}"):   # what it computes, found by the planner in the trace
            result, default = _run(ctx, rule, leaves, tree, named, xs, tuple(map(ctx.placement, xs)), {})
        if explore:   # decision points the rule met but does not declare (whether to widen a type), with each strategy
            declared = len(getattr(rule, "options", lambda *a, **k: [])(*args, **kwargs))
            with ctx.as_at(before):   # priced without the copies the default made
                others += _try_all(ctx, rule, leaves, tree, named, xs, [
                    (f.entry, {**dict(f.options), p: c}) for f in [default] + others
                    for p, n in enumerate(f.points) if p >= declared for c in range(1, n)])
        inner = [self.ops[j].strategies[0] for j in range(k, len(self.ops))]   # a scan body's ops, priced apart
        if inner:
            # the body's collectives traced again when jax differentiates the loop (after the
            # body's ops ended, attributed to them): the program runs them once, the sandboxes
            # (never differentiated) trace them once
            again = [r for r in ctx.rec.records[self.ended:] if (r.op, r.line) != ctx.rec.op]
            default = dataclasses.replace(default, forward=default.forward - sum(r.total_bytes for r in again),
                                          backward=default.backward - dual_bytes(again),
                                          runs=_less(default.runs, _runs(again, [])))
            fwd, bwd = sum(f.forward for f in inner), sum(f.backward for f in inner)
            body = [run for f in inner for run in f.runs]
            default, *others = [dataclasses.replace(f, forward=f.forward - fwd, backward=f.backward - bwd,
                                                    runs=_less(f.runs, body)) for f in [default] + others]
        strategies = _distinct([default] + [s for s in others if len(s.gives) == len(default.gives)])
        if inner:   # a loop: its remat policy's residuals, and the policies it leaves to the plan
            strategies = remat.strategies(ctx, self, rule, self.ops[k:], operands, strategies, xs)
        outs = [y for y in jax.tree_util.tree_leaves(result, is_leaf=is_named) if is_named(y)]
        results = [self.vid(ctx, y, made=True) for y in outs]
        for slot, v in enumerate(results):
            self.gives[v] = tuple(dict.fromkeys(f.gives[slot] for f in strategies[1:] if f.gives[slot] != default.gives[slot]))
        for slot, v in enumerate(operands):   # a reader slicing it (no data moves): another may share the copy
            self.read_at[v] = tuple(dict.fromkeys(self.read_at.get(v, ()) + tuple(
                f.entry[slot] for f in strategies if _sliced(self.placed[v], f.entry[slot]))))
        self.ops.insert(len(self.ops) - (self.count - k - 1), OpRecord(
            name, ctx.rec.op[1] if ctx.rec.op else "", operands, results, strategies,
            any(differentiated(x.raw) for x in xs), range(k + 1, self.count)))
        self.ended = len(ctx.rec.records)
        return result

    @property
    def current(self) -> int:
        """The number of the op running now (the latest begun)."""
        return self.count - 1

    def read(self, maker: int, cost: float, copy) -> None:
        """The rule running now read ``copy`` (a key), which op ``maker`` made (``cost``: its
        bytes); counted once however often the rule reads it."""
        if self._forced and (maker, cost, copy) not in self._forced[-1][2]:
            self._forced[-1][2].append((maker, cost, copy))

    def varies(self, ctx, x: NamedArray, axes: frozenset, cost: float) -> None:
        """The rule running now reads ``x`` as typed varying over mesh ``axes`` (as its producer's
        strategy in this trace leaves it) without casting it: a plan where the producer leaves it
        typed otherwise casts it here, for ``cost`` bytes (the cast's backward all-reduce)."""
        if self._forced and not self.emit:
            read = (-1, cost, ("varies", self.vid(ctx, x), frozenset(axes)))
            if read not in self._forced[-1][2]:
                self._forced[-1][2].append(read)

    def made(self, copy, cost: float = 0.0) -> None:
        """The rule running now made ``copy`` (a key) for ``cost`` bytes: a later op reading it
        reads it free where this op takes a strategy that makes it, and strategies of several ops
        making it pay it once (:func:`meshdsl.planner.plan.build`)."""
        if self._forced:
            self._forced[-1][3].append((copy, cost))

    def option(self, ctx, count: int) -> int:
        """The candidate the next decision point of the rule running now takes (0: the rule's
        default): its decision points are numbered in the order the rule meets them."""
        if not self._forced:
            return 0
        options, met, _, _ = self._forced[-1]
        met.append(count)
        return options.get(len(met) - 1, 0)


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

    @property
    def makes(self) -> frozenset:
        """The copies (keys) the rule made."""
        return frozenset(c for c, _ in self.made)


def _run(ctx, rule, leaves, tree, named, xs, entry, options):
    """``rule`` on the operands relaid to ``entry``, its decision points taking ``options``:
    ``(result, Found)``."""
    leaves = list(leaves)
    for i, x, pl in zip(named, xs, entry):
        leaves[i] = _relay(ctx, x, pl)
    entry = tuple(ctx.placement(leaves[i]) for i in named)   # as relaid: a pending sum x does not carry is not claimed
    args, kwargs = jax.tree_util.tree_unflatten(tree, leaves)
    start = len(ctx.rec.records), len(ctx.rec.casts), len(ctx.rec.work), len(ctx.rec.held), len(ctx.rec.gathers)
    met: list = []
    reads: list = []
    makes: list = []
    ctx._narrowing = False
    ctx.planner._forced.append((dict(options), met, reads, makes))
    saved, ctx.entry = ctx.entry, frozenset(id(leaves[i].raw) for i in named)
    try:
        result = rule(ctx, *args, **kwargs)
    finally:
        ctx.planner._forced.pop()
        ctx.entry = saved
    outs = [y for y in jax.tree_util.tree_leaves(result, is_leaf=is_named) if is_named(y)]
    forward = sum(r.total_bytes for r in ctx.rec.records[start[0]:])
    vary = tuple(frozenset(varying_axes(y.raw)) - ctx.placement(y).used_axes() for y in outs)
    emitted = tuple((r.kind, r.axes, r.total_bytes) for r in ctx.rec.records[start[0]:])
    duals = tuple((r.axes, dual_bytes([r])) for r in ctx.rec.records[start[0]:]) + \
        tuple((axes, b) for b, axes, _ in ctx.rec.casts[start[1]:])
    runs = _runs(ctx.rec.records[start[0]:], ctx.rec.casts[start[1]:])
    return result, Found(tuple(entry), tuple(ctx.placement(y) for y in outs), forward,
                         _backward_guess(ctx, start), tuple(sorted(dict(options).items())), vary, tuple(met),
                         tuple(reads), emitted, duals, runs,
                         tuple(map(sum, zip(*ctx.rec.work[start[2]:]))), tuple(map(sum, zip(*ctx.rec.held[start[3]:]))),
                         gathers=tuple(ctx.rec.gathers[start[4]:]), made=tuple(makes))


def _runs(records, casts) -> tuple:
    """``(mesh axes, forward runs, backward runs)`` of each collective of ``records`` (a gather's
    backward reduce-scatter runs as often as it) and of each cast's backward psum: each pays its
    link's latency each run."""
    return tuple((r.axes, r.count, r.count if dual_bytes([r]) else 0) for r in records) + \
        tuple((axes, 0, n) for _, axes, n in casts)


def _less(runs, minus) -> tuple:
    """``runs`` less the entries of ``minus`` (a loop body's collectives, priced by its own ops)."""
    left = collections.Counter(minus)
    out = []
    for run in runs:
        if left[run]:
            left[run] -= 1
        else:
            out.append(run)
    return tuple(out)


def _sliced(held: Placement, entry: Placement) -> bool:
    """Is ``entry`` ``held`` with more of its dims split (a local slice of it, nothing moved)?"""
    return entry != held and entry.pending == held.pending and held.sliced_to(entry.axes)


def _distinct(strategies) -> list:
    """``strategies`` less those that compute like an earlier one (entry, results, bytes and
    types alike: another decision point's candidate that changed nothing)."""
    seen, out = set(), []
    for f in strategies:
        key = (f.entry, f.gives, f.forward, f.backward, f.vary)
        if key not in seen:
            seen.add(key)
            out.append(f)
    return out


def _relay(ctx, x: NamedArray, pl: Placement) -> NamedArray:
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


def _sandboxed_run(ctx, rule, leaves, tree, named, xs, entry, options):
    """:func:`_run` in a sandbox the trace then rolls back (records, relayout cache): the strategy
    it shows, or None if the rule refuses it with a :class:`MeshDSLError` (what it would tell a
    user who placed the operands there). Any other exception is a bug in the rule: it surfaces."""
    mark = ctx.checkpoint()
    try:
        with ctx.rec.sandboxed(), apart():
            return _run(ctx, rule, leaves, tree, named, xs, entry, options)[1]
    except MeshDSLError:   # the rule refuses that entry: not a candidate
        return None
    finally:
        ctx.rollback(mark)


def _backward_guess(ctx, start) -> float:
    """The backward bytes of what the op emitted since ``start``: its collectives' duals
    (:func:`meshdsl.costmodel.cost.dual_bytes`) and its casts' psums."""
    return dual_bytes(ctx.rec.records[start[0]:]) + sum(b for b, *_ in ctx.rec.casts[start[1]:])


def _try_all(ctx, rule, leaves, tree, named, xs, tries) -> list:
    """The strategies the rule shows for ``tries`` (entry placements, options), each in a sandbox."""
    found = (_sandboxed_run(ctx, rule, leaves, tree, named, xs, entry, options) for entry, options in tries)
    return [f for f in found if f is not None]
