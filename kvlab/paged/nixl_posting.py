"""NIXL posting under concurrency (issue 30): T posters, each posting its own prepared WRITE request of K descriptors,
released together by a barrier. Three ways (`MODES`): T threads through one pair of NIXL agents (kvlab.paged.nixl.
NixlLink, both in this process; `shared-agents`), T threads each through a pair of its own (`agents-per-thread`), and T
spawned processes each with its own pair (`processes`) — and each with NIXL's progress thread in every agent (its
default) or without (`progress_thread`). The shared pair is made thread-safe (NIXL's strict synchronisation: without
it an agent takes no locks, and two threads posting at once crashed it here); the others keep NIXL's default. If the threads' rate stays at one thread's while the processes' grows, what
serialises the posting is this process's interpreter lock, not the agent.

Why phases: a NIXL agent's progress thread polls its backend without pause, so an agent that merely exists keeps a
core busy (run 20261204-202448-h200 kept every mode's 17 pairs alive at once on the H200 host's 16 cores, and every
rate fell, one thread's included). Here only one phase's posters exist at a time: a phase is (mode, progress thread,
T), its T posters are made, run every descriptor count for all rounds (rotated), and are closed before the next.

The re-shard runs found posting, not copying, to be what NIXL costs on this host (about 10 µs of host time a
descriptor, docs/results/tp_reshard.md). Per round and poster: how long its `transfer()` call took (post_us), and,
for the round, the time from the release (or the first post, where a poster began before the parent read its clock)
until the last call returned (wall_post_us) and until every request was DONE (done_us): time.perf_counter, the
system's monotonic clock, which every process reads alike. Descriptors are small (`nbytes`, 64 KiB by default) so
that the posting, not the bytes, sets the time. `summarise`: per (mode, progress thread, T, K), the median wall time
with its interval, the aggregate posting rate (descriptors a second) and its ratio to one poster's of the same mode
and progress thread, with that ratio's interval.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import statistics
import threading
import time

import numpy as np
import pandas as pd
import torch

from .. import plots
from ..intervals import median_ci, ratio_ci
from .nixl import NixlLink, same_process_env

__all__ = ["THREADS", "DESCRIPTORS", "MODES", "WHO", "measure", "summarise", "findings", "figure"]

THREADS = (1, 2, 4, 8)
DESCRIPTORS = (56, 448)  # one piece's layer sides on Qwen2.5-7B (28 layers × K, V), and eight of them
MODES = ("shared-agents", "agents-per-thread", "processes")


TIMEOUT_S = 120.0  # a barrier, a reply or a request that takes longer has failed (a poster died, or NIXL hung)


class _Poster:
    """One poster's own bytes (kmax descriptors of `nbytes` in a source and a destination tensor), the link it posts
    through (its own, or `link` shared, its bytes at slot `index` of the shared tensors) and a prepared request per
    descriptor count."""

    def __init__(self, descriptors, nbytes: int, dev: torch.device, progress_thread: bool = True,
                 link: NixlLink | None = None, index: int = 0, src=None, dst=None):
        kmax = max(descriptors)
        self.own = link is None
        if self.own:
            src = torch.full((kmax * nbytes,), 1 + index % 255, dtype=torch.uint8, device=dev)
            dst = torch.zeros_like(src)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            link, index = NixlLink([src], [dst], progress_thread=progress_thread), 0
        self.link, self.src, self.dst = link, src, dst
        self.handles = {}
        try:
            for k in descriptors:
                offs = (index * kmax + np.arange(k, dtype=np.int64)) * nbytes
                self.handles[k] = link.prepare(src, offs, dst, offs, nbytes)
        except BaseException:
            if self.own:
                link.close()
            raise

    def post(self, k: int, posted) -> tuple[float, float, float]:
        """(posted at, post returned at, DONE at) for the request of k descriptors. Between posting and polling the
        poster waits at `posted` (a barrier of the phase's posters), so that no poster polls while another posts."""
        h = self.handles[k]
        t0 = time.perf_counter()
        state = self.link.initiator.transfer(h)
        t1 = time.perf_counter()
        posted.wait(TIMEOUT_S)
        self.link.wait(h, state, TIMEOUT_S)
        return t0, t1, time.perf_counter()

    def close(self) -> bool:
        """Close an own link; True when its destination holds its source."""
        if not self.own:
            return True
        try:
            return torch.equal(self.src, self.dst)
        finally:
            self.link.close()


def _process_poster(index, descriptors, nbytes, device, progress_thread, conn, gate, posted) -> None:
    """A posting process: sets up its poster, says ready, then per command k (None: stop) waits at the phase's
    barrier and posts; sends back its times; at the end ("close"), whether its bytes arrived; on an error, its text."""
    try:
        poster = _Poster(descriptors, nbytes, torch.device(device), progress_thread, index=index)
        conn.send("ready")
        while (k := conn.recv()) is not None:
            gate.wait(TIMEOUT_S)
            conn.send(poster.post(k, posted))
        conn.send(("closed", poster.close()))
    except BaseException as exc:  # the parent raises it
        conn.send(f"{type(exc).__name__}: {exc}")


class _Threads:
    """T posters in this process, each posting on a thread of its own when released: through one shared pair of
    agents (shared; each poster's slot of the shared tensors holds its own byte value) or a pair each."""

    def __init__(self, t, descriptors, nbytes, dev, progress_thread, shared: bool):
        self.link, self.posters = None, []
        try:
            if shared:
                kmax = max(descriptors)
                slot = torch.arange(1, t + 1, dtype=torch.uint8, device=dev).repeat_interleave(kmax * nbytes)
                self.src, self.dst = slot, torch.zeros_like(slot)
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                self.link = NixlLink([self.src], [self.dst], progress_thread=progress_thread, thread_safe=True)
            for i in range(t):
                self.posters.append(_Poster(descriptors, nbytes, dev, progress_thread, self.link, i,
                                            *((self.src, self.dst) if shared else (None, None))))
        except BaseException:
            self.close()
            raise

    def post(self, k):
        """Every poster's request of k descriptors, released by one barrier: per poster (posted at, returned at, DONE
        at) and the release time."""
        n = len(self.posters)
        gate, posted, out, errors = threading.Barrier(n + 1), threading.Barrier(n), [None] * n, []

        def work(i, p):
            try:
                gate.wait(TIMEOUT_S)
                out[i] = p.post(k, posted)
            except Exception as exc:
                errors.append(exc)
                posted.abort()  # the others must not wait for this one

        threads = [threading.Thread(target=work, args=(i, p)) for i, p in enumerate(self.posters)]
        for th in threads:
            th.start()
        gate.wait(TIMEOUT_S)
        t_rel = time.perf_counter()
        for th in threads:
            th.join()
        if errors:
            raise RuntimeError(f"nixl posting: a posting thread failed: {errors[0]!r}")
        return out, t_rel

    def close(self) -> bool:
        ok = True
        for p in self.posters:  # every one closed, whatever another's close raised
            try:
                ok = p.close() and ok
            except Exception:
                ok = False
        if self.link is not None:
            ok = torch.equal(self.src, self.dst) and ok
            self.link.close()
        return ok


class _Processes:
    """T posting processes (spawned: CUDA does not survive a fork), each with its own pair of agents."""

    def __init__(self, t, descriptors, nbytes, dev, progress_thread):
        ctx = mp.get_context("spawn")
        self.gate, self.posted = ctx.Barrier(t + 1), ctx.Barrier(t)
        self.conns, self.procs = [], []
        try:
            for i in range(t):
                mine, theirs = ctx.Pipe()
                proc = ctx.Process(target=_process_poster, daemon=True, name=f"kvlab-nixl-poster-{i}",
                                   args=(i, descriptors, nbytes, str(dev), progress_thread, theirs, self.gate,
                                         self.posted))
                proc.start()
                theirs.close()  # the child's end: with it closed here, a child that dies reads as EOF, not silence
                self.conns.append(mine)
                self.procs.append(proc)
            for i in range(t):
                self._reply(i)
        except BaseException:
            self.close()
            raise

    def _reply(self, i):
        """Process i's next message; RuntimeError naming it when it died, failed or said nothing in TIMEOUT_S."""
        conn, proc = self.conns[i], self.procs[i]
        def gone():
            proc.join(timeout=5)  # its pipe can close before it is reaped
            return f"nixl posting process {i} exited with code {proc.exitcode}"

        if not mpc.wait([conn, proc.sentinel], TIMEOUT_S) or not conn.poll():
            raise RuntimeError(gone() if not proc.is_alive() else f"nixl posting process {i} said nothing in "
                               f"{TIMEOUT_S:g} s")
        try:
            got = conn.recv()
        except EOFError:
            raise RuntimeError(gone()) from None
        if isinstance(got, str) and got != "ready":
            raise RuntimeError(f"nixl posting process {i} failed: {got}")
        return got

    def post(self, k):
        for c in self.conns:
            c.send(k)
        try:
            self.gate.wait(TIMEOUT_S)
        except threading.BrokenBarrierError:
            raise RuntimeError(f"nixl posting: not every process reached the release in {TIMEOUT_S:g} s") from None
        t_rel = time.perf_counter()
        return [tuple(self._reply(i)) for i in range(len(self.conns))], t_rel

    def close(self) -> bool:
        """Stop every process (each closes its link first and says whether its bytes arrived); True when all did."""
        ok = True
        for i, c in enumerate(self.conns):
            try:
                c.send(None)
                got = self._reply(i)
                ok = ok and got == ("closed", True)
            except (OSError, RuntimeError):
                ok = False
        for proc in self.procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)
        for c in self.conns:
            c.close()
        return ok


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 0


def measure(threads=THREADS, descriptors=DESCRIPTORS, nbytes: int = 64 << 10, rounds: int = 10, warmup: int = 1,
            device=None, modes=MODES, progress_threads=(False, True), progress=None) -> pd.DataFrame:
    """Rows (mode, progress_thread, threads, descriptors, round, thread, post_us, wall_post_us, done_us, nbytes,
    device, cpus, nixl_env), phase by phase (mode, progress thread, T posters — "threads" counts processes in mode
    `processes`): the phase's posters are made, every descriptor count runs once a round in rotated order after
    `warmup` rounds, and the posters are closed, each checking that its destination holds its source. Each poster's
    request covers its own bytes on `device` (a GPU: VRAM; else host memory). `progress`: a callable told once per
    configuration run."""
    threads, descriptors = sorted({int(t) for t in threads}), sorted({int(k) for k in descriptors})
    modes, progress_threads = list(dict.fromkeys(modes)), list(dict.fromkeys(bool(p) for p in progress_threads))
    if not threads or min(threads) < 1 or not descriptors or min(descriptors) < 1 or nbytes < 1 or rounds < 1:
        raise ValueError(f"threads={threads}, descriptors={descriptors}, nbytes={nbytes}, rounds={rounds}: give "
                         "threads and descriptors ≥ 1, nbytes ≥ 1 and rounds ≥ 1")
    if not modes or set(modes) - set(MODES):
        raise ValueError(f"modes={modes}: give one or more of {', '.join(MODES)}")
    if not progress_threads:
        raise ValueError("progress_threads=(): give False, True or both")
    dev = torch.device(device or "cpu")
    env, cpus, rows = " ".join(f"{k}={v}" for k, v in same_process_env().items()), _cpus(), []
    for m in modes:
        for prog in progress_threads:
            for t in threads:
                posters = (_Processes(t, descriptors, nbytes, dev, prog) if m == "processes"
                           else _Threads(t, descriptors, nbytes, dev, prog, shared=m == "shared-agents"))
                ok = False
                try:
                    for r in range(warmup + rounds):
                        j = r % len(descriptors)
                        for k in descriptors[j:] + descriptors[:j]:
                            times, t_rel = posters.post(k)
                            if progress is not None:
                                progress()
                            if r < warmup:
                                continue
                            start = min(t_rel, *(t0 for t0, _, _ in times))  # a process may post before the release
                            wall = max(t1 for _, t1, _ in times) - start
                            done = max(t2 for _, _, t2 in times) - start
                            rows += [{"mode": m, "progress_thread": prog, "threads": t, "descriptors": k,
                                      "round": r - warmup, "thread": i, "post_us": 1e6 * (t1 - t0),
                                      "wall_post_us": 1e6 * wall, "done_us": 1e6 * done, "nbytes": nbytes,
                                      "device": str(dev), "cpus": cpus, "nixl_env": env}
                                     for i, (t0, t1, _) in enumerate(times)]
                finally:
                    ok = posters.close()
                    posters = None  # this phase's agents are gone before the next phase's are made
                if not ok:
                    raise RuntimeError(f"nixl posting ({m}, {t} posters): a destination does not hold what its "
                                       "requests wrote, or a poster could not close")
    return pd.DataFrame(rows)


_KEYS = ["mode", "progress_thread", "threads", "descriptors"]


def summarise(rows: pd.DataFrame) -> pd.DataFrame:
    """Per (mode, progress thread, threads, descriptors): rounds, the median wall time from the release until the
    last post returned with its interval, the median until all were DONE, the aggregate posting rate (threads ×
    descriptors ÷ that wall time, per second), its ratio to one poster's rate of the same mode and progress thread for
    the same descriptors with the ratio's interval (rate_x_one, rate_x_lo, rate_x_hi: both rounds' sets resampled),
    the same ratio counted until every request was DONE (done_x_one, done_x_lo, done_x_hi: descriptors landed a
    second, not posted), and a poster's own post time per descriptor (median, µs). Rows from before the modes count as shared-agents with
    NIXL's progress thread (its default, which they ran with)."""
    rows = rows.assign(mode=rows["mode"] if "mode" in rows else "shared-agents",
                       progress_thread=rows["progress_thread"] if "progress_thread" in rows else True)
    per_round = rows.groupby(_KEYS + ["round"], sort=False).agg(
        wall=("wall_post_us", "first"), done=("done_us", "first"), post=("post_us", "median")).reset_index()
    order = {m: i for i, m in enumerate(MODES)}
    per_round = per_round.sort_values(["mode", "progress_thread", "descriptors", "threads", "round"],
                                      key=lambda c: c.map(order) if c.name == "mode" else c)
    out = []
    for (m, prog, t, k), g in per_round.groupby(_KEYS, sort=False):
        wall = g["wall"].tolist()
        single = per_round[(per_round["mode"] == m) & (per_round["progress_thread"] == prog)
                           & (per_round["threads"] == 1) & (per_round["descriptors"] == k)]
        one, one_done = single["wall"].tolist(), single["done"].tolist()
        lo, hi = median_ci(wall)
        # rate ratio = (t·k / wall) / (k / wall_1) = t · wall_1 / wall
        rlo, rhi = ratio_ci(one, wall) if one else (float("nan"), float("nan"))
        dlo, dhi = ratio_ci(one_done, g["done"].tolist()) if one_done else (float("nan"), float("nan"))
        med = statistics.median(wall)
        out.append({"mode": m, "progress_thread": bool(prog), "threads": int(t), "descriptors": int(k),
                    "n": len(wall), "wall_post_us": med, "wall_lo": lo, "wall_hi": hi,
                    "done_us": statistics.median(g["done"]), "descriptors_per_s": 1e6 * t * k / med,
                    "rate_x_one": t * statistics.median(one) / med if one else float("nan"),
                    "rate_x_lo": t * rlo, "rate_x_hi": t * rhi,
                    "done_x_one": t * statistics.median(one_done) / statistics.median(g["done"]) if one_done
                    else float("nan"), "done_x_lo": t * dlo, "done_x_hi": t * dhi,
                    "post_us_per_descriptor": statistics.median(g["post"]) / k})
    return pd.DataFrame(out).sort_values(["mode", "progress_thread", "descriptors", "threads"],
                                         key=lambda c: c.map(order) if c.name == "mode" else c, ignore_index=True)


WHO = {"shared-agents": "threads through one pair of agents", "agents-per-thread": "threads with an agent pair each",
       "processes": "processes with an agent pair each"}


def findings(s: pd.DataFrame, values: dict) -> list[str]:
    """One line per (mode, progress thread, descriptor count): the aggregate rate at one poster and at the most, and
    the ratio, posted and until DONE. Fills `values` (posting.{mode}.{prog|noprog}.{K}.rate_x_max, .done_x_max and
    .one_us_per_descriptor)."""
    out = []
    for (m, prog, k), g in s.groupby(["mode", "progress_thread", "descriptors"], sort=False):
        one, top = g[g["threads"] == g["threads"].min()].iloc[0], g[g["threads"] == g["threads"].max()].iloc[0]
        key = f"posting.{m}.{'prog' if prog else 'noprog'}.{k}"
        values[f"{key}.rate_x_max"] = f"{top.rate_x_one:.2f}"
        values[f"{key}.done_x_max"] = f"{top.done_x_one:.2f}"
        values[f"{key}.one_us_per_descriptor"] = f"{1e6 / one.descriptors_per_s:.1f}"
        out.append(f"- NIXL posting, {WHO.get(m, m)} ({'with' if prog else 'without'} NIXL's progress thread), "
                   f"{int(k)} descriptors a request: one posts {one.descriptors_per_s:,.0f} descriptors a second "
                   f"({1e6 / one.descriptors_per_s:.1f} µs each); {int(top.threads)} together "
                   f"{top.descriptors_per_s:,.0f} a second, {top.rate_x_one:.2f}× [{top.rate_x_lo:.2f}, "
                   f"{top.rate_x_hi:.2f}] one's rate; counted until DONE, {top.done_x_one:.2f}× "
                   f"[{top.done_x_lo:.2f}, {top.done_x_hi:.2f}].")
    return out


def figure(s: pd.DataFrame, cpus: int | None = None):
    """One panel per mode: the aggregate posting rate against one poster's (median, 95 % interval) by posters, a line
    per (progress thread, descriptors a request), beside the line of perfect scaling."""
    import matplotlib.pyplot as plt  # matplotlib only when a figure is drawn

    modes = [m for m in MODES if m in set(s["mode"])] + sorted(set(s["mode"]) - set(MODES))
    fig, axes = plt.subplots(1, len(modes), figsize=(3.4 * len(modes), 4.2), squeeze=False, sharey=True,
                             layout="constrained")
    series = [(p, k) for p in (False, True) for k in sorted(set(s["descriptors"]))]
    colors = plots.palette([f"{'with' if p else 'no'} progress thread, {k} descriptors" for p, k in series])
    ts = sorted(set(s["threads"]))
    for ax, m in zip(axes[0], modes):
        ax.plot(ts, ts, color="0.6", ls=":", lw=1, label="perfect scaling" if ax is axes[0][0] else None)
        for p, k in series:
            g = s[(s["mode"] == m) & (s["progress_thread"] == p) & (s["descriptors"] == k)].sort_values("threads")
            if not len(g):
                continue
            name = f"{'with' if p else 'no'} progress thread, {k} descriptors"
            err = [(g["rate_x_one"] - g["rate_x_lo"]).clip(lower=0), (g["rate_x_hi"] - g["rate_x_one"]).clip(lower=0)]
            ax.errorbar(g["threads"], g["rate_x_one"], yerr=err, marker="o", ms=4, capsize=3, color=colors[name],
                        ls="-" if not p else "--", label=name if ax is axes[0][0] else None)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ts, [str(t) for t in ts])
        ax.set_title(WHO.get(m, m), fontsize=10.5)
        ax.set_xlabel("posters at once")
    axes[0][0].set_ylabel("aggregate posting rate ÷ one poster's")
    axes[0][0].legend(fontsize=8, frameon=False, loc="upper left")
    fig.suptitle("NIXL posting under concurrency" + (f" ({cpus} CPUs)" if cpus else ""), fontsize=12)
    return fig
