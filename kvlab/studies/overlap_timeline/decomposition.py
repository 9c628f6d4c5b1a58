"""Why a layer-wise handoff costs what it costs: two timelines of the same prefill, compared op by op.

Input: the events tables (kvlab.tracefmt, as this package's trace.trace_handoff takes them) of a
colocated prefill and of a layer-wise prefill + send of the same model and prompt. The model is deterministic, so both runs launch the same kernels in the
same order on their compute stream; matching them one-to-one shows where the layer-wise run lost
time. With the compute stream's ops numbered k = 0 … n−1 (kernels, and any memset / memcpy that
prefill itself issues on that stream), each run's wall time is exactly

    wall = Σ_k dur_k  +  Σ_k gap_k  +  tail

    dur_k   how long op k ran
    gap_k   idle time on the compute stream before op k (start_k − end_{k−1}): the GPU waiting for
            the host to launch the next kernel, or for an event
    tail    the exposed tail: how long the last copy ran on after the last compute op (0 colocated)

measured from the first compute op. Hence

    Δwall = Σ Δdur (ops that overlapped a copy)  +  Σ Δdur (ops that did not)  +  Δ Σ gap  +  Δ tail

When the walls are measured independently of the trace (CUDA events around the region, as
trace.trace_handoff does), they also hold the lead-in — host work between the start event and
prefill's first kernel (arming copies, the first hooks); trace_handoff marks the region with a
kvlab/region range so its Δ is a term of its own. Whatever the measured Δwall holds beyond all these
terms is reported as the unexplained remainder.

Copies: memcpy records (on any stream other than the compute stream, or launched from a send range)
ran on a copy engine; copy kernels (names with "copy" / "elementwise" on a non-compute stream, or
launched from a send range) ran on SMs, competing with prefill's kernels for SM time as well as HBM.
On one H200, same-GPU device→device copies slowed concurrent GEMMs by half while device→host copies
did not (docs/REFERENCE.md) — the "stretch inside copy windows" term measures that directly.

Every timestamp and duration in the tables here is in ns (``_ns``) unless the column says ``_ms``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from ...tracefmt import GPU_KINDS, REGION, TraceError, check_events

__all__ = ["NO_GPU_MESSAGE", "NoGPUActivity", "has_gpu_activity", "compute_stream", "copies", "compute_ops",
           "layer_table", "match_kernels", "Decomposition", "decompose", "clock_on_trace", "mean_clock", "on_stream",
           "CLOCK_TERM", "TERMS"]

NO_GPU_MESSAGE = "no GPU activity in this trace; run on a GPU for the timeline"
_COPY_KERNEL_RE = re.compile(r"copy|elementwise|memcpy", re.IGNORECASE)
_ENGINE_OF_KIND = {"memcpy": "copy engine", "kernel": "SM"}


class NoGPUActivity(TraceError):
    """The trace holds no kernels / memcpys (a CPU run): there is no GPU timeline to analyse."""

    def __init__(self, message: str = NO_GPU_MESSAGE):
        super().__init__(message)


def has_gpu_activity(events: pd.DataFrame) -> bool:
    """True when the trace holds at least one kernel, memcpy or memset."""
    check_events(events)
    return bool(events.kind.isin(GPU_KINDS).any())


def _need_gpu(events: pd.DataFrame, what: str) -> None:
    if not has_gpu_activity(events):
        raise NoGPUActivity(f"{NO_GPU_MESSAGE} ({what} has only host events)")


def compute_stream(events: pd.DataFrame) -> tuple[int, int]:
    """(device, stream) on which kernels ran longest: prefill's stream."""
    _need_gpu(events, "this trace")
    k = events[events.kind == "kernel"]
    if k.empty:
        raise NoGPUActivity("this trace has GPU copies but no kernels: it cannot show prefill's compute stream")
    busy = k.groupby(["device", "stream"]).dur_ns.sum()
    dev, stream = busy.idxmax()
    return int(dev), int(stream)


def on_stream(events: pd.DataFrame, lane: tuple[int, int]) -> pd.Series:
    return (events.device == lane[0]).fillna(False) & (events.stream == lane[1]).fillna(False)


def _n_layers(events: pd.DataFrame) -> int | None:
    layers = events.layer.dropna()
    return int(layers.max()) + 1 if len(layers) else None


def _send_ranges(events: pd.DataFrame) -> pd.DataFrame:
    """Host-side kvlab/send{i} ranges, one row per layer (the first if a layer has several)."""
    r = events[(events.kind == "range") & events.stream.isna()
               & events.name.astype(str).str.startswith("kvlab/send")]
    return r.sort_values("start_ns").drop_duplicates("layer").set_index("layer")


def _has_layer_ranges(events: pd.DataFrame) -> bool:
    return bool(((events.kind == "range") & events.name.astype(str).str.startswith("kvlab/layer")).any())


def copies(events: pd.DataFrame, compute: tuple[int, int] | None = None,
           layers: int | None = None) -> pd.DataFrame:
    """The transfers of a run: one row per memcpy or copy kernel, with the engine that moved it.

    Selected: memcpys not on the compute stream, memcpys launched inside a kvlab/send range, and
    kernels on another stream that were launched inside a send range or are named like a copy.
    Columns: the events columns plus ``engine`` ("copy engine" for memcpy records, "SM" for copy
    kernels) and ``layer_source`` ("range": from the send range; "order": the copies carry no range —
    copies armed before prefill (kvlab.transfer's "flag" mode) or issued by a worker thread (pageable
    host) — so the k-th of n·layers copies belongs to layer k // n, since every mode issues layers in
    order; "none").
    """
    check_events(events)
    if not has_gpu_activity(events):
        return events.iloc[0:0].assign(engine=pd.Series(dtype=object), layer_source=pd.Series(dtype=object))
    cs = compute or compute_stream(events)
    on_cs = on_stream(events, cs)
    in_send = events.range_name.astype(str).str.startswith("kvlab/send")
    memcpy = (events.kind == "memcpy") & (~on_cs | in_send)
    kern = (events.kind == "kernel") & ~on_cs & (in_send | events.name.astype(str).str.contains(_COPY_KERNEL_RE))
    out = events[memcpy | kern].sort_values("start_ns").copy()
    out["engine"] = out.kind.map(_ENGINE_OF_KIND)
    out["layer_source"] = np.where(out.layer.notna(), "range", "none").astype(object)
    n_layers = layers or _n_layers(events)
    missing = out.layer.isna()
    if missing.all() and n_layers and len(out) and len(out) % n_layers == 0:
        per = len(out) // n_layers
        out["layer"] = pd.array(np.arange(len(out)) // per, dtype="Int64")
        out["layer_source"] = "order"
    return out


def compute_ops(events: pd.DataFrame, compute: tuple[int, int] | None = None) -> pd.DataFrame:
    """Prefill's ops on the compute stream, in order, with ``layer`` and ``segment`` set.

    layer: from the enclosing kvlab/layer{i} range of the launching call; without layer ranges but
    with send ranges, op k belongs to layer i when it was launched after send{i−1} began and before
    send{i} began (so layer i−1's MLP counts towards layer i, and what follows the last send — the
    last layer's MLP, the final norm, the LM head — is "post"). segment: "layer i", or "pre" / "post"
    for ops before the first / after the last layer (embedding; final norm and LM head).
    Raises NoGPUActivity for a CPU trace.
    """
    _need_gpu(events, "this trace")
    cs = compute or compute_stream(events)
    ops = events[on_stream(events, cs) & events.kind.isin(GPU_KINDS)].sort_values("start_ns").copy()
    if not _has_layer_ranges(events):
        sends = _send_ranges(events)
        if len(sends) and ops.launch_ns.notna().any():
            starts = sends.start_ns.to_numpy()
            launched = ops.launch_ns.astype("float64").to_numpy()
            idx = np.searchsorted(starts, launched, side="right")
            layer = np.where(np.isnan(launched), np.nan, idx).astype("float64")
            layer[layer >= len(starts)] = np.nan  # after the last send began: the head
            ops["layer"] = pd.array(np.where(np.isnan(layer), None, layer), dtype="Int64")
        else:
            ops["layer"] = pd.array([pd.NA] * len(ops), dtype="Int64")
    ops["segment"] = _segments(ops.layer)
    return ops.reset_index(drop=True)


def _segments(layer: pd.Series) -> pd.Series:
    lay = layer.astype("Float64")
    seg = pd.Series(["layer " + str(int(x)) if pd.notna(x) else None for x in lay], index=layer.index,
                    dtype=object)
    known = np.flatnonzero(lay.notna().to_numpy())
    if len(known):
        first, last = known[0], known[-1]
        pos = np.arange(len(seg))
        seg[(pos < first) & seg.isna().to_numpy()] = "pre"
        seg[(pos > last) & seg.isna().to_numpy()] = "post"
        seg[seg.isna()] = "between"
    else:
        seg[:] = "unassigned"
    return seg


def _need_ranges(events: pd.DataFrame, what: str) -> None:
    if not events.range_name.notna().any():
        raise TraceError(f"{what} has no kvlab/layer{{i}} or kvlab/send{{i}} ranges: trace it with "
                         "LayerHooks(model, ..., ranges=True) (or KVLAB_RANGES=1 under nsys) so its "
                         "kernels can be assigned to layers")


def _intervals_overlap(starts, ends, qs, qe) -> np.ndarray:
    """For each query interval [qs, qe), the time it overlaps the union of [starts, ends)."""
    if len(starts) == 0:
        return np.zeros(len(qs), dtype=np.int64)
    order = np.argsort(starts)
    s, e = np.asarray(starts)[order], np.asarray(ends)[order]
    merged = []
    for a, b in zip(s, e):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    ms = np.array([m[0] for m in merged])
    me = np.array([m[1] for m in merged])
    out = np.zeros(len(qs), dtype=np.int64)
    for k, (a, b) in enumerate(zip(qs, qe)):
        lo = max(np.searchsorted(me, a, side="right"), 0)
        hi = np.searchsorted(ms, b, side="left")
        total = 0
        for j in range(lo, hi):
            total += max(0, min(b, me[j]) - max(a, ms[j]))
        out[k] = total
    return out


def layer_table(events: pd.DataFrame, compute: tuple[int, int] | None = None,
                ceiling_gbps: float | None = None, ops: pd.DataFrame | None = None,
                copy_rows: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per layer of a layer-wise run: its compute window and its copy.

    Columns (ns unless named otherwise):
      layer, kernels (ops in the window), compute_start_ns / compute_end_ns (first op start, last op
      end), compute_ns (window length), last_attn_end_ns (end of the last op launched before the
      layer's send hook ran: its attention), copy_start_ns / copy_end_ns, copy_busy_ns (summed copy
      durations), copy_bytes, copy_gbps (bytes / busy time, decimal GB/s), ceiling_gbps,
      pct_ceiling, start_lag_ns (copy start − last_attn_end: how long the copy waited after its data
      was ready), backlog_ns (copy end − compute end: how far the link trails the layer), engine.
    Raises TraceError when the trace has no hook ranges, NoGPUActivity for a CPU trace.
    """
    _need_gpu(events, "this trace")
    _need_ranges(events, "this trace")
    cs = compute or compute_stream(events)
    ops = ops if ops is not None else compute_ops(events, cs)
    cp = copy_rows if copy_rows is not None else copies(events, cs)
    sends = _send_ranges(events)
    layers = sorted(set(int(x) for x in ops.layer.dropna()) | set(int(x) for x in cp.layer.dropna()))
    rows = []
    for i in layers:
        o = ops[ops.layer == i]
        c = cp[cp.layer == i]
        row = {"layer": i, "kernels": len(o)}
        row["compute_start_ns"] = int(o.start_ns.min()) if len(o) else pd.NA
        row["compute_end_ns"] = int(o.end_ns.max()) if len(o) else pd.NA
        row["compute_ns"] = row["compute_end_ns"] - row["compute_start_ns"] if len(o) else pd.NA
        last_attn = pd.NA
        if i in sends.index and len(o) and o.launch_ns.notna().any():
            before = o[o.launch_ns < int(sends.loc[i, "start_ns"])]
            if len(before):
                last_attn = int(before.end_ns.max())
        row["last_attn_end_ns"] = last_attn
        if len(c):
            busy = int(c.dur_ns.sum())
            nbytes = int(c.bytes.sum()) if c.bytes.notna().any() else pd.NA
            row.update(copy_start_ns=int(c.start_ns.min()), copy_end_ns=int(c.end_ns.max()), copy_busy_ns=busy,
                       copy_bytes=nbytes,
                       copy_gbps=(nbytes / busy) if nbytes is not pd.NA and busy > 0 else np.nan,
                       engine=", ".join(sorted(set(c.engine))))
        else:
            row.update(copy_start_ns=pd.NA, copy_end_ns=pd.NA, copy_busy_ns=pd.NA, copy_bytes=pd.NA,
                       copy_gbps=np.nan, engine=None)
        rows.append(row)
    df = pd.DataFrame(rows, columns=["layer", "kernels", "compute_start_ns", "compute_end_ns", "compute_ns",
                                     "last_attn_end_ns", "copy_start_ns", "copy_end_ns", "copy_busy_ns",
                                     "copy_bytes", "copy_gbps", "engine"])
    for col in ("compute_start_ns", "compute_end_ns", "compute_ns", "last_attn_end_ns", "copy_start_ns",
                "copy_end_ns", "copy_busy_ns", "copy_bytes"):
        df[col] = pd.array(df[col], dtype="Int64")
    df["copy_gbps"] = df.copy_gbps.astype(float)
    df["ceiling_gbps"] = float(ceiling_gbps) if ceiling_gbps else np.nan
    df["pct_ceiling"] = 100 * df.copy_gbps / df.ceiling_gbps
    df["start_lag_ns"] = df.copy_start_ns - df.last_attn_end_ns
    df["backlog_ns"] = df.copy_end_ns - df.compute_end_ns
    return df


def _first_difference(a: list[str], b: list[str]) -> str:
    for k, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"first difference at op {k}: {x[:80]!r} vs {y[:80]!r}"
    return f"the first {min(len(a), len(b))} ops agree, then one run has {abs(len(a) - len(b))} more"


def match_kernels(colocated: pd.DataFrame, layerwise: pd.DataFrame,
                  compute_co: tuple[int, int] | None = None,
                  compute_lw: tuple[int, int] | None = None) -> pd.DataFrame:
    """Match the compute-stream ops of the two runs one-to-one by order and compare them.

    Raises TraceError when the sequences differ (count or any name): the runs did not run the same
    model and prompt, or something else launched work on prefill's stream. Columns: k, name, kind,
    layer, segment (from the layer-wise run, else the colocated one), start_co_ns, dur_co_ns,
    gap_co_ns, start_lw_ns, dur_lw_ns, gap_lw_ns (idle before the op; 0 for the first),
    delta_ns (dur_lw − dur_co), delta_gap_ns, overlap_ns (time the layer-wise op overlapped copies),
    inside_copy (overlap_ns > 0), stretch (dur_lw / dur_co).
    """
    _need_gpu(colocated, "the colocated trace")
    _need_gpu(layerwise, "the layer-wise trace")
    cs_co = compute_co or compute_stream(colocated)
    cs_lw = compute_lw or compute_stream(layerwise)
    co = compute_ops(colocated, cs_co)
    lw = compute_ops(layerwise, cs_lw)
    names_co, names_lw = co.name.astype(str).tolist(), lw.name.astype(str).tolist()
    if names_co != names_lw:
        raise TraceError(
            f"the colocated and layer-wise runs did not launch the same ops on their compute streams "
            f"({len(names_co)} vs {len(names_lw)} ops; {_first_difference(names_co, names_lw)}): compare "
            "two runs of the same model, prompt and dtype")
    cp = copies(layerwise, cs_lw)
    overlap = _intervals_overlap(cp.start_ns.to_numpy(dtype=np.int64), cp.end_ns.to_numpy(dtype=np.int64),
                                 lw.start_ns.to_numpy(dtype=np.int64), lw.end_ns.to_numpy(dtype=np.int64))
    use_lw = lw.layer.notna().any()
    layer = lw.layer if use_lw else co.layer
    segment = lw.segment if use_lw else co.segment

    def gaps(ops):
        g = ops.start_ns.to_numpy(dtype=np.int64) - np.concatenate(([ops.start_ns.iloc[0]],
                                                                    ops.end_ns.to_numpy(dtype=np.int64)[:-1]))
        return g

    out = pd.DataFrame({
        "k": np.arange(len(co)), "name": co.name.to_numpy(), "kind": co.kind.to_numpy(),
        "layer": pd.array(layer.to_numpy(), dtype="Int64"), "segment": segment.to_numpy(),
        "start_co_ns": co.start_ns.to_numpy(dtype=np.int64), "dur_co_ns": co.dur_ns.to_numpy(dtype=np.int64),
        "gap_co_ns": gaps(co),
        "start_lw_ns": lw.start_ns.to_numpy(dtype=np.int64), "dur_lw_ns": lw.dur_ns.to_numpy(dtype=np.int64),
        "gap_lw_ns": gaps(lw),
    })
    out["delta_ns"] = out.dur_lw_ns - out.dur_co_ns
    out["delta_gap_ns"] = out.gap_lw_ns - out.gap_co_ns
    out["overlap_ns"] = overlap
    out["inside_copy"] = out.overlap_ns > 0
    out["stretch"] = np.where(out.dur_co_ns > 0, out.dur_lw_ns / out.dur_co_ns.where(out.dur_co_ns > 0, 1), np.nan)
    return out


CLOCK_TERM = "kernels slowed by a lower SM clock (NVML)"


@dataclass
class Decomposition:
    """The result of decompose(). Tables in ns unless a column says _ms.

    totals: wall_co_ns, wall_lw_ns, wall_source ("measured": walls passed in, e.g. CUDA events around
        the traced region; "trace": first compute op → last compute op or copy end), delta_wall_ns,
        kernel_inside_ns, kernel_outside_ns (Σ Δdur of ops that did / did not overlap a copy),
        copy_cost_ns (kernel_inside_ns less the run-wide drift: drift_rate = kernel_outside_ns / the
        colocated time of the ops outside windows, applied to kernel_time_inside_ns, the colocated time of
        the ops inside) — what the copies cost the kernels they overlapped,
        idle_ns (Δ Σ gap), tail_ns (Δ exposed tail), lead_ns (Δ lead-in: region start → first compute
        op; measured walls and kvlab/region ranges only, else 0), explained_ns, remainder_ns,
        explained_frac (1 − |remainder| / |Δwall|), plus counts and median stretches.
    segments: one row per segment ("lead-in", "pre", "layer 0" …, "post", "tail") with the Δ terms
        in ms (kernel_inside_ms, kernel_outside_ms, idle_ms, tail_ms, lead_ms, total_ms).
    layers: layer_table() of the layer-wise run, with the colocated compute windows beside it.
    kernels: match_kernels(); copies: copies() of the layer-wise run.
    """

    totals: dict
    segments: pd.DataFrame
    layers: pd.DataFrame
    kernels: pd.DataFrame
    copies: pd.DataFrame
    ceiling_gbps: float | None = None
    notes: list = field(default_factory=list)

    def summary(self) -> pd.DataFrame:
        """The decomposition as a small table: term, ms, share of Δwall (%)."""
        t = self.totals
        d = t["delta_wall_ns"]
        rows = [("Δwall", d)] + [(words, t[key]) for term, words, _, key in TERMS
                                  if term != "clock" or t.get("clock_term")]
        return pd.DataFrame([{"term": name, "ms": ns / 1e6, "pct_of_delta": 100 * ns / d if d else np.nan}
                             for name, ns in rows])


def clock_on_trace(samples: pd.DataFrame, gpu: int, t0_ns: int, events: pd.DataFrame) -> pd.DataFrame:
    """NVML samples of one GPU (kvlab.clocks.Sampler) placed on one traced run's time axis: `trace_ns` =
    the kvlab/region range's start in the trace + (sample time − t0_ns), where t0_ns is the host time at
    which that run's start event was recorded (trace_handoff's walls.t0_ns) — the region range opens at the
    same host moment. Columns: trace_ns, sm_mhz, power_w. Empty when the trace has no region range."""
    r = events[(events.kind == "range") & (events.name == REGION) & events.stream.isna()]
    s = samples[samples.gpu == gpu]
    if not len(r) or not len(s):
        return pd.DataFrame(columns=["trace_ns", "sm_mhz", "power_w"])
    base = int(r.start_ns.min())
    return pd.DataFrame({"trace_ns": base + (s.t_ns.to_numpy(dtype=np.int64) - int(t0_ns)),
                         "sm_mhz": s.sm_mhz.to_numpy(dtype=float), "power_w": s.power_w.to_numpy(dtype=float)})


def mean_clock(clock: pd.DataFrame, start_ns: int, end_ns: int) -> float:
    """Time-weighted mean SM clock over [start_ns, end_ns] of a run's trace axis, each reading held until the
    next (NVML refreshes its reading about every 100 ms on our H200s, so a reading is a period's value).
    NaN without samples."""
    c = clock.sort_values("trace_ns")
    t, f = c.trace_ns.to_numpy(dtype=float), c.sm_mhz.to_numpy(dtype=float)
    if not len(t) or end_ns <= start_ns:
        return float("nan")
    edges = np.clip(np.concatenate((t, [np.inf])), start_ns, end_ns)
    weights = np.diff(edges)  # how long reading i was in force inside the window
    weights[0] += max(0.0, float(t[0]) - start_ns)  # before the first reading, that reading stands in
    return float(np.sum(weights * f) / np.sum(weights)) if np.sum(weights) > 0 else float(f[-1])


def decompose(colocated: pd.DataFrame, layerwise: pd.DataFrame, *, ceiling_gbps: float | None = None,
              wall_co_ns: int | None = None, wall_lw_ns: int | None = None,
              compute_co: tuple[int, int] | None = None,
              compute_lw: tuple[int, int] | None = None,
              clock_co: pd.DataFrame | None = None, clock_lw: pd.DataFrame | None = None) -> Decomposition:
    """Decompose the layer-wise run's extra wall time into kernel stretch (inside / outside copy
    windows), idle gaps and exposed tail, per layer and in total (see the module docstring).

    colocated, layerwise: events tables of one run each (kvlab.tracefmt). ceiling_gbps: the link's
    ceiling on the same path (bytes / time of one bulk copy), to put each layer's copy rate beside.
    wall_co_ns, wall_lw_ns: wall times measured outside the trace (both or neither); without them the
    walls come from the trace itself and the remainder only shows what the matching missed.
    clock_co, clock_lw: the prefill GPU's SM clock on each run's trace axis (clock_on_trace; both or
    neither). With them each matched kernel's stretch is split into what the run's lower clock predicts —
    dur_co × (f_co / f_lw − 1), kernel time taken ∝ 1 / SM clock, f the time-weighted mean clock over each
    run's compute span (mean_clock; NVML's readings last ~100 ms, too coarse to give one kernel its own) —
    and the rest; totals gain clock_ns (Σ over all kernels), clock_inside_ns, clock_outside_ns, sm_mhz_co and
    sm_mhz_lw, and kernel_inside_ns / kernel_outside_ns become the stretch *beyond* the clock (the sum is
    unchanged).
    Raises NoGPUActivity (CPU traces), TraceError (no hook ranges in the layer-wise run, different
    op sequences).
    """
    _need_gpu(colocated, "the colocated trace")
    _need_gpu(layerwise, "the layer-wise trace")
    _need_ranges(layerwise, "the layer-wise trace")
    if (wall_co_ns is None) != (wall_lw_ns is None):
        raise ValueError("give both wall_co_ns and wall_lw_ns (measured walls of the two runs), or neither")
    cs_co = compute_co or compute_stream(colocated)
    cs_lw = compute_lw or compute_stream(layerwise)
    kern = match_kernels(colocated, layerwise, cs_co, cs_lw)
    cp_lw = copies(layerwise, cs_lw)
    cp_co = copies(colocated, cs_co)
    ops_lw = compute_ops(layerwise, cs_lw)
    ops_co = compute_ops(colocated, cs_co)
    if ops_lw.layer.isna().all():
        raise TraceError(
            "the layer-wise trace has kvlab ranges, but none of its compute kernels falls inside one: the "
            "runtime calls that launched them ran on other threads than the ranges, or outside them, and no "
            "GPU-side range (Kineto's gpu_user_annotation) covers them; check the trace's 'thread' and "
            "'launch_ns' columns for the kernels")

    def lead_in(events, ops):
        r = events[(events.kind == "range") & (events.name == REGION) & events.stream.isna()]
        return int(ops.start_ns.min()) - int(r.start_ns.min()) if len(r) else None

    def span(ops, cp):
        first = int(ops.start_ns.min())
        last_compute = int(ops.end_ns.max())
        last_copy = int(cp.end_ns.max()) if len(cp) else last_compute
        tail = max(0, last_copy - last_compute)
        return first, last_compute, tail, last_compute + tail - first

    _, end_co, tail_co, trace_wall_co = span(ops_co, cp_co)
    _, end_lw, tail_lw, trace_wall_lw = span(ops_lw, cp_lw)
    measured = wall_co_ns is not None
    wall_co = int(wall_co_ns) if measured else trace_wall_co
    wall_lw = int(wall_lw_ns) if measured else trace_wall_lw
    if (clock_co is None) != (clock_lw is None):
        raise ValueError("give both clock_co and clock_lw (the SM clock on each run's trace), or neither")
    with_clock = clock_co is not None and len(clock_co) > 0 and len(clock_lw) > 0
    f_co = f_lw = float("nan")
    if with_clock:
        # one mean clock per run over its compute span: NVML's ~100 ms readings cannot place a single kernel
        f_co = mean_clock(clock_co, int(kern.start_co_ns.min()), int((kern.start_co_ns + kern.dur_co_ns).max()))
        f_lw = mean_clock(clock_lw, int(kern.start_lw_ns.min()), int((kern.start_lw_ns + kern.dur_lw_ns).max()))
        with_clock = bool(np.isfinite(f_co) and np.isfinite(f_lw) and f_lw > 0)
    if with_clock:
        kern["clock_ns"] = kern.dur_co_ns.to_numpy() * (f_co / f_lw - 1)
    else:
        kern["clock_ns"] = 0.0
    clock_in = float(kern.clock_ns[kern.inside_copy].sum())
    clock_out = float(kern.clock_ns[~kern.inside_copy].sum())
    inside = int(round(kern.delta_ns[kern.inside_copy].sum() - clock_in))
    outside = int(round(kern.delta_ns[~kern.inside_copy].sum() - clock_out))
    clock = int(round(clock_in + clock_out))
    idle = int(kern.delta_gap_ns.sum())
    tail = tail_lw - tail_co
    lead_co, lead_lw = lead_in(colocated, ops_co), lead_in(layerwise, ops_lw)
    # trace-derived walls start at the first compute op, so only measured walls hold a lead-in
    lead = lead_lw - lead_co if measured and lead_co is not None and lead_lw is not None else 0
    delta = wall_lw - wall_co
    explained = clock + inside + outside + idle + tail + lead
    remainder = delta - explained
    frac = 1 - abs(remainder) / abs(delta) if delta != 0 else (1.0 if remainder == 0 else 0.0)

    # the copies' own cost: kernels inside copy windows also carry whatever slowed the whole run (clocks
    # drift by several ms at 16k between runs), so take off the stretch rate seen outside the windows
    # (with a clock, both terms are already net of what the clock explains)
    dur_in = int(kern.dur_co_ns[kern.inside_copy].sum())
    dur_out = int(kern.dur_co_ns[~kern.inside_copy].sum())
    drift_rate = outside / dur_out if dur_out else 0.0
    copy_cost = inside - drift_rate * dur_in
    stretch_in = kern.stretch[kern.inside_copy].median() if kern.inside_copy.any() else np.nan
    stretch_out = kern.stretch[~kern.inside_copy].median() if (~kern.inside_copy).any() else np.nan
    totals = {
        "wall_co_ns": wall_co, "wall_lw_ns": wall_lw, "wall_source": "measured" if measured else "trace",
        "trace_wall_co_ns": trace_wall_co, "trace_wall_lw_ns": trace_wall_lw,
        "delta_wall_ns": delta, "kernel_inside_ns": inside, "kernel_outside_ns": outside, "idle_ns": idle,
        "clock_ns": clock, "clock_inside_ns": int(round(clock_in)), "clock_outside_ns": int(round(clock_out)),
        "clock_term": bool(with_clock), "sm_mhz_co": f_co, "sm_mhz_lw": f_lw,
        "tail_ns": tail, "lead_ns": lead, "lead_co_ns": lead_co, "lead_lw_ns": lead_lw,
        "explained_ns": explained, "remainder_ns": remainder, "explained_frac": frac,
        "ops": len(kern), "ops_inside": int(kern.inside_copy.sum()),
        "kernel_time_inside_ns": dur_in, "drift_rate": float(drift_rate), "copy_cost_ns": float(copy_cost),
        "stretch_inside": float(stretch_in), "stretch_outside": float(stretch_out),
        "idle_co_ns": int(kern.gap_co_ns.sum()), "idle_lw_ns": int(kern.gap_lw_ns.sum()),
        "copies": len(cp_lw), "copy_bytes": int(cp_lw.bytes.sum()) if cp_lw.bytes.notna().any() else 0,
        "copy_busy_ns": int(cp_lw.dur_ns.sum()), "engines": sorted(set(cp_lw.engine)) if len(cp_lw) else [],
        "copy_kinds": sorted(set(x for x in cp_lw.copy_kind if x)) if len(cp_lw) else [],
        "compute_stream_co": cs_co, "compute_stream_lw": cs_lw,
    }

    zero = {"clock_ms": 0.0, "kernel_inside_ms": 0.0, "kernel_outside_ms": 0.0, "idle_ms": 0.0, "tail_ms": 0.0,
            "lead_ms": 0.0}
    seg_rows = [{"segment": "lead-in", "layer": pd.NA, "ops": 0, **zero, "lead_ms": lead / 1e6}]
    for seg in dict.fromkeys(kern.segment):
        g = kern[kern.segment == seg]
        layer = g.layer.dropna()
        seg_rows.append({
            "segment": seg, "layer": int(layer.iloc[0]) if len(layer) else pd.NA, "ops": len(g), **zero,
            "clock_ms": g.clock_ns.sum() / 1e6,
            "kernel_inside_ms": (g.delta_ns[g.inside_copy].sum() - g.clock_ns[g.inside_copy].sum()) / 1e6,
            "kernel_outside_ms": (g.delta_ns[~g.inside_copy].sum() - g.clock_ns[~g.inside_copy].sum()) / 1e6,
            "idle_ms": g.delta_gap_ns.sum() / 1e6,
        })
    seg_rows.append({"segment": "tail", "layer": pd.NA, "ops": 0, **zero, "tail_ms": tail / 1e6})
    segments = pd.DataFrame(seg_rows)
    segments["layer"] = pd.array(segments.layer, dtype="Int64")
    segments["total_ms"] = segments[list(zero)].sum(axis=1)

    layers = layer_table(layerwise, cs_lw, ceiling_gbps, ops=ops_lw, copy_rows=cp_lw)
    # the colocated run's windows, with the layer labels of the matched layer-wise ops
    co_l = kern[["layer", "start_co_ns", "dur_co_ns"]].assign(end=lambda d: d.start_co_ns + d.dur_co_ns)
    win = co_l.dropna(subset=["layer"]).groupby("layer").agg(co_compute_start_ns=("start_co_ns", "min"),
                                                             co_compute_end_ns=("end", "max"))
    layers = layers.merge(win, left_on="layer", right_index=True, how="left")
    for col in ("co_compute_start_ns", "co_compute_end_ns"):
        layers[col] = pd.array(layers[col], dtype="Int64")
    notes = []
    if len(cp_lw) and (cp_lw.layer_source == "order").all():
        notes.append("copies carried no send range (armed before prefill, or issued by a worker thread); "
                     "they were assigned to layers in issue order")
    return Decomposition(totals, segments, layers, kern, cp_lw, ceiling_gbps, notes)


# the terms of Δwall: key (what the code tests), the words a reader sees, the segments' column, the totals' key
TERMS = (("clock", CLOCK_TERM, "clock_ms", "clock_ns"),
         ("inside", "kernels stretched inside copy windows", "kernel_inside_ms", "kernel_inside_ns"),
         ("outside", "kernels stretched outside copy windows", "kernel_outside_ms", "kernel_outside_ns"),
         ("idle", "GPU idle gaps (waiting for the host)", "idle_ms", "idle_ns"),
         ("tail", "exposed tail after the last kernel", "tail_ms", "tail_ns"),
         ("lead", "host work before the first kernel (lead-in)", "lead_ms", "lead_ns"),
         ("remainder", "unexplained remainder", None, "remainder_ns"))
