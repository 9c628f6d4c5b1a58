"""Link ceilings: how fast is each link of this machine, per copy size? (notebook 01, `kvlab ceilings`)

Every bandwidth kvlab reports elsewhere is shown beside the ceiling of its path measured on the same host: the
best median GB/s a plain copy reaches there. This study times plain copies over a size sweep on every path
(kvlab.ceilings.measure) and fits seed 004's two-part model per copy, time = fixed cost + bytes / bandwidth
(kvlab.ceilings_fit).
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from ... import calculator, ceilings, ceilings_fit, devices, models
from ...results import Run
from ...study import Analysis, Param, check_params, md_table
from ...timing import resolve_device
from ...units import fmt_bytes

__all__ = ["NAME", "NOTEBOOK", "TITLE", "QUESTION", "FIGURES", "PARAMS", "Config", "check", "measure", "analyse", "figures",
           "BLOCKS"]

NAME = "link_ceilings"
NOTEBOOK = "01_link_ceilings"
TITLE = "Link ceilings"
QUESTION = "How fast is each link of this machine, and what does one copy cost before its bytes?"
FIGURES = ("gbps_vs_size",)


def _positive(n: int):
    def check(value, name):
        if value < n:
            raise ValueError(f"{name} = {value!r}: give an int ≥ {n}")
    return check


def _paths(value, name):
    ceilings.resolve_paths(value)


def _sizes(value, name):
    for s in str(value).split(","):
        if s.strip():
            ceilings.parse_size(s.strip())


PARAMS = (
    Param("paths", "str", "auto", 'comma-separated path names, "d2d_peer" for every GPU pair, or "auto" for every path '
          "here", _paths),
    Param("sizes", "str", "auto", 'bytes per copy, e.g. "4K,1M,1G" (binary units); "auto": GPU 4 KiB…1 GiB, CPU 4 '
          "KiB…16 MiB", _sizes),
    Param("repeats", "int", 9, "timed samples per (path, size), after warm-up; publish with 9 or more", _positive(1)),
    Param("warmup", "int", 3, "untimed samples per (path, size) first", _positive(0)),
)


@dataclass(frozen=True)
class Config:
    """What one run measures: path names, sizes in bytes, timed and untimed samples, the device ("cpu" on a CPU
    preset, else None: the current GPU)."""

    paths: list
    sizes: list
    repeats: int
    warmup: int
    device: str | None

    def resolved(self) -> dict:
        return {"paths": self.paths, "sizes_bytes": self.sizes, "device": str(resolve_device(self.device))}


def check(params) -> Config:
    """The run's Config from notebook or command-line values ("auto" resolved for this machine's hardware)."""
    p = check_params(PARAMS, params, NAME)
    # a CPU preset (no GPU here, or KVLAB_PRESET set to cpu) measures the host path only, at small sizes
    device = "cpu" if devices.preset() == "cpu" else None
    return Config(paths=ceilings.resolve_paths(p["paths"], device),
                  sizes=ceilings.resolve_sizes(p["sizes"], resolve_device(device)),
                  repeats=p["repeats"], warmup=p["warmup"], device=device)


def measure(cfg: Config, run: Run) -> None:
    """Time every (path, size) and write the raw samples (results.csv, one row per timed sample)."""
    run.update(resolved=cfg.resolved())
    run.save_table(ceilings.measure(cfg.paths, cfg.sizes, n=cfg.repeats, warmup=cfg.warmup, device=cfg.device),
                   "results")


def analyse(record: dict, tables: dict) -> Analysis:
    """The fit per path (fit.csv), every size against its path's ceiling (sizes.csv), the finding, and what the fit
    predicts for seed 004's case: the Qwen2.5-7B cache of a 32k prompt as 2 × 28 copies against one copy."""
    df = tables["results"]
    fitted = ceilings_fit.fit(df)
    ceil = fitted.ceilings
    spec = models.get("qwen2.5-7b")
    cache = calculator.kv_cache_bytes(spec, 32768)
    copies = 2 * spec.layers  # K and V of every layer, one copy each
    findings = [ceilings_fit.finding_text(df, ceil)]
    values = {}
    for p in ceil.names:
        pc = ceil[p]
        values[f"{p}.ceiling_gbps"] = f"{pc.ceiling_gbps:,.1f}"
        if not pc.has_fit:
            continue
        values[f"{p}.fixed_us"] = f"{pc.fixed_us:.2f}"
        many = ceil.predict_ms(p, cache, copies=copies)
        one = ceil.predict_ms(p, cache, copies=1)
        eff = cache / (many / 1e3) / 1e9
        findings.append(f"- {p}: the 32k cache ({fmt_bytes(cache)}) as {copies} copies is predicted to take "
                        f"{many:.4g} ms against {one:.4g} ms as one copy: {eff:,.4g} GB/s, "
                        f"{100 * ceil.fraction(p, eff):.3g}% of the ceiling.")
    return Analysis(NAME, record, raw=dict(tables),
                    tables={"fit": fitted.table, "sizes": ceilings_fit.summary_table(df, ceil)},
                    findings=findings, values=values, fields={"ceilings": ceil.to_dict()})


def figures(a: Analysis) -> dict:
    """GB/s against copy size, per path, with the fit."""
    df = a.raw["results"]
    return {"gbps_vs_size": ceilings_fit.plot(df, ceilings_fit.fit(df).ceilings)}


def _ceilings_table(analyses: list[Analysis], **_) -> str:
    """Per path of one run: the fit's fixed cost and bandwidth, the ceiling (best median, min–max) and its size."""
    fit = analyses[0].tables["fit"]
    out = pd.DataFrame({
        "path": "`" + fit.path + "`", "mechanism": fit.mechanism,
        "fixed cost per copy (µs, fit)": fit.fixed_us.map(lambda v: f"{v:.2f}"),
        "bandwidth (GB/s, fit)": fit.bandwidth_gbps.map(lambda v: f"{v:,.1f}"),
        "ceiling: best median (GB/s)": [f"{c:,.1f} ({lo:,.1f}–{hi:,.1f})" for c, lo, hi in
                                        zip(fit.ceiling_gbps, fit.ceiling_min_gbps, fit.ceiling_max_gbps)],
        "at size": fit.ceiling_size_bytes.map(lambda b: f"{b / 2**20:,.0f} MiB")})
    return md_table(out)


BLOCKS = {"ceilings": _ceilings_table}
