"""Every published figure reads in a blog column (~700 px wide): drawn here from the committed runs it shows,
with the code that would publish it, no text smaller than 6.5 px at that width and no text over other text
(issue 13). kvlab.plots.readability is the yardstick; its own test makes sure it can fail."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from kvlab import plots  # noqa: E402

DATA = Path(__file__).resolve().parent.parent / "data"


def _calculator(name):
    from kvlab import studies

    analysis = studies.analyse_run(DATA / "calculator/20261203-153916-cpu")  # its tables, as the notebook reads them
    return studies.get("calculator").figures(analysis, [name])[name]


FIGURES = {  # the calculator's: drawn by notebook 00 (kvlab.studies.calculator.figures), here from its published run
    "kv_table": lambda: _calculator("kv_table"),
    "ratio_vs_length": lambda: _calculator("ratio_vs_length"),
    "tp_scaling": lambda: _calculator("tp_scaling"),
    "exposure_vs_link": lambda: _calculator("exposure_vs_link"),
}

# the published figures kvlab analyse redraws, by the run they come from (as figures/*/*.json name them)
PUBLISHED = json.loads("{}")
for side in sorted((DATA.parent / "figures").glob("*/*.json")):
    meta = json.loads(side.read_text())
    if meta.get("analysis") and not side.with_suffix(".html").is_file():  # a page is read in a browser (test_pages_browser)
        # the name the analysis draws it under (published with a suffix, such as _nvlink, it says so)
        PUBLISHED.setdefault(meta["run"], []).append(meta.get("drawn_as", meta["figure"].removesuffix("_nvlink")))


@pytest.mark.parametrize("run", sorted(PUBLISHED))
def test_published_figures_read_700_px_wide_as_kvlab_analyse_draws_them(run, tmp_path):
    from kvlab import analyse

    out = analyse.analyse(DATA / run, tmp_path / "a")
    issues = json.loads((out / "analysis.json").read_text())["readability"]
    for name in PUBLISHED[run]:
        assert name in issues, f"{run}: the analysis no longer draws {name}"
        assert issues[name] == [], f"{run} {name}: " + "; ".join(issues[name][:5])


def test_the_published_figures_are_the_ones_this_test_checks():
    assert len(PUBLISHED) >= 5, PUBLISHED


@pytest.mark.parametrize("name", list(FIGURES))
def test_published_figure_reads_700_px_wide(name):
    plots.style()
    fig = FIGURES[name]()
    plots.set_footer(fig, plots.footer_text("20261129-103726-h200", "NVIDIA H200", "0000000"))
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
