"""The FP8-wire study (kvlab.studies.wire_dtype, `kvlab wire`): bad input refused in one line before a folder is
made; a CPU run end to end writes the issue's wire table, its rates and break-even bandwidths, judges its goals and
is analysed again the same way by `kvlab analyse`."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from kvlab import analyse, goals, studies
from kvlab.cli import main
from kvlab.studies import wire_dtype as study


@pytest.mark.parametrize("params,match", [
    ({"scales": "per-token-head,per-block"}, "give distinct scale modes"),
    ({"scales": "per-head,per-head"}, "give distinct scale modes"),
    ({"layout": "thd"}, "is not a pool layout"),
    ({"model": "deepseek-v3"}, "MLA latent"),
    ({"device": "cuda:7"}, "does not exist"),
    ({"contexts": "0"}, "contexts"),
    ({"block_size": 0}, "give an int ≥ 1"),
])
def test_bad_input_is_one_line_and_names_the_value(params, match):
    with pytest.raises(ValueError, match=match) as e:
        study.check({"model": "kvlab-tiny", **params})
    assert "\n" not in str(e.value)


def test_a_cpu_run_writes_the_wire_table_rates_and_breakeven_and_is_analysed_again_the_same(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["wire", "--model", "kvlab-tiny", "--context", "64", "--scales", "per-token-head,per-tensor",
                 "--repeats", "3", "--out", str(out)]) == 0
    assert f"run: {out}" in capsys.readouterr().out
    record = json.loads((out / "run.json").read_text())
    assert record["status"] == "finished" and [g["id"] for g in record["goals"]] == [
        g.id for g in goals.for_study("wire_dtype")]
    wire = pd.read_csv(out / "wire.csv")
    issue = ["path", "direction", "context", "wire_dtype", "scales", "ms_median", "ms_lo", "ms_hi", "bytes"]
    assert set(issue) <= set(wire.columns)
    # two scale modes × (quantize d2d, d2h; dequantize d2d, h2d) + bf16 copy × 3 ways + gather × 2
    assert len(wire) == 2 * 4 + 5 and set(wire.wire_dtype) == {"fp8", "bf16"}
    assert (wire.ms_lo <= wire.ms_median).all() and (wire.ms_median <= wire.ms_hi).all()
    fp8 = wire[wire.wire_dtype == "fp8"]
    assert (fp8.bytes < fp8.bf16_bytes).all() and fp8.bf16_copy_ms.notna().all()
    be = pd.read_csv(out / "breakeven.csv")
    assert set(be.scales) == {"per-token-head", "per-tensor"} and (be.lo <= be.breakeven_gbps).all()
    rates = pd.read_csv(out / "wire_rates.csv")
    assert list(rates.columns) == ["kernel", "direction", "context", "scales", "input_gbps", "lo", "hi"]
    again = analyse.analyse(out, tmp_path / "again")
    pd.testing.assert_frame_equal(pd.read_csv(again / "wire.csv"), wire)
    assert json.loads((again / "analysis.json").read_text())["figures"] == ["wire_ms.png"]


def test_the_goals_read_the_wire_table_at_32k_on_the_qwen_shape():
    rows = pd.DataFrame([dict(context=32768, model="qwen2.5-7b", kernel="quantize-gather", direction="d2h",
                              scales="per-token-head", ms_median=18.0, ms_lo=17.9, ms_hi=18.2, input_gbps=2000.0,
                              gbps_lo=1900.0, gbps_hi=2100.0, bytes_ratio=0.52),
                         dict(context=32768, model="qwen2.5-7b", kernel="dequantize-scatter", direction="h2d",
                              scales="per-token-head", ms_median=19.0, ms_lo=18.9, ms_hi=19.5, input_gbps=1.0,
                              gbps_lo=1.0, gbps_hi=1.0, bytes_ratio=0.52),
                         dict(context=4096, model="qwen2.5-7b", kernel="quantize-gather", direction="d2h",
                              scales="per-token-head", ms_median=99.0, ms_lo=98.0, ms_hi=100.0, input_gbps=1.0,
                              gbps_lo=1.0, gbps_hi=1.0, bytes_ratio=0.52)])
    g = goals.evaluate(goals.for_study("wire_dtype"), rows, keys=("context", "kernel", "direction", "scales"))
    got = dict(zip(g.id, g.verdict))
    assert got == {"wire.fp8_d2h": "met", "wire.fp8_h2d": "missed"}  # 4k is not judged; no d2d row here
    assert studies.has_face(study) and "wire_dtype" in studies.NAMES
