"""Different TP on each side: a paged cache re-sharded from P prefill ranks to D decode ranks (`kvlab reshard`).

Seed 000 names it among what the calculator leaves out: "Prefill at TP=8 handing off to decode at TP=2 means
re-sharding in flight." Each decode rank needs the KV heads its attention computes, held by one or more prefill
ranks (P > D gathers from P/D ranks, P < D feeds D/P ranks from one, fewer KV heads than D replicates). The movers
(kvlab.paged.reshard): kvlab's fused Triton kernel (gather the pages and split the heads in one pass), torch
indexing, and staging (head slices gathered into one buffer per destination rank and layer, one copy, a scatter).
Each is checked once, bit for bit against the source's head slices, the destination poisoned beforehand and
nothing written outside its blocks, then timed beside the yardstick: the same cache moved between P and P ranks on
the same path and layout (one whole-row copy per rank, what kvlab disagg's ipc path makes for a paged cache). All
ranks' pools sit on one device in one process (kvlab.paged.reshard_bench), so the times are the kernels' and copies'
own, with no link and no process between ranks. The calculator's prediction (reshard.predict over the d2d_same
ceiling this run measured) stands beside each.

Then decode with TP on the decode side (`decode_check`, kvlab.tp_decode): per (pair, layout) a small model's cache is
re-sharded by the fused mover into D pools and D processes decode from them together over gloo on the CPU, compared
with the colocated decode (tokens equal at every step, logits within the reduction-order tolerance, shards exact).
"""

from __future__ import annotations

import os
import re
import statistics
from dataclasses import dataclass

import pandas as pd
import torch
from tqdm.auto import tqdm

from ... import calculator, ceilings, ceilings_fit, devices, goals, models, plots, tp_decode
from ...disagg.config import kv_dtype_name
from ...intervals import ratio_ci
from ...paged import reshard, reshard_bench
from ...paged.nixl import nixl_missing
from ...paged.pools import LAYOUTS
from ...parse import token_list
from ...results import Run
from ...study import Analysis, Param, at_least, check_params, ctx_label, md_table, sig

__all__ = ["NAME", "NOTEBOOK", "TITLE", "QUESTION", "FIGURES", "PARAMS", "Config", "check", "measure", "analyse",
           "figures", "BLOCKS", "goal_table", "parse_pairs", "summarise", "nixl_findings"]

NAME = "tp_reshard"
NOTEBOOK = "06_tp_reshard"
TITLE = "Re-sharding between different TP"
QUESTION = ("What does handing a paged cache from P prefill ranks to D decode ranks cost beside moving it between "
            "equal TP on the same path, and does the calculator predict it?")
FIGURES = ("reshard_pct",)

# "auto" by hardware: issue 28's case on a GPU (Qwen2.5-7B's shape: 28 query heads, 4 KV heads; TP 8 does not
# divide its query heads); on a CPU kvlab-tiny (4 query, 2 KV heads: TP 4 replicates) at a size that checks the logic
GPU_MODEL, GPU_CONTEXT, GPU_PAIRS, GPU_REPEATS = "qwen2.5-7b", "32k", "1-2,2-1,1-4,4-1,2-4", 10
CPU_MODEL, CPU_CONTEXT, CPU_PAIRS, CPU_REPEATS = "kvlab-tiny", "256", "2-1,1-2,1-4", 3
METHODS = ("fused", "torch-index", "staging")  # block-slices is a host loop: predicted, not timed, at 32k
# NIXL's forms of staging and block-slices (two agents in this process, UCX): given by name, where NIXL loads
NIXL_METHODS = ("nixl-staging", "nixl-staging-bulk", "nixl-slices")
CEILING_SIZES = {"gpu": "64K,1M,16M,256M,1G", "cpu": "64K,1M"}
CEILING_PATH = {"gpu": "d2d_same", "cpu": "h2h"}  # a copy within the device every rank's pool is on
# the decode check: D processes decode together on the CPU (gloo) from the re-sharded pools of a prompt this long
DECODE_CONTEXT, DECODE_STEPS = 128, 20
_PAIR = re.compile(r"^\s*(\d+)\s*[-:>x→]+\s*(\d+)\s*$")


def parse_pairs(value, name: str = "pairs") -> list[tuple[int, int]]:
    """ "1-2,2-1" (or "1->2", "1:2") → [(1, 2), (2, 1)]: prefill TP and decode TP, each ≥ 1, no pair twice."""
    parts = [p for p in str(value).split(",") if p.strip()]
    if not parts:
        raise ValueError(f"{name} = {value!r}: give P-D pairs such as '1-2,2-1' (prefill TP - decode TP)")
    out = []
    for part in parts:
        m = _PAIR.match(part)
        if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
            raise ValueError(f"{name} = {value!r}: {part.strip()!r} is not a pair of TP degrees ≥ 1 such as '1-2'")
        pair = (int(m.group(1)), int(m.group(2)))
        if pair in out:
            raise ValueError(f"{name} = {value!r}: {pair[0]}-{pair[1]} is given twice")
        out.append(pair)
    return out


def _names(valid, what: str):
    def check(value, name):
        got = [v.strip() for v in str(value).split(",") if v.strip()]
        bad = [v for v in got if v not in valid]
        if not got or bad:
            raise ValueError(f"{name} = {value!r}: {', '.join(bad) or 'nothing'} is not {what}; give some of "
                             f"{', '.join(valid)}, comma-separated")
    return check


PARAMS = (
    Param("model", "str", "auto", "registry name or a config.json / model folder: the cache's shape and heads; "
          f"\"auto\": {GPU_MODEL} on a GPU, {CPU_MODEL} on a CPU", lambda v, n: models.kv_model_ref(v, n)),
    Param("context", "str", "auto", f"tokens in the cache (\"32k\"); \"auto\": {GPU_CONTEXT} on a GPU, {CPU_CONTEXT} "
          "on a CPU", lambda v, n: token_list(v, n, 1)),
    Param("pairs", "str", "auto", "prefill TP - decode TP pairs, comma-separated (\"1-2,2-1\"); \"auto\": "
          f"{GPU_PAIRS} on a GPU, {CPU_PAIRS} on a CPU", parse_pairs),
    Param("layouts", "str", "hnd,nhd", "pool layouts, each run on both sides: hnd (heads before tokens in a block) "
          "and/or nhd", _names(LAYOUTS, "a pool layout")),
    Param("methods", "str", ",".join(METHODS), "movers timed beside the same-TP copy: fused, torch-index, staging, "
          "and where NIXL loads nixl-staging (staging's sends as NIXL WRITEs, one descriptor per layer side; timed "
          "beside staging, which it needs), nixl-staging-bulk (one descriptor per staging buffer) and nixl-slices (one descriptor per block slice, vLLM's way; where a "
          "layout would post over 500,000 a repeat it is counted, not timed)", _names(METHODS + NIXL_METHODS,
                                                                                      "a timed mover")),
    Param("block_size", "int", 16, "tokens per block", at_least(1)),
    Param("kv_dtype", "str", "bf16", "bf16, fp16 or fp32", lambda v, n: kv_dtype_name(v, n)),
    Param("device", "str", "auto", "the device every rank's pool is on: cuda:N, or cpu (checks the logic); "
          "\"auto\": cuda:0, cpu where there is no GPU (or KVLAB_PRESET set to cpu)", devices.check_device_name),
    Param("repeats", "int", 0, f"timed rounds per (pair, layout), every mover once a round in rotated order; 0: "
          f"{GPU_REPEATS} on a GPU, {CPU_REPEATS} on a CPU", at_least(0)),
    Param("seed", "int", 0, "seed of the block tables and the data", at_least(0)),
    Param("decode_check", "str", "kvlab-tiny", f"model (random weights) whose {DECODE_CONTEXT}-token cache each pair "
          f"re-shards, then decodes {DECODE_STEPS} tokens with D ranks together (CPU, gloo) against the colocated "
          "decode; \"\" skips it", lambda v, n: None if v == "" else models.kv_model_ref(v, n)),
)


@dataclass(frozen=True)
class Config:
    """One run: the model (its name), the context in tokens, the (P, D) pairs, layouts and movers, the pools' block
    size and dtype, the device every rank's pool is on, timed rounds, the seed."""

    model: str
    context: int
    pairs: list
    layouts: list
    methods: list
    block_size: int
    kv_dtype: str
    device: torch.device
    repeats: int
    seed: int
    decode_check: str = ""

    def resolved(self) -> dict:
        return {"model": self.model, "context": self.context, "pairs": [list(p) for p in self.pairs],
                "layouts": self.layouts, "methods": self.methods, "block_size": self.block_size,
                "kv_dtype": self.kv_dtype, "device": str(self.device), "repeats": self.repeats, "seed": self.seed,
                "decode_check": self.decode_check, "decode_context": DECODE_CONTEXT, "decode_steps": DECODE_STEPS,
                "ceiling_sizes": CEILING_SIZES["gpu" if self.device.type == "cuda" else "cpu"],
                "ceiling_path": CEILING_PATH["gpu" if self.device.type == "cuda" else "cpu"]}


def check(params) -> Config:
    """The run's Config: each value checked, "auto" resolved by hardware, every pair planned (reshard.plan refuses TP
    degrees that neither divide nor multiply, query heads TP does not divide, MLA's latent) and, on a CPU, the pools'
    size held against free memory — all before anything is allocated or written."""
    p = check_params(PARAMS, params, NAME)
    dev = devices.run_device(p["device"])
    gpu = dev.type == "cuda"
    model = (GPU_MODEL if gpu else CPU_MODEL) if p["model"] == "auto" else p["model"]
    spec = models.from_hf_config(model) if os.path.exists(model) else models.get(model)
    ctx = token_list((GPU_CONTEXT if gpu else CPU_CONTEXT) if p["context"] == "auto" else p["context"], "context", 1)
    if len(ctx) != 1:
        raise ValueError(f"context = {p['context']!r}: give one context per run (a run times every pair at it)")
    pairs = parse_pairs((GPU_PAIRS if gpu else CPU_PAIRS) if p["pairs"] == "auto" else p["pairs"])
    for a, b in pairs:
        try:
            reshard.plan(spec, a, b)
        except ValueError as err:
            raise ValueError(f"pairs: {a}-{b} for {spec.name}: {err}") from None
    for a, b in pairs if p["decode_check"] else ():
        try:
            tp_decode.check_pair(p["decode_check"], a, b, DECODE_CONTEXT, DECODE_STEPS)
        except ValueError as err:
            raise ValueError(f"decode_check = {p['decode_check']!r}: TP {a}-{b}: {err}; give another model, or "
                             "decode_check = \"\" to skip the decode check") from None
    kv = kv_dtype_name(p["kv_dtype"], "kv_dtype")
    # every rank's pools (both sides, replicas and the same-TP destination) live on the one device, in whole blocks;
    # about eight caches at the most (a CPU run's temporaries included)
    blocks = -(-ctx[0] // p["block_size"])
    need = 8 * calculator.kv_bytes_per_token(spec, kv) * blocks * p["block_size"]
    free = devices.free_bytes(dev)
    if free is not None and need > 0.8 * free:
        raise ValueError(f"{spec.name} at {ctx[0]} tokens in blocks of {p['block_size']:,} needs about "
                         f"{need / 2**30:.1f} GiB on {dev} and {free / 2**30:.1f} GiB is free; give a smaller --model, "
                         "--context or --block-size")
    repeats = p["repeats"] or (GPU_REPEATS if gpu else CPU_REPEATS)
    split = lambda s: [v.strip() for v in str(s).split(",") if v.strip()]  # noqa: E731
    methods = split(p["methods"])
    if set(methods) & set(NIXL_METHODS):
        why = nixl_missing()
        if why:
            raise ValueError(f"methods = {p['methods']!r}: {why}")
        if {"nixl-staging", "nixl-staging-bulk"} & set(methods) and "staging" not in methods:
            raise ValueError(f"methods = {p['methods']!r}: nixl-staging is judged against staging (the same buffers "
                             "sent by a copy, as the ipc path would), so give staging too")
    return Config(model=spec.name, context=ctx[0], pairs=pairs, layouts=split(p["layouts"]),
                  methods=methods, block_size=p["block_size"], kv_dtype=kv, device=dev, repeats=repeats,
                  seed=p["seed"], decode_check=p["decode_check"])


def measure(cfg: Config, run: Run) -> None:
    """The device's own copy ceiling first (ceilings.csv: kvlab.ceilings over d2d_same, h2h on a CPU: the calculator's
    input), then
    every (pair, layout) by reshard_bench.bench (a progress bar over them): reshard_rows.csv, one row per (pair,
    layout, mover, round), the same-TP yardstick as mover "same-tp" (decode_tp = P; `pair` says whose yardstick it
    is), with the calculator's predicted_ms. Then, unless decode_check is "", the decode check (`decode_checks`):
    decode_check.csv."""
    run.update(resolved=cfg.resolved())
    kind = "gpu" if cfg.device.type == "cuda" else "cpu"
    sizes = ceilings.resolve_sizes(CEILING_SIZES[kind], cfg.device)
    path = CEILING_PATH[kind]
    ceil_df = ceilings.measure([path], sizes, n=max(cfg.repeats, 9), warmup=3, device=cfg.device, progress=False)
    run.save_table(ceil_df, "ceilings")
    fitted = ceilings_fit.fit(ceil_df).ceilings
    rows, counted = [], []
    jobs = [(pair, layout) for pair in cfg.pairs for layout in cfg.layouts]
    bar = tqdm(jobs, desc="reshard", unit="pair")
    for (a, b), layout in bar:
        bar.set_postfix_str(f"{a}→{b} {layout}")
        methods = []
        for m in cfg.methods:  # nixl-slices past its descriptor cap: counted (its accounting), not timed
            why = reshard_bench.refusal(m, reshard.plan(cfg.model, a, b), cfg.context, cfg.block_size, layout,
                                        kv_dtype=cfg.kv_dtype)
            if why and m == "nixl-slices":
                acc = reshard.account(reshard.plan(cfg.model, a, b), cfg.context, cfg.kv_dtype, m, cfg.block_size,
                                      layout)
                counted.append({"prefill_tp": a, "decode_tp": b, "pool_layout": layout, "method": m,
                                "context": cfg.context, "descriptors": sum(acc.pieces_per_decode_rank),
                                "why_not_timed": why})
            else:
                methods.append(m)
        got = reshard_bench.bench(a, b, layout, methods=methods, model=cfg.model, context=cfg.context,
                                  block_size=cfg.block_size, kv_dtype=cfg.kv_dtype, repeats=cfg.repeats,
                                  device=cfg.device, seed=cfg.seed, ceilings=fitted, path=path)
        rows += [dict(r, pair=f"{a}-{b}") for r in got]  # the same-TP rows (decode_tp = P) belong to this pair
    bar.close()
    run.save_table(pd.DataFrame(rows), "reshard_rows")
    if counted:
        run.save_table(pd.DataFrame(counted), "not_timed")
    if cfg.decode_check:
        run.save_table(decode_checks(cfg), "decode_check")


def decode_checks(cfg: Config) -> pd.DataFrame:
    """Per (pair, layout): kvlab.tp_decode.run of `cfg.decode_check` (random weights, fp32, CPU): prefill, re-shard
    P → D by the fused mover, D processes decode DECODE_STEPS tokens together over gloo; one row each, with the
    rule that judged it."""
    out = []
    jobs = [(pair, layout) for pair in cfg.pairs for layout in cfg.layouts]
    for (a, b), layout in tqdm(jobs, desc="TP decode", unit="pair"):
        r = tp_decode.run(cfg.decode_check, a, b, context=DECODE_CONTEXT, steps=DECODE_STEPS, src_layout=layout,
                          dst_layout=layout, method="fused", dtype="float32", seed=cfg.seed, backend="gloo")
        out.append({"model": cfg.decode_check, "prefill_tp": a, "decode_tp": b, "pool_layout": layout,
                    "context": DECODE_CONTEXT, "steps": DECODE_STEPS, "impl": r["impl"], "backend": "gloo",
                    "device": "cpu", "tokens_match": bool(r["tokens_match"]),
                    "logits_max_abs_diff": float(r["logits_max_abs_diff"]),
                    "logits_tolerance": float(r["logits_tolerance"]), "logits_equal": bool(r["logits_equal"]),
                    "shards_exact": bool(r["shards_exact"]), "poison_left": int(r["poison_left"]),
                    "replica_bytes": int(sum(r["replica_bytes"])), "passed": bool(r["passed"]), "rule": r["rule"]})
    return pd.DataFrame(out)


def summarise(rows: pd.DataFrame, model: str = "") -> pd.DataFrame:
    """Per (prefill_tp, decode_tp, pool_layout, method, context), the issue's reshard table: ms_median (min, max), GB/s
    of whole blocks written, the same-TP copy's median, pct_of_same_tp = same-TP median ÷ the mover's × 100 with the
    95 % interval of that ratio (intervals.ratio_ci: both sets resampled), x_same_tp (its inverse: how many times the
    same-TP time) with its interval, pieces per decode rank, the calculator's predicted_ms and the measured time's
    difference from it in %, the calculator's own % of same TP (predicted_pct), and whether every shard checked out (verified). `mode` ("TP 1→2, fused") and `layout`
    name each row in the verdicts. The NIXL movers' rows add x_ipc (their median ÷ staging's in the same rounds:
    the same buffers sent by a copy on the device, what kvlab disagg's ipc path makes) with its interval
    (x_ipc_lo, x_ipc_hi), descriptors_per_request, post_us and wait_us; NaN on the other rows."""
    out = []
    for (pair, lay, ctx), g in rows.groupby(["pair", "pool_layout", "context"], sort=False):
        p, d = (int(x) for x in str(pair).split("-"))
        same = g[g["method"] == "same-tp"]["ms"].tolist()
        staging = g[g["method"] == "staging"]["ms"].tolist()
        for method, m in g[g["method"] != "same-tp"].groupby("method", sort=False):
            ms = m["ms"].tolist()
            lo, hi = ratio_ci(same, ms)
            nan = float("nan")
            nixl = method.startswith("nixl") and "descriptors_per_request" in m
            x_ipc = (statistics.median(ms) / statistics.median(staging), *ratio_ci(ms, staging)) if (
                nixl and staging) else (nan, nan, nan)
            first = lambda col: float(m[col].iloc[0]) if nixl and col in m else nan  # noqa: E731
            per_desc = first("post_us") / first("pieces") if nixl and "pieces" in m else nan  # a NIXL piece: a descriptor
            med, same_med = statistics.median(ms), statistics.median(same)
            pred = float(m["predicted_ms"].iloc[0]) if "predicted_ms" in m else float("nan")
            same_pred = (float(g[g["method"] == "same-tp"]["predicted_ms"].iloc[0]) if "predicted_ms" in g
                         else float("nan"))
            out.append({"model": model, "prefill_tp": int(p), "decode_tp": int(d), "pool_layout": lay,
                        "method": method, "context": int(ctx), "n": len(ms), "ms_median": med, "ms_min": min(ms),
                        "ms_max": max(ms), "gbps": float(m["bytes"].iloc[0]) / med / 1e6, "same_tp_ms": same_med,
                        "pct_of_same_tp": 100 * same_med / med, "pct_lo": 100 * lo, "pct_hi": 100 * hi,
                        "x_same_tp": med / same_med, "x_lo": 1 / hi, "x_hi": 1 / lo,
                        "pieces_per_decode_rank": int(m["pieces_per_decode_rank"].iloc[0]),
                        "bytes": int(m["bytes"].iloc[0]), "predicted_ms": pred,
                        "predicted_pct": 100 * same_pred / pred if pred == pred and pred > 0 else float("nan"),
                        "pred_err_pct": 100 * (med / pred - 1) if pred == pred and pred > 0 else float("nan"),
                        "pred_err_abs_pct": abs(100 * (med / pred - 1)) if pred == pred and pred > 0 else float("nan"),
                        "verified": bool(m["verified"].astype(bool).all()
                                         and g[g["method"] == "same-tp"]["verified"].astype(bool).all()),
                        "backend": str(m["backend"].iloc[0]), "layout": lay, "mode": f"TP {p}→{d}, {method}",
                        "x_ipc": x_ipc[0], "x_ipc_lo": x_ipc[1], "x_ipc_hi": x_ipc[2],
                        "descriptors_per_request": first("descriptors_per_request"), "post_us": first("post_us"),
                        "wait_us": first("wait_us"), "post_us_per_descriptor": per_desc})
    s = pd.DataFrame(out)
    if len(s):
        s["unverified_all"] = int((~s["verified"]).sum())
        s["first_row"] = [True] + [False] * (len(s) - 1)
    return s


def analyse(record: dict, tables: dict) -> Analysis:
    """The reshard table (`summarise`), the goals judged on it by those in force when the run started, a finding per
    row and the values the docs quote."""
    model = str((record.get("resolved") or {}).get("model", ""))
    s = summarise(tables["reshard_rows"], model)
    dc = tables.get("decode_check")
    keys = ("layout", "mode", "context")
    g = goals.evaluate_run(NAME, record, s, keys=keys, measured_only=True)
    if dc is not None and len(dc):  # the decode goal on a row of its own, named for what it judges
        pairs = ", ".join(dict.fromkeys(f"{a}→{b}" for a, b in zip(dc["prefill_tp"], dc["decode_tp"])))
        row = pd.DataFrame([{"mode": f"decode check ({dc['model'].iloc[0]}), TP {pairs}",
                             "layout": ",".join(dict.fromkeys(dc["pool_layout"])), "context": int(dc["context"].iloc[0]),
                             "first_row": True, "decode_mismatch_all": int((~dc["tokens_match"].astype(bool)).sum())}])
        g = pd.concat([g, goals.evaluate_run(NAME, record, row, keys=keys, measured_only=True)], ignore_index=True)
    findings, values = [], {}
    for r in s.itertuples():
        pct = f"{r.pct_of_same_tp:.1f} % [{r.pct_lo:.1f}, {r.pct_hi:.1f}]"
        values[f"{r.prefill_tp}-{r.decode_tp}.{r.pool_layout}.{r.method}.pct_of_same_tp"] = pct
        pred = f"; the calculator said {sig(r.predicted_ms)} ms ({r.pred_err_pct:+.0f} %)" if r.predicted_ms == r.predicted_ms else ""
        nx = ""
        if r.descriptors_per_request == r.descriptors_per_request:
            each = r.post_us_per_descriptor
            nx = (f"; NIXL: {int(r.descriptors_per_request):,} descriptors per request (a decode rank's piece from "
                  f"one prefill rank), posting {sig(r.post_us)} µs"
                  + (f" ({sig(each)} µs a descriptor)" if each == each else "") + f", posted → done {sig(r.wait_us)} µs")
            if r.x_ipc == r.x_ipc:
                nx += f", {r.x_ipc:.3f}× [{r.x_ipc_lo:.3f}, {r.x_ipc_hi:.3f}] staging's time"
                values[f"{r.prefill_tp}-{r.decode_tp}.{r.pool_layout}.{r.method}.x_ipc"] = f"{r.x_ipc:.3f}"
        findings.append(f"- {ctx_label(r.context)}, TP {r.prefill_tp} → {r.decode_tp}, {r.pool_layout}, {r.method}: "
                        f"{sig(r.ms_median)} ms, {pct} of the same-TP copy ({sig(r.same_tp_ms)} ms), "
                        f"{r.pieces_per_decode_rank:,} pieces per decode rank{pred}{nx}"
                        f"{'' if r.verified else ' — a shard did not check out'}.")
    nt = tables.get("not_timed")
    for r in nt.itertuples() if nt is not None else ():
        findings.append(f"- Not timed: {r.method} for TP {r.prefill_tp} → {r.decode_tp} on {r.pool_layout} at "
                        f"{ctx_label(r.context)}, {r.descriptors:,} descriptors a move ({r.why_not_timed}).")
    findings += nixl_findings(s, values)
    findings += calculator_findings(s, tables.get("ceilings"), values)
    findings += decode_findings(dc, values)
    out = ({"reshard": s} | ({"decode_check": dc} if dc is not None and len(dc) else {})
           | ({"not_timed": nt} if nt is not None and len(nt) else {}))
    return Analysis(NAME, record, raw=dict(tables), tables=out, goals=g, findings=findings, values=values)


def nixl_findings(s: pd.DataFrame, values: dict) -> list[str]:
    """Per NIXL mover, over every (P, D, layout) of the run: its time against staging's (min–max of the ratios) and
    NIXL's posting cost per descriptor (min–max). Fills `values` (`{method}.x_ipc_range`,
    `{method}.post_us_per_descriptor_range`)."""
    out = []
    nx = s[s["method"].str.startswith("nixl")] if len(s) else s
    for method, m in nx.groupby("method", sort=False) if len(nx) else ():
        x, each = m["x_ipc"].dropna(), m["post_us_per_descriptor"].dropna()
        if x.empty or each.empty:
            continue
        fmt = lambda v: f"{v:.2f}" if v < 10 else f"{v:,.0f}"  # noqa: E731
        values[f"{method}.x_ipc_range"] = f"{fmt(x.min())}–{fmt(x.max())}"
        values[f"{method}.post_us_per_descriptor_range"] = f"{each.min():.1f}–{each.max():.1f}"
        n = int(m["descriptors_per_request"].max())
        out.append(f"- {method}: {values[f'{method}.x_ipc_range']}× staging's time over every (P, D, layout), with "
                   f"{n:,} descriptor{'s' if n != 1 else ''} a request at the most; posting cost "
                   f"{values[f'{method}.post_us_per_descriptor_range']} µs a descriptor.")
    return out


def decode_findings(dc: pd.DataFrame | None, values: dict) -> list[str]:
    """One line on the decode check: how many (pair, layout) runs gave the colocated tokens and passed the whole rule,
    the largest logit difference beside its tolerance, the replicas' bytes. Fills `values`."""
    if dc is None or not len(dc):
        return []
    ok, passed = int(dc["tokens_match"].astype(bool).sum()), int(dc["passed"].astype(bool).sum())
    worst = dc.loc[(dc["logits_max_abs_diff"] / dc["logits_tolerance"]).idxmax()]
    values.update({"decode.tokens_match": f"{ok} of {len(dc)}", "decode.passed": f"{passed} of {len(dc)}"})
    r = dc.iloc[0]
    return [f"- Decode with TP on the decode side ({r.model}, random weights, {int(r.context)}-token prompt, "
            f"{int(r.steps)} greedy steps, D processes over gloo on the CPU): {ok} of {len(dc)} (P, D, layout) runs "
            f"gave the colocated tokens at every step, {passed} passed the whole rule (logits within the "
            f"reduction-order tolerance, shards exact, no poison); the largest logit difference against its "
            f"tolerance was {worst.logits_max_abs_diff:.2e} of {worst.logits_tolerance:.2e} (TP {int(worst.prefill_tp)} "
            f"→ {int(worst.decode_tp)}, {worst.pool_layout}). Random weights make equal tokens weak evidence of "
            "accuracy; here they check that every rank decoded from the right shard."]


def calculator_findings(s: pd.DataFrame, ceil: pd.DataFrame | None, values: dict) -> list[str]:
    """Where the calculator's prediction parts from the measurement, said from the data: the fit of this run's copy
    sweep it predicts with, the rate the same-TP copy of the paged cache reaches against the sweep's best copy, and
    the range of measured ÷ predicted per mover. Fills `values` with what it quotes."""
    if ceil is None or ceil.empty or s.empty or s["predicted_ms"].isna().all():
        return []
    fitted = ceilings_fit.fit(ceil).ceilings.to_dict()["paths"]
    (path, c), = fitted.items()
    same_gbps = statistics.median(s["bytes"] / s["same_tp_ms"] / 1e6)
    values.update({"fit_gbps": f"{c['bandwidth_gbps']:,.0f}", "fit_fixed_us": f"{c['fixed_us']:.1f}",
                   "best_copy_gbps": f"{c['ceiling_gbps']:,.0f}", "same_tp_gbps": f"{same_gbps:,.0f}",
                   "same_tp_pct_of_best": f"{100 * same_gbps / c['ceiling_gbps']:.0f}"})
    out = [f"- The calculator predicts from this run's {path} sweep, fitted as {values['fit_fixed_us']} µs per copy + "
           f"bytes at {values['fit_gbps']} GB/s (its best measured copy: {values['best_copy_gbps']} GB/s). The paged "
           f"cache's same-TP copy reaches {values['same_tp_gbps']} GB/s, {values['same_tp_pct_of_best']} % of that "
           "best copy: the calculator prices a paged gather at a contiguous copy's rate."]
    for method, m in s.groupby("method", sort=False):
        ratio = m["ms_median"] / m["predicted_ms"]
        values[f"{method}.measured_over_predicted"] = f"{ratio.min():.2f}–{ratio.max():.2f}"
        out.append(f"- {method}: measured ÷ predicted {ratio.min():.2f}–{ratio.max():.2f} over every (P, D, layout).")
    return out


def goal_table(a: Analysis, study: str) -> pd.DataFrame:
    """The re-shard goals of run `a`, as the verdicts table shows them."""
    return a.goals


def figures(a: Analysis) -> dict:
    """Each mover's share of the same-TP copy, per (P, D) and layout, with its 95 % interval and the calculator's
    prediction as a mark."""
    import matplotlib.pyplot as plt  # matplotlib only when a figure is drawn

    s = a.tables["reshard"]
    if s.empty:
        raise ValueError("the run timed no re-shard, so there is nothing to draw")
    layouts = list(dict.fromkeys(s["pool_layout"]))
    colors = plots.palette(list(dict.fromkeys(s["method"])))
    fig, axes = plt.subplots(1, len(layouts), figsize=(5.2 * len(layouts), 4.6), squeeze=False, sharey=True,
                             layout="constrained")
    for ax, lay in zip(axes[0], layouts):
        t = s[s["pool_layout"] == lay]
        pairs = list(dict.fromkeys(zip(t["prefill_tp"], t["decode_tp"])))
        methods = list(dict.fromkeys(t["method"]))
        width = 0.8 / max(len(methods), 1)
        for k, method in enumerate(methods):
            m = t[t["method"] == method].set_index(["prefill_tp", "decode_tp"])
            xs = [i + (k - (len(methods) - 1) / 2) * width for i in range(len(pairs))]
            v = [m.loc[p, "pct_of_same_tp"] if p in m.index else float("nan") for p in pairs]
            lo = [m.loc[p, "pct_lo"] if p in m.index else float("nan") for p in pairs]
            hi = [m.loc[p, "pct_hi"] if p in m.index else float("nan") for p in pairs]
            pred = [m.loc[p, "predicted_pct"] if p in m.index else float("nan") for p in pairs]
            ax.bar(xs, v, width * 0.9, color=colors[method], label=method if ax is axes[0][0] else None,
                   yerr=[[max(a_ - b_, 0) for a_, b_ in zip(v, lo)], [max(b_ - a_, 0) for a_, b_ in zip(v, hi)]],
                   capsize=2.5)
            ax.scatter(xs, pred, marker="_", s=140, color="black", zorder=3,
                       label="calculator's prediction" if k == 0 and ax is axes[0][0] else None)
        ax.axhline(100, color="0.5", lw=0.8, ls=":")
        ax.set_xticks(range(len(pairs)), [f"{p}→{d}" for p, d in pairs])
        ax.set_xlabel("prefill TP → decode TP")
        ax.set_title(f"{lay} pools")
    axes[0][0].set_ylabel("% of the same-TP copy (higher is better)")
    axes[0][0].set_ylim(0, 132)  # headroom for the legend above the bars
    axes[0][0].legend(loc="upper left", ncol=2, fontsize=8.5, frameon=False)
    ctx = ctx_label(int(s["context"].iloc[0]))
    fig.suptitle(f"Re-sharding a {ctx} {s['model'].iloc[0]} cache between different TP, every rank on one device",
                 fontsize=12)
    return {"reshard_pct": fig}


def _table(analyses: list[Analysis], link, **_) -> str:
    """Per run, (P, D), layout and mover: median ms (min–max), % of the same-TP copy with its 95 % interval, pieces
    per decode rank, the calculator's prediction and the difference from it, and whether every shard checked out."""
    rows = []
    for a in analyses:
        for r in a.tables["reshard"].itertuples():
            rows.append({"run": link(a.where), "context": ctx_label(r.context), "TP": f"{r.prefill_tp} → {r.decode_tp}",
                         "pools": r.pool_layout, "method": r.method,
                         "ms median (min–max)": f"{sig(r.ms_median)} ({sig(r.ms_min)}–{sig(r.ms_max)})",
                         "same-TP ms": sig(r.same_tp_ms),
                         "% of same TP [95 %]": f"{r.pct_of_same_tp:.1f} [{r.pct_lo:.1f}, {r.pct_hi:.1f}]",
                         "pieces / decode rank": f"{r.pieces_per_decode_rank:,}",
                         "predicted ms (diff)": (f"{sig(r.predicted_ms)} ({r.pred_err_pct:+.0f} %)"
                                                 if r.predicted_ms == r.predicted_ms else "—"),
                         "shards exact": "yes" if r.verified else "**no**"})
    return md_table(pd.DataFrame(rows))


def _nixl_table(analyses: list[Analysis], link, **_) -> str:
    """Per run, (P, D), layout and NIXL mover: median ms, × staging's time in the same rounds with its 95 % interval,
    descriptors per request (one decode rank's piece from one prefill rank), the medians of posting every request
    and of posted → all done, in µs; then what was counted and not timed."""
    rows = []
    for a in analyses:
        s = a.tables["reshard"]
        for r in s[s["method"].str.startswith("nixl")].itertuples():
            rows.append({"run": link(a.where), "context": ctx_label(r.context),
                         "TP": f"{r.prefill_tp} → {r.decode_tp}", "pools": r.pool_layout, "method": r.method,
                         "ms median": sig(r.ms_median),
                         "× staging [95 %]": (f"{r.x_ipc:.3f} [{r.x_ipc_lo:.3f}, {r.x_ipc_hi:.3f}]"
                                              if r.x_ipc == r.x_ipc else "—"),
                         "descriptors / request": f"{int(r.descriptors_per_request):,}",
                         "post µs (a descriptor)": sig(r.post_us) + (f" ({sig(each)})" if (
                             each := r.post_us_per_descriptor) == each else ""),
                         "posted → done µs": sig(r.wait_us)})
        nt = a.tables.get("not_timed")
        for r in nt.itertuples() if nt is not None else ():
            rows.append({"run": link(a.where), "context": ctx_label(r.context),
                         "TP": f"{r.prefill_tp} → {r.decode_tp}", "pools": r.pool_layout, "method": r.method,
                         "ms median": "not timed", "× staging [95 %]": "—",
                         "descriptors / request": f"{r.descriptors:,} a move", "post µs (a descriptor)": "—",
                         "posted → done µs": "—"})
    if not rows:
        raise ValueError("no run of these timed a NIXL mover (methods nixl-staging, nixl-slices)")
    return md_table(pd.DataFrame(rows))


BLOCKS = {"table": _table, "nixl": _nixl_table}
