"""A per-layer timeline of a layer-wise handoff from CUDA events alone, without a profiler (`event_handoff`):
one event per layer at its signal on the compute stream, one before and after each layer's copy on the copy
stream, in rounds interleaved with the same send untimed so the events' own cost is measured.

torch.profiler's host work lands on prefill's critical path when prefill is host-bound (1k tokens); these
events do not, so this coarser timeline can be held to the ≤ 5 % goal where the traced pair cannot.
`event_table` turns the event times into the per-layer table (pure).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from ...hooks import LayerHooks
from ...kvcache import KVBuffer, layout_for
from ...steps import check_request, make_prompt, model_device, prefill_or_abort, time_layerwise_round, warm_prefill
from ...timing import schedule, sync_device
from ...transfer import Transport
from .summaries import event_overhead

__all__ = ["event_table", "EventTimeline", "event_handoff"]


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
    overhead = event_overhead(df)
    mid = sorted(kept, key=lambda o: o["prefill_ms"])[(len(kept) - 1) // 2]
    layers = event_table(mid["kv"], mid["cs"], mid["ce"], mid["prefill_ms"], layout.bytes_per_layer)
    mode = f"{timed.mode}, signal from the {hooks_timed.point}"
    del plain, timed, t, src
    return EventTimeline(df, layers, overhead, mid["prefill_ms"], mode, layout.bytes_per_layer)
