"""``md.explain``: what a layout costs, before compiling.

``md.explain(fn, mesh, layout, *args)`` traces ``fn`` through the explicit rewriter (no compile,
abstract shapes are fine, and an abstract mesh of any size works) and returns a :class:`Report`:

* every collective the rewriter will emit: the op and user source line that needs it, kind, mesh
  axes, local shape, dtype, bytes moved per device (ring formulas, as ``hlo_comm`` counts them on
  the compiled HLO), and how many times it runs (scan trip counts); backward-pass collectives too
  when ``fn`` takes gradients;
* matmul FLOPs per device and a memory estimate per device (:mod:`meshdsl.costmodel.jaxpr_stats`).

``report.summary()`` has the same shape as ``hlo_comm``'s (kind -> count, bytes), so the two can be
compared number for number. ``to_markdown()``, ``to_dict()``; :mod:`meshdsl.views.display` adds an HTML
view for notebooks.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.extend

from ..costmodel import jaxpr_stats, liveness, roofline, simplify
from ..costmodel.cost import KINDS
from ..lowering.lower import lower
from ..names.named import is_named
from ..planner.plan import decisions, priced
from ..costmodel.step_time import StepTime, predict
from ..names.units import fmt_bytes, fmt_flops, fmt_seconds

__all__ = ["explain", "Report", "ROW_HEAD", "row_cells"]

ROW_HEAD = ("phase", "op", "line", "kind", "axes", "local shape", "dtype", "count", "bytes/device", "what")


def row_cells(r) -> tuple:
    """One collective record as the cells of a report's table (markdown and HTML alike)."""
    return (r.phase, r.op, r.line, r.kind, "+".join(r.axes), "x".join(map(str, r.shape)) or "scalar",
            r.dtype, str(r.count), fmt_bytes(r.total_bytes), r.tensor)


@dataclasses.dataclass
class Report:
    """The cost of one program under one layout, per device."""

    mesh: str
    layout: str
    collectives: list
    flops: float
    memory: dict
    pipeline: dict | None = None   # stages, microbatches, schedule, ticks, bubble_fraction (if any)
    bytes_accessed: float | None = None   # HBM bytes read and written per device (jaxpr_stats.bytes_accessed)
    plan_decisions: list = dataclasses.field(default_factory=list)   # see decisions()
    planned: dict = dataclasses.field(default_factory=dict)   # the solved plan as its graph prices it: bytes, memory
    attention: list = dataclasses.field(default_factory=list)   # each md.attention: strategy, bytes, memory, balance
    kernels: list = dataclasses.field(default_factory=list)   # the program's kernels (meshdsl.costmodel.roofline.Kernel)
    compile: object = dataclasses.field(default=None, repr=False, compare=False)  # concrete mesh: -> compiled

    def compiled_memory(self) -> dict | None:
        """The compiled program's memory per device (``arguments``, ``outputs``, ``temporaries``:
        XLA's ``memory_analysis``), next to the estimate in :attr:`memory`; compiled once, on first
        use; ``None`` on an abstract mesh. The estimate walks the traced program (what lives when);
        XLA also reuses buffers and fuses, so its temporaries can be smaller."""
        if self.compile is None:
            return None
        if not hasattr(self, "_compiled_memory"):
            ma = self.compile().memory_analysis()
            self._compiled_memory = {"arguments": ma.argument_size_in_bytes, "outputs": ma.output_size_in_bytes,
                                     "temporaries": ma.temp_size_in_bytes}
        return self._compiled_memory

    def summary(self) -> dict:
        """kind -> {"count": executions, "bytes": bytes moved per device} (like ``hlo_comm``)."""
        out = {}
        for r in self.collectives:
            row = out.setdefault(r.kind, {"count": 0, "bytes": 0.0})
            row["count"] += r.count
            row["bytes"] += r.total_bytes
        return {k: out[k] for k in KINDS if k in out}

    def decisions(self) -> list:
        """Where the planner weighed candidates (:mod:`meshdsl.planner`): per op, the placement
        chosen (``chosen``: where its operands enter, which candidate of the rule's own), the bytes
        of the whole plan, and the next-best candidate with the plan's bytes had that op taken it
        (``next``, ``next_bytes``); under the time objective also the plan's predicted seconds
        (communication and compute) with each (``seconds``, ``next_seconds``); ``followed`` is
        False where the rules' own choices moved fewer bytes when traced (the bytes objective),
        and ran instead."""
        return [dict(d) for d in self.plan_decisions]

    def time(self, hardware, *, overlap: float = 0.0, dtype: str = "bfloat16") -> StepTime:
        """The step time this report predicts on ``hardware`` (an :class:`meshdsl.Hardware`:
        a profile such as ``md.Hardware.profile("h100-80gb")`` or ``md.Hardware.measure(mesh)``):
        compute, communication per collective on the link its axes run on, and their sum less
        ``overlap`` of the shorter (:mod:`meshdsl.costmodel.step_time`)."""
        return predict(self, hardware, overlap=overlap, dtype=dtype)

    @property
    def total_bytes(self) -> float:
        return sum(r.total_bytes for r in self.collectives)

    def counts(self) -> dict:
        return {k: v["count"] for k, v in self.summary().items()}

    def to_dict(self) -> dict:
        return {"mesh": self.mesh, "layout": self.layout, "flops_per_device": self.flops,
                "bytes_accessed_per_device": self.bytes_accessed,
                "memory_per_device": dict(self.memory), "total_bytes_per_device": self.total_bytes,
                "summary": self.summary(), "collectives": [r.as_dict() for r in self.collectives],
                "pipeline": None if self.pipeline is None else dict(self.pipeline), "decisions": self.decisions(),
                "attention": [dict(a) for a in self.attention],
                "kernels": [dataclasses.asdict(k) for k in self.kernels],
                "compiled_memory_per_device": self.compiled_memory()}

    def to_markdown(self) -> str:
        lines = [f"**mesh** {self.mesh} · **layout** `{self.layout}`", "",
                 f"communication {fmt_bytes(self.total_bytes)} per device · matmul {fmt_flops(self.flops)} "
                 f"per device · memory {fmt_bytes(self.memory['peak'])} per device (arguments "
                 f"{fmt_bytes(self.memory['arguments'])}, outputs {fmt_bytes(self.memory.get('outputs', 0))}, "
                 f"temporaries {fmt_bytes(self.memory['temporaries'])}){compiled_note(self)}", ""]
        moved = self.memory.get("transfers", {})
        if any(moved.values()):
            lines += [f"host memory {fmt_bytes(self.memory.get('host', 0))} per device; host link "
                      f"{fmt_bytes(moved['to host'])} to the host and {fmt_bytes(moved['to device'])} to the device "
                      f"per device", "", "| phase | line | direction | count | bytes/device | total |",
                      "| --- | --- | --- | ---: | ---: | ---: |"]
            lines += [f"| {r['phase']} | {r['line']} | {r['direction']} | {r['count']} | {fmt_bytes(r['bytes'])} "
                      f"| {fmt_bytes(r['total'])} |" for r in self.memory.get("host_transfers", [])]
            lines.append("")
        if self.pipeline:
            p = self.pipeline
            sched = p["schedule"] + (f", {p['repeats']} repeats" if "repeats" in p else "")
            lines += [f"pipeline ({sched}) over {p['axis']}: {p['stages']} stages, {p['microbatches']} "
                      f"microbatch{'es' * (p['microbatches'] > 1)}, {p['ticks']} ticks, bubble "
                      f"{p['bubble_fraction']:.0%}" + (" (one microbatch: all bubble; set md.Layout(..., "
                                                      "microbatches=...))" if p["microbatches"] == 1 else "")
                      + (f"; at most {p['in_flight']} microbatch inputs kept per stage" if "in_flight" in p else ""),
                      ""]
        lines += _attention_lines(self.attention)
        lines += ["| kind | count | bytes/device |", "| --- | ---: | ---: |"]
        for kind, row in self.summary().items():
            lines.append(f"| {kind} | {row['count']} | {fmt_bytes(row['bytes'])} |")
        if not self.collectives:
            lines.append("| (none) | 0 | 0 B |")
        if self.collectives:
            lines += ["", "| " + " | ".join(ROW_HEAD) + " |", "|" + " --- |" * len(ROW_HEAD)]
            lines += ["| " + " | ".join(row_cells(r)) + " |" for r in self.collectives]
        if self.plan_decisions:
            lines += [""] + _decision_rows(self.plan_decisions)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_markdown()


def _decision_rows(rows) -> list:
    """The decisions' markdown table (with the plans' predicted times under the time objective)."""
    timed = "seconds" in rows[0]
    time_of = (lambda seconds: f" {fmt_seconds(seconds)} |") if timed else (lambda seconds: "")
    head = ["| decision | chosen | plan bytes |" + (" plan time |" if timed else "") + " next best | its plan bytes |"
            + (" its plan time |" if timed else ""),
            "| --- | --- | ---: |" + (" ---: |" if timed else "") + " --- | ---: |" + (" ---: |" if timed else "")]
    return head + [f"| {d['op']} | {d['chosen']} | {fmt_bytes(d['bytes'])} |{time_of(d.get('seconds'))} {d['next']} | "
                   f"{fmt_bytes(d['next_bytes'])} |{time_of(d.get('next_seconds'))}" for d in rows]


def compiled_note(report) -> str:
    """``; compiled: arguments .., outputs .., temporaries ..`` where the mesh is concrete, else ``""``."""
    compiled = report.compiled_memory()
    if compiled is None:
        return ""
    return (f"; compiled: arguments {fmt_bytes(compiled['arguments'])}, outputs {fmt_bytes(compiled['outputs'])}, "
            f"temporaries {fmt_bytes(compiled['temporaries'])}")


def explain(fn, mesh, layout, *args, param_gather: str = "keep", schedule: str = "gpipe",
            repeats: int = 1, planner: bool = True, attention: str | None = None, unused_rules: str = "allow",
            objective: str = "time", hardware=None, memory_budget=None) -> Report:
    """Trace ``fn(*args)`` under ``mesh`` and ``layout`` (explicit backend) without compiling;
    the options as in :func:`meshdsl.lower` (``objective`` and ``hardware``: what the plan
    minimises, on which machine; ``memory_budget``: the bytes per device it may hold)."""
    f = lower(fn, mesh, layout, param_gather=param_gather, schedule=schedule, repeats=repeats, planner=planner,
              attention=attention, unused_rules=unused_rules, objective=objective, hardware=hardware,
              memory_budget=memory_budget)
    closed, ctx, prog = f.trace(*args)
    body = simplify.live(jaxpr_stats.inner_body(closed), ctx.mesh.platform)
    runs = jaxpr_stats.name_scopes(body)
    kept = []
    for r in ctx.rec.records:  # as often as the program runs it: dead ones dropped, replays counted
        if runs[r.tag] == r.count:
            kept.append(r)
        elif runs[r.tag]:
            note = " (runs again in the backward pass)" if runs[r.tag] > r.count else " (hoisted out of the loop)"
            kept.append(dataclasses.replace(r, count=runs[r.tag], tensor=r.tensor + note))
    memory = liveness.memory(body)
    memory["host_transfers"] = liveness.host_transfer_rows(body)
    memory["transfers"] = liveness.host_transfers(memory["host_transfers"])
    memory["kinds"] = _kinds(args, prog, jaxpr_stats.inner_body(closed), body, memory)
    return Report(mesh=str(mesh), layout=str(layout), collectives=kept,
                  flops=jaxpr_stats.matmul_flops(body), memory=memory,
                  bytes_accessed=jaxpr_stats.bytes_accessed(body), kernels=roofline.program_kernels(body, ctx.attentions),
                  pipeline=_pipeline_entry(ctx.pipelines), attention=[dict(a) for a in ctx.attentions],
                  plan_decisions=[] if prog.solved is None else decisions(prog.solved, prog.plan is not None or not prog.solved.choice),
                  planned={} if prog.solved is None else priced(prog.solved),
                  compile=None if f.mesh.is_abstract else (lambda: f.lower(*args).compile()))


_OPTIMIZER_KEYS = ("opt_state", "mu", "nu")   # nnx.Optimizer's and optax's Adam state's names


def _kinds(args, prog, whole, body, memory) -> dict:
    """The peak's bytes per device by what holds them: arguments (``parameters`` - marked
    ``md.param`` -, ``optimizer state`` - under a key named ``opt_state``, ``mu`` or ``nu`` -,
    other ``inputs``), outputs (``parameter outputs``: gradients or updated parameters, marked
    ``md.param``; ``other outputs``) and the temporaries live at the peak by what made them
    (``memory["breakdown"]``: activations kept for the backward pass, collective buffers,
    matmul results, other temporaries). They add up to ``memory["peak"]`` (an argument the
    program never reads is in neither)."""
    kinds: dict = {}

    def add(kind, nbytes):
        if nbytes:
            kinds[kind] = kinds.get(kind, 0) + nbytes
    leaves = jax.tree_util.tree_flatten_with_path(args, is_leaf=is_named)[0]
    read = set(body.invars)   # the program's live arguments (``whole``: all of them, in order)
    if len(leaves) == len(whole.invars) and read <= set(whole.invars):
        for (path, leaf), var in zip(leaves, whole.invars):
            if var not in read:
                continue
            keys = {str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", "")))) for k in path}
            kind = ("optimizer state" if keys & set(_OPTIMIZER_KEYS) else
                    "parameters" if is_named(leaf) and leaf.is_param else "inputs")
            add(kind, jaxpr_stats.nbytes(var.aval))
    else:
        add("arguments", memory["arguments"])
    if len(prog.out_templates) == len(body.outvars):
        for template, var in zip(prog.out_templates, body.outvars):
            if isinstance(var, jax.extend.core.Var):
                add("parameter outputs" if template and template[1] else "other outputs", jaxpr_stats.nbytes(var.aval))
    else:
        add("outputs", memory["outputs"])
    for kind, nbytes in memory["breakdown"].items():
        add(kind, nbytes)
    return kinds


def _attention_lines(entries) -> list:
    if not entries:
        return []
    lines = ["| attention | strategy | axes | devices | bytes/ring step | forward | backward | kept memory | balance |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for e in entries:
        balance = "-" if e["balance"] is None else f"{e['balance']:.2f}"
        lines.append(f"| {e['op']} | {e['strategy']} | {'+'.join(e['axes']) or '-'} | {e['devices']} | "
                     f"{fmt_bytes(e['bytes_per_step'])} | {fmt_bytes(e['forward_bytes'])} | "
                     f"{fmt_bytes(e['backward_bytes'])} | {fmt_bytes(e['memory']['kept'])} | {balance} |")
    return lines + [""]


def _pipeline_entry(pipelines) -> dict | None:
    """The program's pipeline: the first; when there are several, how many (``count``) and each
    in program order (``each``: the T5 encoder's GPipe and its decoder's 1F1B)."""
    if not pipelines:
        return None
    entry = dict(pipelines[0])
    if len(pipelines) > 1:
        entry["count"] = len(pipelines)
        entry["each"] = [dict(p) for p in pipelines]
    return entry
