"""Provenance: run ids and run.json (kvlab.results), the hardware record (kvlab.devices), figure
publishing and its CPU-never-replaces-GPU rule (kvlab.plots), and the notebook helpers
(kvlab.nbtools)."""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from kvlab import devices, nbtools, paths, plots, provenance, results, runfolder  # noqa: E402

REPO = Path(__file__).resolve().parent.parent

RUN_ID = re.compile(r"^\d{8}-\d{6}-[a-z0-9]+(-\d+)?$")
UTC_STAMP = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z$")

FAKE_H200 = {
    "device_kind": "cuda",
    "device_tag": "h200",
    "host": {"hostname": "gpu-node", "os": "Linux", "cpu_model": "x", "cpu_count": 16,
             "cpu_usable": 16, "memory_bytes": 2**37},
    "devices": [{"index": 0, "name": "NVIDIA H200", "memory_bytes": 150_000_000_000,
                 "compute_capability": "9.0", "sm_count": 132}],
    "p2p": [[None]],
    "driver_version": "580.159.04",
    "cuda_runtime": "13.0",
    "versions": {"python": "3.12.0", "torch": "2.11.0"},
}


@pytest.fixture
def fake_gpu(monkeypatch):
    """Make this machine look like one H200 to kvlab (run ids, run.json, presets)."""
    monkeypatch.setattr(devices, "has_cuda", lambda: True)
    monkeypatch.setattr(devices, "gpus", lambda: FAKE_H200["devices"])
    monkeypatch.setattr(devices, "describe", lambda: json.loads(json.dumps(FAKE_H200)))


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


# ------------------------------------------------------------------------------- run.json


def test_start_writes_run_json_at_once_with_every_field(kvlab_dirs):
    params = {"model": "kvlab-tiny", "contexts": (128, 256), "out": Path("/tmp/x"),
              "repeats": np.int64(9), "ratio": np.float32(0.5), "dtype": torch.bfloat16,
              "device": torch.device("cpu"), "weights": np.arange(3), "missing": float("nan")}
    run = results.start("toy", params)
    assert run.dir.parent == kvlab_dirs.data / "toy"
    assert run.dir.name == run.run_id and RUN_ID.match(run.run_id)
    record = read_json(run.dir / "run.json")
    for key in ("schema", "run_id", "study", "status", "started_utc", "finished_utc", "duration_s",
                "git", "kvlab_version", "device_kind", "device_tag", "host", "devices", "p2p",
                "driver_version", "cuda_runtime", "versions", "parameters", "argv", "invocation"):
        assert key in record, key
    assert record["study"] == "toy" and record["status"] == "running"
    assert UTC_STAMP.match(record["started_utc"]) and record["finished_utc"] is None
    assert {"commit", "dirty", "dirty_paths", "code_sha256"} <= set(record["git"])
    assert record["host"]["hostname"] and record["host"]["cpu_count"] >= 1
    assert record["versions"]["python"].count(".") == 2
    assert record["versions"]["torch"] == torch.__version__
    assert isinstance(record["argv"], list)
    assert record["parameters"] == {
        "model": "kvlab-tiny", "contexts": [128, 256], "out": "/tmp/x", "repeats": 9,
        "ratio": 0.5, "dtype": "torch.bfloat16", "device": "cpu", "weights": [0, 1, 2],
        "missing": "nan"}
    assert isinstance(record["parameters"]["repeats"], int)

    run.finish()
    done = read_json(run.dir / "run.json")
    assert done["status"] == "finished" and UTC_STAMP.match(done["finished_utc"])
    assert done["duration_s"] >= 0
    assert done["started_utc"] == record["started_utc"]
    # what the host did: a reading at each end, and the shares between them
    assert set(done["host_state_start"]) == set(done["host_state_end"]) == {
        "loadavg", "cpu_ticks", "cpu_mhz", "thp", "numa_nodes"}
    usage = done["host_usage"]
    assert usage is None or (set(usage) == {"busy_pct", "iowait_pct", "steal_pct", "ticks"}
                             and 0 <= usage["steal_pct"] <= 100)


def test_cpu_run_is_tagged_cpu(kvlab_dirs, monkeypatch):
    monkeypatch.setattr(devices, "has_cuda", lambda: False)
    run = results.start("toy", {})
    assert run.run_id.endswith("-cpu") and not run.is_gpu
    assert run.record["device_kind"] == "cpu"


def test_gpu_run_is_tagged_with_the_gpu_model(kvlab_dirs, fake_gpu):
    run = results.start("toy", {})
    assert run.run_id.endswith("-h200") and run.is_gpu
    assert run.record["devices"][0]["name"] == "NVIDIA H200"
    assert run.record["driver_version"] == "580.159.04"


def test_forced_cpu_preset_on_a_gpu_host_is_a_cpu_run(kvlab_dirs, fake_gpu, monkeypatch):
    monkeypatch.setenv("KVLAB_PRESET", "cpu")
    run = results.start("toy", {})
    assert run.run_id.endswith("-cpu") and not run.is_gpu


def test_run_id_format_is_utc():
    when = dt.datetime(2026, 11, 29, 10, 30, 12, tzinfo=dt.timezone(dt.timedelta(hours=1)))
    assert results.new_run_id("h200", when) == "20261129-093012-h200"
    with pytest.raises(ValueError, match="H200"):
        results.new_run_id("H200", when)


def test_runs_started_in_the_same_second_get_distinct_folders(kvlab_dirs, monkeypatch):
    monkeypatch.setattr(results, "new_run_id", lambda tag=None, when=None: "20261129-093012-cpu")
    first, second = results.start("toy", {}), results.start("toy", {})
    assert first.run_id == "20261129-093012-cpu"
    assert second.run_id == "20261129-093012-cpu-2"


def test_given_run_dir_is_used_and_named_by_its_folder(tmp_path):
    run = results.start("toy", {"a": 1}, run_dir=tmp_path / "here" / "20260101-000000-cpu")
    assert run.dir == tmp_path / "here" / "20260101-000000-cpu"
    assert read_json(run.dir / "run.json")["run_id"] == "20260101-000000-cpu"


def test_invocation_from_kvlab_run_is_recorded(kvlab_dirs, monkeypatch):
    argv = ["kvlab", "run", "toy", "-p", "size", "4"]
    monkeypatch.setenv("KVLAB_INVOCATION", json.dumps({"argv": argv, "command": "run"}))
    record = results.start("toy", {}).record
    assert record["argv"] == argv and record["invocation"]["command"] == "run"


@pytest.mark.parametrize("study, params, error, match", [
    ("toy", [("a", 1)], TypeError, "mapping"),
    ("toy", {"x": object()}, TypeError, r"params\['x'\].*object"),
    ("toy", {"x": {"deep": [1, {2, object()}]}}, TypeError, r"params\['x'\]\['deep'\]\[1\]"),
    ("toy", {"big": np.zeros(20_000)}, TypeError, "20,000 elements"),
    ("toy", {"t": torch.zeros(200, 100)}, TypeError, "torch tensor"),
    ("toy", {(1, 2): 3}, TypeError, "key"),
    ("Bad-Study", {}, ValueError, "Bad-Study"),
    ("", {}, ValueError, "study name"),
    ("../up", {}, ValueError, "lowercase"),
])
def test_bad_params_are_refused_before_anything_is_written(kvlab_dirs, study, params, error,
                                                             match):
    with pytest.raises(error, match=match):
        results.start(study, params)
    assert not kvlab_dirs.data.exists()


def test_save_table_writes_tidy_csv_and_lists_it(kvlab_dirs):
    run = results.start("toy", {})
    df = pd.DataFrame({"size_bytes": [1024, 2048], "ms": [0.5, 0.75]})
    path = run.save_table(df)
    assert path == run.dir / "results.csv"
    assert pd.read_csv(path).equals(df)
    grouped = df.assign(path=["a", "b"]).groupby("path")["ms"].median()
    named = run.save_table(grouped.to_frame(), "medians.csv")
    assert list(pd.read_csv(named).columns) == ["path", "ms"]  # the named index is data
    filtered = df[df.ms > 0.6]  # an unnamed index is only row numbers: dropped
    assert list(pd.read_csv(run.save_table(filtered, "filtered")).columns) == ["size_bytes", "ms"]
    tables = read_json(run.dir / "run.json")["tables"]
    import hashlib

    digest = hashlib.sha256((run.dir / "results.csv").read_bytes()).hexdigest()
    assert tables["results"] == {"file": "results.csv", "rows": 2, "columns": ["size_bytes", "ms"], "sha256": digest}
    assert set(tables) == {"results", "medians", "filtered"}
    with pytest.raises(ValueError, match="sub/dir"):
        run.save_table(df, "sub/dir")
    with pytest.raises(TypeError, match="list"):
        run.save_table([1, 2])


def test_update_adds_fields_and_guards_provenance(kvlab_dirs):
    run = results.start("toy", {"a": 1})
    run.update(ceilings={"d2d_same": {"gbps": 2000.0}}, resolved={"sizes": (4096, 8192)})
    record = read_json(run.dir / "run.json")
    assert record["ceilings"]["d2d_same"]["gbps"] == 2000.0
    assert record["resolved"]["sizes"] == [4096, 8192]
    with pytest.raises(ValueError, match="git"):
        run.update(git={"commit": "forged"})
    with pytest.raises(TypeError, match="later"):
        run.update(later=object())
    assert read_json(run.dir / "run.json")["git"] == record["git"]


def test_record_execution_marks_a_crashed_run_failed(kvlab_dirs):
    run = results.start("toy", {})
    assert runfolder.record_execution(run.dir, "00_toy.ipynb", False, 1.5, "RuntimeError: x")
    record = read_json(run.dir / "run.json")
    assert record["status"] == "failed"
    assert record["execution"] == {"notebook": "00_toy.ipynb", "ok": False, "seconds": 1.5,
                                   "error": "RuntimeError: x"}
    assert "stopped before it finished (RuntimeError: x)" in (run.dir / runfolder.STOPPED).read_text()
    assert not runfolder.record_execution(kvlab_dirs.data / "nowhere", "x.ipynb", False, 0.0)
    early = kvlab_dirs.data / "toy" / "20261130-000000-cpu"  # failed before start(): no run.json
    early.mkdir(parents=True)
    assert not runfolder.record_execution(early, "00_toy.ipynb", False, 0.2, "interrupted")
    said = (early / runfolder.STOPPED).read_text()
    assert "(interrupted)" in said and f"Folder: {early.resolve()}" in said
    assert "before run.json was written" in said and "run.json says status: failed" not in said
    assert "run.json says status: failed" in (run.dir / runfolder.STOPPED).read_text()
    fine = results.start("toy", {})
    runfolder.record_execution(fine.dir, "00_toy.ipynb", True, 1.0)
    assert not (fine.dir / runfolder.STOPPED).exists()


# ------------------------------------------------------------------------------------- git


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t",
                           *args], check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A git repository with one commit, as KVLAB_ROOT, with KVLAB_DATA inside it."""
    root = tmp_path / "repo"
    root.mkdir()
    git(root, "init", "-q")
    (root / "kvlab").mkdir()
    (root / "kvlab" / "code.py").write_text("x = 1\n")
    monkeypatch.setenv("KVLAB_ROOT", str(root))
    monkeypatch.setenv("KVLAB_DATA", str(root / "data"))
    monkeypatch.setenv("KVLAB_FIGURES", str(root / "figures"))
    return root


def test_git_commit_and_dirty_flag(repo):
    state = provenance.git_state()
    assert state["commit"] is None and state["dirty"] is True  # no commit yet, code.py untracked
    git(repo, "add", "kvlab/code.py")
    git(repo, "commit", "-qm", "first")
    head = git(repo, "rev-parse", "HEAD")

    run = results.start("toy", {})  # writes data/toy/<id>/run.json inside the repository
    code = provenance.tree_hash(repo)
    assert run.record["git"] == {"commit": head, "dirty": False, "dirty_paths": [], "code_sha256": code,
                                 "code_matches_commit": True}
    (repo / "figures" / "toy").mkdir(parents=True)
    (repo / "figures" / "toy" / "f.png").write_bytes(b"png")
    assert provenance.git_state()["dirty"] is False  # what runs write is not dirt

    (repo / "kvlab" / "code.py").write_text("x = 2\n")
    state = results.start("toy", {}).record["git"]
    assert state["commit"] == head and state["dirty"] is True
    assert state["dirty_paths"] == ["kvlab/code.py"]


def test_git_state_is_null_outside_a_repository_or_without_git(tmp_path, monkeypatch):
    plain = tmp_path / "plain"
    plain.mkdir()
    assert provenance.git_state(plain) == {"commit": None, "dirty": None, "dirty_paths": [],
                                        "code_sha256": provenance.tree_hash(plain)}
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    state = provenance.git_state(Path(__file__).parent)
    assert {k: state[k] for k in ("commit", "dirty", "dirty_paths")} == {"commit": None, "dirty": None,
                                                                         "dirty_paths": []}


# -------------------------------------------------------------------------- paths, reading


def test_roots_follow_the_environment(tmp_path, monkeypatch, kvlab_dirs):
    assert paths.data_root() == kvlab_dirs.data
    assert paths.figures_root() == kvlab_dirs.figures
    monkeypatch.delenv("KVLAB_DATA")
    monkeypatch.setenv("KVLAB_ROOT", str(tmp_path / "elsewhere"))
    assert paths.data_root() == tmp_path / "elsewhere" / "data"
    monkeypatch.delenv("KVLAB_ROOT")
    assert (paths.repo_root() / "pyproject.toml").is_file()  # this checkout


@pytest.mark.parametrize("name, study", [("notebooks/02_handoff.ipynb", "handoff"),
                                         ("01_link_ceilings.ipynb", "link_ceilings"),
                                         ("scratch.ipynb", "scratch")])
def test_study_of_notebook(name, study):
    assert paths.study_of(name) == study


def _finished(study: str, run_id: str, kind: str, status: str = "finished") -> Path:
    folder = paths.data_root() / study / run_id
    folder.mkdir(parents=True)
    started = dt.datetime.strptime(run_id[:15], "%Y%m%d-%H%M%S").strftime("%Y-%m-%dT%H:%M:%SZ")
    (folder / "run.json").write_text(json.dumps(
        {"run_id": run_id, "study": study, "status": status, "started_utc": started,
         "device_kind": kind}))
    return folder


def test_latest_prefers_gpu_runs_and_skips_unfinished(kvlab_dirs):
    with pytest.raises(FileNotFoundError, match="'handoff'.*kvlab run handoff"):
        results.latest("handoff")
    cpu_old = _finished("handoff", "20261101-000000-cpu", "cpu")
    assert results.latest("handoff") == cpu_old  # no GPU run yet: the CPU one
    gpu = _finished("handoff", "20261102-000000-h200", "cuda")
    cpu_new = _finished("handoff", "20261103-000000-cpu", "cpu")
    _finished("handoff", "20261104-000000-h200", "cuda", status="failed")
    _finished("handoff", "20261105-000000-h200", "cuda", status="running")
    assert results.latest("handoff") == gpu
    assert results.latest("handoff", gpu=False) == cpu_new
    assert results.runs("handoff") == [cpu_new, gpu, cpu_old]
    assert results.runs("handoff", gpu=True, finished=False)[0].name == "20261105-000000-h200"


def test_load_returns_record_and_tables(kvlab_dirs):
    run = results.start("toy", {"a": 1})
    run.save_table(pd.DataFrame({"x": [1, 2]}))
    run.save_table(pd.DataFrame({"y_ms": [0.5]}), "fit")
    run.finish()
    record, tables = results.load(run.dir)
    assert record["parameters"] == {"a": 1} and record["status"] == "finished"
    assert set(tables) == {"results", "fit"} and tables["fit"]["y_ms"].tolist() == [0.5]
    with pytest.raises(FileNotFoundError, match="run.json"):
        results.load(kvlab_dirs.data)


# --------------------------------------------------------------------------------- devices


@pytest.mark.parametrize("name, tag", [
    ("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA A100-SXM4-80GB", "a100"),
    ("NVIDIA GeForce RTX 4090", "rtx4090"), ("Tesla V100-SXM2-16GB", "v100"),
    ("NVIDIA GH200 480GB", "gh200"), ("NVIDIA L40S", "l40s"), ("AMD Instinct MI300X", "mi300x"),
    ("NVIDIA RTX A6000", "a6000"), ("", "gpu"),
])
def test_device_tag_from_gpu_name(name, tag):
    assert devices.tag_from_name(name) == tag


def test_describe_answers_on_this_machine():
    info = devices.describe()
    json.dumps(info, allow_nan=False)  # it goes into run.json as is
    assert info["device_kind"] == ("cuda" if torch.cuda.is_available() else "cpu")
    assert len(info["devices"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert len(info["p2p"]) == len(info["devices"])
    assert info["cuda_runtime"] == torch.version.cuda
    assert info["host"]["memory_bytes"] > 2**28
    assert info["versions"]["transformers"]
    assert devices.device_tag() == info["device_tag"]


def test_summary_names_the_hardware():
    assert devices.summary(FAKE_H200) == "NVIDIA H200"
    two = {**FAKE_H200, "devices": FAKE_H200["devices"] * 2}
    assert devices.summary(two) == "2× NVIDIA H200"
    assert devices.summary({**two, "device_kind": "cpu"}) == "cpu"


# -------------------------------------------------------------------------- figures (plots)


def _figure():
    fig, ax = plt.subplots()
    ax.plot([0, 1], [0, 1], color=plots.color("bulk"))
    return fig


def test_save_writes_run_copy_and_publishes_with_footer(kvlab_dirs):
    run = results.start("toy", {})
    fig = _figure()
    assert plots.save(fig, "line", run) == [run.dir / "figures" / "line.png", run.dir / "figures" / "line.svgz"]
    assert not (kvlab_dirs.figures / "toy").exists(), "a plain run publishes nothing"
    paths = plots.save(fig, "line", run, publish=True)
    published = kvlab_dirs.figures / "toy"
    assert paths == [run.dir / "figures" / "line.png", run.dir / "figures" / "line.svgz",
                     published / "line.png", published / "line.svgz"]
    assert all(p.stat().st_size > 0 for p in paths)
    assert (published / "line.png").read_bytes() == (run.dir / "figures/line.png").read_bytes()
    drawn = provenance.drawing()
    footer = f"kvlab · run {run.run_id} · cpu · drawn by {provenance.short(drawn)}"
    assert [t.get_text() for t in fig.texts] == [footer]
    sidecar = read_json(published / "line.json")
    assert sidecar["run_id"] == run.run_id and sidecar["is_gpu"] is False
    assert sidecar["drawn_by"] == drawn and drawn["code_sha256"] == provenance.tree_hash()
    import gzip

    assert gzip.decompress((published / "line.svgz").read_bytes()).lstrip().startswith(b"<?xml")
    (published / "line.svg").write_text("<svg/>")  # an earlier publish's plain SVG: another drawing, removed
    plots.save(fig, "line", run, publish=True)  # saving again keeps one footer
    assert not (published / "line.svg").exists()
    (run.dir / "figures" / "line.svg").write_text("<svg/>")  # in the run folder too: drawn again, it goes
    plots.save(fig, "line", run)
    assert not (run.dir / "figures" / "line.svg").exists() and (run.dir / "figures" / "line.svgz").is_file()
    assert len(fig.texts) == 1
    plt.close(fig)


def test_publishing_says_what_it_replaced_and_from_which_run(kvlab_dirs, capsys):
    fig = _figure()
    first = results.start("toy", {})
    plots.save(fig, "line", first, publish=True)
    assert f"published {kvlab_dirs.figures / 'toy' / 'line'}.png from run {first.run_id} (new)" in capsys.readouterr().out
    second = results.start("toy", {})
    plots.save(fig, "line", second, publish=True)
    out = capsys.readouterr().out
    assert f"from run {second.run_id}, replacing the one from run {first.run_id}" in out
    plt.close(fig)


def test_cpu_run_never_replaces_a_gpu_published_figure(kvlab_dirs, monkeypatch, capsys):
    published = kvlab_dirs.figures / "toy"
    monkeypatch.setenv("KVLAB_PUBLISH", "1")  # what `kvlab run --publish` sets
    with monkeypatch.context() as m:  # a GPU run publishes first
        m.setattr(devices, "has_cuda", lambda: True)
        m.setattr(devices, "gpus", lambda: FAKE_H200["devices"])
        m.setattr(devices, "describe", lambda: json.loads(json.dumps(FAKE_H200)))
        gpu_run = results.start("toy", {})
        fig = _figure()
        plots.save(fig, "line", gpu_run)
        assert fig.texts[0].get_text().startswith(f"kvlab · run {gpu_run.run_id} · NVIDIA H200 · drawn by ")
    gpu_png = (published / "line.png").read_bytes()

    cpu_run = results.start("toy", {})
    assert not cpu_run.is_gpu
    paths = plots.save(_figure(), "line", cpu_run)
    assert paths == [cpu_run.dir / "figures/line.png", cpu_run.dir / "figures/line.svgz"]
    assert (published / "line.png").read_bytes() == gpu_png
    assert read_json(published / "line.json")["run_id"] == gpu_run.run_id
    assert "GPU run" in capsys.readouterr().out

    plots.save(_figure(), "other", cpu_run)  # a name no GPU run published: CPU publishes it
    assert read_json(published / "other.json")["run_id"] == cpu_run.run_id

    # Redrawing from the GPU run's folder (an analysis notebook) publishes as that GPU run.
    plots.save(_figure(), "other", gpu_run.dir)
    sidecar = read_json(published / "other.json")
    assert sidecar.pop("drawn_by") == provenance.drawing()
    assert sidecar == {
        "figure": "other", "study": "toy", "run_id": gpu_run.run_id, "is_gpu": True,
        "device": "NVIDIA H200", "run": f"toy/{gpu_run.run_id}", "parameters": {}}


def test_a_published_figure_is_replaced_only_by_a_run_with_its_parameters(kvlab_dirs, monkeypatch, capsys):
    monkeypatch.setenv("KVLAB_PUBLISH", "1")
    published = kvlab_dirs.figures / "toy"
    first = results.start("toy", {"kv_dtype": "bf16", "tokens": 8192})
    plots.save(_figure(), "line", first)
    assert read_json(published / "line.json")["parameters"] == {"kv_dtype": "bf16", "tokens": 8192}
    other = results.start("toy", {"kv_dtype": "fp8", "tokens": 8192})
    plots.save(_figure(), "line", other)
    assert read_json(published / "line.json")["run_id"] == first.run_id
    assert "parameters differ (kv_dtype)" in capsys.readouterr().out
    same = results.start("toy", {"kv_dtype": "bf16", "tokens": 8192})
    plots.save(_figure(), "line", same)
    assert read_json(published / "line.json")["run_id"] == same.run_id
    monkeypatch.setenv("KVLAB_PUBLISH", "force")
    plots.save(_figure(), "line", other)
    assert read_json(published / "line.json")["run_id"] == other.run_id
    monkeypatch.delenv("KVLAB_PUBLISH")
    plots.save(_figure(), "line", same)  # no publish asked: figures/ stays as it is
    assert read_json(published / "line.json")["run_id"] == other.run_id
    plt.close("all")


@pytest.mark.parametrize("name", ["Line", "line.png", "a b", "", "../x"])
def test_save_refuses_bad_figure_names(kvlab_dirs, name):
    run = results.start("toy", {})
    with pytest.raises(ValueError, match="figure name"):
        plots.save(_figure(), name, run)
    assert not (run.dir / "figures").exists()
    plt.close("all")


def test_colors_are_fixed_per_name_and_distinct_per_figure():
    assert plots.color("bulk") == plots.BLUE
    assert plots.color("layer_wise") == plots.color("Layer-wise") == plots.VERMILLION
    assert plots.color("cuda:3") == plots.color("peer")
    assert plots.color("same-device") == plots.color("same-gpu")  # CPU and GPU runs agree
    assert plots.color("pinned-host") == plots.color("pinned")
    assert plots.color("pageable-host") == plots.color("pageable")
    assert plots.color("some new method") == plots.color("some_new_method")
    assert plots.color("some new method") in plots.CYCLE
    names = ["bulk", "100G", "200G", "400G", "800G", "nvlink"]
    pal = plots.palette(names)
    assert list(pal) == names and pal["bulk"] == plots.BLUE
    assert len(set(pal.values())) == len(names)


def test_style_applies_the_house_settings():
    plots.style()
    assert matplotlib.rcParams["svg.hashsalt"] == "kvlab"
    assert matplotlib.rcParams["axes.spines.top"] is False
    colors = [matplotlib.colors.to_hex(c["color"]) for c in matplotlib.rcParams["axes.prop_cycle"]]
    assert colors == [c.lower() for c in plots.CYCLE]


# -------------------------------------------------------------------------------- nbtools


def test_preset_follows_hardware_and_environment(monkeypatch):
    monkeypatch.setattr(devices, "has_cuda", lambda: False)
    assert devices.preset() == "cpu"
    assert nbtools.resolve("auto", gpu="qwen2.5-7b", cpu="kvlab-tiny") == "kvlab-tiny"
    assert nbtools.resolve("llama-2-7b", gpu="qwen2.5-7b", cpu="kvlab-tiny") == "llama-2-7b"
    monkeypatch.setenv("KVLAB_PRESET", "gpu")
    with pytest.raises(RuntimeError, match="no CUDA"):
        devices.preset()
    monkeypatch.setattr(devices, "has_cuda", lambda: True)
    assert devices.preset() == "gpu"
    monkeypatch.setenv("KVLAB_PRESET", "cpu")
    assert devices.preset() == "cpu"
    monkeypatch.setenv("KVLAB_PRESET", "tpu")
    with pytest.raises(ValueError, match="tpu"):
        devices.preset()


def test_is_interactive_is_false_outside_a_kernel(monkeypatch):
    assert nbtools.is_interactive() is False


@pytest.mark.parametrize("x, text", [(524288, "524,288"), (1234.5678, "1,235"), (12.3456, "12.3"),
                                     (0.000123456, "0.000123"), (1.5, "1.50"), (0, "0"),
                                     (float("nan"), ""), (True, "True"), (np.int64(4096), "4,096"),
                                     (np.bool_(False), "False"), (np.float32(2.5), "2.50"),
                                     (torch.tensor(0.25), "0.25")])
def test_format_number(x, text):
    assert nbtools.format_number(x) == text


def test_show_table_prints_without_index(capsys):
    nbtools.show_table(pd.DataFrame({"model": ["a", "b"], "kv_bytes": [524288, 131072],
                                     "ms": [12.3456, 0.5]}), caption="KV per token")
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "KV per token"
    assert out[1].split() == ["model", "kv_bytes", "ms"]
    assert out[2].split() == ["a", "524,288", "12.3"]
    with pytest.raises(TypeError, match="DataFrame"):
        nbtools.show_table([1, 2])


def test_a_sent_commit_wins_over_a_stale_local_git(repo, monkeypatch):
    git(repo, "add", "kvlab/code.py")
    git(repo, "commit", "-qm", "first")
    head = git(repo, "rev-parse", "HEAD")
    (repo / "kvlab" / "code.py").write_text("x = 2\n")  # the tree that was sent differs from the local HEAD
    code = provenance.tree_hash(repo)
    monkeypatch.setenv("KVLAB_GIT_COMMIT", "f" * 40)
    state = provenance.git_state()
    assert state["commit"] == "f" * 40 and state["commit_source"] == "KVLAB_GIT_COMMIT"
    assert state["local_git"] == {"commit": head, "dirty": True, "dirty_paths": ["kvlab/code.py"]}
    assert state["code_sha256"] == code
    monkeypatch.setenv("KVLAB_GIT_COMMIT", head)  # the same commit: the local state stands
    assert provenance.git_state() == {"commit": head, "dirty": True, "dirty_paths": ["kvlab/code.py"],
                                   "code_sha256": code}


def test_host_usage_shares_from_two_readings():
    a = {"cpu_ticks": dict(user=100, nice=0, system=50, idle=800, iowait=10, irq=0, softirq=0, steal=40)}
    b = {"cpu_ticks": dict(user=160, nice=0, system=70, idle=880, iowait=20, irq=0, softirq=0, steal=70)}
    # deltas: user 60, system 20, idle 80, iowait 10, steal 30 → 200 ticks, busy 80
    assert devices.host_usage(a, b) == {"busy_pct": 40.0, "iowait_pct": 5.0, "steal_pct": 15.0, "ticks": 200}
    assert devices.host_usage(a, {"cpu_ticks": None}) is None
    assert devices.host_usage(a, a) is None  # no time passed
    state = devices.host_state()
    assert set(state) == {"loadavg", "cpu_ticks", "cpu_mhz", "thp", "numa_nodes"}


def test_host_state_cannot_be_overwritten(kvlab_dirs):
    run = results.start("toy", {})
    with pytest.raises(ValueError, match="cannot be updated"):
        run.update(host_usage={"busy_pct": 0})


# ------------------------------------------------------------------------------- provenance


def test_a_run_from_changed_code_records_the_diff_that_rebuilds_it(repo, tmp_path):
    git(repo, "add", "kvlab/code.py")
    git(repo, "commit", "-qm", "first")
    head = git(repo, "rev-parse", "HEAD")
    clean = results.start("toy", {})
    assert provenance.status(clean.record, clean.dir, repo)[0] == "verified"
    assert not (clean.dir / "git.diff").exists()

    (repo / "kvlab" / "code.py").write_text("x = 2\n")
    (repo / "kvlab" / "new.py").write_text("y = 3\n")  # untracked code counts too
    (repo / "notes.txt").write_text("not code\n")  # dirt, but not code
    run = results.start("toy", {})
    g = run.record["git"]
    assert g["dirty"] is True and sorted(g["dirty_paths"]) == ["kvlab/code.py", "kvlab/new.py", "notes.txt"]
    assert g["code_matches_commit"] is False and g["diff_file"] == "git.diff"
    assert provenance.status(run.record, run.dir, repo)[0] == "diff"

    # the diff, applied to the commit, gives back exactly the code that ran
    rebuilt = tmp_path / "rebuilt"
    subprocess.run(["git", "clone", "-q", str(repo), str(rebuilt)], check=True)
    git(rebuilt, "checkout", "-q", head)
    git(rebuilt, "apply", str(run.dir / "git.diff"))
    assert provenance.tree_hash(rebuilt) == g["code_sha256"]

    assert g["diff_rebuilds_code"] is True
    # what git ignores (JupyterLab's checkpoints) is not code: it neither changes the hash nor needs a diff
    (repo / ".gitignore").write_text(".ipynb_checkpoints/\n")
    (repo / "kvlab" / ".ipynb_checkpoints").mkdir()
    (repo / "kvlab" / ".ipynb_checkpoints" / "x-checkpoint.py").write_text("junk\n")
    assert provenance.tree_hash(repo) == g["code_sha256"]

    # a diff that was edited afterwards no longer vouches for the run
    (run.dir / "git.diff").write_text("tampered\n")
    assert provenance.status(run.record, run.dir, repo)[0] == "mismatch"


def test_a_large_diff_is_kept_compressed_and_still_vouches_for_its_run(repo, monkeypatch):
    import gzip

    git(repo, "add", "kvlab/code.py")
    git(repo, "commit", "-qm", "first")
    (repo / "kvlab" / "big.py").write_text("".join(f"v{i} = {i}\n" for i in range(400)))
    monkeypatch.setattr(results, "DIFF_GZIP_BYTES", 1024)
    run = results.start("toy", {})
    g = run.record["git"]
    assert not (run.dir / "git.diff").exists() and (run.dir / "git.diff.gz").is_file()
    assert g["diff_file"] == "git.diff" and g["diff_rebuilds_code"] is True
    assert provenance.status(run.record, run.dir, repo)[0] == "diff"
    # its sha256 is the patch's, so a changed patch inside the gzip is caught as the plain file would be
    (run.dir / "git.diff.gz").write_bytes(gzip.compress(b"tampered\n"))
    assert provenance.status(run.record, run.dir, repo)[0] == "mismatch"


def test_the_diff_is_of_the_bytes_on_disk_not_of_what_the_notebook_filter_would_commit(repo, tmp_path):
    """make puts nbstripout on notebooks as git's clean filter: a notebook saved with outputs looks unchanged to git,
    yet its bytes are what ran. The recorded diff must rebuild those bytes, outputs and all."""
    (repo / "notebooks").mkdir()
    (repo / "notebooks" / "a.ipynb").write_text('{"cells": []}\n')
    (repo / ".gitattributes").write_text("*.ipynb filter=nbstripout\n")
    git(repo, "config", "filter.nbstripout.clean", "sed -e s/outputs/stripped/")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "first")
    head = git(repo, "rev-parse", "HEAD")
    (repo / "notebooks" / "a.ipynb").write_text('{"cells": [], "outputs": 1}\n')
    run = results.start("toy", {})
    g = run.record["git"]
    assert g["code_matches_commit"] is False and g["diff_rebuilds_code"] is True
    rebuilt = tmp_path / "rebuilt"
    subprocess.run(["git", "clone", "-q", str(repo), str(rebuilt)], check=True)
    git(rebuilt, "checkout", "-q", head)
    git(rebuilt, "-c", "filter.nbstripout.clean=cat", "apply", str(run.dir / "git.diff"))
    assert (rebuilt / "notebooks" / "a.ipynb").read_text() == '{"cells": [], "outputs": 1}\n'


def test_a_sent_commit_is_checked_against_the_code_that_travelled(repo, monkeypatch):
    git(repo, "add", "kvlab/code.py")
    git(repo, "commit", "-qm", "first")
    first = git(repo, "rev-parse", "HEAD")
    (repo / "kvlab" / "code.py").write_text("x = 2\n")
    git(repo, "commit", "-qam", "second")
    second = git(repo, "rev-parse", "HEAD")
    git(repo, "checkout", "-q", first)  # a node whose .git is older than the tree it was sent
    (repo / "kvlab" / "code.py").write_text("x = 2\n")
    monkeypatch.setenv("KVLAB_GIT_COMMIT", second)
    run = results.start("toy", {})
    assert provenance.status(run.record, run.dir, repo)[0] == "verified"
    wrong = dict(run.record, git=dict(run.record["git"], commit=first))  # naming the wrong commit is caught
    assert provenance.status(wrong, run.dir, repo)[0] == "mismatch"
    unknown = dict(run.record, git=dict(run.record["git"], commit="e" * 40))
    assert provenance.status(unknown, run.dir, repo)[0] == "unknown"


@pytest.mark.parametrize("git_record, expected", [
    ({"commit": None, "dirty": True, "dirty_paths": []}, "no commit"),
    ({"commit": "a" * 40, "dirty": True, "dirty_paths": ["kvlab/x.py"]}, "dirty"),
    ({"commit": "a" * 40, "dirty": False, "dirty_paths": []}, "clean"),
    ({"commit": "a" * 40, "dirty": None, "dirty_paths": [], "commit_source": "KVLAB_GIT_COMMIT"}, "unverified"),
])
def test_runs_from_before_code_hashes_get_the_status_their_record_allows(git_record, expected):
    assert provenance.status({"git": git_record})[0] == expected
    assert (expected in provenance.PUBLISHABLE) == (expected == "clean")


def test_every_published_run_has_a_provenance_status():
    """Every committed run gets one of the known statuses; the README's provenance table lists them."""
    known = {"verified", "diff", "clean", "unverified", "dirty", "mismatch", "unknown", "no commit"}
    dirs = sorted(p.parent for p in (Path(__file__).resolve().parents[1] / "data").glob("*/*/run.json"))
    assert dirs
    for d in dirs:
        st, detail = provenance.status(json.loads((d / "run.json").read_text()), d,
                                       Path(__file__).resolve().parents[1])
        assert st in known and detail, d


def test_sigterm_handler_nests_and_restores():
    """kvlab's main() arms SIGTERM and kvlab disagg arms it again inside: the inner call must leave the outer handler
    alone (restoring it after it fired would re-arm it), and the outer restore puts back what was there."""
    import signal

    before = signal.getsignal(signal.SIGTERM)
    restore = runfolder.raise_on_sigterm()
    try:
        armed = signal.getsignal(signal.SIGTERM)
        assert getattr(armed, "_kvlab_sigterm", False)
        inner = runfolder.raise_on_sigterm()
        assert signal.getsignal(signal.SIGTERM) is armed
        with pytest.raises(runfolder.Terminated, match="SIGTERM"):
            armed(signal.SIGTERM, None)  # fires once: a second SIGTERM (timeout's to the group) is ignored
        assert armed(signal.SIGTERM, None) is None
        inner()
        assert signal.getsignal(signal.SIGTERM) is armed and armed.fired  # the inner restore re-armed nothing
        assert runfolder.stop_reason(runfolder.Terminated("terminated (SIGTERM)")) == "terminated (SIGTERM)"
        assert runfolder.stop_reason(KeyboardInterrupt()) == "interrupted (Ctrl-C)"
    finally:
        restore()
    assert signal.getsignal(signal.SIGTERM) == before
    again = runfolder.raise_on_sigterm()  # a new arming after a restore fires again
    try:
        with pytest.raises(runfolder.Terminated):
            signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
    finally:
        again()


def test_a_run_made_by_papermill_itself_records_where_its_executed_notebook_went(tmp_path, kvlab_dirs, make_notebook):
    """Users batch-run notebooks with papermill directly too: with --inject-paths the run's record names the
    notebook and the executed copy, as a `kvlab run` record names its own."""
    pytest.importorskip("papermill")
    nb = make_notebook(tmp_path / "00_toy.ipynb", 'size: int = 1  # rows\nrun_dir: str = ""  # set by kvlab run\n',
                       "from kvlab import results\nrun = results.start('toy', {'size': size}, run_dir)\n"
                       "print(run.dir)\nrun.finish()")
    out = tmp_path / "executed.ipynb"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    subprocess.run([sys.executable, "-m", "papermill", str(nb), str(out), "-p", "size", "2", "-p", "run_dir",
                    str(tmp_path / "run"), "--inject-paths", "--no-progress-bar"], check=True, env=env,
                   capture_output=True, stdin=subprocess.DEVNULL, timeout=300)
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["status"] == "finished" and record["parameters"]["size"] == 2
    assert record["invocation"] == {"tool": "papermill", "notebook": str(nb), "executed": str(out)}
