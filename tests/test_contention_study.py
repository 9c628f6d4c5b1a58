"""The contention study (kvlab.studies.contention, `kvlab contention`): bad input refused in one line before a folder
is made; a CPU run (threads copying host buffers: the logic only) writes flows.csv, the contention table and
validation.csv, judges its goals and is analysed again the same way; Jain's index is what its definition says."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from kvlab import analyse, goals, studies
from kvlab.cli import main
from kvlab.studies import contention as study


@pytest.mark.parametrize("params,match", [
    ({"flows": "1,4"}, "both must be among them"),
    ({"flows": "1,2,2"}, "distinct flow counts"),
    ({"flows": "1,2,x"}, "distinct flow counts"),
    ({"size": "1K"}, "at least 1M"),
    ({"size": "lots"}, "size = 'lots'"),
    ({"device": "cuda:7"}, "does not exist"),
    ({"repeats": -2}, "give an int ≥ 0"),
])
def test_bad_input_is_one_line_and_names_the_value(params, match):
    with pytest.raises(ValueError, match=match) as e:
        study.check({"device": "cpu", **params})
    assert "\n" not in str(e.value)


def test_jain_is_one_for_equal_flows_and_one_over_n_for_one_taking_all():
    assert study.jain([5, 5, 5, 5]) == pytest.approx(1.0)
    assert study.jain([8, 0, 0, 0]) == pytest.approx(0.25)
    assert 0.25 < study.jain([4, 2, 1, 1]) < 1


def test_a_cpu_run_writes_its_tables_and_validation_and_is_analysed_again_the_same(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["contention", "--device", "cpu", "--flows", "1,2,4", "--size", "2M", "--repeats", "3",
                 "--out", str(out)]) == 0
    assert f"run: {out}" in capsys.readouterr().out
    record = json.loads((out / "run.json").read_text())
    assert record["status"] == "finished" and [g["id"] for g in record["goals"]] == [
        g.id for g in goals.for_study("contention")]
    flows = pd.read_csv(out / "flows.csv")
    assert len(flows) == (1 + 2 + 4) * 3 and (flows.ms > 0).all()
    assert (flows.groupby(["flows", "round"]).round_ms.first() >= flows.groupby(["flows", "round"]).ms.max()).all()
    table = pd.read_csv(out / "contention.csv")
    assert table.flows.tolist() == [1, 2, 4] and (table.aggregate_lo <= table.aggregate_gbps).all()
    v = pd.read_csv(out / "validation.csv")
    assert list(v.columns[:7]) == ["path", "flows", "role", "measured_gbps", "measured_lo", "measured_hi",
                                   "simulated_gbps"]
    assert v.role.tolist() == ["calibrate", "calibrate", "validate"]
    assert set(pd.read_csv(out / "goals.csv").id) == {"contention.sim_each", "contention.sim_median"}
    again = analyse.analyse(out, tmp_path / "again")
    pd.testing.assert_frame_equal(pd.read_csv(again / "contention.csv"), table)
    assert json.loads((again / "analysis.json").read_text())["figures"] == ["contention_gbps.png"]
    assert studies.has_face(study) and "contention" in studies.NAMES
