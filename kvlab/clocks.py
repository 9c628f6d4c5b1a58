"""GPU clocks, power and link counters on the host's clock (NVML), and the experiment that asks what
sending a KV cache to a peer GPU costs a prefill that runs at its power cap.

Why this module exists: on 2×H200 over NVLink, sending every layer's K and V to the peer during a 32k
prefill made that prefill tens of ms slower, while the same bytes sent within one GPU cost nothing
measurable; a probe saw the prefill GPU at its power cap and its SM clock lower during such sends. A
profiler timeline shows the symptom (every kernel a little longer, copy or no copy); the clock shows
whether that is the cause. Two tools:

`Sampler` — a thread that reads, every `interval_ms`, each GPU's SM clock, power draw, clock-event
    ("throttle") reasons and NVLink byte counters through NVML (nvidia-ml-py), stamped with
    ``time.perf_counter_ns`` — the clock kvlab's timed rounds already note on the host, so a sample can be
    placed on a CUDA-event timeline whose start was recorded on an idle GPU (`window`, `on_timeline`).
    Without NVML (a CPU machine, no driver) it records nothing and says why (`available`, `why`).

`send_patterns` — one context, colocated prefill against layer-wise sends that differ in one thing each
    (where the bytes go, how many bytes, how often, who issues the copy, copy engine or SMs, and the send
    policies of kvlab.sends.release_plan), in balanced rounds, with the sampler running. Its analysis
    (`pattern_summary`) sets each variant's extra prefill time beside what its lower SM clock alone
    predicts: prefill × (f_colocated / f_variant − 1) — if the two agree across the variants, the clock
    is the cause and the copies themselves are not.

Reasons bits (NVML's clocks-event reasons): 0x4 SW power cap, 0x8 HW slowdown, 0x20 SW thermal,
0x40 HW thermal, 0x80 HW power brake.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

__all__ = ["Sampler", "SAMPLE_COLUMNS", "REASON_BITS", "window", "on_timeline", "PATTERNS", "send_patterns",
           "PatternRun", "pattern_summary", "pattern_findings", "plot_patterns", "plot_clock_timeline"]

SAMPLE_COLUMNS = ["t_ns", "gpu", "sm_mhz", "power_w", "reasons", "power_capped", "nvlink_tx_kib", "nvlink_rx_kib"]

REASON_BITS = {0x1: "gpu idle", 0x2: "application clocks", 0x4: "SW power cap", 0x8: "HW slowdown",
               0x10: "sync boost", 0x20: "SW thermal", 0x40: "HW thermal", 0x80: "HW power brake",
               0x100: "display clocks"}
_POWER_CAP = 0x4
_FI_POWER_INSTANT = 186      # NVML_FI_DEV_POWER_INSTANT (W·1000)
_FI_NVLINK_TX = 138          # NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX (KiB, a running counter per link)
_FI_NVLINK_RX = 139          # NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX
_NVLINKS = 18                # links asked for (scope ids 0…17; an H200 has 18, absent ones return an error)


def _field_value(fv):
    """The number in an nvmlFieldValue_t, or NaN when NVML returned an error for it."""
    if getattr(fv, "nvmlReturn", 1) != 0:
        return float("nan")
    name = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal"}.get(fv.valueType)
    return float(getattr(fv.value, name)) if name else float("nan")


class Sampler:
    """NVML samples of `gpus` (CUDA device indices) every `interval_ms`, in a background thread.

    Use as a context manager or start()/stop(); `samples()` returns the table (SAMPLE_COLUMNS): t_ns
    (perf_counter_ns), gpu (CUDA index), sm_mhz, power_w (instantaneous where the driver offers it, else
    NVML's averaged reading), reasons (bitmask, see REASON_BITS), power_capped (the SW power-cap bit),
    nvlink_tx_kib / nvlink_rx_kib (running counters summed over the links, read every `nvlink_every`-th
    sample and NaN in between; difference two readings for the bytes in between). NVML itself refreshes
    clocks and power only every ~100 ms on our H200s (the readings hold still for that long), so a reading
    is that period's value: sample means over a 1 s prefill are sound, a single kernel's clock is not
    resolved. The interval is a request: `measured_interval_ms()` says what it was (one read of the 36
    NVLink fields takes tens of ms). Sampling holds the GIL for short spells, which a host-bound prefill
    (1k tokens) would feel: sample long prefills, or take a coarser interval.
    """

    def __init__(self, gpus=(0,), interval_ms: float = 5.0, nvlink_every: int = 20):
        if not isinstance(interval_ms, (int, float)) or isinstance(interval_ms, bool) or not interval_ms >= 0.5:
            raise ValueError(f"interval_ms={interval_ms!r}: expected a number ≥ 0.5 (ms between samples)")
        if isinstance(nvlink_every, bool) or not isinstance(nvlink_every, int) or nvlink_every < 1:
            raise ValueError(f"nvlink_every={nvlink_every!r}: expected an int ≥ 1 (samples per NVLink read)")
        self.nvlink_every = nvlink_every
        self._n = 0
        self.gpus = [int(g) for g in gpus]
        self.interval_ms = float(interval_ms)
        self._rows: list[tuple] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.available, self.why = False, ""
        self._nvml = None
        self._handles: list = []
        self.instant_power = False
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handles = [self._handle(g) for g in self.gpus]
            self.available = True
        except Exception as exc:  # no library, no driver, no GPU: the sampler records nothing
            self.why = f"NVML unavailable: {type(exc).__name__}: {exc}"
            return
        try:
            fv = pynvml.nvmlDeviceGetFieldValues(self._handles[0], [_FI_POWER_INSTANT])
            self.instant_power = np.isfinite(_field_value(fv[0]))
        except Exception:
            self.instant_power = False

    def _handle(self, gpu: int):
        """NVML's handle for CUDA device `gpu`, matched by PCI bus id (NVML and CUDA may number GPUs
        differently), falling back to the same index."""
        nv = self._nvml
        try:
            import torch

            from .devices import pci_address

            return nv.nvmlDeviceGetHandleByPciBusId(pci_address(torch.cuda.get_device_properties(gpu), 8).upper())
        except Exception:
            return nv.nvmlDeviceGetHandleByIndex(gpu)

    def _read(self, gpu: int, h) -> tuple:
        nv = self._nvml
        t = time.perf_counter_ns()
        sm = float(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM))
        # the throughput counters are per link (scope id = link): run 20261130-142913-h200 read link 0 alone
        # and saw 1/18 of the bytes, so every link is summed; reading 36 fields stretched the sampling
        # interval from ~8 to ~44 ms (run 20261130-145803-h200), so the running counters are read only every
        # nvlink_every-th sample (NaN in between) and clock and power at the full rate
        links = self._n % self.nvlink_every == 0
        ids = ([(_FI_NVLINK_TX, k) for k in range(_NVLINKS)] + [(_FI_NVLINK_RX, k) for k in range(_NVLINKS)]
               if links else [])
        ids += [_FI_POWER_INSTANT] if self.instant_power else []
        try:
            vals = [_field_value(f) for f in nv.nvmlDeviceGetFieldValues(h, ids)] if ids else []
        except Exception:
            vals = [float("nan")] * len(ids)
        tx = rx = float("nan")
        if links:
            t_l, r_l = (np.asarray(vals[k * _NVLINKS:(k + 1) * _NVLINKS]) for k in (0, 1))
            tx = float(np.nansum(t_l)) if np.isfinite(t_l).any() else float("nan")
            rx = float(np.nansum(r_l)) if np.isfinite(r_l).any() else float("nan")
        power = vals[-1] / 1e3 if self.instant_power else nv.nvmlDeviceGetPowerUsage(h) / 1e3
        get = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or nv.nvmlDeviceGetCurrentClocksThrottleReasons
        reasons = int(get(h))
        return (t, gpu, sm, float(power), reasons, bool(reasons & _POWER_CAP), tx, rx)

    def sample_once(self) -> None:
        """Take one sample of every GPU now (the thread calls this; tests may too)."""
        for g, h in zip(self.gpus, self._handles):
            self._rows.append(self._read(g, h))
        self._n += 1

    def measured_interval_ms(self) -> float:
        """The median time between two samples of one GPU, as taken (NaN with fewer than two)."""
        s = self.samples()
        if s.empty:
            return float("nan")
        d = s.groupby("gpu").t_ns.diff().dropna()
        return float(d.median() / 1e6) if len(d) else float("nan")

    def _loop(self) -> None:
        wait = self.interval_ms / 1e3
        while not self._stop.is_set():
            try:
                self.sample_once()
            except Exception as exc:  # a failing read ends sampling, and says so
                self.why = f"sampling stopped: {type(exc).__name__}: {exc}"
                return
            self._stop.wait(wait)

    def start(self) -> "Sampler":
        if self.available and self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="kvlab-nvml-sampler", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> pd.DataFrame:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        return self.samples()

    def samples(self) -> pd.DataFrame:
        return pd.DataFrame(list(self._rows), columns=SAMPLE_COLUMNS)

    def __enter__(self) -> "Sampler":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def window(samples: pd.DataFrame, gpu: int, t0_ns: int, t1_ns: int) -> dict:
    """What one GPU did between host times t0_ns and t1_ns (perf_counter_ns): mean SM clock and power of
    the samples inside, the share with the SW power-cap bit set, NVLink KiB sent and received (counter at
    the first reading after t1 − counter at the last reading before t0; readings are taken every few
    samples, so this spans a little more than the window), and how many samples fell inside."""
    s = samples[samples.gpu == gpu]
    inside = s[(s.t_ns >= t0_ns) & (s.t_ns <= t1_ns)]
    out = {"samples": len(inside), "sm_mhz": float(inside.sm_mhz.mean()) if len(inside) else float("nan"),
           "power_w": float(inside.power_w.mean()) if len(inside) else float("nan"),
           "capped_frac": float(inside.power_capped.mean()) if len(inside) else float("nan")}
    for col in ("nvlink_tx_kib", "nvlink_rx_kib"):
        c = s.dropna(subset=[col])  # counters are read every few samples only
        before, after = c[c.t_ns < t0_ns], c[c.t_ns > t1_ns]
        out[col] = float(after[col].iloc[0] - before[col].iloc[-1]) if len(before) and len(after) else float("nan")
    return out


def on_timeline(samples: pd.DataFrame, t0_ns: int) -> pd.DataFrame:
    """The samples with `ms` = milliseconds since t0_ns (the host time at which a timeline's start event
    was recorded on an idle GPU, so GPU-event milliseconds and these agree to within the event's latency)."""
    return samples.assign(ms=(samples.t_ns - t0_ns) / 1e6)


# ============================================================================== the experiment

PATTERNS = {
    "colocated": "prefill alone",
    "peer, every layer": "each layer's K,V to the peer at its signal (copy engine, issued by the prefill GPU)",
    "same GPU, every layer": "the same bytes to a second buffer on the prefill GPU",
    "peer, 1 KiB pings": "a 1 KiB copy to the peer at every layer's signal (cadence kept, bytes gone)",
    "peer, last 4 layers": "only the last 4 layers' K,V to the peer (a probe: the cache is incomplete)",
    "peer, batch:4": "every layer, released in 4 batches of 7 (kvlab policy batch:4)",
    "peer, deadline": "every layer, held while the prefill left covers the transfer left with a 2× margin "
                      "(kvlab policy deadline; for Qwen2.5-7B: all but the last layer go at layer 26's signal)",
    "peer, pull": "every layer, the copy issued by the peer GPU (its copy engine pulls); its exposed time is "
                  "seen from the prefill GPU after prefill's end, so it is ≥ 0 by construction",
    "peer, SM copy": "every layer by a copy kernel on the prefill GPU's SMs, storing into the peer",
    "peer, SM copy, 8 programs": "the same kernel throttled to 8 programs (a slow, steady stream)",
}


@dataclass
class PatternRun:
    """What send_patterns measured: `rounds` (variant, round, prefill_ms, wall_ms, exposed_ms, t0_ns and the
    sampler's window per GPU: sm_mhz_g0, power_w_g0, capped_frac_g0, nvlink_tx_kib_g0, … for g1),
    `samples` (the sampler's table), `timeline` (per-layer copy windows of the median "peer, every layer"
    round, ms from its start), `meta` (context, bytes, release layer of the deadline policy, sampler
    interval, the colocated prefill and one layer's copy that paced the deadline)."""

    rounds: pd.DataFrame
    samples: pd.DataFrame
    timeline: pd.DataFrame
    meta: dict = field(default_factory=dict)


class _Armed:
    """Work queued on `stream` before prefill, each job behind a flag the prefill's per-layer signal
    writes (the flag mode of kvlab.sends.LayerwiseSend), for probe sends that are not a whole cache:
    pings, a subset of layers, copy kernels. jobs: [(release layer, callable that queues the job)]."""

    def __init__(self, device, stream, jobs, layers: int, dst_stream=None):
        import torch
        from cuda.bindings import driver as cu

        from .sends import FlagWriter

        self.cu, self.device, self.stream, self.jobs, self.layers = cu, device, stream, jobs, layers
        self.dst_stream = dst_stream
        self.flag = torch.zeros(1, dtype=torch.int32, device=device)
        self.ptr = cu.CUdeviceptr(self.flag.data_ptr())
        self.write = FlagWriter(self.flag)
        self.done = torch.cuda.Event(enable_timing=True)
        self.gen = 0
        self.base = 0
        self.sent = 0
        self._release = torch.cuda.Stream(device=device)
        self._watchdog = None
        self.watchdog_s = 60.0

    def arm(self):
        import torch

        from .landing import dst_stream_context

        cu = self.cu
        self.gen += 1
        if (self.gen + 1) * self.layers >= 2**31 - 1:  # keep the flag inside int32, as LayerwiseSend does
            torch.cuda.synchronize(self.device)
            self.flag.zero_()
            torch.cuda.synchronize(self.device)
            self.gen = 1
        self.base = self.gen * self.layers
        handle = cu.CUstream(self.stream.cuda_stream)
        geq = cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
        with torch.cuda.stream(self.stream), dst_stream_context(self.dst_stream):
            for rel, job in self.jobs:
                (err,) = cu.cuStreamWaitValue32(handle, self.ptr, self.base + rel + 1, geq)
                if err != cu.CUresult.CUDA_SUCCESS:
                    raise RuntimeError(f"cuStreamWaitValue32 failed: {err}")
                job()
            self.done.record(self.stream)
        # as LayerwiseSend does: a device-wide sync between arm() and the last signal would wait for copies
        # that wait for flags the stalled host never writes; release them after watchdog_s
        self._watchdog = threading.Timer(self.watchdog_s, self.abort)
        self._watchdog.daemon = True
        self._watchdog.start()
        return self

    def begin(self):
        import torch

        self.sent = 0
        self.write.bind(torch.cuda.current_stream(self.device))
        return self

    def on_layer(self, i: int) -> None:
        self.sent += 1
        err = self.write(self.base + i + 1)
        if err:
            self.abort()
            raise RuntimeError(f"cuStreamWriteValue32 failed for layer {i}: {err}")

    def abort(self) -> None:
        """Let every armed job run (after an error, or from the watchdog), so nothing waits forever."""
        self.cu.cuStreamWriteValue32(self.cu.CUstream(self._release.cuda_stream), self.ptr,
                                     self.base + self.layers, 0)

    def finish(self):
        """The event after the last job (on the prefill GPU's copy stream)."""
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        return self.done


class _Pull:
    """Layer-wise send issued by the destination GPU: at layer i's signal the prefill GPU records an event,
    a stream of the peer waits for it and the peer's copy engine pulls layer i (cudaMemcpyAsync on that
    stream). The send's end is seen from the prefill GPU: its compute stream waits for the peer's last
    event and records `done`."""

    def __init__(self, src, dst, peer):
        import torch
        from cuda.bindings import runtime as cudart

        self.rt, self.torch = cudart, torch
        self.src_dev, self.peer = src.device, torch.device(peer)
        L = src.data.shape[0]
        self.layers = L
        self.n = [src.data[i].numel() * src.data.element_size() for i in range(L)]
        self.sp = [src.data[i].data_ptr() for i in range(L)]
        self.dp = [dst.data[i].data_ptr() for i in range(L)]
        self.stream = torch.cuda.Stream(device=self.peer)
        self.ready = [torch.cuda.Event() for _ in range(L)]
        with torch.cuda.device(self.peer):
            self.landed = [torch.cuda.Event() for _ in range(L)]
        self.done = torch.cuda.Event(enable_timing=True)
        self.sent = 0
        self.compute = None

    def arm(self):
        return self

    def begin(self):
        self.sent = 0
        self.compute = self.torch.cuda.current_stream(self.src_dev)
        return self

    def on_layer(self, i: int) -> None:
        torch = self.torch
        self.sent += 1
        self.ready[i].record(self.compute)
        self.stream.wait_event(self.ready[i])
        with torch.cuda.device(self.peer):
            (err,) = self.rt.cudaMemcpyAsync(self.dp[i], self.sp[i], self.n[i],
                                             self.rt.cudaMemcpyKind.cudaMemcpyDefault, self.stream.cuda_stream)
            if int(err) != 0:
                raise RuntimeError(f"cudaMemcpyAsync (pull, layer {i}) failed: {err}")
            self.landed[i].record(self.stream)

    def abort(self) -> None:
        pass

    def finish(self):
        self.compute.wait_event(self.landed[-1])
        self.done.record(self.compute)
        return self.done


def send_patterns(model, context: int, peer: str = "cuda:1", variants=None, rounds: int = 9, warmup: int = 2,
                  device=None, interval_ms: float = 5.0, seed: int = 0, progress=None) -> PatternRun:
    """Colocated prefill against layer-wise sends that differ in one thing each (PATTERNS), `rounds` rounds in
    the orders of kvlab.timing.schedule (a Williams design: over a cycle every variant follows every
    other equally often, so the power state one prefill leaves does not always fall on the same variant),
    with NVML sampling both GPUs. (Runs made before commit 5961a27 rotated the order cyclically, so each
    variant almost always followed the same one: colocated followed "peer, SM copy, 8 programs".)

    GPU only, two GPUs, cuda-bindings' stream memory operations (the armed sends). Every send variant is
    signalled from kvlab's KV arena (LayerHooks point "cache"). Per round: prefill_ms (start → prefill's
    last kernel, CUDA events on the prefill GPU), exposed_ms (the send's end − prefill's end; pings and the
    last-4 probe included), wall_ms = prefill + max(exposed, 0), and the sampler's window over the prefill.
    The deadline policy is paced by this context's colocated prefill (median of 3, / layers) and one layer's
    copy to the peer timed alone, both measured here first.
    """
    import torch

    from .steps import check_request
    from .paged import kernels
    from .steps import (make_prompt, model_device, prefill, prefill_or_abort, request_wall, time_plain_copy,
                        time_prefill, warm_prefill)
    from .hooks import LayerHooks
    from .kvcache import KVBuffer, layout_for
    from .timing import schedule
    from .sends import release_plan, stream_memops_available
    from .transfer import Transport

    variants = list(PATTERNS) if variants is None else list(variants)
    unknown = [v for v in variants if v not in PATTERNS]
    if unknown:
        raise ValueError(f"unknown send pattern(s) {unknown}; valid: {list(PATTERNS)}")
    if "colocated" not in variants:
        variants = ["colocated"] + variants
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1 or warmup < 0:
        raise ValueError(f"rounds must be an int ≥ 1 and warmup ≥ 0, got rounds={rounds!r}, warmup={warmup!r}")
    dev = torch.device(device) if device is not None else model_device(model)
    if dev.type != "cuda":
        raise ValueError("send_patterns needs a CUDA prefill device (it compares sends to a peer GPU)")
    dev = torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())
    (dest,) = check_request(model, [context], [peer], dev)
    if dest.kind != "peer":
        raise ValueError(f"peer={peer!r} is not another GPU than {dev}; give 'cuda:N' with N ≠ {dev.index}")
    if not stream_memops_available(dev):
        raise ValueError("send_patterns needs cuda-bindings' stream memory operations (cuStreamWaitValue32)")
    say = progress or (lambda s: None)
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    layout = layout_for(model, context)
    L = layout.layers
    ids = make_prompt(cfg.vocab_size, context, dev, seed)
    src = KVBuffer(layout, device=dev)
    t_peer = Transport(layout, dest, dev, granularity="buffer")
    t_same = Transport(layout, "same-gpu", dev, granularity="buffer") if "same GPU, every layer" in variants else None
    # peer access both ways before anything is timed (torch enables it on the first copy in each direction)
    t_peer.buffer.data[0, 0, 0, 0, :1].copy_(src.data[0, 0, 0, 0, :1])
    src.data[0, 0, 0, 0, :1].copy_(t_peer.buffer.data[0, 0, 0, 0, :1])
    warm_prefill(model, ids, src)
    torch.cuda.synchronize(dest.device)

    # pace of the deadline policy, measured here with the handoff's own timers
    pre_ms = sorted(time_prefill(model, ids, src, dev) for _ in range(3))[1]
    layer_ms = sorted(time_plain_copy(t_peer.stream, t_peer.buffer.data[L - 1], src.data[L - 1], dest, dev)
                      for _ in range(5))[2]
    deadline = release_plan("deadline", L, compute_ms=pre_ms / L, transfer_ms=layer_ms)
    say(f"colocated prefill {pre_ms:.1f} ms, one layer to {dest.label} {layer_ms:.3f} ms: the deadline policy "
        f"releases layers 0…{deadline[0]} at layer {deadline[0]}'s signal")

    senders = {}
    row_words = 16384 // 8  # the SM copy moves each layer as 16 KiB rows
    rows_per_layer = layout.bytes_per_layer // 16384
    if any(v.startswith("peer, SM copy") for v in variants) and layout.bytes_per_layer % 16384:
        raise ValueError(f"the SM copy variants move 16 KiB rows; one layer here is {layout.bytes_per_layer} B, "
                         "not a multiple of 16 KiB: choose a context that makes it one, or leave them out")
    idx = torch.arange(rows_per_layer, dtype=torch.int64, device=dev)

    def sm_job(i, programs=None):
        s = src.data[i].reshape(-1).view(torch.int64).view(rows_per_layer, row_words)
        d = t_peer.buffer.data[i].reshape(-1).view(torch.int64).view(rows_per_layer, row_words)
        cfg_k = kernels.KernelConfig(block=256, rows_per_program=1, num_warps=4, streaming=False)
        return lambda: kernels.launch_rows(s, idx, d, None, cfg_k, programs=programs)

    ping_src = torch.zeros(256, dtype=torch.int32, device=dev)
    ping_dst = torch.zeros(256, dtype=torch.int32, device=dest.device)
    for v in variants:
        if v == "colocated":
            senders[v] = None
        elif v == "peer, every layer":
            senders[v] = t_peer.layerwise(src, timeline=True)
        elif v == "same GPU, every layer":
            senders[v] = t_same.layerwise(src)
        elif v == "peer, batch:4":
            senders[v] = t_peer.layerwise(src, release=release_plan("batch:4", L))
        elif v == "peer, deadline":
            senders[v] = t_peer.layerwise(src, release=deadline)
        elif v == "peer, 1 KiB pings":
            senders[v] = _Armed(dev, t_peer.stream, [(i, lambda: ping_dst.copy_(ping_src, non_blocking=True))
                                                     for i in range(L)], L, t_peer.dst_stream)
        elif v == "peer, last 4 layers":
            senders[v] = _Armed(dev, t_peer.stream,
                                [(i, (lambda i=i: t_peer.buffer.data[i].copy_(src.data[i], non_blocking=True)))
                                 for i in range(L - 4, L)], L, t_peer.dst_stream)
        elif v == "peer, pull":
            senders[v] = _Pull(src, t_peer.buffer, dest.device)
        elif v == "peer, SM copy":
            senders[v] = _Armed(dev, t_peer.stream, [(i, sm_job(i)) for i in range(L)], L)
        elif v == "peer, SM copy, 8 programs":
            senders[v] = _Armed(dev, t_peer.stream, [(i, sm_job(i, programs=8)) for i in range(L)], L)
    hooks = {v: LayerHooks(model, s.on_layer, ranges=False) for v, s in senders.items() if s is not None}
    # every kernel and copy kind once, unarmed, before anything waits on a flag (a first launch loads code)
    if any(v.startswith("peer, SM copy") for v in variants):
        sm_job(0)()
        sm_job(0, programs=8)()
    ping_dst.copy_(ping_src)
    torch.cuda.synchronize(dev)
    torch.cuda.synchronize(dest.device)

    sampler = Sampler([dev.index, dest.device.index], interval_ms=interval_ms)
    if not sampler.available:
        say(sampler.why)

    def one(v) -> dict:
        s = senders[v]
        torch.cuda.synchronize(dest.device)
        torch.cuda.synchronize(dev)  # the last device sync: never between arm() and prefill
        stream = torch.cuda.current_stream(dev)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if s is None:
            t0 = time.perf_counter_ns()
            a.record(stream)
            prefill(model, ids, src)
            b.record(stream)
            b.synchronize()
            p = a.elapsed_time(b)
            return {"prefill_ms": p, "exposed_ms": float("nan"), "wall_ms": p, "t0_ns": t0}
        s.arm()
        h = hooks[v]
        with h:
            t0 = time.perf_counter_ns()
            a.record(stream)
            s.begin()
            prefill_or_abort(model, ids, src, s, h)
            b.record(stream)
            end = s.finish()
        if hasattr(end, "done_event"):  # a Landing
            end.wait()
            end = end.done_event
        else:
            end.synchronize()
        b.synchronize()
        p = a.elapsed_time(b)
        exposed = b.elapsed_time(end)
        out = {"prefill_ms": p, "exposed_ms": exposed, "wall_ms": request_wall(p, exposed), "t0_ns": t0}
        if v == "peer, every layer":
            out["copies"] = [(a.elapsed_time(s.copy_start[i]), a.elapsed_time(t_peer._events[i])) for i in range(L)]
        return out

    rows, windows, failed = [], [], {}
    say(f"{rounds} rounds × {len(variants)} variants at {context:,} tokens → {dest.label} "
        f"(NVML {'on' if sampler.available else 'off'})")
    first_round = -warmup
    with sampler:
        for k, v in schedule(variants, rounds, warmup):
            if v in failed:
                continue
            try:
                out = one(v)
            except Exception as exc:
                # a variant that cannot run here (an API the driver refuses, say) is dropped in the first
                # round, with its reason kept in meta["failed"]; later failures are real errors
                if k > first_round or v == "colocated":
                    raise
                if senders[v] is not None:
                    senders[v].abort()
                torch.cuda.synchronize(dev)
                failed[v] = f"{type(exc).__name__}: {exc}"
                say(f"{v}: dropped — {failed[v]}")
                continue
            if k >= 0:
                rows.append(dict(variant=v, round=k, **{k2: v2 for k2, v2 in out.items() if k2 != "copies"}))
                if "copies" in out:
                    windows.append((out["prefill_ms"], out["copies"]))
    samples = sampler.samples()
    df = pd.DataFrame(rows)
    for i, g in enumerate((dev.index, dest.device.index)):
        stats = [window(samples, g, int(t0), int(t0 + w * 1e6)) for t0, w in zip(df.t0_ns, df.prefill_ms)]
        for key in ("sm_mhz", "power_w", "capped_frac", "nvlink_tx_kib", "nvlink_rx_kib", "samples"):
            df[f"{key}_g{i}"] = [s[key] for s in stats]
    timeline = pd.DataFrame()
    if windows:
        med = sorted(windows, key=lambda w: w[0])[(len(windows) - 1) // 2]
        timeline = pd.DataFrame([{"layer": i, "copy_start_ms": s0, "copy_end_ms": s1}
                                 for i, (s0, s1) in enumerate(med[1])]).assign(prefill_ms=med[0])
    meta = dict(context=context, destination=dest.label, layers=L, kv_bytes=layout.nbytes,
                bytes_per_layer=layout.bytes_per_layer, colocated_prefill_ms=pre_ms, layer_copy_ms=layer_ms,
                deadline_release_layer=deadline[0], interval_ms=interval_ms,
                measured_interval_ms=sampler.measured_interval_ms(), nvml=sampler.available,
                nvml_why=sampler.why, instant_power=sampler.instant_power, gpus=[dev.index, dest.device.index],
                variants={v: PATTERNS[v] for v in variants if v not in failed}, failed=failed)
    del senders, hooks, t_peer, t_same, src
    return PatternRun(df, samples, timeline, meta)


# ============================================================================== analysis (reads what send_patterns wrote)


def pattern_summary(rounds: pd.DataFrame) -> pd.DataFrame:
    """Per variant, against colocated in the same round: extra prefill (median of the paired differences,
    95 % bootstrap interval), extra wall (until the send landed), exposed, mean SM clock and power of the
    prefill GPU, power-capped share, and the clock's prediction — colocated prefill × (f_colocated /
    f_variant − 1) per round, the extra a kernel-time ∝ 1/clock model gives for the clock alone — with its
    interval. Columns: variant, rounds, prefill_ms, extra_ms, extra_lo_ms, extra_hi_ms, wall_extra_ms,
    wall_lo_ms, wall_hi_ms, exposed_ms, sm_mhz, clock_drop_mhz, clock_pred_ms, clock_pred_lo_ms,
    clock_pred_hi_ms, power_w, capped_frac, nvlink_tx_gb (prefill GPU, NVML's counter over the prefill)."""
    from .timing import median_ci

    def ci(x):
        x = x.dropna()
        return median_ci(x) if len(x) else (float("nan"), float("nan"))

    base = rounds[rounds.variant == "colocated"].set_index("round")
    out = []
    for v, g in rounds.groupby("variant", sort=False):
        g = g.set_index("round")
        d = (g.prefill_ms - base.prefill_ms).dropna()
        w = (g.wall_ms - base.wall_ms).dropna()
        pred = (base.prefill_ms * (base.sm_mhz_g0 / g.sm_mhz_g0 - 1)).dropna()
        lo, hi = ci(d)
        wlo, whi = ci(w)
        plo, phi = ci(pred)
        out.append(dict(variant=v, rounds=len(g), prefill_ms=float(g.prefill_ms.median()),
                        extra_ms=float(d.median()) if len(d) else float("nan"), extra_lo_ms=lo, extra_hi_ms=hi,
                        wall_extra_ms=float(w.median()) if len(w) else float("nan"), wall_lo_ms=wlo, wall_hi_ms=whi,
                        exposed_ms=float(g.exposed_ms.median()), sm_mhz=float(g.sm_mhz_g0.median()),
                        clock_drop_mhz=float((base.sm_mhz_g0 - g.sm_mhz_g0).dropna().median()) if len(g) else float("nan"),
                        clock_pred_ms=float(pred.median()) if len(pred) else float("nan"),
                        clock_pred_lo_ms=plo, clock_pred_hi_ms=phi, power_w=float(g.power_w_g0.median()),
                        capped_frac=float(g.capped_frac_g0.mean()),
                        nvlink_tx_gb=float(g.nvlink_tx_kib_g0.median()) * 1024 / 1e9))
    return pd.DataFrame(out)


def pattern_findings(summary: pd.DataFrame, meta: dict) -> list[str]:
    """Sentences from the numbers: each variant's extra beside the clock's prediction, then what agrees."""
    out = []
    s = summary.set_index("variant")
    if "colocated" in s.index:
        c = s.loc["colocated"]
        out.append(f"Colocated prefill at {meta.get('context', 0):,} tokens: {c.prefill_ms:,.1f} ms, SM clock "
                   f"{c.sm_mhz:,.0f} MHz, {c.power_w:,.0f} W, SW power cap set in {100 * c.capped_frac:.0f} % "
                   "of the samples.")
    for v, r in s.drop(index="colocated", errors="ignore").iterrows():
        out.append(f"{v}: prefill {r.extra_ms:+.2f} ms [{r.extra_lo_ms:+.2f}, {r.extra_hi_ms:+.2f}], SM clock "
                   f"{-r.clock_drop_mhz:+.0f} MHz, which alone predicts {r.clock_pred_ms:+.2f} ms "
                   f"[{r.clock_pred_lo_ms:+.2f}, {r.clock_pred_hi_ms:+.2f}]; exposed {r.exposed_ms:+.2f} ms.")
    for v, why in (meta.get("failed") or {}).items():
        out.append(f"{v}: not measured on this machine ({why}).")
    return out


def plot_patterns(summary: pd.DataFrame, title: str = ""):
    """Each variant's extra prefill time (bar, 95 % interval) beside the extra its SM clock predicts
    (hollow bar, interval): where the two agree the clock explains the cost."""
    import matplotlib.pyplot as plt

    from . import plots

    plots.style()
    order = {v: i for i, v in enumerate(PATTERNS)}
    s = summary[summary.variant != "colocated"]
    s = s.iloc[sorted(range(len(s)), key=lambda i: order.get(s.variant.iloc[i], len(order)))].reset_index(drop=True)
    fig, ax = plt.subplots(figsize=(7.6, 0.55 * len(s) + 2.0))
    y = np.arange(len(s))
    ax.barh(y - 0.18, s.extra_ms, 0.36, color=plots.VERMILLION, label="measured extra prefill",
            xerr=[s.extra_ms - s.extra_lo_ms, s.extra_hi_ms - s.extra_ms], error_kw=dict(lw=0.8, capsize=2))
    ax.barh(y + 0.18, s.clock_pred_ms, 0.36, fill=False, edgecolor=plots.BLUE, hatch="//",
            label="predicted from the SM clock alone",
            xerr=[s.clock_pred_ms - s.clock_pred_lo_ms, s.clock_pred_hi_ms - s.clock_pred_ms],
            error_kw=dict(lw=0.8, capsize=2, ecolor=plots.BLUE))
    ax.set_yticks(y, s.variant, fontsize=8)
    ax.invert_yaxis()
    ax.axvline(0, color="black", lw=0.6)
    ax.set_xlabel("ms over colocated prefill (median of paired rounds, 95 % interval)")
    import textwrap

    ax.set_title("\n".join(textwrap.wrap(title or "What each send pattern costs prefill, and what its clock predicts",
                                         70)), fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
    fig.tight_layout()
    return fig


def plot_clock_timeline(samples: pd.DataFrame, rounds: pd.DataFrame, timeline: pd.DataFrame, gpu: int,
                        variants=("colocated", "peer, every layer"), title: str = ""):
    """SM clock and power of the prefill GPU across one prefill of each variant (the round whose prefill is
    the median of its variant), ms from its start, with the layer copies of "peer, every layer" drawn as
    bars on top: the instrument drawn under the timeline."""
    import matplotlib.pyplot as plt

    from . import plots

    plots.style()
    fig, (ax_k, ax_c, ax_p) = plt.subplots(3, 1, figsize=(9, 5.8), sharex=True,
                                           gridspec_kw=dict(height_ratios=[0.5, 3, 2]))
    colours = {variants[0]: plots.BLUE, variants[-1]: plots.VERMILLION}
    for v in variants:
        g = rounds[rounds.variant == v].sort_values("prefill_ms")
        if g.empty:
            continue
        r = g.iloc[(len(g) - 1) // 2]
        s = on_timeline(samples[samples.gpu == gpu], int(r.t0_ns))
        s = s[(s.ms >= -20) & (s.ms <= r.prefill_ms + 20)]
        col = colours.get(v, plots.GREEN)
        # NVML holds a reading for ~100 ms: draw it as the step it is
        ax_c.step(s.ms, s.sm_mhz, where="post", color=col, lw=1,
                  label=f"{v} (round {int(r['round'])}, {r.prefill_ms:,.0f} ms)")
        ax_p.step(s.ms, s.power_w, where="post", color=col, lw=1)
        ax_c.axvline(r.prefill_ms, color=col, lw=0.6, ls=":")
    if len(timeline):
        # each copy lasts ~0.2 ms, far below a pixel at this scale: a tick at its start
        ax_k.vlines(timeline.copy_start_ms, 0, 1, color=plots.VERMILLION, lw=1.2)
    ax_k.set_yticks([])
    ax_k.set_ylabel("copies", rotation=0, ha="right", va="center", fontsize=8)
    ax_c.set_ylabel("SM clock (MHz)")
    ax_p.set_ylabel("power (W)")
    ax_p.set_xlabel("ms since the prefill's start (ticks: each layer's copy to the peer starts; dotted: prefill ends)")
    ax_c.legend(fontsize=7, loc="lower left")
    import textwrap

    ax_k.set_title("\n".join(textwrap.wrap(title or "SM clock and power under the timeline", 90)), fontsize=10)
    fig.tight_layout()
    return fig
