"""Two network stacks on one machine, joined by a veth pair, and the kernel's token-bucket shaper on the link
between them: a link slower than compute, made on purpose.

Each "node" is a network namespace of its own; the two share this host's kernel and clock (so a process in one
and a process in the other read one monotonic clock), but every byte between them crosses a real (virtual)
Ethernet link through two TCP/IP stacks. `shape` puts a ``tbf`` qdisc on one end's egress (``tc qdisc replace dev
… root tbf rate R``): what leaves that end is held to R bits a second, counted on the wire, Ethernet and IP and
TCP headers included, so a TCP stream's payload gets ``payload_share()`` of R. (``netem`` does not work on these
machines; ``tbf`` does.)

Everything a `namespaces()` block makes is removed when it exits, by an exception, Ctrl-C or SIGTERM (deleting a
namespace deletes its end of the pair and its qdiscs). A SIGKILL leaves them: their names carry the making
process's id (``kvlab-n0-<pid>-…``), and `sweep()` removes those whose process is gone.

Needs root and iproute2 (``ip``, ``tc``); `unavailable()` says why not, in one line.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time

__all__ = ["PREFIX", "MIN_RATE_BPS", "MAX_RATE_BPS", "unavailable", "namespaces", "kill_all_in", "check_rate",
           "shape", "payload_share", "sweep"]

PREFIX = "kvlab-n"
# what a tbf qdisc can hold a veth to, as kvlab uses it: below 8 kbit/s one frame takes longer than tc's default
# latency bound, above 100 Gbit/s a veth on these hosts does not go that fast unshaped
MIN_RATE_BPS = 8e3
MAX_RATE_BPS = 100e9


def unavailable() -> str | None:
    """Why namespaces and shaping cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces and tc need root"
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        return f"{' and '.join(missing)} not found (iproute2)"
    return None


def _run(*argv: str) -> str:
    done = subprocess.run(list(argv), capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def kill_all_in(ns: str) -> None:
    """SIGKILL every process in namespace `ns` (torchrun starts its workers in sessions of their own, so killing
    torchrun alone would leave them), and wait until none is left: a namespace lives on while a process holds it.
    RuntimeError, naming them, if some are still there after 5 s (deleting its name would then hide a namespace
    that lives on, with its veth and qdisc)."""
    pids: list[str] = []
    for _ in range(50):
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        time.sleep(0.1)
    raise RuntimeError(f"namespace {ns}: processes {', '.join(pids)} outlived SIGKILL for 5 s; it is left in place "
                       f"(remove it with: ip netns del {ns})")


def _remove(names) -> tuple[list[str], list[str]]:
    """Kill what runs in each namespace and delete it: (the names removed, what kill_all_in said of the others,
    which are left in place)."""
    gone, left = [], []
    for ns in names:
        try:
            kill_all_in(ns)
        except RuntimeError as err:
            left.append(str(err))
            continue
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        gone.append(ns)
    return gone, left


def _sigterm(signum, frame):  # SIGTERM unwinds like Ctrl-C, so the finally below removes what was made
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def namespaces(tag: str = ""):
    """Two network namespaces joined by a veth pair: yields [(namespace, interface, address), ...], node 0's and
    node 1's, on a /24 of their own. Removed on exit, with every process still in them."""
    why = unavailable()
    if why:
        raise RuntimeError(why)
    pid = os.getpid()
    tag = f"{pid}-{tag}" if tag else str(pid)
    short = f"{pid % 100000}{tag[len(str(pid)):]}"[:9]  # interface names are at most 15 characters
    a, b = f"{PREFIX}0-{tag}", f"{PREFIX}1-{tag}"
    net = f"10.{77 + pid % 100}.{pid % 250}"
    nodes = [(a, f"kv0-{short}", f"{net}.1"), (b, f"kv1-{short}", f"{net}.2")]
    made = []
    old = signal.getsignal(signal.SIGTERM)
    with contextlib.suppress(ValueError):  # not the main thread: Ctrl-C and exceptions still clean up
        signal.signal(signal.SIGTERM, _sigterm)
    try:
        for ns, _, _ in nodes:
            _run("ip", "netns", "add", ns)
            made.append(ns)
        # the pair is made with each end already in its namespace: nothing is left in this one if a step fails
        _run("ip", "link", "add", nodes[0][1], "netns", a, "type", "veth", "peer", "name", nodes[1][1], "netns", b)
        for ns, dev, addr in nodes:
            _run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _run("ip", "-n", ns, "link", "set", dev, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        yield nodes
    finally:
        # a second Ctrl-C or SIGTERM must not cut the clean-up short: both are held back until it is done (and
        # delivered then)
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            _, left = _remove(made)
            if left:
                raise RuntimeError("; ".join(left))
        finally:
            with contextlib.suppress(ValueError, TypeError):  # TypeError: a handler C code set (getsignal: None)
                signal.signal(signal.SIGTERM, old)
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def check_rate(rate_bps, name: str = "rate") -> float:
    """A rate the shaper can set, in bits a second; else ValueError naming the value and what is valid."""
    if isinstance(rate_bps, bool) or not isinstance(rate_bps, (int, float)) or not (
            MIN_RATE_BPS <= rate_bps <= MAX_RATE_BPS):
        raise ValueError(f"{name} = {rate_bps!r}: the shaper sets {MIN_RATE_BPS:,.0f} to {MAX_RATE_BPS:,.0f} bits/s")
    return float(rate_bps)


def shape(ns: str, dev: str, rate_bps: float, burst_bytes: int = 0, latency_ms: float = 1000.0) -> dict:
    """Hold `dev`'s egress in namespace `ns` to `rate_bps` with a tbf qdisc (replacing any root qdisc there).

    burst_bytes: the bucket (0: 10 ms at the rate, at least 16 KiB — tbf needs at least a frame, and a bucket
    much smaller than rate/HZ cannot reach the rate); latency_ms: how long a packet may wait in its queue before
    tbf drops it (long: the sender's TCP window, not drops, should hold the flow back). Returns what tc reports."""
    rate = check_rate(rate_bps)
    burst = int(burst_bytes) or max(16 << 10, int(rate / 8 * 0.010))
    _run("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{int(rate)}bit",
         "burst", str(burst), "latency", f"{latency_ms:g}ms")
    shown = _run("ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", dev).strip()
    if "tbf" not in shown:
        raise RuntimeError(f"tc set no tbf qdisc on {dev} in {ns}: {shown}")
    return {"rate_bps": rate, "burst_bytes": burst, "latency_ms": latency_ms, "tc": shown}


def payload_share(mtu: int = 1500) -> float:
    """The share of a shaped rate a TCP stream's payload gets: a full frame carries MTU − 52 payload bytes (IPv4
    20, TCP 20, its timestamp option 12) and is MTU + 14 bytes (the Ethernet header) where tbf counts it on a veth.
    1448 / 1514 = 0.956 at MTU 1500."""
    return (mtu - 52) / (mtu + 14)


def sweep() -> list[str]:
    """Remove kvlab's namespaces whose making process is gone (a SIGKILLed run's); returns their names.
    RuntimeError, naming them, for those whose processes outlive SIGKILL (the others are removed all the same)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    stale = []
    for line in out.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.match(rf"^{re.escape(PREFIX)}[01]-(\d+)(?:-|$)", name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            stale.append(name)
    gone, left = _remove(stale)
    if left:
        raise RuntimeError(f"removed {', '.join(gone) or 'none'}; " + "; ".join(left))
    return gone
