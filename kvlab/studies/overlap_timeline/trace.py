"""The traced pair: a colocated and a layer-wise prefill of the same prompt, each under torch.profiler
(`trace_handoff`), with untraced rounds beside them so the profiler's own cost is measured.

Measurement only: the events tables it returns are read by kvlab.tracefmt; the analysis of a traced pair
(decomposition, backlog, charts) is in this package's decomposition, findings and report modules.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch

from ...hooks import LayerHooks
from ...kvcache import KVBuffer, layout_for
from ...steps import (make_prompt, model_device, prefill, prefill_or_abort, request_wall, time_copy,
                      time_plain_copy)
from ...timing import schedule
from ...tracefmt import REGION, capture
from ...transfer import Destination, Transport
from .summaries import tracing_overhead

__all__ = ["trace_handoff", "HandoffTrace"]


@dataclass
class HandoffTrace:
    """What trace_handoff measured. Times in ms unless a name says ns.

    colocated, layerwise: events tables of the kept repeat (the layer-wise trace with the median
        traced wall, and the colocated trace of the same round).
    walls: tidy, one row per (variant, traced, repeat): wall_ms, prefill_ms, exposed_ms.
        Colocated wall = prefill; layer-wise wall = prefill + max(exposed, 0), exposed = last layer
        landed − prefill done (as kvlab.studies.handoff measures it).
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
    (the clock term of this package's decomposition.decompose). The samples are in `extra["clock_samples"]`.
    """
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
                # it as lead-in (kvlab.studies.handoff arms before its clock starts and reports the arm time apart)
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
    # the first of each is a warm-up; timed as kvlab.studies.handoff times its copies: the copy stream held while
    # the host queues the copy, the end event recorded right behind it (not after a host round trip)
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
