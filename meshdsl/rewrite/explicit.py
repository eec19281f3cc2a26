"""The explicit rewriter's context: local blocks, placements, recorded collectives.

Inside ``shard_map`` every NamedArray holds this device's block and a
:class:`~meshdsl.names.named.Placement` (which mesh axes split which dim, which hold pending partial
sums). Rules ask :meth:`ExplicitContext.plan` where to compute (:mod:`meshdsl.rewrite.placement`) and
:meth:`ExplicitContext.local` for operands placed so (:mod:`meshdsl.rewrite.relayout`, which emits the
collectives of :mod:`meshdsl.rewrite.collectives`); the :class:`~meshdsl.rewrite.recorder.Recorder` keeps what was
emitted for ``md.explain``.

Relayouts are cached per (source value, target) for the trace that owns the source: a value
read by several ops is relaid once and its cotangent reduced once; a value a ``md.scan`` step
captures from outside is relaid outside the loop (hoisted), once.
"""

from __future__ import annotations

import contextlib
import dataclasses

from . import collectives as C
from ..platform import jaxcompat
from . import param_gather
from .contexts import LayoutContext
from ..costmodel.cost import dual_bytes
from ..names.errors import LayoutError
from ..platform.jaxcompat import differentiated, varying_axes
from ..names.layout import check_axes
from ..names.named import Facts, NamedArray, Placement
from .placement import plan
from .relayout import relayout

__all__ = ["ExplicitContext"]


class ExplicitContext(LayoutContext):
    """Inside ``shard_map``: local blocks, placements, explicit recorded collectives.

    ``params``: the param-gather policy (:mod:`meshdsl.rewrite.param_gather`). ``schedule``: how a scan
    over a split dim is pipelined (:mod:`meshdsl.ops.pipeline`). ``param_axes``: the mesh axes the
    program's (non-parameter) inputs are split over (see :meth:`vary`)."""

    explicit = True

    def __init__(self, mesh, layout, *, params=None, schedule: str = "gpipe", repeats: int = 1,
                 attention: str | None = None):
        super().__init__(mesh, layout)
        self.params = params or param_gather.KEEP
        self.schedule = schedule          # pipeline schedule of a scan over a split dim
        self.repeats = repeats            # chunks per stage of the circular schedule
        self.attention = attention        # md.attention's context-parallel strategy, if forced
        self.pipelines: list[dict] = []   # one entry per pipeline traced (for md.explain)
        self.attentions: list[dict] = []  # one entry per md.attention traced (for md.explain)
        self.frame = None                 # the microbatch being processed inside a pipeline tick
        self.param_axes: frozenset = frozenset()
        self._cache: dict = {}       # relayout / cast results, per jax trace
        self._cache_log: list = []   # cache keys in insertion order (for rollback)
        # What the rewriter knows of each value is on the value (NamedArray.facts: its maker, whether
        # only weights reach it, whether it was left unwidened, its pieces); below, the caches of
        # this trace's relayouts, keyed by the local array relaid (alive while the context lives).
        self._keepalive: list = []   # keeps the ids below unique while the context lives
        self._relaid: dict = {}      # id(local array) -> {target axes per dim} relaid (cached) so far
        self._narrowing = False      # the op being lowered was left unwidened
        self._copies: dict = {}      # (id(local array), target) -> (planner's op number making it, its bytes)
        self._sliced_from: dict = {}  # id(local block) -> (the local array it is a slice of, that array's axes)
        self.entry: frozenset = frozenset()  # ids of the local arrays the planned op lowered now reads
        self.planner = None          # the planner's recording or plan for this trace (meshdsl.planner)

    def option(self, count: int) -> int:
        """Which of ``count`` candidates a rule's decision point takes: the planner's choice, or 0
        (the rule's own)."""
        return 0 if self.planner is None else self.planner.option(self, count)

    def apply(self, name, rule, args, kwargs):
        if self.planner is None:
            return rule(self, *args, **kwargs)
        return self.planner.apply(self, name, rule, args, kwargs)

    # -- placements ------------------------------------------------------------------------------

    def whole_placement(self, dims):
        return Placement(tuple(() for _ in dims))

    def placement(self, x: NamedArray) -> Placement:
        return x.placement if x.placement is not None else self.whole_placement(x.dims)

    def pending(self, x: NamedArray) -> frozenset:
        return self.placement(x).pending

    def axes_size(self, axes) -> int:
        return self.mesh.axes_size(axes)

    def plan(self, dims, operands, *, prefer=(), keep_pending=frozenset(), cheapest=False, out_dtype=None):
        return plan(self, dims, operands, prefer=prefer, keep_pending=keep_pending, cheapest=cheapest,
                    out_dtype=out_dtype)

    def vary(self, planned, operands=(), keep_pending=frozenset(), out_size=None):
        """Mesh axes an op's local computation varies over: every axis the plan splits a dim on
        (``planned``: axes tuples), the pending sums it keeps, and any axis an operand already
        varies over beyond its placement (a replicated value typed varying).

        An op reading a parameter also varies over the axes the program's inputs are split over
        (``param_axes``, e.g. ``data``): a parameter's gradient is then summed over them where the
        parameter is read - the smallest place - not on some larger value computed from it (a
        position bias [heads, seq, kv_seq] from its table [buckets, heads]). Only for a gradient
        (an operand differentiated, or a loop body, differentiated after it is traced), and only where that is
        smaller: when the op's result (``out_size`` elements, unknown = larger) is no larger than
        the parameter, or when it meets only parameters and scalars (no data: ids, positions), the
        parameter stays invariant, so a value computed from parameters alone
        (an updated parameter ``w - lr * g``, ``tanh(w)``) stays typed replicated and is never
        all-reduced to fix its type."""
        out = set(keep_pending)
        for axes in planned:
            out.update(axes)
        widen = False
        for x in operands:
            pl = self.placement(x)
            out |= varying_axes(x.raw) - pl.used_axes()
            widen = widen or x.is_param and (out_size is None or out_size > x.size) and any(
                not self.weights_only(y) and y.ndim for y in operands if y is not x)
        # Only for a gradient: no operand differentiated (and not in a loop body, which jax
        # differentiates after tracing it), widening would only type values varying to all-reduce
        # them again. Where what the op computes is returned and all-reduced only to type it
        # replicated, widening costs that all-reduce: whether to widen is a decision point of
        # the planner (candidate 1: stay invariant). An op reading a value computed from one left
        # unwidened follows that decision (else it would widen the value in its place).
        if widen and self.param_axes and (self.rec.multiplier > 1 or self.rec.in_loop() or any(differentiated(x.raw) for x in operands)):
            if any(x.facts.narrowed for x in operands) or self.option(2):
                self._narrowing = True
            else:
                out |= self.param_axes
        return frozenset(out)

    def weights_only(self, x: NamedArray) -> bool:
        """A parameter, or a value computed from parameters alone (``sum(w)``, ``concat([w, w])``,
        scalars aside): no data reaches it, so it is no reason to vary over data axes. Values made
        from no parameter (``arange`` positions, bucket ids) count as data: a parameter they
        index into (a position-bias table) has its gradient summed where it is read, at its size."""
        return x.is_param or x.facts.weights_only

    def relaid(self, x: NamedArray, target) -> bool:
        """Is ``x`` relaid to ``target`` (axes per dim, pending sums reduced) in this trace
        already? Reading that copy moves nothing more - if the op that made it stays: one the
        compiler drops (its result unused) leaves the copy to this reader alone. So reading a
        copy another op made is a decision point of the planner (candidate 1: as if it were not
        made), and the reading is priced with the maker's liveness (:mod:`meshdsl.planner.plan`).
        (A copy another op makes later is an entry placement the planner prices.)"""
        whole = self.unsliced(x.raw, target)
        if whole is not None and id(whole) in self.entry:
            return True   # a slice of another operand of this op, placed there: that operand is the copy
        made = tuple(target) in self._relaid.get(id(x.raw), ())
        if not made or self.planner is None:
            return made
        maker, cost = self._copies.get((id(x.raw), tuple(target)), (None, 0.0))
        if maker is None or maker == self.planner.current:
            return True
        if self.option(2):
            return False
        self.planner.read(maker, cost, (id(x.raw), tuple(target)))
        return True

    def result_relaid(self, operands, target) -> bool:
        """Will the result of the op at hand (reading ``operands``) be relaid to ``target`` later
        (a returned value gathered at the return)? A decision point of the planner: it prices both
        answers over the whole program (candidate 0: no)."""
        return bool(self.option(2))

    def pieces(self, y, name, pieces):
        y.facts = dataclasses.replace(y.facts, pieces=(name, tuple(pieces)))
        return y

    def part(self, array, dims, like):
        pl = self.placement(like)
        axes = dict(zip(like.names, pl.axes))
        return NamedArray(array, dims, placement=Placement(tuple(axes[d.name] for d in dims), pl.pending))

    def padded_from(self, y):
        """``(dim name, [(piece, offset)])`` of a value made of pieces along a dim (a pad, a
        concat, a zero-filled shift), or None. A rename or reshape since makes another value (a
        swap ``c <-> d`` of two dims of one size: the pieces' ``c`` is the value's ``d`` now)."""
        return y.facts.pieces

    def derived(self, operands, result) -> None:
        narrowed = self._narrowing or any(x.facts.narrowed for x in operands)
        self._narrowing = False
        weights = bool(operands) and all(self.weights_only(x) for x in operands)
        for y in result:
            if narrowed and not y.facts.narrowed or weights and not y.facts.weights_only:
                y.facts = dataclasses.replace(y.facts, narrowed=y.facts.narrowed or narrowed,
                                              weights_only=y.facts.weights_only or weights)

    def local(self, x: NamedArray, axes_by_name=None, vary=frozenset(), *, keep_pending=frozenset()):
        pl = self.placement(x)
        target = tuple(pl.of(x.dims, d.name) if axes_by_name is None else axes_by_name.get(d.name, ())
                       for d in x.dims)
        return relayout(self, x, target, frozenset(vary), frozenset(keep_pending))

    def note_slice(self, block, whole, axes) -> None:
        """``block`` is this device's slice of ``whole`` (placed by ``axes``, no pending sums)."""
        self._sliced_from[id(block)] = (whole, tuple(axes))
        self._keepalive.append(block)

    def unsliced(self, block, axes):
        """The local array ``block`` was sliced from, where that one is placed by ``axes``; else None."""
        hit = self._sliced_from.get(id(block))
        return hit[0] if hit is not None and hit[1] == tuple(axes) else None

    def out(self, array, dims, axes_by_name=None, pending=frozenset(), *, is_param=False) -> NamedArray:
        x = NamedArray(array, dims, is_param=is_param)
        self.canonical(x.dims)  # every tensor must be valid under the layout, used or not
        self.dims_seen.update(x.names)
        axes = tuple((axes_by_name or {}).get(d.name, ()) for d in x.dims)
        what = self.where()
        check_axes(x.dims, axes, self.mesh, what=f"{what}: result (as placed)")
        overlap = set(pending) & {a for ax in axes for a in ax}
        if overlap:
            raise LayoutError(f"internal: {what} result both split and pending over {sorted(overlap)}")
        x.placement = Placement(axes, frozenset(pending))
        x.facts = Facts(made_by=what if self.op else "", narrowed=self._narrowing)
        return x

    def operand(self, x: NamedArray) -> NamedArray:
        return x if self.frame is None else self.frame.take(self, x)

    def block_start(self, name: str, size: int, split, block: int):
        if self.frame is None:
            return super().block_start(name, size, split, block)
        return self.frame.block_start(name, size, split, block)

    def same_rows(self, old, new) -> None:
        if self.frame is not None:
            self.frame.same_rows(old, new)

    def position_extent(self, name: str, size: int) -> int:
        return size if self.frame is None else self.frame.extent(name, size)

    # -- values entering and leaving the rewriter ----------------------------------------------

    def adopt(self, array, dims, where: str):
        """``md.named`` inside the lowering: a whole value, valid under the layout. A device's
        local block (a value that varies between devices) is refused: it is not the global value."""
        self.layout.tensor_axes(dims, self.mesh, what=where)
        self.dims_seen.update(dims.names)
        vary = varying_axes(array)
        if vary:
            raise LayoutError(
                f"{where}: the array differs between devices (it varies over mesh axes "
                f"{self.mesh.axes_text([a for a in self.mesh.factor_axes if a in vary])}): "
                f"it is a device's local block, not the global value [{dims}]. Inside md.lower, x.array "
                "is a local block; run plain jax/flax code on named values with "
                "md.local_map(fn, x, out='...'), which gives fn whole values")
        return self.whole_placement(dims)

    def read(self, x: NamedArray):
        """``x.array`` inside the lowering: the block in its placement, pending sums reduced."""
        with self.at("array", "x.array"):
            return self.finalize(x, x.placement.axes)

    def finalize(self, leaf: NamedArray, axes):
        """``leaf``'s local block placed by ``axes``, pending sums reduced, and typed invariant
        wherever it is replicated (a value equal on every device that jax types varying - computed
        from parameters cast for a data-parallel op - is typed invariant with one all-reduce)."""
        if self.planner is not None:
            axes = self.planner.sink(self, leaf, axes)
        target = dict(zip(leaf.names, axes))
        split = frozenset(a for ax in axes for a in ax)
        arr = self.local(leaf, target, split)
        manual = frozenset() if self.frame is None else self.frame.stage_axis  # stages differ there
        extra = tuple(a for a in self.mesh.factor_axes if a in varying_axes(arr) - split - manual)
        if extra:
            arr = self.cached(arr, ("replicate", extra), lambda: C.replicate(
                self, arr, extra, f"[{leaf.dims}] replicated value typed varying over {self.mesh.axes_text(extra)}"))
        if self.planner is not None:
            self.planner.sank(self, arr)
        return arr

    # -- per-trace cache -------------------------------------------------------------------------

    def cached(self, source, key, make):
        """``make()`` once per (``source`` array, key); later callers share the result, so a value
        used by several ops is relaid / cast once and its cotangents are summed once (one backward
        collective, not one per use).

        When ``source`` belongs to a jax trace enclosing the current one - a value captured by a
        ``md.scan`` step - ``make()`` runs in that enclosing trace: the relayout is hoisted out of
        the loop, done once instead of once per step, and its backward collective too."""
        trace = jaxcompat.current_trace()
        owner = jaxcompat.enclosing_trace(source, trace)
        full = (id(source), key, id(jaxcompat.stands_for(owner)))
        hit = self._cache.get(full)
        # a copy other ops may share: a relayout (by its target) or a cast to varying
        shared = key[2] if key[0] == "relayout" and not key[4] else key if key[0] == "cast" else None
        if hit is not None and shared is not None and self.planner is not None:
            self._read_copy(source, shared)
        if hit is None:
            n_records, n_casts = len(self.rec.records), len(self.rec.casts)
            if owner is trace:
                hit = make()
            else:
                saved = self.rec.multiplier
                self.rec.multiplier = self.rec.multiplier_of(owner)
                try:
                    with jaxcompat.in_trace(owner):
                        hit = make()
                finally:
                    self.rec.multiplier = saved
            self._cache[full] = hit
            self._cache_log.append(full)
            if key[0] == "relayout" and not key[4]:
                self._relaid.setdefault(id(source), set()).add(key[2])
            if shared is not None and self.planner is not None:
                made = self.rec.records[n_records:]
                # its collectives, their duals where the source is differentiated, its casts' psums
                cost = sum(r.total_bytes for r in made) + (dual_bytes(made) if differentiated(source) else 0.0) \
                    + sum(b for b, *_ in self.rec.casts[n_casts:])
                self._copies[(id(source), shared)] = (self.planner.current, cost)
                self.planner.made((id(source), shared), cost)

            self._keepalive.append((source, owner))  # ids stay unique while the cache lives
        return hit

    def _read_copy(self, source, target) -> None:
        """An op reads the copy of ``source`` at ``target`` another op made: free only while
        that op stays (the planner charges the copy to this reader where the maker is dead)."""
        maker, cost = self._copies.get((id(source), target), (None, 0.0))
        if maker is not None and maker != self.planner.current:
            self.planner.read(maker, cost, (id(source), target))

    def checkpoint(self):
        """A mark to roll records and cache back to (an aborted trace, see md.scan)."""
        planned = self.planner.checkpoint() if self.planner is not None else None
        return (len(self.rec.records), len(self._cache_log), planned, len(self.rec.casts), len(self.attentions),
                len(self.rec.work), len(self.rec.held), len(self.rec.gathers))

    @contextlib.contextmanager
    def as_at(self, mark):
        """The relayout cache as it was at ``mark`` while inside (what was made since is hidden,
        and back after): a candidate priced after the op ran must not read the copies it made."""
        hidden = self._cache_log[mark[1]:]
        saved = {full: self._cache.pop(full) for full in hidden if full in self._cache}
        copies = [(full[0], full[1][2]) for full in hidden if full[1][0] == "relayout" and not full[1][4]]
        for source, target in copies:
            self._relaid.get(source, set()).discard(target)
        del self._cache_log[mark[1]:]
        try:
            yield
        finally:
            self._cache.update(saved)
            self._cache_log.extend(hidden)
            for source, target in copies:
                self._relaid.setdefault(source, set()).add(target)

    def rollback(self, mark) -> None:
        n_records, n_cache, planned, n_casts, n_attentions, n_work, n_held, n_gathers = mark
        del self.rec.casts[n_casts:]
        del self.rec.gathers[n_gathers:]
        del self.rec.work[n_work:]
        del self.rec.held[n_held:]
        del self.attentions[n_attentions:]
        if planned is not None:
            self.planner.rollback(planned)
        del self.rec.records[n_records:]
        for full in self._cache_log[n_cache:]:
            self._cache.pop(full, None)
            if full[1][0] == "relayout":
                self._relaid.get(full[0], set()).discard(full[1][2])

        del self._cache_log[n_cache:]
