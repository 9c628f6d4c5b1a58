"""The analysis of a `kvlab disagg` run, from the tables it wrote (requests.csv, bench.csv, faults.csv) and its
summary (run.json's `summary`, as summary.json holds it): what crossing a process boundary adds to the decode
side's time to first token, the bulk send beside its in-process ceiling, the fault campaign, and the inputs of the
goals (kvlab.goals, studies "disagg" and "faults"). Pure: nothing here measures or reads a file.

    ttft_extra(requests)                  → per (layout, mode, context): paired per-round TTFT − colocated TTFT,
                                            median, 95 % interval
    goal_rows(requests, bench, summary, peer) → one row per (layout, mode, context) with what the disagg goals
                                            read (`peer`: the host's best peer ceiling, kvlab.host_ceilings)
    fault_goal_rows(summary, faults)      → one row per campaign with what the fault goals read
    nixl_table(requests)                  → a nixl run: descriptors, transfers and posting time per config
    fault_table(faults), checksum_table(faults) → the campaign by policy and kind; what its checksums cost
    plot(requests, bench, summary)        → TTFT over colocated (left), the bulk send against its ceiling (right)
    plot_faults(faults)                   → time to refuse or recover, by fault kind and policy

bench_table (the send against its ceiling) is the library's (kvlab.disagg.summary): summary.json holds it too.
"""

from __future__ import annotations

import math
import statistics

import pandas as pd

from ... import plots
from ...disagg.summary import bench_table
from ...intervals import median_ci

__all__ = ["ttft_extra", "goal_rows", "best_peer_rows", "fault_goal_rows", "bench_table", "plot", "fault_table", "plot_faults",
           "nixl_table", "checksum_table"]


def ttft_extra(req: pd.DataFrame) -> pd.DataFrame:
    """Each mode's TTFT minus the colocated TTFT of the same round (the two ran back to back, in rotated order),
    per (layout, mode, context): median, 95 % interval of the median, n. Also the medians of exposed and
    prefill, with their intervals."""
    timed = req[~req["warmup"].astype(bool)]
    rows = []
    for (layout, context), g in timed.groupby(["layout", "context"]):
        co = g[g["mode"] == "colocated"].set_index("round")["ttft_ms"]
        for mode, m in g[g["mode"] != "colocated"].groupby("mode"):
            m = m.set_index("round")
            diff = (m["ttft_ms"] - co.reindex(m.index)).dropna().tolist()
            row = {"layout": layout, "mode": mode, "context": int(context), "n": len(diff),
                   "colocated_ttft_ms": float(co.median()), "ttft_ms": float(m["ttft_ms"].median())}
            for name, vals in (("ttft_extra_ms", diff), ("exposed_ms", m["exposed_ms"].dropna().tolist()),
                               ("prefill_ms", m["prefill_ms"].tolist())):
                row[name] = statistics.median(vals) if vals else float("nan")
                row[f"{name}_lo"], row[f"{name}_hi"] = median_ci(vals) if len(vals) else (float("nan"),) * 2
            ok = m[["tokens_match", "logits_equal", "bytes_equal"]].astype(bool).all(axis=1)
            row["mismatched"] = int((~ok).sum() + (m["poison_left"] > 0).sum())
            rows.append(row)
    return pd.DataFrame(rows)


def goal_rows(req: pd.DataFrame, bench: pd.DataFrame | None, summary: dict, peer: dict | None = None) -> pd.DataFrame:
    """What the disagg goals read, one row per (layout, mode, context): ttft_extra's columns, the run's backend
    and devices, and — where the run has a bench — the send's % of its ceiling and one layer's send time.
    `req`: requests.csv; `bench`: bench.csv or None; `summary`: the run's summary ({} when it has none); `peer`:
    the best peer ceiling the host's link_ceilings run measured ({"gbps", "path", "run"}, kvlab.host_ceilings) or
    None — with it and a bench, each bulk send's % of that ceiling (`pct_of_best_peer`, the interval from the
    send's median interval: the ceiling is the host's, held fixed) beside the % of its own run's copy."""
    t = ttft_extra(req)
    # every request the run decoded counts, warm-up rounds included
    moved = req[req["mode"] != "colocated"]
    ok = moved[["tokens_match", "logits_equal", "bytes_equal"]].astype(bool).all(axis=1) & (moved["poison_left"] == 0)
    t["mismatched_all"] = int((~ok).sum())
    t["first_row"] = [True] + [False] * (len(t) - 1)
    t["backend"] = summary.get("backend", req["backend"].iloc[0])
    t["same_gpu"] = summary.get("prefill_device") == summary.get("decode_device")
    if bench is not None:
        b = bench_table(bench)[["layout", "context", "pct_of_ceiling", "pct_lo", "pct_hi", "layer_ms",
                                "send_gbps", "ceiling_gbps"]]
        t = t.merge(b, on=["layout", "context"], how="left")
        t.loc[t["mode"] != "bulk", ["pct_of_ceiling", "pct_lo", "pct_hi"]] = float("nan")
        if peer is not None:
            t = t.merge(pd.DataFrame(best_peer_rows(bench, peer)), on=["layout", "context"], how="left")
            t.loc[t["mode"] != "bulk", ["pct_of_best_peer", "pct_best_lo", "pct_best_hi"]] = float("nan")
    return t


def best_peer_rows(bench: pd.DataFrame, peer: dict) -> list[dict]:
    """Per (layout, context) of a bench: the send's median GB/s as a % of the host's best peer ceiling `peer`, with
    the interval of the send's median (a two-host bench, whose times are NaN, gives NaN)."""
    rows = []
    for (layout, context), g in bench[bench["kind"] == "send"].groupby(["layout", "context"]):
        ms, nbytes = g["ms"].astype(float).tolist(), int(g["bytes"].iloc[0])
        pct = (lambda t: 100 * nbytes / t / 1e6 / peer["gbps"])  # noqa: E731
        if all(math.isfinite(x) for x in ms):
            lo_ms, hi_ms = median_ci(ms)
            vals = (pct(statistics.median(ms)), pct(hi_ms), pct(lo_ms))
        else:
            vals = (float("nan"),) * 3
        rows.append({"layout": layout, "context": int(context), "best_peer_gbps": peer["gbps"],
                     "best_peer_path": peer["path"], "best_peer_run": peer["run"], "pct_of_best_peer": vals[0],
                     "pct_best_lo": vals[1], "pct_best_hi": vals[2]})
    return rows


def fault_goal_rows(summary: dict, f: pd.DataFrame) -> pd.DataFrame:
    """What the fault goals read, one row per campaign run: faults injected, decodes from a partial cache, faults
    not handled under the run's policy, and the slowest decision's excess over one deadline per attempt (ms).
    `summary`: the run's summary; `f`: faults.csv."""
    handled = summary["refused"] if summary["policy"] == "fail" else summary["recovered"]
    over = (f["recover_ms"] - f["attempts"] * f["fault_timeout_s"] * 1e3).max()
    return pd.DataFrame([{"policy": summary["policy"], "faults_injected": summary["faults_injected"],
                          "decoded_from_partial": summary["decoded_from_partial"],
                          "unhandled": summary["faults_injected"] - handled, "over_deadline_ms": float(over)}])


def plot(req: pd.DataFrame, bench: pd.DataFrame | None, summary: dict, title: str = ""):
    """Left: what each mode adds to the decode side's TTFT over colocated, by context (paired rounds, median and
    95 % interval), per layout. Right (a run with a bench): the bulk send's GB/s beside its ceiling (a plain copy
    of the same bytes in the prefill process). Arguments as goal_rows'."""
    import matplotlib.pyplot as plt
    import numpy as np

    t = ttft_extra(req)
    layouts = list(dict.fromkeys(t["layout"]))
    contexts = sorted(t["context"].unique())
    x = np.arange(len(contexts))
    ncols = 2 if bench is not None else 1
    fig, axes = plt.subplots(1, ncols, figsize=(6.6 if ncols == 1 else 10.5, 5.0), squeeze=False)
    ax = axes[0][0]
    markers = {"contiguous": "o", "paged": "s"}
    offsets = {}
    k = 0
    for layout in layouts:
        for mode in ("bulk", "layerwise"):
            g = t[(t["layout"] == layout) & (t["mode"] == mode)].set_index("context")
            if g.empty:
                continue
            off = offsets.setdefault((layout, mode), -0.18 + 0.12 * k)
            k += 1
            v = np.array([g["ttft_extra_ms"].get(c, np.nan) for c in contexts], dtype=float)
            lo = np.array([g["ttft_extra_ms_lo"].get(c, np.nan) for c in contexts], dtype=float)
            hi = np.array([g["ttft_extra_ms_hi"].get(c, np.nan) for c in contexts], dtype=float)
            err = np.clip(np.vstack([np.nan_to_num(v - lo), np.nan_to_num(hi - v)]), 0, None)
            ax.errorbar(x + off, v, yerr=err, fmt=markers.get(layout, "o"), color=plots.color(mode), ms=5,
                        mfc=plots.color(mode) if layout == "contiguous" else "white", elinewidth=1.1, capsize=2.5,
                        ls="none", label=f"{mode}, {layout}")
    ax.axhline(0, color=plots.BLACK, lw=0.8)
    ax.set_xticks(x, [f"{c // 1024}k" if c >= 1024 else str(c) for c in contexts])
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT − colocated TTFT (ms)")
    ax.set_yscale("symlog", linthresh=1.0)
    ax.set_title("decode side's time to first token, over colocated")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=2, frameon=False)
    if bench is not None:
        b = bench_table(bench)
        ax2 = axes[0][1]
        for layout in layouts:
            g = b[b["layout"] == layout].set_index("context")
            if g.empty:
                continue
            ax2.plot(x, [g["send_gbps"].get(c, np.nan) for c in contexts], marker=markers.get(layout, "o"),
                     color=plots.BLUE, mfc=plots.BLUE if layout == "contiguous" else "white",
                     label=f"send, {layout} ({g['kernel'].iloc[0]})")
        ceil = b.groupby("context")["ceiling_gbps"].median()
        ax2.plot(x, [ceil.get(c, np.nan) for c in contexts], ls="--", color=plots.GREY,
                 label="ceiling: copy_ of the same bytes, in-process")
        ax2.set_xticks(x, [f"{c // 1024}k" if c >= 1024 else str(c) for c in contexts])
        ax2.set_xlabel("prompt tokens")
        ax2.set_ylabel("GB/s (decimal)")
        ax2.set_ylim(0, None)
        ax2.set_title("bulk send across the process boundary")
        ax2.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=1, frameon=False)
    pre, dec = summary.get("prefill_device", "?"), summary.get("decode_device", "?")
    fig.suptitle(title or f"{summary.get('backend', '?')}: prefill on {pre}, decode on {dec}, two processes, "
                 f"{summary.get('model', '')}", fontsize=10)
    fig.tight_layout()
    return fig


def nixl_table(req: pd.DataFrame) -> pd.DataFrame:
    """A nixl run's requests per (layout, mode, context): descriptors and transfers a request (each the same in
    every request), the host time spent building descriptor lists and posting — median, min, max, n — the
    median exposed time and the decodes that differed from colocated."""
    timed = req[(req["mode"] != "colocated") & ~req["warmup"].astype(bool)]
    rows = []
    for (layout, mode, context), g in timed.groupby(["layout", "mode", "context"], sort=False):
        ok = g[["tokens_match", "logits_equal", "bytes_equal"]].astype(bool).all(axis=1) & (g["poison_left"] == 0)
        rows.append({"layout": layout, "mode": mode, "context": int(context), "n": len(g),
                     "descriptors": sorted(set(g["descriptors"].astype(int))),
                     "transfers": sorted(set(g["transfers"].astype(int))), "kv_bytes": int(g["kv_bytes"].iloc[0]),
                     "post_ms": float(g["post_ms"].median()), "post_ms_min": float(g["post_ms"].min()),
                     "post_ms_max": float(g["post_ms"].max()), "exposed_ms": float(g["exposed_ms"].median()),
                     "mismatched": int((~ok).sum())})
    return pd.DataFrame(rows)


def checksum_table(faults: pd.DataFrame) -> pd.DataFrame:
    """What the per-layer checksums cost in a campaign: on the prefill side (every layer of the source) and on the
    decode side (the layers that landed), per request — median and max ms, and the median rate in GB/s."""
    rows = []
    for side in ("send", "recv"):
        ms, nbytes = f"checksum_{side}_ms", f"checksum_{side}_bytes"
        if ms not in faults:
            continue
        g = faults[faults[ms].notna() & (faults[nbytes] > 0)]
        if g.empty:
            continue
        rows.append({"side": "prefill (source, every layer)" if side == "send" else "decode (the layers that landed)",
                     "requests": len(g), "MiB a request": float(g[nbytes].median()) / 2**20,
                     "median ms": float(g[ms].median()), "max ms": float(g[ms].max()),
                     "GB/s": float((g[nbytes] / g[ms] / 1e6).median())})
    return pd.DataFrame(rows)


def fault_table(faults: pd.DataFrame) -> pd.DataFrame:
    """Per (policy, kind): faults, how they were detected, outcomes, decodes that differed from colocated, and the
    time from the request to its decision (refused) or its recovered cache: median and max, ms."""
    rows = []
    for (policy, kind), g in faults.groupby(["policy", "kind"], sort=False):
        dec = g[g["decoded"].astype(bool)]
        rows.append({"policy": policy, "kind": kind, "faults": len(g),
                     "detected by": ", ".join(f"{k} {v}" for k, v in g["detected_by"].value_counts().items()),
                     "outcome": ", ".join(f"{k} {v}" for k, v in g["outcome"].value_counts().items()),
                     "decodes ≠ colocated": int((~(dec["tokens_match"].astype(bool) & dec["logits_equal"].astype(bool)
                                                   & dec["bytes_equal"].astype(bool))).sum()),
                     "decision median ms": float(g["recover_ms"].median()), "decision max ms": float(g["recover_ms"].max()),
                     # kill: the successor's start and join, after a fail or recompute decision (inside a retry's)
                     "new prefill process median ms": float(g["takeover_ms"].median()) if "takeover_ms" in g
                     else float("nan")})
    return pd.DataFrame(rows)


def plot_faults(faults: pd.DataFrame, title: str = ""):
    """Time from each faulty request to its outcome (refused, or a cache decoded exactly like colocated), by fault
    kind (x) and policy (colour); the deadline drawn for reference."""
    import matplotlib.pyplot as plt
    import numpy as np

    kinds = list(dict.fromkeys(faults["kind"]))
    policies = list(dict.fromkeys(faults["policy"]))
    fig, ax = plt.subplots(figsize=(6.6, 3.8))
    colors = dict(zip(policies, [plots.BLUE, plots.VERMILLION, plots.GREEN, plots.ORANGE]))
    width = 0.8 / max(1, len(policies))
    rng = np.random.default_rng(0)
    for j, pol in enumerate(policies):
        for k, kind in enumerate(kinds):
            v = faults[(faults["policy"] == pol) & (faults["kind"] == kind)]["recover_ms"].to_numpy()
            if not len(v):
                continue
            x = k - 0.4 + width * (j + 0.5) + rng.uniform(-width * 0.3, width * 0.3, len(v))
            ax.plot(x, v, "o", ms=3, alpha=0.6, color=colors[pol], label=pol if k == 0 else None)
    if "fault_timeout_s" in faults.columns:
        ax.axhline(float(faults["fault_timeout_s"].iloc[0]) * 1e3, color=plots.GREY, ls="--", lw=1,
                   label="deadline")
    ax.set_xticks(range(len(kinds)), kinds)
    ax.set_xlim(-0.5, len(kinds) - 0.5)
    ax.set_yscale("log")
    ax.set_ylabel("request → outcome (ms)")
    ax.set_xlabel("fault injected")
    ax.set_title(title or "faults: time to refuse or recover, by kind and policy")
    ax.legend(fontsize=8, frameon=False, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig
