"""kvlab swapin: a paged cache from pinned host memory into a GPU pool by block table, beside the GPU → host
gather. On this CPU the staged path runs and is verified; the check itself must catch a wrong and a stray block;
bad input is refused before a folder is made."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

from kvlab.paged import BlockAllocator, BlockPool, PoolSpec
from kvlab.studies.swapin import bench as swapin
from kvlab.studies.swapin import command


def test_swapin_run_on_a_cpu_writes_a_finished_run(tmp_path):
    out = tmp_path / "run"
    path, analysis = command.run({"model": "kvlab-tiny", "contexts": "64,100", "repeats": 2}, out=str(out))
    s = analysis.tables["summary"]
    run = json.loads((out / "run.json").read_text())
    assert run["status"] == "finished" and run["study"] == "swapin"
    df = pd.read_csv(out / "results.csv")
    for method in ("staged", "copy + scatter"):
        ran = df[(df.method == method)]
        assert len(ran) == 2 * 2 and (ran["ms"] > 0).all()
    got = set(zip(s["direction"], s["host_layout"], s["method"]))
    assert got == {("host→gpu", "contiguous", "contiguous"), ("gpu→host", "contiguous", "contiguous"),
                   ("host→gpu", "scattered", "triton-uva"), ("host→gpu", "packed", "triton-uva"),
                   ("host→gpu", "scattered", "staged"), ("host→gpu", "packed", "copy + scatter"),
                   ("gpu→host", "packed", "chunked-gather-d2h"), ("gpu→host", "scattered", "chunked-gather-d2h")}
    skipped = s[s.method.isin(["triton-uva", "chunked-gather-d2h"])]
    assert (skipped["n"] == 0).all() and skipped["note"].str.len().gt(0).all()
    # 100 tokens in 16-token blocks = 7 blocks of every layer side moved
    spec = PoolSpec(2, 16, 2, 16, "bfloat16")
    assert set(s[s.context == 100]["bytes"]) == {2 * 2 * 7 * spec.block_bytes}


def test_the_check_catches_a_wrong_and_a_stray_block():
    spec = PoolSpec(2, 4, 2, 8, "bfloat16")
    src, dst = BlockPool(spec, 6), BlockPool(spec, 6).poison()
    swapin._fill(src, 0)
    s_ids = BlockAllocator(6, 4, seed=1, order="random").allocate(12).ids
    d_ids = BlockAllocator(6, 4, seed=2, order="random").allocate(12).ids
    hr = torch.as_tensor(swapin.paged_rows(spec, 6, s_ids))
    dr = torch.as_tensor(swapin.paged_rows(spec, 6, d_ids))
    dst.rows[dr] = src.rows[hr]
    assert swapin._verify(dst, d_ids, src, s_ids)
    wrong = dst.rows[dr[3]].clone()
    dst.rows[dr[3]] = src.rows[hr[4]]  # a row from the wrong block
    assert not swapin._verify(dst, d_ids, src, s_ids)
    dst.rows[dr[3]] = wrong
    free = sorted(set(range(6)) - set(d_ids.tolist()))[0]
    dst.rows[free] = 0.0  # a write outside the table (row `free` is layer 0, K side, block `free`)
    assert not swapin._verify(dst, d_ids, src, s_ids)


@pytest.mark.parametrize("kw, says", [
    ({"contexts": "0"}, "context"), ({"block_size": 0}, "block_size = 0"), ({"kv_dtype": "int8"}, "kv_dtype = 'int8'"),
    ({"device": "tpu"}, "device = 'tpu' is not a device"), ({"model": "no-such-model"}, "no-such-model"),
    ({"repeats": 0}, "repeats = 0")])
def test_bad_input_is_refused_before_a_folder(tmp_path, kw, says):
    with pytest.raises(ValueError, match=says):
        command.run({"model": "kvlab-tiny", "contexts": "64", **kw}, out=str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_the_figure_takes_any_number_of_contexts_and_refuses_an_empty_run():
    import matplotlib

    matplotlib.use("Agg")
    rows = [{"context": c, "direction": d, "host_layout": lay, "method": m, "n": 3, "bytes": 1, "note": "",
             "ms": 1.0, "ms_min": 1.0, "ms_max": 1.0, "gbps": 1.0, "pct_of_ceiling": 90.0, "pct_lo": 89.0,
             "pct_hi": 91.0}
            for c in (128, 256, 512, 1024, 2048, 4096) for d, lay, m in (("host→gpu", "packed", "copy + scatter"),
                                                                         ("gpu→host", "packed", "chunked-gather-d2h"))]
    fig = swapin.plot(pd.DataFrame(rows))
    assert len(fig.axes) == 2 and len(fig.axes[0].patches) == 6
    only_ceiling = pd.DataFrame([dict(rows[0], method="contiguous", host_layout="contiguous")])
    with pytest.raises(ValueError, match="nothing to plot"):
        swapin.plot(only_ceiling)


def test_kvlab_swapin_prints_each_method_and_never_overwrites_a_finished_run(tmp_path, capsys, monkeypatch):
    from kvlab import cli

    monkeypatch.setenv("KVLAB_PRESET", "cpu")
    out = tmp_path / "run"
    argv = ["swapin", "--model", "kvlab-tiny", "--context", "64", "--repeats", "2", "--out", str(out)]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "copy + scatter" in printed and "% of the contiguous copy" in printed and f"run: {out}" in printed
    record = json.loads((out / "run.json").read_text())
    assert record["resolved"]["device"] == "cpu" and record["resolved"]["contexts"] == [64]
    assert {"results", "summary"} <= set(record["tables"])
    assert cli.main(argv) == 2
    assert "holds a finished run" in capsys.readouterr().err
