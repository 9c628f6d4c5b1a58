"""Per-layer forward hooks: the points where a layer's K and V become final, with trace ranges.

`LayerHooks(model, on_kv_ready)` calls `on_kv_ready(i)` as soon as decoder layer i's attention has
returned — its cache update (the K and V write) is queued by then, so a copy queued behind an event
recorded at that point reads final bytes. That is half a layer earlier than a hook on the whole
decoder layer: the MLP of layer i runs while layer i's K and V are already on the wire.

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

__all__ = ["LayerHooks", "decoder_layers", "ranges_wanted"]


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

    on_kv_ready(i) is called when layer i's K and V are final (after its attention module returns).
    bytes_per_layer: recorded in the send ranges' args.
    """

    def __init__(self, model, on_kv_ready=None, ranges: bool | str = "auto", bytes_per_layer: int = 0):
        self.model = model
        self.layers = decoder_layers(model)
        self.on_kv_ready = on_kv_ready
        self.ranges = ranges_wanted() if ranges == "auto" else bool(ranges)
        self.bytes_per_layer = bytes_per_layer
        self.host_ns = 0
        self.calls = 0
        self._handles = []

    def install(self) -> "LayerHooks":
        if self._handles:
            return self
        n = len(self.layers)
        if self.ranges:
            self._layer_ranges = [_Range(f"kvlab/layer{i}", f"layer={i}") for i in range(n)]
            self._send_ranges = [_Range(f"kvlab/send{i}", f"layer={i} bytes={self.bytes_per_layer}")
                                 for i in range(n)]
        for i, layer in enumerate(self.layers):
            attn = getattr(layer, "self_attn", None) or getattr(layer, "attention", None) or layer
            if self.ranges:
                self._handles.append(layer.register_forward_pre_hook(self._layer_begin(i)))
                self._handles.append(layer.register_forward_hook(self._layer_end(i)))
            if self.on_kv_ready is not None:
                self._handles.append(attn.register_forward_hook(self._kv_ready(i)))
        return self

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

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

    def _kv_ready(self, i):
        cb = self.on_kv_ready
        if self.ranges:
            r = self._send_ranges[i]

            def hook(module, args, output):
                t0 = time.perf_counter_ns()
                r.begin()
                cb(i)
                r.end()
                self.calls += 1
                self.host_ns += time.perf_counter_ns() - t0
        else:
            def hook(module, args, output):
                t0 = time.perf_counter_ns()
                cb(i)
                self.calls += 1
                self.host_ns += time.perf_counter_ns() - t0

        return hook
