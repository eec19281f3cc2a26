"""The collective cost model, in one place.

Bytes moved per device follow the bandwidth-optimal ring formulas, exactly as ``hlo_comm`` counts
them on compiled HLO (``n`` = devices in the group, ``S`` = buffer bytes):

    all-reduce          2 (n-1)/n * S        S = buffer
    all-gather          (n-1)/n * S_full     S_full = gathered result
    reduce-scatter      (n-1)/n * S_full     S_full = operand before scattering
    all-to-all          (n-1)/n * S          S = operand
    ragged-all-to-all   (n-1)/n * S          S = operand buffer: the most it moves (the rows sent vary)
    collective-permute  S                    per sending device

Element sizes follow the backend: XLA's CPU backend carries bf16 collectives as f32, so on CPU a
bf16 element moves 4 bytes (a GPU or TPU moves 2).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from numpy.typing import DTypeLike

__all__ = ["KINDS", "element_bytes", "moved_bytes", "dual_bytes"]

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all", "collective-permute")
"""The collective kinds, in the order reports list them (the names XLA gives them in HLO)."""


def dual_bytes(records) -> float:
    """The backward bytes that forward collective ``records`` imply by duality: a gather's
    reduce-scatter, a reduce-scatter's gather, an all-to-all and a permute back; an all-reduce's
    transpose (a cast) moves nothing."""
    return sum(r.total_bytes for r in records if r.phase == "forward" and r.kind != "all-reduce")


def element_bytes(dtype: DTypeLike, platform: str) -> int:
    """Bytes one element of ``dtype`` occupies in a collective on ``platform``.

    Example:
        >>> from meshdsl.costmodel.cost import element_bytes
        >>> element_bytes("bfloat16", "tpu"), element_bytes("bfloat16", "cpu"), element_bytes("float32", "gpu")
        (2, 4, 4)
    """
    dtype = np.dtype(dtype)
    if platform == "cpu" and dtype.name == "bfloat16":
        return 4
    return dtype.itemsize


def moved_bytes(kind: str, operand_bytes: float, result_bytes: float, n: int) -> float:
    """Bytes one device sends for one execution of a collective over ``n`` devices.

    ``kind`` is one of :data:`KINDS`; ``operand_bytes`` and ``result_bytes`` are the local buffer
    sizes before and after the collective. A group of one device moves nothing.

    Example:
        >>> from meshdsl.costmodel.cost import moved_bytes
        >>> moved_bytes("all-reduce", 1024, 1024, 4)       # 2 (n-1)/n * S
        1536.0
        >>> moved_bytes("all-gather", 256, 1024, 4)        # (n-1)/n * S_full
        768.0
        >>> moved_bytes("collective-permute", 64, 64, 8)   # S
        64.0
    """
    if n <= 1:
        return 0.0
    if kind == "all-reduce":
        return 2.0 * (n - 1) / n * operand_bytes
    if kind == "all-gather":
        return (n - 1) / n * result_bytes
    if kind in ("reduce-scatter", "all-to-all", "ragged-all-to-all"):   # (ragged: its whole buffer, the most)
        return (n - 1) / n * operand_bytes
    if kind == "collective-permute":
        return float(operand_bytes)
    raise ValueError(f"unknown collective kind {kind!r}")


def array_bytes(shape: Sequence[int], dtype: DTypeLike, platform: str) -> int:
    """Bytes of an array of ``shape`` and ``dtype`` as a collective on ``platform`` moves it."""
    return math.prod(shape) * element_bytes(dtype, platform)
