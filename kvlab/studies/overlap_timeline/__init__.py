"""Overlap timeline: where does a layer-wise handoff's time go, kernel by kernel? (notebook 03)

Seed 004 found layer-by-layer sending worse than one bulk copy at 32k tokens and stopped at "a timeline would
show it". This study takes that timeline: a colocated and a layer-wise prefill of the same prompt under
torch.profiler (trace.trace_handoff), matched op by op (decomposition.decompose) so the layer-wise run's extra
wall time splits into kernels stretched inside / outside copy windows, idle gaps, the exposed tail, the host's
lead-in and, with NVML samples, a lower SM clock. Beside it: a per-layer timeline from CUDA events alone
(events.event_handoff, cheap enough for 1k tokens), and with two GPUs the send-pattern experiment under the
clock (patterns.send_patterns).

Modules: measurement — trace, events, patterns (GPU; they write raw tables); analysis — decomposition,
findings, report (backlog, goals, charts), pattern_report, summaries (pure, on a CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import torch

from ... import devices, models
from ...clocks import Sampler
from ...parse import name_list, suggest, token_list
from ...results import Run
from ...study import Analysis, Param, at_least, check_params, ctx_label, fmt_or_dash, md_table
from ...tracefmt import GPU_KINDS, host_layers, summarize
from ...transfer import Destination
from . import report
from .decomposition import clock_on_trace, decompose, has_gpu_activity
from .events import event_handoff
from .findings import causes, findings
from .pattern_report import pattern_findings, pattern_summary, plot_clock_timeline, plot_patterns
from .patterns import PATTERNS, send_patterns
from .summaries import event_overhead, tracing_overhead
from .trace import trace_handoff

__all__ = ["NAME", "NOTEBOOK", "TITLE", "QUESTION", "FIGURES", "PARAMS", "Config", "check", "measure", "analyse",
           "figures", "BLOCKS", "goal_table"]

NAME = "overlap_timeline"
NOTEBOOK = "03_overlap_timeline"
TITLE = "Overlap timeline"
QUESTION = ("Where does a layer-wise handoff lose its time against a colocated prefill of the same prompt, kernel "
            "by kernel, and what sets the cost of sending to a peer GPU?")
# every figure the study draws; which of them a run gets depends on what it measured (a GPU trace, the per-layer
# events, the send patterns)
FIGURES = ("timeline", "decomposition", "backlog", "event_timeline", "patterns", "clock_timeline")


def _choice(*valid: str):
    def check(value, name):
        if str(value) not in valid:
            raise ValueError(f"{name} = {value!r} is not valid; valid: {', '.join(valid)}{suggest(str(value), valid)}")
    return check


def _one(value, name):
    items = name_list(value, name)
    if len(items) != 1:
        raise ValueError(f"{name} = {value!r}: give one value, not {len(items)} (this notebook takes a single {name})")
    return items[0]


def _context(value, name):
    return token_list(_one(value, name), name, 2)[0]


def _destination(value, name):
    src = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        Destination.parse(_one(value, name), src)
    except RuntimeError:  # torch.device("cuda:one")
        raise ValueError(f"unknown destination {value!r}; valid: 'same-gpu', 'cuda:N' (N a GPU index), 'pinned', "
                         "'pageable'") from None


def _clock_interval(value, name):
    if not (value == 0 or value >= 0.5):
        raise ValueError(f"{name} = {value!r}: give 0 (off) or a number >= 0.5 (ms)")


def _pattern_list(value) -> list[str] | None:
    """The patterns a `patterns` value names; None for "auto" (every pattern) and "off"."""
    if value in ("auto", "off"):
        return None
    return [p.strip() for p in str(value).split(";") if p.strip()]


def _patterns(value, name):
    for p in _pattern_list(value) or []:
        if p not in PATTERNS:
            raise ValueError(f"{name}: unknown pattern {p!r}; valid: {', '.join(PATTERNS)}{suggest(p, PATTERNS)}")


PARAMS = (
    Param("model", "str", "auto", 'registry name; "auto": qwen2.5-7b (random weights) on a GPU, kvlab-tiny on a CPU',
          lambda v, n: models.kv_model_ref(v, n)),
    Param("context", "str", "auto", 'prompt length in tokens (8192, 8k, 32k); "auto": 32768 on a GPU, 64 on a CPU',
          _context),
    Param("destination", "str", "auto", 'same-gpu | pinned | pageable | cuda:N; "auto": pinned on a GPU, same-gpu on '
          "a CPU", _destination),
    Param("transport", "str", "copy", 'how the cache moves: "copy" (kvlab.transfer.Transport, one copy per layer)',
          _choice("copy")),
    Param("send_mode", "str", "auto", 'layer-wise sending: "auto" (armed flags, or staged for pageable), "event" (each '
          "hook launches its copy: the naive way)", _choice("auto", "event")),
    Param("repeats", "int", 3, "traced and untraced runs of each variant, interleaved; the median traced run is "
          "analysed", at_least(1)),
    Param("events", "str", "auto", 'the per-layer timeline from CUDA events alone (no profiler): "auto" (on a GPU), '
          '"off"', _choice("auto", "off")),
    Param("event_rounds", "int", 15, "interleaved rounds with and without those events (their overhead is measured)",
          at_least(1)),
    Param("clock_interval_ms", "float", 5.0, "NVML samples of the GPUs' SM clock, power and NVLink counters during "
          "the traced rounds (0: off)", _clock_interval),
    Param("patterns", "str", "auto", 'the send-pattern experiment (kvlab.studies.overlap_timeline.patterns): "auto" '
          '(when the destination is another GPU), "off", or names from its PATTERNS separated by ";"', _patterns),
    Param("pattern_rounds", "int", 9, "rounds of every pattern, in balanced orders (9 or more for published numbers)",
          at_least(1)),
)


@dataclass(frozen=True)
class Config:
    """One run, every value resolved: the model (registry name), context (tokens), destination (as given or
    resolved: "pinned", "cuda:1" …), transport, send_mode, repeats, device ("cuda" or "cpu"), clock_interval_ms
    (0: no NVML sampling of the traced rounds), event_timeline (run events.event_handoff: a GPU, send_mode auto,
    events auto), event_rounds, send_patterns (run patterns.send_patterns: a GPU, another GPU as destination, two
    GPUs here, patterns not "off"), pattern_list (the patterns named; None: every one), pattern_rounds."""

    model: str
    context: int
    destination: str
    transport: str
    send_mode: str
    repeats: int
    device: str
    clock_interval_ms: float
    event_timeline: bool
    event_rounds: int
    send_patterns: bool
    pattern_list: list | None
    pattern_rounds: int


def check(params) -> Config:
    """The run's Config from notebook or command-line values ("auto" resolved by this machine's hardware); nothing
    is allocated. ValueError (one line) for a value the study cannot take."""
    p = check_params(PARAMS, params, NAME)
    on_gpu = devices.preset() == "gpu"
    auto = lambda name, gpu, cpu: (gpu if on_gpu else cpu) if p[name] == "auto" else p[name]  # noqa: E731
    dest = _one(auto("destination", "pinned", "same-gpu"), "destination")
    return Config(
        model=auto("model", "qwen2.5-7b", "kvlab-tiny"), context=_context(auto("context", 32768, 64), "context"),
        destination=dest, transport=p["transport"], send_mode=p["send_mode"],
        repeats=p["repeats"], device="cuda" if on_gpu else "cpu", clock_interval_ms=float(p["clock_interval_ms"]),
        event_timeline=p["events"] == "auto" and on_gpu and p["send_mode"] == "auto", event_rounds=p["event_rounds"],
        send_patterns=(on_gpu and p["patterns"] != "off" and dest.startswith("cuda:")
                       and torch.cuda.device_count() > 1),
        pattern_list=_pattern_list(p["patterns"]), pattern_rounds=p["pattern_rounds"])


def _kept(events: pd.DataFrame, variant: str) -> pd.DataFrame:
    """What the run keeps of one traced run's events: its GPU rows and hook ranges (a 32k GPU trace's host ops
    would make the table large, and the analysis does not read them); for a trace without GPU activity (a CPU
    run) its host ops too, which are then the timeline the figure draws."""
    keep = events.kind.isin(GPU_KINDS) | (events.kind == "range")
    if not events.kind.isin(GPU_KINDS).any():
        keep |= events.kind == "cpu_op"
    return events[keep].assign(variant=variant)


def measure(cfg: Config, run: Run) -> None:
    """Trace the colocated / layer-wise pair (trace.trace_handoff, NVML sampling on a GPU), then the per-layer
    CUDA-event timeline (events.event_handoff) and the send patterns (patterns.send_patterns) where the machine
    allows. Writes the raw tables — walls, timeline (GPU rows and ranges of the analysed pair), events_summary
    (of the whole traces), clock_samples, event_rounds, event_layers, pattern_rounds, pattern_samples,
    pattern_timeline — and what was resolved and measured alone into run.json; raw traces stay in the run folder
    as trace_*.json.gz."""
    device = torch.device(cfg.device)
    if cfg.device == "cpu":
        # the tiny model's matrices are a few KiB: a second BLAS thread only spins against whatever else
        # runs on the machine, and stalls of 100 ms would swamp a 1 ms prefill
        torch.set_num_threads(1)
    lm = models.build(cfg.model, weights="random", device=device, dtype=torch.bfloat16)
    run.update(resolved=dict(model=cfg.model, context=cfg.context, destination=cfg.destination,
                             transport=cfg.transport, device=str(device), layers=lm.config.num_hidden_layers))
    sampler = None
    if cfg.device == "cuda" and cfg.clock_interval_ms:
        # the prefill GPU and, for a peer destination, the peer
        gpus = sorted({device.index or 0} | ({int(cfg.destination.split(":")[1])}
                                             if cfg.destination.startswith("cuda:") else set()))
        sampler = Sampler(gpus, interval_ms=cfg.clock_interval_ms)
    if sampler is not None and not sampler.available:
        print(sampler.why)
        sampler = None
    ht = trace_handoff(lm, cfg.context, cfg.destination, transport=cfg.transport, repeats=cfg.repeats,
                       send_mode=cfg.send_mode, device=device, out_dir=run.dir, progress=print, sampler=sampler)
    clock_samples = ht.extra.pop("clock_samples", None)
    if clock_samples is not None:
        run.save_table(clock_samples, "clock_samples", compress=True)
    run.save_table(ht.walls, "walls")
    timeline = pd.concat([_kept(ht.colocated, "colocated"), _kept(ht.layerwise, "layerwise")], ignore_index=True)
    run.save_table(timeline, "timeline", compress=True)
    run.save_table(pd.concat([summarize(ht.colocated).assign(variant="colocated"),
                              summarize(ht.layerwise).assign(variant="layerwise")], ignore_index=True),
                   "events_summary")
    run.update(trace_files={v: [p.name for p in ps] for v, ps in ht.paths.items()}, analysed_repeat=ht.kept,
               ceiling_gbps=ht.ceiling_gbps, bulk_copy_ms=ht.bulk_copy_ms, layer_copy_ms=ht.layer_copy_ms,
               kv_bytes=ht.kv_bytes, send_mode=ht.extra.get("send_mode"), destination_label=ht.destination)
    print(f"ceiling on this path: {ht.ceiling_gbps:,.1f} GB/s (whole cache, {ht.bulk_copy_ms:.3f} ms); "
          f"one layer alone: {ht.layer_copy_ms:.4f} ms; send mode: {ht.extra.get('send_mode')}")
    if cfg.event_timeline:
        et = event_handoff(lm, cfg.context, cfg.destination, rounds=cfg.event_rounds, device=device, progress=print)
        run.save_table(et.rounds, "event_rounds")
        run.save_table(et.layers, "event_layers")
        run.update(event_mode=et.mode)
    else:
        print("per-layer events: skipped (they need a GPU, send_mode='auto' and events='auto')")
    if cfg.send_patterns:
        pat = send_patterns(lm, cfg.context, cfg.destination, variants=cfg.pattern_list, rounds=cfg.pattern_rounds,
                            device=device, interval_ms=cfg.clock_interval_ms or 5.0, progress=print)
        run.save_table(pat.rounds, "pattern_rounds")
        run.save_table(pat.samples, "pattern_samples", compress=True)
        run.save_table(pat.timeline, "pattern_timeline")
        run.update(patterns_meta=pat.meta)
    else:
        print("send patterns: skipped (they need two GPUs and destination='cuda:N', and patterns != 'off')")


# ------------------------------------------------------------------------------------------------ analysis


def _prefill_gpu(record: dict) -> int:
    """The prefill GPU's index from run.json (the pattern run's first GPU, or the resolved device's index)."""
    meta = record.get("patterns_meta") or {}
    if meta.get("gpus"):
        return int(meta["gpus"][0])
    dev = str((record.get("resolved") or {}).get("device", "cuda:0"))
    return int(dev.split(":")[1]) if ":" in dev else 0


def _pair(timeline: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The analysed pair's events tables (colocated, layer-wise) from the run's timeline table."""
    return (timeline[timeline.variant == "colocated"].drop(columns="variant"),
            timeline[timeline.variant == "layerwise"].drop(columns="variant"))


def analyse(record: dict, tables: dict) -> Analysis:
    """From run.json and the raw tables: the tracing overhead (overhead), the decomposition of Δwall and its
    tables (decomposition, segments, layers, causes, copies) or, for a CPU trace, the host view (host_layers),
    the backlog against the pipelined model (backlog), the per-layer events' cost (event_overhead), the
    send-pattern summary (patterns), the goals and the findings; `decomposition_totals` for run.json."""
    if "walls" not in tables:
        raise FileNotFoundError("this overlap_timeline run has no walls.csv: it did not write what its analysis needs")
    walls = tables["walls"]
    overhead = tracing_overhead(walls)
    out = {"overhead": overhead}
    lines, fields, totals = [], {}, None
    timeline, kept = tables.get("timeline"), record.get("analysed_repeat")
    if timeline is not None and kept is not None and "variant" in timeline.columns:
        co, lw = _pair(timeline)
        w = walls[walls.traced & (walls["repeat"] == kept)].set_index("variant")
        wall_ns = {v: int(round(float(w.wall_ms[v]) * 1e6)) for v in ("colocated", "layerwise")}
        if has_gpu_activity(lw):
            kw = {}
            samples = tables.get("clock_samples")
            if samples is not None and len(samples) and "t0_ns" in walls.columns:
                # the prefill GPU's SM clock placed on each analysed run's own trace axis
                gpu = _prefill_gpu(record)
                kw = dict(clock_co=clock_on_trace(samples, gpu, int(w.t0_ns["colocated"]), co),
                          clock_lw=clock_on_trace(samples, gpu, int(w.t0_ns["layerwise"]), lw))
            dec = decompose(co, lw, ceiling_gbps=record.get("ceiling_gbps"), wall_co_ns=wall_ns["colocated"],
                            wall_lw_ns=wall_ns["layerwise"], **kw)
            backlog = report.backlog_comparison(dec, layer_copy_ms=record.get("layer_copy_ms"))
            out.update(decomposition=dec.summary(), segments=dec.segments, layers=dec.layers, causes=causes(dec),
                       copies=dec.copies[["name", "device", "stream", "start_ns", "end_ns", "dur_ns", "bytes",
                                          "copy_kind", "layer", "engine", "layer_source"]], backlog=backlog)
            totals = dec.totals
            fields["decomposition_totals"] = {k: v for k, v in totals.items() if not isinstance(v, tuple)}
            lines = findings(dec, backlog)
        else:
            out["host_layers"] = host_layers(co).merge(host_layers(lw), on="layer",
                                                       suffixes=("_colocated", "_layerwise"))
            out["backlog"] = report.host_backlog_comparison(co, lw, layer_copy_ms=record.get("layer_copy_ms"))
            lines = report.host_findings(co, lw, wall_ns["colocated"] / 1e6, wall_ns["layerwise"] / 1e6)
    oh = overhead.set_index("variant")
    traced = int((walls.traced & (walls.variant == "colocated")).sum())
    lines.append(f"Tracing added {oh.loc['colocated', 'overhead_pct']:+.1f} % to colocated prefill and "
                 f"{oh.loc['layerwise', 'overhead_pct']:+.1f} % to the layer-wise run (medians of {traced}).")
    ev_rounds, ev_layers, ev = tables.get("event_rounds"), tables.get("event_layers"), None
    if ev_rounds is not None and len(ev_rounds):
        ev = out["event_overhead"] = event_overhead(ev_rounds)
        ov, tail = ev.iloc[0], float(ev_layers.backlog_ms.iloc[-1])
        lines.append(f"The per-layer CUDA events added {ov.extra_ms:+.3f} ms ({ov.overhead_pct:+.2f} %; 95 % interval "
                     f"{ov.extra_ci_lo_ms:+.3f}…{ov.extra_ci_hi_ms:+.3f} ms) to the layer-wise prefill over "
                     f"{int(ov.rounds)} paired rounds; the last layer's copy ended {abs(tail):.3f} ms "
                     f"{'after' if tail > 0 else 'before'} prefill's last op.")
    summary = report.goal_summary(overhead, totals, ev)
    rounds = tables.get("pattern_rounds")
    if rounds is not None and len(rounds):
        out["patterns"] = pattern_summary(rounds)
        lines += pattern_findings(out["patterns"], record.get("patterns_meta") or {})
    values = {f"tracing_{v}_pct": f"{oh.loc[v, 'overhead_pct']:+.1f}" for v in oh.index}
    if totals is not None:
        values.update(delta_wall_ms=f"{totals['delta_wall_ns'] / 1e6:+.2f}",
                      explained_pct=f"{100 * totals['explained_frac']:.0f}")
    if ev is not None:
        values.update(events_extra_ms=f"{ev.extra_ms.iloc[0]:+.3f}", events_pct=f"{ev.overhead_pct.iloc[0]:+.2f}")
    return Analysis(NAME, record, raw=dict(tables), tables=out, goals=report.goals(summary, record), findings=lines,
                    values=values, fields=fields)


def figures(a: Analysis) -> dict:
    """Every figure the run's tables allow: the timeline of the analysed pair (Gantt lanes), the decomposition per
    layer (host time per layer for a CPU trace), the backlog, the per-layer event timeline, the send patterns and
    the prefill GPU's clock under them."""
    res = a.record.get("resolved") or {}
    model, n = res.get("model", ""), int(res.get("context", 0) or 0)
    label = a.record.get("destination_label", "")
    out = {}
    timeline = a.raw.get("timeline")
    if timeline is not None and "variant" in timeline.columns:
        co, lw = _pair(timeline)
        out["timeline"] = report.gantt_pair(co, lw, title=f"{model}, {n:,} tokens → {label}: colocated vs layer-wise "
                                                          f"({res.get('device', '')})")
        if "segments" in a.tables:
            clock = bool(a.fields.get("decomposition_totals", {}).get("clock_term"))
            out["decomposition"] = report.segments_chart(
                a.tables["segments"], clock, title=f"Δ time per layer vs colocated: {model}, {n:,} tokens → {label}"
            ).figure
        elif "host_layers" in a.tables:
            out["decomposition"] = report.host_chart(co, lw, title=f"Host time per layer (no GPU trace): {model}, "
                                                                   f"{n:,} tokens").figure
    if "backlog" in a.tables:
        out["backlog"] = report.backlog_chart(a.tables["backlog"], title=f"Backlog per layer: {model}, {n:,} tokens "
                                                                         f"→ {label}").figure
    layers = a.raw.get("event_layers")
    if layers is not None and len(layers):
        out["event_timeline"] = report.event_gantt(layers, report.prefill_end_of(layers),
                                                   title=f"{model}, {n:,} tokens → {label}: per-layer timeline "
                                                         "from CUDA events (no profiler)")
    if "patterns" in a.tables:
        rounds = a.raw["pattern_rounds"]
        dest = res.get("destination", (a.record.get("patterns_meta") or {}).get("destination", ""))
        out["patterns"] = plot_patterns(a.tables["patterns"], title=f"{model}, {n:,} tokens → {dest}: what each send "
                                        "pattern costs prefill, beside what its SM clock predicts "
                                        f"({rounds['round'].nunique()} rounds)")
        samples = a.raw.get("pattern_samples")
        if samples is not None and len(samples):
            tl = a.raw.get("pattern_timeline")
            out["clock_timeline"] = plot_clock_timeline(
                samples, rounds, tl if tl is not None else pd.DataFrame(), gpu=_prefill_gpu(a.record),
                title=f"{model}, {n:,} tokens: the prefill GPU's SM clock and power, colocated vs every layer to "
                      f"{dest} (ticks: copy starts)")
    return out


# ------------------------------------------------------------------------------------ the published tables


def _where(record: dict) -> tuple:
    """(context, destination) of a run as the tables name them: resolved values first, then the parameters."""
    r = record.get("resolved") or {}
    p = record.get("parameters") or {}
    return r.get("context", p.get("context")), record.get("destination_label") or r.get("destination") or p.get(
        "destination")


def _patterns_table(analyses: list[Analysis], **_) -> str:
    """One run's send patterns against colocated: extra prefill [95 %], the SM clock's drop and what it alone
    predicts [95 %], the NVLink bytes out of the prefill GPU."""
    s = analyses[0].tables["patterns"]
    order = {v: i for i, v in enumerate(PATTERNS)}
    s = s[s.variant != "colocated"].sort_values("variant", key=lambda v: v.map(order))
    out = pd.DataFrame({
        "sent during prefill": s.variant,
        "extra prefill ms [95 % interval]": [f"{a:+.1f} [{lo:+.1f}, {hi:+.1f}]" for a, lo, hi in
                                             zip(s.extra_ms, s.extra_lo_ms, s.extra_hi_ms)],
        "GPU 0 SM clock vs colocated": [f"{-x:+.0f} MHz" for x in s.clock_drop_mhz],
        "the clock alone predicts ms": [f"{a:+.1f} [{lo:+.1f}, {hi:+.1f}]" for a, lo, hi in
                                        zip(s.clock_pred_ms, s.clock_pred_lo_ms, s.clock_pred_hi_ms)],
        "NVLink GB out of GPU 0": s.nvlink_tx_gb.map(lambda v: fmt_or_dash(v, ".2f"))})
    return md_table(out)


def _event_overhead_table(analyses: list[Analysis], link, **_) -> str:
    """Per run: prefill without and with the per-layer CUDA events, their paired extra [95 %] and its share."""
    rows = []
    for a in analyses:
        ctx, dest = _where(a.record)
        ev = a.tables["event_overhead"].iloc[0]
        base = float(ev.untimed_ms)
        rows.append({"run": link(a.where), "context": ctx_label(ctx), "destination": dest,
                     "prefill without events (ms)": f"{ev.untimed_ms:.1f}", "with events (ms)": f"{ev.evented_ms:.1f}",
                     "events add, ms [95 % interval]": f"{ev.extra_ms:+.2f} [{ev.extra_ci_lo_ms:+.2f}, {ev.extra_ci_hi_ms:+.2f}]",
                     "% of prefill [95 % interval]": (f"{100 * ev.extra_ms / base:.1f} % [{100 * ev.extra_ci_lo_ms / base:.1f}, "
                                                      f"{100 * ev.extra_ci_hi_ms / base:.1f}]"),
                     "rounds": int(ev.rounds)})
    return md_table(pd.DataFrame(rows))


def _runs_table(analyses: list[Analysis], link, **_) -> str:
    """Per traced run: Δwall and its largest terms, the share explained, the profiler's cost to colocated prefill."""
    rows = []
    for a in analyses:
        ctx, dest = _where(a.record)
        dec = a.tables["decomposition"].set_index("term").ms
        oh = a.tables["overhead"].set_index("variant")
        dw = float(dec["Δwall"])
        explained = 1 - abs(float(dec["unexplained remainder"])) / abs(dw) if dw else float("nan")
        rows.append({"run": link(a.where), "context": ctx_label(ctx), "destination": dest,
                     "send mode": a.record.get("send_mode") or (a.record.get("parameters") or {}).get("send_mode", "—"),
                     "Δwall traced (ms)": f"{dw:+.2f}",
                     "GPU idle gaps (ms)": f"{dec['GPU idle gaps (waiting for the host)']:+.2f}",
                     "lead-in host (ms)": f"{dec['host work before the first kernel (lead-in)']:+.2f}",
                     "kernels stretched in / out of copy windows (ms)": (
                         f"{dec['kernels stretched inside copy windows']:+.2f} / {dec['kernels stretched outside copy windows']:+.2f}"),
                     "explained": f"{100 * explained:.0f} %",
                     "tracing overhead (colocated)": f"{oh.loc['colocated', 'overhead_pct']:.1f} %"})
    return md_table(pd.DataFrame(rows))


BLOCKS = {"patterns": _patterns_table, "event_overhead": _event_overhead_table, "runs": _runs_table}


def goal_table(analysis: Analysis, study: str = NAME) -> pd.DataFrame:
    """The goal rows of one run for the verdicts table (kvlab.goals under its one rule; a goal whose measurement
    did not run is left out)."""
    return analysis.goals

