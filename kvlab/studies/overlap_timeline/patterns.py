"""What sending a KV cache to a peer GPU costs a prefill that runs at its power cap: the send-pattern experiment.

One context, colocated prefill against layer-wise sends that differ in one thing each (where the bytes go, how
many bytes, how often, who issues the copy, copy engine or SMs, and the send policies of
kvlab.sends.release_plan), in balanced rounds, with kvlab.clocks.Sampler running (`send_patterns`). Its
analysis (pattern_report.pattern_summary) sets each variant's extra prefill time beside what its lower SM clock
alone predicts: prefill × (f_colocated / f_variant − 1) — if the two agree across the variants, the clock is
the cause and the copies themselves are not.

Measurement only; GPU only (two GPUs, cuda-bindings' stream memory operations).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import pandas as pd
import torch

from ...clocks import Sampler, window
from ...hooks import LayerHooks
from ...kvcache import KVBuffer, layout_for
from ...landing import dst_stream_context
from ...sends import FlagWriter, release_plan, stream_memops_available
from ...steps import (check_request, make_prompt, model_device, prefill, prefill_or_abort, request_wall,
                      time_plain_copy, time_prefill, warm_prefill)
from ...timing import schedule
from ...transfer import Transport

__all__ = ["PATTERNS", "PatternRun", "send_patterns"]

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
        from cuda.bindings import driver as cu

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
    from ...paged import kernels  # triton: imported only when the experiment runs

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
