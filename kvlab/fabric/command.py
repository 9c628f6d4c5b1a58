"""``kvlab simulate``: one fabric simulation from the command line, into a folder of its own.

    kvlab simulate --gpus 1000 --requests 100000 --out DIR [--send bulk|layerwise|deadline] [--fp8] ...

Writes ``summary.json`` (the summary and every configuration field), ``requests.csv`` (one row per request)
and ``links.csv`` (one row per link) into ``--out``, which must be new or empty; it is created only after
every argument was checked.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from kvlab import calculator
from kvlab.fabric.sim import simulate
from kvlab.fabric.topology import TopologyConfig
from kvlab.fabric.workload import ARRIVALS, DECODE_CHOICES, LAYER_FLOWS, PLACEMENTS, PROMPTS, SENDS, SimConfig

__all__ = ["add_arguments", "config_from_args", "run_args"]


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``kvlab simulate`` options to ``parser`` (a CLI subparser)."""
    d = SimConfig()
    t = d.topology
    g = parser.add_argument_group("fabric")
    g.add_argument("--gpus", type=int, default=t.gpus, help=f"GPUs in the cluster (default {t.gpus})")
    g.add_argument("--gpus-per-node", type=int, default=t.gpus_per_node, help="GPUs on one NVSwitch (default %(default)s)")
    g.add_argument("--nodes-per-leaf", type=int, default=t.nodes_per_leaf, help="nodes under one leaf (default %(default)s)")
    g.add_argument("--nic", default=f"{t.nic_gbit_s:g}G",
                   help="each GPU's NIC, per direction: 100G, 400Gb/s, 50GB/s; a bare number is Gb/s (default %(default)s)")
    g.add_argument("--nvlink", default=f"{t.nvlink_gbyte_s:g}GB/s",
                   help="NVLink per GPU per direction, with its unit: 450GB/s (a bare number is Gb/s; default %(default)s)")
    g.add_argument("--pcie", default=None,
                   help="each GPU's PCIe link per direction, with its unit: 64GB/s (default: not modelled)")
    g.add_argument("--oversubscription", type=float, default=t.oversubscription,
                   help="leaf downlink over uplink capacity, ≥ 1 (default %(default)s)")
    w = parser.add_argument_group("workload")
    w.add_argument("--prefill", type=int, default=None, help="prefill workers (default: half the GPUs)")
    w.add_argument("--decode", type=int, default=None, help="decode workers (default: the other half)")
    w.add_argument("--placement", choices=PLACEMENTS, default=d.placement, help="(default %(default)s)")
    w.add_argument("--model", default=d.model, help="kvlab model name (default %(default)s)")
    w.add_argument("--tflops", type=float, default=d.tflops, help="achieved prefill TFLOP/s per GPU (default %(default)s)")
    w.add_argument("--requests", type=int, default=d.requests, help="requests to simulate (default %(default)s)")
    w.add_argument("--load", type=float, default=d.load, help="offered prefill load, 1 = prefill always busy (default %(default)s)")
    w.add_argument("--rate", type=float, default=None, help="arrivals per second (overrides --load)")
    w.add_argument("--arrival", choices=ARRIVALS, default=d.arrival, help="(default %(default)s)")
    w.add_argument("--burst-size", type=int, default=d.burst_size, help="requests per burst (default %(default)s)")
    w.add_argument("--burst-period-ms", type=float, default=None, help="ms between bursts (default: the load's mean rate)")
    w.add_argument("--prompt", choices=PROMPTS, default=d.prompt, help="prompt-length distribution (default %(default)s)")
    w.add_argument("--tokens", type=int, default=d.prompt_tokens, help="fixed length / lognormal median (default %(default)s)")
    w.add_argument("--prompt-min", type=int, default=d.prompt_min, help="(default %(default)s)")
    w.add_argument("--prompt-max", type=int, default=d.prompt_max, help="(default %(default)s)")
    w.add_argument("--prompt-sigma", type=float, default=d.prompt_sigma, help="lognormal log-σ (default %(default)s)")
    s = parser.add_argument_group("sending")
    s.add_argument("--send", choices=SENDS, default=d.send, help="send policy (default %(default)s)")
    s.add_argument("--fp8", action="store_true", help="send fp8 KV (--fp8-factor of the bytes)")
    s.add_argument("--fp8-factor", type=float, default=d.fp8_factor, help="fp8 bytes over kv-dtype bytes (default %(default)s)")
    s.add_argument("--kv-dtype", default=d.kv_dtype, help="(default %(default)s)")
    s.add_argument("--layer-flows", choices=LAYER_FLOWS, default=d.layer_flows, help="(default %(default)s)")
    s.add_argument("--deadline-margin", type=float, default=d.deadline_margin, help="(default %(default)s)")
    s.add_argument("--fixed-us", type=float, default=d.flow_fixed_s * 1e6, help="per-flow start cost, µs (default %(default)s)")
    s.add_argument("--post-us", type=float, default=d.post_s * 1e6,
                   help="posting cost per descriptor, µs (NIXL measured 6.8–12.8; default %(default)s)")
    s.add_argument("--descriptors-per-layer", type=int, default=d.descriptors_per_layer, help="(default %(default)s)")
    s.add_argument("--bulk-descriptors", type=int, default=None, help="(default: layers × descriptors per layer)")
    s.add_argument("--flow-gbps", type=float, default=None, help="one flow's own ceiling, GB/s (default: none)")
    s.add_argument("--decode-choice", choices=DECODE_CHOICES, default=d.decode_choice, help="(default %(default)s)")
    s.add_argument("--max-inflight", type=int, default=None, help="handoffs into one decode worker at once (default: no cap)")
    s.add_argument("--decode-step-ms", type=float, default=d.decode_step_s * 1e3, help="added to TTFT (default %(default)s)")
    parser.add_argument("--seed", type=int, default=d.seed, help="(default %(default)s)")
    parser.add_argument("--out", required=True, help="a new or empty folder for summary.json and the tables")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def _rate(flag: str, value: str, unit: str) -> float:
    try:
        lk = calculator.link(value)
    except ValueError as err:
        raise ValueError(f"{flag} {value!r}: {err}") from None
    return lk.gbit_per_s if unit == "gbit" else lk.gbyte_per_s


def _ms(flag: str, value: float | None) -> float | None:
    if value is None:
        return None
    if not math.isfinite(value):
        raise ValueError(f"{flag} {value!r}: must be a finite number")
    return value


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """The SimConfig the parsed options describe (every field validated; ValueError names the option)."""
    topo = TopologyConfig(gpus=args.gpus, gpus_per_node=args.gpus_per_node, nodes_per_leaf=args.nodes_per_leaf,
                          nic_gbit_s=_rate("--nic", args.nic, "gbit"),
                          nvlink_gbyte_s=_rate("--nvlink", args.nvlink, "gbyte"),
                          oversubscription=args.oversubscription,
                          pcie_gbyte_s=None if args.pcie is None else _rate("--pcie", args.pcie, "gbyte"))
    prefill = args.prefill if args.prefill is not None else max(args.gpus // 2, 1)
    decode = args.decode if args.decode is not None else max(args.gpus - prefill, 1)
    period = _ms("--burst-period-ms", args.burst_period_ms)
    return SimConfig(
        topology=topo, prefill_workers=prefill, decode_workers=decode, placement=args.placement,
        model=args.model, tflops=args.tflops, requests=args.requests, load=args.load, rate_per_s=args.rate,
        arrival=args.arrival, burst_size=args.burst_size, burst_period_s=None if period is None else period / 1e3,
        prompt=args.prompt, prompt_tokens=args.tokens, prompt_min=args.prompt_min, prompt_max=args.prompt_max,
        prompt_sigma=args.prompt_sigma, send=args.send, fp8=bool(args.fp8), fp8_factor=args.fp8_factor,
        kv_dtype=args.kv_dtype, layer_flows=args.layer_flows, deadline_margin=args.deadline_margin,
        flow_fixed_s=_ms("--fixed-us", args.fixed_us) / 1e6, post_s=_ms("--post-us", args.post_us) / 1e6,
        descriptors_per_layer=args.descriptors_per_layer, bulk_descriptors=args.bulk_descriptors,
        flow_gbyte_s=args.flow_gbps, decode_choice=args.decode_choice, max_inflight=args.max_inflight,
        decode_step_s=_ms("--decode-step-ms", args.decode_step_ms) / 1e3, seed=args.seed)


def _check_out(value: str) -> Path:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"--out {value!r}: give a folder")
    out = Path(value)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {value}: is a file; give a new or empty folder")
    if out.is_dir() and any(out.iterdir()):
        raise ValueError(f"--out {value}: already holds files; give a new or empty folder")
    return out


def run_args(args: argparse.Namespace) -> int:
    """Run ``kvlab simulate`` with parsed options; returns the exit code (bad input: ValueError, nothing written)."""
    out = _check_out(args.out)
    cfg = config_from_args(args)
    result = simulate(cfg, progress=not args.no_progress)
    out.mkdir(parents=True, exist_ok=True)
    summary = {**result.summary, "config": cfg.as_dict(), "argv": list(getattr(args, "argv", []) or [])}
    (out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=False) + "\n")
    result.requests.to_csv(out / "requests.csv", index=False)
    result.links.to_csv(out / "links.csv", index=False)
    s = result.summary
    print(f"{s['requests']} requests, {cfg.send}{' fp8' if cfg.fp8 else ''}: TTFT p50 {s['ttft_p50_ms']:.2f} ms, "
          f"p99 {s['ttft_p99_ms']:.2f} ms; exposed transfer p50 {s['transfer_exposed_p50_ms']:.3f} ms; "
          f"busiest link {s['link_util_max']:.1%}; simulated {s['sim_seconds']:.1f} s in {s['wall_seconds']:.1f} s "
          f"→ {out}")
    return 0
