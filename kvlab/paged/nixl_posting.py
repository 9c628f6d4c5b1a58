"""NIXL posting under concurrency (issue 30): T threads, each posting its own prepared WRITE request of K descriptors
through one pair of NIXL agents (kvlab.paged.nixl.NixlLink, both in this process), released together by a barrier.

The re-shard runs found posting, not copying, to be what NIXL costs on this host (about 10 µs of host time a
descriptor, docs/results/tp_reshard.md). Does a second posting thread double the rate, or do the threads queue behind
one another (a lock in the agent, or the interpreter's)? Per round and thread: how long its `transfer()` call took
(post_us), and, for the round, the time from the release until the last call returned (wall_post_us) and until every
request was DONE (done_us). Descriptors are small (`nbytes`, 64 KiB by default) so that the posting, not the bytes,
sets the time. `summarise`: per (threads, descriptors), the median wall time with its interval, the aggregate
posting rate (descriptors a second) and its ratio to one thread's with that ratio's interval.
"""

from __future__ import annotations

import statistics
import threading
import time

import numpy as np
import pandas as pd
import torch

from ..intervals import median_ci, ratio_ci
from .nixl import NixlLink

__all__ = ["THREADS", "DESCRIPTORS", "measure", "summarise", "findings"]

THREADS = (1, 2, 4, 8)
DESCRIPTORS = (56, 448)  # one piece's layer sides on Qwen2.5-7B (28 layers × K, V), and eight of them


def _post_together(agent, handles) -> tuple[list[tuple[float, float, float]], float]:
    """Each handle posted by a thread of its own, all released by one barrier; each thread polls its request to DONE.
    Returns per thread (posted at, post returned at, DONE at) and the release time, on time.perf_counter's clock."""
    gate, out, errors = threading.Barrier(len(handles) + 1), [None] * len(handles), []

    def work(i, h):
        gate.wait()
        t0 = time.perf_counter()
        state = agent.transfer(h)
        t1 = time.perf_counter()
        while state == "PROC":
            state = agent.check_xfer_state(h)
        out[i] = (t0, t1, time.perf_counter())
        if state != "DONE":
            errors.append(state)

    threads = [threading.Thread(target=work, args=(i, h)) for i, h in enumerate(handles)]
    for t in threads:
        t.start()
    gate.wait()
    t_rel = time.perf_counter()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"nixl transfer ended in state {errors[0]!r}")
    return out, t_rel


def measure(threads=THREADS, descriptors=DESCRIPTORS, nbytes: int = 64 << 10, rounds: int = 10, warmup: int = 1,
            device=None, progress=None) -> pd.DataFrame:
    """Rows (threads, descriptors, round, thread, post_us, wall_post_us, done_us, nbytes, device, nixl_env): every
    (threads, descriptors) configuration once a round, in rotated order, after `warmup` rounds. Each thread's request
    covers its own bytes of one source and one destination tensor on `device` (a GPU: VRAM; else host memory).
    `progress`: a callable told once per configuration run."""
    threads, descriptors = sorted({int(t) for t in threads}), sorted({int(k) for k in descriptors})
    if not threads or min(threads) < 1 or not descriptors or min(descriptors) < 1 or nbytes < 1 or rounds < 1:
        raise ValueError(f"threads={threads}, descriptors={descriptors}, nbytes={nbytes}, rounds={rounds}: give "
                         "threads and descriptors ≥ 1, nbytes ≥ 1 and rounds ≥ 1")
    dev = torch.device(device or "cpu")
    tmax, kmax = max(threads), max(descriptors)
    src = torch.ones(tmax * kmax * nbytes, dtype=torch.uint8, device=dev)
    dst = torch.zeros_like(src)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    link = NixlLink([src], [dst])
    try:
        handles = {}
        for i in range(tmax):
            for k in descriptors:
                offs = (i * kmax + np.arange(k, dtype=np.int64)) * nbytes
                handles[i, k] = link.prepare(src, offs, dst, offs, nbytes)
        configs = [(t, k) for k in descriptors for t in threads]
        env = " ".join(f"{k}={v}" for k, v in link.env.items())
        rows = []
        for r in range(warmup + rounds):
            j = r % len(configs)
            for t, k in configs[j:] + configs[:j]:
                times, t_rel = _post_together(link.initiator, [handles[i, k] for i in range(t)])
                if progress is not None:
                    progress()
                if r < warmup:
                    continue
                wall = max(t1 for _, t1, _ in times) - t_rel
                done = max(t2 for _, _, t2 in times) - t_rel
                rows += [{"threads": t, "descriptors": k, "round": r - warmup, "thread": i,
                          "post_us": 1e6 * (t1 - t0), "wall_post_us": 1e6 * wall, "done_us": 1e6 * done,
                          "nbytes": nbytes, "device": str(dev), "nixl_env": env}
                         for i, (t0, t1, _) in enumerate(times)]
        if not torch.equal(src, dst):
            raise RuntimeError("nixl posting: the destination does not hold what the requests wrote")
    finally:
        link.close()
    return pd.DataFrame(rows)


def summarise(rows: pd.DataFrame) -> pd.DataFrame:
    """Per (threads, descriptors): rounds, the median wall time from the release until the last post returned with
    its interval, the median until all were DONE, the aggregate posting rate (threads × descriptors ÷ that wall time,
    per second), its ratio to one thread's rate for the same descriptors with the ratio's interval (rate_x_one,
    rate_x_lo, rate_x_hi: both rounds' sets resampled), and one thread's own post time per descriptor (median, µs)."""
    per_round = rows.groupby(["threads", "descriptors", "round"], sort=True).agg(
        wall=("wall_post_us", "first"), done=("done_us", "first"), post=("post_us", "median")).reset_index()
    out = []
    for (t, k), g in per_round.groupby(["threads", "descriptors"], sort=True):
        wall = g["wall"].tolist()
        one = per_round[(per_round["threads"] == 1) & (per_round["descriptors"] == k)]["wall"].tolist()
        lo, hi = median_ci(wall)
        # rate ratio = (t·k / wall) / (k / wall_1) = t · wall_1 / wall
        rlo, rhi = ratio_ci(one, wall) if one else (float("nan"), float("nan"))
        med = statistics.median(wall)
        out.append({"threads": int(t), "descriptors": int(k), "n": len(wall), "wall_post_us": med,
                    "wall_lo": lo, "wall_hi": hi, "done_us": statistics.median(g["done"]),
                    "descriptors_per_s": 1e6 * t * k / med,
                    "rate_x_one": t * statistics.median(one) / med if one else float("nan"),
                    "rate_x_lo": t * rlo, "rate_x_hi": t * rhi,
                    "post_us_per_descriptor": statistics.median(g["post"]) / k})
    return pd.DataFrame(out)


def findings(s: pd.DataFrame, values: dict) -> list[str]:
    """One line per descriptor count: the aggregate rate at one thread and at the most threads, and the ratio.
    Fills `values` (posting.{K}.rate_x_max, posting.{K}.one_thread_us_per_descriptor)."""
    out = []
    for k, g in s.groupby("descriptors", sort=True):
        one, top = g[g["threads"] == g["threads"].min()].iloc[0], g[g["threads"] == g["threads"].max()].iloc[0]
        values[f"posting.{k}.rate_x_max"] = f"{top.rate_x_one:.2f}"
        values[f"posting.{k}.one_thread_us_per_descriptor"] = f"{1e6 / one.descriptors_per_s:.1f}"
        out.append(f"- NIXL posting, {int(k)} descriptors a request: {int(one.threads)} thread posts "
                   f"{one.descriptors_per_s:,.0f} descriptors a second ({1e6 / one.descriptors_per_s:.1f} µs each); "
                   f"{int(top.threads)} threads together {top.descriptors_per_s:,.0f} a second, {top.rate_x_one:.2f}× "
                   f"[{top.rate_x_lo:.2f}, {top.rate_x_hi:.2f}] one thread's rate.")
    return out
