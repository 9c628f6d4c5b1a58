"""What the link-ceilings sweep (kvlab.ceilings.measure) says: per path, a fixed cost per copy and a bandwidth
fitted to time = fixed + bytes / bandwidth (`fit_model`, `fit`), the ceiling (the best median GB/s over the
sweep), the `Ceilings` every later bandwidth is held against (`gbps`, `predict_ms`, JSON round trip), and the
table, figure and sentence a notebook shows. Reads the sweep's rows; never measures.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import NamedTuple, Sequence

import numpy as np
import pandas as pd

from . import plots
from .intervals import fmt_ms
from .parse import check_int
from .units import KiB, fmt_bytes

__all__ = ["fit_model", "fit", "Fit", "PathCeiling", "Ceilings", "summary_table", "plot", "finding_text"]

_REQUIRED = ("path", "size_bytes", "ms", "gbps")


# --------------------------------------------------------------------------- #
# fit
# --------------------------------------------------------------------------- #
def fit_model(size_bytes: Sequence[float], ms: Sequence[float]) -> tuple[float, float, float]:
    """Fit ``ms = t0 + size / B`` to per-size times, minimising *relative* error.

    Least squares on ``(t0 + size·b − t) / t``: every size weighs the same in
    proportion, so the small sizes (where t ≈ t0) pin the fixed cost and the
    large ones (where t ≈ size/B) pin the bandwidth — an unweighted fit would
    let the 1 GiB point swallow t0 whole. Constrained to t0 ≥ 0 and b ≥ 0.

    Args:
        size_bytes: payload per copy, bytes, >= 2 distinct values.
        ms: time per copy at each size, ms, > 0 (usually the median).

    Returns:
        ``(fixed_us, bandwidth_gbps, max_rel_err)``: t0 in µs, B in decimal
        GB/s (``inf`` if time does not grow with size), and the largest
        ``|fit − t| / t`` over the points.

    Raises:
        ValueError: mismatched lengths, fewer than 2 distinct sizes, or a
            non-positive or non-finite size or time.
    """
    s = np.asarray(size_bytes, dtype=np.float64).reshape(-1)
    t = np.asarray(ms, dtype=np.float64).reshape(-1)
    if s.shape != t.shape:
        raise ValueError(f"fit_model: {s.size} sizes but {t.size} times; pass one time per size")
    if np.unique(s).size < 2:
        raise ValueError(f"fit_model needs >= 2 distinct sizes to separate fixed cost from bandwidth; got {s.tolist()}")
    if not (np.all(np.isfinite(s)) and np.all(s > 0) and np.all(np.isfinite(t)) and np.all(t > 0)):
        raise ValueError(f"fit_model: sizes and times must be finite and > 0; got sizes {s.tolist()}, ms {t.tolist()}")
    g = s / 1e9  # GB, so b comes out in ms per GB and the two columns are of similar scale
    a = np.column_stack([1.0 / t, g / t])
    scale = np.linalg.norm(a, axis=0)
    coef, *_ = np.linalg.lstsq(a / scale, np.ones_like(t), rcond=None)
    t0, b = coef / scale
    if t0 < 0:
        # all fixed cost attributed to bandwidth: min Σ((g·b − t)/t)²
        t0, b = 0.0, float(np.sum(g / t) / np.sum(g**2 / t**2))
    if b * g.max() <= 1e-9 * np.min(t):
        # time does not grow with size (b is at most rounding noise): a pure fixed cost, min Σ((t0 − t)/t)²
        t0, b = float(np.sum(1.0 / t) / np.sum(1.0 / t**2)), 0.0
    pred = t0 + g * b
    max_rel = float(np.max(np.abs(pred - t) / t))
    bandwidth_gbps = 1e3 / b if b > 0 else math.inf  # b ms per GB → GB per s
    return float(t0 * 1e3), float(bandwidth_gbps), max_rel


@dataclass(frozen=True)
class PathCeiling:
    """The measured ceiling and the fitted model of one path.

    Attributes:
        path, mechanism: as in :func:`measure`.
        fixed_us: fitted fixed cost per copy, µs (NaN when fewer than 2 sizes).
        bandwidth_gbps: fitted bandwidth B, decimal GB/s (NaN as above; inf if
            time did not grow with size).
        ceiling_gbps: best per-size median GB/s — the number later bandwidths
            on this path are compared with.
        ceiling_min_gbps, ceiling_max_gbps: min and max GB/s of the samples at
            that size.
        ceiling_size_bytes: the size where the ceiling was measured.
        half_size_bytes: ``t0·B``, the copy size at which the fit reaches half
            of B (smaller copies are launch-bound).
        n_sizes: sizes measured; max_rel_err: largest relative fit error.
    """

    path: str
    mechanism: str
    fixed_us: float
    bandwidth_gbps: float
    ceiling_gbps: float
    ceiling_min_gbps: float
    ceiling_max_gbps: float
    ceiling_size_bytes: int
    half_size_bytes: float
    n_sizes: int
    max_rel_err: float

    @property
    def has_fit(self) -> bool:
        return math.isfinite(self.fixed_us) and not math.isnan(self.bandwidth_gbps)


def _json_float(x):
    # JSON has no NaN/inf; strings survive json.dump and float() reads them back
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return x


@dataclass
class Ceilings:
    """Ceilings and fits of every measured path, with where they were measured.

    ``paths``: path name → :class:`PathCeiling`. ``device``: GPU name or
    ``"cpu"``. ``p2p``: the peer-access matrix at measurement time. ``meta``:
    free-form (n, warmup, run id …).
    """

    paths: dict[str, PathCeiling]
    device: str = ""
    p2p: list = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    # -- lookup ------------------------------------------------------------- #
    def __contains__(self, path: str) -> bool:
        return path in self.paths

    def __getitem__(self, path: str) -> PathCeiling:
        if path not in self.paths:
            raise ValueError(f"no ceiling for path {path!r}; measured: {sorted(self.paths)}")
        return self.paths[path]

    @property
    def names(self) -> list[str]:
        return list(self.paths)

    def gbps(self, path: str) -> float:
        """The ceiling of ``path``, decimal GB/s (best median of the sweep)."""
        return self[path].ceiling_gbps

    def fixed_us(self, path: str) -> float:
        """Fitted fixed cost per copy of ``path``, µs."""
        return self[path].fixed_us

    def bandwidth_gbps(self, path: str) -> float:
        """Fitted bandwidth B of ``path``, decimal GB/s."""
        return self[path].bandwidth_gbps

    def predict_ms(self, path: str, nbytes: float, copies: int = 1) -> float:
        """Predicted ms to move ``nbytes`` in total as ``copies`` back-to-back copies.

        ``copies · t0 + nbytes / B`` — seed 004's model: its 32k cache was 56
        copies (K and V of 28 layers) of 1.88 GB in total.

        Raises:
            ValueError: unknown path, a path without a fit, ``nbytes < 0``, or
                ``copies`` not an int >= 1.
        """

        pc = self[path]
        copies = check_int("copies", copies, 1)
        if not (isinstance(nbytes, (int, float, np.integer, np.floating)) and math.isfinite(nbytes) and nbytes >= 0):
            raise ValueError(f"nbytes={nbytes!r}: expected a finite number of bytes >= 0")
        if not pc.has_fit:
            raise ValueError(f"path {path!r} has no fit (measured at {pc.n_sizes} size(s); the fit needs >= 2)")
        bytes_ms = 0.0 if math.isinf(pc.bandwidth_gbps) else nbytes / (pc.bandwidth_gbps * 1e9) * 1e3
        return copies * pc.fixed_us / 1e3 + bytes_ms

    def fraction(self, path: str, gbps: float) -> float:
        """``gbps`` as a fraction of the ceiling of ``path`` (1.0 = at the ceiling)."""
        return float(gbps) / self.gbps(path)

    # -- tables and JSON ------------------------------------------------------ #
    def table(self) -> pd.DataFrame:
        """One row per path, the :class:`PathCeiling` fields as columns."""
        return pd.DataFrame([asdict(pc) for pc in self.paths.values()], columns=[f.name for f in fields(PathCeiling)])

    @classmethod
    def from_table(cls, table: pd.DataFrame, device: str = "", p2p: list | None = None, meta: dict | None = None) -> "Ceilings":
        """Inverse of :meth:`table` (e.g. from a run's fit.csv)."""
        missing = [f.name for f in fields(PathCeiling) if f.name not in table.columns]
        if missing:
            raise ValueError(f"fit table lacks columns {missing}; expected those of PathCeiling")
        paths = {}
        for rec in table.to_dict("records"):
            kw = {f.name: rec[f.name] for f in fields(PathCeiling)}
            kw["ceiling_size_bytes"], kw["n_sizes"] = int(kw["ceiling_size_bytes"]), int(kw["n_sizes"])
            for k in ("fixed_us", "bandwidth_gbps", "ceiling_gbps", "ceiling_min_gbps", "ceiling_max_gbps",
                      "half_size_bytes", "max_rel_err"):
                kw[k] = float(kw[k])
            paths[str(kw["path"])] = PathCeiling(**kw)
        return cls(paths, device, list(p2p or []), dict(meta or {}))

    def to_dict(self) -> dict:
        """JSON-ready dict (NaN/inf written as the strings "nan"/"inf"); store it with ``run.update(ceilings=...)``."""
        return {
            "device": self.device,
            "p2p": self.p2p,
            "meta": self.meta,
            "paths": {name: {k: _json_float(v) for k, v in asdict(pc).items()} for name, pc in self.paths.items()},
        }

    def to_json(self, indent: int | None = 2) -> str:
        """:meth:`to_dict` as a JSON string."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, data: str | dict) -> "Ceilings":
        """Inverse of :meth:`to_json` / :meth:`to_dict` (accepts either)."""
        if isinstance(data, str):
            data = json.loads(data)
        if not isinstance(data, dict) or "paths" not in data:
            raise ValueError("Ceilings.from_json: expected a dict (or JSON text) with a 'paths' key, as to_dict() writes")
        table = pd.DataFrame(list(data["paths"].values()))
        return cls.from_table(table, data.get("device", ""), data.get("p2p") or [], data.get("meta") or {})

    @classmethod
    def load(cls, run_dir: str | os.PathLike) -> "Ceilings":
        """The ceilings a link-ceilings run stored in ``<run_dir>/run.json`` under ``"ceilings"``."""
        path = Path(run_dir) / "run.json"
        if not path.is_file():
            raise ValueError(f"{path} does not exist; pass a run directory written by notebooks/01_link_ceilings")
        data = json.loads(path.read_text())
        if "ceilings" not in data:
            raise ValueError(f"{path} has no 'ceilings' entry; it is not a link-ceilings run")
        return cls.from_json(data["ceilings"])


class Fit(NamedTuple):
    """What :func:`fit` returns: ``table`` (one row per path) and ``ceilings``."""

    table: pd.DataFrame
    ceilings: Ceilings


def _per_size(df: pd.DataFrame) -> pd.DataFrame:
    """Median/min/max of ms and GB/s per (path, size)."""
    g = df.groupby(["path", "size_bytes"], sort=False)
    out = g.agg(
        mechanism=("mechanism", "first"),
        copies_per_sample=("copies_per_sample", "first"),
        n=("ms", "size"),
        ms=("ms", "median"),
        ms_min=("ms", "min"),
        ms_max=("ms", "max"),
        gbps=("gbps", "median"),
        gbps_min=("gbps", "min"),
        gbps_max=("gbps", "max"),
    ).reset_index()
    # paths in the order they were measured, sizes ascending
    order = {p: i for i, p in enumerate(dict.fromkeys(df["path"]))}
    out["_order"] = out["path"].map(order)
    return out.sort_values(["_order", "size_bytes"]).drop(columns="_order").reset_index(drop=True)


def fit(df: pd.DataFrame) -> Fit:
    """Fit fixed cost + bandwidth per path and take each path's ceiling.

    Args:
        df: :func:`measure`'s tidy table (or the same columns read back from
            results.csv: ``path``, ``size_bytes``, ``ms``, ``gbps``; ``mechanism``
            optional).

    Returns:
        :class:`Fit` ``(table, ceilings)``; ``table`` has one row per path with
        the :class:`PathCeiling` columns. A path measured at one size gets a
        ceiling but NaN for the fit.

    Raises:
        ValueError: missing columns or an empty table.
    """
    if not isinstance(df, pd.DataFrame):
        raise ValueError(f"fit() needs the DataFrame from measure(), got {type(df).__name__}")
    missing = [c for c in _REQUIRED if c not in df.columns]
    if missing:
        raise ValueError(f"fit(): the table lacks columns {missing}; expected {list(_REQUIRED)} as measure() writes")
    if df.empty:
        raise ValueError("fit(): the table has no rows")
    if "mechanism" not in df.columns:
        df = df.assign(mechanism="")
    if "copies_per_sample" not in df.columns:
        df = df.assign(copies_per_sample=1)
    per = _per_size(df)
    paths: dict[str, PathCeiling] = {}
    for path, g in per.groupby("path", sort=False):
        best = g.loc[g["gbps"].idxmax()]
        if g["size_bytes"].nunique() >= 2:
            t0_us, bw, err = fit_model(g["size_bytes"], g["ms"])
        else:
            t0_us, bw, err = math.nan, math.nan, math.nan
        half = t0_us / 1e6 * bw * 1e9 if math.isfinite(t0_us) and math.isfinite(bw) else math.nan
        paths[str(path)] = PathCeiling(
            path=str(path),
            mechanism=str(best["mechanism"]),
            fixed_us=t0_us,
            bandwidth_gbps=bw,
            ceiling_gbps=float(best["gbps"]),
            ceiling_min_gbps=float(best["gbps_min"]),
            ceiling_max_gbps=float(best["gbps_max"]),
            ceiling_size_bytes=int(best["size_bytes"]),
            half_size_bytes=half,
            n_sizes=int(g["size_bytes"].nunique()),
            max_rel_err=err,
        )
    meta = {k: df.attrs[k] for k in ("n", "warmup") if k in df.attrs}
    ceil = Ceilings(paths, device=str(df.attrs.get("device", "")), p2p=list(df.attrs.get("p2p", [])), meta=meta)
    return Fit(ceil.table(), ceil)


# --------------------------------------------------------------------------- #
# presentation
# --------------------------------------------------------------------------- #
def _as_ceilings(c: "Ceilings | Fit | pd.DataFrame") -> Ceilings:
    if isinstance(c, Ceilings):
        return c
    if isinstance(c, Fit):
        return c.ceilings
    if isinstance(c, pd.DataFrame):
        return Ceilings.from_table(c)
    raise ValueError(f"expected Ceilings, Fit or a fit table, got {type(c).__name__}")


def _fmt_time_range(median_ms: float, lo_ms: float, hi_ms: float) -> str:
    """``"11.8 (11.2–13) µs"``: all three in the unit :func:`fmt_ms` picks for the median."""
    value, unit = fmt_ms(median_ms).rsplit(" ", 1)
    scale = {"ns": 1e6, "µs": 1e3, "ms": 1.0, "s": 1e-3}[unit]

    def g(x: float) -> str:  # 3 significant digits, but never scientific notation
        return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.3g}"

    return f"{value} ({g(lo_ms * scale)}–{g(hi_ms * scale)}) {unit}"


def summary_table(df: pd.DataFrame, ceilings: "Ceilings | Fit | pd.DataFrame") -> pd.DataFrame:
    """One row per (path, size) for a notebook: median with min–max, GB/s, % of ceiling, fit.

    Columns: ``path``, ``size`` (e.g. "16 KiB"), ``size_bytes``,
    ``copies_per_sample``, ``time per copy`` (str, "median (min–max)" in
    µs/ms/s), ``ms`` (median, per copy), ``gbps`` / ``gbps_min`` /
    ``gbps_max``, ``pct_of_ceiling`` (median GB/s / ceiling × 100),
    ``fit_ms`` (the model's time), ``fit_err_pct`` ((fit − median)/median × 100).
    """
    ceil = _as_ceilings(ceilings)
    per = _per_size(df)
    rows = []
    for r in per.itertuples(index=False):
        pc = ceil.paths.get(r.path)
        fit_ms = ceil.predict_ms(r.path, r.size_bytes) if pc is not None and pc.has_fit else math.nan
        rows.append({
            "path": r.path,
            "size": fmt_bytes(r.size_bytes),
            "size_bytes": int(r.size_bytes),
            "copies_per_sample": int(r.copies_per_sample),
            "time per copy": _fmt_time_range(r.ms, r.ms_min, r.ms_max),
            "ms": r.ms,
            "gbps": r.gbps,
            "gbps_min": r.gbps_min,
            "gbps_max": r.gbps_max,
            "pct_of_ceiling": 100.0 * r.gbps / pc.ceiling_gbps if pc is not None else math.nan,
            "fit_ms": fit_ms,
            "fit_err_pct": 100.0 * (fit_ms - r.ms) / r.ms,
        })
    return pd.DataFrame(rows)


def plot(df: pd.DataFrame, ceilings: "Ceilings | Fit | pd.DataFrame", ax=None, title: str | None = None):
    """GB/s against copy size, one colour per path.

    Measured medians with min–max error bars, the fitted ``t0 + bytes/B``
    curve dashed, the path's ceiling as a dotted horizontal line; the legend
    names each path's fixed µs, fitted GB/s and ceiling. Log–log axes, sizes
    labelled in binary units.

    Returns:
        The matplotlib Figure (pass it to ``kvlab.plots.save(fig, "gbps_vs_size", run)``).
    """
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    ceil = _as_ceilings(ceilings)
    per = _per_size(df)
    own_figure = ax is None
    if own_figure:
        # constrained layout keeps room for the legend below the axes, inside the figure (the
        # footer kvlab.plots.save adds hangs below the figure's edge and must not cover it)
        fig = plt.figure(figsize=(9, 6.5), layout="constrained")
        ax = fig.add_subplot()
    else:
        fig = ax.figure
    names = list(dict.fromkeys(per["path"]))
    colors = plots.palette(names)  # the house palette: distinct, colour-blind safe
    markers = "osD^vPX*"  # paired paths (d2h/h2d, i->j/j->i) often overlap: shapes tell them apart
    for k, (path, g) in enumerate(per.groupby("path", sort=False)):
        color, marker = colors[path], markers[k % len(markers)]
        pc = ceil.paths.get(path)
        label = path
        if pc is not None and pc.has_fit:
            bw = "∞" if math.isinf(pc.bandwidth_gbps) else f"{pc.bandwidth_gbps:,.4g}"
            label = f"{path}: {pc.fixed_us:.3g} µs + {bw} GB/s; ceiling {pc.ceiling_gbps:,.4g} GB/s"
        elif pc is not None:
            label = f"{path}: ceiling {pc.ceiling_gbps:,.4g} GB/s"
        yerr = np.vstack([g["gbps"] - g["gbps_min"], g["gbps_max"] - g["gbps"]])
        # paths that run alike (0->1 and 1->0, d2h and h2d) would hide each other: each path's points sit a
        # little to the side of its size (a dodge of ±3 % per path; the fitted curves stay at the true sizes)
        dodge = 2 ** (0.045 * (k - (len(names) - 1) / 2))
        ax.errorbar(g["size_bytes"] * dodge, g["gbps"], yerr=yerr, fmt=marker, ms=4, capsize=3, color=color,
                    label=label)
        if pc is not None and pc.has_fit:
            s = np.geomspace(g["size_bytes"].min(), g["size_bytes"].max(), 200)
            t_s = pc.fixed_us / 1e6 + (0.0 if math.isinf(pc.bandwidth_gbps) else s / (pc.bandwidth_gbps * 1e9))
            ax.plot(s, s / t_s / 1e9, "--", color=color, lw=1.2)
    # Ceilings within 5 % of each other (d2h and h2d pinned; the copy engine and SM copy within a GPU) would
    # draw one dotted line over the other: draw each group once, and name its paths on it.
    groups: list[list[tuple[str, float]]] = []
    for path in names:
        pc = ceil.paths.get(path)
        if pc is None:
            continue
        for grp in groups:
            if abs(pc.ceiling_gbps / grp[0][1] - 1) <= 0.05:
                grp.append((path, pc.ceiling_gbps))
                break
        else:
            groups.append([(path, pc.ceiling_gbps)])
    above = None
    for grp in sorted(groups, key=lambda g: -max(v for _, v in g)):
        level = max(v for _, v in grp)
        color = colors[grp[0][0]] if len(grp) == 1 else "0.35"
        ax.axhline(level, ls=":", color=color, lw=1)
        text = "ceiling " + " · ".join(f"{p} {v:,.4g}" for p, v in grp) + " GB/s"
        # at the left edge, where small copies run far below every ceiling, the label covers no data; a ceiling
        # close under the one above takes its label under its line, so the two labels do not collide
        below = above is not None and above / level < 1.25
        ax.annotate(text, (0.0, level), xycoords=("axes fraction", "data"), xytext=(3, -2 if below else 2),
                    textcoords="offset points", ha="left", va="top" if below else "bottom", fontsize=7.5, color=color)
        above = level
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    sizes = sorted(per["size_bytes"].unique())
    ax.xaxis.set_major_locator(FixedLocator(sizes))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticks(sizes, [fmt_bytes(s).replace(" ", "\u2009") for s in sizes], rotation=45, ha="right")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _pos: f"{y:,.4g}"))
    ax.set_xlabel("bytes per copy")
    ax.set_ylabel("GB/s (decimal, payload bytes)")
    n = df.attrs.get("n", int(df.groupby(["path", "size_bytes"]).size().min()))
    ax.set_title(title or f"Copy bandwidth vs size — {ceil.device or 'device'}\n"
                          f"median of {n} (bars: min–max; paths side by side); dashed: fit t0 + bytes/B; dotted: ceiling",
                 fontsize=11)
    ax.grid(True, which="both", alpha=0.3)
    if own_figure:
        fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center", ncol=2 if len(names) > 3 else 1,
                   fontsize=8)
    else:
        ax.legend(fontsize=8, loc="lower right")
    return fig


def finding_text(df: pd.DataFrame, ceilings: "Ceilings | Fit | pd.DataFrame", probe_bytes: int = 16 * KiB) -> str:
    """A few Markdown bullets stating what the sweep found, all numbers from ``df``/``ceilings``.

    Per path: the ceiling and where it was reached, the fitted fixed cost and
    bandwidth, the size needed for half the bandwidth, and what a
    ``probe_bytes`` copy (default 16 KiB, one paged-KV block) achieves — called
    launch-bound when the fixed cost exceeds its bytes' time.
    """
    ceil = _as_ceilings(ceilings)
    per = _per_size(df)
    lines = []
    for path, g in per.groupby("path", sort=False):
        pc = ceil.paths.get(path)
        if pc is None:
            continue
        line = (f"- **{path}** ({pc.mechanism}): ceiling **{pc.ceiling_gbps:,.4g} GB/s** "
                f"(min–max {pc.ceiling_min_gbps:,.4g}–{pc.ceiling_max_gbps:,.4g}) at {fmt_bytes(pc.ceiling_size_bytes)}")
        if pc.has_fit:
            bw = "unbounded" if math.isinf(pc.bandwidth_gbps) else f"{pc.bandwidth_gbps:,.4g} GB/s"
            line += (f"; fit: {pc.fixed_us:.3g} µs fixed per copy + bytes at {bw} "
                     f"(the fit's largest error at any size: {100 * pc.max_rel_err:.0f} % of the measured time"
                     f"{'; a poor fit' if pc.max_rel_err > 0.2 else ''})")
            if math.isfinite(pc.half_size_bytes):
                line += f"; copies under {fmt_bytes(pc.half_size_bytes)} get less than half the fitted bandwidth"
        probe = g[g["size_bytes"] == probe_bytes]
        if not probe.empty:
            p = probe.iloc[0]
            pct = 100.0 * p["gbps"] / pc.ceiling_gbps
            line += f". A {fmt_bytes(probe_bytes)} copy takes {fmt_ms(p['ms'])} ({pct:.2g}% of the ceiling)"
            if pc.has_fit and not math.isinf(pc.bandwidth_gbps):
                bytes_us = probe_bytes / (pc.bandwidth_gbps * 1e9) * 1e6
                bound = "launch-bound" if pc.fixed_us > bytes_us else "bandwidth-bound"
                line += f": {bound} ({pc.fixed_us:.3g} µs fixed vs {bytes_us:.3g} µs of bytes)"
        lines.append(line + ".")
    return "\n".join(lines)
