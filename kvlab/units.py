"""Units and their formatting, once for the whole package: binary byte sizes (KiB, MiB, GiB) and how a
size is written in a table or a message. Decimal GB/s are computed where they are measured (bytes / s / 1e9).
"""

from __future__ import annotations

import math
import numbers

__all__ = ["KiB", "MiB", "GiB", "TiB", "fmt_bytes"]

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40


def fmt_bytes(n: float) -> str:
    """A byte count in binary units with four significant digits: 524288 → "512 KiB", 1.5 · 2**20 →
    "1.5 MiB", 1000 → "1000 B", 4294967296 → "4 GiB". Raises ValueError for a negative or non-finite n."""
    if isinstance(n, bool) or not isinstance(n, numbers.Real) or not math.isfinite(n) or n < 0:
        raise ValueError(f"fmt_bytes({n!r}): need a number of bytes ≥ 0")
    for unit, scale in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale:
            return f"{n / scale:.4g} {unit}"
    return f"{n:.4g} B"
