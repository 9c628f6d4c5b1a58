"""Layer-wise sending: how each layer's K and V leave as soon as prefill has written them.

`LayerwiseSend` (built by kvlab.transfer.Transport.layerwise) sends layer i when the per-layer signal says
it is final — by copies armed before prefill behind a flag the signal writes (`FlagWriter`, one driver call a
layer), by an event and a copy launched from the signal, or through a worker thread for pageable host memory.
Send policies (`release_plan`: eager, batch:N, deadline) say when each layer may go. `HookCostProbe` and
`signal_costs` price the signal alone; `wake_groups` plans when a staged worker wakes.
"""

from __future__ import annotations

import ctypes
import queue
import threading
import time

import torch

from .exposure import deadline_release
from .kvcache import KVBuffer
from .landing import Landing, dst_stream_context

__all__ = ["LayerwiseSend", "FlagWriter", "HookCostProbe", "signal_costs", "WAKE_PLANS", "wake_groups",
           "stream_memops_available", "POLICIES", "check_policy", "release_plan"]


class LayerwiseSend:
    """Sends layer i as soon as the hook says it is final, on the transport's copy stream.

    Modes (chosen by `mode="auto"`):
      "flag"   (GPU destinations and pinned host, when cuda-bindings offers stream memory operations)
               `arm()` queues, before prefill, every layer's copy on the copy stream, each behind a
               cuStreamWaitValue32 on a flag in device memory; the hook for layer i is then a single
               cuStreamWriteValue32 on the compute stream (one driver call). A generation
               counter makes the flag monotonic, so a new request never sees an old request's value.
      "event"  the hook records an event on the compute stream, makes the copy stream wait on it and
               launches the layer's copy (four host calls a layer — seed 004's hook; at 1k tokens the
               GPU then waits for the host, see notebook 03 with send_mode="event").
      "staged" (pageable host, with stream memory operations) the flag mode into a pinned staging
               buffer, and a worker thread (started by `arm()`, before the request) that waits for the
               staging copies and moves them into the pageable destination with a plain host memcpy. The
               driver never sees pageable memory, so nothing it does for that copy can stall prefill's
               kernel launches. Each time the worker wakes it needs the GIL, which the host thread
               launching prefill's kernels then waits for; `wakes` says how often it wakes:
               "halving" (default) wakes after layers L/2, 3L/4, 7L/8, … and then after each of the
               last layers — six wakes for 28 layers, and the last layer still moves alone, so
               nothing more is left after prefill than with per-layer wakes; "layer" wakes once per
               layer (28 wakes for Qwen2.5-7B).
      "thread" (pageable host, fallback) the driver blocks the calling thread for a copy to pageable
               memory, so the hook records an event and hands the layer to a worker thread that issues the
               copy; the driver's pageable copy then runs while prefill launches kernels, which "staged"
               avoids.
      "cpu"    a CPU-only machine: synchronous copies.
    Everything (events, views, the destination buffer) is prepared before prefill starts.

    timeline=True (GPU; flag, staged and event modes): a timing event is recorded on the copy stream right
    before each layer's copy (`copy_start[i]`; its end is the transport's completion event), so
    kvlab.studies.overlap_timeline.events.event_handoff can place every copy without the profiler. In flag and staged modes the
    events are queued by arm(), so they cost prefill no host time at all.

    release: when each layer may go (the send policy; see `release_plan`): release[i] is the layer whose
    signal lets layer i's copy start, ≥ i. None = [0, 1, …, L-1], every layer at its own signal ("eager").
    A held layer waits in stream order behind the copies before it, so layers still land in order.
    Flag, event and cpu modes take any plan; staged and thread modes (pageable host) only "eager".

    Flag and staged modes: run the model once with nothing armed before the first armed request of a
    process (kvlab.steps.warm_prefill). On our H200 a tiny model's first bf16 prefill behind an armed
    copy stream never returned — with CUDA_MODULE_LOADING=EAGER as well, so not lazy kernel loading, and
    with no synchronisation torch's sync-debug mode reports; the watchdog below did not release it either
    (data/probes/armed_first_prefill). After one unarmed prefill the same request took 1 s.
    """

    _landing = None  # the current send's Landing, from begin() on

    def __init__(self, transport, src: KVBuffer, mode: str = "auto", wakes: str = "halving",
                 timeline: bool = False, release: "list[int] | None" = None):
        self.t = transport
        L = transport.layout.layers
        self.layers = L
        if wakes not in WAKE_PLANS:
            raise ValueError(f"unknown wake plan {wakes!r}; valid: {list(WAKE_PLANS)}")
        self.wakes = wakes
        self.groups = wake_groups(L, wakes)
        self.release = _check_release(release, L)
        # the layers whose copies each layer's signal starts (event and cpu modes issue them there)
        self._released_by = [[i for i in range(L) if self.release[i] == j] for j in range(L)]
        self._src = [src.data[i] for i in range(L)]
        self._dst = [transport.buffer.data[i] for i in range(L)]
        self.cuda = transport.cuda
        self.mode = self._choose_mode(mode)
        if self.mode in ("staged", "thread") and self.release != list(range(L)):
            raise ValueError(f"a send policy other than 'eager' needs a GPU destination or pinned host (flag or "
                             f"event mode); this send to {transport.dest.label} runs in {self.mode!r} mode")
        self.host_done_ns = 0  # staged mode: when the worker finished the last host memcpy
        if self.mode == "staged":
            self._staging = transport.staging()
            self._stage = [self._staging.data[i] for i in range(L)]
        if self.cuda:
            self._ready = [torch.cuda.Event() for _ in range(L)]
            self._done = transport._events
        if timeline and self.mode not in ("flag", "staged", "event"):
            raise ValueError(f"timeline=True needs a GPU send in flag, staged or event mode; this one is "
                             f"{self.mode!r}")
        self.copy_start = [torch.cuda.Event(enable_timing=True) for _ in range(L)] if timeline else None
        if self.mode in ("flag", "staged"):
            from cuda.bindings import driver as cu

            self._cu = cu
            self._flag = torch.zeros(1, dtype=torch.int32, device=transport.src_device)
            self._ptr = cu.CUdeviceptr(self._flag.data_ptr())
            self._write = FlagWriter(self._flag)
            self._gen = 0
            # a stream of its own for releasing the flag from the watchdog thread
            self._release_stream = torch.cuda.Stream(device=transport.src_device)
        self._armed = False
        self._watchdog: threading.Timer | None = None
        self.watchdog_s = 60.0
        self.timed_out = False
        self._queue: queue.SimpleQueue | None = None
        self._worker: threading.Thread | None = None
        self._compute = None
        self.sent = 0
        self.arm_host_ns = 0

    def _choose_mode(self, mode: str) -> str:
        modes = ("auto", "flag", "event", "staged", "thread", "cpu")
        if mode not in modes:
            raise ValueError(f"unknown layer-wise mode {mode!r}; valid: {list(modes)}")
        if not self.cuda:
            return "cpu"
        if self.t.dest.kind == "pageable":
            if mode in ("auto", "staged") and stream_memops_available(self.t.src_device):
                return "staged"
            return "thread"
        if mode in ("flag", "auto") and stream_memops_available(self.t.src_device):
            return "flag"
        if mode == "flag":
            raise ValueError("layer-wise mode 'flag' needs cuda-bindings and stream memory operations; "
                             "use mode='event'")
        return "event"

    # -- the "flag" mode's preparation ---------------------------------------------------------------
    def arm(self) -> "LayerwiseSend":
        """Queue every layer's copy behind its flag value (flag mode; a no-op otherwise). Host time is
        recorded in `arm_host_ns`: it is spent before prefill starts, like preparing a transfer list."""
        if self.mode not in ("flag", "staged") or self._armed:
            return self
        t0 = time.perf_counter_ns()
        cu = self._cu
        L = self.layers
        self._gen += 1
        if (self._gen + 1) * L >= 2**31 - 1:  # keep the counter inside int32; reset once in a long while
            torch.cuda.synchronize(self.t.src_device)
            self._flag.zero_()
            torch.cuda.synchronize(self.t.src_device)
            self._gen = 1
        self._base = self._gen * L
        stream = self.t.stream
        handle = cu.CUstream(stream.cuda_stream)
        geq = cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
        with torch.cuda.stream(stream), dst_stream_context(self.t.dst_stream):
            for i in range(L):
                (err,) = cu.cuStreamWaitValue32(handle, self._ptr, self._base + self.release[i] + 1, geq)
                if err != cu.CUresult.CUDA_SUCCESS:
                    raise RuntimeError(f"cuStreamWaitValue32 failed: {err}")
                if self.copy_start is not None:
                    self.copy_start[i].record(stream)
                target = self._stage[i] if self.mode == "staged" else self._dst[i]
                target.copy_(self._src[i], non_blocking=True)
                self._done[i].record(stream)
        self._armed = True
        if self.mode == "staged":
            self._start_worker()
        # Insurance against a deadlock: anything that synchronises the whole device between arm() and the
        # last hook (a cudaFree when the caching allocator runs short, a stray torch.cuda.synchronize) would
        # wait for copies that wait for flags the stalled host never writes. After watchdog_s the flag is
        # released from another thread, the sync returns, and finish() reports the send as failed.
        self.timed_out = False
        self._watchdog = threading.Timer(self.watchdog_s, self._expire)
        self._watchdog.daemon = True
        self._watchdog.start()
        self.arm_host_ns = time.perf_counter_ns() - t0
        return self

    def _expire(self) -> None:
        self.timed_out = True
        self._cu.cuStreamWriteValue32(self._cu.CUstream(self._release_stream.cuda_stream), self._ptr,
                                      self._base + self.layers, 0)

    def _release(self) -> None:
        """Let an armed copy stream run to the end (after an error), so nothing waits forever."""
        if self.mode in ("flag", "staged") and self._armed:
            self._cancel_watchdog()
            self._cu.cuStreamWriteValue32(self._cu.CUstream(self._release_stream.cuda_stream), self._ptr,
                                          self._base + self.layers, 0)
            self._armed = False

    def _cancel_watchdog(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

    # -- per request ---------------------------------------------------------------------------------
    def begin(self) -> "LayerwiseSend":
        """Call right before prefill: captures the compute stream (arms, or starts the worker, if needed). The
        destination's next send starts here: its Landing is in flight until every layer has landed."""
        self.sent = 0
        self._landing = self.t.new_landing(list(self._done) if self.cuda else None).start_issuing()
        if self.cuda:
            self._compute = torch.cuda.current_stream(self.t.src_device)
            if self.mode in ("flag", "staged"):
                self.arm()
                self._write.bind(self._compute)
            if self.t.dst_stream is not None and self.mode not in ("flag", "staged"):
                self._saved_dst_stream = torch.cuda.current_stream(self.t.dest.device)
                torch.cuda.set_stream(self.t.dst_stream)
                torch.cuda.set_stream(self._compute)
        if self.mode == "thread":
            self._start_worker()
        if self.mode in ("thread", "staged") and self._worker is not None:
            self._landing.worker = self._worker
            self._landing.landed_layers = 0
        return self

    def _start_worker(self) -> None:
        self._queue = queue.SimpleQueue()
        target = self._drain_staged if self.mode == "staged" else self._drain
        self._worker = threading.Thread(target=target, name="kvlab-pageable-send", daemon=True)
        self._worker.start()  # begin() ties it to the request's Landing (arm() may start it first)

    def on_layer(self, i: int) -> None:
        """Layer i's K and V are final on the compute stream: send them. Each layer exactly once, 0 … L-1."""
        if self._landing is None:
            raise RuntimeError("layer-wise send: on_layer() before begin(); call begin() right before prefill")
        i = self._landing.issue(i)
        self.sent += 1
        mode = self.mode
        if mode == "flag" or mode == "staged":
            err = self._write(self._base + i + 1)
            if err:
                self._release()
                raise RuntimeError(f"cuStreamWriteValue32 failed for layer {i}: {err}")
            return
        if mode == "cpu":
            for k in self._released_by[i]:
                self._dst[k].copy_(self._src[k])
            return
        ready = self._ready[i]
        ready.record(self._compute)
        if mode == "thread":
            self._queue.put(i)
            return
        group = self._released_by[i]
        if not group:
            return
        stream = self.t.stream
        stream.wait_event(ready)
        torch.cuda.set_stream(stream)
        for k in group:
            if self.copy_start is not None:
                self.copy_start[k].record(stream)
            self._dst[k].copy_(self._src[k], non_blocking=True)
            self._done[k].record(stream)
        torch.cuda.set_stream(self._compute)

    def _drain(self) -> None:
        torch.cuda.set_device(self.t.src_device)
        stream = self.t.stream
        with torch.cuda.stream(stream):
            for _ in range(self.layers):
                i = self._queue.get()
                if i < 0:  # aborted
                    return
                stream.wait_event(self._ready[i])
                self._dst[i].copy_(self._src[i])  # blocks this thread until the bytes are in host memory
                self._done[i].record(stream)
                self._landing.landed_layers = i + 1

    def _drain_staged(self) -> None:
        dst, stage = self.t.buffer.data, self._staging.data
        for first, last in self.groups:
            self._done[last].synchronize()  # layers first…last are in pinned staging (GIL released while waiting)
            if not self._queue.empty() and self._queue.get() < 0:  # aborted
                return
            dst[first:last + 1].copy_(stage[first:last + 1])  # one host memcpy, GIL released
            self._landing.landed_layers = last + 1
        self.host_done_ns = time.perf_counter_ns()

    def abort(self, why: str = "aborted") -> None:
        """Prefill failed: unblock whatever waits (copy stream, worker) and mark the send aborted, so the
        destination is refused until a later send lands (a layer already released may be half written too:
        every layer counts as missing unless it is known to have landed)."""
        self._release()
        if self.mode in ("thread", "staged") and self._worker is not None and self._worker.is_alive():
            self._queue.put(-1)
            self._worker.join()
        landing = getattr(self, "_landing", None)
        if landing is not None:
            landing.abort_issuing(why)

    def finish(self) -> Landing:
        """After prefill returns: the Landing of this send (layers not yet landed are still in flight)."""
        if self._landing is None:
            raise RuntimeError("layer-wise send: finish() before begin(); call begin() right before prefill")
        if self.sent != self.layers:
            missing = self._landing.unissued
            self.abort()
            self._landing.fail(missing, f"the send saw {self.sent} of {self.layers} layers")
            raise RuntimeError(f"layer-wise send saw {self.sent} of {self.layers} layers (missing {missing}): were "
                               "the hooks installed, and — for LayerHooks(point='cache') — passed to the prefill "
                               "(kvlab.steps.prefill(..., hooks=hooks)) so the KV arena can signal?")
        self._armed = False
        self._cancel_watchdog()
        if self.timed_out:
            self._landing.fail(range(self.layers), "released by the watchdog")
            raise RuntimeError(f"layer-wise send: the armed copies were released by the watchdog after "
                               f"{self.watchdog_s:.0f} s (something synchronised the device mid-prefill); "
                               "the destination may hold stale layers")
        if self.cuda and self.t.dst_stream is not None and self.mode not in ("flag", "staged"):
            torch.cuda.set_stream(self._saved_dst_stream)
            torch.cuda.set_stream(self._compute)
        return self._landing.end_issuing()


_LIBCUDA_WRITE = []  # [function or None], resolved once


def _libcuda_write32():
    """libcuda's cuStreamWriteValue32_v2 through ctypes, or None where it cannot be had (no Linux libcuda,
    an old driver): the fallback for machines without cuda-bindings."""
    if not _LIBCUDA_WRITE:
        fn = None
        try:
            fn = ctypes.CDLL("libcuda.so.1").cuStreamWriteValue32_v2
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
            fn.restype = ctypes.c_int
        except (OSError, AttributeError):
            fn = None
        _LIBCUDA_WRITE.append(fn)
    return _LIBCUDA_WRITE[0]


def _have_cuda_bindings() -> bool:
    try:
        from cuda.bindings import driver  # noqa: F401
    except Exception:
        return False
    return True


class FlagWriter:
    """Write a value into a 32-bit device flag in stream order: cuStreamWriteValue32 on a bound stream.
    Calling it returns the CUresult as an int (0 = success). The hot path of a flag-mode send.

    api: "cuda-bindings" (NVIDIA's Python bindings), "ctypes" (libcuda directly), or "auto" — cuda-bindings
    when installed, else ctypes. On our H200 one call cost 1.6 µs of host time through cuda-bindings and
    2.1 µs through ctypes (kvlab.sends.signal_costs; data/signal_costs/20261129-102536-h200), so the
    bindings are the default and ctypes only stands in where they are missing.
    """

    def __init__(self, flag: torch.Tensor, api: str = "auto"):
        if api not in ("auto", "ctypes", "cuda-bindings"):
            raise ValueError(f"unknown flag-write api {api!r}; valid: ['auto', 'ctypes', 'cuda-bindings']")
        self._addr = flag.data_ptr()
        if api == "auto":
            api = "cuda-bindings" if _have_cuda_bindings() else "ctypes"
        fn = _libcuda_write32() if api == "ctypes" else None
        if api == "ctypes" and fn is None:
            raise ValueError("api='ctypes' needs libcuda.so.1 with cuStreamWriteValue32_v2; use 'cuda-bindings'")
        self.api = api
        self._fn = fn
        if fn is None:
            from cuda.bindings import driver as cu

            self._cu = cu
            self._ptr = cu.CUdeviceptr(self._addr)
        self._stream = None

    def bind(self, stream) -> "FlagWriter":
        """The stream the writes go to (a torch.cuda.Stream)."""
        if self._fn is not None:
            self._stream = stream.cuda_stream
        else:
            self._stream = self._cu.CUstream(stream.cuda_stream)
        return self

    def __call__(self, value: int) -> int:
        if self._fn is not None:
            return self._fn(self._stream, self._addr, value, 0)
        (err,) = self._cu.cuStreamWriteValue32(self._stream, self._ptr, value, 0)
        return int(err)


class HookCostProbe:
    """The host side of a flag-mode send without the send: per layer, the same driver call
    (cuStreamWriteValue32 on the compute stream, through the same FlagWriter) to a flag that nothing
    waits on, and no copies.

    Prefill with this signal minus plain prefill is the price of signalling; layer-wise minus this is
    the price of the copies (kvlab.studies.handoff.experiment.attribute_extra). GPU with stream memory operations only.
    """

    def __init__(self, device):
        self.device = torch.device(device)
        self._flag = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._write = FlagWriter(self._flag)
        self._value = 0

    def begin(self) -> "HookCostProbe":
        self._write.bind(torch.cuda.current_stream(self.device))
        return self

    def on_layer(self, i: int) -> None:
        self._value = (self._value + 1) & 0x3FFFFFFF
        err = self._write(self._value)
        if err:
            raise RuntimeError(f"cuStreamWriteValue32 failed for layer {i}: CUresult {err}")


def _counting(write):
    value = [0]

    def call():
        value[0] = (value[0] + 1) & 0x3FFFFFFF
        return write(value[0])

    return call


def signal_costs(device=None, calls: int = 2000) -> dict:
    """Host µs per call of the per-layer signals a layer-wise send could use, on `device` (GPU only):
    cuStreamWriteValue32 through ctypes and through cuda-bindings, torch.cuda.Event.record, and a
    one-element fill_ kernel launch. Medians of `calls` calls each, timed with perf_counter_ns.
    Nothing waits on the flag; the stream is synchronised between the kinds."""
    dev = torch.device(device) if device is not None else torch.device("cuda")
    flag = torch.zeros(1, dtype=torch.int32, device=dev)
    stream = torch.cuda.current_stream(dev)
    ev = torch.cuda.Event()
    kinds = {}
    for api in ("ctypes", "cuda-bindings"):
        try:
            w = FlagWriter(flag, api).bind(stream)
        except (ValueError, ImportError):
            continue
        kinds[f"cuStreamWriteValue32 ({api})"] = _counting(w)
    kinds["torch.cuda.Event.record"] = lambda: ev.record(stream)
    kinds["fill_ kernel"] = lambda: flag.fill_(1)
    out = {}
    for name, fn in kinds.items():
        torch.cuda.synchronize(dev)
        for _ in range(50):
            fn()
        t = []
        for _ in range(calls):
            t0 = time.perf_counter_ns()
            fn()
            t.append(time.perf_counter_ns() - t0)
        torch.cuda.synchronize(dev)
        t.sort()
        out[name] = t[len(t) // 2] / 1e3
    return out


POLICIES = ("eager", "deadline", "batch:N")


def _check_release(release, layers: int) -> list[int]:
    if release is None:
        return list(range(layers))
    out = list(release)
    if len(out) != layers or any(isinstance(r, bool) or not isinstance(r, int) for r in out):
        raise ValueError(f"release must list one int per layer ({layers}), got {release!r}")
    bad = [i for i, r in enumerate(out) if not i <= r < layers]
    if bad:
        i = bad[0]
        raise ValueError(f"release[{i}] = {out[i]}: a layer can only be released by its own signal or a later "
                         f"one, i.e. a value in {i}…{layers - 1}")
    return out


def check_policy(policy) -> str:
    """The policy's canonical name ("eager", "deadline" or "batch:N" with N ≥ 1), or ValueError naming what
    is valid. Whether N fits the model's layers is checked by release_plan, which knows them."""
    p = str(policy).strip().lower()
    if p in ("eager", "deadline"):
        return p
    if p.startswith("batch:"):
        n = p.split(":", 1)[1]
        if n.isdigit() and int(n) >= 1:
            return f"batch:{int(n)}"
        raise ValueError(f"policy {policy!r}: N must be an int ≥ 1 (the number of releases), e.g. 'batch:4'")
    raise ValueError(f"unknown send policy {policy!r}; valid: 'eager', 'deadline', 'batch:N' (N releases)")


def release_plan(policy: str, layers: int, *, compute_ms: float | None = None,
                 transfer_ms: float | None = None, margin: float = 2.0) -> list[int]:
    """A send policy as a release plan for LayerwiseSend: release[i] = the layer whose signal starts layer i's copy.

    policy:
      "eager"     every layer at its own signal (seed 004's way; the default).
      "batch:N"   N releases: the layers go in N groups of about L/N, each at the signal of its last layer.
      "deadline"  hold every copy as long as the prefill time left still covers the transfer time left: the
                  latest layer r such that sending layers 0…r at r's end, then each later layer at its own
                  end, exposes no more than eager sending would with every transfer `margin` times slower
                  than modelled (kvlab.exposure.deadline_release). With layers of equal compute that is
                  r = L-2 whenever the whole transfer fits under one layer's compute (Qwen2.5-7B over
                  NVLink at 1k-32k: layers 0-26 go at layer 26's signal, 27 at its own). Needs compute_ms (one layer's prefill
                  time, ms) and transfer_ms (one layer's send time, ms), e.g. this run's prefill / L and one
                  layer's copy timed alone.
    Raises ValueError for an unknown policy, a bad N, or a deadline without its two times.
    """
    p = check_policy(policy)
    if p == "eager":
        return list(range(layers))
    if p.startswith("batch:"):
        n = int(p.split(":", 1)[1])
        if n > layers:
            raise ValueError(f"policy {policy!r}: N must be an int in 1…{layers} (the number of releases; the "
                             f"model has {layers} layers)")
        ends = [round((k + 1) * layers / n) - 1 for k in range(n)]
        return [next(e for e in ends if e >= i) for i in range(layers)]
    if p == "deadline":
        if compute_ms is None or transfer_ms is None or not compute_ms > 0 or not transfer_ms >= 0:
            raise ValueError("policy 'deadline' needs compute_ms > 0 (one layer's prefill time) and transfer_ms "
                             f"≥ 0 (one layer's send time); got compute_ms={compute_ms!r}, transfer_ms={transfer_ms!r}")
        r = deadline_release([compute_ms / 1e3] * layers, [transfer_ms / 1e3] * layers, margin=margin)
        return [max(i, r) for i in range(layers)]
    raise AssertionError(p)  # check_policy admits nothing else


WAKE_PLANS = ("halving", "layer")


def wake_groups(layers: int, plan: str = "halving") -> list[tuple[int, int]]:
    """When a staged send's worker wakes: a list of (first, last) layer ranges, in order, covering every
    layer once. "layer": one range per layer. "halving": ranges ending at ⌈L/2⌉, ⌈3L/4⌉, … until one
    layer is left per range, e.g. 28 layers → (0–13) (14–20) (21–23) (24–25) (26) (27): six wakes."""
    if plan == "layer":
        return [(i, i) for i in range(layers)]
    if plan != "halving":
        raise ValueError(f"unknown wake plan {plan!r}; valid: {list(WAKE_PLANS)}")
    out, first = [], 0
    while first < layers:
        size = max(1, (layers - first) // 2)
        out.append((first, first + size - 1))
        first += size
    return out


def stream_memops_available(device) -> bool:
    """Whether cuda-bindings is importable and the device supports cuStreamWaitValue32."""
    try:
        from cuda.bindings import driver as cu
    except ImportError:
        return False
    index = torch.device(device).index or 0
    err, value = cu.cuDeviceGetAttribute(
        cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR, index)
    return err == cu.CUresult.CUDA_SUCCESS and bool(value)
