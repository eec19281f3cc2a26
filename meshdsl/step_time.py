"""The time model: a step's seconds from an ``md.explain`` report and a :class:`~meshdsl.hardware.Hardware`.

Per device, with the report's numbers (``docs/cost_model.md`` has the whole model and what it
leaves out)::

    matmul_s        = report.flops / peak FLOP/s of dtype
    memory_s        = bytes accessed / HBM bandwidth
    compute_s       = matmul_s + memory_s
    communication_s = sum over collectives of  latency(link) x count + total_bytes / bandwidth(link)
    total_s         = compute_s + communication_s - overlap x min(compute_s, communication_s)

``memory_s`` counts the HBM bytes the per-device program reads and writes
(:func:`meshdsl.jaxpr_stats.bytes_accessed`: every op's buffer operands and results, a fused
elementwise chain's inside neither, loop bodies per iteration): recomputing activations (remat)
costs their traffic again. A report without that count (a hand-made one) falls back to the bytes
it holds (arguments + outputs + temporaries), each taken as moved once. A collective's link is the slowest of its
axes' links (:meth:`Hardware.link`); its bytes already follow the ring formulas of
:mod:`meshdsl.cost`, so bytes / per-device link bandwidth is its transfer time.

Example:
    >>> import jax, jax.numpy as jnp, meshdsl as md
    >>> from meshdsl.hardware import Hardware
    >>> from meshdsl.step_time import predict
    >>> x = md.named(jax.ShapeDtypeStruct((16, 256), jnp.float32), "batch d_model")
    >>> w = md.param(md.named(jax.ShapeDtypeStruct((256, 1024), jnp.float32), "d_model d_ff"))
    >>> report = md.explain(lambda x, w: md.einsum(x, w, out="batch"), md.Mesh.abstract({"data": 2, "model": 4}),
    ...                     md.Layout.parse("batch:data;d_model:model"), x, w)
    >>> t = predict(report, Hardware.profile("h100-80gb"), dtype="float32")
    >>> t.per_collective[0]["kind"], t.per_collective[0]["link"], t.communication_s == 1e-5 + 48 / 450e9
    ('all-reduce', 'nvlink', True)
"""

from __future__ import annotations

import dataclasses

from .hardware import Hardware
from .units import fmt_bytes

__all__ = ["StepTime", "predict"]


@dataclasses.dataclass
class StepTime:
    """Predicted seconds of one step per device (:func:`predict`); ``per_collective`` has one dict
    per collective of the report: ``kind``, ``axes``, ``link``, ``count``, ``bytes``, ``latency_s``
    (latency x count), ``transfer_s`` (bytes / bandwidth), ``seconds`` (their sum)."""

    hardware: str
    dtype: str
    matmul_s: float
    memory_s: float
    compute_s: float
    communication_s: float
    overlap: float
    total_s: float
    per_collective: list

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_markdown(self) -> str:
        lines = [f"**step** {_fmt_s(self.total_s)} per device on {self.hardware} · compute "
                 f"{_fmt_s(self.compute_s)} (matmul {_fmt_s(self.matmul_s)} at {self.dtype}, memory "
                 f"{_fmt_s(self.memory_s)}) · communication {_fmt_s(self.communication_s)} · overlap "
                 f"{self.overlap:.0%}", "",
                 "| kind | axes | link | count | bytes/device | latency | transfer | time |",
                 "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
        lines += [f"| {r['kind']} | {'+'.join(r['axes'])} | {r['link']} | {r['count']} | {fmt_bytes(r['bytes'])} "
                  f"| {_fmt_s(r['latency_s'])} | {_fmt_s(r['transfer_s'])} | {_fmt_s(r['seconds'])} |"
                  for r in self.per_collective]
        if not self.per_collective:
            lines.append("| (none) | | | 0 | 0 B | | | 0 s |")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_markdown()


def predict(report: object, hardware: Hardware, *, overlap: float = 0.0, dtype: str = "bfloat16") -> StepTime:
    """Seconds of one step per device for ``report`` (an ``md.explain`` report) on ``hardware``.

    Args:
        report: anything with ``mesh`` (a Mesh, its text, or a dict of axis sizes), ``flops``,
            ``bytes_accessed`` (or else ``memory``: ``arguments``, ``outputs``, ``temporaries``
            bytes) and ``collectives``
            (records with ``kind``, ``axes``, ``count``, ``total_bytes``).
        hardware: a :class:`~meshdsl.hardware.Hardware` (a profile, or measured).
        overlap: the fraction of the shorter of compute and communication hidden under the
            other: 0 (nothing overlaps) to 1 (perfect overlap: the step takes the longer one).
        dtype: the matmuls' dtype, which picks the peak FLOP/s.

    Raises:
        ValueError: ``overlap`` outside [0, 1]; MeshDSLError: a dtype the hardware has no peak for.
    """
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap is a fraction in [0, 1], got {overlap!r}")
    matmul = report.flops / hardware.peak_flops(dtype)
    accessed = getattr(report, "bytes_accessed", None)
    if accessed is None:
        accessed = sum(report.memory.get(k, 0) for k in ("arguments", "outputs", "temporaries"))
    memory = accessed / hardware.hbm_bandwidth
    rows = [_collective(r, hardware, report.mesh) for r in report.collectives]
    compute, communication = matmul + memory, sum(r["seconds"] for r in rows)
    return StepTime(hardware=hardware.name, dtype=str(dtype), matmul_s=matmul, memory_s=memory,
                    compute_s=compute, communication_s=communication, overlap=overlap,
                    total_s=compute + communication - overlap * min(compute, communication), per_collective=rows)


def _collective(record, hardware: Hardware, mesh) -> dict:
    kind = hardware.link(record.axes, mesh)
    link = hardware.interconnect[kind]
    latency, transfer = link.latency * record.count, record.total_bytes / link.bandwidth
    return {"kind": record.kind, "axes": tuple(record.axes), "link": kind, "count": record.count,
            "bytes": record.total_bytes, "latency_s": latency, "transfer_s": transfer, "seconds": latency + transfer}


def _fmt_s(seconds: float) -> str:
    """``1.5e-4`` -> ``'150.00 us'``."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.2f} {unit}"
    return f"{seconds / 1e-9:.2f} ns" if seconds else "0 s"
