"""The README's result tables, made from the committed runs — no number copied by hand.

The README marks each generated table with a pair of comments:

    <!-- kvlab-report:NAME -->
    ...the table, as `render(NAME)` makes it...
    <!-- /kvlab-report -->

`kvlab report` rewrites every marked block from `data/`; `kvlab report --check` (a test runs it) fails when
the README differs from what the committed runs give. Each block names its run(s) in `BLOCKS`; the verdicts
come from kvlab.goals, under its one rule.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import pandas as pd

from . import handoff_report
from .paths import read_json, repo_root

__all__ = ["BLOCKS", "render", "update", "check", "add_arguments", "run_args"]

_BLOCK_RE = re.compile(r"(<!-- kvlab-report:([a-z0-9_]+) -->\n)(.*?)(<!-- /kvlab-report -->)", re.S)

# seed 004's 2×H100 numbers (docs/REFERENCE.md): the reference column of the two-GPU table
SEED_H100 = handoff_report.SEED004_H100


def _data() -> Path:
    """The committed runs: the repository's data/ (not KVLAB_DATA, which is where new runs go)."""
    return repo_root() / "data"


# the runs read while results tables render (evidence_runs() turns it on): which runs the tables rest on
_READ: set[str] | None = None


def _note_read(path: str) -> None:
    if _READ is not None:
        _READ.add(path)


def _run(path: str) -> tuple[dict, Path]:
    _note_read(path)
    d = _data() / path
    return read_json(d / "run.json"), d


def _table(path: str, name: str) -> pd.DataFrame:
    _note_read(path)
    d = _data() / path
    for f in (d / f"{name}.csv", d / f"{name}.csv.gz"):
        if f.is_file():
            return pd.read_csv(f)
    raise FileNotFoundError(f"{d} has no {name}.csv(.gz)")


def _md(df: pd.DataFrame) -> str:
    head = "| " + " | ".join(df.columns) + " |"
    rule = "|" + "|".join("---" for _ in df.columns) + "|"
    body = ["| " + " | ".join(str(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join([head, rule, *body]) + "\n"


def _ctx(c) -> str:
    c = int(c)
    return f"{c // 1024}k" if c >= 1024 and c % 1024 == 0 else f"{c:,}"


def _s(x, fmt: str) -> str:
    return "—" if x is None or (isinstance(x, float) and x != x) else format(x, fmt)


def _g(x, digits: int = 3) -> str:
    """Significant digits, thousands separated: 1,186.1 / 4.74 / 0.0309."""
    if x is None or (isinstance(x, float) and x != x):
        return "—"
    x = float(x)
    if abs(x) >= 100:
        return f"{x:,.1f}"
    return f"{x:.{digits}g}"


# ------------------------------------------------------------------------------------------- blocks


def ceilings(path: str) -> str:
    fit = _table(path, "fit")
    out = pd.DataFrame({
        "path": "`" + fit.path + "`", "mechanism": fit.mechanism,
        "fixed cost per copy (µs, fit)": fit.fixed_us.map(lambda v: f"{v:.2f}"),
        "bandwidth (GB/s, fit)": fit.bandwidth_gbps.map(lambda v: f"{v:,.1f}"),
        "ceiling: best median (GB/s)": [f"{c:,.1f} ({lo:,.1f}–{hi:,.1f})" for c, lo, hi in
                                        zip(fit.ceiling_gbps, fit.ceiling_min_gbps, fit.ceiling_max_gbps)],
        "at size": fit.ceiling_size_bytes.map(lambda b: f"{b / 2**20:,.0f} MiB")})
    return _md(out)


def handoff_summary(path: str) -> pd.DataFrame:
    """kvlab.handoff_report.summarize of a committed handoff run, against the ceilings that run measured."""
    _note_read(path)  # the cache below skips _run and _table on a second call
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


def disagg(paths: list[str]) -> str:
    """Two processes (kvlab disagg): per run, layout, mode and context — the decode side's TTFT, its paired extra
    over colocated (same round), and what was still exposed when prefill ended, as the decode side knew it."""
    from .disagg import report as dr

    rows = []
    for path in paths:
        record, d = _run(path)
        t = dr.goal_table(d)
        s = read_json(d / "summary.json")
        for r in t.itertuples():
            rows.append({"run": _link(path), "backend": f"{s['backend']} ({s['prefill_device']} → {s['decode_device']})",
                         "layout": r.layout, "mode": r.mode, "context": _ctx(r.context),
                         "colocated TTFT ms": _g(r.colocated_ttft_ms), "TTFT ms": _g(r.ttft_ms),
                         "TTFT − colocated ms [95 %]": f"{r.ttft_extra_ms:+.2f} [{r.ttft_extra_ms_lo:+.2f}, "
                                                        f"{r.ttft_extra_ms_hi:+.2f}]",
                         "exposed ms [95 %]": f"{r.exposed_ms:+.3f} [{r.exposed_ms_lo:+.3f}, {r.exposed_ms_hi:+.3f}]",
                         "decodes ≠ colocated": int(r.mismatched)})
    return _md(pd.DataFrame(rows))


def disagg_bench(paths: list[str]) -> str:
    """The bulk send across the process boundary alone, beside a plain copy of the same bytes in the prefill
    process (the ceiling), per run, layout and context."""
    from .disagg import report as dr

    rows = []
    for path in paths:
        record, d = _run(path)
        for r in dr.bench_table(pd.read_csv(d / "bench.csv")).itertuples():
            rows.append({"run": _link(path), "layout": r.layout, "context": _ctx(r.context), "kernel": r.kernel,
                         "send ms": _g(r.send_ms), "send GB/s": _g(r.send_gbps, 4),
                         "ceiling GB/s": _g(r.ceiling_gbps, 4),
                         "% of ceiling [95 %]": f"{r.pct_of_ceiling:.1f} [{r.pct_lo:.1f}, {r.pct_hi:.1f}]",
                         "one layer ms": _g(r.layer_ms)})
    return _md(pd.DataFrame(rows))


def disagg_nixl(paths: list[str]) -> str:
    """Two NIXL agents (kvlab disagg --backend nixl): per run, layout, mode and context — descriptors and transfers a
    request, the host time to build descriptor lists and post, the UCX transport that carried the writes."""
    from .disagg import report as dr
    from .disagg.nixl_link import cache_transports, ucx_transports

    rows = []
    for path in paths:
        record, d = _run(path)
        req, _, s = dr.load(d)
        # read from the prefill log by today's parser: summary.json's field, written by the run, missed the GPU's
        # cuda → cuda tables before 2026-12-01 (the H200 runs of 13a05c7 say tcp/lo, which was another memory pair)
        ucx = cache_transports(ucx_transports(Path(d) / "worker-prefill.log"), s.get("prefill_device", "cpu"),
                               s.get("decode_device")) or s["nixl"]["ucx_transports"]
        for r in dr.nixl_table(req).itertuples():
            order = (record.get("disagg_config") or {}).get("block_order", "random") if r.layout == "paged" else "—"
            rows.append({"run": _link(path), "descriptors": s["nixl"]["descs"], "block tables": order,
                         "layout": r.layout, "mode": r.mode,
                         "context": _ctx(r.context), "KiB": f"{r.kv_bytes // 1024:,}",
                         "descriptors a request": ", ".join(f"{x:,}" for x in r.descriptors),
                         "transfers": ", ".join(str(x) for x in r.transfers),
                         "post ms median (min–max)": f"{_g(r.post_ms)} ({_g(r.post_ms_min)}–{_g(r.post_ms_max)})",
                         "n": r.n, "UCX transport": ", ".join(ucx) if isinstance(ucx, list) else ucx,
                         "decodes ≠ colocated": r.mismatched})
    return _md(pd.DataFrame(rows))


def faults(paths: list[str]) -> str:
    """The fault campaigns (kvlab disagg --faults): per policy and fault kind, how faults were detected, what came
    of them, decodes that differed from colocated, and the time to each decision."""
    from .disagg import report as dr

    tables, backends = [], []
    for path in paths:  # one run at a time: two runs may share a policy (another backend)
        record, d = _run(path)
        t = dr.fault_table(pd.read_csv(d / "faults.csv"))
        t.insert(0, "run", _link(path))
        s = read_json(d / "summary.json")
        backends.append(s["backend"] + (" (in order)" if s["backend"] == "gloo" and s.get("in_order") else ""))
        t.insert(1, "backend", backends[-1])
        tables.append(t)
    t = pd.concat(tables, ignore_index=True)
    if len(set(backends)) == 1:
        t = t.drop(columns="backend")
    t["decision median ms"] = t["decision median ms"].map(lambda x: _g(x, 4))
    t["decision max ms"] = t["decision max ms"].map(lambda x: _g(x, 4))
    if t["new prefill process median ms"].notna().any():
        t["new prefill process median ms"] = t["new prefill process median ms"].map(lambda x: _g(x, 4) if x == x else "—")
    else:
        t = t.drop(columns="new prefill process median ms")
    return _md(t)


def checksum_cost(paths: list[str]) -> str:
    """What the campaigns' per-layer checksums cost, per run (backend, layout, context) and side."""
    from .disagg import report as dr

    rows = []
    for path in paths:
        record, d = _run(path)
        s = read_json(d / "summary.json")
        f = pd.read_csv(d / "faults.csv")
        for r in dr.checksum_table(f).to_dict("records"):
            rows.append({"run": _link(path), "backend": f"{s['backend']} ({s['prefill_device']} → {s['decode_device']})",
                         "layout": s["layouts"][0], "context": _ctx(s["contexts"][0]), "side": r["side"],
                         "requests": r["requests"], "MiB a request": _g(r["MiB a request"]),
                         "median ms": _g(r["median ms"]), "max ms": _g(r["max ms"]), "GB/s (median)": _g(r["GB/s"])})
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


_GiB = 1 << 30


def decode_memory(paths: list[str]) -> str:
    """Finished kvlab disagg runs' decode-side memory by phase (summary.json's decode_memory), in GiB."""
    rows = []
    for path in paths:
        _, d = _run(path)
        rows += [{"run": _link(path), "layout": r["layout"], "context": _ctx(r["context"]), "phase": r["phase"],
                  "allocated at its end (GiB)": f"{r['allocated_bytes'] / _GiB:.2f}",
                  "peak allocated (GiB)": f"{r['peak_allocated_bytes'] / _GiB:.2f}",
                  "peak reserved (GiB)": f"{r['peak_reserved_bytes'] / _GiB:.2f}"}
                 for r in read_json(d / "summary.json")["decode_memory"]]
    return _md(pd.DataFrame(rows))


def _exit(code) -> str:
    import signal

    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"{code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return str(code)


def decode_oom(paths: list[str]) -> str:
    """kvlab disagg runs under --decode-memory-gib (and one without): the cap; how the run ended — finished, with
    its checks and the decode side's peak, or stopped by a real out-of-memory, with the step it hit, what it asked
    for and what was allocated then; and how each worker process ended."""
    rows = []
    for path in paths:
        rec, d = _run(path)
        cap = rec["parameters"].get("decode_memory_gib") or 0
        row = {"run": _link(path), "cap (GiB)": f"{cap:.2f}" if cap else "none"}
        if rec["status"] == "finished":
            s = read_json(d / "summary.json")
            peak = max(r["peak_allocated_bytes"] for r in s["decode_memory"])
            ok = s["tokens_match"] and s["logits_equal"] and s["bytes_equal"] and s["poison_left"] == 0
            row.update({"ended": f"finished, {s['requests']} request(s) "
                                 f"{'identical to colocated' if ok else 'DIFFERENT'}",
                        "step": "—", "asked for": "—", "allocated (GiB)": f"peak {peak / _GiB:.2f}"})
        else:
            why = rec.get("stopped", "")
            failed = [r for r in rec.get("decode_memory") or [] if r.get("failed")]
            asked = re.search(r"it asked for ([\d.]+ [KMGT]?i?B)", why)
            held = (re.search(r"\(([\d.]+) GiB of it allocated", why)  # since the refusal says both
                    or re.search(r"already holds ([\d.]+) GiB", why))
            oom = "DecodeOutOfMemory" in why
            row.update({"ended": "stopped: decode out of memory" if oom else f"stopped: {why[:60]}",
                        "step": failed[0]["phase"] if failed else "capping" if held else "—",
                        "asked for": asked.group(1) if asked else "—",
                        "allocated (GiB)": (f"{failed[0]['allocated_bytes'] / _GiB:.2f}" if failed
                                            else f"{float(held.group(1)):.2f}" if held else "—")})
        row["decode, prefill exit"] = ", ".join(_exit(c) for c in (rec.get("worker_exit") or {}).values()) or "—"
        rows.append(row)
    return _md(pd.DataFrame(rows))


def _link(path: str) -> str:
    return f"[{path.split('/')[-1]}](data/{path}/)"


# the runs whose goals the README reports, by study
# (runs whose code cannot be rebuilt keep their verdicts here: a goal's verdict is never dropped)
VERDICT_RUNS = {
    "handoff": ["handoff/20261129-103726-h200", "handoff/20261129-115502-h200", "handoff/20261130-142532-h200",
                "handoff/20261130-143505-h200", "handoff/20261130-150123-h200", "handoff/20261201-051641-h200",
                *(f"handoff/20261201-{r}-h200" for r in ("092005", "092144", "092404"))],
    "paged_transfer": ["paged_transfer/20261129-103427-h200", "paged_transfer/20261129-114123-h200",
                       "paged_transfer/20261130-145124-h200", "paged_transfer/20261201-052414-h200",
                       "paged_transfer/20261201-091924-h200"],
    "overlap_timeline": ["overlap_timeline/20261129-104724-h200", "overlap_timeline/20261129-113044-h200",
                         "overlap_timeline/20261129-114951-h200", "overlap_timeline/20261130-145803-h200",
                         *(f"overlap_timeline/20261201-{r}-h200" for r in (
                             "052308", "052334", "052238", "053129", "053057", "053340", "071055", "053207",
                             "071148", "052920")),
                         "overlap_timeline/20261201-092615-h200"],
    "disagg": ["disagg/20261130-174816-h200", "disagg/20261130-175223-h200", "disagg/20261130-175620-h200",
               "disagg/20261130-175845-h200", "disagg/20261201-023701-h200", "disagg/20261201-023837-h200",
               "disagg/20261201-030308-h200", "disagg/20261201-032027-h200", "disagg/20261201-035926-h200",
               "disagg/20261201-040057-h200",
               *(f"disagg/20261201-{r}-h200" for r in ("092931", "093212", "093344", "093517", "093649", "095437"))],
    "faults": ["disagg/20261130-190554-cpu", "disagg/20261130-190727-cpu", "disagg/20261130-190910-cpu",
               "disagg/20261130-231101-cpu", "disagg/20261130-231342-cpu", "disagg/20261130-231636-cpu",
               "disagg/20261201-003237-cpu", "disagg/20261201-003410-cpu", "disagg/20261201-003554-cpu",
               "disagg/20261201-005329-cpu", "disagg/20261201-005442-cpu", "disagg/20261201-005602-cpu",
               "disagg/20261201-005719-cpu",
               "disagg/20261201-024052-h200", "disagg/20261201-025205-h200", "disagg/20261201-024517-h200",
               "disagg/20261201-113139-cpu", "disagg/20261201-113251-cpu", "disagg/20261201-113412-cpu"],
}
DISAGG_RUNS = VERDICT_RUNS["disagg"]
FAULT_RUNS = VERDICT_RUNS["faults"][:3]  # drop, delay, corrupt
KILL_RUNS = VERDICT_RUNS["faults"][3:6]  # the same kinds and kill
NIXL_FAULT_RUNS = VERDICT_RUNS["faults"][6:9]  # drop, delay, corrupt over two NIXL agents, paged
OOM_RUNS = VERDICT_RUNS["faults"][9:13]  # drop, delay, corrupt, oom at 1k: gloo (fail, retry, recompute), nixl (retry)
GPU_FAULT_RUNS = VERDICT_RUNS["faults"][13:16]  # the same kinds over ipc on one H200, Qwen2.5-7B at 1k, paged
IN_ORDER_FAULT_RUNS = VERDICT_RUNS["faults"][16:19]  # the same kinds over gloo matching in order (nccl's protocol), 1k
# a real out-of-memory on the decode side (--decode-memory-gib), ipc on one H200, Qwen2.5-7B at 32k, paged, at 75f2289:
# no cap; 10 GiB; between reference and destination; half a cache, 1.5 caches past the destination; the peak + 1 GiB;
# and, at df6d814 (the refusal counts what the allocator has reserved), 16.1 GiB: between allocated and reserved
DECODE_OOM_RUNS = [f"disagg/20261201-{r}-h200" for r in ("071737", "071759", "071816", "071832", "071853", "071914",
                                                        "073339")]
NIXL_RUNS = ["disagg/20261201-003207-cpu", "disagg/20261201-003224-cpu"]  # one descriptor a block; merged
# two NIXL agents on one H200, Qwen2.5-7B: contiguous; paged, a descriptor a block; paged, merged, packed tables
NIXL_GPU_RUNS = DISAGG_RUNS[4:6] + ["disagg/20261201-035926-h200"]
# notebook 03 on one H200 at a98a5a7, one lease (2026-12-01): 1k same GPU with seed 004's hooks (event), then
# armed flags; 1k pinned (31 event rounds) and pageable; 4k, 16k and 32k within the GPU; 32k to pageable host;
# and, in a later lease at f9f197f (no change to notebook 03's code), 16k and 32k to pinned host
OVERLAP_1GPU = VERDICT_RUNS["overlap_timeline"][4:14]
# the six two-GPU notebook runs again, on a 2×H200 at 267ef9f (2026-12-01), with the parameters of 20261130's runs,
# whose code cannot be rebuilt (those keep their verdicts above): ceilings; paged; handoff eager, deadline, deadline
# at 32k; the send patterns
TWO_GPU = dict(ceilings="link_ceilings/20261201-091906-h200", paged="paged_transfer/20261201-091924-h200",
               eager="handoff/20261201-092005-h200", deadline="handoff/20261201-092144-h200",
               deadline32="handoff/20261201-092404-h200", patterns="overlap_timeline/20261201-092615-h200")
# two processes on the 2×H200 (267ef9f), Qwen2.5-7B: nccl (32k, both layouts and modes, the bench); ipc from cuda:0
# into cuda:1 (32k, bulk, the bench); NIXL contiguous, paged with merged descriptors and packed tables, paged with a
# descriptor a block (4k and 32k); then nccl's bench again, its copy made after the decode side landed each round
DISAGG_2GPU = DISAGG_RUNS[10:12]
NIXL_2GPU_RUNS = DISAGG_RUNS[12:15]


def _goals_of(study: str, path: str) -> pd.DataFrame:
    from . import goals, handoff_report, overlap_report, paged_report

    if study == "disagg":
        from .disagg import report as dr

        g = goals.evaluate(goals.for_study("disagg"), dr.goal_table(_data() / path), keys=("layout", "mode", "context"))
        g.loc[g.id == "disagg.identical", ["layout", "mode", "context"]] = ["every request", "", float("nan")]
    elif study == "faults":
        from .disagg import report as dr

        g = goals.evaluate(goals.for_study("faults"), dr.fault_goal_table(_data() / path), keys=("policy",))
    elif study == "handoff":
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


def _host(record: dict) -> str:
    devices = record.get("devices") or []
    cpus = (record.get("host") or {}).get("cpu_count")
    if not devices:
        return f"CPU host ({cpus} vCPU)"
    name = str(devices[0].get("name", "GPU")).removeprefix("NVIDIA ")
    return f"{len(devices)}×{name} host ({cpus} vCPU)"


def _host_bound(study: str, path: str, record: dict) -> str:
    """'1k colocated prefill X ms' of a run: run.json's host_bound, or (older runs) its committed summary."""
    hb = record.get("host_bound")
    if hb is None and study == "handoff":
        hb = handoff_report.host_bound(handoff_summary(path))
    return f"1k colocated prefill {hb['colocated_prefill_ms']:.1f} ms" if hb else ""


def verdicts() -> str:
    """Every goal of every run in VERDICT_RUNS under kvlab.goals' one rule. Goals at 1k (host-bound) name the
    host's 1k prefill time: they hold on that host, not on an H200 in general."""
    rows = []
    for study, runs in VERDICT_RUNS.items():
        for path in runs:
            record, d = _run(path)
            g = _goals_of(study, path)
            for r in g.itertuples():
                ctx = getattr(r, "context", None)
                has_ctx = ctx is not None and ctx == ctx
                where = ", ".join(x for x in (_ctx(ctx) if has_ctx else "", getattr(r, "destination", "") or "",
                                              getattr(r, "layout", "") or "", getattr(r, "mode", "") or "",
                                              f"policy {r.policy}" if getattr(r, "policy", "") else "") if x)
                host = _host(record)
                if has_ctx and int(ctx) <= handoff_report.HOST_BOUND_CONTEXT:
                    host += "; " + _host_bound(study, path, record) + " (host-bound: holds on this host)"
                rows.append({"goal": r.goal, "run": _link(path), "host": host, "where": where or "—",
                             "value [95 % interval] vs goal": r.value,
                             "verdict": f"**{r.verdict}**" if r.verdict != "met" else r.verdict})
    return _md(pd.DataFrame(rows))


def verdict_counts() -> str:
    """How many goal checks are met, missed and not resolved, by study."""
    rows = []
    for study, runs in VERDICT_RUNS.items():
        v = pd.concat([_goals_of(study, p) for p in runs]).verdict.value_counts()
        rows.append({"study": study, "runs": len(runs), "checks": int(v.sum()),
                     **{k: int(v.get(k, 0)) for k in ("met", "missed", "not resolved")}})
    return _md(pd.DataFrame(rows))


def _committed_runs() -> list[Path]:
    """run.json of every run git tracks under data/ (a checkout's own, ignored CPU runs are not published);
    every run.json under data/ where git cannot say."""
    import subprocess

    root = repo_root()
    try:
        done = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--", "data/*/*/run.json"],
                              capture_output=True, text=True, timeout=60, check=True)
        tracked = [root / p for p in done.stdout.split("\0") if p]
        if tracked:
            return sorted(tracked)
    except (OSError, subprocess.SubprocessError):
        pass
    return sorted(_data().glob("*/*/run.json"))


def provenance_table() -> str:
    """Every committed run by provenance status (kvlab.provenance): can a reader get the code that ran?"""
    from . import provenance

    rows = {}
    for f in _committed_runs():
        st = provenance.status(read_json(f), f.parent)[0]
        rows.setdefault(st, []).append(f"{f.parent.parent.name}/{f.parent.name}")
    from . import goals

    order = ["verified", "diff", "clean", "unverified", "dirty", "mismatch", "unknown", "no commit"]
    out = [{"status": st, "code can be rebuilt": "yes" if st in provenance.PUBLISHABLE else "**no**",
            "runs": len(rows[st]), "which": ", ".join(r.split("/")[1] for r in rows[st])}
           for st in order if st in rows]
    total = sum(len(v) for v in rows.values())
    bad = sum(len(v) for st, v in rows.items() if st not in provenance.PUBLISHABLE)
    used = evidence_runs()
    cannot = [p for p in used if provenance.status(_run(p)[0], _data() / p)[0] not in provenance.PUBLISHABLE]
    g = goals.evaluate(goals.for_study("provenance"), pd.DataFrame([{
        "cannot_rebuild": bad, "tables_cannot_rebuild": len(cannot)}]), keys=()).set_index("id").verdict
    return (_md(pd.DataFrame(out))
            + f"\nGoal (issue 12): every published run can be rebuilt — {bad} of {total} cannot: "
              f"**{g['provenance.every_run']}**.\n"
            + f"\nGoal beside it (2026-12-01; the one above keeps its verdict): every run that a results table in this "
              f"README reads can be rebuilt — {len(cannot)} of {len(used)} cannot: **{g['provenance.tables']}**"
            + (f" ({', '.join(p.split('/')[1] for p in cannot)}).\n" if cannot else ".\n"))


# blocks about the runs rather than tables of results (evidence_runs() does not render them)
META_BLOCKS = ("verdicts", "verdict_counts", "provenance")


def evidence_runs() -> list[str]:
    """The runs ("study/run_id") that the README's results tables read, found by rendering every block but
    META_BLOCKS and noting each run folder opened: the list cannot drift from what the tables show."""
    global _READ
    outer, _READ = _READ, set()
    try:
        for name, make in BLOCKS.items():
            if name not in META_BLOCKS:
                make()
        found = _READ
    finally:
        _READ = outer
    if outer is not None:  # a nested call: what it read, the outer one read too
        outer |= found
    return sorted(found)


def goals_side_by_side(runs: dict[str, str]) -> str:
    """The handoff goals of several runs in columns ({column title: run path}), one row per goal and place:
    value [95 % interval] and the verdict under the one rule."""
    cols = {}
    for title, path in runs.items():
        g = _goals_of("handoff", path)
        for r in g.itertuples():
            key = (r.goal, int(r.context), r.destination)
            v = r.verdict if r.verdict == "met" else f"**{r.verdict}**"
            cols.setdefault(key, {})[title] = f"{v}: {r.value.split(' <=')[0].split(' >=')[0]}"
    rows = [{"goal": goal, "where": _ctx(ctx), **{t: c.get(t, "—") for t in runs}}
            for (goal, ctx, dest), c in cols.items()]
    return _md(pd.DataFrame(rows))


BLOCKS = {
    "ceilings_1gpu": lambda: ceilings("link_ceilings/20261201-051613-h200"),
    "ceilings_2gpu": lambda: ceilings(TWO_GPU["ceilings"]),
    "handoff_1gpu": lambda: handoff_table("handoff/20261201-051641-h200"),
    "handoff_2gpu": lambda: handoff_table(TWO_GPU["eager"], reference=True),
    "policies_2gpu": lambda: policies(TWO_GPU["eager"], TWO_GPU["deadline"], TWO_GPU["deadline32"]),
    "patterns_2gpu": lambda: patterns(TWO_GPU["patterns"]),
    "paged_1gpu": lambda: paged("paged_transfer/20261201-052414-h200"),
    "paged_2gpu": lambda: paged(TWO_GPU["paged"]),
    "attribution_1gpu": lambda: attribution("handoff/20261201-051641-h200"),
    "access_patterns_1gpu": lambda: access_patterns("paged_transfer/20261201-052414-h200"),
    "event_overhead_1gpu": lambda: event_overhead([p for p in OVERLAP_1GPU if (_data() / p / "event_overhead.csv").is_file()]),
    "overlap_runs_1gpu": lambda: overlap_runs(OVERLAP_1GPU),
    "goals_2gpu": lambda: goals_side_by_side({
        "eager (092005)": TWO_GPU["eager"], "deadline (092144)": TWO_GPU["deadline"],
        "deadline, 32k (092404)": TWO_GPU["deadline32"]}),
    "disagg_2gpu": lambda: disagg(DISAGG_2GPU + NIXL_2GPU_RUNS),
    "disagg_bench_2gpu": lambda: disagg_bench(DISAGG_2GPU + DISAGG_RUNS[15:16]),
    "disagg_nixl_2gpu": lambda: disagg_nixl(NIXL_2GPU_RUNS),
    "disagg_1gpu": lambda: disagg(DISAGG_RUNS[:2]),
    "disagg_bench_1gpu": lambda: disagg_bench([p for p in DISAGG_RUNS[:10] if (_data() / p / "bench.csv").is_file()]),
    "faults_cpu": lambda: faults(FAULT_RUNS),
    "faults_kill_cpu": lambda: faults(KILL_RUNS),
    "disagg_nixl_cpu": lambda: disagg_nixl(NIXL_RUNS),
    "faults_nixl_cpu": lambda: faults(NIXL_FAULT_RUNS),
    "faults_oom_cpu": lambda: faults(OOM_RUNS),
    "checksum_cost_cpu": lambda: checksum_cost(OOM_RUNS),
    "disagg_nixl_gpu": lambda: disagg_nixl(NIXL_GPU_RUNS),
    "disagg_nixl_ttft_gpu": lambda: disagg(NIXL_GPU_RUNS),
    "faults_gpu": lambda: faults(GPU_FAULT_RUNS),
    "faults_in_order_cpu": lambda: faults(IN_ORDER_FAULT_RUNS),
    "checksum_cost_gpu": lambda: checksum_cost(GPU_FAULT_RUNS + ["disagg/20261201-030404-h200"]),
    "swapin_1gpu": lambda: swapin(["swapin/20261201-030638-h200"]),
    "decode_memory_gpu": lambda: decode_memory(DECODE_OOM_RUNS[:1]),
    "decode_memory_two_contexts_gpu": lambda: decode_memory(["disagg/20261201-074648-h200"]),
    "decode_oom_gpu": lambda: decode_oom(DECODE_OOM_RUNS),
    "verdicts": verdicts,
    "verdict_counts": verdict_counts,
    "provenance": provenance_table,
}


def render(name: str) -> str:
    """The markdown of block `name` (a table and its trailing newline)."""
    if name not in BLOCKS:
        raise ValueError(f"unknown report block {name!r}; known: {sorted(BLOCKS)}")
    return BLOCKS[name]()


def update(text: str) -> tuple[str, list[str]]:
    """`text` with every marked block regenerated; and the names of the blocks that changed. ValueError when
    the markers do not pair up (a block without its end would swallow the next)."""
    starts = re.findall(r"<!-- kvlab-report:([a-z0-9_]+) -->", text)
    ends = text.count("<!-- /kvlab-report -->")
    found = [m.group(2) for m in _BLOCK_RE.finditer(text)]
    if len(starts) != ends or found != starts or any("<!-- kvlab-report:" in m.group(3) for m in _BLOCK_RE.finditer(text)):
        raise ValueError(f"README report markers do not pair up: {len(starts)} starts ({', '.join(starts)}), {ends} "
                         "ends; each <!-- kvlab-report:NAME --> needs its own <!-- /kvlab-report --> before the next")
    changed = []

    def sub(m):
        new = render(m.group(2))
        if new != m.group(3):
            changed.append(m.group(2))
        return m.group(1) + new + m.group(4)

    return _BLOCK_RE.sub(sub, text), changed


def _shallow() -> bool:
    import subprocess

    try:
        done = subprocess.run(["git", "-C", str(repo_root()), "rev-parse", "--is-shallow-repository"],
                              capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.stdout.strip() == "true"


# blocks that need the commits of the runs (to check their code): a shallow clone lacks them
NEEDS_HISTORY = ("provenance",)


def check(readme: str | Path | None = None) -> list[str]:
    """The names of the README's blocks that differ from what the committed runs give (empty: it matches). In a
    shallow clone the blocks of NEEDS_HISTORY are not compared: the commits they check are not there."""
    path = Path(readme) if readme is not None else repo_root() / "README.md"
    changed = update(path.read_text(encoding="utf-8"))[1]
    return [c for c in changed if c not in NEEDS_HISTORY] if _shallow() else changed


def add_arguments(parser) -> None:
    parser.add_argument("--check", action="store_true", help="only say which blocks differ; exit 1 if any")
    parser.add_argument("--readme", default=None, help="the README to read (default: the repository's)")


def run_args(args) -> int:
    path = Path(args.readme) if args.readme else repo_root() / "README.md"
    text = path.read_text(encoding="utf-8")
    found = [m.group(2) for m in _BLOCK_RE.finditer(text)]
    if not found:  # nothing to compare is not a match
        raise ValueError(f"{path} has no <!-- kvlab-report:NAME --> blocks; give the README whose tables kvlab "
                         "report makes")
    new, changed = update(text)
    if args.check:
        if _shallow():
            skipped = [c for c in changed if c in NEEDS_HISTORY]
            changed = [c for c in changed if c not in NEEDS_HISTORY]
            if skipped:
                print(f"shallow clone: not compared: {', '.join(skipped)} (it checks the runs' commits)")
        print(f"{len(found)} blocks; {'differ: ' + ', '.join(changed) if changed else 'all match the committed runs'}")
        return 1 if changed else 0
    if changed:
        path.write_text(new, encoding="utf-8")
    print(f"{len(found)} blocks; rewritten: {', '.join(changed) or 'none'}")
    return 0
