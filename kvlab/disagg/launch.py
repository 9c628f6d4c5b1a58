"""Start the two processes, wait for them, and write the run: `run(cfg, out)`.

On one host the launcher hosts the control store (a TCPStore on a free port, or --port, listening on loopback
only), draws the run key that signs every control message (kvlab.disagg.protocol) and starts the prefill and the
decode worker as subprocesses (`python -m kvlab.disagg`), the key in their environment. Under torchrun (two nodes,
or two processes on one) every process runs `kvlab disagg` itself: rank 0 is the decode worker and writes the run,
rank 1 prefills; both use torchrun's own store, and the user sets one run key (KVLAB_CONTROL_KEY) on every node.
Either way a worker that fails posts its error first, the launcher names it in one line, stops the other process
(no orphans) and leaves the run folder marked as stopped; a worker stopped (SIGSTOP) past the deadline is named too.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from pathlib import Path

import pandas as pd

from .. import results, runfolder
from .backends import BACKENDS
from .config import DECODE, DisaggConfig, check
from . import tp_handoff
from .memory import DecodeOutOfMemory
from .protocol import KEY_ENV, Control, ControlIntegrityError, new_key, run_key, unverified
from .summary import build as summary_of
from .workers import ROWS_FILE, entry

__all__ = ["run", "DisaggError", "under_torchrun", "gloo_interface", "worker_pids", "is_halted", "progress_of"]


class DisaggError(RuntimeError):
    """A worker process failed; the message names the process and its error in one line."""


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ


def _params(cfg: DisaggConfig) -> dict:
    d = dataclasses.asdict(cfg)
    d["contexts"], d["modes"], d["layouts"] = list(cfg.contexts), list(cfg.modes), list(cfg.layouts)
    return d


def _store(port: int, timeout_s: float):
    """The control store's server, listening on 127.0.0.1 only. Given host 127.0.0.1, torch's TCPStore still
    listens on every interface (`*:PORT`); a socket bound here to loopback and handed over (master_listen_fd, libuv
    backend, which closes it with the store) keeps it to this machine."""
    import socket
    import torch.distributed as dist
    from datetime import timedelta

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", port))
    except OSError as err:  # address in use, or a port below 1024 without the right
        sock.close()
        raise ValueError(f"port = {port}: cannot listen on it ({err.strerror or err}); pick another --port, or leave "
                         "it out and a free port is chosen") from None
    port = sock.getsockname()[1]
    fd = sock.detach()
    try:
        return dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                             timeout=timedelta(seconds=timeout_s), master_listen_fd=fd, use_libuv=True)
    except Exception as err:
        try:  # torch may have closed it already
            os.close(fd)
        except OSError:
            pass
        raise ValueError(f"port = {port}: the control store cannot listen on it ({str(err).splitlines()[0][:120]}); "
                         "pick another --port, or leave it out and a free port is chosen") from None


def _control(store, timeout_s: float, key: str) -> Control:
    """The launcher's view of the workers' messages: the same prefix ("kvlab") and key as theirs."""
    import torch.distributed as dist

    return Control(dist.PrefixStore("kvlab", store), timeout_s, bytes.fromhex(key), scope="kvlab")


def _stopped(run, why: str) -> None:
    """Mark the run folder stopped (run.json's `stopped` and status "failed", STOPPED.txt), deaf to SIGTERM and
    Ctrl-C meanwhile (runfolder.shielded): `timeout` signals the launcher twice (itself, then its process group), and a
    second Terminated raised in here once left run.json saying "running" (a campaign on the H200, 2026-12-01)."""
    with runfolder.shielded():
        try:
            run.update(stopped=why)
        except Exception:
            pass
        try:
            runfolder.record_execution(run.dir, "kvlab disagg", ok=False, seconds=0.0, error=why)
        except OSError:  # a full disk, a folder removed: the error that stopped the run is the one to raise
            pass
        try:
            run.reload()  # so a later update starts from "failed", not from this object's "running"
        except Exception:
            pass


def _record_end(run, procs=None, memory=None) -> None:
    """After the workers are stopped: how each ended (run.json `worker_exit`) and, after a decode-side
    out-of-memory, the decode side's memory by phase up to it (`decode_memory`). Written after the folder is marked
    stopped, on its own: a failure here cannot undo that marking."""
    extra = {}
    if procs:
        extra["worker_exit"] = _exit_codes(procs)
    if memory:
        extra["decode_memory"] = memory
    if extra:
        with runfolder.shielded():
            try:
                results.amend(run.dir, **extra)  # on what is on disk ("failed"), then read back into `run`
                run.reload()
            except Exception:
                pass


def _exit_codes(procs: list) -> dict:
    """{role: exit code} of the worker processes (None: still running)."""
    return {role: p.poll() for role, p in procs}


def _worker_memory(control) -> list | None:
    """The memory phases the decode process posted with its error (an out-of-memory), or None."""
    try:
        return (control.read("error/decode") or {}).get("memory")
    except Exception:
        return None


def _worker_error(control) -> str | None:
    """The first error a worker posted, in one line; a posted value that does not verify is itself the failure
    (someone else wrote into the run's control store)."""
    for role in ("decode", "prefill"):
        try:
            got = control.read(f"error/{role}")
        except ControlIntegrityError as err:
            return f"the control store was written by someone else: {err}"
        if got is not None:
            return f"the {role} process stopped: {got['error']}"
    return None


def run(cfg: DisaggConfig, out: str | os.PathLike = "", progress: bool = True, run=None) -> dict:
    """Run `cfg` in two processes; returns the summary (also written to <run>/summary.json).

    out: the run folder (empty: a new data/disagg/<run_id>/). run: a results.Run already started (notebook 05):
    its folder is used and the caller finishes it. Raises ValueError for bad input (before anything is written)
    and DisaggError when a worker fails (the run folder then says it stopped; each worker's output is in
    <run>/worker-<role>.log)."""
    check(cfg)
    if cfg.prefill_tp > 1 or cfg.decode_tp > 1:  # P + D processes, the cache re-sharded between them
        if under_torchrun():
            raise ValueError("--prefill-tp/--decode-tp start their own P + D processes; run them without torchrun")
        try:
            return tp_handoff.run_tp(cfg, out, progress)
        except tp_handoff.RankError as err:  # the first rank that failed, in one line (the folder says it stopped)
            raise DisaggError(str(err)) from err
    if under_torchrun():
        if cfg.faults and "kill" in cfg.fault_kinds:
            raise ValueError("fault-kinds: kill needs kvlab's own launcher, which starts the successor of a killed "
                             "prefill process; under torchrun leave kill out")
        return _torchrun(cfg, out, progress)
    store = _store(cfg.port, cfg.timeout_s)
    key = new_key()
    control = _control(store, cfg.timeout_s, key)
    owned = run is None
    procs: list = []
    run_ = None
    restore_term = runfolder.raise_on_sigterm()
    try:  # from the run folder's creation on: a SIGTERM meanwhile still leaves a folder that says it stopped
        run_ = results.start("disagg", _params(cfg), run_dir=out) if owned else run
        run_.update(disagg_config=_params(cfg))
        t0 = time.monotonic()
        procs = _start_workers(cfg, store.port, run_.dir, key)
        deaths = _watch(cfg, control, procs, progress,
                        restart=lambda g: _start(cfg, store.port, run_.dir, "prefill", key, g))
        summary = _write(run_, cfg, time.monotonic() - t0, deaths=deaths)
        _stop(procs)  # a prefill process still on its way out is stopped here, not left to run on
        run_.update(worker_exit=_exit_codes(procs))
        if owned:
            run_.finish()
        return summary
    except BaseException as err:
        if run_ is not None:
            if isinstance(err, OSError) and not err.filename:  # a full disk mid-run: name the folder
                err.filename = str(run_.dir)
            _stopped(run_, runfolder.stop_reason(err))
            with runfolder.shielded():  # a second Ctrl-C or SIGTERM must not cut the stop or the record short
                _stop(procs)
            _record_end(run_, procs, _worker_memory(control))
        raise
    finally:
        _stop(procs)
        restore_term()


Terminated = runfolder.Terminated  # the launcher's SIGTERM, as kvlab.results raises it


def _start(cfg: DisaggConfig, port: int, run_dir: Path, role: str, key: str, generation: int = 0):
    """One worker: `python -m kvlab.disagg`, its output in <run>/worker-<role>.log (a prefill process started in
    place of a dead one: worker-prefill-g<generation>.log), the run key in its environment (not on its command line,
    which every user of the machine can read). Plain subprocesses rather than multiprocessing's
    spawn, so a caller's script needs no ``if __name__ == "__main__"`` guard."""
    import subprocess
    import sys

    rank = DECODE if role == "decode" else 1 - DECODE
    cmd = [sys.executable, "-m", "kvlab.disagg", "--rank", str(rank), "--config", json.dumps(_params(cfg)),
           "--host", "127.0.0.1", "--port", str(port), "--prefix", "kvlab", "--run-dir", str(run_dir),
           "--generation", str(generation)]
    env = {**os.environ, KEY_ENV: key}
    if cfg.backend == "nixl" and "UCX_PROTO_INFO" not in os.environ:
        # UCX prints which transport each protocol chose (cma, cuda_ipc, tcp…) into the log: summary.json reads it
        env["UCX_PROTO_INFO"] = "y"
    with open(Path(run_dir, _log_name(role, generation)), "w") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)


def _log_name(role: str, generation: int = 0) -> str:
    """A worker's log in the run folder: worker-<role>.log, or worker-prefill-g<g>.log for a successor."""
    return f"worker-{role}.log" if not generation else f"worker-{role}-g{generation}.log"


def _start_workers(cfg: DisaggConfig, port: int, run_dir: Path, key: str) -> list:
    """The decode (rank 0) and the prefill (rank 1) process."""
    return [(role, _start(cfg, port, run_dir, role, key)) for role in ("decode", "prefill")]


def _watch(cfg: DisaggConfig, control, procs: list, progress: bool, restart=None) -> list[dict]:
    """Wait for both workers, showing the decode side's progress; the first failure is a DisaggError naming the
    process and its error (posted by the worker, else its exit code and last log line). In a campaign with kill
    faults, a prefill process that announced its kill (`kill/<generation>`) and died by SIGKILL is the fault
    itself: its death is recorded in the store (`dead/prefill/<generation>`), where the decode side looks for it,
    and `restart(generation + 1)` starts its successor; any other death is a failure. Returns the planned deaths."""
    import sys

    from tqdm.auto import tqdm

    total = (cfg.warmup + cfg.repeats) * (1 + len(cfg.modes)) * len(cfg.layouts) * len(cfg.contexts) + cfg.faults
    bar = tqdm(total=total, desc=f"disagg {cfg.backend}", unit="req", disable=not progress or None, file=sys.stderr)
    decode_done_at = None
    generation = 0
    deaths: list[dict] = []
    kills = "kill" in cfg.fault_kinds and cfg.faults > 0 and restart is not None
    halted: dict[str, float] = {}  # role: when its process was first seen stopped (SIGSTOP, Ctrl-Z, a debugger)
    try:
        while True:
            time.sleep(0.05 if kills else 0.1)
            try:
                done = control.read("progress")  # signed like the rest; one that does not verify moves no bar
            except ControlIntegrityError:
                done = None
            if isinstance(done, int) and done >= bar.n:
                bar.update(done - bar.n)
            codes = [(role, p.poll()) for role, p in procs]
            _check_halted(procs, halted, cfg.timeout_s)
            announced = kills and control.ready(f"kill/{generation}")  # a planned kill: a fault, never a cause
            if announced and dict(codes).get("prefill") == -signal.SIGKILL:  # the kill it announced: the fault itself
                planned = control.read(f"kill/{generation}")  # checked: a forged announcement stops the run
                control.post(f"dead/prefill/{generation}", -signal.SIGKILL)
                pid = next(p.pid for r, p in procs if r == "prefill")
                deaths.append({"generation": generation, "pid": pid, **planned})
                generation += 1
                procs[:] = [(r, p) for r, p in procs if r != "prefill"] + [("prefill", restart(generation))]
                continue
            if _worker_error(control) or any(c not in (None, 0) for _, c in codes):
                raise DisaggError(_halted_cause(procs, halted) or _first_cause(control, procs, planned_prefill_kill=announced))
            if all(c == 0 for _, c in codes):
                return deaths
            if dict(codes).get("decode") == 0:
                # the results are written; a prefill process that does not exit within the deadline is stopped
                decode_done_at = decode_done_at or time.monotonic()
                if time.monotonic() - decode_done_at > cfg.timeout_s:
                    return deaths
    finally:
        bar.close()


def worker_pids(run_dir) -> dict[str, int]:
    """{role: pid} of the live worker processes writing run folder `run_dir` (from /proc; {} where there is none):
    what to look for when a run must be stopped or watched from outside."""
    found = {}
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if b"kvlab.disagg" in args and str(run_dir).encode() in args and b"--rank" in args:
            rank = args[args.index(b"--rank") + 1]
            found["decode" if rank == str(DECODE).encode() else "prefill"] = int(cmdline.parent.name)
    return found


def progress_of(port: int, host: str = "127.0.0.1") -> int:
    """Requests a run's decode side has finished, as an onlooker (a test, a probe) without the run key reads it from
    the store on `port`: the body of the signed `kvlab/progress` value, unchecked; 0 while there is none."""
    import socket
    import torch.distributed as dist
    from datetime import timedelta

    with socket.socket() as probe:  # not before the store listens: torch's client logs every refused attempt
        if probe.connect_ex((host, port)) != 0:
            return 0
    try:
        s = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=2))
        if not s.check(["kvlab/progress"]):
            return 0
        return int(unverified(s.get("kvlab/progress")))
    except Exception:
        return 0


def is_halted(pid: int) -> bool:
    """Whether process `pid` is stopped (state T or t in /proc/<pid>/stat: SIGSTOP, Ctrl-Z, a tracer); False where
    there is no /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:][:1] in ("T", "t")


def _check_halted(procs: list, halted: dict, timeout_s: float) -> None:
    """A worker stopped for longer than the deadline is a failure, named as such: its peer would otherwise wait out
    its own deadline (the prefill side waits twice the deadline for a request) and name only the silence."""
    now = time.monotonic()
    for role, p in procs:
        if p.poll() is None and is_halted(p.pid):
            since = halted.setdefault(role, now)
            if now - since > timeout_s:
                raise DisaggError(f"the {role} process (pid {p.pid}) has been stopped (SIGSTOP, Ctrl-Z or a debugger) "
                                  f"for {now - since:.1f} s, past the {timeout_s:g} s deadline")
        else:
            halted.pop(role, None)


def _halted_cause(procs: list, halted: dict) -> str | None:
    """A worker that has been stopped (SIGSTOP, Ctrl-Z, a debugger) for at least 0.5 s is the cause of whatever its
    peer then reports (a wait that ran out): named first. A shorter stop (a sampling profiler's) blames nobody.
    halted: {role: when _check_halted first saw it stopped}."""
    now = time.monotonic()
    for role, p in procs:
        since = halted.get(role)
        if since is not None and now - since >= 0.5 and p.poll() is None and is_halted(p.pid):
            return (f"the {role} process (pid {p.pid}) has been stopped (SIGSTOP, Ctrl-Z or a debugger) for "
                    f"{now - since:.1f} s; its peer gave up waiting for it")
    return None


def _posted(control, role: str) -> bool:
    """Whether `role` posted a verified error (a value someone else wrote there does not count)."""
    try:
        return control.read(f"error/{role}") is not None
    except Exception:
        return False


def _first_cause(control, procs: list, planned_prefill_kill: bool = False) -> str:
    """The line that names what went wrong first. A process killed from outside (SIGKILL: the OOM killer or a
    user; SIGTERM) without posting an error is the cause, and its peer's posted error ("Connection closed by
    peer") only the consequence, whichever reached the launcher first — unless it is the prefill process whose
    kill the fault campaign planned. Otherwise the posted error, with a word on any other process that ended by
    a signal (a crash on the way out, e.g. SIGABRT, whose order against the error is not known); else the exit
    code and the log's last line. Waits 0.5 s for the other side's exit code or posted error, which may still
    be on its way."""
    time.sleep(0.5)
    codes = [(role, p.poll()) for role, p in procs]

    # deaths by a signal nothing else explains: the process posted no error of its own, and no campaign planned it
    silent = {role: code for role, code in codes if code is not None and code < 0
              and not _posted(control, role) and not (role == "prefill" and planned_prefill_kill)}
    for role, code in silent.items():
        if code in (-signal.SIGKILL, -signal.SIGTERM):
            return f"the {role} process {_how_it_ended(code)}: {_last_line(procs, role)}"
    why = _worker_error(control)
    if why:
        also = [f"the {role} process {_how_it_ended(code)}" for role, code in silent.items()]
        return why + (f" ({'; '.join(also)})" if also else "")
    role, code = next(((r, c) for r, c in codes if c not in (None, 0)), codes[0])
    return f"the {role} process {_how_it_ended(code)}: {_last_line(procs, role)}"


def _how_it_ended(code: int) -> str:
    """'exited with code 1', or 'was killed by SIGKILL (exit code -9)' for a signal."""
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name} (exit code {code})"
        except ValueError:
            pass
    return f"exited with code {code}"


def _last_line(procs: list, role: str) -> str:
    for r, p in procs:
        if r == role:
            try:
                gen = int(p.args[p.args.index("--generation") + 1]) if "--generation" in p.args else 0
                lines = [ln for ln in Path(p.args[p.args.index("--run-dir") + 1], _log_name(role, gen))
                         .read_text(errors="replace").splitlines() if ln.strip()]
                return f"last line of its log: {lines[-1][:300]}" if lines else "its log is empty"
            except OSError:
                return "(no log)"
    return ""


def _stop(procs: list) -> None:
    """No orphans: terminate what still runs (and continue it: a stopped process takes no SIGTERM), kill what does
    not stop in 5 s."""
    for _, p in procs:
        if p.poll() is None:
            p.terminate()
            try:
                os.kill(p.pid, signal.SIGCONT)
            except OSError:
                pass
    for _, p in procs:
        try:
            p.wait(5)
        except Exception:
            p.kill()
            p.wait()


def gloo_interface(master_addr: str, nnodes: int = 1) -> tuple[str | None, str]:
    """The network interface gloo should use on this node, and why.

    gloo tells its peer to connect to the address this host's name resolves to. On many machines that is a
    loopback address (127.0.1.1 in /etc/hosts, or 127.0.0.1), and the other node's connection is then refused
    (seen here: `Gloo connectFullMesh failed ... remote=[127.0.0.1]`). So, unless GLOO_SOCKET_IFNAME is set, the
    interface whose address routes to MASTER_ADDR is chosen (psutil lists the interfaces). MASTER_ADDR on this
    host's loopback is fine for one node and refused for several (the other node could not reach it); with no
    route to it, gloo keeps its own choice."""
    import ipaddress
    import socket

    import psutil

    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return os.environ["GLOO_SOCKET_IFNAME"], "GLOO_SOCKET_IFNAME was set"
    try:
        family, _, _, _, addr = socket.getaddrinfo(master_addr, None, type=socket.SOCK_DGRAM)[0]
    except OSError as err:
        raise ValueError(f"MASTER_ADDR = {master_addr!r} does not resolve ({err}); give the decode node's address") from None
    target = addr[0]
    if ipaddress.ip_address(target.split("%")[0]).is_loopback:
        if nnodes > 1:
            raise ValueError(f"MASTER_ADDR = {master_addr!r} is {target} on this node, a loopback address the other "
                             "node cannot reach; give the decode node's network address, or set GLOO_SOCKET_IFNAME")
        return None, f"MASTER_ADDR {master_addr} is this host's loopback (one node): gloo's own choice"
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:  # connect() on UDP sends nothing
            probe.connect((target, 9))
            local = probe.getsockname()[0].split("%")[0]
    except OSError as err:
        return None, f"no route to MASTER_ADDR {target} ({err.strerror or err}): gloo's own choice"
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == family and a.address.split("%")[0] == local for a in addrs):
            return name, f"the interface with {local}, which routes to MASTER_ADDR {target}"
    return None, f"no interface holds {local}: gloo's own choice"


def _env_int(name: str, default: str | None = None, low: int = 0, high: int | None = None) -> int:
    """An integer torchrun set in the environment, checked: ValueError in one line naming the variable."""
    text = os.environ.get(name, default)
    valid = f"an integer ≥ {low}" + (f" and ≤ {high}" if high is not None else "")
    if text is None:
        raise ValueError(f"{name} is not set; torchrun sets it for every process it starts (valid: {valid})")
    try:
        v = int(text.strip())
    except ValueError:
        v = None
    if v is None or v < low or (high is not None and v > high):
        raise ValueError(f"{name} = {text[:40]!r}: expected {valid}, as torchrun sets it")
    return v


def _torchrun(cfg: DisaggConfig, out, progress: bool) -> dict:
    world = _env_int("WORLD_SIZE", "0")
    if world != 2:
        raise ValueError(f"kvlab disagg under torchrun needs exactly 2 processes (decode = rank 0, prefill = rank 1), "
                         f"got WORLD_SIZE={world}")
    rank = _env_int("RANK", high=1)
    host, port = os.environ.get("MASTER_ADDR", ""), _env_int("MASTER_PORT", low=1, high=65535)
    if not host:
        raise ValueError("MASTER_ADDR is not set; torchrun sets it (the decode node's address) for every process")
    key = run_key(where="under torchrun every process of the pair")  # before anything is written
    prefix = f"kvlab/{os.environ['TORCHELASTIC_RUN_ID']}"
    nnodes = _env_int("GROUP_WORLD_SIZE", "0") or None
    group = BACKENDS[cfg.backend].group
    iface, why = gloo_interface(host, nnodes or 1) if group == "gloo" else (None, f"{group} chooses its own")
    if iface:
        os.environ["GLOO_SOCKET_IFNAME"] = iface
    if rank != DECODE:
        entry(rank, _params(cfg), host, port, prefix, "", progress=False, key=key)
        return {}
    launcher = {"kind": "torchrun", "nnodes": nnodes,
                "node_rank": _env_int("GROUP_RANK", "0"), "master_addr": host, "master_port": port,
                "run_id": os.environ["TORCHELASTIC_RUN_ID"], "gloo_interface": iface, "gloo_interface_why": why}
    run_ = None
    try:
        run_ = results.start("disagg", _params(cfg), run_dir=out)
        run_.update(launcher=launcher)
        t0 = time.monotonic()
        try:
            entry(rank, _params(cfg), host, port, prefix, str(run_.dir), progress, key=key)
        except DecodeOutOfMemory as err:  # this process is the decode worker: its error, in the launcher's words
            raise DisaggError(f"the decode process stopped: DecodeOutOfMemory: {err}") from err
        summary = _write(run_, cfg, time.monotonic() - t0, launcher)
        run_.finish()
        return summary
    except BaseException as err:
        if run_ is not None:
            _stopped(run_, runfolder.stop_reason(err))
            _record_end(run_, memory=getattr(err.__cause__, "memory_rows", None))
        raise


def _write(run_, cfg: DisaggConfig, seconds: float, launcher: dict | None = None, deaths: list | None = None) -> dict:
    """The run's tables (requests.csv, bench.csv, faults.csv) from what the decode worker handed over, and its
    summary (kvlab.disagg.summary) as summary.json and run.json's `summary`."""
    path = Path(run_.dir, ROWS_FILE)
    got = json.loads(path.read_text())
    run_.save_table(pd.DataFrame(got["rows"]), "requests")
    if got["bench"]:
        run_.save_table(pd.DataFrame(got["bench"]), "bench")
    path.unlink()
    summary = summary_of(got, cfg, seconds, run_.dir, launcher, deaths)
    if got.get("faults"):
        run_.save_table(pd.DataFrame(got["faults"]), "faults")
    Path(run_.dir, "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    run_.update(summary={k: v for k, v in summary.items() if k not in ("configs", "bench")})
    return summary
