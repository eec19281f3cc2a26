"""hlo_comm: collective-communication accounting for compiled XLA HLO.

Given a compiled JAX object (``jax.jit(f).lower(*args).compile()``) or the
text of an HLO module (``compiled.as_text()``, an XLA dump file, ...), find
every collective operation and report, per collective kind:

* ``count``          - number of collective instructions (times the trip count
                       of enclosing while loops when XLA knows it),
* ``operand_bytes``  - total bytes of the operand shapes (per device),
* ``result_bytes``   - total bytes of the result shapes (per device),
* ``moved_bytes``    - bytes actually sent per device, with the usual
                       bandwidth-optimal (ring) formulas, ``n`` = group size:

      all-reduce            2 (n-1)/n * S        S = buffer size
      all-gather            (n-1)/n * S_full     S_full = gathered result
      reduce-scatter        (n-1)/n * S_full     S_full = un-scattered operand
      all-to-all            (n-1)/n * S          S = operand size
      ragged-all-to-all     (n-1)/n * S          S = data operand (a bound: the rows sent vary)
      collective-permute    S                    (per sending device)
      collective-broadcast  S

Kinds recognised: all-reduce, all-gather, reduce-scatter, all-to-all,
ragged-all-to-all, collective-permute, collective-broadcast, in their
synchronous form, their ``-start``/``-done`` async form (counted once, at the
``-start``), and wrapped in ``async-start`` (counted inside the wrapped
computation).  Tuple shapes (variadic collectives) are summed.  Group sizes
come from ``replica_groups`` (explicit ``{{0,1},{2,3}}``, iota
``[2,4]<=[8]`` / ``[4,2]<=[2,4]T(1,0)``, Shardy mesh axes
``mesh['x'=2,'y'=4] {'y'}``, or empty = all devices) or from
``source_target_pairs``.

Caveats: the per-device numbers assume every group has the same size (true
for SPMD programs); the formulas are the ring lower bounds, not what a given
backend's algorithm really sends; collectives in a while loop whose trip
count XLA does not know are counted once (``unknown_trip_count`` is set).
On the CPU backend XLA promotes bf16/f16 all-reduces to f32, so bytes there
are twice what a GPU/TPU would move.

Python API::

    from meshdsl.costmodel import hlo_comm
    rep = hlo_comm.analyze(jax.jit(f).lower(x).compile())
    print(rep.table())
    rep.summary()["all-reduce"]["moved_bytes"]
    rep.collectives            # list of Collective records

CLI::

    python -m meshdsl.costmodel.hlo_comm module.hlo.txt [--json] [--details]
    python -m meshdsl.costmodel.hlo_comm --demo  # Megatron MLP on 8 virtual CPU devices

Only the Python standard library is needed (``--demo`` needs JAX).
Tests: ``tests/tools/test_hlo_comm.py`` (hand-written HLO, no JAX).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from collections.abc import Iterable
from typing import Any

from .hlo_text import (
    CALLEE_RE,
    DTYPE_BYTES,
    OPNAME_RE,
    TRIP_RE,
    attr,
    group_shape,
    operand_shape,
    parse_computations,
    shape_bytes,
    shape_str,
)

__all__ = [
    "DTYPE_BYTES",
    "KINDS",
    "Collective",
    "CommReport",
    "analyze",
    "parse_hlo_text",
    "shape_bytes",
]

KINDS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
    "collective-broadcast",
)


# --------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------


@dataclasses.dataclass
class Collective:
    """One collective instruction (per-device view)."""

    kind: str               # canonical kind, e.g. "all-gather"
    opcode: str             # raw opcode, e.g. "all-gather-start"
    name: str               # instruction name
    computation: str        # enclosing computation
    operand_shape: str
    result_shape: str
    operand_bytes: float
    result_bytes: float
    group_size: int         # devices per replica group (2 for a permute)
    num_groups: int         # replica groups (source/target pairs for a permute)
    multiplier: int = 1     # executions (known while-loop trip counts)
    op_name: str = ""       # jax op_name metadata, when present
    unknown_trip_count: bool = False

    @property
    def logical_bytes(self) -> float:
        """The ``S`` of the ring formula for this kind."""
        if self.kind == "all-gather":
            return self.result_bytes
        if self.kind == "all-reduce":
            return max(self.result_bytes, self.operand_bytes)
        return self.operand_bytes

    @property
    def moved_bytes(self) -> float:
        """Bytes sent per device, one execution (ring formulas)."""
        n, s = self.group_size, self.logical_bytes
        if self.kind in ("collective-permute", "collective-broadcast"):
            return s if n > 1 else 0.0
        if n <= 1:
            return 0.0
        if self.kind == "all-reduce":
            return 2.0 * (n - 1) / n * s
        return (n - 1) / n * s

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["logical_bytes"] = self.logical_bytes
        d["moved_bytes"] = self.moved_bytes
        return d


@dataclasses.dataclass
class CommReport:
    module_name: str
    num_partitions: int
    replica_count: int
    collectives: list

    def summary(self) -> dict:
        """kind -> {count, operand_bytes, result_bytes, moved_bytes}
        (all multiplied by known loop trip counts)."""
        out = {}
        for c in self.collectives:
            row = out.setdefault(c.kind, {"count": 0, "operand_bytes": 0.0,
                                          "result_bytes": 0.0, "moved_bytes": 0.0})
            k = c.multiplier
            row["count"] += k
            row["operand_bytes"] += k * c.operand_bytes
            row["result_bytes"] += k * c.result_bytes
            row["moved_bytes"] += k * c.moved_bytes
        return {k: out[k] for k in KINDS if k in out}

    def total_moved_bytes(self) -> float:
        return sum(r["moved_bytes"] for r in self.summary().values())

    def counts(self) -> dict:
        return {k: v["count"] for k, v in self.summary().items()}

    def table(self, details: bool = False) -> str:
        head = (f"module {self.module_name}: {self.num_partitions} partitions"
                f" x {self.replica_count} replicas")
        lines = [head,
                 f"{'kind':<22}{'count':>6}{'operand B':>14}{'result B':>14}{'moved B/dev':>14}"]
        for kind, r in self.summary().items():
            lines.append(f"{kind:<22}{r['count']:>6}{_fmt(r['operand_bytes']):>14}"
                         f"{_fmt(r['result_bytes']):>14}{_fmt(r['moved_bytes']):>14}")
        if not self.collectives:
            lines.append("(no collectives)")
        lines.append(f"{'total':<22}{sum(self.counts().values()):>6}{'':>28}"
                     f"{_fmt(self.total_moved_bytes()):>14}")
        if details:
            for c in self.collectives:
                mult = f" x{c.multiplier}" if c.multiplier != 1 else ""
                unk = " (unknown trip count)" if c.unknown_trip_count else ""
                lines.append(f"  {c.name}: {c.opcode} {c.operand_shape} -> {c.result_shape}"
                             f" n={c.group_size} groups={c.num_groups}{mult}{unk}"
                             f" moved={_fmt(c.moved_bytes)}  [{c.op_name}]")
        return "\n".join(lines)

    def to_json(self, details: bool = False) -> str:
        d: dict = {"module": self.module_name, "num_partitions": self.num_partitions,
                   "replica_count": self.replica_count, "summary": self.summary()}
        if details:
            d["collectives"] = [c.as_dict() for c in self.collectives]
        return json.dumps(d, indent=2)


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.1f}"


# --------------------------------------------------------------------------
# Main entry points
# --------------------------------------------------------------------------


def _canonical(opcode: str) -> str | None:
    if opcode in KINDS:
        return opcode
    if opcode.endswith("-start") and opcode[:-6] in KINDS:
        return opcode[:-6]
    return None


def _executions(comps: dict, entry: str | None) -> tuple:
    """Executions per computation (while trip counts along the call graph): (computation -> count,
    computation -> inside a while loop whose trip count XLA does not know)."""
    edges: dict = {c: [] for c in comps}   # caller -> [(callee, factor, unknown)]
    for cname, instrs in comps.items():
        for ins in instrs:
            for key, val in CALLEE_RE.findall(ins.attrs):
                if key == "to_apply":
                    continue  # reducers: scalar code, never collectives
                for callee in re.findall(r"%?([\w.\-]+)", val.strip("{}")):
                    if callee not in comps:
                        continue
                    factor, unknown = 1, False
                    if ins.opcode == "while" and key == "body":
                        t = TRIP_RE.search(ins.attrs)
                        factor, unknown = (int(t.group(1)), False) if t else (1, True)
                    edges[cname].append((callee, factor, unknown))
    mult: dict = {}
    unknown_loop: dict = {}

    def visit(c: str, m: int, unk: bool, stack: tuple) -> None:
        if c in stack:
            return
        mult[c] = mult.get(c, 0) + m
        unknown_loop[c] = unknown_loop.get(c, False) or unk
        for callee, f, u in edges.get(c, []):
            visit(callee, m * f, unk or u, stack + (c,))

    roots = [entry] if entry else list(comps)
    for r in roots:
        visit(r, 1, False, ())
    return mult, unknown_loop


def _collectives(cname: str, instrs: list, total: int, mult: dict, unknown_loop: dict) -> list:
    """The collectives of computation ``cname`` (``total`` devices, executions from ``_executions``)."""
    collectives = []
    symbols = {i.name: i.shape for i in instrs}
    done_of = {}
    for i in instrs:
        if i.opcode.endswith("-done") and i.operands:
            done_of[i.operands[0].split()[-1].lstrip("%")] = i
    for ins in instrs:
        kind = _canonical(ins.opcode)
        if kind is None:
            continue
        op_shapes = tuple(operand_shape(o, symbols) for o in ins.operands)
        if kind == "ragged-all-to-all":   # (data, output, offsets and sizes: the data's buffer, the most it moves)
            op_shapes = op_shapes[:1]
        operand_bytes = sum(shape_bytes(s) for s in op_shapes)
        res_shape = ins.shape
        if ins.opcode.endswith("-start"):
            done = done_of.get(ins.name)
            if done is not None:
                res_shape = done.shape
            elif kind in ("all-gather", "collective-permute") and isinstance(res_shape, tuple) \
                    and len(res_shape) >= 2:
                res_shape = res_shape[1]
        result_bytes = shape_bytes(res_shape)
        if kind == "collective-permute":
            pairs = re.findall(r"\{(\d+),(\d+)\}", attr(ins.attrs, "source_target_pairs") or "")
            group_size, num_groups = (2 if pairs else 1), len(pairs)
        else:
            group_size, num_groups = group_shape(attr(ins.attrs, "replica_groups"), total)
        opn = OPNAME_RE.search(ins.attrs)
        collectives.append(Collective(
            kind=kind, opcode=ins.opcode, name=ins.name, computation=cname,
            operand_shape=shape_str(op_shapes[0]) if len(op_shapes) == 1 else shape_str(op_shapes),
            result_shape=shape_str(res_shape),
            operand_bytes=operand_bytes, result_bytes=result_bytes,
            group_size=group_size, num_groups=num_groups,
            multiplier=max(mult.get(cname, 1), 1), op_name=opn.group(1) if opn else "",
            unknown_trip_count=unknown_loop.get(cname, False)))
    return collectives


def parse_hlo_text(text: str) -> CommReport:
    """Parse HLO module text (as printed by ``compiled.as_text()``)."""
    header = next((ln for ln in text.splitlines() if ln.startswith("HloModule")), "")
    mname = re.match(r"HloModule\s+([\w.\-]+)", header)
    np_ = re.search(r"\bnum_partitions=(\d+)", header)
    nr_ = re.search(r"\breplica_count=(\d+)", header)
    num_partitions = int(np_.group(1)) if np_ else 1
    replica_count = int(nr_.group(1)) if nr_ else 1
    total = num_partitions * replica_count

    comps, entry = parse_computations(text)
    mult, unknown_loop = _executions(comps, entry)
    collectives = []
    for cname, instrs in comps.items():
        collectives.extend(_collectives(cname, instrs, total, mult, unknown_loop))
    return CommReport(mname.group(1) if mname else "?", num_partitions, replica_count, collectives)


def analyze(obj: Any) -> CommReport:
    """Accept a ``jax.stages.Compiled`` (anything with ``as_text()`` that
    returns HLO), or HLO text. A ``Lowered`` object is compiled first."""
    if isinstance(obj, str):
        return parse_hlo_text(obj)
    if hasattr(obj, "compile") and hasattr(obj, "as_text") and not hasattr(obj, "memory_analysis"):
        obj = obj.compile()  # jax.stages.Lowered: its text is StableHLO
    text = obj.as_text()
    if isinstance(text, (list, tuple)):
        text = "\n".join(text)
    return parse_hlo_text(text)


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------


def _demo() -> int:
    import os
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    b, d, f = 64, 256, 1024
    x, w1, w2 = jnp.ones((b, d)), jnp.ones((d, f)), jnp.ones((f, d))
    specs = (P("data", None), P(None, "model"), P("model", None))

    def mlp(x, w1, w2):
        return jnp.maximum(x @ w1, 0) @ w2

    def local(x, w1, w2):
        return jax.lax.psum(mlp(x, w1, w2), "model")

    sm = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P("data", None))
    shard = tuple(NamedSharding(mesh, s) for s in specs)
    gspmd = jax.jit(mlp, in_shardings=shard, out_shardings=NamedSharding(mesh, P("data", None)))
    for label, fn in (("shard_map", jax.jit(sm)), ("gspmd", gspmd)):
        print(f"== {label} forward")
        print(analyze(fn.lower(x, w1, w2).compile()).table(details=True))
    return 0


def main(argv: Iterable[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("file", nargs="?", help="HLO text file ('-' for stdin)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--details", action="store_true", help="list every collective")
    p.add_argument("--demo", action="store_true", help="run a JAX demo on 8 CPU devices")
    a = p.parse_args(list(argv) if argv is not None else None)
    if a.demo:
        return _demo()
    if not a.file:
        p.error("give an HLO file, '-' or --demo")
    if a.file == "-":
        text = sys.stdin.read()
    else:
        with open(a.file) as fh:
            text = fh.read()
    rep = parse_hlo_text(text)
    print(rep.to_json(a.details) if a.json else rep.table(a.details))
    return 0


if __name__ == "__main__":
    sys.exit(main())
