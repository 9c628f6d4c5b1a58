"""Timeline formats: what the host and the GPU did during a region, as one tidy events table.

Seed 004 found layer-by-layer sending *worse* than one bulk copy at 32k tokens and could not say why;
it needed a timeline. This module makes one and reads it into a pandas table that the overlap
analysis (kvlab.overlap) works on, whichever tool recorded it:

    capture(fn)            torch.profiler (Kineto) around fn(): CPU ops, CUDA runtime calls, kernels,
                           memcpys, memsets and the hooks' ranges; exports a .json.gz Chrome/Perfetto
                           trace. This is the path that works everywhere (on our H200 too).
    load_kineto(path)      an existing Kineto trace (.json or .json.gz) from any recent torch.
    kvlab.nsys             Nsight Systems with CUDA + NVTX tracing, exported to SQLite and read back
                           (run_nsys, load_nsys_sqlite) — where nsys can make a report (on our H200 it
                           only writes a .qdstrm).

The experiments that take such timelines (trace_handoff, event_handoff) live in kvlab.trace.

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
import gzip
import json
import os
import re
import shutil
import tempfile
import zlib
from pathlib import Path

import pandas as pd

__all__ = [
    "EVENT_COLUMNS", "KINDS", "GPU_KINDS", "COPY_KINDS", "REGION", "TraceError", "make_table", "attribute_ranges",
    "capture", "load", "load_kineto", "profiler_range",
    "summarize", "host_layers", "check_events",
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


# ============================================================================== the events table


def make_table(rows: list[dict]) -> pd.DataFrame:
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


def attribute_ranges(rows: list[dict]) -> list[dict]:
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
        try:
            start, dur = _ns(e["ts"]), _ns(e["dur"])
        except (decimal.InvalidOperation, TypeError, ValueError):
            raise TraceError(f"{path}: event {str(e.get('name', ''))[:60]!r} has ts={e['ts']!r}, dur={e['dur']!r}; "
                             "a Kineto trace gives both as numbers of µs") from None
        if dur < 0:  # a broken trace: say so rather than clamp it to zero and draw a wrong timeline
            raise TraceError(f"{path}: event {str(e.get('name', ''))[:60]!r} has a negative duration "
                             f"(dur={e['dur']!r} µs); the trace is corrupt")
        end = start + dur
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
    return make_table(attribute_ranges(rows))


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


@contextlib.contextmanager
def native_stderr_muted():
    """Send what native code writes to file descriptor 2 to /dev/null inside the block: Kineto prints a
    "USDT: … profiler_start" line (and, on a CUDA build without a GPU, "gpuGetDeviceCount failed") at every
    start and stop, whatever KINETO_LOG_LEVEL says. Only the profiler's start and stop run inside it, so
    errors of the code being profiled still show. Python's sys.stderr is flushed first and left alone."""
    import sys

    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):
        yield
        return
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


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
    prof = profile(activities=activities, record_shapes=False, with_stack=False, profile_memory=False)
    with native_stderr_muted():  # Kineto's own "USDT: profiler_start" lines, CUPTI's device-count probe
        prof.__enter__()
    try:
        fn()
        sync()
    finally:
        with native_stderr_muted():
            prof.__exit__(None, None, None)
    # export plain JSON next to the target, then gzip it ourselves: older torch versions do not
    # compress on export, and the uncompressed file may be large
    plain = out / f".{name}.{os.getpid()}.json"
    prof.export_chrome_trace(str(plain))
    path = out / f"{name}.json.gz"
    _gzip_file(plain, path)
    plain.unlink()
    return load_kineto(path), path


# ============================================================================== Nsight Systems


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
                from .nsys import load_nsys_sqlite

                return load_nsys_sqlite(p)
    if p.suffix in (".qdstrm", ".nsys-rep", ".qdrep"):
        raise TraceError(f"{p} is a raw Nsight Systems file; export it first (nsys export --type sqlite "
                         f"{p}) or, where nsys cannot make reports, trace with kvlab.tracefmt.capture")
    return load_kineto(p)


# ============================================================================== summaries


def summarize(events: pd.DataFrame) -> pd.DataFrame:
    """A small table per (kind, device, stream): count, busy_ms (summed durations), span_ms (first
    start → last end), bytes, and GB/s (bytes / busy time) for copies. Host rows are grouped per kind
    only. This — not the raw trace — is what a run folder keeps."""
    check_events(events)
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
    check_events(events)
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


def check_events(events) -> None:
    if not isinstance(events, pd.DataFrame):
        raise TypeError(f"events must be the DataFrame from kvlab.trace (capture / load_*), got {type(events).__name__}")
    missing = [c for c in EVENT_COLUMNS if c not in events.columns]
    if missing:
        raise TraceError(f"not a kvlab events table: columns {missing} are missing "
                         "(make it with kvlab.tracefmt.capture, load_kineto or load_nsys_sqlite)")


# ============================================================================== the measured run


# ============================================================================== per-layer events


# ============================================================================== CLI

