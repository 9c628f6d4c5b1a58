"""FP8 on the wire between two processes (`kvlab disagg --wire-dtype fp8`, issue 29): the codec's bytes and
bits, issue 29's CPU contract over gloo, a fault campaign through the lossy wire, and the refusals."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

from conftest import cpu_env as _env
from conftest import kvlab_command
from kvlab import calculator, models
from kvlab.disagg.endpoints import Sink, Source
from kvlab.disagg.wire_codec import WireCodec
from kvlab.kvcache import KVBuffer, KVLayout
from kvlab.paged.wire import dequantize_layer, quantize_layer


def _buffer(layers=2, heads=2, tokens=24, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    buf = KVBuffer(KVLayout(layers, 1, heads, tokens, dim, torch.bfloat16))
    buf.data.copy_((torch.randn(buf.data.shape, generator=g) * 4).to(torch.bfloat16))
    return buf


@pytest.mark.parametrize("mode, scales", [("per-token-head", 2 * 24 * 2), ("per-head", 2 * 2), ("per-tensor", 2)])
def test_a_layer_crosses_as_one_byte_an_element_and_four_a_scale_and_comes_back_by_the_rule(mode, scales):
    buf = _buffer()
    codec = WireCodec(mode)
    x = buf.data[1]
    wire = codec.encode(x)
    assert wire.dtype == torch.uint8 and wire.numel() == codec.layer_bytes(x) == x.numel() + 4 * scales
    out = torch.empty_like(x)
    codec.decode(wire, out)
    # the rule by hand, for per-tensor: one scale per side = amax / 448 over the whole side
    if mode == "per-tensor":
        c = x[:, 0].permute(0, 2, 1, 3).float()                      # [2, T, H, D]
        scale = (c.abs().amax(dim=(1, 2, 3)) / 448).view(2, 1, 1)
        want = dequantize_layer(quantize_layer(c, scale), scale)
        assert torch.equal(out[:, 0].permute(0, 2, 1, 3), want)
    err = ((out.float() - x.float()).abs() / x.float().abs().clamp_min(1e-3)).max()
    assert 0 < float(err) < 0.07  # e4m3 keeps 3 mantissa bits: at most half an ulp of 2^-3, relative
    flipped = wire.clone()
    flipped[0] ^= 0xFF  # a corrupt byte on the wire changes what lands, so a checksum of what decode reads sees it
    again = torch.empty_like(x)
    codec.decode(flipped, again)
    assert not torch.equal(again, out)


def test_a_unit_of_layers_travels_as_its_payloads_then_its_scales_and_lands_as_its_layers_do_one_by_one():
    """A bulk unit is one packet (every layer's e4m3 bytes, then every layer's scales: one kernel launch each way);
    it is as long as its layers' bytes, and decodes to what the same layers sent one by one decode to."""
    buf = _buffer(layers=3)
    codec = WireCodec("per-token-head")
    bulk = codec.encode_layers(buf.data, (0, 1, 2))
    ones = [codec.encode(buf.data[i]) for i in range(3)]
    n = buf.data[0].numel()
    assert bulk.numel() == sum(w.numel() for w in ones) == codec.offsets(buf.data)[-1]
    assert torch.equal(bulk[:3 * n], torch.cat([w[:n] for w in ones]))
    assert torch.equal(bulk[3 * n:], torch.cat([w[n:] for w in ones]))
    a, b = KVBuffer(buf.layout), KVBuffer(buf.layout)
    codec.decode_layers(bulk, a.data, (0, 1, 2))
    for i, w in enumerate(ones):
        codec.decode_layers(w, b.data, (i,))
    assert torch.equal(a.data, b.data)
    with pytest.raises(ValueError, match="a unit is a run of consecutive layers"):
        codec.encode_layers(buf.data, (0, 2))


def test_source_and_sink_move_the_wire_bytes_and_land_what_the_round_trip_gives():
    buf = _buffer(layers=3)
    codec = WireCodec("per-token-head")
    src = Source(buffer=buf, wire=codec)
    sink = Sink(buffer=KVBuffer(buf.layout), wire=codec)
    sink.poison()
    unit = (0, 1, 2)
    assert src.nbytes(unit) == src.view(unit).numel() == sum(codec.layer_bytes(buf.data[i]) for i in unit)
    landing = sink.landing_view(unit)
    landing.copy_(src.view(unit))
    sink.settle(unit, landing)
    ref = buf.data.clone()
    codec.roundtrip(ref)
    assert torch.equal(sink.buffer.data, ref) and sink.buffer.count_poison() == 0
    assert torch.equal(src.truth((1,)), ref[1])
    with pytest.raises(ValueError, match="contiguous"):
        Sink(pool=object(), wire=codec)


def test_a_layer_wise_unit_lands_in_its_own_span_and_a_poisoned_staging_cannot_pass_for_it():
    """Layer 1 alone: its wire bytes land in layer 1's span of the staging tensor and settle into layer 1 only. A
    second request whose layer 1 is never written dequantizes the poisoned staging (NaN), not the first request's
    identical bytes, so the cache it would read is not the reference."""
    buf = _buffer(layers=3)
    codec = WireCodec("per-head")
    src, sink = Source(buffer=buf, wire=codec), Sink(buffer=KVBuffer(buf.layout), wire=codec)
    ref = buf.data.clone()
    codec.roundtrip(ref)
    for first in (True, False):
        sink.poison()
        if first:
            a, b = src.wire_span((1,))
            landing = sink.landing_view((1,))
            assert landing.numel() == b - a == codec.layer_bytes(buf.data[1])
            landing.copy_(src.view((1,)))
        sink.settle((1,), sink.landing_view((1,)))  # the second time: a "landed" unit nobody wrote
        if first:
            assert torch.equal(sink.buffer.data[1], ref[1]) and int(sink.buffer.count_poison()) > 0  # 0 and 2 unsent
        else:
            assert torch.isnan(sink.buffer.data[1].float()).all()


@pytest.fixture(scope="module")
def contract_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("wire") / "run"
    done = kvlab_command(["disagg", "--backend", "gloo", "--model", "kvlab-tiny", "--context", "128", "--wire-dtype",
                          "fp8", "--wire-scales", "per-head", "--out", str(out)], _env(out.parent))
    return done, out


def test_issue_29s_cpu_contract(contract_run):
    done, out = contract_run
    assert done.returncode == 0, done.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    bf16 = calculator.kv_cache_bytes(models.get("kvlab-tiny"), 128, "bf16")  # what the bf16 run moves
    assert s["wire_dtype"] == "fp8" and s["wire_scales"] == "per-head" and s["bf16_bytes"] == bf16
    # a hand count: per layer one byte an element, and per-head scales: 4 bytes for each of 2 sides × KV heads
    spec = models.get("kvlab-tiny")
    hand = spec.layers * (2 * 128 * spec.kv_heads * spec.head_dim + 4 * 2 * spec.kv_heads)
    assert s["bytes_moved"] == hand <= 0.53 * bf16 and s["wire_bytes_ratio"] == hand / bf16
    assert 0 < s["kv_max_rel_err"] < 0.07 and "token_agreement" in s
    assert s["tokens_match"] and s["logits_equal"] and s["bytes_equal"] and s["poison_left"] == 0
    assert "quantize → dequantize" in s["rule"] and "FP8 wire, per-head scales" in done.stdout
    rows = pd.read_csv(out / "requests.csv")
    moved = rows[rows["mode"] != "colocated"]
    assert set(moved["mode"]) == {"bulk", "layerwise"} and (moved["bytes_moved"] == s["bytes_moved"]).all()


def test_a_fault_campaign_through_an_fp8_wire_decodes_nothing_partial_and_recovers(tmp_path):
    out = tmp_path / "run"
    done = kvlab_command(["disagg", "--backend", "gloo", "--model", "kvlab-tiny", "--context", "128", "--wire-dtype",
                          "fp8", "--mode", "layerwise", "--repeats", "1", "--faults", "3", "--policy", "retry",
                          "--quiet", "--out", str(out)], _env(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["faults_injected"] == 3 and s["decoded_from_partial"] == 0 and s["undetected"] == 0
    assert s["recovered"] == 3  # drop, delay, corrupt: each retried and then identical to its reference
    faults = pd.read_csv(out / "faults.csv")
    assert set(faults["kind"]) == {"drop", "delay", "corrupt"}
    assert faults.loc[faults["kind"] == "corrupt", "detected_by"].iloc[0] == "checksum"


@pytest.mark.parametrize("argv, says", [
    (["--wire-dtype", "fp4"], "--wire-dtype 'fp4' is not valid; valid: bf16, fp8"),
    (["--wire-dtype", "fp8", "--wire-scales", "per-row"], "--wire-scales 'per-row' is not valid"),
    (["--wire-scales", "per-head"], "wire-scales = 'per-head' sets up an FP8 wire; add --wire-dtype fp8"),
    (["--wire-dtype", "fp8", "--layout", "paged"], "wire-dtype = 'fp8' moves a contiguous cache"),
    (["--wire-dtype", "fp8", "--kv-dtype", "fp32"], "wire-dtype = 'fp8' quantizes a bf16 cache"),
    (["--wire-dtype", "fp8", "--bench"], "with wire-dtype = 'fp8' the send quantizes too: leave out --bench"),
])
def test_bad_wire_input_is_one_line_before_anything_is_written(argv, says, tmp_path):
    done = kvlab_command(["disagg", *argv, "--out", str(tmp_path / "run")], _env(tmp_path))
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert done.returncode == 2 and len(lines) == 1 and says in lines[0], done.stderr
    assert not (tmp_path / "run").exists()


def test_an_fp8_wire_is_refused_over_nccl_and_between_two_gpus_naming_why(monkeypatch):
    from kvlab.disagg.config import DisaggConfig, _wire_ok

    with pytest.raises(ValueError, match="runs over backend gloo, ipc, nixl so far; got 'nccl'"):
        _wire_ok(DisaggConfig(backend="nccl", wire_dtype="fp8"))
    monkeypatch.setattr(DisaggConfig, "devices", lambda self: ("cuda:0", "cuda:1"))
    with pytest.raises(ValueError, match="both processes on one GPU or on CPUs so far; got cuda:0 → cuda:1"):
        _wire_ok(DisaggConfig(backend="ipc", wire_dtype="fp8"))


def _fp8_contract(out, bf16_bytes):
    s = json.loads((out / "summary.json").read_text())
    assert s["wire_dtype"] == "fp8" and s["tokens_match"] and s["logits_equal"] and s["bytes_equal"], s
    assert s["poison_left"] == 0 and s["bytes_moved"] <= 0.53 * bf16_bytes
    return s


def test_an_fp8_wire_over_nixl_writes_its_bytes_into_the_staging_and_decodes_like_its_reference(tmp_path):
    """NIXL's one-sided write of the wire bytes (a registered buffer of their own on the prefill side, the decode
    side's staging tensor registered instead of its cache), dequantized on the notification: CPU agents over UCX."""
    import os

    from kvlab.paged.nixl import nixl_missing

    if nixl_missing() is not None and not os.environ.get("CI"):
        pytest.skip(str(nixl_missing()))
    out = tmp_path / "run"
    done = kvlab_command(["disagg", "--backend", "nixl", "--model", "kvlab-tiny", "--context", "128", "--wire-dtype",
                          "fp8", "--wire-scales", "per-head", "--repeats", "2", "--quiet", "--out", str(out)],
                         _env(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    _fp8_contract(out, calculator.kv_cache_bytes(models.get("kvlab-tiny"), 128, "bf16"))
    df = pd.read_csv(out / "requests.csv")
    moved = df[df["mode"] != "colocated"]
    assert (moved[moved["mode"] == "bulk"]["descriptors"] == 1).all()  # one run of wire bytes a unit


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")
@pytest.mark.parametrize("scales", ["per-token-head", "per-head", "per-tensor"])
def test_an_fp8_wire_over_ipc_on_one_gpu_decodes_like_its_reference(scales, tmp_path):
    """Two processes on one GPU: the prefill process quantizes on its copy stream into the decode process's staging
    tensor, which dequantizes before a layer counts as landed; bulk and layer-wise."""
    from kvlab import disagg

    s = disagg.run(disagg.DisaggConfig(backend="ipc", model="kvlab-tiny", contexts=(128,), repeats=2,
                                       wire_dtype="fp8", wire_scales=scales), tmp_path / "run", progress=False)
    assert s["wire_dtype"] == "fp8" and s["wire_scales"] == scales
    assert s["tokens_match"] and s["logits_equal"] and s["bytes_equal"] and s["poison_left"] == 0
    bf16 = calculator.kv_cache_bytes(models.get("kvlab-tiny"), 128, "bf16")
    if scales != "per-token-head":  # kvlab-tiny's head_dim of 16 makes a scale a token and head cost more
        assert s["bytes_moved"] <= 0.53 * bf16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")
def test_a_fault_campaign_through_an_fp8_wire_over_ipc_decodes_nothing_partial(tmp_path):
    from kvlab import disagg

    s = disagg.run(disagg.DisaggConfig(backend="ipc", model="kvlab-tiny", contexts=(128,), repeats=1, warmup=0,
                                       modes=("layerwise",), faults=3, policy="retry", wire_dtype="fp8"),
                   tmp_path / "run", progress=False)
    assert s["faults_injected"] == 3 and s["decoded_from_partial"] == 0 and s["undetected"] == 0
    assert s["recovered"] == 3


@pytest.mark.parametrize("mode", ["per-token-head", "per-head", "per-tensor"])
def test_the_codecs_kernels_give_the_torch_references_bits_both_ways(mode, monkeypatch):
    """A contiguous layer through kvlab.paged.wire_kernels (Triton's interpreter here, in integer rounding; the
    GPU's casts on an H200) against the torch reference: the same wire bytes, the same bf16 back — into a view of a
    larger buffer too, as a one-sided write puts them in the decode side's staging tensor."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    pytest.importorskip("triton")
    buf = _buffer(layers=3, heads=2, tokens=24, dim=16, seed=3)
    buf.data[0, 1, 0, 1, 5] = 0  # a zero token-head among the rest
    ref, fast = WireCodec(mode, backend="torch"), WireCodec(mode, backend="triton")
    for unit in ((0, 1, 2), (1,), (1, 2)):  # a bulk unit, one layer past the first, a run of two
        want = ref.encode_layers(buf.data, unit)
        staging = torch.full((want.numel() + 8,), 0xAB, dtype=torch.uint8)
        fast.encode_layers_into(buf.data, unit, staging[4:4 + want.numel()])
        assert torch.equal(staging[4:4 + want.numel()], want), unit
        assert (staging[:4] == 0xAB).all() and (staging[-4:] == 0xAB).all()
        a, b = KVBuffer(buf.layout), KVBuffer(buf.layout)
        a.poison(), b.poison()
        ref.decode_layers(want, a.data, unit)
        fast.decode_layers(staging[4:4 + want.numel()], b.data, unit)  # from a view at an offset, as it lands
        assert torch.equal(a.data.view(torch.int16), b.data.view(torch.int16)), unit
