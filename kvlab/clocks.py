"""GPU clocks, power and link counters on the host's clock (NVML): a library tool, no experiment.

Why it exists: on 2×H200 over NVLink, sending every layer's K and V to the peer during a 32k prefill made
that prefill tens of ms slower, while the same bytes sent within one GPU cost nothing measurable; a probe
saw the prefill GPU at its power cap and its SM clock lower during such sends. A profiler timeline shows
the symptom (every kernel a little longer, copy or no copy); the clock shows whether that is the cause.

`Sampler` — a thread that reads, every `interval_ms`, each GPU's SM clock, power draw, clock-event
    ("throttle") reasons and NVLink byte counters through NVML (nvidia-ml-py), stamped with
    ``time.perf_counter_ns`` — the clock kvlab's timed rounds already note on the host, so a sample can be
    placed on a CUDA-event timeline whose start was recorded on an idle GPU (`window`, `on_timeline`).
    Without NVML (a CPU machine, no driver) it records nothing and says why (`available`, `why`).

The experiment that uses it — send patterns against colocated prefill under the clock — is the
overlap_timeline study's (kvlab.studies.overlap_timeline.patterns).

Reasons bits (NVML's clocks-event reasons): 0x4 SW power cap, 0x8 HW slowdown, 0x20 SW thermal,
0x40 HW thermal, 0x80 HW power brake.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pandas as pd

from .devices import pci_address

__all__ = ["Sampler", "SAMPLE_COLUMNS", "REASON_BITS", "window", "on_timeline"]

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
