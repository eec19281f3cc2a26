"""``md.search``: which layout - candidates ranked by the cost model, before compiling.

``md.search(fn, mesh_or_device_count, *args)`` enumerates layouts of the program, costs each with
:func:`meshdsl.explain` (exact bytes per collective, matmul FLOPs, the memory estimate) and the
time model (:mod:`meshdsl.costmodel.step_time` on a :class:`~meshdsl.costmodel.hardware.Hardware`), drops those that
are invalid or over the memory budget (saying why), and ranks the rest by predicted step time,
then bytes, then memory.

The space, per mesh (the mesh given, or every factorisation of a device count into ``data``,
``data x model`` or, with ``mesh_axes=3``, ``data x model x pipe``):

* every assignment of the program's dims (those of its arguments, or ``dims=``) to the mesh
  axes: each axis splits nothing, one dim, or a group of parameter dims no value of the program
  holds two of (Megatron's ``heads``, ``d_ff``, ``vocab``); a dim may take several axes (in mesh order). An
  assignment whose axes do not divide a dim's size is pruned before costing;
* with ``zero=True``, each assignment also with its parameters stored split (ZeRO-3): each mesh
  axis the assignment uses stores the parameters not computed split over it on one dim, the one
  holding the most parameter elements that axis divides (``params=`` rules), gathered where read
  (``param_gather``, default ``"keep"``);
* with ``choices={"remat": ["none", "full"], ...}``, each layout with each combination of the
  program's keyword arguments;
* where a layout makes the program a pipeline (an ``md.scan`` over a dim it splits), also each
  of ``microbatches=`` over ``microbatch_dim`` with each of ``schedules=``.

Before tracing, a layout is rejected when its arguments and outputs alone (known from shapes)
are over the budget, or (``screen=True``) its screened estimate is (:mod:`meshdsl.search.floor`). A layout whose per-device program is one already costed under other names
for the axes is retimed on its own links rather than traced again. Layouts are costed in the
order of their compute floor (the seconds their matmuls and attention kernels take at least, the
unsharded program's contractions split as the layout splits their dims), and the search stops
where that floor is over the step time of the ``top``-th layout ranked so far: none left could
rank (``bound=False`` costs them all).

With ``optimizer_state=`` (bytes per parameter byte) each layout also holds its parameters'
optimizer state, split as they are stored, on the device through the step: its plan is solved
for the budget less it. With ``offload=True`` a layout whose state does not fit on the device
keeps it in host memory instead (``md.Layout(..., offload="optimizer")``, its plan solved for the
whole budget) and pays its trip to the device and back each step at
:attr:`~meshdsl.costmodel.hardware.Hardware.host_bandwidth`; where all fits it stays on the device.
A layout over the budget even so is costed again with its parameters in host memory too
(``offload=("optimizer", "params")``: each layer's slice brought to the device where used, the
gradients sent back), paying what explain counts on the host link plus the update's trips.

Each layout is planned under the memory budget (less the margin): the solver weighs each op's
strategies by the step's time holding at most that, so a context-parallel layout (an
attention's positions split) whose keys gathered would not fit takes the ring, which holds one
chunk of keys - no strategy forced from outside the solve. The memory estimate is
:func:`meshdsl.costmodel.liveness.memory`'s (XLA's buffer reuse modelled: within 10% of the compiled peak on
the measured training steps, ``docs/cost_model.md``).
"""

from __future__ import annotations

import dataclasses
import functools
import html
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..costmodel.hardware import Hardware
from ..names.errors import MeshDSLError
from ..names.mesh import Mesh
from ..names.units import fmt_bytes, parse_bytes
from ..platform import gcpause
from . import space
from .costing import Candidate, Costing, fmt_s
from .floor import Held

__all__ = ["search", "Candidate", "SearchResult", "DEFAULT_HARDWARE"]

DEFAULT_HARDWARE = "h100-80gb"   # the profile a search ranks by when given no hardware


@dataclasses.dataclass
class SearchResult:
    """Ranked candidates (best first; iterate, index, ``len``), ``best``, ``rejected`` (each with
    its ``why``), how many layouts were ``costed`` (traced and explained), how many were
    ``retimed`` (the program of a costed layout under other axis names: timed on their links),
    how many were ``bounded`` (not costed: their compute floor alone is slower than the last
    ranked) and the search's ``seconds``."""

    candidates: list
    rejected: list
    costed: int
    seconds: float
    hardware: str
    retimed: int = 0
    bounded: int = 0

    @property
    def best(self) -> Candidate:
        if not self.candidates:
            raise MeshDSLError("md.search found no valid layout within the budget; see .rejected for why "
                               "each was rejected")
        return self.candidates[0]

    def __iter__(self):
        return iter(self.candidates)

    def __len__(self) -> int:
        return len(self.candidates)

    def __getitem__(self, i):
        return self.candidates[i]

    def rows(self) -> list[tuple]:
        """One tuple of cells per ranked candidate (the table's rows)."""
        return [(str(i + 1), str(c.mesh), f"`{c.describe()}`", fmt_s(c.time), fmt_bytes(c.total_bytes),
                 fmt_bytes(c.memory.get("peak", 0)), c.why) for i, c in enumerate(self.candidates)]

    def to_markdown(self, top: int | None = None) -> str:
        """The ranking as a markdown table (its first ``top`` rows, default all)."""
        head = ("rank", "mesh", "layout", "step (predicted)", "bytes/device", "peak memory/device", "why")
        retimed = f" (+{self.retimed} retimed)" if self.retimed else ""
        retimed += f", {self.bounded} not costed (their compute floor is slower)" if self.bounded else ""
        lines = [f"{len(self.candidates)} ranked, {len(self.rejected)} rejected, {self.costed} costed{retimed} in "
                 f"{self.seconds:.1f} s; times on {self.hardware}", "",
                 "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
        lines += ["| " + " | ".join(r) + " |" for r in self.rows()[:top]]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        head = ("rank", "mesh", "layout", "step", "bytes/device", "peak memory/device", "why")
        cells = "".join("<tr>" + "".join(f"<td>{html.escape(x.strip('`'))}</td>" for x in r) + "</tr>"
                        for r in self.rows())
        return (f"<p>{len(self.candidates)} ranked, {len(self.rejected)} rejected; times on "
                f"{html.escape(self.hardware)}</p><table><tr>" + "".join(f"<th>{h}</th>" for h in head)
                + f"</tr>{cells}</table>")

    def __str__(self) -> str:
        return self.to_markdown()


def search(fn: Callable, mesh_or_device_count: Mesh | int, *args: Any, memory_budget: int | float | str | None = None,
           hardware: Hardware | str | None = None, top: int = 10, dims: Sequence[str] | None = None,
           zero: bool = False, choices: Mapping[str, Sequence] | None = None, microbatches: Sequence[int] = (),
           microbatch_dim: str = "batch", schedules: Sequence[str] = ("gpipe",),
           dtype: str | None = None, overlap: float = 0.0, memory_margin: float = 0.1, mesh_axes: int = 2, screen: bool = True,
           bound: bool = True, optimizer_state: float = 0.0, offload: bool = False, **options: Any) -> SearchResult:
    """Rank layouts of ``fn(*args)`` on a mesh (an :class:`~meshdsl.Mesh`) or a device count.

    Args:
        fn: the program, as for :func:`meshdsl.explain`.
        mesh_or_device_count: a mesh, or a device count to factorise (see the module doc).
        args: its arguments (abstract shapes are fine).
        memory_budget: bytes per device (a number, or text such as ``"12GiB"``): each layout is
            planned to hold at most it less ``memory_margin`` (the solver trades time for memory:
            a ring for gathered keys, parameters left stored), and rejected where no plan does or
            its estimated peak, plus ``memory_margin`` of it, is over it. Default: the hardware's
            device memory.
        hardware: an :class:`~meshdsl.Hardware` or a profile name (default ``"h100-80gb"``).
        top: how many ranked candidates to keep.
        dims: the dims to place (default: every dim of the arguments, and every dim a rename in
            the program gives one of them: a model's ``length`` fed by the batch's ``targets``;
            any dim the program has may be named).
        zero: also try each assignment with its parameters stored split (ZeRO-3).
        choices: keyword arguments of ``fn`` to try with each of their values (``{"remat":
            ["none", "full"]}``); a candidate's ``choices`` say which it was costed with.
        microbatches: where a layout makes the program a pipeline, also these microbatch counts
            over ``microbatch_dim`` (those dividing it), each with each of ``schedules``.
        dtype: the dtype every matmul is priced at (:meth:`meshdsl.Report.time`; default: each
            kernel's own; ``overlap`` too).
        overlap: the overlap of compute and communication.
        memory_margin: the share of the estimated peak kept free for the estimate's error (the
            memory model is within 10% of the compiled peak where measured, ``docs/cost_model.md``).
        mesh_axes: for a device count, the most axes of a factorisation (1 to 3: ``data``,
            ``model``, ``pipe``; names only).
        screen: reject before tracing a layout whose estimate by :mod:`meshdsl.search.floor` (which
            errs low) is over the budget; ``False`` costs every layout.
        bound: cost layouts in the order of their compute floor (the seconds their matmuls and
            attention kernels take at least: :meth:`meshdsl.search.floor.Held.compute_seconds`) and
            stop where the floor is over the step time of the ``top``-th ranked: no layout left
            could rank (each is rejected, saying so); ``False`` costs every layout.
        optimizer_state: the optimizer state's bytes per parameter byte (AdamW: 2), held by each
            layout on the device as its parameters are stored (see the module doc).
        offload: a layout over the budget keeps its state, or also its parameters, on the host.
        options: passed to :func:`meshdsl.explain` (``param_gather``, ``schedule``, ...) and
            returned in each candidate's ``lower_kwargs``.
    """
    start = time.perf_counter()
    hw, budget = _hardware_and_budget(hardware, memory_budget)
    options = {"memory_budget": budget / (1 + memory_margin), **options}   # each plan solved to fit, less the margin
    programs = [(dict(c), functools.partial(fn, **c) if c else fn) for c in space.combinations(choices)]
    held = {id(p): Held(p, args) for _, p in programs}
    sizes, params, units = space.dims_of(args, dims, held[id(programs[0][1])])
    meshes = space.meshes(mesh_or_device_count, mesh_axes)
    dim_sets = set().union(*(h.dim_sets for h in held.values()))
    counts = {microbatch_dim: [m for m in microbatches if sizes.get(microbatch_dim, 0) % m == 0]}
    run = Costing(args, budget, hw, dtype, overlap, memory_margin, (counts, schedules), screen, (optimizer_state, offload))
    with gcpause.paused():   # each traced layout's garbage collected after it (_Costing.cost)
        scanned = set().union(*(h.scanned for h in held.values()))
        _cost_all(run, hw, meshes, (sizes, units, scanned), params, zero, dim_sets, programs, held, options, top, bound)
    ranked = _ranked(run.ranked)
    return SearchResult(ranked[:top], run.rejected, run.costed, time.perf_counter() - start, hw.name, run.retimed,
                        run.bounded)


def _cost_all(run, hw, meshes, dims, params, zero, dim_sets, programs, held, options, top, bound) -> None:
    """Every layout of ``meshes`` for each program, costed or rejected by ``run``: in the order of
    their compute floors (:meth:`meshdsl.search.floor.Held.compute_seconds`), and (``bound``) none
    whose floor is over the step time of the ``top``-th ranked so far (it could not rank).
    ``dims``: the dims' sizes, the units an axis splits (:func:`meshdsl.search.space.dims_of`)
    and the dims an ``md.scan`` runs over."""
    seen: set = set()
    queue = []
    sizes, units, scanned = dims
    for mesh in meshes:
        for layout, pruned in space.layouts(mesh, sizes, params, zero, dim_sets, units, scanned):
            same, alike = space.devices_grouped(mesh, layout), space.costs_alike(mesh, layout, hw)
            if same in seen or alike in seen:
                continue   # the same blocks on the same devices, or on devices as far apart, as one costed
            seen.update((same, alike))
            for chosen, program in programs:
                cand = Candidate(layout, mesh, dict(options), chosen)
                if pruned:
                    run.reject(cand, pruned)
                    continue
                floor = held[id(program)].compute_seconds(mesh, layout, hw, run.dtype)
                queue.append((floor, len(queue), cand, program))
    queue.sort(key=lambda t: t[:2])
    for i, (floor, _, cand, program) in enumerate(queue):
        bar = run.bar(top)
        if bound and floor > bar:
            for rest, _, other, _ in queue[i:]:
                run.reject(other, f"not costed: its matmuls and attention alone take {fmt_s(rest)} or more per "
                                  f"step, over the {top}th ranked layout's {fmt_s(bar)} (bound=False costs it)")
            run.bounded = len(queue) - i
            return
        report = run.cost(cand, program, held[id(program)])
        if report is not None:
            run.variants(cand, program, held[id(program)], report)


def _hardware_and_budget(hardware, memory_budget) -> tuple:
    hw = Hardware.profile(hardware or DEFAULT_HARDWARE) if hardware is None or isinstance(hardware, str) else hardware
    try:
        return hw, hw.memory_bytes if memory_budget is None else parse_bytes(memory_budget)
    except ValueError as e:
        raise MeshDSLError(f"md.search: memory_budget: {e}") from None


def _ranked(candidates) -> list:
    """Best first, each with the reason for its rank."""
    ranked = sorted(candidates, key=lambda c: c.key)
    for i, c in enumerate(ranked):
        c.why = _why(i, c, ranked[0])
    return ranked


def _why(i, c, best) -> str:
    t = c.step_time
    text = (f"{fmt_s(t.compute_s)} compute + {fmt_s(t.communication_s)} communication "
            f"({fmt_bytes(c.total_bytes)})" + (f" + {fmt_s(c.host_s)} {_offloaded(c)} to the device and back "
                                              f"({fmt_bytes(c.memory.get('host', 0))} in host memory)" if c.host_s else "")
            + f", peak {fmt_bytes(c.memory['peak'])}")
    if i == 0:
        return "fastest predicted: " + text
    return f"{c.time / best.time:.2f}x the best's time: " + text if best.time else text


def _offloaded(c) -> str:
    if "params" in c.layout.offload:
        return "parameters (each layer's slice fetched while the layer before computes) and optimizer state"
    return "optimizer state"
