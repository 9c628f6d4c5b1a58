"""What a `kvlab disagg` run writes as its summary (summary.json, and run.json's `summary`), from what the decode
worker handed over: the checks of every request, medians per (layout, mode, context), the bench's send against its
ceiling, NIXL's transports, and the fault campaign in numbers. Nothing here measures; the study's analysis
(kvlab.studies.disagg) reads these tables again from the run.

    build(got, cfg, seconds, run_dir, launcher, deaths) → the summary dict (JSON-ready: no NaN or infinity)
    summarise(rows, cfg)                                → per (layout, mode, context): medians and checks
    bench_table(bench)                                  → per (layout, context): the send against its ceiling
    fault_summary(rows, cfg)                            → the campaign: faults, detections, outcomes
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import pandas as pd

from .. import calculator
from ..paged.nixl import nixl_version
from ..intervals import median_ci, ratio_ci
from .config import DisaggConfig
from .nixl_link import cache_transports, ucx_transports

__all__ = ["build", "summarise", "bench_table", "fault_summary", "nixl_summary", "clean"]


def summarise(rows: list[dict], cfg: DisaggConfig) -> list[dict]:
    """Per (layout, mode, context): medians of the timed rounds and whether every check held."""
    groups: dict = {}
    for r in rows:
        if not r.get("warmup"):
            groups.setdefault((r["layout"], r["mode"], r["context"]), []).append(r)
    out = []
    for (layout, mode, context), rs in sorted(groups.items()):
        g = {"layout": layout, "mode": mode, "context": context, "n": len(rs)}
        for col in ("prefill_ms", "ttft_ms", "exposed_ms", "step_ms", "send_host_ms", "read_ms"):
            vals = [r[col] for r in rs if col in r and r[col] == r[col]]
            if vals:
                g[col] = statistics.median(vals)
                lo, hi = median_ci(vals)
                g[f"{col}_lo"], g[f"{col}_hi"] = lo, hi
        if mode != "colocated":
            for col in ("tokens_match", "logits_equal", "bytes_equal", "first_token_match"):
                g[col] = all(r[col] for r in rs)
            g["poison_left"] = sum(r["poison_left"] for r in rs)
            g["bytes_moved"] = rs[0]["bytes_moved"]
            g["kv_bytes"] = rs[0]["kv_bytes"]
        out.append(g)
    return out


def bench_table(bench: pd.DataFrame) -> pd.DataFrame:
    """Per (layout, context): the send alone (tuned kernel for a paged cache) against a plain copy of the same
    bytes in the prefill process, with the ratio's 95 % interval (intervals.ratio_ci resamples both), and one layer's
    send time. Times in ms, rates in GB/s (decimal), shares in %."""
    rows = []
    for (layout, context), g in bench.groupby(["layout", "context"]):
        send = g[g["kind"] == "send"]["ms"].tolist()
        ceil = g[g["kind"] == "ceiling"]["ms"].tolist()
        nbytes = int(g[g["kind"] == "send"]["bytes"].iloc[0])
        finite = all(math.isfinite(x) for x in send + ceil)
        # two hosts have no clock in common: their bench's times are NaN, and so is every ratio of them
        lo, hi = ratio_ci(ceil, send) if finite else (float("nan"), float("nan"))
        row = {"layout": layout, "context": int(context), "n": len(send), "bytes": nbytes,
               "send_ms": statistics.median(send), "ceiling_ms": statistics.median(ceil),
               "send_gbps": nbytes / statistics.median(send) / 1e6,
               "ceiling_gbps": nbytes / statistics.median(ceil) / 1e6,
               "pct_of_ceiling": 100 * statistics.median(ceil) / statistics.median(send),
               "pct_lo": 100 * lo, "pct_hi": 100 * hi,
               "layer_ms": statistics.median(g[g["kind"] == "layer"]["ms"].tolist()),
               "kernel": g[g["kind"] == "send"]["kernel"].iloc[0]}
        d = g[g["kind"] == "send_default"]["ms"].tolist()
        if d:
            row["send_default_ms"] = statistics.median(d)
            row["pct_default_of_ceiling"] = 100 * statistics.median(ceil) / statistics.median(d)
        rows.append(row)
    return pd.DataFrame(rows)


def clean(x):
    """`x` with every non-finite float (NaN, ±inf) as None, through dicts and lists: JSON has no NaN."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: clean(v) for k, v in x.items()}
    if isinstance(x, list):
        return [clean(v) for v in x]
    return x


def build(got: dict, cfg: DisaggConfig, seconds: float, run_dir, launcher: dict | None = None,
          deaths: list | None = None) -> dict:
    """The run's summary from what the decode worker handed over (`got`: its rows, bench rows, tuned kernels,
    fault rows, memory phases, pids and host), `seconds` the run took; `run_dir` holds the workers' logs (NIXL's
    transports are read from the prefill log). Cleaned (`clean`): what summary.json holds."""
    rows = got["rows"]
    moved = [r for r in rows if r["mode"] != "colocated"]
    spec = cfg.spec()
    pre, dec = cfg.devices()
    summary = {
        "backend": cfg.backend,
        "in_order": bool(got.get("in_order")),  # the decode side's link matched receives in posting order
        "processes": 2,
        "launcher": launcher or {"kind": "subprocess"},
        "prefill_kills": deaths or [],  # kill faults: each dead prefill process (generation, pid, request, layer)
        "pids": {"decode": got["pid"], "prefill": got["peer_pid"]},
        "host": got["host"],
        "model": cfg.model,
        "context": cfg.contexts[0],
        "contexts": list(cfg.contexts),
        "kv_dtype": cfg.kv_dtype,
        "modes": list(cfg.modes),
        "layouts": list(cfg.layouts),
        "prefill_device": pre,
        "decode_device": dec,
        "bytes_moved": next((r["bytes_moved"] for r in moved if r["layout"] == "contiguous"
                             and r["context"] == cfg.contexts[0]), moved[0]["bytes_moved"] if moved else 0),
        "kv_cache_bytes": calculator.kv_cache_bytes(spec, cfg.contexts[0], cfg.kv_dtype),
        "requests": len(moved),
        "tokens_match": all(r["tokens_match"] for r in moved),
        "logits_equal": all(r["logits_equal"] for r in moved),
        "bytes_equal": all(r["bytes_equal"] for r in moved),
        "poison_left": sum(r["poison_left"] for r in moved),
        "seconds": round(seconds, 3),
        "configs": summarise(rows, cfg),
    }
    if cfg.wire_dtype == "fp8":  # what the lossy wire saved and what it did to the decode (measured, not required);
        agree = [r["token_agreement"] for r in moved if "token_agreement" in r]  # a bf16 run writes none of these
        summary.update(
            wire_dtype=cfg.wire_dtype, wire_scales=cfg.wire_scales, bf16_bytes=moved[0]["kv_bytes"] if moved else 0,
            wire_bytes_ratio=summary["bytes_moved"] / moved[0]["kv_bytes"] if moved else None,
            token_agreement=min(agree) if agree else None,
            kv_max_rel_err=max((r["kv_max_rel_err"] for r in moved if "kv_max_rel_err" in r), default=None),
            rule=("FP8 wire: bytes, tokens and logits equal the colocated decode from the same cache passed through "
                  "quantize → dequantize; token_agreement (the lowest of any request) is against the bf16 decode"))
    if got.get("memory"):  # GPU: the decode process's memory by phase (kvlab.disagg.memory)
        summary["decode_memory"] = got["memory"]
    if got["bench"]:
        summary["bench"] = bench_table(pd.DataFrame(got["bench"])).to_dict("records")
    if got.get("tuned"):
        summary["tuned_kernels"] = got["tuned"]
    if cfg.backend == "nixl":
        summary["nixl"] = nixl_summary(run_dir, cfg, launcher)
    if got.get("faults"):
        summary.update(fault_summary(got["faults"], cfg))
    return clean(summary)


def nixl_summary(run_dir, cfg: DisaggConfig, launcher: dict | None) -> dict:
    """NIXL's version, the descriptor option and the transports UCX chose for the prefill agent's writes (from
    UCX_PROTO_INFO in the prefill worker's log; under torchrun the logs are torchrun's: not read)."""
    found = ucx_transports(Path(run_dir, "worker-prefill.log")) if not launcher else []
    used = cache_transports(found, *cfg.devices())  # the cache's memory pair only (ucx_writes keeps every table)
    return {"version": nixl_version(), "descs": cfg.nixl_descs, "operation": "WRITE", "agents": 2,
            "ucx_writes": found, "ucx_transports": used or "unknown (no UCX_PROTO_INFO report in the prefill log)",
            "tcp_fallback": any(t.startswith("tcp/") for t in used) if used else None}


def fault_summary(rows: list[dict], cfg: DisaggConfig) -> dict:
    """The campaign in numbers: faults injected, how each was detected and what came of it. decoded_from_partial
    counts decodes whose cache was not the reference's bytes (the number that must be 0); recovered counts
    decodes after a fault that matched the colocated decode exactly; refused, requests not decoded."""
    decoded = [r for r in rows if r["decoded"]]
    by = {}
    for r in rows:
        by.setdefault(r["kind"], {}).setdefault(r["outcome"], 0)
        by[r["kind"]][r["outcome"]] += 1
    return {"faults_injected": len(rows), "policy": cfg.policy, "fault_timeout_s": cfg.fault_timeout_s,
            "decoded_from_partial": sum(1 for r in decoded if not r["bytes_equal"]),
            "recovered": sum(1 for r in decoded if r["outcome"] != "delivered" and r["tokens_match"]
                             and r["logits_equal"]),
            "refused": sum(1 for r in rows if r["outcome"] == "refused"),
            "undetected": sum(1 for r in rows if r["detected_by"] == "not detected"),
            "slowest_decision_ms": max(r["recover_ms"] for r in rows),
            "outcomes_by_kind": by}
