"""The handoff study's analysis: from the tidy rows kvlab.handoff measured to seed 004's table (`summarize`),
the goals' verdicts (`goals`), the models beside the measurements (`predictions`), sentences (`findings`) and
figures (`plot_bars`, `plot_attribution`). Reads tables; never measures.
"""

from __future__ import annotations

import pandas as pd

from .timing import median_ci

__all__ = ["run_ceilings", "summarize", "goals", "goal_state", "predictions", "plot_bars", "findings", "attribution_summary",
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


def plot_bars(summary: pd.DataFrame, preds: pd.DataFrame | None = None, title: str = ""):
    """Seed 004's figure: per context, each cost as a percentage of prefill (log scale).

    Measured bars: the bulk copy alone and the layer-wise extra (paired A/B median, floored at 0.001 %
    so a zero or negative cost still shows as "nothing") per destination; a whisker on each layer-wise bar
    spans its 95 % interval where the summary has one (the part below 0.001 % is cut by the log axis).
    Predicted bars (hatched, dashed edge): the calculator's network links.
    """
    import matplotlib.pyplot as plt
    import numpy as np

    from . import plots

    contexts = sorted(summary.context.unique())
    dests = list(dict.fromkeys(summary.destination))
    bars = []
    for d in dests:
        bars.append((f"bulk copy → {d}", d, "copy_pct_prefill", False))
        bars.append((f"layer-wise extra → {d}", d, "layerwise_extra_pct", False))
    net = [] if preds is None or preds.empty else list(dict.fromkeys(preds[preds.destination == "network"].model))
    n = len(bars) + len(net)
    fig, ax = plt.subplots(figsize=(max(7.0, 1.6 * len(contexts) + 0.35 * n), 4.6))
    width = 0.8 / n
    x = np.arange(len(contexts))
    floor = 1e-3
    k = 0
    for label, d, col, _ in bars:
        vals = [float(summary[(summary.context == c) & (summary.destination == d)][col].iloc[0]) for c in contexts]
        colour = plots.color(d)
        hatch = None if label.startswith("bulk") else "//"
        pos = x + (k - n / 2 + 0.5) * width
        ax.bar(pos, [max(v, floor) for v in vals], width, label=label, color=colour,
               alpha=1.0 if hatch is None else 0.55, hatch=hatch, edgecolor=colour)
        if col == "layerwise_extra_pct" and {"extra_ci_lo_ms", "extra_ci_hi_ms"} <= set(summary.columns):
            for xi, c in zip(pos, contexts):
                r = summary[(summary.context == c) & (summary.destination == d)].iloc[0]
                hi = 100 * r.extra_ci_hi_ms / r.prefill_ms
                if hi > floor:
                    lo = max(100 * r.extra_ci_lo_ms / r.prefill_ms, floor)
                    ax.plot([xi, xi], [lo, hi], color="0.2", lw=0.8)
        k += 1
    for name in net:
        vals = [float(preds[(preds.context == c) & (preds.model == name)].pct_prefill.iloc[0]) for c in contexts]
        ax.bar(x + (k - n / 2 + 0.5) * width, vals, width, label=f"predicted: {name}", fill=False,
               linestyle="--", edgecolor=plots.color(name), hatch="..")
        k += 1
    ax.set_yscale("log")
    ax.axhline(100, color="0.3", lw=1)
    ax.text(x[-1] + 0.45, 100, "prefill = 100 %", va="bottom", ha="right", fontsize=8, color="0.3")
    ax.set_xticks(x, [f"{c // 1024}k" if c >= 1024 else str(c) for c in contexts])
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("% of prefill time (log)")
    import textwrap

    ax.set_title("\n".join(textwrap.wrap(title or "Cost of moving the KV cache, as a share of prefill", 80)),
                 fontsize=11)
    ax.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.18), frameon=False)
    fig.tight_layout()
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
