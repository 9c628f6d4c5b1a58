"""The disagg study of one shape (kvlab.studies.disagg): its checks refuse bad input in one line, its analysis of
the committed runs gives back what they committed, `kvlab analyse` redraws both of the notebook's figures, and the
library writes summary.json without the study (kvlab.disagg.summary). CPU only, no process started."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from kvlab import analyse, disagg, report, studies
from kvlab.disagg import summary as dsummary
from kvlab.studies import disagg as study
from kvlab.studies.disagg import command

DATA = Path(__file__).resolve().parent.parent / "data" / "disagg"
ONE_GPU = DATA / "20261130-174816-h200"  # ipc, one H200, with a bench and a committed analysis (at 2d297fa)
CAMPAIGN = DATA / "20261201-024052-h200"  # nccl, a fault campaign with checksums
NIXL_H200 = DATA / "20261201-023701-h200"  # nixl: its summary says tcp/lo, its prefill log cuda_ipc/cuda


def _same(new: pd.DataFrame, old: pd.DataFrame) -> None:
    assert len(new) == len(old) and list(new.columns) == list(old.columns)
    for col in old.columns:
        a, b = new[col], old[col]
        if a.dtype.kind in "fi" and b.dtype.kind in "fi":
            assert np.allclose(a.astype(float), b.astype(float), rtol=1e-12, atol=0, equal_nan=True), col
        else:
            assert a.fillna("").astype(str).tolist() == b.fillna("").astype(str).tolist(), col


def test_the_analysis_of_a_committed_run_gives_back_its_committed_analysis(tmp_path):
    """kvlab analyse at 2d297fa wrote summary.csv and goals.csv for this run; the study's analyse, run on a CPU from
    the run's raw tables and run.json, gives them back, with the same findings."""
    (old,) = (ONE_GPU / "analysis").iterdir()
    out = analyse.analyse(ONE_GPU, tmp_path / "a")
    for name in ("summary", "goals"):
        _same(pd.read_csv(out / f"{name}.csv"), pd.read_csv(old / f"{name}.csv"))
    meta, before = (json.loads((d / "analysis.json").read_text()) for d in (out, old))
    assert meta["findings"] == before["findings"] and len(before["findings"]) == 7
    assert meta["figures"] == ["disagg_ttft.png"] and (out / "disagg_ttft.png").is_file()


def test_the_bench_the_analysis_reads_is_the_one_summary_json_holds():
    a = studies.analyse_run(ONE_GPU)
    held = pd.DataFrame(json.loads((ONE_GPU / "summary.json").read_text())["bench"])
    _same(a.tables["bench_summary"], held)
    assert a.values["paged.32k.send_pct_of_ceiling"] == "83.8 [83.5, 84.9]"


def test_a_campaign_is_reanalysed_with_both_of_the_notebooks_figures_and_its_goals(tmp_path):
    out = analyse.analyse(CAMPAIGN, tmp_path / "c")
    meta = json.loads((out / "analysis.json").read_text())
    assert meta["figures"] == ["disagg_ttft.png", "faults.png"]
    assert {"summary.csv", "fault_summary.csv", "checksum_cost.csv", "fault_goals.csv", "goals.csv"} == set(meta["tables"])
    fg = pd.read_csv(out / "fault_goals.csv")
    assert fg.id.tolist() == ["faults.count", "faults.no_partial_decode", "faults.handled", "faults.deadline"]
    faults = pd.read_csv(CAMPAIGN / "faults.csv")
    assert pd.read_csv(out / "fault_summary.csv")["faults"].sum() == len(faults)
    with pytest.raises(ValueError, match="draws disagg_ttft, faults"):
        analyse.analyse(CAMPAIGN, tmp_path / "d", only=["ttft"])


def test_goal_tables_of_the_verdicts():
    a = studies.analyse_run(ONE_GPU)
    g = study.goal_table(a, "disagg")
    ident = g[g.id == "disagg.identical"]
    assert len(ident) == 1 and ident.layout.iloc[0] == "every request" and ident.context.isna().all()
    assert (a.goals.id == "disagg.identical").sum() == 1 and a.goals.layout.ne("every request").all()  # not changed
    with pytest.raises(ValueError, match="no fault campaign"):
        study.goal_table(a, "faults")
    with pytest.raises(ValueError, match="'handoff'"):
        study.goal_table(a, "handoff")
    killed = studies.analyse_run(DATA / "20261130-231342-cpu")  # retry with kills: its deadline goal missed
    got = study.goal_table(killed, "faults").set_index("id").verdict
    assert got["faults.deadline"] == "missed" and (got.drop("faults.deadline") == "met").all()


def test_a_stopped_run_has_no_tables_and_its_block_says_how_it_ended():
    a = studies.analyse_run(DATA / "20261201-071759-h200")
    assert a.record["status"] == "failed" and a.tables == {} and len(a.goals) == 0 and study.figures(a) == {}
    text = study.BLOCKS["decode_oom"]([a], link=lambda p: p)
    assert "stopped: decode out of memory" in text and "disagg/20261201-071759-h200" in text


def test_the_nixl_table_reads_the_transport_from_the_prefill_log():
    s = json.loads((NIXL_H200 / "summary.json").read_text())
    assert s["nixl"]["ucx_transports"] == ["cma/memory", "tcp/lo"]  # what the run's parser of then found
    text = report.render("disagg_nixl_gpu")
    assert "cuda_ipc/cuda" in text and "tcp/lo" not in text


@pytest.mark.parametrize("params, says", [
    ({"backend": "ipcx"}, "backend = 'ipcx' is not valid; valid: gloo, ipc, nccl, nixl; did you mean 'ipc'"),
    ({"bench": "maybe"}, "bench = 'maybe' is not valid; valid: auto, on, off"),
    ({"repeats": 0}, "repeats = 0: give an int ≥ 1"),
    ({"policy": "retyr"}, "policy = 'retyr' is not valid; valid: fail, retry, recompute; did you mean 'retry'"),
    ({"contexts": "1k,zero"}, "contexts"),
    ({"layouts": "paged,pagd"}, "layout = 'pagd' is not valid; valid: contiguous, paged"),
    ({"faults": 0, "policy": "retry"}, "--policy set(s) up a fault campaign; add --faults N"),
    ({"repeats": "9"}, "repeats = '9': give a int"),
])
def test_bad_parameters_are_one_line_naming_the_value(params, says, monkeypatch):
    monkeypatch.setenv("KVLAB_PRESET", "cpu")
    with pytest.raises(ValueError) as err:
        study.check(params)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_the_check_resolves_auto_for_a_cpu(monkeypatch):
    monkeypatch.setenv("KVLAB_PRESET", "cpu")
    cfg = study.check({"faults": 0})
    assert isinstance(cfg, study.Config) and (cfg.backend, cfg.model, cfg.contexts) == ("gloo", "kvlab-tiny", (128,))
    assert cfg.devices() == ("cpu", "cpu") and cfg.bench is False and cfg.repeats == 9 and cfg.warmup == 2


def test_the_command_refuses_bad_input_before_any_folder_is_made(tmp_path):
    with pytest.raises(ValueError, match="context"):
        command.main(["--context", "0", "--out", str(tmp_path / "run")])
    assert not (tmp_path / "run").exists()
    finished = tmp_path / "done"
    finished.mkdir()
    (finished / "run.json").write_text(json.dumps({"status": "finished"}))
    with pytest.raises(ValueError, match="holds a finished run"):
        command.main(["--out", str(finished)])


def test_the_library_writes_its_summary_without_the_study(tmp_path):
    """kvlab.disagg.summary.build: summary.json's fields in the order runs have always written them, NaN as null,
    the bench as bench_table's records, the campaign's counts."""
    cfg = disagg.check(disagg.DisaggConfig(backend="gloo", faults=2, policy="retry"))
    row = {"layout": "contiguous", "mode": "bulk", "context": 128, "warmup": False, "prefill_ms": 1.0,
           "ttft_ms": 2.0, "exposed_ms": float("nan"), "tokens_match": True, "logits_equal": True,
           "bytes_equal": True, "first_token_match": True, "poison_left": 0, "bytes_moved": 4096, "kv_bytes": 4096}
    bench = [{"layout": "contiguous", "context": 128, "kind": k, "sample": i, "ms": 1.0 + i, "bytes": 4096,
              "kernel": "copy_"} for k in ("send", "ceiling", "layer") for i in range(3)]
    faults = [{"kind": "drop", "outcome": "recovered", "decoded": True, "bytes_equal": True, "tokens_match": True,
               "logits_equal": True, "detected_by": "deadline", "recover_ms": 9.0},
              {"kind": "corrupt", "outcome": "refused", "decoded": False, "bytes_equal": None, "tokens_match": None,
               "logits_equal": None, "detected_by": "checksum", "recover_ms": 3.0}]
    got = {"rows": [row, dict(row, mode="colocated")], "bench": bench, "faults": faults, "pid": 1, "peer_pid": 2,
           "host": "h"}
    s = dsummary.build(got, cfg, 1.23456, tmp_path)
    assert list(s) == ["backend", "in_order", "processes", "launcher", "prefill_kills", "pids", "host", "model",
                       "context", "contexts", "kv_dtype", "modes", "layouts", "prefill_device", "decode_device",
                       "bytes_moved", "kv_cache_bytes", "requests", "tokens_match", "logits_equal", "bytes_equal",
                       "poison_left", "seconds", "configs", "bench", "faults_injected", "policy", "fault_timeout_s",
                       "decoded_from_partial", "recovered", "refused", "undetected", "slowest_decision_ms",
                       "outcomes_by_kind"]
    assert s["seconds"] == 1.235 and s["requests"] == 1 and s["configs"][0]["mode"] == "bulk"
    assert "exposed_ms" not in s["configs"][0]  # NaN rows are left out of the medians
    assert s["bench"] == dsummary.clean(dsummary.bench_table(pd.DataFrame(bench)).to_dict("records"))
    assert (s["recovered"], s["refused"], s["slowest_decision_ms"]) == (1, 1, 9.0)
    assert json.loads(json.dumps(s)) == s


def test_a_two_gpu_send_is_held_against_its_hosts_best_peer_ceiling_beside_its_own_yardstick():
    """Issue 25: beside disagg.peer_send (a copy of the same bytes in the same run), disagg.peer_send_link holds the
    send against the best peer ceiling the same machine's link_ceilings run measured; declared after the two-GPU
    runs, it is judged beside their goals, and a run on another machine finds no ceiling."""
    from kvlab import host_ceilings

    nccl = DATA / "20261201-092931-h200"
    record = json.loads((nccl / "run.json").read_text())
    peer = host_ceilings.peer_ceiling(record, "cuda:0", "cuda:1")
    assert peer["run"] == "20261201-091906-h200" and peer["path"] == "d2d_peer:0->1"
    assert 390 < peer["gbps"] < 400
    assert host_ceilings.peer_ceiling(record, "cuda:0", "cuda:0") is None  # one GPU: no peer
    other = dict(record, host=dict(record["host"], cpu_count=16))  # the one-GPU host's fingerprint
    assert host_ceilings.peer_ceiling(other, "cuda:0", "cuda:1") is None
    late = dict(record, started_utc="2026-12-03T09:29:32Z")  # the same fingerprint two days on: another machine
    assert host_ceilings.peer_ceiling(late, "cuda:0", "cuda:1") is None
    g = studies.analyse_run(nccl).goals.set_index(["id", "layout"])
    assert g.loc[("disagg.peer_send", "paged"), "verdict"] == "not resolved"  # its own verdict, kept
    assert not g.loc[("disagg.peer_send", "paged"), "later"]
    link = g.loc[("disagg.peer_send_link", "paged")]
    assert link["later"] and link["verdict"] == "missed" and link["value"].startswith("64.6 % [64.1, 65.1]")
    # the one-GPU run has no peer: its goals are as it committed them (the test above), with no later goal
    assert "later" not in studies.analyse_run(ONE_GPU).goals.columns
