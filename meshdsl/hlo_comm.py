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

    from meshdsl import hlo_comm
    rep = hlo_comm.analyze(jax.jit(f).lower(x).compile())
    print(rep.table())
    rep.summary()["all-reduce"]["moved_bytes"]
    rep.collectives            # list of Collective records

CLI::

    python -m meshdsl.hlo_comm module.hlo.txt [--json] [--details]
    python -m meshdsl.hlo_comm --demo  # Megatron MLP on 8 virtual CPU devices

Only the Python standard library is needed (``--demo`` needs JAX).
Tests: ``tests/tools/test_hlo_comm.py`` (hand-written HLO, no JAX).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
import warnings
from collections.abc import Iterable
from typing import Any, Union

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

# Bytes per element. Sub-byte types count as fractions.
DTYPE_BYTES = {
    "pred": 1, "s1": 0.125, "u1": 0.125, "s2": 0.25, "u2": 0.25,
    "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2,
    "s32": 4, "u32": 4, "s64": 8, "u64": 8,
    "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16,
    "f4e2m1fn": 0.5, "f8e3m4": 1, "f8e4m3": 1, "f8e4m3fn": 1,
    "f8e4m3b11fnuz": 1, "f8e4m3fnuz": 1, "f8e5m2": 1, "f8e5m2fnuz": 1,
    "f8e8m0fnu": 1, "token": 0, "opaque": 0,
}

# --------------------------------------------------------------------------
# Shapes
# --------------------------------------------------------------------------

_ARRAY_RE = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")


@dataclasses.dataclass(frozen=True)
class _Array:
    dtype: str
    dims: tuple

    @property
    def nbytes(self) -> float:
        return DTYPE_BYTES.get(self.dtype, 0) * math.prod(self.dims)

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.dims))}]"


# A shape is an _Array or a tuple of shapes.
Shape = Union[_Array, tuple]  # noqa: UP007 (runtime alias, py3.8+)


def _matching(text: str, start: int, open_c: str, close_c: str) -> int:
    """Index of the bracket closing the one at ``text[start]``."""
    depth = 0
    for i in range(start, len(text)):
        c = text[i]
        if c == open_c:
            depth += 1
        elif c == close_c:
            depth -= 1
            if depth == 0:
                return i
    raise ValueError(f"unbalanced {open_c!r} in {text[start:start + 80]!r}")


def _split_top(text: str, sep: str = ",") -> list:
    """Split on ``sep`` outside (), [], {}."""
    parts, depth, cur = [], 0, []
    for c in text:
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        if c == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    if cur or parts:
        parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def _parse_shape(text: str) -> Shape:
    """Parse ``f32[8,32]{1,0}`` or ``(f32[2]{0}, (s32[], bf16[4]))``."""
    text = text.strip()
    if text.startswith("("):
        end = _matching(text, 0, "(", ")")
        return tuple(_parse_shape(p) for p in _split_top(text[1:end]))
    m = _ARRAY_RE.match(text)
    if not m:
        if text.startswith(("token", "opaque")):
            return _Array("token", ())
        raise ValueError(f"cannot parse shape {text!r}")
    dims = tuple(int(d.replace("<=", "")) for d in m.group(2).split(",") if d.strip())
    return _Array(m.group(1), dims)


def shape_bytes(shape: Shape | str) -> float:
    """Total bytes of a shape (tuples summed). Accepts HLO shape text."""
    if isinstance(shape, str):
        shape = _parse_shape(shape)
    if isinstance(shape, _Array):
        return shape.nbytes
    return sum(shape_bytes(s) for s in shape)


def _shape_str(shape: Shape) -> str:
    if isinstance(shape, _Array):
        return str(shape)
    return "(" + ", ".join(_shape_str(s) for s in shape) + ")"


# --------------------------------------------------------------------------
# HLO text parsing
# --------------------------------------------------------------------------

_COMP_RE = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\))?\s*->\s*.*\{\s*$")
_INSTR_RE = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE_RE = re.compile(r"\s*([a-z][\w\-]*)\(")
_CALLEE_RE = re.compile(
    r"\b(calls|body|condition|to_apply|true_computation|false_computation|"
    r"branch_computations|called_computations)=(\{[^}]*\}|%?[\w.\-]+)")
_TRIP_RE = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)"?')
_OPNAME_RE = re.compile(r'op_name="([^"]*)"')
_COMMENT_RE = re.compile(r"/\*.*?\*/")
_IOTA_RE = re.compile(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
# Shardy-style "mesh axes" groups, e.g.
#   mesh['axis_0'=2,'axis_1'=4] {'axis_1'}
#   mesh[x=8,y=8,z=16] {x:(2)4,y:(2)4}            (sub-axes: (pre_size)size)
#   mesh[x=2,y=4], device_ids=(...) {y}
_MESH_GROUPS_RE = re.compile(
    r"mesh\[([^\]]*)\](?:,\s*device_ids=\((?:[^()]|\([^()]*\))*\))?\s*\{([^}]*)\}")


@dataclasses.dataclass
class _Instr:
    name: str
    shape: Shape
    opcode: str
    operands: list
    attrs: str
    computation: str


def _parse_instruction(line: str, comp: str) -> _Instr | None:
    m = _INSTR_RE.match(line)
    if not m:
        return None
    name, rest = m.group(2), m.group(3)
    rest = rest.lstrip()
    if rest.startswith("("):
        end = _matching(rest, 0, "(", ")")
    else:
        sp = rest.find(" ")
        if sp < 0:
            return None
        end = sp - 1
    shape_txt, rest = rest[:end + 1], rest[end + 1:]
    om = _OPCODE_RE.match(rest)
    if not om:
        return None
    opcode = om.group(1)
    open_idx = om.end() - 1
    close_idx = _matching(rest, open_idx, "(", ")")
    operands = _split_top(rest[open_idx + 1:close_idx])
    try:
        shape = _parse_shape(shape_txt)
    except ValueError:
        shape = ()
    return _Instr(name, shape, opcode, operands, rest[close_idx + 1:], comp)


def _operand_shape(tok: str, symbols: dict) -> Shape:
    """An operand is ``%name`` or, in some printers, ``f32[4]{0} %name``."""
    tok = tok.strip()
    if tok.startswith("%") or re.match(r"^[\w.\-]+$", tok):
        return symbols.get(tok.lstrip("%"), ())
    try:
        return _parse_shape(tok)
    except ValueError:
        return symbols.get(tok.split()[-1].lstrip("%"), ())


def _attr(attrs: str, key: str) -> str | None:
    """Raw value of ``key=...`` (handles nested braces / iota forms)."""
    m = re.search(r"\b" + re.escape(key) + r"=", attrs)
    if not m:
        return None
    i = m.end()
    if i < len(attrs) and attrs[i] == "{":
        return attrs[i:_matching(attrs, i, "{", "}") + 1]
    for pattern in (_IOTA_RE, _MESH_GROUPS_RE):
        special = pattern.match(attrs, i)
        if special:
            return special.group(0)
    j = i
    while j < len(attrs) and attrs[j] not in ", ":
        j += 1
    return attrs[i:j]


def _group_shape(raw: str | None, total_devices: int) -> tuple:
    """replica_groups -> (group_size, num_groups)."""
    m = _MESH_GROUPS_RE.match(raw.strip()) if raw else None
    if m:
        sizes = {}
        for ax in _split_top(m.group(1)):
            name, _, size = ax.rpartition("=")
            sizes[name.strip().strip("'\"")] = int(size)
        group = 1
        for ax in _split_top(m.group(2)):
            sub = re.match(r"(.+?):\((\d+)\)(\d+)$", ax)
            group *= int(sub.group(3)) if sub else sizes[ax.strip().strip("'\"")]
        return group, math.prod(sizes.values()) // group
    groups = _parse_groups(raw, total_devices)
    if not groups or not groups[0]:
        warnings.warn(f"hlo_comm: cannot parse replica_groups={raw!r}; "
                      f"assuming one group of all {total_devices} devices")
        return max(total_devices, 1), 1
    return len(groups[0]), len(groups)


def _parse_groups(raw: str | None, total_devices: int) -> list:
    """replica_groups (explicit or iota form) -> list of groups (lists of ids)."""
    if raw is None or raw.strip() in ("{}", "{{}}", ""):
        return [list(range(total_devices))] if total_devices else []
    raw = raw.strip()
    m = _IOTA_RE.match(raw)
    if m:  # iota format: [G,N]<=[dims]T(perm)
        out_dims = [int(x) for x in m.group(1).split(",")]
        rdims = [int(x) for x in m.group(2).split(",")]
        perm = [int(x) for x in m.group(3).split(",")] if m.group(3) else list(range(len(rdims)))
        ids = _iota_transpose(rdims, perm)
        size = out_dims[-1]
        return [ids[i:i + size] for i in range(0, len(ids), size)]
    inner = raw[1:-1] if raw.startswith("{") else raw
    groups = []
    for g in re.findall(r"\{([^{}]*)\}", inner):
        groups.append([int(x) for x in g.split(",") if x.strip()])
    return groups


def _iota_transpose(dims: list, perm: list) -> list:
    """Flattened ``transpose(reshape(iota(prod(dims)), dims), perm)``."""
    n = math.prod(dims)
    strides = [math.prod(dims[i + 1:]) for i in range(len(dims))]
    pdims = [dims[p] for p in perm]
    pstrides = [strides[p] for p in perm]
    out = []
    for flat in range(n):
        idx, rem = 0, flat
        for d, s in zip(reversed(pdims), reversed(pstrides)):
            idx += (rem % d) * s
            rem //= d
        out.append(idx)
    return out


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


def parse_hlo_text(text: str) -> CommReport:
    """Parse HLO module text (as printed by ``compiled.as_text()``)."""
    header = next((ln for ln in text.splitlines() if ln.startswith("HloModule")), "")
    mname = re.match(r"HloModule\s+([\w.\-]+)", header)
    np_ = re.search(r"\bnum_partitions=(\d+)", header)
    nr_ = re.search(r"\breplica_count=(\d+)", header)
    num_partitions = int(np_.group(1)) if np_ else 1
    replica_count = int(nr_.group(1)) if nr_ else 1
    total = num_partitions * replica_count

    comps: dict = {}          # computation -> list[_Instr]
    entry = None
    cur = None
    for line in text.splitlines():
        # XLA marks long tuples with /*index=N*/ comments; they would hide an element's shape.
        line = _COMMENT_RE.sub("", line)
        if cur is None:
            m = _COMP_RE.match(line)
            if m and not line.startswith("HloModule"):
                cur = m.group(2)
                comps[cur] = []
                if m.group(1):
                    entry = cur
            continue
        if line.strip() == "}":
            cur = None
            continue
        ins = _parse_instruction(line, cur)
        if ins is not None:
            comps[cur].append(ins)

    # Executions per computation (while trip counts along the call graph).
    edges: dict = {c: [] for c in comps}   # caller -> [(callee, factor, unknown)]
    for cname, instrs in comps.items():
        for ins in instrs:
            for key, val in _CALLEE_RE.findall(ins.attrs):
                if key == "to_apply":
                    continue  # reducers: scalar code, never collectives
                for callee in re.findall(r"%?([\w.\-]+)", val.strip("{}")):
                    if callee not in comps:
                        continue
                    factor, unknown = 1, False
                    if ins.opcode == "while" and key == "body":
                        t = _TRIP_RE.search(ins.attrs)
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

    collectives = []
    for cname, instrs in comps.items():
        symbols = {i.name: i.shape for i in instrs}
        done_of = {}
        for i in instrs:
            if i.opcode.endswith("-done") and i.operands:
                done_of[i.operands[0].split()[-1].lstrip("%")] = i
        for ins in instrs:
            kind = _canonical(ins.opcode)
            if kind is None:
                continue
            op_shapes = tuple(_operand_shape(o, symbols) for o in ins.operands)
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
                pairs = re.findall(r"\{(\d+),(\d+)\}", _attr(ins.attrs, "source_target_pairs") or "")
                group_size, num_groups = (2 if pairs else 1), len(pairs)
            else:
                group_size, num_groups = _group_shape(_attr(ins.attrs, "replica_groups"), total)
            opn = _OPNAME_RE.search(ins.attrs)
            collectives.append(Collective(
                kind=kind, opcode=ins.opcode, name=ins.name, computation=cname,
                operand_shape=_shape_str(op_shapes[0]) if len(op_shapes) == 1 else _shape_str(op_shapes),
                result_shape=_shape_str(res_shape),
                operand_bytes=operand_bytes, result_bytes=result_bytes,
                group_size=group_size, num_groups=num_groups,
                multiplier=max(mult.get(cname, 1), 1), op_name=opn.group(1) if opn else "",
                unknown_trip_count=unknown_loop.get(cname, False)))
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
