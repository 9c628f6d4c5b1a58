"""Paged transfer: how close does moving a paged KV cache's blocks come to one contiguous copy of the same bytes?
(notebook 04)

A serving engine keeps a sequence's cache in blocks scattered over a pool, so a handoff moves many small pieces.
Every paged transport (.bench.METHODS) moves one sequence's blocks to each destination beside the contiguous copy
of the same bytes measured in the same run (the ceiling); each is verified byte for byte before it is timed, and a
decode from a cache that travelled through each transport must match the colocated decode bit for bit
(.correctness). On a GPU one kernel launch is also timed with the rows in different orders (.patterns). NIXL runs
in a process of its own (.nixl_only) and is merged through `nixl_csv`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch
from tqdm.auto import tqdm

from ... import devices, models
from ...parse import name_list, suggest, token_list
from ...paths import repo_root
from ...results import Run
from ...study import Analysis, Param, at_least, check_params, fmt_or_dash, md_table, sig
from ...transfer import Destination
from . import bench, correctness, page, patterns, report

__all__ = ["NAME", "NOTEBOOK", "TITLE", "QUESTION", "FIGURES", "PARAMS", "Config", "check", "measure", "analyse",
           "figures", "BLOCKS", "goal_table"]

NAME = "paged_transfer"
NOTEBOOK = "04_paged_transfer"
TITLE = "Paged transfer"
QUESTION = ("How close does each way of moving a paged KV cache's scattered blocks come to one contiguous copy of the "
            "same bytes on the same link?")
FIGURES = ("gbps_vs_block_size", "access_patterns", page.NAME)


def _methods(value, name):
    for m in name_list(value, name):
        if m not in bench.METHODS:
            raise ValueError(f"{name}: unknown method {m!r}; valid: {', '.join(bench.METHODS)}"
                             f"{suggest(m, bench.METHODS)}")


def _destinations(value, name):
    src = "cuda" if torch.cuda.is_available() else "cpu"
    for d in name_list(value, name):
        try:
            Destination.parse(d, src)
        except RuntimeError:  # torch.device("cuda:one")
            raise ValueError(f"unknown destination {d!r}; valid: 'same-gpu', 'cuda:N' (N a GPU index), 'pinned', "
                             "'pageable'") from None


def _pool_layout(value, name):
    if value not in ("nhd", "hnd"):
        raise ValueError(f"{name} = {value!r} is not valid; valid: nhd, hnd{suggest(value, ('nhd', 'hnd'))}")


def _check_model(value, name):
    if value != "":
        models.kv_model_ref(value, name)


def _nixl_path(value: str) -> Path:
    # a relative path is read from the repository root (papermill runs the notebook in notebooks/)
    path = Path(value).expanduser()
    return path if path.is_absolute() else repo_root() / path


def _nixl_csv(value, name):
    if value == "":
        return
    path = _nixl_path(value)
    if not path.is_file():
        raise ValueError(f"{name} = {value!r}: no such file (give the nixl_results.csv that "
                         "kvlab.studies.paged_transfer.nixl_only.run_nixl_only wrote, or \"\")")
    missing = sorted(set(bench.COLUMNS) - set(pd.read_csv(path, nrows=0).columns))
    if missing:
        raise ValueError(f"{name} = {value!r}: the file lacks the columns {missing} of the paged measurement; give a "
                         "nixl_results.csv that run_nixl_only wrote")


PARAMS = (
    Param("contexts", "str", "auto", 'prompt lengths in tokens, comma-separated ("1k,32k" works); "auto": GPU '
          "1k,4k,16k,32k · CPU 64,256", lambda v, n: token_list(v, n, 1)),
    Param("block_sizes", "str", "auto", 'tokens per block, comma-separated; "auto": 16,32,64,128',
          lambda v, n: token_list(v, n, 1)),
    Param("methods", "str", "auto", 'comma-separated method names (see the table above); "auto": all; the contiguous '
          "ceiling is always measured", _methods),
    Param("destinations", "str", "auto", 'comma-separated: same-gpu, pinned, pageable, cuda:N; "auto": GPU '
          "same-gpu,pinned (+cuda:1 with 2 GPUs) · CPU same-gpu,pageable", _destinations),
    Param("layout", "str", "auto", 'KV shape per token: "qwen2.5-7b" (28 layers × 4 KV heads × 128, bf16) or "tiny"; '
          '"auto": by hardware', lambda v, n: bench.check_layout(v)),
    Param("pool_layout", "str", "nhd", 'block layout in the pool: "nhd" (vLLM-like) or "hnd" (heads first)',
          _pool_layout),
    Param("repeats", "int", 9, "timed sends per configuration after warm-up (slow methods are timed once; the row "
          "says so)", at_least(1)),
    Param("warmup", "int", 2, "untimed sends per configuration first", at_least(0)),
    Param("tune", "bool", True, "GPU: time a few tile/warp shapes of the Triton kernels on the real tables and keep "
          "the fastest"),
    Param("check_model", "str", "kvlab-tiny", 'model for the decode-from-pages check (random weights); "" skips the '
          "check", _check_model),
    Param("nixl_csv", "str", "", "nixl_results.csv written by kvlab.studies.paged_transfer.nixl_only.run_nixl_only, "
          'merged into the results; "": none', _nixl_csv),
)


@dataclass(frozen=True)
class Config:
    """One run: contexts and block sizes in tokens, the methods, destinations, the KV layout's name, the source device,
    the pool layout, timed and untimed sends, whether to tune the Triton kernels, the decode check's model ("": none)
    and the NIXL results to merge (an absolute path, "": none)."""

    contexts: list
    block_sizes: list
    methods: list
    destinations: list
    layout: str
    device: str
    pool_layout: str
    repeats: int
    warmup: int
    tune: bool
    check_model: str
    nixl_csv: str

    def resolved(self) -> dict:
        return {"contexts": self.contexts, "block_sizes": self.block_sizes, "methods": self.methods,
                "destinations": self.destinations, "layout": self.layout, "device": self.device}


def check(params) -> Config:
    """The run's Config from notebook or command-line values: each checked, then "auto" resolved by hardware (a CPU
    preset runs the tiny layout at small sizes) and the destinations checked against this machine."""
    p = check_params(PARAMS, params, NAME)
    device = "cpu" if devices.preset() == "cpu" else None
    r = bench.resolve(p["contexts"], p["block_sizes"], p["methods"], p["destinations"], p["layout"], device)
    return Config(contexts=r["contexts"], block_sizes=r["block_sizes"], methods=r["methods"],
                  destinations=r["destinations"], layout=r["layout"], device=r["device"], pool_layout=p["pool_layout"],
                  repeats=p["repeats"], warmup=p["warmup"], tune=p["tune"], check_model=p["check_model"],
                  nixl_csv=str(_nixl_path(p["nixl_csv"])) if p["nixl_csv"] else "")


def measure(cfg: Config, run: Run) -> None:
    """The decode check first (decode_check.csv; a mismatch stops the run here), then every method against its
    ceiling (results.csv, NIXL's own-process rows merged in; the transports' configurations in run.json), then on a
    GPU the access patterns of one kernel launch (access_patterns.csv)."""
    run.update(resolved=cfg.resolved())
    if cfg.check_model:
        net = models.build(cfg.check_model, device=cfg.device, dtype="bfloat16")
        checks = correctness.decode_check(net, methods=cfg.methods, destinations=cfg.destinations, tokens=77,
                                          block_size=16, steps=8, device=cfg.device, pool_layout=cfg.pool_layout)
        del net
        run.save_table(checks, "decode_check")
        run.update(paged_prefill_logits_equal=checks.attrs["paged_prefill_logits_equal"])
        ran = checks[checks.status == "ok"]
        bad = ran[~(ran.tokens_match & ran.logits_equal & ran.blocks_ok & (ran.poison_left == 0))]
        if len(bad) or not checks.attrs["paged_prefill_logits_equal"]:
            raise RuntimeError(f"decode from moved pages differs from colocated:\n{bad.to_string()}")
    methods = ["contiguous", *dict.fromkeys(m for m in cfg.methods if m != "contiguous")]
    bar = tqdm(total=len(cfg.contexts) * len(cfg.block_sizes) * len(cfg.destinations) * len(methods),
               desc="paged_transfer", unit="send")
    df = bench.measure(cfg.contexts, cfg.block_sizes, cfg.methods, cfg.destinations, repeats=cfg.repeats,
                       warmup=cfg.warmup, device=cfg.device, layout=cfg.layout, pool_layout=cfg.pool_layout,
                       tune=cfg.tune, progress=lambda _: bar.update(1))
    bar.close()
    run.update(transports=df.attrs.get("transports", []))
    if cfg.nixl_csv:
        nixl = Path(cfg.nixl_csv)
        df = report.merge(df, pd.read_csv(nixl))
        sidecar = nixl.with_name("nixl_config.json")
        if sidecar.is_file():
            run.update(nixl=json.loads(sidecar.read_text(encoding="utf-8")))
    run.save_table(df, "results")
    pat = patterns.access_patterns(max(cfg.contexts), 16, device=cfg.device, layout=cfg.layout, repeats=cfg.repeats,
                                   warmup=cfg.warmup)
    if len(pat):
        run.save_table(pat, "access_patterns")


def _headline_context(a: Analysis) -> int:
    contexts = (a.record.get("resolved") or {}).get("contexts")
    return int(max(contexts)) if contexts else int(a.raw["results"].context.max())


def analyse(record: dict, tables: dict) -> Analysis:
    """From the raw rows: the headline summary (the longest context, 16-token blocks; summary.csv), every
    configuration as % of its ceiling (pct_of_ceiling.csv), the Triton tunings (tuning.csv, from run.json's
    transports), the access-pattern summary, the goals, and the findings."""
    df = tables["results"]
    # the tunings measure() kept beside its rows, on a frame of their own: pandas copies a frame's attrs into every
    # frame derived from it, and the summaries derive thousands
    tunings = pd.DataFrame()
    tunings.attrs["transports"] = record.get("transports") or []
    summary = report.summary(df)
    out = {"summary": summary}
    for name, t in (("pct_of_ceiling", report.pct_table(df)), ("tuning", report.tuning_table(tunings))):
        if len(t):  # an empty table would be an unreadable CSV
            out[name] = t
    pat = tables.get("access_patterns")
    if pat is not None and len(pat):
        out["access_pattern_summary"] = report.pattern_summary(pat)
    goals = report.goals(df, record=record)
    findings = [report.finding(df)]
    checks = tables.get("decode_check")
    if checks is not None and len(checks):
        ran = checks[checks.status == "ok"]
        same = ran[ran.tokens_match & ran.logits_equal & ran.blocks_ok & (ran.poison_left == 0)]
        findings.append(f"Decode from moved pages: {len(same)} of {len(ran)} transfers decoded identically to "
                        f"colocated; {int((checks.status != 'ok').sum())} not run here (reasons in decode_check.csv).")
    findings += [f"- {r.goal}: {r.value} — {r.verdict}" for r in goals.itertuples()]
    values = {}
    for r in summary.itertuples():
        if r.method != "contiguous" and r.pct_of_ceiling == r.pct_of_ceiling:
            values[f"{r.destination}.{r.method}.gbps"] = sig(r.gbps)
            values[f"{r.destination}.{r.method}.pct_of_ceiling"] = f"{r.pct_of_ceiling:.1f}"
    return Analysis(NAME, record, raw=dict(tables), tables=out, goals=goals, findings=findings, values=values)


def figures(a: Analysis) -> dict:
    """GB/s against block size per destination (the longest context); on a GPU run, the access patterns too; and
    the same medians as a page, by destination and block size."""
    figs = {"gbps_vs_block_size": report.plot_gbps_vs_block_size(a.raw["results"])}
    if "access_pattern_summary" in a.tables:
        figs["access_patterns"] = report.plot_patterns(
            a.tables["access_pattern_summary"], title=f"{_headline_context(a):,} tokens in 16-token blocks: what the "
                                                      "access pattern costs one kernel launch")
    figs[page.NAME] = page.page(a)  # the same medians as an interactive page (kvlab.pages)
    return figs


def goal_table(a: Analysis, study: str) -> pd.DataFrame:
    """The paged goals judged at the headline configuration of the run (the verdicts table's rows)."""
    return a.goals


def _table(analyses: list[Analysis], **_) -> str:
    """The headline of one run: per destination and method, time median (min–max), GB/s, % of the ceiling."""
    s = analyses[0].tables["summary"]
    # a method this run could not use (NIXL not installed): said, not timed; other skips keep their row as it is
    skipped = (s.status == "skipped") & s.note.fillna("").str.contains("not installed|does not load")
    out = pd.DataFrame({
        "destination": s.destination, "method": s.method, "pieces": s.pieces.map(lambda v: f"{v:,}"),
        "time median (min–max)": s.time.where(~skipped, "not run here"),
        "GB/s": s.gbps.map(lambda v: fmt_or_dash(v, ",.1f")),
        "% of contiguous ceiling": s.pct_of_ceiling.map(lambda v: "—" if v != v else f"{v:.1f} %"),
        "repeats": s.repeats, "verified": s.verified.where(~skipped, "—")})
    return md_table(out)


def _kernel_config(c) -> str:
    if not isinstance(c, str) or not c:
        return "—"
    d = json.loads(c)
    return ", ".join(f"{k}={d[k]}" for k in ("block", "rows_per_program", "num_warps") if k in d)


def _access_patterns(analyses: list[Analysis], **_) -> str:
    """One run's kernel launches with the rows in different orders, beside the contiguous copy."""
    s = analyses[0].tables["access_pattern_summary"]
    out = pd.DataFrame({"pattern": s.pattern, "time median (min–max)": s.time,
                        "GB/s": s.gbps.map(lambda v: f"{v:,.0f}"),
                        "% of contiguous copy": s.pct_of_contiguous.map(lambda v: f"{v:.1f} %"),
                        "repeats": s.repeats, "tuned kernel": s.config.map(_kernel_config)})
    return md_table(out)


BLOCKS = {"table": _table, "access_patterns": _access_patterns}
