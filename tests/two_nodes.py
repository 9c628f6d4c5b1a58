"""the disagg page's two-node `kvlab disagg` commands, run as written on one machine: each "node" is a network namespace of
its own, the two joined by a veth pair, so the rendezvous, the control store and gloo's traffic cross a real
(virtual) Ethernet link between two network stacks, not loopback. Two kernels' worth of separation it is not: both
namespaces share this host's kernel, clock and hostname.

Needs root and iproute2 (`ip netns`). Used by tests/test_disagg.py, and by hand to make a committed run:

    python tests/two_nodes.py --out data/disagg/<run_id>
"""

from __future__ import annotations

import os
import re
import secrets
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kvlab.netns import kill_all_in, namespaces  # noqa: E402  (made by kvlab.netns, removed on every exit)
PAGE = REPO / "docs" / "results" / "disagg.md"  # the disagg page shows the two-node commands


def readme_commands() -> list[str]:
    """The two torchrun command lines of the disagg page's two-node block (rank 0 first), continuation lines joined."""
    text = PAGE.read_text(encoding="utf-8")
    block = text.split("Two nodes", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    joined = re.sub(r"\\\n\s*", "", block)
    commands = [ln.strip() for ln in joined.splitlines() if ln.strip().startswith("torchrun ")]
    if len(commands) != 2:
        raise ValueError(f"the disagg page's two-node block should hold 2 torchrun commands, found {len(commands)}")
    return commands


def link_bytes(ns: str, dev: str) -> dict:
    """rx/tx bytes of `dev` inside `ns`, from /sys."""
    out = {}
    for d in ("rx", "tx"):
        done = subprocess.run(["ip", "netns", "exec", ns, "cat", f"/sys/class/net/{dev}/statistics/{d}_bytes"],
                              check=True, capture_output=True, text=True)
        out[f"{d}_bytes"] = int(done.stdout)
    return out


def run(out: Path, timeout_s: float = 240.0, env: dict | None = None) -> dict:
    """the disagg page's two commands in two namespaces; $MASTER_ADDR is rank 0's address, /shared/disagg-run is `out`
    (the port stays the disagg page's: each namespace has ports of its own).
    Returns {"returncodes", "logs", "link": rank 0's veth counters before and after, "commands"}."""
    commands = readme_commands()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("KVLAB_", "GLOO_", "MASTER_"))}
    base["KVLAB_CONTROL_KEY"] = secrets.token_hex(32)  # the page's export, the same secret on both "nodes"
    base.update(env or {})
    base["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{base.get('PATH', '')}"  # this venv's torchrun
    base["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), base.get("PYTHONPATH")) if p)
    with namespaces() as nodes:
        master = nodes[0][2]
        argvs = []
        for text in commands:
            text = text.replace("$MASTER_ADDR", master).replace("/shared/disagg-run", shlex.quote(str(out)))
            argvs.append(shlex.split(text))
        before = link_bytes(nodes[0][0], nodes[0][1])
        procs, logs, codes = [], [], []
        try:
            for (ns, _, _), argv in zip(nodes, argvs):
                procs.append(subprocess.Popen(["ip", "netns", "exec", ns, *argv], cwd=REPO, env=base,
                                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                              stderr=subprocess.STDOUT, text=True))
            for p in procs:
                try:
                    logs.append(p.communicate(timeout=timeout_s)[0])
                except subprocess.TimeoutExpired:
                    for ns, _, _ in nodes:
                        kill_all_in(ns)
                    logs.append(p.communicate()[0])
                codes.append(p.returncode)
        finally:  # an error or Ctrl-C here: nothing of this run outlives it (namespaces() kills the rest)
            for p in procs:
                if p.poll() is None:
                    p.kill()
        after = link_bytes(nodes[0][0], nodes[0][1])
    return {"returncodes": codes, "logs": logs, "commands": [" ".join(a) for a in argvs],
            "link": {"interface": nodes[0][1], "before": before, "after": after}}


if __name__ == "__main__":
    import argparse
    import json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the decode node's run folder (the disagg page's /shared/disagg-run)")
    args = parser.parse_args()
    got = run(Path(args.out).resolve())
    for code, log in zip(got["returncodes"], got["logs"]):
        print(log[-3000:])
    record = {k: got[k] for k in ("returncodes", "commands", "link")}
    Path(args.out, "two_nodes.json").write_text(json.dumps(record, indent=2) + "\n")
    sys.exit(max(got["returncodes"]) != 0)
