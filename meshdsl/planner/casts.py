"""Casts an op makes because an operand's type varies: paid only where that operand's producer
takes a strategy leaving it typed so.

An elementwise op reading one operand typed varying over a mesh axis (a value the planning
trace computed from a block, or summed there) and another typed invariant (a parameter) casts
the second to vary too, and its gradient's cotangent is summed over the axis in the backward
pass. A strategy of the op recorded in the planning trace carries that cast in its own cost.
But where the varying operand's producer takes a strategy that leaves it invariant (its sum
reduced where it is made), the op casts nothing: ``where(p, einsum(v, v, x), w)`` with ``x``'s
summed dim split costs the cast of ``w`` (its whole size, backward) after the default einsum and
nothing after one summing ``x`` first and reducing that.

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
import dataclasses

from .graph import Graph, SharedCopy

__all__ = ["follow_types"]


def _varies(strategy, slot: int, axes: frozenset) -> bool:
    """Does ``strategy`` give its result ``slot`` typed varying over all of ``axes``?"""
    detail = strategy.detail
    typed = detail.vary[slot] if detail is not None and detail.vary else frozenset()
    return axes <= typed | strategy.gives[slot].used_axes()


def _casts(strategy):
    """``(copy, axes, bytes)`` of each cast the strategy makes over axes it does not place by."""
    detail = strategy.detail
    placed = frozenset().union(*(p.used_axes() for p in (*detail.entry, *detail.gives) if p is not None))
    for copy, cost in detail.made:
        key = copy[1]
        if cost > 0 and isinstance(key, tuple) and key and key[0] == "cast" and not frozenset(key[1]) & placed:
            yield copy, frozenset(key[1]), cost


def follow_types(graph: Graph) -> None:
    """Apply the module doc's rule to every node of ``graph`` (after its common copies)."""
    makers = collections.defaultdict(set)   # copy -> the nodes making or reading it
    for k, node in enumerate(graph.nodes):
        for st in node.strategies:
            for copy in (st.detail.makes if st.detail is not None else ()):
                makers[copy].add(k)
            for _, _, copy in (st.detail.reads if st.detail is not None else ()):
                makers[copy].add(k)
    for k, node in enumerate(graph.nodes):
        for s, st in enumerate(node.strategies):
            if st.detail is None or not st.detail.made:
                continue
            moved = 0.0
            for copy, axes, cost in _casts(st):
                causes = [graph.producer[v] for v in node.operands if v in graph.producer
                          and _varies(graph.nodes[graph.producer[v][0]].strategies[0], graph.producer[v][1], axes)]
                if len(makers[copy]) > 1 or len(causes) != 1:
                    continue
                p, slot = causes[0]
                invariant = frozenset(i for i, other in enumerate(graph.nodes[p].strategies)
                                      if not _varies(other, slot, axes))
                if invariant:
                    graph.shared.append(SharedCopy(k, s, p, invariant, cost))
                    moved += cost
            if moved:
                node.strategies[s] = dataclasses.replace(
                    st, cost=max(st.cost - moved, 0.0),
                    own_time=None if st.own_time is None else max(st.own_time - moved, 0.0))
