"""The FP8 wire (kvlab.paged.wire, kvlab.paged.wire_kernels): its byte count, the Triton kernels against the torch references
bit for bit on CPU through Triton's interpreter, the rounding on every bf16 input and every e4m3 pattern, the
error metrics, the break-even arithmetic, the CPU path of the benchmark, and FP8 pools (kvlab.paged).

TRITON_INTERPRET=1 is set for every test by an autouse fixture (kvlab.paged.wire_kernels builds its kernels lazily
and pins the mode while decorating, as kvlab.paged.kernels does). Pools are tiny: the interpreter runs each program
in Python.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvlab.paged import kernels, wire
from kvlab.paged import wire_kernels as wk
from kvlab.kvcache import KVBuffer, KVLayout
from kvlab.paged import BlockPool, BlockTable, PoolSpec, verify_transfer

triton = pytest.importorskip("triton")

MODES = wire.SCALE_MODES


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _pool(layout="nhd", layers=2, block_size=4, heads=2, dim=8, blocks=6, seed=0, dtype=torch.bfloat16):
    return BlockPool(PoolSpec(layers, block_size, heads, dim, dtype, layout), blocks).fill_random(seed)


def _static(pool, mode, table):
    return None if mode == "per-token-head" else wire.calibrate_scales(pool, mode, table)


def _bits(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _same_packet(a, b):
    return torch.equal(a.payload, b.payload) and torch.equal(_bits(a.scales), _bits(b.scales))


# ---------------------------------------------------------------------------------------------------
# bytes


def test_qwen_7b_shape_with_per_token_head_scales_is_under_053_of_bf16():
    qwen = (28, 4, 128)
    assert wire.raw_bytes(qwen, 1) == 57_344                      # bf16 bytes per token
    per_token = wire.wire_bytes(qwen, 1, "per-token-head")
    assert per_token == 28 * 2 * 4 * 128 + 28 * 2 * 4 * 4 == 29_568
    for tokens in (1, 1024, 32768):
        assert wire.wire_bytes(qwen, tokens, "per-token-head") == tokens * 29_568
        assert wire.wire_bytes(qwen, tokens, "per-token-head") <= 0.53 * wire.raw_bytes(qwen, tokens)
    assert wire.wire_bytes(qwen, 32768, "per-head") == 32768 * 28_672 + 28 * 2 * 4 * 4
    assert wire.wire_bytes(qwen, 32768, "per-tensor") == 32768 * 28_672 + 28 * 2 * 4


def test_kvlab_tiny_pays_for_per_token_head_scales():
    tiny = (2, 2, 16)   # kvlab-tiny: 2 layers, 2 KV heads, head_dim 16
    bf16 = wire.raw_bytes(tiny, 128)
    assert wire.wire_bytes(tiny, 128, "per-token-head") == 2 * 2 * 128 * 2 * (16 + 4)
    assert wire.wire_bytes(tiny, 128, "per-token-head") / bf16 == 0.625   # > 0.53: 4 B of scale per 16 B
    assert wire.wire_bytes(tiny, 128, "per-head") / bf16 <= 0.53
    assert wire.wire_bytes(tiny, 128, "per-tensor") / bf16 <= 0.53


def test_pool_spec_counts_whole_blocks_and_layer_shares():
    spec = PoolSpec(3, 16, 2, 8)
    assert wire.wire_bytes(spec, 17, "per-token-head") == 3 * 2 * 32 * 2 * (8 + 4)
    assert wire.raw_bytes(spec, 17) == spec.payload_bytes(17)
    assert wire.wire_bytes(spec, 17, "per-head", layers=1) == 2 * 32 * 2 * 8 + 2 * 2 * 4
    assert wire.wire_bytes(spec, 17, "per-tensor", layers=(1, 3)) == 2 * (2 * 32 * 2 * 8 + 2 * 4)


@pytest.mark.parametrize("mode", MODES)
def test_packet_bytes_equal_the_count(mode):
    pool = _pool(block_size=4)
    table = BlockTable([5, 0, 2], 9, 4)
    pk = wire.quantize_gather_reference(pool, table, mode, _static(pool, mode, table))
    assert pk.nbytes == wire.wire_bytes(pool.spec, 9, mode)
    assert pk.e4m3.dtype == torch.float8_e4m3fn and pk.e4m3.shape == (2, 2, 12, 2, 8)


# ---------------------------------------------------------------------------------------------------
# kernels against the references


SHAPES = [dict(block_size=4, heads=2, dim=8), dict(block_size=5, heads=3, dim=12)]  # powers of two, and not


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
@pytest.mark.parametrize("shape", SHAPES)
def test_quantize_gather_is_bit_exact(mode, layout, shape):
    pool = _pool(layout, blocks=7, seed=3, **shape)
    table = BlockTable([6, 1, 3], 2 * shape["block_size"] + 1, shape["block_size"])
    st = _static(pool, mode, table)
    want = wire.quantize_gather_reference(pool, table, mode, st)
    got = wk.quantize_gather(pool, table, mode, st, backend="triton", config=wk.WireConfig(pairs=4, num_warps=1))
    assert _same_packet(got, want)
    assert int((want.payload & 0x7F == 0x7F).sum()) == 0   # random finite data: no NaN on the wire


@pytest.mark.parametrize("mode", MODES)
def test_quantize_a_layer_range_into_a_given_packet(mode):
    pool = _pool("hnd", layers=3, seed=5)
    table = BlockTable([2, 4], 7, 4)
    st = _static(pool, mode, table)
    out = wire.empty_packet(pool.spec, table, mode, layers=(1, 3))
    out.payload.fill_(0xAB)
    got = wk.quantize_gather(pool, table, mode, st, out=out, layers=(1, 3), backend="triton")
    assert got is out and out.first_layer == 1 and out.layers == 2
    full = wire.quantize_gather_reference(pool, table, mode, st)
    assert torch.equal(out.payload, full.payload[1:3]) and torch.equal(_bits(out.scales), _bits(full.scales[1:3]))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("src_layout,dst_layout", [("nhd", "nhd"), ("nhd", "hnd"), ("hnd", "nhd"), ("hnd", "hnd")])
def test_dequantize_scatter_is_bit_exact_and_converts_layouts(mode, src_layout, dst_layout):
    src = _pool(src_layout, blocks=5, seed=7, block_size=5, heads=3, dim=12)
    table = BlockTable([4, 0], 7, 5)
    pk = wire.quantize_gather_reference(src, table, mode, _static(src, mode, table))
    spec = PoolSpec(2, 5, 3, 12, torch.bfloat16, dst_layout)
    want, got = BlockPool(spec, 6).poison(), BlockPool(spec, 6).poison()
    dst = BlockTable([3, 1], 7, 5)
    wire.dequantize_scatter_reference(pk, want, dst)
    wk.dequantize_scatter(pk, got, dst, backend="triton", config=wk.WireConfig(pairs=8, num_warps=2))
    assert torch.equal(_bits(got.data), _bits(want.data))
    assert torch.isnan(got.data[:, :, [0, 2, 4, 5]]).all()            # blocks outside the table keep their poison
    # the same cache whatever the layouts: read back as contiguous KV
    ref = src.read(table).data.float()
    back = got.read(dst).data.float()
    assert (back - ref).abs().max() <= ref.abs().max() / 8


def test_round_trip_through_the_kernels_reads_like_the_reference_cache():
    src = _pool("nhd", seed=11)
    table = BlockTable([1, 5, 2], 12, 4)
    pk = wk.quantize_gather(src, table, "per-token-head", backend="triton")
    dst = BlockPool(PoolSpec(2, 4, 2, 8, torch.bfloat16, "hnd"), 3).poison()
    wk.dequantize_scatter(pk, dst, BlockTable.packed(12, 4), backend="triton")
    ref = BlockPool(PoolSpec(2, 4, 2, 8, torch.bfloat16, "hnd"), 3).poison()
    wire.dequantize_scatter_reference(wire.quantize_gather_reference(src, table, "per-token-head"), ref, [0, 1, 2])
    assert verify_transfer(ref, BlockTable.packed(12, 4), dst)["ok"]


# ---------------------------------------------------------------------------------------------------
# rounding on every input


def _every_bf16(scale_layout="nhd"):
    """A 1-layer pool holding all 65,536 bf16 bit patterns (NaN and ±inf included) in 32 blocks of 16 × 4 × 16."""
    pool = BlockPool(PoolSpec(1, 16, 4, 16, torch.bfloat16, scale_layout), 32)
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    pool.data.view(torch.int16).copy_(every.view(pool.data.shape))
    return pool


@pytest.mark.parametrize("scale", [1.0, 0.7, 2.0 ** -12, 3.0e5])
def test_every_bf16_input_quantizes_like_torch(scale):
    # per-tensor with a given scale: every bf16 value (ties, subnormals, saturation, ±inf, NaN) through both roundings
    pool = _every_bf16()
    table = BlockTable.packed(512, 16)
    st = torch.full((1, 2), scale)
    want = wire.quantize_gather_reference(pool, table, "per-tensor", st)
    got = wk.quantize_gather(pool, table, "per-tensor", st, backend="triton")
    assert torch.equal(got.payload, want.payload)
    q = want.payload.flatten()
    assert int((q == wire.E4M3_NAN).sum()) == 254        # the NaN inputs (127 patterns a sign) only
    assert int((q == 0xFF).sum()) == 0                    # the canonical NaN carries no sign


def test_every_bf16_input_gets_a_token_head_scale_like_torch():
    pool = _every_bf16("hnd")
    table = BlockTable.packed(512, 16)
    want = wire.quantize_gather_reference(pool, table, "per-token-head")
    got = wk.quantize_gather(pool, table, "per-token-head", backend="triton")
    assert _same_packet(got, want)


def test_every_e4m3_pattern_dequantizes_like_torch():
    # all 256 patterns against scales that push products into bf16 subnormals, ties and overflow
    g = torch.Generator().manual_seed(0)
    slots, heads, dim = 8, 4, 64
    payload = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(2 * slots * heads * dim // 256)
    payload = payload.view(1, 2, slots, heads, dim).contiguous()
    scales = torch.exp2(torch.randint(-140, 120, (1, 2, slots, heads), generator=g).float()) * \
        (1 + torch.rand((1, 2, slots, heads), generator=g))
    scales[0, 0, 0] = torch.tensor([1.0, 2.0 ** -133, 3.0e38, 1.0 + 2.0 ** -8])
    pk = wire.WirePacket(payload, scales, "per-token-head", 8, 4)
    spec = PoolSpec(1, 4, heads, dim, torch.bfloat16, "nhd")
    want, got = BlockPool(spec, 2).poison(), BlockPool(spec, 2).poison()
    wire.dequantize_scatter_reference(pk, want, [0, 1])
    wk.dequantize_scatter(pk, got, BlockTable.packed(8, 4), backend="triton")
    assert torch.equal(_bits(got.data), _bits(want.data))
    assert torch.isinf(want.data).any() and (want.data.view(torch.int16) & 0x7F80 == 0).any()  # overflow, subnormal


# ---------------------------------------------------------------------------------------------------
# edge cases and error


@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_a_zero_token_gets_scale_one_and_comes_back_zero(layout):
    pool = _pool(layout, seed=2)
    table = BlockTable([3, 0], 8, 4)
    pool.data[:, :, 0].zero_()                                   # block 0 (tokens 4…7 of the table) is all zeros
    for backend in ("torch", "triton"):
        pk = wk.quantize_gather(pool, table, "per-token-head", backend=backend)
        assert torch.equal(pk.scales[:, :, 4:], torch.ones_like(pk.scales[:, :, 4:]))
        assert int(pk.payload[:, :, 4:].sum()) == 0
        dst = BlockPool(pool.spec, 2).poison()
        wk.dequantize_scatter(pk, dst, BlockTable.packed(8, 4), backend=backend)
        assert torch.isfinite(dst.data).all() and (dst.data[:, :, 1] == 0).all()


def test_nan_poisons_its_token_head_and_inf_its_token_head_after_the_round_trip():
    pool = _pool("nhd", seed=4)
    table = BlockTable([1, 2], 8, 4)
    pool.data[0, 0, 1, 2, 1, 3] = float("nan")                   # layer 0 K, block 1 token 2 head 1
    pool.data[1, 1, 2, 0, 0, 0] = float("inf")                   # layer 1 V, block 2 token 0 head 0
    want = wire.quantize_gather_reference(pool, table, "per-token-head")
    got = wk.quantize_gather(pool, table, "per-token-head", backend="triton")
    assert _same_packet(got, want)
    assert torch.isnan(want.scales[0, 0, 2, 1]) and torch.isinf(want.scales[1, 1, 4, 0])
    dst_ref, dst = BlockPool(pool.spec, 2).poison(), BlockPool(pool.spec, 2).poison()
    wire.dequantize_scatter_reference(want, dst_ref, [0, 1])
    wk.dequantize_scatter(got, dst, BlockTable.packed(8, 4), backend="triton")
    assert torch.equal(_bits(dst.data), _bits(dst_ref.data))
    bad = torch.isnan(dst.data)
    assert bad[0, 0, 0, 2, 1].all() and bad[1, 1, 1, 0, 0].all() and int(bad.sum()) == 2 * 8


def test_dynamic_round_trip_error_is_within_e4m3_rounding():
    pool = _pool("nhd", seed=9, dim=16)
    pool.data.mul_(torch.logspace(-3, 2, 16).to(torch.bfloat16))  # values over five decades inside a token-head
    table = BlockTable([0, 4, 2], 12, 4)
    pk = wk.quantize_gather(pool, table, "per-token-head", backend="triton")
    dst = BlockPool(pool.spec, 3).poison()
    wk.dequantize_scatter(pk, dst, BlockTable.packed(12, 4), backend="triton")
    x = pool.read(table).data.float()
    y = dst.read(BlockTable.packed(12, 4)).data.float()
    s = pk.scales.view(2, 2, 12, 2).permute(0, 1, 3, 2)[:, :, None, :, :, None]  # → [L, 2, 1, H, T, 1]
    bound = 2.0 ** -4 * x.abs() * 1.001 + 2.0 ** -10 * s + 2.0 ** -8 * y.abs()
    assert ((y - x).abs() <= bound).all()
    rows = wire.kv_rel_err(x, y)
    assert len(rows) == 4 and all(r["norm_rel_err"] < 2.0 ** -4 for r in rows)


def test_static_scales_saturate_values_past_their_calibration():
    pool = _pool("nhd", seed=1)
    table = BlockTable([0, 1], 8, 4)
    st = wire.calibrate_scales(pool, "per-head", table)
    pool.data.mul_(10)                                           # ten times the calibration's amax
    pk = wk.quantize_gather(pool, table, "per-head", st, backend="triton")
    assert _same_packet(pk, wire.quantize_gather_reference(pool, table, "per-head", st))
    e = pk.e4m3.float()
    assert e.abs().max() == 448 and torch.isfinite(e).all()
    assert torch.equal(_bits(pk.scales), _bits(st))


def test_calibration_ignores_the_last_blocks_unused_slots_and_agrees_with_a_kv_buffer():
    pool = _pool("hnd", seed=6)
    table = BlockTable([4, 2], 5, 4)
    pool.data[:, :, 2] = 1000.0                                  # block 2 holds token 4 … 7; only token 4 counts
    buf = pool.read(table)
    for mode in ("per-head", "per-tensor"):
        a = wire.calibrate_scales(pool, mode, table)
        assert torch.equal(a, wire.calibrate_scales(buf, mode))
        assert torch.equal(a, torch.full_like(a, 1000.0 / 448))


# ---------------------------------------------------------------------------------------------------
# metrics and break-even


def test_kv_rel_err_by_hand():
    ref = torch.tensor([1.0, -2.0, 0.0, 1e-4]).view(1, 2, 2)
    deq = torch.tensor([1.5, -2.0, 1e-4, 0.0]).view(1, 2, 2)
    k, v = wire.kv_rel_err(ref, deq, eps=1e-3)
    assert (k["layer"], k["side"], v["side"]) == (0, "K", "V")
    assert k["max_rel_err"] == pytest.approx(0.5) and k["mean_rel_err"] == pytest.approx(0.25)
    assert k["norm_rel_err"] == pytest.approx(0.5 / math.sqrt(5))
    assert v["max_rel_err"] == pytest.approx(0.1) and v["mean_rel_err"] == pytest.approx(0.1)
    assert v["norm_rel_err"] == pytest.approx(math.sqrt(2))
    assert wire.kv_rel_err(ref, ref)[0]["norm_rel_err"] == 0.0


def _attention_by_hand(q, k, v):
    hq, tq, d = q.shape
    hkv, tk, _ = k.shape
    out = torch.empty(hq, tq, v.shape[-1], dtype=torch.float64)
    for h in range(hq):
        kh, vh = k[h // (hq // hkv)].double(), v[h // (hq // hkv)].double()
        for i in range(tq):
            n = tk - tq + i + 1                                 # causal: keys 0 … position
            w = torch.softmax(q[h, i].double() @ kh[:n].T / math.sqrt(d), -1)
            out[h, i] = w @ vh[:n]
    return out


def test_attn_out_rel_err_is_causal_and_gqa_aware():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(4, 3, 8, generator=g)
    k, v = torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 8, generator=g)
    kd, vd = k + 0.01 * torch.randn(k.shape, generator=g), v.clone()
    o, od = _attention_by_hand(q, k, v), _attention_by_hand(q, kd, vd)
    e = (od - o).norm(dim=-1) / o.norm(dim=-1)
    got = wire.attn_out_rel_err(q, k, v, kd, vd)
    assert got["max_rel_err"] == pytest.approx(float(e.max()), rel=1e-4)
    assert got["mean_rel_err"] == pytest.approx(float(e.mean()), rel=1e-4)
    assert got["norm_rel_err"] == pytest.approx(float((od - o).norm() / o.norm()), rel=1e-4)
    assert wire.attn_out_rel_err(q[None], k[None], v[None], k[None], v[None])["max_rel_err"] == 0.0
    # queries at positions 2, 3, 4: only the last sees the last key, so changing it leaves the others exact
    kl = k.clone()
    kl[:, -1] += 1
    e = (_attention_by_hand(q, kl, v) - o).norm(dim=-1) / o.norm(dim=-1)
    assert (e[:, :2] == 0).all() and (e[:, 2] > 0).all()
    assert wire.attn_out_rel_err(q, k, v, kl, v)["mean_rel_err"] == pytest.approx(float(e.mean()), rel=1e-4)
    with pytest.raises(ValueError):
        wire.attn_out_rel_err(torch.randn(3, 3, 8), k, v, k, v)   # 3 query heads over 2 KV heads


def test_breakeven_by_hand():
    # the rule of thumb: a 2× smaller wire breaks even when both passes run at 4× the link
    assert wire.breakeven_gbps(400, 400, 2) == pytest.approx(100)
    assert wire.breakeven_gbps(1500, 500, 2) == pytest.approx(0.5 / (1 / 1500 + 1 / 500)) == pytest.approx(187.5)
    assert wire.breakeven_gbps(1500, 500, 1.94, overlap=True) == 500
    assert wire.breakeven_gbps(math.inf, math.inf, 2) == math.inf
    assert wire.breakeven_gbps(100, 100, 1.0) == 0.0 and wire.breakeven_gbps(100, 100, 0.5, overlap=True) == 0.0
    got = wire.breakeven_gbps(np.array([400.0, 800.0]), 400, 2)
    assert np.allclose(got, [100, 0.5 / (1 / 800 + 1 / 400)])
    for bad in ((0, 1, 2), (1, -1, 2), (1, 1, math.inf), (1, float("nan"), 2)):
        with pytest.raises(ValueError):
            wire.breakeven_gbps(*bad)


# ---------------------------------------------------------------------------------------------------
# benchmark helper (CPU path)


def test_bench_wire_cpu_path_gives_tidy_rows():
    pool = _pool("nhd", blocks=4, seed=8)
    table = BlockTable([3, 1], 8, 4)
    dest = BlockPool(PoolSpec(2, 4, 2, 8, torch.bfloat16, "hnd"), 3).poison()
    rows = wk.bench_wire(pool, table, dest, repeats=2, warmup=0, scales=("per-token-head", "per-tensor"))
    assert len(rows) == 2 * (2 * 4 + 5)
    kinds = {(r["kernel"], r["direction"], r["scales"]) for r in rows}
    assert ("quantize-gather", "d2h", "per-tensor") in kinds and ("bf16-copy", "h2d", "none") in kinds
    assert all(set(r) >= {"kernel", "direction", "context", "scales", "ms", "bytes", "input_gbps"} for r in rows)
    bf16 = 2 * 2 * 2 * pool.spec.block_bytes
    for r in rows:
        assert r["context"] == 8 and r["bf16_bytes"] == bf16 and r["device"] == "cpu" and r["ms"] > 0
        assert r["input_gbps"] == pytest.approx(bf16 / r["ms"] / 1e6)
        if r["kernel"].startswith("bf16"):
            assert r["bytes"] == bf16
        else:
            assert r["bytes"] == wire.wire_bytes(pool.spec, 8, r["scales"]) and r["backend"] == "triton"
            assert r["convert"] == "int"


# ---------------------------------------------------------------------------------------------------
# FP8 pools


@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_fp8_pools_fill_write_read_and_verify(layout):
    spec = PoolSpec(2, 4, 2, 8, torch.float8_e4m3fn, layout)
    a = BlockPool(spec, 5).poison().fill_random(3)
    assert torch.isfinite(a.data.float()).all() and a.data.float().std() > 0.5
    table = BlockTable([4, 1], 6, 4)
    buf = KVBuffer(KVLayout(2, 1, 2, 6, 8, torch.float8_e4m3fn))
    buf.data.copy_(torch.randn(buf.data.shape).to(torch.float8_e4m3fn))
    a.write(buf, table)
    assert torch.equal(a.read(table).data.view(torch.uint8), buf.data.view(torch.uint8))
    b = BlockPool(spec, 5).poison()
    dst = BlockTable([0, 3], 6, 4)
    for layer in range(2):
        b.write_layer(layer, buf.data[layer, 0], buf.data[layer, 1], dst)
    assert verify_transfer(a, table, b, dst)["ok"]
    assert torch.equal(a.blocks(table).view(torch.uint8), b.blocks(dst).view(torch.uint8))
    # the Triton row copy moves FP8 rows as raw words
    c = BlockPool(spec, 5).poison()
    rows = lambda p, t: (torch.arange(4)[:, None] * p.num_blocks + t.tensor()[None, :]).reshape(-1)
    kernels.copy_rows(a.rows, rows(a, table), c.rows, rows(c, dst), backend="triton")
    assert verify_transfer(a, table, c, dst)["ok"]


# ---------------------------------------------------------------------------------------------------
# bad input


def test_without_the_interpreter_auto_runs_the_reference(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    pool = _pool()
    table = BlockTable([1, 0], 8, 4)
    assert wk.wire_backend("cpu")[0] == "torch"
    assert _same_packet(wk.quantize_gather(pool, table, "per-token-head"),
                        wire.quantize_gather_reference(pool, table, "per-token-head"))
    with pytest.raises(ValueError, match="not available"):
        wk.quantize_gather(pool, table, "per-token-head", backend="triton")


def _bad_quantize(case, pool, table, out):
    st = torch.ones(2, 2, 2)
    kw = {}
    mode = "per-head"
    if case == "mode":
        mode = "per-block"
    elif case == "missing_static":
        st = None
    elif case == "static_for_dynamic":
        mode = "per-token-head"
    elif case == "static_shape":
        st = torch.ones(2, 2)
    elif case == "static_zero":
        st = torch.zeros(2, 2, 2)
    elif case == "static_nan":
        st = torch.full((2, 2, 2), float("nan"))
    elif case == "fp16_pool":
        pool = BlockPool(PoolSpec(2, 4, 2, 8, torch.float16), 6)
    elif case == "table_range":
        table = BlockTable([1, 9], 8, 4)
    elif case == "layers":
        kw["layers"] = (1, 3)
    elif case == "out_shape":
        kw["out"] = wire.empty_packet(pool.spec, BlockTable([1, 0, 2], 9, 4), "per-head")
    elif case == "out_mode":
        kw["out"] = wire.empty_packet(pool.spec, table, "per-tensor")
    elif case == "config":
        kw["config"] = {"pairs": 4}
    elif case == "hw_on_cpu":
        kw["config"] = wk.WireConfig(convert="hw")
    if case != "out_shape" and case != "out_mode":
        kw["out"] = out
    return wk.quantize_gather(pool, table, mode, st, backend="triton", **kw)


@pytest.mark.parametrize("case", ["mode", "missing_static", "static_for_dynamic", "static_shape", "static_zero",
                                  "static_nan", "fp16_pool", "table_range", "layers", "out_shape", "out_mode",
                                  "config", "hw_on_cpu"])
def test_bad_quantize_input_raises_before_writing(case):
    pool = _pool()
    table = BlockTable([1, 0], 8, 4)
    out = wire.empty_packet(pool.spec, table, "per-head")
    out.payload.fill_(0xAB)
    with pytest.raises(ValueError):
        _bad_quantize(case, pool, table, out)
    assert (out.payload == 0xAB).all()


@pytest.mark.parametrize("case", ["heads", "block_size", "blocks", "layers", "fp8_dst", "not_packet"])
def test_bad_dequantize_input_raises_before_writing(case):
    pool = _pool()
    table = BlockTable([1, 0], 8, 4)
    pk = wire.quantize_gather_reference(pool, table, "per-token-head")
    spec, dst, arg = pool.spec, BlockTable([2, 3], 8, 4), pk
    if case == "heads":
        spec = PoolSpec(2, 4, 1, 8)
    elif case == "block_size":
        spec, dst = PoolSpec(2, 8, 2, 8), BlockTable([2], 8, 8)
    elif case == "blocks":
        dst = BlockTable([2, 3, 4], 9, 4)
    elif case == "layers":
        spec = PoolSpec(1, 4, 2, 8)
    elif case == "fp8_dst":
        spec = PoolSpec(2, 4, 2, 8, torch.float8_e4m3fn)
    elif case == "not_packet":
        arg = pk.payload
    target = BlockPool(spec, 6).poison()
    with pytest.raises(ValueError):
        wk.dequantize_scatter(arg, target, dst, backend="triton")
    assert torch.isnan(target.data.float()).all()


def test_packet_and_config_validate():
    with pytest.raises(ValueError):
        wire.WirePacket(torch.zeros(1, 2, 8, 2, 4, dtype=torch.uint8), torch.zeros(1, 2, 8), "per-token-head", 8, 4)
    with pytest.raises(ValueError):
        wire.WirePacket(torch.zeros(1, 2, 8, 2, 4, dtype=torch.uint8), torch.zeros(1, 2, 2), "per-head", 3, 4)
    for kw in (dict(pairs=3), dict(num_warps=3), dict(pairs=-2), dict(convert="fast")):
        with pytest.raises(ValueError):
            wk.WireConfig(**kw)
    # the default tile is a whole block, at most 8192 elements: 64 pairs of 128 for the Qwen2.5-7B shape
    assert wk.WireConfig().resolved(16 * 4, 128) == 64 and wk.WireConfig().resolved(16 * 8, 128) == 64
    assert wk.WireConfig().resolved(15, 16) == 16 and wk.WireConfig(pairs=4).resolved(64, 128) == 4
    assert wk.WireConfig().hw_convert("cpu") is False
    for bad in (((28, 4), 1, "per-head"), ((28, 4, 128), 0, "per-head"), ((28, 4, 128), 1, "per-block")):
        with pytest.raises(ValueError):
            wire.wire_bytes(*bad)
    with pytest.raises(ValueError):
        wire.wire_bytes((28, 4, 128), 1, "per-head", layers=29)


# ---------------------------------------------------------------------------------------------------
# GPU


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_gpu_kernels_match_the_reference_to_device_and_pinned(monkeypatch, layout):
    monkeypatch.delenv("TRITON_INTERPRET")
    dev = torch.device("cuda")
    pool = BlockPool(PoolSpec(4, 16, 4, 128, torch.bfloat16, layout), 64, device=dev).fill_random(0)
    table = BlockTable(torch.randperm(64)[:40], 40 * 16 - 5, 16)
    dest = BlockPool(PoolSpec(4, 16, 4, 128, torch.bfloat16, "nhd" if layout == "hnd" else "hnd"), 48,
                     device=dev).poison()
    for convert in ("int", "hw"):                # check=True: bit-exact with the torch reference or RuntimeError
        rows = wk.bench_wire(pool, table, dest, repeats=2, warmup=1, check=True, config=wk.WireConfig(convert=convert))
        assert {(r["backend"], r["convert"]) for r in rows if "quantize" in r["kernel"]} == {("triton", convert)}
