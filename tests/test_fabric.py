"""kvlab.fabric: routes, max-min sharing, flows on a SimPy clock, the serving simulation, sweeps on Dask,
calibration, and `kvlab simulate`'s command half — against cases worked out by hand or by kvlab.calculator."""

from __future__ import annotations

import argparse
import json
import math
import random

import numpy as np
import pandas as pd
import pytest
import simpy
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab import calculator, exposure
from kvlab.fabric import calibrate, command, sharing, sweep
from kvlab.fabric.flows import Fabric
from kvlab.fabric.sim import simulate
from kvlab.fabric.topology import Topology, TopologyConfig
from kvlab.fabric.workload import SimConfig, draw

GB = 1e9


# ---- topology ---------------------------------------------------------------------------------


def _topo(**kw) -> Topology:
    base = dict(gpus=32, gpus_per_node=8, nodes_per_leaf=2, nic_gbit_s=400, nvlink_gbyte_s=450)
    return Topology(TopologyConfig(**{**base, **kw}))


def test_routes_by_distance():
    t = _topo()
    names = lambda r: [t.names[i] for i in r]
    assert names(t.route(0, 7)) == ["nvlink-tx/g0", "nvlink-rx/g7"]            # same node
    assert names(t.route(0, 8)) == ["nic-tx/g0", "nic-rx/g8"]                  # same leaf, another node
    assert names(t.route(0, 16)) == ["nic-tx/g0", "leaf-up/l0", "leaf-down/l1", "nic-rx/g16"]
    assert t.bottleneck(t.route(0, 7)) == 450 * GB
    assert t.bottleneck(t.route(0, 16)) == 50 * GB


def test_pcie_and_host_endpoints():
    t = _topo(pcie_gbyte_s=64)
    names = lambda r: [t.names[i] for i in r]
    assert names(t.route(3, 20)) == ["pcie-up/g3", "nic-tx/g3", "leaf-up/l0", "leaf-down/l1", "nic-rx/g20",
                                     "pcie-down/g20"]
    assert names(t.route(2, "host2")) == ["pcie-up/g2"]
    assert names(t.route("host5", "gpu5")) == ["pcie-down/g5"]
    assert names(t.route(0, 1)) == ["nvlink-tx/g0", "nvlink-rx/g1"]  # NVLink never crosses PCIe
    with pytest.raises(ValueError, match="attached"):
        t.route("host1", 2)
    with pytest.raises(ValueError, match="pcie_gbyte_s is None"):
        _topo().route(0, "host0")
    with pytest.raises(ValueError, match="same endpoint"):
        t.route(4, 4)
    with pytest.raises(ValueError, match="out of range"):
        t.route(0, 32)


def test_uplinks_follow_oversubscription_and_partial_leaf():
    # 5 nodes of 2 GPUs, 2 nodes a leaf: leaves of 4, 4 and 2 GPUs; 100 Gb/s NICs = 12.5 GB/s
    t = Topology(TopologyConfig(gpus=10, gpus_per_node=2, nodes_per_leaf=2, nic_gbit_s=100, oversubscription=4))
    caps = {n: c for n, c in zip(t.names, t.capacity)}
    assert caps["leaf-up/l0"] == pytest.approx(4 * 12.5e9 / 4)
    assert caps["leaf-down/l2"] == pytest.approx(2 * 12.5e9 / 4)
    assert "leaf-up/l3" not in caps


@pytest.mark.parametrize("field,value,match", [
    ("gpus", 0, "topology.gpus"), ("gpus", 12, "multiple of gpus_per_node"),
    ("gpus_per_node", -1, "topology.gpus_per_node"), ("nodes_per_leaf", 1.5, "topology.nodes_per_leaf"),
    ("nic_gbit_s", -400, "topology.nic_gbit_s"), ("nic_gbit_s", math.inf, "topology.nic_gbit_s"),
    ("nvlink_gbyte_s", 0, "topology.nvlink_gbyte_s"), ("oversubscription", 0.5, "topology.oversubscription"),
    ("pcie_gbyte_s", -64, "topology.pcie_gbyte_s"), ("gpus", True, "topology.gpus"),
])
def test_topology_refuses_bad_fields(field, value, match):
    with pytest.raises(ValueError, match=match) as err:
        TopologyConfig(**{"gpus": 16, "gpus_per_node": 8, field: value})
    assert "\n" not in str(err.value)


# ---- max-min sharing ---------------------------------------------------------------------------


def test_three_flows_two_links():
    # link 0 (10 B/s): flows 0, 1; link 1 (4 B/s): flows 0, 2. Link 1 fills first at 2 each; flow 1 takes
    # what flow 0 leaves of link 0: 10 - 2 = 8.
    rates = sharing.max_min_rates([[0, 1], [0, -1], [1, -1]], [10.0, 4.0])
    np.testing.assert_allclose(rates, [2, 8, 2])


def test_parking_lot_and_chain():
    # a long flow over both links, one short flow on each, equal capacities: everyone gets half
    np.testing.assert_allclose(sharing.max_min_rates([[0, 1], [0, -1], [1, -1]], [1.0, 1.0]), [0.5] * 3)
    # link 0 (3): flows 0, 1 → 1.5 each; link 1 (10): flow 1 at 1.5, flow 2 takes 8.5
    np.testing.assert_allclose(sharing.max_min_rates([[0], [0], [1]], [3.0, 10.0]), [1.5, 1.5, 10.0])
    np.testing.assert_allclose(sharing.max_min_rates([[0, -1], [0, 1], [1, -1]], [3.0, 10.0]), [1.5, 1.5, 8.5])


def test_flow_ceilings():
    # one link of 10, three flows, one capped at 1: the others split the 9 left
    rates = sharing.max_min_rates([[0], [0], [0]], [10.0], flow_cap=[1.0, np.inf, np.inf])
    np.testing.assert_allclose(rates, [1, 4.5, 4.5])
    # a ceiling above the fair share changes nothing
    np.testing.assert_allclose(sharing.max_min_rates([[0], [0]], [10.0], flow_cap=[7.0, 7.0]), [5, 5])
    # a flow on no link, bounded only by its ceiling
    np.testing.assert_allclose(sharing.max_min_rates([[-1]], [1.0], flow_cap=[3.0]), [3.0])


@pytest.mark.parametrize("routes,capacity,cap,match", [
    ([[0, 2]], [1.0, 1.0], None, "link indices"),
    ([[0, 0]], [1.0], None, "twice"),
    ([[0]], [-1.0], None, "capacity"),
    ([[-1]], [1.0], None, "infinite"),
    ([[0.5]], [1.0], None, "integer"),
    ([[0]], [1.0], [0.0], "flow_cap"),
])
def test_sharing_refuses_bad_input(routes, capacity, cap, match):
    with pytest.raises(ValueError, match=match):
        sharing.max_min_rates(np.asarray(routes), capacity, cap)


def _reference_rates(routes, capacity, cap):
    """Progressive filling one level at a time, in plain Python (the textbook loop)."""
    n = len(routes)
    rate, frozen = [0.0] * n, [False] * n
    left = list(capacity)
    while not all(frozen):
        live = [i for i in range(n) if not frozen[i]]
        steps = [cap[i] - rate[i] for i in live]
        for link in range(len(capacity)):
            users = [i for i in live if link in routes[i]]
            if users:
                steps.append(left[link] / len(users))
        step = min(steps)
        for i in live:
            rate[i] += step
            for link in routes[i]:
                left[link] -= step
        for i in live:
            full = [link for link in routes[i] if left[link] <= 1e-9 * capacity[link]]
            if full or rate[i] >= cap[i] * (1 - 1e-12):
                frozen[i] = True
    return rate


@st.composite
def _problems(draw_):
    links = draw_(st.integers(1, 6))
    capacity = draw_(st.lists(st.floats(0.1, 100), min_size=links, max_size=links))
    n = draw_(st.integers(1, 12))
    routes = [draw_(st.lists(st.integers(0, links - 1), min_size=1, max_size=min(links, 4), unique=True))
              for _ in range(n)]
    cap = [draw_(st.one_of(st.just(math.inf), st.floats(0.05, 200))) for _ in range(n)]
    return routes, capacity, cap


@settings(max_examples=150, deadline=None)
@given(_problems())
def test_max_min_properties(problem):
    routes, capacity, cap = problem
    hops = max(len(r) for r in routes)
    padded = np.array([r + [-1] * (hops - len(r)) for r in routes])
    rates = sharing.max_min_rates(padded, capacity, cap)
    assert (rates >= 0).all()
    load = np.zeros(len(capacity))
    for r, x in zip(routes, rates):
        load[r] += x
    assert (load <= np.asarray(capacity) * (1 + 1e-9)).all()              # no link over capacity
    for i, r in enumerate(routes):                                       # every flow has a bottleneck
        capped = rates[i] >= cap[i] * (1 - 1e-7)
        bottleneck = any(load[link] >= capacity[link] * (1 - 1e-7)
                         and all(rates[i] >= rates[j] * (1 - 1e-7) for j, rj in enumerate(routes) if link in rj)
                         for link in r)
        assert capped or bottleneck, (i, rates, load)
    np.testing.assert_allclose(rates, _reference_rates(routes, capacity, cap), rtol=1e-6)


def test_start_delay():
    assert sharing.start_delay_s(4, fixed_s=20e-6, post_s=10e-6) == pytest.approx(60e-6)
    np.testing.assert_allclose(sharing.start_delay_s(np.array([0, 28]), post_s=6.8e-6), [0, 28 * 6.8e-6])
    with pytest.raises(ValueError, match="post_s"):
        sharing.start_delay_s(1, post_s=-1e-6)
    with pytest.raises(ValueError, match="descriptors"):
        sharing.start_delay_s(-1)


# ---- flows on a SimPy clock ---------------------------------------------------------------------


def _run_flows(capacity, plan, shortcuts=True):
    """plan: (start_s, route, nbytes, cap); returns each flow's landing time."""
    env = simpy.Environment()
    fabric = Fabric(env, capacity, max_hops=4, shortcuts=shortcuts)
    ends = [None] * len(plan)

    def go(i, start, route, nbytes, cap):
        yield env.timeout(start)
        ends[i] = yield fabric.send(route, nbytes, cap).done

    for i, p in enumerate(plan):
        env.process(go(i, *p))
    env.run()
    return ends, fabric


def test_two_flows_share_then_one_runs_alone():
    # 10 B/s; A (100 B) alone for 5 s → 50 B left; B (30 B) joins: 5 B/s each, B lands at 11;
    # A then has 20 B left at 10 B/s → 13
    ends, _ = _run_flows([10.0], [(0, [0], 100, math.inf), (5, [0], 30, math.inf)])
    assert ends == pytest.approx([13.0, 11.0])


def test_extend_moves_only_the_completion():
    env = simpy.Environment()
    fabric = Fabric(env, [10.0])
    flow = fabric.send([0], 50)

    def later():
        yield env.timeout(2)
        fabric.extend(flow, 30)

    env.process(later())
    env.run()
    assert flow.end_s == pytest.approx(8.0) and flow.nbytes == 80
    assert fabric.link_bytes[0] == 80
    with pytest.raises(ValueError, match="already landed"):
        fabric.extend(flow, 1)


def test_flow_cap_and_zero_bytes():
    ends, _ = _run_flows([10.0], [(0, [0], 40, 4.0), (0, [0], 60, math.inf)])
    assert ends == pytest.approx([10.0, 10.0])  # 4 + 6 B/s, both land at 10
    ends, _ = _run_flows([10.0], [(3, [0], 0, math.inf)])
    assert ends == [3]


@pytest.mark.parametrize("links", [5, 40])
def test_shortcuts_change_nothing(links):
    rng = random.Random(links)
    capacity = [rng.uniform(2, 30) for _ in range(links)]
    plan = []
    for _ in range(300):
        route = rng.sample(range(links), rng.randint(1, 3))
        plan.append((rng.uniform(0, 20), route, rng.uniform(1, 60),
                     rng.choice([math.inf, math.inf, rng.uniform(1, 8)])))
    fast, fabric = _run_flows(capacity, plan)
    slow, reference = _run_flows(capacity, plan, shortcuts=False)
    np.testing.assert_allclose(fast, slow, rtol=1e-9)
    assert fabric.shortcuts > 0 and fabric.reallocations < reference.reallocations
    np.testing.assert_allclose(fabric.link_bytes, reference.link_bytes)


# ---- the serving simulation --------------------------------------------------------------------

_TINY_TOPO = TopologyConfig(gpus=4, gpus_per_node=1, nodes_per_leaf=4, nic_gbit_s=400)


def _one(send: str, **kw) -> dict:
    cfg = SimConfig(topology=_TINY_TOPO, prefill_workers=1, decode_workers=1, requests=1, prompt="fixed",
                    prompt_tokens=4096, send=send, **kw)
    return simulate(cfg).requests.iloc[0]


def test_one_bulk_request_matches_the_calculator():
    est = calculator.handoff_estimate("qwen2.5-7b", 4096, "400G", tflops=400)
    row = _one("bulk")
    assert row.ttft_ms == pytest.approx((est.prefill_s + est.transfer_s) * 1e3, rel=1e-9)
    assert row.exposed_ms == pytest.approx(est.bulk_exposed_s * 1e3, rel=1e-9)
    assert row.kv_bytes == est.kv_bytes
    # with start costs: 56 descriptors at 10 µs, 20 µs fixed, and a decode step of 5 ms
    row = _one("bulk", post_s=10e-6, flow_fixed_s=20e-6, decode_step_s=5e-3)
    extra = 56 * 10e-6 + 20e-6
    assert row.exposed_ms == pytest.approx((est.transfer_s + extra) * 1e3, rel=1e-9)
    assert row.ttft_ms == pytest.approx((est.prefill_s + est.transfer_s + extra + 5e-3) * 1e3, rel=1e-9)


def test_one_layerwise_request_matches_the_pipelined_model():
    est = calculator.handoff_estimate("qwen2.5-7b", 4096, "400G", tflops=400)
    row = _one("layerwise")
    assert row.exposed_ms == pytest.approx(est.exposed_s * 1e3, rel=1e-6)
    # a link slower than compute (10 Gb/s): the backlog grows layer by layer, still as the calculator says
    slow = TopologyConfig(gpus=4, gpus_per_node=1, nic_gbit_s=10)
    est = calculator.handoff_estimate("qwen2.5-7b", 4096, "10G", tflops=400)
    assert est.link_bound
    for flows in ("serial", "parallel"):
        row = simulate(SimConfig(topology=slow, prefill_workers=1, decode_workers=1, requests=1, prompt="fixed",
                                 prompt_tokens=4096, send="layerwise", layer_flows=flows)).requests.iloc[0]
        # one request alone: how its layers are cut into flows does not change when the last byte lands
        assert row.exposed_ms == pytest.approx(est.exposed_s * 1e3, rel=1e-6)


def test_one_deadline_request_matches_held_exposure():
    slow = TopologyConfig(gpus=4, gpus_per_node=1, nic_gbit_s=100)
    est = calculator.handoff_estimate("qwen2.5-7b", 4096, "100G", tflops=400)
    compute, transfer = est.timeline.compute_s, est.timeline.transfer_s
    release = exposure.deadline_release(compute, transfer, 2.0)
    assert release > 0  # the policy really holds layers here
    row = simulate(SimConfig(topology=slow, prefill_workers=1, decode_workers=1, requests=1, prompt="fixed",
                             prompt_tokens=4096, send="deadline")).requests.iloc[0]
    assert row.exposed_ms == pytest.approx(exposure.held_exposure(compute, transfer, release) * 1e3, rel=1e-6)
    assert row.first_send_s == pytest.approx(row.prefill_start_s + sum(compute[:release + 1]), rel=1e-9)


def test_fp8_scales_the_bytes():
    base, fp8 = _one("bulk"), _one("bulk", fp8=True)
    assert fp8.kv_bytes == pytest.approx(0.53 * base.kv_bytes)
    assert fp8.exposed_ms == pytest.approx(0.53 * base.exposed_ms, rel=1e-9)
    assert _one("bulk", fp8=True, fp8_factor=0.5).exposed_ms == pytest.approx(0.5 * base.exposed_ms, rel=1e-9)


def _burst(**kw):
    # two prefill workers, one decode worker, two identical prompts at t = 0: both handoffs leave at once
    cfg = SimConfig(topology=_TINY_TOPO, prefill_workers=2, decode_workers=1, requests=2, prompt="fixed",
                    prompt_tokens=2048, arrival="bursty", burst_size=2, burst_period_s=1.0, **kw)
    return simulate(cfg)


def test_incast_shares_the_decode_nic_and_admission_queues():
    x = calculator.kv_cache_bytes("qwen2.5-7b", 2048) / 50e9
    shared = _burst().requests
    np.testing.assert_allclose(shared.exposed_ms, [2 * x * 1e3] * 2, rtol=1e-9)  # half the NIC each
    queued = _burst(max_inflight=1).requests.sort_values("last_byte_s")
    np.testing.assert_allclose(queued.exposed_ms, [x * 1e3, 2 * x * 1e3], rtol=1e-9)  # one at a time
    np.testing.assert_allclose(queued.admission_wait_ms, [0, x * 1e3], rtol=1e-9, atol=1e-9)


def test_oversubscribed_uplink_is_the_bottleneck():
    # 4 single-GPU nodes, 2 per leaf: prefill on leaf 0, decode on leaf 1; uplink = 2 NICs / 4 = half a NIC,
    # shared by the two handoffs: a quarter NIC each
    topo = TopologyConfig(gpus=4, gpus_per_node=1, nodes_per_leaf=2, nic_gbit_s=400, oversubscription=4)
    cfg = SimConfig(topology=topo, prefill_workers=2, decode_workers=2, requests=2, prompt="fixed",
                    prompt_tokens=2048, arrival="bursty", burst_size=2, burst_period_s=1.0)
    res = simulate(cfg)
    x = calculator.kv_cache_bytes("qwen2.5-7b", 2048) / 50e9
    np.testing.assert_allclose(res.requests.exposed_ms, [4 * x * 1e3] * 2, rtol=1e-9)
    assert set(res.requests.path) == {"spine"}
    links = res.links.set_index("name")
    assert links.loc["leaf-up/l0", "utilisation"] == pytest.approx(links["utilisation"].max())
    assert res.summary["link_util_max"] == pytest.approx(links.loc["leaf-up/l0", "utilisation"])


def test_interleaved_placement_uses_nvlink():
    topo = TopologyConfig(gpus=2, gpus_per_node=2, nvlink_gbyte_s=450)
    cfg = SimConfig(topology=topo, prefill_workers=1, decode_workers=1, placement="interleave", requests=1,
                    prompt="fixed", prompt_tokens=2048)
    row = simulate(cfg).requests.iloc[0]
    assert row.path == "nvlink"
    assert row.exposed_ms == pytest.approx(calculator.kv_cache_bytes("qwen2.5-7b", 2048) / 450e9 * 1e3, rel=1e-9)


def _small(**kw) -> SimConfig:
    topo = TopologyConfig(gpus=16, gpus_per_node=4, nodes_per_leaf=2, nic_gbit_s=100, oversubscription=2)
    return SimConfig(**{"topology": topo, "prefill_workers": 8, "decode_workers": 8, "requests": 400, "load": 0.9,
                        **kw})


def test_deterministic_in_the_seed_and_summary_fields():
    a, b = simulate(_small(send="layerwise")), simulate(_small(send="layerwise"))
    pd.testing.assert_frame_equal(a.requests, b.requests)
    pd.testing.assert_frame_equal(a.links, b.links)
    c = simulate(_small(send="layerwise", seed=1))
    assert not np.array_equal(a.requests.tokens, c.requests.tokens)
    s = a.summary
    for key in ("ttft_p50_ms", "ttft_p99_ms", "ttft_mean_ms", "transfer_exposed_p50_ms", "requests", "sim_seconds",
                "wall_seconds", "link_util_max", "link_util_mean"):
        assert key in s
    assert s["requests"] == 400 and s["ttft_p99_ms"] >= s["ttft_p50_ms"] > 0
    r = a.requests
    assert (r.ttft_ms >= r.queue_ms + r.prefill_ms - 1e-9).all() and (r.exposed_ms >= -1e-9).all()
    assert (r.last_byte_s >= r.prefill_end_s - 1e-12).all()
    assert s["sim_seconds"] == pytest.approx(r.last_byte_s.max())
    assert s["kv_bytes_total"] == pytest.approx(a.links.query("kind == 'nic-tx'").bytes.sum())


@pytest.mark.parametrize("send,flows", [("bulk", "serial"), ("layerwise", "serial"), ("deadline", "parallel")])
def test_simulation_shortcuts_change_nothing(send, flows):
    cfg = _small(send=send, layer_flows=flows, requests=150, load=1.0, max_inflight=2, post_s=8e-6)
    fast, slow = simulate(cfg), simulate(cfg, shortcuts=False)
    np.testing.assert_allclose(fast.requests.last_byte_s, slow.requests.last_byte_s, rtol=1e-9)
    assert fast.summary["reallocations"] < slow.summary["reallocations"]


def test_layerwise_hides_what_bulk_exposes_under_load():
    bulk, lw = simulate(_small(send="bulk")).summary, simulate(_small(send="layerwise")).summary
    assert lw["transfer_exposed_p50_ms"] < bulk["transfer_exposed_p50_ms"]
    assert lw["ttft_p50_ms"] < bulk["ttft_p50_ms"]


def test_least_loaded_and_round_robin():
    rr = simulate(_small(decode_choice="round-robin")).requests
    # the FIFO queue starts requests in arrival order, and round-robin hands them out in that order
    assert rr.decode_worker.tolist() == [i % 8 for i in range(400)]
    ll = simulate(_small(decode_choice="least-loaded", max_inflight=1, load=1.2)).requests
    start, last, dw = ll.prefill_start_s.to_numpy(), ll.last_byte_s.to_numpy(), ll.decode_worker.to_numpy()
    assert len(set(dw)) == 8
    busiest = 0
    for i in range(len(ll)):  # at each choice, the chosen worker had the fewest handoffs assigned, not landed
        earlier = (np.arange(len(ll)) < i) & (last > start[i])
        load = np.bincount(dw[earlier], minlength=8)
        assert load[dw[i]] == load.min()
        busiest = max(busiest, load.max())
    assert busiest >= 2  # the test saw a worker with a queue, not only idle ones


def test_arrivals_and_prompts():
    cfg = SimConfig(requests=2000, prompt="uniform", prompt_min=100, prompt_max=200, rate_per_s=50.0)
    w = draw(cfg)
    assert w.tokens.min() >= 100 and w.tokens.max() <= 200 and len(np.unique(w.tokens)) > 50
    assert (np.diff(w.arrival_s) >= 0).all() and w.arrival_s[0] == 0
    assert 2000 / w.arrival_s[-1] == pytest.approx(50, rel=0.1)
    w = draw(SimConfig(requests=1000, prompt="lognormal", prompt_tokens=1000, prompt_sigma=0.5))
    assert np.median(w.tokens) == pytest.approx(1000, rel=0.1)
    b = draw(SimConfig(requests=10, arrival="bursty", burst_size=4, burst_period_s=0.5))
    assert b.arrival_s.tolist() == [0, 0, 0, 0, 0.5, 0.5, 0.5, 0.5, 1.0, 1.0]
    # the load sets the rate: load × P / mean prefill time
    f = draw(SimConfig(requests=10, prompt="fixed", load=0.5, prefill_workers=4))
    assert f.rate_per_s == pytest.approx(0.5 * 4 / f.prefill_s[0])


@pytest.mark.parametrize("kw,match", [
    (dict(prefill_workers=10, decode_workers=7), "more workers than GPUs"),
    (dict(requests=0), "empty workload"),
    (dict(send="eager"), "send='eager'"),
    (dict(load=-1), "load"),
    (dict(model="gpt-5"), "model"),
    (dict(max_inflight=0), "max_inflight"),
    (dict(prompt_min=300, prompt_max=200), "prompt_min"),
    (dict(fp8_factor=1.5), "fp8_factor"),
    (dict(post_s=-1e-6), "post_s"),
    (dict(kv_dtype="fp4"), "kv_dtype"),
])
def test_sim_config_refuses_bad_input(kw, match):
    with pytest.raises(ValueError, match=match) as err:
        SimConfig(**kw)
    assert "\n" not in str(err.value)


def test_with_routes_topology_fields():
    cfg = SimConfig().with_(oversubscription=4, send="layerwise")
    assert cfg.topology.oversubscription == 4 and cfg.send == "layerwise"
    with pytest.raises(ValueError, match="unknown field"):
        SimConfig().with_(nic=400)


# ---- sweep on Dask ---------------------------------------------------------------------------------


def test_sweep_on_a_local_cluster():
    base = _small(requests=60)
    grid = {"load": [0.5, 0.9], "policy": ["bulk", "layerwise"], "link": ["100G", "400G"]}
    table = sweep.sweep(base, grid, n_workers=2, processes=False, progress=False)
    assert len(table) == 8 and table.point.tolist() == list(range(8))
    assert table.policy.tolist() == ["bulk", "bulk", "layerwise", "layerwise"] * 2
    one = simulate(base.with_(load=0.9, send="layerwise", nic_gbit_s=400.0)).summary
    row = table[(table.load == 0.9) & (table.policy == "layerwise") & (table.link == "400G")].iloc[0]
    assert row.ttft_p99_ms == one["ttft_p99_ms"] and row.flows == one["flows"]
    with pytest.raises(ValueError, match="grid\\['link'\\]"):
        sweep.points(base, {"link": ["fast"]})
    with pytest.raises(ValueError, match="more workers than GPUs"):
        sweep.points(base, {"prefill_workers": [4, 12]})


# ---- calibration -------------------------------------------------------------------------------------

_TRUE = {"d2h": (50.0, 26.0), "h2d": (48.0, 48.0)}  # (capacity, per-flow ceiling) GB/s
_FIXED, _POST = 20e-6, 9e-6


def _measured(path: str, flows: int, nbytes: float, desc: int) -> float:
    """Aggregate GB/s from the model's closed form (independent of the fit and of the simulator)."""
    parts = path.split("+")
    worst = max(_FIXED + desc * _POST + nbytes / min(_TRUE[p][1] * GB, _TRUE[p][0] * GB / flows) for p in parts)
    return len(parts) * flows * nbytes / worst / GB


def _rows(noise: float = 0.0, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    rows = []
    for path in _TRUE:
        for flows in (1, 2):
            for nbytes in (1 << 20, 16 << 20, 256 << 20):
                for desc in (1, 8, 64):
                    rows.append((path, flows, "calibrate", nbytes, desc))
    for path, flows in [("d2h", 4), ("d2h", 8), ("h2d", 4), ("h2d", 8), ("d2h+h2d", 1), ("d2h+h2d", 4)]:
        rows.append((path, flows, "validate", 64 << 20, 16))
    df = pd.DataFrame(rows, columns=["path", "flows", "role", "bytes", "descriptors"])
    truth = np.array([_measured(r.path, r.flows, r.bytes, r.descriptors) for r in df.itertuples()])
    df["measured_gbps"] = truth * (1 + noise * rng.standard_normal(len(df)))
    df["measured_lo"], df["measured_hi"] = df.measured_gbps * 0.98, df.measured_gbps * 1.02
    df["truth"] = truth
    return df


def test_calibration_recovers_known_parameters():
    rows = _rows()
    cal = calibrate.fit(rows)
    assert cal.costs_fitted == (True, True)
    assert cal.fixed_s == pytest.approx(_FIXED, rel=1e-6) and cal.post_s == pytest.approx(_POST, rel=1e-6)
    for path, (cap, flow) in _TRUE.items():
        assert cal.paths[path].capacity_gbps == pytest.approx(cap, rel=1e-6)
        assert cal.paths[path].flow_gbps == pytest.approx(flow, rel=1e-6)
        assert not cal.paths[path].capacity_lower_bound
    table = calibrate.validation_table(rows, cal)
    assert list(table.columns) == list(calibrate.VALIDATION_COLUMNS)
    np.testing.assert_allclose(table.simulated_gbps, rows.truth, rtol=1e-6)
    assert calibrate.errors(table)["max_pct"] < 1e-4


def test_calibration_with_noise_and_its_limits():
    rows = _rows(noise=0.01, seed=3)
    cal = calibrate.fit(rows)
    for path, (cap, flow) in _TRUE.items():
        assert cal.paths[path].capacity_gbps == pytest.approx(cap, rel=0.05)
        assert cal.paths[path].flow_gbps == pytest.approx(flow, rel=0.05)
    err = calibrate.errors(calibrate.validation_table(rows, cal))
    assert err["rows"] == 6 and err["max_pct"] < 5
    # one size and one descriptor count per row group: fixed costs cannot be told from bandwidth
    same = rows[(rows.bytes == 16 << 20) & (rows.descriptors == 8) | (rows.role == "validate")]
    assert calibrate.fit(same).costs_fitted == (False, False)
    # a path whose two flows are still flow-capped: its capacity is only a lower bound
    capped = pd.DataFrame({"path": ["nv", "nv"], "flows": [1, 2], "role": ["calibrate"] * 2,
                           "measured_gbps": [100.0, 200.0], "measured_lo": [99.0, 198.0],
                           "measured_hi": [101.0, 202.0]})
    fitted = calibrate.fit(capped).paths["nv"]
    assert fitted.capacity_lower_bound and fitted.capacity_gbps == pytest.approx(200)


def test_calibration_refuses_bad_rows():
    rows = _rows()
    with pytest.raises(ValueError, match="missing column"):
        calibrate.fit(rows.drop(columns="role"))
    with pytest.raises(ValueError, match="calibrate on N = 1 and 2"):
        calibrate.fit(rows.assign(role="calibrate").query("path != 'd2h+h2d'"))
    with pytest.raises(ValueError, match="not calibrated"):
        calibrate.validation_table(pd.concat([rows, rows.iloc[[-1]].assign(path="peer01")]))
    with pytest.raises(ValueError, match="role"):
        calibrate.fit(rows.assign(role="train"))


# ---- kvlab simulate (the command's half) -----------------------------------------------------------------


def _args(*argv: str) -> argparse.Namespace:
    return command.add_arguments(argparse.ArgumentParser()).parse_args(list(argv))


def test_command_writes_summary_and_tables(tmp_path, capsys):
    out = tmp_path / "sim"
    args = _args("--gpus", "8", "--gpus-per-node", "4", "--requests", "50", "--send", "layerwise", "--fp8",
                 "--nic", "100G", "--post-us", "10", "--out", str(out), "--no-progress")
    assert command.run_args(args) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["requests"] == 50 and summary["config"]["send"] == "layerwise" and summary["config"]["fp8"]
    assert summary["config"]["topology.nic_gbit_s"] == 100 and summary["config"]["post_s"] == pytest.approx(1e-5)
    assert len(pd.read_csv(out / "requests.csv")) == 50
    assert "utilisation" in pd.read_csv(out / "links.csv")
    assert "TTFT p50" in capsys.readouterr().out
    with pytest.raises(ValueError, match="already holds files"):
        command.run_args(args)


@pytest.mark.parametrize("argv,match", [
    (["--gpus", "4", "--gpus-per-node", "2", "--prefill", "3", "--decode", "3"], "more workers than GPUs"),
    (["--gpus", "12"], "multiple of gpus_per_node"),
    (["--nic", "fast"], "--nic 'fast'"),
    (["--requests", "0"], "empty workload"),
    (["--oversubscription", "-2"], "oversubscription"),
])
def test_command_refuses_before_writing(tmp_path, argv, match):
    out = tmp_path / "never"
    with pytest.raises(ValueError, match=match):
        command.run_args(_args(*argv, "--out", str(out), "--no-progress"))
    assert not out.exists()
