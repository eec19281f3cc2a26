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

import dataclasses

import jax

from ..costmodel.cost import dual_bytes
from ..platform.jaxcompat import differentiated, pricing, primal_var
from ..names.named import NamedArray, Placement, is_named
from . import remat
from .candidates import loop_tries, op_tries
from .found import distinct, less, run, runs_of, sandboxed_run, sliced, try_all

__all__ = ["Recording", "OpRecord", "OP_SCOPE"]

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

    def __init__(self, choice=None, sinks=(), carries=None):
        self.emit = choice is not None
        self.choice = dict(choice or {})
        self.planned_sinks = list(sinks)   # emitting: where each output and x.array read is read, as planned
        # loop op number -> {carry index: axes per dim it enters with} where the planning trace's
        # loop took them from its step (not the layout's); emitting, each loop enters so
        self.carries: dict = dict(carries or {})
        # what a loop's step reads from the loop (meshdsl.planner.carries): (loop op number, value
        # ids of its carry's and its slices' named leaves), and a step's carry leaving it: (value
        # id, loop op number, its index among the carry's named leaves, and among its leaves)
        self.steps: list = []
        self.carry_outs: list = []
        # loop op number -> (placements its step reads its carry and slices in, (first, end) of the
        # records relaying the carry there) as the latest run of its rule left them (meshdsl.ops.loop)
        self.carry_in: dict = {}
        self.pinned: dict = {}     # loop op number -> its carry's entry a candidate holds fixed (meshdsl.ops.loop)
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

    def stepping(self, ctx, loop: int, xs: list) -> None:
        """A step of loop op ``loop`` reads ``xs`` (its carry's and its slices' named leaves) as
        the loop gives them (:mod:`meshdsl.planner.carries`)."""
        if not self.emit and not pricing() and ctx.frame is None:
            self.steps.append((loop, tuple(self.vid(ctx, x) for x in xs)))

    def carried(self, ctx, x: NamedArray, loop: int, index: tuple) -> None:
        """``x`` leaves a step of loop op ``loop`` as its carry's leaf ``index`` (among the named
        leaves, and among all): the next step takes it where this one took it."""
        if not self.emit and not pricing() and ctx.frame is None:
            self.carry_outs.append((self.vid(ctx, x), loop, *index))

    def sank(self, ctx, block) -> None:
        """``block`` is what the latest sink reads (its placement's block, sums reduced)."""
        if ctx.frame is None and not self.emit and self.sink_vars:
            self.sink_vars[-1] = primal_var(block)

    # -- ops -------------------------------------------------------------------------------------

    def checkpoint(self):
        return self.count, len(self.ops), len(self.sinks), len(self.steps), len(self.carry_outs)

    def rollback(self, mark) -> None:
        self.count, n_ops, n_sinks, n_steps, n_carried = mark
        del self.ops[n_ops:]
        del self.sinks[n_sinks:]
        del self.steps[n_steps:]
        del self.carry_outs[n_carried:]
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
            return run(ctx, rule, leaves, tree, named, xs, found.entry, found.options)[0]
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
        others = try_all(ctx, rule, leaves, tree, named, xs, tries)
        before = ctx.checkpoint()
        with jax.named_scope(f"{OP_SCOPE}{k}"):   # what it computes, found by the planner in the trace
            result, default = run(ctx, rule, leaves, tree, named, xs, tuple(map(ctx.placement, xs)), {})
        if explore:   # decision points the rule met but does not declare (whether to widen a type), with each strategy
            declared = len(getattr(rule, "options", lambda *a, **k: [])(*args, **kwargs))
            with ctx.as_at(before):   # priced without the copies the default made
                others += try_all(ctx, rule, leaves, tree, named, xs, [
                    (f.entry, {**dict(f.options), p: c}) for f in [default] + others
                    for p, n in enumerate(f.points) if p >= declared for c in range(1, n)])
        if getattr(rule, "relays", 0) and self.carries.get(k):   # its carry entered where its step left it
            others += self._pinned(ctx, k, rule, (leaves, tree, named, xs))
        inner = [self.ops[j].strategies[0] for j in range(k, len(self.ops))]   # a scan body's ops, priced apart
        if inner:
            default, *others = self._apart(ctx, inner, default, others)
        strategies = distinct([default] + [s for s in others if len(s.gives) == len(default.gives)])
        if inner:   # a loop: its remat policy's residuals, and the policies it leaves to the plan
            strategies = remat.strategies(ctx, self, rule, self.ops[k:], operands, strategies, xs)
        outs = [y for y in jax.tree_util.tree_leaves(result, is_leaf=is_named) if is_named(y)]
        results = [self.vid(ctx, y, made=True) for y in outs]
        for slot, v in enumerate(results):
            self.gives[v] = tuple(dict.fromkeys(f.gives[slot] for f in strategies[1:] if f.gives[slot] != default.gives[slot]))
        for slot, v in enumerate(operands):   # a reader slicing it (no data moves): another may share the copy
            self.read_at[v] = tuple(dict.fromkeys(self.read_at.get(v, ()) + tuple(
                f.entry[slot] for f in strategies if sliced(self.placed[v], f.entry[slot]))))
        self.ops.insert(len(self.ops) - (self.count - k - 1), OpRecord(
            name, ctx.rec.op[1] if ctx.rec.op else "", operands, results, strategies,
            any(differentiated(x.raw) for x in xs), range(k + 1, self.count)))
        self.ended = len(ctx.rec.records)
        return result

    def _apart(self, ctx, inner, default, others) -> list:
        """A loop's ``default`` and ``others`` strategies less what its body's ops (``inner``:
        their defaults) move, which they price each on its own."""
        # the body's collectives traced again when jax differentiates the loop (after the body's
        # ops ended, attributed to them): the program runs them once, the sandboxes (never
        # differentiated) trace them once
        again = [r for r in ctx.rec.records[self.ended:] if (r.op, r.line) != ctx.rec.op]
        default = dataclasses.replace(default, forward=default.forward - sum(r.total_bytes for r in again),
                                      backward=default.backward - dual_bytes(again),
                                      runs=less(default.runs, runs_of(again, [])))
        fwd, bwd = sum(f.forward for f in inner), sum(f.backward for f in inner)
        body = [run for f in inner for run in f.runs]
        return [dataclasses.replace(f, forward=f.forward - fwd, backward=f.backward - bwd, runs=less(f.runs, body))
                for f in [default] + others]

    def _pinned(self, ctx, k, rule, operands) -> list:
        """Loop op ``k`` whose rule entered its carry where its step left it: the candidate with
        the carry entering where the layout places it, and relaid back there each step (its step's
        ops may leave it there under the plan: :mod:`meshdsl.planner.carries`)."""
        leaves, tree, named, xs = operands
        saved, self.count = self.count, k + 1   # the loop's rule runs again as op k
        self.pinned[k] = {}
        try:
            found = sandboxed_run(ctx, rule, leaves, tree, named, xs, tuple(map(ctx.placement, xs)), {})
        finally:
            self.count = saved
            del self.pinned[k]
        return [] if found is None else [found]

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
