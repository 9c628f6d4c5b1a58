"""The calculator: the KV-cache bill of a prefill → decode handoff, as arithmetic (notebook 00, `kvlab calc`).

From published model configs alone (kvlab.models) it works out how many bytes one prompt's KV cache is, how long
each link takes to move it against the prefill that made it, what tensor parallelism does to each GPU's share,
and what a layer-by-layer send exposes after prefill (kvlab.calculator, kvlab.exposure). Nothing is measured, so
its runs are CPU runs by design. `measure` writes the two tables the notebook always wrote — kv_table.csv (one row
per model) and results.csv (one row per estimate; its `finding` column names the figure) — and `analyse` reads
them back; the per-layer timelines of the exposure figure are worked out again from the run's parameters, and
checked against the run's own exposed times.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

from ... import calculator
from ...parse import name_list
from ...results import Run
from ...study import Analysis, Param, check_params, md_table
from . import calcviz, findings, page

__all__ = ["NAME", "NOTEBOOK", "TITLE", "QUESTION", "FIGURES", "PARAMS", "Config", "check", "measure", "analyse",
           "figures", "BLOCKS", "widget", "start_page"]

NAME = "calculator"
NOTEBOOK = "00_calculator"
TITLE = "The KV-cache calculator"
QUESTION = ("How many bytes does a prompt's KV cache hand from prefill to decode, how long does each link take, "
            "and can a layer-by-layer send hide it under prefill?")
FIGURES = ("kv_table", "ratio_vs_length", "tp_scaling", "exposure_vs_link", page.NAME)


def _named(fn):
    """A Param check from a parse function: its ValueError's first line, with the parameter and value in front."""
    def check(value, name):
        try:
            fn(value)
        except ValueError as err:
            text = str(err).splitlines()[0] if str(err) else repr(err)
            raise ValueError(text if text.startswith(f"{name} = ") else f"{name} = {value!r}: {text}") from None
    return check


def _at_least(n: int):
    def check(value):
        if value < n:
            raise ValueError(f"give an int ≥ {n}")
    return _named(check)


def _positive_number(value):
    if not 0 < value < float("inf"):
        raise ValueError("give a finite number > 0")


def _some(parse):
    """A check of a list parameter: not empty, and every item passes `parse`."""
    def check(value):
        items = [str(x).strip() for x in value if str(x).strip()]
        if not items:
            raise ValueError("give at least one")
        for item in items:
            parse(item)
    return _named(check)


PARAMS = (
    Param("models", "str", "all", 'models of the KV table: comma-separated registry names, or "all" for every '
          "published model in kvlab.models", _named(calcviz.resolve_models)),
    Param("prompt_tokens", "int", 8192, "prompt length (tokens) of the KV table, the TP figure and the exposure figure",
          _at_least(1)),
    Param("kv_dtype", "str", "bf16", "KV element type of the table, ratio and TP figures: fp32, bf16, fp16, fp8, int8",
          _named(calculator.dtype_bytes)),
    Param("tflops", "float", 400.0, "achieved prefill TFLOP/s per GPU (an H100's dense bf16 peak is about 989)",
          _named(_positive_number)),
    Param("links", "list", ["100G", "200G", "400G", "800G", "nvlink-h100"], "links of the exposure figure: presets "
          '(kvlab.calculator.LINKS) or rates such as "50GB/s"', _some(calculator.link)),
    Param("ratio_models", "list", ["llama-2-7b", "llama-3.1-8b", "llama-3.1-70b", "qwen2.5-7b", "deepseek-v3"],
          "models of the ratio-vs-length figure", _some(calcviz.resolve_models)),
    Param("ratio_links", "list", ["100G", "400G"], "links of the ratio figure, one panel each", _some(calculator.link)),
    Param("ratio_min_tokens", "int", 128, "shortest prompt of the ratio sweep (tokens); the sweep doubles from here",
          _at_least(1)),
    Param("ratio_max_tokens", "int", 131072, "longest prompt of the ratio sweep (tokens)", _at_least(1)),
    Param("tp_models", "list", ["llama-2-7b", "llama-3.1-70b", "qwen2.5-7b", "deepseek-v3"], "models of the TP figure",
          _some(calcviz.resolve_models)),
    Param("tp_link", "str", "400G", "the NIC each GPU sends over in the TP figure (rail-optimised: one NIC per GPU)",
          _named(calculator.link)),
    Param("tp_max", "int", 8, "largest TP degree; the sweep is 1, 2, 4, … up to it", _at_least(1)),
    Param("exposure_cases", "list", ["llama-2-7b:bf16", "llama-2-7b:fp8", "llama-3.1-8b:bf16", "llama-3.1-70b:bf16"],
          '"model:kv_dtype" lines of the exposure figure', _some(calcviz.parse_case)),
    Param("interactive", "bool", True, "in a live JupyterLab kernel, show the ipywidgets calculator at the end"),
)

_HELP = {p.name: p.help for p in PARAMS}


@dataclass(frozen=True)
class Config:
    """One run's estimates: registry names per figure, links parsed (kvlab.calculator.Link), the ratio sweep's prompt
    lengths and the TP degrees (powers of two), the exposure cases as given ("model:kv_dtype") and parsed
    ((registry name, kv dtype)); prompt_tokens in tokens, tflops achieved per GPU."""

    models: list
    prompt_tokens: int
    kv_dtype: str
    tflops: float
    links: list
    ratio_models: list
    ratio_links: list
    ratio_tokens: list
    tp_models: list
    tp_link: calculator.Link
    tps: list
    exposure_cases: list
    cases: list
    interactive: bool

    def resolved(self) -> dict:
        """What run.json records as resolved: the table's models, the sweeps, and each exposure link's rate."""
        return {"models": self.models, "ratio_tokens": self.ratio_tokens, "tp": self.tps,
                "links_bytes_per_s": {lk.name: lk.bytes_per_s for lk in self.links}}


def check(params) -> Config:
    """The run's Config from notebook or command-line values; ValueError (one line) for the first bad one."""
    p = check_params(PARAMS, params, NAME)
    auto = next((n for n, v in p.items() if v == "auto"), None)
    if auto is not None:  # nothing here depends on the hardware, so no value is resolved by it
        raise ValueError(f"{auto} = 'auto': the calculator has no automatic value; give one ({_HELP[auto]})")
    lo, hi = p["ratio_min_tokens"], p["ratio_max_tokens"]
    if lo > hi:
        raise ValueError(f"ratio_min_tokens = {lo} > ratio_max_tokens = {hi}: the sweep runs from the first up to the "
                         "second")
    cases = name_list(p["exposure_cases"])
    return Config(models=calcviz.resolve_models(p["models"]), prompt_tokens=p["prompt_tokens"],
                  kv_dtype=p["kv_dtype"], tflops=float(p["tflops"]),
                  links=[calculator.link(x) for x in name_list(p["links"])],
                  ratio_models=calcviz.resolve_models(name_list(p["ratio_models"])),
                  ratio_links=[calculator.link(x) for x in name_list(p["ratio_links"])],
                  ratio_tokens=calcviz.powers_of_two(lo, hi),
                  tp_models=calcviz.resolve_models(name_list(p["tp_models"])), tp_link=calculator.link(p["tp_link"]),
                  tps=calcviz.powers_of_two(1, p["tp_max"]), exposure_cases=cases,
                  cases=[calcviz.parse_case(c) for c in cases], interactive=p["interactive"])


def measure(cfg: Config, run: Run) -> None:
    """Work out every estimate: kv_table.csv (one row per model) and results.csv (the ratio, TP and exposure figures'
    rows, its `finding` column naming which)."""
    run.update(resolved=cfg.resolved())
    run.save_table(calcviz.kv_table(cfg.models, cfg.prompt_tokens, cfg.kv_dtype), "kv_table")
    ratio = calcviz.ratio_table(cfg.ratio_models, cfg.ratio_links, cfg.ratio_tokens, cfg.kv_dtype, cfg.tflops)
    tp = calcviz.tp_table(cfg.tp_models, cfg.prompt_tokens, cfg.tp_link, cfg.tps, cfg.kv_dtype, cfg.tflops)
    exp = calcviz.exposure_table(cfg.exposure_cases, cfg.links, cfg.prompt_tokens, cfg.tflops)
    run.save_table(pd.concat([ratio, tp, exp], ignore_index=True), "results")


def _need(tables: dict, name: str) -> pd.DataFrame:
    if name not in tables:
        raise FileNotFoundError(f"this calculator run has no {name}.csv: its analysis reads kv_table.csv and "
                                "results.csv")
    return tables[name]


def analyse(record: dict, tables: dict) -> Analysis:
    """The KV table as shown, a summary per figure (ratio_summary, tp_summary, exposure_summary), the exposure
    figure's per-layer timelines on its first link (timelines: worked out from the run's parameters, each case's
    exposed time checked against results.csv), the findings, and named values: each model's KV per token
    ("kv_per_token.llama-2-7b") and each case's exposed ms and verdict on the first link
    ("exposed_ms.llama-2-7b:bf16.100G", "link_bound.llama-2-7b:bf16.100G")."""
    kv, res = _need(tables, "kv_table"), _need(tables, "results")
    given = record.get("parameters") or {}
    cfg = check({k: v for k, v in given.items() if k in _HELP})  # a parameter since retired is left out
    ratio, tp, exp = (calcviz.finding_rows(res, f) for f in calcviz.FINDINGS)
    timelines = calcviz.timeline_table(cfg.exposure_cases, cfg.links[0], cfg.prompt_tokens, cfg.tflops)
    derived = {"kv": findings.kv_shown(kv), "ratio_summary": findings.ratio_summary(ratio),
               "tp_summary": findings.tp_summary(tp), "exposure_summary": findings.exposure_summary(exp, timelines),
               "timelines": timelines}
    lines = [*findings.kv_lines(kv), "", *findings.ratio_lines(derived["ratio_summary"]), "",
             *findings.tp_lines(derived["tp_summary"]), "",
             *findings.exposure_lines(derived["exposure_summary"], exp)]
    values = {f"kv_per_token.{r.model}": str(r.kv_per_token) for r in kv.itertuples()}
    for r in derived["exposure_summary"].itertuples():
        case = r.case.replace(" ", ":")  # as exposure_cases writes it, so a key has no space: "llama-2-7b:bf16"
        values[f"exposed_ms.{case}.{r.link}"] = f"{r.exposed_ms:,.2f}"
        values[f"link_bound.{case}.{r.link}"] = "link-bound" if r.link_bound else "keeps up"
    return Analysis(NAME, record, raw=dict(tables), tables=derived, findings=lines, values=values)


def figures(a: Analysis, names=FIGURES) -> dict:
    """The figures `names` (default all of FIGURES) of the analysis: KV per token, the ratio against prompt length,
    per-GPU transfer time against TP, the exposed time against link with each case's per-layer lag, and the
    interactive calculator as a page (kvlab.pages), starting where the notebook's widget starts."""
    bad = [n for n in names if n not in FIGURES]
    if bad:
        raise ValueError(f"figure {bad[0]!r}: the calculator draws {', '.join(FIGURES)}")
    res = a.raw["results"]
    out = {}
    for name in names:
        if name == "kv_table":
            out[name] = calcviz.plot_kv_table(a.raw["kv_table"])
        elif name == "ratio_vs_length":
            ratio = calcviz.finding_rows(res, "ratio_vs_length")
            out[name] = calcviz.plot_ratio(ratio, float(ratio["tflops"].iloc[0]))
        elif name == page.NAME:
            given = a.record.get("parameters") or {}
            out[name] = start_page(check({k: v for k, v in given.items() if k in _HELP}))
        elif name == "tp_scaling":
            out[name] = calcviz.plot_tp(calcviz.finding_rows(res, "tp_scaling"))
        else:
            tl = a.tables["timelines"]
            out[name] = calcviz.plot_exposure(calcviz.finding_rows(res, "exposure_vs_link"), calcviz.timelines_of(tl),
                                              str(tl["link"].iloc[0]))
    return out


def widget(cfg: Config):
    """The interactive calculator (ipywidgets), starting from the run's first exposure case, prompt length, first
    link (a preset; 100G when the first link is a rate) and TFLOP/s."""
    model, tokens, dtype, link, tflops = _start(cfg)
    return calcviz.calculator_widget(model, tokens, dtype, link, tp=1, tflops=tflops)


def _start(cfg: Config) -> tuple:
    """Where the interactive calculators start: the run's first exposure case, prompt length, first link (a preset;
    100G when it is a rate) and TFLOP/s."""
    model, dtype = cfg.cases[0]
    first = cfg.links[0].name
    return model, cfg.prompt_tokens, dtype, first if first in calculator.LINKS else "100G", cfg.tflops


def start_page(cfg: Config):
    """The calculator page (kvlab.studies.calculator.page), starting where the widget starts; a prompt length off
    the page's slider (powers of two in quarter steps, 128 to 128k) starts at the nearest step."""
    model, tokens, dtype, link, tflops = _start(cfg)
    log2 = min(17.0, max(7.0, round(math.log2(tokens) * 4) / 4))
    return page.page(model, round(2 ** log2), dtype if dtype in ("bf16", "fp8") else "bf16", link, 1,
                     min(1000.0, max(50.0, round(tflops / 10) * 10)))


def _params_b(row) -> str:
    total = f"{row.params_b:,.3g} B"
    return total if row.active_params_b == row.params_b else f"{total} ({row.active_params_b:,.3g} B active)"


def _kv_table(analyses: list[Analysis], **_) -> str:
    """Per model of one run's KV table: attention kind, layout, KV bytes per token (at the prompt's length, the
    uncapped figure beside, where the run has both), the KV of one prompt (sliding windows capped), a hybrid's
    per-sequence state, the sliding-window layers and the parameter count."""
    kv = analyses[0].raw["kv_table"]
    tokens, dtype = int(kv["tokens"].iloc[0]), kv["kv_dtype"].iloc[0]
    cols = {"model": kv["model"], "attention": kv["attention"].str.upper(),
            "layers × KV heads × dim": kv["kv_layout"]}
    if "kv_per_token_at_prompt" in kv:  # runs since the hybrid bill: the figure at the prompt leads
        cols[f"KV per token at {tokens:,} ({dtype})"] = kv["kv_per_token_at_prompt"]
        cols["uncapped"] = kv["kv_per_token"]
    else:
        cols[f"KV per token ({dtype})"] = kv["kv_per_token"]
    cols[f"KV of a {tokens:,}-token prompt"] = kv["kv_cache"]
    if "state" in kv:
        cols["state per sequence"] = kv["state"]
    cols["sliding-window layers"] = [f"{int(r.sliding_layers)} of {int(r.layers)} (window {int(r.sliding_window):,})"
                                     if r.sliding_layers else "—" for r in kv.itertuples()]
    cols["parameters"] = [_params_b(r) for r in kv.itertuples()]
    return md_table(pd.DataFrame(cols))


BLOCKS = {"kv_table": _kv_table}
