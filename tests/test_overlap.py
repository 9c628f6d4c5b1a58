"""The overlap study's decomposition (kvlab.studies.overlap_timeline): Δwall decomposed on synthetic two-layer
timelines whose answer is known.

The runs are written as Kineto traces (the categories and args torch.profiler emits) and read back with
kvlab.tracefmt.load_kineto, so these tests go through the same path as a real GPU trace.

Colocated (µs on the GPU, one compute stream 7):
    embed 20–30 | L0: qkv 30–40, attn 40–50, mlp 50–70 | L1: qkv 70–80, attn 80–90, mlp 90–110 | head 110–120
Layer-wise (copies on stream 13 after each layer's attention):
    embed 20–30 | L0: qkv 30–40, attn 40–50, mlp 50–75 (+5, overlaps copy0 51–81)
    L1: qkv 75–85 (overlaps copy0), attn 85–96 (+1, no copy), mlp 99–119 (3 µs idle before; overlaps copy1
    96–141) | head 119–129 | copy1 runs on to 141: exposed tail 12
So Δwall = 5 (inside copy windows) + 1 (outside) + 3 (idle) + 12 (tail) = 21 µs.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pandas as pd
import pytest
import torch

from kvlab import tracefmt
from kvlab.studies import overlap_timeline as study
from kvlab.studies.overlap_timeline import decomposition as overlap
from kvlab.studies.overlap_timeline import events, trace
from kvlab.studies.overlap_timeline import report as overlap_report
from kvlab.studies.overlap_timeline.findings import causes, findings
from kvlab.tracefmt import TraceError

US = 1000  # ns


def _num(ns):
    return f"__NUM__{ns // 1000}.{ns % 1000:03d}"


def _write(path, events):
    doc = {"schemaVersion": 1, "traceEvents": events}
    path.write_text(re.sub(r'"__NUM__([0-9.]+)"', r"\1", json.dumps(doc)))
    return tracefmt.load_kineto(path)


def _x(cat, name, start_us, dur_us, pid, tid, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": _num(int(start_us * US)),
            "dur": _num(int(dur_us * US)), "args": args}


NAMES = ["embed", "qkv", "attn", "mlp", "qkv", "attn", "mlp", "head"]
# host launch times (µs) of the 8 compute ops; layer ranges 10–60 and 60–110, sends 16–20 and 66–70
LAUNCH = [5, 12, 14, 22, 62, 64, 72, 115]


def run_events(tmp_path, name, gpu, copies=(), layer_ranges=True, send_ranges=True, copy_name=None,
               copy_stream=13, copy_kind="memcpy", copy_launch=(17, 67), extra_compute=(), region=None,
               launch_thread=1):
    """A run: host ranges + one runtime call per GPU op; gpu = [(start, end)] of the 8 compute ops,
    copies = [(start, end, bytes)] issued from the send hooks; region = (start, dur) of kvlab/region."""
    T, ev = 1, []
    if region is not None:
        ev.append(_x("user_annotation", "kvlab/region", region[0], region[1], 9, T))
    if layer_ranges:
        ev += [_x("user_annotation", "kvlab/layer0", 10, 50, 9, T), _x("user_annotation", "kvlab/layer1", 60, 50, 9, T)]
    if send_ranges and copies:
        ev += [_x("user_annotation", "kvlab/send0", 16, 4, 9, T), _x("user_annotation", "kvlab/send1", 66, 4, 9, T)]
    corr = 1
    for (s, e), n, at in zip(list(gpu) + list(extra_compute), NAMES + ["extra"] * len(extra_compute),
                             LAUNCH + [116] * len(extra_compute)):
        ev.append(_x("cuda_runtime", "cudaLaunchKernel", at, 0.5, 9, launch_thread, correlation=corr))
        ev.append(_x("kernel", f"void {n}_kernel()", s, e - s, 0, 7, device=0, stream=7, correlation=corr))
        corr += 1
    for (s, e, nbytes), at in zip(copies, copy_launch):
        ev.append(_x("cuda_runtime", "cudaMemcpyAsync", at, 1, 9, T, correlation=corr))
        if copy_kind == "memcpy":
            ev.append(_x("gpu_memcpy", copy_name or "Memcpy DtoH (Device -> Pinned)", s, e - s, 0, copy_stream,
                         device=0, stream=copy_stream, correlation=corr, bytes=nbytes))
        else:
            ev.append(_x("kernel", copy_name or "void at::native::direct_copy_kernel_cuda()", s, e - s, 0,
                         copy_stream, device=0, stream=copy_stream, correlation=corr))
        corr += 1
    return _write(tmp_path / f"{name}.json", ev)


CO_GPU = [(20, 30), (30, 40), (40, 50), (50, 70), (70, 80), (80, 90), (90, 110), (110, 120)]
LW_GPU = [(20, 30), (30, 40), (40, 50), (50, 75), (75, 85), (85, 96), (99, 119), (119, 129)]
LW_COPIES = [(51, 81, 3_000_000), (96, 141, 4_500_000)]


@pytest.fixture
def pair(tmp_path):
    co = run_events(tmp_path, "co", CO_GPU)
    lw = run_events(tmp_path, "lw", LW_GPU, LW_COPIES)
    return co, lw


def test_decomposition_matches_the_constructed_answer(pair):
    co, lw = pair
    d = overlap.decompose(co, lw, ceiling_gbps=200.0)
    t = d.totals
    assert t["wall_source"] == "trace"
    assert (t["wall_co_ns"], t["wall_lw_ns"], t["delta_wall_ns"]) == (100 * US, 121 * US, 21 * US)
    assert (t["kernel_inside_ns"], t["kernel_outside_ns"], t["idle_ns"], t["tail_ns"]) == (5 * US, 1 * US, 3 * US, 12 * US)
    assert t["remainder_ns"] == 0 and t["explained_frac"] == 1.0
    assert (t["ops"], t["ops_inside"]) == (8, 4)  # mlp0, qkv1, mlp1, head overlapped a copy
    # drift from the ops outside copy windows: +1 µs on 40 µs; the 60 µs inside would carry 1.5 µs of it
    assert t["kernel_time_inside_ns"] == 60 * US and t["drift_rate"] == pytest.approx(1 / 40)
    assert t["copy_cost_ns"] == pytest.approx(3.5 * US)
    assert t["engines"] == ["copy engine"] and t["copy_kinds"] == ["DtoH"]
    seg = d.segments.set_index("segment")
    assert list(seg.index) == ["lead-in", "pre", "layer 0", "layer 1", "post", "tail"]
    assert seg.loc["lead-in", "total_ms"] == 0  # trace-derived walls start at the first kernel
    assert seg.loc["layer 0", "kernel_inside_ms"] == pytest.approx(0.005)
    assert seg.loc["layer 1", "kernel_outside_ms"] == pytest.approx(0.001)
    assert seg.loc["layer 1", "idle_ms"] == pytest.approx(0.003)
    assert seg.loc["tail", "tail_ms"] == pytest.approx(0.012)
    assert seg.total_ms.sum() == pytest.approx(0.021)
    summary = d.summary().set_index("term")
    assert summary.loc["exposed tail after the last kernel", "pct_of_delta"] == pytest.approx(100 * 12 / 21)


def test_measured_walls_leave_a_remainder(pair):
    co, lw = pair
    # walls from CUDA events include 2 µs more lead-in for the layer-wise run than the trace can see
    d = overlap.decompose(co, lw, wall_co_ns=104 * US, wall_lw_ns=127 * US)
    t = d.totals
    assert t["wall_source"] == "measured" and t["delta_wall_ns"] == 23 * US
    assert t["remainder_ns"] == 2 * US
    assert t["explained_frac"] == pytest.approx(1 - 2 / 23)
    with pytest.raises(ValueError, match="both"):
        overlap.decompose(co, lw, wall_co_ns=1)


def test_lead_in_before_the_first_kernel_is_a_term_of_its_own(tmp_path):
    # the start events were recorded at 10 µs (colocated) and 0 µs (layer-wise: arming copies first);
    # prefill's first kernel starts at 20 in both, so the layer-wise run has 10 µs more lead-in
    co = run_events(tmp_path, "co_r", CO_GPU, region=(10, 110))
    lw = run_events(tmp_path, "lw_r", LW_GPU, LW_COPIES, region=(0, 141))
    d = overlap.decompose(co, lw, wall_co_ns=110 * US, wall_lw_ns=141 * US)
    t = d.totals
    assert (t["lead_co_ns"], t["lead_lw_ns"], t["lead_ns"]) == (10 * US, 20 * US, 10 * US)
    assert t["delta_wall_ns"] == 31 * US and t["remainder_ns"] == 0
    assert d.segments.set_index("segment").loc["lead-in", "lead_ms"] == pytest.approx(0.010)
    f = findings(d)
    assert f[2].startswith("Next: host work before the first kernel (lead-in) added 10 µs (32 % of Δwall); "
                           "prefill's first kernel started 20 µs after the start event, against 10 µs colocated.")
    # without measured walls the trace's own walls start at the first kernel: no lead-in term
    assert overlap.decompose(co, lw).totals["lead_ns"] == 0
    # the region range attributes nothing: kernels keep their layer ranges
    assert overlap.compute_ops(lw).layer.tolist()[1:7] == [0, 0, 0, 1, 1, 1]


def test_layer_table_windows_lags_rates_and_backlog(pair):
    _, lw = pair
    lt = overlap.layer_table(lw, ceiling_gbps=200.0).set_index("layer")
    # times relative to the trace's first event: the embedding's launch at 5 µs
    assert (lt.loc[0, "compute_start_ns"], lt.loc[0, "compute_end_ns"]) == (25 * US, 70 * US)
    assert lt.loc[0, "kernels"] == 3 and lt.loc[1, "kernels"] == 3
    # layer 0's attention (launched before send0 began at 16 µs) ended at 50; its copy began at 51
    assert lt.loc[0, "last_attn_end_ns"] == 45 * US and lt.loc[0, "start_lag_ns"] == 1 * US
    assert lt.loc[1, "start_lag_ns"] == 0
    assert lt.loc[0, "copy_gbps"] == pytest.approx(100.0) and lt.loc[0, "pct_ceiling"] == pytest.approx(50.0)
    assert lt.loc[0, "backlog_ns"] == 6 * US and lt.loc[1, "backlog_ns"] == 22 * US
    assert lt.loc[0, "engine"] == "copy engine"


def test_backlog_against_the_pipelined_model(pair):
    co, lw = pair
    d = overlap.decompose(co, lw, ceiling_gbps=100.0)
    b = overlap_report.backlog_comparison(d, layer_copy_ms=0.030)
    # colocated layers end at 70 and 110 µs from the first op at 20: 50 and 40 µs of compute
    assert b.compute_ms.tolist() == pytest.approx([0.050, 0.040])
    assert b.measured_backlog_ms.tolist() == pytest.approx([0.006, 0.022])
    # model: ready 50, send 50–80 (backlog 30); ready 90, send 90–120 (30)
    assert b.predicted_backlog_ms.tolist() == pytest.approx([0.030, 0.030])
    assert b.predicted_wait_ms.tolist() == pytest.approx([0.0, 0.0])
    by_bytes = overlap_report.backlog_comparison(d)  # bytes at the 100 GB/s ceiling: 30 and 45 µs
    assert by_bytes.transfer_ms.tolist() == pytest.approx([0.030, 0.045])


def test_predicted_backlog_follows_the_calculator():
    p = overlap_report.predicted_backlog([1.0, 1.0, 1.0], [2.0, 2.0, 2.0])  # link slower than compute
    assert p.send_start_s.tolist() == [1.0, 3.0, 5.0]
    assert p.backlog_s.tolist() == [2.0, 3.0, 4.0] and p.wait_s.tolist() == [0.0, 1.0, 2.0]
    q = overlap_report.predicted_backlog([2.0, 2.0], [0.5, 0.5])  # link keeps up: backlog is one transfer
    assert q.backlog_s.tolist() == [0.5, 0.5]
    # by hand: compute ends at 1, 4, 4.5; sends run 1→3, 4→4.1, 4.5→8.5
    via = overlap_report.predicted_backlog([1.0, 3.0, 0.5], [2.0, 0.1, 4.0])
    assert via.send_end_s.tolist() == pytest.approx([3.0, 4.1, 8.5])
    with pytest.raises(ValueError, match="one compute and one transfer"):
        overlap_report.predicted_backlog([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="finite"):
        overlap_report.predicted_backlog([float("nan")], [1.0])


def test_findings_rank_the_causes_from_the_numbers(tmp_path, pair):
    co, lw = pair
    d = overlap.decompose(co, lw, ceiling_gbps=200.0)
    f = findings(d, overlap_report.backlog_comparison(d, layer_copy_ms=0.03))
    assert f[0].startswith("Layer-wise prefill took 21 µs longer than colocated")
    assert f[1].startswith("The largest cause: exposed tail after the last kernel added 12 µs (57 % of Δwall)")
    assert f[2].startswith("Next: kernels stretched inside copy windows added 5.0 µs")
    assert f[3].startswith("Next: GPU idle gaps (waiting for the host) added 3.0 µs")
    text = " ".join(f)
    assert "copy engine (DtoH)" in text and "50 % of the 200.0 GB/s ceiling" in text
    assert "started a median 0.5 µs after its layer's attention" in text
    d.layers["start_lag_ns"] = -13_100_000  # signalled from the cache: copies start while attention runs
    assert "started a median 13.10 ms before its layer's attention finished" in " ".join(findings(d))
    assert "from 6.0 µs at layer 0 to 22 µs at layer 1 (it rises by less than one layer copy" in text
    assert f[-1] == ("The decomposition explains 100 % of Δwall (walls taken from the trace, so the remainder only "
                     "shows what the matching missed); 0.0 µs is unexplained.")
    # a backlog that climbs by more than one layer's copy is called out as a slow link
    slow = pd.DataFrame({"layer": [0, 1, 2], "transfer_ms": [2.0] * 3, "measured_backlog_ms": [2.0, 4.5, 7.0],
                         "predicted_backlog_ms": [2.0, 4.0, 6.0]})
    assert "the link is slower than compute" in " ".join(findings(d, slow))
    # make the stretch the dominant term: a 30 µs slower MLP under copy0 (copy0 now ends after it)
    lw_gpu = LW_GPU[:3] + [(50, 105), (105, 115), (115, 126), (129, 149), (149, 159)]
    lw2 = run_events(tmp_path, "lw2", lw_gpu, [(51, 111, 3_000_000), (126, 160, 4_500_000)])
    d2 = overlap.decompose(co, lw2)
    assert causes(d2).cause.iloc[0] == "kernels stretched inside copy windows"
    assert findings(d2)[1].startswith("The largest cause: kernels stretched inside copy windows")


def test_sequences_that_differ_are_refused(tmp_path, pair):
    co, _ = pair
    longer = run_events(tmp_path, "lw_extra", LW_GPU, LW_COPIES, extra_compute=[(130, 131)])
    with pytest.raises(TraceError, match="8 vs 9 ops"):
        overlap.decompose(co, longer)
    renamed = run_events(tmp_path, "lw_named", LW_GPU, LW_COPIES)
    renamed.loc[(renamed.kind == "kernel") & (renamed.name == "void attn_kernel()"), "name"] = "void flash_kernel()"
    with pytest.raises(TraceError, match="first difference at op 2"):
        overlap.match_kernels(co, renamed)


def test_a_run_without_hook_ranges_is_refused(tmp_path, pair):
    co, _ = pair
    bare = run_events(tmp_path, "bare", LW_GPU, LW_COPIES, layer_ranges=False, send_ranges=False)
    with pytest.raises(TraceError, match="no kvlab/layer.*ranges=True"):
        overlap.decompose(co, bare)
    # ranges on one thread, kernels launched from another: nothing can be placed in a layer
    elsewhere = run_events(tmp_path, "elsewhere", LW_GPU, LW_COPIES, launch_thread=2)
    with pytest.raises(TraceError, match="none of its compute kernels falls inside one"):
        overlap.decompose(co, elsewhere)


def test_cpu_traces_degrade_with_the_no_gpu_message(tmp_path):
    ev = _write(tmp_path / "cpu.json", [_x("user_annotation", "kvlab/layer0", 0, 10, 9, 1),
                                        _x("user_annotation", "kvlab/send0", 2, 3, 9, 1),
                                        _x("cpu_op", "aten::copy_", 2.5, 2, 9, 1),
                                        _x("cpu_op", "aten::mm", 6, 3, 9, 1)])
    assert not overlap.has_gpu_activity(ev)
    with pytest.raises(overlap.NoGPUActivity, match="no GPU activity in this trace; run on a GPU"):
        overlap.decompose(ev, ev)
    assert overlap.copies(ev).empty
    f = overlap_report.host_findings(ev, ev, wall_co_ms=1.0, wall_lw_ms=1.5)
    assert f[0] == "No GPU activity in this trace; run on a GPU for the timeline."
    assert "+0.50 ms" in f[1] and "send hooks took 0.003 ms of the 0.01 ms" in f[2]


def test_copies_name_the_engine_and_fall_back_to_issue_order(tmp_path, pair):
    co, _ = pair
    sm = run_events(tmp_path, "sm", LW_GPU, [(51, 81, 0), (96, 141, 0)], copy_kind="kernel")
    cp = overlap.copies(sm)
    assert cp.engine.tolist() == ["SM", "SM"] and cp.layer_source.tolist() == ["range", "range"]
    d = overlap.decompose(co, sm)
    assert d.totals["engines"] == ["SM"]
    assert "ran on the SM (kernels)" in " ".join(findings(d))
    # a pageable send issues its copies from a worker thread, outside every send range
    worker = run_events(tmp_path, "worker", LW_GPU, LW_COPIES, copy_launch=(200, 201))
    cw = overlap.copies(worker)
    assert cw.layer.tolist() == [0, 1] and cw.layer_source.tolist() == ["order", "order"]
    dw = overlap.decompose(co, worker)
    assert any("issue order" in s for s in findings(dw))


def test_send_ranges_alone_split_the_layers(tmp_path, pair):
    co, _ = pair
    lw = run_events(tmp_path, "sends_only", LW_GPU, LW_COPIES, layer_ranges=False)
    ops = overlap.compute_ops(lw)
    # launched before send0 began (16 µs): layer 0, embedding included; between send0 and send1 (66):
    # layer 1, layer 0's MLP included; after send1: layer 1's MLP and the head, unassigned
    assert ops.layer.tolist()[:6] == [0, 0, 0, 1, 1, 1] and ops.layer.isna().tolist()[-2:] == [True, True]
    assert ops.segment.tolist()[-2:] == ["post", "post"]
    d = overlap.decompose(co, lw)
    assert d.totals["delta_wall_ns"] == 21 * US and d.totals["remainder_ns"] == 0


def test_figures_draw_gpu_and_cpu_timelines(tmp_path, pair):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    co, lw = pair
    d = overlap.decompose(co, lw)
    fig = overlap_report.gantt_pair(co, lw)
    labels = [t.get_text() for t in fig.axes[1].get_yticklabels()]
    assert labels == ["copy\n(gpu 0, stream 13)", "compute\n(gpu 0, stream 7)"]
    assert {t.get_text() for t in fig.axes[1].texts} == {"L0", "L1"}
    ax = overlap_report.decomposition_chart(d)
    assert len(ax.patches) == 5 * len(d.segments)
    ax2 = overlap_report.backlog_chart(overlap_report.backlog_comparison(d, layer_copy_ms=0.03))
    assert len(ax2.lines) == 3
    cpu = _write(tmp_path / "cpu.json", [_x("user_annotation", "kvlab/layer0", 0, 10, 9, 1),
                                         _x("cpu_op", "aten::mm", 1, 3, 9, 1), _x("cpu_op", "aten::mul", 1.5, 1, 9, 1),
                                         _x("cpu_op", "aten::add", 5, 1, 9, 1)])
    axc = overlap_report.gantt(cpu)
    assert [t.get_text() for t in axc.get_yticklabels()] == ["hook ranges", "host ops\n(thread 1)"]
    plt.close("all")


def test_the_notebooks_gpu_branch_runs_on_a_synthetic_gpu_trace(tmp_path, pair, monkeypatch):
    """The notebook's cells, executed with the study's measurement replaced by a synthetic GPU HandoffTrace and
    event timeline and a GPU configuration: the branch a CPU run never takes must not first fail on the H200."""
    import dataclasses
    from pathlib import Path
    from types import SimpleNamespace

    import matplotlib

    matplotlib.use("Agg")
    import nbformat

    co, lw = pair
    walls = pd.DataFrame([dict(variant=v, traced=t, repeat=0, wall_ms=w, prefill_ms=w, exposed_ms=0.0, t0_ns=t0)
                          for v, t, w, t0 in (("colocated", False, 0.098, 1000), ("layerwise", False, 0.118, 2000),
                                              ("colocated", True, 0.100, 3000), ("layerwise", True, 0.121, 4000))])
    samples = pd.DataFrame({"t_ns": [3000, 4000], "gpu": [0, 0], "sm_mhz": [1500.0, 1400.0], "power_w": [690.0, 700.0]})
    ht = trace.HandoffTrace(colocated=co, layerwise=lw, walls=walls, paths={"colocated": [], "layerwise": []},
                            model="synthetic", context=1024, destination="pinned-host", transport="copy",
                            device="cuda:0", layers=2, bytes_per_layer=3_000_000, kv_bytes=6_000_000,
                            ceiling_gbps=200.0, bulk_copy_ms=0.03, layer_copy_ms=0.03, kept=0,
                            extra={"send_mode": "flag", "clock_samples": samples})
    layers = events.event_table([0.05, 0.09], [0.051, 0.091], [0.081, 0.121], 0.12, 3_000_000)
    # three paired rounds, each 1 µs slower with the events (the analysis recomputes their cost from the rounds)
    ev_rounds = pd.DataFrame([dict(variant=v, round=r, prefill_ms=p, wall_ms=p) for r in range(3)
                              for v, p in (("layer-wise", 0.118), ("layer-wise + events", 0.119))])
    overhead = pd.DataFrame([dict(untimed_ms=0.118, evented_ms=0.119, extra_ms=0.001, extra_ci_lo_ms=0.001,
                                  extra_ci_hi_ms=0.001, overhead_pct=0.85, rounds=3)])
    monkeypatch.setattr(study, "trace_handoff", lambda *a, **k: ht)
    monkeypatch.setattr(study, "event_handoff", lambda *a, **k: events.EventTimeline(
        ev_rounds, layers, overhead, 0.12, "flag, signal from the cache", 3_000_000))
    monkeypatch.setattr(study.models, "build", lambda *a, **k: SimpleNamespace(config=SimpleNamespace(num_hidden_layers=2)))
    monkeypatch.setenv("KVLAB_PRESET", "cpu")
    gpu = dataclasses.replace(study.check({}), model="synthetic", context=1024, destination="pinned", device="cuda",
                              event_timeline=True, send_patterns=False)
    monkeypatch.setattr(study, "check", lambda given: gpu)
    path = Path(__file__).resolve().parent.parent / "notebooks" / "03_overlap_timeline.ipynb"
    code = [c.source for c in nbformat.read(str(path), as_version=4).cells if c.cell_type == "code"]
    ns = {}
    exec(compile(code[0], str(path), "exec"), ns)  # the parameters cell
    ns["run_dir"] = str(tmp_path / "run")
    for source in code[1:]:
        exec(compile(source, str(path), "exec"), ns)
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["status"] == "finished"
    assert record["findings"][1].startswith("The largest cause: exposed tail")
    written = {p.name for p in (tmp_path / "run").glob("*.csv*")}
    assert {"clock_samples.csv.gz", "decomposition.csv", "segments.csv", "layers.csv", "causes.csv", "copies.csv", "backlog.csv",
            "goals.csv", "timeline.csv.gz", "event_rounds.csv", "event_layers.csv", "event_overhead.csv"} <= written
    assert {p.name for p in (tmp_path / "run" / "figures").glob("*.png")} == {
        "timeline.png", "decomposition.png", "backlog.png", "event_timeline.png"}
    goals = pd.read_csv(tmp_path / "run" / "goals.csv")
    # 2.0 % tracing overhead; 100 % explained; the events' 0.85 %
    assert goals.met.tolist() == [True, True, True]
    assert any("per-layer CUDA events added +0.001 ms (+0.85 %" in line for line in record["findings"])
    import matplotlib.pyplot as plt

    plt.close("all")


def test_a_lower_clock_takes_its_share_of_the_stretch(pair):
    co, lw = pair
    t_ns = [0, 200 * US]
    clock_co = pd.DataFrame({"trace_ns": t_ns, "sm_mhz": [1600.0, 1600.0], "power_w": [700.0, 700.0]})
    # the layer-wise run at 10/11 of the clock: every kernel should take 10 % longer on that account alone
    clock_lw = clock_co.assign(sm_mhz=1600.0 * 10 / 11)
    d = overlap.decompose(co, lw, clock_co=clock_co, clock_lw=clock_lw)
    t = d.totals
    assert t["clock_term"] and t["clock_ns"] == 10 * US  # 100 µs of colocated kernel time × 0.1
    assert (t["clock_inside_ns"], t["clock_outside_ns"]) == (6 * US, 4 * US)
    # what is left of the stretch beyond the clock, inside and outside copy windows; the sum is unchanged
    assert (t["kernel_inside_ns"], t["kernel_outside_ns"]) == (-1 * US, -3 * US)
    assert t["remainder_ns"] == 0 and t["delta_wall_ns"] == 21 * US
    assert d.segments.clock_ms.sum() == pytest.approx(0.010)
    summary = d.summary().set_index("term")
    assert summary.loc[overlap.CLOCK_TERM, "ms"] == pytest.approx(0.010)
    assert causes(d).cause.iloc[1] == overlap.CLOCK_TERM  # second to the 12 µs tail
    assert overlap_report.decomposition_chart(d).get_legend_handles_labels()[1][0] == "kernels, lower SM clock"
    # an unchanged clock explains nothing, and one clock without the other is refused
    same = overlap.decompose(co, lw, clock_co=clock_co, clock_lw=clock_co)
    assert same.totals["clock_ns"] == 0 and same.totals["kernel_inside_ns"] == 5 * US
    with pytest.raises(ValueError, match="both clock_co and clock_lw"):
        overlap.decompose(co, lw, clock_co=clock_co)


def test_clock_samples_are_placed_on_a_run_by_its_region(tmp_path):
    lw = run_events(tmp_path, "lw_r", LW_GPU, LW_COPIES, region=(0, 141))
    samples = pd.DataFrame({"t_ns": [1_000_000, 1_050_000, 1_050_000], "gpu": [0, 0, 1],
                            "sm_mhz": [1500.0, 1400.0, 300.0], "power_w": [690.0, 700.0, 80.0]})
    region = lw[(lw.kind == "range") & (lw.name == tracefmt.REGION)].start_ns.min()
    on = overlap.clock_on_trace(samples, 0, 1_000_000, lw)
    assert on.trace_ns.tolist() == [region, region + 50_000] and on.sm_mhz.tolist() == [1500.0, 1400.0]
    assert overlap.clock_on_trace(samples, 0, 0, run_events(tmp_path, "no_region", LW_GPU)).empty


def test_mean_clock_holds_each_reading_until_the_next():
    c = pd.DataFrame({"trace_ns": [0, 100, 300], "sm_mhz": [1000.0, 2000.0, 500.0]})
    assert overlap.mean_clock(c, 0, 400) == pytest.approx((100 * 1000 + 200 * 2000 + 100 * 500) / 400)
    assert overlap.mean_clock(c, 150, 250) == 2000.0
    assert overlap.mean_clock(c, -100, 50) == 1000.0  # before the first reading, the first stands in
    assert overlap.mean_clock(c, 500, 600) == 500.0
    assert np.isnan(overlap.mean_clock(c.iloc[:0], 0, 10))
