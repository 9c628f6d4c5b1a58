"""The statistics kvlab reports: a summary of samples (Stats), the 95 % bootstrap interval of a median and of a
ratio of medians, and how a time in milliseconds is written. Numpy only: an analysis that judges a goal from a
committed table needs no torch (kvlab.timing takes the samples; this module says what they show)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

__all__ = ["Stats", "stats", "median_ci", "quantile_ci", "mean_ci", "ratio_ci", "MIN_CI_SAMPLES", "fmt_ms"]


# --------------------------------------------------------------------------- #
# statistics
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class Stats:
    """Summary of ``n`` samples of one quantity.

    Attributes are floats in ``unit`` (``"ms"`` by default). ``std`` is the
    sample standard deviation (ddof=1; 0.0 when n == 1). ``p10``/``p90`` are
    linear-interpolation percentiles, present only when n >= 10 — with fewer
    samples they would just re-label the min and max.
    """

    n: int
    median: float
    min: float
    max: float
    mean: float
    std: float
    p10: float | None = None
    p90: float | None = None
    unit: str = "ms"

    @property
    def spread(self) -> float:
        """max − min, in ``unit`` (the seed's "spread" column)."""
        return self.max - self.min

    def fmt(self, digits: int = 3, unit: bool = True) -> str:
        """``"median (min–max)"`` with ``digits`` significant digits, e.g. ``"11.8 (11.2–13) µs"``."""
        if not isinstance(digits, int) or digits < 1:
            raise ValueError(f"digits={digits!r}: expected an int >= 1")
        f = f"{{:.{digits}g}}"
        text = f"{f.format(self.median)} ({f.format(self.min)}–{f.format(self.max)})"
        return f"{text} {self.unit}" if unit and self.unit else text

    def __str__(self) -> str:
        return self.fmt()

    def to_dict(self) -> dict:
        """Plain dict (JSON-ready) of every field."""
        return asdict(self)


def stats(samples, unit: str = "ms") -> Stats:
    """Summarise samples into a :class:`Stats`.

    Args:
        samples: one or more finite numbers (list, numpy array or tensor;
            flattened). Negative values are allowed (e.g. a signed exposure).
        unit: label carried into :class:`Stats` and its formatting.

    Raises:
        ValueError: no samples, or a sample that is NaN/inf.
    """
    if hasattr(samples, "detach"):  # a torch tensor, read without importing torch
        arr = samples.detach().cpu().double().reshape(-1).numpy()
    elif isinstance(samples, np.ndarray):
        arr = samples.astype(np.float64).reshape(-1)
    else:
        arr = np.asarray(list(samples), dtype=np.float64).reshape(-1)
    if arr.size == 0:
        raise ValueError("stats() got no samples: pass at least one number")
    if not np.all(np.isfinite(arr)):
        bad = arr[~np.isfinite(arr)][0]
        raise ValueError(f"stats() got a non-finite sample {bad!r}: every sample must be a finite number")
    n = int(arr.size)
    p10 = p90 = None
    if n >= 10:
        p10, p90 = (float(v) for v in np.percentile(arr, [10, 90]))
    return Stats(
        n=n,
        median=float(np.median(arr)),
        min=float(arr.min()),
        max=float(arr.max()),
        mean=float(arr.mean()),
        std=float(arr.std(ddof=1)) if n > 1 else 0.0,
        p10=p10,
        p90=p90,
        unit=unit,
    )


def median_ci(samples, level: float = 0.95, n_boot: int = 4000, seed: int = 0) -> tuple[float, float]:
    """A bootstrap confidence interval (percentile method) for the median of `samples`, e.g. the paired
    differences B − A of interleaved rounds.

    Why: prefill alone varies by several ms between runs at 16k tokens on our H200, so the median of nine
    paired differences can land a few ms either side of zero by chance; an interval says whether a
    difference (or a goal's threshold) is resolved by the rounds that were run. Deterministic (`seed`).
    Returns (low, high) in the samples' unit; (nan, nan) for fewer than MIN_CI_SAMPLES samples, where a
    bootstrap says nothing (one sample would give (x, x), an interval of zero width that a goal would count
    as resolved). Raises ValueError for no samples, non-finite samples, or a level outside (0, 1).
    """
    return _bootstrap(samples, lambda resamples: np.median(resamples, axis=1), level, n_boot, seed, "median_ci")


def _bootstrap(samples, statistic, level: float, n_boot: int, seed: int, who: str) -> tuple[float, float]:
    """The percentile-method interval of ``statistic`` (resamples (n_boot, n) → n_boot values) over `samples`."""
    if not 0 < level < 1:
        raise ValueError(f"level={level!r}: expected a fraction in (0, 1), e.g. 0.95")
    arr = np.asarray(list(samples), dtype=np.float64).reshape(-1)
    if arr.size == 0:
        raise ValueError(f"{who}() got no samples: pass at least one number")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{who}() got a non-finite sample: {arr[~np.isfinite(arr)][0]!r}")
    if arr.size < MIN_CI_SAMPLES:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    values = statistic(arr[rng.integers(0, arr.size, size=(n_boot, arr.size))])
    lo, hi = np.percentile(values, [100 * (1 - level) / 2, 100 * (1 + level) / 2])
    return float(lo), float(hi)


MIN_CI_SAMPLES = 3


def quantile_ci(samples, q: float, level: float = 0.95, n_boot: int = 4000, seed: int = 0) -> tuple[float, float]:
    """A bootstrap interval (percentile method) for the ``q`` quantile of `samples` (q = 0.95: the 95th
    percentile, numpy's linear interpolation), as median_ci does for the median — which it equals at q = 0.5.
    A tail quantile rests on few samples (q = 0.95 of 240 on the 12 largest), so its interval is wide where the
    tail is; (nan, nan) below MIN_CI_SAMPLES. ValueError for q outside [0, 1] and as median_ci."""
    if not 0 <= q <= 1:
        raise ValueError(f"q={q!r}: expected a quantile in [0, 1], e.g. 0.95")
    return _bootstrap(samples, lambda resamples: np.quantile(resamples, q, axis=1), level, n_boot, seed, "quantile_ci")


def mean_ci(samples, level: float = 0.95, n_boot: int = 4000, seed: int = 0) -> tuple[float, float]:
    """A bootstrap interval (percentile method) for the mean of `samples`: for a pooled share over units of equal
    weight (the tokens of prompts of one length: the mean of the per-prompt shares). As median_ci otherwise."""
    return _bootstrap(samples, lambda resamples: np.mean(resamples, axis=1), level, n_boot, seed, "mean_ci")


def ratio_ci(numerator, denominator, level: float = 0.95, n_boot: int = 4000, seed: int = 0) -> tuple[float, float]:
    """A bootstrap interval for median(numerator) / median(denominator) of two independent sets of samples —
    e.g. a contiguous copy's times over a send's times: the send's share of the ceiling, with the ceiling's own
    noise in the interval (resampling only the send would treat the ceiling as exact). Each set is resampled
    on its own. (nan, nan) when either has fewer than MIN_CI_SAMPLES samples."""
    if not 0 < level < 1:
        raise ValueError(f"level={level!r}: expected a fraction in (0, 1), e.g. 0.95")
    a = np.asarray(list(numerator), dtype=np.float64).reshape(-1)
    b = np.asarray(list(denominator), dtype=np.float64).reshape(-1)
    if a.size < MIN_CI_SAMPLES or b.size < MIN_CI_SAMPLES:
        return float("nan"), float("nan")
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        raise ValueError("ratio_ci() got a non-finite sample")
    rng = np.random.default_rng(seed)
    ma = np.median(a[rng.integers(0, a.size, size=(n_boot, a.size))], axis=1)
    mb = np.median(b[rng.integers(0, b.size, size=(n_boot, b.size))], axis=1)
    lo, hi = np.percentile(ma / mb, [100 * (1 - level) / 2, 100 * (1 + level) / 2])
    return float(lo), float(hi)


def fmt_ms(ms: float, digits: int = 3) -> str:
    """A duration given in ms, written in the unit that keeps it readable.

    ``0.0118 → "11.8 µs"``, ``3.4 → "3.4 ms"``, ``826.0 → "826 ms"``,
    ``1500 → "1.5 s"``; below 1 µs it is written in ns.
    """
    if not math.isfinite(ms):
        return str(ms)
    f = f"{{:.{digits}g}}"
    a = abs(ms)
    if a >= 1000:
        return f"{f.format(ms / 1000)} s"
    if a >= 1 or a == 0:
        return f"{f.format(ms)} ms"
    if a >= 1e-3:
        return f"{f.format(ms * 1e3)} µs"
    return f"{f.format(ms * 1e6)} ns"
