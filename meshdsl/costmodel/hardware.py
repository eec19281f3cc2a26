"""Hardware profiles for the time model: peak FLOP/s, memory bandwidth and size, and links.

A :class:`Hardware` holds per-device numbers: peak matmul FLOP/s per dtype, HBM bandwidth, memory,
and per *link kind* a bandwidth and a latency (a :class:`Link`). Each mesh axis runs on one link
kind (:meth:`Hardware.link`): the profile's default (``ici`` on TPU, ``nvlink`` on GPU, ``host``
on CPU); on a GPU profile an axis whose groups span hosts (more than ``devices_per_host`` devices
apart in row-major device order) runs on ``network``; ``axis_links`` (or :meth:`Hardware.with_links`)
says it outright, e.g. ``{"data": "dcn"}`` for the axis across TPU slices.

Profiles (:meth:`Hardware.profile`) come from vendor datasheets, each number cited where it is set;
:meth:`Hardware.measure` fits the same constants on the machine at hand. ``docs/cost_model.md``
has the table and the time model (:mod:`meshdsl.costmodel.step_time`).

Example:
    >>> from meshdsl.costmodel.hardware import Hardware
    >>> h100 = Hardware.profile("h100-80gb")
    >>> h100.peak_flops("bfloat16") / 1e12, h100.interconnect["nvlink"].bandwidth / 1e9
    (989.0, 450.0)
    >>> mesh = {"data": 4, "model": 8}            # 32 GPUs, 8 per host: model inside a host
    >>> h100.link("model", mesh), h100.link("data", mesh), h100.link(("data", "model"), mesh)
    ('nvlink', 'network', 'network')
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence

import jax.numpy as jnp

from ..names.errors import MeshDSLError, MeshError, suggest
from .timing import Timer, cache_fit, device_memory, link_fit

__all__ = ["Hardware", "Link", "PROFILES", "PLATFORM_PROFILES"]

GB, GiB = 1e9, 2.0 ** 30


@dataclasses.dataclass(frozen=True)
class Link:
    """One link kind: ``bandwidth`` in bytes/s per device in one direction (what a device sends
    per second in a ring collective, the rate the ring formulas of :mod:`meshdsl.costmodel.cost` divide by)
    and ``latency`` in seconds per execution of a collective: ``count`` executions that send
    ``nbytes`` in all take ``latency * count + nbytes / bandwidth`` (:mod:`meshdsl.costmodel.step_time`).
    """

    bandwidth: float
    latency: float


# -- the profiles -------------------------------------------------------------------------------
#
# Conventions. FLOP/s are dense (no 2:4 sparsity) and per device (a TPU chip, a GPU). "float32" is
# a float32 matmul at JAX's default precision, which "leans toward speed: float32 dot products may
# be computed with reduced-precision arithmetic internally (bfloat16 on TPU, TF32 on recent GPUs)"
# (https://docs.jax.dev/en/latest/201/precision.html): the bf16 rate on TPU, the dense TF32 rate on
# A100/H100/H200. Link bandwidth is per device and per direction: NVIDIA quotes NVLink as the
# bidirectional total (halved here); Google quotes ICI per chip summed over its links (one
# direction); a ring along one torus axis uses the two links of that axis, one each way, so an axis
# gets 2 x one link's one-way rate (a mesh axis = one torus axis with wraparound; a slice without
# wraparound gets about half). Gb/s / 8 = GB/s.
#
# Latencies: no datasheet gives the time of one collective; these are order-of-magnitude
# assumptions (tens of microseconds per small collective). Fit them with Hardware.measure.
_LATENCY = {"ici": 1e-5, "dcn": 5e-5, "nvlink": 1e-5, "network": 3e-5, "host": 1e-5}


# What kernels reach of the peaks (the roofline of meshdsl.costmodel.step_time prices each kernel at these).
# GPUs: a large bf16 matmul (cuBLAS) reaches ~80% of an H100's dense peak at its best shape (the
# "maximum achievable matmul FLOPS" measured in S. Bekman's ML Engineering, 794 of 989 TFLOP/s),
# less over a training step's shapes: 0.75. A fused attention kernel reaches about half
# (FlashAttention-2 on an H100: 335-350 TFLOP/s forward, FlashAttention-3: 500-660; Shah et al.
# 2024): 0.5, which is also what the two H100 steps of docs/cost_model.md give (Llama-2-7B widths,
# 4 layers, 4 x 2048 and 1 x 8192 tokens: 94.8 and 105.9 ms measured; the step's attention work is
# the difference). Streaming kernels reach ~90% of HBM bandwidth (STREAM-like copies on HBM3), and
# each kernel adds ~3 us of launch and scheduling (XLA's command buffers batch launches).
# TPUs: the same fractions assumed (no measurement of ours yet); launches ~1 us (one program).
_GPU_KERNELS = dict(matmul_efficiency=0.75, attention_efficiency=0.5, memory_efficiency=0.9, kernel_launch_s=3e-6)
_TPU_KERNELS = dict(matmul_efficiency=0.75, attention_efficiency=0.5, memory_efficiency=0.9, kernel_launch_s=1e-6)


def _tpu(bf16, hbm, memory, ici, dcn, host=32 * GB):
    return dict(flops={"bfloat16": bf16, "float32": bf16}, hbm_bandwidth=hbm, memory_bytes=memory, host_bandwidth=host,
                interconnect={"ici": Link(ici, _LATENCY["ici"]), "dcn": Link(dcn, _LATENCY["dcn"])},
                default_link="ici", **_TPU_KERNELS)


def _gpu(bf16, tf32, hbm, memory, nvlink, network, host):
    return dict(flops={"bfloat16": bf16, "float32": tf32}, hbm_bandwidth=hbm, memory_bytes=memory, host_bandwidth=host,
                interconnect={"nvlink": Link(nvlink, _LATENCY["nvlink"]),
                              "network": Link(network, _LATENCY["network"])},
                default_link="nvlink", devices_per_host=8, cross_host_link="network", **_GPU_KERNELS)


_PROFILES = {
    # https://cloud.google.com/tpu/docs/v4: 275 TFLOP/s bf16 per chip; HBM2 32 GiB, 1200 GB/s.
    # ICI: 6 links per chip (3D torus), 400 Gb/s = 50 GB/s per link per direction (Jouppi et al.,
    # "TPU v4", ISCA 2023) -> 2 x 50 GB/s per axis. DCN per chip is not published for v4: v5p's
    # 50 Gb/s = 6.25 GB/s is assumed. No TPU page gives a chip's host (PCIe) bandwidth: PCIe Gen4
    # x16's 32 GB/s per direction is assumed for every TPU profile.
    "tpu-v4": _tpu(bf16=275e12, hbm=1200 * GB, memory=32 * GiB, ici=2 * 50 * GB, dcn=6.25 * GB),
    # https://cloud.google.com/tpu/docs/v5e: 197 TFLOP/s bf16; HBM2 16 GB, 819 GB/s; ICI 1600 Gb/s
    # per chip over 4 links (2D torus) = 50 GB/s per link per direction -> 2 x 50 GB/s per axis;
    # DCN 6.4 Tb/s per 256-chip pod = 25 Gb/s = 3.125 GB/s per chip.
    "tpu-v5e": _tpu(bf16=197e12, hbm=819 * GB, memory=16 * GB, ici=2 * 50 * GB, dcn=3.125 * GB),
    # https://cloud.google.com/tpu/docs/v5p: 459 TFLOP/s bf16; HBM2e 95 GiB, 2765 GB/s; ICI
    # 4800 Gb/s per chip over 6 links (3D torus) = 100 GB/s per link per direction (the page's
    # "bidirectional ICI bandwidth per chip 1200 GBps" agrees) -> 2 x 100 GB/s per axis;
    # DCN 50 Gb/s = 6.25 GB/s per chip.
    "tpu-v5p": _tpu(bf16=459e12, hbm=2765 * GB, memory=95 * GiB, ici=2 * 100 * GB, dcn=6.25 * GB),
    # NVIDIA A100 datasheet (SXM4 80GB): BF16 312 TFLOP/s, TF32 156 (dense; 624/312 with
    # sparsity); HBM2e 80 GB, 2039 GB/s; NVLink 600 GB/s bidirectional -> 300 GB/s per direction.
    # DGX A100: one 200 Gb/s HDR InfiniBand ConnectX-6 per GPU = 25 GB/s. Host: PCIe Gen4 64 GB/s
    # (the datasheet's, both directions) -> 32 GB/s.
    "a100-80gb": _gpu(bf16=312e12, tf32=156e12, hbm=2039 * GB, memory=80 * GB, nvlink=300 * GB,
                      network=25 * GB, host=32 * GB),
    # NVIDIA H100 datasheet (SXM5): BF16 1979 TFLOP/s with sparsity = 989 dense, TF32 989 with
    # sparsity = 494.5 dense; HBM3 80 GB, 3.35 TB/s; NVLink 900 GB/s bidirectional -> 450 GB/s.
    # DGX H100: one 400 Gb/s ConnectX-7 (NDR InfiniBand) per GPU = 50 GB/s. Host: PCIe Gen5
    # 128 GB/s (the datasheet's, both directions) -> 64 GB/s.
    "h100-80gb": _gpu(bf16=989e12, tf32=494.5e12, hbm=3350 * GB, memory=80 * GB, nvlink=450 * GB,
                      network=50 * GB, host=64 * GB),
    # NVIDIA H200 datasheet (SXM): the H100's compute (BF16 989, TF32 494.5 dense); HBM3e 141 GB,
    # 4.8 TB/s; NVLink 900 GB/s bidirectional -> 450 GB/s. DGX H200: 400 Gb/s ConnectX-7 per GPU.
    # Host: PCIe Gen5 128 GB/s -> 64 GB/s.
    "h200": _gpu(bf16=989e12, tf32=494.5e12, hbm=4800 * GB, memory=141 * GB, nvlink=450 * GB,
                 network=50 * GB, host=64 * GB),
    # One CPU socket as one device (an AMD EPYC 9654 as the example, from AMD's product page): 96
    # Zen 4 cores x 2.4 GHz base x 32 f32 FLOP/cycle (two 256-bit FMA pipes) = 7.37 TFLOP/s; bf16
    # taken at the f32 rate (XLA:CPU has no fast bf16 matmul to count on); 12 channels of
    # DDR5-4800 x 8 B = 460.8 GB/s; 384 GB (12 x 32 GB DIMMs, an assumption). Collectives between
    # devices of one process are memory copies: each byte read and written, half the DRAM rate.
    # Virtual devices (--xla_force_host_platform_device_count) share the socket: use measure().
    # Host memory is the same DRAM: a move to it is a copy, at the links' rate.
    "cpu": dict(flops={"bfloat16": 7.3728e12, "float32": 7.3728e12}, hbm_bandwidth=460.8 * GB,
                memory_bytes=384 * GB, interconnect={"host": Link(230.4 * GB, _LATENCY["host"])},
                default_link="host", host_bandwidth=230.4 * GB),
}

PROFILES = tuple(_PROFILES)
"""The names :meth:`Hardware.profile` knows."""

PLATFORM_PROFILES = {"cpu": "cpu", "gpu": "h100-80gb", "tpu": "tpu-v5p"}
"""The profile a platform's devices are priced on where no hardware is given."""


@dataclasses.dataclass(frozen=True)
class Hardware:
    """What one device of a machine can do, and the links between devices.

    Args:
        name: the profile's name (``"measured"`` for :meth:`measure`).
        flops: dtype name -> peak matmul FLOP/s per device (``"bfloat16"``, ``"float32"``).
        hbm_bandwidth: device memory bandwidth, bytes/s.
        memory_bytes: device memory, bytes.
        interconnect: link kind -> :class:`Link`.
        default_link: the kind of an axis nothing else decides.
        devices_per_host: with ``cross_host_link``: devices that share the default link.
        cross_host_link: the kind of an axis whose groups span hosts (GPU profiles: ``"network"``).
        axis_links: mesh axis name -> link kind, before any other rule.
        matmul_efficiency: the fraction of the peak FLOP/s a large matmul reaches.
        attention_efficiency: the fraction of the peak a fused attention kernel reaches.
        memory_efficiency: the fraction of ``hbm_bandwidth`` a streaming kernel reaches.
        kernel_launch_s: seconds each kernel adds (launch and scheduling).
        cache_bytes: a kernel touching at most this many bytes per device runs at
            ``cache_bandwidth`` (its working set stays in cache; 0: every kernel streams at
            ``hbm_bandwidth``). :meth:`measure` fits both on a CPU, where a step's activations
            often fit the caches; the GPU and TPU profiles leave it 0.
        cache_bandwidth: the bandwidth of such a kernel, bytes/s.
        host_bandwidth: bytes/s per device and direction between its memory and the host's
            (pinned) memory, the link an offloaded state crosses (PCIe; 0: not known).

    Example:
        >>> from meshdsl.costmodel.hardware import Hardware
        >>> v5p = Hardware.profile("tpu-v5p").with_links(data="dcn")   # data across slices
        >>> v5p.link("data", {"data": 2, "model": 256}), v5p.link("model", {"data": 2, "model": 256})
        ('dcn', 'ici')
    """

    name: str
    flops: Mapping[str, float]
    hbm_bandwidth: float
    memory_bytes: float
    interconnect: Mapping[str, Link]
    default_link: str
    devices_per_host: int | None = None
    cross_host_link: str | None = None
    axis_links: Mapping[str, str] = dataclasses.field(default_factory=dict)
    matmul_efficiency: float = 1.0
    attention_efficiency: float = 1.0
    memory_efficiency: float = 1.0
    kernel_launch_s: float = 0.0
    cache_bytes: float = 0.0
    cache_bandwidth: float = 0.0
    host_bandwidth: float = 0.0

    def __post_init__(self) -> None:
        named = {"default_link": self.default_link, "cross_host_link": self.cross_host_link,
                 **{f"axis_links[{a!r}]": k for a, k in self.axis_links.items()}}
        for what, kind in named.items():
            if kind is not None and kind not in self.interconnect:
                raise MeshDSLError(f"{what} = {kind!r} is not a link of hardware {self.name!r}"
                                   f"{suggest(kind, self.interconnect)}; its links: {sorted(self.interconnect)}")

    @classmethod
    def profile(cls, name: str) -> Hardware:
        """The profile ``name``, one of :data:`PROFILES`.

        Raises:
            MeshDSLError: an unknown name (the message lists the known ones).
        """
        if name not in _PROFILES:
            raise MeshDSLError(f"unknown hardware profile {name!r}{suggest(name, PROFILES)}; "
                               f"known profiles: {', '.join(PROFILES)}")
        return cls(name=name, **_PROFILES[name])

    @classmethod
    def of(cls, hardware, mesh) -> Hardware:
        """``hardware`` (a :class:`Hardware` or a profile's name), else a profile of ``mesh``'s
        platform (:data:`PLATFORM_PROFILES`: ``cpu``, ``h100-80gb`` for a GPU, ``tpu-v5p`` for a TPU)."""
        if hardware is None:
            return cls.profile(PLATFORM_PROFILES.get(mesh.platform, "cpu"))
        return cls.profile(hardware) if isinstance(hardware, str) else hardware

    def with_links(self, **axis_links: str) -> Hardware:
        """A copy where each named mesh axis runs on the given link kind: ``with_links(data="dcn")``."""
        return dataclasses.replace(self, axis_links={**self.axis_links, **axis_links})

    def peak_flops(self, dtype) -> float:
        """Peak matmul FLOP/s per device for ``dtype`` (a name or a dtype)."""
        try:
            key = jnp.dtype(dtype).name
        except TypeError:
            key = str(dtype)
        if key not in self.flops:
            raise MeshDSLError(f"hardware {self.name!r} has no peak FLOP/s for {key}; it has {sorted(self.flops)}")
        return self.flops[key]

    def memory_seconds(self, nbytes: float, touched: float | None = None) -> float:
        """Seconds to move ``nbytes`` through memory by kernels each touching ``touched`` bytes
        (default ``nbytes``: one kernel): at ``cache_bandwidth`` where that fits ``cache_bytes``,
        else at ``hbm_bandwidth`` times ``memory_efficiency``."""
        touched = nbytes if touched is None else touched
        if self.cache_bytes and touched <= self.cache_bytes:
            return nbytes / self.cache_bandwidth
        return nbytes / (self.hbm_bandwidth * self.memory_efficiency)

    def host_seconds(self, nbytes: float) -> float:
        """Seconds to move ``nbytes`` per device between device and host memory, one way."""
        if not self.host_bandwidth:
            raise MeshDSLError(f"hardware {self.name!r} has no host link bandwidth; give one with "
                               f"dataclasses.replace(hw, host_bandwidth=...) or use Hardware.measure")
        return nbytes / self.host_bandwidth

    def matmul_peak(self, operand_dtype) -> float:
        """Peak FLOP/s of a matmul whose operands are ``operand_dtype``: 16-bit and narrower at the
        bfloat16 rate, wider (float32, 32- and 64-bit integers) at the float32 rate."""
        name = str(operand_dtype)
        wide = name in ("float32", "float64", "int32", "int64", "uint32", "uint64")
        return self.peak_flops("float32" if wide else "bfloat16")

    def link(self, axes: str | Sequence[str], mesh) -> str:
        """The link kind of a collective over ``axes`` (one mesh axis name or several, or a part of
        an axis as reports write it, ``"x:(1)4"``) on ``mesh`` (a :class:`~meshdsl.Mesh`, a dict of
        axis sizes, or ``str(mesh)``): of several, the slowest (least bandwidth)."""
        sizes = _mesh_sizes(mesh)
        kinds = [self._axis_link(a, sizes) for a in ([axes] if isinstance(axes, str) else axes)]
        return min(kinds, key=lambda k: (self.interconnect[k].bandwidth, -self.interconnect[k].latency))

    def _axis_link(self, axis: str, sizes: dict[str, int]) -> str:
        name, before, part = _axis_part(axis, sizes)
        if name in self.axis_links:
            return self.axis_links[name]
        if self.cross_host_link is None:
            return self.default_link
        order = list(sizes)
        stride = math.prod(sizes[a] for a in order[order.index(name) + 1:]) * (sizes[name] // (before * part))
        inside = self.devices_per_host % (stride * part) == 0   # every group within one host's block
        return self.default_link if inside else self.cross_host_link

    @classmethod
    def measure(cls, mesh, *, seconds: float = 0.02) -> Hardware:
        """Fit the constants on the machine at hand, over the devices of ``mesh`` (a concrete
        :class:`~meshdsl.Mesh`); takes a few seconds (compiles dominate on CPU).

        Every device works at once (``jax.shard_map`` over the whole mesh): a square matmul per
        dtype gives FLOP/s, ``x * 2 + 1`` gives memory bandwidth (read + write), and per mesh axis
        an all-reduce and an all-gather at three sizes give a link, fitted by least squares (relative
        error) to ``latency + bytes / bandwidth`` with the bytes of :mod:`meshdsl.costmodel.cost`. Each call is
        repeated for ``seconds`` after its compile and the fastest run counts. The links are named
        after the axes they were measured on (``axis_links`` maps each axis to its own).

        Example:
            >>> import meshdsl as md
            >>> from meshdsl.costmodel.hardware import Hardware
            >>> hw = Hardware.measure(md.Mesh({"data": 2, "model": 4}))   # doctest: +SKIP
            >>> hw.name, sorted(hw.interconnect), hw.link("model", md.Mesh({"data": 2, "model": 4}))  # doctest: +SKIP
            ('measured', ['data', 'model'], 'model')
        """
        axes = [a for a in mesh.axis_names if mesh.shape[a] > 1]
        if mesh.is_abstract or not axes:
            raise MeshError(f"Hardware.measure needs a mesh of devices with an axis of size > 1, got {mesh!r}")
        timer = Timer(mesh, seconds)
        links = {a: Link(*link_fit(*timer.collectives(a))) for a in axes}
        streaming = timer.elementwise()
        cache_bytes, cache_bandwidth = cache_fit(timer.in_loop(), streaming)
        return cls(name="measured", flops={d: timer.matmul(d) for d in ("bfloat16", "float32")},
                   hbm_bandwidth=streaming, memory_bytes=device_memory(mesh),
                   interconnect=links, default_link=min(links, key=lambda a: links[a].bandwidth),
                   axis_links={a: a for a in axes}, cache_bytes=cache_bytes, cache_bandwidth=cache_bandwidth,
                   host_bandwidth=timer.host_copy())


def _mesh_sizes(mesh) -> dict[str, int]:
    """Axis sizes of a Mesh, a dict, or a mesh's text ``"data:2 x model:4"``."""
    if isinstance(mesh, Mapping):
        return dict(mesh)
    if isinstance(mesh, str):
        return {n: int(s) for n, s in (item.split(":") for item in mesh.split(" x "))}
    return mesh.shape


def _axis_part(axis: str, sizes: dict[str, int]) -> tuple[str, int, int]:
    """``(name, before, size)``: a whole axis ``"x"`` is ``(x, 1, size of x)``; a part ``"x:(2)4"``
    (the part of size 4 whose major factors multiply to 2, :meth:`Mesh.axes_text`) is ``(x, 2, 4)``."""
    m = re.fullmatch(r"(\w+):\((\d+)\)(\d+)", axis)
    name = m.group(1) if m else axis
    if name not in sizes:
        raise MeshError(f"mesh {sizes} has no axis {name!r}{suggest(name, sizes)}")
    return (name, int(m.group(2)), int(m.group(3))) if m else (name, 1, sizes[name])
