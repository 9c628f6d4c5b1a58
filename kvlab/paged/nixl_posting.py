"""NIXL posting under concurrency (issue 30): T posters, each posting its own prepared WRITE request of K descriptors,
released together by a barrier. Three ways (`MODES`): T threads through one pair of NIXL agents (kvlab.paged.nixl.
NixlLink, both in this process; `shared-agents`), T threads each through a pair of its own (`agents-per-thread`), and T
processes each with its own pair (`processes`). If the threads' rate stays at one thread's while the processes' grows,
what serialises the posting is this process's interpreter lock (the binding keeps it while it posts), not the agent.

The re-shard runs found posting, not copying, to be what NIXL costs on this host (about 10 µs of host time a
descriptor, docs/results/tp_reshard.md). Does a second posting thread double the rate, or do the threads queue behind
one another (a lock in the agent, or the interpreter's)? Per round and thread: how long its `transfer()` call took
(post_us), and, for the round, the time from the release (or the first post, where a poster began before the parent
read its clock) until the last call returned (wall_post_us) and until every request was DONE (done_us): time.perf_counter, the system's monotonic clock, which every process reads alike. Descriptors are small (`nbytes`, 64 KiB by default) so that the posting, not the bytes,
sets the time. `summarise`: per (mode, threads, descriptors), the median wall time with its interval, the aggregate
posting rate (descriptors a second) and its ratio to one poster's in the same mode with that ratio's interval.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import threading
import time

import numpy as np
import pandas as pd
import torch

from ..intervals import median_ci, ratio_ci
from .nixl import NixlLink, same_process_env

__all__ = ["THREADS", "DESCRIPTORS", "MODES", "measure", "summarise", "findings"]

THREADS = (1, 2, 4, 8)
DESCRIPTORS = (56, 448)  # one piece's layer sides on Qwen2.5-7B (28 layers × K, V), and eight of them
MODES = ("shared-agents", "agents-per-thread", "processes")


class _Poster:
    """One poster's own bytes (a source and a destination tensor of kmax descriptors of `nbytes`), the link it posts
    through (its own, or `link` shared with others) and a prepared request per descriptor count."""

    def __init__(self, descriptors, nbytes: int, dev: torch.device, link: NixlLink | None = None, index: int = 0,
                 src=None, dst=None):
        kmax = max(descriptors)
        self.own = link is None
        if self.own:
            src = torch.full((kmax * nbytes,), 1 + index % 255, dtype=torch.uint8, device=dev)
            dst = torch.zeros_like(src)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            link, index = NixlLink([src], [dst]), 0
        self.link, self.src, self.dst = link, src, dst
        self.handles = {k: link.prepare(src, (index * kmax + np.arange(k, dtype=np.int64)) * nbytes, dst,
                                        (index * kmax + np.arange(k, dtype=np.int64)) * nbytes, nbytes)
                        for k in descriptors}

    def post(self, k: int) -> tuple[float, float, float]:
        """(posted at, post returned at, DONE at) for the request of k descriptors."""
        agent, h = self.link.initiator, self.handles[k]
        t0 = time.perf_counter()
        state = agent.transfer(h)
        t1 = time.perf_counter()
        while state == "PROC":
            state = agent.check_xfer_state(h)
        t2 = time.perf_counter()
        if state != "DONE":
            raise RuntimeError(f"nixl transfer ended in state {state!r}")
        return t0, t1, t2

    def close(self) -> bool:
        """Close an own link; True when its destination holds its source."""
        ok = torch.equal(self.src, self.dst) if self.own else True
        if self.own:
            self.link.close()
        return ok


def _process_poster(index, descriptors, nbytes, device, conn, gates) -> None:
    """A posting process: sets up its poster, says ready, then per command k (None: stop) waits at the barrier of
    its configuration and posts; sends back its times, or the error's text."""
    try:
        poster = _Poster(descriptors, nbytes, torch.device(device), index=index)
        conn.send("ready")
        while (cmd := conn.recv()) is not None:
            t, k = cmd
            gates[t].wait()
            conn.send(poster.post(k))
        conn.send(poster.close())
    except BaseException as exc:  # the parent raises it
        conn.send(f"{type(exc).__name__}: {exc}")


def _threads_post(posters, k) -> tuple[list[tuple[float, float, float]], float]:
    """Each poster posts its request of k descriptors on a thread of its own, all released by one barrier. Returns
    per poster (posted at, post returned at, DONE at) and the release time, on time.perf_counter's clock."""
    gate, out, errors = threading.Barrier(len(posters) + 1), [None] * len(posters), []

    def work(i, p):
        gate.wait()
        try:
            out[i] = p.post(k)
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i, p)) for i, p in enumerate(posters)]
    for t in threads:
        t.start()
    gate.wait()
    t_rel = time.perf_counter()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out, t_rel


def _reply(conn):
    got = conn.recv()
    if isinstance(got, str) and got != "ready":
        raise RuntimeError(f"a posting process failed: {got}")
    return got


class _Processes:
    """tmax posting processes (spawned: CUDA does not survive a fork), each with its own pair of agents."""

    def __init__(self, tmax, threads, descriptors, nbytes, dev):
        ctx = mp.get_context("spawn")
        self.gates = {t: ctx.Barrier(t + 1) for t in threads}
        self.conns, self.procs = [], []
        try:
            for i in range(tmax):
                mine, theirs = ctx.Pipe()
                proc = ctx.Process(target=_process_poster, args=(i, descriptors, nbytes, str(dev), theirs, self.gates),
                                   daemon=True)
                proc.start()
                self.conns.append(mine)
                self.procs.append(proc)
            for c in self.conns:
                _reply(c)
        except BaseException:
            self.close(check=False)
            raise

    def post(self, t, k):
        for c in self.conns[:t]:
            c.send((t, k))
        self.gates[t].wait()
        t_rel = time.perf_counter()
        return [tuple(_reply(c)) for c in self.conns[:t]], t_rel

    def close(self, check=True) -> bool:
        ok = True
        for c, proc in zip(self.conns, self.procs):
            try:
                c.send(None)
                ok = bool(_reply(c)) and ok if check else ok
            except (OSError, EOFError, RuntimeError):
                ok = False
        for proc in self.procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
        return ok


def measure(threads=THREADS, descriptors=DESCRIPTORS, nbytes: int = 64 << 10, rounds: int = 10, warmup: int = 1,
            device=None, modes=MODES, progress=None) -> pd.DataFrame:
    """Rows (mode, threads, descriptors, round, thread, post_us, wall_post_us, done_us, nbytes, device, nixl_env):
    every (mode, threads, descriptors) configuration once a round, in rotated order, after `warmup` rounds ("threads"
    counts the posters, processes in mode `processes`). Each poster's request covers its own bytes on `device` (a GPU:
    VRAM; else host memory); every destination is checked against its source at the end. `progress`: a callable told
    once per configuration run."""
    threads, descriptors = sorted({int(t) for t in threads}), sorted({int(k) for k in descriptors})
    modes = list(dict.fromkeys(modes))
    if not threads or min(threads) < 1 or not descriptors or min(descriptors) < 1 or nbytes < 1 or rounds < 1:
        raise ValueError(f"threads={threads}, descriptors={descriptors}, nbytes={nbytes}, rounds={rounds}: give "
                         "threads and descriptors ≥ 1, nbytes ≥ 1 and rounds ≥ 1")
    if not modes or set(modes) - set(MODES):
        raise ValueError(f"modes={modes}: give one or more of {', '.join(MODES)}")
    dev = torch.device(device or "cpu")
    tmax, kmax = max(threads), max(descriptors)
    runners, closers, env = {}, [], " ".join(f"{k}={v}" for k, v in same_process_env().items())
    try:
        if "shared-agents" in modes:  # one pair of agents, the posters' bytes side by side in one pair of tensors
            src = torch.ones(tmax * kmax * nbytes, dtype=torch.uint8, device=dev)
            dst = torch.zeros_like(src)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            link = NixlLink([src], [dst])
            closers.append(lambda: (link.close(), torch.equal(src, dst))[1])
            shared = [_Poster(descriptors, nbytes, dev, link, i, src, dst) for i in range(tmax)]
            runners["shared-agents"] = lambda t, k: _threads_post(shared[:t], k)
        if "agents-per-thread" in modes:
            own = []
            closers.append(lambda: all([p.close() for p in own]))
            own += [_Poster(descriptors, nbytes, dev, index=i) for i in range(tmax)]
            runners["agents-per-thread"] = lambda t, k: _threads_post(own[:t], k)
        if "processes" in modes:
            procs = _Processes(tmax, threads, descriptors, nbytes, dev)
            closers.append(procs.close)
            runners["processes"] = procs.post
        configs = [(m, t, k) for m in modes for k in descriptors for t in threads]
        rows = []
        for r in range(warmup + rounds):
            j = r % len(configs)
            for m, t, k in configs[j:] + configs[:j]:
                times, t_rel = runners[m](t, k)
                if progress is not None:
                    progress()
                if r < warmup:
                    continue
                start = min(t_rel, *(t0 for t0, _, _ in times))  # a process may post before the parent reads its clock
                wall = max(t1 for _, t1, _ in times) - start
                done = max(t2 for _, _, t2 in times) - start
                rows += [{"mode": m, "threads": t, "descriptors": k, "round": r - warmup, "thread": i,
                          "post_us": 1e6 * (t1 - t0), "wall_post_us": 1e6 * wall, "done_us": 1e6 * done,
                          "nbytes": nbytes, "device": str(dev), "nixl_env": env}
                         for i, (t0, t1, _) in enumerate(times)]
    finally:
        ok = [c() for c in closers]
    if not all(ok):
        raise RuntimeError("nixl posting: a destination does not hold what its requests wrote")
    return pd.DataFrame(rows)


def summarise(rows: pd.DataFrame) -> pd.DataFrame:
    """Per (mode, threads, descriptors): rounds, the median wall time from the release until the last post returned
    with its interval, the median until all were DONE, the aggregate posting rate (threads × descriptors ÷ that wall
    time, per second), its ratio to one poster's rate in the same mode for the same descriptors with the ratio's
    interval (rate_x_one, rate_x_lo, rate_x_hi: both rounds' sets resampled), and a poster's own post time per
    descriptor (median, µs). Rows from before the modes count as shared-agents."""
    rows = rows if "mode" in rows else rows.assign(mode="shared-agents")
    per_round = rows.groupby(["mode", "threads", "descriptors", "round"], sort=False).agg(
        wall=("wall_post_us", "first"), done=("done_us", "first"), post=("post_us", "median")).reset_index()
    per_round = per_round.sort_values(["mode", "descriptors", "threads", "round"], key=lambda c: c.map(
        {m: i for i, m in enumerate(MODES)}) if c.name == "mode" else c)
    out = []
    for (m, k, t), g in per_round.groupby(["mode", "descriptors", "threads"], sort=False):
        wall = g["wall"].tolist()
        one = per_round[(per_round["mode"] == m) & (per_round["threads"] == 1)
                        & (per_round["descriptors"] == k)]["wall"].tolist()
        lo, hi = median_ci(wall)
        # rate ratio = (t·k / wall) / (k / wall_1) = t · wall_1 / wall
        rlo, rhi = ratio_ci(one, wall) if one else (float("nan"), float("nan"))
        med = statistics.median(wall)
        out.append({"mode": m, "threads": int(t), "descriptors": int(k), "n": len(wall), "wall_post_us": med,
                    "wall_lo": lo, "wall_hi": hi, "done_us": statistics.median(g["done"]),
                    "descriptors_per_s": 1e6 * t * k / med,
                    "rate_x_one": t * statistics.median(one) / med if one else float("nan"),
                    "rate_x_lo": t * rlo, "rate_x_hi": t * rhi,
                    "post_us_per_descriptor": statistics.median(g["post"]) / k})
    return pd.DataFrame(out)


_WHO = {"shared-agents": "threads through one pair of agents", "agents-per-thread": "threads with an agent pair each",
        "processes": "processes with an agent pair each"}


def findings(s: pd.DataFrame, values: dict) -> list[str]:
    """One line per (mode, descriptor count): the aggregate rate at one poster and at the most, and the ratio.
    Fills `values` (posting.{mode}.{K}.rate_x_max, posting.{mode}.{K}.one_us_per_descriptor)."""
    out = []
    for (m, k), g in s.groupby(["mode", "descriptors"], sort=False):
        one, top = g[g["threads"] == g["threads"].min()].iloc[0], g[g["threads"] == g["threads"].max()].iloc[0]
        values[f"posting.{m}.{k}.rate_x_max"] = f"{top.rate_x_one:.2f}"
        values[f"posting.{m}.{k}.one_us_per_descriptor"] = f"{1e6 / one.descriptors_per_s:.1f}"
        out.append(f"- NIXL posting, {_WHO.get(m, m)}, {int(k)} descriptors a request: one posts "
                   f"{one.descriptors_per_s:,.0f} descriptors a second ({1e6 / one.descriptors_per_s:.1f} µs each); "
                   f"{int(top.threads)} together {top.descriptors_per_s:,.0f} a second, {top.rate_x_one:.2f}× "
                   f"[{top.rate_x_lo:.2f}, {top.rate_x_hi:.2f}] one's rate.")
    return out
