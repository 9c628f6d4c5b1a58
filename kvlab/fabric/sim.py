"""The disaggregated-serving simulation: prefill workers, KV handoffs over a shared fabric, decode admission.

What happens to a request (all on one SimPy clock):

1. it arrives (Poisson or in bursts) and waits in one FIFO queue for a free prefill worker (lowest
   index first); a worker serves one request at a time, and takes the next as soon as a prefill ends
   (the KV it still sends does not hold up compute);
2. when its prefill starts, a decode worker is chosen (round-robin, or least-loaded: the fewest handoffs
   assigned and not yet landed);
3. its KV leaves by the send policy: ``bulk`` — all bytes in one flow once prefill ends; ``layerwise`` —
   each layer as soon as it has computed, that layer's K and V as *one* flow (they share path and start,
   so one flow of their summed bytes is exact); ``deadline`` — layers 0…r held until layer r has computed
   (r: :func:`kvlab.exposure.deadline_release`, priced at the route's bottleneck), the rest eagerly;
4. before the first of its bytes leaves, the handoff is admitted by the decode worker (at most
   ``max_inflight`` at once, FIFO); then each send posts its descriptors (one after another,
   ``post_s`` each) and pays ``flow_fixed_s`` before its bytes move;
5. bytes move at max-min fair rates over the route's links (:class:`kvlab.fabric.flows.Fabric`);
   with ``layer_flows="serial"`` a request's layers queue on one connection (a layer ready while the
   previous one is still moving joins the same flow, which is exact: the connection's rate does not
   depend on how its bytes are cut), with ``"parallel"`` each layer is a flow of its own;
6. TTFT = arrival → last byte landed (+ ``decode_step_s``); exposed transfer = last byte − prefill end.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import pandas as pd
import simpy
from tqdm.auto import tqdm

from kvlab import exposure
from kvlab.fabric.flows import Fabric
from kvlab.fabric.topology import Topology
from kvlab.fabric.workload import SimConfig, Workload, draw

__all__ = ["SimResult", "simulate", "summarise"]

_PROGRESS_EVERY = 1000  # requests landed between progress-bar updates (tqdm per request would cost more)


@dataclass(frozen=True)
class SimResult:
    """What :func:`simulate` returns.

    Fields:
        summary: flat dict (ttft_p50_ms, ttft_p99_ms, ttft_mean_ms, transfer_exposed_p50_ms, requests,
            sim_seconds, wall_seconds, link_util_max, link_util_mean, …; see :func:`summarise`).
        requests: one row per request (times in seconds from the first arrival, ``*_ms`` durations).
        links: one row per link: name, kind, capacity_gbyte_s, bytes, utilisation (bytes over capacity ×
            sim_seconds).
        config: the SimConfig.
    """

    summary: dict[str, Any]
    requests: pd.DataFrame
    links: pd.DataFrame
    config: SimConfig


class _Run:
    """The state of one simulation and its SimPy processes."""

    def __init__(self, cfg: SimConfig, topo: Topology, work: Workload, env: simpy.Environment,
                 fabric: Fabric, bar: tqdm) -> None:
        self.cfg, self.topo, self.work, self.env, self.fabric, self.bar = cfg, topo, work, env, fabric, bar
        m = cfg.requests
        self.arrival = work.arrival_s.tolist()
        self.kind = work.kind.tolist()
        self.prefill_s = work.prefill_s.tolist()
        nan = math.nan
        self.start, self.want, self.admit = [nan] * m, [nan] * m, [nan] * m
        self.first, self.last = [nan] * m, [nan] * m
        self.pw, self.dw = [-1] * m, [-1] * m
        self.idle = list(range(cfg.prefill_workers))  # a heap: the lowest free worker takes the next request
        self.waiting: deque[int] = deque()
        self.next_decode = 0
        self.outstanding = np.zeros(cfg.decode_workers, dtype=np.int64)
        self.gates = ([simpy.Resource(env, cfg.max_inflight) for _ in range(cfg.decode_workers)]
                      if cfg.max_inflight is not None else None)
        self.flow_cap = math.inf if cfg.flow_gbyte_s is None else cfg.flow_gbyte_s * 1e9
        self.routes: dict[tuple[int, int], tuple[list[int], float]] = {}
        self.plans: dict[tuple[int, float], list[tuple[float, float, int]]] = {}
        self.landed = 0

    # ---- arrivals and prefill ----------------------------------------------------------------

    def arrivals(self):
        env = self.env
        for i, t in enumerate(self.arrival):
            if t > env.now:
                yield env.timeout(t - env.now)
            if self.idle:
                self._start(i, heapq.heappop(self.idle))
            else:
                self.waiting.append(i)

    def _start(self, i: int, worker: int) -> None:
        env, cfg = self.env, self.cfg
        self.start[i] = env.now
        self.pw[i] = worker
        if cfg.decode_choice == "round-robin":
            d = self.next_decode
            self.next_decode = (d + 1) % cfg.decode_workers
        else:
            d = int(np.argmin(self.outstanding))
        self.outstanding[d] += 1
        self.dw[i] = d
        env.process(self._handoff(i))
        env.timeout(self.prefill_s[self.kind[i]]).callbacks.append(partial(self._prefill_done, worker))

    def _prefill_done(self, worker: int, _event) -> None:
        if self.waiting:
            self._start(self.waiting.popleft(), worker)
        else:
            heapq.heappush(self.idle, worker)

    # ---- the handoff -------------------------------------------------------------------------

    def _route(self, p: int, d: int) -> tuple[list[int], float]:
        key = (p, d)
        hit = self.routes.get(key)
        if hit is None:
            route = self.topo.route(self.work.prefill_gpus[p], self.work.decode_gpus[d])
            hit = self.routes[key] = (route, min(self.topo.bottleneck(route), self.flow_cap))
        return hit

    def _plan(self, kind: int, bottleneck: float) -> list[tuple[float, float, int]]:
        """(release offset after prefill start s, bytes, descriptors) of each send, in order."""
        cfg = self.cfg
        key = (kind, bottleneck if cfg.send == "deadline" else 0.0)
        plan = self.plans.get(key)
        if plan is not None:
            return plan
        ends = self.work.layer_end_s[kind].tolist()
        nbytes = self.work.layer_bytes[kind].tolist()
        dpl = cfg.descriptors_per_layer
        if cfg.send == "bulk":
            plan = [(self.prefill_s[kind], float(sum(nbytes)), cfg.bulk_descriptors or dpl * len(nbytes))]
        else:
            hold = 0
            if cfg.send == "deadline":
                compute = [ends[0]] + [b - a for a, b in zip(ends, ends[1:])]
                per_send = cfg.flow_fixed_s + dpl * cfg.post_s
                transfer = [per_send + b / bottleneck for b in nbytes]
                hold = exposure.deadline_release(compute, transfer, cfg.deadline_margin)
            plan = [(ends[max(i, hold)], b, dpl) for i, b in enumerate(nbytes)]
        self.plans[key] = plan
        return plan

    def _handoff(self, i: int):
        env, cfg, fabric = self.env, self.cfg, self.fabric
        began = env.now
        d = self.dw[i]
        route, bottleneck = self._route(self.pw[i], d)
        plan = self._plan(self.kind[i], bottleneck)
        yield env.timeout(plan[0][0])
        self.want[i] = env.now  # its first send is released: admission starts here
        gate = None
        if self.gates is not None:
            gate = self.gates[d].request()
            yield gate
        self.admit[i] = posted = env.now
        serial = cfg.layer_flows == "serial"
        conn = None
        flows = []
        for offset, nbytes, descriptors in plan:
            posted = max(posted, began + offset) + descriptors * cfg.post_s
            ready = posted + cfg.flow_fixed_s
            if ready > env.now:
                yield env.timeout(ready - env.now)
            if serial and conn is not None and conn.active:
                fabric.extend(conn, nbytes)
            else:
                conn = fabric.send(route, nbytes, self.flow_cap)
                flows.append(conn)
                if len(flows) == 1:
                    self.first[i] = env.now
        pending = [f.done for f in flows if f.active]
        if pending:
            yield env.all_of(pending) if len(pending) > 1 else pending[0]
        self.last[i] = max(f.end_s for f in flows)
        if gate is not None:
            self.gates[d].release(gate)
        self.outstanding[d] -= 1
        self.landed += 1
        if self.landed % _PROGRESS_EVERY == 0:
            self.bar.update(_PROGRESS_EVERY)


def summarise(requests: pd.DataFrame, links: pd.DataFrame) -> dict[str, Any]:
    """The headline numbers of a run's tables: TTFT and exposed-transfer percentiles (ms), queueing, links.

    ``link_util_mean`` averages over links that carried bytes (idle NVLink ports would drown it otherwise).
    """
    ttft = requests["ttft_ms"].to_numpy()
    exposed = requests["exposed_ms"].to_numpy()
    used = links["utilisation"][links["bytes"] > 0]
    return {
        "requests": int(len(requests)),
        "ttft_p50_ms": float(np.percentile(ttft, 50)),
        "ttft_p99_ms": float(np.percentile(ttft, 99)),
        "ttft_mean_ms": float(ttft.mean()),
        "transfer_exposed_p50_ms": float(np.percentile(exposed, 50)),
        "transfer_exposed_p99_ms": float(np.percentile(exposed, 99)),
        "transfer_exposed_mean_ms": float(exposed.mean()),
        "prefill_queue_p50_ms": float(requests["queue_ms"].median()),
        "prefill_queue_p99_ms": float(np.percentile(requests["queue_ms"], 99)),
        "admission_wait_p99_ms": float(np.percentile(requests["admission_wait_ms"], 99)),
        "kv_bytes_total": float(requests["kv_bytes"].sum()),
        "link_util_max": float(links["utilisation"].max()),
        "link_util_mean": float(used.mean()) if len(used) else 0.0,
    }


def simulate(cfg: SimConfig, progress: bool = False, shortcuts: bool = True) -> SimResult:
    """Run one simulation of ``cfg`` to the last request's last byte; deterministic in ``cfg.seed``.

    ``progress``: show a tqdm bar of requests landed. ``shortcuts``: the fabric's exact shortcuts
    (:class:`kvlab.fabric.flows.Fabric`); False recomputes every rate at every start and end (slow; for tests).
    """
    if not isinstance(cfg, SimConfig):
        raise ValueError(f"cfg={cfg!r}: expected a kvlab.fabric.workload.SimConfig")
    wall = time.perf_counter()
    topo = Topology(cfg.topology)
    work = draw(cfg)
    env = simpy.Environment()
    fabric = Fabric(env, topo.capacity, topo.max_hops, shortcuts=shortcuts)
    with tqdm(total=cfg.requests, disable=not progress, unit="req", desc="simulate") as bar:
        run = _Run(cfg, topo, work, env, fabric, bar)
        env.process(run.arrivals())
        env.run()
        bar.update(run.landed - bar.n)
    if run.landed != cfg.requests:  # a bug, not bad input: every request must land once the queue drains
        raise RuntimeError(f"simulation ended with {run.landed} of {cfg.requests} requests landed")
    sim_s = float(env.now)
    arrival = work.arrival_s
    start, admit = np.asarray(run.start), np.asarray(run.admit)
    first, last = np.asarray(run.first), np.asarray(run.last)
    prefill = work.prefill_s[work.kind]
    pw, dw = np.asarray(run.pw), np.asarray(run.dw)
    pre_gpu = np.asarray(work.prefill_gpus)[pw]
    dec_gpu = np.asarray(work.decode_gpus)[dw]
    kv_bytes = work.layer_bytes.sum(axis=1)[work.kind]
    g = cfg.topology
    same_node = pre_gpu // g.gpus_per_node == dec_gpu // g.gpus_per_node
    same_leaf = pre_gpu // (g.gpus_per_node * g.nodes_per_leaf) == dec_gpu // (g.gpus_per_node * g.nodes_per_leaf)
    requests = pd.DataFrame({
        "request": np.arange(cfg.requests), "arrival_s": arrival, "tokens": work.tokens,
        "prefill_worker": pw, "prefill_gpu": pre_gpu, "decode_worker": dw, "decode_gpu": dec_gpu,
        "path": np.where(same_node, "nvlink", np.where(same_leaf, "leaf", "spine")),
        "prefill_start_s": start, "prefill_end_s": start + prefill, "admitted_s": admit,
        "first_send_s": first, "last_byte_s": last, "kv_bytes": kv_bytes,
        "queue_ms": (start - arrival) * 1e3, "prefill_ms": prefill * 1e3,
        "admission_wait_ms": (admit - np.asarray(run.want)) * 1e3,
        "ttft_ms": (last - arrival + cfg.decode_step_s) * 1e3,
        "exposed_ms": (last - (start + prefill)) * 1e3,
    })
    links = topo.link_table()
    links["bytes"] = fabric.link_bytes
    links["utilisation"] = fabric.link_bytes / (topo.capacity * sim_s) if sim_s > 0 else 0.0
    summary = summarise(requests, links)
    summary.update({
        "send": cfg.send, "fp8": cfg.fp8, "gpus": g.gpus, "prefill_workers": cfg.prefill_workers,
        "decode_workers": cfg.decode_workers, "offered_rate_per_s": work.rate_per_s,
        "sim_seconds": sim_s, "flows": fabric.flows_started, "reallocations": fabric.reallocations,
        "shortcut_events": fabric.shortcuts, "wall_seconds": time.perf_counter() - wall,
    })
    return SimResult(summary=summary, requests=requests, links=links, config=cfg)
