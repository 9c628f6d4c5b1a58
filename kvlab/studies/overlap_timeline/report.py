"""What notebook 03 shows of a decomposed pair of timelines: the backlog against the calculator's pipelined
model, the host-side view of a CPU trace, and the charts (Gantt lanes, decomposition bars, backlog, the
per-layer event timeline). The decomposition itself is this package's decomposition module.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from ... import plots
from ...exposure import pipeline_exposure
from ...goals import evaluate_run
from ...tracefmt import GPU_KINDS, TraceError, check_events, host_layers
from .decomposition import NO_GPU_MESSAGE, Decomposition, compute_stream, has_gpu_activity, on_stream

__all__ = ["predicted_backlog", "backlog_comparison", "host_backlog_comparison", "host_findings", "gantt",
           "gantt_pair", "decomposition_chart", "segments_chart", "host_chart", "backlog_chart", "prefill_end_of",
           "event_gantt", "goal_summary", "goals"]


def predicted_backlog(compute_s_per_layer, transfer_s_per_layer) -> pd.DataFrame:
    """The calculator's pipelined-exposure model, per layer (seconds in, seconds out).

    Uses kvlab.exposure.pipeline_exposure. Columns: layer, compute_s, transfer_s, compute_end_s, send_start_s, send_end_s,
    wait_s (send_start − compute_end: the calculator's "backlog", time waiting for the link) and
    backlog_s (send_end − compute_end: how far the link trails the layer — the quantity measured as
    copy end − compute end).
    """
    c = [float(x) for x in compute_s_per_layer]
    t = [float(x) for x in transfer_s_per_layer]
    if len(c) != len(t) or not c:
        raise ValueError(f"need one compute and one transfer time per layer, got {len(c)} and {len(t)}")
    if any(not math.isfinite(x) or x < 0 for x in c + t):
        raise ValueError("compute and transfer times must be finite seconds ≥ 0")
    e = pipeline_exposure(c, t)
    res = {"compute_end_s": list(e.compute_end_s), "send_start_s": list(e.send_start_s),
           "send_end_s": list(e.send_end_s)}
    df = pd.DataFrame({"layer": np.arange(len(c)), "compute_s": c, "transfer_s": t, **res})
    df["wait_s"] = df.send_start_s - df.compute_end_s
    df["backlog_s"] = df.send_end_s - df.compute_end_s
    return df


def backlog_comparison(decomp: Decomposition, layer_copy_ms: float | None = None) -> pd.DataFrame:
    """Measured backlog per layer (copy end − compute end, layer-wise run) beside the predicted one.

    Prediction inputs: compute time of layer i = the colocated run's layer end i − layer end i−1
    (layer 0 from the first op), so the model's clock matches the trace's; transfer time =
    layer_copy_ms (one layer copied alone, fixed cost included) when given, else the layer's bytes at
    the ceiling, else its measured copy busy time. Columns in ms: layer, compute_ms, transfer_ms,
    measured_backlog_ms, predicted_backlog_ms, predicted_wait_ms.
    """
    lay = decomp.layers.dropna(subset=["co_compute_end_ns", "compute_end_ns"]).sort_values("layer")
    if lay.empty:
        raise TraceError("no layer has a compute window in both runs: cannot compare backlogs")
    origin = int(decomp.kernels.start_co_ns.min())
    ends = lay.co_compute_end_ns.astype("int64").to_numpy()
    compute_ns = np.diff(np.concatenate(([origin], ends)))
    if layer_copy_ms is not None:
        transfer_ns = np.full(len(lay), layer_copy_ms * 1e6)
    elif decomp.ceiling_gbps and lay.copy_bytes.notna().all():
        transfer_ns = lay.copy_bytes.astype("float64").to_numpy() / decomp.ceiling_gbps
    else:
        transfer_ns = lay.copy_busy_ns.astype("float64").fillna(0).to_numpy()
    pred = predicted_backlog(compute_ns / 1e9, transfer_ns / 1e9)
    lw_origin = int(decomp.kernels.start_lw_ns.min())
    return pd.DataFrame({
        "layer": lay.layer.astype(int).to_numpy(),
        "compute_ms": compute_ns / 1e6, "transfer_ms": transfer_ns / 1e6,
        "measured_backlog_ms": lay.backlog_ns.astype("float64").to_numpy() / 1e6,
        "predicted_backlog_ms": pred.backlog_s.to_numpy() * 1e3,
        "predicted_wait_ms": pred.wait_s.to_numpy() * 1e3,
        "measured_compute_end_ms": (lay.compute_end_ns.astype("float64").to_numpy() - lw_origin) / 1e6,
        "predicted_compute_end_ms": pred.compute_end_s.to_numpy() * 1e3,
    })


def host_backlog_comparison(colocated: pd.DataFrame, layerwise: pd.DataFrame,
                            layer_copy_ms: float) -> pd.DataFrame:
    """The backlog comparison from host ranges alone, for traces without GPU activity (a CPU run).

    compute_ms: colocated kvlab/layer{i} end − layer{i−1} end (layer 0 from its own start);
    measured_backlog_ms: layer-wise send{i} end − layer{i} end (on a CPU the copy is synchronous inside
    the hook, so it ends before its layer does: negative); predicted from compute_ms and layer_copy_ms.
    Same columns as backlog_comparison.
    """
    r_co = colocated[(colocated.kind == "range") & colocated.stream.isna() & (colocated.name == colocated.range_name)]
    r_lw = layerwise[(layerwise.kind == "range") & layerwise.stream.isna() & (layerwise.name == layerwise.range_name)]
    lay_co = r_co[r_co.name.str.startswith("kvlab/layer")].drop_duplicates("layer").set_index("layer").sort_index()
    lay_lw = r_lw[r_lw.name.str.startswith("kvlab/layer")].drop_duplicates("layer").set_index("layer").sort_index()
    snd_lw = r_lw[r_lw.name.str.startswith("kvlab/send")].drop_duplicates("layer").set_index("layer").sort_index()
    layers = [i for i in lay_co.index if i in lay_lw.index and i in snd_lw.index]
    if not layers:
        raise TraceError("the traces lack kvlab/layer{i} ranges in the colocated run or kvlab/layer{i} and "
                         "kvlab/send{i} ranges in the layer-wise run: trace both with LayerHooks(ranges=True)")
    ends = lay_co.loc[layers, "end_ns"].astype("int64").to_numpy()
    compute_ns = np.diff(np.concatenate(([int(lay_co.loc[layers[0], "start_ns"])], ends)))
    transfer_ns = np.full(len(layers), float(layer_copy_ms) * 1e6)
    pred = predicted_backlog(compute_ns / 1e9, transfer_ns / 1e9)
    measured = (snd_lw.loc[layers, "end_ns"].astype("int64").to_numpy()
                - lay_lw.loc[layers, "end_ns"].astype("int64").to_numpy())
    origin = int(lay_lw.loc[layers[0], "start_ns"])
    return pd.DataFrame({
        "layer": np.asarray(layers, dtype=int), "compute_ms": compute_ns / 1e6, "transfer_ms": transfer_ns / 1e6,
        "measured_backlog_ms": measured / 1e6, "predicted_backlog_ms": pred.backlog_s.to_numpy() * 1e3,
        "predicted_wait_ms": pred.wait_s.to_numpy() * 1e3,
        "measured_compute_end_ms": (lay_lw.loc[layers, "end_ns"].astype("int64").to_numpy() - origin) / 1e6,
        "predicted_compute_end_ms": pred.compute_end_s.to_numpy() * 1e3,
    })


def host_findings(colocated: pd.DataFrame, layerwise: pd.DataFrame, wall_co_ms: float | None = None,
                  wall_lw_ms: float | None = None) -> list[str]:
    """Sentences for traces without GPU activity (a CPU run): the no-GPU notice, then what the hooks'
    host ranges show (per-layer host time, send time, which on a CPU holds the synchronous copy)."""
    out = [NO_GPU_MESSAGE[0].upper() + NO_GPU_MESSAGE[1:] + "."]
    if wall_co_ms is not None and wall_lw_ms is not None:
        d = wall_lw_ms - wall_co_ms
        out.append(f"On the host, layer-wise prefill took {wall_lw_ms:.2f} ms against {wall_co_ms:.2f} ms "
                   f"colocated ({d:+.2f} ms).")
    try:
        lw = host_layers(layerwise)
    except TraceError as e:
        out.append(str(e))
        return out
    send = lw.send_ms.sum()
    lay = lw.layer_ms.sum()
    out.append(f"The {len(lw)} send hooks took {send:.3f} ms of the {lay:.2f} ms spent inside layer ranges "
               f"({100 * send / lay:.1f} %); on a CPU a send is a synchronous copy, so it cannot overlap compute.")
    try:
        co = host_layers(colocated)
        out.append(f"Per layer, the host spent a median {lw.layer_ms.median():.3f} ms with sending and "
                   f"{co.layer_ms.median():.3f} ms without.")
    except TraceError:
        pass
    return out


def _layer_colors():
    return plots.BLUE, plots.SKY_BLUE, plots.VERMILLION, plots.ORANGE, plots.GREY


def _lanes(events: pd.DataFrame):
    """Lanes for a Gantt chart: (label, rows, role) — GPU streams when there are any, else host threads."""
    lanes = []
    if has_gpu_activity(events):
        cs = compute_stream(events)
        gpu = events[events.kind.isin(GPU_KINDS)]
        keys = [cs] + sorted({(int(d), int(s)) for d, s in zip(gpu.device, gpu.stream)} - {cs})
        for key in keys:
            rows = gpu[on_stream(gpu, key)]
            role = "compute" if key == cs else "copy"
            lanes.append((f"{role}\n(gpu {key[0]}, stream {key[1]})", rows, role))
        return lanes
    host = events[events.kind == "cpu_op"]
    for tid, rows in host.groupby("thread", dropna=False):
        rows = rows.sort_values("start_ns")
        keep, end = [], -1
        for i, (s, e) in enumerate(zip(rows.start_ns, rows.end_ns)):
            if s >= end:  # top-level ops only: nested aten calls would draw over their parents
                keep.append(i)
                end = e
        lanes.append((f"host ops\n(thread {tid})", rows.iloc[keep], "host"))
    ranges = events[(events.kind == "range") & events.range_name.notna() & (events.name == events.range_name)]
    if len(ranges):
        lanes.append(("hook ranges", ranges, "ranges"))
    return lanes


def _origin(events: pd.DataFrame) -> tuple[int, str]:
    """Where a Gantt chart's x = 0 is: the first compute-stream op (GPU), else the first host op — the
    same point in both runs of a pair, which their first events (e.g. copies armed before prefill) are not."""
    if has_gpu_activity(events) and (events.kind == "kernel").any():
        cs = compute_stream(events)
        return int(events[on_stream(events, cs)].start_ns.min()), "the first compute kernel"
    ops = events[events.kind == "cpu_op"]
    return (int(ops.start_ns.min()), "the first host op") if len(ops) else (0, "the first event")


def gantt(events: pd.DataFrame, ax=None, title: str | None = None, label_layers: bool = True,
          legend: bool = False):
    """A per-stream Gantt chart of one run (x in ms from its first compute kernel, or first host op on a
    CPU): compute-stream ops shaded by layer (alternating), copies in vermillion (copy engine) or orange
    (SM copy kernels), memsets grey. A CPU trace draws host threads instead (top-level ops) and the
    hooks' ranges. Returns the Axes."""
    import matplotlib.pyplot as plt

    check_events(events)
    if ax is None:
        _, ax = plt.subplots(figsize=(11, 2.8))
    even, odd, engine_c, sm_c, grey = _layer_colors()
    lanes = _lanes(events)
    origin, origin_name = _origin(events)
    for y, (label, rows, role) in enumerate(reversed(lanes)):
        if rows.empty:
            continue
        starts = (rows.start_ns.to_numpy(dtype=float) - origin) / 1e6
        widths = np.maximum(rows.dur_ns.to_numpy(dtype=float) / 1e6, 1e-4)
        if role in ("compute", "host"):
            lay = rows.layer.astype("Float64").fillna(-1).to_numpy()
            colors = np.where(lay < 0, grey, np.where(lay % 2 == 0, even, odd))
            colors = np.where(rows.kind.to_numpy() == "memset", grey, colors)
        elif role == "copy":
            colors = np.where(rows.kind.to_numpy() == "memcpy", engine_c,
                              np.where(rows.kind.to_numpy() == "kernel", sm_c, grey))
        else:
            lay = rows.layer.astype("Float64").fillna(0).to_numpy()
            colors = np.where(rows.name.astype(str).str.startswith("kvlab/send").to_numpy(), engine_c,
                              np.where(lay % 2 == 0, even, odd))
        ax.broken_barh(list(zip(starts, widths)), (y - 0.4, 0.8), facecolors=list(colors), linewidth=0)
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([label for label, _, _ in reversed(lanes)], fontsize=8)
    ax.set_xlabel(f"time from {origin_name} (ms)")
    ax.grid(axis="y", visible=False)
    if label_layers and lanes:
        rows = lanes[0][1]
        lay = rows.dropna(subset=["layer"])
        if len(lay):
            win = lay.groupby("layer").agg(s=("start_ns", "min"), e=("end_ns", "max"))
            step = max(1, len(win) // 16)
            for i, (layer, w) in enumerate(win.iterrows()):
                if i % step == 0:
                    # inside the top lane, so the legend above the lanes never covers a label
                    ax.text((w.s + w.e - 2 * origin) / 2e6, len(lanes) - 1, f"L{int(layer)}", ha="center", va="center",
                            fontsize=7, color="#222222",
                            bbox={"boxstyle": "round,pad=0.15", "fc": "white", "alpha": 0.75, "lw": 0})
    if legend:
        from matplotlib.patches import Patch

        roles = {role for _, _, role in lanes}
        if roles & {"compute", "copy"}:
            items = [(even, "compute, even layers"), (odd, "compute, odd layers"), (engine_c, "memcpy (copy engine)"),
                     (sm_c, "copy kernel (SMs)"), (grey, "outside layers / memset")]
        else:
            items = [(even, "even layers"), (odd, "odd layers"), (engine_c, "send hook"), (grey, "outside layers")]
        # above the lanes, right-aligned beside the left-aligned title: below them it would sit on the
        # x label, whose distance from the axes depends on the figure's height
        ax.legend(handles=[Patch(color=c, label=t) for c, t in items], fontsize=7, ncol=len(items),
                  loc="lower right", bbox_to_anchor=(1.0, 1.0), frameon=False, handlelength=1.2,
                  columnspacing=1.0, borderaxespad=0.2)
    if title:
        ax.set_title(title)
    return ax


def gantt_pair(colocated: pd.DataFrame, layerwise: pd.DataFrame, title: str | None = None):
    """Two Gantt charts on one time axis: colocated above, layer-wise below. Returns the Figure."""
    import matplotlib.pyplot as plt

    n_co, n_lw = len(_lanes(colocated)), len(_lanes(layerwise))
    fig, (a, b) = plt.subplots(2, 1, figsize=(11, 1.2 + 0.75 * (n_co + n_lw)), sharex=True,
                               gridspec_kw={"height_ratios": [max(n_co, 1), max(n_lw, 1)]})
    gantt(colocated, ax=a, title="colocated prefill")
    gantt(layerwise, ax=b, title="layer-wise prefill + send", legend=True)
    a.set_xlabel("")
    if title:
        fig.suptitle(title, x=0.01, ha="left", fontweight="bold")
    fig.tight_layout()
    return fig


def decomposition_chart(decomp: Decomposition, ax=None, title: str | None = None):
    """Stacked bars per segment (lead-in, pre, layer 0 …, post, tail): Δ kernel time inside / outside
    copy windows, Δ idle gaps, the exposed tail and the lead-in, in ms (and the SM clock's share, when the
    decomposition has the clock term). Returns the Axes."""
    return segments_chart(decomp.segments, bool(decomp.totals.get("clock_term")), ax=ax, title=title)


def segments_chart(seg: pd.DataFrame, clock_term: bool = False, ax=None, title: str | None = None):
    """decomposition_chart from a Decomposition's `segments` table (ms columns clock_ms, kernel_inside_ms,
    kernel_outside_ms, idle_ms, tail_ms, lead_ms; one row per segment), with a bar for the SM clock's share
    when `clock_term`. Returns the Axes."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(max(6, 0.28 * len(seg) + 2), 3.6))
    x = np.arange(len(seg))
    terms = [("clock_ms", "kernels, lower SM clock", "#777777")] if clock_term else []
    terms += [("kernel_inside_ms", "kernels, inside copy windows", plots.VERMILLION),
             ("kernel_outside_ms", "kernels, outside copy windows", plots.BLUE),
             ("idle_ms", "idle gaps", plots.GREEN), ("tail_ms", "exposed tail", plots.PURPLE),
             ("lead_ms", "lead-in (host, before the first kernel)", plots.ORANGE)]
    pos = np.zeros(len(seg))
    neg = np.zeros(len(seg))
    for col, label, color in terms:
        v = seg[col].to_numpy(dtype=float)
        bottom = np.where(v >= 0, pos, neg)
        ax.bar(x, v, bottom=bottom, color=color, label=label, width=0.8)
        pos += np.where(v >= 0, v, 0)
        neg += np.where(v < 0, v, 0)
    # "lead-in" on two lines: on one it ran into "pre" beside it (28 layers, 0.28 in a segment)
    labels = [s.replace("layer ", "").replace("lead-in", "lead-\nin") for s in seg.segment]
    step = max(1, len(labels) // 30)
    ax.set_xticks(x[::step])
    ax.set_xticklabels(labels[::step], fontsize=8)
    ax.axhline(0, color="#333333", linewidth=0.8)
    # left-aligned: centred, the long label ran into the footer at the figure's bottom right
    ax.set_xlabel("layer (pre = embedding, post = norm + LM head)", loc="left")
    ax.set_ylabel("Δ time vs colocated (ms)")
    ax.legend(fontsize=8, ncol=2)
    if title:
        ax.set_title(title)
    return ax


def host_chart(colocated: pd.DataFrame, layerwise: pd.DataFrame, ax=None, title: str | None = None):
    """Per layer, host time inside the hooks' ranges: colocated layer, layer-wise layer, and the
    layer-wise send hook (ms). The chart a CPU trace can give in place of the decomposition."""
    import matplotlib.pyplot as plt

    co, lw = host_layers(colocated), host_layers(layerwise)
    if ax is None:
        _, ax = plt.subplots(figsize=(max(6, 0.3 * len(lw) + 2), 3.6))
    x = np.arange(len(lw))
    w = 0.28
    ax.bar(x - w, co.layer_ms.reindex(range(len(lw))).to_numpy(dtype=float), w, color=plots.color("colocated"),
           label="colocated: layer")
    ax.bar(x, lw.layer_ms.to_numpy(dtype=float), w, color=plots.color("layer-wise"), label="layer-wise: layer")
    ax.bar(x + w, lw.send_ms.to_numpy(dtype=float), w, color=plots.ORANGE, label="layer-wise: send hook")
    ax.set_xticks(x)
    ax.set_xticklabels([str(int(i)) for i in lw.layer])
    ax.set_xlabel("layer")
    ax.set_ylabel("host time (ms)")
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title)
    return ax


def backlog_chart(table: pd.DataFrame, ax=None, title: str | None = None):
    """Measured backlog per layer (copy end − compute end) against the pipelined model's. Returns Axes."""
    import matplotlib.pyplot as plt


    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.6))
    ax.plot(table.layer, table.measured_backlog_ms, marker="o", color=plots.color("layer-wise"), label="measured")
    ax.plot(table.layer, table.predicted_backlog_ms, linestyle="--", color=plots.GREY, label="predicted (pipelined model)")
    ax.axhline(0, color="#333333", linewidth=0.8)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("layer")
    ax.set_ylabel("copy end − compute end (ms)")
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title)
    return ax


def prefill_end_of(layers: pd.DataFrame) -> float:
    """Prefill's end (ms) of an event_layers table, as events.event_table recorded it: the last layer's
    copy end less its backlog."""
    return float(layers.copy_end_ms.iloc[-1] - layers.backlog_ms.iloc[-1])


def event_gantt(layers: pd.DataFrame, prefill_end_ms: float, ax=None, title: str | None = None):
    """Two lanes from events.event_table: prefill between consecutive layer signals (alternating
    shades, layer labels) and each layer's copy; a line at prefill's end. No profiler was running."""
    import matplotlib.pyplot as plt


    if ax is None:
        fig, ax = plt.subplots(figsize=(9.0, 2.4))
    else:
        fig = ax.figure
    even, odd = plots.BLUE, plots.SKY_BLUE
    starts = np.concatenate(([0.0], layers.kv_ready_ms.to_numpy()[:-1]))
    for i, (a, w) in enumerate(zip(starts, layers.compute_ms)):
        ax.broken_barh([(a, w)], (1.1, 0.8), color=even if i % 2 == 0 else odd)
        if w > 0.03 * float(prefill_end_ms or 1):
            ax.text(a + w / 2, 1.5, str(i), ha="center", va="center", fontsize=6, color="white")
    ax.broken_barh(list(zip(layers.copy_start_ms, layers.copy_ms)), (0.1, 0.8), color=plots.VERMILLION)
    ax.axvline(float(prefill_end_ms), color="black", lw=0.8, ls="--")
    ax.set_ylim(0, 2.4)  # room above the lanes for the line's label, inside the axes (not on the title)
    ax.annotate(f"prefill ends, {float(prefill_end_ms):,.1f} ms", (float(prefill_end_ms), 2.32),
                xytext=(-3, 0), textcoords="offset points", ha="right", va="top", fontsize=7.5)
    ax.set_yticks([0.5, 1.5], ["copies", "prefill (layer i ends at its signal)"], fontsize=8)
    ax.set_xlabel("ms since the request started (CUDA events, no profiler)")
    end = max(float(prefill_end_ms), float(layers.copy_end_ms.max()))
    ax.set_xlim(0, end * 1.02)
    ax.set_title(title or "Per-layer timeline from CUDA events", fontsize=10)
    fig.tight_layout()
    return fig


def goal_summary(overhead: pd.DataFrame, totals: dict | None = None,
                 event_overhead: pd.DataFrame | None = None) -> pd.DataFrame:
    """The one-row table notebook 03's goals are judged on: tracing_pct (colocated: traced over untraced
    median, from summaries.tracing_overhead), explained_pct (the decomposition's explained share; NaN
    without a GPU trace), events_pct with events_pct_lo / _hi (the per-layer events' paired median extra and
    its 95 % interval, over the untimed median; NaN when they did not run)."""
    oh = overhead.set_index("variant")
    row = {"tracing_pct": float(oh.loc["colocated", "overhead_pct"]),
           "explained_pct": 100 * float(totals["explained_frac"]) if totals else float("nan"),
           "events_pct": float("nan"), "events_pct_lo": float("nan"), "events_pct_hi": float("nan")}
    if event_overhead is not None and len(event_overhead):
        ov = event_overhead.iloc[0]
        base = float(ov.untimed_ms)
        row.update(events_pct=float(ov.overhead_pct), events_pct_lo=100 * float(ov.extra_ci_lo_ms) / base,
                   events_pct_hi=100 * float(ov.extra_ci_hi_ms) / base)
    return pd.DataFrame([row])


def goals(summary: pd.DataFrame, record: dict | None = None) -> pd.DataFrame:
    """Notebook 03's goals (kvlab.goals, study "overlap_timeline") judged on goal_summary's row, by those in force
    when the run of `record` started; a goal whose measurement did not run (no GPU trace, no per-layer events) is
    left out."""
    return evaluate_run("overlap_timeline", record, summary, keys=(), measured_only=True)
