"""Units and their formatting, once for the whole package: binary byte sizes (KiB, MiB, GiB) and how a
size is written in a table or a message. Decimal GB/s are computed where they are measured (bytes / s / 1e9).
"""

from __future__ import annotations

import math
import numbers

__all__ = ["KiB", "MiB", "GiB", "TiB", "fmt_bytes", "sig"]

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


def sig(x: float, digits: int) -> str:
    """``x`` rounded to ``digits`` significant digits, with thousands separators and never in exponent form (what a
    reader of a page sees): sig(1167.3, 4) → "1,167", sig(12346, 4) → "12,350", sig(0.15757, 4) → "0.1576",
    sig(5.70, 3) → "5.7". Non-finite values are written as Python writes them."""
    x = float(x)
    if x == 0:
        return "0"  # -0.0 too
    if not math.isfinite(x):
        return f"{x:g}"
    places = digits - 1 - math.floor(math.log10(abs(x)))
    text = f"{round(x, places):,.{max(places, 0)}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text
