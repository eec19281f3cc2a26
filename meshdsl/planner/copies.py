"""Copies and casts: one op makes them, others read them, and the plan decides who pays.

A relayout or a cast an op's rule makes in the planning trace (``Found.made``) is a copy a later
op may read for free - where the maker's chosen strategy still makes it. This module prices
that sharing in the graph (:mod:`meshdsl.planner.graph`'s ``SharedCopy`` and ``CommonCopy``):

* :func:`share_copies`: a copy a reader reads is free only where its maker takes a strategy
  making it; a value the reader reads typed varying is cast there where its type's deciding op
  leaves it otherwise;
* :func:`common_copies`: a copy strategies of several ops make is paid once;
* :func:`follow_types`: a cast an op makes because another operand is typed varying is paid only
  where that operand's producer leaves it typed so.

**The casts of :func:`follow_types`.** An elementwise op reading one operand typed varying over
a mesh axis (a value the planning trace computed from a block, or summed there) and another
typed invariant (a parameter) casts the second to vary too, and its gradient's cotangent is
summed over the axis in the backward pass. A strategy of the op recorded in the planning trace
carries that cast in its own cost. But where the varying operand's producer takes a strategy
that leaves it invariant (its sum reduced where it is made), the op casts nothing: ``where(p,
einsum(v, v, x), w)`` with ``x``'s summed dim split costs the cast of ``w`` (its whole size,
backward) after the default einsum and nothing after one summing ``x`` first and reducing that.

:func:`follow_types` moves each such cast out of the strategy's own cost into a
:class:`~meshdsl.planner.graph.SharedCopy` paid unless the producer takes a strategy leaving the
operand invariant over the cast's axes. Only casts over axes the strategy neither splits nor
keeps pending (those it makes whatever its operands' types), caused by one operand, whose
producer has such a strategy, and made or read by no other op (a copy several ops make is a
:class:`~meshdsl.planner.graph.CommonCopy` already; one another op reads - a tied embedding's
table cast by its lookup and read so by the logits - is needed there whatever the lookup does).
"""

from __future__ import annotations

import collections

from .graph import CommonCopy, Graph, SharedCopy

__all__ = ["share_copies", "common_copies", "follow_types", "cast_axes"]


def _varies(strategy, slot: int, axes: frozenset) -> bool:
    """Does ``strategy`` give its result ``slot`` typed varying over all of ``axes``?"""
    detail = strategy.detail
    typed = detail.vary[slot] if detail is not None and slot < len(detail.vary) else frozenset()
    return axes <= typed | strategy.gives[slot].used_axes()


def cast_axes(copy) -> frozenset | None:
    """The mesh axes a copy (``(source id, key)``, :meth:`ExplicitContext.cached`'s) casts its
    source to vary over; ``None`` where it is no cast (a relayout)."""
    key = copy[1]
    return frozenset(key[1]) if isinstance(key, tuple) and key and key[0] == "cast" else None


def _casts(strategy):
    """``(copy, axes, bytes)`` of each cast the strategy makes over axes it does not place by."""
    detail = strategy.detail
    placed = frozenset().union(*(p.used_axes() for p in (*detail.entry, *detail.gives) if p is not None))
    for copy, cost in detail.made:
        axes = cast_axes(copy)
        if cost > 0 and axes is not None and not axes & placed:
            yield copy, axes, cost


def follow_types(graph: Graph) -> None:
    """Apply the module doc's rule to every node of ``graph`` (after its common copies)."""
    users = collections.defaultdict(set)   # copy -> the nodes making or reading it
    for k, node in enumerate(graph.nodes):
        for st in node.strategies:
            if st.detail is not None:
                for copy in (*st.detail.makes, *(c for _, _, c in st.detail.reads)):
                    users[copy].add(k)
    for k, node in enumerate(graph.nodes):
        for s, st in enumerate(node.strategies):
            if st.detail is None or not st.detail.made:
                continue
            moved = 0.0
            for copy, axes, cost in _casts(st):
                causes = [graph.producer[v] for v in node.operands if v in graph.producer
                          and _varies(graph.nodes[graph.producer[v][0]].strategies[0], graph.producer[v][1], axes)]
                if len(users[copy]) > 1 or len(causes) != 1:
                    continue
                p, slot = causes[0]
                invariant = frozenset(i for i, other in enumerate(graph.nodes[p].strategies)
                                      if not _varies(other, slot, axes))
                if invariant:
                    graph.shared.append(SharedCopy(k, s, p, invariant, cost))
                    moved += cost
            if moved:
                node.strategies[s] = st.less(moved)


def share_copies(graph, node_of, found) -> None:
    """The copies the strategies ``found`` of the node just added read from a live op: free
    only where that op takes a strategy making them (it may take one that does not: a cast its
    default makes and the plan's candidate leaves out). A reader computing from the maker's
    results follows the maker's choice (an op reading what an op left uncast computed is not
    cast either: :meth:`meshdsl.rewrite.explicit.ExplicitContext.vary`): its copy stays free -
    unless the copy is a cast over axes the reader itself splits over, which it needs whatever
    the maker took (a maker computing replicated and taking its block leaves its result split)."""
    reader = len(graph.nodes) - 1
    for s, f in enumerate(found):
        for maker, cost, copy in f.reads:
            if copy[0] == "varies" and cost:
                _typed_varying(graph, reader, s, copy, cost)
            if maker not in node_of or not cost:
                continue
            if _reads_from(graph, reader, node_of[maker]) and not _cast_over_own_split(f, copy):
                continue
            m = node_of[maker]
            makers = frozenset(i for i, st in enumerate(graph.nodes[m].strategies) if copy in st.detail.makes)
            if len(makers) < len(graph.nodes[m].strategies):
                graph.shared.append(SharedCopy(reader, s, m, makers, cost))


def _typed_varying(graph, reader, s, copy, cost) -> None:
    """Strategy ``s`` of node ``reader`` reads a value as typed varying over mesh axes (``copy``:
    ``("varies", value, axes)``), as the planning trace leaves it: where the op deciding that type
    takes a strategy leaving it otherwise (a parameter left unwidened), the reader casts it, for
    ``cost`` (a :class:`~meshdsl.planner.graph.SharedCopy` that op's varying strategies make). The
    deciding op is the value's producer, or - where every strategy of the producer varies because
    an operand does (an elementwise op follows its operands' types) - that operand's, back along
    the one value whose type it follows (where several make it vary, the reader pays the cast)."""
    _, v, axes = copy

    def varies(st, slot):
        return st.detail is not None and slot < len(st.detail.vary) and axes <= st.detail.vary[slot] | st.gives[slot].used_axes()

    seen = set()
    while v in graph.producer and v not in seen:
        seen.add(v)
        p, slot = graph.producer[v]
        strategies = graph.nodes[p].strategies
        makers = frozenset(i for i, st in enumerate(strategies) if varies(st, slot))
        if len(makers) < len(strategies):
            graph.shared.append(SharedCopy(reader, s, p, makers, cost))
            return
        if strategies[0].gives[slot].used_axes() & axes:
            return   # split or pending there: varying by its placement, whatever it reads
        follows = {w for w in graph.nodes[p].operands
                   if varies(graph.nodes[graph.producer[w][0]].strategies[0], graph.producer[w][1])}
        if len(follows) != 1:   # several operands make it vary: the reader pays the cast
            graph.shared.append(SharedCopy(reader, s, p, frozenset(), cost))
            return
        v = follows.pop()


def common_copies(graph, plain) -> None:
    """Copies that strategies of several nodes make, each in its own sandbox (one value cast or
    relaid the same way: a parameter cast to vary over the axes two ops' candidates both split
    over): paid once where any of those strategies is taken (a
    :class:`~meshdsl.planner.graph.CommonCopy`), not by each - the emitted program makes the copy
    once and the later op reads it. Only ops of ``plain`` (graph nodes neither a loop nor in a
    loop's body, whose copies a loop's candidate counts again as its own) take part. Under the
    time objective the copy is priced as its bytes on the reference link (its axes are not kept)."""
    makers: dict = {}
    for k, node in enumerate(graph.nodes):
        for s, st in enumerate(node.strategies if k in plain else ()):
            for copy, cost in getattr(st.detail, "made", ()):
                if cost > 0:
                    makers.setdefault((copy, cost), set()).add((k, s))
    for (_, cost), members in makers.items():
        if len({k for k, _ in members}) < 2:
            continue
        for k, s in members:
            graph.nodes[k].strategies[s] = graph.nodes[k].strategies[s].less(cost)
        graph.common.append(CommonCopy(cost, frozenset(members)))


def _cast_over_own_split(found, copy) -> bool:
    """Is ``copy`` (``(source id, key)``) a cast to varying over mesh axes that strategy
    ``found`` splits its operands or results over?"""
    axes = cast_axes(copy)
    split = {a for pl in (*found.entry, *found.gives) if pl is not None for axes_ in pl.axes for a in axes_}
    return axes is not None and axes <= split


def _reads_from(graph, reader: int, maker: int) -> bool:
    """Does node ``reader`` compute from a result of node ``maker`` (through any ops between)?"""
    stack, seen = [reader], set()
    while stack:
        k = stack.pop()
        for v in graph.nodes[k].operands:
            p = graph.producer[v][0]
            if p == maker:
                return True
            if p > maker and p not in seen:
                seen.add(p)
                stack.append(p)
    return False
