"""How long the fabric simulator takes at cluster scale: issue 30's goal is 1,000 GPUs × 100,000 requests with
bulk sends in under 5 minutes on a 2-core machine, with the layer-wise time reported beside it.

    PYTHONPATH=. python tools/fabric_speed.py                      # bulk and layerwise, 1000 GPUs × 100k
    PYTHONPATH=. python tools/fabric_speed.py --sends bulk --requests 10000 --json speed.json

The cluster: 8 GPUs a node, 16 nodes a leaf, 400G NICs (--nic-gbit-s), non-blocking (--oversubscription), 500 prefill + 500 decode workers (split placement),
Qwen2.5-7B at 400 TFLOP/s, lognormal prompts (median 2048 tokens), Poisson arrivals at 0.8 of prefill
capacity. One simulation at a time (each is single-threaded); the wall time is simulate()'s own, draw and
tables included.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvlab import goals, provenance  # noqa: E402
from kvlab.fabric.sim import simulate  # noqa: E402
from kvlab.fabric.topology import TopologyConfig  # noqa: E402
from kvlab.fabric.workload import SENDS, SimConfig  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=1000)
    p.add_argument("--requests", type=int, default=100_000)
    p.add_argument("--sends", default="bulk,layerwise", help=f"comma-separated, of {', '.join(SENDS)}")
    p.add_argument("--load", type=float, default=0.8)
    p.add_argument("--oversubscription", type=float, default=1.0)
    p.add_argument("--nic-gbit-s", type=float, default=400.0, help="NIC Gb/s per direction (default 400)")
    p.add_argument("--json", default=None, help="also write the rows to this file")
    p.add_argument("--out", default=None, help="a result folder to make: speed.csv, goals.csv (kvlab.goals' fabric "
                   "goals) and meta.json (host, commit, load); default data/probes/fabric_speed/<UTC>-<commit>/ for "
                   "the default cluster, none otherwise")
    args = p.parse_args(argv)
    sends = [s.strip() for s in args.sends.split(",") if s.strip()]
    bad = [s for s in sends if s not in SENDS]
    if bad or not sends:
        p.error(f"--sends {args.sends!r}: valid: {', '.join(SENDS)}")
    topo = TopologyConfig(gpus=args.gpus, gpus_per_node=8, nodes_per_leaf=16, nic_gbit_s=args.nic_gbit_s,
                          oversubscription=args.oversubscription)
    half = args.gpus // 2
    rows = []
    out = _result_folder(args)
    for send in sends:
        cfg = SimConfig(topology=topo, prefill_workers=half, decode_workers=args.gpus - half, requests=args.requests,
                        load=args.load, send=send)
        t0 = time.perf_counter()
        s = simulate(cfg, progress=True).summary
        wall = time.perf_counter() - t0
        row = {"send": send, "nic_gbit_s": args.nic_gbit_s, "oversubscription": args.oversubscription,
               "load": args.load, "gpus": args.gpus, "requests": args.requests, "wall_s": round(wall, 1),
               "sim_seconds": round(s["sim_seconds"], 2), "flows": s["flows"], "reallocations": s["reallocations"],
               "ttft_p50_ms": round(s["ttft_p50_ms"], 2), "ttft_p99_ms": round(s["ttft_p99_ms"], 2),
               "transfer_exposed_p50_ms": round(s["transfer_exposed_p50_ms"], 3),
               "cpu": platform.processor() or platform.machine(), "cores": len(os.sched_getaffinity(0))}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    if out is not None:
        _finish(out, rows)
    return 0


def _result_folder(args) -> Path | None:
    """The result folder, made now with meta.json (before anything is timed: the goals as recorded, the load)."""
    default = args.gpus == 1000 and args.requests == 100_000
    if args.out is None and not default:
        return None
    state = provenance.git_state(ROOT)
    out = Path(args.out) if args.out else (ROOT / "data" / "probes" / "fabric_speed" /
                                           f"{datetime.now(timezone.utc):%Y%m%d-%H%M%S}-{str(state.get('commit'))[:7]}")
    out.mkdir(parents=True, exist_ok=False)
    meta = {"tool": "tools/fabric_speed.py", "argv": sys.argv[1:],
            "started_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "host": {"machine": platform.machine(), "cpus": len(os.sched_getaffinity(0)),
                     "python": platform.python_version(), "loadavg_start": list(os.getloadavg())},
            "git": {"commit": state.get("commit"), "dirty": state.get("dirty")},
            "goals": goals.recorded("fabric"), "status": "running"}
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    return out


def _finish(out: Path, rows: list[dict]) -> None:
    import pandas as pd

    table = pd.DataFrame(rows)
    table.to_csv(out / "speed.csv", index=False)
    judged = goals.evaluate(goals.for_study("fabric"), table, keys=("send",))
    judged.to_csv(out / "goals.csv", index=False)
    meta = json.loads((out / "meta.json").read_text(encoding="utf-8"))
    meta.update(status="done", finished_utc=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                loadavg_end=list(os.getloadavg()))
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    for r in judged.itertuples():
        print(f"goal {r.id} ({r.send}): {r.value} — {r.verdict}")
    if judged.empty:
        print("note: no goal judges this run: fabric.speed_bulk is about bulk sends on the default cluster (1,000 GPUs, "
              "100,000 requests, load 0.8, 400G NICs, non-blocking) on a 2-CPU machine")
    print(f"wrote {out}")


if __name__ == "__main__":
    raise SystemExit(main())
