"""The published tables of the studies not yet moved into kvlab/studies/<study>/ (each one's BLOCKS replaces its
functions here as it moves): each takes run folders under data/ ("study/run_id") and gives a markdown table.
`kvlab.report` calls them for the blocks data/PUBLISHED.yaml names."""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd

from .paths import read_json, repo_root
from .study import ctx_label as _ctx
from .study import md_table as _md
from .study import sig as _g

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


def goals_of(study: str, path: str) -> pd.DataFrame:
    from . import goals

    if study == "disagg":
        from .disagg import report as dr

        g = goals.evaluate(goals.for_study("disagg"), dr.goal_table(_data() / path), keys=("layout", "mode", "context"))
        g.loc[g.id == "disagg.identical", ["layout", "mode", "context"]] = ["every request", "", float("nan")]
    elif study == "faults":
        from .disagg import report as dr

        g = goals.evaluate(goals.for_study("faults"), dr.fault_goal_table(_data() / path), keys=("policy",))
    else:
        raise ValueError(f"no goal table for study {study!r} here: a study of the one shape has its own goal_table")
    return g


def host_label(record: dict) -> str:
    devices = record.get("devices") or []
    cpus = (record.get("host") or {}).get("cpu_count")
    if not devices:
        return f"CPU host ({cpus} vCPU)"
    name = str(devices[0].get("name", "GPU")).removeprefix("NVIDIA ")
    return f"{len(devices)}×{name} host ({cpus} vCPU)"


def host_bound_label(study: str, path: str, record: dict) -> str:
    """'1k colocated prefill X ms' of a run: its record's host_bound (kvlab.report fills it in from the analysis of
    a run recorded without one), "" when it has none."""
    hb = record.get("host_bound")
    return f"1k colocated prefill {hb['colocated_prefill_ms']:.1f} ms" if hb else ""
