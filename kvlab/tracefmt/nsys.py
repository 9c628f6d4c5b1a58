"""Nsight Systems: run a command under nsys (CUDA + NVTX tracing, exported to SQLite) and read the export into
kvlab.tracefmt's events table. On our H200s nsys writes a .qdstrm but cannot make a report, so torch.profiler
(kvlab.tracefmt.capture) is the working timeline there; this path is for machines where nsys works.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import sqlite3
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from .events import COPY_KINDS, TraceError, attribute_ranges, make_table

__all__ = ["NsysUnavailable", "NsysInfo", "nsys_available", "run_nsys", "load_nsys_sqlite"]


class NsysUnavailable(RuntimeError):
    """Nsight Systems is missing here or cannot turn a recording into a report."""


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
        try:
            tables = _tables(db)
        except sqlite3.DatabaseError as err:
            raise TraceError(f"{path} starts like an SQLite database but cannot be read ({err}): a truncated or "
                             "corrupt export; export it again with nsys export --type sqlite") from None
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
    return make_table(attribute_ranges(rows))


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
                                           "/usr/local/cuda*/; use kvlab.tracefmt.capture (torch.profiler)")
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
                    "report; use kvlab.tracefmt.capture (torch.profiler) instead")


def run_nsys(command, out_dir: str | os.PathLike, capture_range: str = "cudaProfilerApi",
             name: str = "nsys", trace: str = "cuda,nvtx", nsys: str | None = None,
             extra_args=(), timeout: float | None = None):
    """Profile ``command`` (a list of strings) with Nsight Systems and load the result.

    Runs ``nsys profile --trace=<trace> --capture-range=<capture_range> -o <out_dir>/<name>``, with
    KVLAB_RANGES=1 in the child's environment (so kvlab's hooks emit their NVTX ranges), then exports
    SQLite (``nsys export --type sqlite``, falling back to ``nsys stats``) and returns
    ``(events, sqlite_path)`` from load_nsys_sqlite. capture_range "cudaProfilerApi" records between
    torch.cuda.profiler.start() and stop() in the child (kvlab.tracefmt.profiler_range() does both);
    "none" records the whole run.

    Raises NsysUnavailable when nsys is missing, or when it leaves only a .qdstrm (it recorded but
    could not make a report) — the message says so and points at kvlab.tracefmt.capture.
    """
    if isinstance(command, str) or not command:
        raise ValueError(f"command must be a non-empty list of strings, e.g. ['python', 'run.py'], got {command!r}")
    if capture_range not in ("cudaProfilerApi", "none"):
        raise ValueError(f"capture_range {capture_range!r} is not valid; use 'cudaProfilerApi' (between "
                         "kvlab.tracefmt.profiler_range() / torch.cuda.profiler.start() and stop()) or 'none'")
    path = nsys or _find_nsys()
    if path is None:
        raise NsysUnavailable("Nsight Systems (nsys) is not installed here (not on PATH, nor under "
                              "/opt/nvidia/nsight-*/): trace with torch.profiler instead — "
                              "kvlab.tracefmt.capture(fn), which needs nothing else")
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
                f"kvlab.tracefmt.capture(fn). nsys said:\n{tail}")
        raise NsysUnavailable(f"nsys profile exited with {proc.returncode} and wrote no report "
                              f"({stem}.nsys-rep). Use kvlab.tracefmt.capture (torch.profiler). nsys said:\n{tail}")
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
                              f"{exp.returncode}: {exp.stderr.strip()[-300:]}); use kvlab.tracefmt.capture")
    return load_nsys_sqlite(sqlite_path), sqlite_path
