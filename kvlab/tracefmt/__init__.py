"""Timeline formats: what the host and the GPU did during a region, as one tidy events table.

Seed 004 found layer-by-layer sending *worse* than one bulk copy at 32k tokens and could not say why;
it needed a timeline. This package makes one and reads it into a pandas table that the overlap
analysis (the overlap_timeline study's decomposition) works on, whichever tool recorded it:

    capture(fn)            torch.profiler (Kineto) around fn(): CPU ops, CUDA runtime calls, kernels,
                           memcpys, memsets and the hooks' ranges; exports a .json.gz Chrome/Perfetto
                           trace. This is the path that works everywhere (on our H200 too).
    load_kineto(path)      an existing Kineto trace (.json or .json.gz) from any recent torch.
    kvlab.tracefmt.nsys    Nsight Systems with CUDA + NVTX tracing, exported to SQLite and read back
                           (run_nsys, load_nsys_sqlite) — where nsys can make a report (on our H200 it
                           only writes a .qdstrm).

The experiments that take such timelines (trace_handoff, event_handoff) live in kvlab.studies.overlap_timeline;
`kvlab trace` (take or read a timeline, print its summary) is kvlab.tracefmt.command.

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

import os
from pathlib import Path

import pandas as pd

from .events import (COPY_KINDS, EVENT_COLUMNS, GPU_KINDS, KINDS, REGION, TraceError, attribute_ranges, check_events,
                     host_layers, make_table, summarize)
from .kineto import capture, load_kineto, native_stderr_muted, profiler_range
from .nsys import load_nsys_sqlite

__all__ = [
    "EVENT_COLUMNS", "KINDS", "GPU_KINDS", "COPY_KINDS", "REGION", "TraceError", "make_table", "attribute_ranges",
    "capture", "load", "load_kineto", "load_nsys_sqlite", "profiler_range", "native_stderr_muted",
    "summarize", "host_layers", "check_events",
]


def load(path: str | os.PathLike) -> pd.DataFrame:
    """Read any trace kvlab understands, by content: an nsys SQLite export or a Kineto .json(.gz)."""
    p = Path(path)
    if p.is_file():
        with open(p, "rb") as f:
            if f.read(16) == b"SQLite format 3\x00":
                return load_nsys_sqlite(p)
    if p.suffix in (".qdstrm", ".nsys-rep", ".qdrep"):
        raise TraceError(f"{p} is a raw Nsight Systems file; export it first (nsys export --type sqlite "
                         f"{p}) or, where nsys cannot make reports, trace with kvlab.tracefmt.capture")
    return load_kineto(p)
