"""Byte counts and rates as people read them (decimal units, as download tools show)."""

from __future__ import annotations


def format_bytes(n: float) -> str:
    """``n`` bytes in decimal units: ``"7.4 MB"``."""
    if abs(n) < 1000:
        return f"{n:.0f} B"
    for unit in ("KB", "MB", "GB", "TB"):
        n /= 1000
        if abs(n) < 1000:
            return f"{n:.1f} {unit}"
    return f"{n / 1000:.1f} PB"


def format_rate(bytes_per_second: float) -> str:
    """``"12.5 MB/s"``."""
    return f"{format_bytes(bytes_per_second)}/s"


__all__ = ["format_bytes", "format_rate"]
