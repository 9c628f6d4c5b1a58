"""The paged study's analysis: from the rows .bench measured to its summary (`summary`, `pct_table`), the goals
(`goals`), a finding, the tuning records and the access-pattern table, and figures. Reads tables; never measures.
"""

from __future__ import annotations

import textwrap

import numpy as np
import pandas as pd

from ... import goals as G
from ... import intervals, plots
from .bench import COLUMNS, METHODS

__all__ = ["merge", "summary", "pct_table", "goals", "finding", "plot_gbps_vs_block_size", "tuning_table",
           "pattern_summary", "plot_patterns"]


def merge(df: pd.DataFrame, extra: pd.DataFrame) -> pd.DataFrame:
    """Add the method rows of another run of measure() (e.g. run_nixl_only's CSV) to `df`.

    Its own "contiguous" rows are dropped: every method is compared with the ceiling of the main run.
    A method already in `df` for the same (context, block_size, destination) is replaced by the extra rows.
    """
    missing = set(COLUMNS) - set(extra.columns)
    if missing:
        raise ValueError(f"the extra results lack columns {sorted(missing)}; expected measure()'s columns")
    extra = extra[extra.method != "contiguous"]
    key = ["context", "block_size", "method", "destination"]
    have = df.set_index(key).index
    drop = have.isin(extra.set_index(key).index)
    out = pd.concat([df[~drop], extra[COLUMNS]], ignore_index=True)
    out.attrs = dict(df.attrs)  # the transports' configurations (tuning tables) stay with the results
    return out


def _pick(df: pd.DataFrame, context=None, block_size=None) -> tuple[int, int]:
    if context is None:
        context = int(df.context.max())
    if block_size is None:
        sizes = sorted(df.block_size.unique())
        block_size = 16 if 16 in sizes else int(sizes[0])
    return int(context), int(block_size)


def summary(df: pd.DataFrame, context: int | None = None, block_size: int | None = None) -> pd.DataFrame:
    """The headline table at one context and block size (default: the longest context, 16-token blocks).

    One row per (destination, method): pieces, repeats, ms median/min/max, time "median (min–max)",
    gbps (at the median), ceiling_gbps (the contiguous copy, same destination, same run), pct_of_ceiling,
    pct_lo / pct_hi (the 95 % bootstrap interval of median(contiguous) / median(send), both resampled, so the
    ceiling's own noise is in it: what the goals judge), verified, status, note. Skipped or failed methods appear with their reason.
    """
    context, block_size = _pick(df, context, block_size)
    sub = df[(df.context == context) & (df.block_size == block_size)]
    out = []
    for dest, g in sub.groupby("destination", sort=False):
        ceil_ms = g[(g.method == "contiguous") & (g.status == "ok")].ms
        ceiling = float(g.bytes.iloc[0] / (ceil_ms.median() * 1e6)) if len(ceil_ms) else float("nan")
        for method, m in g.groupby("method", sort=False):
            ok = m[m.status == "ok"]
            row = dict(context=context, block_size=block_size, destination=dest, method=method,
                       pieces=int(m.pieces.iloc[0]), repeats=len(ok), verified=bool(m.verified.all()),
                       status=m.status.iloc[0], backend=_text(m.backend.iloc[0]), note=_text(m.note.iloc[0]))
            if len(ok):
                med = float(ok.ms.median())
                r_lo, r_hi = intervals.ratio_ci(ceil_ms, ok.ms) if len(ceil_ms) else (float("nan"), float("nan"))
                gbps = float(ok.bytes.iloc[0] / (med * 1e6))
                row.update(ms=med, ms_min=float(ok.ms.min()), ms_max=float(ok.ms.max()),
                           time=f"{intervals.fmt_ms(med)} ({intervals.fmt_ms(float(ok.ms.min()))}–"
                                f"{intervals.fmt_ms(float(ok.ms.max()))})",
                           gbps=gbps, ceiling_gbps=ceiling, pct_of_ceiling=100 * gbps / ceiling,
                           pct_lo=100 * r_lo, pct_hi=100 * r_hi)
            else:
                row.update(ms=float("nan"), ms_min=float("nan"), ms_max=float("nan"), time="—",
                           gbps=float("nan"), ceiling_gbps=ceiling, pct_of_ceiling=float("nan"),
                           pct_lo=float("nan"), pct_hi=float("nan"))
            out.append(row)
    cols = ["context", "block_size", "destination", "method", "pieces", "time", "ms", "ms_min", "ms_max", "gbps",
            "ceiling_gbps", "pct_of_ceiling", "pct_lo", "pct_hi", "repeats", "verified", "status", "backend", "note"]
    return pd.DataFrame(out, columns=cols)


def _text(v) -> str:
    # CSV round trips turn empty strings into NaN
    return "" if v is None or (isinstance(v, float) and v != v) else str(v)


def pct_table(df: pd.DataFrame) -> pd.DataFrame:
    """Every configuration at a glance: % of the contiguous ceiling (median), one row per (destination,
    context, block_size), one column per method."""
    parts = [summary(df, c, b) for c, b in df[["context", "block_size"]].drop_duplicates().itertuples(index=False)]
    s = pd.concat(parts, ignore_index=True)
    s = s[(s.method != "contiguous") & s.pct_of_ceiling.notna()]
    if s.empty:
        return pd.DataFrame()
    t = s.pivot_table(index=["destination", "context", "block_size"], columns="method", values="pct_of_ceiling",
                      sort=False)
    t = t[[m for m in METHODS if m in t.columns]]
    t.columns.name = None
    return t.reset_index()


def goals(df: pd.DataFrame, context: int | None = None, block_size: int | None = None,
          record: dict | None = None) -> pd.DataFrame:
    """The paged goals (kvlab.goals, study "paged_transfer") judged at the headline configuration: triton ≥ 95 %
    of the contiguous copy to the same GPU, chunked-gather-d2h ≥ 98 % to pinned host, chunked-gather-peer ≥ 98 %
    to a peer — each over the min–max of its sends (the one rule); with the run's `record`, by the goals in force
    when it started."""
    return G.evaluate_run("paged_transfer", record, summary(df, context, block_size),
                          keys=("context", "block_size", "destination"))


def finding(df: pd.DataFrame, context: int | None = None, block_size: int | None = None) -> str:
    """A few sentences derived from the numbers at the headline configuration."""
    s = summary(df, context, block_size)
    if s.empty:
        return "No results."
    ctx, bs = int(s.context.iloc[0]), int(s.block_size.iloc[0])
    parts = []
    for dest, g in s.groupby("destination", sort=False):
        ok = g[(g.method != "contiguous") & g.gbps.notna()]
        ceiling = float(g.ceiling_gbps.iloc[0])
        if ok.empty or ceiling != ceiling:
            continue
        best = ok.loc[ok.gbps.idxmax()]
        worst = ok.loc[ok.gbps.idxmin()]
        how = f" ({best.backend})" if best.backend and best.backend != best.method else ""
        text = (f"To {dest}, the contiguous copy of the same {g.pieces.max():,} blocks' bytes ran at {ceiling:,.0f} GB/s; "
                f"the fastest paged method, {best.method}{how}, reached {best.gbps:,.3g} GB/s "
                f"({best.pct_of_ceiling:.1f} % of it, {best.time})")
        if worst.method != best.method:
            text += (f", and the slowest, {worst.method}, {worst.gbps:,.3g} GB/s "
                     f"({best.gbps / worst.gbps:,.0f}× slower than {best.method})")
        parts.append(text + ".")
    skipped = s[s.status != "ok"]
    if len(skipped):
        parts.append("Not measured here: " + "; ".join(f"{r.method} to {r.destination} ({r.note})"
                                                     for r in skipped.drop_duplicates("method").itertuples()) + ".")
    return f"At {ctx:,} tokens in {bs}-token blocks: " + " ".join(parts)


def plot_gbps_vs_block_size(df: pd.DataFrame, context: int | None = None):
    """GB/s (median) against block size, one line per method, one column per destination, at one context
    (default the longest); the contiguous copy of the same bytes is the dashed ceiling.

    Top row: GB/s on a log axis (every method). Bottom row: the same medians as % of the contiguous copy, on a
    linear axis zoomed on 80–102 % — where the fast methods sit within a few % of each other and of the ceiling, and
    would hide one another on the log axis. A hollow marker is a send timed once (one took over a second: the
    row's note says so); a method measured at one block size only (NIXL, in a process of its own) is a lone
    marker and its legend entry says so. Returns the matplotlib Figure."""
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    context = int(df.context.max()) if context is None else int(context)
    sub = df[(df.context == context) & (df.status == "ok")]
    dests = list(dict.fromkeys(sub.destination))
    ncol = max(len(dests), 1)
    fig, axes = plt.subplots(2, ncol, figsize=(max(7.0, 4.6 * ncol), 6.6), squeeze=False, sharex="col",
                             gridspec_kw={"height_ratios": [1.25, 1]})
    med = (sub.groupby(["destination", "method", "block_size"], sort=False)
           .apply(lambda g: pd.Series({"gbps": g.bytes.iloc[0] / (g.ms.median() * 1e6), "n": len(g)}),
                  include_groups=False)
           .reset_index())
    methods = [m for m in METHODS if m in set(med.method)]
    colors = plots.palette(methods)
    labels = {}
    for m in methods:
        backends = set(sub[sub.method == m].backend.dropna().astype(str)) - {"", m}
        label = f"{m} ({', '.join(sorted(backends))})" if any("fallback" in b for b in backends) else m
        sizes = sorted(med[med.method == m].block_size.unique())
        if len(sizes) == 1 and m != "contiguous":
            label += f" — {sizes[0]}-token blocks only" + (" (own process)" if m == "nixl" else "")
        labels[m] = label
    for col, dest in enumerate(dests):
        top, bottom = axes[0][col], axes[1][col]
        d = med[med.destination == dest]
        ceil = d[d.method == "contiguous"].set_index("block_size").gbps
        for m in methods:
            line = d[d.method == m].sort_values("block_size")
            if line.empty:
                continue
            pct = 100 * line.gbps.values / ceil.reindex(line.block_size).values
            if m == "contiguous":
                for ax, y in ((top, line.gbps), (bottom, pct)):
                    ax.plot(line.block_size, y, "--", color=colors[m], lw=1.8, label="contiguous copy (the ceiling)")
                continue
            for ax, y in ((top, line.gbps.values), (bottom, pct)):
                ax.plot(line.block_size, y, "-", color=colors[m], lw=1.4, label=labels[m])
                once = line.n.values == 1
                ax.plot(line.block_size.values[~once], y[~once], "o", color=colors[m], ms=5)
                if once.any():
                    ax.plot(line.block_size.values[once], y[once], "o", mfc="white", mec=colors[m], ms=5, mew=1.3)
        top.set_yscale("log")
        lo, hi = float(d.gbps.min()), float(d.gbps.max())
        top.set_ylim(lo / 1.6, hi * 1.6)
        # under two decades matplotlib labels the minor ticks too (2×10⁰, 3×10⁰ …), and they overlap (run 052414):
        # there, plain numbers at 1, 2 and 5 of each decade; above, the decades alone
        top.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        if hi * 1.6 / (lo / 1.6) < 100:
            top.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
            top.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        top.set_title(dest)
        bottom.set_ylim(80, 102)
        bottom.axhline(100, color="0.5", lw=0.6)
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            sizes = sorted(d.block_size.unique())
            ax.set_xticks(sizes, [str(x) for x in sizes])
            ax.grid(True, which="both", alpha=0.3)
        bottom.set_xlabel("block size (tokens)")
    axes[0][0].set_ylabel("GB/s (median, log)", fontsize=9)
    axes[1][0].set_ylabel("% of the contiguous copy\n(zoom: 80–102 %)", fontsize=9)
    handles = {}
    for ax in axes[0]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    from matplotlib.lines import Line2D

    if (med.n == 1).any():
        handles["hollow: a send timed once (over a second each)"] = Line2D([], [], ls="none", marker="o", mfc="white",
                                                                          mec="0.3", ms=5)
    fig.suptitle(f"Paged KV transfer at {context:,} tokens: GB/s by block size", fontsize=11)
    fig.tight_layout(rect=(0, 0.16, 1, 1))
    fig.legend(list(handles.values()), list(handles.keys()), loc="lower center", ncol=2, frameon=False,
               fontsize=8, bbox_to_anchor=(0.5, 0.0))
    return fig


def tuning_table(df: pd.DataFrame) -> pd.DataFrame:
    """The kernel tunings behind measure()'s Triton rows, tidy: one row per (configuration, destination,
    method, tuned candidate) with its median ms, from df.attrs["transports"]. Empty when nothing was tuned."""
    rows = []
    for rec in df.attrs.get("transports", []):
        cfg = rec.get("config") or {}
        for cand in cfg.get("tuning") or []:
            rows.append({"context": rec.get("context"), "block_size": rec.get("block_size"),
                         "destination": rec.get("destination"), "method": rec.get("method"),
                         "tuned_rows": cfg.get("tuned_rows"), "chosen_order": cfg.get("order"), **cand})
    return pd.DataFrame(rows)


def pattern_summary(df: pd.DataFrame) -> pd.DataFrame:
    """Median (min–max) per pattern and its share of the contiguous copy's GB/s."""
    if df.empty:
        return df
    ceil = df[df.pattern == "contiguous copy_"].ms.median()
    out = []
    for name, g in df.groupby("pattern", sort=False):
        med = g.ms.median()
        out.append(dict(pattern=name, time=f"{intervals.fmt_ms(med)} ({intervals.fmt_ms(g.ms.min())}–{intervals.fmt_ms(g.ms.max())})",
                        ms=med, gbps=float(g.bytes.iloc[0] / med / 1e6), pct_of_contiguous=100 * ceil / med,
                        repeats=len(g), config=g.config.iloc[0], description=g.description.iloc[0]))
    return pd.DataFrame(out)


def plot_patterns(summary: pd.DataFrame, title: str = ""):
    """Dots: GB/s per access pattern (median), the contiguous copy as the ceiling line and
    each dot labelled with its share of it. The axis is zoomed on the data: the differences are a few %."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.0, 0.42 * len(summary) + 1.6))
    kern = summary[summary.pattern != "contiguous copy_"].reset_index(drop=True)
    ceil = summary[summary.pattern == "contiguous copy_"].gbps
    y = np.arange(len(kern))
    ax.scatter(kern.gbps, y, color=plots.BLUE, zorder=3, s=28)
    for yi, (g, p) in enumerate(zip(kern.gbps, kern.pct_of_contiguous)):
        ax.annotate(f"{p:.1f} %", (g, yi), xytext=(0, 7), textcoords="offset points", ha="center", fontsize=8)
    lo = float(kern.gbps.min())
    hi = float(kern.gbps.max())
    if len(ceil):
        c = float(ceil.iloc[0])
        hi = max(hi, c)
        ax.axvline(c, color=plots.GREY, ls="--", lw=1)
        ax.annotate("contiguous copy_", (c, len(kern) - 0.5), xytext=(-4, 0), textcoords="offset points",
                    ha="right", va="center", fontsize=7, color=plots.GREY)
    pad = 0.15 * (hi - lo) + 1.0
    ax.set_xlim(lo - pad, hi + pad)
    ax.set_ylim(len(kern) - 0.4, -0.6)
    ax.set_yticks(y, [p.removeprefix("kernel: ") for p in kern.pattern], fontsize=8)
    ax.set_xlabel("GB/s (decimal), median of the timed launches")
    ax.set_title("\n".join(textwrap.wrap(title or "The same bytes, rows in different orders", 62)), fontsize=10)
    fig.tight_layout()
    return fig
