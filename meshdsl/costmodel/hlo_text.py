"""hlo_text: HLO module text read into shapes, instructions and replica groups.

The reading half of the measuring tool (``hlo_comm`` counts the collectives and reports): element
sizes per dtype (``DTYPE_BYTES``), shapes (``f32[8,32]{1,0}``, tuples) and their bytes, a module's
computations as lists of ``Instr`` (name, shape, opcode, operands, attributes), an instruction's
attributes (``attr``), and replica groups (explicit, iota, Shardy mesh axes) as group sizes.

Only the Python standard library is needed (no jax import).
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from typing import Union

__all__ = [
    "CALLEE_RE",
    "DTYPE_BYTES",
    "OPNAME_RE",
    "TRIP_RE",
    "Instr",
    "Shape",
    "attr",
    "group_shape",
    "operand_shape",
    "parse_computations",
    "parse_groups",
    "parse_instruction",
    "parse_shape",
    "shape_bytes",
    "shape_str",
]

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


def parse_shape(text: str) -> Shape:
    """Parse ``f32[8,32]{1,0}`` or ``(f32[2]{0}, (s32[], bf16[4]))``."""
    text = text.strip()
    if text.startswith("("):
        end = _matching(text, 0, "(", ")")
        return tuple(parse_shape(p) for p in _split_top(text[1:end]))
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
        shape = parse_shape(shape)
    if isinstance(shape, _Array):
        return shape.nbytes
    return sum(shape_bytes(s) for s in shape)


def shape_str(shape: Shape) -> str:
    if isinstance(shape, _Array):
        return str(shape)
    return "(" + ", ".join(shape_str(s) for s in shape) + ")"


# --------------------------------------------------------------------------
# HLO text parsing
# --------------------------------------------------------------------------

_COMP_RE = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*(?:(\(.*\))?\s*->\s*.*)?\{\s*$")   # (lowered text: no signature)
_INSTR_RE = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE_RE = re.compile(r"\s*([a-z][\w\-]*)\(")
CALLEE_RE = re.compile(
    r"\b(calls|body|condition|to_apply|true_computation|false_computation|"
    r"branch_computations|called_computations)=(\{[^}]*\}|%?[\w.\-]+)")
TRIP_RE = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)"?')
OPNAME_RE = re.compile(r'op_name="([^"]*)"')
_COMMENT_RE = re.compile(r"/\*.*?\*/")
_IOTA_RE = re.compile(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
# Shardy-style "mesh axes" groups, e.g.
#   mesh['axis_0'=2,'axis_1'=4] {'axis_1'}
#   mesh[x=8,y=8,z=16] {x:(2)4,y:(2)4}            (sub-axes: (pre_size)size)
#   mesh[x=2,y=4], device_ids=(...) {y}
_MESH_GROUPS_RE = re.compile(
    r"mesh\[([^\]]*)\](?:,\s*device_ids=\((?:[^()]|\([^()]*\))*\))?\s*\{([^}]*)\}")


@dataclasses.dataclass
class Instr:
    name: str
    shape: Shape
    opcode: str
    operands: list
    attrs: str
    computation: str


def parse_instruction(line: str, comp: str) -> Instr | None:
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
        shape = parse_shape(shape_txt)
    except ValueError:
        shape = ()
    return Instr(name, shape, opcode, operands, rest[close_idx + 1:], comp)


def parse_computations(text: str) -> tuple:
    """HLO module text -> ({computation: [Instr, ...]}, name of the ENTRY computation or None)."""
    comps: dict = {}          # computation -> list[Instr]
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
        ins = parse_instruction(line, cur)
        if ins is not None:
            comps[cur].append(ins)
    return comps, entry


def operand_shape(tok: str, symbols: dict) -> Shape:
    """An operand is ``%name`` or, in some printers, ``f32[4]{0} %name``."""
    tok = tok.strip()
    if tok.startswith("%") or re.match(r"^[\w.\-]+$", tok):
        return symbols.get(tok.lstrip("%"), ())
    try:
        return parse_shape(tok)
    except ValueError:
        return symbols.get(tok.split()[-1].lstrip("%"), ())


def attr(attrs: str, key: str) -> str | None:
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


# --------------------------------------------------------------------------
# Replica groups
# --------------------------------------------------------------------------


def group_shape(raw: str | None, total_devices: int) -> tuple:
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
    groups = parse_groups(raw, total_devices)
    if not groups or not groups[0]:
        warnings.warn(f"hlo_comm: cannot parse replica_groups={raw!r}; "
                      f"assuming one group of all {total_devices} devices")
        return max(total_devices, 1), 1
    return len(groups[0]), len(groups)


def parse_groups(raw: str | None, total_devices: int) -> list:
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

