"""The published tables of the disagg study (BLOCKS, one function per kind data/PUBLISHED.yaml names), each from the
analyses of the runs its block lists, and the goal rows the verdicts table shows (`goal_table`).

    ttft            per run, layout, mode and context: TTFT over colocated, exposed, decodes ≠ colocated
    wire            what crossed (bf16, or FP8 with its scales): bytes against bf16's, TTFT, exposed, token agreement
    bench           the bulk send alone against a copy of the same bytes in the prefill process
    nixl            descriptors, transfers, posting time and the UCX transport of a nixl run
    faults          a fault campaign by policy and kind: detection, outcome, time to each decision
    checksum_cost   what the campaign's per-layer checksums cost, on each side
    decode_memory   the decode side's memory by phase (GiB)
    decode_oom      runs under a decode memory cap: how each ended, and how its worker processes ended
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pandas as pd

from ... import calculator
from ...disagg.nixl_link import cache_transports, ucx_transports
from ...paths import repo_root
from ...study import Analysis, ctx_label, host_label, md_table, sig

__all__ = ["BLOCKS", "goal_table"]

_GiB = 1 << 30


def _devices(s: dict) -> str:
    return f"{s['backend']} ({s['prefill_device']} → {s['decode_device']})"


def ttft(analyses: list[Analysis], link, **_) -> str:
    """Two processes (kvlab disagg): per run, layout, mode and context — the decode side's TTFT, its paired extra
    over colocated (same round), and what was still exposed when prefill ended, as the decode side knew it."""
    rows = []
    for a in analyses:
        s = a.record["summary"]
        for r in a.tables["summary"].itertuples():
            rows.append({"run": link(a.where), "backend": _devices(s),
                         "layout": r.layout, "mode": r.mode, "context": ctx_label(r.context),
                         "colocated TTFT ms": sig(r.colocated_ttft_ms), "TTFT ms": sig(r.ttft_ms),
                         "TTFT − colocated ms [95 %]": f"{r.ttft_extra_ms:+.2f} [{r.ttft_extra_ms_lo:+.2f}, "
                                                        f"{r.ttft_extra_ms_hi:+.2f}]",
                         "exposed ms [95 %]": f"{r.exposed_ms:+.3f} [{r.exposed_ms_lo:+.3f}, {r.exposed_ms_hi:+.3f}]",
                         "decodes ≠ colocated": int(r.mismatched)})
    return md_table(pd.DataFrame(rows))


def _bf16_links(analyses: list[Analysis]) -> dict:
    """Per (backend and devices, context): the calculator's link fitted on a bf16 run's bulk exposure (bytes over
    exposed time), the yardstick an FP8 run of the same block is predicted on."""
    out = {}
    for a in analyses:
        s = a.record["summary"]
        if s.get("wire_dtype") == "fp8":
            continue
        req = a.raw["requests"]
        for r in a.tables["summary"].itertuples():
            if r.mode != "bulk" or r.layout != "contiguous" or not r.exposed_ms > 0:
                continue
            key = (_devices(s), r.context)
            if key in out:
                raise ValueError(f"the wire table's block has two bf16 runs of {key[0]} at {r.context} tokens "
                                 f"({out[key].name.removeprefix('fitted on ')} and {a.where}): keep one, the FP8 runs' "
                                 "yardstick")
            nbytes = int(req[(req["mode"] == "bulk") & (req["layout"] == "contiguous")
                             & (req["context"] == r.context)]["bytes_moved"].iloc[0])
            out[key] = calculator.Link.from_GBps(nbytes / r.exposed_ms / 1e6, name=f"fitted on {a.where}")
    return out


def wire(analyses: list[Analysis], link, **_) -> str:
    """What crossed the wire (kvlab disagg --wire-dtype): per run, mode and context — the wire's dtype and scales, the
    bytes a request against the bf16 cache's, the decode side's TTFT and exposed time, decodes that differed from
    their reference (an FP8 wire's: the colocated cache through quantize → dequantize), and the FP8 decode's token
    agreement with the bf16 decode (measured, not required). Beside an FP8 bulk send, the calculator's exposure for
    its bytes (calculator.transfer_time_s) over the link a bf16 run of the same block measured (its bytes over its
    exposed time, same backend, devices and context): the seed's "switch to FP8 and the exposure shrinks" as a
    prediction, which leaves out what quantizing and dequantizing cost."""
    fitted = _bf16_links(analyses)
    rows = []
    for a in analyses:
        s = a.record["summary"]
        fp8 = s.get("wire_dtype") == "fp8"
        req = a.raw["requests"]  # each config's own bytes, from its requests
        per = {k: g.iloc[0] for k, g in req[req["mode"] != "colocated"].groupby(["layout", "mode", "context"])}
        for r in a.tables["summary"].itertuples():
            if r.mode == "colocated":
                continue
            c = per[(r.layout, r.mode, r.context)]
            lk = fitted.get((_devices(s), r.context)) if fp8 and r.mode == "bulk" else None
            rows.append({"run": link(a.where), "backend": _devices(s),
                         "wire": f"fp8, {s['wire_scales']} scales" if fp8 else "bf16",
                         "bytes a request": f"{int(c['bytes_moved']):,}",
                         "× bf16": f"{c['bytes_moved'] / c['kv_bytes']:.3f}",
                         "mode": r.mode, "context": ctx_label(r.context), "TTFT ms": sig(r.ttft_ms),
                         "exposed ms [95 %]": f"{r.exposed_ms:+.3f} [{r.exposed_ms_lo:+.3f}, {r.exposed_ms_hi:+.3f}]",
                         "calculator ms (bf16 run's link)":
                             sig(1e3 * calculator.transfer_time_s(int(c["bytes_moved"]), lk)) if lk else "—",
                         "decodes ≠ reference": int(r.mismatched),
                         "token agreement with bf16": f"{s['token_agreement']:.2f}" if fp8 else "—"})
    return md_table(pd.DataFrame(rows))


def bench(analyses: list[Analysis], link, **_) -> str:
    """The bulk send across the process boundary alone, beside a plain copy of the same bytes in the prefill
    process (the ceiling), per run, layout and context."""
    rows = []
    for a in analyses:
        for r in a.tables["bench_summary"].itertuples():
            rows.append({"run": link(a.where), "layout": r.layout, "context": ctx_label(r.context), "kernel": r.kernel,
                         "send ms": sig(r.send_ms), "send GB/s": sig(r.send_gbps, 4),
                         "ceiling GB/s": sig(r.ceiling_gbps, 4),
                         "% of ceiling [95 %]": f"{r.pct_of_ceiling:.1f} [{r.pct_lo:.1f}, {r.pct_hi:.1f}]",
                         "one layer ms": sig(r.layer_ms)})
    return md_table(pd.DataFrame(rows))


def _ucx(a: Analysis, s: dict):
    """The UCX transports of a committed nixl run's writes, read from its prefill log by today's parser: summary's
    field, written by the run, missed the GPU's cuda → cuda tables before 2026-12-01 (the H200 runs of 13a05c7 say
    tcp/lo, which was another memory pair). The run's own field where there is no log."""
    log = repo_root() / "data" / a.where / "worker-prefill.log"
    found = ucx_transports(log) if a.where and Path(log).is_file() else []
    return cache_transports(found, s.get("prefill_device", "cpu"), s.get("decode_device")) or s["nixl"]["ucx_transports"]


def nixl(analyses: list[Analysis], link, **_) -> str:
    """Two NIXL agents (kvlab disagg --backend nixl): per run, layout, mode and context — descriptors and transfers a
    request, the host time to build descriptor lists and post, the UCX transport that carried the writes."""
    rows = []
    for a in analyses:
        if "nixl" not in a.tables:
            raise ValueError(f"run {a.where}: not a nixl run (backend {a.record.get('summary', {}).get('backend')}); "
                             "the nixl table lists nixl runs only")
        s = a.record["summary"]
        ucx = _ucx(a, s)
        for r in a.tables["nixl"].itertuples():
            order = (a.record.get("disagg_config") or {}).get("block_order", "random") if r.layout == "paged" else "—"
            rows.append({"run": link(a.where), "descriptors": s["nixl"]["descs"], "block tables": order,
                         "layout": r.layout, "mode": r.mode,
                         "context": ctx_label(r.context), "KiB": f"{r.kv_bytes // 1024:,}",
                         "descriptors a request": ", ".join(f"{x:,}" for x in r.descriptors),
                         "transfers": ", ".join(str(x) for x in r.transfers),
                         "post ms median (min–max)": f"{sig(r.post_ms)} ({sig(r.post_ms_min)}–{sig(r.post_ms_max)})",
                         "n": r.n, "UCX transport": ", ".join(ucx) if isinstance(ucx, list) else ucx,
                         "decodes ≠ colocated": r.mismatched})
    return md_table(pd.DataFrame(rows))


def faults(analyses: list[Analysis], link, **_) -> str:
    """The fault campaigns (kvlab disagg --faults): per policy and fault kind, how faults were detected, what came
    of them, decodes that differed from colocated, and the time to each decision."""
    tables, backends, hosts = [], [], []
    for a in analyses:  # one run at a time: two runs may share a policy (another backend, another host)
        t = a.tables["fault_summary"].copy()
        t.insert(0, "run", link(a.where))
        s = a.record["summary"]
        backends.append(s["backend"] + (" (in order)" if s["backend"] == "gloo" and s.get("in_order") else ""))
        hosts.append(host_label(a.record))
        t.insert(1, "host", hosts[-1])
        t.insert(2, "backend", backends[-1])
        tables.append(t)
    t = pd.concat(tables, ignore_index=True)
    # a column that says the same on every row is said once, by the text around the table
    t = t.drop(columns=[c for c, v in (("backend", backends), ("host", hosts)) if len(set(v)) == 1])
    t["decision median ms"] = t["decision median ms"].map(lambda x: sig(x, 4))
    t["decision max ms"] = t["decision max ms"].map(lambda x: sig(x, 4))
    if t["new prefill process median ms"].notna().any():
        t["new prefill process median ms"] = t["new prefill process median ms"].map(lambda x: sig(x, 4) if x == x else "—")
    else:
        t = t.drop(columns="new prefill process median ms")
    return md_table(t)


def checksum_cost(analyses: list[Analysis], link, **_) -> str:
    """What the campaigns' per-layer checksums cost, per run (backend, layout, context) and side."""
    rows = []
    for a in analyses:
        s = a.record["summary"]
        cost = a.tables.get("checksum_cost", pd.DataFrame())
        for r in cost.to_dict("records"):
            rows.append({"run": link(a.where), "backend": _devices(s),
                         "layout": s["layouts"][0], "context": ctx_label(s["contexts"][0]), "side": r["side"],
                         "requests": r["requests"], "MiB a request": sig(r["MiB a request"]),
                         "median ms": sig(r["median ms"]), "max ms": sig(r["max ms"]), "GB/s (median)": sig(r["GB/s"])})
    return md_table(pd.DataFrame(rows))


def decode_memory(analyses: list[Analysis], link, **_) -> str:
    """Finished kvlab disagg runs' decode-side memory by phase (summary's decode_memory), in GiB."""
    rows = []
    for a in analyses:
        rows += [{"run": link(a.where), "layout": r["layout"], "context": ctx_label(r["context"]), "phase": r["phase"],
                  "allocated at its end (GiB)": f"{r['allocated_bytes'] / _GiB:.2f}",
                  "peak allocated (GiB)": f"{r['peak_allocated_bytes'] / _GiB:.2f}",
                  "peak reserved (GiB)": f"{r['peak_reserved_bytes'] / _GiB:.2f}"}
                 for r in a.record["summary"]["decode_memory"]]
    return md_table(pd.DataFrame(rows))


def _exit(code) -> str:
    """A worker's exit code as a reader reads it: "-9 (SIGKILL)", "0", "still running"."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"{code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return str(code)


def decode_oom(analyses: list[Analysis], link, **_) -> str:
    """kvlab disagg runs under --decode-memory-gib (and one without): the cap; how the run ended — finished, with
    its checks and the decode side's peak, or stopped by a real out-of-memory, with the step it hit, what it asked
    for and what was allocated then; and how each worker process ended."""
    rows = []
    for a in analyses:
        rec = a.record
        cap = rec["parameters"].get("decode_memory_gib") or 0
        row = {"run": link(a.where), "cap (GiB)": f"{cap:.2f}" if cap else "none"}
        if rec["status"] == "finished":
            s = rec["summary"]
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
    return md_table(pd.DataFrame(rows))


BLOCKS = {"ttft": ttft, "wire": wire, "bench": bench, "nixl": nixl, "faults": faults, "checksum_cost": checksum_cost,
          "decode_memory": decode_memory, "decode_oom": decode_oom}


def goal_table(a: Analysis, study: str) -> pd.DataFrame:
    """The goal rows the verdicts table shows for run `a`: study "disagg", its disagg goals (the identity goal said
    of every request, not of one config); study "faults", its campaign's goals."""
    if study == "faults":
        if "fault_goals" not in a.tables:
            raise ValueError(f"run {a.where}: no fault campaign (faults = 0), so no fault goals to show")
        return a.tables["fault_goals"]
    if study != "disagg":
        raise ValueError(f"study = {study!r}: the disagg runs' goals are those of 'disagg' and 'faults'")
    g = a.goals.copy()
    g.loc[g.id == "disagg.identical", ["layout", "mode", "context"]] = ["every request", "", float("nan")]
    return g
