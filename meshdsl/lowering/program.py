"""One compiled variant of a lowered function: the traced per-device program.

:class:`Program` is what ``md.lower`` builds per input structure (tree, dims, shapes, dtypes):
the placement of every input (parameters by the storage rules), and the function ``jax.jit``
compiles. Traced, it runs the user's ``fn`` either

* inside ``jax.shard_map`` over every factor axis (:mod:`meshdsl.names.mesh`) with an :class:`~meshdsl.rewrite.explicit.ExplicitContext`
  (``backend="explicit"``): the rewriter decides every collective; outputs are brought to the
  layout's placement (``param_gather="auto"``: whether to gather each stored parameter is the
  planner's decision, :mod:`meshdsl.rewrite.param_gather`); or
* on global arrays with a :class:`~meshdsl.rewrite.contexts.GspmdContext` (``backend="gspmd"``): one
  sharding constraint per op output, the compiler decides.
"""

from __future__ import annotations

import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
from jax.extend.core import jaxpr_as_fun
from jax.sharding import NamedSharding, PartitionSpec

from ..platform import gcpause, jaxcompat
from ..costmodel import jaxpr_stats, liveness, roofline, simplify
from ..rewrite import param_gather
from ..rewrite.contexts import GspmdContext
from ..names.errors import LayoutError, MemoryBudgetError, suggest
from ..rewrite.explicit import ExplicitContext
from ..platform.jaxcompat import HOST_MEMORY, host_resident, varying_axes
from ..names.layout import Layout, effective, mesh_spec, to_spec
from ..names.named import NamedArray, Placement, is_named
from ..planner.plan import choose
from ..planner.solve import NoPlanFits
from ..planner.record import Recording
from ..planner.unread import unread
from ..costmodel.step_time import predict
from ..names.tracing import using
from ..names.units import fmt_bytes

__all__ = ["Program"]


@dataclasses.dataclass
class _Leaf:
    named: bool
    dims: object = None
    is_param: bool = False
    axes: tuple = ()
    spec: PartitionSpec = PartitionSpec()


class Program:
    """A fixed input structure of ``owner`` (a LoweredFunction), its placements, and the jitted
    function. ``last_ctx``: the explicit context of the latest trace, for explain."""

    def __init__(self, owner, treedef, leaves):
        self.owner, self.treedef = owner, treedef
        mesh, layout = owner.mesh, owner.layout
        self.infos = []
        for k, leaf in enumerate(leaves):
            if is_named(leaf):
                axes = effective(layout.tensor_axes(leaf.dims, mesh, storage=leaf.is_param, what=f"argument {k} "
                                                    f"({'parameter' if leaf.is_param else 'input'})"), mesh)
                self.infos.append(_Leaf(True, leaf.dims, leaf.is_param, axes, to_spec(axes)))
            else:
                self.infos.append(_Leaf(False))
        self.out_tree = None
        self.out_templates: list = []
        self.last_ctx = None
        self.compiled = None
        self.out_axes: list = []   # factor axes per dim of each output (() for a plain array)
        self._jitted = None
        self.plan = None       # the whole-program plan the program follows (meshdsl.planner), if kept
        self.solved = None     # the plan the solver found (followed or not), for md.explain
        self._recording = False  # the trace under way is the planning trace
        self._planned = False
        # parameters a layout offloads (``offload="params"``) enter in host memory
        self.host = [bool(i.named and i.is_param and "params" in layout.offload) for i in self.infos]
        if not mesh.is_abstract:
            self.shardings = [NamedSharding(mesh.jax_mesh, mesh_spec(mesh, i.axes),
                                            memory_kind=HOST_MEMORY if host else None)
                              for i, host in zip(self.infos, self.host)]

    def avals(self, arrays) -> list:
        """The arguments' shapes and dtypes (and host memory, for offloaded parameters)."""
        host = NamedSharding(self.owner.mesh.jax_mesh, PartitionSpec(), memory_kind=HOST_MEMORY)
        return [jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=host) if h else v
                for v, h in zip((_aval(a) for a in arrays), self.host)]

    def jitted(self, arrays):
        """``jax.jit`` of the program with the inputs' and the outputs' shardings. The outputs'
        are known once traced (from their dims), so the first call traces (shapes only) to learn
        them: a jit without ``out_shardings`` hits a jax 0.10.2 cache bug when another mesh
        shape with the same axis names ran before (gradients around the function fail)."""
        if self._jitted is None:  # traced once: the jit compiles the traced program
            closed = self.make_jaxpr(self.avals(arrays))
            mesh = self.owner.mesh
            hosts = [t is not None and t[1] and "params" in self.owner.layout.offload for t in self.out_templates]
            outs = [NamedSharding(mesh.jax_mesh, mesh_spec(mesh, axes), memory_kind=HOST_MEMORY if host else None)
                    for axes, host in zip(self.out_axes, hosts)]
            self._jitted = jax.jit(jaxpr_as_fun(closed), in_shardings=self.shardings, out_shardings=outs)
        return self._jitted

    def make_jaxpr(self, avals):
        """The traced program: a planning trace (:mod:`meshdsl.planner`: the rules' own choices,
        each op's candidates priced apart), the solve, and - where the plan differs from the rules'
        own choices - an emitting trace following it. The trace best by the objective is kept (its
        predicted step time, or the bytes it moves) of those whose peak memory (:func:`meshdsl.costmodel.liveness.memory`)
        fits ``memory_budget``. The solve is unconstrained first (where its plan's trace fits, no
        constraint could improve it: the graph's memory is an estimate that errs high as well as
        low); where no trace fits, it runs again holding at most the budget less what the graph's
        estimate missed of the traced peak, then the graph's least, and at last a
        :class:`MemoryBudgetError`."""
        planning = self.owner.backend == "explicit" and not self._planned and self.owner.planner
        self._recording = planning
        closed = _traced(self.run, avals)
        self._recording = False
        if not planning:
            return closed
        self._planned = True
        ctx, hw, budget = self.last_ctx, self.owner.hardware, self.owner.memory_budget
        recording, ctx.planner = ctx.planner, None
        recording.unread = unread(closed, recording)   # forward values the program drops
        measure = (lambda c, x: _seconds(c, x, hw)) if self.owner.objective == "time" else _moved
        rules = _RulesTrace(closed, budget)   # its peak walked only where a budget needs it
        best = None          # (cost, trace, context, plan) of the best plan traced that fits
        least = None         # (peak, what) of the least a plan traced holds
        limit = None   # the unconstrained optimum first: where its trace fits, it is the plan
        least_tried = False
        for _ in range(1 if budget is None else 4):
            try:
                # the plan of the objective (a loop's carries settle where it says: planner/carries.py)
                plan = choose(ctx, recording, objective=self.owner.objective, hardware=hw, memory_budget=limit)
            except NoPlanFits as e:
                if best is None and limit is not None and limit < e.least and not least_tried:
                    # less than the graph's least asked: its least, traced (it may fit where the
                    # graph's estimate errs high)
                    limit, least_tried = e.least * (1 + 1e-9), True
                    continue
                if best is None and not rules.fits:   # (the graph's estimate errs high: the rules' may fit)
                    raise _no_plan_fits(budget, f"the least the planner finds is {fmt_bytes(e.least)} (values "
                                        f"held from their producer to their last reader, the backward pass's "
                                        f"to the end)") from None
                break
            self.solved = plan   # the latest solve: the budget it kept
            best, least, over = self._weigh([plan], avals, rules, best, least, measure)
            if not over:
                break
            # a plan the graph thought fits does not: ask the solve for its graph's estimate less
            # its traced excess (the budget less what the estimate missed of the traced peak):
            # less than that plan holds as the graph sees it, so another plan, and no less than
            # the graph's own differences between plans say fits (it errs high as well as low)
            limit = budget - max(m for _, m in over)
        # the rules' own trace is kept where no plan's trace is better and it fits
        if (best is None or measure(closed, ctx) <= best[0]) and rules.fits:
            best = (None, closed, ctx, None)
        if best is None:
            found = min([(rules.peak, "the rules' own choices")] + ([least] if least else []))
            raise _no_plan_fits(budget, f"the least peak found is {fmt_bytes(found[0])} ({found[1]})")
        _, closed, self.last_ctx, self.plan = best
        self.solved = self.plan or self.solved
        return closed

    def _weigh(self, plans, avals, rules, best, least, measure) -> tuple:
        """Each plan other than the rules' own choices traced, and kept as ``best`` (cost, trace,
        context, plan) where its peak fits the budget and ``measure`` prices it under the best so
        far: ``(best, least peak a plan traced holds, over)``, ``over`` the (excess, what the
        graph's estimate missed) of each plan whose trace does not fit (the rules' own choices
        among them, asked for again where they do not)."""
        budget = self.owner.memory_budget
        over = []
        for plan in plans:
            if not plan.choice:
                if budget is not None and not rules.fits:   # the rules' own choices again, which do not fit
                    over.append((rules.peak - budget, rules.peak - plan.graph.memory(plan.solution.choice)))
                continue
            if plan.gain <= 0.5 and budget is None:
                continue   # as good as the rules' own choices: their trace is the program
            self.plan = plan
            planned = _traced(self.run, avals)
            used = _peak(planned) if budget is not None else 0.0
            least = min(least or (used, "the plan"), (used, "the plan"))
            if budget is not None and used > budget:
                over.append((used - budget, used - plan.graph.memory(plan.solution.choice)))
                continue
            cost = measure(planned, self.last_ctx)
            if best is None or cost < best[0]:
                best = (cost, planned, self.last_ctx, plan)
        return best, least, over

    # -- the traced program ----------------------------------------------------------------------

    def run(self, *arrays):
        if self.owner.backend == "gspmd":
            return self._run_gspmd(arrays)
        return self._run_explicit(arrays, param_gather.make(self.owner.param_gather))

    def _run_explicit(self, arrays, policy):
        # jax.shard_map reads out_specs once the body is traced: the body fills this list with the
        # layout's placement of each output (known only from the outputs' dims).
        specs: list = []
        body = functools.partial(self._explicit_body, policy=policy, out_specs=specs)
        smap = jax.shard_map(body, mesh=self.owner.mesh.factor_mesh, in_specs=tuple(i.spec for i in self.infos),
                             out_specs=specs, check_vma=True)
        return smap(*arrays)

    def _args(self, arrays, explicit: bool):
        leaves = [NamedArray(a, i.dims, is_param=i.is_param, placement=Placement(i.axes) if explicit else None)
                  if i.named else a for a, i in zip(arrays, self.infos)]
        return jax.tree_util.tree_unflatten(self.treedef, leaves)

    def _explicit_body(self, *arrays, policy, out_specs):
        owner = self.owner
        ctx = ExplicitContext(owner.mesh, owner.layout, params=policy, schedule=owner.schedule,
                              repeats=owner.repeats, attention=owner.attention)
        if self.plan is not None:
            ctx.planner = Recording(self.plan.choice, self.plan.sinks, self.plan.carries)
        elif self._recording:
            ctx.planner = Recording()
        self.last_ctx = ctx
        ctx.dims_seen.update(n for i in self.infos if i.named for n in i.dims.names)
        ctx.param_axes = frozenset(a for i in self.infos if i.named and not i.is_param for ax in i.axes for a in ax)
        with using(ctx):
            out = owner.fn(*self._args(arrays, True))
            with ctx.at("output", "return value"):
                results, self.out_axes = self._explicit_outputs(ctx, out)
                out_specs[:] = [to_spec(axes) for axes in self.out_axes]
            _check_unused_rules(owner.layout, ctx.dims_seen, strict=owner.unused_rules == "error")
        ctx.rec.tracing = False
        policy.finish()
        return results

    def _explicit_outputs(self, ctx, out):
        """Local blocks of the outputs in the layout's placement, and their factor axes per dim."""
        leaves, self.out_tree = jax.tree_util.tree_flatten(out, is_leaf=is_named)
        results, placed, self.out_templates = [], [], []
        for k, leaf in enumerate(leaves):
            if is_named(leaf):
                axes = effective(self.owner.layout.tensor_axes(leaf.dims, self.owner.mesh, storage=leaf.is_param,
                                                               what=f"output {k}"), self.owner.mesh)
                results.append(self._output(ctx, leaf, axes))
                placed.append(axes)
                self.out_templates.append((leaf.dims, leaf.is_param))
                continue
            arr = jnp.asarray(leaf)
            if varying_axes(arr):
                vary = ctx.mesh.axes_text([a for a in ctx.mesh.factor_axes if a in varying_axes(arr)])
                raise LayoutError(
                    f"output {k} is a plain jax array that differs between devices (it varies over "
                    f"{vary}); return NamedArrays so the layout can place them")
            results.append(arr)
            placed.append(())
            self.out_templates.append(None)
        return results, placed

    def _output(self, ctx, leaf, axes):
        """An output's local block in ``axes``; a parameter's (its gradient, its update) where the
        layout offloads parameters: in host memory, left there when it is already in place."""
        if not self._host_output(leaf):
            return ctx.finalize(leaf, axes)
        if host_resident(leaf.raw) and ctx.placement(leaf).axes == tuple(axes) and not ctx.pending(leaf):
            return leaf.raw
        return jaxcompat.to_memory(ctx.finalize(leaf, axes), "host")

    def _host_output(self, leaf) -> bool:
        return bool(leaf.is_param and "params" in self.owner.layout.offload)

    def _run_gspmd(self, arrays):
        owner = self.owner
        ctx = GspmdContext(owner.mesh, owner.layout)
        ctx.dims_seen.update(n for i in self.infos if i.named for n in i.dims.names)
        with using(ctx):
            out = owner.fn(*self._args(arrays, False))
            leaves, self.out_tree = jax.tree_util.tree_flatten(out, is_leaf=is_named)
            results, self.out_templates, self.out_axes = [], [], []
            for leaf in leaves:
                if is_named(leaf):
                    axes = effective(owner.layout.tensor_axes(leaf.dims, owner.mesh, storage=leaf.is_param), owner.mesh)
                    results.append(jax.lax.with_sharding_constraint(
                        leaf.raw, NamedSharding(owner.mesh.jax_mesh, mesh_spec(owner.mesh, axes))))
                    self.out_templates.append((leaf.dims, leaf.is_param))
                    self.out_axes.append(axes)
                else:
                    results.append(jnp.asarray(leaf))
                    self.out_templates.append(None)
                    self.out_axes.append(())
            _check_unused_rules(owner.layout, ctx.dims_seen, strict=owner.unused_rules == "error")
        return results

    def rebuild(self, arrays):
        """The user's output tree of global NamedArrays from the compiled function's arrays."""
        leaves = [a if t is None else NamedArray(a, t[0], is_param=t[1]) for a, t in zip(arrays, self.out_templates)]
        return jax.tree_util.tree_unflatten(self.out_tree, leaves)


def _aval(a):
    """Shape and dtype of an argument (array, tracer, PRNG key or Python scalar)."""
    if hasattr(a, "shape") and hasattr(a, "dtype"):
        return jax.ShapeDtypeStruct(a.shape, a.dtype)
    a = jnp.asarray(a)
    return jax.ShapeDtypeStruct(a.shape, a.dtype)


def _check_unused_rules(layout: Layout, seen: set, strict: bool = False) -> None:
    """A rule for a dim the program never has is fine (a shared layout), unless it looks like a
    typo of a dim the program has and the layout does not place: it would be silently ignored.
    ``strict`` (``md.lower(..., unused_rules="error")``): every rule must match a dim of the program."""
    unplaced = seen - layout.dim_names()
    for dim in sorted(layout.dim_names() - seen):
        hint = suggest(dim, unplaced, cutoff=0.8)
        if hint:
            raise LayoutError(f"layout rule for {dim!r} matches no dim of the program{hint}; "
                              f"fix the dim name in the layout")
        if strict:
            kind = "layout rule" if dim in layout.rules else "params rule"
            dims = ", ".join(sorted(d for d in seen if not d.endswith("_")))   # (a trailing _: an op's own)
            raise LayoutError(f"{kind} for {dim!r} matches no dim of the program (its dims: {dims})"
                              f"{suggest(dim, seen)}; drop the rule or name one of these dims "
                              f"(md.lower(..., unused_rules='error'))")


def _no_plan_fits(budget, least: str) -> MemoryBudgetError:
    """The error where no plan holds at most ``budget`` bytes per device (``least``: what the
    least found was, and where)."""
    return MemoryBudgetError(f"no plan of this program holds at most memory_budget={fmt_bytes(budget)} per device: "
                       f"{least}; raise memory_budget, split more of the program's dims over the mesh (or store "
                       f"parameters split: params= rules), or rematerialise activations (jax.checkpoint around "
                       f"a layer)")


def _moved(closed, ctx) -> float:
    """Bytes a traced program moves per device, as :func:`meshdsl.explain` counts them: its
    recorded collectives, as often as the live program runs each (dead ones dropped)."""
    runs = jaxpr_stats.name_scopes(simplify.live(jaxpr_stats.inner_body(closed), ctx.mesh.platform))
    return sum(r.bytes * runs[r.tag] for r in ctx.rec.records)


class _RulesTrace:
    """The planning trace (the rules' own choices): its peak bytes per device walked once, where
    a budget asks whether it fits."""

    def __init__(self, closed, budget):
        self.closed, self.budget, self._peak = closed, budget, None

    @property
    def peak(self) -> float:
        if self._peak is None:
            self._peak = _peak(self.closed) if self.budget is not None else 0.0
        return self._peak

    @property
    def fits(self) -> bool:
        return self.budget is None or self.peak <= self.budget


def _peak(closed) -> float:
    """A traced program's peak bytes per device, as :func:`meshdsl.explain` reports it."""
    return liveness.memory(simplify.live(jaxpr_stats.inner_body(closed)))["peak"]


def _seconds(closed, ctx, hardware) -> float:
    """A traced program's predicted step time on ``hardware`` (:mod:`meshdsl.costmodel.step_time`): its
    kernels and its recorded collectives, as often as the live program runs each."""
    body = simplify.live(jaxpr_stats.inner_body(closed), ctx.mesh.platform)
    runs = jaxpr_stats.name_scopes(body)
    collectives = [dataclasses.replace(r, count=runs[r.tag]) for r in ctx.rec.records if runs[r.tag]]
    program = types.SimpleNamespace(mesh=ctx.mesh, collectives=collectives, flops=0.0, bytes_accessed=0.0,
                                    kernels=roofline.program_kernels(body, ctx.attentions))
    return predict(program, hardware).total_s


def _traced(run, avals):
    """``run`` traced to a jaxpr, as a trace of its own: what jax traced in an earlier trace (a
    jax.checkpoint'ed function) runs its rules again (:func:`meshdsl.platform.jaxcompat.fresh`), Python's
    cyclic garbage collector paused (:mod:`meshdsl.platform.gcpause`)."""
    with jaxcompat.fresh(), gcpause.paused():
        return jax.make_jaxpr(run)(*avals)
