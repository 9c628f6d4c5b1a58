"""How long after a worker is stopped (SIGSTOP) does `kvlab disagg` end, against its deadline — idle, and with every
core busy? `python3 data/probes/sigstop/probe.py OUT [--trials N] [--backend gloo|ipc] [--timeout S]`, from the
repository root. For each load, each role (prefill, decode) and each trial: a run of a million requests, the role
stopped once requests flow, the time until the launcher says why it stopped (said_s: its one line, printed once the
folder is marked and both workers are stopped) and until it has exited (ended_s); rows to OUT/results.csv, the host to
OUT/meta.json. Loaded: twice as many busy-looping processes as cores, for the whole load's trials."""

from __future__ import annotations

import argparse
import csv
import json
import multiprocessing
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvlab.disagg.launch import progress_of as _done
from kvlab.disagg.launch import worker_pids


def _burn() -> None:
    while True:
        pass


def trial(role: str, backend: str, timeout_s: float, scratch: Path) -> dict:
    out = scratch / f"run-{role}-{time.monotonic_ns()}"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("KVLAB_")}, "KVLAB_DATA": str(scratch / "data"),
           "KVLAB_PRESET": "cpu" if backend == "gloo" else "gpu",
           "PYTHONPATH": os.pathsep.join(q for q in (os.getcwd(), os.environ.get("PYTHONPATH")) if q)}
    p = subprocess.Popen([sys.executable, "-m", "kvlab", "disagg", "--backend", backend, "--repeats", "1000000",
                          "--quiet", "--timeout", str(timeout_s), "--port", str(port), "--out", str(out)],
                         env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180
        while (_done(port) < 2 or len(worker_pids(out)) < 2) and time.monotonic() < deadline:
            if p.poll() is not None:
                raise RuntimeError(f"the run ended before any worker was stopped: {p.stderr.read()[-500:]}")
            time.sleep(0.1)
        os.kill(worker_pids(out)[role], signal.SIGSTOP)
        t0 = time.monotonic()
        err = p.stderr.readline()  # the launcher's one line: it is printed once the run is marked and stopped
        said = time.monotonic() - t0
        err += p.communicate(timeout=300)[1]
        ended = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
        for pid in worker_pids(out).values():
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
    line = next((ln for ln in err.splitlines() if ln.strip()), "")
    return {"role": role, "deadline_s": timeout_s, "said_s": round(said, 3), "said_over_s": round(said - timeout_s, 3),
            "ended_s": round(ended, 3), "over_s": round(ended - timeout_s, 3),
            "exit_code": p.returncode, "named_stopped": "has been stopped" in line, "line": line[:300]}


def main() -> None:
    a = argparse.ArgumentParser()
    a.add_argument("out")
    a.add_argument("--trials", type=int, default=5)
    a.add_argument("--backend", default="gloo")
    a.add_argument("--timeout", type=float, default=3.0)
    a.add_argument("--loads", default="idle,loaded")
    args = a.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=False)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for load in args.loads.split(","):
            burners = [multiprocessing.Process(target=_burn, daemon=True) for _ in range(2 * (os.cpu_count() or 1))] \
                if load == "loaded" else []
            for b in burners:
                b.start()
            try:
                for k in range(args.trials):
                    for role in ("prefill", "decode"):
                        r = {"load": load, "busy_processes": len(burners), "trial": k,
                             **trial(role, args.backend, args.timeout, Path(scratch))}
                        rows.append(r)
                        print(json.dumps(r), flush=True)
            finally:
                for b in burners:
                    b.kill()
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                text=True).stdout.strip())
    (out / "meta.json").write_text(json.dumps({"host": socket.gethostname(), "cpus": os.cpu_count(),
                                               "platform": platform.platform(), "python": sys.version.split()[0],
                                               "backend": args.backend, "timeout_s": args.timeout,
                                               "trials": args.trials, "commit": commit, "dirty": dirty,
                                               "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=2) + "\n")


if __name__ == "__main__":
    main()
