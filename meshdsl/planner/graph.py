"""The program as the planner sees it: values, ops, and each op's candidate placements.

A :class:`Graph` is what the shape-only planning trace records (:mod:`meshdsl.planner.record`):

* a **value** is one NamedArray an op made (or an input): it has one producer slot and any
  number of consumer slots;
* a **node** is one named op (or an input, an output, an ``x.array`` read) with its operand
  value ids, its result value ids, and its **strategies**: the placements it may compute in;
* a :class:`Strategy` says, per operand slot, the placement the operand must be *in* (a
  placement key, hashable), per result slot the placement the result comes out in, and the
  op's *own* bytes (what it moves itself beyond bringing its operands there: the statistics of a
  softmax over a split dim, the candidates of a top_k), forward and backward, times executions.

Moving a value from where its producer leaves it to where a consumer needs it is a **relay**,
priced by ``Graph.relay(value, src, dst)`` (the relayout's bytes, forward and the backward it
implies). One relay of a value to one placement is shared by every consumer reading it there
(the rewriter caches relayouts per value and target), so the cost of a plan is

    sum over nodes of own bytes
  + sum over values v, over the distinct placements T its chosen consumers need, of
        relay(v, placement its producer gives, T)

  + sum over **shared copies** (a strategy reading a copy another op's strategy made: a gathered
    or cast operand both read) of the copy's bytes, where the maker takes a strategy not making it

and, with the time objective, the compute of each node's strategy (``Strategy.work``: its
seconds as the bytes the mesh's slowest link moves in that time, so that one sum prices the
step); :func:`meshdsl.planner.solve.solve` minimises it over one strategy per node. Strategy 0 of
each node is its default (the rule's own choice): a tie keeps it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable

__all__ = ["Strategy", "Node", "Graph", "SharedCopy", "CommonCopy"]


@dataclasses.dataclass(frozen=True)
class Strategy:
    """One way an op may compute: operand placements needed, result placements given, own cost."""

    needs: tuple           # per operand slot: the placement key that operand must be in
    gives: tuple           # per result slot: the placement key the result comes out in
    cost: float = 0.0      # own bytes per device, forward + backward, times executions
    label: str = ""        # what it computes, for reports ("[batch:data d_ff:model]")
    detail: object = dataclasses.field(default=None, compare=False)   # what the emitter needs
    work: float = 0.0      # its compute per device, as the bytes the reference link moves meanwhile
    own_time: float | None = None   # its own collectives' seconds on their links, as bytes of the
    #                                 reference link (None: its bytes, the bytes objective)
    memory: tuple = ()     # per result slot: the bytes per device the result holds
    kept: float = 0.0      # bytes per device it holds beyond operands and results, to the end
    #                        (residuals the backward pass reads) or, undifferentiated, while it runs
    working: float = 0.0   # bytes per device it holds beyond operands and results while it runs
    departures: int = 0    # candidates it takes at its rule's decision points (beyond its entry):
    #                        a tie goes to the plan departing least from the rules' own choices

    @property
    def tie(self) -> int:
        """How far it departs from its node's default, for breaking ties (the default: 0)."""
        return 1 + self.departures

    @property
    def time(self) -> float:
        """Its own collectives in the objective's units (its bytes where time is not priced)."""
        return self.cost if self.own_time is None else self.own_time

    def less(self, nbytes: float) -> Strategy:
        """This strategy with ``nbytes`` of its own cost priced elsewhere (a copy paid once for
        several ops, or only under other ops' strategies), in both objectives' units."""
        return dataclasses.replace(self, cost=max(self.cost - nbytes, 0.0),
                                   own_time=None if self.own_time is None else max(self.own_time - nbytes, 0.0))


@dataclasses.dataclass
class Node:
    """One op of the program with its candidate strategies (strategies[0]: the default)."""

    name: str
    operands: list
    results: list
    strategies: list

    def __post_init__(self):
        if not self.strategies:
            raise ValueError(f"{self.name}: a node needs at least one strategy")
        for s in self.strategies:
            if len(s.needs) != len(self.operands) or len(s.gives) != len(self.results):
                raise ValueError(f"{self.name}: strategy {s.label or s} has {len(s.needs)} needs and "
                                 f"{len(s.gives)} gives for {len(self.operands)} operands and "
                                 f"{len(self.results)} results")


@dataclasses.dataclass(frozen=True)
class SharedCopy:
    """Node ``reader``'s strategy ``strategy`` reads a copy node ``maker`` makes under its
    strategies ``makers`` only: under any other, the reader makes it (``cost`` bytes)."""

    reader: int
    strategy: int
    maker: int
    makers: frozenset
    cost: float


@dataclasses.dataclass(frozen=True)
class CommonCopy:
    """A copy (a relayout or cast of one value) that strategies of several nodes make, each in
    its own sandbox (``members``: (node, strategy) pairs): made once where any of them is taken,
    for ``cost`` (which their own costs leave out)."""

    cost: float
    members: frozenset


class Graph:
    """Nodes in program order; ``relay(value, src, dst)`` prices moving a value between keys."""

    def __init__(self, relay: Callable[[int, Hashable, Hashable], float],
                 relay_time: Callable[[int, Hashable, Hashable], float] | None = None):
        self.nodes: list[Node] = []
        self.relay_fn = relay
        self.relay_time_fn = relay_time
        self.producer: dict = {}    # value id -> (node index, result slot)
        self.consumers: dict = {}   # value id -> [(node index, operand slot)]
        self.shared: list[SharedCopy] = []
        self.common: list[CommonCopy] = []
        self._relay_cache: dict = {}
        self._time_cache: dict = {}
        self.rate = 0.0             # bytes per second of the link time is priced at (0: bytes alone)
        self.saved: set = set()     # value ids the backward pass reads: live to the program's end
        self.ties: list = []        # (node, node) taking the same strategy (a loop's carry entering and leaving)

    def add(self, node: Node) -> int:
        """Append ``node`` (its operands must have producers already); its index."""
        k = len(self.nodes)
        for slot, v in enumerate(node.operands):
            if v not in self.producer:
                raise ValueError(f"{node.name}: operand {slot} (value {v}) has no producer")
            self.consumers.setdefault(v, []).append((k, slot))
        for slot, v in enumerate(node.results):
            if v in self.producer:
                raise ValueError(f"{node.name}: value {v} is produced twice")
            self.producer[v] = (k, slot)
        self.nodes.append(node)
        return k

    def tie(self, a: int, b: int) -> None:
        """Nodes ``a`` and ``b`` (as many strategies each) take the same strategy: one choice
        seen at two points of the program (where a loop's carry enters a step, and where the
        step leaves it for the next)."""
        if len(self.nodes[a].strategies) != len(self.nodes[b].strategies):
            raise ValueError(f"{self.nodes[a].name} and {self.nodes[b].name}: tied nodes need as many strategies")
        self.ties.append((a, b))

    def relay(self, value, src, dst) -> float:
        """Bytes of bringing ``value`` from placement ``src`` to ``dst`` (0 when equal), cached."""
        if src == dst:
            return 0.0
        key = (value, src, dst)
        hit = self._relay_cache.get(key)
        if hit is None:
            hit = self._relay_cache[key] = float(self.relay_fn(value, src, dst))
        return hit

    def relay_cost(self, value, src, dst) -> float:
        """What relaying ``value`` from ``src`` to ``dst`` adds to the objective: its bytes, or
        under the time objective its collectives' seconds on their links (bandwidth and latency),
        as bytes of the reference link (``relay_time``), cached."""
        if self.relay_time_fn is None or src == dst:
            return self.relay(value, src, dst)
        key = (value, src, dst)
        hit = self._time_cache.get(key)
        if hit is None:
            hit = self._time_cache[key] = float(self.relay_time_fn(value, src, dst))
        return hit

    def cost(self, choice) -> float:
        """The objective of the plan picking strategy ``choice[k]`` for node ``k``: its bytes or,
        under the time objective, its collectives' and compute's seconds (as bytes of the
        reference link)."""
        return self._total(choice, self.relay_cost, lambda s: s.time + s.work)

    def moved(self, choice) -> float:
        """Bytes the plan picking strategy ``choice[k]`` for node ``k`` moves per device."""
        return self._total(choice, self.relay, lambda s: s.cost)

    def _total(self, choice, relay, own) -> float:
        """Each node's ``own(strategy)``, each relay a chosen consumer needs priced by ``relay``
        (once per value and placement), and the shared copies a reader makes itself."""
        total = sum(own(self.nodes[k].strategies[s]) for k, s in enumerate(choice))
        for v, (p, slot) in self.producer.items():
            src = self.nodes[p].strategies[choice[p]].gives[slot]
            wanted = {self.nodes[c].strategies[choice[c]].needs[j] for c, j in self.consumers.get(v, ())}
            total += sum(relay(v, src, t) for t in wanted)
        return total + sum(c.cost for c in self.shared if choice[c.reader] == c.strategy and choice[c.maker] not in c.makers) \
            + sum(c.cost for c in self.common if any(choice[k] == s for k, s in c.members))

    def live_range(self, v) -> tuple[int, int]:
        """``(first, last)`` node index where value ``v`` is held: from its producer to its last
        consumer, or to the end of the program where the backward pass reads it."""
        p = self.producer[v][0]
        if v in self.saved:
            return p, len(self.nodes) - 1
        return p, max([p] + [c for c, _ in self.consumers.get(v, ())])

    def holdings(self) -> list:
        """What the program holds, as the memory model sees it: ``(first, last, node, sizes)`` for
        every value (held from its producer to its last reader, to the end where the backward
        pass reads it; ``sizes``: its bytes per device under each strategy of its producer
        ``node``) and for what each op's strategies hold beyond (residuals to the end where it is
        differentiated, working buffers while it runs). :meth:`memory` and the solver's memory
        rows (:mod:`meshdsl.planner.solve`) both read it."""
        out = []
        for v, (p, slot) in self.producer.items():
            sizes = [s.memory[slot] if s.memory else 0.0 for s in self.nodes[p].strategies]
            if any(sizes):
                out.append((*self.live_range(v), p, sizes))
        for p, node in enumerate(self.nodes):
            kept, working = [s.kept for s in node.strategies], [s.working for s in node.strategies]
            if any(kept):
                out.append((p, len(self.nodes) - 1, p, kept))
            if any(working):
                out.append((p, p, p, working))
        return out

    def memory(self, choice) -> float:
        """Per-device bytes the plan ``choice`` holds at its peak, as the graph sees it
        (:meth:`holdings`, each in the strategy its node takes)."""
        level = [0.0] * (len(self.nodes) + 1)
        for first, last, p, sizes in self.holdings():
            level[first] += sizes[choice[p]]
            level[last + 1] -= sizes[choice[p]]
        peak = held = 0.0
        for x in level[:-1]:
            held += x
            peak = max(peak, held)
        return peak

    def components(self) -> list[list[int]]:
        """Node indices of each connected part (nodes joined by a value), in program order."""
        parent = list(range(len(self.nodes)))

        def find(a):
            while parent[a] != a:
                parent[a] = parent[parent[a]]
                a = parent[a]
            return a

        for v, (p, _) in self.producer.items():
            for c, _ in self.consumers.get(v, ()):
                parent[find(c)] = find(p)
        for c in self.shared:
            parent[find(c.reader)] = find(c.maker)
        for c in self.common:
            first = min(k for k, _ in c.members)
            for k, _ in c.members:
                parent[find(k)] = find(first)
        for a, b in self.ties:
            parent[find(b)] = find(a)
        groups: dict = {}
        for k in range(len(self.nodes)):
            groups.setdefault(find(k), []).append(k)
        return list(groups.values())
