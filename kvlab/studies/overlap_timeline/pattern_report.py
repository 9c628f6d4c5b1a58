"""The send-pattern experiment's analysis, from what send_patterns wrote (its rounds, the NVML samples, the
copy windows of one round): the summary against colocated, its findings, and the two figures. Pure; no GPU."""

from __future__ import annotations

import textwrap

import numpy as np
import pandas as pd

from ... import plots
from ...clocks import on_timeline
from ...intervals import median_ci
from .patterns import PATTERNS

__all__ = ["pattern_summary", "pattern_findings", "plot_patterns", "plot_clock_timeline"]


def pattern_summary(rounds: pd.DataFrame) -> pd.DataFrame:
    """Per variant, against colocated in the same round: extra prefill (median of the paired differences,
    95 % bootstrap interval), extra wall (until the send landed), exposed, mean SM clock and power of the
    prefill GPU, power-capped share, and the clock's prediction — colocated prefill × (f_colocated /
    f_variant − 1) per round, the extra a kernel-time ∝ 1/clock model gives for the clock alone — with its
    interval. Columns: variant, rounds, prefill_ms, extra_ms, extra_lo_ms, extra_hi_ms, wall_extra_ms,
    wall_lo_ms, wall_hi_ms, exposed_ms, sm_mhz, clock_drop_mhz, clock_pred_ms, clock_pred_lo_ms,
    clock_pred_hi_ms, power_w, capped_frac, nvlink_tx_gb (prefill GPU, NVML's counter over the prefill)."""
    def ci(x):
        x = x.dropna()
        return median_ci(x) if len(x) else (float("nan"), float("nan"))

    base = rounds[rounds.variant == "colocated"].set_index("round")
    out = []
    for v, g in rounds.groupby("variant", sort=False):
        g = g.set_index("round")
        d = (g.prefill_ms - base.prefill_ms).dropna()
        w = (g.wall_ms - base.wall_ms).dropna()
        pred = (base.prefill_ms * (base.sm_mhz_g0 / g.sm_mhz_g0 - 1)).dropna()
        lo, hi = ci(d)
        wlo, whi = ci(w)
        plo, phi = ci(pred)
        out.append(dict(variant=v, rounds=len(g), prefill_ms=float(g.prefill_ms.median()),
                        extra_ms=float(d.median()) if len(d) else float("nan"), extra_lo_ms=lo, extra_hi_ms=hi,
                        wall_extra_ms=float(w.median()) if len(w) else float("nan"), wall_lo_ms=wlo, wall_hi_ms=whi,
                        exposed_ms=float(g.exposed_ms.median()), sm_mhz=float(g.sm_mhz_g0.median()),
                        clock_drop_mhz=float((base.sm_mhz_g0 - g.sm_mhz_g0).dropna().median()) if len(g) else float("nan"),
                        clock_pred_ms=float(pred.median()) if len(pred) else float("nan"),
                        clock_pred_lo_ms=plo, clock_pred_hi_ms=phi, power_w=float(g.power_w_g0.median()),
                        capped_frac=float(g.capped_frac_g0.mean()),
                        nvlink_tx_gb=float(g.nvlink_tx_kib_g0.median()) * 1024 / 1e9))
    return pd.DataFrame(out)


def pattern_findings(summary: pd.DataFrame, meta: dict) -> list[str]:
    """Sentences from the numbers: each variant's extra beside the clock's prediction, then what agrees."""
    out = []
    s = summary.set_index("variant")
    if "colocated" in s.index:
        c = s.loc["colocated"]
        out.append(f"Colocated prefill at {meta.get('context', 0):,} tokens: {c.prefill_ms:,.1f} ms, SM clock "
                   f"{c.sm_mhz:,.0f} MHz, {c.power_w:,.0f} W, SW power cap set in {100 * c.capped_frac:.0f} % "
                   "of the samples.")
    for v, r in s.drop(index="colocated", errors="ignore").iterrows():
        out.append(f"{v}: prefill {r.extra_ms:+.2f} ms [{r.extra_lo_ms:+.2f}, {r.extra_hi_ms:+.2f}], SM clock "
                   f"{-r.clock_drop_mhz:+.0f} MHz, which alone predicts {r.clock_pred_ms:+.2f} ms "
                   f"[{r.clock_pred_lo_ms:+.2f}, {r.clock_pred_hi_ms:+.2f}]; exposed {r.exposed_ms:+.2f} ms.")
    for v, why in (meta.get("failed") or {}).items():
        out.append(f"{v}: not measured on this machine ({why}).")
    return out


def plot_patterns(summary: pd.DataFrame, title: str = ""):
    """Each variant's extra prefill time (bar, 95 % interval) beside the extra its SM clock predicts
    (hollow bar, interval): where the two agree the clock explains the cost."""
    import matplotlib.pyplot as plt

    plots.style()
    order = {v: i for i, v in enumerate(PATTERNS)}
    s = summary[summary.variant != "colocated"]
    s = s.iloc[sorted(range(len(s)), key=lambda i: order.get(s.variant.iloc[i], len(order)))].reset_index(drop=True)
    fig, ax = plt.subplots(figsize=(7.6, 0.55 * len(s) + 2.0))
    y = np.arange(len(s))
    ax.barh(y - 0.18, s.extra_ms, 0.36, color=plots.VERMILLION, label="measured extra prefill",
            xerr=[s.extra_ms - s.extra_lo_ms, s.extra_hi_ms - s.extra_ms], error_kw=dict(lw=0.8, capsize=2))
    ax.barh(y + 0.18, s.clock_pred_ms, 0.36, fill=False, edgecolor=plots.BLUE, hatch="//",
            label="predicted from the SM clock alone",
            xerr=[s.clock_pred_ms - s.clock_pred_lo_ms, s.clock_pred_hi_ms - s.clock_pred_ms],
            error_kw=dict(lw=0.8, capsize=2, ecolor=plots.BLUE))
    ax.set_yticks(y, s.variant, fontsize=8)
    ax.invert_yaxis()
    ax.axvline(0, color="black", lw=0.6)
    ax.set_xlabel("ms over colocated prefill (median of paired rounds, 95 % interval)")
    ax.set_title("\n".join(textwrap.wrap(title or "What each send pattern costs prefill, and what its clock predicts",
                                         70)), fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
    fig.tight_layout()
    return fig


def plot_clock_timeline(samples: pd.DataFrame, rounds: pd.DataFrame, timeline: pd.DataFrame, gpu: int,
                        variants=("colocated", "peer, every layer"), title: str = ""):
    """SM clock and power of the prefill GPU across one prefill of each variant (the round whose prefill is
    the median of its variant), ms from its start, with the layer copies of "peer, every layer" drawn as
    bars on top: the instrument drawn under the timeline."""
    import matplotlib.pyplot as plt

    plots.style()
    fig, (ax_k, ax_c, ax_p) = plt.subplots(3, 1, figsize=(9, 5.8), sharex=True,
                                           gridspec_kw=dict(height_ratios=[0.5, 3, 2]))
    colours = {variants[0]: plots.BLUE, variants[-1]: plots.VERMILLION}
    for v in variants:
        g = rounds[rounds.variant == v].sort_values("prefill_ms")
        if g.empty:
            continue
        r = g.iloc[(len(g) - 1) // 2]
        s = on_timeline(samples[samples.gpu == gpu], int(r.t0_ns))
        s = s[(s.ms >= -20) & (s.ms <= r.prefill_ms + 20)]
        col = colours.get(v, plots.GREEN)
        # NVML holds a reading for ~100 ms: draw it as the step it is
        ax_c.step(s.ms, s.sm_mhz, where="post", color=col, lw=1,
                  label=f"{v} (round {int(r['round'])}, {r.prefill_ms:,.0f} ms)")
        ax_p.step(s.ms, s.power_w, where="post", color=col, lw=1)
        ax_c.axvline(r.prefill_ms, color=col, lw=0.6, ls=":")
    if len(timeline):
        # each copy lasts ~0.2 ms, far below a pixel at this scale: a tick at its start
        ax_k.vlines(timeline.copy_start_ms, 0, 1, color=plots.VERMILLION, lw=1.2)
    ax_k.set_yticks([])
    ax_k.set_ylabel("copies", rotation=0, ha="right", va="center", fontsize=8)
    ax_c.set_ylabel("SM clock (MHz)")
    ax_p.set_ylabel("power (W)")
    ax_p.set_xlabel("ms since the prefill's start (ticks: each layer's copy to the peer starts; dotted: prefill ends)")
    ax_c.legend(fontsize=7, loc="lower left")
    ax_k.set_title("\n".join(textwrap.wrap(title or "SM clock and power under the timeline", 90)), fontsize=10)
    fig.tight_layout()
    return fig
