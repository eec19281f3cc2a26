"""Human-readable units for reports: bytes (KiB, MiB, GiB) and FLOPs."""

from __future__ import annotations

__all__ = ["fmt_bytes", "fmt_flops", "fmt_seconds", "parse_bytes"]

_UNITS = {"": 1, "b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
          "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}


def fmt_bytes(n: float) -> str:
    """``1536`` -> ``'1.50 KiB'`` (binary units)."""
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def parse_bytes(value) -> float:
    """``"12GiB"``, ``"512 MB"``, ``1e9`` -> bytes."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    text = str(value).strip().lower().replace(" ", "")
    number = text.rstrip("kmgtib")
    unit = text[len(number):]
    try:
        if unit not in _UNITS:
            raise ValueError
        return float(number) * _UNITS[unit]
    except ValueError:
        raise ValueError(f"cannot read {value!r} as a size in bytes; write it as 12GiB, 512MB or a number "
                         "of bytes") from None


def fmt_flops(n: float) -> str:
    """``2.1e6`` -> ``'2.10 MFLOP'``."""
    for unit, scale in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} FLOP"


def fmt_seconds(seconds: float) -> str:
    """``1.5e-4`` -> ``'150.00 us'``."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.2f} {unit}"
    return f"{seconds / 1e-9:.2f} ns" if seconds else "0 s"
