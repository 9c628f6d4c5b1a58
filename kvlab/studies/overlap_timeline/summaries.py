"""Two small summaries of raw tables, which the measurement returns with its rounds and the analysis recomputes
from a run's tables: what the profiler costs (`tracing_overhead`, from trace_handoff's walls) and what the
per-layer CUDA events cost (`event_overhead`, from event_handoff's rounds). Pure pandas; no GPU.

They sit apart so that the measurement (trace, events) and the analysis (report, the face) both use them
without the measurement importing the analysis.
"""

from __future__ import annotations

import pandas as pd

from ...intervals import median_ci

__all__ = ["tracing_overhead", "event_overhead"]


def tracing_overhead(walls: pd.DataFrame) -> pd.DataFrame:
    """Tracing overhead per variant from trace_handoff's walls: median wall with and without the profiler
    (+ ranges), and the difference as a percentage of the untraced median (goal: ≤ 5 % of prefill).
    Columns: variant, untraced_ms, traced_ms, overhead_ms, overhead_pct."""
    rows = []
    for variant, g in walls.groupby("variant", sort=False):
        plain = float(g[~g.traced].wall_ms.median())
        traced = float(g[g.traced].wall_ms.median())
        rows.append({"variant": variant, "untraced_ms": plain, "traced_ms": traced, "overhead_ms": traced - plain,
                     "overhead_pct": 100 * (traced - plain) / plain if plain > 0 else float("nan")})
    return pd.DataFrame(rows)


def event_overhead(rounds: pd.DataFrame) -> pd.DataFrame:
    """What the per-layer CUDA events cost prefill, from event_handoff's rounds (variant "layer-wise" and
    "layer-wise + events", round, prefill_ms): one row of untimed_ms and evented_ms (medians), extra_ms (the
    median of the paired differences, same round) with its 95 % bootstrap interval extra_ci_lo_ms /
    extra_ci_hi_ms (kvlab.intervals.median_ci), overhead_pct (extra over the untimed median) and rounds (pairs)."""
    ev = rounds[rounds.variant == "layer-wise + events"].set_index("round").prefill_ms
    pl = rounds[rounds.variant == "layer-wise"].set_index("round").prefill_ms
    diff = (ev - pl).dropna()
    lo, hi = median_ci(diff)
    base = float(pl.median())
    return pd.DataFrame([{"untimed_ms": base, "evented_ms": float(ev.median()), "extra_ms": float(diff.median()),
                          "extra_ci_lo_ms": lo, "extra_ci_hi_ms": hi, "overhead_pct": 100 * float(diff.median()) / base,
                          "rounds": len(diff)}])
