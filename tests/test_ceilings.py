"""Tests of kvlab.ceilings: sizes and paths, the two-part fit, Ceilings, a CPU sweep, the CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import numpy as np
import pandas as pd
import pytest
import torch

from conftest import CELL_TIMEOUT_S
from kvlab import ceilings as C
from kvlab import ceilings_fit as CF
from kvlab.ceilings import measure, parse_size
from kvlab.ceilings_fit import Ceilings, fit, fit_model
from kvlab.studies.link_ceilings import command as ceilings_command
from kvlab.units import GiB, KiB, MiB

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
REPO = Path(__file__).resolve().parent.parent


def synth(models: dict[str, tuple[float, float]], sizes=C.GPU_SIZES, n=9, noise=0.0, seed=0) -> pd.DataFrame:
    """A table shaped like measure()'s, with times drawn from t = t0 + bytes/B per path.

    models: path → (fixed µs, GB/s). noise: relative sd of multiplicative log-normal noise.
    """
    rng = np.random.default_rng(seed)
    rows = []
    for path, (t0_us, bw) in models.items():
        for size in sizes:
            for r in range(n):
                ms = t0_us / 1e3 + size / (bw * 1e9) * 1e3
                if noise:
                    ms *= float(np.exp(rng.normal(0.0, noise)))
                rows.append((path, "test", size, 1, r, ms, size / (ms / 1e3) / 1e9))
    return pd.DataFrame(rows, columns=["path", "mechanism", "size_bytes", "copies_per_sample", "repeat", "ms", "gbps"])


# --------------------------------------------------------------------------- sizes and paths
@pytest.mark.parametrize(
    "text, expected",
    [(4096, 4096), ("4096", 4096), ("4K", 4 * KiB), ("4KiB", 4 * KiB), ("16k", 16 * KiB), ("1.5M", 3 * MiB // 2),
     ("64MiB", 64 * MiB), ("1G", GiB), (" 2 GiB ", 2 * GiB), ("7B", 7), (np.int64(8), 8)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "bad, match",
    [(0, "> 0"), (-4096, "> 0"), ("0K", "> 0"), ("4KB", "ambiguous"), ("1GB", "ambiguous"), ("4X", "unknown unit"),
     ("abc", "expected a positive int"), (1.5, "expected a positive int"), (True, "expected a positive int"),
     ("0.3", "not a whole number")],
)
def test_parse_size_rejects(bad, match):
    with pytest.raises(ValueError, match=match):
        parse_size(bad)


def test_default_sizes():
    assert C.GPU_SIZES == (4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB, GiB)
    assert C.CPU_SIZES[-1] == 16 * MiB and len(C.CPU_SIZES) == 7
    assert C.resolve_sizes("auto", torch.device("cpu")) == list(C.CPU_SIZES)
    assert C.resolve_sizes(None, torch.device("cuda")) == list(C.GPU_SIZES)
    assert C.resolve_sizes("64K,4K,4096", torch.device("cpu")) == [4 * KiB, 64 * KiB]  # sorted, deduplicated
    with pytest.raises(ValueError, match="no sizes"):
        C.resolve_sizes(",", torch.device("cpu"))


def test_auto_copies():
    assert [C.auto_copies(s) for s in (4 * KiB, 64 * KiB, 256 * KiB, MiB, 4 * MiB, GiB)] == [64, 64, 16, 4, 1, 1]


def test_fmt_bytes():
    assert C.fmt_bytes(4096) == "4 KiB"
    assert C.fmt_bytes(GiB) == "1 GiB"
    assert C.fmt_bytes(1.5 * MiB) == "1.5 MiB"
    assert C.fmt_bytes(1000) == "1000 B"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path list")
def test_paths_on_cpu():
    assert C.available_paths() == ["h2h"]
    assert C.resolve_paths("auto") == ["h2h"]
    assert C.resolve_paths(["h2h", "h2h"]) == ["h2h"]
    with pytest.raises(ValueError, match=r"path 'd2d_same' needs a CUDA GPU and torch sees none here; on this machine: \['h2h'\]"):
        C.resolve_paths("d2d_same")
    with pytest.raises(ValueError, match="two or more GPUs"):
        C.resolve_paths("d2d_peer")
    with pytest.raises(ValueError, match="no path names"):
        C.resolve_paths(" , ")


# --------------------------------------------------------------------------- the fit
def test_fit_model_exact_recovery():
    # H200 reference: 11.8 µs per 16 KiB copy_, ~2000 GB/s at 1 GiB
    sizes = np.array(C.GPU_SIZES, dtype=float)
    ms = 11.8e-3 + sizes / 2000e9 * 1e3
    t0, bw, err = fit_model(sizes, ms)
    assert t0 == pytest.approx(11.8, rel=1e-9)
    assert bw == pytest.approx(2000.0, rel=1e-9)
    assert err < 1e-9


def test_fit_model_with_noise():
    rng = np.random.default_rng(1)
    sizes = np.repeat(np.array(C.GPU_SIZES, dtype=float), 9)
    true = 18e-3 + sizes / 395e9 * 1e3  # seed 004: ~18 µs per copy, 395 GB/s NVLink
    ms = true * np.exp(rng.normal(0, 0.02, sizes.size))
    t0, bw, err = fit_model(sizes, ms)
    assert t0 == pytest.approx(18.0, rel=0.05)
    assert bw == pytest.approx(395.0, rel=0.02)
    assert 0.0 < err < 0.2


def test_fit_model_relative_weighting_keeps_small_sizes():
    # An unweighted fit is dominated by the 1 GiB point and loses t0; the relative fit keeps it
    # even when the large sizes carry a 1 % bias.
    sizes = np.array(C.GPU_SIZES, dtype=float)
    ms = 10e-3 + sizes / 50e9 * 1e3
    ms[-3:] *= 1.01
    t0, bw, _ = fit_model(sizes, ms)
    assert t0 == pytest.approx(10.0, rel=0.03)


def test_fit_model_clamps():
    sizes = np.array([4 * KiB, 64 * KiB, MiB, 16 * MiB], dtype=float)
    # no fixed cost at all, and a small negative bias at small sizes: t0 clamps to 0
    ms = sizes / 10e9 * 1e3 * np.array([0.9, 0.95, 1.0, 1.0])
    t0, bw, _ = fit_model(sizes, ms)
    assert t0 == 0.0 and bw > 0
    # time independent of size: pure fixed cost, unbounded bandwidth
    t0, bw, err = fit_model(sizes, np.full(4, 0.005))
    assert t0 == pytest.approx(5.0) and math.isinf(bw) and err == pytest.approx(0.0)


@pytest.mark.parametrize(
    "sizes, ms, match",
    [([4096, 4096], [1.0, 1.0], ">= 2 distinct sizes"), ([1, 2], [1.0], "2 sizes but 1 times"),
     ([1, 2], [1.0, 0.0], "> 0"), ([1, 2], [1.0, float("nan")], "> 0"), ([0, 2], [1.0, 1.0], "> 0")],
)
def test_fit_model_rejects(sizes, ms, match):
    with pytest.raises(ValueError, match=match):
        fit_model(sizes, ms)


def test_fit_table_and_ceilings():
    df = synth({"fast": (11.8, 2000.0), "slow": (8.5, 55.0)})
    table, ceil = fit(df)
    assert list(table["path"]) == ["fast", "slow"]
    assert set(table.columns) >= {"fixed_us", "bandwidth_gbps", "ceiling_gbps", "ceiling_size_bytes", "half_size_bytes"}
    fast = ceil["fast"]
    assert fast.fixed_us == pytest.approx(11.8) and fast.bandwidth_gbps == pytest.approx(2000.0)
    # with a fixed cost the best GB/s is at the largest size, and below B
    assert fast.ceiling_size_bytes == GiB
    expected = GiB / (11.8e-6 + GiB / 2000e9) / 1e9
    assert fast.ceiling_gbps == pytest.approx(expected)
    assert fast.ceiling_gbps == ceil.gbps("fast")
    assert fast.half_size_bytes == pytest.approx(11.8e-6 * 2000e9)
    assert fast.n_sizes == 10
    assert ceil.fraction("slow", 27.5) == pytest.approx(27.5 / ceil.gbps("slow"))


def test_fit_ceiling_is_best_median_with_spread():
    df = synth({"p": (5.0, 100.0)}, sizes=[MiB, 16 * MiB], n=3)
    # make the middle sample of the larger size slower: the ceiling is the median, min/max the spread
    big = df.index[df["size_bytes"] == 16 * MiB]
    df.loc[big, "gbps"] = [90.0, 80.0, 95.0]
    _, ceil = fit(df)
    pc = ceil["p"]
    assert (pc.ceiling_gbps, pc.ceiling_min_gbps, pc.ceiling_max_gbps) == (90.0, 80.0, 95.0)


def test_fit_single_size_has_ceiling_but_no_model():
    df = synth({"one": (5.0, 100.0)}, sizes=[MiB], n=3)
    _, ceil = fit(df)
    assert ceil["one"].n_sizes == 1
    assert math.isnan(ceil.fixed_us("one")) and not ceil["one"].has_fit
    assert ceil.gbps("one") > 0
    with pytest.raises(ValueError, match="has no fit"):
        ceil.predict_ms("one", MiB)


def test_fit_rejects_bad_tables():
    with pytest.raises(ValueError, match="lacks columns"):
        fit(pd.DataFrame({"path": ["a"], "ms": [1.0]}))
    with pytest.raises(ValueError, match="no rows"):
        fit(synth({"a": (1.0, 1.0)}).iloc[:0])
    with pytest.raises(ValueError, match="DataFrame"):
        fit([1, 2, 3])


def test_predict_ms_seed_004():
    # seed 004: 56 copies (K, V × 28 layers), 1.88 GB, ~18 µs each, 395 GB/s → about 5.76 ms
    _, ceil = fit(synth({"nvlink": (18.0, 395.0)}))
    nbytes = 32768 * 57344
    assert ceil.predict_ms("nvlink", nbytes, copies=56) == pytest.approx(56 * 0.018 + nbytes / 395e9 * 1e3)
    assert ceil.predict_ms("nvlink", nbytes, copies=56) == pytest.approx(5.77, abs=0.01)
    assert ceil.predict_ms("nvlink", 0) == pytest.approx(0.018)


@pytest.mark.parametrize(
    "args, match",
    [(("nope", 1), r"no ceiling for path 'nope'; measured: \['nvlink'\]"), (("nvlink", -1), "nbytes=-1"),
     (("nvlink", float("inf")), "nbytes=inf"), (("nvlink", 10, 0), "copies=0"), (("nvlink", 10, 1.5), "copies=1.5")],
)
def test_predict_ms_rejects(args, match):
    _, ceil = fit(synth({"nvlink": (18.0, 395.0)}))
    with pytest.raises(ValueError, match=match):
        ceil.predict_ms(*args)


def test_ceilings_json_round_trip():
    df = synth({"a": (11.8, 2000.0), "b": (8.5, 55.0)}, noise=0.01)
    flat = synth({"flat": (5.0, 1.0)}, sizes=[4096, 8192], n=3).assign(ms=0.005)  # time independent of size
    df = pd.concat([df, flat.assign(gbps=flat["size_bytes"] / 5e-3 / 1e9)])  # → bandwidth inf
    df = pd.concat([df, synth({"one": (5.0, 10.0)}, sizes=[4096], n=3)])  # no fit → NaN
    df.attrs.update(device="NVIDIA H200", p2p=[[None, True], [True, None]], n=9, warmup=3)
    _, ceil = fit(df)
    assert math.isinf(ceil.bandwidth_gbps("flat"))
    text = ceil.to_json()
    json.loads(text)  # valid JSON: no bare NaN/Infinity
    assert "NaN" not in text and "Infinity" not in text
    back = Ceilings.from_json(text)
    assert back.to_dict() == ceil.to_dict()
    assert back.device == "NVIDIA H200" and back.p2p == [[None, True], [True, None]] and back.meta["n"] == 9
    assert Ceilings.from_json(ceil.to_dict()).gbps("a") == ceil.gbps("a")
    assert back.predict_ms("a", GiB, copies=4) == ceil.predict_ms("a", GiB, copies=4)
    assert back.predict_ms("flat", GiB, copies=2) == pytest.approx(0.010)  # bytes cost nothing at B = inf
    with pytest.raises(ValueError, match="'paths'"):
        Ceilings.from_json({"x": 1})


def test_ceilings_from_fit_csv(tmp_path):
    table, ceil = fit(synth({"a": (11.8, 2000.0)}))
    table.to_csv(tmp_path / "fit.csv", index=False)
    back = Ceilings.from_table(pd.read_csv(tmp_path / "fit.csv"))
    assert back.to_dict()["paths"] == ceil.to_dict()["paths"]


def test_ceilings_load(tmp_path):
    _, ceil = fit(synth({"a": (11.8, 2000.0)}))
    (tmp_path / "run.json").write_text(json.dumps({"ceilings": ceil.to_dict()}))
    assert Ceilings.load(tmp_path).gbps("a") == ceil.gbps("a")
    with pytest.raises(ValueError, match="does not exist"):
        Ceilings.load(tmp_path / "nothing")


# --------------------------------------------------------------------------- presentation
def test_summary_table():
    df = synth({"a": (11.8, 2000.0), "b": (8.5, 55.0)}, sizes=[16 * KiB, MiB, GiB], n=3)
    f = fit(df)
    t = CF.summary_table(df, f)
    assert len(t) == 6
    assert list(t["size"][:3]) == ["16 KiB", "1 MiB", "1 GiB"]
    assert t.groupby("path")["pct_of_ceiling"].max().tolist() == pytest.approx([100.0, 100.0])
    assert t["fit_err_pct"].abs().max() < 1e-6  # exact model data
    assert t["time per copy"].iloc[0] == "11.8 (11.8–11.8) µs"  # 16 KiB at 2000 GB/s adds 8 ns
    assert CF._fmt_time_range(826.0, 800.0, 1200.0) == "826 (800–1,200) ms"
    # the fit table alone is accepted too (e.g. read back from fit.csv)
    assert CF.summary_table(df, f.table)["pct_of_ceiling"].equals(t["pct_of_ceiling"])


def test_plot_one_series_per_path():
    df = synth({"a": (11.8, 2000.0), "b": (8.5, 55.0)}, sizes=[16 * KiB, MiB, GiB], n=3)
    fig = CF.plot(df, fit(df).ceilings)
    ax = fig.axes[0]
    assert len(ax.containers) == 2  # one errorbar series per path
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels[0].startswith("a: 11.8 µs + 2,000 GB/s")
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_finding_text_names_launch_bound():
    df = synth({"d2d": (11.8, 2000.0)})
    text = CF.finding_text(df, fit(df))
    assert "16 KiB copy takes 11.8 µs (0.071% of the ceiling)" in text
    assert "launch-bound (11.8 µs fixed vs 0.00819 µs of bytes)" in text
    assert "ceiling **1,957 GB/s**" in text  # 1 GiB / (11.8 µs + 1 GiB / 2000 GB/s) = 1 GiB / 548.7 µs
    big = CF.finding_text(df, fit(df), probe_bytes=GiB)
    assert "bandwidth-bound" in big


# --------------------------------------------------------------------------- measuring (CPU)
def test_measure_cpu_smoke():
    df = measure("h2h", "4K,64K", n=3, warmup=1, device="cpu", progress=False)
    assert list(df.columns) == ["path", "mechanism", "size_bytes", "copies_per_sample", "repeat", "ms", "gbps"]
    assert len(df) == 6
    assert sorted(df["size_bytes"].unique()) == [4096, 65536]
    assert list(df["repeat"][:3]) == [0, 1, 2]
    assert set(df["copies_per_sample"]) == {64}
    assert (df["ms"] > 0).all()
    assert np.allclose(df["gbps"], df["size_bytes"] / (df["ms"] / 1e3) / 1e9)
    assert df.attrs["device"] == "cpu" and df.attrs["n"] == 3
    table, ceil = fit(df)
    assert ceil.gbps("h2h") > 0 and len(table) == 1


def test_measure_forced_copies():
    df = measure("h2h", [8192], n=2, warmup=0, device="cpu", copies=3, progress=False)
    assert set(df["copies_per_sample"]) == {3}


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"sizes": "0"}, "> 0"),
        ({"sizes": [-1]}, "> 0"),
        ({"sizes": "4KB"}, "ambiguous"),
        ({"paths": "nope"}, r"unknown path 'nope'.*valid: \["),
        ({"n": 0}, "n=0"),
        ({"warmup": -1}, "warmup=-1"),
        ({"copies": 0}, "copies=0"),
        ({"device": "tpu"}, "device='tpu'"),
    ],
)
def test_measure_bad_input_before_allocating(monkeypatch, kwargs, match):
    def no_alloc(*a, **k):
        raise AssertionError("allocated before refusing bad input")

    monkeypatch.setattr(C, "_Case", no_alloc)
    args = {"paths": "h2h" if not torch.cuda.is_available() else "d2d_same", "sizes": "4K", "n": 3, "progress": False}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        measure(**args)


def test_measure_refuses_size_beyond_free_memory(monkeypatch):
    monkeypatch.setattr(C, "_host_available_bytes", lambda: 10 * MiB)
    monkeypatch.setattr(C, "_Case", lambda *a, **k: (_ for _ in ()).throw(AssertionError("allocated")))
    with pytest.raises(ValueError, match=r"size 16 MiB .* 'h2h' needs 32 MiB on host, but only 10 MiB is free.*"
                                         r"largest requested size that fits is 4 MiB"):
        measure("h2h", "4M,16M", n=1, device="cpu", progress=False)


def test_verify_catches_a_copy_that_did_not_happen(monkeypatch):
    monkeypatch.setattr(C._Case, "copy", lambda self: None)
    with pytest.raises(RuntimeError, match="differ from the source"):
        measure("h2h", "4K", n=1, warmup=0, device="cpu", progress=False)


@pytest.mark.parametrize("size", [4096, 4097])  # int32 words, and a size that falls back to bytes
def test_sm_kernel_copy_is_exact_on_cpu(size):
    cpu = torch.device("cpu")
    spec = C._PathSpec("d2d_same_sm", "sm_kernel", cpu, cpu, kernel=True, timer=cpu)
    case = C._Case(spec, size, seed=3)
    assert not torch.equal(case.src, case.dst)  # poisoned before the copy
    case.copy()
    assert torch.equal(case.src, case.dst)
    case.verify()


def test_source_is_random_not_zero():
    cpu = torch.device("cpu")
    case = C._Case(C._PathSpec("h2h", "host_copy", cpu, cpu, timer=cpu), 64 * KiB, seed=0)
    assert case.src.unique().numel() == 256
    assert bool((case.dst == C._POISON).all())


def test_pinned_need_rounds_up():
    cpu = torch.device("cpu")
    spec = C._PathSpec("x", "m", torch.device("cuda", 0), cpu, dst_pinned=True)
    assert spec.needs(3 * MiB) == {"cuda:0": 3 * MiB, "host": 4 * MiB}


# --------------------------------------------------------------------------- command line
def test_ceilings_main_writes_a_run(tmp_path, monkeypatch, capsys):
    pytest.importorskip("kvlab.results")
    monkeypatch.setenv("KVLAB_DATA", str(tmp_path / "data"))
    monkeypatch.setenv("KVLAB_FIGURES", str(tmp_path / "figures"))
    monkeypatch.setenv("KVLAB_PRESET", "cpu")
    run_dir = tmp_path / "run"
    rc = ceilings_command.main(["--paths", "h2h", "--sizes", "4K,16K", "-n", "3", "--warmup", "1",
                          "--device", "cpu", "--run-dir", str(run_dir)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "h2h" in out and "fixed_us" in out
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "finished" and record["study"] == "link_ceilings"
    assert Ceilings.from_json(record["ceilings"]).gbps("h2h") > 0
    assert len(pd.read_csv(run_dir / "results.csv")) == 6
    assert list(pd.read_csv(run_dir / "fit.csv")["path"]) == ["h2h"]


def test_ceilings_main_bad_input(tmp_path, capsys):
    assert ceilings_command.main(["--paths", "nope", "--no-save"]) == 2
    assert "unknown path 'nope'" in capsys.readouterr().err
    assert ceilings_command.main(["--copies", "x", "--no-save"]) == 2
    assert ceilings_command.main(["--sizes", "-3", "--no-save"]) == 2


def test_notebook_is_committed_clean():
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(REPO / "notebooks" / "01_link_ceilings.ipynb", as_version=4)
    tagged = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1
    src = tagged[0].source
    for name in ("paths: str", "sizes: str", "repeats: int", "warmup: int", 'run_dir: str = ""'):
        assert name in src
    for line in src.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            assert ": " in line.split("=")[0] and "#" in line, f"parameter without type or comment: {line}"
    for c in nb.cells:
        if c.cell_type == "code":
            assert c.outputs == [] and c.execution_count is None


@pytest.mark.slow
def test_notebook_runs_on_cpu(tmp_path, monkeypatch):
    pytest.importorskip("papermill")
    from kvlab import nbexec

    pytest.importorskip("kvlab.results")
    pytest.importorskip("kvlab.plots")
    monkeypatch.setenv("KVLAB_DATA", str(tmp_path / "data"))
    monkeypatch.setenv("KVLAB_FIGURES", str(tmp_path / "figures"))
    monkeypatch.setenv("KVLAB_PRESET", "cpu")
    monkeypatch.setenv("KVLAB_BATCH", "1")
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    run_dir = tmp_path / "run"
    nbexec.execute_notebook(str(REPO / "notebooks" / "01_link_ceilings.ipynb"), str(tmp_path / "out.ipynb"),
                            parameters={"sizes": "4K,16K,64K", "repeats": 3, "warmup": 1, "run_dir": str(run_dir)},
                            progress_bar=False, kernel_name="python3", execution_timeout=int(CELL_TIMEOUT_S))
    record = json.loads((run_dir / "run.json").read_text())
    assert Ceilings.from_json(record["ceilings"]).gbps("h2h") > 0
    assert (run_dir / "results.csv").is_file() and (run_dir / "fit.csv").is_file()
    assert (run_dir / "figures" / "gbps_vs_size.png").is_file()
    assert not (tmp_path / "figures" / "link_ceilings").exists(), "published without being asked to"


# --------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@needs_cuda
def test_d2d_same_64mib_above_100_gbps():
    df = measure("d2d_same", "64M", n=9, warmup=3, device="cuda", progress=False)
    _, ceil = fit(df)
    assert ceil.gbps("d2d_same") > 100.0


@pytest.mark.gpu
@needs_cuda
def test_gpu_paths_all_measure_and_verify():
    df = measure("auto", "4K,1M", n=3, warmup=1, progress=False)
    assert set(df["path"]) == set(C.available_paths())
    table, _ = fit(df)
    assert (table["ceiling_gbps"] > 0).all()
