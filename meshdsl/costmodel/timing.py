"""Timing the machine at hand: what :meth:`meshdsl.costmodel.hardware.Hardware.measure` fits.

Every device works at once (``jax.shard_map`` over the whole mesh); each program is repeated for
a few hundredths of a second after its compile, and the fastest run counts. Plain numbers come
out (FLOP/s, bytes/s, seconds); the hardware module builds its profile from them.
"""

from __future__ import annotations

import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from .cost import moved_bytes
from ..platform.jaxcompat import host_memory_kind, to_memory

__all__ = ["Timer", "cache_fit", "link_fit", "device_memory"]


def cache_fit(points, streaming: float) -> tuple[float, float]:
    """``(cache_bytes, cache_bandwidth)`` from ``(bytes touched, bandwidth)`` of a kernel repeated
    in a loop at growing sizes: the largest size up to which every size runs at least 1.5x the
    streaming bandwidth, and the least bandwidth up to it (a kernel's working set that fits is
    never credited more than the slowest such size reached); ``(0, 0)`` where none does."""
    size, rate = 0.0, math.inf
    for touched, bandwidth in sorted(points):
        if bandwidth < 1.5 * streaming:
            break
        size, rate = touched, min(rate, bandwidth)
    return (size, rate) if size else (0.0, 0.0)


def link_fit(nbytes: np.ndarray, secs: np.ndarray) -> tuple[float, float]:
    """``(bandwidth, latency)``: least squares of ``secs ~ latency + nbytes / bandwidth`` in relative error (each point
    weighted by 1 / its time, so small messages decide the latency and large ones the bandwidth).
    Where timing noise makes a constant come out negative: latency 0, or bandwidth the best rate
    the largest message reached."""
    a = np.stack([np.ones_like(nbytes), nbytes], axis=1) / secs[:, None]
    latency, slope = np.linalg.lstsq(a, np.ones_like(secs), rcond=None)[0]
    bandwidth = 1.0 / slope if slope > 0 else float(nbytes.max() / secs.max())
    return float(bandwidth), float(max(latency, 0.0))


def device_memory(mesh) -> float:
    """Bytes of memory per device: the runtime's limit, else (CPU) physical memory over the local devices."""
    stats = mesh.jax_mesh.devices.flat[0].memory_stats()
    if stats and "bytes_limit" in stats:
        return float(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / jax.local_device_count()


class Timer:
    """Times per-device work run on every device of a mesh at once (see :meth:`Hardware.measure`)."""

    COLLECTIVE_ELEMENTS = (2 ** 8, 2 ** 16, 2 ** 20)   # float32 per device: 1 KiB, 256 KiB, 4 MiB

    def __init__(self, mesh, seconds: float) -> None:
        self.mesh, self.seconds = mesh.jax_mesh, seconds
        self.spec = P(mesh.axis_names)
        self.n = mesh.size

    def run(self, body, *local_shapes_dtypes) -> float:
        """Fastest time of ``body`` on every device over local blocks of the given shapes."""
        args = [jnp.ones((self.n * s[0], *s[1:]), d) for s, d in local_shapes_dtypes]
        f = jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=(self.spec,) * len(args), out_specs=self.spec))
        return self.best(f, *args)

    def best(self, f, *args) -> float:
        """Fastest time of ``f(*args)``, repeated for ``seconds`` after a first (compiling) run."""
        jax.block_until_ready(f(*args))   # compile and warm up
        best, spent = math.inf, 0.0
        while spent < self.seconds or best == math.inf:
            start = time.perf_counter()
            jax.block_until_ready(f(*args))
            took = time.perf_counter() - start
            best, spent = min(best, took), spent + took
        return best

    def grown(self, timed, size: int, limit: int) -> tuple[int, float]:
        """``timed(size)``, doubling ``size`` (up to ``limit``) until one run takes ``seconds / 4``."""
        took = timed(size)
        while took < self.seconds / 4 and size < limit:
            size *= 2
            took = timed(size)
        return size, took

    def host_copy(self) -> float:
        """Bytes/s of one device's arrays moved to host memory (0 where it has none): the
        direction an offloaded state leaves by (both directions take one link)."""
        device = self.mesh.devices.flat[0]
        if host_memory_kind(device) is None:
            return 0.0

        def timed(k):
            x = jax.device_put(jnp.ones((k,), jnp.float32), device)
            return self.best(jax.jit(lambda x: to_memory(x * 1.0, "host")), x)
        size, took = self.grown(timed, 2 ** 20, 2 ** 26)
        return 4.0 * size / took

    def matmul(self, dtype: str) -> float:
        n, took = self.grown(lambda n: self.run(jnp.dot, ((n, n), dtype), ((n, n), dtype)), 128, 8192)
        return 2.0 * n ** 3 / took

    def elementwise(self) -> float:
        size, took = self.grown(lambda k: self.run(lambda x: x * 2 + 1, ((k,), jnp.float32)), 2 ** 20, 2 ** 26)
        return 2.0 * 4 * size / took   # read and write 4-byte elements

    CACHE_ELEMENTS = (2 ** 14, 2 ** 16, 2 ** 18, 2 ** 20)   # float32 per device: 64 KiB .. 4 MiB
    LOOP = 64

    def in_loop(self) -> list:
        """``(bytes touched, bandwidth)`` of ``x * a + 1`` repeated in a loop inside one program
        (no dispatch between runs) at each of :data:`CACHE_ELEMENTS` per device."""
        def body(x):
            return jax.lax.fori_loop(0, self.LOOP, lambda i, v: v * 0.5 + 1.0, x)
        return [(2.0 * 4 * k, 2.0 * 4 * k * self.LOOP / self.run(body, ((k,), jnp.float32)))
                for k in self.CACHE_ELEMENTS]

    def collectives(self, axis: str) -> tuple[np.ndarray, np.ndarray]:
        """Bytes sent per device and seconds, for an all-reduce and an all-gather over ``axis``."""
        group = self.mesh.shape[axis]
        nbytes, secs = [], []
        for k in self.COLLECTIVE_ELEMENTS:
            for kind, body, result in (("all-reduce", lambda x: jax.lax.psum(x, axis), k),
                                       ("all-gather", lambda x: jax.lax.all_gather(x, axis, tiled=True), k * group)):
                nbytes.append(moved_bytes(kind, 4 * k, 4 * result, group))
                secs.append(self.run(body, ((k,), jnp.float32)))
        return np.array(nbytes), np.array(secs)
