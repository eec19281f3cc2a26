"""Dropout as a function of a PRNG key: the same mask under every layout.

    y = where(keep, x / (1 - rate), 0),   keep ~ Bernoulli(1 - rate) over x's dims

``keep`` comes from ``md.random.bernoulli``, which draws each element from its *global* position,
so a layout only decides which block of the one global mask each device builds: no communication,
and training under data, tensor or expert parallelism drops exactly the same activations as on one
device. ``key=None`` (or ``rate == 0``) is the deterministic (evaluation) path.
"""

from __future__ import annotations

from flax import nnx

import meshdsl as md

__all__ = ["Dropout", "dropout"]


def dropout(x: md.NamedArray, rate: float, key=None) -> md.NamedArray:
    """Zero each element with probability ``rate`` and scale the rest by ``1 / (1 - rate)``."""
    if key is None or rate == 0.0:
        return x
    if not 0.0 <= rate < 1.0:
        raise md.MeshDSLError(f"dropout rate must be in [0, 1), got {rate}")
    keep = md.random.bernoulli(key, 1.0 - rate, x.dims)
    return md.where(keep, x / (1.0 - rate), 0)


class Dropout(nnx.Module):
    """``Dropout(rate)(x, key)``: :func:`dropout` as a module (no parameters)."""

    def __init__(self, rate: float):
        self.rate = rate

    def __call__(self, x: md.NamedArray, key=None) -> md.NamedArray:
        return dropout(x, self.rate, key)
