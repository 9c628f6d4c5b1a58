"""torch.profiler (Kineto) timelines: record one around a function (`capture`) or read one (`load_kineto`) into
kvlab's events table (kvlab.tracefmt.events). This is the path that works everywhere (on our H200 too)."""

from __future__ import annotations

import contextlib
import decimal
import gzip
import json
import os
import re
import reprlib
import shutil
import stat
import tempfile
import zlib
from pathlib import Path

import pandas as pd

from .events import COPY_KINDS, GPU_KINDS, TraceError, attribute_ranges, make_table

__all__ = ["load_kineto", "parse_kineto", "capture", "profiler_range", "native_stderr_muted"]

# ============================================================================== Kineto traces

_KINETO_KIND = {
    "kernel": "kernel", "gpu_memcpy": "memcpy", "memcpy": "memcpy", "gpu_memset": "memset",
    "memset": "memset", "cpu_op": "cpu_op", "operator": "cpu_op", "cuda_runtime": "runtime",
    "cuda_driver": "runtime", "runtime": "runtime", "user_annotation": "range",
    "gpu_user_annotation": "range",
}
_MEMCPY_NAME_RE = re.compile(r"^Memcpy\s+([A-Za-z]to[A-Za-z])\b")


# a trace kvlab reads at most this many bytes, compressed or not (a 32k prefill's Kineto export is a few hundred
# MB; a gzip bomb of 1 MB would otherwise inflate to tens of GB); KVLAB_MAX_TRACE_BYTES raises it
MAX_TRACE_BYTES = 4 << 30


def _max_bytes() -> int:
    raw = os.environ.get("KVLAB_MAX_TRACE_BYTES", "").strip()
    if not raw:
        return MAX_TRACE_BYTES
    try:
        n = int(raw)
    except ValueError:
        raise TraceError(f"KVLAB_MAX_TRACE_BYTES = {raw!r}: give a number of bytes > 0") from None
    if n <= 0:
        raise TraceError(f"KVLAB_MAX_TRACE_BYTES = {raw!r}: give a number of bytes > 0")
    return n


def _read_bytes(path: Path) -> bytes:
    """The trace's bytes, gunzipped as they stream in: only a regular file (a FIFO or a device would block or never
    end), and at most MAX_TRACE_BYTES of it before or after decompression."""
    if not path.exists():
        raise FileNotFoundError(f"no trace at {path}")
    if path.is_dir():
        raise TraceError(f"{path} is a directory, not a trace file")
    if not stat.S_ISREG(path.stat().st_mode):
        raise TraceError(f"{path} is not a regular file (a pipe, a device or a socket): give a trace file")
    limit = _max_bytes()
    if path.stat().st_size > limit:
        raise TraceError(f"{path} is {path.stat().st_size:,} bytes; kvlab reads traces of at most {limit:,} "
                         "(KVLAB_MAX_TRACE_BYTES raises it)")
    with open(path, "rb") as f:
        raw = f.read(limit + 1)
    if raw[:2] != b"\x1f\x8b":
        return raw
    out, d = bytearray(), zlib.decompressobj(16 + zlib.MAX_WBITS)
    data = raw
    try:
        while data:
            out += d.decompress(data, limit + 1 - len(out))
            if len(out) > limit:
                raise TraceError(f"{path} inflates to more than {limit:,} bytes; kvlab stops there "
                                 "(KVLAB_MAX_TRACE_BYTES raises it)")
            data = d.unconsumed_tail
            if d.eof:
                break
    except zlib.error as e:
        raise TraceError(f"{path} looks gzip-compressed but cannot be read: {e}") from None
    if not d.eof:
        raise TraceError(f"{path} is truncated: the gzip stream ends before its end marker "
                         "(was the trace still being written?)")
    return bytes(out)


_NS_LIMIT = 2 ** 63 // 2  # a time in ns whose sums still fit the table's int64 columns


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
    return parse_kineto(_read_bytes(path), path)


def parse_kineto(raw: bytes, path: str | os.PathLike = "the trace") -> pd.DataFrame:
    """`load_kineto` of a trace's (uncompressed) bytes already in memory; `path` names it in errors."""
    text = raw.decode("utf-8", errors="replace")
    head = text.lstrip()[:1]
    if head not in ("{", "["):
        raise TraceError(f"{path} is not a Kineto/Chrome trace: it is not JSON "
                         f"(starts with {text[:20]!r}); expected a .json or .json.gz from torch.profiler")
    try:
        doc = json.loads(text, parse_float=decimal.Decimal)
    except RecursionError:
        raise TraceError(f"{path} is not a Kineto/Chrome trace: its JSON nests too deep to read") from None
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
        args = e.get("args") if isinstance(e.get("args"), dict) else {}
        try:
            start, dur = _ns(e["ts"]), _ns(e["dur"])
        except (decimal.InvalidOperation, TypeError, ValueError, OverflowError):
            raise TraceError(f"{path}: event {str(e.get('name', ''))[:60]!r} has ts={reprlib.repr(e['ts'])}, "
                             f"dur={reprlib.repr(e['dur'])}; a Kineto trace gives both as numbers of µs") from None
        if not (abs(start) < _NS_LIMIT and abs(dur) < _NS_LIMIT):
            raise TraceError(f"{path}: event {str(e.get('name', ''))[:60]!r} has ts={reprlib.repr(e['ts'])} µs, "
                             f"dur={reprlib.repr(e['dur'])} µs: beyond any clock (at most about 292 years in ns)")
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
