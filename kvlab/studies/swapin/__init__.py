"""Swap-in: a paged cache from pinned host memory back into a GPU pool by block table (`kvlab swapin`; no notebook).

The decode side's half of a host-staged handoff, measured beside the prefill side's half (the GPU → host gather of
notebook 04), each against one contiguous copy of the same bytes over the same link, timed in the same run
(.bench says how). The command line is .command; this face is what `kvlab analyse` and `kvlab report` call.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pandas as pd
import torch
from tqdm.auto import tqdm

from ... import devices, models
from ...disagg.config import kv_dtype_name
from ...paged import PoolSpec
from ...parse import token_list
from ...results import Run
from ...study import Analysis, Param, at_least, check_params, ctx_label, md_table, sig
from . import bench

__all__ = ["NAME", "NOTEBOOK", "TITLE", "QUESTION", "FIGURES", "PARAMS", "Config", "check", "measure", "analyse",
           "figures", "BLOCKS"]

NAME = "swapin"
NOTEBOOK = None
TITLE = "Swap-in"
QUESTION = ("How much of the PCIe link does a paged cache keep when pinned host memory is scattered into a GPU pool "
            "by block table, beside the GPU → host gather?")
FIGURES = ("swapin_pct",)

# "auto" by hardware: the published case on a GPU; on a CPU a size that checks the logic in seconds
GPU_MODEL, GPU_CONTEXTS = "qwen2.5-7b", "4k,32k"
CPU_MODEL, CPU_CONTEXTS = "kvlab-tiny", "256"


PARAMS = (
    Param("model", "str", "auto", "registry name or a config.json / model folder: the cache's shape; \"auto\": "
          f"{GPU_MODEL} on a GPU, {CPU_MODEL} on a CPU", lambda v, n: models.kv_model_ref(v, n)),
    Param("contexts", "str", "auto", f"tokens in the cache, comma-separated (\"4k,32k\"), each run in turn; \"auto\": "
          f"{GPU_CONTEXTS} on a GPU, {CPU_CONTEXTS} on a CPU", lambda v, n: token_list(v, n, 1)),
    Param("block_size", "int", 16, "tokens per block", at_least(1)),
    Param("kv_dtype", "str", "bf16", "bf16, fp16 or fp32", lambda v, n: kv_dtype_name(v, n)),
    Param("device", "str", "auto", "the GPU the pool is on: cuda:N, or cpu (checks the logic); \"auto\": cuda:0, "
          "cpu where there is no GPU (or KVLAB_PRESET set to cpu)", devices.check_device_name),
    Param("repeats", "int", 9, "timed sends per method and context", at_least(1)),
    Param("seed", "int", 0, "seed of the block tables and the data", at_least(0)),
)


@dataclass(frozen=True)
class Config:
    """One run: the model's name, the pool's shape (`spec`: layers, block size, KV heads, head dim, dtype), the
    contexts in tokens, the device the "GPU" pool is on, timed sends per method and context, the seed."""

    model: str
    spec: PoolSpec
    contexts: list
    device: torch.device
    repeats: int
    seed: int

    def resolved(self) -> dict:
        return {"model": self.model, "contexts": self.contexts, "block_size": self.spec.block_size,
                "kv_dtype": str(self.spec.dtype).removeprefix("torch."), "device": str(self.device),
                "repeats": self.repeats, "seed": self.seed}


def check(params) -> Config:
    """The run's Config from command-line values: each checked, "auto" resolved by hardware, then the device
    checked against this machine and, on a CPU, the pools' size against its free memory (nothing allocated)."""
    p = check_params(PARAMS, params, NAME)
    dev = devices.run_device(p["device"])
    gpu = dev.type == "cuda"
    model = (GPU_MODEL if gpu else CPU_MODEL) if p["model"] == "auto" else p["model"]
    ctx = token_list((GPU_CONTEXTS if gpu else CPU_CONTEXTS) if p["contexts"] == "auto" else p["contexts"],
                     "contexts", 1)
    spec_m = models.from_hf_config(model) if os.path.exists(model) else models.get(model)
    spec = PoolSpec(spec_m.layers, p["block_size"], spec_m.kv_heads, spec_m.head_dim,
                    kv_dtype_name(p["kv_dtype"], "kv_dtype"))
    if not gpu:  # host and "device" pools, staging and copies all live in this machine's memory
        need = 13 * spec.pool_bytes(spec.blocks_for(max(ctx)))  # 22.8 GB resident seen for a 1.75 GiB cache
        free = devices.host_available_bytes()
        if free is not None and need > 0.8 * free:
            raise ValueError(f"{spec_m.name} at {max(ctx)} tokens needs about {need / 2**30:.1f} GiB on a CPU (pools, "
                             f"staging, copies) and {free / 2**30:.1f} GiB is free; give a smaller --model or "
                             "--context (e.g. --model kvlab-tiny --context 256), or run it on a GPU")
    return Config(model=spec_m.name, spec=spec, contexts=ctx, device=dev, repeats=p["repeats"], seed=p["seed"])


def measure(cfg: Config, run: Run) -> None:
    """Every method and its ceilings, context by context (a progress bar per context): results.csv, one row per
    (context, direction, host layout, method, repeat)."""
    run.update(resolved=cfg.resolved())
    bar = tqdm(total=len(cfg.contexts), desc="swapin", unit="context")
    df = bench.measure(cfg.spec, cfg.contexts, cfg.device, repeats=cfg.repeats, seed=cfg.seed,
                       progress=lambda _: bar.update(1))
    bar.close()
    run.save_table(df, "results")


def analyse(record: dict, tables: dict) -> Analysis:
    """The summary (bench.summarise: per context, direction, host layout and method, the median against the same
    direction's contiguous copy, with its 95 % interval) and a finding per method."""
    s = bench.summarise(tables["results"])
    findings, values = [], {}
    for r in s.itertuples():
        if r.method == "contiguous":
            continue
        where = f"{ctx_label(r.context)} {r.direction}, {r.host_layout} host blocks, {r.method}"
        if r.n == 0:
            findings.append(f"- {where}: not run here ({r.note}).")
            continue
        pct = f"{r.pct_of_ceiling:.1f} % [{r.pct_lo:.1f}, {r.pct_hi:.1f}]"
        values[f"{r.context}.{r.direction}.{r.host_layout}.{r.method}.pct_of_ceiling"] = pct
        findings.append(f"- {where}: {sig(r.ms)} ms, {sig(r.gbps)} GB/s, {pct} of a contiguous copy of the same "
                        "bytes.")
    return Analysis(NAME, record, raw=dict(tables), tables={"summary": s}, findings=findings, values=values)


def figures(a: Analysis) -> dict:
    """Each method's share of the contiguous copy, per direction and context (ValueError when only the copy ran)."""
    return {"swapin_pct": bench.plot(a.tables["summary"])}


def _table(analyses: list[Analysis], link, **_) -> str:
    """Per run, context, direction, host layout and method: median ms (min–max), GB/s and % of the same direction's
    contiguous copy with its 95 % interval; a method that could not run says so."""
    rows = []
    for a in analyses:
        for r in a.tables["summary"].itertuples():
            ran = r.n > 0
            rows.append({"run": link(a.where), "context": ctx_label(r.context), "direction": r.direction,
                         "host blocks": r.host_layout, "method": r.method,
                         "ms median (min–max)": f"{sig(r.ms)} ({sig(r.ms_min)}–{sig(r.ms_max)})" if ran else "—",
                         "GB/s": sig(r.gbps) if ran else "—",
                         "% of contiguous [95 %]": (f"{r.pct_of_ceiling:.1f} [{r.pct_lo:.1f}, {r.pct_hi:.1f}]"
                                                    if ran and r.method != "contiguous" else "—" if not ran else "100"),
                         "n": r.n})
    return md_table(pd.DataFrame(rows))


BLOCKS = {"table": _table}
