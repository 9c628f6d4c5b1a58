"""The decomposition in words: its terms ranked by size (`causes`) and the findings a reader sees (`findings`),
every number taken from a Decomposition (and, when given, the backlog table of report.backlog_comparison)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from .decomposition import TERMS, Decomposition

__all__ = ["causes", "findings"]


def causes(decomp: Decomposition) -> pd.DataFrame:
    """The terms of Δwall ranked by size (largest |ms| first): term (a key from TERMS), cause (its words), ms,
    pct_of_delta, largest_in (the segment contributing most to that term)."""
    t = decomp.totals
    seg = decomp.segments
    rows = []
    for term, words, col, key in TERMS:
        if term == "clock" and not t.get("clock_term"):
            continue
        ns = t[key]
        where = ""
        if col is not None and len(seg):
            s = seg.loc[seg[col].abs().idxmax()]
            if abs(s[col]) > 0:
                where = f"{s.segment} ({s[col]:+.3f} ms)"
        rows.append({"term": term, "cause": words, "ms": ns / 1e6,
                     "pct_of_delta": 100 * ns / t["delta_wall_ns"] if t["delta_wall_ns"] else np.nan,
                     "largest_in": where})
    df = pd.DataFrame(rows)
    return df.reindex(df.ms.abs().sort_values(ascending=False).index).reset_index(drop=True)


def _ms(ns) -> str:
    """A duration in ns as text: ms from 0.1 ms up, else µs (one decimal below 10 µs)."""
    x = ns / 1e6
    if abs(x) >= 0.1:
        return f"{x:.2f} ms"
    us = x * 1e3
    return f"{us:.1f} µs" if abs(us) < 10 else f"{us:.0f} µs"


def findings(decomp: Decomposition, backlog: pd.DataFrame | None = None) -> list[str]:
    """Short sentences derived from the numbers: the wall-time difference, its causes ranked by size,
    the copies (engine, rate against the ceiling, start lag), the backlog, and how much of Δwall the
    decomposition explains."""
    t = decomp.totals
    d = t["delta_wall_ns"]
    out = []
    rel = 100 * d / t["wall_co_ns"] if t["wall_co_ns"] else float("nan")
    out.append(f"Layer-wise prefill took {_ms(abs(d))} {'longer' if d >= 0 else 'less'} than colocated "
               f"({t['wall_lw_ns'] / 1e6:.2f} vs {t['wall_co_ns'] / 1e6:.2f} ms, {rel:+.1f} %).")
    ranked = causes(decomp)
    ranked = ranked[ranked.term != "remainder"]
    shown = 0
    cost_said = False
    for r in ranked.itertuples():
        if shown >= 3 or (abs(r.ms) < 1e-3 and shown > 0):
            break
        share = f"{r.pct_of_delta:.0f} % of Δwall" if np.isfinite(r.pct_of_delta) else "Δwall is 0"
        lead = "The largest cause" if shown == 0 else "Next"
        sign = "added" if r.ms >= 0 else "saved"
        text = f"{lead}: {r.cause} {sign} {_ms(abs(r.ms * 1e6))} ({share})"
        if r.term == "inside":
            text += (f"; {t['ops_inside']} of {t['ops']} compute ops overlapped a copy, median "
                     f"{t['stretch_inside']:.2f}× their colocated time (outside: {t['stretch_outside']:.2f}×)")
        if r.term in ("inside", "outside") and "copy_cost_ns" in t and not cost_said:
            cost_said = True
            text += (f"; taking off the run-wide drift ({100 * t['drift_rate']:+.2f} % on every kernel, from the "
                     f"ops outside copy windows), the copies cost the kernels they overlapped "
                     f"{_ms(abs(t['copy_cost_ns']))}{'' if t['copy_cost_ns'] >= 0 else ' less than nothing (noise)'}")
        elif r.term == "idle":
            text += (f"; the compute stream sat idle {_ms(t['idle_lw_ns'])} in total against "
                     f"{_ms(t['idle_co_ns'])} colocated")
        elif r.term == "lead":
            text += (f"; prefill's first kernel started {_ms(t['lead_lw_ns'])} after the start event, against "
                     f"{_ms(t['lead_co_ns'])} colocated")
        if r.largest_in and r.term not in ("tail", "lead"):
            text += f", most of it in {r.largest_in}"
        out.append(text + ".")
        shown += 1
    cp = decomp.copies
    if len(cp):
        lay = decomp.layers
        engines = " and ".join(f"{e} ({', '.join(sorted(set(x for x in cp[cp.engine == e].copy_kind if x)) or ['kernels'])})"
                               for e in sorted(set(cp.engine)))
        rate = lay.copy_gbps.median()
        text = f"The {len(cp)} copies ran on the {engines}"
        if np.isfinite(rate):
            text += f" at a median {rate:.1f} GB/s per layer"
            if decomp.ceiling_gbps:
                text += f", {100 * rate / decomp.ceiling_gbps:.0f} % of the {decomp.ceiling_gbps:.1f} GB/s ceiling"
        lag = lay.start_lag_ns.dropna()
        if len(lag):
            med = float(lag.median())
            when = "after" if med >= 0 else "before"
            text += f"; a copy started a median {_ms(abs(med))} {when} its layer's attention finished"
        out.append(text + ".")
    if backlog is not None and len(backlog):
        first, last = backlog.measured_backlog_ms.iloc[0], backlog.measured_backlog_ms.iloc[-1]
        pred = backlog.predicted_backlog_ms.iloc[-1]
        # queueing shows as a backlog that rises by more than one layer's copy over the run and ends
        # later than one copy after the last layer's compute; a backlog that stays negative (copies land
        # before their layer's compute ends) is a link that keeps up, whatever its drift
        one_copy = float(backlog.transfer_ms.median())
        grows = last - first > one_copy and last > one_copy
        out.append(f"The measured backlog went from {_ms(first * 1e6)} at layer {backlog.layer.iloc[0]} to "
                   f"{_ms(last * 1e6)} at layer {backlog.layer.iloc[-1]} "
                   f"({'it grows by more than one layer copy: the link is slower than compute' if grows else 'it rises by less than one layer copy: the link keeps up'}); "
                   f"the pipelined model predicts {_ms(pred * 1e6)} at the last layer.")
    source = ("walls measured around each run" if t["wall_source"] == "measured" else
              "walls taken from the trace, so the remainder only shows what the matching missed")
    out.append(f"The decomposition explains {100 * t['explained_frac']:.0f} % of Δwall ({source}); "
               f"{_ms(abs(t['remainder_ns']))} is unexplained.")
    out.extend(n[0].upper() + n[1:] + "." for n in decomp.notes)
    return out
