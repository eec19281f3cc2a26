"""The per-device program as the kernels XLA runs, each priced by a roofline.

The time model (:mod:`meshdsl.costmodel.step_time`) prices a step kernel by kernel: a kernel takes the
longer of its FLOPs at the matmul rate and its HBM traffic at the memory rate, plus a launch. This
module finds the kernels of a traced per-device program (a jaxpr) the way XLA's fusion passes
form them, and what each reads and writes:

* **A matmul** (``dot_general``) is a kernel of its own (a library call): it reads its operands
  and writes its result; its FLOPs are ``2 x |result| x |contracted|``.
* **Elementwise ops fuse** (loop fusion): a chain of them, with the broadcasts, reshapes, slices,
  transposes, pads and concatenations between them, runs as one kernel that reads the buffers the
  chain starts from and writes the values that leave it. A value stays inside (is never written)
  unless something that cannot fuse it reads it: a matmul, a collective, a loop, or the program's
  end. A value two kernels read is computed in each (XLA duplicates cheap producers) unless it is
  a buffer anyway.
* **A reduction** fuses the elementwise chain feeding it (input fusion): one kernel reading the
  chain's buffers and writing the reduced result.
* **Gathers, scatters, dynamic slices and updates** move the rows they touch; **sorts, cumulative
  sums** and other ops read their operands and write their results.
* **Loops** (``scan``, ``while``) run their body's kernels once per iteration; a ``cond`` its
  costliest branch; a call (``jit``, ``custom_vjp``, ``remat``) its body's kernels.
* **A fused attention kernel** (``md.attention``): its ops run inside a name scope
  ``mdk<N>f`` (forward) or ``mdk<N>b`` (backward) and are not priced op by op; the op records the
  kernel's FLOPs and HBM bytes (:mod:`meshdsl.ops.attention_cost`), and :func:`kernel_runs` counts
  how often each scope runs (loops, remat's second forward). The blockwise loop a trace on CPU
  builds is then priced as the fused kernel a GPU runs: its inputs and outputs, not its tiles.
* **Collectives** are not kernels here: they are priced on their links from ``md.explain``'s records.

Each kernel is a :class:`Kernel` (kind, matmul dtype, FLOPs, bytes, run count); alike kernels are
merged (:func:`kernels`), so a report carries a few hundred rows however long the program.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter

import numpy as np
from jax.extend import core as jcore

from ..platform.jaxcompat import MATMULS, dot_dims, matmul_groups, scan_parts
from .jaxpr_stats import ALIASES, FUSIBLE, nbytes, sub_jaxprs

__all__ = ["Kernel", "kernels", "KERNEL_SCOPE", "kernel_runs", "program_kernels"]

KERNEL_SCOPE = r"mdk\d+[fb]"   # the name scopes of fused kernels that an op prices itself (md.attention)

# Ops XLA fuses into the loop fusion of their consumer (index maps and elementwise math).
_FUSES = FUSIBLE | ALIASES | frozenset(("transpose", "slice", "pad", "concatenate", "rev", "select_and_gather_add",
                                        "dynamic_slice", "squeeze", "reduce_precision", "real", "imag",
                                        "clamp", "max", "min", "sign", "square", "rem", "atan2", "tan",
                                        "population_count", "imag", "conj", "bitcast_convert_type"))
# Reductions: one kernel with the elementwise chain that feeds them (input fusion).
_REDUCES = frozenset(("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
                      "argmax", "argmin", "reduce_xor"))
_COLLECTIVES = frozenset(("psum", "psum2", "pmax", "pmin", "all_gather", "all_gather_invariant", "all_to_all",
                          "ppermute", "psum_scatter", "reduce_scatter", "pbroadcast", "psum_invariant",
                          "axis_index", "pvary", "ragged_all_to_all"))
_READS_PART = frozenset(("gather",))
_WRITES_PART = frozenset(("dynamic_update_slice", "scatter", "scatter-add", "scatter_add", "scatter_mul",
                          "scatter_min", "scatter_max"))
_FREE = frozenset(("iota",)) | ALIASES


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel of the program (or several alike): ``kind`` (``"matmul"``, ``"fusion"``,
    ``"reduction"``, ``"memory"``: a gather, scatter or copy, ``"attention"``), the dtype its
    FLOPs run at (a matmul's operands; ``""`` for others), FLOPs and HBM bytes of one run, and how
    many times it runs per step."""

    kind: str
    dtype: str
    flops: float
    bytes: float
    count: int = 1

    def as_tuple(self) -> tuple:
        return (self.kind, self.dtype, self.flops, self.bytes, self.count)


def kernels(jaxpr) -> list[Kernel]:
    """The kernels of one execution of ``jaxpr`` (per device inside shard_map), alike ones merged
    (their ``count`` added), the fused kernels of scopes :data:`KERNEL_SCOPE` left out."""
    found: Counter = Counter()
    _walk(getattr(jaxpr, "jaxpr", jaxpr), 1, found)
    return [Kernel(kind, dtype, flops, nb, count) for (kind, dtype, flops, nb), count in sorted(found.items())]


def program_kernels(body, attentions) -> list[Kernel]:
    """The kernels of the per-device program ``body`` (:func:`kernels`), and each ``md.attention``
    of it (``attentions``: the trace's entries, :mod:`meshdsl.ops.attention_cost`) as its fused
    kernel's forward and backward passes, as often as their scopes run."""
    runs = kernel_runs(body)
    fused = [Kernel("attention", k["dtype"], k[f"{phase}_flops"], k[f"{phase}_bytes"], runs[k["scope"] + p])
             for k in (a["kernel"] for a in attentions if "kernel" in a)
             for phase, p in (("forward", "f"), ("backward", "b")) if runs[k["scope"] + p]]
    return kernels(body) + fused


def kernel_runs(jaxpr) -> Counter:
    """How many times each scope :data:`KERNEL_SCOPE` runs in one execution of ``jaxpr``: each scope
    counted once per execution of the equations under it (loops multiply; a remat'ed forward
    traced again is run again)."""
    runs: Counter = Counter()
    _scope_runs(getattr(jaxpr, "jaxpr", jaxpr), 1, runs)
    return runs


def _scope_runs(jaxpr, multiplier: int, runs: Counter) -> None:
    """Runs of each scope: a stretch of equations under it counts once if it computes (a matmul,
    a loop, a call, a library kernel); an elementwise op XLA hoisted out of a loop does not."""
    group, work = frozenset(), False
    for eqn in jaxpr.eqns + [None]:
        tags = frozenset(re.findall(KERNEL_SCOPE, str(eqn.source_info.name_stack))) if eqn is not None else frozenset()
        if tags != group:
            if work:
                for tag in group:
                    runs[tag] += multiplier
            group, work = tags, False
        if eqn is None:
            break
        if tags:
            work = work or _computes(eqn)
            continue
        m = multiplier * _trips(eqn)
        subs = list(sub_jaxprs(eqn))
        if eqn.primitive.name == "cond" and subs:
            subs = subs[-1:]   # the branches compute the same kernels (flash's skip branch aside)
        for sub in subs:
            _scope_runs(sub, m, runs)


def _computes(eqn) -> bool:
    name = eqn.primitive.name
    return name in MATMULS or next(sub_jaxprs(eqn), None) is not None or \
        name not in _FUSES | _REDUCES | _COLLECTIVES | _FREE | _READS_PART | _WRITES_PART | {"optimization_barrier"}


def _trips(eqn) -> int:
    return scan_parts(eqn).length if eqn.primitive.name == "scan" else 1


class _Fusion:
    """Which values of one jaxpr XLA writes to memory, and what a kernel computing one reads."""

    def __init__(self, jaxpr):
        self.consumers: dict = {}
        for eqn in jaxpr.eqns:
            for v in eqn.invars:
                if isinstance(v, jcore.Var):
                    self.consumers.setdefault(v, []).append(eqn)
        self.outs = {v for v in jaxpr.outvars if isinstance(v, jcore.Var)}
        self.producer = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
        self.scoped = {id(eqn) for eqn in jaxpr.eqns if re.search(KERNEL_SCOPE, str(eqn.source_info.name_stack))}
        self.memo: dict = {}

    def is_buffer(self, v) -> bool:
        """Is ``v`` written to memory (not kept inside a fused kernel)?"""
        eqn = self.producer.get(v)
        if eqn is None or v in self.outs or id(eqn) in self.scoped or eqn.primitive.name not in _FUSES:
            return True
        if eqn.primitive.name in ALIASES:
            return isinstance(eqn.invars[0], jcore.Var) and self.is_buffer(eqn.invars[0])
        return any(c.primitive.name not in _FUSES and c.primitive.name not in _REDUCES
                   for c in self.consumers.get(v, ()))

    def renames(self, v) -> bool:
        """Is buffer ``v`` another name (a reshape, a cast to the same type) of a buffer made before?"""
        eqn = self.producer.get(v)
        return eqn is not None and eqn.primitive.name in ALIASES and isinstance(eqn.invars[0], jcore.Var) \
            and self.is_buffer(eqn.invars[0])

    def reads(self, v) -> dict:
        """The buffers (value -> bytes read) a kernel using ``v`` reads for it: ``v`` itself where it
        is a buffer, else what the fused ops computing it read."""
        if not isinstance(v, jcore.Var):
            return {}
        if v not in self.memo:
            self.memo[v] = {v: nbytes(v.aval)} if self.is_buffer(v) else self.computing(self.producer[v])
        return self.memo[v]

    def computing(self, eqn) -> dict:
        """The buffers a fused ``eqn`` reads: a slice of a buffer reads the part it takes."""
        out = {}
        sliced = eqn.primitive.name in ("slice", "dynamic_slice") and isinstance(eqn.invars[0], jcore.Var) \
            and self.is_buffer(eqn.invars[0])
        if sliced:
            out[eqn.outvars[0]] = nbytes(eqn.outvars[0].aval)
        for u in eqn.invars[1:] if sliced else eqn.invars:
            out.update(self.reads(u))
        return out


def _walk(jaxpr, multiplier: int, found: Counter) -> None:
    """Add the kernels of ``jaxpr``, run ``multiplier`` times, to ``found``."""
    fusion = _Fusion(jaxpr)
    for eqn in jaxpr.eqns:
        if id(eqn) in fusion.scoped:
            continue
        subs = list(sub_jaxprs(eqn))
        if eqn.primitive.name == "cond" and subs:   # its costliest branch
            branches = []
            for sub in subs:
                branches.append(Counter())
                _walk(sub, multiplier, branches[-1])
            found.update(max(branches, key=_seconds_proxy))
        elif subs:
            for sub in subs:
                _walk(sub, multiplier * _trips(eqn), found)
        else:
            kernel = _kernel(eqn, fusion)
            if kernel is not None:
                found[kernel] += multiplier


def _kernel(eqn, fusion: _Fusion):
    """``(kind, dtype, flops, bytes)`` of the kernel ``eqn`` ends, or None (fused, free, a collective)."""
    name = eqn.primitive.name
    if name in _COLLECTIVES or name in _FREE:
        return None
    if name in MATMULS:
        (lc, _), _ = dot_dims(eqn)
        lhs, out = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
        moved = sum(nbytes(v.aval) for v in eqn.invars) + nbytes(eqn.outvars[0].aval)
        flops = 2.0 * math.prod(out) * math.prod(lhs[i] for i in lc) * matmul_groups(eqn)
        return "matmul", np.dtype(eqn.invars[0].aval.dtype).name, flops, float(moved)
    if name in _READS_PART:
        return "memory", "", 0.0, float(2 * sum(nbytes(v.aval) for v in eqn.outvars)
                                        + sum(nbytes(v.aval) for v in eqn.invars[1:]))
    if name in _WRITES_PART:
        return "memory", "", 0.0, float(2 * nbytes(eqn.invars[-1].aval) + sum(nbytes(v.aval) for v in eqn.invars[1:-1]))
    written, kind = eqn.outvars, "reduction" if name in _REDUCES else "memory"
    if name in _FUSES:
        written, kind = [v for v in eqn.outvars if fusion.is_buffer(v)], "fusion"
        if not written or all(fusion.renames(v) for v in written):
            return None   # fused into its consumers, or a new name for a buffer
    return kind, "", 0.0, float(sum(fusion.computing(eqn).values()) + sum(nbytes(v.aval) for v in written))


def _seconds_proxy(found: Counter) -> float:
    """A branch's cost for choosing the costlier one: bytes, and FLOPs at an accelerator's balance
    of about 300 FLOP per byte of memory traffic."""
    return sum(count * max(flops / 300.0, nb) for (_, _, flops, nb), count in found.items())
