"""The calculator as a study of the one shape (kvlab.studies.calculator): its check refuses what the notebook would
fail on, its measure gives back the published run's tables, its analyse gives back what that run's notebook
printed, and its kv_table block, figures and `kvlab analyse` read the published run (a CPU run by design)."""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
import numpy as np
import pandas as pd
import pytest

from kvlab import analyse, results, studies
from kvlab.studies import calculator as study
from kvlab.studies.calculator import calcviz

DATA = Path(__file__).resolve().parent.parent / "data"
PUBLISHED = DATA / "calculator" / "20261203-153916-cpu"


@pytest.fixture(scope="module")
def published():
    return studies.analyse_run(PUBLISHED, where="calculator/20261203-153916-cpu")


@pytest.mark.parametrize("params, says", [
    ({"ratio_min_tokens": 4096, "ratio_max_tokens": 128}, "ratio_min_tokens = 4096 > ratio_max_tokens = 128"),
    ({"links": []}, "links = []: give at least one"),
    ({"ratio_models": ["llama-2-7b", "llama-3.2-1b"]}, "ratio_models = ['llama-2-7b', 'llama-3.2-1b']: unknown "
                                                       "model 'llama-3.2-1b'"),
    ({"models": "llama-3.1-8"}, "models = 'llama-3.1-8': unknown model 'llama-3.1-8'; did you mean 'llama-3.1-8b'"),
    ({"exposure_cases": ["llama-2-7b:fp4"]}, "exposure_cases = ['llama-2-7b:fp4']: kv_dtype='fp4' is not known"),
    ({"tp_link": "fast"}, "tp_link = 'fast': link='fast' is not understood"),
    ({"kv_dtype": "fp7"}, "kv_dtype = 'fp7'"),
    ({"tflops": -3}, "tflops = -3: give a finite number > 0"),
    ({"tp_max": 0}, "tp_max = 0: give an int ≥ 1"),
    ({"prompt_tokens": "auto"}, "prompt_tokens = 'auto': the calculator has no automatic value"),
])
def test_check_refuses_in_one_line_what_the_notebook_would_fail_on(params, says):
    with pytest.raises(ValueError) as err:
        study.check(params)
    assert str(err.value).startswith(says) and "\n" not in str(err.value), str(err.value)


def test_check_resolves_the_published_parameters():
    record = json.loads((PUBLISHED / "run.json").read_text())
    cfg = study.check(record["parameters"])
    assert cfg.resolved() == record["resolved"]
    assert cfg.cases == [("llama-2-7b", "bf16"), ("llama-2-7b", "fp8"), ("llama-3.1-8b", "bf16"),
                         ("llama-3.1-70b", "bf16")]
    assert [lk.name for lk in cfg.ratio_links] == ["100G", "400G"] and cfg.tp_link.bytes_per_s == 50e9


def test_measure_gives_back_the_published_tables(tmp_path):
    """The published run's parameters, worked out again by this code: the same kv_table.csv and results.csv."""
    record = json.loads((PUBLISHED / "run.json").read_text())
    run = results.start(study.NAME, record["parameters"], tmp_path / "run")
    study.measure(study.check(record["parameters"]), run)
    assert run.record["resolved"] == record["resolved"]
    for name in ("kv_table", "results"):
        new, old = pd.read_csv(run.dir / f"{name}.csv"), pd.read_csv(PUBLISHED / f"{name}.csv")
        assert list(new.columns) == list(old.columns) and len(new) == len(old), name
        for col in old.columns:
            a, b = new[col], old[col]
            if a.dtype.kind in "fi" and b.dtype.kind in "fi":
                assert np.allclose(a, b, rtol=1e-12, equal_nan=True), (name, col)
            else:
                assert a.fillna("").astype(str).tolist() == b.fillna("").astype(str).tolist(), (name, col)


def _markdown_outputs(path: Path) -> list[str]:
    nb = nbformat.read(str(path), as_version=4)
    return [o["data"]["text/markdown"] for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if "data" in o and "text/markdown" in o["data"]]


def test_analyse_says_what_the_published_notebook_printed(published):
    """Every finding the published run's notebook displayed (its committed executed copy), line for line."""
    before = [ln for text in _markdown_outputs(PUBLISHED / "00_calculator.ipynb") for ln in text.splitlines()
              if ln.strip()]
    assert len(before) > 10
    assert [ln for ln in published.findings if ln.strip()] == before
    assert published.values["kv_per_token.llama-2-7b"] == "512 KiB"
    assert published.values["link_bound.llama-2-7b:bf16.100G"] == "link-bound"
    assert published.values["exposed_ms.llama-3.1-8b:bf16.100G"] == "2.68"


def test_analyse_tables_come_from_the_run(published):
    kv = published.tables["kv"]
    assert list(kv.columns) == ["model", "attention", "layers × KV heads × dim", "KV / token at 8,192",
                                "KV / token (uncapped)", "8,192-token prompt", "state / sequence", "sliding_layers",
                                "params_b"]
    assert len(kv) == 16 and kv.set_index("model").loc["gemma-2-9b", "8,192-token prompt"] == "1.969 GiB"
    # gpt-oss's 128-token windows halve a token's cost at 8k; a hybrid's state is shown beside its KV
    assert kv.set_index("model").loc["gpt-oss-20b", ["KV / token at 8,192", "KV / token (uncapped)"]].tolist() == [
        "24.38 KiB", "48 KiB"]
    assert kv.set_index("model").loc["qwen3-next-80b-a3b", "state / sequence"] == "74.25 MiB"
    exp = published.tables["exposure_summary"].set_index("case")
    assert exp.loc["llama-2-7b bf16", "link_bound"] and not exp.loc["llama-3.1-8b bf16", "link_bound"]
    tl = published.tables["timelines"]
    assert set(tl["link"]) == {"100G"} and len(tl) == 32 + 32 + 32 + 80  # one row per layer of each case
    tp = published.tables["tp_summary"].set_index("model")
    assert tp.loc["qwen2.5-7b", "query_heads_not_split"] == "8" and tp.loc["deepseek-v3", "attention"] == "mla"


def test_analyse_refuses_a_run_its_arithmetic_no_longer_gives(tmp_path):
    record, tables = results.load(PUBLISHED)
    res = tables["results"].copy()
    row = res.index[(res["finding"] == "exposure_vs_link") & (res["case"] == "llama-2-7b bf16")][0]
    res.loc[row, "exposed_ms"] *= 1.01
    with pytest.raises(ValueError, match="'llama-2-7b bf16': the timeline exposes .* the calculator changed"):
        study.analyse(record, {**tables, "results": res})
    with pytest.raises(FileNotFoundError, match="no results.csv"):
        study.analyse(record, {"kv_table": tables["kv_table"]})


def test_finding_rows_read_back_flags_and_counts_from_the_csv():
    res = pd.read_csv(PUBLISHED / "results.csv")
    tp = calcviz.finding_rows(res, "tp_scaling")
    assert tp["replicated"].dtype == bool and tp["kv_heads"].dtype == np.int64 and len(tp) == 16
    assert "case" not in tp.columns  # the exposure figure's column: NaN on every TP row
    ratio = calcviz.finding_rows(res, "ratio_vs_length")
    assert ratio["beyond_context"].dtype == bool and ratio["beyond_context"].sum() > 0
    with pytest.raises(ValueError, match="finding = 'ratio'"):
        calcviz.finding_rows(res, "ratio")


def test_the_kv_table_block(published):
    block = study.BLOCKS["kv_table"]([published], link=lambda p: p, labels=[""])
    lines = block.splitlines()
    assert lines[0] == ("| model | attention | layers × KV heads × dim | KV per token at 8,192 (bf16) | uncapped | KV "
                        "of a 8,192-token prompt | state per sequence | sliding-window layers | parameters |")
    assert len(lines) == 2 + 16 and block.endswith("\n")
    assert "| llama-2-7b | MHA | 32 × 32 × 128 | 512 KiB | 512 KiB | 4 GiB | — | — | 6.74 B |" in lines
    assert ("| gemma-2-9b | GQA | 42 × 8 × 256 | 252 KiB | 336 KiB | 1.969 GiB | — | 21 of 42 (window 4,096) | 9.24 B |"
            in lines)
    assert ("| deepseek-v3 | MLA | 61 × latent 512+64 | 68.62 KiB | 68.62 KiB | 549 MiB | — | — | 671 B (37.6 B active) |"
            in lines)
    assert ("| jamba-mini-1.5 | GQA | 4 × 8 × 128 + 28 state layers | 16 KiB | 16 KiB | 128 MiB | 15.75 MiB | — | "
            "51.6 B (12.1 B active) |" in lines)


def test_figures_draws_what_it_is_asked_and_refuses_others(published):
    import matplotlib.pyplot as plt

    figs = study.figures(published, ["tp_scaling"])
    assert list(figs) == ["tp_scaling"]
    plt.close(figs["tp_scaling"])
    with pytest.raises(ValueError, match="figure 'ttft'"):
        study.figures(published, ["ttft"])


def test_kvlab_analyse_redraws_every_figure_of_the_notebook(tmp_path):
    out = analyse.analyse(PUBLISHED, tmp_path / "a")
    meta = json.loads((out / "analysis.json").read_text())
    assert meta["figures"] == [f"{n}.html" if n == "calculator_page" else f"{n}.png" for n in study.FIGURES]
    assert (out / "calculator_page.html").is_file()  # the interactive page, beside the pictures
    assert all(issues == [] for issues in meta["readability"].values())
    assert meta["findings"][0].startswith("At 8,192 tokens, per token, **llama-2-7b** stores the most (512 KiB)")
    assert {"kv.csv", "ratio_summary.csv", "tp_summary.csv", "exposure_summary.csv", "timelines.csv"} == set(
        meta["tables"])
