"""kvlab analyse: a committed run's analysis recomputed from its own tables, into a folder of its own,
on a CPU — here on the two-GPU runs committed under data/."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from kvlab import analyse, cli

DATA = Path(__file__).resolve().parent.parent / "data"
OVERLAP_32K = DATA / "overlap_timeline" / "20261130-142913-h200"
HANDOFF_EAGER = DATA / "handoff" / "20261130-142532-h200"


def test_overlap_run_reanalysed_with_the_clock_term(tmp_path):
    out = analyse.analyse(OVERLAP_32K, tmp_path / "a")
    meta = json.loads((out / "analysis.json").read_text())
    assert meta["source_run"] == OVERLAP_32K.name and meta["study"] == "overlap_timeline"
    assert {"decomposition.csv", "causes.csv", "segments.csv", "backlog.csv", "patterns.csv"} <= set(meta["tables"])
    assert {"decomposition.png", "patterns.png", "clock_timeline.png"} <= set(meta["figures"])
    totals = meta["decomposition_totals"]
    assert totals["clock_term"] and totals["sm_mhz_co"] > totals["sm_mhz_lw"] > 1000
    dec = pd.read_csv(out / "decomposition.csv").set_index("term")
    # the terms still add up to Δwall (the clock only takes its share of the kernel stretch)
    assert abs(dec.loc["unexplained remainder", "ms"]) < 0.05 * dec.loc["Δwall", "ms"]
    pat = pd.read_csv(out / "patterns.csv").set_index("variant")
    # the committed run's own summary, recomputed: every layer to the peer cost prefill time, same-GPU did not
    assert pat.loc["peer, every layer", "extra_lo_ms"] > 10 and pat.loc["same GPU, every layer", "extra_lo_ms"] < 0


def test_handoff_run_reanalysed_with_its_goals(tmp_path):
    out = analyse.analyse(HANDOFF_EAGER, tmp_path / "h")
    goals = pd.read_csv(out / "goals.csv")
    peer = goals[goals.goal == "layer-wise TTFT extra ≤ 0.5 ms over colocated (peer)"]
    assert len(peer) == 1 and peer.met.iloc[0] == False  # noqa: E712 — the eager send missed by ~29 ms
    assert (out / "handoff_ttft.png").is_file()


def test_analyse_refuses_what_it_cannot_read(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a run folder"):
        analyse.analyse(tmp_path)
    (tmp_path / "run.json").write_text(json.dumps({"study": "toy", "status": "finished"}))
    with pytest.raises(ValueError, match="kvlab analyse knows"):
        analyse.analyse(tmp_path)
    (tmp_path / "run.json").write_text(json.dumps({"study": "calculator", "status": "finished"}))
    with pytest.raises(FileNotFoundError, match="no kv_table.csv"):
        analyse.analyse(tmp_path, tmp_path / "a")
    (tmp_path / "run.json").write_text(json.dumps({"study": "handoff", "status": "running"}))
    with pytest.raises(ValueError, match="did not finish"):
        analyse.analyse(tmp_path)
    assert cli.main(["analyse", str(tmp_path / "nowhere")]) == 2


@pytest.mark.parametrize("run", [DATA / "handoff" / "20261129-103726-h200",
                                 DATA / "paged_transfer" / "20261129-114123-h200",
                                 DATA / "swapin" / "20261201-030638-h200",
                                 DATA / "swapin" / "20261201-030223-h200"])  # before the host_layout column
def test_analyse_reproduces_the_committed_summary(run, tmp_path):
    """The analysis, re-run from a GPU run's raw rows on a CPU, gives back the summary that run committed
    (every column it had; the handoff summary has gained columns since, which are extra here)."""
    import numpy as np

    out = analyse.analyse(run, tmp_path / "a")
    new, old = pd.read_csv(out / "summary.csv"), pd.read_csv(run / "summary.csv")
    assert len(new) == len(old) and set(old.columns) <= set(new.columns)
    for col in old.columns:
        a, b = new[col], old[col]
        if a.dtype.kind in "fi" and b.dtype.kind in "fi":
            assert np.allclose(a.astype(float), b.astype(float), rtol=1e-9, atol=1e-12, equal_nan=True), col
        else:
            assert a.fillna("").astype(str).tolist() == b.fillna("").astype(str).tolist(), col


def test_reanalysis_publishes_only_when_asked_and_says_who_drew_it(tmp_path, kvlab_dirs):
    from kvlab import provenance

    analyse.analyse(HANDOFF_EAGER, tmp_path / "quiet")
    assert not kvlab_dirs.figures.exists()
    analyse.analyse(HANDOFF_EAGER, tmp_path / "pub", publish=True, suffix="_nvlink")
    side = json.loads((kvlab_dirs.figures / "handoff" / "handoff_ttft_nvlink.json").read_text())
    assert side["run_id"] == HANDOFF_EAGER.name and side["is_gpu"] is True
    assert side["drawn_by"] == provenance.drawing() and side["analysis"] == str(tmp_path / "pub")
    assert (kvlab_dirs.figures / "handoff" / "handoff_ttft_nvlink.png").is_file()


def test_the_ttft_figure_draws_what_was_measured_and_marks_references_apart():
    import matplotlib

    matplotlib.use("Agg")
    from kvlab import report
    from kvlab.studies.handoff import charts

    one = report.analysis("handoff/20261129-103726-h200").tables["summary"]
    fig = charts.plot_ttft(one)
    def title(ax):
        return "".join(ax.get_title(loc=where) for where in ("left", "center", "right"))

    axes = [ax for ax in fig.axes if title(ax)]
    assert [title(ax) for ax in axes] == ["same-gpu", "pinned-host", "pageable-host"]
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert not any("seed 004" in t for t in labels), "no H100 reference beside one-GPU destinations"
    # a negative median stays negative (no floor on a log axis): 32k same-GPU layer-wise was −1.13 ms
    ys = [y for line in axes[0].lines for y in line.get_ydata()]
    assert min(ys) < -1
    peer = charts.plot_ttft(report.analysis("handoff/20261130-142532-h200").tables["summary"])
    labels = [t.get_text() for t in peer.legends[0].get_texts()]
    assert any("seed 004 on 2×H100" in t and "reference" in t for t in labels)
