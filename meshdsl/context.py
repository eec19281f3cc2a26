"""Lowering contexts: the one object every lowering rule talks to.

A rule (see :mod:`meshdsl.ops`) is written once. It asks its context four things: where should
this op compute (:meth:`plan`), give me this operand's local block placed so (:meth:`local`), which
mesh axes does the result vary over (:meth:`vary`), and wrap my result (:meth:`out`). Three
contexts answer:

* :class:`GlobalContext` - outside ``md.lower``: every dim whole, no communication. This is the
  unsharded reference every layout must reproduce.
* :class:`GspmdContext` - ``backend="gspmd"``: global arrays plus a sharding constraint per op
  output; the compiler chooses the communication. The baseline for benchmarks.
* :class:`ExplicitContext` - ``backend="explicit"``: local blocks inside ``shard_map``; every
  collective comes from :mod:`meshdsl.relayout` / :mod:`meshdsl.collectives` and is recorded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading

import jax
from jax.sharding import NamedSharding

from . import cost
from .errors import LayoutError
from .layout import check_axes, to_spec
from .named import NamedArray, Placement

__all__ = ["current", "using", "GlobalContext", "GspmdContext", "ExplicitContext", "CollectiveRecord"]

_local = threading.local()


def current():
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else GLOBAL


@contextlib.contextmanager
def using(ctx):
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    stack.append(ctx)
    try:
        yield ctx
    finally:
        stack.pop()


@dataclasses.dataclass
class CollectiveRecord:
    """One collective the rewriter emitted (per device)."""

    op: str            # the named op that needed it, e.g. "einsum"
    line: str          # user source line of that op
    kind: str          # all-reduce | all-gather | reduce-scatter | all-to-all | collective-permute
    axes: tuple        # mesh axes of the group
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


class GlobalContext:
    """Outside ``md.lower``: whole arrays, nothing to place, nothing to communicate."""

    explicit = False
    mesh = None
    layout = None

    def __init__(self):
        self.op = None  # (name, line) of the outermost named op being lowered

    def whole_placement(self, dims):
        return None

    def placement(self, x: NamedArray):
        return None

    def pending(self, x: NamedArray) -> frozenset:
        return frozenset()

    def plan(self, dims, operands, *, prefer=(), keep_pending=frozenset(), cheapest=False):
        return {d.name: () for d in dims}

    def vary(self, planned, operands=(), keep_pending=frozenset()):
        return frozenset()

    def local(self, x: NamedArray, axes_by_name=None, vary=frozenset(), *, keep_pending=frozenset()):
        return x._array

    def out(self, array, dims, axes_by_name=None, pending=frozenset(), *, is_param=False) -> NamedArray:
        return NamedArray(array, dims, is_param=is_param)

    def axes_size(self, axes) -> int:
        return 1

    def layout_axes(self, name: str) -> tuple:
        return ()


GLOBAL = GlobalContext()


class GspmdContext(GlobalContext):
    """Global arrays under ``jax.jit``; each op output is constrained to the layout."""

    def __init__(self, mesh, layout):
        super().__init__()
        self.mesh, self.layout = mesh, layout
        self.dims_seen: set[str] = set()
        self._checked: dict = {}

    def layout_axes(self, name: str) -> tuple:
        return self.layout.axes(name)

    def out(self, array, dims, axes_by_name=None, pending=frozenset(), *, is_param=False) -> NamedArray:
        x = NamedArray(array, dims, is_param=is_param)
        self.dims_seen.update(x.names)
        axes = _checked_canonical(self, x.dims)
        if any(axes):
            spec = to_spec(axes)
            x._array = jax.lax.with_sharding_constraint(array, NamedSharding(self.mesh.jax_mesh, spec))
        return x


def _checked_canonical(ctx, dims) -> tuple:
    hit = ctx._checked.get(dims)
    if hit is None:
        what = f"{ctx.op[0]} at {ctx.op[1]}" if ctx.op else "tensor"
        hit = tuple(ctx.layout.axes(d.name) for d in dims)
        check_axes(dims, hit, ctx.mesh, what=f"{what}: result")
        ctx._checked[dims] = hit
    return hit


class ExplicitContext(GlobalContext):
    """Inside ``shard_map``: local blocks, placements, explicit recorded collectives."""

    explicit = True

    def __init__(self, mesh, layout, *, param_gather: str = "keep"):
        super().__init__()
        self.mesh, self.layout = mesh, layout
        self.param_gather = param_gather
        self.gather_plan: list | None = None  # param_gather="auto": gather (True) or stay, per decision
        self.gather_probe: list = []           # (params, gather bytes, stay bytes) per decision
        self.records: list[CollectiveRecord] = []
        self.multiplier = 1          # executions of the code being traced (md.scan trip counts)
        self.phase = "forward"
        self.tracing = True          # False once the trace is over: late backward rules record nothing
        self.dims_seen: set[str] = set()
        self.param_axes: frozenset = frozenset()  # axes the program's (non-parameter) inputs are split over
        self._tags = 0
        self._checked: dict = {}
        self._cache: dict = {}       # relayout / cast results, per jax trace
        self._made_by: dict = {}     # id(local array) -> "op at line" that produced it
        self._cache_log: list = []   # cache keys in insertion order (for rollback)
        self._multipliers: dict = {}  # id(loop body trace) -> executions
        self._keepalive: list = []

    # -- placements ------------------------------------------------------------------------------

    def layout_axes(self, name: str) -> tuple:
        return self.layout.axes(name)

    def canonical(self, dims) -> tuple:
        return _checked_canonical(self, dims)

    def whole_placement(self, dims):
        return Placement(tuple(() for _ in dims))

    def placement(self, x: NamedArray) -> Placement:
        return x.placement if x.placement is not None else self.whole_placement(x.dims)

    def pending(self, x: NamedArray) -> frozenset:
        return self.placement(x).pending

    def axes_size(self, axes) -> int:
        return self.mesh.axes_size(axes)

    def plan(self, dims, operands, *, prefer=(), keep_pending=frozenset(), cheapest=False):
        from .placement import plan
        return plan(self, dims, operands, prefer=prefer, keep_pending=keep_pending, cheapest=cheapest)

    def vary(self, planned, operands=(), keep_pending=frozenset()):
        """Mesh axes an op's local computation varies over: every axis the plan splits a dim on
        (``planned``: axes tuples), the pending sums it keeps, and any axis an operand already
        varies over beyond its placement (a replicated value typed varying).

        An op reading a parameter also varies over the axes the program's inputs are split over
        (``param_axes``, e.g. ``data``): a parameter's gradient is then summed over them where the
        parameter is read - the smallest place - not on some larger value computed from it (a
        position bias [heads, seq, kv_seq] from its table [buckets, heads])."""
        out = set(keep_pending)
        for axes in planned:
            out.update(axes)
        for x in operands:
            pl = self.placement(x)
            out |= varying_axes(x._array) - pl.used_axes()
            if x.is_param:
                out |= self.param_axes
        return frozenset(out)

    def local(self, x: NamedArray, axes_by_name=None, vary=frozenset(), *, keep_pending=frozenset()):
        from .relayout import relayout
        pl = self.placement(x)
        target = tuple(pl.of(x.dims, d.name) if axes_by_name is None else axes_by_name.get(d.name, ())
                       for d in x.dims)
        return relayout(self, x, target, frozenset(vary), frozenset(keep_pending))

    def out(self, array, dims, axes_by_name=None, pending=frozenset(), *, is_param=False) -> NamedArray:
        x = NamedArray(array, dims, is_param=is_param)
        self.canonical(x.dims)  # every tensor must be valid under the layout, used or not
        self.dims_seen.update(x.names)
        axes = tuple((axes_by_name or {}).get(d.name, ()) for d in x.dims)
        what = f"{self.op[0]} at {self.op[1]}" if self.op else "tensor"
        check_axes(x.dims, axes, self.mesh, what=f"{what}: result (as placed)")
        overlap = set(pending) & {a for ax in axes for a in ax}
        if overlap:
            raise LayoutError(f"internal: {what} result both split and pending over {sorted(overlap)}")
        x.placement = Placement(axes, frozenset(pending))
        if self.op:
            self._made_by[id(array)] = f"{self.op[0]} at {self.op[1]}"
            self._keepalive.append(array)
        return x

    def made_by(self, array) -> str:
        """``"einsum at model.py:12"`` for a value an op produced (``""`` for inputs)."""
        return self._made_by.get(id(array), "")

    # -- recording -------------------------------------------------------------------------------

    def tag(self) -> str:
        self._tags += 1
        return f"mdc{self._tags}"

    def record(self, kind, axes, operand, result, tensor: str = "", tag: str = "") -> None:
        if not self.tracing:
            return
        n = self.mesh.axes_size(axes)
        if n <= 1:
            return
        platform = self.mesh.platform
        op_b = cost.array_bytes(operand.shape, operand.dtype, platform)
        res_b = cost.array_bytes(result.shape, result.dtype, platform)
        name, line = self.op or ("?", "?")
        self.records.append(CollectiveRecord(
            op=name, line=line, kind=kind, axes=tuple(axes), shape=tuple(operand.shape),
            dtype=str(operand.dtype), bytes=cost.moved_bytes(kind, op_b, res_b, n),
            count=self.multiplier, phase=self.phase, tensor=tensor, tag=tag))

    @contextlib.contextmanager
    def origin(self, op, multiplier, phase):
        """Attribute what is emitted inside (e.g. a backward rule) to the op that caused it."""
        saved = (self.op, self.multiplier, self.phase)
        self.op, self.multiplier, self.phase = op, multiplier, phase
        try:
            yield
        finally:
            self.op, self.multiplier, self.phase = saved

    # -- per-trace cache -------------------------------------------------------------------------

    def cached(self, source, key, make):
        """``make()`` once per (``source`` array, key); later callers share the result, so a value
        used by several ops is relaid / cast once and its cotangents are summed once (one backward
        collective, not one per use).

        When ``source`` belongs to a jax trace enclosing the current one - a value captured by a
        ``md.scan`` step - ``make()`` runs in that enclosing trace: the relayout is hoisted out of
        the loop, done once instead of once per step, and its backward collective too."""
        trace = _current_trace()
        owner = _enclosing_owner(source, trace)
        full = (id(source), key, id(owner))
        hit = self._cache.get(full)
        if hit is None:
            if owner is trace:
                hit = make()
            else:
                from jax._src import core
                saved = self.multiplier
                self.multiplier = self._multiplier_of(owner)
                try:
                    with core.set_current_trace(owner):
                        hit = make()
                finally:
                    self.multiplier = saved
            self._cache[full] = hit
            self._cache_log.append(full)
            self._keepalive.append((source, owner))  # ids stay unique while the cache lives
        return hit

    def enter_loop(self, multiplier: int) -> None:
        """Called at the start of a loop body's trace: what runs in it runs ``multiplier`` times."""
        self._multipliers[id(_current_trace())] = multiplier
        self._keepalive.append(_current_trace())

    def executions_of(self, array) -> int:
        """How often a relayout of ``array`` runs: hoisted to the trace that owns it (see
        :meth:`cached`), so a value captured by a loop body is relaid once, not once per step."""
        return self._multiplier_of(_enclosing_owner(array, _current_trace()))

    def _multiplier_of(self, trace) -> int:
        while trace is not None:
            if id(trace) in self._multipliers:
                return self._multipliers[id(trace)]
            trace = getattr(trace, "parent_trace", None)
        return 1

    def checkpoint(self):
        """A mark to roll records and cache back to (an aborted trace, see md.scan)."""
        return len(self.records), len(self._cache_log)

    def rollback(self, mark) -> None:
        n_records, n_cache = mark
        del self.records[n_records:]
        for full in self._cache_log[n_cache:]:
            self._cache.pop(full, None)
        del self._cache_log[n_cache:]


def _enclosing_owner(source, trace):
    """The trace owning tracer ``source`` if it strictly encloses ``trace``, else ``trace``."""
    owner = getattr(source, "_trace", None)
    if owner is None or owner is trace:
        return trace
    t = getattr(trace, "parent_trace", None)
    while t is not None:
        if t is owner:
            return owner
        t = getattr(t, "parent_trace", None)
    return trace


def varying_axes(array) -> frozenset:
    """Mesh axes jax's type system says ``array`` varies over (empty outside shard_map)."""
    try:
        return frozenset(jax.typeof(array).mat.varying)
    except (AttributeError, TypeError):
        return frozenset()


def _current_trace():
    try:
        from jax._src import core
        return core.trace_ctx.trace
    except Exception:  # pragma: no cover - jax internals moved
        return None
