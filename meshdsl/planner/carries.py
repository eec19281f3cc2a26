"""Where a loop's carry enters its step, and leaves it: one choice, seen at both ends of the step.

An ``md.scan`` step takes its carry in one placement and must give it back in the same one for
the next step (:mod:`meshdsl.ops.loop`): where the step's ops leave it elsewhere, it is relaid
there at the end of every step. Each strategy of a loop's node enters the carry somewhere: the
rules' own where the layout places it, or where the step's own choices leave it (the loop traced
again so); a candidate where its entry put it. Its slices of the stacked
values enter as its entry placed them. So in the graph, for a live loop:

* each value its step reads from the loop (its carry's and its slices' named leaves) is a
  **result of the loop's node**, given where that strategy has the step read it (the relay of
  the carry before the loop, from where the loop was given it, is an edge: once; the loop's own
  cost leaves it out, :mod:`meshdsl.planner.record`);
* per carry leaf, a node **after the step's ops** needs the value the step returns where that
  strategy entered it (the relay at the end of each step, as often as the step runs), tied to
  the loop's node (:meth:`meshdsl.planner.graph.Graph.tie`): the two take the same strategy.

A trace following the plan enters each carry where its loop's chosen strategy does
(:attr:`meshdsl.planner.plan.Plan.carries`), and relays it back there at the end of each step.
"""

from __future__ import annotations

import dataclasses

from .graph import Node, Strategy

__all__ = ["Loop", "loops_of", "entering", "leave", "entries"]


@dataclasses.dataclass(frozen=True)
class Loop:
    """Loop op ``loop``: ``values`` the ids of what its step reads from it (its carry's named
    leaves, then its slices'), ``outs`` per carry leaf (index among the named leaves, among all
    leaves, the value id its step returns)."""

    loop: int
    values: tuple
    outs: tuple


def loops_of(recording) -> dict:
    """Loop op number -> :class:`Loop`, as the planning trace met each."""
    steps = dict(recording.steps)
    outs: dict = {}
    for v, k, named, leaf in recording.carry_outs:
        outs.setdefault(k, {})[named] = (leaf, v)
    return {k: Loop(k, values, tuple((n, *outs[k][n]) for n in sorted(outs.get(k, {}))))
            for k, values in steps.items()}


def entering(strategies: list, loop: Loop | None, held) -> tuple:
    """``(strategies, values)``: an op node's ``strategies`` and, where it is ``loop``'s, each
    also giving what its step reads where it reads it, and those values (``held(v, pl)``: the
    bytes a value holds in a placement); no values where it is no loop's, or a strategy does not
    say (its node then gives as its rule's records say, nothing more)."""
    if loop is None or len(set(loop.values)) != len(loop.values) or any(
            s.detail is None or len(s.detail.stepped) != len(loop.values) for s in strategies):
        return strategies, ()
    return [dataclasses.replace(s, gives=s.gives + s.detail.stepped, memory=s.memory + tuple(
        held(v, pl) for v, pl in zip(loop.values, s.detail.stepped)) if s.memory else ())
            for s in strategies], loop.values


def leave(graph, loop_node: int, loop: Loop) -> None:
    """A node per carry leaf of the loop at ``loop_node`` (after its step's ops) needing the value
    its step returns where the loop's strategy entered it, tied to the loop's node."""
    strategies = graph.nodes[loop_node].strategies
    for n, leaf, v in loop.outs:
        if v in graph.producer:
            node = graph.add(Node(f"carry {leaf} of loop {loop.loop} leaves its step", [v], [],
                                  [Strategy((s.detail.stepped[n],), (), label="carried") for s in strategies]))
            graph.tie(loop_node, node)


def entries(graph, looped: dict, choice) -> dict:
    """Loop op number -> {carry leaf: axes per dim it enters with} under the plan ``choice``
    (``looped``: loop node -> its :class:`Loop`)."""
    out: dict = {}
    for node, loop in looped.items():
        found = graph.nodes[node].strategies[choice[node]].detail
        for n, leaf, _ in loop.outs:
            out.setdefault(loop.loop, {})[leaf] = found.stepped[n].axes
    return out
