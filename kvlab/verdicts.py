"""The one rule that judges every goal in kvlab, and the Goal it judges (the goals themselves: kvlab.goals).

A goal names a study, the metric of its summary table that it judges (a column), the yardstick (a number, or
another column: one bulk copy's time, one layer's send), the direction, and — where the measurement has one —
the interval around the metric (a 95 % bootstrap interval of the median: of paired differences, of a copy or of a send).
Every verdict in kvlab, in notebooks, in `kvlab analyse`, in the README, comes from `evaluate` under one rule:

    with an interval   met     when the whole interval is on the goal's side of the yardstick
                       missed  when the whole interval is on the other side
                       not resolved otherwise (the measurement cannot tell)
    a point value      met or missed by the value alone (said as such: rule "point")
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import pandas as pd

__all__ = ["Goal", "VERDICTS", "judge", "evaluate", "state"]

VERDICTS = ("met", "missed", "not resolved")
_OPS = ("<=", ">=")


def _always(row, table) -> bool:
    return True


@dataclass(frozen=True)
class Goal:
    """One goal. metric / lo / hi / threshold (when a str) are columns of the study's summary table.

    applies(row, table) says which rows it judges (e.g. only the longest context); declared says when and
    where it was fixed; beside names the earlier goal a later yardstick stands beside."""

    id: str
    study: str
    text: str
    metric: str
    op: str
    threshold: float | str
    lo: str | None = None
    hi: str | None = None
    interval: str = ""
    unit: str = ""
    digits: int = 2
    applies: Callable[[Any, pd.DataFrame], bool] = field(default=_always, compare=False)
    declared: str = ""
    beside: str | None = None
    note: str = ""

    def __post_init__(self):
        if self.op not in _OPS:
            raise ValueError(f"goal {self.id}: op {self.op!r} is not one of {list(_OPS)}")
        if (self.lo is None) != (self.hi is None):
            raise ValueError(f"goal {self.id}: give both lo and hi (the interval's columns) or neither")


def _num(x) -> float:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return float("nan")
    return v


def judge(value, lo, hi, op: str, threshold) -> tuple[str, str]:
    """(verdict, rule) of one measurement against one yardstick — the one rule (see the module doc).

    lo/hi None (a goal without an interval): the point value decides (rule "point"); lo/hi given but NaN (too few
    samples for an interval): "not resolved" (rule "no interval"); a NaN value or threshold: "not resolved"."""
    if op not in _OPS:
        raise ValueError(f"op {op!r} is not one of {list(_OPS)}")
    if (lo is None) != (hi is None):
        raise ValueError(f"an interval needs both ends: lo={lo!r}, hi={hi!r} (both None: judge the point value)")
    v, t, a, b = _num(value), _num(threshold), _num(lo), _num(hi)
    if math.isnan(t) or (math.isnan(v) and (math.isnan(a) or math.isnan(b))):
        return "not resolved", "no value"
    if lo is not None and hi is not None and (math.isnan(a) or math.isnan(b)):
        # the goal has an interval but this measurement could not give one (too few samples): its point
        # value alone cannot decide a goal that is judged on an interval
        return "not resolved", "no interval"
    if not (math.isnan(a) or math.isnan(b)):
        a, b = min(a, b), max(a, b)
        if op == "<=":
            return ("met" if b <= t else "missed" if a > t else "not resolved"), "interval"
        return ("met" if a >= t else "missed" if b < t else "not resolved"), "interval"
    ok = v <= t if op == "<=" else v >= t
    return ("met" if ok else "missed"), "point"


def state(verdict: str) -> bool | None:
    """A verdict as True / False / None (not resolved), as goal tables' `met` column holds it."""
    return {"met": True, "missed": False}.get(verdict)


def _fmt(x, digits: int) -> str:
    v = _num(x)
    return "nan" if math.isnan(v) else f"{v:,.{digits}f}"


def evaluate(goals, table: pd.DataFrame, keys=("context", "destination")) -> pd.DataFrame:
    """Judge `table` (a study's summary, one row per configuration) against `goals`. A row without the
    goal's value (a measurement an older run did not take) is left out rather than judged.

    Returns one row per (goal, row it applies to): id, goal (its text), the `keys` columns, value (the
    metric, its interval and the yardstick, as text), metric, lo, hi, threshold (numbers), verdict, met (True /
    False / None), rule ("interval" | "point" | "no value"), how (what the interval is, and the yardstick).
    """
    rows = []
    for g in goals:
        for r in table.itertuples(index=False):
            if not g.applies(r, table):
                continue
            # a column the table lacks (an older run's summary) counts as no value: NaN
            nan = float("nan")
            thr = getattr(r, g.threshold, nan) if isinstance(g.threshold, str) else g.threshold
            value = getattr(r, g.metric, nan)
            # a table without the interval's columns (a run from before they were kept) is judged on the point,
            # and says so; columns present but empty (too few samples) leave the goal not resolved
            lo = getattr(r, g.lo, None) if g.lo else None
            hi = getattr(r, g.hi, None) if g.hi else None
            verdict, rule = judge(value, lo, hi, g.op, thr)
            if rule == "no value":  # a measurement this run did not take (an older run): not judged
                continue
            text = f"{_fmt(value, g.digits)}{g.unit}"
            if rule == "interval":
                text += f" [{_fmt(lo, g.digits)}, {_fmt(hi, g.digits)}]"
            elif rule == "no interval":
                text += " [too few samples for an interval]"
            text += f" {g.op} {_fmt(thr, g.digits)}{g.unit}"
            how = (g.interval + "; " if rule == "interval" and g.interval else "") + (
                f"yardstick: {g.threshold}" if isinstance(g.threshold, str) else f"threshold {g.threshold}{g.unit}")
            rows.append(dict(id=g.id, goal=g.text, **{k: getattr(r, k, None) for k in keys}, value=text,
                             metric=_num(value), lo=_num(lo), hi=_num(hi), threshold=_num(thr), verdict=verdict,
                             met=state(verdict), rule=rule, how=how))
    cols = ["id", "goal", *keys, "value", "metric", "lo", "hi", "threshold", "verdict", "met", "rule", "how"]
    return pd.DataFrame(rows, columns=cols)
