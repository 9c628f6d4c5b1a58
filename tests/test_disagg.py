"""Prefill and decode as two processes (kvlab.disagg, issue 15): the CPU path through gloo, the completion
protocol's refusals, and bad input refused before anything starts. The ipc and nccl paths run on GPUs
(test_disagg_gpu below; the committed GPU runs are in data/disagg/)."""

from __future__ import annotations

import contextlib
import json
import os
import socket

import pandas as pd
import pytest
import torch
import torch.distributed as dist

from conftest import cpu_env as _env
from conftest import cpu_process_env
from conftest import disagg_workers as _workers_of
from conftest import free_port as _free_port
from conftest import kvlab_command
from conftest import requests_done as _requests_done
from kvlab import calculator, disagg, models
from kvlab.disagg.protocol import Control, IncompleteCacheError, LandedLayers


# ------------------------------------------------------------------------------------------ protocol


def test_landed_layers_refuses_what_is_not_a_complete_send():
    t = LandedLayers(4, "cuda:0")
    t.begin(7)
    t.mark(7, 0)
    t.mark(7, 2)
    with pytest.raises(IncompleteCacheError, match=r"request 7: 2 of 4 layers .* \(missing \[1, 3\]\)"):
        t.require(7)
    for bad, says in ((lambda: t.mark(7, 2), "signalled twice"), (lambda: t.mark(7, -1), "out of range"),
                      (lambda: t.mark(7, 4), "out of range"), (lambda: t.mark(6, 1), "belongs to request 7")):
        with pytest.raises(ValueError, match=says):
            bad()
    t.mark(7, 1)
    t.mark(7, 3)
    t.require(7)
    t.begin(8)  # a new request starts from nothing: the old request's layers are not its layers
    with pytest.raises(IncompleteCacheError, match="request 8: 4 of 4"):
        t.require(8)
    with pytest.raises(IncompleteCacheError, match="request 7"):
        t.require(7)


# ------------------------------------------------------------------------------------- the CPU path


@pytest.fixture(scope="module")
def gloo_run(tmp_path_factory):
    """One gloo run, both layouts, a context that fills its last block and one that does not."""
    out = tmp_path_factory.mktemp("disagg") / "run"
    done = kvlab_command(["disagg", "--backend", "gloo", "--model", "kvlab-tiny", "--context", "128,100",
                          "--layout", "contiguous,paged", "--decode-tokens", "20", "--repeats", "2", "--quiet",
                          "--out", str(out)], _env(out.parent))
    return done, out


def test_gloo_contract_summary(gloo_run):
    done, out = gloo_run
    assert done.returncode == 0, done.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["backend"] == "gloo" and s["processes"] >= 2 and s["context"] == 128 and s["kv_dtype"] == "bfloat16"
    assert s["bytes_moved"] == calculator.kv_cache_bytes(models.get("kvlab-tiny"), 128, "bf16") == s["kv_cache_bytes"]
    assert s["tokens_match"] is True and s["logits_equal"] is True and s["poison_left"] == 0
    pids = set(s["pids"].values())
    assert len(pids) == 2 and all(isinstance(p, int) for p in pids)
    run = json.loads((out / "run.json").read_text())
    assert run["status"] == "finished" and run["study"] == "disagg" and run["summary"]["backend"] == "gloo"
    assert run["worker_exit"] == {"decode": 0, "prefill": 0}  # both ended of themselves, none left running
    assert "decode_memory" not in s  # a CPU decode side records no device memory


def test_gloo_every_request_decodes_like_colocated(gloo_run):
    done, out = gloo_run
    df = pd.read_csv(out / "requests.csv")
    moved = df[df["mode"] != "colocated"]
    # 2 layouts × 2 contexts × (warm-up + 2 rounds) × 2 modes
    assert len(moved) == 2 * 2 * 3 * 2
    assert set(moved["layout"]) == {"contiguous", "paged"} and set(moved["context"]) == {100, 128}
    for col in ("tokens_match", "logits_equal", "bytes_equal", "first_token_match"):
        assert moved[col].all(), moved[~moved[col]]
    assert (moved["poison_left"] == 0).all()
    # the paged path moves whole blocks: 100 tokens in 16-token blocks is 7 blocks = 112 tokens' bytes
    paged100 = moved[(moved["layout"] == "paged") & (moved["context"] == 100)]
    spec = models.get("kvlab-tiny")
    assert (paged100["bytes_moved"] == calculator.kv_cache_bytes(spec, 112, "bf16")).all()
    assert (moved["exposed_ms"].notna()).all() and (moved["ttft_ms"] > 0).all()


def test_a_layer_that_never_arrives_is_refused_by_name(tmp_path):
    cfg = disagg.DisaggConfig(modes=("layerwise",), repeats=1, warmup=0, drop_layer=1, timeout_s=3)
    with pytest.raises(disagg.DisaggError, match=r"decode process stopped: IncompleteCacheError: request \d+: 1 of 2 "
                                                  r"layers have not landed on cpu \(missing \[1\]\); decode refused"):
        disagg.run(cfg, tmp_path / "run", progress=False)
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["status"] == "failed" and (tmp_path / "run" / "STOPPED.txt").is_file()
    assert not (tmp_path / "run" / "summary.json").exists()


# ------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("argv, says", [
    (["--backend", "glo"], "did you mean 'gloo'"),
    (["--mode", "bulky"], "did you mean 'bulk'"),
    (["--layout", "pagd"], "did you mean 'paged'"),
    (["--model", "llama-3.1-8"], "did you mean 'llama-3.1-8b'"),
    (["--context", "1x"], "'1x' is not a token count"),
    (["--context", "128,128"], "with a repeat"),
    (["--policy", "retyr"], "did you mean 'retry'"),
    (["--faults", "-1"], "faults = -1"),
    (["--faults", "3", "--timeout", "1.5"], "must stay at least 1 s under timeout"),
    (["--kv-dtype", "fp8"], "kv_dtype = 'fp8' is not valid"),
    (["--repeats", "0"], "repeats = 0"),
    (["--device", "cuda:7"], "does not exist"),
    (["--timeout", "0"], "timeout = 0.0"),
    (["--decode-memory-gib", "-1"], "decode-memory-gib = -1.0: give GiB > 0, or 0 for no cap"),
    (["--decode-memory-gib", "nan"], "decode-memory-gib = nan"),
    (["--decode-memory-gib", "0.0001"], "give at least 1 MiB"),
    (["--decode-memory-gib", "2", "--decode-device", "cpu"], "caps a GPU's allocator; the decode device is cpu"),
    # found in a later audit: each of these started, ran or hung before
    (["--timeout", "inf"], "timeout = inf: give seconds > 0 and at most 86400"),
    (["--timeout", "1e12"], "timeout = 1000000000000.0"),
    (["--context", "8k"], "context = 8192: longer than kvlab-tiny's 4096 positions"),
    (["--layout", "paged", "--block-size", "1000000"], "block-size = 1000000: give at most 4096 tokens a block"),
    (["--policy", "retry"], "--policy set(s) up a fault campaign; add --faults N"),
    (["--fault-kinds", "drop"], "--fault-kinds set(s) up a fault campaign"),
    (["--in-order", "--backend", "ipc"], "in-order makes gloo match sends in order as nccl does; got backend 'ipc'"),
    (["--in-order", "--backend", "nccl"], "(nccl is in order already)"),
])
def test_bad_input_is_one_line_before_anything_is_written(argv, says, tmp_path):
    done = kvlab_command(["disagg", *argv, "--out", str(tmp_path / "run")], _env(tmp_path))
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert done.returncode == 2 and len(lines) == 1 and says in lines[0], done.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("kw", [dict(in_order=True), dict(in_order=True, faults=2)])
def test_a_test_drop_on_an_in_order_link_is_refused(kw):
    """drop_layer skips one layer outside the campaign's fence: on an in-order link the receive posted for it
    would take a later unit's bytes."""
    with pytest.raises(ValueError, match="drop_layer = 1 on an in-order link .* run a fault campaign"):
        disagg.check(disagg.DisaggConfig(drop_layer=1, **kw))
    with pytest.raises(ValueError, match="in_order = 'yes': give True or False"):
        disagg.check(disagg.DisaggConfig(in_order="yes"))


def test_an_empty_out_is_refused_not_taken_for_the_default(tmp_path):
    done = kvlab_command(["disagg", "--out", ""], _env(tmp_path))
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert done.returncode == 2 and len(lines) == 1 and "--out is empty" in lines[0], done.stderr
    assert not (tmp_path / "data").exists()


@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="this checks the refusals of a machine without GPUs")
@pytest.mark.parametrize("backend, says", [("ipc", "needs a GPU"), ("nccl", "needs two GPUs")])
def test_backends_this_machine_lacks_are_refused(backend, says):
    with pytest.raises(ValueError, match=says):
        disagg.check(disagg.DisaggConfig(backend=backend))


def test_bench_is_refused_where_the_backend_has_none():
    with pytest.raises(ValueError, match="bench times the send alone with backend gloo, ipc, nccl; got 'nixl'"):
        disagg.check(disagg.DisaggConfig(backend="nixl", bench=True))


def test_gloo_bench_times_the_send_against_a_copy_of_the_same_bytes(tmp_path):
    """The bench of the torch.distributed backends on this CPU: every round's send (bulk, and the last layer)
    is timed from the prefill side's start to the decode side's landing, beside an in-process copy of the same
    bytes; both layouts, each round a positive time, the bytes those of the cache (or its last layer)."""
    from kvlab import calculator

    s = disagg.run(disagg.DisaggConfig(backend="gloo", layouts=("contiguous", "paged"), repeats=1, bench=True,
                                       bench_repeats=3), tmp_path / "run", progress=False)
    b = pd.read_csv(tmp_path / "run" / "bench.csv")
    assert set(b["kind"]) == {"send", "ceiling", "layer"} and set(b["layout"]) == {"contiguous", "paged"}
    assert (b.groupby(["layout", "kind"]).size() == 3).all() and (b["ms"] > 0).all()
    assert (b["timer"] == "host clock, two processes").all()
    spec = disagg.DisaggConfig().spec()
    whole = calculator.kv_cache_bytes(spec, 128, "bfloat16")
    assert set(b[b.kind != "layer"]["bytes"]) == {whole} and set(b[b.kind == "layer"]["bytes"]) == {whole // spec.layers}
    assert s["tokens_match"] and s["logits_equal"]


@pytest.mark.parametrize("signals", [1, 2])
def test_sigterm_stops_both_workers_and_marks_the_run(tmp_path, signals):
    """A `timeout` or a batch system ends the launcher with SIGTERM: the workers must go too, and the run folder
    must say it stopped (on 2×H200 a killed launcher once left run.json saying "running"). `timeout` signals
    twice, the launcher and then its process group: with the second one, run.json once kept saying "running"
    (an H200 campaign, 2026-12-01)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from conftest import REPO

    out = tmp_path / "run"
    env = cpu_process_env(tmp_path)
    port = _free_port()
    p = subprocess.Popen([sys.executable, "-m", "kvlab", "disagg", "--repeats", "1000000", "--quiet", "--out", str(out),
                          "--port", str(port)],
                         cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while _requests_done(port) < 2 and time.monotonic() < deadline:  # the workers are up and requests flow
            time.sleep(0.2)
        for _ in range(signals):
            p.send_signal(signal.SIGTERM)
        p.wait(30)
    finally:
        if p.poll() is None:
            p.kill()
        for pid in _workers_of(out).values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert p.returncode == 143, p.stderr.read()
    run = json.loads((out / "run.json").read_text())
    assert run["status"] == "failed" and "SIGTERM" in run["stopped"] and (out / "STOPPED.txt").is_file()
    time.sleep(1)
    left = _workers_of(out)
    assert not left, f"orphan workers: pids {left}"


@pytest.mark.parametrize("posted_first", [True, False])
def test_a_signal_death_is_named_before_the_error_it_caused_in_its_peer(posted_first, tmp_path, monkeypatch):
    """CI once saw the decode side's "Connection closed by peer" reach the launcher before the prefill process's
    SIGKILL did, and the line named the consequence. Whichever arrives first, the death by a signal is the cause."""
    from kvlab.disagg import launch

    class Proc:
        def __init__(self, role, code):
            self.code, self.args = code, ["x", "--run-dir", str(tmp_path)]
            (tmp_path / f"worker-{role}.log").write_text(f"{role} was here\n")

        def poll(self):
            return self.code

    monkeypatch.setattr(launch.time, "sleep", lambda s: None)
    store = Control(dist.HashStore(), 5.0, b"k" * 32, scope="kvlab")  # as the launcher reads it: signed values
    store.post("error/decode", {"error": "RuntimeError: Connection closed by peer"})
    procs = [("decode", Proc("decode", 1 if not posted_first else None)), ("prefill", Proc("prefill", -9))]
    line = launch._first_cause(store, procs)
    assert line == "the prefill process was killed by SIGKILL (exit code -9): last line of its log: prefill was here"
    # a process that posted its own error and then aborted on its way out (a C++ thread alive at exit) failed on
    # that error: the abort is not the cause
    procs[0] = ("decode", Proc("decode", -6))
    procs[1] = ("prefill", Proc("prefill", None))
    assert launch._first_cause(store, procs) == "the decode process stopped: RuntimeError: Connection closed by peer"
    # the prefill process's death the kill campaign planned is a fault, never the cause of a failure
    procs[0] = ("decode", Proc("decode", 1))
    procs[1] = ("prefill", Proc("prefill", -9))
    assert launch._first_cause(store, procs, planned_prefill_kill=True) == \
        "the decode process stopped: RuntimeError: Connection closed by peer"
    # a crash signal (SIGABRT from a library as its peer vanished) does not outrank a posted error: both are named
    store.store.delete_key("error/decode")
    store.post("error/prefill", {"error": "RuntimeError: NIXL transfer ERR"})
    procs[:] = [("decode", Proc("decode", -6)), ("prefill", Proc("prefill", 1))]
    assert launch._first_cause(store, procs) == ("the prefill process stopped: RuntimeError: NIXL transfer ERR (the "
                                                 "decode process was killed by SIGABRT (exit code -6))")
    store.store.delete_key("error/prefill")
    store.post("error/decode", {"error": "RuntimeError: Connection closed by peer"})
    # without a death by a signal the posted error is the cause, and without either the exit code and the log
    procs[1] = ("prefill", Proc("prefill", None))
    assert launch._first_cause(store, procs) == "the decode process stopped: RuntimeError: Connection closed by peer"
    store.store.delete_key("error/decode")
    procs[0] = ("decode", Proc("decode", 3))
    assert launch._first_cause(store, procs) == "the decode process exited with code 3: last line of its log: decode was here"


@pytest.mark.parametrize("when", ["at start", "mid-run", "mid-run, kill faults planned"])
def test_a_peer_that_dies_is_named_in_one_line_and_leaves_no_orphan(when, tmp_path):
    """The prefill process killed (SIGKILL: no goodbye, no posted error) as soon as it exists, or while requests
    flow: the launcher names it and its signal in one line, stops the decode process and marks the run stopped,
    well inside the deadline a decode-side wait would have used."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from conftest import REPO

    out = tmp_path / "run"
    env = cpu_process_env(tmp_path)
    port = _free_port()
    # with kill faults planned, a SIGKILL the prefill process did not announce (the OOM killer, a user) is still
    # a failure, not a fault to recover from
    planned = ["--faults", "1", "--fault-kinds", "kill"] if "planned" in when else []
    p = subprocess.Popen([sys.executable, "-m", "kvlab", "disagg", "--repeats", "1000000", "--quiet", "--out", str(out),
                          "--port", str(port), *planned],
                         cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while "prefill" not in _workers_of(out) and time.monotonic() < deadline:
            time.sleep(0.05)
        if when.startswith("mid-run"):  # until the decode side has finished requests: they flow
            while _requests_done(port) < 2 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert _requests_done(port) >= 2, "no requests finished within 60 s"
        os.kill(_workers_of(out)["prefill"], signal.SIGKILL)
        t0 = time.monotonic()
        _, err = p.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:  # a failed assertion or a timeout here must not leave a run of a million rounds on CI's two cores
        if p.poll() is None:
            p.kill()
        for pid in _workers_of(out).values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert p.returncode != 0 and len(lines) == 1, err
    assert "the prefill process was killed by SIGKILL (exit code -9)" in lines[0], lines[0]
    assert took < 30, f"the launcher took {took:.0f} s to notice"
    run = json.loads((out / "run.json").read_text())
    assert run["status"] == "failed" and "prefill" in run["stopped"] and (out / "STOPPED.txt").is_file()
    time.sleep(1)
    assert not _workers_of(out), "orphan workers"


def test_a_port_in_use_is_refused(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ValueError, match=f"port = {port}: cannot listen"):
            disagg.run(disagg.DisaggConfig(port=port), tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------------------------ GPU


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")
def test_disagg_gpu_ipc(tmp_path):
    """Two processes on one GPU: the prefill process writes into the decode process's memory (copy engine for a
    contiguous cache, the Triton row kernel for a paged one); every decode matches the colocated one."""
    s = disagg.run(disagg.DisaggConfig(backend="ipc", contexts=(128, 100), layouts=("contiguous", "paged"),
                                       repeats=2, bench=True, bench_repeats=3), tmp_path / "run", progress=False)
    assert s["tokens_match"] and s["logits_equal"] and s["bytes_equal"] and s["poison_left"] == 0
    assert len(s["bench"]) == 4


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two GPUs")
def test_disagg_gpu_nccl(tmp_path):
    s = disagg.run(disagg.DisaggConfig(backend="nccl", contexts=(128, 100), layouts=("contiguous", "paged"),
                                       repeats=2, bench=True, bench_repeats=3), tmp_path / "run", progress=False)
    assert s["tokens_match"] and s["logits_equal"] and s["bytes_equal"] and s["poison_left"] == 0
    assert len(s["bench"]) == 4


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two GPUs")
@pytest.mark.parametrize("policy, layout", [("fail", "contiguous"), ("retry", "paged"), ("recompute", "paged")])
def test_disagg_gpu_nccl_fault_campaign(policy, layout, tmp_path):
    """NCCL matches in order: a dropped layer holds back those behind it until the fence, and the decode side
    polls each receive against the deadline (seed 9 draws layers 1, 1, 1, 0, 0, 0, 1, 1 of the tiny model).
    Nothing decodes from a partial or corrupt cache; fail refuses all, retry and recompute recover all."""
    cfg = disagg.DisaggConfig(backend="nccl", repeats=1, warmup=0, modes=("layerwise",), faults=8, policy=policy,
                              seed=9, fault_timeout_s=1.0, layouts=(layout,),
                              fault_kinds=("drop", "delay", "corrupt", "oom"))
    s = disagg.run(cfg, tmp_path / "run", progress=False)
    df = pd.read_csv(tmp_path / "run" / "faults.csv")
    assert s["faults_injected"] == 8 and s["decoded_from_partial"] == 0 and s["undetected"] == 0
    assert df["detected_by"].tolist() == ["deadline", "deadline", "checksum", "decode out of memory"] * 2
    if policy == "fail":
        assert s["refused"] == 8 and not df["decoded"].any()
        assert "missing or corrupt [0, 1]" in df[(df.kind == "drop") & (df.layer == 0)]["error"].iloc[0]
    else:
        assert s["recovered"] == 8 and df["tokens_match"].all() and df["logits_equal"].all() and df["bytes_equal"].all()
    assert s["tokens_match"] and s["logits_equal"] and s["poison_left"] == 0  # the measured rounds around it
    assert df["recover_ms"].max() <= (cfg.fault_timeout_s + 1.0) * 1e3 * (cfg.retries + 1)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="a paged send between two GPUs needs two GPUs")
def test_disagg_gpu_ipc_paged_between_two_gpus_pulls(tmp_path):
    """Triton will not store to the peer's IPC pointer, so the row kernel runs on the decode GPU and reads the
    prefill pool over NVLink: every decode identical, the bench names the pull."""
    s = disagg.run(disagg.DisaggConfig(backend="ipc", decode_device="cuda:1", contexts=(128,), layouts=("paged",),
                                       repeats=2, bench=True, bench_repeats=3), tmp_path / "run", progress=False)
    assert s["tokens_match"] and s["logits_equal"] and s["bytes_equal"] and s["poison_left"] == 0
    b = pd.read_csv(tmp_path / "run" / "bench.csv")
    assert b[b.kind == "send"]["kernel"].str.contains("pulled by the decode GPU").all()


@pytest.mark.gpu
def test_a_real_decode_out_of_memory_stops_the_run_in_one_line_and_leaves_no_process(tmp_path):
    """Not injected: the decode process's allocator is capped between what it holds after its reference and what
    its destination needs, so allocating the destination really fails. One line names the step, nothing is
    decoded, both workers are gone and the run folder says so, with the memory recorded up to the failure.
    A small model with a wide cache (32 KiB a token): the 8k pool (512 MiB) needs a segment of its own, so the cap
    is met by the allocator and not absorbed by a segment the reference left half free (kvlab-tiny's was)."""
    config = tmp_path / "wide.json"
    config.write_text(json.dumps({"model_type": "qwen2", "hidden_size": 1024, "num_attention_heads": 8,
                                  "num_key_value_heads": 8, "num_hidden_layers": 8, "intermediate_size": 2048,
                                  "vocab_size": 1000, "max_position_embeddings": 16384, "torch_dtype": "bfloat16"}))
    cfg = dict(backend="ipc", model=str(config), contexts=(8192,), layouts=("paged",), modes=("layerwise",),
               repeats=1, warmup=0)
    s = disagg.run(disagg.DisaggConfig(**cfg), tmp_path / "free", progress=False)
    assert s["tokens_match"] and s["logits_equal"]
    phases = {r["phase"]: r for r in s["decode_memory"]}
    assert set(phases) == {"reference", "destination", "requests"}
    before, after = phases["reference"]["allocated_bytes"], phases["destination"]["allocated_bytes"]
    assert after - before >= 512 << 20  # the destination is allocated and kept
    cap = (before + (after - before) / 2) / 2 ** 30
    with pytest.raises(disagg.DisaggError, match="while allocating its destination for the cache: it asked for") as e:
        disagg.run(disagg.DisaggConfig(**cfg, decode_memory_gib=cap), tmp_path / "capped", progress=False)
    assert "DecodeOutOfMemory" in str(e.value) and "\n" not in str(e.value)
    run = json.loads((tmp_path / "capped" / "run.json").read_text())
    assert run["status"] == "failed" and "DecodeOutOfMemory" in run["stopped"]
    assert run["worker_exit"]["decode"] == 1 and run["worker_exit"]["prefill"] is not None
    assert [r["phase"] for r in run["decode_memory"]] == ["reference", "destination"]
    assert run["decode_memory"][-1]["failed"]
    assert not (tmp_path / "capped" / "requests.csv").exists()


@pytest.mark.gpu
@pytest.mark.parametrize("layouts", [("contiguous", "paged"), ("paged", "contiguous")])
def test_a_context_leaves_nothing_behind_for_the_next(layouts, tmp_path):
    """Two (layout, context) pairs over ipc, with the bench (a paged bulk send replays a CUDA graph, and is tuned):
    the first's destination is let go of by the prefill process and freed before the second's reference, so both
    references end holding exactly the same memory (weights and one reference cache). Before, the first
    destination (and its reference) still counted."""
    config = tmp_path / "wide.json"
    config.write_text(json.dumps({"model_type": "qwen2", "hidden_size": 1024, "num_attention_heads": 8,
                                  "num_key_value_heads": 8, "num_hidden_layers": 8, "intermediate_size": 2048,
                                  "vocab_size": 1000, "max_position_embeddings": 16384, "torch_dtype": "bfloat16"}))
    s = disagg.run(disagg.DisaggConfig(backend="ipc", model=str(config), contexts=(8192,), layouts=layouts,
                                       modes=("bulk",), repeats=1, warmup=0, bench=True, bench_repeats=3),
                   tmp_path / "run", progress=False)
    assert s["tokens_match"] and s["logits_equal"] and s["bytes_equal"]
    refs = [r for r in s["decode_memory"] if r["phase"] == "reference"]
    assert [r["layout"] for r in refs] == list(layouts)
    assert refs[1]["allocated_bytes"] == refs[0]["allocated_bytes"]


def test_an_out_of_memory_in_the_decode_process_becomes_one_line_naming_the_request_and_step():
    from kvlab.disagg.memory import DecodeMemory, DecodeOutOfMemory
    from kvlab.disagg.decode import DecodeWorker

    w = object.__new__(DecodeWorker)
    w.mem = DecodeMemory(torch.device("cpu"))

    def fails():
        w.mem.where, w.mem.step = "request 7 (paged, 32768 tokens, layerwise)", "reading"
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.75 GiB. GPU 0 has a total capacity of "
                                     "139.81 GiB\nmore lines")

    w._run = fails
    with pytest.raises(DecodeOutOfMemory) as e:
        w.run()
    msg = str(e.value)
    assert msg.startswith("request 7 (paged, 32768 tokens, layerwise): the decode process ran out of memory on cpu "
                          "while reading the landed cache into the cache decode reads: it asked for 1.75 GiB")
    assert "nothing was decoded from its cache" in msg and "\n" not in msg
    assert isinstance(e.value.__cause__, torch.OutOfMemoryError)
    w.mem.step, w.mem.landed = "landing", "5 of 28 layers had landed; missing 5…27"
    assert "while receiving the layers (5 of 28 layers had landed; missing 5…27)" in str(w.mem.explain(
        torch.OutOfMemoryError("out of memory")))
    w.mem.step = "checking"
    assert "its decode had finished but could not be checked, so it is not counted" in str(w.mem.explain(
        torch.OutOfMemoryError("out of memory")))
    w.mem.step = "colocated"
    assert "colocated request's decode step (from its own reference cache)" in str(w.mem.explain(
        torch.OutOfMemoryError("out of memory")))
    other = ValueError("not a memory error")
    w._run = lambda: (_ for _ in ()).throw(other)
    with pytest.raises(ValueError) as e:  # anything else passes through as it was
        w.run()
    assert e.value is other


def test_layer_lists_are_written_as_runs():
    from kvlab.disagg.decode import _layers_text

    assert _layers_text([3, 4, 5, 9]) == "3…5, 9"
    assert _layers_text([0]) == "0" and _layers_text([]) == "none" and _layers_text([1, 3]) == "1, 3"


def test_a_stopped_run_records_how_each_worker_ended_and_the_decode_sides_memory(tmp_path):
    from kvlab import results
    from kvlab.disagg import launch

    class Proc:
        def __init__(self, code):
            self.code = code

        def poll(self):
            return self.code

    mem = [{"phase": "reference", "allocated_bytes": 10}, {"phase": "destination", "failed": True}]
    store = Control(dist.HashStore(), 5.0, b"k" * 32, scope="kvlab")
    store.post("error/decode", {"error": "DecodeOutOfMemory: x", "memory": mem})
    run = results.start("disagg", {}, run_dir=tmp_path / "r")
    launch._stopped(run, "DisaggError: the decode process stopped")
    launch._record_end(run, [("decode", Proc(1)), ("prefill", Proc(-15))], launch._worker_memory(store))
    got = json.loads((tmp_path / "r" / "run.json").read_text())
    assert got["status"] == "failed" and got["worker_exit"] == {"decode": 1, "prefill": -15}
    assert got["decode_memory"] == mem and got["stopped"] == "DisaggError: the decode process stopped"
    run.update(note="later")  # the Run object was read back: a later update keeps "failed" and the record
    got = json.loads((tmp_path / "r" / "run.json").read_text())
    assert got["status"] == "failed" and got["worker_exit"]["decode"] == 1 and got["note"] == "later"
    assert launch._worker_memory(Control(dist.HashStore(), 5.0, b"k" * 32)) is None


def test_an_out_of_memory_after_decode_is_named_as_the_check_and_leaves_no_process(tmp_path):
    """Through the launcher, on a CPU: the decode process's poison count (the check after its decode) raises
    torch.OutOfMemoryError, as it did for real on the H200 (run 20261201-071033), here by a patch loaded into both
    worker processes. One line names the request and the step and says the decode had finished; both workers are
    gone; run.json says it stopped and how each worker ended."""
    patch = tmp_path / "patch"
    patch.mkdir()
    (patch / "sitecustomize.py").write_text(
        "import torch\n"
        "from kvlab import kvcache\n"
        "def _oom(self):\n"
        "    raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 7.00 GiB. (a test)')\n"
        "kvcache.KVBuffer.count_poison = _oom\n")
    env = _env(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(patch), os.environ.get("PYTHONPATH", "")) if p)
    out = tmp_path / "run"
    done = kvlab_command(["disagg", "--backend", "gloo", "--device", "cpu", "--context", "128", "--mode", "bulk",
                          "--repeats", "1", "--warmup", "0", "--quiet", "--out", str(out)], env)
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert done.returncode == 1 and len(lines) == 1, done.stderr[-3000:]
    assert ("DecodeOutOfMemory: request 1 (contiguous, 128 tokens, bulk): the decode process ran out of memory on cpu "
            "while checking the decode against the colocated reference" in lines[0]), lines[0]
    assert "it asked for 7.00 GiB; its decode had finished but could not be checked, so it is not counted" in lines[0]
    run = json.loads((out / "run.json").read_text())
    assert run["status"] == "failed" and "DecodeOutOfMemory" in run["stopped"] and (out / "STOPPED.txt").is_file()
    assert run["worker_exit"]["decode"] == 1 and run["worker_exit"]["prefill"] is not None
    assert not (out / "summary.json").exists() and not (out / "requests.csv").exists()


def test_a_decode_out_of_memory_under_torchrun_is_one_line_and_keeps_the_memory(monkeypatch, tmp_path):
    """Under torchrun rank 0 is the decode worker itself: its DecodeOutOfMemory reaches the caller as the
    launcher's one-line DisaggError, and run.json keeps the memory rows it carried."""
    from kvlab.disagg import launch
    from kvlab.disagg.memory import DecodeOutOfMemory

    for k, v in {"TORCHELASTIC_RUN_ID": "t", "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": "29999", "KVLAB_CONTROL_KEY": "ab" * 32}.items():
        monkeypatch.setenv(k, v)
    rows = [{"phase": "reference", "allocated_bytes": 1}, {"phase": "destination", "failed": True}]

    def entry(*a, **k):
        err = DecodeOutOfMemory("paged, 128 tokens: the decode process ran out of memory on cuda:0 while allocating")
        err.memory_rows = rows
        raise err

    monkeypatch.setattr(launch, "entry", entry)
    with pytest.raises(disagg.DisaggError, match="^the decode process stopped: DecodeOutOfMemory: paged, 128 tokens"):
        disagg.run(disagg.DisaggConfig(), tmp_path / "run", progress=False)
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["status"] == "failed" and run["decode_memory"] == rows


def test_the_poison_count_is_the_same_across_its_chunks():
    """count_poison sums its mask 16 M elements at a time: NaNs in the first chunk, at a chunk's edge and in the
    last, partial one are all counted."""
    from kvlab.kvcache import KVBuffer, KVLayout

    buf = KVBuffer(KVLayout(1, 1, 1, (1 << 24) + 1000, 1, torch.bfloat16), "cpu")  # one chunk and a bit
    buf.data.zero_()
    flat = buf.data.view(-1)
    assert flat.numel() > 1 << 24
    for i in (0, (1 << 24) - 1, 1 << 24, flat.numel() - 1):
        flat[i] = float("nan")
    assert buf.count_poison() == 4 == int(torch.isnan(buf.data).sum())


# ------------------------------------------------------------------------------------- fault injection


@pytest.mark.parametrize("policy", ["fail", "retry", "recompute"])
def test_fault_campaign_never_decodes_a_partial_cache(policy, tmp_path):
    """Issue 16's campaign, small: each kind (drop, delay, corrupt) at each of the tiny model's two layers (seed 9
    draws layers 1, 1, 1, 0, 0, 0: a dropped layer 0 is the case where, without per-unit tags, layer 1's bytes
    landed in layer 0's receive). fail refuses each with a clear error; retry and recompute recover each with a
    decode identical to colocated; nothing undetected, nothing decoded from a partial or corrupt cache, no
    decision later than the deadline + 1 s."""
    from kvlab.disagg.faults import DEFAULT_KINDS as KINDS
    from kvlab.disagg.faults import plan

    assert [f["layer"] for f in plan(6, 2, seed=9)] == [1, 1, 1, 0, 0, 0]
    cfg = disagg.DisaggConfig(repeats=1, warmup=0, modes=("layerwise",), faults=6, policy=policy, seed=9,
                              fault_timeout_s=0.5, layouts=("paged",) if policy == "retry" else ("contiguous",))
    s = disagg.run(cfg, tmp_path / "run", progress=False)
    df = pd.read_csv(tmp_path / "run" / "faults.csv")
    assert sorted(set(df["kind"])) == sorted(KINDS) and s["faults_injected"] == 6
    assert s["decoded_from_partial"] == 0 and s["undetected"] == 0
    assert set(df["detected_by"]) == {"deadline", "checksum"}
    assert (df[df.kind == "corrupt"]["detected_by"] == "checksum").all()
    if policy == "fail":
        assert s["refused"] == 6 and not df["decoded"].any()
        assert df["error"].str.contains("decode refused").all() and df["error"].str.contains("missing or corrupt").all()
    else:
        assert s["recovered"] == 6 and s["refused"] == 0
        assert df["tokens_match"].all() and df["logits_equal"].all() and df["bytes_equal"].all()
        want = "recovered (retry)" if policy == "retry" else "recovered (recompute)"
        assert (df["outcome"] == want).all()
    assert df["recover_ms"].max() <= (cfg.fault_timeout_s + 1.0) * 1e3 * (cfg.retries + 1)
    if policy == "fail":  # a refusal comes within the deadline + 1 s
        assert df["recover_ms"].max() <= (cfg.fault_timeout_s + 1.0) * 1e3


@pytest.mark.parametrize("policy", ["fail", "retry", "recompute"])
def test_a_sender_killed_mid_send_is_replaced_and_nothing_decodes_from_its_half(policy, tmp_path):
    """kill: the prefill process sends layer 0, then dies by SIGKILL before layer 1 (seed 9 draws layer 1). The
    decode side sees the receive fail, trusts no layer of that request (no live sender checksummed them), and
    forms a new process group with the process the launcher started in the dead one's place. fail refuses and
    names the death; recompute prefills itself, and so does retry (the new process's start, seconds, is not
    bounded by the fault's deadline; the first kill-retry campaign, run 20261130-231342-cpu, waited 2.7 s past
    it). Every policy decides within the deadline + 1 s; the run then goes on with the new process (its stop
    message is answered), and no process is left."""
    cfg = disagg.DisaggConfig(repeats=1, warmup=0, modes=("layerwise",), faults=1, policy=policy, seed=9,
                              fault_timeout_s=0.5, fault_kinds=("kill",))
    s = disagg.run(cfg, tmp_path / "run", progress=False)
    df = pd.read_csv(tmp_path / "run" / "faults.csv")
    assert df["kind"].tolist() == ["kill"] and df["layer"].tolist() == [1]
    assert s["decoded_from_partial"] == 0 and s["undetected"] == 0
    assert df["detected_by"].iloc[0] in ("receive failed", "peer died")
    assert (tmp_path / "run" / "worker-prefill-g1.log").is_file()  # the successor ran
    assert [(k["generation"], k["layer"]) for k in s["prefill_kills"]] == [(0, 1)]  # the announced, planned death
    if policy == "fail":
        assert s["refused"] == 1 and not df["decoded"].any()
        assert "the prefill process died mid-send" in df["error"].iloc[0]
    else:
        assert s["recovered"] == 1 and df["tokens_match"].all() and df["logits_equal"].all() and df["bytes_equal"].all()
        assert df["outcome"].iloc[0] == {"retry": "recovered (recompute: sender died)",
                                         "recompute": "recovered (recompute)"}[policy]
    assert df["recover_ms"].iloc[0] <= (cfg.fault_timeout_s + 1.0) * 1e3  # decided before the successor came
    assert df["takeover_ms"].iloc[0] > 0  # and the successor was joined after the decision
    assert not _workers_of(tmp_path / "run")


@pytest.mark.parametrize("policy", ["fail", "retry", "recompute"])
def test_a_decode_side_out_of_memory_is_refused_or_recovered_never_decoded_half(policy, tmp_path):
    """oom: the decode side's allocation fails as layer k lands (seed 9 draws layers 1 and 1; the paged layout,
    whose later receives are drained after the failure). Layer k and after are not trusted: fail refuses and
    says out of memory, retry asks for them again, recompute prefills on the decode side."""
    cfg = disagg.DisaggConfig(repeats=1, warmup=0, modes=("layerwise",), faults=2, policy=policy, seed=9,
                              fault_timeout_s=0.5, fault_kinds=("oom",), layouts=("paged",))
    s = disagg.run(cfg, tmp_path / "run", progress=False)
    df = pd.read_csv(tmp_path / "run" / "faults.csv")
    assert df["kind"].tolist() == ["oom", "oom"] and (df["detected_by"] == "decode out of memory").all()
    assert s["decoded_from_partial"] == 0 and s["undetected"] == 0
    if policy == "fail":
        assert s["refused"] == 2 and not df["decoded"].any()
        assert df["error"].str.contains("ran out of memory as they landed: missing \\[1\\]").all(), df["error"]
    else:
        assert s["recovered"] == 2 and df["tokens_match"].all() and df["logits_equal"].all() and df["bytes_equal"].all()
        if policy == "retry":
            assert (df["attempts"] == 2).all()
    assert df["recover_ms"].max() <= (cfg.fault_timeout_s + 1.0) * 1e3
    # the checksums' cost, both sides: every layer of the source; on the decode side only layer 0 had landed
    kv = calculator.kv_cache_bytes(models.get("kvlab-tiny"), 128, "bf16")
    assert (df["checksum_send_bytes"] == kv).all() and (df["checksum_recv_bytes"] == kv // 2).all()
    assert (df["checksum_send_ms"] > 0).all() and (df["checksum_recv_ms"] > 0).all()


@pytest.mark.parametrize("policy, layout", [("fail", "contiguous"), ("retry", "paged")])
def test_an_in_order_link_holds_back_the_layers_behind_a_drop_and_nothing_decodes_from_them(policy, layout, tmp_path):
    """gloo matching in order, as NCCL does (in_order): a receive takes whatever is sent next, so a dropped layer
    holds back the layers behind it until the fence, where they leave in the order their receives were posted.
    Seed 9 draws layers 1, 1, 1, 0, 0, 0, 1, 1: the drop at layer 0 leaves both layers missing. Without the holding
    back, layer 1's bytes took layer 0's receive and the fence waited until the run's timeout for a receive no
    send would match (tried once on this CPU: the run stopped with that TimeoutError)."""
    cfg = disagg.DisaggConfig(repeats=1, warmup=0, modes=("layerwise",), faults=8, policy=policy, seed=9,
                              fault_timeout_s=0.5, layouts=(layout,), in_order=True,
                              fault_kinds=("drop", "delay", "corrupt", "oom"))
    s = disagg.run(cfg, tmp_path / "run", progress=False)
    df = pd.read_csv(tmp_path / "run" / "faults.csv")
    assert df["layer"].tolist() == [1, 1, 1, 0, 0, 0, 1, 1]
    assert s["faults_injected"] == 8 and s["decoded_from_partial"] == 0 and s["undetected"] == 0
    assert df["detected_by"].tolist() == ["deadline", "deadline", "checksum", "decode out of memory",
                                          "deadline", "deadline", "checksum", "decode out of memory"]
    if policy == "fail":
        assert s["refused"] == 8 and not df["decoded"].any()
        drop0 = df[(df.kind == "drop") & (df.layer == 0)]["error"].iloc[0]
        assert "2 of 2 layers did not land intact" in drop0 and "missing or corrupt [0, 1]" in drop0
    else:
        assert s["recovered"] == 8 and df["tokens_match"].all() and df["logits_equal"].all() and df["bytes_equal"].all()
        assert (df["outcome"] == "recovered (retry)").all()
    assert df["recover_ms"].max() <= (cfg.fault_timeout_s + 1.0) * 1e3 * (cfg.retries + 1)


@pytest.mark.parametrize("in_order", [True, False])
def test_what_the_prefill_side_sends_before_the_fence_after_a_drop(in_order, tmp_path):
    """A 4-layer model, three drops (seed 1 draws layers 1, 0, 2). In order, the prefill side sends only the
    layers before the dropped one (faults.csv's `sent`), and the rest at the fence; by tag, every layer but the
    dropped one. Both recover every drop identically, and summary.json says how the run's receives matched."""
    from kvlab.model_registry import REGISTRY

    config = tmp_path / "four.json"
    config.write_text(json.dumps({**REGISTRY["kvlab-tiny"]["config"], "num_hidden_layers": 4}))
    cfg = disagg.DisaggConfig(model=str(config), repeats=1, warmup=0, modes=("layerwise",), faults=3, seed=1,
                              policy="retry", fault_timeout_s=0.5, fault_kinds=("drop",), in_order=in_order)
    s = disagg.run(cfg, tmp_path / "run", progress=False)
    df = pd.read_csv(tmp_path / "run" / "faults.csv")
    assert df["layer"].tolist() == [1, 0, 2] and s["in_order"] is in_order
    sent = [json.loads(x) for x in df["sent"]]
    if in_order:
        assert sent == [[0], [], [0, 1]]
    else:
        assert sent == [[0, 2, 3], [1, 2, 3], [0, 1, 3]]
    assert s["recovered"] == 3 and s["decoded_from_partial"] == 0 and df["tokens_match"].all()
    assert df["bytes_equal"].all() and df["logits_equal"].all()


def test_the_poll_flag_is_put_back_when_an_attempt_raises():
    from kvlab.disagg.faults import _polling
    from kvlab.disagg.links import DistLink

    nccl, gloo = DistLink("nccl", 1, torch.device("cpu"), 5.0), DistLink("gloo", 1, torch.device("cpu"), 5.0)
    with pytest.raises(KeyError):
        with _polling(nccl), _polling(gloo):
            assert nccl.poll and not gloo.poll  # gloo waits on its own thread: nothing to poll
            raise KeyError("an attempt that failed")
    assert not nccl.poll and not gloo.poll


class _FakeWork:
    """A receive that completes after `after` polls (None: never)."""

    def __init__(self, after):
        self.after, self.polls, self.waited = after, 0, False

    def is_completed(self):
        self.polls += 1
        return self.after is not None and self.polls > self.after

    def wait(self):
        self.waited = True


def test_a_polled_nccl_receive_is_waited_for_until_the_host_deadline_then_refused():
    """DistLink.poll (the fault campaign on nccl): a receive that completes is returned once it has, the stream
    made to wait for it; one that never completes is a TimeoutError at the deadline, and stays posted (drain)."""
    import time

    from kvlab.disagg.links import DistLink

    link = DistLink("nccl", peer=1, device=torch.device("cpu"), timeout_s=5.0)
    assert link.in_order and not link.poll
    link.poll = True
    late, never = _FakeWork(after=3), _FakeWork(after=None)
    link._arrived = None
    link._recvs = [((0,), late, None), ((1,), never, None)]
    unit, work, _ = link._next(7, time.monotonic() + 5.0, "did not arrive")
    assert unit == (0,) and work is late and late.polls == 4 and late.waited
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"request 7: layer\(s\) \[1\] did not arrive"):
        link._next(7, time.monotonic() + 0.2, "did not arrive")
    assert 0.2 <= time.monotonic() - t0 < 1.0 and never.polls > 1 and not never.waited
    assert link.pending == [(1,)]
    assert DistLink("gloo", 1, torch.device("cpu"), 5.0).tag(3, (1,)) != 0  # tagged: its own tag a unit
    assert DistLink("gloo", 1, torch.device("cpu"), 5.0, in_order=True).tag(3, (1,)) == 0


def test_checksum_table_reports_each_side_and_skips_what_was_not_checked():
    from kvlab.studies.disagg.analysis import checksum_table

    f = pd.DataFrame({"checksum_send_ms": [1.0, 3.0, float("nan")], "checksum_send_bytes": [2e6, 2e6, float("nan")],
                      "checksum_recv_ms": [0.5, 2.0, 1.0], "checksum_recv_bytes": [1e6, 1e6, 0]})
    t = checksum_table(f).set_index("side")
    send, recv = t.loc["prefill (source, every layer)"], t.loc["decode (the layers that landed)"]
    assert send["requests"] == 2 and send["median ms"] == 2.0 and send["max ms"] == 3.0
    assert abs(send["GB/s"] - (2.0 + 2 / 3) / 2) < 1e-9  # the median of 2 GB/s and 0.67 GB/s
    assert recv["requests"] == 2 and recv["max ms"] == 2.0  # the request with nothing landed is not a rate
    assert checksum_table(pd.DataFrame({"recover_ms": [1.0]})).empty  # a campaign from before the columns


def test_checksum_sees_one_flipped_bit_and_a_swap():
    from kvlab.disagg.faults import checksum
    from kvlab.disagg.endpoints import flip_first_byte

    far = torch.randn(70_000 * 2, dtype=torch.bfloat16)  # two words 65,521 apart (a weakness of the first version)
    swapped = far.clone()
    w = swapped.view(torch.int32)
    w[[0, 65521]] = w[[65521, 0]].clone()
    if not torch.equal(far, swapped):
        assert checksum(swapped) != checksum(far)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    assert checksum(x) == checksum(x.clone())
    assert checksum(flip_first_byte(x.clone())) != checksum(x)
    y = x.clone()
    y.view(-1)[[0, 2]] = y.view(-1)[[2, 0]].clone()
    y.view(-1)[[1, 3]] = y.view(-1)[[3, 1]].clone()
    if not torch.equal(x, y):
        assert checksum(y) != checksum(x)
    z = x.clone()
    z.view(-1).view(torch.int32)[5] ^= 1 << 7  # one bit
    assert checksum(z) != checksum(x)


def test_paged_rows_from_the_peer_are_checked_against_the_pool_before_any_copy():
    from kvlab.disagg.endpoints import Rows

    rows = Rows.for_ids(2, 4, [3, 0], "cpu")
    assert rows.per_layer > 0 and int(rows.all.max()) >= 0
    for bad in ([4], [-1], [0, 9]):
        with pytest.raises(ValueError, match="outside a pool of 4 blocks"):
            Rows.for_ids(2, 4, bad, "cpu")
    assert rows.top == int(rows.all.max())  # known on the host, without a device sync


def test_the_ipc_send_refuses_rows_past_the_destination_the_decode_side_shared():
    from kvlab.disagg.endpoints import Rows
    from kvlab.disagg.links import IpcLink

    link = IpcLink(torch.device("cpu"), control=None, timeout_s=1.0)
    rows = Rows.for_ids(2, 4, [3, 0], "cpu")
    link._dst["t"] = torch.empty((rows.top + 1) * 8)  # exactly room for the highest row, 8 elements a row
    link.bind("t", rows, 8)
    link._dst["small"] = torch.empty(rows.top * 8)
    with pytest.raises(ValueError, match=f"rows reach {rows.top}, past the {rows.top} rows"):
        link.bind("small", rows, 8)


def _netns_ok() -> str | None:
    import shutil
    import subprocess

    if os.geteuid() != 0 or not shutil.which("ip"):
        return "needs root and iproute2 (ip netns)"
    probe = f"kvlab-probe-{os.getpid()}"
    done = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if done.returncode == 0:  # and a veth pair inside it, as the test makes
        done = subprocess.run(["ip", "-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1"],
                              capture_output=True, text=True)
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None if done.returncode == 0 else f"cannot make a network namespace and veth here: {done.stderr.strip()[:120]}"


def test_readmes_two_node_commands_run_as_written_across_two_network_stacks(tmp_path):
    """README's torchrun pair, each "node" in its own network namespace joined by veth: the rendezvous, the store
    and gloo cross a (virtual) Ethernet link, and gloo must pick that link itself (no GLOO_SOCKET_IFNAME), since
    this host's name resolves to a loopback address the other node cannot reach."""
    why = _netns_ok()
    if why:
        pytest.skip(why)
    import json

    import two_nodes

    got = two_nodes.run(tmp_path / "run")
    assert got["returncodes"] == [0, 0], "\n".join(log[-1500:] for log in got["logs"])
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["tokens_match"] and summary["logits_equal"] and summary["poison_left"] == 0
    assert summary["bytes_moved"] == summary["kv_cache_bytes"] and summary["context"] == 4096
    launcher = summary["launcher"]
    assert launcher["kind"] == "torchrun" and launcher["nnodes"] == 2
    assert launcher["gloo_interface"] == got["link"]["interface"]
    assert summary["pids"]["decode"] != summary["pids"]["prefill"]
    # every request's cache crossed the veth: rank 0 received at least the bytes moved, times the requests
    received = got["link"]["after"]["rx_bytes"] - got["link"]["before"]["rx_bytes"]
    assert received >= summary["requests"] * summary["bytes_moved"]


def test_gloo_interface_is_chosen_for_two_nodes_and_refused_where_it_cannot_work(monkeypatch):
    from kvlab.disagg.launch import gloo_interface

    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert gloo_interface("127.0.0.1", 1)[0] is None  # one node on loopback: gloo's own choice is right
    with pytest.raises(ValueError, match="loopback address the other node cannot reach"):
        gloo_interface("localhost", 2)
    with pytest.raises(ValueError, match="does not resolve"):
        gloo_interface("no-such-host.invalid", 2)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth9")
    assert gloo_interface("localhost", 2) == ("eth9", "GLOO_SOCKET_IFNAME was set")


def test_kill_faults_are_refused_under_torchrun(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="kill needs kvlab's own launcher"):
        disagg.run(disagg.DisaggConfig(faults=2, fault_kinds=("kill",)), tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_checksums_together_are_the_checksums_one_by_one():
    """The batched checksums (one host wait) give each tensor's own checksum, chunked or not, for 4-byte words and
    for sizes that fall back to bytes; mixed sizes are checked one by one; a flipped bit changes its layer's only."""
    from kvlab.disagg.faults import checksum, checksums

    g = torch.Generator().manual_seed(3)
    layers = [torch.randn(2, 8, 16, generator=g).to(torch.bfloat16) for _ in range(5)]
    want = [checksum(t) for t in layers]
    assert checksums(layers) == want and checksums(layers, chunk_bytes=1) == want
    odd = [torch.randint(0, 255, (7,), dtype=torch.uint8, generator=g) for _ in range(3)]
    assert checksums(odd) == [checksum(t) for t in odd]
    mixed = [layers[0], odd[0], layers[1]]
    assert checksums(mixed) == [checksum(t) for t in mixed]
    flipped = [t.clone() for t in layers]
    flipped[2].view(-1).view(torch.uint8)[5] ^= 1
    got = checksums(flipped)
    assert [a == b for a, b in zip(got, want)] == [True, True, False, True, True]
    assert checksums([]) == []


def test_a_bench_without_a_common_clock_is_tabulated_as_unknown():
    """Across two hosts the bench's times are NaN (no clock in common): the table says so instead of failing the
    run while it writes its results."""
    from kvlab.disagg.summary import bench_table

    nan = float("nan")
    rows = [{"layout": "contiguous", "context": 128, "kind": k, "sample": i, "ms": nan if k != "ceiling" else 1.0,
             "bytes": 1000, "kernel": "nccl send"} for k in ("send", "ceiling", "layer") for i in range(3)]
    t = bench_table(pd.DataFrame(rows))
    assert len(t) == 1 and t[["pct_of_ceiling", "pct_lo", "pct_hi", "send_ms"]].isna().all(axis=None)


def test_bulk_orders_permute_the_same_rows():
    """Each bulk order of a paged ipc send moves exactly the table's rows, once each, pairs kept together: by
    destination row, by source row, or block-major across the layer sides."""
    from kvlab.disagg.endpoints import Rows
    from kvlab.disagg.links import BULK_ORDERS, bulk_perm

    src = Rows(3, 10, [7, 2, 5, 0], "cpu")
    dst = Rows(3, 12, [1, 9, 4, 11], "cpu")
    s, d = src.all, dst.all
    pairs = set(zip(s.tolist(), d.tolist()))
    for order in BULK_ORDERS:
        perm = bulk_perm(order, s, d, 2 * 3)
        ps, pd_ = (s, d) if perm is None else (s[perm], d[perm])
        assert set(zip(ps.tolist(), pd_.tolist())) == pairs and len(ps) == len(s) == len(set(ps.tolist()))
    assert bulk_perm("table", s, d, 6) is None
    assert d[bulk_perm("dst", s, d, 6)].tolist() == sorted(d.tolist())
    assert s[bulk_perm("src", s, d, 6)].tolist() == sorted(s.tolist())
    inter = s[bulk_perm("interleaved", s, d, 6)].tolist()
    assert inter[:6] == [side * 10 + 7 for side in range(6)]  # the first block of every layer side first
    with pytest.raises(ValueError, match="unknown bulk order 'zigzag'"):
        bulk_perm("zigzag", s, d, 6)


def test_a_block_order_that_does_not_exist_is_refused():
    with pytest.raises(ValueError, match="block-order = 'sorted' is not valid; valid: random, packed"):
        disagg.check(disagg.DisaggConfig(layouts=("paged",), block_order="sorted"))
    with pytest.raises(ValueError, match="block-order = 'packed' orders a paged cache's blocks; add --layout paged"):
        disagg.check(disagg.DisaggConfig(layouts=("contiguous",), block_order="packed"))
