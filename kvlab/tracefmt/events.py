"""The events table every trace reader gives: one row per event, times in integer nanoseconds.

Columns (EVENT_COLUMNS), the kinds, range attribution (`attribute_ranges`: which hook range a GPU row belongs
to), `make_table`, and the summaries a run folder keeps (`summarize`, `host_layers`). Readers: kvlab.tracefmt.kineto
(torch.profiler) and kvlab.tracefmt.nsys (Nsight Systems); kvlab.tracefmt.load reads either by content.
"""

from __future__ import annotations

import bisect
import re

import pandas as pd

__all__ = ["EVENT_COLUMNS", "KINDS", "GPU_KINDS", "COPY_KINDS", "RANGE_RE", "REGION", "TraceError", "make_table",
           "attribute_ranges", "summarize", "host_layers", "check_events"]

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
        raise TypeError(f"events must be the DataFrame from kvlab.tracefmt (capture / load_*), got {type(events).__name__}")
    missing = [c for c in EVENT_COLUMNS if c not in events.columns]
    if missing:
        raise TraceError(f"not a kvlab events table: columns {missing} are missing "
                         "(make it with kvlab.tracefmt.capture, load_kineto or load_nsys_sqlite)")
