"""The time model: a step's seconds from an ``md.explain`` report and a :class:`~meshdsl.costmodel.hardware.Hardware`.

Per device, kernel by kernel (``docs/cost_model.md`` has the whole model, its measurements and
what it leaves out)::

    kernel_s        = max(flops / (peak FLOP/s of its dtype x matmul_efficiency),
                          bytes / (HBM bandwidth x memory_efficiency))      (a roofline)
    compute_s       = sum over kernels of kernel_s x runs + kernel_launch_s x runs
    communication_s = sum over collectives of  latency(link) x count + total_bytes / bandwidth(link)
    host_s          = bytes over the host link (both ways) / host bandwidth
    total_s         = compute_s + communication_s - overlap x min(compute_s, communication_s)
                      + max(0, host_s - compute_s)

The kernels are the ones XLA runs (:mod:`meshdsl.costmodel.roofline`): a matmul each, an elementwise chain
fused into one kernel with the reduction it feeds, loop bodies once per iteration, and each
``md.attention`` as its fused kernel (FLOPs of the pairs it computes at ``attention_efficiency``,
its inputs and outputs once), not the blockwise loop a CPU trace holds. ``matmul_s`` sums the
kernels bound by their FLOPs, ``memory_s`` those bound by their bytes: recomputing activations
(remat) costs their kernels again. A report without kernels (a hand-made one) is priced as one
matmul of its ``flops`` and one pass over its ``bytes_accessed`` (or else the bytes it holds:
arguments + outputs + temporaries). A collective's link is the slowest of its axes' links
(:meth:`Hardware.link`); its bytes already follow the ring formulas of :mod:`meshdsl.costmodel.cost`, so
bytes / per-device link bandwidth is its transfer time. Transfers between device and host memory
(offloaded parameters streamed a layer ahead, offloaded residuals) run beside the compute, which
hides them up to its own length.

Example:
    >>> import jax, jax.numpy as jnp, meshdsl as md
    >>> from meshdsl.costmodel.hardware import Hardware
    >>> from meshdsl.costmodel.step_time import predict
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
from ..names.units import fmt_bytes, fmt_seconds

__all__ = ["StepTime", "predict", "kernel_seconds"]


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
    launch_s: float = 0.0   # kernel launches (Hardware.kernel_launch_s each)
    kernels: int = 0        # kernels run per step (0: a report priced without them)
    host_s: float = 0.0     # the host link's transfers, beside the compute (what outlasts it adds)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_markdown(self) -> str:
        at = "" if self.dtype == "per kernel" else f" at {self.dtype}"
        launches = f", launches {fmt_seconds(self.launch_s)} of {self.kernels} kernels" if self.kernels else ""
        lines = [f"**step** {fmt_seconds(self.total_s)} per device on {self.hardware} · compute "
                 f"{fmt_seconds(self.compute_s)} (matmul {fmt_seconds(self.matmul_s)}{at}, memory "
                 f"{fmt_seconds(self.memory_s)}{launches}) · communication {fmt_seconds(self.communication_s)} · overlap "
                 f"{self.overlap:.0%}" + (f" · host link {fmt_seconds(self.host_s)} beside the compute"
                                          if self.host_s else ""), "",
                 "| kind | axes | link | count | bytes/device | latency | transfer | time |",
                 "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
        lines += [f"| {r['kind']} | {'+'.join(r['axes'])} | {r['link']} | {r['count']} | {fmt_bytes(r['bytes'])} "
                  f"| {fmt_seconds(r['latency_s'])} | {fmt_seconds(r['transfer_s'])} | {fmt_seconds(r['seconds'])} |"
                  for r in self.per_collective]
        if not self.per_collective:
            lines.append("| (none) | | | 0 | 0 B | | | 0 s |")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_markdown()


def predict(report: object, hardware: Hardware, *, overlap: float = 0.0, dtype: str | None = None) -> StepTime:
    """Seconds of one step per device for ``report`` (an ``md.explain`` report) on ``hardware``.

    Args:
        report: anything with ``mesh`` (a Mesh, its text, or a dict of axis sizes), ``collectives``
            (records with ``kind``, ``axes``, ``count``, ``total_bytes``) and either ``kernels``
            (:class:`meshdsl.costmodel.roofline.Kernel`: each priced by its roofline) or ``flops`` and
            ``bytes_accessed`` (or else ``memory``: ``arguments``, ``outputs``, ``temporaries``
            bytes), priced as one matmul and one memory pass.
        hardware: a :class:`~meshdsl.costmodel.hardware.Hardware` (a profile, or measured).
        overlap: the fraction of the shorter of compute and communication hidden under the
            other: 0 (nothing overlaps) to 1 (perfect overlap: the step takes the longer one).
        dtype: the dtype every matmul runs at (its peak FLOP/s); default: each kernel's own
            (a report without kernels: bfloat16).

    Raises:
        ValueError: ``overlap`` outside [0, 1]; MeshDSLError: a dtype the hardware has no peak for.
    """
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap is a fraction in [0, 1], got {overlap!r}")
    if dtype is not None:
        hardware.peak_flops(dtype)   # an unknown dtype is an error even where no kernel needs it
    kernels = getattr(report, "kernels", None) or []
    if kernels:
        matmul = memory = 0.0
        for k in kernels:
            flops_s, bytes_s = kernel_seconds(k, hardware, dtype)
            if flops_s >= bytes_s:
                matmul += k.count * flops_s
            else:
                memory += k.count * bytes_s
        launch = hardware.kernel_launch_s * sum(k.count for k in kernels)
    else:
        matmul = report.flops / hardware.peak_flops(dtype or "bfloat16")
        accessed = getattr(report, "bytes_accessed", None)
        if accessed is None:
            accessed = sum(report.memory.get(k, 0) for k in ("arguments", "outputs", "temporaries"))
        memory, launch = accessed / hardware.hbm_bandwidth, 0.0
    rows = [_collective(r, hardware, report.mesh) for r in report.collectives]
    compute, communication = matmul + memory + launch, sum(r["seconds"] for r in rows)
    moved = (getattr(report, "memory", None) or {}).get("transfers", {})
    host = hardware.host_seconds(sum(moved.values())) if any(moved.values()) else 0.0
    return StepTime(hardware=hardware.name, dtype=str(dtype or "per kernel"), matmul_s=matmul, memory_s=memory,
                    compute_s=compute, communication_s=communication, overlap=overlap,
                    total_s=compute + communication - overlap * min(compute, communication) + max(0.0, host - compute),
                    per_collective=rows, launch_s=launch, kernels=sum(k.count for k in kernels), host_s=host)


def kernel_seconds(kernel, hardware: Hardware, dtype=None) -> tuple[float, float]:
    """``(flops_s, bytes_s)`` of one run of a :class:`~meshdsl.costmodel.roofline.Kernel`: its FLOPs at the
    achievable rate of its dtype (``dtype`` where given; a fused attention kernel at the
    attention rate), its bytes at the achievable memory bandwidth. It takes the larger."""
    flops_s = 0.0
    if kernel.flops:
        rate = hardware.attention_efficiency if kernel.kind == "attention" else hardware.matmul_efficiency
        peak = hardware.peak_flops(dtype) if dtype else hardware.matmul_peak(kernel.dtype)
        flops_s = kernel.flops / (peak * rate)
    return flops_s, hardware.memory_seconds(kernel.bytes)


def _collective(record, hardware: Hardware, mesh) -> dict:
    kind = hardware.link(record.axes, mesh)
    link = hardware.interconnect[kind]
    latency, transfer = link.latency * record.count, record.total_bytes / link.bandwidth
    return {"kind": record.kind, "axes": tuple(record.axes), "link": kind, "count": record.count,
            "bytes": record.total_bytes, "latency_s": latency, "transfer_s": transfer, "seconds": latency + transfer}
