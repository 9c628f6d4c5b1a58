"""The handoff study's analysis: from the tidy rows kvlab.studies.handoff.experiment measured to seed 004's table
(`summarize`), the goals' verdicts (`goals`), the models beside the measurements (`predictions`), sentences
(`findings`) and the split of the shortest context's layer-wise cost (`attribution_summary`). Reads tables;
never measures. The figures are in kvlab.studies.handoff.charts.
"""

from __future__ import annotations

import pandas as pd

from ... import calculator, ceilings_fit, models
from ... import goals as G
from ...study import Analysis, ctx_label, fmt_or_dash, sig
from ...intervals import median_ci

__all__ = ["analyse", "run_ceilings", "run_ceiling_record", "layers_of", "summarize", "goals", "goal_state",
           "predictions", "SEED004_H100", "findings", "correctness_finding", "attribution_summary",
           "attribution_findings", "host_bound", "HOST_BOUND_CONTEXT", "seed_table", "values"]

STUDY = "handoff"


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
    _hi_ms, decode_step_ms — every _ci_ pair a 95 % bootstrap interval of the median (kvlab.intervals.median_ci).
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


def goals(summary: pd.DataFrame, record: dict | None = None) -> pd.DataFrame:
    """The handoff goals (kvlab.goals, study "handoff") judged row by row under the one rule: the link goal
    and the same-bytes goal beside it at the longest context; exposed ≤ one layer and never worse than bulk
    from 4k (and at every context to a peer); hook host time and the interleaved extra ≤ 0.5 ms at a
    host-bound shortest context (≤ 1k); issue 14's NVLink goals at 32k. `met` is True, False or None (not
    resolved); `verdict` says it in words, `rule` whether an interval or a point value decided. With the run's
    `record`, by the goals in force when it started (kvlab.goals.evaluate_run), later ones beside them."""
    return G.evaluate_run("handoff", record, summary)


def goal_state(value) -> bool | None:
    """A goal table's `met` as True, False or None (not resolved), whatever pandas or a CSV made of it."""
    if value is None or (isinstance(value, float) and value != value):
        return None
    if isinstance(value, str):
        return {"true": True, "false": False}.get(value.strip().lower())
    return bool(value)


def predictions(summary: pd.DataFrame, layers: int | None, ceilings=None, links=("100G", "400G")) -> pd.DataFrame:
    """What the models predict beside what was measured, per context (and destination for the fit).

    links: the calculator's network predictions (bytes / link rate, no fixed cost) — seed 000's NICs.
    ceilings: a kvlab.ceilings_fit.Ceilings of the same run; the fitted fixed + bytes model predicts one copy
    and 2 × layers copies (seed 004's 56 tensors) for each destination's path (one copy only when `layers` is
    None: a run that did not record its model's layers).
    Columns: context, destination, model, ms, pct_prefill, link (the calculator's preset for a network row, else
    empty).
    """
    rows = []
    for context, g in summary.groupby("context", sort=True):
        nbytes = float(g.kv_mib.iloc[0]) * 2**20
        prefill_ms = float(g.prefill_ms.median())
        for name in links:
            ms = 1e3 * calculator.transfer_time_s(nbytes, calculator.link(name))
            rows.append(dict(context=context, destination="network", model=f"{name} NIC (calculator)",
                             ms=ms, pct_prefill=100 * ms / prefill_ms, link=name))
        if ceilings is None:
            continue
        for r in g.itertuples():
            path = r.ceiling_path
            if not path or path not in ceilings.names:
                continue
            fits = ((1, "fit, 1 copy"),) + (((2 * layers, f"fit, {2 * layers} copies"),) if layers else ())
            for copies, what in fits:
                ms = ceilings.predict_ms(path, nbytes, copies=copies)
                rows.append(dict(context=context, destination=r.destination, model=what, ms=ms,
                                 pct_prefill=100 * ms / r.prefill_ms, link=""))
    return pd.DataFrame(rows)


# Seed 004's numbers on two H100s over NVLink (docs/REFERENCE.md), by context: (prefill, bulk copy, layer-wise
# extra), ms. A reference drawn beside kvlab's own measurements, never mixed with them.
SEED004_H100 = {1024: (29, 1.1, 0.1), 4096: (109, 1.4, 3.9), 16384: (495, 3.4, 8.6), 32768: (1167, 5.7, 23.3)}


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


def seed_table(summary: pd.DataFrame) -> pd.DataFrame:
    """`summarize`'s table as the notebook shows it, one formatted text column per measure (ms unless marked):
    prefill (spread) · bulk copy (% of prefill) · GB/s / ceiling (%) · vs same bytes [95 % interval] ·
    per-tensor copy · one layer · layer-wise extra [95 % interval] (%) · exposed [min, max] · hook host ·
    arm host · first decode step."""
    s = summary
    view = s.assign(
        prefill=s.prefill_ms.map("{:,.1f}".format) + " (" + s.prefill_spread_ms.map("{:.1f}".format) + ")",
        copy=s.copy_ms.map("{:.3g}".format) + " (" + s.copy_pct_prefill.map("{:.2f}".format) + " %)",
        gbps=s.copy_gbps.map("{:,.1f}".format) + " / " + s.ceiling_gbps.map("{:,.1f}".format)
             + " (" + s.copy_pct_ceiling.map("{:.1f}".format) + " %)",
        same_bytes=s.copy_pct_ref.map("{:.1f}".format) + " % [" + s.copy_pct_ref_lo.map("{:.1f}".format)
                   + ", " + s.copy_pct_ref_hi.map("{:.1f}".format) + "]",
        per_tensor=s.copy_tensor_ms.map("{:.3g}".format),
        one_layer=s.copy_layer_ms.map("{:.3g}".format),
        extra=s.layerwise_extra_ms.map("{:+.2f}".format) + " [" + s.extra_ci_lo_ms.map("{:+.2f}".format) + ", "
              + s.extra_ci_hi_ms.map("{:+.2f}".format) + "] (" + s.layerwise_extra_pct.map("{:+.2f}".format) + " %)",
        exposed=s.exposed_ms.map("{:+.3g}".format) + " [" + s.exposed_min_ms.map("{:+.3g}".format) + ", "
                + s.exposed_max_ms.map("{:+.3g}".format) + "]",
        hooks=s.hook_host_ms.map("{:.3f}".format), armed=s.arm_host_ms.map("{:.3f}".format),
        decode=s.decode_step_ms.map("{:.2f}".format),
    )
    return view[["context", "kv_mib", "destination", "prefill", "copy", "gbps", "same_bytes", "per_tensor", "one_layer",
                 "extra", "exposed", "hooks", "armed", "decode"]]


# ------------------------------------------------------------------------------ one run, from what it wrote


def run_ceiling_record(record: dict, tables: dict) -> dict | None:
    """The run's link ceilings as run.json keeps them (kvlab.ceilings_fit.Ceilings.to_dict): those its run.json
    already holds (runs before the study had one shape wrote them while measuring), else the fit of its
    `ceilings` table, with the sweep's device, peer matrix and sample counts from resolved.ceiling_sweep. None when
    the run measured no ceilings."""
    if record.get("ceilings"):
        return record["ceilings"]
    table = tables.get("ceilings")
    if table is None or table.empty:
        return None
    sweep = dict((record.get("resolved") or {}).get("ceiling_sweep") or {})
    table = table.copy()
    table.attrs.update({k: sweep[k] for k in ("device", "p2p", "n", "warmup") if k in sweep})
    return ceilings_fit.fit(table).ceilings.to_dict()


def layers_of(record: dict) -> int | None:
    """The model's decoder layers: resolved.layers, or (runs before it was recorded) the registry's for its model;
    None when neither says."""
    res = record.get("resolved") or {}
    if res.get("layers"):
        return int(res["layers"])
    try:
        return models.get(str(res.get("model", ""))).layers
    except (ValueError, OSError):  # not a registry name (a config.json or model folder given)
        return None


def _iv(v, lo, hi, fmt: str) -> str:
    """`v [lo, hi]` with `fmt`, the interval left out when it is not there."""
    text = fmt_or_dash(v, fmt)
    if pd.notna(lo) and pd.notna(hi):
        text += f" [{format(lo, fmt)}, {format(hi, fmt)}]"
    return text


def values(summary: pd.DataFrame, attribution: pd.DataFrame | None, host: dict | None) -> dict[str, str]:
    """The run's named numbers, formatted, for the docs' inline markers: per "<context>.<destination>" (e.g.
    "32k.peer-cuda:1") its prefill, bulk copy, GB/s, % of the ceiling and of the same bytes, layer-wise extra and
    exposed time, hook host time; the host-bound prefill; per attribution variant its extra prefill time."""
    out = {}
    for r in summary.itertuples():
        k = f"{ctx_label(r.context)}.{r.destination}"
        out[f"{k}.prefill_ms"] = sig(r.prefill_ms)
        out[f"{k}.copy_ms"] = sig(r.copy_ms)
        out[f"{k}.copy_gbps"] = fmt_or_dash(r.copy_gbps, ",.1f")
        out[f"{k}.copy_pct_ceiling"] = fmt_or_dash(r.copy_pct_ceiling, ".1f")
        out[f"{k}.copy_pct_ref"] = _iv(r.copy_pct_ref, r.copy_pct_ref_lo, r.copy_pct_ref_hi, ".1f")
        out[f"{k}.layerwise_extra_ms"] = _iv(r.layerwise_extra_ms, r.extra_ci_lo_ms, r.extra_ci_hi_ms, "+.2f")
        out[f"{k}.exposed_ms"] = _iv(r.exposed_ms, r.exposed_ci_lo_ms, r.exposed_ci_hi_ms, "+.3g")
        out[f"{k}.hook_host_ms"] = fmt_or_dash(r.hook_host_ms, ".3f")
    if host:
        out["host_bound.colocated_prefill_ms"] = f"{host['colocated_prefill_ms']:.1f}"
    if attribution is not None:
        for r in attribution.itertuples():
            out[f"attribution.{ctx_label(r.context)}.{r.destination}.{r.variant}.extra_ms"] = _iv(
                r.extra_ms, r.extra_ci_lo_ms, r.extra_ci_hi_ms, "+.2f")
    return out


def correctness_finding(checks: pd.DataFrame) -> str:
    """One sentence on the run's correctness checks: how many moved caches decoded as the colocated one did."""
    ok = checks.tokens_match.astype(bool) & checks.logits_equal.astype(bool) & (checks.poison_left == 0)
    if ok.all():
        return (f"All {len(checks)} correctness checks identical: the decode from every moved cache matched the "
                "colocated decode, tokens and logits bit for bit, with no poison left.")
    bad = checks[~ok]
    return (f"{len(bad)} of {len(checks)} correctness checks differ from the colocated decode: "
            + ", ".join(f"{r.method} → {r.destination} at {int(r.context):,} tokens" for r in bad.itertuples()) + ".")


def analyse(record: dict, tables: dict) -> Analysis:
    """A handoff run's analysis from run.json and its raw tables (results, checks, ceilings, attribution_rounds):
    seed 004's table (summary), the predictions beside it, the run's ceiling fit (ceiling_fit), the 1k attribution
    when the run measured it, the goals, the findings, the named values; run.json gains `ceilings` (the fit) and
    `host_bound` (the 1k colocated prefill, on this host)."""
    if "results" not in tables:
        raise FileNotFoundError(f"handoff run {record.get('run_id', '')!r} has no results.csv: this run did not write "
                                "what its analysis needs")
    ceil_record = run_ceiling_record(record, tables)
    with_ceil = {**record, "ceilings": ceil_record} if ceil_record else record
    ceil, paths = run_ceilings(with_ceil)
    summary = summarize(tables["results"], ceil or None, paths or None)
    fitted = ceilings_fit.Ceilings.from_json(ceil_record) if ceil_record else None
    out = {"summary": summary, "predictions": predictions(summary, layers_of(record), fitted)}
    if fitted is not None:
        out["ceiling_fit"] = fitted.table()
    attr = None
    rounds = tables.get("attribution_rounds")
    if rounds is not None and len(rounds):
        attr = out["attribution"] = attribution_summary(rounds)
    goal_table = goals(summary, record)
    found = ([correctness_finding(tables["checks"])] if "checks" in tables else []) + findings(summary, goal_table)
    if attr is not None:
        found += attribution_findings(attr)
    host = host_bound(summary)
    fields = {"host_bound": host}
    if ceil_record:
        fields["ceilings"] = ceil_record
    return Analysis(STUDY, record, raw=dict(tables), tables=out, goals=goal_table, findings=found,
                    values=values(summary, attr, host), fields=fields)
