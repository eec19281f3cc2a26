"""Foresight: what one trace of a program learned, for a second trace to decide better.

The rewriter decides op by op, in program order; a few choices depend on what later ops do:

* a value with a pending sum that a linear op carries on (``shift(rows)``) and that is also
  reduced (``rows`` is returned), or that linear ops carry on into several values each reduced
  (``rows * 0.5`` and ``-rows``; ``shift(rows)`` and ``sum(rows, "e")``, both returned): the sum
  travels once per value. Had the sum been reduced where the value is made, every reader would
  share one reduction (gspmd's choice), cheaper when those values together are larger;
* an elementwise op on a parameter stored split (``erf(w)``) runs where ``w`` is stored; when a
  later op gathers ``w`` whole anyway (``top_k(w)``), reading that copy would move nothing and the
  result would already be where the layout wants it;
* a reshape that could park a split on a kept dim (an all-to-all now, instead of a gather) when
  its result is returned whole anyway: the parked split then moves twice;
* an op reading a parameter and data varies over the data axes (``ExplicitContext.vary``: the
  parameter's gradient is then summed at the parameter's size); when the data is replicated and
  what it computes is returned, it is all-reduced only to type it replicated.

:class:`Foresight` numbers the values of a trace (in the order made or first seen: the same numbers
in every trace of one program), records both situations, and :meth:`Foresight.next`
turns them into the hints of a second trace: pending sums to reduce where made (``early``),
copies that will be made anyway (``later``) and ops not to widen (``narrow``). ``Program.make_jaxpr`` traces a second time only when
there is something to gain (and a third when the second raised a question the first could not
answer: an op that now meets a gathered copy asks whether its result moves later); numbers that no longer match just make a hint moot (a reduction or a
gather done earlier than needed is still correct).

Reading a copy another op made (``ExplicitContext.relaid``) is free only if that op stays: when
the compiler drops it (its result is never used), the copy is made for the reader alone. A trace
in which some collective is dead and some op read a copy is compared with one reading none
(``no_reuse``); ``Program.make_jaxpr`` keeps whichever moves fewer bytes. (Whether a reshape
moves a split to make its result split off the layout, betting it stays so, is no longer a
retrace: it is a decision point the planner prices over the whole program.)

A pending sum reduced with a dim whole that the layout splits over free axes (``rows[b k]``, a
lookup's partial rows, ``k`` whole because the small value it came from - a top_k's ``[k]`` -
was replicated) is all-reduced whole; sliced first, its backward would gather the cotangent.
gspmd computes ``k`` split from where it enters, at the small value's size. A trace computing
such dims (``split``) as the layout splits them wherever an op could keep them whole for free
is compared with the others.
"""

from __future__ import annotations

__all__ = ["Foresight"]


class Foresight:
    """Hints from a previous trace (``early``, ``later``) and this trace's observations."""

    def __init__(self, early=None, later=None, narrow=None, no_reuse=False, split=()):
        self.no_reuse = no_reuse      # read no copy made by another op (see Program.make_jaxpr)
        self.split = frozenset(split)  # dims to compute split as the layout says, wherever that is free
        self.split_wished: set = set()  # dims a pending sum was reduced whole that the layout splits
        self.reused = False           # an op read a copy made by another op
        self.early: dict = dict(early or {})   # number -> (dim names, placement to reduce its sum to)
        self.later: dict = dict(later or {})   # number -> placements of copies a later op makes
        self.narrow: set = set(narrow or ())   # widenings (in order) to leave out
        self._widenings = 0
        self._widened: dict = {}      # number of a value -> the widenings that typed it
        self._replicated: set = set()  # widenings a value was all-reduced for, to type it
        self._numbers: dict = {}   # id(local array) -> number
        self._alive: list = []     # keeps the ids above unique while the trace lives
        self._count = 0
        self._kept: set = set()       # numbers of pending values a linear op carried on
        self._carried: list = []      # numbers of pending values the op at hand carries on
        self._names: dict = {}        # number of an op result -> its dim names
        self._sizes: dict = {}        # number of an op result -> its local block's elements
        self._origin: dict = {}       # number of a pending result -> the value its sum came from
        self._resolved_from: dict = {}  # number of an origin -> (placement, dim names, elements) of each
        #                                 value its carried sum was reduced in (elements times the
        #                                 trips of the loop around the reduction)
        self._log: list = []          # origins, in the order reductions were added above
        self._slice_of: dict = {}     # number of one step's slice of a scanned stack -> the scanned
        #                               dim's position in the stack
        self._resolved: dict = {}     # number -> placement its pending sum was first reduced to
        self._made: dict = {}         # number -> placements of the copies made (relayouts)
        self._wished: set = set()     # (number, placement) an elementwise op would have read

    # -- numbering -------------------------------------------------------------------------------

    def result(self, array, names=(), pending=False) -> int:
        """Number an op's result (every result, in trace order). A pending result of an op that
        carried one operand's sum on (``x * 0.5`` or ``sum(x, "e")`` of a pending ``x``) keeps
        that operand's origin: the value whose sum it is."""
        n = self.number(array)
        self._names[n] = tuple(names)
        self._sizes[n] = getattr(array, "size", 0)
        origins = {self._origin.get(k, k) for k in self._carried}
        if pending and len(origins) == 1:
            self._origin[n] = origins.pop()
        self._carried = []
        return n

    def number(self, array) -> int:
        """``array``'s number: op results in the order made, other arrays (inputs, the tracers
        ``jax.grad`` inside the function wraps them in) in the order first seen. Traces of one
        program run the same calls in the same order, so the numbers agree."""
        n = self._numbers.get(id(array))
        if n is None:
            self._count += 1
            n = self._numbers[id(array)] = self._count
            self._alive.append(array)
        return n

    # -- observations ----------------------------------------------------------------------------

    def kept(self, array) -> None:
        """A linear op read ``array`` (a value with a pending sum) keeping the sum."""
        n = self.number(array)
        self._kept.add(n)
        self._carried.append(n)

    def sliced(self, stack, piece, names, pos) -> None:
        """``piece`` is one step's slice of ``stack`` (a scanned input with a pending sum, dims
        ``names``, the scanned dim at ``pos`` left out): a reduction of the slice in every step
        reduces the stack's sum piece by piece, placed as the slice is with the scanned dim whole."""
        n, m = self.number(stack), self.number(piece)
        self._origin[m] = self._origin.get(n, n)
        self._names[m], self._sizes[m], self._slice_of[m] = tuple(names), getattr(piece, "size", 0), pos

    def resolved(self, array, target, trips=1) -> None:
        """``array``'s pending sum was reduced, the value placed by ``target`` (axes per dim),
        ``trips`` times (in a loop body)."""
        n = self.number(array)
        target = tuple(target)
        self._resolved.setdefault(n, target)
        if n in self._origin:
            if n in self._slice_of:   # the stack's placement: the scanned dim whole
                pos = self._slice_of[n]
                target = target[:pos] + ((),) + target[pos:]
            o = self._origin[n]
            self._resolved_from.setdefault(o, []).append((target, self._names.get(n), self._sizes.get(n, 0) * trips))
            self._log.append(o)

    def checkpoint(self):
        """A mark to forget later reductions at (an aborted trace of a loop body: md.scan)."""
        return len(self._log)

    def rollback(self, mark) -> None:
        while len(self._log) > mark:
            self._resolved_from[self._log.pop()].pop()

    def early_target(self, number, names):
        """The placement to reduce the pending sum of result ``number`` (over dims ``names``) to
        where it is made, or ``None``."""
        hint = self.early.get(number)
        return hint[1] if hint is not None and tuple(hint[0]) == tuple(names) else None

    def made(self, array, target) -> None:
        """A copy of ``array`` placed by ``target`` was made (a relayout)."""
        self._made.setdefault(self.number(array), set()).add(tuple(target))

    def will_make(self, array, target) -> bool:
        """Does the previous trace say a copy of ``array`` placed by ``target`` gets made? (Asked
        by an elementwise op that would read that copy: remembered, see :meth:`next`.)"""
        n = self.number(array)
        self._wished.add((n, tuple(target)))
        return tuple(target) in self.later.get(n, ())

    def next_made(self, target) -> bool:
        """Does the previous trace say a copy of the next op result placed by ``target`` gets made?
        (Asked by an op choosing its result's placement before making it: reshape.)"""
        n = self._count + 1
        self._wished.add((n, tuple(target)))
        return tuple(target) in self.later.get(n, ())

    def widening(self):
        """The next widening of an op's type by the data axes: its index, or ``None`` when the
        previous trace says to leave it out."""
        self._widenings += 1
        return None if self._widenings in self.narrow else self._widenings

    def widened(self, array, k) -> None:
        """``array`` is the result of the op widened by widening ``k``."""
        self._widened[self.number(array)] = frozenset({k})

    def derived(self, operands, results) -> None:
        """An op made ``results`` from ``operands`` (arrays): they carry the operands' widenings."""
        ks = frozenset().union(*(self._widened.get(self.number(a), frozenset()) for a in operands))
        if ks:
            for a in results:
                n = self.number(a)
                self._widened[n] = self._widened.get(n, frozenset()) | ks

    def replicated(self, array) -> None:
        """``array`` was all-reduced to type it replicated: the widenings it carries are left out
        next time."""
        self._replicated |= self._widened.get(self.number(array), frozenset())

    # -- the next trace --------------------------------------------------------------------------

    def next(self):
        """Hints for a second trace, or ``None`` when it would decide nothing differently."""
        early = {n: t for n, t in self._resolved.items() if n in self._kept}
        early.update((o, t) for o, t in map(self._reduce_once, self._resolved_from) if t is not None and o not in early)
        # with the value's dim names: a trace deciding otherwise numbers values otherwise, and a
        # hint must not place a value it was not learned on
        early = {n: (self._names.get(n, ()), t) for n, t in early.items()}
        wished = {(n, t) for n, t in self._wished if t in self._made.get(n, ())}
        if not early and not wished and not self._replicated:
            return None
        hints = {"early": early, "later": {n: set(ts) for n, ts in self._made.items()},
                 "narrow": set(self._replicated)}
        return {**hints, "split": self.split} if self.split else hints

    def _reduce_once(self, o):
        """``(o, placement)``: one sum carried on into several values, each reduced, costs less
        reduced once where made, when those values together are larger than it (``rows * 0.5``
        and ``-rows``; or ``shift(rows)`` and ``sum(rows, "e")``): placed as the values over its
        own dims were (all alike), else ``None``."""
        reductions = self._resolved_from[o]
        alike = {t for t, names, _ in reductions if names == self._names.get(o)}
        if len(alike) != 1 or sum(size for _, _, size in reductions) <= self._sizes.get(o, 0):
            return o, None
        return o, alike.pop()
