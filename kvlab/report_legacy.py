"""The published tables of the studies not yet moved into kvlab/studies/<study>/ (each one's BLOCKS replaces its
functions here as it moves): each takes run folders under data/ ("study/run_id") and gives a markdown table.
`kvlab.report` calls them for the blocks data/PUBLISHED.yaml names."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pandas as pd

from . import handoff_report
from .paths import read_json, repo_root
from .study import ctx_label as _ctx
from .study import fmt_or_dash as _s
from .study import md_table as _md
from .study import sig as _g

# seed 004's 2×H100 numbers (docs/REFERENCE.md): the reference column of the two-GPU table
SEED_H100 = handoff_report.SEED004_H100
LINK_PREFIX = ""  # where data/ is, seen from the file a table goes into ("" for the README; kvlab.report sets it)


def _data() -> Path:
    """The committed runs: the repository's data/ (not KVLAB_DATA, which is where new runs go)."""
    return repo_root() / "data"


def _run(path: str) -> tuple[dict, Path]:
    d = _data() / path
    return read_json(d / "run.json"), d


def _table(path: str, name: str) -> pd.DataFrame:
    d = _data() / path
    for f in (d / f"{name}.csv", d / f"{name}.csv.gz"):
        if f.is_file():
            return pd.read_csv(f)
    raise FileNotFoundError(f"{d} has no {name}.csv(.gz)")


def _link(path: str) -> str:
    return f"[{path.split('/')[-1]}]({LINK_PREFIX}data/{path}/)"


def handoff_summary(path: str) -> pd.DataFrame:
    """kvlab.handoff_report.summarize of a committed handoff run, against the ceilings that run measured."""
    return _handoff_summary(path, str(_data())).copy()


@functools.lru_cache(maxsize=None)
def _handoff_summary(path: str, _root: str) -> pd.DataFrame:  # committed runs do not change: once a process
    record, _ = _run(path)
    ceil, paths = handoff_report.run_ceilings(record)
    return handoff_report.summarize(_table(path, "results"), ceil or None, paths or None)


def handoff_table(path: str, reference: bool = False) -> str:
    s = handoff_summary(path)
    record, _ = _run(path)
    ceil, _ = handoff_report.run_ceilings(record)
    rows = []
    for r in s.itertuples():
        cg = ceil.get(r.destination)
        gb = f"{r.copy_gbps:,.0f} / {cg:,.0f} ({100 * r.copy_gbps / cg:.1f} %)" if cg else f"{r.copy_gbps:,.0f}"
        row = {"context": _ctx(r.context), "KV MiB": f"{r.kv_mib:,.0f}", "destination": r.destination,
               "prefill ms (spread)": f"{_g(r.prefill_ms)} ({r.prefill_spread_ms:.1f})"}
        if reference:
            row["H100 prefill"] = f"{SEED_H100.get(int(r.context), ('—',))[0]:,}" if int(r.context) in SEED_H100 else "—"
        row["bulk copy ms (% of prefill)"] = f"{_g(r.copy_ms)} ({r.copy_pct_prefill:.2f} %)"
        if reference:
            row["H100 bulk"] = str(SEED_H100[int(r.context)][1]) if int(r.context) in SEED_H100 else "—"
        row["GB/s vs ceiling"] = gb
        row["2×28 copies ms"] = _g(r.copy_tensor_ms)
        row["layer-wise extra ms [95 % interval]"] = (f"{r.layerwise_extra_ms:+.2f} [{r.extra_ci_lo_ms:+.2f}, "
                                                      f"{r.extra_ci_hi_ms:+.2f}]")
        if reference:
            row["H100 extra"] = f"{SEED_H100[int(r.context)][2]}" if int(r.context) in SEED_H100 else "—"
        row["exposed ms (median)"] = f"{max(r.exposed_ms, 0):.2f} ({r.exposed_ms:+.2f})"
        if reference:
            row["first decode step ms"] = f"{r.decode_step_ms:.1f}"
        else:
            row["hook host ms"] = f"{r.hook_host_ms:.2f}"
        rows.append(row)
    return _md(pd.DataFrame(rows))


def policies(eager: str, deadline: str, deadline_32k: str) -> str:
    e = handoff_summary(eager).set_index("context")
    d = handoff_summary(deadline).set_index("context")
    d32 = handoff_summary(deadline_32k).set_index("context")
    rows = []
    for c in d.index:
        iv = lambda t, c: f"{t.loc[c, 'layerwise_extra_ms']:+.2f} [{t.loc[c, 'extra_ci_lo_ms']:+.2f}, {t.loc[c, 'extra_ci_hi_ms']:+.2f}]"  # noqa: E731
        dl = iv(d, c) + (f"; rerun: {iv(d32, c)}" if c in d32.index else "")
        rows.append({"context": _ctx(c), f"eager extra ms [95 % interval] ({eager.split('/')[-1]})": iv(e, c) if c in e.index else "—",
                     "deadline extra ms [95 % interval]": dl,
                     "deadline exposed ms (max)": f"{d.loc[c, 'exposed_ms']:+.2f} ({d.loc[c, 'exposed_max_ms']:+.2f})",
                     "bulk copy ms": _g(d.loc[c, "copy_ms"])})
    return _md(pd.DataFrame(rows))


def patterns(path: str) -> str:
    from . import clocks

    s = clocks.pattern_summary(_table(path, "pattern_rounds"))
    order = {v: i for i, v in enumerate(clocks.PATTERNS)}
    s = s[s.variant != "colocated"].sort_values("variant", key=lambda v: v.map(order))
    out = pd.DataFrame({
        "sent during prefill": s.variant,
        "extra prefill ms [95 % interval]": [f"{a:+.1f} [{lo:+.1f}, {hi:+.1f}]" for a, lo, hi in
                                             zip(s.extra_ms, s.extra_lo_ms, s.extra_hi_ms)],
        "GPU 0 SM clock vs colocated": [f"{-x:+.0f} MHz" for x in s.clock_drop_mhz],
        "the clock alone predicts ms": [f"{a:+.1f} [{lo:+.1f}, {hi:+.1f}]" for a, lo, hi in
                                        zip(s.clock_pred_ms, s.clock_pred_lo_ms, s.clock_pred_hi_ms)],
        "NVLink GB out of GPU 0": s.nvlink_tx_gb.map(lambda v: _s(v, ".2f"))})
    return _md(out)


def paged(path: str) -> str:
    from . import paged_report

    s = paged_report.summary(_table(path, "results"))
    # a method this run could not use (NIXL not installed): said, not timed; other skips keep their row as it is
    skipped = (s.status == "skipped") & s.note.fillna("").str.contains("not installed|does not load")
    out = pd.DataFrame({
        "destination": s.destination, "method": s.method, "pieces": s.pieces.map(lambda v: f"{v:,}"),
        "time median (min–max)": s.time.where(~skipped, "not run here"), "GB/s": s.gbps.map(lambda v: _s(v, ",.1f")),
        "% of contiguous ceiling": s.pct_of_ceiling.map(lambda v: "—" if v != v else f"{v:.1f} %"),
        "repeats": s.repeats, "verified": s.verified.where(~skipped, "—")})
    return _md(out)


def attribution(path: str) -> str:
    """The 1k split of a layer-wise send's cost (signal only, attention hooks, per-layer wakes)."""
    s = handoff_report.attribution_summary(_table(path, "attribution_rounds"))
    out = pd.DataFrame({
        "destination": s.destination, "variant": s.variant, "signal point, mode": s["mode"].fillna("—"),
        "extra prefill ms [95 % interval]": [f"{a:+.2f} [{lo:+.2f}, {hi:+.2f}]" for a, lo, hi in
                                             zip(s.extra_ms, s.extra_ci_lo_ms, s.extra_ci_hi_ms)],
        "hook host ms": s.hook_host_ms.map(lambda v: f"{v:.2f}"), "rounds": s.rounds})
    return _md(out)


def access_patterns(path: str) -> str:
    from . import paged_report

    s = paged_report.pattern_summary(_table(path, "access_patterns"))

    def cfg(c):
        if not isinstance(c, str) or not c:
            return "—"
        d = json.loads(c)
        return ", ".join(f"{k}={d[k]}" for k in ("block", "rows_per_program", "num_warps") if k in d)

    out = pd.DataFrame({"pattern": s.pattern, "time median (min–max)": s.time,
                        "GB/s": s.gbps.map(lambda v: f"{v:,.0f}"),
                        "% of contiguous copy": s.pct_of_contiguous.map(lambda v: f"{v:.1f} %"),
                        "repeats": s.repeats, "tuned kernel": s.config.map(cfg)})
    return _md(out)


def _params(record: dict) -> tuple:
    r = record.get("resolved") or {}
    p = record.get("parameters") or {}
    ctx = r.get("context", p.get("context"))
    dest = record.get("destination_label") or r.get("destination") or p.get("destination")
    return ctx, dest


def event_overhead(paths: list[str]) -> str:
    rows = []
    for path in paths:
        record, _ = _run(path)
        ctx, dest = _params(record)
        ev = _table(path, "event_overhead").iloc[0]
        base = float(ev.untimed_ms)
        rows.append({"run": _link(path), "context": _ctx(ctx), "destination": dest,
                     "prefill without events (ms)": f"{ev.untimed_ms:.1f}", "with events (ms)": f"{ev.evented_ms:.1f}",
                     "events add, ms [95 % interval]": f"{ev.extra_ms:+.2f} [{ev.extra_ci_lo_ms:+.2f}, {ev.extra_ci_hi_ms:+.2f}]",
                     "% of prefill [95 % interval]": (f"{100 * ev.extra_ms / base:.1f} % [{100 * ev.extra_ci_lo_ms / base:.1f}, "
                                                      f"{100 * ev.extra_ci_hi_ms / base:.1f}]"),
                     "rounds": int(ev.rounds)})
    return _md(pd.DataFrame(rows))


def overlap_runs(paths: list[str]) -> str:
    rows = []
    for path in paths:
        record, _ = _run(path)
        ctx, dest = _params(record)
        dec = _table(path, "decomposition").set_index("term").ms
        oh = _table(path, "overhead").set_index("variant")
        dw = float(dec["Δwall"])
        explained = 1 - abs(float(dec["unexplained remainder"])) / abs(dw) if dw else float("nan")
        rows.append({"run": _link(path), "context": _ctx(ctx), "destination": dest,
                     "send mode": record.get("send_mode") or (record.get("parameters") or {}).get("send_mode", "—"),
                     "Δwall traced (ms)": f"{dw:+.2f}",
                     "GPU idle gaps (ms)": f"{dec['GPU idle gaps (waiting for the host)']:+.2f}",
                     "lead-in host (ms)": f"{dec['host work before the first kernel (lead-in)']:+.2f}",
                     "kernels stretched in / out of copy windows (ms)": (
                         f"{dec['kernels stretched inside copy windows']:+.2f} / {dec['kernels stretched outside copy windows']:+.2f}"),
                     "explained": f"{100 * explained:.0f} %",
                     "tracing overhead (colocated)": f"{oh.loc['colocated', 'overhead_pct']:.1f} %"})
    return _md(pd.DataFrame(rows))


def swapin(paths: list[str]) -> str:
    """kvlab swapin: per run, context, direction, host layout and method — median ms (min–max), GB/s and % of the
    same direction's contiguous copy with its 95 % interval; a method that could not run says why."""
    rows = []
    for path in paths:
        for r in _table(path, "summary").itertuples():
            ran = r.n > 0
            rows.append({"run": _link(path), "context": _ctx(r.context), "direction": r.direction,
                         "host blocks": r.host_layout, "method": r.method,
                         "ms median (min–max)": f"{_g(r.ms)} ({_g(r.ms_min)}–{_g(r.ms_max)})" if ran else "—",
                         "GB/s": _g(r.gbps) if ran else "—",
                         "% of contiguous [95 %]": (f"{r.pct_of_ceiling:.1f} [{r.pct_lo:.1f}, {r.pct_hi:.1f}]"
                                                    if ran and r.method != "contiguous" else "—" if not ran else "100"),
                         "n": r.n})
    return _md(pd.DataFrame(rows))


def goals_side_by_side(runs: dict[str, str]) -> str:
    """The handoff goals of several runs in columns ({column title: run path}), one row per goal and place:
    value [95 % interval] and the verdict under the one rule."""
    cols = {}
    for title, path in runs.items():
        g = goals_of("handoff", path)
        for r in g.itertuples():
            key = (r.goal, int(r.context), r.destination)
            v = r.verdict if r.verdict == "met" else f"**{r.verdict}**"
            cols.setdefault(key, {})[title] = f"{v}: {r.value.split(' <=')[0].split(' >=')[0]}"
    rows = [{"goal": goal, "where": _ctx(ctx), **{t: c.get(t, "—") for t in runs}}
            for (goal, ctx, dest), c in cols.items()]
    return _md(pd.DataFrame(rows))


def goals_of(study: str, path: str) -> pd.DataFrame:
    from . import handoff_report, overlap_report, paged_report

    if study == "handoff":
        g = handoff_report.goals(handoff_summary(path))
    elif study == "paged_transfer":
        g = paged_report.goals(_table(path, "results"))
    else:
        walls = _table(path, "walls")
        dec = _table(path, "decomposition").set_index("term").ms
        totals = None
        if "Δwall" in dec.index and dec["Δwall"]:
            totals = {"explained_frac": 1 - abs(dec["unexplained remainder"]) / abs(dec["Δwall"])}
        try:
            events = _table(path, "event_overhead")
        except FileNotFoundError:
            events = None
        g = overlap_report.goals(overlap_report.goal_summary(overlap_report.tracing_overhead(walls), totals, events))
    return g


def host_label(record: dict) -> str:
    devices = record.get("devices") or []
    cpus = (record.get("host") or {}).get("cpu_count")
    if not devices:
        return f"CPU host ({cpus} vCPU)"
    name = str(devices[0].get("name", "GPU")).removeprefix("NVIDIA ")
    return f"{len(devices)}×{name} host ({cpus} vCPU)"


def host_bound_label(study: str, path: str, record: dict) -> str:
    """'1k colocated prefill X ms' of a run: run.json's host_bound, or (older runs) its committed summary."""
    hb = record.get("host_bound")
    if hb is None and study == "handoff":
        hb = handoff_report.host_bound(handoff_summary(path))
    return f"1k colocated prefill {hb['colocated_prefill_ms']:.1f} ms" if hb else ""
