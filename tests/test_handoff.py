"""The handoff path on the CPU: contiguous buffer, transports, hooks, decode check, bad input."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

from kvlab import steps
from kvlab.hooks import LayerHooks
from kvlab.kvcache import KVBuffer, KVLayout, layout_for
from kvlab.studies.handoff import analysis, charts, experiment
from kvlab.transfer import Destination, Transport


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      intermediate_size=128, vocab_size=256, num_hidden_layers=3, max_position_embeddings=512,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


def test_layout_bytes():
    lay = KVLayout(layers=28, batch=1, kv_heads=4, tokens=32768, head_dim=128)
    assert lay.bytes_per_layer == 2 * 4 * 32768 * 128 * 2
    assert lay.nbytes == 57344 * 32768 == 1792 * 2**20


def test_layout_rejects_bad_values():
    with pytest.raises(ValueError, match="tokens"):
        KVLayout(layers=2, batch=1, kv_heads=2, tokens=0, head_dim=16)
    with pytest.raises(ValueError, match="unknown KV dtype"):
        KVLayout(layers=2, batch=1, kv_heads=2, tokens=4, head_dim=16, dtype="fp7")


def test_prefill_writes_into_buffer_and_matches_plain_cache(tiny):
    ids = steps.make_prompt(256, 24, "cpu")
    buf = KVBuffer(layout_for(tiny, 24, dtype=torch.float32)).poison()
    logits = steps.prefill(tiny, ids, buf)
    assert buf.count_poison() == 0
    with torch.inference_mode():
        out = tiny(input_ids=ids, use_cache=True, logits_to_keep=1)
    ref = out.past_key_values if hasattr(out, "past_key_values") else out.cache
    for i in range(3):
        k, v = buf.layer(i)
        assert torch.equal(k, ref.layers[i].keys) and torch.equal(v, ref.layers[i].values)
    assert torch.equal(logits, out.logits[:, -1])


def test_prefill_rejects_wrong_length(tiny):
    ids = steps.make_prompt(256, 10, "cpu")
    buf = KVBuffer(layout_for(tiny, 12, dtype=torch.float32))
    with pytest.raises(ValueError, match="does not fit the KV buffer"):
        steps.prefill(tiny, ids, buf)


@pytest.mark.parametrize("granularity", ["buffer", "layer", "tensor"])
@pytest.mark.parametrize("dest", ["same-gpu", "pageable"])
def test_bulk_and_layerwise_decode_identically(tiny, granularity, dest):
    ids = steps.make_prompt(256, 20, "cpu", seed=1)
    lay = layout_for(tiny, 20, dtype=torch.float32)
    src = KVBuffer(lay).poison()
    first = steps.prefill(tiny, ids, src).argmax(-1)
    ref_t, ref_l = steps.decode(tiny, src, first, 6)

    t = Transport(lay, dest, "cpu", granularity=granularity)
    t.poison()
    got = t.receive(t.send(src), "cpu")
    toks, lg = steps.decode(tiny, got, first, 6)
    assert steps.correctness_check(ref_t, ref_l, toks, lg, got.count_poison()) == {
        "tokens_match": True, "logits_equal": True, "logits_max_abs_diff": 0.0, "poison_left": 0}

    t.poison()
    src.poison()
    for point in ("cache", "attention"):
        t.poison()
        src.poison()
        sender = t.layerwise(src)
        with LayerHooks(tiny, sender.on_layer, ranges=True, point=point) as hooks:
            sender.begin()
            steps.prefill(tiny, ids, src, hooks)
            landing = sender.finish()
        assert hooks.calls == 3 and hooks.host_ns > 0
        assert landing.all_landed()
        got = t.receive(landing, "cpu")
        toks, lg = steps.decode(tiny, got, first, 6)
        assert torch.equal(toks, ref_t) and torch.equal(lg, ref_l), point


def test_cache_point_signals_after_the_layer_is_written_and_installs_no_module_hooks(tiny):
    lay = layout_for(tiny, 16, dtype=torch.float32)
    src = KVBuffer(lay).poison()
    ids = steps.make_prompt(256, 16, "cpu")
    seen = []

    def on_kv_ready(i):  # at the signal, layer i is written and layer i+1 is not yet
        k, v = src.layer(i)
        later = src.layer(i + 1)[0] if i + 1 < lay.layers else None
        seen.append((i, bool(torch.isnan(k).any() or torch.isnan(v).any()),
                     None if later is None else bool(torch.isnan(later).all())))

    hooks = LayerHooks(tiny, on_kv_ready, ranges=False)
    with hooks:
        assert not any(m._forward_hooks or m._forward_pre_hooks for m in tiny.modules())
        steps.prefill(tiny, ids, src, hooks)
    assert seen == [(0, False, True), (1, False, True), (2, False, None)]
    steps.prefill(tiny, ids, src, hooks)  # not installed: no signal
    assert len(seen) == 3
    with pytest.raises(ValueError, match="hook point 'mlp'"):
        LayerHooks(tiny, on_kv_ready, point="mlp")


def test_a_cache_point_send_without_the_cache_callback_fails_loudly(tiny):
    lay = layout_for(tiny, 16, dtype=torch.float32)
    src = KVBuffer(lay)
    sender = Transport(lay, "same-gpu", "cpu").layerwise(src)
    ids = steps.make_prompt(256, 16, "cpu")
    with LayerHooks(tiny, sender.on_layer, ranges=False):
        sender.begin()
        steps.prefill(tiny, ids, src)  # hooks not passed: the arena never signals
        with pytest.raises(RuntimeError, match="saw 0 of 3 layers"):
            sender.finish()


def test_poison_shows_an_unwritten_layer(tiny):
    """A transport that skips a layer must fail the check: the poison is what makes the check able to fail."""
    ids = steps.make_prompt(256, 16, "cpu")
    lay = layout_for(tiny, 16, dtype=torch.float32)
    src = KVBuffer(lay)
    first = steps.prefill(tiny, ids, src).argmax(-1)
    ref_t, ref_l = steps.decode(tiny, src, first, 4)
    t = Transport(lay, "same-gpu", "cpu")
    t.poison()
    t.buffer.data[:2].copy_(src.data[:2])  # layer 2 never sent, by a transport that does not say so:
    t.buffer.guard = None  # with the transfer-state guard off, the poison alone must still catch it
    toks, lg = steps.decode(tiny, t.buffer, first, 4)
    check = steps.correctness_check(ref_t, ref_l, toks, lg, t.buffer.count_poison())
    assert check["poison_left"] == lay.bytes_per_layer // 4
    assert not check["logits_equal"]


def test_layerwise_finish_refuses_missing_layers(tiny):
    lay = layout_for(tiny, 8, dtype=torch.float32)
    src = KVBuffer(lay)
    sender = Transport(lay, "same-gpu", "cpu").layerwise(src)
    sender.begin()
    sender.on_layer(0)
    with pytest.raises(RuntimeError, match="saw 1 of 3 layers"):
        sender.finish()


def test_run_handoff_tidy_tables(tiny):
    cfg = experiment.HandoffConfig(contexts=[8, 16], destinations=["same-gpu", "pageable"], repeats=2, warmup=0,
                                decode_tokens=3, interleave_short=3, interleave=2, short_context=8)
    timings, checks = experiment.run_handoff(tiny, cfg, device="cpu")
    assert set(timings.columns) == {"context", "kv_bytes", "destination", "method", "measure", "repeat", "ms"}
    assert checks.tokens_match.all() and checks.logits_equal.all() and (checks.poison_left == 0).all()
    assert len(checks) == 2 * (1 + 2 * 2)
    summary = analysis.summarize(timings, ceilings={"same-device": 10.0})
    assert list(summary.context) == [8, 8, 16, 16]
    # 3 interleaved rounds at the short context, `repeats` rounds above it
    assert list(summary.rounds) == [3, 3, 2, 2]
    row = summary.iloc[0]
    assert row.copy_gbps == pytest.approx(row.kv_mib * 2**20 / (row.copy_ms / 1e3) / 1e9)
    assert row.copy_pct_ceiling == pytest.approx(100 * row.copy_gbps / 10.0)
    # every bulk copy has a plain copy of the same bytes timed beside it, in alternating order
    pairs = timings[(timings.method == "bulk") & timings.measure.isin(["copy", "copy_ref"])]
    assert (pairs.groupby(["context", "destination", "measure"]).size() == 2).all()
    ratio = 100 * (pairs[pairs.measure == "copy_ref"].set_index(["context", "destination", "repeat"]).ms
                   / pairs[pairs.measure == "copy"].set_index(["context", "destination", "repeat"]).ms)
    first = ratio.xs((8, row.destination), level=(0, 1))
    assert row.copy_pct_ref == pytest.approx(first.median())
    # 2 rounds give no interval (fewer than 3 samples): the columns are there, and empty
    assert summary.copy_pct_ref_lo.isna().all() and summary.copy_pct_ref_hi.isna().all()
    assert summary.copy_pct_ref.notna().all()
    # 3 interleaved rounds at the short context bracket its median; 2 above it give no interval
    short, long_ = summary[summary.context == 8], summary[summary.context == 16]
    assert (short.extra_ci_lo_ms <= short.layerwise_extra_ms).all() and (short.layerwise_extra_ms <= short.extra_ci_hi_ms).all()
    assert long_.extra_ci_lo_ms.isna().all()
    g = analysis.goals(summary)
    assert set(g.goal) >= {"hook host time ≤ 0.5 ms", "bulk ≥ 95 % of the link ceiling"}


def test_ab_rounds_alternate_their_order(tiny, monkeypatch):
    calls = []
    monkeypatch.setattr(experiment, "time_prefill", lambda *a: calls.append("A") or 1.0)
    monkeypatch.setattr(experiment, "time_layerwise_round",
                        lambda *a: calls.append("B") or {"wall": 1.0, "prefill": 1.0, "exposed": 0.0})
    cfg = experiment.HandoffConfig(contexts=[8], destinations=["same-gpu"], repeats=1, warmup=1, decode_tokens=2,
                                interleave_short=4, short_context=8)
    timings, _ = experiment.run_handoff(tiny, cfg, device="cpu")
    ab = "".join(calls)[-10:]  # the A/B rounds come last: 1 warm-up + 4 timed rounds
    assert ab == "ABBAABBAAB"
    assert len(timings[(timings.method == "layerwise") & (timings.measure == "wall")]) == 4


@pytest.mark.parametrize("pct,want", [(97.0, True), (90.0, False)])
def test_the_link_goal_keeps_its_yardstick_and_the_same_bytes_goal_stands_beside_it(pct, want):
    import pandas as pd

    # issue 12: the link goal is judged against the size sweep's ceiling (here 80–84 %: missed) whatever the
    # paired same-bytes copy says; that ratio is a goal of its own, beside it, with its own verdict
    rows = [_summary_row(context=32768, copy_pct_ceiling=82.0, copy_pct_ceiling_lo=80.0, copy_pct_ceiling_hi=84.0,
                         copy_pct_ref=pct, copy_pct_ref_lo=pct - 2, copy_pct_ref_hi=pct + 2), _summary_row(context=1024)]
    g = analysis.goals(pd.DataFrame(rows)).set_index("goal")
    link = g.loc["bulk ≥ 95 % of the link ceiling"]
    same = g.loc["bulk send ≥ 95 % of a plain copy_ of the same bytes"]
    assert link.met is False and link.verdict == "missed" and link.rule == "interval"
    assert same.met is want and f"{pct:.1f} %" in same.value and "alternation" in same.how
    # the 0.5 ms hook goals belong to the host-bound 1k regime: a run of long contexts only has none
    long_only = analysis.goals(pd.DataFrame([_summary_row(context=32768, copy_pct_ref=pct, copy_pct_ref_lo=pct,
                                                                copy_pct_ref_hi=pct)]))
    assert "hook host time ≤ 0.5 ms" not in set(long_only.goal) and "bulk ≥ 95 % of the link ceiling" in set(long_only.goal)
    assert "hook host time ≤ 0.5 ms" in set(g.index)
    # a summary without the copies' min–max (runs before it was kept) is judged on the point value
    old = analysis.goals(pd.DataFrame([_summary_row(context=32768, copy_pct_ceiling=96.0), _summary_row(context=1024)]))
    row = old[old.goal == "bulk ≥ 95 % of the link ceiling"].iloc[0]
    assert row.met is True and row.rule == "point"


def _summary_row(**kw):
    row = dict(context=16384, kv_mib=896.0, destination="same-gpu", ceiling_path="d2d_same", prefill_ms=500.0,
               copy_ms=0.5, copy_pct_ceiling=96.0, exposed_ms=-12.0, copy_layer_ms=0.02, hook_host_ms=0.3,
               layerwise_extra_ms=0.2, extra_ci_lo_ms=-1.0, extra_ci_hi_ms=2.0, rounds=15)
    row.update(kw)
    return row


@pytest.mark.parametrize("lo,hi,want", [(-1.0, 0.4, True), (0.6, 3.0, False), (-1.0, 2.0, None)])
def test_never_worse_than_bulk_is_decided_by_the_interval(lo, hi, want):
    import pandas as pd

    summary = pd.DataFrame([_summary_row(extra_ci_lo_ms=lo, extra_ci_hi_ms=hi), _summary_row(context=1024)])
    g = analysis.goals(summary)
    row = g[g.goal == "layer-wise never worse than bulk"].iloc[0]
    assert analysis.goal_state(row.met) is want
    lines = analysis.findings(pd.DataFrame([_summary_row(extra_ci_lo_ms=lo, extra_ci_hi_ms=hi, copy_min_ms=0.5,
                                                        copy_max_ms=0.6, copy_gbps=1.0, ceiling_gbps=2.0,
                                                        copy_pct_prefill=0.1, copy_tensor_ms=0.6,
                                                        extra_min_ms=-2, extra_max_ms=3)]), g)
    text = " ".join(lines)
    assert ("Not resolved: layer-wise never worse" in text) == (want is None)
    assert ("Not met: layer-wise never worse" in text) == (want is False)


def test_bad_requests_are_refused_before_allocating(tiny):
    with pytest.raises(ValueError, match="exceeds the model's max positions"):
        steps.check_request(tiny, [1024], ["same-gpu"], "cpu")
    with pytest.raises(ValueError, match="unknown destination 'nvme'"):
        steps.check_request(tiny, [16], ["nvme"], "cpu")
    with pytest.raises(ValueError, match="does not exist"):
        steps.check_request(tiny, [16], ["cuda:7"], "cpu")
    with pytest.raises(ValueError, match="context 0"):
        steps.check_request(tiny, [0], ["same-gpu"], "cpu")


def test_destination_parse_and_cpu_limits():
    assert Destination.parse("pageable", "cpu").kind == "pageable"
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs CUDA"):
            Destination.parse("pinned", "cpu")
    with pytest.raises(ValueError, match="granularity"):
        Transport(KVLayout(1, 1, 1, 4, 8), "same-gpu", "cpu", granularity="page")


@pytest.mark.gpu
def test_gpu_destinations_decode_identically(tiny):
    dev = torch.device("cuda")
    model = tiny.to(dev)
    try:
        cfg = experiment.HandoffConfig(contexts=[64], destinations=["same-gpu", "pinned", "pageable"], repeats=2,
                                    warmup=1, decode_tokens=5, interleave_short=2, short_context=64)
        timings, checks = experiment.run_handoff(model, cfg, device=dev)
        assert checks.tokens_match.all() and checks.logits_equal.all() and (checks.poison_left == 0).all()
        assert (timings[timings.measure != "exposed"].ms > 0).all()  # exposed is signed by design
    finally:
        tiny.to("cpu")


def test_attribution_on_cpu_is_tidy_and_explained(tiny):
    rows = experiment.attribute_extra(tiny, 8, ["same-gpu", "pageable"], rounds=3, warmup=0, device="cpu")
    # no stream memory operations on a CPU: no "signal only"
    assert set(rows.variant) == {"colocated", "layer-wise", "layer-wise, attention hooks"}
    assert len(rows) == 2 * 3 * 3 and (rows.ms > 0).all()
    summary = analysis.attribution_summary(rows)
    assert list(summary.variant) == ["layer-wise", "layer-wise, attention hooks"] * 2
    assert (summary.rounds == 3).all()
    assert (summary.extra_ci_lo_ms <= summary.extra_ms).all() and (summary.extra_ms <= summary.extra_ci_hi_ms).all()
    lines = analysis.attribution_findings(summary)
    assert len(lines) == 2 and "the real send (cpu, cache)" in lines[0] and "attention-module hooks" in lines[0]
    fig = charts.plot_attribution(summary)
    assert fig.axes[0].get_xlabel().startswith("extra prefill time")


def test_attribution_refuses_bad_input(tiny):
    with pytest.raises(ValueError, match="rounds"):
        experiment.attribute_extra(tiny, 8, ["same-gpu"], rounds=0, device="cpu")
    with pytest.raises(ValueError, match="unknown destination"):
        experiment.attribute_extra(tiny, 8, ["nvme"], device="cpu")


@settings(max_examples=60, deadline=None)
@given(layers=st.integers(1, 200), plan=st.sampled_from(["halving", "layer"]))
def test_wake_groups_cover_every_layer_once_and_end_alone(layers, plan):
    from kvlab.sends import wake_groups

    g = wake_groups(layers, plan)
    covered = [i for a, b in g for i in range(a, b + 1)]
    assert covered == list(range(layers))
    assert g[-1] == (layers - 1, layers - 1)  # the last layer always moves by itself
    if plan == "halving":
        assert len(g) <= 2 * max(1, layers).bit_length()


def test_wake_plan_is_validated():
    from kvlab.sends import wake_groups

    with pytest.raises(ValueError, match="wake plan 'sometimes'"):
        wake_groups(4, "sometimes")
    lay = KVLayout(2, 1, 1, 4, 8)
    with pytest.raises(ValueError, match="wake plan"):
        Transport(lay, "pageable", "cpu").layerwise(KVBuffer(lay), wakes="never")


@pytest.mark.gpu
def test_gpu_attribution_has_every_variant(tiny):
    dev = torch.device("cuda")
    model = tiny.to(dev)
    try:
        rows = experiment.attribute_extra(model, 64, ["same-gpu", "pageable"], rounds=2, warmup=1, device=dev)
        got = rows.groupby("destination").variant.unique().map(set).to_dict()
        assert got["same-gpu"] == {"colocated", "signal only", "layer-wise", "layer-wise, attention hooks"}
        assert got["pageable-host"] == {"colocated", "signal only", "layer-wise", "layer-wise, attention hooks",
                                        "layer-wise, per-layer wakes"}
        assert (rows.ms > 0).all()
    finally:
        tiny.to("cpu")


def test_flag_writer_validates_its_api():
    from kvlab.sends import FlagWriter

    with pytest.raises(ValueError, match="flag-write api 'nvml'"):
        FlagWriter(torch.zeros(1, dtype=torch.int32), "nvml")


@pytest.mark.gpu
def test_flag_writer_apis_write_in_stream_order():
    from kvlab.sends import FlagWriter, signal_costs

    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    for api in ("ctypes", "cuda-bindings"):
        w = FlagWriter(flag, api).bind(torch.cuda.current_stream())
        torch.cuda._sleep(1_000_000)  # the write queues behind this
        assert w(7 if api == "ctypes" else 9) == 0
        torch.cuda.synchronize()
        assert int(flag.item()) == (7 if api == "ctypes" else 9)
    costs = signal_costs(calls=200)
    assert set(costs) >= {"cuStreamWriteValue32 (ctypes)", "torch.cuda.Event.record"} and min(costs.values()) > 0


@pytest.mark.parametrize("lo,hi,exp_max,want,want_exp", [(-0.4, 0.4, -38.0, True, True),
                                                         (0.6, 3.0, 0.7, False, None),
                                                         (-0.4, 1.7, 0.9, None, False)])
def test_the_peer_goals_follow_the_interval_rule(lo, hi, exp_max, want, want_exp):
    import pandas as pd

    exp_min = -40.0 if want_exp is not False else 0.6
    row = _summary_row(context=32768, destination="peer-cuda:1", extra_ci_lo_ms=lo, extra_ci_hi_ms=hi,
                       layerwise_extra_ms=(lo + hi) / 2, exposed_ms=exp_max, exposed_ci_lo_ms=exp_min,
                       exposed_ci_hi_ms=exp_max, copy_pct_ceiling=97.9, copy_gbps=386.0, ceiling_gbps=394.0,
                       copy_ms=4.74)
    g = analysis.goals(pd.DataFrame([row])).set_index("goal")
    assert analysis.goal_state(g.loc["layer-wise TTFT extra ≤ 0.5 ms over colocated (peer)", "met"]) is want
    assert analysis.goal_state(g.loc["layer-wise exposed ≤ 0.5 ms (peer)", "met"]) is want_exp
    assert analysis.goal_state(g.loc["bulk peer send ≥ 98 % of the peer ceiling", "met"]) is False  # 97.9 %
    # a same-GPU row at 32k has none of these goals, and a peer row gets "never worse than bulk" at 1k too
    same = analysis.goals(pd.DataFrame([dict(row, destination="same-gpu")]))
    assert not same.goal.str.contains("peer").any()
    short = analysis.goals(pd.DataFrame([dict(row, context=1024)]))
    assert "layer-wise never worse than bulk" in set(short.goal)


def test_a_policy_is_checked_before_anything_runs(tiny):
    with pytest.raises(ValueError, match="cannot send to pageable-host"):
        steps.check_request(tiny, [8], ["same-gpu", "pageable"], "cpu", policy="deadline")
    with pytest.raises(ValueError, match="N must be an int in 1…3"):
        steps.check_request(tiny, [8], ["same-gpu"], "cpu", policy="batch:4")
    with pytest.raises(ValueError, match="unknown send policy 'lazy'"):
        steps.check_request(tiny, [8], ["same-gpu"], "cpu", policy="lazy")
    assert steps.check_request(tiny, [8], ["same-gpu", "pageable"], "cpu", policy="eager")
