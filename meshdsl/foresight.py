"""Foresight: what one trace of a program learned, for a second trace to decide better.

The rewriter decides op by op, in program order; a few choices depend on what later ops do:

* a value with a pending sum that a linear op carries on (``shift(rows)``) and that is also
  reduced (``rows`` is returned): the sum travels twice, once per value. Had the sum been reduced
  where the value is made, every reader would share one reduction (gspmd's choice);
* an elementwise op on a parameter stored split (``erf(w)``) runs where ``w`` is stored; when a
  later op gathers ``w`` whole anyway (``top_k(w)``), reading that copy would move nothing and the
  result would already be where the layout wants it.

:class:`Foresight` numbers the values of a trace (in the order made or first seen: the same numbers
in every trace of one program), records both situations, and :meth:`Foresight.next`
turns them into the hints of a second trace: pending sums to reduce where made (``early``) and
copies that will be made anyway (``later``). ``Program.make_jaxpr`` traces a second time only when
there is something to gain; numbers that no longer match just make a hint moot (a reduction or a
gather done earlier than needed is still correct).
"""

from __future__ import annotations

__all__ = ["Foresight"]


class Foresight:
    """Hints from a previous trace (``early``, ``later``) and this trace's observations."""

    def __init__(self, early=None, later=None):
        self.early: dict = dict(early or {})   # number -> placement to reduce its pending sum to
        self.later: dict = dict(later or {})   # number -> placements of copies a later op makes
        self._numbers: dict = {}   # id(local array) -> number
        self._alive: list = []     # keeps the ids above unique while the trace lives
        self._count = 0
        self._kept: set = set()       # numbers of pending values a linear op carried on
        self._resolved: dict = {}     # number -> placement its pending sum was first reduced to
        self._made: dict = {}         # number -> placements of the copies made (relayouts)
        self._wished: set = set()     # (number, placement) an elementwise op would have read

    # -- numbering -------------------------------------------------------------------------------

    def result(self, array) -> int:
        """Number an op's result (every result, in trace order)."""
        return self.number(array)

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
        self._kept.add(self.number(array))

    def resolved(self, array, target) -> None:
        """``array``'s pending sum was reduced, the value placed by ``target`` (axes per dim)."""
        self._resolved.setdefault(self.number(array), tuple(target))

    def made(self, array, target) -> None:
        """A copy of ``array`` placed by ``target`` was made (a relayout)."""
        self._made.setdefault(self.number(array), set()).add(tuple(target))

    def will_make(self, array, target) -> bool:
        """Does the previous trace say a copy of ``array`` placed by ``target`` gets made? (Asked
        by an elementwise op that would read that copy: remembered, see :meth:`next`.)"""
        n = self.number(array)
        self._wished.add((n, tuple(target)))
        return tuple(target) in self.later.get(n, ())

    # -- the next trace --------------------------------------------------------------------------

    def next(self):
        """Hints for a second trace, or ``None`` when it would decide nothing differently."""
        early = {n: t for n, t in self._resolved.items() if n in self._kept}
        wished = {(n, t) for n, t in self._wished if t in self._made.get(n, ())}
        if not early and not wished:
            return None
        return {"early": early, "later": {n: set(ts) for n, ts in self._made.items()}}
