"""The solver: one strategy per node minimising the program's bytes, exactly.

An integer linear program over a :class:`~meshdsl.planner.graph.Graph`, solved by HiGHS
(``scipy.optimize.milp``), as Alpa does at the HLO level; ours works on named ops and shares a
relay between the consumers that read a value in the same placement:

    x[k, s]  in {0, 1}   node k computes by strategy s            (one per node)
    e[v, c, g, T] >= 0   consumer slot c reads value v in placement T while its producer gives
                         v in g: for each g, sum over T of e = the x of the producer's
                         strategies giving g; for each T, sum over g of e = the x of c's
                         strategies needing T (the pair's joint choice: Alpa's edge variables)
    y[v, g, T] in [0, 1] v is relaid from g to T: y >= e[v, c, g, T] for every consumer slot c
                         (one relay shared by every consumer needing T)

    z[c]     in [0, 1]   a shared copy's reader makes it: z >= x[reader, s] - sum of x[maker, s']
                         over the maker's strategies s' that make it
    w[c]     in [0, 1]   a copy strategies of several nodes make is made: w >= x[k, s] for each

    x[a, s] = x[b, s]    nodes tied to one strategy (a loop's node and the node after its step
                         that needs the step's carry where the loop entered it)

    minimise  sum x * own bytes  +  sum y * relay(v, g, T)  +  sum (z + w) * copy bytes

A relay is shared by every consumer needing the same placement. With ``x`` integral, ``e`` is
the product of the producer's and the consumer's choice and ``y`` the largest of them, so the
optimum of the program is the optimum of the plan. The edge variables tie each consumer's
placement to the producer's: without them (``y[v, T, s] <= x[producer, s]``, summed over ``s``
to cover each consumer) the relaxation mixes strategies half and half, each read relaid from
whichever half is cheaper, and HiGHS could not close the gap: a tiny Switch model under expert
parallelism and ZeRO-3, time objective, hit the 60 s limit with a 9% gap (and a plan 2,160
units over the optimum); with them it solves exactly in 0.13 s.
Ties go to the default strategies (index 0: the rule's own choice): each op off its default
costs a ten-thousandth of a byte, and as much again per candidate it takes at its rule's decision
points (``Strategy.departures``), so a program where nothing can be gained lowers as the rules
alone would, and of two plans of equal cost the one departing less from the rules is taken. (Memory is not a tie-break yet: the strategies do not price it.)

With a memory budget (bytes per device), Alpa's constraint at each point of the program:

    sum over values v live at node t, over their producer's strategies s, of
        x[producer, s] * bytes per device v holds under s
    + what each op's strategy holds beyond its operands and results (an attention's gathered
      keys kept for the backward pass, a ring's chunks while it runs)   <=  budget

(:meth:`~meshdsl.planner.graph.Graph.live_range`: from its producer to its last reader, to the
end where the backward pass reads it); the whole graph is then one part.

Parts of the graph no value joins are solved apart; a part whose nodes all have one strategy is
not solved at all. :func:`solve_exact` enumerates every plan of a small graph (the tests' check
of the ILP).
"""

from __future__ import annotations

import dataclasses
import itertools
import time

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_array

from .graph import Graph

__all__ = ["Solution", "solve", "solve_exact", "NoPlanFits"]


@dataclasses.dataclass
class Solution:
    """The strategy index per node, the plan's bytes, and how it was found."""

    choice: list
    bytes: float
    seconds: float = 0.0
    variables: int = 0
    optimal: bool = True

    def alternatives(self, graph: Graph, k: int) -> list:
        """``(strategy index, bytes of the plan)`` for node ``k``'s other strategies, every other
        node as chosen: what the next-best placement of this op alone would have cost."""
        out = []
        for s in range(len(graph.nodes[k].strategies)):
            if s != self.choice[k]:
                other = list(self.choice)
                for a, b in graph.ties:   # a tied node's alternative is its partner's too
                    if k in (a, b):
                        other[a] = other[b] = s
                other[k] = s
                out.append((s, graph.cost(other)))
        return sorted(out, key=lambda t: t[1])


_TIE = 1e-4   # bytes charged per departure from the rules' choices (Strategy.tie): a tie keeps
#               them; far below the smallest difference in bytes two plans can have (half a byte)


class NoPlanFits(Exception):
    """No plan of the graph holds at most the memory budget (``least``: the least peak a plan has)."""

    def __init__(self, least: float):
        super().__init__(least)
        self.least = least


def solve(graph: Graph, *, time_limit: float = 20.0, memory_budget: float | None = None) -> Solution:
    """The plan of least cost (then most defaults) for ``graph`` holding at most ``memory_budget``
    bytes per device at every point (None: no limit); ``optimal`` is False where the solver ran
    out of ``time_limit`` (seconds per part) and kept the best plan it had, or the defaults.

    Raises:
        NoPlanFits: no plan holds at most ``memory_budget``.
    """
    start = time.perf_counter()
    choice = [0] * len(graph.nodes)
    variables, optimal = 0, True
    parts = graph.components() if memory_budget is None else [list(range(len(graph.nodes)))]
    for part in parts:
        if all(len(graph.nodes[k].strategies) == 1 for k in part) and memory_budget is None:
            continue
        picked, n, exact = _solve_part(graph, part, time_limit, memory_budget)
        variables += n
        optimal = optimal and exact
        for k, s in picked.items():
            choice[k] = s
    return Solution(choice, graph.cost(choice), time.perf_counter() - start,
                    variables, optimal)


def solve_exact(graph: Graph, memory_budget: float | None = None) -> Solution:
    """Every plan enumerated (small graphs only), least cost then most defaults, as :func:`solve`."""
    start = time.perf_counter()
    best = None
    for choice in itertools.product(*(range(len(n.strategies)) for n in graph.nodes)):
        if any(choice[a] != choice[b] for a, b in graph.ties) or \
                memory_budget is not None and graph.memory(choice) > memory_budget:
            continue
        key = (round(graph.cost(choice), 6), sum(graph.nodes[k].strategies[s].tie for k, s in enumerate(choice) if s))
        if best is None or key < best[0]:
            best = (key, list(choice))
    if best is None:
        raise NoPlanFits(min(graph.memory(c) for c in itertools.product(*(range(len(n.strategies)) for n in graph.nodes))))
    choice = best[1]
    return Solution(choice, graph.cost(choice), time.perf_counter() - start)


class _Program:
    """The ILP of one part of the graph: variables, objective terms, constraint rows."""

    def __init__(self):
        self.n = 0
        self.bytes: list = []      # objective coefficient per variable (bytes)
        self.integer: list = []
        self.upper: list = []
        self.rows: list = []       # (coefficients {var: c}, lower, upper)

    def var(self, cost=0.0, integer=True, upper=1.0) -> int:
        self.bytes.append(cost)
        self.integer.append(1 if integer else 0)
        self.upper.append(upper)
        self.n += 1
        return self.n - 1

    def row(self, coefs: dict, lo: float, hi: float) -> None:
        self.rows.append((coefs, lo, hi))

    def run(self, objective, time_limit=20.0):
        rows = self.rows
        r, c, d = [], [], []
        for i, (coefs, _, _) in enumerate(rows):
            for j, value in coefs.items():
                r.append(i)
                c.append(j)
                d.append(value)
        a = coo_array((d, (r, c)), shape=(len(rows), self.n)).tocsr()
        constraint = LinearConstraint(a, [lo for _, lo, _ in rows], [hi for _, _, hi in rows])
        res = milp(np.asarray(objective, float), constraints=constraint, integrality=np.asarray(self.integer),
                   bounds=Bounds(np.zeros(self.n), np.asarray(self.upper, float)),
                   options={"time_limit": time_limit, "mip_rel_gap": 0.0})
        return res


def _solve_part(graph: Graph, part: list, time_limit: float, memory_budget: float | None = None):
    """``({node: strategy}, variables, optimal)`` for one connected part; the defaults when the
    solver finds no plan in ``time_limit`` seconds."""
    prog = _Program()
    x = {}
    for k in part:
        node = graph.nodes[k]
        ids = [prog.var(s.time + s.work + (_TIE * s.tie if i else 0.0)) for i, s in enumerate(node.strategies)]
        x[k] = ids
        prog.row({i: 1.0 for i in ids}, 1.0, 1.0)
    members = set(part)
    for v, (p, slot) in graph.producer.items():
        if p in members:
            _relay_terms(graph, prog, x, v, p, slot)
    for c in graph.shared:   # z >= x[reader][strategy] - x[maker][any strategy making the copy]
        if c.reader in members:
            z = prog.var(c.cost, integer=False, upper=1.0)
            prog.row({z: 1.0, x[c.reader][c.strategy]: -1.0, **{x[c.maker][s]: 1.0 for s in c.makers}}, 0.0, np.inf)
    for c in graph.common:   # w >= x[k][s] for each (node, strategy) making the copy: made once
        if any(k in members for k, _ in c.members):
            w = prog.var(c.cost, integer=False, upper=1.0)
            for k, s in c.members:
                prog.row({w: 1.0, x[k][s]: -1.0}, 0.0, np.inf)
    _tie_rows(graph, prog, x)
    for coefs in _memory_rows(graph, x, memory_budget) if memory_budget is not None else ():
        prog.row(coefs, -np.inf, memory_budget)
    res = prog.run(prog.bytes, time_limit=time_limit)
    if res.x is None:
        if memory_budget is not None and res.status == 2:   # infeasible: no plan fits
            raise NoPlanFits(_least_memory(graph))
        return {k: 0 for k in part}, prog.n, False
    picked = {k: int(np.argmax([res.x[i] for i in ids])) for k, ids in x.items()}
    return picked, prog.n, bool(res.status == 0)


def _tie_rows(graph: Graph, prog: _Program, x: dict) -> None:
    """x[a][s] = x[b][s] for each pair of tied nodes (``x``: node -> its strategies' variables)."""
    for a, b in graph.ties:
        if a in x and b in x:
            for xa, xb in zip(x[a], x[b]):
                prog.row({xa: 1.0, xb: -1.0}, 0.0, 0.0)


def _relay_terms(graph: Graph, prog: _Program, x: dict, v, p: int, slot: int) -> None:
    """Variables and rows pricing the relays of value ``v`` (made by node ``p``'s result
    ``slot``): an edge variable per consumer slot, source and target placement, and a relay
    variable per source and target, shared by the consumers (the module doc)."""
    sources: dict = {}   # placement the producer gives -> its strategies giving it
    for s, strat in enumerate(graph.nodes[p].strategies):
        sources.setdefault(strat.gives[slot], []).append(s)
    readers = []         # per consumer slot: (node, {placement needed: its strategies needing it})
    for c, j in graph.consumers.get(v, ()):
        needed: dict = {}
        for s, strat in enumerate(graph.nodes[c].strategies):
            needed.setdefault(strat.needs[j], []).append(s)
        readers.append((c, needed))
    costs = {(g, t): graph.relay_cost(v, g, t) for g in sources for _, needed in readers for t in needed}
    if not any(costs.values()):
        return
    relays = {pair: prog.var(cost, integer=False, upper=1.0) for pair, cost in costs.items()
              if cost and cost != np.inf}
    for c, needed in readers:
        e = {(g, t): prog.var(0.0, integer=False, upper=0.0 if costs[g, t] == np.inf else 1.0)
             for g in sources for t in needed}
        for g, strategies in sources.items():
            prog.row({**{e[g, t]: 1.0 for t in needed}, **{x[p][s]: -1.0 for s in strategies}}, 0.0, 0.0)
        for t, strategies in needed.items():
            prog.row({**{e[g, t]: 1.0 for g in sources}, **{x[c][s]: -1.0 for s in strategies}}, 0.0, 0.0)
        for pair, y in relays.items():
            if pair[1] in needed:
                prog.row({y: 1.0, e[pair]: -1.0}, 0.0, np.inf)


def _memory_rows(graph: Graph, x: dict, budget: float) -> list:
    """The coefficients of one row per point of the program where what is held may exceed
    ``budget`` (distinct rows only): the bytes per device of each holding live there
    (:meth:`Graph.holdings`) under each strategy of its node (``x``: node -> its strategies'
    variables)."""
    starts: dict = {}
    for first, last, p, sizes in graph.holdings():
        starts.setdefault(first, []).append((last, p, sizes))
    live: list = []
    rows: dict = {}
    for t in range(len(graph.nodes)):
        live = [e for e in live if e[0] >= t] + starts.get(t, [])
        if sum(max(sizes) for _, _, sizes in live) <= budget:
            continue   # no plan holds more here than the budget
        coefs: dict = {}
        for _, p, sizes in live:
            for s, size in enumerate(sizes):
                if size:
                    coefs[x[p][s]] = coefs.get(x[p][s], 0.0) + size
        rows.setdefault(tuple(sorted(coefs.items())), coefs)
    return list(rows.values())


def _least_memory(graph: Graph) -> float:
    """The least peak any plan holds (the ILP minimising its memory, no budget)."""
    prog = _Program()
    ids = {}
    for k in range(len(graph.nodes)):
        ids[k] = [prog.var() for _ in graph.nodes[k].strategies]
        prog.row({i: 1.0 for i in ids[k]}, 1.0, 1.0)
    _tie_rows(graph, prog, ids)
    peak = prog.var(1.0, integer=False, upper=np.inf)
    for coefs in _memory_rows(graph, ids, 0.0):
        prog.row({**coefs, peak: -1.0}, -np.inf, 0.0)
    res = prog.run(prog.bytes)
    return float(res.x[peak]) if res.x is not None else float("nan")
