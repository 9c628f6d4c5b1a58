"""The cases issue 26 listed as not yet tried, each through `kvlab disagg` as a user starts it on a CPU: a worker
stopped with SIGSTOP, the run folder removed mid-run, a full disk, and a fault campaign with a microsecond deadline.
Each ends in one line, leaves no worker behind, and either leaves a folder that says (or can be seen) it stopped or,
for the microsecond deadline, decodes nothing from a partial cache."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, cpu_process_env, disagg_workers, free_port, requests_done
from kvlab import runfolder

TIMEOUT_S = 3.0  # the run's deadline (--timeout) in these tests


def _start(out, tmp_path, *extra: str, port: int | None = None) -> subprocess.Popen:
    env = cpu_process_env(tmp_path)
    argv = [sys.executable, "-m", "kvlab", "disagg", "--quiet", "--out", str(out), *extra]
    if port is not None:
        argv += ["--port", str(port)]
    return subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)


def _flowing(out, port: int, n: int = 2) -> None:
    """Until the decode side has finished `n` requests (60 s at most)."""
    deadline = time.monotonic() + 60
    while (requests_done(port) < n or len(disagg_workers(out)) < 2) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert requests_done(port) >= n, "no requests finished within 60 s"


def _cleanup(p: subprocess.Popen, out) -> None:
    if p.poll() is None:
        p.kill()
    for pid in disagg_workers(out).values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)


def _no_orphans(out) -> None:
    deadline = time.monotonic() + 5
    while disagg_workers(out) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not disagg_workers(out), f"orphan workers: {disagg_workers(out)}"


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_stopped_worker_ends_the_run_within_the_deadline_in_one_line(role, tmp_path):
    """SIGSTOP of either worker while requests flow: the launcher's one line names the stopped process (even when
    its peer's own wait ran out first) within the deadline plus 2.5 s (its poll, marking the folder and stopping
    both workers; data/probes/sigstop has what it took on a loaded machine, and CI's cores are busy with the
    suite), stops both workers (a stopped one is continued so it can
    take its SIGTERM) and marks the folder stopped. Before, a stopped decode side was noticed only when the prefill
    side's wait for the next request, twice the deadline, ran out."""
    import threading

    out, port = tmp_path / "run", free_port()
    p = _start(out, tmp_path, "--repeats", "1000000", "--timeout", str(TIMEOUT_S), port=port)
    said: list = []
    try:
        _flowing(out, port)
        os.kill(disagg_workers(out)[role], signal.SIGSTOP)
        t0 = time.monotonic()
        reader = threading.Thread(target=lambda: said.extend((ln, time.monotonic() - t0) for ln in p.stderr),
                                  daemon=True)
        reader.start()
        p.wait(timeout=60)
        reader.join(timeout=10)
    finally:
        _cleanup(p, out)
    lines = [(ln, t) for ln, t in said if ln.strip()]
    assert p.returncode != 0 and len(lines) == 1, said
    line, t = lines[0]
    assert f"the {role} process (pid" in line and "has been stopped" in line, line
    assert t <= TIMEOUT_S + 2.5, f"the launcher said why {t:.1f} s after the SIGSTOP (deadline {TIMEOUT_S} s)"
    assert runfolder.run_state(out) == "failed" and (out / "STOPPED.txt").is_file()
    _no_orphans(out)


def test_the_run_folder_removed_mid_run_is_one_line_and_no_orphan(tmp_path):
    """`rm -rf` of the run folder while requests flow: nothing is left to mark, but the run must end (the decode
    side cannot write its results) in one line, with no traceback and no worker left."""
    out, port = tmp_path / "run", free_port()
    p = _start(out, tmp_path, "--repeats", "40", "--timeout", str(TIMEOUT_S), port=port)
    try:
        _flowing(out, port)
        shutil.rmtree(out)
        _, err = p.communicate(timeout=120)
    finally:
        _cleanup(p, out)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert p.returncode != 0 and len(lines) == 1 and "Traceback" not in err, err
    assert not out.exists(), f"the removed folder came back: {os.listdir(out)}"  # nothing half-written reappears
    _no_orphans(out)


def _tmpfs(path, size: str) -> bool:
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    return done.returncode == 0


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.geteuid() != 0 or shutil.which("mount") is None,
                    reason="a full disk is a small tmpfs, which needs root and Linux")
@pytest.mark.parametrize("size", ["40k", "56k", "72k"])
def test_a_full_disk_is_one_line_naming_the_folder_which_reads_as_stopped(size, tmp_path):
    """The run folder on a tmpfs of a few dozen KiB: the disk fills while the record, the diff or the tables are
    written (which one depends on the size and on how large this checkout's diff is). One line names the folder
    and the disk; the folder reads as stopped, failed or killed (a claim whose process is gone), never running or
    finished, and nothing it holds is taken for a whole run."""
    disk = tmp_path / "disk"
    if not _tmpfs(disk, size):
        pytest.skip("this machine refuses to mount a tmpfs")
    out = disk / "run"
    try:
        p = _start(out, tmp_path, "--repeats", "3")
        _, err = p.communicate(timeout=180)
        lines = [ln for ln in err.splitlines() if ln.strip()]
        if p.returncode == 0:  # this checkout's diff is small enough that the run fitted: nothing to judge
            assert runfolder.run_state(out) == "finished"
            return
        assert len(lines) == 1 and "No space left on device" in lines[0] and str(out) in lines[0], err
        assert runfolder.run_state(out) in ("failed", "killed", "stopped"), runfolder.run_state(out)
        _no_orphans(out)
        runfolder.check_run_folder(out)  # and, the disk freed, the folder takes a new run (the attempt set aside)
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def test_a_fault_campaign_with_a_microsecond_deadline_decodes_nothing_partial(tmp_path):
    """--fault-timeout 0.000001: no layer can land in time, so each fault's request is refused or, retried, recovered
    with the colocated tokens — and never decoded from a partial cache."""
    out = tmp_path / "run"
    p = _start(out, tmp_path, "--faults", "6", "--fault-timeout", "0.000001", "--policy", "retry", "--repeats", "1",
               "--warmup", "0")
    try:
        _, err = p.communicate(timeout=240)
    finally:
        _cleanup(p, out)
    assert p.returncode == 0, err
    s = json.loads((out / "summary.json").read_text())
    assert s["faults_injected"] == 6 and s["decoded_from_partial"] == 0, s
    assert s["recovered"] + s["refused"] == 6 and s["undetected"] == 0, s
