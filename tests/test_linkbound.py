"""The link-bound regime's parts (issue 30): kvlab.netns (two network stacks, a tbf shaper, removal on every exit)
and the models tools/linkbound.py judges its runs against."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvlab import calculator, models, netns
from kvlab.exposure import pipeline_exposure

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import linkbound  # noqa: E402


def test_tcp_payload_share_of_a_frame():
    assert netns.payload_share(1500) == 1448 / 1514
    assert netns.payload_share(9000) == 8948 / 9014


@pytest.mark.parametrize("rate", [0, -5, 1e3, 1e12, float("nan"), True, "100M"])
def test_a_rate_the_shaper_cannot_set_is_refused_in_one_line(rate):
    with pytest.raises(ValueError) as err:
        netns.check_rate(rate, "rate_bps")
    assert str(err.value).startswith(f"rate_bps = {rate!r}: the shaper sets 8,000 to") and "\n" not in str(err.value)


def test_released_at_the_layer_end_is_the_calculators_pipelined_model():
    rng = np.random.default_rng(3)
    for _ in range(50):
        c, t = rng.uniform(0.01, 0.1, 8), rng.uniform(0.001, 0.3, 8)
        assert linkbound.released_exposure(c, t, 1.0) == pytest.approx(pipeline_exposure(list(c), list(t)).exposed_s)


def test_the_bucket_model_by_hand():
    # an empty bucket is the hook-release model; a full one lets its bytes through at once after an idle link
    c, n = [0.05] * 8, [1e6] * 8
    assert linkbound.bucket_exposure(c, n, 0.2, 1e7, 0.0) == pytest.approx(
        linkbound.released_exposure(c, np.array(n) / 1e7, 0.2))
    assert linkbound.bucket_exposure([0.6], [8e6], 1.0, 1e7, 5e5) == pytest.approx((8e6 - 5e5) / 1e7)
    # a link faster than compute idles between layers and refills: the last layer's send takes (n − bucket)/rate
    # after its release, 0.8 of the way through the last layer
    assert linkbound.bucket_exposure(c, n, 0.8, 1e8, 5e5) == pytest.approx((1e6 - 5e5) / 1e8 - 0.2 * 0.05)


def test_the_hook_points_share_of_a_layer():
    """ready_share's arithmetic only (where kvlab disagg's hook fires is kvlab.hooks' to test): the q, k and v
    projections' FLOPs over the layer's."""
    spec = models.from_hf_config(linkbound.MODEL)
    share = linkbound.ready_share(spec, 1024)
    qkv = 2 * 1024 * 256 * (4 + 2 * 2) * 64  # hidden 256; 4 query and 2 KV heads of 64
    assert share == qkv / calculator.prefill_flops(spec, 1024).per_layer()[0] and 0 < share < 0.5


def _netns_ok() -> str | None:
    why = netns.unavailable()
    if why:
        return why
    probe = "kvlab-probe-lb"
    done = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None if done.returncode == 0 else f"cannot make a network namespace here: {done.stderr.strip()[:120]}"


def _listed() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {ln.split()[0] for ln in out.splitlines() if ln.split()}


def test_namespaces_are_shaped_and_removed_on_every_exit():
    why = _netns_ok()
    if why:
        pytest.skip(why)
    with pytest.raises(RuntimeError, match="stop here"):
        with netns.namespaces("t") as nodes:
            names = {ns for ns, _, _ in nodes}
            assert names <= _listed()
            got = netns.shape(nodes[1][0], nodes[1][1], 50e6)
            assert "tbf" in got["tc"] and got["burst_bytes"] == max(16 << 10, int(50e6 / 8 * 0.010))
            raise RuntimeError("stop here")
    assert not names & _listed()


def test_a_sigkilled_runs_namespaces_are_swept():
    why = _netns_ok()
    if why:
        pytest.skip(why)
    dead = subprocess.Popen(["true"])
    dead.wait()  # a process id that is gone
    name = f"{netns.PREFIX}0-{dead.pid}-x"
    subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
    try:
        assert name in netns.sweep() and name not in _listed()
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def test_the_error_interval_of_a_negative_prediction():
    # measured −59.0 [−65.2, −54.1] against −59.9: the interval of the error spans 0
    err, lo, hi = linkbound._abs_err(-59.0, -65.2, -54.1, -59.9)
    assert err == pytest.approx(1.5, abs=0.1) and lo == 0.0 and hi == pytest.approx(9.7, abs=0.1)
    err, lo, hi = linkbound._abs_err(110.0, 108.0, 112.0, 100.0)
    assert (round(err, 6), round(lo, 6), round(hi, 6)) == (10.0, 8.0, 12.0)


_HOLD = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # a background job may start with SIGINT ignored
sys.path.insert(0, {repo!r})
from kvlab import netns
with netns.namespaces("sig") as nodes:
    print(" ".join(ns for ns, _, _ in nodes), flush=True)
    time.sleep(60)
"""


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_stopped_run_removes_its_namespaces(sig):
    """A run stopped by SIGTERM or Ctrl-C (SIGINT) leaves none of its namespaces behind."""
    import signal

    why = _netns_ok()
    if why:
        pytest.skip(why)
    repo = str(Path(__file__).resolve().parent.parent)
    proc = subprocess.Popen([sys.executable, "-c", _HOLD.format(repo=repo)], stdout=subprocess.PIPE, text=True)
    try:
        names = set(proc.stdout.readline().split())
        assert len(names) == 2 and names <= _listed()
        proc.send_signal(getattr(signal, sig))
        assert proc.wait(timeout=30) != 0
        assert not names & _listed()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_error_in_units_of_the_prefill_is_the_difference_over_the_prefill_with_its_interval():
    # 110 ms measured [105, 115] against 100 predicted: 10 % of the prediction, 1 % of a 1 s prefill
    assert linkbound._abs_err(110.0, 105.0, 115.0, 100.0) == pytest.approx((10.0, 5.0, 15.0))
    assert linkbound._abs_err(110.0, 105.0, 115.0, 100.0, 1000.0) == pytest.approx((1.0, 0.5, 1.5))
    # an interval across the prediction reaches zero; a negative prediction leaves the prefill's sign alone
    assert linkbound._abs_err(102.0, 95.0, 110.0, 100.0, 1000.0) == pytest.approx((0.2, 0.0, 1.0))
    assert linkbound._abs_err(5.0, 2.0, 8.0, -5.0, 100.0) == pytest.approx((10.0, 7.0, 13.0))
