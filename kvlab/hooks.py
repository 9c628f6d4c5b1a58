"""Per-layer signals: the points where a layer's K and V become final, with trace ranges.

`LayerHooks(model, on_kv_ready, point=...)` calls `on_kv_ready(i)` as soon as layer i's K and V writes
are queued on the compute stream, so a copy queued behind that point reads final bytes. Two points:

  "cache"      (default) from kvlab's KV arena itself: the prefill cache (KVBuffer.as_hf_cache) calls
               back right after it has queued layer i's K and V writes — before layer i's attention
               kernel even runs — and no module hook is installed. Pass `hooks.cache_callback` to the
               prefill (kvlab.steps.prefill(..., hooks=hooks) does it).
  "attention"  a forward hook on layer i's attention module (any cache): half a layer later, and every
               hooked module then takes PyTorch's slower hook-dispatch path, which costs host time at
               short contexts (kvlab.studies.handoff.experiment.attribute_extra prices it).
Either way the MLP of layer i runs while layer i's K and V are already on the wire.

Ranges: with `ranges=True` every decoder layer is wrapped in a range named `kvlab/layer{i}` and every
send in `kvlab/send{i}` (torch.profiler record_function and, on a GPU, NVTX), carrying the layer index
and the bytes sent, so Kineto/Perfetto and Nsight Systems timelines show them. Ranges cost host time
(a few µs each), and at 1k tokens prefill is bound by the host launching kernels, so the default is
"auto": on while torch.profiler is recording or when KVLAB_RANGES=1 (kvlab's nsys wrapper sets it).

Host cost: `host_ns` sums the host time spent inside the hook callbacks (perf_counter_ns around each
call), so the price of layer-wise sending at short contexts is measured directly.
"""

from __future__ import annotations

import os
import time

import torch

__all__ = ["LayerHooks", "decoder_layers", "ranges_wanted", "POINTS"]

POINTS = ("cache", "attention")


def decoder_layers(model) -> list:
    """The decoder layer modules of a transformers causal LM, in order."""
    inner = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"cannot find decoder layers on {type(model).__name__}: expected .model.layers")
    return list(layers)


def ranges_wanted() -> bool:
    """Whether trace ranges should be on: torch.profiler is recording, or KVLAB_RANGES=1."""
    if os.environ.get("KVLAB_RANGES", "") == "1":
        return True
    try:
        return bool(torch.autograd.profiler._is_profiler_enabled)
    except AttributeError:
        return False


class _Range:
    """A reusable begin/end range: record_function always, NVTX on a GPU build."""

    def __init__(self, name: str, args: str = ""):
        self.name, self.args = name, args
        self.handle = None
        self.nvtx = torch.cuda.is_available()

    def begin(self):
        self.handle = torch.ops.profiler._record_function_enter_new(self.name, self.args or None)
        if self.nvtx:
            torch.cuda.nvtx.range_push(self.name)

    def end(self):
        if self.nvtx:
            torch.cuda.nvtx.range_pop()
        torch.ops.profiler._record_function_exit._RecordFunction(self.handle)
        self.handle = None


class LayerHooks:
    """Install hooks on every decoder layer; use as a context manager.

    on_kv_ready(i) is called when layer i's K and V are final (see the module docstring for `point`).
    bytes_per_layer: recorded in the send ranges' args.
    cache_callback: with point="cache" and a callback, the callable the prefill cache must call with the
    layer index once that layer's K and V writes are queued (None otherwise).
    clock: record a timing event (GPU) and the host clock at every signal (`kv_events`, `kv_host_ns`).
    """

    def __init__(self, model, on_kv_ready=None, ranges: bool | str = "auto", bytes_per_layer: int = 0,
                 point: str = "cache", clock: bool = False):
        if point not in POINTS:
            raise ValueError(f"unknown hook point {point!r}; valid: {list(POINTS)}")
        self.model = model
        self.layers = decoder_layers(model)
        self.on_kv_ready = on_kv_ready
        self.point = point
        self.ranges = ranges_wanted() if ranges == "auto" else bool(ranges)
        self.bytes_per_layer = bytes_per_layer
        self.host_ns = 0
        self.calls = 0
        self._handles = []
        self._signals = None
        # clock=True: a timing event on the compute stream at every signal (GPU; about a microsecond of
        # host time each), and the host clock beside it, for kvlab.studies.overlap_timeline.events.event_handoff
        self.clock = bool(clock)
        self.kv_events = None
        self.kv_host_ns = [0] * len(self.layers)
        if self.clock and torch.cuda.is_available():
            self.kv_events = [torch.cuda.Event(enable_timing=True) for _ in self.layers]
        if self.ranges:
            n = len(self.layers)
            self._layer_ranges = [_Range(f"kvlab/layer{i}", f"layer={i}") for i in range(n)]
            self._send_ranges = [_Range(f"kvlab/send{i}", f"layer={i} bytes={self.bytes_per_layer}")
                                 for i in range(n)]
        if on_kv_ready is not None:
            self._signals = [self._signal(i) for i in range(len(self.layers))]
        self._installed = False

    @property
    def cache_callback(self):
        """For point="cache": call with layer i when its K and V writes are queued (None when there is
        nothing to signal, or when the point is "attention"). Counts only while installed."""
        if self.point != "cache" or self._signals is None:
            return None
        return self._cache_signal

    def _cache_signal(self, i: int) -> None:
        if self._installed:
            self._signals[i]()

    def install(self) -> "LayerHooks":
        if self._installed:
            return self
        for i, layer in enumerate(self.layers):
            attn = getattr(layer, "self_attn", None) or getattr(layer, "attention", None) or layer
            if self.ranges:
                self._handles.append(layer.register_forward_pre_hook(self._layer_begin(i)))
                self._handles.append(layer.register_forward_hook(self._layer_end(i)))
            if self._signals is not None and self.point == "attention":
                sig = self._signals[i]
                self._handles.append(attn.register_forward_hook(lambda module, args, output, sig=sig: sig()))
        self._installed = True
        return self

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._installed = False

    def reset_counters(self) -> None:
        self.host_ns = 0
        self.calls = 0

    def __enter__(self):
        return self.install()

    def __exit__(self, *exc):
        self.remove()

    def _layer_begin(self, i):
        r = self._layer_ranges[i]

        def pre(module, args):
            t0 = time.perf_counter_ns()
            r.begin()
            self.host_ns += time.perf_counter_ns() - t0

        return pre

    def _layer_end(self, i):
        r = self._layer_ranges[i]

        def post(module, args, output):
            t0 = time.perf_counter_ns()
            r.end()
            self.host_ns += time.perf_counter_ns() - t0

        return post

    def _signal(self, i):
        """Layer i's signal: the callback, its host time counted, inside a send range when ranges are on."""
        cb = self.on_kv_ready
        if self.clock:
            inner = cb
            ev = self.kv_events[i] if self.kv_events is not None else None
            host = self.kv_host_ns

            def cb(i):
                if ev is not None:
                    ev.record()
                host[i] = time.perf_counter_ns()
                inner(i)
        if self.ranges:
            r = self._send_ranges[i]

            def signal():
                t0 = time.perf_counter_ns()
                r.begin()
                cb(i)
                r.end()
                self.calls += 1
                self.host_ns += time.perf_counter_ns() - t0
        else:
            def signal():
                t0 = time.perf_counter_ns()
                cb(i)
                self.calls += 1
                self.host_ns += time.perf_counter_ns() - t0

        return signal
