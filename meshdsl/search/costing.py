"""Costing one layout for ``md.search``: its rejections before tracing (memory floors), its
trace and explain (planned under the budget), a layout of a known per-device program retimed on
its own links, and the variants a report calls for (a pipeline's microbatch counts and
schedules). :mod:`meshdsl.search.search` orders the layouts
and ranks what this costs.
"""

from __future__ import annotations

import dataclasses
import math

from ..costmodel.step_time import StepTime
from ..names.errors import LayoutError, MemoryBudgetError, MeshDSLError
from ..names.layout import Layout
from ..names.mesh import Mesh
from ..names.units import fmt_bytes
from ..platform import gcpause
from ..platform.jaxcompat import forget_staged
from ..views.explain import Report, explain
from . import space

__all__ = ["Candidate", "Costing", "fmt_s", "DEFAULTS"]

DEFAULTS = {"param_gather": "keep", "schedule": "gpipe", "repeats": 1, "planner": True, "attention": None}


@dataclasses.dataclass
class Candidate:
    """One costed layout: ``layout``, ``mesh``, ``lower_kwargs`` (for :func:`meshdsl.lower`),
    ``choices`` (the keyword arguments of the program it was costed with, from ``choices=``), predicted ``time`` (seconds per step), ``bytes`` (kind -> count and bytes per device),
    ``total_bytes``, ``memory`` (per device, as :attr:`meshdsl.Report.memory`), ``why`` (what
    ranks it here, or what rejected it), and the ``report``."""

    layout: Layout
    mesh: Mesh
    lower_kwargs: dict
    choices: dict = dataclasses.field(default_factory=dict)
    time: float = math.inf
    step_time: StepTime | None = None
    bytes: dict = dataclasses.field(default_factory=dict)
    total_bytes: float = math.inf
    memory: dict = dataclasses.field(default_factory=dict)
    why: str = ""
    report: Report | None = dataclasses.field(default=None, repr=False)
    host_s: float = 0.0   # of ``time``: the trips over the host link of what it offloads (not hidden by compute)
    over_budget: bool = False   # rejected for the memory budget (not as invalid)

    @property
    def key(self) -> tuple:
        return self.time, self.total_bytes, self.memory.get("peak", math.inf)

    def describe(self) -> str:
        """The layout, with the program choices and the non-default lowering options (the
        schedule of a pipeline) it was costed with."""
        extra = [f"{k}={v}" for k, v in self.choices.items()]
        extra += [f"{k}={v}" for k, v in self.lower_kwargs.items()
                  if k != "memory_budget" and DEFAULTS.get(k, object()) != v]
        return " · ".join([str(self.layout), *extra])


class Costing:
    """The candidates costed so far: ranked, rejected (each with its why), how many were traced."""

    def __init__(self, args, budget, hw, dtype, overlap, margin, variants=({}, ()), screen=True, state=(0.0, False)):
        self.args, self.budget, self.hw, self.dtype, self.overlap, self.margin = args, budget, hw, dtype, overlap, margin
        self.screen = screen
        self.state, self.offload = state   # optimizer state per parameter byte; may it live on the host
        self.counts, self.schedules = variants   # what to try again: a pipeline's microbatches and schedules
        self.ranked, self.rejected, self.costed, self.retimed, self.bounded = [], [], 0, 0, 0
        self.traced: dict = {}   # the shape of a layout's per-device program -> (axis names, report or error)

    def variants(self, cand, program, held, report) -> None:
        """Cost ``cand`` again where its report shows a pipeline: with its microbatch counts and
        schedules."""
        if report.pipeline is not None:
            self.pipelines(cand, program, held, self.counts, self.schedules)

    def pipelines(self, cand, program, held, counts, schedules) -> None:
        """Cost ``cand`` (a layout under which the program pipelines) with each microbatch count
        (``{dim: counts}``) and schedule."""
        (dim, ms), = counts.items()
        for m in ms:
            for schedule in schedules:
                piped = Layout(cand.layout.rules, params=cand.layout.param_rules, microbatches={dim: m})
                self.cost(Candidate(piped, cand.mesh, {**cand.lower_kwargs, "schedule": schedule}, cand.choices),
                          program, held)

    def bar(self, top: int) -> float:
        """The step time of the ``top``-th ranked so far (inf while fewer are ranked)."""
        if len(self.ranked) < top:
            return math.inf
        return sorted(c.time for c in self.ranked)[top - 1]

    def reject(self, cand, why: str, over_budget: bool = False) -> None:
        cand.why, cand.over_budget = why, over_budget
        self.rejected.append(cand)

    def cost(self, cand, program, held) -> Report | None:
        """Cost ``cand`` (ranked or rejected); its report, or None when it was not traced. Where
        it is over the memory budget and ``offload`` allows, cost it again streaming its
        parameters from host memory (with the optimizer state there too)."""
        report = self._cost(cand, program, held)
        if self.offload and cand.over_budget and "params" not in cand.layout.offload:
            layout = cand.layout
            streamed = Layout(layout.rules, params=layout.param_rules, microbatches=layout.microbatches or None,
                              offload=("optimizer", "params"))
            self._cost(Candidate(streamed, cand.mesh, dict(cand.lower_kwargs), cand.choices), program, held)
        return report

    def _cost(self, cand, program, held) -> Report | None:
        try:
            floor, params = held.per_device(cand.mesh, cand.layout), held.param_bytes(cand.mesh, cand.layout)
            state = self.state * params
        except LayoutError as e:
            return self.reject(cand, f"invalid: {str(e).splitlines()[0]}")
        if state and not self.offload:   # held on the device through the step: the plan has the rest
            floor += state
            cand.lower_kwargs = {**cand.lower_kwargs, "memory_budget": cand.lower_kwargs["memory_budget"] - state}
        if floor * (1 + self.margin) > self.budget:
            return self.reject(cand, f"over the memory budget before costing: its arguments and outputs alone take "
                                     f"{fmt_bytes(floor)} per device + {self.margin:.0%} > {fmt_bytes(self.budget)}",
                               True)
        most = {d: max(ms) for d, ms in self.counts.items() if ms}   # a pipeline's most microbatches
        least = held.screen(cand.mesh, cand.layout, floor, most) if self.screen else floor
        if least > self.budget:   # (no margin: the screen errs low, or high by less than the margin)
            return self.reject(cand, f"over the memory budget before costing (screen): its arguments and outputs "
                                     f"({fmt_bytes(floor)}) and the unsharded program's temporaries as it could split "
                                     f"them take ~{fmt_bytes(least)} per device > {fmt_bytes(self.budget)}; "
                                     f"screen=False costs it", True)
        shape, rename = _shape_of(cand, program)
        known = self.traced.get(shape) if cand.mesh.is_abstract else None
        report = None if known is None else _renamed(known, rename, cand)
        if report is None:
            self.costed += 1
            try:
                report = explain(program, cand.mesh, cand.layout, *self.args, hardware=self.hw, **cand.lower_kwargs)
            except MeshDSLError as e:
                self.traced[shape] = (rename, e)
                return self.reject(cand, _refused(e), isinstance(e, MemoryBudgetError))
            finally:
                forget_staged()   # the next layout traces other local shapes
                gcpause.collect_young()
            self.traced.setdefault(shape, (rename, report))
        elif isinstance(report, MeshDSLError):
            self.retimed += 1
            return self.reject(cand, _refused(report), isinstance(report, MemoryBudgetError))
        else:
            self.retimed += 1
        _cost(cand, report, self.hw, self.dtype, self.overlap)
        if "params" in cand.layout.offload:
            # the step's trips (in its time: what its compute does not cover), and the update's
            # (in 2x, out 1x), after the step
            update = self.hw.host_seconds(3 * params)
            cand.host_s = max(0.0, cand.step_time.host_s - cand.step_time.compute_s) + update
            cand.time += update
        if state:
            self._with_state(cand, state)
        if cand.memory["peak"] * (1 + self.margin) > self.budget:
            self.reject(cand, f"over the memory budget: peak {fmt_bytes(cand.memory['peak'])} per device "
                              f"+ {self.margin:.0%} > {fmt_bytes(self.budget)}", True)
        else:
            self.ranked.append(cand)
        return report


    def _with_state(self, cand, state: float) -> None:
        """``cand`` holding its optimizer state (``state`` bytes per device): on the device through
        the step, or, where that is over the budget and ``offload`` allows, in host memory
        (``md.Layout(..., offload="optimizer")``), paying its trip to the device and back."""
        cand.memory["optimizer"] = state
        resident = cand.memory["peak"] + state
        if "optimizer" not in cand.layout.offload and (not self.offload or resident * (1 + self.margin) <= self.budget):
            cand.memory["peak"] = resident
            return
        layout = cand.layout
        cand.layout = Layout(layout.rules, params=layout.param_rules, microbatches=layout.microbatches or None,
                             offload={"optimizer", *layout.offload})
        cand.memory["host"] = cand.memory.get("host", 0) + state
        trips = 2 * self.hw.host_seconds(state)
        cand.host_s, cand.time = cand.host_s + trips, cand.time + trips


def _refused(e: MeshDSLError) -> str:
    """Why a layout the lowering refused is rejected: no plan of it fits the budget, or it is
    invalid (the error's first line)."""
    first = str(e).splitlines()[0]
    return f"over the memory budget: {first}" if isinstance(e, MemoryBudgetError) else f"invalid: {first}"


def _shape_of(cand, program) -> tuple:
    """What a layout's per-device program is, whatever its axes are called: per dim (compute and
    storage) the sizes of the axes splitting it, with the program and options; and the axes in
    the same order. Two layouts of one shape (``batch:data;d_ff:model`` on ``data:64 x model:8``,
    ``batch:model;d_ff:data`` on ``data:8 x model:64``) trace to one program up to the axes'
    names: its collectives, FLOPs and memory are the same, its times differ by the links."""
    def split(rules):
        return tuple(sorted((d, tuple(cand.mesh.shape[a] for a in axes)) for d, axes in rules.items() if axes))

    def axes(rules):
        return [a for d, ax in sorted(rules.items()) for a in ax]
    layout = cand.layout
    shape = (id(program), tuple(sorted(cand.lower_kwargs.items())), tuple(sorted(layout.microbatches.items())),
             tuple(sorted(layout.offload)),
             split(layout.rules), split(layout.param_rules), space.sharing(layout, lambda a: cand.mesh.shape[a]))
    return shape, axes(layout.rules) + axes(layout.param_rules)


def _renamed(known, rename, cand):
    """The known report (or error) of a layout of the same shape, with its axes called as
    ``cand``'s (``rename``: the axes in :func:`_shape_of`'s order); None where a collective runs
    over an axis the names do not map (a part of an axis)."""
    old_names, report = known
    if isinstance(report, MeshDSLError):
        return report
    names: dict = {}
    for old, new in zip(old_names, rename):
        if names.setdefault(old, new) != new:
            return None
    if len(set(names.values())) != len(names) or any(a not in names for r in report.collectives for a in r.axes):
        return None
    collectives = [dataclasses.replace(r, axes=tuple(names[a] for a in r.axes)) for r in report.collectives]
    pipeline = report.pipeline
    if pipeline is not None and "axis" in pipeline:
        if pipeline["axis"] not in names:
            return None
        pipeline = {**pipeline, "axis": names[pipeline["axis"]]}
    return dataclasses.replace(report, mesh=str(cand.mesh), layout=str(cand.layout), collectives=collectives,
                               pipeline=pipeline, compile=None)


def _cost(cand, report, hw, dtype, overlap) -> None:
    cand.report = report
    cand.step_time = report.time(hw, dtype=dtype, overlap=overlap)
    cand.time = cand.step_time.total_s
    cand.bytes = report.summary()
    cand.total_bytes = report.total_bytes
    cand.memory = dict(report.memory)


def fmt_s(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"
