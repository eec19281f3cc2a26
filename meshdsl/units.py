"""Human-readable units for reports: bytes (KiB, MiB, GiB) and FLOPs."""

from __future__ import annotations

__all__ = ["fmt_bytes", "fmt_flops"]


def fmt_bytes(n: float) -> str:
    """``1536`` -> ``'1.50 KiB'`` (binary units)."""
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def fmt_flops(n: float) -> str:
    """``2.1e6`` -> ``'2.10 MFLOP'``."""
    for unit, scale in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} FLOP"
