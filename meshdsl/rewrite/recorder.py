"""The collective recorder: what the rewriter emitted, where, why, and how often it runs.

Every collective :mod:`meshdsl.rewrite.collectives` emits is recorded as a :class:`CollectiveRecord`
(op and user source line, kind, mesh axes, local shape, dtype, bytes per device) under the
*origin* active at that moment: the named op being lowered, the phase (``forward``, or
``backward`` for a rule jax runs while differentiating) and the multiplier (executions of the
code being traced: the trip counts of the ``md.scan`` loops around it). ``md.explain`` reads the
records; each collective runs under a unique name scope (:meth:`Recorder.tag`) so that explain
can match it to the traced program and drop it if the compiler would.
"""

from __future__ import annotations

import contextlib
import dataclasses

from ..costmodel import cost
from ..platform import jaxcompat

__all__ = ["CollectiveRecord", "Recorder"]


@dataclasses.dataclass
class CollectiveRecord:
    """One collective the rewriter emitted (per device)."""

    op: str            # the named op that needed it, e.g. "einsum"
    line: str          # user source line of that op
    kind: str          # all-reduce | all-gather | reduce-scatter | all-to-all | collective-permute
    axes: tuple        # mesh axes of the group (a part of an axis written "x:(1)4", see meshdsl.names.mesh)
    shape: tuple       # local operand shape
    dtype: str
    bytes: float       # bytes moved per device, one execution
    count: int = 1     # executions (scan trip counts)
    phase: str = "forward"
    tensor: str = ""   # what moved, e.g. "[batch:8 d_ff:64] gather d_ff"
    tag: str = ""      # name scope of the collective in the traced program

    @property
    def total_bytes(self) -> float:
        return self.bytes * self.count

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["total_bytes"] = self.total_bytes
        return d


class Recorder:
    """Records collectives for one trace of a program on ``mesh``."""

    def __init__(self, mesh):
        self.mesh = mesh
        self.records: list[CollectiveRecord] = []
        self.op: tuple | None = None   # (name, line) of the outermost named op being lowered
        self.multiplier = 1            # executions of the code being traced (md.scan trip counts)
        self.phase = "forward"
        self.tracing = True            # False once the trace is over: late backward rules record nothing
        self._tags = 0
        self.casts: list = []          # (bytes, mesh axes, executions) the backward moves, priced before emitted
        #                                (casts, slices, own backwards; axes () where not known)
        self.work: list = []           # (forward FLOPs, HBM bytes, backward FLOPs, HBM bytes) of each
        #                                local contraction the rules traced, times its executions
        self.held: list = []           # (kept, working) bytes per device an op holds beyond its
        #                                operands and results (kept: stacked over executions)
        self.gathers: list = []        # (kept, moved, mesh axes, executions, again) of each parameter
        #                                stored split an op gathered inside a loop (see param_gathered)
        self.sandbox = None            # the planner's sandbox being traced now (an int), if any
        self._closed: set = set()      # sandboxes rolled back: what jax traces for them later is dead
        self._sandboxes = 0
        self._loops: dict = {}         # id(loop body trace) -> executions
        self._keepalive: list = []     # traces whose ids key _loops

    def tag(self) -> str:
        """A fresh name scope for one collective."""
        self._tags += 1
        return f"mdc{self._tags}"

    def record(self, kind, axes, operand, result, tensor: str = "", tag: str = "") -> None:
        """Record one collective of ``operand`` -> ``result`` over ``axes`` (no-op on 1 device)."""
        if not self.tracing or self.sandbox in self._closed:
            return
        n = self.mesh.axes_size(axes)
        if n <= 1:
            return
        platform = self.mesh.platform
        op_b = cost.array_bytes(operand.shape, operand.dtype, platform)
        res_b = cost.array_bytes(result.shape, result.dtype, platform)
        name, line = self.op or ("?", "?")
        self.records.append(CollectiveRecord(
            op=name, line=line, kind=kind, axes=self.mesh.collapse(axes), shape=tuple(operand.shape),
            dtype=str(operand.dtype), bytes=cost.moved_bytes(kind, op_b, res_b, n),
            count=self.multiplier, phase=self.phase, tensor=tensor, tag=tag))

    def cast(self, x, axes) -> None:
        """A value ``x`` that gets a gradient was cast to varying over ``axes``: the backward pass
        sums its cotangent there (an all-reduce the planner prices before it is emitted)."""
        b = cost.array_bytes(x.shape, x.dtype, self.mesh.platform)
        self.backward_bytes(cost.moved_bytes("all-reduce", b, b, self.mesh.axes_size(axes)), axes)

    def sliced(self, block, axes) -> None:
        """A value that gets a gradient, replicated over ``axes``, was sliced to this device's
        ``block`` (no data moves): the backward all-gathers the blocks' cotangents there."""
        b, n = cost.array_bytes(block.shape, block.dtype, self.mesh.platform), self.mesh.axes_size(axes)
        self.backward_bytes(cost.moved_bytes("all-gather", b, b * n, n), axes)

    def backward_bytes(self, nbytes: float, axes=()) -> None:
        """The op being lowered has a hand-written backward that moves ``nbytes`` per execution
        (over factor ``axes``) beyond its forward collectives' duals (a ring rotating gradients
        as well as keys): the planner prices them before the backward is emitted."""
        if self.tracing and self.sandbox not in self._closed:
            self.casts.append((nbytes * self.multiplier, self.mesh.collapse(tuple(axes)), self.multiplier))

    def computed(self, forward_flops: float, forward_bytes: float, backward_flops: float,
                 backward_bytes: float) -> None:
        """The op being lowered computes a local contraction (an einsum's block, an attention
        kernel) of these FLOPs and HBM bytes per execution, forward and backward: the planner
        prices each strategy's compute by what its rule emitted."""
        if self.tracing and self.sandbox not in self._closed:
            m = self.multiplier
            self.work.append((forward_flops * m, forward_bytes * m, backward_flops * m, backward_bytes * m))

    def holds(self, kept: float, working: float) -> None:
        """The op being lowered holds buffers beyond its operands and results: ``kept`` bytes per
        device each execution until the backward pass reads them (where it is differentiated; else
        while it runs), ``working`` while it runs (an attention's gathered keys, a ring's chunks):
        the planner weighs each strategy's memory by what its rule holds."""
        if self.tracing and self.sandbox not in self._closed:
            self.held.append((kept * self.multiplier, working))

    def param_gathered(self, kept: float, moved: float, axes, again: bool) -> None:
        """The op being lowered gathered a parameter stored split inside a loop: ``kept`` bytes
        per device each execution (its gathered block, which the backward pass reads), ``moved``
        bytes per execution over factor ``axes``; ``again``: the backward gathers it again instead
        of keeping it. The planner weighs keeping against gathering again by what each holds and
        moves (:mod:`meshdsl.planner.remat`)."""
        if self.tracing and self.sandbox not in self._closed:
            m = self.multiplier
            self.gathers.append((kept * m, moved * m, self.mesh.collapse(tuple(axes)), m, again))

    @contextlib.contextmanager
    def at(self, name: str, line: str):
        """Attribute what is emitted inside to op ``name`` at ``line``, unless an outer op is
        already being lowered (a rule that calls other ops is attributed as a whole)."""
        if self.op is not None:
            yield
            return
        self.op = (name, line)
        try:
            yield
        finally:
            self.op = None

    @contextlib.contextmanager
    def origin(self, op, multiplier, phase, sandbox=None):
        """Attribute what is emitted inside (e.g. a backward rule jax runs later) to ``op``."""
        saved = (self.op, self.multiplier, self.phase, self.sandbox)
        self.op, self.multiplier, self.phase, self.sandbox = op, multiplier, phase, sandbox
        try:
            yield
        finally:
            self.op, self.multiplier, self.phase, self.sandbox = saved

    def capture(self):
        """The origin active now, to re-enter later with ``origin(*captured)``."""
        return self.op, self.multiplier, self.phase, self.sandbox

    @contextlib.contextmanager
    def sandboxed(self):
        """A trace the planner rolls back (a candidate it prices): what it records counts while
        it runs; what jax traces for it later (the forward of a collective under ``jax.grad`` in a
        loop body, run when the loop is differentiated) is dead code and records nothing."""
        saved = self.sandbox
        self._sandboxes += 1
        self.sandbox = self._sandboxes
        try:
            yield
        finally:
            self._closed.add(self.sandbox)
            self.sandbox = saved

    # -- loops -------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def loop(self, length: int, *, inside_op: bool = False):
        """A loop body's trace: what runs inside runs ``length`` times more often. ``inside_op``:
        the loop is an op's own (a ring's steps), attributed to that op; else the body's ops are
        attributed each to itself."""
        saved = (self.multiplier, self.op)
        self.multiplier, self.op = saved[0] * length, saved[1] if inside_op else None
        if self.mesh is not None:  # only a rewriter's trace counts executions
            trace = jaxcompat.current_trace()
            self._loops[id(trace)] = self.multiplier
            self._keepalive.append(trace)
        try:
            yield
        finally:
            self.multiplier, self.op = saved

    def in_loop(self) -> bool:
        """Is the code being traced a loop body's (whatever its trip count: a scan of one layer
        is a loop too, which jax differentiates only once it is traced)?"""
        trace = jaxcompat.current_trace()
        while trace is not None:
            if id(trace) in self._loops:
                return True
            trace = jaxcompat.parent_trace(trace)
        return False

    def multiplier_of(self, trace) -> int:
        """Executions of code built into ``trace`` (the innermost loop body around it)."""
        while trace is not None:
            if id(trace) in self._loops:
                return self._loops[id(trace)]
            trace = jaxcompat.parent_trace(trace)
        return 1

    def executions_of(self, array) -> int:
        """How often a relayout of ``array`` runs: hoisted to the trace that owns it, so a value a
        loop body captures is relaid once, not once per step."""
        trace = jaxcompat.current_trace()
        return self.multiplier_of(jaxcompat.enclosing_trace(array, trace))
