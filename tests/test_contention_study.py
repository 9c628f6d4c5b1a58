"""The contention study (kvlab.studies.contention, `kvlab contention`): bad input refused in one line before a folder
is made; a CPU run (threads copying host buffers: the logic only) writes flows.csv, the contention table and
validation.csv, judges its goals and is analysed again the same way; Jain's index is what its definition says."""

from __future__ import annotations

import json
import os

import pandas as pd
import pytest

from kvlab import analyse, goals, studies
from kvlab.cli import main
from kvlab.paged import nixl_posting
from kvlab.paged.nixl import nixl_missing
from kvlab.studies import contention as study


@pytest.mark.parametrize("params,match", [
    ({"flows": "1,4"}, "both must be among them"),
    ({"flows": "1,2,2"}, "distinct flow counts"),
    ({"flows": "1,2,x"}, "distinct flow counts"),
    ({"size": "1K"}, "at least 1M"),
    ({"size": "lots"}, "size = 'lots'"),
    ({"device": "cuda:7"}, "does not exist"),
    ({"device": "cuda:99999999999999999999"}, "not a device this machine can have"),
    ({"flows": "1,2,01"}, "distinct flow counts"),
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
    table = pd.read_csv(out / "contention.csv")
    assert table.flows.tolist() == [1, 2, 4] and (table.aggregate_lo <= table.aggregate_gbps).all()
    # the aggregate is all the round's bytes over the time until its last flow landed, median over the rounds
    agg = flows.groupby(["flows", "round"]).apply(lambda x: x.bytes.sum() / x.round_ms.iloc[0] / 1e6,
                                                  include_groups=False).groupby("flows").median()
    assert table.set_index("flows").aggregate_gbps.to_dict() == pytest.approx(agg.to_dict())
    assert table.jain_if_serial.round(2).tolist() == [1.0, 0.9, 0.76]
    v = pd.read_csv(out / "validation.csv")
    assert list(v.columns[:7]) == ["path", "flows", "role", "measured_gbps", "measured_lo", "measured_hi",
                                   "simulated_gbps"]
    assert v.role.tolist() == ["calibrate", "calibrate", "validate"]
    assert set(pd.read_csv(out / "goals.csv").id) == {g.id for g in goals.for_study("contention")}
    side = pd.read_csv(out / "beside.csv")  # the compute load alone and beside each of the three configurations
    assert len(side) == (1 + 3) * 3 and (side.compute_ms > 0).all()
    assert (side[side.path == "alone"].copies_ms == 0).all() and (side[side.path != "alone"].copies_ms > 0).all()
    assert record["resolved"]["compute"]["matmuls"] >= 1
    summary = study.beside_summary(side)
    assert summary.flows.tolist() == [1, 2, 4] and (summary.slowdown_lo <= summary.slowdown).all()
    again = analyse.analyse(out, tmp_path / "again")
    pd.testing.assert_frame_equal(pd.read_csv(again / "contention.csv"), table)
    pd.testing.assert_frame_equal(pd.read_csv(again / "compute_beside.csv"), summary, check_dtype=False)
    assert json.loads((again / "analysis.json").read_text())["figures"] == ["contention_gbps.png"]
    assert studies.has_face(study) and "contention" in studies.NAMES


def test_the_goals_judge_validate_rows_only_and_the_interval_goal_reads_the_errors_interval():
    s = pd.DataFrame([dict(path=p, flows=n, aggregate_gbps=g, aggregate_lo=g - 1, aggregate_hi=g + 1, bytes_per_flow=2**28)
                      for p, n, g in (("d2h", 1, 50.0), ("d2h", 2, 50.0), ("h2d", 1, 50.0), ("h2d", 2, 50.0),
                                      ("d2h+h2d", 1, 90.5))])
    v = study.validation(s)
    assert v.role.tolist() == ["calibrate"] * 4 + ["validate"]
    r = v.iloc[-1]  # the joined path: the model predicts the two ceilings' sum, 100 against 90.5 [89.5, 91.5]
    assert r.simulated_gbps == pytest.approx(100, rel=1e-3)
    assert r.abs_error_lo == pytest.approx(100 * (r.simulated_gbps / 91.5 - 1))
    assert r.abs_error_hi == pytest.approx(100 * (r.simulated_gbps / 89.5 - 1))
    g = goals.evaluate(goals.for_study("contention"), v, keys=("path", "flows")).set_index("id")
    assert g.loc["contention.sim_each", "path"] == "d2h+h2d"  # only the validate row is judged
    assert g.loc["contention.sim_each", "verdict"] == "missed"  # 10.5 % as a point value
    assert g.loc["contention.sim_each_interval", "verdict"] == "not resolved"  # 9.3 % … 11.7 %: across 10 %


def test_the_compute_beside_is_its_median_over_the_median_alone_and_off_writes_none(tmp_path):
    rows = [dict(path="alone", flows=0, round=r, compute_ms=10.0, copies_ms=0.0) for r in range(9)]
    rows += [dict(path="d2h", flows=2, round=r, compute_ms=11.0 + (r % 3) * 0.1, copies_ms=20.0) for r in range(9)]
    t = study.beside_summary(pd.DataFrame(rows))
    assert t.slowdown.tolist() == pytest.approx([1.11]) and t.copies_over_compute.tolist() == pytest.approx([20 / 11.1])
    assert t.slowdown_lo.iloc[0] <= 1.11 <= t.slowdown_hi.iloc[0]
    out = tmp_path / "run"
    assert main(["contention", "--device", "cpu", "--flows", "1,2", "--size", "1M", "--repeats", "1", "--beside", "off",
                 "--out", str(out)]) == 0
    assert not (out / "beside.csv").exists() and (out / "flows.csv").is_file()


def test_gate_both_judges_each_gate_against_the_compute_alone_with_the_same_gate():
    rows = [dict(path="alone", flows=0, gate=g, round=r, compute_ms=a, copies_ms=0.0)
            for g, a in (("on", 10.0), ("off", 10.5)) for r in range(9)]
    rows += [dict(path="d2h", flows=2, gate=g, round=r, compute_ms=c, copies_ms=20.0)
             for g, c in (("on", 10.1), ("off", 11.55)) for r in range(9)]
    t = study.beside_summary(pd.DataFrame(rows)).set_index("gate")
    assert t.loc["on", "slowdown"] == pytest.approx(1.01) and t.loc["off", "slowdown"] == pytest.approx(1.1)
    old = study.beside_summary(pd.DataFrame([r for r in rows if r["gate"] == "on"]).drop(columns="gate"))
    assert old.gate.tolist() == ["—"]  # a run from before beside.csv said which gate


@pytest.mark.parametrize("value", ["maybe", "ON"])
def test_a_gate_that_is_not_on_off_or_both_is_one_line(value):
    with pytest.raises(ValueError, match=f"gate = '{value}': give on, off or both"):
        study.check({"gate": value, "device": "cpu"})


def test_nixl_posting_that_is_asked_for_where_nixl_does_not_load_is_one_line(monkeypatch):
    monkeypatch.setattr(study, "nixl_missing", lambda: "nixl is not installed")
    with pytest.raises(ValueError, match="nixl_posting = 'on': nixl is not installed; give auto or off") as e:
        study.check({"nixl_posting": "on", "device": "cpu"})
    assert "\n" not in str(e.value)
    assert study.check({"device": "cpu"}).nixl_posting is False  # auto: off where it does not load, and on a CPU
    with pytest.raises(ValueError, match="nixl_posting = 'yes': give auto, on or off"):
        study.check({"nixl_posting": "yes", "device": "cpu"})


def test_the_posting_summary_is_the_threads_rate_over_one_threads_from_the_rounds_wall_times():
    # one thread: 100 µs a request of 56 descriptors; two threads: 150 µs for both requests (1.33× the rate); four:
    # 400 µs (no faster than one)
    walls = {1: 100.0, 2: 150.0, 4: 400.0}
    rows = pd.DataFrame([dict(threads=t, descriptors=56, round=r, thread=i, post_us=w * (0.5 + 0.5 * (i == 0)),
                              wall_post_us=w + r % 3, done_us=w + 10 + r % 3)
                         for t, w in walls.items() for r in range(9) for i in range(t)])
    s = nixl_posting.summarise(rows).set_index("threads")
    assert s.wall_post_us.to_dict() == pytest.approx({t: w + 1 for t, w in walls.items()})
    assert s.rate_x_one.to_dict() == pytest.approx({1: 1.0, 2: 2 * 101 / 151, 4: 4 * 101 / 401})
    assert (s.rate_x_lo <= s.rate_x_one).all() and (s.rate_x_one <= s.rate_x_hi).all()
    assert s.descriptors_per_s[2] == pytest.approx(1e6 * 2 * 56 / 151)
    # until DONE: each round's DONE is 10 µs after its last post returned
    assert s.done_x_one.to_dict() == pytest.approx({1: 1.0, 2: 2 * 111 / 161, 4: 4 * 111 / 411})
    # a thread's own post time: the median over the round's threads, then over the rounds
    assert s.post_us_per_descriptor[1] == pytest.approx(100 / 56) and s.post_us_per_descriptor[4] == pytest.approx(200 / 56)
    values = {}
    (line,) = nixl_posting.findings(s.reset_index(), values)
    assert values == {"posting.shared-agents.prog.56.rate_x_max": f"{4 * 101 / 401:.2f}",
                      "posting.shared-agents.prog.56.done_x_max": f"{4 * 111 / 411:.2f}",
                      "posting.shared-agents.prog.56.one_us_per_descriptor": "1.8"}
    # rows from before the modes: one shared pair of agents with NIXL's default progress thread
    assert "4 together" in line and "threads through one pair of agents (with NIXL's progress thread)" in line
    # each mode against its own one poster: processes twice as fast alone do not change the threads' ratio
    both = pd.concat([rows.assign(mode="shared-agents"),
                      rows.assign(mode="processes", wall_post_us=rows.wall_post_us / 2)])
    t = nixl_posting.summarise(both).set_index(["mode", "threads"])
    assert t.index.get_level_values(0).unique().tolist() == ["shared-agents", "processes"]  # in MODES' order
    assert t.rate_x_one.to_dict() == pytest.approx({(m, n): x for m in ("shared-agents", "processes")
                                                    for n, x in s.rate_x_one.items()})


@pytest.mark.skipif(nixl_missing() is not None, reason="NIXL does not load here")
def test_a_cpu_run_with_nixl_posting_writes_every_threads_request_and_checks_the_bytes(tmp_path):
    out = tmp_path / "run"
    assert main(["contention", "--device", "cpu", "--flows", "1,2", "--size", "1M", "--repeats", "2", "--beside", "off",
                 "--nixl-posting", "on", "--out", str(out)]) == 0
    rows = pd.read_csv(out / "nixl_posting.csv")
    per = rows.groupby(["mode", "progress_thread", "threads", "descriptors"]).size().to_dict()
    assert per == {(m, False, t, k): 2 * t for m in nixl_posting.MODES for t in (1, 2) for k in nixl_posting.DESCRIPTORS}
    assert (rows.post_us > 0).all() and (rows.wall_post_us >= rows.post_us - 1).all() and (rows.nbytes == 4096).all()
    assert rows.nixl_env.str.contains("UCX_CUDA_IPC_ENABLE_SAME_PROCESS=").all()
    assert pd.read_csv(out / "posting.csv").equals(pd.read_csv(analyse.analyse(out, tmp_path / "again") / "posting.csv"))
    t = pd.read_csv(out / "posting.csv")
    assert len(t) == len(nixl_posting.MODES) * 2 * len(nixl_posting.DESCRIPTORS)
    assert t.done_x_one.notna().all()  # two rounds: too few for its interval
    assert json.loads((out / "run.json").read_text())["resolved"]["nixl_posting"] is True


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(nixl_missing() is not None or not os.path.isdir("/proc/self/task"), reason="NIXL does not load "
                    "here, or no /proc")
def test_posting_with_the_progress_thread_lands_every_request_and_a_closed_link_stops_its_agents():
    from kvlab.paged.nixl import NixlLink
    import torch
    a, b = torch.ones(4096, dtype=torch.uint8), torch.zeros(4096, dtype=torch.uint8)
    NixlLink([a], [b]).close()  # the process-wide threads UCX starts once, before counting
    before = _os_threads()
    link = NixlLink([a], [b])  # two agents, each with its progress thread
    assert _os_threads() > before
    link.close()  # still referenced here: closing, not collecting, must stop them (a phase's posters before the next)
    assert _os_threads() <= before
    rows = nixl_posting.measure((1, 2), (3,), nbytes=4096, rounds=2, modes=("shared-agents", "agents-per-thread"),
                                progress_threads=(True,))
    assert rows.groupby(["mode", "threads"]).size().to_dict() == {(m, t): 2 * t for m in ("shared-agents",
                                                                                      "agents-per-thread") for t in (1, 2)}
    assert rows.progress_thread.all() and (rows.done_us >= rows.wall_post_us).all() and (rows.cpus >= 1).all()
    assert _os_threads() <= before  # every phase's agents and posting threads are gone at the end


@pytest.mark.parametrize("kw,match", [({"threads": (0,)}, "give threads and descriptors ≥ 1"),
                                       ({"modes": ("fast",)}, "give one or more of shared-agents, agents-per-thread")])
def test_nixl_posting_refuses_bad_arguments_in_one_line(kw, match):
    with pytest.raises(ValueError, match=match) as e:
        nixl_posting.measure(**kw)
    assert "\n" not in str(e.value)


def test_a_posting_process_that_dies_is_named_with_its_exit_code_not_waited_for():
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=os._exit, args=(3,))
    proc.start()
    theirs.close()
    procs = object.__new__(nixl_posting._Processes)
    procs.conns, procs.procs = [mine], [proc]
    with pytest.raises(RuntimeError, match="nixl posting process 0 exited with code 3"):
        procs._reply(0)
    assert procs.close() is False  # a dead process cannot say its bytes arrived


def test_a_nixl_request_that_never_finishes_is_an_error_after_the_timeout():
    from kvlab.paged.nixl import NixlLink

    class Stuck:
        def check_xfer_state(self, handle):
            return "PROC"

    link = object.__new__(NixlLink)
    link.progress_thread, link.initiator = True, Stuck()
    with pytest.raises(RuntimeError, match="still in progress after 0.05 s"):
        link.wait(object(), timeout_s=0.05)
