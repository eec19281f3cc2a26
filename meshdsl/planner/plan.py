"""From a planning trace to a plan: the graph, its relay prices, the solve.

:func:`build` turns a :class:`~meshdsl.planner.record.Recording` into a
:class:`~meshdsl.planner.graph.Graph`: inputs pinned where they enter, one node per outermost op
with the strategies its rule showed, sinks (outputs, ``x.array`` reads) needing their placement.
A relay of a value from one placement to another costs the relayout's bytes
(:func:`meshdsl.rewrite.relayout.relayout_bytes`, run as often as the value's trace runs) and, when the
value is differentiated, the relayout back in the backward pass (a gather's reduce-scatter, an
all-to-all back; a reduced sum's transpose moves nothing). :func:`choose` solves it and returns
the entry placements of every op the plan moves off its default.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from ..costmodel.cost import element_bytes, moved_bytes
from ..costmodel.hardware import Hardware
from ..rewrite.relayout import relayout_bytes
from . import carries
from .carries import loops_of
from .copies import common_copies, follow_types, share_copies
from .graph import Graph, Node, SharedCopy, Strategy
from .remat import value_bytes
from .solve import Solution, solve

__all__ = ["build", "choose", "decisions", "priced", "Plan", "Unread", "OBJECTIVES"]



@dataclasses.dataclass
class Plan:
    """The solver's answer for one program: entry placements per moved op, and the numbers."""

    choice: dict            # op number -> the Found strategy it takes (entry placements, options)
    solution: Solution
    default_bytes: float    # the plan of every rule's own choice, as the model prices it
    graph: Graph
    nodes: dict             # graph node index -> op number
    sinks: tuple = ()       # the placement each output and x.array read needs, in program order
    carries: dict = dataclasses.field(default_factory=dict)   # loop op number -> where its carries enter

    @property
    def gain(self) -> float:
        return self.default_bytes - self.solution.bytes


OBJECTIVES = ("time", "bytes")


@dataclasses.dataclass(frozen=True)
class Unread:
    """A placement a consumer whose forward the program never reads needs its operand in (the
    loss of ``jax.grad``: :mod:`meshdsl.planner.unread`): relaying there moves only the backward."""

    placement: object


def _compute_cost(op, found, grad: bool, dtype: str, hw: Hardware, rate: float, forward: bool = True) -> float:
    """The op's compute per device under strategy ``found``, as the bytes the slowest link moves
    in that time (``rate``: its bandwidth): the local contractions its rule emitted there
    (``found.work``: an einsum's blocks, an attention's kernel, as often as they run), each pass
    the larger of its FLOPs at the dtype's peak and its HBM bytes at the memory's bandwidth, the
    backward's where the op is differentiated (``grad``). A loop's body ops are priced apart: a loop
    pays only what its remat policy recomputes (``found.again``) and what it offloads, to the host
    in the forward pass and back in the backward over the host link (``found.host``), each way
    beyond the compute of its pass (``found.beside``), which the transfer overlaps. ``forward``:
    the program reads its forward pass (:mod:`meshdsl.planner.unread`), else the compiler drops it."""
    def seconds(flops, nbytes):
        return max(flops / hw.matmul_peak(dtype) / hw.matmul_efficiency,
                   nbytes / hw.hbm_bandwidth / hw.memory_efficiency)
    if op.inner:   # what its remat policy recomputes, and what it moves to host memory and back
        if not grad:
            return 0.0
        offloaded = 0.0
        if found.host and hw.host_bandwidth:   # each way overlapping its pass's compute
            move = found.host / hw.host_bandwidth
            fwd, bwd = (seconds(*found.beside[:2]), seconds(*found.beside[2:])) if found.beside else (0.0, 0.0)
            offloaded = max(0.0, move - fwd) + max(0.0, move - bwd)
        return ((seconds(*found.again) if found.again else 0.0) + offloaded) * rate
    if not found.work:
        return 0.0
    forward_flops, forward_bytes, backward_flops, backward_bytes = found.work
    total = (seconds(forward_flops, forward_bytes) if forward else 0.0) + \
        (seconds(backward_flops, backward_bytes) if grad else 0.0)
    return total * rate


class _Prices:
    """What movement costs under the time objective: a collective's seconds on the link of its
    axes (:meth:`meshdsl.costmodel.hardware.Hardware.link`: bandwidth, and latency for a relay's steps),
    as the bytes the reference link (the mesh's slowest) moves in that time. ``rate`` is 0 under
    the bytes objective (nothing priced but bytes)."""

    def __init__(self, ctx, hw: Hardware, objective: str):
        self.mesh, self.hw = ctx.mesh, hw
        axes = tuple(a for a in ctx.mesh.axis_names if ctx.mesh.shape[a] > 1)
        self.rate = hw.interconnect[hw.link(axes, ctx.mesh.shape)].bandwidth if axes and objective == "time" else 0.0

    def _link(self, axes):
        return self.hw.interconnect[self.hw.link(axes, self.mesh.shape)]

    def step(self, kind, factor_axes, nbytes) -> float:
        """One step of a relay (factor axes): bandwidth and latency."""
        link = self._link(self.mesh.collapse(factor_axes))
        return (nbytes / link.bandwidth + link.latency) * self.rate

    def own(self, found) -> float:
        """A rule's own bytes, forward and backward, each at the bandwidth of the links its
        collectives run on (bytes whose axes are not known: the reference link's), and each
        collective's latency as often as it runs (in a loop body: its trip count), as a relay's
        steps pay theirs."""
        def ratio(parts):
            moved = sum(b for _, b in parts)
            return sum(b * self.rate / self._link(axes).bandwidth if axes else b for axes, b in parts) / moved \
                if moved else 1.0
        latency = sum((fwd + bwd) * self._link(axes).latency for axes, fwd, bwd in found.runs if axes) * self.rate
        return found.forward * ratio([(axes, b) for _, axes, b in found.collectives]) + \
            found.backward * ratio(found.duals) + latency


def build(ctx, recording, objective: str = "time", hardware=None) -> tuple[Graph, dict, dict]:
    """The graph of ``recording`` (made in ``ctx``'s trace), graph node -> op number, and loop node
    -> its :class:`~meshdsl.planner.carries.Loop` (what its step reads from it). With the
    ``"time"`` objective each strategy also pays its compute (:func:`_compute_cost`), and its own
    collectives and each relay their seconds on the links of their axes (:class:`_Prices`), in
    bytes of the mesh's slowest link, so that the plan minimises the step's time, not its bytes."""
    hw = Hardware.of(hardware, ctx.mesh)
    prices = _Prices(ctx, hw, objective)
    rate = prices.rate
    timed = (lambda v, src, dst: _relay_bytes(ctx, recording.values[v], src, dst, prices.step)) if rate else None
    graph = Graph(lambda v, src, dst: _relay_bytes(ctx, recording.values[v], src, dst), timed)
    graph.rate = rate
    nodes = {}
    held = functools.partial(value_bytes, ctx, recording)
    live, grads = _live(recording), _differentiated(recording)
    loops = {k: loop for k, loop in loops_of(recording).items() if k in live}
    looped = {}   # loop node -> its Loop
    _inputs(graph, recording, held, {v for loop in loops.values() for v in loop.values})
    unread_ops, unread_sinks = recording.unread
    node_of = {}
    orphans: dict = {}   # a copy whose maker the compiler drops -> (graph node, strategies) of its first live reader
    for k, op in enumerate(recording.ops):
        if k not in live:
            continue   # nothing it makes reaches an output: the compiler drops it
        for v in op.operands:   # made by an op of an aborted trace (a md.scan body traced again)
            if v not in graph.producer:
                graph.add(Node(f"value {v}", [], [v], [Strategy((), (recording.placed[v],), label="made",
                                                                memory=(held(v, recording.placed[v]),))]))
        # a copy another op made is free to read only if that op stays (else it is made for the reader)
        dtype = str(recording.values[(op.operands or op.results)[0]][1]) if op.operands or op.results else "float32"
        strategies = []
        node = len(graph.nodes)
        later = []   # (strategy, copy, cost) read from a dead maker whose copy an earlier live reader makes
        for s, f in enumerate(op.strategies):
            reads = _dead_reads(f, s, node, live, orphans, later)
            own = f if k in grads else dataclasses.replace(f, backward=0.0, runs=tuple((a, n, 0) for a, n, _ in f.runs))
            if k in unread_ops:   # the compiler drops its forward pass: its backward alone moves
                own = dataclasses.replace(own, forward=0.0, runs=tuple((a, 0, b) for a, _, b in own.runs))
            strategies.append(Strategy(
                tuple(Unread(p) for p in f.entry) if k in unread_ops else f.entry, f.gives,
                own.forward + own.backward + reads, detail=f, label=_label(ctx, recording, op, f),
                work=_compute_cost(op, f, k in grads, dtype, hw, rate, k not in unread_ops) if rate else 0.0,
                own_time=prices.own(own) + reads if rate else None,
                memory=tuple(held(v, pl) for v, pl in zip(op.results, f.gives)), departures=len(f.options),
                **_beyond(f, k in grads)))
        if k in grads:   # what a differentiated op reads, the backward pass reads again
            graph.saved.update(v for v in op.operands if recording.values[v][3])
        strategies, stepped = carries.entering(strategies, loops.get(k), held)   # what its step reads from it
        node_of[k] = graph.add(Node(f"{op.name} at {op.line}", list(op.operands), [*op.results, *stepped], strategies))
        nodes[node_of[k]] = k
        if stepped:
            looped[node_of[k]] = loops[k]
        for s, (maker, makers), cost in later:   # the copy is made once: free where its first reader makes it
            graph.shared.append(SharedCopy(node_of[k], s, maker, frozenset(makers), cost))
        share_copies(graph, node_of, op.strategies)
    body = set().union(*(op.inner for op in recording.ops))
    common_copies(graph, {n for n, k in nodes.items() if not recording.ops[k].inner and k not in body})
    follow_types(graph)   # a cast another operand's type makes: paid where its producer leaves that type
    _sinks(ctx, graph, recording, unread_sinks, prices)
    for node, leaves in looped.items():   # a step's carry, taken by the next step where it entered
        carries.leave(graph, node, leaves)
    return graph, nodes, looped


def _inputs(graph, recording, held, stepped) -> None:
    """A node per value first met where it entered (an argument, held throughout), but those a
    loop's step reads from the loop (``stepped``: the loop's node gives them)."""
    for v, pl in recording.entered.items():
        if v not in stepped:
            graph.add(Node(f"input {v}", [], [v], [Strategy((), (pl,), label="entered", memory=(held(v, pl),))]))
            graph.saved.add(v)


def _sinks(ctx, graph, recording, unread, prices) -> None:
    """A node per output and ``x.array`` read, needing its value in the placement it is read
    in; one the program never reads (``unread``: their numbers) moves nothing forward for it."""
    for i, (v, pl) in enumerate(recording.sinks):
        if v not in graph.producer:
            continue
        if i in unread:
            graph.add(Node(f"unread {v}", [v], [], [Strategy((Unread(pl),), (), label="needed, unread")]))
            continue
        _replicate_at(ctx, graph, recording.values[v], v, pl, prices)
        graph.add(Node(f"output {v}", [v], [], [Strategy((pl,), (), label="needed")]))


def _beyond(found, grad: bool) -> dict:
    """What a strategy holds beyond its operands and results (its rule's declared ``held``):
    residuals kept to the end where the op is differentiated, else only while it runs."""
    if not found.held:
        return {}
    kept, working = found.held
    return {"kept": kept, "working": working} if grad else {"working": working + kept}


def _differentiated(recording) -> set:
    """Numbers of the differentiated ops: those reading a differentiated value, and the body ops
    of a loop that is (jax differentiates a loop's body after tracing it: its values are not
    differentiated while it is traced)."""
    grads = {k for k, op in enumerate(recording.ops) if op.grad}
    return grads.union(*(recording.ops[k].inner for k in grads))


def _dead_reads(found, s, node, live, orphans, later) -> float:
    """Bytes of the copies strategy ``s`` (``found``) of graph node ``node`` reads that only a dead
    op made (the compiler drops it): the first live reader makes such a copy (its bytes here,
    ``orphans`` remembers which of its strategies read it), a later one shares it where that reader
    does (``later``: ``(strategy, (first reader, its strategies), bytes)``, a shared copy)."""
    reads = 0.0
    for maker, cost, copy in found.reads:
        if maker in live or not cost or copy[0] == "varies":
            continue
        first = orphans.setdefault(copy, (node, set()))
        if first[0] == node:
            first[1].add(s)
            reads += cost
        else:
            later.append((s, first, cost))
    return reads


def _replicate_at(ctx, graph, value, v, pl, prices) -> None:
    """A value leaving the program typed varying over axes its placement ``pl`` does not split
    (computed from a parameter and data, widened to the data axes) is all-reduced there to type
    it replicated: charged to each strategy of its producer that leaves it so."""
    dims, dtype, executions, _ = value
    k, slot = graph.producer[v]
    node = graph.nodes[k]
    local = element_bytes(dtype, ctx.mesh.platform) * math.prod(dims.sizes) / ctx.mesh.axes_size(pl.split_axes())
    for i, s in enumerate(node.strategies):
        found = s.detail
        extra = (found.vary[slot] - pl.split_axes()) if found is not None and slot < len(found.vary) else frozenset()
        if extra:
            cost = moved_bytes("all-reduce", local, local, ctx.mesh.axes_size(tuple(extra))) * executions
            node.strategies[i] = dataclasses.replace(s, cost=s.cost + cost, own_time=None if s.own_time is None else
                                                     s.own_time + prices.step("all-reduce", tuple(extra), cost))


def choose(ctx, recording, *, time_limit: float = 60.0, objective: str = "time", hardware=None,
           memory_budget: float | None = None) -> Plan:
    """Solve the program ``recording`` holds for ``objective`` on ``hardware``, holding at most
    ``memory_budget`` bytes per device as the graph sees it; the ops the plan moves, with their
    entries. Raises :class:`~meshdsl.planner.solve.NoPlanFits` where no plan holds so little."""
    graph, nodes, looped = build(ctx, recording, objective, hardware)
    solution = solve(graph, time_limit=time_limit, memory_budget=memory_budget)
    default = graph.cost([0] * len(graph.nodes))
    choice = {}
    for g, k in nodes.items():
        s = solution.choice[g]
        if s:
            choice[k] = graph.nodes[g].strategies[s].detail
    return Plan(choice, solution, default, graph, nodes, tuple(pl for _, pl in recording.sinks),
                {**recording.carries, **carries.entries(graph, looped, solution.choice)})


def priced(plan) -> dict:
    """The solved plan as its graph prices it: ``bytes`` per device it moves, ``memory`` (the
    peak per device the graph's liveness sees), whether the solver proved it ``optimal`` (False:
    it ran out of time and kept the best plan it had) and its ``seconds``."""
    choice = plan.solution.choice
    return {"bytes": plan.graph.moved(choice), "memory": plan.graph.memory(choice),
            "optimal": plan.solution.optimal, "seconds": plan.solution.seconds}


def decisions(plan, followed: bool) -> list:
    """Per op whose candidates differ in cost: the placement chosen and the next-best one, each
    with the whole plan's bytes and (time objective) its predicted seconds of communication and
    compute, every other op as chosen. ``followed``: the program runs this plan (else the rules'
    own choices moved fewer bytes when traced, and ran)."""
    out = []
    graph, rate = plan.graph, plan.graph.rate
    for g, k in plan.nodes.items():
        node = graph.nodes[g]
        others = [(s, b) for s, b in plan.solution.alternatives(graph, g) if b != math.inf]
        if not others:
            continue
        chosen = node.strategies[plan.solution.choice[g]]
        nxt, nxt_cost = others[0]
        other = list(plan.solution.choice)
        other[g] = nxt
        row = {"op": node.name, "chosen": chosen.label, "bytes": graph.moved(plan.solution.choice),
               "memory": graph.memory(plan.solution.choice), "next": node.strategies[nxt].label,
               "next_bytes": graph.moved(other), "next_memory": graph.memory(other), "followed": followed}
        if rate:
            row.update(seconds=plan.solution.bytes / rate, next_seconds=nxt_cost / rate)
        out.append(row)
    return out


def _label(ctx, recording, op, found) -> str:
    """``"operands [b:data] [d:model]; candidate 2"``: where the operands enter, which candidate
    (a loop's remat policy by name)."""
    text = "operands " + " ".join(f"[{p.describe(recording.values[v][0], ctx.mesh) or 'whole'}]"
                                  for v, p in zip(op.operands, found.entry))
    if found.regathered:
        text += f"; {found.regathered} parameter{'s' * (found.regathered > 1)} gathered again"
    if found.remat:
        return text + f"; remat {found.remat}"
    return text + "".join(f"; candidate {c} at decision {p}" for p, c in found.options)


def _live(recording) -> set:
    """Numbers of the ops some output or read depends on (a loop's body ops read values made
    outside it - closed over, not the loop's operands - which it depends on too)."""
    wanted = {v for v, _ in recording.sinks}
    live = set()
    for k in range(len(recording.ops) - 1, -1, -1):
        op = recording.ops[k]
        if k in live or wanted & set(op.results):
            live.add(k)
            live.update(op.inner)   # a scan's results come from its body, and what its body reads
            wanted |= set(op.operands).union(*(recording.ops[j].operands for j in op.inner))
    return live


def _relay_bytes(ctx, value, src, dst, price=None) -> float:
    """Bytes (or, with ``price``, what its steps cost) of relaying ``value`` from ``src`` to
    ``dst``, forward and, differentiated, back, as often as the value's trace runs."""
    dims, dtype, executions, grad = value
    read = not isinstance(dst, Unread)   # else the compiler drops the forward relayout
    dst = dst if read else dst.placement
    if not dst.pending <= src.pending:
        return math.inf   # no collective creates a pending sum
    itemsize = element_bytes(dtype, ctx.mesh.platform)
    forward = relayout_bytes(ctx, dims, itemsize, src.axes, src.pending, dst.axes, dst.pending, price) if read else 0.0
    backward = relayout_bytes(ctx, dims, itemsize, dst.axes, frozenset(), src.axes, price=price) if grad else 0.0
    return (forward + backward) * executions
