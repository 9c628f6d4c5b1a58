"""The re-shard study (kvlab.studies.tp_reshard, `kvlab reshard`): bad input refused in one line before a folder is
made; a CPU run end to end writes the issue's reshard table, judges its goals and is analysed again the same way by
`kvlab analyse`; the summary's ratios and their intervals are what its samples give."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from kvlab import analyse, goals, studies
from kvlab.cli import main
from kvlab.studies import tp_reshard as study
from kvlab.studies.tp_reshard import command


@pytest.mark.parametrize("params,match", [
    ({"pairs": "3-2"}, "pairs: 3-2 for kvlab-tiny"),  # neither divides nor multiplies
    ({"pairs": "1-2,1-2"}, "given twice"),
    ({"pairs": "one-two"}, "is not a pair of TP degrees"),
    ({"pairs": "0-2"}, "is not a pair of TP degrees"),
    ({"layouts": "hnd,thd"}, "thd is not a pool layout"),
    ({"methods": "fused,block-slices"}, "block-slices is not a timed mover"),
    ({"context": "128,256"}, "one context per run"),
    ({"device": "cuda:7"}, "does not exist"),
    ({"repeats": -1}, "give an int ≥ 0"),
    ({"colour": 1}, "unknown parameter 'colour'"),
])
def test_bad_input_is_one_line_and_names_the_value(params, match):
    with pytest.raises(ValueError, match=match) as e:
        study.check({"model": "kvlab-tiny", **params})
    assert "\n" not in str(e.value)


def test_the_command_refuses_bad_input_before_a_folder_is_made(tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["reshard", "--model", "kvlab-tiny", "--pairs", "3-2", "--out", str(out)]) == 2
    assert not out.exists() and "pairs: 3-2" in capsys.readouterr().err


def test_a_cpu_run_writes_the_reshard_table_judges_its_goals_and_is_analysed_again_the_same(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["reshard", "--model", "kvlab-tiny", "--context", "128", "--pairs", "2-1,1-4", "--repeats", "3",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "TP 1→4 nhd" in printed and "shards exact" in printed and f"run: {out}" in printed
    record = json.loads((out / "run.json").read_text())
    assert record["status"] == "finished" and record["study"] == "tp_reshard"
    assert [g["id"] for g in record["goals"]] == [g.id for g in goals.for_study("tp_reshard")]
    rows = pd.read_csv(out / "reshard_rows.csv")
    # every (pair, layout) times its movers and its own same-TP yardstick, 3 rounds each
    assert len(rows) == 2 * 2 * (len(study.METHODS) + 1) * 3 and set(rows.pair) == {"2-1", "1-4"}
    table = pd.read_csv(out / "reshard.csv")
    issue = ["prefill_tp", "decode_tp", "pool_layout", "method", "context", "ms_median", "pct_of_same_tp", "pct_lo",
             "pct_hi"]
    assert set(issue) <= set(table.columns) and len(table) == 2 * 2 * len(study.METHODS)
    assert table.verified.all() and (table.pct_lo <= table.pct_of_same_tp).all()
    assert (table.pct_of_same_tp <= table.pct_hi).all()
    # 4 decode ranks of a model with 2 KV heads: each gets one head, two ranks per head (replicas), so twice the
    # bytes of the cache land, where TP 2 → 1 lands it once
    r14 = table[(table.prefill_tp == 1) & (table.decode_tp == 4)]
    r21 = table[(table.prefill_tp == 2) & (table.decode_tp == 1)]
    assert set(r14.bytes) == {2 * int(r21.bytes.iloc[0])}
    g = pd.read_csv(out / "goals.csv")
    # the rest are judged at 32k; the decode check ran both pairs on both layouts, D processes over gloo
    assert g.id.tolist() == ["tp_reshard.exact", "tp_reshard.tp_decode"] and g.verdict.tolist() == ["met", "met"]
    dc = pd.read_csv(out / "decode_check.csv")
    assert len(dc) == 4 and dc.tokens_match.all() and dc.passed.all() and set(dc.decode_tp) == {1, 4}
    assert "decode (kvlab, gloo): tokens equal" in printed
    again = analyse.analyse(out, tmp_path / "again")
    pd.testing.assert_frame_equal(pd.read_csv(again / "reshard.csv"), table)
    assert json.loads((again / "analysis.json").read_text())["figures"] == ["reshard_pct.png"]


def test_the_summary_ratio_its_interval_and_its_inverse_come_from_the_samples():
    same = [1.0, 1.1, 0.9, 1.0, 1.05]
    moved = [2.0, 2.1, 1.9, 2.0, 2.2]
    rows = pd.DataFrame(
        [dict(pair="1-2", prefill_tp=1, decode_tp=1, pool_layout="hnd", method="same-tp", context=32768, ms=v,
              bytes=10**9, pieces_per_decode_rank=1, predicted_ms=0.8, verified=True, backend="triton") for v in same]
        + [dict(pair="1-2", prefill_tp=1, decode_tp=2, pool_layout="hnd", method="fused", context=32768, ms=v,
                bytes=10**9, pieces_per_decode_rank=2, predicted_ms=1.6, verified=True, backend="triton")
           for v in moved])
    s = study.summarise(rows, "qwen2.5-7b").iloc[0]
    assert s.pct_of_same_tp == pytest.approx(50.0) and s.x_same_tp == pytest.approx(2.0)
    assert s.pct_lo <= 50.0 <= s.pct_hi and s.x_lo == pytest.approx(100 / s.pct_hi)
    assert s.pred_err_pct == pytest.approx(25.0) and s.predicted_pct == pytest.approx(50.0)
    assert s.decode_tp == 2 and s["mode"] == "TP 1→2, fused"
    g = goals.evaluate(goals.for_study("tp_reshard"), study.summarise(rows, "qwen2.5-7b"),
                       keys=("layout", "mode", "context")).set_index("id")
    assert g.loc["tp_reshard.hnd_fused", "verdict"] == "missed"  # 50 % of the same-TP copy, wholly below 90 %
    assert g.loc["tp_reshard.p1d2_one_gpu", "verdict"] == "missed"  # 2× the same-TP time
    assert g.loc["tp_reshard.calculator", "verdict"] == "missed"  # 25 % off the prediction


def test_the_study_has_the_one_shape():
    assert studies.has_face(study) and "tp_reshard" in studies.NAMES


def test_the_shape_goals_judge_only_the_qwen_shape_and_the_calculator_goal_every_row():
    row = dict(pair="1-2", prefill_tp=1, decode_tp=1, pool_layout="hnd", method="same-tp", context=32768, ms=1.0,
               bytes=10**9, pieces_per_decode_rank=1, predicted_ms=1.0, verified=True, backend="triton")
    rows = pd.DataFrame([row, dict(row, method="fused", decode_tp=2, ms=1.02, predicted_ms=1.0)] * 3)
    for model, judged in (("qwen2.5-7b", {"tp_reshard.hnd_fused", "tp_reshard.p1d2_one_gpu"}), ("llama-3.1-8b", set())):
        g = goals.evaluate(goals.for_study("tp_reshard"), study.summarise(rows, model),
                           keys=("layout", "mode", "context"))
        assert set(g.id) == judged | {"tp_reshard.exact", "tp_reshard.calculator"}, model


def test_a_pair_the_decode_checks_model_cannot_split_is_refused_naming_decode_check():
    with pytest.raises(ValueError, match=r"decode_check = 'kvlab-tiny': TP 1-8: .*decode_check = \"\" to skip") as err:
        study.check({"model": "llama-3.1-8b", "context": "256", "pairs": "1-8", "device": "cpu"})
    assert "\n" not in str(err.value)
    assert study.check({"model": "llama-3.1-8b", "context": "256", "pairs": "1-8", "device": "cpu",
                       "decode_check": ""}).decode_check == ""


# ---------------------------------------------------------------------------------------------------- NIXL's movers
from kvlab.paged import reshard, reshard_bench  # noqa: E402
from kvlab.paged.nixl import nixl_missing  # noqa: E402

needs_nixl = pytest.mark.skipif(nixl_missing() is not None and not __import__("os").environ.get("CI"),
                                reason=str(nixl_missing()))


@needs_nixl
def test_a_cpu_run_with_nixl_counts_descriptors_times_them_beside_staging_and_says_what_it_did_not_time(
        tmp_path, capsys, monkeypatch):
    # a cap small enough that an nhd head split's slices (block_size of them per block) are counted, not timed
    monkeypatch.setattr(reshard_bench, "_MAX_NIXL_DESCRIPTORS", 100)
    out = tmp_path / "run"
    assert main(["reshard", "--model", "kvlab-tiny", "--context", "64", "--pairs", "1-2", "--repeats", "3",
                 "--methods", "staging,nixl-staging,nixl-slices", "--decode-check", "", "--out", str(out)]) == 0
    capsys.readouterr()
    table = pd.read_csv(out / "reshard.csv").set_index(["pool_layout", "method"])
    layers = reshard.plan("kvlab-tiny", 1, 2).spec.layers
    for lay in ("hnd", "nhd"):
        r = table.loc[(lay, "nixl-staging")]
        assert r.descriptors_per_request == 2 * layers and r.pieces_per_decode_rank == 2 * layers
        assert r.x_ipc_lo <= r.x_ipc <= r.x_ipc_hi and r.verified and r.post_us > 0
        assert pd.isna(table.loc[(lay, "staging")].x_ipc)  # the yardstick has no ratio to itself
    # hnd: one descriptor per block and layer side (4 blocks of 16 tokens); nhd: over the cap, so counted only
    assert table.loc[("hnd", "nixl-slices")].descriptors_per_request == 2 * layers * 4
    assert ("nhd", "nixl-slices") not in table.index
    nt = pd.read_csv(out / "not_timed.csv")
    assert nt.method.tolist() == ["nixl-slices"] and nt.descriptors.tolist() == [2 * 2 * layers * 4 * 16]
    a = studies.analyse_run(out)
    assert any(f.startswith("- Not timed: nixl-slices for TP 1 → 2 on nhd") for f in a.findings)
    assert any("staging's time" in f and "nixl-staging" in f for f in a.findings)
    block = study.BLOCKS["nixl"]([a], link=str)
    assert "not timed" in block and "nixl-staging" in block


def test_nixl_staging_is_judged_against_staging_which_it_needs(monkeypatch):
    with pytest.raises(ValueError, match="give staging too"):
        study.check({"model": "kvlab-tiny", "methods": "fused,nixl-staging"})
    monkeypatch.setattr(study, "nixl_missing", lambda: "nixl is not installed")
    with pytest.raises(ValueError, match="methods = 'staging,nixl-slices': nixl is not installed"):
        study.check({"model": "kvlab-tiny", "methods": "staging,nixl-slices"})


def test_the_nixl_goals_judge_descriptors_and_the_ratio_to_staging():
    base = dict(pair="1-2", prefill_tp=1, decode_tp=2, pool_layout="hnd", context=32768, bytes=10**9,
                predicted_ms=1.0, verified=True, backend="triton")
    rows = ([dict(base, method="same-tp", decode_tp=1, ms=1.0, pieces_per_decode_rank=1) for _ in range(9)]
            + [dict(base, method="staging", ms=v, pieces_per_decode_rank=56) for v in [1.0, 1.01, 0.99] * 3]
            + [dict(base, method="nixl-staging", ms=v, pieces_per_decode_rank=56, descriptors_per_request=56,
                    post_us=40.0, wait_us=300.0) for v in [1.1, 1.11, 1.09] * 3])
    g = goals.evaluate(goals.for_study("tp_reshard"), study.summarise(pd.DataFrame(rows), "qwen2.5-7b"),
                       keys=("layout", "mode", "context")).set_index(["id", "mode"])
    assert g.loc[("tp_reshard.nixl_descriptors", "TP 1→2, nixl-staging"), "verdict"] == "met"
    assert g.loc[("tp_reshard.nixl_vs_ipc", "TP 1→2, nixl-staging"), "verdict"] == "met"  # 1.1× of staging
    slow = [dict(r, ms=r["ms"] * 1.3) if r["method"] == "nixl-staging" else r for r in rows]
    g = goals.evaluate(goals.for_study("tp_reshard"), study.summarise(pd.DataFrame(slow), "qwen2.5-7b"),
                       keys=("layout", "mode", "context")).set_index(["id", "mode"])
    assert g.loc[("tp_reshard.nixl_vs_ipc", "TP 1→2, nixl-staging"), "verdict"] == "missed"  # 1.43×, wholly above


def test_the_bench_says_why_it_will_not_time_a_mover():
    pl = reshard.plan("qwen2.5-7b", 1, 2)
    assert reshard_bench.refusal("nixl-slices", pl, 32768, 16, "hnd") is None  # 2 × 114,688 descriptors
    why = reshard_bench.refusal("nixl-slices", pl, 32768, 16, "nhd")
    assert "3,670,016 descriptors" in why and "\n" not in why
    assert "host copies" in reshard_bench.refusal("block-slices", pl, 32768, 16, "hnd")
    assert "cannot convert" in reshard_bench.refusal("nixl-slices", pl, 1024, 16, "hnd", "nhd")
