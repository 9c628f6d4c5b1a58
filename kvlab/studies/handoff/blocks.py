"""The handoff study's published tables (data/PUBLISHED.yaml's block kinds for study handoff), each from the
analyses of the runs a block names: `BLOCKS[kind](analyses, link=..., labels=...)` gives its markdown."""

from __future__ import annotations

import pandas as pd

from ...study import Analysis, ctx_label, md_table, sig
from .analysis import SEED004_H100

__all__ = ["BLOCKS", "goal_table", "seed_table_md", "policies", "attribution", "goals_side_by_side"]


def goal_table(a: Analysis, study: str = "handoff") -> pd.DataFrame:
    """The goal rows the verdicts table shows for one handoff run (kvlab.goals, under its one rule)."""
    return a.goals


def _ceiling(value) -> float | None:
    """A summary row's ceiling GB/s, None where the run measured none for that destination."""
    return None if value is None or pd.isna(value) else float(value)


def seed_table_md(a: Analysis, reference: bool = False) -> str:
    """Seed 004's table of one run: per context and destination the prefill (spread), the bulk copy (% of prefill),
    GB/s against the run's ceiling, 2 × 28 copies, the layer-wise extra [95 % interval] and what was exposed; with
    `reference`, seed 004's 2×H100 numbers beside them and the first decode step instead of the hook host time."""
    rows = []
    for r in a.tables["summary"].itertuples():
        cg = _ceiling(r.ceiling_gbps)
        gb = f"{r.copy_gbps:,.0f} / {cg:,.0f} ({100 * r.copy_gbps / cg:.1f} %)" if cg else f"{r.copy_gbps:,.0f}"
        ref = SEED004_H100.get(int(r.context))
        row = {"context": ctx_label(r.context), "KV MiB": f"{r.kv_mib:,.0f}", "destination": r.destination,
               "prefill ms (spread)": f"{sig(r.prefill_ms)} ({r.prefill_spread_ms:.1f})"}
        if reference:
            row["H100 prefill"] = f"{ref[0]:,}" if ref else "—"
        row["bulk copy ms (% of prefill)"] = f"{sig(r.copy_ms)} ({r.copy_pct_prefill:.2f} %)"
        if reference:
            row["H100 bulk"] = str(ref[1]) if ref else "—"
        row["GB/s vs ceiling"] = gb
        row["2×28 copies ms"] = sig(r.copy_tensor_ms)
        row["layer-wise extra ms [95 % interval]"] = (f"{r.layerwise_extra_ms:+.2f} [{r.extra_ci_lo_ms:+.2f}, "
                                                      f"{r.extra_ci_hi_ms:+.2f}]")
        if reference:
            row["H100 extra"] = f"{ref[2]}" if ref else "—"
        row["exposed ms (median)"] = f"{max(r.exposed_ms, 0):.2f} ({r.exposed_ms:+.2f})"
        if reference:
            row["first decode step ms"] = f"{r.decode_step_ms:.1f}"
        else:
            row["hook host ms"] = f"{r.hook_host_ms:.2f}"
        rows.append(row)
    return md_table(pd.DataFrame(rows))


def _run_id(a: Analysis) -> str:
    return (a.where or a.run_id).split("/")[-1]


def policies(analyses: list[Analysis], **_) -> str:
    """Send policies side by side, from three runs (eager, deadline, deadline rerun at 32k): per context of the
    deadline run, each one's layer-wise extra [95 % interval], the deadline run's exposed time and bulk copy."""
    eager, deadline, deadline_32k = analyses
    e, d, d32 = (x.tables["summary"].set_index("context") for x in (eager, deadline, deadline_32k))

    def iv(t, c):
        return (f"{t.loc[c, 'layerwise_extra_ms']:+.2f} [{t.loc[c, 'extra_ci_lo_ms']:+.2f}, "
                f"{t.loc[c, 'extra_ci_hi_ms']:+.2f}]")

    rows = []
    for c in d.index:
        dl = iv(d, c) + (f"; rerun: {iv(d32, c)}" if c in d32.index else "")
        rows.append({"context": ctx_label(c),
                     f"eager extra ms [95 % interval] ({_run_id(eager)})": iv(e, c) if c in e.index else "—",
                     "deadline extra ms [95 % interval]": dl,
                     "deadline exposed ms (max)": f"{d.loc[c, 'exposed_ms']:+.2f} ({d.loc[c, 'exposed_max_ms']:+.2f})",
                     "bulk copy ms": sig(d.loc[c, "copy_ms"])})
    return md_table(pd.DataFrame(rows))


def attribution(analyses: list[Analysis], **_) -> str:
    """The shortest context's split of a layer-wise send's cost (signal only, attention hooks, per-layer wakes)."""
    s = analyses[0].tables["attribution"]
    out = pd.DataFrame({
        "destination": s.destination, "variant": s.variant, "signal point, mode": s["mode"].fillna("—"),
        "extra prefill ms [95 % interval]": [f"{a:+.2f} [{lo:+.2f}, {hi:+.2f}]" for a, lo, hi in
                                             zip(s.extra_ms, s.extra_ci_lo_ms, s.extra_ci_hi_ms)],
        "hook host ms": s.hook_host_ms.map(lambda v: f"{v:.2f}"), "rounds": s.rounds})
    return md_table(out)


def goals_side_by_side(analyses: list[Analysis], labels=None, **_) -> str:
    """The goals of several runs in columns, one row per goal and place: value [95 % interval] and the verdict under
    the one rule. A column is titled "<label> (<run time>)", its label from the manifest."""
    labels = list(labels or [""] * len(analyses))
    runs = {f"{label} ({_run_id(a).split('-')[1]})": a for a, label in zip(analyses, labels)}
    cols = {}
    for title, a in runs.items():
        for r in goal_table(a).itertuples():
            key = (r.goal, int(r.context), r.destination)
            v = r.verdict if r.verdict == "met" else f"**{r.verdict}**"
            cols.setdefault(key, {})[title] = f"{v}: {r.value.split(' <=')[0].split(' >=')[0]}"
    rows = [{"goal": goal, "where": ctx_label(ctx), **{t: c.get(t, "—") for t in runs}}
            for (goal, ctx, dest), c in cols.items()]
    return md_table(pd.DataFrame(rows))


BLOCKS = {
    "table": lambda analyses, **_: seed_table_md(analyses[0]),
    "table_with_reference": lambda analyses, **_: seed_table_md(analyses[0], reference=True),
    "policies": policies,
    "attribution": attribution,
    "goals_side_by_side": goals_side_by_side,
}
