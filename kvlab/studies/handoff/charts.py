"""The handoff study's figures: what moving the cache adds to the time to first token (`plot_ttft`, with the run's
fitted link model and, beside a peer GPU, seed 004's 2×H100 numbers), and where layer-wise sending's cost goes at
the shortest context (`plot_attribution`). `figures(analysis)` draws every figure a run has the data for, with
the titles the notebook and `kvlab analyse` both show. matplotlib is imported when a figure is drawn.
"""

from __future__ import annotations

import textwrap

import numpy as np
import pandas as pd

from ... import plots
from ...study import Analysis
from . import page
from .analysis import SEED004_H100

__all__ = ["FIGURES", "figures", "plot_ttft", "plot_attribution", "ttft_title", "attribution_title"]

FIGURES = ("handoff_ttft", "attribution_short", page.NAME)


def ttft_title(a: Analysis) -> str:
    """The TTFT figure's title: the model, the GPUs ("2×H200"; one GPU is its tag) and the run."""
    model = (a.record.get("resolved") or {}).get("model", "")
    gpus = len(a.record.get("devices") or [])
    where = f"{gpus}×{a.device_tag.upper()}" if gpus > 1 else a.device_tag
    return f"{model} on {where} (run {a.run_id}): what moving the KV cache adds to the time to first token"


def attribution_title(a: Analysis) -> str:
    """The attribution figure's title: the model, the context, the device and the rounds per variant."""
    s = a.tables["attribution"]
    model = (a.record.get("resolved") or {}).get("model", "")
    rounds = (a.record.get("parameters") or {}).get("attribution_rounds")
    if not isinstance(rounds, int):
        rounds = int(s.rounds.max())
    short = int(s.context.min())
    return f"{model}, {short:,} tokens: where layer-wise sending's cost goes ({a.device_tag}, {rounds} rounds)"


def figures(a: Analysis) -> dict:
    """{name: Figure} of a handoff analysis: handoff_ttft (with the run's predictions), attribution_short when
    the run measured the attribution, and seed004_table, seed 004's results figure as an interactive page
    (kvlab.pages)."""
    out = {"handoff_ttft": plot_ttft(a.tables["summary"], a.tables.get("predictions"), title=ttft_title(a))}
    if "attribution" in a.tables:
        out["attribution_short"] = plot_attribution(a.tables["attribution"], title=attribution_title(a))
    out[page.NAME] = page.page(a)
    return out


def plot_attribution(summary: pd.DataFrame, title: str = ""):
    """Horizontal bars: each variant's extra prefill time over colocated, with its 95 % interval, per
    destination; the issue's 0.5 ms budget as a dashed line."""
    import matplotlib.pyplot as plt

    plots.style()
    fig, ax = plt.subplots(figsize=(7.0, 0.45 * len(summary) + 1.6))
    labels = [f"{r.destination} · {r.variant}" for r in summary.itertuples()]
    y = range(len(summary))
    palette = {"signal only": plots.BLUE, "layer-wise": plots.VERMILLION, "layer-wise, attention hooks": plots.PURPLE,
               "layer-wise, per-layer wakes": plots.ORANGE}
    colors = [palette.get(v, plots.GREEN) for v in summary.variant]
    ax.barh(list(y), summary.extra_ms, color=colors,
            xerr=[summary.extra_ms - summary.extra_ci_lo_ms, summary.extra_ci_hi_ms - summary.extra_ms],
            error_kw=dict(lw=0.8, capsize=2))
    ax.set_yticks(list(y), labels, fontsize=8)
    ax.invert_yaxis()
    ax.axvline(0, color="black", lw=0.6)
    ax.axvline(0.5, color="black", lw=0.8, ls="--")
    ax.text(0.5, -0.6, " 0.5 ms budget", fontsize=7, va="bottom")
    ax.set_xlabel("extra prefill time over colocated, ms (median of paired rounds, 95 % interval)")
    ctx = ", ".join(f"{c:,}" for c in summary.context.unique())
    ax.set_title("\n".join(textwrap.wrap(title or f"Where layer-wise sending's cost goes at {ctx} tokens", 62)),
                 fontsize=10)
    fig.tight_layout()
    return fig


def _ctx_label(c: int) -> str:
    return f"{c // 1024}k" if c >= 1024 and c % 1024 == 0 else str(c)


def plot_ttft(summary: pd.DataFrame, preds: pd.DataFrame | None = None, title: str = "",
              reference: bool | None = None):
    """The headline figure: what moving the cache adds to the time to first token, by context, one panel per
    destination.

    Measured (filled markers, 95 % intervals as bars): *bulk* = the one copy after prefill (median, interval of
    the median copy); *layer-wise* = the request's wall time over colocated prefill, paired A/B rounds (median,
    interval of the median). Zero is colocated; below zero is faster than colocated (noise, or drift). The
    y axis is symmetric-log, linear within ±0.1 ms, so 0.03 ms and 145 ms both read. Marked apart (hollow,
    grey, dashed): seed 004's 2×H100 numbers, drawn in a peer-GPU panel only (``reference``: force on / off),
    and the prediction of the run's fitted link model for one copy (``preds`` with model "fit, 1 copy").
    Each context's tick names its colocated prefill time, the rest of the time to first token.
    """
    import matplotlib.pyplot as plt

    dests = list(dict.fromkeys(summary.destination))
    contexts = sorted(int(c) for c in summary.context.unique())
    x = np.arange(len(contexts))
    fig, axes = plt.subplots(1, len(dests), figsize=(max(6.4, 3.3 * len(dests)), 3.9), sharey=True, squeeze=False)
    axes = axes[0]
    handles = {}
    for ax, d in zip(axes, dests):
        g = summary[summary.destination == d].set_index("context")
        rows = [g.loc[c] if c in g.index else None for c in contexts]

        def series(col, lo_col, hi_col):
            v = np.array([float(r[col]) if r is not None else np.nan for r in rows])
            lo = np.array([float(r[lo_col]) if r is not None and lo_col in r and pd.notna(r[lo_col]) else np.nan
                           for r in rows])
            hi = np.array([float(r[hi_col]) if r is not None and hi_col in r and pd.notna(r[hi_col]) else np.nan
                           for r in rows])
            return v, lo, hi

        copy_lo = "copy_ci_lo_ms" if "copy_ci_lo_ms" in g.columns else "copy_min_ms"
        copy_hi = "copy_ci_hi_ms" if "copy_ci_hi_ms" in g.columns else "copy_max_ms"
        for key, (col, lo_col, hi_col), off, fmt in (
                ("bulk", ("copy_ms", copy_lo, copy_hi), -0.09, "o-"),
                ("layer-wise", ("layerwise_extra_ms", "extra_ci_lo_ms", "extra_ci_hi_ms"), 0.09, "s")):
            v, lo, hi = series(col, lo_col, hi_col)
            err = np.vstack([np.where(np.isnan(lo), 0, v - lo), np.where(np.isnan(hi), 0, hi - v)])
            # bulk grows with the bytes (a line); layer-wise points are separate A/B medians (no line: a line
            # would draw noise as a trend)
            h = ax.errorbar(x + off, v, yerr=np.clip(err, 0, None), fmt=fmt, color=plots.color(key),
                            ms=5, lw=1.2, elinewidth=1.1, capsize=2.5, label=f"{key}, measured (median, 95 % interval)")
            handles.setdefault(key, h)
        if preds is not None and not preds.empty:
            p = preds[(preds.destination == d) & (preds.model == "fit, 1 copy")].set_index("context")
            if len(p):
                y = [float(p.ms.get(c, np.nan)) for c in contexts]
                handles.setdefault("fit", ax.plot(x, y, ls="--", lw=1, color=plots.GREY,
                                                  label="bulk, predicted by the run's fitted link model")[0])
        show_ref = reference if reference is not None else str(d).startswith("peer")
        if show_ref:
            ref = [SEED004_H100.get(c) for c in contexts]
            xs = [xi for xi, r in zip(x, ref) if r]
            if xs:
                handles.setdefault("h100b", ax.plot(np.array(xs) - 0.09, [r[1] for r in ref if r], "o", mfc="none",
                                                    mec=plots.GREY, ms=6, ls="none",
                                                    label="seed 004 on 2×H100: bulk (reference)")[0])
                handles.setdefault("h100l", ax.plot(np.array(xs) + 0.09, [r[2] for r in ref if r], "s", mfc="none",
                                                    mec=plots.GREY, ms=6, ls="none",
                                                    label="seed 004 on 2×H100: layer-wise (reference)")[0])
        ax.axhline(0, color="0.25", lw=0.8)
        ax.set_yscale("symlog", linthresh=0.1, linscale=0.6)
        ticks = [t for t in (-100, -10, -1, -0.1, 0, 0.1, 1, 10, 100, 1000)]
        ax.set_yticks(ticks, [f"{t:g}".replace("-", "−") for t in ticks], fontsize=8)
        ax.yaxis.set_minor_locator(plt.NullLocator())
        ax.set_title(str(d), fontsize=10)
        pre = [float(r["prefill_ms"]) if r is not None else np.nan for r in rows]
        ax.set_xticks(x, [f"{_ctx_label(c)}\n{p:,.0f} ms" for c, p in zip(contexts, pre)], fontsize=8)
        ax.set_xlim(-0.5, len(contexts) - 0.5)
        ax.grid(axis="y", lw=0.4, alpha=0.5)
    lows = [float(v) for c in ("extra_ci_lo_ms", "layerwise_extra_ms") if c in summary for v in summary[c] if pd.notna(v)]
    highs = [float(v) for c in ("copy_ms", "extra_ci_hi_ms") if c in summary for v in summary[c] if pd.notna(v)]
    lo_lim = -10 ** np.ceil(np.log10(max(0.1, -min(lows + [0])))) if min(lows + [0]) < -0.1 else -0.2
    hi_lim = 10 ** np.ceil(np.log10(max(highs + [1]) * 1.05))
    axes[0].set_ylim(lo_lim * 1.3, hi_lim * 1.3)
    axes[0].set_ylabel("added to time to first token, ms\n(symlog; 0 = colocated)", fontsize=9)
    # room under the panels for the legend's rows (two entries a row) and the axis label above them
    bottom = 0.04 + 0.04 * -(-len(handles) // 2)
    fig.supxlabel("context in tokens, with its colocated prefill time", fontsize=9, y=bottom + 0.01)
    fig.suptitle("\n".join(textwrap.wrap(title or "What moving the KV cache adds to the time to first token", 70)),
                 fontsize=11)
    fig.tight_layout(rect=(0, bottom, 1, 1))
    fig.legend(handles.values(), [h.get_label() for h in handles.values()], loc="lower center", ncol=2,
               fontsize=8, frameon=False, bbox_to_anchor=(0.5, 0.0))
    return fig
