"""Every published figure reads in a blog column (~700 px wide): drawn here from the committed runs it shows,
with the code that would publish it, no text smaller than 6.5 px at that width and no text over other text
(issue 13). kvlab.plots.readability is the yardstick; its own test makes sure it can fail."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402

from kvlab import plots  # noqa: E402

DATA = Path(__file__).resolve().parent.parent / "data"


def _ttft(path, title):
    from kvlab import handoff_report, report

    return handoff_report.plot_ttft(report.handoff_summary(path), title=title)


def _ceilings(run):
    from kvlab import ceilings_fit

    d = DATA / "link_ceilings" / run
    return ceilings_fit.plot(pd.read_csv(d / "results.csv"),
                             ceilings_fit.Ceilings.from_json(json.loads((d / "run.json").read_text())["ceilings"]))


def _paged():
    from kvlab import paged_report

    return paged_report.plot_gbps_vs_block_size(pd.read_csv(DATA / "paged_transfer/20261129-103427-h200/results.csv.gz"))


def _access():
    from kvlab import paged_report

    s = paged_report.pattern_summary(pd.read_csv(DATA / "paged_transfer/20261129-103427-h200/access_patterns.csv"))
    return paged_report.plot_patterns(s, title="32,768 tokens, 16-token blocks, same GPU: where the last 5 % goes")


def _events():
    from kvlab import overlap_report

    d = DATA / "overlap_timeline/20261129-114951-h200"
    layers = pd.read_csv(d / "event_layers.csv")
    return overlap_report.event_gantt(layers, overlap_report.prefill_end_of(layers), title="qwen2.5-7b, 1,024 tokens → pinned-host: one round")


def _patterns():
    from kvlab import clocks

    s = clocks.pattern_summary(pd.read_csv(DATA / "overlap_timeline/20261130-145803-h200/pattern_rounds.csv"))
    return clocks.plot_patterns(s, title="32,768 tokens → cuda:1: what each send pattern costs prefill, beside what "
                                         "its SM clock predicts")


def _calculator(which):
    from kvlab import calculator as calc, calcviz

    p = json.loads((DATA / "calculator/20261130-164435-cpu/run.json").read_text())["parameters"]
    if which == "kv_table":
        return calcviz.plot_kv_table(calcviz.kv_table(calcviz.resolve_models(p["models"]), p["prompt_tokens"], p["kv_dtype"]))
    if which == "ratio":
        links = [calc.link(x) for x in p["ratio_links"]]
        df = calcviz.ratio_table(calcviz.resolve_models(p["ratio_models"]), links,
                                 calcviz.powers_of_two(p["ratio_min_tokens"], p["ratio_max_tokens"]), p["kv_dtype"],
                                 p["tflops"])
        return calcviz.plot_ratio(df, p["tflops"])
    if which == "tp":
        return calcviz.plot_tp(calcviz.tp_table(calcviz.resolve_models(p["tp_models"]), p["prompt_tokens"],
                                                calc.link(p["tp_link"]), calcviz.powers_of_two(1, p["tp_max"]),
                                                p["kv_dtype"], p["tflops"]))
    links = [calc.link(x) for x in p["links"]]
    cases = [calcviz.parse_case(c) for c in p["exposure_cases"]]
    exp = calcviz.exposure_table(p["exposure_cases"], links, p["prompt_tokens"], p["tflops"])
    timelines = {f"{m} {d}": calc.handoff_estimate(m, p["prompt_tokens"], links[0], d, tflops=p["tflops"]).timeline
                 for m, d in cases}
    return calcviz.plot_exposure(exp, timelines, links[0].name)


FIGURES = {
    "handoff_ttft": lambda: _ttft("handoff/20261129-103726-h200", "qwen2.5-7b on 1×H200 (run 20261129-103726-h200): "
                                  "what moving the KV cache adds to the time to first token"),
    "handoff_ttft_nvlink": lambda: _ttft("handoff/20261130-142532-h200", "qwen2.5-7b on 2×H200 (run "
                                         "20261130-142532-h200): what moving the KV cache adds to the time to first token"),
    "gbps_vs_size (1 GPU)": lambda: _ceilings("20261129-091839-h200"),
    "gbps_vs_size (2 GPUs)": lambda: _ceilings("20261130-144545-h200"),
    "gbps_vs_block_size": _paged,
    "access_patterns": _access,
    "event_timeline": _events,
    "patterns": _patterns,
    "kv_table": lambda: _calculator("kv_table"),
    "ratio_vs_length": lambda: _calculator("ratio"),
    "tp_scaling": lambda: _calculator("tp"),
    "exposure_vs_link": lambda: _calculator("exposure"),
}


@pytest.mark.parametrize("name", list(FIGURES))
def test_published_figure_reads_700_px_wide(name):
    plots.style()
    fig = FIGURES[name]()
    plots._set_footer(fig, plots.footer_text("20261129-103726-h200", "NVIDIA H200", "0000000"))
    issues = plots.readability(fig)
    plt.close(fig)
    assert issues == [], f"{name}: " + "; ".join(issues[:5])


def test_the_readability_check_can_fail():
    fig, ax = plt.subplots(figsize=(20, 3))  # 20 inches shown 700 px wide: small text becomes unreadable
    ax.text(0.5, 0.5, "tiny", fontsize=8)
    ax.text(0.5, 0.5, "on top", fontsize=30)
    issues = plots.readability(fig)
    plt.close(fig)
    assert any("'tiny' is" in i for i in issues) and any("overlaps" in i for i in issues)
