"""Contention: N transfers sharing one path at once, measured, and the fabric simulator validated on them
(`kvlab contention`).

Seed 000 ends its agenda with congestion: KV bursts share a fabric with everything else. Here N copies of the same
size start together on N CUDA streams — GPU → pinned host, pinned host → GPU, or both directions at once — and the
run records when each lands (CUDA events: one start, one end per flow). Per configuration: the aggregate rate (all
bytes over the time until the last flow lands) against the path's ceiling (one copy of 1 GiB alone, the same run),
each flow's own rate and Jain's fairness index over them. Then kvlab's fabric simulator (kvlab.fabric.calibrate:
per-path capacity, per-flow ceiling and a start cost, flows shared max-min fairly) is fitted on the single paths at
N = 1 and 2 only, and predicts the rest — N = 4, 8 and both directions at once — which it was not fitted to:
validation.csv as issue 30 asks. Beside them (`beside`, on by default), what the copies do to a prefill running at
the same time: a fixed compute load — the matmuls of a Qwen2.5-7B MLP projection at 4k tokens, bf16, on its own
stream — timed alone and started together with each configuration's copies (beside.csv; the analysis's
compute_beside.csv: its time against alone, with the ratio's interval, and how long the copies ran against it). And
(`nixl_posting`, where NIXL loads) NIXL posting under concurrency: 1–8 threads or processes posting prepared requests
at once (kvlab.paged.nixl_posting; nixl_posting.csv). On a CPU the same code copies between host
buffers on threads and multiplies small float32 matrices (the logic only).
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from ... import devices, goals, plots
from ...fabric import calibrate
from ...intervals import median_ci, ratio_ci
from ...results import Run
from ...study import Analysis, Param, at_least, check_params, md_table, one_of, sig
from ...ceilings import parse_size
from ...paged import nixl_posting
from ...paged.nixl import nixl_missing

__all__ = ["NAME", "NOTEBOOK", "TITLE", "QUESTION", "FIGURES", "PARAMS", "Config", "check", "measure", "analyse",
           "figures", "BLOCKS", "goal_table", "jain", "summarise", "validation", "beside_summary"]

NAME = "contention"
NOTEBOOK = None
TITLE = "Contention on one path"
QUESTION = ("What do N transfers sharing one path get, together and each, against the path's ceiling, and does the "
            "fabric simulator, fitted on one and two flows, predict the rest?")
FIGURES = ("contention_gbps", "nixl_posting")  # nixl_posting: only for a run that timed NIXL posting

GPU_PATHS, CPU_PATHS = ("d2h", "h2d", "d2h+h2d"), ("h2h",)
GPU_SIZE, CPU_SIZE = "256M", "4M"
GPU_REPEATS, CPU_REPEATS = 10, 3
_PATH_NAMES = {"d2h": "GPU → pinned host", "h2d": "pinned host → GPU", "d2h+h2d": "both directions at once",
               "h2h": "host → host (CPU)"}


GATES = ("on", "off", "both")


def _flows(value, name):
    got = [v.strip() for v in str(value).split(",") if v.strip()]
    if not got or not all(v.isdigit() and int(v) >= 1 for v in got) or len({int(v) for v in got}) != len(got):
        raise ValueError(f"{name} = {value!r}: give distinct flow counts ≥ 1, comma-separated, such as 1,2,4,8")
    if not {1, 2} <= {int(v) for v in got}:
        raise ValueError(f"{name} = {value!r}: the simulator is fitted on 1 and 2 flows, so both must be among them")


def _size(value, name):
    try:
        n = parse_size(value)
    except ValueError as err:
        raise ValueError(f"{name} = {value!r}: {err}") from None
    if n < 1 << 20:
        raise ValueError(f"{name} = {value!r}: give at least 1M per flow (a smaller copy measures its start, not the "
                         "path)")


PARAMS = (
    Param("flows", "str", "1,2,4,8", "flow counts, comma-separated; 1 and 2 fit the simulator, the rest validate it",
          _flows),
    Param("size", "str", "auto", f"bytes per flow (\"256M\"); \"auto\": {GPU_SIZE} on a GPU, {CPU_SIZE} on a CPU",
          _size),
    Param("device", "str", "auto", "the GPU: cuda:N, or cpu (threads copying host buffers: the logic only); "
          "\"auto\": cuda:0, cpu where there is no GPU (or KVLAB_PRESET set to cpu)", devices.check_device_name),
    Param("repeats", "int", 0, f"timed rounds per configuration, in rotated order; 0: {GPU_REPEATS} on a GPU, "
          f"{CPU_REPEATS} on a CPU", at_least(0)),
    Param("beside", "str", "on", "on: also time a prefill-like compute load alone and beside each configuration's "
          "copies (beside.csv); off: the copies only", one_of("on", "off")),
    Param("gate", "str", "on", "the compute-beside rounds on a GPU start behind a GPU sleep, so the host has queued "
          "every copy before any runs (on), without it (off), or both, each configuration both ways in the same "
          "rotated rounds (both: what the gate changes, in one run)", one_of(*GATES)),
    Param("nixl_posting", "str", "auto", "on: also time NIXL posting under concurrency (1, 2, 4, 8 posters at once, "
          "each a request of 56 or 448 descriptors: threads through one pair of agents, threads with a pair each, "
          "processes with a pair each; with and without NIXL's progress threads; nixl_posting.csv; on a CPU 1 and 2 "
          "posters without progress threads, the logic only); \"auto\": on where "
          "NIXL loads and the device is a GPU; off: not", one_of("auto", "on", "off")),
)


@dataclass(frozen=True)
class Config:
    """One run: the flow counts, bytes per flow, the device, timed rounds, and the paths (by device kind)."""

    flows: list
    size: int
    device: torch.device
    repeats: int
    paths: tuple
    beside: bool = True
    gate: str = "on"
    nixl_posting: bool = False

    def resolved(self) -> dict:
        return {"flows": self.flows, "size_bytes": self.size, "device": str(self.device), "repeats": self.repeats,
                "paths": list(self.paths), "beside": self.beside, "gate": self.gate, "nixl_posting": self.nixl_posting,
                **({"compute": _Compute.describe(self.device)} if self.beside else {})}


def check(params) -> Config:
    """The run's Config: every value checked, "auto" resolved by hardware, the pinned buffers held against this
    machine's free memory — before anything is allocated or written."""
    p = check_params(PARAMS, params, NAME)
    dev = devices.run_device(p["device"])
    gpu = dev.type == "cuda"
    flows = sorted(int(v) for v in p["flows"].split(",") if v.strip())
    size = parse_size((GPU_SIZE if gpu else CPU_SIZE) if p["size"] == "auto" else p["size"])
    need = 2 * 2 * max(flows) * size + (2 << 30)  # each direction's sources and destinations, and the ceiling's
    free = devices.host_available_bytes()
    if free is not None and need > 0.8 * free:
        raise ValueError(f"{max(flows)} flows of {size / 2**20:.0f} MiB need about {need / 2**30:.1f} GiB of host "
                         f"memory and {free / 2**30:.1f} GiB is free; give a smaller --size or fewer --flows")
    why = nixl_missing() if p["nixl_posting"] == "on" or p["nixl_posting"] == "auto" and gpu else "off"
    if why and p["nixl_posting"] == "on":
        raise ValueError(f"nixl_posting = 'on': {why}; give auto or off")
    return Config(flows=flows, size=size, device=dev, repeats=p["repeats"] or (GPU_REPEATS if gpu else CPU_REPEATS),
                  paths=GPU_PATHS if gpu else CPU_PATHS, beside=p["beside"] == "on", gate=p["gate"],
                  nixl_posting=p["nixl_posting"] != "off" and not why)


class _Compute:
    """The prefill-like load: `STEPS` matmuls x @ w, on a GPU the shape of a Qwen2.5-7B MLP projection at 4k tokens
    (x [4096, 3584], w [3584, 18944], bf16: about 0.56 TFLOP a matmul), on a CPU small float32 ones (the logic only)."""

    STEPS = 8
    GPU_SHAPE, CPU_SHAPE = (4096, 3584, 18944), (128, 128, 128)

    def __init__(self, dev: torch.device):
        gpu = dev.type == "cuda"
        m, k, n = self.GPU_SHAPE if gpu else self.CPU_SHAPE
        dtype = torch.bfloat16 if gpu else torch.float32
        g = torch.Generator(device=dev).manual_seed(0)
        self.x = torch.randn(m, k, device=dev, dtype=dtype, generator=g)
        self.w = torch.randn(k, n, device=dev, dtype=dtype, generator=g) / k ** 0.5
        self.out = torch.empty(m, n, device=dev, dtype=dtype)
        self.stream = torch.cuda.Stream(dev) if gpu else None

    @classmethod
    def describe(cls, dev: torch.device) -> dict:
        gpu = dev.type == "cuda"
        m, k, n = cls.GPU_SHAPE if gpu else cls.CPU_SHAPE
        return {"matmuls": cls.STEPS, "m": m, "k": k, "n": n, "dtype": "bfloat16" if gpu else "float32",
                "flop": 2 * m * k * n * cls.STEPS}

    def __call__(self) -> None:
        for _ in range(self.STEPS):
            torch.matmul(self.x, self.w, out=self.out)


GATE_CYCLES = 2_000_000  # the start gate: about 1 ms of GPU clock at 1.98 GHz, more than the host needs to queue all


def _beside_gpu(jobs, streams, dev, compute: _Compute, gate: bool = True) -> tuple[float, float]:
    """The compute load and `jobs` start together (every stream waits on one start event); (ms until the compute
    ends, ms until the last copy lands; 0 without copies). With `gate`, the start event is recorded behind a GPU sleep
    (torch.cuda._sleep, GATE_CYCLES), so every copy and the compute are queued before it fires: without the gate,
    the compute's time held the host's queueing of the copies before it (run 20261204-024402: tenths of a millisecond
    at 16 copies, against 5.7 ms of compute — a hypothesis run 20261204-024624 supports; `gate` "both" tests it)."""
    cur = torch.cuda.current_stream(dev)
    start, c_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ends = [torch.cuda.Event(enable_timing=True) for _ in jobs]
    torch.cuda.synchronize(dev)
    if gate:
        torch.cuda._sleep(GATE_CYCLES)  # torch's own test helper; no public API holds a stream for a set time
    start.record(cur)
    compute.stream.wait_event(start)
    for (_, dst, src), s, e in zip(jobs, streams, ends):
        s.wait_event(start)
        with torch.cuda.stream(s):
            dst.copy_(src, non_blocking=True)
            e.record(s)
    with torch.cuda.stream(compute.stream):
        compute()
        c_end.record(compute.stream)
    torch.cuda.synchronize(dev)
    return start.elapsed_time(c_end), max((start.elapsed_time(e) for e in ends), default=0.0)


def _beside_cpu(jobs, compute: _Compute) -> tuple[float, float]:
    """The same on a CPU: the compute on this thread while a thread per copy runs (_threads)."""
    _, t1, done, t_c = _threads(jobs, compute)
    return (t_c - t1) * 1e3, max(((x - t1) * 1e3 for x in done), default=0.0)


class _Buffers:
    """Each direction's flows' sources and destinations, allocated once: device buffers and pinned host buffers
    (on a CPU, host buffers for the threads)."""

    def __init__(self, n: int, size: int, dev: torch.device):
        gpu = dev.type == "cuda"
        mk_dev = (lambda: torch.empty(size, dtype=torch.uint8, device=dev)) if gpu else \
            (lambda: torch.empty(size, dtype=torch.uint8))
        mk_host = lambda: torch.empty(size, dtype=torch.uint8, pin_memory=gpu)  # noqa: E731
        self.dev_src = [mk_dev().fill_(1) for _ in range(n)]
        self.host_dst = [mk_host() for _ in range(n)]
        self.host_src = [mk_host().fill_(2) for _ in range(n)] if gpu else []
        self.dev_dst = [mk_dev() for _ in range(n)] if gpu else []
        self.streams = [torch.cuda.Stream(dev) for _ in range(2 * n)] if gpu else []

    def jobs(self, path: str, n: int) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        out = []
        for part in path.split("+"):
            for i in range(n):
                if part == "d2h":
                    out.append((part, self.host_dst[i], self.dev_src[i]))
                elif part == "h2d":
                    out.append((part, self.dev_dst[i], self.host_src[i]))
                else:  # h2h, on a CPU
                    out.append((part, self.host_dst[i], self.dev_src[i]))
        return out


def _run_gpu(jobs, streams, dev) -> tuple[float, list[float]]:
    """All `jobs` start together (each stream waits on one start event) and each records its end; (ms until the
    last lands, each flow's ms). The start event is recorded before the host has queued every copy, so a flow's time
    also holds the queueing of the copies before it: microseconds each, against milliseconds a copy at the default
    size; a size of a few MiB would show it."""
    cur = torch.cuda.current_stream(dev)
    start = torch.cuda.Event(enable_timing=True)
    ends = [torch.cuda.Event(enable_timing=True) for _ in jobs]
    torch.cuda.synchronize(dev)
    start.record(cur)
    for (_, dst, src), s, e in zip(jobs, streams, ends):
        s.wait_event(start)
        with torch.cuda.stream(s):
            dst.copy_(src, non_blocking=True)
            e.record(s)
    torch.cuda.synchronize(dev)
    each = [start.elapsed_time(e) for e in ends]
    return max(each), each


def _threads(jobs, during=None) -> tuple[float, float, list[float], float]:
    """One thread per job's copy, released together by a barrier; `during` (a callable) runs on this thread once they
    are released. Returns the clock (time.perf_counter) just before and just after the release, each copy's end and
    `during`'s end (the release's time without it)."""
    gate, done = threading.Barrier(len(jobs) + 1), [0.0] * len(jobs)

    def work(i, dst, src):
        gate.wait()
        dst.copy_(src)
        done[i] = time.perf_counter()

    threads = [threading.Thread(target=work, args=(i, d, s)) for i, (_, d, s) in enumerate(jobs)]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    gate.wait()
    t1 = time.perf_counter()
    if during is not None:
        during()
    t_end = time.perf_counter() if during is not None else t1
    for t in threads:
        t.join()
    return t0, t1, done, t_end


def _run_cpu(jobs) -> tuple[float, list[float]]:
    """The same on a CPU: one thread per flow, released together; (ms until the last lands, each flow's ms)."""
    t0, _, done, _ = _threads(jobs)
    each = [(x - t0) * 1e3 for x in done]
    return max(each), each


def measure(cfg: Config, run: Run) -> None:
    """The ceiling first — one 1 GiB copy alone per direction (on a CPU 64 MiB or a flow's size), cfg.repeats times
    (ceiling.csv) — then every (path,
    flows) configuration in rotated rounds after a warm-up round (a progress bar over the rounds): flows.csv, one
    row per (path, flows, round, flow) with the flow's ms and bytes, and the round's ms until the last flow landed.
    With cfg.beside, the compute load alone and beside each configuration, in rotated rounds after a warm-up round:
    beside.csv, one row per (path — "alone" without copies —, flows, gate, round) with the compute's ms and the
    copies'; gate "both" runs every one of them gated and ungated in the same rounds (on a CPU the gate is moot:
    its rows say gate on)."""
    run.update(resolved=cfg.resolved())
    dev, gpu = cfg.device, cfg.device.type == "cuda"
    configs = [(p, n) for p in cfg.paths for n in cfg.flows]
    buf = _Buffers(max(cfg.flows), cfg.size, dev)
    ceil_rows = []
    # the ceiling: 1 GiB alone on a GPU (where the link ceilings are measured); on a CPU, whose run checks the logic
    # only, the larger of a flow's size and 64 MiB
    size = (1 << 30) if gpu else max(cfg.size, 64 << 20)
    big = _Buffers(1, size, dev)
    for part in cfg.paths[0].split("+") if not gpu else ("d2h", "h2d"):
        for r in range(cfg.repeats + 1):
            jobs = big.jobs(part, 1)
            ms, _ = _run_gpu(jobs, big.streams, dev) if gpu else _run_cpu(jobs)
            if r:  # the first is a warm-up
                ceil_rows.append({"path": part, "round": r - 1, "ms": ms, "bytes": size})
    del big
    run.save_table(pd.DataFrame(ceil_rows), "ceiling")
    rows = []
    bar = tqdm(total=(cfg.repeats + 1) * len(configs), desc="contention", unit="config")
    for r in range(cfg.repeats + 1):
        k = r % len(configs)
        for path, n in configs[k:] + configs[:k]:  # rotated: drift hits every configuration alike
            jobs = buf.jobs(path, n)
            total, each = _run_gpu(jobs, buf.streams, dev) if gpu else _run_cpu(jobs)
            bar.update(1)
            if r == 0:
                continue  # warm-up round
            for i, ((part, _, _), ms) in enumerate(zip(jobs, each)):
                rows.append({"path": path, "flows": n, "round": r - 1, "flow": i, "direction": part, "ms": ms,
                             "bytes": cfg.size, "round_ms": total})
    bar.close()
    run.save_table(pd.DataFrame(rows), "flows")
    if cfg.beside:
        compute, side = _Compute(dev), []
        gates = {"on": (True,), "off": (False,), "both": (True, False)}[cfg.gate] if gpu else (True,)
        kinds = [(path, n, g) for path, n in [("alone", 0)] + configs for g in gates]
        bar = tqdm(total=(cfg.repeats + 1) * len(kinds), desc="compute beside", unit="config")
        for r in range(cfg.repeats + 1):
            k = r % len(kinds)
            for path, n, g in kinds[k:] + kinds[:k]:
                jobs = [] if path == "alone" else buf.jobs(path, n)
                c_ms, copies_ms = (_beside_gpu(jobs, buf.streams, dev, compute, gate=g) if gpu
                                   else _beside_cpu(jobs, compute))
                bar.update(1)
                if r:
                    side.append({"path": path, "flows": n, "gate": "on" if g else "off", "round": r - 1,
                                 "compute_ms": c_ms, "copies_ms": copies_ms})
        bar.close()
        run.save_table(pd.DataFrame(side), "beside")
    if cfg.nixl_posting:
        # on a CPU the logic only: 1 and 2 posters of 4 KiB, without the progress threads (each keeps a core busy)
        posters, progs = (nixl_posting.THREADS, (False, True)) if gpu else ((1, 2), (False,))
        n = len(nixl_posting.MODES) * len(progs) * len(posters) * len(nixl_posting.DESCRIPTORS) * (cfg.repeats + 1)
        with tqdm(total=n, desc="nixl posting", unit="config") as bar:
            rows = nixl_posting.measure(posters, rounds=cfg.repeats, device=dev, nbytes=(64 if gpu else 4) << 10,
                                        progress_threads=progs, progress=bar.update)
        run.save_table(rows, "nixl_posting")


def jain(rates) -> float:
    """Jain's fairness index of the flows' rates: 1 when all are equal, 1/N when one has everything."""
    x = [float(v) for v in rates]
    return sum(x) ** 2 / (len(x) * sum(v * v for v in x)) if x and any(x) else float("nan")


def summarise(flows: pd.DataFrame, ceiling: pd.DataFrame) -> pd.DataFrame:
    """Per (path, flows): the aggregate rate (all bytes ÷ the time until the last flow lands) with the 95 % interval
    of its median over the rounds, the path's ceiling (the median 1 GiB copy alone; both directions' summed for a
    joined path) and the share of it, each flow's median rate and the slowest's, and Jain's index (median over the
    rounds) beside the index copies run one after another would give (jain_if_serial), and how far the flows' landings
    are from one after another (serial_gap_pct: the median over rounds of the largest |t_k ÷ (k · t_1) − 1|, per
    direction; near 0: they ran in order, each flow's "rate" is its place in the queue)."""
    ceil = {p: float(g["bytes"].iloc[0]) / statistics.median(g["ms"]) / 1e6 for p, g in ceiling.groupby("path")}
    out = []
    for (path, n), g in flows.groupby(["path", "flows"], sort=False):
        per_round = g.groupby("round")
        agg = [float(x["bytes"].sum()) / float(x["round_ms"].iloc[0]) / 1e6 for _, x in per_round]
        fair = [jain(x["bytes"] / x["ms"] / 1e6) for _, x in per_round]
        rate = g["bytes"] / g["ms"] / 1e6
        # copies that run one after another land at k × one copy's time: how far each round is from that (the
        # largest relative gap over its flows, per direction), and the Jain index such an order gives
        serial = []
        for _, x in g.groupby(["round", "direction"]):
            t = sorted(x["ms"])
            serial.append(max(abs(tk / ((k + 1) * t[0]) - 1) for k, tk in enumerate(t)))
        per_dir = len(g) // max(g["round"].nunique(), 1) // max(g["direction"].nunique(), 1)
        lo, hi = median_ci(agg)
        c = sum(ceil.get(p, float("nan")) for p in str(path).split("+"))
        med = statistics.median(agg)
        out.append({"path": path, "flows": int(n), "n": len(agg), "aggregate_gbps": med, "aggregate_lo": lo,
                    "aggregate_hi": hi, "ceiling_gbps": c, "pct_of_ceiling": 100 * med / c,
                    "pct_lo": 100 * lo / c, "pct_hi": 100 * hi / c, "flow_gbps_median": float(rate.median()),
                    "flow_gbps_min": float(rate.min()), "jain": statistics.median(fair),
                    "jain_if_serial": jain([1 / k for k in range(1, per_dir + 1)]),
                    "serial_gap_pct": 100 * statistics.median(serial),
                    "bytes_per_flow": int(g["bytes"].iloc[0])})
    order = {p: i for i, p in enumerate((*GPU_PATHS, *CPU_PATHS))}
    return pd.DataFrame(out).sort_values(["path", "flows"], key=lambda c: c.map(order) if c.name == "path" else c,
                                         kind="stable", ignore_index=True)


def validation(s: pd.DataFrame) -> pd.DataFrame:
    """validation.csv (issue 30): each configuration's measured aggregate with its interval and role (calibrate:
    a single path with 1 or 2 flows; validate: the rest), the simulator's prediction from the calibrate rows
    alone (kvlab.fabric.calibrate), the relative error and its interval from the measured aggregate's (abs_error_lo,
    abs_error_hi: of its size)."""
    rows = pd.DataFrame({"path": s["path"], "flows": s["flows"],
                         "role": ["calibrate" if "+" not in p and n <= 2 else "validate"
                                  for p, n in zip(s["path"], s["flows"])],
                         "measured_gbps": s["aggregate_gbps"], "measured_lo": s["aggregate_lo"],
                         "measured_hi": s["aggregate_hi"], "bytes": s["bytes_per_flow"]})
    v = calibrate.validation_table(rows)
    v["error_pct"] = 100 * (v["simulated_gbps"] / v["measured_gbps"] - 1)
    v["abs_error_pct"] = v["error_pct"].abs()
    # the error's interval from the measured aggregate's: sim/hi − 1 … sim/lo − 1, and of its size (0 where it
    # straddles zero)
    a, b = 100 * (v["simulated_gbps"] / v["measured_hi"] - 1), 100 * (v["simulated_gbps"] / v["measured_lo"] - 1)
    v["error_lo"], v["error_hi"] = a, b
    apart = (a > 0) | (b < 0)  # the interval does not hold zero
    v["abs_error_lo"] = np.where(apart, np.minimum(a.abs(), b.abs()), 0.0)
    v["abs_error_hi"] = np.maximum(a.abs(), b.abs())
    val = v[v["role"] == "validate"]
    v["median_abs_error_pct"] = float(val["abs_error_pct"].median()) if len(val) else float("nan")
    v["first_row"] = [True] + [False] * (len(v) - 1)
    return v


def beside_summary(beside: pd.DataFrame) -> pd.DataFrame:
    """Per configuration: the compute load's median time beside its copies with its interval, alone, the slowdown
    (median beside ÷ median alone) with the ratio's interval (intervals.ratio_ci: both sets resampled), and the
    copies' median time as a share of the compute's (≥ 1: they ran through all of it). Per gate (on / off; "—" for a
    run from before beside.csv said), each against the compute alone with the same gate."""
    beside = beside.assign(gate=beside["gate"] if "gate" in beside else "—")
    out = []
    for gate, bg in beside.groupby("gate", sort=False):
        alone = bg.loc[bg["path"] == "alone", "compute_ms"].tolist()
        a = statistics.median(alone)
        for (path, n), g in bg[bg["path"] != "alone"].groupby(["path", "flows"], sort=False):
            c = g["compute_ms"].tolist()
            lo, hi = median_ci(c)
            rlo, rhi = ratio_ci(c, alone)
            out.append({"path": path, "flows": int(n), "gate": gate, "n": len(c), "compute_ms": statistics.median(c),
                        "compute_lo": lo, "compute_hi": hi, "alone_ms": a, "slowdown": statistics.median(c) / a,
                        "slowdown_lo": rlo, "slowdown_hi": rhi,
                        "copies_over_compute": statistics.median(g["copies_ms"]) / statistics.median(c)})
    return pd.DataFrame(out)


def analyse(record: dict, tables: dict) -> Analysis:
    """The contention table (`summarise`), validation.csv (`validation`), the goals judged on the validation table
    by those in force when the run started, and a finding per path."""
    s = summarise(tables["flows"], tables["ceiling"])
    v = validation(s)
    g = goals.evaluate_run(NAME, record, v, keys=("path", "flows"))
    findings, values = [], {}
    for path, t in s.groupby("path", sort=False):
        parts = ", ".join(f"{r.flows}: {sig(r.aggregate_gbps)} GB/s ({r.pct_of_ceiling:.0f} %, Jain {r.jain:.2f})"
                          for r in t.itertuples())
        findings.append(f"- {_PATH_NAMES.get(path, path)}, ceiling {sig(t['ceiling_gbps'].iloc[0])} GB/s; by flows: "
                        f"{parts}.")
    ordered = s[(s["flows"] > 1)]
    if len(ordered):
        values["serial_gap_max_pct"] = f"{ordered['serial_gap_pct'].max():.1f}"
        findings.append(f"- With more than one flow on a path, the k-th flow lands at k × the first's time within "
                        f"{values['serial_gap_max_pct']} % (every configuration's median round): the copies run one "
                        "after another, so a flow's rate here is its place in the queue and Jain's index is the one that "
                        "order gives (the jain_if_serial column), not a measure of how the link shares.")
    val = v[v["role"] == "validate"]
    if len(val):
        values["median_abs_error_pct"] = f"{val['abs_error_pct'].median():.1f}"
        values["max_abs_error_pct"] = f"{val['abs_error_pct'].max():.1f}"
        full = int((~val["path"].str.contains("+", regex=False)).sum())
        findings.append(f"- The simulator, fitted on 1 and 2 flows of each single path, predicts the other "
                        f"{len(val)} configurations within {values['max_abs_error_pct']} % (median "
                        f"{values['median_abs_error_pct']} %); {full} of them are single paths that one flow already "
                        "fills, where any sharing rule gives the same aggregate, so only the joined paths test it.")
    out = {"contention": s, "validation": v}
    if "beside" in tables:
        b = out["compute_beside"] = beside_summary(tables["beside"])
        comp = record.get("resolved", {}).get("compute", {})
        for gate, bg in b.groupby("gate", sort=False):
            worst = bg.loc[bg["slowdown"].idxmax()]
            key = "beside_worst_pct" if gate in ("on", "—") else f"beside_worst_pct_gate_{gate}"
            values[key] = f"{100 * (worst.slowdown - 1):+.1f}"
            how = {"on": " (rounds started behind the GPU gate)", "off": " (rounds without the GPU gate)"}.get(gate, "")
            findings.append(f"- A prefill-like load ({comp.get('matmuls', '?')} matmuls of {comp.get('m', '?')} × "
                            f"{comp.get('k', '?')} × {comp.get('n', '?')}, {comp.get('dtype', '?')}) takes "
                            f"{sig(worst.alone_ms)} ms alone{how}; beside the copies it is at most "
                            f"{values[key]} % slower ({_PATH_NAMES.get(worst.path, worst.path)}, "
                            f"{worst.flows} flows: {worst.slowdown:.3f}× [{worst.slowdown_lo:.3f}, "
                            f"{worst.slowdown_hi:.3f}]).")
    if "nixl_posting" in tables:
        out["posting"] = nixl_posting.summarise(tables["nixl_posting"])  # posting.csv beside the raw rows
        findings += nixl_posting.findings(out["posting"], values)
        raw = tables["nixl_posting"]
        values["posting.descriptor_kib"] = f"{raw['nbytes'].max() / 1024:g}"
        if "cpus" in raw:
            values["posting.cpus"] = str(int(raw["cpus"].max()))
    return Analysis(NAME, record, raw=dict(tables), tables=out, goals=g, findings=findings, values=values)


def goal_table(a: Analysis, study: str) -> pd.DataFrame:
    """The contention goals of run `a`, as the verdicts table shows them (`mode`: the path and its flows)."""
    g = a.goals.copy()
    if len(g):
        g["mode"] = g["path"].map(lambda p: _PATH_NAMES.get(p, p)) + ", " + g["flows"].astype(str) + " flows"
    return g


def figures(a: Analysis) -> dict:
    """Per path, the aggregate rate by flow count (median and 95 % interval) against the path's ceiling, the
    simulator's prediction beside each, and Jain's index under each bar (copies in order give 0.90, 0.76, 0.60 at 2, 4,
    8 flows: the findings say how close the landings were to that order)."""
    import matplotlib.pyplot as plt  # matplotlib only when a figure is drawn

    s, v = a.tables["contention"], a.tables["validation"].set_index(["path", "flows"])
    paths = list(dict.fromkeys(s["path"]))
    # 3.4 in a panel: three side by side still read at a blog's 700 px
    fig, axes = plt.subplots(1, len(paths), figsize=(3.4 * len(paths), 4.4), squeeze=False, layout="constrained")
    colors = plots.palette(["measured", "simulated"])
    for ax, path in zip(axes[0], paths):
        t = s[s["path"] == path]
        xs = range(len(t))
        err = [(t["aggregate_gbps"] - t["aggregate_lo"]).clip(lower=0), (t["aggregate_hi"] - t["aggregate_gbps"]).clip(lower=0)]
        role = [v.loc[(path, n), "role"] for n in t["flows"]]
        bars = ax.bar(xs, t["aggregate_gbps"], 0.6, yerr=err, capsize=3, color=colors["measured"],
                      label="measured (hatched: not fitted)" if ax is axes[0][0] else None)
        for bar, r in zip(bars, role):
            if r != "calibrate":
                bar.set_hatch("//")
        sim = [v.loc[(path, n), "simulated_gbps"] for n in t["flows"]]
        ax.scatter(xs, sim, marker="_", s=220, color="black", zorder=3,
                   label="simulated (fitted on 1 and 2 flows)" if ax is axes[0][0] else None)
        ax.axhline(t["ceiling_gbps"].iloc[0], color="0.4", ls=":", lw=1)
        ax.set_xticks(list(xs), [f"{n}\n{j:.2f}" for n, j in zip(t["flows"], t["jain"])])
        ax.set_xlabel("flows (below: Jain's index)")
        ax.set_title(_PATH_NAMES.get(path, path), fontsize=11)
        ax.set_ylim(0, pd.concat([t["aggregate_hi"], t["aggregate_gbps"], t["ceiling_gbps"]]).max() * 1.3)  # NaN: too few rounds
    axes[0][0].set_ylabel("aggregate GB/s (dotted: the path's ceiling)")
    axes[0][0].legend(fontsize=8.5, frameon=False, loc="upper left")
    fig.suptitle(f"N copies of {s['bytes_per_flow'].iloc[0] / 2**20:.0f} MiB sharing one path at once", fontsize=12)
    out = {"contention_gbps": fig}
    if "posting" in a.tables:
        out["nixl_posting"] = nixl_posting.figure(a.tables["posting"], a.raw["nixl_posting"]["cpus"].max()
                                                  if "cpus" in a.raw["nixl_posting"] else None)
    return out


def _table(analyses: list[Analysis], link, **_) -> str:
    """Per run, path and flow count: the aggregate GB/s with its 95 % interval, the share of the path's ceiling,
    each flow's median and slowest GB/s, Jain's index beside the one copies in order give, and the simulator's
    prediction with its role and error (with the error's interval)."""
    rows = []
    for a in analyses:
        v = a.tables["validation"].set_index(["path", "flows"])
        for r in a.tables["contention"].itertuples():
            sim = v.loc[(r.path, r.flows)]
            rows.append({"run": link(a.where), "path": _PATH_NAMES.get(r.path, r.path), "flows": r.flows,
                         "aggregate GB/s [95 %]": f"{sig(r.aggregate_gbps)} [{sig(r.aggregate_lo)}, {sig(r.aggregate_hi)}]",
                         "% of ceiling": f"{r.pct_of_ceiling:.0f}", "per flow (slowest) GB/s":
                         f"{sig(r.flow_gbps_median)} ({sig(r.flow_gbps_min)})", "Jain (one after another)": f"{r.jain:.2f} ({r.jain_if_serial:.2f})",
                         "simulated GB/s": sig(sim.simulated_gbps), "role": sim.role,
                         "error [95 %]": f"{sim.error_pct:+.1f} % [{sim.error_lo:+.1f}, {sim.error_hi:+.1f}]"})
    return md_table(pd.DataFrame(rows))


def _beside(analyses: list[Analysis], link, **_) -> str:
    """Per run, configuration and gate (on: rounds started behind the GPU sleep; off: without; —: a run from before
    beside.csv said): the prefill-like load's time beside the copies against alone, the slowdown with its interval,
    and how long the copies ran against it."""
    rows = []
    for a in analyses:
        for r in a.tables["compute_beside"].itertuples():
            rows.append({"run": link(a.where), "path": _PATH_NAMES.get(r.path, r.path), "flows": r.flows,
                         "gate": r.gate, "compute ms [95 %]": f"{sig(r.compute_ms)} [{sig(r.compute_lo)}, {sig(r.compute_hi)}]",
                         "alone ms": sig(r.alone_ms),
                         "slowdown [95 %]": f"{r.slowdown:.3f}× [{r.slowdown_lo:.3f}, {r.slowdown_hi:.3f}]",
                         "copies ÷ compute": f"{r.copies_over_compute:.2f}"})
    return md_table(pd.DataFrame(rows))


def _posting(analyses: list[Analysis], link, **_) -> str:
    """Per run, posting mode, descriptors a request and posters: the wall time from the release until the last post
    returned with its interval, the aggregate posting rate, its ratio to one poster's with the ratio's interval, the
    time until every request was DONE, and a poster's own post time per descriptor."""
    rows = [{"run": link(a.where), "way": r.mode, "progress thread": "on" if r.progress_thread else "off",
             "descriptors": r.descriptors, "posters": r.threads, "rounds": r.n,
             "wall µs [95 %]": f"{sig(r.wall_post_us)} [{sig(r.wall_lo)}, {sig(r.wall_hi)}]",
             "descriptors / s": f"{r.descriptors_per_s:,.0f}",
             "× one poster [95 %]": f"{r.rate_x_one:.2f} [{r.rate_x_lo:.2f}, {r.rate_x_hi:.2f}]",
             "until DONE µs": sig(r.done_us), "× one, until DONE [95 %]":
             f"{r.done_x_one:.2f} [{r.done_x_lo:.2f}, {r.done_x_hi:.2f}]" if hasattr(r, "done_x_one") else "—",
             "post µs / descriptor": f"{r.post_us_per_descriptor:.1f}"}
            for a in analyses if "posting" in a.tables for r in a.tables["posting"].itertuples()]
    return md_table(pd.DataFrame(rows))


BLOCKS = {"table": _table, "beside": _beside, "posting": _posting}
