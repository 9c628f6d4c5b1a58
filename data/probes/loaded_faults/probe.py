"""Does a fault campaign keep its decisions within the deadline + 1 s when every core is busy?
`python3 data/probes/loaded_faults/probe.py OUT [kvlab disagg options]`, from the repository root: starts twice as many
busy-looping processes as the host has cores, runs `kvlab disagg --faults 100 --fault-kinds drop,delay,corrupt,kill
--policy retry --repeats 1 --warmup 0 --seed 9 --quiet` (or the options given) into the usual data/disagg/ folder,
stops the load, and writes OUT/meta.json: the run's id, the busy processes, the host and the commit. The run is an
ordinary run of the disagg study; its goals are judged by its study like any other."""

from __future__ import annotations

import json
import multiprocessing
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

DEFAULT = ["--faults", "100", "--fault-kinds", "drop,delay,corrupt,kill", "--policy", "retry", "--repeats", "1",
           "--warmup", "0", "--seed", "9", "--quiet"]


def _burn() -> None:
    while True:
        pass


def main() -> None:
    out = Path(sys.argv[1])
    options = sys.argv[2:] or DEFAULT
    out.mkdir(parents=True, exist_ok=False)
    data = Path(os.environ.get("KVLAB_DATA", "data")) / "disagg"
    before = set(p.name for p in data.glob("*")) if data.is_dir() else set()
    # the code as it is when the run starts (the run's own run.json records it too)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                text=True).stdout.strip())
    cpus = os.cpu_count() or 1
    burners = [multiprocessing.Process(target=_burn, daemon=True) for _ in range(2 * cpus)]
    for b in burners:
        b.start()
    t0 = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-m", "kvlab", "disagg", *options],
                              env={**os.environ, "KVLAB_PRESET": os.environ.get("KVLAB_PRESET", "cpu")},
                              stdin=subprocess.DEVNULL, capture_output=True, text=True)
    finally:
        for b in burners:
            b.kill()
    new = sorted(set(p.name for p in data.glob("*")) - before)
    meta = {"runs": new, "busy_processes": len(burners), "cpus": cpus, "host": platform.node(),
            "platform": platform.platform(), "python": platform.python_version(), "options": options,
            "exit_code": done.returncode, "wall_s": round(time.monotonic() - t0, 1), "commit": commit, "dirty": dirty,
            "stdout_tail": done.stdout[-2000:], "stderr_tail": done.stderr[-2000:],
            "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(json.dumps({k: meta[k] for k in ("runs", "busy_processes", "exit_code", "wall_s")}))


if __name__ == "__main__":
    main()
