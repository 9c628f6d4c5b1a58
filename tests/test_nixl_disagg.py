"""`kvlab disagg --backend nixl`: two NIXL agents (UCX) in two processes, on the CPU (DRAM to DRAM). CI installs
nixl-cu13 (the dev extra), so these run there; elsewhere without NIXL they skip, except under CI=true."""

from __future__ import annotations

import json
import os

import numpy as np
import pandas as pd
import pytest

from conftest import cpu_env as _env
from conftest import kvlab_command
from kvlab import calculator, models
from kvlab.disagg.nixl_link import merge_runs, ucx_transports
from kvlab.paged.nixl import nixl_missing

MISSING = nixl_missing()
needs_nixl = pytest.mark.skipif(MISSING is not None and not os.environ.get("CI"), reason=str(MISSING))


@pytest.fixture(scope="module")
def nixl_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("nixl") / "run"
    done = kvlab_command(["disagg", "--backend", "nixl", "--context", "128,100", "--layout", "contiguous,paged",
                          "--repeats", "2", "--quiet", "--out", str(out)], _env(out.parent))
    return done, out


@needs_nixl
def test_nixl_two_agents_move_the_cache_and_decode_like_colocated(nixl_run):
    done, out = nixl_run
    assert done.returncode == 0, done.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["backend"] == "nixl" and s["processes"] == 2 and len(set(s["pids"].values())) == 2
    assert s["bytes_moved"] == calculator.kv_cache_bytes(models.get("kvlab-tiny"), 128, "bf16")
    assert s["tokens_match"] is True and s["logits_equal"] is True and s["bytes_equal"] is True
    assert s["poison_left"] == 0
    df = pd.read_csv(out / "requests.csv")
    moved = df[df["mode"] != "colocated"]
    assert len(moved) == 2 * 2 * 3 * 2
    for col in ("tokens_match", "logits_equal", "bytes_equal", "first_token_match"):
        assert moved[col].all(), moved[~moved[col]]


@needs_nixl
def test_nixl_descriptors_and_transfers_are_counted_per_request(nixl_run):
    """One descriptor per unit for a contiguous cache; one per row (a block of one layer's K or V) for a paged one;
    one transfer per unit (bulk: 1, layer-wise: one per layer); posting time recorded."""
    done, out = nixl_run
    assert done.returncode == 0, done.stderr[-3000:]
    spec = models.get("kvlab-tiny")
    df = pd.read_csv(out / "requests.csv")
    moved = df[df["mode"] != "colocated"]
    for (layout, mode, context), g in moved.groupby(["layout", "mode", "context"]):
        transfers = 1 if mode == "bulk" else spec.layers
        rows = spec.layers * 2 * -(-context // 16)
        descs = transfers if layout == "contiguous" else rows
        assert (g["transfers"] == transfers).all() and (g["descriptors"] == descs).all(), (layout, mode, context)
        assert (g["post_ms"] > 0).all()


@needs_nixl
def test_nixl_summary_names_the_ucx_transport_it_used(nixl_run):
    """UCX's own protocol report says which transport carried the writes: on one host of the CPU, shared memory
    (cma) or, where the kernel forbids it, TCP — and then summary.json says it fell back to TCP."""
    done, out = nixl_run
    assert done.returncode == 0, done.stderr[-3000:]
    n = json.loads((out / "summary.json").read_text())["nixl"]
    assert n["operation"] == "WRITE" and n["agents"] == 2 and n["descs"] == "block" and n["version"]
    assert isinstance(n["ucx_transports"], list) and n["ucx_transports"], n
    assert n["tcp_fallback"] == any(t.startswith("tcp/") for t in n["ucx_transports"])
    assert all(e["from"] == "host" and e["to"] == "host" for e in n["ucx_writes"])


@needs_nixl
@pytest.mark.parametrize("policy", ["retry", "fail"])
def test_nixl_fault_campaign_never_decodes_a_partial_cache(policy, tmp_path):
    """Drop, delay, corrupt a layer and run out of memory on the decode side over NIXL: a corrupt layer is written
    from a flipped copy (the source stays true), so retry recovers it exactly; fail refuses each."""
    out = tmp_path / "run"
    done = kvlab_command(["disagg", "--backend", "nixl", "--layout", "paged", "--repeats", "1", "--faults", "8",
                          "--fault-kinds", "drop,delay,corrupt,oom", "--fault-timeout", "1", "--policy", policy,
                          "--quiet", "--out", str(out)], _env(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["faults_injected"] == 8 and s["decoded_from_partial"] == 0 and s["undetected"] == 0
    if policy == "retry":
        assert s["recovered"] == 8
    else:
        assert s["refused"] == 8
    f = pd.read_csv(out / "faults.csv")
    assert set(f["kind"]) == {"drop", "delay", "corrupt", "oom"}
    assert set(f.loc[f["kind"] == "corrupt", "detected_by"]) == {"checksum"}
    assert set(f.loc[f["kind"] == "oom", "detected_by"]) == {"decode out of memory"}


@needs_nixl
def test_nixl_merged_descriptors_move_the_cache_and_a_corrupt_copy_exactly(tmp_path):
    """--nixl-descs merged end to end, with two corrupt faults (written from a copy whose rows are adjacent on the
    prefill side only): every decode like colocated, each corrupt layer caught and recovered."""
    out = tmp_path / "run"
    done = kvlab_command(["disagg", "--backend", "nixl", "--layout", "paged", "--nixl-descs", "merged", "--repeats", "1",
                          "--faults", "2", "--fault-kinds", "corrupt", "--policy", "retry", "--quiet", "--out", str(out)],
                         _env(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["nixl"]["descs"] == "merged" and s["tokens_match"] and s["logits_equal"] and s["bytes_equal"]
    assert s["recovered"] == 2 and s["decoded_from_partial"] == 0
    f = pd.read_csv(out / "faults.csv")
    assert (f["detected_by"] == "checksum").all() and f["bytes_equal"].all()


@needs_nixl
def test_packed_block_tables_let_merged_descriptors_join_whole_layer_sides(tmp_path):
    """With both allocators handing out the lowest ids in order, a layer side's blocks are adjacent in both pools:
    merged, a bulk request is one descriptor per layer side (2 layers × K, V = 4) and a layer-wise one 2, where
    one a block is 2 × 2 × 8 = 32 (128 tokens in 16-token blocks); every decode identical."""
    out = tmp_path / "run"
    done = kvlab_command(["disagg", "--backend", "nixl", "--layout", "paged", "--nixl-descs", "merged", "--block-order",
                          "packed", "--repeats", "1", "--quiet", "--out", str(out)], _env(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["tokens_match"] and s["logits_equal"] and s["bytes_equal"] and s["poison_left"] == 0
    req = pd.read_csv(out / "requests.csv")
    assert set(req[req["mode"] == "bulk"]["descriptors"]) == {4}
    assert set(req[req["mode"] == "layerwise"]["descriptors"]) == {4}  # per request: 2 per layer, 2 layers


def test_merge_runs_joins_rows_adjacent_on_both_sides_only():
    src = np.array([4, 5, 6, 9, 10, 2], dtype=np.int64)
    dst = np.array([0, 1, 7, 8, 9, 10], dtype=np.int64)
    s, d, n = merge_runs(src, dst, 100)
    # 4→0, 5→1 run; 6→7 breaks (dst jumps); 9→8, 10→9 run; 2→10 breaks (src goes back)
    assert s.tolist() == [4, 6, 9, 2] and d.tolist() == [0, 7, 8, 10] and n.tolist() == [200, 100, 200, 100]
    s, d, n = merge_runs(np.arange(5), np.arange(10, 15), 8)
    assert s.tolist() == [0] and d.tolist() == [10] and n.tolist() == [40]
    assert merge_runs(np.zeros(0, np.int64), np.zeros(0, np.int64), 8)[2].size == 0


def test_ucx_transports_reads_the_write_tables_and_nothing_else(tmp_path):
    """A protocol report as UCX prints it (UCX_PROTO_INFO=y): only the remote-write tables of a peer endpoint count,
    not the agent's own loopback (self) nor the active-message tables that follow them."""
    p = "[1796083877.5] [vm:1:0]   "
    log = "\n".join(p + ln for ln in [
        "| agent self cfg#0                                         |",
        "| remote memory write by ucp_put* from host memory to host |",
        "+--------+-------------+-------------+",
        "| 0..inf | zero-copy   | posix/memory |",
        "+--------+-------------+-------------+",
        "| agent intra-node cfg#1                                   |",
        "| remote memory write by ucp_put* from cuda memory to cuda |",
        "+--------+-------------+-------------+",
        "| Range  | Description |   Config    |",
        "+--------+-------------+-------------+",
        "|   0..8 | short       | tcp/lo      |",
        "| 9..inf | zero-copy   | cuda_ipc/cuda, cuda_copy/cuda |",
        "+--------+-------------+-------------+",
        "+------------+--------------------+---------------+",
        "| agent intra-node cfg#1                          |",
        "| active message by ucp_am_send* from host memory |",
        "+------------+--------------------+---------------+",
        "|          0 | short              | tcp/lo        |",
    ]) + "\nsome other line\n"
    (tmp_path / "w.log").write_text(log)
    assert ucx_transports(tmp_path / "w.log") == [
        {"peer": "intra-node", "from": "cuda", "to": "cuda", "transports": ["cuda_copy/cuda", "cuda_ipc/cuda", "tcp/lo"]}]
    assert ucx_transports(tmp_path / "absent.log") == []


def test_ucx_transports_of_the_cache_on_a_gpu(tmp_path):
    """As UCX 1.x printed it on the H200 (run 20261201-023701): device names instead of "memory", and a table for
    host → GPU writes over tcp/lo beside the cache's GPU → GPU writes over cuda_ipc. The cache's transport is
    cuda_ipc, with no TCP; on a CPU run the host tables are the cache's."""
    from kvlab.disagg.nixl_link import cache_transports

    p = "[1796092643.8] [vm:496  :1]   "
    log = "\n".join(p + ln for ln in [
        "| kvlab-prefill-496 intra-node cfg#2                              |",
        "| remote memory write by ucp_put* from host memory to cuda/dev[1] |",
        "+--------+--------------------+-----------------+",
        "|  Range |    Description     |     Config      |",
        "+--------+--------------------+-----------------+",
        "| 0..inf | software emulation | tcp/lo          |",
        "+--------+--------------------+-----------------+",
        "| kvlab-prefill-496 intra-node cfg#2                                   |",
        "| remote memory write by ucp_put*(multi) from cuda/GPU0 to cuda/dev[1] |",
        "+--------+-------------+-----------------+",
        "| 0..inf | zero-copy   | cuda_ipc/cuda   |",
        "+--------+-------------+-----------------+",
    ])
    (tmp_path / "w.log").write_text(log)
    found = ucx_transports(tmp_path / "w.log")
    assert found == [{"peer": "intra-node", "from": "host", "to": "cuda", "transports": ["tcp/lo"]},
                     {"peer": "intra-node", "from": "cuda", "to": "cuda", "transports": ["cuda_ipc/cuda"]}]
    assert cache_transports(found, "cuda:0") == ["cuda_ipc/cuda"] == cache_transports(found, "cuda:0", "cuda:1")
    assert cache_transports(found, "cpu") == ["tcp/lo"] == cache_transports(found, "cpu", "cuda:0")
    assert cache_transports(found, "cpu", "cpu") == []  # no host → host table in this log


@pytest.mark.parametrize("argv, says", [
    (["--backend", "nixl", "--nixl-descs", "merge"], "nixl-descs = 'merge' is not valid; valid: block, merged"),
    (["--backend", "gloo", "--nixl-descs", "merged"], "is an option of backend nixl"),
])
def test_nixl_bad_input_is_one_line_before_anything_is_written(argv, says, tmp_path):
    if MISSING and "nixl" in argv[1]:
        pytest.skip(MISSING)
    done = kvlab_command(["disagg", *argv, "--out", str(tmp_path / "run")], _env(tmp_path))
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert done.returncode == 2 and len(lines) == 1 and says in lines[0], done.stderr
    assert not (tmp_path / "run").exists()


def test_a_machine_without_nixl_is_told_how_to_get_it(monkeypatch):
    from kvlab.disagg.backends import BACKENDS
    from kvlab.paged import nixl

    monkeypatch.setattr(nixl, "nixl_missing", lambda: "nixl is not installed or does not load (ImportError: x): "
                                                           "pip install 'kvlab[nixl]'")
    why = BACKENDS["nixl"].unavailable("cpu", "cpu")
    assert why.startswith("backend 'nixl': nixl is not installed") and "pip install 'kvlab[nixl]'" in why
