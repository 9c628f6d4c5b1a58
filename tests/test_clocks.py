"""kvlab.clocks (NVML samples), the send-pattern experiment's analysis (kvlab.studies.overlap_timeline), the send
policies of kvlab.sends.release_plan and the calculator's deadline (kvlab.exposure), all on a CPU; the two-GPU runs are in
test_peer.py."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from kvlab import clocks, exposure, steps
from kvlab.studies.overlap_timeline import pattern_report, patterns
from kvlab.hooks import LayerHooks
from kvlab.kvcache import KVBuffer, layout_for
from kvlab.sends import release_plan
from kvlab.studies.handoff import experiment
from kvlab.transfer import Transport


def test_release_plans():
    assert release_plan("eager", 4) == [0, 1, 2, 3]
    assert release_plan("batch:2", 4) == [1, 1, 3, 3]
    assert release_plan("batch:4", 28)[:8] == [6] * 7 + [13]
    assert release_plan("batch:1", 5) == [4] * 5
    # 28 layers of 42 ms, 0.17 ms a layer on the link: hold until layer 26, send 0…26 while 27 computes
    assert release_plan("deadline", 28, compute_ms=42.0, transfer_ms=0.17) == [26] * 27 + [27]
    # a link as slow as compute: holding anything would expose more, so deadline is eager
    assert release_plan("deadline", 28, compute_ms=1.0, transfer_ms=0.9) == list(range(28))
    for bad, match in (("batch:0", "N must be an int"), ("batch:x", "N must be an int"), ("lazy", "unknown send policy"),
                       ("deadline", "needs compute_ms")):
        with pytest.raises(ValueError, match=match):
            release_plan(bad, 4)


def test_check_policy():
    from kvlab.sends import check_policy

    assert check_policy(" Batch:04 ") == "batch:4" and check_policy("deadline") == "deadline"
    for bad in ("batch:0", "batch:-1", "batch:", "batch:two", "soon"):
        with pytest.raises(ValueError):
            check_policy(bad)
    assert release_plan("batch:3", 7) == [1, 1, 4, 4, 4, 6, 6]  # N that does not divide L: groups of 2, 3, 2
    with pytest.raises(ValueError, match="N must be an int in 1…4"):
        release_plan("batch:5", 4)


def test_a_deadline_with_margin_still_exposes_no_more_than_eager_at_the_real_speed():
    # the plan is made with every transfer taken `margin` times slower; at the speed it really has, holding
    # must still expose no more than sending each layer at its own end would
    rng = np.random.default_rng(1)
    for _ in range(500):
        L = int(rng.integers(2, 40))
        c = list(rng.uniform(0.0, 2.0, L))
        t = list(rng.uniform(0.0, 2.0, L))
        r = exposure.deadline_release(c, t, margin=2.0)
        assert exposure.held_exposure(c, t, r) <= exposure.pipeline_exposure(c, t).exposed_s + 1e-9


def test_deadline_never_exposes_more_than_eager():
    rng = np.random.default_rng(0)
    for _ in range(200):
        L = int(rng.integers(1, 40))
        c = list(rng.uniform(0.0, 2.0, L))
        t = list(rng.uniform(0.0, 2.0, L))
        r = exposure.deadline_release(c, t, margin=1.0)
        eager = exposure.pipeline_exposure(c, t).exposed_s
        assert exposure.held_exposure(c, t, 0) == pytest.approx(eager)
        assert exposure.held_exposure(c, t, r) <= eager + 1e-9
        # the latest such layer: holding until any later one exposes more
        assert all(exposure.held_exposure(c, t, k) > eager + 1e-12 for k in range(r + 1, L))
    assert exposure.held_exposure([1.0, 1.0], [0.5, 0.5], 0) == 0.5
    assert exposure.held_exposure([1.0, 1.0], [0.5, 0.5], 1) == 1.0
    with pytest.raises(ValueError, match="margin"):
        exposure.deadline_release([1.0], [1.0], margin=0.5)
    with pytest.raises(ValueError, match="release"):
        exposure.held_exposure([1.0], [1.0], 1)


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      intermediate_size=128, vocab_size=256, num_hidden_layers=4, max_position_embeddings=512,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


@pytest.mark.parametrize("policy", ["eager", "batch:2", "batch:1", "batch:3"])
def test_a_held_send_still_lands_every_layer(tiny, policy):
    ids = steps.make_prompt(256, 12, "cpu", seed=2)
    lay = layout_for(tiny, 12, dtype=torch.float32)
    src = KVBuffer(lay).poison()
    first = steps.prefill(tiny, ids, src).argmax(-1)
    ref = steps.decode(tiny, src, first, 4)
    t = Transport(lay, "same-gpu", "cpu")
    t.poison()
    sender = t.layerwise(src, release=release_plan(policy, lay.layers))
    landed_at = []
    with LayerHooks(tiny, lambda i: (sender.on_layer(i), landed_at.append(t.buffer.count_poison())), ranges=False) as h:
        sender.begin()
        steps.prefill(tiny, ids, src, h)
        landing = sender.finish()
    got = t.receive(landing, "cpu")
    toks, lg = steps.decode(tiny, got, first, 4)
    assert torch.equal(toks, ref[0]) and torch.equal(lg, ref[1]) and got.count_poison() == 0
    per_layer = lay.bytes_per_layer // 4
    # a held layer is still poisoned after its own signal: batch:1 writes nothing before the last signal
    if policy == "batch:1":
        assert landed_at[:-1] == [lay.layers * per_layer] * (lay.layers - 1)
    if policy == "eager":
        assert landed_at == [(lay.layers - 1 - i) * per_layer for i in range(lay.layers)]


def test_release_is_validated():
    from kvlab.kvcache import KVLayout

    lay = KVLayout(3, 1, 1, 4, 8)
    t = Transport(lay, "same-gpu", "cpu")
    with pytest.raises(ValueError, match=r"release\[1\] = 0"):
        t.layerwise(KVBuffer(lay), release=[0, 0, 2])
    with pytest.raises(ValueError, match="one int per layer"):
        t.layerwise(KVBuffer(lay), release=[2, 2])


def test_handoff_refuses_an_unknown_policy_before_measuring(tiny):
    cfg = experiment.HandoffConfig(contexts=[8], destinations=["same-gpu"], policy="sometimes")
    with pytest.raises(ValueError, match="unknown send policy 'sometimes'"):
        experiment.run_handoff(tiny, cfg, device="cpu")


@pytest.mark.parametrize("policy", ["deadline", "batch:3", "batch:4"])
def test_handoff_with_a_policy_on_cpu(tiny, policy):
    cfg = experiment.HandoffConfig(contexts=[8], destinations=["same-gpu"], repeats=1, warmup=0, decode_tokens=2,
                                interleave_short=1, short_context=8, policy=policy)
    _, checks = experiment.run_handoff(tiny, cfg, device="cpu")
    row = checks[checks.method == "layerwise"].iloc[0]
    assert row.policy == policy and 0 <= row.first_release < 4
    assert checks.tokens_match.all() and checks.logits_equal.all() and (checks.poison_left == 0).all()


def test_sampler_without_nvml_records_nothing_and_says_why(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "pynvml", None)  # importing it fails
    s = clocks.Sampler([0], interval_ms=1.0)
    assert not s.available and s.why.startswith("NVML unavailable")
    with s:
        pass
    assert list(s.samples().columns) == clocks.SAMPLE_COLUMNS and s.samples().empty
    with pytest.raises(ValueError, match="interval_ms"):
        clocks.Sampler([0], interval_ms=0.1)


def test_sampler_thread_with_a_fake_nvml(monkeypatch):
    import sys
    import types

    class FV:
        def __init__(self, v):
            self.nvmlReturn, self.valueType = 0, 3
            self.value = types.SimpleNamespace(ullVal=v)

    calls = {"n": 0}

    def clock(h, which):
        calls["n"] += 1
        return 1500 + calls["n"]

    fake = types.SimpleNamespace(
        nvmlInit=lambda: None, NVML_CLOCK_SM=1, nvmlDeviceGetHandleByPciBusId=lambda bus: bus,
        nvmlDeviceGetHandleByIndex=lambda i: i, nvmlDeviceGetClockInfo=clock,
        nvmlDeviceGetFieldValues=lambda h, ids: [FV(700_000 if i == 186 else 10 * calls["n"]) for i in ids],
        nvmlDeviceGetPowerUsage=lambda h: 650_000, nvmlDeviceGetCurrentClocksEventReasons=lambda h: 0x4)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    s = clocks.Sampler([0, 1], interval_ms=1.0, nvlink_every=1)
    assert s.available and s.instant_power
    s.sample_once()
    s.sample_once()
    df = s.samples()
    assert s.measured_interval_ms() > 0
    assert df.gpu.tolist() == [0, 1, 0, 1] and (df.power_w == 700.0).all() and df.power_capped.all()
    assert df.sm_mhz.is_monotonic_increasing and df.t_ns.is_monotonic_increasing
    w = clocks.window(df, 0, int(df.t_ns.iloc[0]) - 1, int(df.t_ns.iloc[-1]) + 1)
    assert w["samples"] == 2 and w["capped_frac"] == 1.0 and np.isnan(w["nvlink_tx_kib"])  # no sample outside
    mid = clocks.window(df, 0, int(df.t_ns.iloc[0]) + 1, int(df.t_ns.iloc[2]) - 1)
    assert mid["samples"] == 0 and mid["nvlink_tx_kib"] == df.nvlink_tx_kib.iloc[2] - df.nvlink_tx_kib.iloc[0]
    s.start()
    import time

    time.sleep(0.02)
    assert len(s.stop()) > 4
    # the NVLink counters every other sample only; a window's bytes then span the nearest readings
    s2 = clocks.Sampler([0], interval_ms=1.0, nvlink_every=2)
    for _ in range(5):
        s2.sample_once()
    d2 = s2.samples()
    assert d2.nvlink_tx_kib.isna().tolist() == [False, True, False, True, False]
    w2 = clocks.window(d2, 0, int(d2.t_ns.iloc[1]) - 1, int(d2.t_ns.iloc[3]) + 1)
    assert w2["samples"] == 3 and w2["nvlink_tx_kib"] == d2.nvlink_tx_kib.iloc[4] - d2.nvlink_tx_kib.iloc[0]
    with pytest.raises(ValueError, match="nvlink_every"):
        clocks.Sampler([0], nvlink_every=0)


def _rounds(extra_ms: dict, clock: dict, n=9, base=1000.0, base_mhz=1600.0, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for r in range(n):
        drift = rng.normal(0, 2)
        for v in ["colocated", *extra_ms]:
            f = clock.get(v, base_mhz)
            p = base + drift + extra_ms.get(v, 0.0) + rng.normal(0, 0.2)
            rows.append(dict(variant=v, round=r, prefill_ms=p, exposed_ms=0.1 if v != "colocated" else np.nan,
                             wall_ms=p + 0.1, t0_ns=r, sm_mhz_g0=f, power_w_g0=690.0, capped_frac_g0=0.9,
                             nvlink_tx_kib_g0=1024.0 * 1e6 / 1024, sm_mhz_g1=300.0))
    return pd.DataFrame(rows)


def test_pattern_summary_sets_the_clock_beside_the_cost():
    # "peer" is 20 ms slower and its clock 2 % lower (which predicts ~20 ms); "pings" 5 ms slower, same clock
    rounds = _rounds({"peer": 20.4, "pings": 5.0}, {"peer": 1600 / 1.0204})
    s = pattern_report.pattern_summary(rounds).set_index("variant")
    assert s.loc["peer", "clock_pred_ms"] == pytest.approx(20.4, rel=0.02)
    assert s.loc["peer", "extra_lo_ms"] <= s.loc["peer", "extra_ms"] <= s.loc["peer", "extra_hi_ms"]
    assert abs(s.loc["peer", "extra_ms"] - 20.4) < 1.0
    assert s.loc["pings", "clock_pred_ms"] == 0 and s.loc["pings", "extra_ms"] == pytest.approx(5.0, abs=1.0)
    assert s.loc["colocated", "extra_ms"] == 0
    assert s.loc["peer", "nvlink_tx_gb"] == pytest.approx(1.024)
    lines = pattern_report.pattern_findings(s.reset_index(), {"context": 32768})
    assert lines[0].startswith("Colocated prefill at 32,768 tokens") and lines[1].startswith("peer: prefill +20")
    fig = pattern_report.plot_patterns(s.reset_index())
    assert len(fig.axes[0].patches) == 4
    import matplotlib.pyplot as plt

    plt.close("all")


def test_clock_timeline_figure_from_samples():
    rounds = _rounds({"peer, every layer": 10.0}, {}, n=3)
    rounds["t0_ns"] = [0, 0, 2_000_000_000, 2_000_000_000, 4_000_000_000, 4_000_000_000]
    t = np.arange(0, 5_000_000_000, 5_000_000)
    samples = pd.DataFrame({"t_ns": t, "gpu": 0, "sm_mhz": 1500.0, "power_w": 690.0, "reasons": 4,
                            "power_capped": True, "nvlink_tx_kib": 0.0, "nvlink_rx_kib": 0.0})
    timeline = pd.DataFrame({"layer": [0, 1], "copy_start_ms": [10.0, 500.0], "copy_end_ms": [10.2, 500.2],
                             "prefill_ms": 1000.0})
    fig = pattern_report.plot_clock_timeline(samples, rounds, timeline, gpu=0)
    ticks, clock, power = fig.axes
    assert len(ticks.collections[0].get_segments()) == 2  # one tick per copy
    assert clock.get_ylabel() == "SM clock (MHz)" and power.get_ylabel() == "power (W)"
    assert len(power.lines) == 2  # one step line per variant
    import matplotlib.pyplot as plt

    plt.close("all")


def test_send_patterns_refuses_a_cpu(tiny):
    with pytest.raises(ValueError, match="needs a CUDA prefill device"):
        patterns.send_patterns(tiny, 16, device="cpu")
    with pytest.raises(ValueError, match="unknown send pattern"):
        patterns.send_patterns(tiny, 16, variants=["peer, carrier pigeon"], device="cpu")


@pytest.mark.parametrize("call, says", [
    (lambda: exposure.held_exposure([1.0, 1.0], [0.5, 0.5], 1.5), "release=1.5: expected a layer index"),
    (lambda: exposure.deadline_release([1.0, 1.0], [0.5, 0.5], margin=float("inf")), "margin=inf"),
])
def test_the_schedule_helpers_name_a_bad_argument(call, says):
    """Found in an audit: release=1.5 raised a raw TypeError, and margin=inf blamed the transfer times."""
    with pytest.raises(ValueError, match=says):
        call()


def test_a_numpy_margin_is_a_number():
    import numpy as np

    assert exposure.deadline_release([1.0, 1.0], [0.5, 0.5], margin=np.float32(2)) == \
        exposure.deadline_release([1.0, 1.0], [0.5, 0.5], margin=2.0)
