"""The handoff study's analysis: from the tidy rows kvlab.handoff measured to seed 004's table (`summarize`),
the goals' verdicts (`goals`), the models beside the measurements (`predictions`), sentences (`findings`) and
figures (`plot_ttft`, `plot_attribution`). Reads tables; never measures.
"""

from __future__ import annotations

import pandas as pd

from .timing import median_ci

__all__ = ["run_ceilings", "summarize", "goals", "goal_state", "predictions", "plot_ttft", "SEED004_H100", "findings", "attribution_summary",
           "attribution_findings", "plot_attribution"]


def attribution_summary(rows: pd.DataFrame) -> pd.DataFrame:
    """Per destination and variant: median prefill, and the median paired difference against colocated
    (same round) with its 95 % bootstrap interval; `part` names what that difference prices.
    Columns: context, destination, variant, mode, rounds, prefill_ms, extra_ms, extra_ci_lo_ms,
    extra_ci_hi_ms, wall_extra_ms (layer-wise variants: until the last layer landed), hook_host_ms, part."""
    parts = {"signal only": "the per-layer signal's host work (one driver call a layer, nothing sent)",
             "layer-wise": "signal + copies (the real send)",
             "layer-wise, attention hooks": "the real send, signalled from attention-module forward hooks",
             "layer-wise, per-layer wakes": "the real send with the worker woken after every layer"}
    out = []
    for (context, dest), g in rows.groupby(["context", "destination"], sort=False):
        base = g[g.variant == "colocated"].set_index("round").ms
        for variant, v in g.groupby("variant", sort=False):
            if variant == "colocated":
                continue
            v = v.set_index("round")
            d = (v.ms - base).dropna()
            lo, hi = median_ci(d)
            wall = (v.wall_ms - base).dropna()
            out.append(dict(context=context, destination=dest, variant=variant, mode=v["mode"].iloc[0],
                            rounds=len(d), prefill_ms=_med(v.ms), extra_ms=_med(d), extra_ci_lo_ms=lo,
                            extra_ci_hi_ms=hi, wall_extra_ms=_med(wall) if len(wall) else float("nan"),
                            hook_host_ms=_med(v.hook_host_ms) if v.hook_host_ms.notna().any() else float("nan"),
                            part=parts.get(variant, "")))
    return pd.DataFrame(out)


def attribution_findings(summary: pd.DataFrame) -> list[str]:
    """One sentence per destination, derived from attribution_summary's numbers."""
    out = []
    for (context, dest), g in summary.groupby(["context", "destination"], sort=False):
        by = g.set_index("variant")

        def part(name):
            r = by.loc[name]
            return f"{r.extra_ms:+.2f} ms (95 % interval {r.extra_ci_lo_ms:+.2f}…{r.extra_ci_hi_ms:+.2f})"

        text = f"At {context:,} tokens → {dest}: "
        bits = []
        if "signal only" in by.index:
            bits.append(f"the per-layer signal alone costs {part('signal only')} over plain prefill")
        if "layer-wise" in by.index:
            bits.append(f"the real send ({by.loc['layer-wise', 'mode']}) {part('layer-wise')}")
        if "signal only" in by.index and "layer-wise" in by.index:
            bits.append(f"so the copies themselves account for about "
                        f"{by.loc['layer-wise', 'extra_ms'] - by.loc['signal only', 'extra_ms']:+.2f} ms")
        if "layer-wise, attention hooks" in by.index:
            bits.append(f"signalled from attention-module hooks instead, the send costs "
                        f"{part('layer-wise, attention hooks')}")
        if "layer-wise, per-layer wakes" in by.index:
            bits.append(f"waking the pageable worker after every layer instead costs {part('layer-wise, per-layer wakes')}")
        out.append(text + "; ".join(bits) + ".")
    return out


def plot_attribution(summary: pd.DataFrame, title: str = ""):
    """Horizontal bars: each variant's extra prefill time over colocated, with its 95 % interval, per
    destination; the issue's 0.5 ms budget as a dashed line."""
    import matplotlib.pyplot as plt

    from . import plots

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
    import textwrap

    ax.set_title("\n".join(textwrap.wrap(title or f"Where layer-wise sending's cost goes at {ctx} tokens", 62)),
                 fontsize=10)
    fig.tight_layout()
    return fig


def _med(s):
    return float(s.median())


def run_ceilings(record: dict) -> tuple[dict, dict]:
    """({destination: the run's own ceiling GB/s}, {destination: its path}) from a handoff run's run.json."""
    paths = (record.get("resolved") or {}).get("ceiling_paths") or {}
    c = record.get("ceilings") or {}
    ceil = {}
    for dest, p in paths.items():
        e = (c.get("paths") or {}).get(p)
        if e and e.get("ceiling_gbps") is not None:
            ceil[dest] = float(e["ceiling_gbps"])
    return ceil, paths


HOST_BOUND_CONTEXT = 1024  # below a few thousand tokens prefill waits for the host: its rate is the host's


def host_bound(summary: pd.DataFrame, context: int = HOST_BOUND_CONTEXT) -> dict | None:
    """The host-bound regime's prefill rate of a run, for run.json: ``{"context", "colocated_prefill_ms",
    "tokens_per_s"}`` — the median colocated prefill at ``context`` over its destinations' rounds. At 1k the
    same GPU gave 29–43 ms on different hosts and processes, so every 1k verdict holds on the host this
    names. None when the run did not measure ``context``."""
    rows = summary[summary.context == context]
    if rows.empty:
        return None
    ms = float(rows.prefill_ms.median())
    return {"context": int(context), "colocated_prefill_ms": round(ms, 3), "tokens_per_s": round(context / ms * 1e3)}


def summarize(timings: pd.DataFrame, ceilings: dict | None = None, paths: dict | None = None) -> pd.DataFrame:
    """The seed-004 table, one row per (context, destination).

    ceilings: {destination label: ceiling GB/s measured in the same run} (optional);
    paths: {destination label: the kvlab.ceilings path behind it} (optional, carried into the table).
    Columns: context, kv_mib, destination, prefill_ms, prefill_spread_ms, copy_ms, copy_min_ms, copy_max_ms,
    copy_ci_lo_ms / copy_ci_hi_ms,
    copy_pct_prefill, copy_gbps, ceiling_gbps, copy_pct_ceiling (against `ceilings`, the run's size sweep) with
    copy_pct_ceiling_lo / _hi (the 95 % bootstrap interval of the median copy, against it),
    ref_copy_ms (a plain copy_ of the same bytes over the same path, interleaved with the bulk copies),
    copy_pct_ref (median of the per-round ratios ref / copy, in %) with copy_pct_ref_lo / _hi (its 95 %
    bootstrap interval), copy_tensor_ms, copy_layer_ms,
    layerwise_extra_ms (median of paired B − A), layerwise_extra_pct, extra_min_ms, extra_max_ms,
    extra_ci_lo_ms / extra_ci_hi_ms (95 % bootstrap interval of that median),
    exposed_ms, exposed_min_ms, exposed_max_ms, exposed_ci_lo_ms / _hi_ms, hook_host_ms with hook_host_ci_lo_ms /
    _hi_ms, decode_step_ms — every _ci_ pair a 95 % bootstrap interval of the median (kvlab.timing.median_ci).
    """
    out = []
    for (context, dest), g in timings[timings.destination != "colocated"].groupby(["context", "destination"],
                                                                               sort=False):
        kv = int(g.kv_bytes.iloc[0])

        def sel(method, measure):
            return g[(g.method == method) & (g.measure == measure)].set_index("repeat").ms

        pre = sel("colocated", "prefill")
        copy = sel("bulk", "copy")
        wall = sel("layerwise", "wall")
        paired = (wall - pre).dropna()
        ci_lo, ci_hi = median_ci(paired) if len(paired) else (float("nan"), float("nan"))
        exposed = sel("layerwise", "exposed")
        prefill_ms = _med(pre)
        copy_ms = _med(copy)
        gbps = kv / (copy_ms / 1e3) / 1e9
        ceil = (ceilings or {}).get(dest)
        ref = sel("bulk", "copy_ref")
        ratio = (100 * ref / copy).dropna()
        nan2 = (float("nan"), float("nan"))
        r_lo, r_hi = median_ci(ratio) if len(ratio) else nan2
        c_lo, c_hi = median_ci(copy.dropna()) if len(copy.dropna()) else nan2
        e_lo, e_hi = median_ci(exposed.dropna()) if len(exposed.dropna()) else nan2
        hook = sel("layerwise", "hook_host").dropna()
        h_lo, h_hi = median_ci(hook) if len(hook) else nan2
        row = dict(
            context=context, kv_mib=kv / 2**20, destination=dest, ceiling_path=(paths or {}).get(dest),
            prefill_ms=prefill_ms, prefill_spread_ms=float(pre.max() - pre.min()),
            copy_ms=copy_ms, copy_min_ms=float(copy.min()), copy_max_ms=float(copy.max()),
            copy_ci_lo_ms=c_lo, copy_ci_hi_ms=c_hi,
            copy_pct_prefill=100 * copy_ms / prefill_ms, copy_gbps=gbps,
            ceiling_gbps=ceil, copy_pct_ceiling=(100 * gbps / ceil) if ceil else None,
            copy_pct_ceiling_lo=(100 * kv / (c_hi / 1e3) / 1e9 / ceil) if ceil else None,
            copy_pct_ceiling_hi=(100 * kv / (c_lo / 1e3) / 1e9 / ceil) if ceil else None,
            ref_copy_ms=_med(ref), copy_pct_ref=_med(ratio), copy_pct_ref_lo=r_lo, copy_pct_ref_hi=r_hi,
            copy_tensor_ms=_med(sel("bulk", "copy_tensor")), copy_layer_ms=_med(sel("bulk", "copy_layer")),
            layerwise_extra_ms=_med(paired), extra_min_ms=float(paired.min()), extra_max_ms=float(paired.max()),
            extra_ci_lo_ms=ci_lo, extra_ci_hi_ms=ci_hi,
            layerwise_extra_pct=100 * _med(paired) / prefill_ms,
            exposed_ms=_med(exposed), exposed_min_ms=float(exposed.min()), exposed_max_ms=float(exposed.max()),
            exposed_ci_lo_ms=e_lo, exposed_ci_hi_ms=e_hi,
            hook_host_ms=_med(sel("layerwise", "hook_host")), hook_host_ci_lo_ms=h_lo, hook_host_ci_hi_ms=h_hi,
            arm_host_ms=_med(sel("layerwise", "arm_host")),
            decode_step_ms=_med(sel("bulk", "decode_step")),
            rounds=len(paired),
        )
        out.append(row)
    return pd.DataFrame(out)


def goals(summary: pd.DataFrame) -> pd.DataFrame:
    """The handoff goals (kvlab.goals, study "handoff") judged row by row under the one rule: the link goal
    and the same-bytes goal beside it at the longest context; exposed ≤ one layer and never worse than bulk
    from 4k (and at every context to a peer); hook host time and the interleaved extra ≤ 0.5 ms at a
    host-bound shortest context (≤ 1k); issue 14's NVLink goals at 32k. `met` is True, False or None (not
    resolved); `verdict` says it in words, `rule` whether an interval or a point value decided."""
    from . import goals as G

    return G.evaluate(G.for_study("handoff"), summary)


def goal_state(value) -> bool | None:
    """A goal table's `met` as True, False or None (not resolved), whatever pandas or a CSV made of it."""
    if value is None or (isinstance(value, float) and value != value):
        return None
    if isinstance(value, str):
        return {"true": True, "false": False}.get(value.strip().lower())
    return bool(value)


def predictions(summary: pd.DataFrame, layers: int, ceilings=None, links=("100G", "400G")) -> pd.DataFrame:
    """What the models predict beside what was measured, per context (and destination for the fit).

    links: the calculator's network predictions (bytes / link rate, no fixed cost) — seed 000's NICs.
    ceilings: a kvlab.ceilings_fit.Ceilings of the same run; the fitted fixed + bytes model predicts one copy
    and 2 × layers copies (seed 004's 56 tensors) for each destination's path.
    Columns: context, destination, model, ms, pct_prefill.
    """
    from . import calculator

    rows = []
    for context, g in summary.groupby("context", sort=True):
        nbytes = float(g.kv_mib.iloc[0]) * 2**20
        prefill_ms = float(g.prefill_ms.median())
        for name in links:
            ms = 1e3 * calculator.transfer_time_s(nbytes, calculator.link(name))
            rows.append(dict(context=context, destination="network", model=f"{name} NIC (calculator)",
                             ms=ms, pct_prefill=100 * ms / prefill_ms))
        if ceilings is None:
            continue
        for r in g.itertuples():
            path = r.ceiling_path
            if not path or path not in ceilings.names:
                continue
            for copies, what in ((1, "fit, 1 copy"), (2 * layers, f"fit, {2 * layers} copies")):
                ms = ceilings.predict_ms(path, nbytes, copies=copies)
                rows.append(dict(context=context, destination=r.destination, model=what, ms=ms,
                                 pct_prefill=100 * ms / r.prefill_ms))
    return pd.DataFrame(rows)


# Seed 004's numbers on two H100s over NVLink (docs/REFERENCE.md), by context: (prefill, bulk copy, layer-wise
# extra), ms. A reference drawn beside kvlab's own measurements, never mixed with them.
SEED004_H100 = {1024: (29, 1.1, 0.1), 4096: (109, 1.4, 3.9), 16384: (495, 3.4, 8.6), 32768: (1167, 5.7, 23.3)}


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
    import numpy as np

    from . import plots

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
    fig.supxlabel("context in tokens, with its colocated prefill time", fontsize=9, y=0.13)
    import textwrap

    fig.suptitle("\n".join(textwrap.wrap(title or "What moving the KV cache adds to the time to first token", 70)),
                 fontsize=11)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.legend(handles.values(), [h.get_label() for h in handles.values()], loc="lower center", ncol=2,
               fontsize=8, frameon=False, bbox_to_anchor=(0.5, 0.0))
    return fig


def findings(summary: pd.DataFrame, goal_table: pd.DataFrame) -> list[str]:
    """Sentences derived from the numbers (never pasted): per destination at the longest context, then the goals."""
    out = []
    longest = summary.context.max()
    for r in summary[summary.context == longest].itertuples():
        ceil = (f", {r.copy_pct_ceiling:.1f} % of the {r.ceiling_gbps:,.1f} GB/s ceiling of this run's size sweep"
                if pd.notna(r.ceiling_gbps) else "")
        pct_ref = getattr(r, "copy_pct_ref", float("nan"))
        if pd.notna(pct_ref):
            ceil += (f" and {pct_ref:.1f} % [{r.copy_pct_ref_lo:.1f}, {r.copy_pct_ref_hi:.1f}] of a plain copy of "
                     f"the same bytes timed in alternation with it ({r.ref_copy_ms:.3g} ms)")
        out.append(
            f"At {longest:,} tokens ({r.kv_mib:,.0f} MiB) the bulk copy to {r.destination} took {r.copy_ms:.3g} ms "
            f"(min–max {r.copy_min_ms:.3g}–{r.copy_max_ms:.3g}), {r.copy_gbps:,.1f} GB/s{ceil}; as "
            f"{r.copy_tensor_ms:.3g} ms when split into per-layer K and V tensors. That is "
            f"{r.copy_pct_prefill:.2f} % of the {r.prefill_ms:,.0f} ms prefill. Layer-wise sending left "
            f"{max(r.exposed_ms, 0):.3g} ms exposed after prefill's last kernel (one layer alone: "
            f"{r.copy_layer_ms:.3g} ms) and changed the whole request by {r.layerwise_extra_ms:+.2f} ms "
            f"(paired median of {r.rounds} A/B rounds, min–max {r.extra_min_ms:+.2f}…{r.extra_max_ms:+.2f}).")
    if not goal_table.empty:
        state = goal_table.met.map(goal_state)
        met = state.map(lambda v: v is True)
        missed = state.map(lambda v: v is False)
        open_ = ~(met | missed)
        text = f"{int(met.sum())} of {len(goal_table)} goal checks met"
        if open_.any():
            text += f", {int(open_.sum())} not resolved by the A/B rounds"
        out.append(text + ".")
        for g in goal_table[missed].itertuples():
            out.append(f"Not met: {g.goal} at {g.context:,} tokens → {g.destination}: {g.value}.")
        for g in goal_table[open_].itertuples():
            out.append(f"Not resolved: {g.goal} at {g.context:,} tokens → {g.destination}: {g.value} — the "
                       "interval straddles the threshold; notebook 03's kernel-by-kernel decomposition at "
                       "this point measures the copies' cost to prefill directly.")
    return out
