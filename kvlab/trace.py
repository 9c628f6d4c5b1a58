"""Timelines: what the host and the GPU did during a region, as one tidy events table.

Seed 004 found layer-by-layer sending *worse* than one bulk copy at 32k tokens and could not say why;
it needed a timeline. This module makes one and reads it into a pandas table that the overlap
analysis (kvlab.overlap) works on, whichever tool recorded it:

    capture(fn)            torch.profiler (Kineto) around fn(): CPU ops, CUDA runtime calls, kernels,
                           memcpys, memsets and the hooks' ranges; exports a .json.gz Chrome/Perfetto
                           trace. This is the path that works everywhere (on our H200 too).
    load_kineto(path)      an existing Kineto trace (.json or .json.gz) from any recent torch.
    run_nsys(command)      Nsight Systems with CUDA + NVTX tracing, exported to SQLite and read by
    load_nsys_sqlite(path) — where nsys can make a report (on our H200 it only writes a .qdstrm).
    trace_handoff(...)     the measured run the overlap notebook needs: colocated and layer-wise
                           prefill, each traced, plus wall times with and without the profiler.

The events table (one row per event; every time in integer nanoseconds, relative to the first event
of the trace):

    kind         "kernel" | "memcpy" | "memset" (GPU activity), "cpu_op" (an aten op on the host),
                 "runtime" (a CUDA runtime/driver call), "range" (record_function / NVTX range;
                 GPU-side copies of ranges — Kineto's gpu_user_annotation — have a stream)
    name         kernel / op / call / range name; memcpys "Memcpy DtoH (Device -> Pinned)"
    device       GPU index (GPU rows and GPU-side ranges), else <NA>
    stream       CUDA stream id (GPU rows and GPU-side ranges), else <NA>
    thread       host thread id: of the event (host rows) or of the call that launched it (GPU rows)
    start_ns, end_ns, dur_ns
    bytes        bytes moved (memcpy) or set (memset), else <NA>
    copy_kind    "DtoD" | "DtoH" | "HtoD" | "PtoP" for memcpys, else None
    correlation  CUDA correlation id linking a GPU row to the runtime call that launched it
    launch_ns    GPU rows: start of that runtime call (host clock, same origin), else <NA>
    layer        index i of the innermost enclosing hook range kvlab/layer{i} or kvlab/send{i}
                 (GPU rows: the range around the launching call; failing that, a GPU-side range
                 on the same stream), else <NA>
    range_name   that range's name ("kvlab/send3"), else None

Only ranges named kvlab/layer{i} and kvlab/send{i} are used for attribution; others stay in the table
as kind "range" — among them kvlab/region, which trace_handoff puts around each timed region so the
analysis can see the host work before prefill's first kernel.
"""

from __future__ import annotations

import bisect
import contextlib
import decimal
import glob
import gzip
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

__all__ = [
    "EVENT_COLUMNS", "KINDS", "GPU_KINDS", "COPY_KINDS", "REGION", "TraceError", "NsysUnavailable",
    "capture", "load", "load_kineto", "load_nsys_sqlite", "nsys_available", "run_nsys", "NsysInfo",
    "profiler_range",
    "summarize", "host_layers", "trace_handoff", "HandoffTrace", "trace_main",
    "event_table", "event_handoff", "EventTimeline",
]

EVENT_COLUMNS = ["kind", "name", "device", "stream", "thread", "start_ns", "end_ns", "dur_ns", "bytes",
                 "copy_kind", "correlation", "launch_ns", "layer", "range_name"]
KINDS = ("kernel", "memcpy", "memset", "cpu_op", "runtime", "range")
GPU_KINDS = ("kernel", "memcpy", "memset")
COPY_KINDS = ("DtoD", "DtoH", "HtoD", "PtoP")
RANGE_RE = re.compile(r"^kvlab/(layer|send)(\d+)$")
# trace_handoff's range around each timed region (not a layer range: it attributes nothing)
REGION = "kvlab/region"

class TraceError(ValueError):
    """A file that is not a trace, a truncated one, or a trace missing what the analysis needs."""


class NsysUnavailable(RuntimeError):
    """Nsight Systems is missing here or cannot turn a recording into a report."""


# ============================================================================== the events table


def _table(rows: list[dict]) -> pd.DataFrame:
    """Rows (dicts with EVENT_COLUMNS keys, absolute ns) → the events table, sorted by start."""
    data = {c: [r.get(c) for r in rows] for c in EVENT_COLUMNS}
    df = pd.DataFrame({
        "kind": pd.Series(data["kind"], dtype=object),
        "name": pd.Series(data["name"], dtype=object),
        **{c: pd.array(data[c], dtype="Int64") for c in ("device", "stream", "thread")},
        "start_ns": pd.Series(data["start_ns"], dtype="int64"),
        "end_ns": pd.Series(data["end_ns"], dtype="int64"),
        "dur_ns": pd.Series([0] * len(rows), dtype="int64"),
        "bytes": pd.array(data["bytes"], dtype="Int64"),
        # object, not pandas' string dtype: None must stay None (pandas 3 would turn it into NaN)
        "copy_kind": pd.Series(data["copy_kind"], dtype=object),
        "correlation": pd.array(data["correlation"], dtype="Int64"),
        "launch_ns": pd.array(data["launch_ns"], dtype="Int64"),
        "layer": pd.array(data["layer"], dtype="Int64"),
        "range_name": pd.Series(data["range_name"], dtype=object),
    })
    df["dur_ns"] = df.end_ns - df.start_ns
    if len(df):
        t0 = int(df.start_ns.min())
        df["start_ns"] -= t0
        df["end_ns"] -= t0
        df["launch_ns"] = df.launch_ns - t0
    # at equal start a range sorts before what it encloses, a call before what it launched
    kind_order = {k: i for i, k in enumerate(("range", "cpu_op", "runtime", "kernel", "memcpy", "memset"))}
    df["_k"] = df.kind.map(kind_order).fillna(99)
    df = df.sort_values(["start_ns", "_k", "end_ns"], ascending=[True, True, False], kind="stable")
    return df.drop(columns="_k").reset_index(drop=True)


def _attribute(rows: list[dict]) -> list[dict]:
    """Fill launch_ns / thread of GPU rows (via the correlation id) and layer / range_name of every
    row (via the innermost enclosing kvlab range). Works in place on absolute times; returns rows."""
    launches = {}
    for r in rows:
        if r["kind"] == "runtime" and r.get("correlation") is not None:
            # one runtime call per correlation id; keep the first if a tool repeats it
            launches.setdefault(r["correlation"], r)
    for r in rows:
        if r["kind"] in GPU_KINDS and r.get("correlation") is not None:
            call = launches.get(r["correlation"])
            if call is not None:
                r["launch_ns"] = call["start_ns"]
                r["thread"] = call.get("thread")

    host = _RangeIndex()
    gpu = _RangeIndex()
    for r in rows:
        if r["kind"] == "range" and RANGE_RE.match(str(r["name"])):
            m = RANGE_RE.match(r["name"])
            r["layer"], r["range_name"] = int(m.group(2)), r["name"]
            if r.get("stream") is None:
                host.add(r.get("thread"), r["start_ns"], r["end_ns"], r["name"])
            else:
                gpu.add((r.get("device"), r.get("stream")), r["start_ns"], r["end_ns"], r["name"])
    host.build()
    gpu.build()
    for r in rows:
        if r["kind"] == "range" and r.get("range_name") is not None:
            continue
        name = None
        if r["kind"] in GPU_KINDS:
            if r.get("launch_ns") is not None:
                name = host.find(r.get("thread"), r["launch_ns"])
            if name is None:
                # no launching call in the trace (or it ran outside every range): a GPU-side copy
                # of a range on the same stream that covers the event's start says which layer
                name = gpu.find((r.get("device"), r.get("stream")), r["start_ns"])
        elif r["kind"] != "range" or r.get("stream") is None:
            name = host.find(r.get("thread"), r["start_ns"])
        if name is not None:
            r["range_name"] = name
            r["layer"] = int(RANGE_RE.match(name).group(2))
    return rows


class _RangeIndex:
    """Nested ranges per lane (a host thread or a GPU stream); innermost range covering a time.

    Ranges on one host thread nest (push/pop), so each range's parent is the nearest earlier range
    that still covers it; a lookup walks from the last range that started before t up that chain.
    """

    def __init__(self):
        self._lanes: dict = {}

    def add(self, lane, start: int, end: int, name: str) -> None:
        self._lanes.setdefault(lane, []).append((start, -end, name))

    def build(self) -> None:
        self._built = {}
        for lane, items in self._lanes.items():
            items.sort()
            starts, ends, names, parent, stack = [], [], [], [], []
            for i, (s, neg_end, name) in enumerate(items):
                e = -neg_end
                while stack and ends[stack[-1]] <= s:
                    stack.pop()
                parent.append(stack[-1] if stack else -1)
                starts.append(s)
                ends.append(e)
                names.append(name)
                stack.append(i)
            self._built[lane] = (starts, ends, names, parent)

    def find(self, lane, t: int) -> str | None:
        entry = self._built.get(lane)
        if entry is None:
            return None
        starts, ends, names, parent = entry
        i = bisect.bisect_right(starts, t) - 1
        while i >= 0 and ends[i] <= t:
            i = parent[i]
        return names[i] if i >= 0 else None


# ============================================================================== Kineto traces

_KINETO_KIND = {
    "kernel": "kernel", "gpu_memcpy": "memcpy", "memcpy": "memcpy", "gpu_memset": "memset",
    "memset": "memset", "cpu_op": "cpu_op", "operator": "cpu_op", "cuda_runtime": "runtime",
    "cuda_driver": "runtime", "runtime": "runtime", "user_annotation": "range",
    "gpu_user_annotation": "range",
}
_MEMCPY_NAME_RE = re.compile(r"^Memcpy\s+([A-Za-z]to[A-Za-z])\b")


def _read_bytes(path: Path) -> bytes:
    if not path.exists():
        raise FileNotFoundError(f"no trace at {path}")
    if path.is_dir():
        raise TraceError(f"{path} is a directory, not a trace file")
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        try:
            return gzip.decompress(raw)
        except EOFError:
            raise TraceError(f"{path} is truncated: the gzip stream ends before its end marker "
                             "(was the trace still being written?)") from None
        except (OSError, zlib.error) as e:
            raise TraceError(f"{path} looks gzip-compressed but cannot be read: {e}") from None
    return raw


def _ns(value) -> int:
    """A Kineto time in µs (Decimal/int, as parsed) → integer ns, exactly (no float rounding: absolute
    µs timestamps of older torch have 16 digits, more than a double holds at ns resolution)."""
    return int((decimal.Decimal(value) * 1000).to_integral_value(rounding=decimal.ROUND_HALF_EVEN))


def _as_int(value):
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, decimal.Decimal):
        return int(value) if value == value.to_integral_value() else None
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            return None
    return None


def load_kineto(path: str | os.PathLike) -> pd.DataFrame:
    """Read a Kineto / Chrome trace (.json or .json.gz, as torch.profiler exports it) into the events
    table (see the module docstring; ns relative to the first event).

    Reads the complete-event records ("ph": "X") of categories kernel, gpu_memcpy, gpu_memset, cpu_op,
    cuda_runtime, cuda_driver, user_annotation and gpu_user_annotation; everything else (metadata,
    flows, python frames, profiler spans) is skipped. GPU rows take device / stream from their args
    ("device", "stream"), falling back to pid / tid.

    Raises FileNotFoundError, or TraceError for a file that is not JSON, a truncated file, JSON that
    is not a trace (no "traceEvents"), or a trace without a single event of those categories.
    """
    path = Path(path)
    raw = _read_bytes(path)
    text = raw.decode("utf-8", errors="replace")
    head = text.lstrip()[:1]
    if head not in ("{", "["):
        raise TraceError(f"{path} is not a Kineto/Chrome trace: it is not JSON "
                         f"(starts with {text[:20]!r}); expected a .json or .json.gz from torch.profiler")
    try:
        doc = json.loads(text, parse_float=decimal.Decimal)
    except json.JSONDecodeError as e:
        # an export cut short (a killed process, a partial copy) stops mid-structure: it does not end
        # with the closing bracket, or the parser ran out of text
        tail = text.rstrip()[-1:]
        if e.pos >= len(text.rstrip()) - 1 or tail not in ("}", "]"):
            raise TraceError(f"{path} is truncated: the JSON ends at character {e.pos} before the "
                             "trace is closed (was the export interrupted?)") from None
        raise TraceError(f"{path} is not a Kineto/Chrome trace: invalid JSON at line {e.lineno}, "
                         f"column {e.colno}: {e.msg}") from None
    if isinstance(doc, dict):
        if "traceEvents" not in doc:
            raise TraceError(f"{path} is JSON but not a Kineto/Chrome trace: it has no 'traceEvents' "
                             f"list (top-level keys: {sorted(doc)[:8]})")
        events = doc["traceEvents"]
    else:
        events = doc
    if not isinstance(events, list):
        raise TraceError(f"{path}: 'traceEvents' is a {type(events).__name__}, expected a list of events")

    rows, seen = [], set()
    for e in events:
        if not isinstance(e, dict):
            continue
        cat = str(e.get("cat", "")).lower()
        seen.add(cat)
        if e.get("ph") != "X" or cat not in _KINETO_KIND:
            continue
        if "ts" not in e or "dur" not in e:
            continue
        kind = _KINETO_KIND[cat]
        args = e.get("args") or {}
        start = _ns(e["ts"])
        end = start + max(_ns(e["dur"]), 0)
        row = {"kind": kind, "name": str(e.get("name", "")), "start_ns": start, "end_ns": end,
               "correlation": _as_int(args.get("correlation"))}
        gpu = kind in GPU_KINDS or cat == "gpu_user_annotation"
        if gpu:
            row["device"] = _as_int(args.get("device", args.get("inDevice", e.get("pid"))))
            row["stream"] = _as_int(args.get("stream", e.get("tid")))
        else:
            row["thread"] = _as_int(e.get("tid"))
        if kind in ("memcpy", "memset"):
            row["bytes"] = _as_int(args.get("bytes"))
        if kind == "memcpy":
            row["copy_kind"] = _copy_kind_from_name(row["name"])
        rows.append(row)
    if not rows:
        raise TraceError(f"{path} holds no events kvlab can read: no complete ('X') events of "
                         f"categories {sorted(set(_KINETO_KIND))}; categories present: "
                         f"{sorted(c for c in seen if c)[:12]}")
    return _table(_attribute(rows))


def _copy_kind_from_name(name: str) -> str | None:
    m = _MEMCPY_NAME_RE.match(name)
    if not m:
        return None
    k = m.group(1)
    k = k[0].upper() + "to" + k[-1].upper()
    return k if k in COPY_KINDS else None


# ============================================================================== torch.profiler


def _gzip_file(src: Path, dst: Path) -> None:
    with open(src, "rb") as f, gzip.open(dst, "wb", compresslevel=6) as g:
        shutil.copyfileobj(f, g)


def capture(fn, *, device=None, out_dir: str | os.PathLike | None = None, name: str = "trace",
            warmup: int = 1):
    """Run ``fn()`` under torch.profiler and return ``(events, path)``.

    device: the device the region runs on (default: CUDA when available, else CPU). CUDA activity
        (kernels, memcpys, runtime calls) is recorded only for a CUDA device.
    out_dir: where ``<name>.json.gz`` goes (default: a new temporary folder).
    name: file stem; kvlab run folders keep raw traces as trace*.json.gz, which git ignores.
    warmup: calls of fn() before profiling (first-call allocations and autotuning stay out).

    The profiler records CPU ops and ranges but no shapes, stacks or memory, to keep its host
    overhead small. Returns the events table (ns, see the module docstring) and the Path of the
    gzipped Chrome/Perfetto trace (open it at ui.perfetto.dev).
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an int ≥ 0, got {warmup!r}")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", str(name)):
        raise ValueError(f"name {name!r} is not a valid file stem: use letters, digits, '_', '-', '.'")
    dev = torch.device(device) if device is not None else \
        torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = dev.type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise ValueError(f"device {dev} requested, but torch sees no CUDA device here")
    out = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="kvlab-trace-"))
    out.mkdir(parents=True, exist_ok=True)

    def sync():
        if cuda:
            torch.cuda.synchronize(dev)

    for _ in range(warmup):
        fn()
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=False, with_stack=False, profile_memory=False) as prof:
        fn()
        sync()
    # export plain JSON next to the target, then gzip it ourselves: older torch versions do not
    # compress on export, and the uncompressed file may be large
    plain = out / f".{name}.{os.getpid()}.json"
    prof.export_chrome_trace(str(plain))
    path = out / f"{name}.json.gz"
    _gzip_file(plain, path)
    plain.unlink()
    return load_kineto(path), path


# ============================================================================== Nsight Systems

# CUpti_ActivityMemcpyKind and CUpti_ActivityMemoryKind (cupti_activity.h): the numbering used only when
# an export lacks its ENUM_CUDA_MEMCPY_OPER / ENUM_CUDA_MEM_KIND tables, which name its own numbers.
_CUPTI_COPY = {0: "Unknown", 1: "HtoD", 2: "DtoH", 3: "HtoA", 4: "AtoH", 5: "AtoA", 6: "AtoD",
               7: "DtoA", 8: "DtoD", 9: "HtoH", 10: "PtoP"}
_CUPTI_MEMORY = {0: "Unknown", 1: "Pageable", 2: "Pinned", 3: "Device", 4: "Array", 5: "Managed",
                 6: "Device Static", 7: "Managed Static"}
# NVTX_EVENTS.eventType: push/pop (thread) ranges and start/end (process) ranges
_NVTX_RANGE_TYPES = (59, 60)


def _tables(db: sqlite3.Connection) -> dict[str, list[str]]:
    names = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")]
    return {n: [c[1] for c in db.execute(f"PRAGMA table_info('{n}')")] for n in names}


def _enum(db, tables, table: str, prefix: str, fallback: dict, short) -> dict:
    """id → label from an nsys ENUM_* table, whose numbering is the export's own (it has not always
    matched CUPTI's), falling back to the CUPTI numbering when the table is absent. ``short`` turns a
    name without its prefix ("DTOH", "DEVICE_STATIC") into the label ("DtoH", "Device Static")."""
    if table not in tables or "id" not in tables[table] or "name" not in tables[table]:
        return dict(fallback)
    out = {}
    for i, name in db.execute(f"SELECT id, name FROM {table}"):
        label = short(str(name).upper().removeprefix(prefix))
        if label:
            out[int(i)] = label
    return out or dict(fallback)


def _copy_label(key: str) -> str | None:
    m = re.fullmatch(r"([A-Z])TO([A-Z])", key)
    return f"{m.group(1)}to{m.group(2)}" if m else None


def _memory_label(key: str) -> str:
    return key.replace("_", " ").title()


def load_nsys_sqlite(path: str | os.PathLike) -> pd.DataFrame:
    """Read an Nsight Systems SQLite export (``nsys export --type sqlite``) into the events table.

    Tables read: CUPTI_ACTIVITY_KIND_KERNEL (name from StringIds via demangledName, else shortName),
    CUPTI_ACTIVITY_KIND_MEMCPY (copyKind / srcKind / dstKind, decoded through ENUM_CUDA_MEMCPY_OPER /
    ENUM_CUDA_MEM_KIND, → "Memcpy DtoH (Device -> Pinned)", the name Kineto gives the same copy), CUPTI_ACTIVITY_KIND_MEMSET, CUPTI_ACTIVITY_KIND_RUNTIME (name
    via nameId, thread = globalTid) and NVTX_EVENTS (push/pop and start/end ranges, text or textId).
    Times in the export are ns already; they are made relative to the first event.

    Raises FileNotFoundError, or TraceError for a file that is not SQLite, or an export without CUDA
    tables (no kernel and no memcpy table: the run was not traced with --trace=cuda, or its capture
    range held no GPU work).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no nsys export at {path}")
    with open(path, "rb") as f:
        magic = f.read(16)
    if magic != b"SQLite format 3\x00":
        raise TraceError(f"{path} is not an SQLite database (make one with: nsys export --type sqlite "
                         "REPORT.nsys-rep); for a torch.profiler trace use load_kineto")
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        tables = _tables(db)
        cuda = [t for t in ("CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_MEMCPY") if t in tables]
        if not cuda:
            raise TraceError(
                f"{path} has no CUDA tables (CUPTI_ACTIVITY_KIND_KERNEL / CUPTI_ACTIVITY_KIND_MEMCPY); "
                f"tables present: {sorted(tables)[:12]}. Profile with --trace=cuda,nvtx and make sure "
                "the capture range contains GPU work")
        strings = dict(db.execute("SELECT id, value FROM StringIds")) if "StringIds" in tables else {}
        copy_names = _enum(db, tables, "ENUM_CUDA_MEMCPY_OPER", "CUDA_MEMCPY_KIND_", _CUPTI_COPY, _copy_label)
        memory_names = _enum(db, tables, "ENUM_CUDA_MEM_KIND", "CUDA_MEMOPR_MEMORY_KIND_", _CUPTI_MEMORY,
                             _memory_label)
        rows: list[dict] = []

        def cols(table, wanted):
            have = tables[table]
            return [c if c in have else "NULL" for c in wanted]

        if "CUPTI_ACTIVITY_KIND_KERNEL" in tables:
            q = cols("CUPTI_ACTIVITY_KIND_KERNEL",
                     ["start", "end", "deviceId", "streamId", "correlationId", "demangledName", "shortName"])
            for s, e, dev, stream, corr, dem, short in db.execute(
                    f"SELECT {', '.join(q)} FROM CUPTI_ACTIVITY_KIND_KERNEL"):
                name = strings.get(dem) or strings.get(short) or f"kernel#{dem if dem is not None else short}"
                rows.append({"kind": "kernel", "name": name, "start_ns": int(s), "end_ns": int(e),
                             "device": dev, "stream": stream, "correlation": corr})
        if "CUPTI_ACTIVITY_KIND_MEMCPY" in tables:
            q = cols("CUPTI_ACTIVITY_KIND_MEMCPY",
                     ["start", "end", "deviceId", "streamId", "correlationId", "bytes", "copyKind",
                      "srcKind", "dstKind"])
            for s, e, dev, stream, corr, nbytes, ck, src, dst in db.execute(
                    f"SELECT {', '.join(q)} FROM CUPTI_ACTIVITY_KIND_MEMCPY"):
                label = copy_names.get(ck, "Unknown")
                name = f"Memcpy {label} ({memory_names.get(src, 'Unknown')} -> {memory_names.get(dst, 'Unknown')})"
                rows.append({"kind": "memcpy", "name": name, "start_ns": int(s), "end_ns": int(e),
                             "device": dev, "stream": stream, "correlation": corr, "bytes": nbytes,
                             "copy_kind": label if label in COPY_KINDS else None})
        if "CUPTI_ACTIVITY_KIND_MEMSET" in tables:
            q = cols("CUPTI_ACTIVITY_KIND_MEMSET",
                     ["start", "end", "deviceId", "streamId", "correlationId", "bytes", "memKind"])
            for s, e, dev, stream, corr, nbytes, mk in db.execute(
                    f"SELECT {', '.join(q)} FROM CUPTI_ACTIVITY_KIND_MEMSET"):
                rows.append({"kind": "memset", "name": f"Memset ({memory_names.get(mk, 'Unknown')})",
                             "start_ns": int(s), "end_ns": int(e), "device": dev, "stream": stream,
                             "correlation": corr, "bytes": nbytes})
        if "CUPTI_ACTIVITY_KIND_RUNTIME" in tables:
            q = cols("CUPTI_ACTIVITY_KIND_RUNTIME", ["start", "end", "globalTid", "correlationId", "nameId"])
            for s, e, tid, corr, name_id in db.execute(
                    f"SELECT {', '.join(q)} FROM CUPTI_ACTIVITY_KIND_RUNTIME"):
                rows.append({"kind": "runtime", "name": strings.get(name_id, f"runtime#{name_id}"),
                             "start_ns": int(s), "end_ns": int(e), "thread": tid, "correlation": corr})
        if "NVTX_EVENTS" in tables:
            q = cols("NVTX_EVENTS", ["start", "end", "globalTid", "text", "textId", "eventType"])
            for s, e, tid, text, text_id, etype in db.execute(
                    f"SELECT {', '.join(q)} FROM NVTX_EVENTS"):
                if e is None or (etype is not None and etype not in _NVTX_RANGE_TYPES):
                    continue  # marks, domain and category definitions have no extent
                name = text if text is not None else strings.get(text_id)
                if name is None:
                    continue
                rows.append({"kind": "range", "name": str(name), "start_ns": int(s), "end_ns": int(e),
                             "thread": tid})
    finally:
        db.close()
    return _table(_attribute(rows))


@dataclass(frozen=True)
class NsysInfo:
    """Where nsys is and whether it can make reports here. Truthy only when it can export."""

    path: str | None
    version: str | None
    can_export: bool
    reason: str

    def __bool__(self) -> bool:
        return self.path is not None and self.can_export


_NSYS_GLOBS = ("/opt/nvidia/nsight-systems*/*/bin/nsys", "/opt/nvidia/nsight-systems*/bin/nsys",
               "/opt/nvidia/nsight-*/bin/nsys", "/opt/nvidia/nsight-*/*/bin/nsys",
               "/usr/local/cuda*/bin/nsys", "/usr/local/cuda*/nsight-systems*/bin/nsys")


def _find_nsys(globs=_NSYS_GLOBS) -> str | None:
    found = shutil.which("nsys")
    if found:
        return found
    for pattern in globs:
        hits = sorted(glob.glob(pattern), reverse=True)  # newest version folder first
        for h in hits:
            if os.access(h, os.X_OK):
                return h
    return None


def nsys_available(nsys: str | None = None, globs=_NSYS_GLOBS) -> NsysInfo:
    """Look for Nsight Systems (PATH, then /opt/nvidia/nsight-*/, /usr/local/cuda*/) and check it can
    make reports: ``nsys --version`` runs and a QdstrmImporter (the tool that turns the raw .qdstrm
    recording into a .nsys-rep) sits in the same installation. Without the importer nsys records but
    leaves only a .qdstrm — the situation on our H200."""
    path = nsys or _find_nsys(globs)
    if path is None:
        return NsysInfo(None, None, False, "nsys is not on PATH, nor under /opt/nvidia/nsight-*/ or "
                                           "/usr/local/cuda*/; use kvlab.trace.capture (torch.profiler)")
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return NsysInfo(path, None, False, f"{path} --version failed: {e}")
    version = (out.stdout or out.stderr).strip().splitlines()[0] if (out.stdout or out.stderr).strip() else None
    if out.returncode != 0:
        return NsysInfo(path, version, False, f"{path} --version exited with {out.returncode}")
    root = Path(os.path.realpath(path)).parent
    for up in (root, root.parent, root.parent.parent):
        if list(up.glob("*/QdstrmImporter*")) or list(up.glob("QdstrmImporter*")):
            return NsysInfo(path, version, True, "ok")
    return NsysInfo(path, version, False,
                    f"no QdstrmImporter next to {path}: nsys can record (.qdstrm) but cannot make a "
                    "report; use kvlab.trace.capture (torch.profiler) instead")


def run_nsys(command, out_dir: str | os.PathLike, capture_range: str = "cudaProfilerApi",
             name: str = "nsys", trace: str = "cuda,nvtx", nsys: str | None = None,
             extra_args=(), timeout: float | None = None):
    """Profile ``command`` (a list of strings) with Nsight Systems and load the result.

    Runs ``nsys profile --trace=<trace> --capture-range=<capture_range> -o <out_dir>/<name>``, with
    KVLAB_RANGES=1 in the child's environment (so kvlab's hooks emit their NVTX ranges), then exports
    SQLite (``nsys export --type sqlite``, falling back to ``nsys stats``) and returns
    ``(events, sqlite_path)`` from load_nsys_sqlite. capture_range "cudaProfilerApi" records between
    torch.cuda.profiler.start() and stop() in the child (kvlab.trace.profiler_range() does both);
    "none" records the whole run.

    Raises NsysUnavailable when nsys is missing, or when it leaves only a .qdstrm (it recorded but
    could not make a report) — the message says so and points at kvlab.trace.capture.
    """
    if isinstance(command, str) or not command:
        raise ValueError(f"command must be a non-empty list of strings, e.g. ['python', 'run.py'], got {command!r}")
    if capture_range not in ("cudaProfilerApi", "none"):
        raise ValueError(f"capture_range {capture_range!r} is not valid; use 'cudaProfilerApi' (between "
                         "kvlab.trace.profiler_range() / torch.cuda.profiler.start() and stop()) or 'none'")
    path = nsys or _find_nsys()
    if path is None:
        raise NsysUnavailable("Nsight Systems (nsys) is not installed here (not on PATH, nor under "
                              "/opt/nvidia/nsight-*/): trace with torch.profiler instead — "
                              "kvlab.trace.capture(fn), which needs nothing else")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]*", str(name)):
        raise ValueError(f"name {name!r} is not valid: use letters, digits, '_' and '-'")
    stem = out / name
    for old in out.glob(f"{name}.*"):
        if old.suffix in (".qdstrm", ".nsys-rep", ".qdrep", ".sqlite"):
            old.unlink()
    env = dict(os.environ, KVLAB_RANGES="1")
    cmd = [path, "profile", f"--trace={trace}", f"--capture-range={capture_range}", "-o", str(stem),
           "--force-overwrite=true", *map(str, extra_args), *map(str, command)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    report = next((p for p in (out / f"{name}.nsys-rep", out / f"{name}.qdrep") if p.exists()), None)
    if report is None:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
        if list(out.glob(f"{name}*.qdstrm")) or ".qdstrm" in proc.stdout + proc.stderr:
            raise NsysUnavailable(
                f"nsys recorded the run but could not make a report: only a .qdstrm was written "
                f"(its QdstrmImporter is missing or failed). Trace with torch.profiler instead — "
                f"kvlab.trace.capture(fn). nsys said:\n{tail}")
        raise NsysUnavailable(f"nsys profile exited with {proc.returncode} and wrote no report "
                              f"({stem}.nsys-rep). Use kvlab.trace.capture (torch.profiler). nsys said:\n{tail}")
    sqlite_path = out / f"{name}.sqlite"
    exp = subprocess.run([path, "export", "--type", "sqlite", "--force-overwrite", "true",
                          "--output", str(sqlite_path), str(report)], capture_output=True, text=True,
                         timeout=timeout)
    if not sqlite_path.exists():
        # older nsys: `stats` writes the .sqlite next to the report as a side effect
        subprocess.run([path, "stats", "--report", "cuda_gpu_trace", str(report)], capture_output=True,
                       text=True, timeout=timeout)
    if not sqlite_path.exists():
        raise NsysUnavailable(f"nsys made {report} but could not export SQLite (nsys export exited with "
                              f"{exp.returncode}: {exp.stderr.strip()[-300:]}); use kvlab.trace.capture")
    return load_nsys_sqlite(sqlite_path), sqlite_path


@contextlib.contextmanager
def profiler_range():
    """In a script run under ``kvlab trace nsys`` (capture range cudaProfilerApi): record only what runs
    inside this block (cudaProfilerStart / cudaProfilerStop). A no-op without CUDA."""
    import torch

    on = torch.cuda.is_available()
    if on:
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
    try:
        yield
    finally:
        if on:
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()


def load(path: str | os.PathLike) -> pd.DataFrame:
    """Read any trace kvlab understands, by content: an nsys SQLite export or a Kineto .json(.gz)."""
    p = Path(path)
    if p.is_file():
        with open(p, "rb") as f:
            if f.read(16) == b"SQLite format 3\x00":
                return load_nsys_sqlite(p)
    if p.suffix in (".qdstrm", ".nsys-rep", ".qdrep"):
        raise TraceError(f"{p} is a raw Nsight Systems file; export it first (nsys export --type sqlite "
                         f"{p}) or, where nsys cannot make reports, trace with kvlab.trace.capture")
    return load_kineto(p)


# ============================================================================== summaries


def summarize(events: pd.DataFrame) -> pd.DataFrame:
    """A small table per (kind, device, stream): count, busy_ms (summed durations), span_ms (first
    start → last end), bytes, and GB/s (bytes / busy time) for copies. Host rows are grouped per kind
    only. This — not the raw trace — is what a run folder keeps."""
    _check_events(events)
    rows = []
    gpu = events[events.kind.isin(GPU_KINDS)]
    for (kind, dev, stream), g in gpu.groupby(["kind", "device", "stream"], dropna=False, sort=True):
        rows.append(_summary_row(kind, dev, stream, g))
    host = events[~events.kind.isin(GPU_KINDS)]
    for kind, g in host.groupby("kind", sort=True):
        on_gpu = g.stream.notna().any()
        rows.append(_summary_row(kind + (" (gpu side)" if on_gpu and kind == "range" else ""), pd.NA, pd.NA, g))
    return pd.DataFrame(rows, columns=["kind", "device", "stream", "count", "busy_ms", "span_ms", "bytes",
                                       "gbps", "layers"])


def _summary_row(kind, dev, stream, g) -> dict:
    busy = int(g.dur_ns.sum())
    nbytes = int(g.bytes.sum()) if g.bytes.notna().any() else pd.NA
    return {"kind": kind, "device": dev, "stream": stream, "count": len(g), "busy_ms": busy / 1e6,
            "span_ms": (int(g.end_ns.max()) - int(g.start_ns.min())) / 1e6,
            "bytes": nbytes, "gbps": (nbytes / busy) if nbytes is not pd.NA and busy > 0 else pd.NA,
            "layers": int(g.layer.nunique())}


def host_layers(events: pd.DataFrame) -> pd.DataFrame:
    """Per layer, from the hooks' host ranges: layer_ms (kvlab/layer{i} duration), send_ms
    (kvlab/send{i}: the hook's own host time; on a CPU it includes the synchronous copy), and
    gap_ms (host time between the end of layer i−1's range and the start of layer i's).
    Raises TraceError when the trace has no host-side kvlab ranges."""
    _check_events(events)
    r = events[(events.kind == "range") & events.stream.isna() & events.range_name.notna()
               & (events.name == events.range_name)]
    if r.empty:
        raise TraceError("this trace has no kvlab/layer{i} or kvlab/send{i} ranges: record it with "
                         "LayerHooks(model, ..., ranges=True) (or KVLAB_RANGES=1) so it can be split by layer")
    lay = r[r.name.str.startswith("kvlab/layer")].set_index("layer")
    snd = r[r.name.str.startswith("kvlab/send")].set_index("layer")
    layers = sorted(set(lay.index) | set(snd.index))
    out = []
    prev_end = None
    for i in layers:
        row = {"layer": int(i)}
        if i in lay.index:
            li = lay.loc[[i]].iloc[0]
            row["layer_ms"] = li.dur_ns / 1e6
            row["gap_ms"] = (li.start_ns - prev_end) / 1e6 if prev_end is not None else 0.0
            prev_end = li.end_ns
        else:
            row["layer_ms"], row["gap_ms"] = float("nan"), float("nan")
        row["send_ms"] = float(snd.loc[[i]].dur_ns.sum()) / 1e6 if i in snd.index else float("nan")
        out.append(row)
    return pd.DataFrame(out, columns=["layer", "layer_ms", "send_ms", "gap_ms"])


def _check_events(events) -> None:
    if not isinstance(events, pd.DataFrame):
        raise TypeError(f"events must be the DataFrame from kvlab.trace (capture / load_*), got {type(events).__name__}")
    missing = [c for c in EVENT_COLUMNS if c not in events.columns]
    if missing:
        raise TraceError(f"not a kvlab events table: columns {missing} are missing "
                         "(make it with kvlab.trace.capture, load_kineto or load_nsys_sqlite)")


# ============================================================================== the measured run


@dataclass
class HandoffTrace:
    """What trace_handoff measured. Times in ms unless a name says ns.

    colocated, layerwise: events tables of the kept repeat (the layer-wise trace with the median
        traced wall, and the colocated trace of the same round).
    walls: tidy, one row per (variant, traced, repeat): wall_ms, prefill_ms, exposed_ms.
        Colocated wall = prefill; layer-wise wall = prefill + max(exposed, 0), exposed = last layer
        landed − prefill done (as kvlab.handoff measures it).
    ceiling_gbps: the whole cache in one copy on the same path, timed alone in this run (bytes/time).
    layer_copy_ms: one layer's K and V copied alone (the per-layer transfer time, fixed cost included).
    paths: {"colocated": [...], "layerwise": [...]} trace files, one per repeat.
    extra: send_mode (kvlab.transfer.LayerwiseSend's mode: "flag", "staged", "event", "thread" or "cpu") and
        hook_host_ms_last (host ms inside the send hooks in the last traced layer-wise run).
    """

    colocated: pd.DataFrame
    layerwise: pd.DataFrame
    walls: pd.DataFrame
    paths: dict
    model: str
    context: int
    destination: str
    transport: str
    device: str
    layers: int
    bytes_per_layer: int
    kv_bytes: int
    ceiling_gbps: float
    bulk_copy_ms: float
    layer_copy_ms: float
    kept: int
    extra: dict = field(default_factory=dict)

    def wall_ns(self, variant: str) -> int:
        """Wall time (ns) of the kept traced repeat of ``variant`` ("colocated" | "layerwise")."""
        w = self.walls
        row = w[(w.variant == variant) & w.traced & (w["repeat"] == self.kept)]
        return int(round(float(row.wall_ms.iloc[0]) * 1e6))

    def overhead(self) -> pd.DataFrame:
        """Tracing overhead per variant: median wall with and without the profiler (+ ranges), and
        the difference as a percentage of the untraced median (goal: ≤ 5 % of prefill)."""
        rows = []
        for variant, g in self.walls.groupby("variant", sort=False):
            plain = float(g[~g.traced].wall_ms.median())
            traced = float(g[g.traced].wall_ms.median())
            rows.append({"variant": variant, "untraced_ms": plain, "traced_ms": traced,
                         "overhead_ms": traced - plain,
                         "overhead_pct": 100 * (traced - plain) / plain if plain > 0 else float("nan")})
        return pd.DataFrame(rows)


def trace_handoff(model, context: int, destination: str, transport: str = "copy", repeats: int = 3,
                  send_mode: str = "auto",
                  device=None, out_dir: str | os.PathLike | None = None, seed: int = 0,
                  warmup: int = 2, progress=None, sampler=None) -> HandoffTrace:
    """Trace a colocated prefill and a layer-wise prefill + send of the same prompt.

    model: a transformers causal LM (kvlab.models.build); context: prompt tokens; destination:
    "same-gpu" | "cuda:N" | "pinned" | "pageable" (kvlab.transfer); transport: "copy" (the
    kvlab.transfer.Transport copy path; the only one so far); repeats: traced and untraced runs of
    each variant, interleaved A B A B; out_dir: where trace_{variant}_r{k}.json.gz go (a run folder;
    git ignores them).

    Both traced variants carry the hooks' layer ranges (the colocated one without sending), so the
    colocated trace splits by layer too and range overhead is the same on both sides; the untraced
    runs have neither profiler nor ranges, so traced − untraced is the whole cost of tracing.

    sampler: an optional kvlab.clocks.Sampler; while the rounds run it samples the GPUs' clocks and power,
    and every row of `walls` notes `t0_ns`, the host time (perf_counter_ns) at which its start event was
    recorded on an idle GPU, so the samples can be placed on that run's timeline
    (kvlab.overlap.decompose's clock term). The samples are in `extra["clock_samples"]`.
    """
    import torch

    from .steps import make_prompt, model_device, prefill, prefill_or_abort, request_wall
    from .hooks import LayerHooks
    from .kvcache import KVBuffer, layout_for
    from .timing import schedule
    from .transfer import Destination, Transport

    if transport != "copy":
        raise ValueError(f"transport {transport!r} is not known to trace_handoff; valid: ['copy']")
    if isinstance(context, bool) or not isinstance(context, int) or context < 2:
        raise ValueError(f"context {context!r} is not valid: give an int ≥ 2 (prompt tokens)")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int ≥ 1, got {repeats!r}")
    dev = torch.device(device) if device is not None else model_device(model)
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    max_pos = getattr(cfg, "max_position_embeddings", None)
    if max_pos is not None and context > max_pos:
        raise ValueError(f"context {context} exceeds the model's max positions ({max_pos}); valid: 2…{max_pos}")
    # a destination this machine cannot serve fails here, before any buffer is allocated
    Destination.parse(destination, dev)
    say = progress or (lambda s: None)
    out = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="kvlab-trace-"))
    out.mkdir(parents=True, exist_ok=True)
    cuda = dev.type == "cuda"

    layout = layout_for(model, context)
    ids = make_prompt(cfg.vocab_size, context, dev, seed)
    src = KVBuffer(layout, device=dev)
    t = Transport(layout, destination, dev, granularity="buffer")
    sender = t.layerwise(src, send_mode)  # send_mode: see kvlab.transfer.LayerwiseSend
    send_hooks = {False: LayerHooks(model, sender.on_layer, ranges=False, bytes_per_layer=layout.bytes_per_layer),
                  True: LayerHooks(model, sender.on_layer, ranges=True, bytes_per_layer=layout.bytes_per_layer)}
    range_hooks = LayerHooks(model, None, ranges=True)

    def sync():
        if cuda:
            torch.cuda.synchronize(dev)

    def region(traced: bool):
        # a host range around the timed region: its start is where the start event was recorded on an
        # idle GPU, so the analysis can see the host work before prefill's first kernel (the lead-in)
        return torch.profiler.record_function(REGION) if traced else contextlib.nullcontext()

    def run_colocated(traced: bool) -> dict:
        sync()
        if traced:
            range_hooks.install()
        try:
            with region(traced):
                if cuda:
                    stream = torch.cuda.current_stream(dev)
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    t0_ns = time.perf_counter_ns()
                    a.record(stream)
                    prefill(model, ids, src)
                    b.record(stream)
                else:
                    t0 = time.perf_counter_ns()
                    prefill(model, ids, src)
                    t1 = time.perf_counter_ns()
        finally:
            range_hooks.remove()
        if cuda:
            b.synchronize()
            ms = a.elapsed_time(b)
        else:
            ms = (t1 - t0) / 1e6
            t0_ns = t0
        return {"wall_ms": ms, "prefill_ms": ms, "exposed_ms": 0.0, "t0_ns": t0_ns}

    def guarded_prefill(hooks):
        prefill_or_abort(model, ids, src, sender, hooks)  # an armed copy stream must not wait forever

    def run_layerwise(traced: bool) -> dict:
        hooks = send_hooks[traced]
        sync()
        with hooks, region(traced):
            if cuda:
                stream = torch.cuda.current_stream(dev)
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0_ns = time.perf_counter_ns()
                a.record(stream)
                # arms the copies in "flag"/"staged" mode: inside the traced region, where the timeline shows
                # it as lead-in (kvlab.handoff arms before its clock starts and reports the arm time apart)
                sender.begin()
                guarded_prefill(hooks)
                b.record(stream)
                landing = sender.finish()
                if sender.mode == "staged":
                    # the last step is a host memcpy no CUDA event sees: compare host clocks, from the
                    # moment the host saw prefill's end event complete
                    b.synchronize()
                    prefill_seen_ns = time.perf_counter_ns()
                landing.wait()
            else:
                t0 = time.perf_counter_ns()
                sender.begin()
                guarded_prefill(hooks)
                t1 = time.perf_counter_ns()
                sender.finish().wait()
                t2 = time.perf_counter_ns()
        if cuda:
            b.synchronize()
            p = a.elapsed_time(b)
            if sender.mode == "staged":
                exposed = (sender.host_done_ns - prefill_seen_ns) / 1e6
            else:
                exposed = b.elapsed_time(landing.done_event)
        else:
            p, exposed = (t1 - t0) / 1e6, (t2 - t1) / 1e6
            t0_ns = t0
        return {"wall_ms": request_wall(p, exposed), "prefill_ms": p, "exposed_ms": exposed, "t0_ns": t0_ns}

    say(f"warm-up ({warmup} rounds)")
    for _ in range(warmup):
        run_colocated(False)
        run_layerwise(False)
        run_colocated(True)
        run_layerwise(True)
    if warmup:
        # the profiler's first session initialises CUPTI and its buffers; keep that out of the data
        _, scratch = capture(lambda: run_layerwise(True), device=dev, out_dir=out, name="trace_warmup", warmup=0)
        scratch.unlink()

    rows = []
    tables = {"colocated": [], "layerwise": []}
    paths = {"colocated": [], "layerwise": []}
    say(f"{repeats} rounds of: colocated, layer-wise, each untraced and under torch.profiler")
    if sampler is not None:
        sampler.start()
    runs = {("colocated", False): run_colocated, ("layerwise", False): run_layerwise,
            ("colocated", True): run_colocated, ("layerwise", True): run_layerwise}
    # all four in every round, in balanced orders (timing.schedule), so drift (clocks, temperature) and what
    # one run leaves for the next reach traced and untraced alike
    for r, (variant, traced) in schedule(list(runs), repeats):
        fn = runs[(variant, traced)]
        if not traced:
            rows.append({"variant": variant, "traced": False, "repeat": r, **fn(False)})
            continue
        box = {}
        ev, path = capture(lambda: box.update(fn(True)), device=dev, out_dir=out, name=f"trace_{variant}_r{r}",
                           warmup=0)
        tables[variant].append(ev)
        paths[variant].append(path)
        rows.append({"variant": variant, "traced": True, "repeat": r, **box})
    walls = pd.DataFrame(rows)
    clock_samples = sampler.stop() if sampler is not None else None

    lw = walls[(walls.variant == "layerwise") & walls.traced].sort_values("wall_ms")
    kept = int(lw.iloc[(len(lw) - 1) // 2]["repeat"])

    say("copy ceiling: the whole cache in one copy, and one layer, each alone")
    # the device side of a staged send lands in pinned staging memory, so its copies are held against
    # the pinned path's ceiling (the host memcpy into pageable memory follows on a worker thread)
    ceil_t = Transport(layout, "pinned", dev, granularity="buffer") if getattr(sender, "mode", None) == "staged" else t
    # the first of each is a warm-up; timed as kvlab.handoff times its copies: the copy stream held while
    # the host queues the copy, the end event recorded right behind it (not after a host round trip)
    from .steps import time_copy, time_plain_copy

    n = max(repeats, 3) + 1
    bulk = [time_copy(ceil_t, src, dev) for _ in range(n)][1:]
    one = [time_plain_copy(ceil_t.stream, ceil_t.buffer.data[0], src.data[0], ceil_t.dest, dev) for _ in range(n)][1:]
    bulk_ms = float(pd.Series(bulk).median())
    layer_ms = float(pd.Series(one).median())
    name = getattr(getattr(model, "config", None), "name_or_path", "") or type(model).__name__
    return HandoffTrace(
        colocated=tables["colocated"][kept], layerwise=tables["layerwise"][kept], walls=walls, paths=paths,
        model=str(name), context=context, destination=t.label, transport=transport, device=str(dev),
        layers=layout.layers, bytes_per_layer=layout.bytes_per_layer, kv_bytes=layout.nbytes,
        ceiling_gbps=layout.nbytes / bulk_ms / 1e6 if bulk_ms > 0 else float("nan"),
        bulk_copy_ms=bulk_ms, layer_copy_ms=layer_ms, kept=kept,
        extra={"send_mode": getattr(sender, "mode", None), "hook_host_ms_last": send_hooks[True].host_ns / 1e6,
               "ceiling_destination": ceil_t.label, "clock_samples": clock_samples})


# ============================================================================== per-layer events


def event_table(kv_ready_ms, copy_start_ms, copy_end_ms, prefill_end_ms: float, bytes_per_layer: int):
    """A per-layer timeline from event times (ms from the request's start), without a profiler.

    kv_ready_ms[i]: when layer i's K and V were written (its signal's event on the compute stream);
    copy_start_ms[i] / copy_end_ms[i]: layer i's copy on the copy stream; prefill_end_ms: prefill's last
    op. Columns: layer, kv_ready_ms, compute_ms (since the previous layer's signal, or the start),
    copy_start_ms, copy_end_ms, lag_ms (copy start − signal: how long the copy waited), copy_ms, gbps
    (decimal), backlog_ms (copy end − the next layer's signal; for the last layer − prefill's end, i.e.
    the exposed tail; positive = the link is behind compute).
    Raises ValueError when the lists differ in length or are empty.
    """
    n = len(kv_ready_ms)
    if n == 0 or len(copy_start_ms) != n or len(copy_end_ms) != n:
        raise ValueError(f"event_table needs one time per layer in every list, got {n}, {len(copy_start_ms)} "
                         f"and {len(copy_end_ms)}")
    kv = np.asarray(kv_ready_ms, dtype=float)
    cs = np.asarray(copy_start_ms, dtype=float)
    ce = np.asarray(copy_end_ms, dtype=float)
    nxt = np.append(kv[1:], float(prefill_end_ms))
    copy = ce - cs
    return pd.DataFrame({
        "layer": np.arange(n), "kv_ready_ms": kv, "compute_ms": np.diff(np.concatenate(([0.0], kv))),
        "copy_start_ms": cs, "copy_end_ms": ce, "lag_ms": cs - kv, "copy_ms": copy,
        "gbps": np.where(copy > 0, bytes_per_layer / np.where(copy > 0, copy, 1) / 1e6, np.nan),
        "backlog_ms": ce - nxt,
    })


@dataclass
class EventTimeline:
    """The result of event_handoff: `rounds` (variant, round, prefill_ms, wall_ms: layer-wise sends with and
    without per-layer events, interleaved), `layers` (event_table of the median evented round),
    `overhead` (one row: untimed and evented medians, the paired median difference and its share),
    `prefill_end_ms`, `mode` (the send mode), `bytes_per_layer`."""

    rounds: pd.DataFrame
    layers: pd.DataFrame
    overhead: pd.DataFrame
    prefill_end_ms: float
    mode: str
    bytes_per_layer: int


def event_handoff(model, context: int, destination: str = "pinned", rounds: int = 9, warmup: int = 2,
                  device=None, seed: int = 0, progress=None) -> EventTimeline:
    """A per-layer timeline of a layer-wise handoff from CUDA events alone — no profiler, so it costs prefill
    next to nothing even at 1k tokens, where torch.profiler adds a quarter to most of prefill.

    One timing event per layer on the compute stream at the layer's signal (LayerHooks(clock=True)), and one
    before and after every layer's copy on the copy stream (the armed send records them in arm(), before
    the request). Rounds of the same send with and without the events run interleaved in counterbalanced
    order, so the overhead is measured, not assumed. GPU only (flag, staged or event mode); on a CPU the
    tables are empty. Staged (pageable) sends are shown up to the pinned staging buffer: the host memcpy
    that follows has no CUDA event.
    """
    import torch

    from .handoff import check_request
    from .steps import make_prompt, model_device, prefill_or_abort, time_layerwise_round, warm_prefill
    from .hooks import LayerHooks
    from .kvcache import KVBuffer, layout_for
    from .timing import median_ci, schedule, sync_device
    from .transfer import Transport

    if rounds < 1 or warmup < 0:
        raise ValueError(f"rounds must be ≥ 1 and warmup ≥ 0, got rounds={rounds}, warmup={warmup}")
    dev = torch.device(device) if device is not None else model_device(model)
    (dest,) = check_request(model, [context], [destination], dev)
    empty = EventTimeline(pd.DataFrame(columns=["variant", "round", "prefill_ms", "wall_ms"]),
                          pd.DataFrame(), pd.DataFrame(), float("nan"), "cpu", 0)
    if dev.type != "cuda":
        return empty
    say = progress or (lambda s: None)
    layout = layout_for(model, context)
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    ids = make_prompt(cfg.vocab_size, context, dev, seed)
    src = KVBuffer(layout, device=dev)
    t = Transport(layout, dest, dev, granularity="buffer")
    plain = t.layerwise(src)
    timed = t.layerwise(src, timeline=True)
    hooks_plain = LayerHooks(model, plain.on_layer, ranges=False)
    hooks_timed = LayerHooks(model, timed.on_layer, ranges=False, clock=True)
    # one prefill with nothing armed first: a model's first prefill behind an armed copy stream can hang
    # (see steps.warm_prefill; it did in this function's first GPU test)
    warm_prefill(model, ids, src)

    def run_timed() -> dict:
        hooks_timed.reset_counters()
        sync_device(dev)  # the last device sync before the request: never between arm() and prefill
        timed.arm()
        stream = torch.cuda.current_stream(dev)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with hooks_timed:
            a.record(stream)
            timed.begin()
            prefill_or_abort(model, ids, src, timed, hooks_timed)
            b.record(stream)
            landing = timed.finish()
        landing.wait()
        b.synchronize()
        end = [a.elapsed_time(e) for e in t._events]
        p = a.elapsed_time(b)
        return {"prefill_ms": p, "wall_ms": max(p, end[-1]),
                "kv": [a.elapsed_time(e) for e in hooks_timed.kv_events],
                "cs": [a.elapsed_time(e) for e in timed.copy_start], "ce": end}

    rows, kept = [], []
    say(f"{rounds} rounds of the layer-wise send to {dest.label}, with and without per-layer events")
    for k, variant in schedule(["plain", "events"], rounds, warmup):
        if variant == "plain":
            b = time_layerwise_round(model, ids, src, plain, hooks_plain, dev)
            out = {"prefill_ms": b["prefill"], "wall_ms": b["wall"]}
        else:
            out = run_timed()
        if k >= 0:
            rows.append({"variant": "layer-wise" if variant == "plain" else "layer-wise + events",
                         "round": k, "prefill_ms": out["prefill_ms"], "wall_ms": out["wall_ms"]})
            if variant == "events":
                kept.append(out)
    df = pd.DataFrame(rows)
    ev = df[df.variant == "layer-wise + events"].set_index("round").prefill_ms
    pl = df[df.variant == "layer-wise"].set_index("round").prefill_ms
    diff = (ev - pl).dropna()
    lo, hi = median_ci(diff)
    base = float(pl.median())
    overhead = pd.DataFrame([{"untimed_ms": base, "evented_ms": float(ev.median()), "extra_ms": float(diff.median()),
                              "extra_ci_lo_ms": lo, "extra_ci_hi_ms": hi, "overhead_pct": 100 * float(diff.median()) / base,
                              "rounds": len(diff)}])
    mid = sorted(kept, key=lambda o: o["prefill_ms"])[(len(kept) - 1) // 2]
    layers = event_table(mid["kv"], mid["cs"], mid["ce"], mid["prefill_ms"], layout.bytes_per_layer)
    mode = f"{timed.mode}, signal from the {hooks_timed.point}"
    del plain, timed, t, src
    return EventTimeline(df, layers, overhead, mid["prefill_ms"], mode, layout.bytes_per_layer)


# ============================================================================== CLI


def trace_main(argv: list[str] | None = None) -> int:
    """``kvlab trace``: take or read a timeline.

        kvlab trace nsys [--out DIR] [--name NAME] [--capture-range R] -- COMMAND …
        kvlab trace load FILE [--csv OUT]

    ``nsys`` profiles COMMAND with Nsight Systems (CUDA + NVTX, KVLAB_RANGES=1 for the child) and
    prints a summary of the loaded timeline; ``load`` reads a Kineto .json(.gz) or an nsys .sqlite
    and prints the same summary (``--csv`` also writes the events table). Returns the exit code:
    0 on success, 2 for bad input (the message says what is missing), 3 when nsys cannot be used.
    """
    import argparse

    argv = list(sys.argv[1:] if argv is None else argv)
    command = []
    if "--" in argv:
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(prog="kvlab trace", description=trace_main.__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    p_nsys = sub.add_parser("nsys", help="profile COMMAND (after --) with Nsight Systems")
    p_nsys.add_argument("--out", default="nsys-trace", help="output folder (default: ./nsys-trace)")
    p_nsys.add_argument("--name", default="nsys", help="report name inside --out")
    p_nsys.add_argument("--capture-range", default="cudaProfilerApi", choices=["cudaProfilerApi", "none"],
                        help="cudaProfilerApi: record inside kvlab.trace.profiler_range() only; none: all")
    p_load = sub.add_parser("load", help="read a Kineto .json(.gz) or nsys .sqlite and summarise it")
    p_load.add_argument("file")
    p_load.add_argument("--csv", default=None, help="also write the events table to this CSV")
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)

    try:
        if args.what == "nsys":
            if not command:
                print("kvlab trace nsys: error: give the command after --, e.g. "
                      "kvlab trace nsys -- python my_run.py", file=sys.stderr)
                return 2
            events, path = run_nsys(command, args.out, capture_range=args.capture_range, name=args.name)
            print(f"nsys export: {path}")
        else:
            events = load(args.file)
            if args.csv:
                events.to_csv(args.csv, index=False)
                print(f"events: {args.csv} ({len(events)} rows)")
    except NsysUnavailable as e:
        print(f"kvlab trace nsys: {e}", file=sys.stderr)
        return 3
    except (TraceError, FileNotFoundError) as e:
        print(f"kvlab trace {args.what}: error: {e}", file=sys.stderr)
        return 2
    _print_summary(events)
    return 0


def _print_summary(events: pd.DataFrame) -> None:
    span = (int(events.end_ns.max()) - int(events.start_ns.min())) / 1e6 if len(events) else 0.0
    print(f"{len(events)} events over {span:.3f} ms")
    with pd.option_context("display.width", 160, "display.max_columns", 20):
        print(summarize(events).to_string(index=False))
    layers = events.layer.dropna()
    if layers.empty:
        print("no kvlab/layer{i} or kvlab/send{i} ranges: run the hooks with ranges=True "
              "(or KVLAB_RANGES=1) to split the timeline by layer")
    else:
        print(f"layers {int(layers.min())}…{int(layers.max())} found in the hook ranges")
    if not events.kind.isin(GPU_KINDS).any():
        print("no GPU activity in this trace; run on a GPU for the timeline")
