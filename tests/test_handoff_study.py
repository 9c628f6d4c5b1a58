"""The handoff study's face (kvlab.studies.handoff): its check resolves "auto" and refuses bad combinations in one
line before anything is written; measure writes raw tables only; analyse, run on what measure wrote, gives the
notebook's tables and both figures, and the same again from the run folder (what kvlab analyse reads); its
published tables come from the analyses of committed runs."""

from __future__ import annotations

import matplotlib
import pandas as pd
import pytest

from kvlab import report, results, studies
from kvlab.studies import handoff as study
from kvlab.studies.handoff import analysis as ha

matplotlib.use("Agg")


@pytest.fixture
def cpu(monkeypatch):
    monkeypatch.setenv("KVLAB_PRESET", "cpu")


def test_auto_is_resolved_for_the_machine_and_the_experiment_gets_it(cpu):
    cfg = study.check({"policy": "Deadline"})
    assert cfg.model == "kvlab-tiny" and cfg.device == "cpu" and cfg.contexts == [32, 128]
    assert cfg.destinations == ["same-gpu"]  # "auto" drops pageable for a policy other than eager
    assert cfg.policy == "deadline" and cfg.attribution and cfg.ceiling_sizes == [2**20, 4 * 2**20]
    h = cfg.handoff()
    assert (h.contexts, h.short_context, h.policy, h.point, h.interleave_short) == ([32, 128], 32, "deadline", "cache", 30)
    eager = study.check({"contexts": "1k,2048", "attribution": "off", "destinations": "pageable"})
    assert eager.contexts == [1024, 2048] and not eager.attribution and eager.destinations == ["pageable"]


@pytest.mark.parametrize("given, says", [
    ({"policy": "deadline", "destinations": "same-gpu,pageable"}, "policy = 'deadline' cannot send to 'pageable'"),
    ({"policy": "batch:9"}, "policy = 'batch:9': N must be an int in 1…2 (kvlab-tiny has 2 layers)"),
    ({"repeats": "auto"}, "repeats = 'auto': this parameter has no automatic value"),
    ({"repeats": 0}, "repeats = 0: give an int ≥ 1"),
    ({"destinations": "cuda:3"}, "destination 'cuda:3' does not exist"),
    ({"contexts": "1024,4O96"}, "'4O96' is not a token count"),
    ({"point": "mlp"}, "point = 'mlp' is not valid; valid: cache, attention"),
    ({"attribution": "on"}, "attribution = 'on' is not valid; valid: auto, off"),
    ({"ceiling_sizes": "1Q"}, "ceiling_sizes = '1Q'"),
    ({"model": "qwen2.5-7"}, "did you mean 'qwen2.5-7b'"),
])
def test_bad_values_and_combinations_are_one_line_before_anything_is_written(cpu, kvlab_dirs, given, says):
    with pytest.raises(ValueError) as err:
        study.check(given)
    assert says in str(err.value) and "\n" not in str(err.value)
    assert not kvlab_dirs.data.exists()


def test_measure_writes_raw_tables_and_analyse_gives_what_the_notebook_shows(cpu, kvlab_dirs):
    given = {"contexts": "16,24", "destinations": "same-gpu,pageable", "repeats": 1, "warmup": 0,
             "decode_tokens": 2, "interleave_short": 3, "interleave": 1, "attribution_rounds": 3}
    cfg = study.check(given)
    run = results.start(study.NAME, given)
    study.measure(cfg, run)
    raw = run.tables()
    assert set(raw) == {"ceilings", "results", "checks", "attribution_rounds"}  # nothing derived
    res = run.record["resolved"]
    assert res["layers"] == 2 and res["ceiling_paths"] == {"same-device": "h2h", "pageable-host": "h2h"}
    assert res["ceiling_sweep"]["n"] == 9 and "ceilings" not in run.record

    a = study.analyse(run.record, raw)
    assert {"summary", "predictions", "ceiling_fit", "attribution"} <= set(a.tables)
    assert list(a.tables["summary"].context) == [16, 16, 24, 24]
    assert {"fit, 1 copy", "fit, 4 copies"} <= set(a.tables["predictions"].model)  # 2 × 2 layers
    assert len(a.goals) and set(a.goals.verdict) <= {"met", "missed", "not resolved"}
    assert a.findings[0].startswith("All 10 correctness checks identical")
    assert a.fields["ceilings"]["paths"]["h2h"]["path"] == "h2h" and a.fields["ceilings"]["meta"]["n"] == 9
    assert a.values["16.same-device.copy_ms"] == ha.values(a.tables["summary"], None, None)["16.same-device.copy_ms"]
    figs = study.figures(a)
    assert list(figs) == list(study.FIGURES)  # both notebook figures, from the same analysis
    ttft = [t.get_text() for t in figs["handoff_ttft"].legends[0].get_texts()]
    assert any("predicted by the run's fitted link model" in t for t in ttft)

    run.save_analysis(a)
    run.finish()
    again = studies.analyse_run(run.dir)  # what kvlab analyse and kvlab report read: the folder, from disk
    for name in ("summary", "predictions", "attribution"):
        pd.testing.assert_frame_equal(again.tables[name], a.tables[name], check_dtype=False)
    pd.testing.assert_frame_equal(again.goals, a.goals, check_dtype=False)


def test_published_tables_come_from_the_analyses_of_committed_runs():
    runs = ["handoff/20261201-092005-h200", "handoff/20261201-092144-h200", "handoff/20261201-092404-h200"]
    analyses = [report.analysis(r) for r in runs]
    assert study.goal_table(analyses[0], "handoff") is analyses[0].goals
    text = study.BLOCKS["goals_side_by_side"](analyses, link=str, labels=["eager", "deadline", "x"])
    head = text.splitlines()[0]
    assert "eager (092005)" in head and "deadline (092144)" in head and "x (092404)" in head
    pol = study.BLOCKS["policies"](analyses, link=str, labels=["", "", ""])
    assert "eager extra ms [95 % interval] (20261201-092005-h200)" in pol.splitlines()[0]
    ref = study.BLOCKS["table_with_reference"](analyses[:1], link=str, labels=[""])
    assert "H100 bulk" in ref.splitlines()[0] and "| 32k | 1,792 | peer-cuda:1 |" in ref
    with pytest.raises(FileNotFoundError, match="has no results.csv"):
        study.analyse({"run_id": "x"}, {})
