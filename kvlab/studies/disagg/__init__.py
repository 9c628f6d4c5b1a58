"""Two processes: prefill and decode apart, the cache across the boundary, and faults on the way (notebook 05,
`kvlab disagg`).

A prefill process and a decode process each build the same model (same config, same seed: the same weights). The
decode process allocates its cache — one buffer or a pool of blocks — and poisons it; the prefill process prefills
and sends the cache in bulk or layer by layer over a backend (gloo, ipc, nccl, nixl); the decode process decodes
once every layer has landed and compares tokens, logits and bytes with its own colocated run. A fault campaign can
follow: requests with one layer dropped, late, corrupt, a killed sender, an out-of-memory (kvlab.disagg.faults).

The two processes are the library's (kvlab.disagg); this face checks the notebook's parameters (`check`), runs it
(`measure`), and reads the run back (`analyse`, `figures`, `BLOCKS`, `goal_table`; kvlab.studies.disagg.analysis).
"""

from __future__ import annotations

import pandas as pd

from ... import disagg, goals, host_ceilings, models, nbtools
from ...disagg import DisaggConfig, from_params
from ...parse import suggest, token_list
from ...results import Run
from ...study import Analysis, Param, at_least, check_params, ctx_label
from .analysis import (bench_table, checksum_table, fault_goal_rows, fault_table, goal_rows, nixl_table, plot,
                       plot_faults)
from .blocks import BLOCKS, goal_table
from .page import PAGES

__all__ = ["NAME", "NOTEBOOK", "TITLE", "QUESTION", "FIGURES", "PARAMS", "Config", "check", "measure", "analyse",
           "figures", "BLOCKS", "PAGES", "goal_table"]

NAME = "disagg"
NOTEBOOK = "05_disagg"
TITLE = "Two processes"
QUESTION = ("What does crossing a process boundary add to the decode side's time to first token, and does nothing "
            "decode from a partial cache when a layer is lost, late or corrupt?")
FIGURES = ("disagg_ttft", "faults")


def _one_of(*valid: str):
    def check(value, name):
        if str(value) not in valid:
            raise ValueError(f"{name} = {value!r} is not valid; valid: {', '.join(valid)}{suggest(value, valid)}")
    return check


PARAMS = (
    Param("backend", "str", "auto", 'gloo, ipc (CUDA IPC, 1-2 GPUs), nccl (two GPUs), nixl (two NIXL agents); "auto": '
          "ipc on a GPU, gloo on a CPU", lambda v, n: disagg.backend(v)),
    Param("model", "str", "auto", 'registry name or config path; "auto": qwen2.5-7b on a GPU, kvlab-tiny on a CPU',
          models.kv_model_ref),
    Param("weights", "str", "random", '"random" (seeded: the same weights in both processes) or a local checkpoint',
          models.check_weights),
    Param("contexts", "str", "auto", 'prompt tokens, comma-separated; "auto": 1k,4k,16k,32k (GPU) or 128 (CPU)',
          lambda v, n: token_list(v, n, 1)),
    Param("modes", "str", "bulk,layerwise", "bulk (one send after prefill) and/or layerwise (each layer as it is "
          "final)"),
    Param("layouts", "str", "contiguous,paged", "the decode side's cache: one buffer, or a pool of blocks"),
    Param("block_size", "int", 16, "tokens per block of a paged cache", at_least(1)),
    Param("block_order", "str", "random", 'paged: both sides\' blocks drawn at random (a busy server) or "packed" '
          "(lowest ids first)"),
    Param("repeats", "int", 9, "timed rounds; a round is a colocated prefill and every mode, in rotated order",
          at_least(1)),
    Param("warmup", "int", 2, "untimed rounds first", at_least(0)),
    Param("decode_tokens", "int", 20, "greedy tokens compared with the colocated decode", at_least(1)),
    Param("bench", "str", "auto", 'time the bulk send alone beside a copy of the same bytes: "auto" (on for ipc and '
          'nccl), "on", "off"', _one_of("auto", "on", "off")),
    Param("faults", "int", 3, "a fault-injection campaign after the measurement: requests with one dropped, late or "
          "corrupt layer", at_least(0)),
    Param("policy", "str", "fail", "what the decode side does about a fault: fail (refuse), retry (the bad layers "
          "only), recompute", _one_of("fail", "retry", "recompute")),
)

Config = DisaggConfig  # what one run does: kvlab.disagg.config checks every field of it


def check(params) -> Config:
    """The run's DisaggConfig from notebook or `kvlab run -p` values: each value checked alone (PARAMS), then "auto"
    resolved by hardware and the whole configuration checked (kvlab.disagg.from_params: the backend on this machine,
    devices, lists, combinations). ValueError, one line; nothing is started or written."""
    return from_params(check_params(PARAMS, params, NAME))


def measure(cfg: Config, run: Run) -> None:
    """Both processes, every (layout, context) × mode, then the campaign: requests.csv, bench.csv (a bench),
    faults.csv (a campaign), summary.json and run.json's `summary` (kvlab.disagg.run); `resolved` says what "auto"
    became. Progress bar in a live notebook."""
    pre, dec = cfg.devices()
    run.update(resolved={"backend": cfg.backend, "model": cfg.model, "contexts": list(cfg.contexts),
                         "modes": list(cfg.modes), "layouts": list(cfg.layouts), "prefill_device": pre,
                         "decode_device": dec, "bench": cfg.bench})
    disagg.run(cfg, run=run, progress=nbtools.is_interactive())


def analyse(record: dict, tables: dict) -> Analysis:
    """From requests.csv (and bench.csv, faults.csv where the run has them) and run.json's `summary`:
    `summary` (per layout, mode and context: TTFT over colocated, exposed, checks — what the disagg goals read),
    `bench_summary` (the send against its ceiling), `nixl` (descriptors and posting), `fault_summary`,
    `checksum_cost` and `fault_goals` (a campaign's); the disagg goals; findings. A run that stopped before its
    requests were written has none of them. A two-GPU bench is also held against the best peer ceiling of its host,
    read from the committed link_ceilings run of the same machine (kvlab.host_ceilings), where there is one."""
    summary = record.get("summary") or {}
    req, bench, faults = tables.get("requests"), tables.get("bench"), tables.get("faults")
    out: dict[str, pd.DataFrame] = {}
    g = pd.DataFrame()
    findings: list[str] = []
    values: dict[str, str] = {}
    if req is not None and len(req):
        peer = (host_ceilings.peer_ceiling(record, summary.get("prefill_device"), summary.get("decode_device"))
                if bench is not None and len(bench) else None)
        t = goal_rows(req, bench, summary, peer)
        out["summary"] = t
        g = goals.evaluate_run("disagg", record, t, keys=("layout", "mode", "context"))
        findings += [f"{r.goal} ({r.layout} {r.mode} {r.context}): {r.value} — {r.verdict}"
                     for r in g.itertuples() if r.id != "disagg.identical"]
        for r in t.itertuples():
            key = f"{r.layout}.{r.mode}.{ctx_label(r.context)}"
            values[f"{key}.ttft_extra_ms"] = (f"{r.ttft_extra_ms:+.2f} [{r.ttft_extra_ms_lo:+.2f}, "
                                              f"{r.ttft_extra_ms_hi:+.2f}]")
            values[f"{key}.exposed_ms"] = f"{r.exposed_ms:+.3f} [{r.exposed_ms_lo:+.3f}, {r.exposed_ms_hi:+.3f}]"
        if bench is not None and len(bench):
            b = bench_table(bench)
            out["bench_summary"] = b
            for r in b.itertuples():
                values[f"{r.layout}.{ctx_label(r.context)}.send_pct_of_ceiling"] = (f"{r.pct_of_ceiling:.1f} "
                                                                                   f"[{r.pct_lo:.1f}, {r.pct_hi:.1f}]")
        if summary.get("backend") == "nixl":
            out["nixl"] = nixl_table(req)
    ranks = tables.get("ranks")
    if ranks is not None and len(ranks) and "decode_tp" in summary:  # P + D processes (kvlab.disagg.tp_handoff)
        out["ranks"] = ranks
        findings.append(f"TP {summary['prefill_tp']} → {summary['decode_tp']} over gloo ({summary['impl']} split): "
                        f"tokens {'equal' if summary['tokens_match'] else 'DIFFERENT'} at every step, logits within "
                        f"{summary['logits_max_abs_diff']:.2e} of a {summary['logits_tolerance']:.2e} tolerance, shards "
                        f"{'exact' if summary['shards_exact'] else 'NOT exact'}, {summary['poison_left']} poison left; "
                        f"{sum(summary['replica_bytes']):,} bytes of replicas — {summary['rule']}")
    if faults is not None and len(faults):
        out["fault_summary"] = fault_table(faults)
        cost = checksum_table(faults)
        if len(cost):
            out["checksum_cost"] = cost
        if "policy" in summary:
            fg = goals.evaluate_run("faults", record, fault_goal_rows(summary, faults), keys=("policy",))
            out["fault_goals"] = fg
            findings += [f"{r.goal} (policy {r.policy}): {r.value} — {r.verdict}" for r in fg.itertuples()]
            values["faults.injected"] = f"{summary['faults_injected']:,}"
            values["faults.decoded_from_partial"] = f"{summary['decoded_from_partial']:,}"
    return Analysis(NAME, record, raw=dict(tables), tables=out, goals=g, findings=findings, values=values)


def figures(a: Analysis) -> dict:
    """disagg_ttft (TTFT over colocated; the bulk send against its ceiling where the run has a bench) and, after a
    fault campaign, faults (time to refuse or recover, by kind and policy)."""
    out = {}
    req = a.raw.get("requests")
    if req is not None and len(req):
        out["disagg_ttft"] = plot(req, a.raw.get("bench"), a.record.get("summary") or {})
    f = a.raw.get("faults")
    if f is not None and len(f):
        out["faults"] = plot_faults(f)
    return out
