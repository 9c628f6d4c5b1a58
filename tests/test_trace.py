"""kvlab.tracefmt (and the overlap study's trace and events modules): reading Kineto and nsys timelines into one
events table, capturing on a CPU, bad input.

GPU-shaped traces are synthetic: written here with Kineto's real field names (categories kernel,
gpu_memcpy, gpu_memset, cuda_runtime, user_annotation, gpu_user_annotation; args device / stream /
correlation / External id / bytes / "memory bandwidth (GB/s)") and nsys's documented SQLite schema.
"""

from __future__ import annotations

import gzip
import json
import re
import sqlite3
import stat
import sys

import pandas as pd
import pytest
import torch

from kvlab import tracefmt
from kvlab.studies.overlap_timeline import events, trace
from kvlab.tracefmt.command import trace_main
from kvlab.tracefmt import nsys
from kvlab.tracefmt import TraceError

BASE_NS = 1_700_000_000_000_000_123  # an absolute epoch-like origin: µs with 3 decimals overflow a double's ns


def _num(ns: int) -> str:
    """A placeholder that _dump turns into a bare JSON number of µs with exactly 3 decimals."""
    return f"__NUM__{ns // 1000}.{ns % 1000:03d}"


def _dump(doc) -> str:
    return re.sub(r'"__NUM__([0-9.]+)"', r"\1", json.dumps(doc, indent=1))


def X(cat, name, start_ns, dur_ns, pid, tid, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": _num(BASE_NS + start_ns),
            "dur": _num(dur_ns), "args": args}


def gpu_doc():
    """Two layers: host thread 77 launches kernels (stream 7) and one DtoH copy per layer (stream 13)."""
    T = 77
    ev = [
        {"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "GPU 0"}},
        {"ph": "i", "name": "Record Window End", "s": "g", "pid": "", "tid": "", "ts": _num(BASE_NS)},
        X("Trace", "PyTorch Profiler (0)", 0, 500_000, "Spans", "PyTorch Profiler"),
        X("user_annotation", "kvlab/layer0", 10_000, 50_000, 4242, T, **{"External id": 1}),
        X("user_annotation", "kvlab/send0", 16_000, 4_000, 4242, T, **{"External id": 2}),
        X("user_annotation", "kvlab/layer1", 60_000, 50_000, 4242, T, **{"External id": 3}),
        X("user_annotation", "kvlab/send1", 66_000, 4_000, 4242, T, **{"External id": 4}),
        X("cpu_op", "aten::mm", 11_500, 2_000, 4242, T, **{"External id": 5}),
        X("cuda_runtime", "cudaLaunchKernel", 12_000, 1_000, 4242, T, cbid=211, correlation=1),
        X("cuda_runtime", "cudaMemcpyAsync", 17_000, 1_500, 4242, T, cbid=41, correlation=3),
        X("cuda_runtime", "cudaLaunchKernel", 22_000, 1_000, 4242, T, cbid=211, correlation=4),
        X("cuda_runtime", "cudaLaunchKernel", 62_000, 1_000, 4242, T, cbid=211, correlation=5),
        X("cuda_runtime", "cudaMemcpyAsync", 67_000, 1_500, 4242, T, cbid=41, correlation=7),
        X("kernel", "void gemm<128>(float*)", 30_000, 10_000, 0, 7, queued=0, device=0, context=1, stream=7,
          correlation=1, **{"External id": 5, "registers per thread": 64}),
        X("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 51_000, 30_000, 0, 13, device=0, context=1,
          stream=13, correlation=3, bytes=3_000_000, **{"memory bandwidth (GB/s)": 100.0}),
        X("kernel", "void mlp_kernel(float*)", 50_000, 25_000, 0, 7, device=0, context=1, stream=7, correlation=4),
        X("gpu_memset", "Memset (Device)", 45_000, 1_000, 0, 7, device=0, context=1, stream=7, correlation=99,
          bytes=4096),
        X("kernel", "void gemm<128>(float*)", 75_000, 10_000, 0, 7, device=0, context=1, stream=7, correlation=5),
        X("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 96_000, 45_000, 0, 13, device=0, context=1,
          stream=13, correlation=7, bytes=4_500_000, **{"memory bandwidth (GB/s)": 100.0}),
        # no runtime record for correlation 8: only the GPU-side range can place this kernel in layer 1
        X("kernel", "void orphan(float*)", 99_000, 2_000, 0, 7, device=0, context=1, stream=7, correlation=8),
        X("gpu_user_annotation", "kvlab/layer1", 74_999, 40_002, 0, 7, **{"External id": 3}),
        {"ph": "s", "id": 1, "pid": 4242, "tid": T, "ts": _num(BASE_NS + 12_000), "cat": "ac2g", "name": "ac2g"},
    ]
    return {"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "NVIDIA H200"}],
            "traceEvents": ev, "traceName": "synthetic"}


@pytest.fixture
def gpu_trace(tmp_path):
    path = tmp_path / "trace_gpu.json"
    path.write_text(_dump(gpu_doc()))
    return path


def test_kineto_gpu_events_are_typed_timed_and_attributed(gpu_trace):
    ev = tracefmt.load_kineto(gpu_trace)
    assert list(ev.columns) == tracefmt.EVENT_COLUMNS
    counts = ev.kind.value_counts().to_dict()
    assert counts == {"range": 5, "runtime": 5, "kernel": 4, "memcpy": 2, "memset": 1, "cpu_op": 1}
    # times: ns relative to the first event (layer0 at +10 µs from BASE), exact to the ns
    assert ev.start_ns.min() == 0
    first = ev[ev.name == "kvlab/layer0"].iloc[0]
    assert (first.start_ns, first.dur_ns) == (0, 50_000)
    k0 = ev[(ev.kind == "kernel") & (ev.correlation == 1)].iloc[0]
    assert (k0.start_ns, k0.end_ns, k0.device, k0.stream) == (20_000, 30_000, 0, 7)
    # a kernel inherits the layer of the range around the call that launched it, and that call's thread
    assert (k0.layer, k0.range_name, k0.launch_ns, k0.thread) == (0, "kvlab/layer0", 2_000, 77)
    c0 = ev[(ev.kind == "memcpy") & (ev.correlation == 3)].iloc[0]
    assert (c0.copy_kind, c0.bytes, c0.layer, c0.range_name) == ("DtoH", 3_000_000, 0, "kvlab/send0")
    c1 = ev[(ev.kind == "memcpy") & (ev.correlation == 7)].iloc[0]
    assert (c1.copy_kind, c1.layer) == ("DtoD", 1)
    # the MLP kernel was launched after the send range closed: layer 0's compute, not its send
    mlp = ev[ev.name == "void mlp_kernel(float*)"].iloc[0]
    assert (mlp.layer, mlp.range_name) == (0, "kvlab/layer0")
    # no launching call in the trace: placed by the GPU-side range on its stream
    orphan = ev[ev.name == "void orphan(float*)"].iloc[0]
    assert pd.isna(orphan.launch_ns) and orphan.layer == 1
    # a memset with no call and no GPU-side range covering it stays unattributed
    ms = ev[ev.kind == "memset"].iloc[0]
    assert pd.isna(ms.layer) and ms.range_name is None and ms.bytes == 4096
    # host rows: the cpu op sits in layer 0; ranges carry their own layer
    assert ev[ev.kind == "cpu_op"].iloc[0].layer == 0
    assert set(ev[ev.kind == "range"].layer) == {0, 1}
    assert ev[(ev.kind == "range") & ev.stream.notna()].iloc[0].stream == 7


def test_kineto_keeps_nanoseconds_of_absolute_microsecond_timestamps(tmp_path):
    doc = {"traceEvents": [X("cpu_op", "a", 0, 1, 1, 1), X("cpu_op", "b", 1_234_567_891, 7, 1, 1)]}
    path = tmp_path / "t.json"
    path.write_text(_dump(doc))
    ev = tracefmt.load_kineto(path)
    b = ev[ev.name == "b"].iloc[0]
    # BASE_NS + 1_234_567_891 ns as 16-digit µs with 3 decimals: a float parse would drift by tens of ns
    assert (b.start_ns, b.dur_ns) == (1_234_567_891, 7)


def test_kineto_gzip_reads_the_same_as_plain(gpu_trace, tmp_path):
    gz = tmp_path / "trace_gpu.json.gz"
    gz.write_bytes(gzip.compress(gpu_trace.read_bytes()))
    a, b = tracefmt.load_kineto(gpu_trace), tracefmt.load_kineto(gz)
    pd.testing.assert_frame_equal(a, b)
    assert tracefmt.load(gz).equals(a)


def test_kineto_bad_input_says_what_is_wrong(gpu_trace, tmp_path):
    with pytest.raises(FileNotFoundError, match="no trace at"):
        tracefmt.load_kineto(tmp_path / "missing.json")
    notjson = tmp_path / "notes.txt"
    notjson.write_text("layer 0 took 3 ms\n")
    with pytest.raises(TraceError, match="not JSON"):
        tracefmt.load_kineto(notjson)
    text = gpu_trace.read_text()
    cut = tmp_path / "cut.json"
    cut.write_text(text[: len(text) // 2])
    with pytest.raises(TraceError, match="truncated"):
        tracefmt.load_kineto(cut)
    cutgz = tmp_path / "cut.json.gz"
    cutgz.write_bytes(gzip.compress(text.encode())[:-40])
    with pytest.raises(TraceError, match="truncated"):
        tracefmt.load_kineto(cutgz)
    other = tmp_path / "config.json"
    other.write_text(json.dumps({"model": "qwen", "layers": 28}))
    with pytest.raises(TraceError, match="traceEvents"):
        tracefmt.load_kineto(other)
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"traceEvents": [{"ph": "M", "name": "process_name", "pid": 1}]}))
    with pytest.raises(TraceError, match="no events kvlab can read"):
        tracefmt.load_kineto(empty)
    with pytest.raises(TraceError, match="raw Nsight Systems"):
        (tmp_path / "r.qdstrm").write_bytes(b"\x00qdstrm")
        tracefmt.load(tmp_path / "r.qdstrm")


def test_summarize_and_host_layers(gpu_trace):
    ev = tracefmt.load_kineto(gpu_trace)
    s = tracefmt.summarize(ev)
    cp = s[(s.kind == "memcpy") & (s.stream == 13)].iloc[0]
    assert cp["count"] == 2 and cp["bytes"] == 7_500_000
    assert cp["gbps"] == pytest.approx(7_500_000 / 75_000)  # bytes per ns = decimal GB/s
    h = tracefmt.host_layers(ev)
    assert h.layer.tolist() == [0, 1]
    assert h.layer_ms.tolist() == pytest.approx([0.05, 0.05])
    assert h.send_ms.tolist() == pytest.approx([0.004, 0.004])
    assert h.gap_ms.tolist() == pytest.approx([0.0, 0.0])
    with pytest.raises(TraceError, match="no kvlab/layer"):
        tracefmt.host_layers(ev[ev.kind != "range"])
    with pytest.raises(TraceError, match="columns"):
        tracefmt.summarize(ev.drop(columns=["layer"]))


# ---------------------------------------------------------------------------------------- nsys


def build_nsys_db(path, with_cuda=True):
    """A small export following nsys's SQLite schema (StringIds, CUPTI_ACTIVITY_KIND_*, NVTX_EVENTS,
    ENUM_CUDA_MEMCPY_OPER); the same two-layer story as gpu_doc, times in ns from an arbitrary origin."""
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL);
        CREATE TABLE ENUM_CUDA_MEMCPY_OPER (id INTEGER PRIMARY KEY, name TEXT, label TEXT);
        CREATE TABLE ENUM_CUDA_MEM_KIND (id INTEGER PRIMARY KEY, name TEXT, label TEXT);
        CREATE TABLE NVTX_EVENTS (start INTEGER NOT NULL, end INTEGER, eventType INTEGER NOT NULL,
            rangeId INTEGER, category INTEGER, color INTEGER, text TEXT, globalTid INTEGER,
            endGlobalTid INTEGER, textId INTEGER, domainId INTEGER, uint64Value INTEGER,
            int64Value INTEGER, doubleValue REAL, uint32Value INTEGER, int32Value INTEGER,
            floatValue REAL, jsonTextId INTEGER, jsonText TEXT);
        CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (start INTEGER NOT NULL, end INTEGER NOT NULL,
            eventClass INTEGER NOT NULL, globalTid INTEGER, correlationId INTEGER, nameId INTEGER NOT NULL,
            returnValue INTEGER NOT NULL, callchainId INTEGER);
    """)
    if with_cuda:
        db.executescript("""
            CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INTEGER NOT NULL, end INTEGER NOT NULL,
                deviceId INTEGER NOT NULL, contextId INTEGER NOT NULL, greenContextId INTEGER,
                streamId INTEGER NOT NULL, correlationId INTEGER, globalPid INTEGER,
                demangledName INTEGER NOT NULL, shortName INTEGER NOT NULL, mangledName INTEGER,
                launchType INTEGER, cacheConfig INTEGER, registersPerThread INTEGER NOT NULL,
                gridX INTEGER NOT NULL, gridY INTEGER NOT NULL, gridZ INTEGER NOT NULL,
                blockX INTEGER NOT NULL, blockY INTEGER NOT NULL, blockZ INTEGER NOT NULL,
                staticSharedMemory INTEGER NOT NULL, dynamicSharedMemory INTEGER NOT NULL,
                localMemoryPerThread INTEGER NOT NULL, localMemoryTotal INTEGER NOT NULL,
                gridId INTEGER NOT NULL, sharedMemoryExecuted INTEGER, graphNodeId INTEGER,
                sharedMemoryLimitConfig INTEGER);
            CREATE TABLE CUPTI_ACTIVITY_KIND_MEMCPY (start INTEGER NOT NULL, end INTEGER NOT NULL,
                deviceId INTEGER NOT NULL, contextId INTEGER NOT NULL, greenContextId INTEGER,
                streamId INTEGER NOT NULL, correlationId INTEGER, globalPid INTEGER, bytes INTEGER NOT NULL,
                copyKind INTEGER NOT NULL, deprecatedSrcId INTEGER, srcKind INTEGER, dstKind INTEGER,
                srcDeviceId INTEGER, srcContextId INTEGER, dstDeviceId INTEGER, dstContextId INTEGER,
                migrationCause INTEGER, graphNodeId INTEGER, virtualAddress INTEGER);
            CREATE TABLE CUPTI_ACTIVITY_KIND_MEMSET (start INTEGER NOT NULL, end INTEGER NOT NULL,
                deviceId INTEGER NOT NULL, contextId INTEGER NOT NULL, greenContextId INTEGER,
                streamId INTEGER NOT NULL, correlationId INTEGER, globalPid INTEGER, value INTEGER NOT NULL,
                bytes INTEGER NOT NULL, graphNodeId INTEGER, memKind INTEGER);
        """)
    strings = {1: "cudaLaunchKernel_v7000", 2: "cudaMemcpyAsync_v3020", 3: "void gemm<128>(float*)",
               4: "gemm", 5: "kvlab/send0", 6: "void mlp_kernel(float*)", 7: "mlp_kernel"}
    db.executemany("INSERT INTO StringIds VALUES (?, ?)", strings.items())
    db.executemany("INSERT INTO ENUM_CUDA_MEMCPY_OPER VALUES (?, ?, ?)",
                   [(1, "CUDA_MEMCPY_KIND_HTOD", "Host-to-Device"), (2, "CUDA_MEMCPY_KIND_DTOH", "Device-to-Host"),
                    (8, "CUDA_MEMCPY_KIND_DTOD", "Device-to-Device"), (10, "CUDA_MEMCPY_KIND_PTOP", "Peer-to-Peer")])
    # the export names its own memory-kind numbers (here not CUPTI's: pinned is 1, device 2)
    db.executemany("INSERT INTO ENUM_CUDA_MEM_KIND VALUES (?, ?, ?)",
                   [(0, "CUDA_MEMOPR_MEMORY_KIND_PAGEABLE", "Pageable"), (1, "CUDA_MEMOPR_MEMORY_KIND_PINNED", "Pinned"),
                    (2, "CUDA_MEMOPR_MEMORY_KIND_DEVICE", "Device"),
                    (5, "CUDA_MEMOPR_MEMORY_KIND_DEVICE_STATIC", "Device Static")])
    tid, t0 = 0x1000000000A2B, 5_000_000_000
    nvtx = "INSERT INTO NVTX_EVENTS (start, end, eventType, text, globalTid, textId) VALUES (?, ?, ?, ?, ?, ?)"
    db.execute(nvtx, (t0 + 10_000, t0 + 60_000, 59, "kvlab/layer0", tid, None))
    db.execute(nvtx, (t0 + 16_000, t0 + 20_000, 59, None, tid, 5))            # text via StringIds
    db.execute(nvtx, (t0 + 60_000, t0 + 110_000, 59, "kvlab/layer1", tid, None))
    db.execute(nvtx, (t0 + 70_000, None, 34, "a mark", tid, None))            # a mark: no extent
    rt = "INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (?, ?, 1, ?, ?, ?, 0, NULL)"
    db.execute(rt, (t0 + 12_000, t0 + 13_000, tid, 1, 1))
    db.execute(rt, (t0 + 17_000, t0 + 18_500, tid, 3, 2))
    db.execute(rt, (t0 + 22_000, t0 + 23_000, tid, 4, 1))
    db.execute(rt, (t0 + 62_000, t0 + 63_000, tid, 5, 1))
    if with_cuda:
        k = ("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL (start, end, deviceId, contextId, streamId, correlationId, "
             "globalPid, demangledName, shortName, registersPerThread, gridX, gridY, gridZ, blockX, blockY, blockZ, "
             "staticSharedMemory, dynamicSharedMemory, localMemoryPerThread, localMemoryTotal, gridId) "
             "VALUES (?, ?, 0, 1, 7, ?, 42, ?, ?, 64, 1, 1, 1, 128, 1, 1, 0, 0, 0, 0, 1)")
        db.execute(k, (t0 + 30_000, t0 + 40_000, 1, 3, 4))
        db.execute(k, (t0 + 50_000, t0 + 75_000, 4, 6, 7))
        db.execute(k, (t0 + 75_000, t0 + 85_000, 5, 3, 4))
        db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_MEMCPY (start, end, deviceId, contextId, streamId, "
                   "correlationId, globalPid, bytes, copyKind, srcKind, dstKind) VALUES (?, ?, 0, 1, 13, 3, 42, "
                   "3000000, 2, 2, 1)", (t0 + 51_000, t0 + 81_000))
        db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_MEMSET (start, end, deviceId, contextId, streamId, "
                   "correlationId, globalPid, value, bytes, memKind) VALUES (?, ?, 0, 1, 7, 99, 42, 0, 4096, 2)",
                   (t0 + 45_000, t0 + 46_000))
    db.commit()
    db.close()
    return path


def test_nsys_sqlite_reads_into_the_same_table(tmp_path):
    ev = nsys.load_nsys_sqlite(build_nsys_db(tmp_path / "r.sqlite"))
    assert list(ev.columns) == tracefmt.EVENT_COLUMNS
    assert ev.kind.value_counts().to_dict() == {"runtime": 4, "kernel": 3, "range": 3, "memcpy": 1, "memset": 1}
    assert ev.start_ns.min() == 0
    cp = ev[ev.kind == "memcpy"].iloc[0]
    # the name Kineto would give the same copy, so one analysis reads both
    assert cp["name"] == "Memcpy DtoH (Device -> Pinned)"
    assert (cp.copy_kind, cp.bytes, cp.stream, cp.layer, cp.range_name) == ("DtoH", 3_000_000, 13, 0, "kvlab/send0")
    k = ev[ev.kind == "kernel"]
    assert k["name"].tolist() == ["void gemm<128>(float*)", "void mlp_kernel(float*)", "void gemm<128>(float*)"]
    assert k.layer.tolist() == [0, 0, 1]
    assert k.iloc[0].launch_ns == 2_000 and k.iloc[0].thread == 0x1000000000A2B
    assert ev[ev.kind == "memset"].iloc[0]["name"] == "Memset (Device)"
    assert set(ev[ev.kind == "range"].name) == {"kvlab/layer0", "kvlab/send0", "kvlab/layer1"}
    assert tracefmt.load(tmp_path / "r.sqlite").equals(ev)


def test_nsys_sqlite_without_enum_tables_uses_cupti_numbers(tmp_path):
    path = build_nsys_db(tmp_path / "r.sqlite")
    db = sqlite3.connect(path)
    db.executescript("DROP TABLE ENUM_CUDA_MEMCPY_OPER; DROP TABLE ENUM_CUDA_MEM_KIND;"
                     "UPDATE CUPTI_ACTIVITY_KIND_MEMCPY SET copyKind = 8, srcKind = 3, dstKind = 3;")
    db.commit()
    db.close()
    cp = nsys.load_nsys_sqlite(path).query("kind == 'memcpy'").iloc[0]
    assert (cp["name"], cp.copy_kind) == ("Memcpy DtoD (Device -> Device)", "DtoD")


def test_nsys_sqlite_bad_input(tmp_path):
    with pytest.raises(TraceError, match="no CUDA tables"):
        nsys.load_nsys_sqlite(build_nsys_db(tmp_path / "nocuda.sqlite", with_cuda=False))
    bogus = tmp_path / "x.sqlite"
    bogus.write_text("not a database")
    with pytest.raises(TraceError, match="not an SQLite database"):
        nsys.load_nsys_sqlite(bogus)
    with pytest.raises(FileNotFoundError):
        nsys.load_nsys_sqlite(tmp_path / "none.sqlite")


def _fake_nsys(tmp_path, mode: str):
    """An executable standing in for nsys: 'qdstrm' leaves only a raw recording, as on our H200;
    'ok' writes a report and, on export, the SQLite database built above. Both record the child's
    KVLAB_RANGES so the test sees what run_nsys passed on."""
    db = build_nsys_db(tmp_path / "prebuilt.sqlite")
    script = tmp_path / "nsys"
    script.write_text(f"""#!{sys.executable}
import os, shutil, sys
args = sys.argv[1:]
if args[:1] == ["--version"]:
    print("NVIDIA Nsight Systems version 2099.1.1"); sys.exit(0)
if args[:1] == ["profile"]:
    open({str(tmp_path / 'env.txt')!r}, "w").write(os.environ.get("KVLAB_RANGES", "unset"))
    out = args[args.index("-o") + 1]
    if {mode!r} == "qdstrm":
        open(out + ".qdstrm", "wb").write(b"raw")
        print("Generating '" + out + ".qdstrm'\\nImporter error: QdstrmImporter not found", file=sys.stderr)
        sys.exit(1)
    open(out + ".nsys-rep", "wb").write(b"report")
    sys.exit(0)
if args[:1] == ["export"]:
    shutil.copyfile({str(db)!r}, args[args.index("--output") + 1]); sys.exit(0)
sys.exit(2)
""")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


def test_run_nsys_without_a_report_points_at_torch_profiler(tmp_path):
    binary = _fake_nsys(tmp_path, "qdstrm")
    with pytest.raises(nsys.NsysUnavailable, match=r"\.qdstrm.*capture"):
        nsys.run_nsys(["python", "-c", "pass"], tmp_path / "out", nsys=binary)
    assert (tmp_path / "env.txt").read_text() == "1"


def test_run_nsys_loads_the_export(tmp_path):
    binary = _fake_nsys(tmp_path, "ok")
    ev, path = nsys.run_nsys(["python", "-c", "pass"], tmp_path / "out", nsys=binary, name="r1")
    assert path == tmp_path / "out" / "r1.sqlite"
    assert (ev.kind == "kernel").sum() == 3
    with pytest.raises(ValueError, match="capture_range"):
        nsys.run_nsys(["x"], tmp_path, capture_range="always", nsys=binary)
    with pytest.raises(ValueError, match="list of strings"):
        nsys.run_nsys("python run.py", tmp_path, nsys=binary)


def test_nsys_available_reports_missing_and_report_less_installs(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    info = nsys.nsys_available(globs=(str(tmp_path / "nowhere" / "nsys"),))
    assert not info and info.path is None and "torch.profiler" in info.reason
    # an nsys with no QdstrmImporter beside it records but cannot report: not usable
    binary = _fake_nsys(tmp_path, "qdstrm")
    info = nsys.nsys_available(nsys=binary)
    assert info.path == binary and "2099.1.1" in info.version and not info.can_export
    assert "QdstrmImporter" in info.reason
    (tmp_path / "host-linux-x64").mkdir()
    (tmp_path / "host-linux-x64" / "QdstrmImporter").write_text("")
    assert nsys.nsys_available(nsys=binary)


def test_run_nsys_with_no_nsys_anywhere(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(nsys, "_NSYS_GLOBS", ())
    monkeypatch.setattr(nsys, "_find_nsys", lambda globs=(): None)
    with pytest.raises(nsys.NsysUnavailable, match="not installed"):
        nsys.run_nsys(["python"], tmp_path / "o")


# ---------------------------------------------------------------------------------------- CLI


def test_trace_main_load_and_errors(gpu_trace, tmp_path, capsys):
    csv = tmp_path / "ev.csv"
    assert trace_main(["load", str(gpu_trace), "--csv", str(csv)]) == 0
    out = capsys.readouterr().out
    assert "memcpy" in out and "layers 0…1" in out
    assert len(pd.read_csv(csv)) == 18
    bad = tmp_path / "bad.json"
    bad.write_text("{\"traceEvents\": [")
    assert trace_main(["load", str(bad)]) == 2
    assert "truncated" in capsys.readouterr().err
    assert trace_main(["nsys"]) == 2
    assert "give the command after --" in capsys.readouterr().err
    assert trace_main(["frobnicate"]) == 2


def test_trace_main_nsys_unavailable_exit_code(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(nsys, "_find_nsys", lambda globs=(): None)
    assert trace_main(["nsys", "--out", str(tmp_path / "o"), "--", "python", "-c", "pass"]) == 3
    assert "torch.profiler" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------- capture


@pytest.fixture
def one_thread():
    # tiny matrices: a second BLAS thread only spins against the other jobs on a shared 2-core box
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_capture_on_cpu_records_ops_and_ranges(tmp_path, one_thread):
    x = torch.randn(32, 32)

    def region():
        with torch.profiler.record_function("kvlab/layer0"):
            y = x @ x
            with torch.profiler.record_function("kvlab/send0"):
                y.clone()
        with torch.profiler.record_function("kvlab/layer1"):
            torch.relu(y)

    ev, path = tracefmt.capture(region, device="cpu", out_dir=tmp_path, name="trace_unit")
    assert path == tmp_path / "trace_unit.json.gz" and path.read_bytes()[:2] == b"\x1f\x8b"
    assert not list(tmp_path.glob(".*.json"))  # the uncompressed export was removed
    assert set(ev.kind) == {"cpu_op", "range"}
    mm = ev[ev.name == "aten::mm"].iloc[0]
    assert (mm.layer, mm.range_name) == (0, "kvlab/layer0")
    assert ev[ev.name == "aten::clone"].iloc[0].range_name == "kvlab/send0"
    assert ev[ev.name == "aten::relu"].iloc[0].layer == 1
    with pytest.raises(ValueError, match="file stem"):
        tracefmt.capture(region, device="cpu", out_dir=tmp_path, name="../escape")
    with pytest.raises(ValueError, match="warmup"):
        tracefmt.capture(region, device="cpu", warmup=-1)


def test_trace_handoff_on_cpu_with_the_tiny_model(tmp_path, one_thread):
    from kvlab import models

    model = models.build("kvlab-tiny", device="cpu", dtype=torch.float32)
    ht = trace.trace_handoff(model, 16, "same-gpu", repeats=2, device="cpu", out_dir=tmp_path, warmup=1)
    assert ht.layers == 2 and ht.destination == "same-device" and ht.kv_bytes == 2 * ht.bytes_per_layer
    assert sorted(p.name for p in tmp_path.glob("trace*.json.gz")) == [
        "trace_colocated_r0.json.gz", "trace_colocated_r1.json.gz",
        "trace_layerwise_r0.json.gz", "trace_layerwise_r1.json.gz"]
    w = ht.walls
    assert len(w) == 8 and set(w.variant) == {"colocated", "layerwise"} and (w.wall_ms > 0).all()
    # the layer-wise trace shows each layer's send range with its copy inside; the colocated one has
    # layer ranges (for splitting) but no sends
    lw = tracefmt.host_layers(ht.layerwise)
    assert lw.layer.tolist() == [0, 1] and (lw.send_ms > 0).all()
    co = tracefmt.host_layers(ht.colocated)
    assert co.send_ms.isna().all() and (co.layer_ms > 0).all()
    for ev in (ht.colocated, ht.layerwise):  # the timed region is marked once in each traced run
        assert (ev.name == tracefmt.REGION).sum() == 1
    copies = ht.layerwise[(ht.layerwise.name == "aten::copy_") & ht.layerwise.range_name.astype(str).str.startswith("kvlab/send")]
    assert sorted(copies.layer.unique().tolist()) == [0, 1]
    oh = ht.overhead()
    assert set(oh.variant) == {"colocated", "layerwise"} and oh.untraced_ms.gt(0).all()
    assert ht.ceiling_gbps > 0 and ht.layer_copy_ms > 0
    assert ht.wall_ns("layerwise") > 0
    with pytest.raises(ValueError, match="transport"):
        trace.trace_handoff(model, 16, "same-gpu", transport="nixl", device="cpu")
    with pytest.raises(ValueError, match="max positions"):
        trace.trace_handoff(model, 10**6, "same-gpu", device="cpu")
    with pytest.raises(ValueError, match="pinned"):
        trace.trace_handoff(model, 16, "pinned", device="cpu", out_dir=tmp_path / "x", repeats=1, warmup=0)


def test_event_table_places_every_layer_from_event_times():
    from kvlab.studies.overlap_timeline import report as overlap_report

    # 3 layers: signals at 10, 20, 30 ms; copies of 2 MB take 1 ms, the last lands after prefill's end (31 ms)
    t = events.event_table([10, 20, 30], [10.5, 20.2, 30.6], [11.5, 21.2, 31.6], 31.0, 2_000_000)
    assert list(t.compute_ms) == [10, 10, 10]
    assert list(t.lag_ms.round(3)) == [0.5, 0.2, 0.6]
    assert list(t.gbps.round(1)) == [2.0, 2.0, 2.0]
    assert list(t.backlog_ms.round(3)) == [-8.5, -8.8, 0.6]  # the last row is the exposed tail
    fig = overlap_report.event_gantt(t, 31.0)
    assert fig.axes[0].get_xlabel().startswith("ms since the request started")
    with pytest.raises(ValueError, match="one time per layer"):
        events.event_table([1, 2], [1], [2], 3.0, 10)


@pytest.fixture
def tiny_model():
    from kvlab import models

    return models.build("kvlab-tiny", device="cpu", dtype=torch.float32)


def test_event_handoff_is_gpu_only_and_refuses_bad_input(tiny_model):
    et = events.event_handoff(tiny_model, 16, "same-gpu", rounds=2, warmup=0, device="cpu")
    assert et.rounds.empty and et.layers.empty
    with pytest.raises(ValueError, match="rounds"):
        events.event_handoff(tiny_model, 16, "same-gpu", rounds=0, device="cpu")
    with pytest.raises(ValueError, match="unknown destination"):
        events.event_handoff(tiny_model, 16, "nvme", device="cpu")


@pytest.mark.gpu
def test_gpu_event_handoff_measures_its_own_overhead(tiny_model):
    model = tiny_model.to(device="cuda", dtype=torch.bfloat16)
    et = events.event_handoff(model, 64, "pinned", rounds=3, warmup=1, device="cuda")
    assert set(et.rounds.variant) == {"layer-wise", "layer-wise + events"} and len(et.rounds) == 6
    assert len(et.layers) == model.config.num_hidden_layers
    assert (et.layers.copy_ms > 0).all() and (et.layers.copy_start_ms >= 0).all()
    assert et.overhead.rounds.iloc[0] == 3
