"""The collective cost model, in one place.

Bytes moved per device follow the bandwidth-optimal ring formulas, exactly as ``hlo_comm`` counts
them on compiled HLO (``n`` = devices in the group, ``S`` = buffer bytes):

    all-reduce          2 (n-1)/n * S        S = buffer
    all-gather          (n-1)/n * S_full     S_full = gathered result
    reduce-scatter      (n-1)/n * S_full     S_full = operand before scattering
    all-to-all          (n-1)/n * S          S = operand
    collective-permute  S                    per sending device

Element sizes follow the backend: XLA's CPU backend carries bf16 collectives as f32, so on CPU a
bf16 element moves 4 bytes (a GPU or TPU moves 2).
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["KINDS", "element_bytes", "moved_bytes"]

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def element_bytes(dtype, platform: str) -> int:
    dtype = np.dtype(dtype)
    if platform == "cpu" and dtype.name == "bfloat16":
        return 4
    return dtype.itemsize


def moved_bytes(kind: str, operand_bytes: float, result_bytes: float, n: int) -> float:
    """Bytes one device sends for one execution of a collective over ``n`` devices."""
    if n <= 1:
        return 0.0
    if kind == "all-reduce":
        return 2.0 * (n - 1) / n * operand_bytes
    if kind == "all-gather":
        return (n - 1) / n * result_bytes
    if kind in ("reduce-scatter", "all-to-all"):
        return (n - 1) / n * operand_bytes
    if kind == "collective-permute":
        return float(operand_bytes)
    raise ValueError(f"unknown collective kind {kind!r}")


def array_bytes(shape, dtype, platform: str) -> int:
    return math.prod(shape) * element_bytes(dtype, platform)
