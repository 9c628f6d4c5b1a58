"""What crosses the wire: a paged bf16 cache sent as FP8 with its scales (`kvlab wire`).

Seed 000's calculator says FP8 KV shrinks a link-bound exposure "to almost nothing": half the bytes. They are half
only if the scales are counted and the quantize and dequantize cost nothing. The sending GPU quantizes inside the
paged gather (one Triton pass: read the blocks, compute the scales, write e4m3 and the scales; kvlab.paged.
wire_kernels), into GPU memory or straight into pinned host memory (the kernel's stores cross PCIe, the 400G NIC's
stand-in); the receiving side dequantizes on arrival into a bf16 pool (from pinned memory, its loads crossing
PCIe). Each kernel is first checked bit for bit against kvlab.paged.wire's torch reference, then timed in rotated
rounds beside the bf16 yardsticks of the same cache in the same run: one copy of its bytes and kvlab's gather of
its blocks, each way. Scales per token and head (dynamic), per head and per tensor (static, calibrated on the same
cache). From the rates, the link bandwidth below which FP8 wins (kvlab.paged.wire.breakeven_gbps). Random values:
this measures bytes and time, not accuracy.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass

import pandas as pd
import torch
from tqdm.auto import tqdm

from ... import devices, goals, models, plots
from ...intervals import median_ci
from ...paged import BlockAllocator, BlockPool, PoolSpec
from ...paged.pools import check_layout
from ...paged.wire import SCALE_MODES, breakeven_gbps, check_modes
from ...paged.wire_kernels import bench_wire
from ...parse import token_list
from ...results import Run
from ...study import Analysis, Param, at_least, check_params, ctx_label, md_table, sig

__all__ = ["NAME", "NOTEBOOK", "TITLE", "QUESTION", "FIGURES", "PARAMS", "Config", "check", "measure", "analyse",
           "figures", "BLOCKS", "goal_table", "summarise", "breakeven"]

NAME = "wire_dtype"
NOTEBOOK = "07_wire_dtype"
TITLE = "FP8 on the wire"
QUESTION = ("How much of the bf16 time does a paged cache sent as FP8 with its scales take, quantize and dequantize "
            "included, and below which link bandwidth does FP8 win?")
FIGURES = ("wire_ms",)

GPU_MODEL, GPU_CONTEXTS, GPU_REPEATS = "qwen2.5-7b", "4k,32k", 10
CPU_MODEL, CPU_CONTEXTS, CPU_REPEATS = "kvlab-tiny", "256", 3
PATHS = {"d2d": "same GPU", "d2h": "pinned host", "h2d": "pinned host"}


PARAMS = (
    Param("model", "str", "auto", "registry name or a config.json / model folder: the cache's shape; \"auto\": "
          f"{GPU_MODEL} on a GPU, {CPU_MODEL} on a CPU", lambda v, n: models.kv_model_ref(v, n)),
    Param("contexts", "str", "auto", f"tokens in the cache, comma-separated; \"auto\": {GPU_CONTEXTS} on a GPU, "
          f"{CPU_CONTEXTS} on a CPU", lambda v, n: token_list(v, n, 1)),
    Param("scales", "str", ",".join(SCALE_MODES), "scale modes, comma-separated: per-token-head (dynamic), per-head "
          "and per-tensor (static, calibrated on the cache)", check_modes),
    Param("layout", "str", "hnd", "both pools' layout: hnd or nhd", check_layout),
    Param("block_size", "int", 16, "tokens per block", at_least(1)),
    Param("device", "str", "auto", "the GPU: cuda:N, or cpu (checks the logic); \"auto\": cuda:0, cpu where there "
          "is no GPU (or KVLAB_PRESET set to cpu)", devices.check_device_name),
    Param("repeats", "int", 0, f"timed rounds per context, every kernel once a round in rotated order; 0: "
          f"{GPU_REPEATS} on a GPU, {CPU_REPEATS} on a CPU", at_least(0)),
    Param("seed", "int", 0, "seed of the block tables and the data", at_least(0)),
)


@dataclass(frozen=True)
class Config:
    """One run: the model's name and pool shape (bf16), the contexts, scale modes, the device, rounds, the seed."""

    model: str
    spec: PoolSpec
    contexts: list
    scales: list
    device: torch.device
    repeats: int
    seed: int

    def resolved(self) -> dict:
        return {"model": self.model, "contexts": self.contexts, "scales": self.scales, "layout": self.spec.layout,
                "block_size": self.spec.block_size, "device": str(self.device), "repeats": self.repeats,
                "seed": self.seed}


def check(params) -> Config:
    """The run's Config: every value checked, "auto" resolved by hardware, the device held against this machine and,
    on a CPU, the pools against free memory — before anything is allocated or written."""
    p = check_params(PARAMS, params, NAME)
    dev = devices.run_device(p["device"])
    gpu = dev.type == "cuda"
    model = (GPU_MODEL if gpu else CPU_MODEL) if p["model"] == "auto" else p["model"]
    m = models.from_hf_config(model) if os.path.exists(model) else models.get(model)
    if m.attention == "mla":
        raise ValueError(f"model = {model!r} keeps an MLA latent; the FP8 wire quantizes K and V heads")
    ctx = token_list((GPU_CONTEXTS if gpu else CPU_CONTEXTS) if p["contexts"] == "auto" else p["contexts"],
                     "contexts", 1)
    spec = PoolSpec(m.layers, p["block_size"], m.kv_heads, m.head_dim, torch.bfloat16, p["layout"])
    # the pool (twice the blocks), its destination, the packets and the bf16 yardsticks' buffers: about eight caches
    need = 8 * spec.pool_bytes(spec.blocks_for(max(ctx)))
    free = devices.free_bytes(dev)
    if free is not None and need > 0.8 * free:
        raise ValueError(f"{m.name} at {max(ctx)} tokens needs about {need / 2**30:.1f} GiB on {dev} and "
                         f"{free / 2**30:.1f} GiB is free; give a smaller --model, --context or --block-size")
    scales = [v.strip() for v in p["scales"].split(",") if v.strip()]
    return Config(model=m.name, spec=spec, contexts=ctx, scales=scales, device=dev,
                  repeats=p["repeats"] or (GPU_REPEATS if gpu else CPU_REPEATS), seed=p["seed"])


def measure(cfg: Config, run: Run) -> None:
    """Per context (a progress bar over them): a bf16 pool twice the cache's blocks filled at random, its blocks
    drawn at random, a poisoned destination pool; wire_kernels.bench_wire checks every kernel against the reference
    and times them all with the bf16 yardsticks. wire_rows.csv: one row per (context, kernel, direction, scales,
    round)."""
    run.update(resolved=cfg.resolved())
    rows = []
    for i, ctx in enumerate(tqdm(cfg.contexts, desc="wire", unit="context")):
        n = cfg.spec.blocks_for(ctx)
        pool = BlockPool(cfg.spec, 2 * n, device=cfg.device).fill_random(cfg.seed + i)
        table = BlockAllocator(2 * n, cfg.spec.block_size, seed=cfg.seed + i, order="random").allocate(ctx)
        dest = BlockPool(cfg.spec, n, device=cfg.device).poison()
        rows += bench_wire(pool, table, dest, repeats=cfg.repeats, scales=cfg.scales)
        del pool, dest
        if cfg.device.type == "cuda":
            torch.cuda.empty_cache()
    run.save_table(pd.DataFrame(rows), "wire_rows")


def summarise(rows: pd.DataFrame, model: str = "") -> pd.DataFrame:
    """Per (context, kernel, direction, scales), the issue's wire table: path, wire_dtype (fp8 | bf16), ms_median with
    its 95 % interval (ms_lo, ms_hi), bytes on the wire (scales included), bf16 bytes and their ratio, GB/s of bf16
    input with its interval, and for the FP8 rows the bf16 copy of the same cache the same way in the same run
    (bf16_copy_ms), the share of its time (pct_of_bf16), and the prediction: its bytes at the rate that copy reached
    (wire_alone_ms, what the link alone would take)."""
    out = []
    for (ctx, kernel, direction, scales), g in rows.groupby(["context", "kernel", "direction", "scales"], sort=False):
        ms = g["ms"].tolist()
        lo, hi = median_ci(ms)
        med = statistics.median(ms)
        bf16 = int(g["bf16_bytes"].iloc[0])
        out.append({"model": model, "context": int(ctx), "kernel": kernel, "path": PATHS.get(direction, direction),
                    "direction": direction, "wire_dtype": "bf16" if scales == "none" else "fp8", "scales": scales,
                    "n": len(ms), "ms_median": med, "ms_lo": lo, "ms_hi": hi, "bytes": int(g["bytes"].iloc[0]),
                    "bf16_bytes": bf16, "bytes_ratio": int(g["bytes"].iloc[0]) / bf16,
                    "input_gbps": bf16 / med / 1e6, "gbps_lo": bf16 / hi / 1e6, "gbps_hi": bf16 / lo / 1e6,
                    "backend": str(g["backend"].iloc[0]), "convert": str(g["convert"].iloc[0])})
    s = pd.DataFrame(out)
    if s.empty:
        return s
    order = {k: i for i, k in enumerate(("quantize-gather", "dequantize-scatter", "bf16-copy", "bf16-gather"))}
    s = s.sort_values(["context", "kernel", "direction", "scales"], key=lambda c: c.map(order) if c.name == "kernel"
                      else c, kind="stable", ignore_index=True)
    copy = s[s["kernel"] == "bf16-copy"].set_index(["context", "direction"])["ms_median"]
    s["bf16_copy_ms"] = [copy.get((c, d), float("nan")) for c, d in zip(s["context"], s["direction"])]
    s["pct_of_bf16"] = 100 * s["ms_median"] / s["bf16_copy_ms"]
    # the prediction beside each: its bytes (scales included) at the rate the bf16 copy reached the same way
    s["wire_alone_ms"] = s["bytes"] / s["bf16_bytes"] * s["bf16_copy_ms"]
    return s


def breakeven(s: pd.DataFrame) -> pd.DataFrame:
    """Per (context, scales): the link bandwidth below which FP8 wins (breakeven_gbps: serial, and with the passes
    overlapped with the copy), from the quantize-gather and dequantize-scatter rates into and out of GPU memory, with
    the interval their rates' intervals give (W* grows with both rates)."""
    out = []
    fp8 = s[s["wire_dtype"] == "fp8"]
    for (ctx, scales), g in fp8.groupby(["context", "scales"], sort=False):
        q = g[(g["kernel"] == "quantize-gather") & (g["direction"] == "d2d")]
        r = g[(g["kernel"] == "dequantize-scatter") & (g["direction"] == "d2d")]
        if q.empty or r.empty:
            continue
        q, r = q.iloc[0], r.iloc[0]
        ratio = 1 / q["bytes_ratio"]
        for overlap in (False, True):
            out.append({"context": int(ctx), "scales": scales, "path": "any link", "overlap": overlap,
                        "ratio": ratio, "breakeven_gbps": breakeven_gbps(q.input_gbps, r.input_gbps, ratio, overlap),
                        "lo": breakeven_gbps(q.gbps_lo, r.gbps_lo, ratio, overlap),
                        "hi": breakeven_gbps(q.gbps_hi, r.gbps_hi, ratio, overlap)})
    return pd.DataFrame(out)


def analyse(record: dict, tables: dict) -> Analysis:
    """The wire table, the rates of the FP8 kernels, the break-even link bandwidths, the goals judged on the wire
    table by those in force when the run started, and a finding per FP8 path at the longest context."""
    model = str((record.get("resolved") or {}).get("model", ""))
    s = summarise(tables["wire_rows"], model)
    b = breakeven(s)
    g = goals.evaluate_run(NAME, record, s, keys=("context", "kernel", "direction", "scales"))
    rates = s[s["wire_dtype"] == "fp8"][["kernel", "direction", "context", "scales", "input_gbps", "gbps_lo",
                                        "gbps_hi"]].rename(columns={"gbps_lo": "lo", "gbps_hi": "hi"})
    findings, values = [], {}
    longest = int(s["context"].max())
    for r in s[(s["context"] == longest) & (s["wire_dtype"] == "fp8")].itertuples():
        key = f"{r.kernel}.{r.direction}.{r.scales}"
        values[f"{key}.ms"] = f"{sig(r.ms_median)} [{sig(r.ms_lo)}, {sig(r.ms_hi)}]"
        findings.append(f"- {ctx_label(r.context)}, {r.kernel} {r.direction} ({r.path}), {r.scales} scales: "
                        f"{sig(r.ms_median)} ms [{sig(r.ms_lo)}, {sig(r.ms_hi)}], {r.pct_of_bf16:.0f} % of the bf16 "
                        f"copy's {sig(r.bf16_copy_ms)} ms (its bytes alone at that copy's rate: "
                        f"{sig(r.wire_alone_ms)} ms), {sig(r.input_gbps)} GB/s of bf16 input; "
                        f"{r.bytes_ratio:.3f}× the bf16 bytes.")
    for r in b[(b["context"] == longest)].itertuples():
        how = "overlapped with the copy" if r.overlap else "one after another"
        findings.append(f"- {ctx_label(r.context)}, {r.scales} scales, passes {how}: FP8 wins on links below "
                        f"{sig(r.breakeven_gbps)} GB/s (bounds {sig(r.lo)}–{sig(r.hi)}, from both rates' 95 % "
                        "intervals).")
    return Analysis(NAME, record, raw=dict(tables), tables={"wire": s, "wire_rates": rates, "breakeven": b},
                    goals=g, findings=findings, values=values)


def goal_table(a: Analysis, study: str) -> pd.DataFrame:
    """The wire goals of run `a`, as the verdicts table shows them (`mode` and `destination` say which row)."""
    g = a.goals.copy()
    if len(g):
        g["mode"] = g["kernel"] + " " + g["direction"] + ", " + g["scales"]
    return g


def figures(a: Analysis) -> dict:
    """Per context, each way the cache can cross pinned host memory: the FP8 kernel's time (one bar per scale mode)
    beside the bf16 copy of the same bytes, with 95 % intervals."""
    import matplotlib.pyplot as plt  # matplotlib only when a figure is drawn

    s = a.tables["wire"]
    host = s[s["direction"].isin(["d2h", "h2d"]) & s["kernel"].isin(["quantize-gather", "dequantize-scatter",
                                                                     "bf16-copy"])]
    if host.empty:
        raise ValueError("the run timed nothing over pinned host memory, so there is nothing to draw")
    contexts = sorted(host["context"].unique())
    series = list(dict.fromkeys(["bf16"] + [m for m in host["scales"] if m != "none"]))
    colors = plots.palette(series)
    fig, axes = plt.subplots(1, len(contexts), figsize=(5.0 * len(contexts), 4.4), squeeze=False,
                             layout="constrained")
    for ax, ctx in zip(axes[0], contexts):
        t = host[host["context"] == ctx]
        width = 0.8 / len(series)
        for k, name in enumerate(series):
            xs, v, lo, hi = [], [], [], []
            for i, direction in enumerate(("d2h", "h2d")):
                row = t[(t["direction"] == direction) & ((t["scales"] == name) if name != "bf16"
                                                          else (t["kernel"] == "bf16-copy"))]
                if row.empty:
                    continue
                r = row.iloc[0]
                xs.append(i + (k - (len(series) - 1) / 2) * width)
                v.append(r.ms_median), lo.append(r.ms_median - r.ms_lo), hi.append(r.ms_hi - r.ms_median)
            ax.bar(xs, v, width * 0.9, yerr=[lo, hi], capsize=2.5, color=colors[name],
                   label=("bf16 copy" if name == "bf16" else f"FP8, {name} scales") if ax is axes[0][0] else None)
        ax.set_xticks([0, 1], ["GPU → pinned host\n(quantize in the gather)", "pinned host → GPU\n(dequantize on arrival)"])
        ax.set_title(f"{ctx_label(int(ctx))} tokens")
    axes[0][0].set_ylabel("ms (lower is better)")
    axes[0][0].legend(fontsize=8.5, frameon=False, loc="upper left")
    for ax in axes[0]:  # each context on its own scale, with headroom for the legend
        ax.set_ylim(0, ax.get_ylim()[1] * 1.3)
    fig.suptitle(f"A paged {s['model'].iloc[0]} cache over pinned host memory: FP8 with its scales beside bf16",
                 fontsize=12)
    return {"wire_ms": fig}


def _table(analyses: list[Analysis], link, **_) -> str:
    """Per run, context, kernel and path: the median ms with its 95 % interval, the share of the bf16 copy the same
    way, GB/s of bf16 input, and the bytes on the wire against bf16's."""
    rows = []
    for a in analyses:
        for r in a.tables["wire"].itertuples():
            rows.append({"run": link(a.where), "context": ctx_label(r.context), "kernel": r.kernel,
                         "way": f"{r.direction} ({r.path})", "scales": r.scales if r.scales != "none" else "—",
                         "ms median [95 %]": f"{sig(r.ms_median)} [{sig(r.ms_lo)}, {sig(r.ms_hi)}]",
                         "time, % of the bf16 copy's": f"{r.pct_of_bf16:.0f}" if r.pct_of_bf16 == r.pct_of_bf16 else "—",
                         "its bytes at the bf16 copy's rate (ms)": sig(r.wire_alone_ms),
                         "GB/s of bf16 input": sig(r.input_gbps), "bytes ÷ bf16": f"{r.bytes_ratio:.3f}"})
    return md_table(pd.DataFrame(rows))


def _breakeven_table(analyses: list[Analysis], link, **_) -> str:
    """Per run, context and scale mode: the link bandwidth below which FP8 wins, serial and overlapped."""
    rows = []
    for a in analyses:
        for r in a.tables["breakeven"].itertuples():
            rows.append({"run": link(a.where), "context": ctx_label(r.context), "scales": r.scales,
                         "passes": "overlapped with the copy" if r.overlap else "one after another",
                         "bytes ratio (bf16 ÷ FP8)": f"{r.ratio:.3f}",
                         "FP8 wins below (GB/s) [bounds]": f"{sig(r.breakeven_gbps)} [{sig(r.lo)}, {sig(r.hi)}]"})
    return md_table(pd.DataFrame(rows))


BLOCKS = {"table": _table, "breakeven": _breakeven_table}
