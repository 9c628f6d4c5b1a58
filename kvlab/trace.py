"""The timeline experiments: a colocated and a layer-wise prefill traced side by side (`trace_handoff`,
torch.profiler), and a per-layer timeline from CUDA events alone (`event_handoff`), plus `kvlab trace`.

The readers and the events table they produce (Kineto, Nsight Systems) live in kvlab.tracefmt; the analysis
of a traced pair (decomposition, backlog, Gantt charts) in kvlab.overlap.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from .tracefmt.nsys import NsysUnavailable, run_nsys
from .parse import OneLineParser  # its errors in one line, as every kvlab command's
from .tracefmt import GPU_KINDS, REGION, TraceError, capture, load, summarize

__all__ = ["trace_handoff", "HandoffTrace", "event_table", "event_handoff", "EventTimeline", "trace_main"]


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
    extra: send_mode (kvlab.sends.LayerwiseSend's mode: "flag", "staged", "event", "thread" or "cpu") and
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
        """Tracing overhead per variant: median wall with and without the profiler (+ ranges), and the
        difference as a percentage of the untraced median (goal: ≤ 5 % of prefill)."""
        from .overlap_report import tracing_overhead

        return tracing_overhead(self.walls)


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
    sender = t.layerwise(src, send_mode)  # send_mode: see kvlab.sends.LayerwiseSend
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

    from .steps import check_request
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

    parser = OneLineParser(prog="kvlab trace", description=trace_main.__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    p_nsys = sub.add_parser("nsys", help="profile COMMAND (after --) with Nsight Systems",
                            description="Profile COMMAND (after --) with Nsight Systems (CUDA + NVTX) and print a "
                                        "summary of its timeline; needs nsys on PATH and a machine where it can "
                                        "make reports (exit 3 says why not otherwise).")
    p_nsys.add_argument("--out", default="nsys-trace", help="output folder (default: ./nsys-trace)")
    p_nsys.add_argument("--name", default="nsys", help="report name inside --out")
    p_nsys.add_argument("--capture-range", default="cudaProfilerApi", choices=["cudaProfilerApi", "none"],
                        help="cudaProfilerApi: record inside kvlab.trace.profiler_range() only; none: all")
    p_load = sub.add_parser("load", help="read a Kineto .json(.gz) or nsys .sqlite and summarise it",
                            description="Read a timeline — a torch.profiler (Kineto) trace, .json or .json.gz, or an "
                                        "Nsight Systems .sqlite export — into kvlab's events table and print a "
                                        "summary by kind and stream.\n\n"
                                        "Example: kvlab trace load examples/trace_tiny_cpu.json.gz",
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    p_load.add_argument("file", help="the trace file (.json, .json.gz or .sqlite)")
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
