"""Re-sharding a paged cache between prefill TP and decode TP (kvlab.paged.reshard, kvlab.paged.reshard_kernels,
kvlab.paged.reshard_bench): the plan and its refusals, bytes that agree with calculator.tp_shard_bytes, pieces that each
mover counts as it issues them, every method byte-exact against the source's head slice with the destinations
poisoned first, the Triton kernel against its torch reference, predictions, and the benchmark's CPU path.

TRITON_INTERPRET=1 is set for every test by an autouse fixture (kvlab.paged.reshard_kernels decorates its kernel lazily,
pinning the mode wanted at that moment), so the fused and staging paths run the real kernel through Triton's
interpreter, at tiny sizes.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlab import calculator, models
from kvlab.paged import reshard, reshard_bench, reshard_movers
from kvlab.ceilings_fit import Ceilings
from kvlab.paged.nixl import nixl_missing
from kvlab.paged.reshard_kernels import Geometry, HeadsConfig, copy_heads

pytest.importorskip("triton")

# NIXL's movers run wherever NIXL loads (CI installs nixl-cu13: there they must run, not skip)
NIXL_HERE = nixl_missing() is None or bool(os.environ.get("CI"))

PAIRS = [(1, 2), (2, 1), (1, 4), (2, 4), (4, 1)]
LAYOUT_PAIRS = [("nhd", "nhd"), ("nhd", "hnd"), ("hnd", "nhd"), ("hnd", "hnd")]
FIT = Path(__file__).resolve().parents[1] / "data/link_ceilings/20261201-091906-h200/fit.csv"  # committed H200 fit


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _bits(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


# ---------------------------------------------------------------------------------------------------- plan


def test_plan_gathers_feeds_and_replicates():
    gather = reshard.plan("kvlab-tiny", 2, 1)  # 2 KV heads: each prefill rank holds one
    assert [(p.src_rank, p.src_head, p.dst_head, p.heads) for p in gather.pieces[0]] == [(0, 0, 0, 1), (1, 0, 1, 1)]
    feed = reshard.plan("qwen2.5-7b", 1, 2)  # 4 KV heads: each decode rank reads 2 from the one prefill rank
    assert [[(p.src_rank, p.src_head, p.heads) for p in ps] for ps in feed.pieces] == [[(0, 0, 2)], [(0, 2, 2)]]
    rep = reshard.plan("kvlab-tiny", 1, 4)  # 2 KV heads over 4 decode ranks: each head twice
    assert rep.dst_global == ((0, 1), (0, 1), (1, 2), (1, 2)) and rep.replica == (False, True, False, True)
    assert any("replicated 2×" in n for n in rep.notes)
    skip = reshard.plan("kvlab-tiny", 4, 1)  # prefill ranks 0,1 hold head 0 and 2,3 head 1: read 0 and 2 only
    assert [p.src_rank for p in skip.pieces[0]] == [0, 2] and skip.skipped == ((1, 3),)
    eight_two = reshard.plan("llama-3.1-8b", 8, 2)  # the seed's 8 → 2: each decode rank gathers from 4
    assert [[p.src_rank for p in ps] for ps in eight_two.pieces] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_mla_reads_the_latent_once_and_skips_the_other_holders():
    pl = reshard.plan("deepseek-v3", 4, 2)
    assert [[p.src_rank for p in ps] for ps in pl.pieces] == [[0], [2]]
    assert pl.skipped == ((1, 2, 3), (0, 1, 3)) and pl.replica == (False, True)
    acc = reshard.account(pl, 1000, "bf16", "staging")
    latent = calculator.kv_cache_bytes("deepseek-v3", 1000)
    assert acc.bytes_per_decode_rank == (latent, latent) and acc.replica_bytes == (0, latent)
    assert acc.pieces_per_decode_rank == (61, 61)  # one side (the latent) per layer
    with pytest.raises(ValueError, match="MLA"):
        reshard.make_pools(pl, "decode", 16)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_qwen_valid_tp(tp):
    assert reshard.plan("qwen2.5-7b", tp, tp).decode_tp == tp


@pytest.mark.parametrize("p,d,match", [(1, 8, "decode_tp=8 does not split .* query heads"),
                                       (8, 1, "prefill_tp=8"), (3, 2, "neither divide nor multiply"),
                                       (2, 3, "neither divide nor multiply"), (0, 1, "prefill_tp"),
                                       (True, 1, "prefill_tp"), (1, 2.0, "decode_tp")])
def test_plan_refusals(p, d, match):
    with pytest.raises(ValueError, match=match) as err:
        reshard.plan("qwen2.5-7b", p, d)
    assert "\n" not in str(err.value)


def test_kv_heads_that_do_not_split_are_refused():
    cfg = dict(models.get("qwen2.5-7b").hf_config, num_attention_heads=24, num_key_value_heads=4,
               head_dim=128)
    for tp in (3, 6):  # both divide the 24 query heads, neither splits nor replicates the 4 KV heads evenly
        with pytest.raises(ValueError, match=r"KV heads \(evenly\); valid TP: \[1, 2, 4, 8, 12, 24\]"):
            reshard.plan(cfg, 1, tp)


def test_mamba_layers_need_equal_tp():
    cfg = dict(models.get("kvlab-tiny").hf_config, layer_types=["mamba", "full_attention"])
    with pytest.raises(ValueError, match="Mamba/SSM layers.*equal TP"):
        reshard.plan(cfg, 2, 1)
    with pytest.raises(ValueError, match="hybrid"):  # equal TP passes this rule; kvlab does not model hybrids
        reshard.plan(cfg, 2, 2)


# ---------------------------------------------------------------------------------------------------- accounting


@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen2.5-7b", "mistral-7b", "gemma-2-9b", "llama-2-7b",
                                  "deepseek-v3", "kvlab-tiny"])
@pytest.mark.parametrize("tokens", [1, 1000, 32768])
def test_bytes_agree_with_the_calculator(name, tokens):
    spec = models.get(name)
    valid = [t for t in (1, 2, 4, 8, 16, 32) if spec.heads % t == 0
             and (spec.attention == "mla" or max(t, spec.kv_heads) % min(t, spec.kv_heads) == 0)]
    for p in valid:
        for d in valid:
            if max(p, d) % min(p, d):
                continue
            acc = reshard.account(reshard.plan(name, p, d), tokens, "bf16")
            shard = calculator.tp_shard_bytes(name, tokens, d)
            assert acc.bytes_per_decode_rank == (shard.bytes_per_gpu,) * d, (p, d)
            assert sum(acc.bytes_per_decode_rank) == shard.total_bytes
            assert sum(acc.replica_bytes) == shard.total_bytes - shard.unique_bytes


def test_pieces_per_method():
    pl = reshard.plan("qwen2.5-7b", 1, 2)
    blocks = 2048  # 32k tokens in blocks of 16
    n = {m: reshard.account(pl, 32768, method=m, src_layout=lay).pieces_per_decode_rank
         for m, lay in [("fused", "hnd"), ("torch-index", "nhd"), ("staging", "hnd")]}
    assert n == {"fused": (1, 1), "torch-index": (1, 1), "staging": (56, 56)}  # staging: one send per layer side
    hnd = reshard.account(pl, 32768, method="block-slices", src_layout="hnd").pieces_per_decode_rank
    nhd = reshard.account(pl, 32768, method="block-slices", src_layout="nhd").pieces_per_decode_rank
    assert hnd == (56 * blocks,) * 2 and nhd == (56 * blocks * 16,) * 2  # an nhd head split: × block_size
    whole = reshard.account(reshard.plan("qwen2.5-7b", 2, 2), 32768, method="block-slices", src_layout="nhd")
    assert whole.pieces_per_decode_rank == (56 * blocks,) * 2  # no head split: a whole block is one run
    with pytest.raises(ValueError, match="cannot convert"):
        reshard.account(pl, 32768, method="block-slices", src_layout="nhd", dst_layout="hnd")
    with pytest.raises(ValueError, match="method"):
        reshard.account(pl, 32768, method="rdma")
    d = reshard.account(reshard.plan("kvlab-tiny", 1, 4), 128, "float32").as_dict()
    assert d["replica_bytes"] == [0, 32768, 0, 32768] and d["prefill_tp"] == 1 and d["decode_tp"] == 4


# ---------------------------------------------------------------------------------------------------- movers


@pytest.mark.parametrize("p,d", PAIRS)
@pytest.mark.parametrize("src_layout,dst_layout", LAYOUT_PAIRS)
def test_every_method_is_byte_exact(p, d, src_layout, dst_layout):
    pl = reshard.plan("kvlab-tiny", p, d)
    tokens = 40  # 3 blocks of 16, the last partly filled
    src = reshard.make_pools(pl, "prefill", tokens, 16, src_layout, "bf16", fill="random")
    methods = [m for m in reshard.METHODS if (m not in reshard.AS_IS or src_layout == dst_layout)
               and (not m.startswith("nixl") or NIXL_HERE)]
    for method in methods:
        dst = reshard.make_pools(pl, "decode", tokens, 16, dst_layout, "bf16")  # poisoned
        # 16 rows a program: the interpreter's cost is per program (the default, 1, runs in the kernel test)
        with reshard_movers.make_mover(method, pl, src, dst, backend="auto",
                                       config=HeadsConfig(rows_per_program=16)) as mover:
            mover.run()
            check = reshard.verify(pl, src, dst)
            assert check["ok"], (method, check)
            rep = mover.report()
            acc = reshard.account(pl, tokens, "bf16", method, 16, src_layout, dst_layout)
            assert [rep["pieces_per_decode_rank"][r] for r in range(d)] == list(acc.pieces_per_decode_rank), method
            assert [rep["block_bytes_per_decode_rank"][r] for r in range(d)] == list(acc.block_bytes_per_decode_rank)
            assert rep["backend"] == ("torch" if method in ("torch-index",) + reshard.AS_IS else "triton")
            mover.run()  # a second run counts afresh
            assert [mover.report()["pieces_per_decode_rank"][r] for r in range(d)] == list(acc.pieces_per_decode_rank)
            if method.startswith("nixl"):  # one request per piece, its descriptors the pieces it carries
                nx = rep["nixl"]
                assert nx["requests"] == sum(len(pcs) for pcs in pl.pieces)
                assert nx["descriptors"] == sum(acc.pieces_per_decode_rank) and nx["runs"] == 1


def test_a_real_cache_survives_the_reshard():
    from kvlab.kvcache import KVBuffer, KVLayout

    pl = reshard.plan("kvlab-tiny", 2, 4)
    buf = KVBuffer(KVLayout(2, 1, 2, 50, 16, torch.float32))
    buf.data.normal_(generator=torch.Generator().manual_seed(3))
    src = reshard.shard_pools(buf, pl, 16, "nhd", seed=5)
    dst = reshard.make_pools(pl, "decode", 50, 16, "hnd", "float32")
    reshard_movers.move("fused", pl, src, dst)
    for r, (pool, table) in enumerate(dst):
        lo, hi = pl.dst_global[r]
        assert torch.equal(pool.read(table).data, buf.data[:, :, :, lo:hi])


def test_only_some_decode_ranks_and_a_custom_send():
    pl = reshard.plan("kvlab-tiny", 1, 2)
    src = reshard.make_pools(pl, "prefill", 20, 16, "hnd", "float32", fill="random")
    dst = reshard.make_pools(pl, "decode", 20, 16, "nhd", "float32")
    sent = []

    def send(a, b):
        sent.append(a.shape)
        b.copy_(a)

    rep = reshard_movers.move("staging", pl, src, {1: dst[1]}, send_fn=send)
    assert rep["pieces_per_decode_rank"] == {1: 4} and len(sent) == 4  # 2 layers × K, V
    assert reshard.verify(pl, src, {1: dst[1]})["ok"]
    assert torch.isnan(dst[0][0].data).all()  # rank 0 was not asked for


def test_verify_catches_mismatch_poison_and_stray_writes():
    pl = reshard.plan("kvlab-tiny", 2, 1)
    src = reshard.make_pools(pl, "prefill", 32, 16, "nhd", "float32", fill="random")
    dst = reshard.make_pools(pl, "decode", 32, 16, "hnd", "float32")
    reshard_movers.move("fused", pl, src, dst)
    pool, table = dst[0]
    inside, outside = int(table.ids[1]), next(b for b in range(pool.num_blocks) if b not in table.ids)
    pool.data[1, 0, inside, 1, 3, 2] += 1.0
    pool.data[0, 1, inside, 0, 0, 0] = float("nan")
    pool.data[0, 0, outside, 0, 0, 0] = 0.0
    rec = reshard.verify(pl, src, dst)["ranks"][0]
    assert not rec["ok"] and rec["mismatched_elements"] == 2 and rec["poison_left"] == 1
    assert rec["written_outside"] == 1


def _bad(case):
    pl = reshard.plan("kvlab-tiny", 2, 1)
    src = reshard.make_pools(pl, "prefill", 32, 16, "nhd", "bf16", fill="random")
    dst = reshard.make_pools(pl, "decode", 32, 16, "nhd", "bf16")
    method, kw = "fused", {}
    if case == "block_size":
        dst = reshard.make_pools(pl, "decode", 32, 8, "nhd", "bf16")
    elif case == "dtype":
        dst = reshard.make_pools(pl, "decode", 32, 16, "nhd", "float32")
    elif case == "heads":
        dst = reshard.make_pools(reshard.plan("kvlab-tiny", 2, 2), "decode", 32, 16, "nhd", "bf16")[:1]
    elif case == "layout":
        dst, method = reshard.make_pools(pl, "decode", 32, 16, "hnd", "bf16"), "block-slices"
    elif case == "sources":
        src = src[:1]
    elif case == "tokens":
        dst = reshard.make_pools(pl, "decode", 48, 16, "nhd", "bf16")
    elif case == "rank":
        dst = {1: dst[0]}
    elif case == "method":
        method = "rdma"
    elif case == "backend":
        kw["backend"] = "cuda"
    return pl, src, dst, method, kw


@pytest.mark.parametrize("case", ["block_size", "dtype", "heads", "layout", "sources", "tokens", "rank", "method",
                                  "backend"])
def test_bad_input_is_refused_before_anything_is_written(case):
    pl, src, dst, method, kw = _bad(case)
    with pytest.raises(ValueError) as err:
        reshard_movers.make_mover(method, pl, src, dst, **kw)
    assert "\n" not in str(err.value)
    pools = dst.values() if isinstance(dst, dict) else dst
    assert all(torch.isnan(pool.data).all() for pool, _ in pools)


def test_a_destination_that_is_a_source_is_refused():
    pl = reshard.plan("kvlab-tiny", 1, 1)
    src = reshard.make_pools(pl, "prefill", 32, 16, "nhd", "bf16", fill="random")
    with pytest.raises(ValueError, match="also a source"):
        reshard_movers.make_mover("fused", pl, src, src)


# ---------------------------------------------------------------------------------------------------- the kernel


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), sh=st.integers(1, 4), dh=st.integers(1, 4), bs=st.sampled_from([1, 3, 4, 16]),
       hd=st.sampled_from([1, 3, 8, 16]), dtype=st.sampled_from([torch.bfloat16, torch.float32, torch.uint8]),
       sl=st.sampled_from(["nhd", "hnd"]), dl=st.sampled_from(["nhd", "hnd"]), rpp=st.sampled_from([1, 2, 8]))
def test_kernel_matches_reference(data, sh, dh, bs, hd, dtype, sl, dl, rpp):
    heads = data.draw(st.integers(1, min(sh, dh)), label="heads")
    s0 = data.draw(st.integers(0, sh - heads), label="src_head")
    d0 = data.draw(st.integers(0, dh - heads), label="dst_head")
    sg, dg = Geometry(sh, bs, hd, sl), Geometry(dh, bs, hd, dl)
    n = data.draw(st.integers(0, 6), label="rows")
    srows = torch.tensor(data.draw(st.lists(st.integers(0, 7), min_size=n, max_size=n)), dtype=torch.int64)
    drows = torch.tensor(data.draw(st.permutations(range(9)))[:n], dtype=torch.int64)
    src = torch.randint(0, 120, (8, sg.row_elems), generator=torch.Generator().manual_seed(n)).to(dtype)
    got = torch.full((9, dg.row_elems), 7, dtype=dtype)
    want = got.clone()
    cfg = HeadsConfig(rows_per_program=rpp, num_warps=1)
    assert copy_heads(src, sg, srows, s0, got, dg, drows, d0, heads, backend="triton", config=cfg) == "triton"
    copy_heads(src, sg, srows, s0, want, dg, drows, d0, heads, backend="torch")
    assert torch.equal(_bits(got), _bits(want))


@pytest.mark.parametrize("kw,match", [(dict(src_head=3), "src_head"), (dict(heads=0), "heads"),
                                      (dict(src_rows=torch.tensor([9])), "src_rows"),
                                      (dict(dst_rows=torch.tensor([0.0])), "dst_rows"),
                                      (dict(dst_geom=Geometry(2, 8, 4, "nhd")), "dst must be"),
                                      (dict(backend="cuda"), "backend")])
def test_kernel_bad_input(kw, match):
    sg, dg = Geometry(2, 4, 4, "hnd"), Geometry(2, 4, 4, "nhd")
    args = dict(src=torch.zeros(4, 32), src_geom=sg, src_rows=torch.tensor([1]), src_head=0,
                dst=torch.full((4, 32), float("nan")), dst_geom=dg, dst_rows=torch.tensor([2]), dst_head=0, heads=2)
    args.update(kw)
    backend = args.pop("backend", "auto")
    with pytest.raises(ValueError, match=match):
        copy_heads(**args, backend=backend)
    assert torch.isnan(args["dst"]).all()


def test_without_interpreter_the_torch_path_runs(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    pl = reshard.plan("kvlab-tiny", 1, 2)
    src = reshard.make_pools(pl, "prefill", 20, 16, "hnd", "float32", fill="random")
    dst = reshard.make_pools(pl, "decode", 20, 16, "nhd", "float32")
    assert reshard_movers.move("fused", pl, src, dst)["backend"] == "torch"
    assert reshard.verify(pl, src, dst)["ok"]
    with pytest.raises(ValueError, match="not available"):
        reshard_movers.move("fused", pl, src, dst, backend="triton")


# ---------------------------------------------------------------------------------------------------- predict, bench


def test_predict_uses_the_fit_and_the_calculator():
    ceil = Ceilings.from_table(pd.read_csv(FIT))
    t0, bw = ceil.fixed_us("d2d_same"), ceil.bandwidth_gbps("d2d_same")
    p = reshard.predict("qwen2.5-7b", 32768, 1, 2, "fused", "d2d_same", ceilings=ceil)
    half = calculator.kv_cache_bytes("qwen2.5-7b", 32768) // 2
    assert p["bytes_per_decode_rank"] == [half, half] and p["pieces_per_decode_rank"] == [1, 1]
    assert p["predicted_ms"] == pytest.approx(2 * (t0 / 1e3 + half / (bw * 1e9) * 1e3))
    assert p["same_tp_ms"] == pytest.approx(t0 / 1e3 + 2 * half / (bw * 1e9) * 1e3)
    assert p["pct_of_same_tp"] == pytest.approx(100 * p["same_tp_ms"] / p["predicted_ms"]) and "d2d_same" in p["model"]
    stg = reshard.predict("qwen2.5-7b", 32768, 1, 2, "staging", "d2d_same", ceilings=ceil, src_layout="nhd")
    assert stg["predicted_ms"] == pytest.approx(2 * (56 * t0 / 1e3 + 3 * half / (bw * 1e9) * 1e3 + 2 * t0 / 1e3))
    nv = reshard.predict("llama-3.1-8b", 32768, 8, 2, "fused", "nvlink-h100-measured", shared=False)
    shard = calculator.tp_shard_bytes("llama-3.1-8b", 32768, 2).bytes_per_gpu
    assert nv["predicted_ms"] == pytest.approx(4 * 18e-3 + shard / 395e9 * 1e3)
    with pytest.raises(ValueError, match="no ceiling for path"):
        reshard.predict("qwen2.5-7b", 32768, 1, 2, "fused", "nvlink", ceilings=ceil)


def test_bench_cpu_path_runs_and_verifies():
    ceil = Ceilings.from_table(pd.read_csv(FIT))
    rows = reshard_bench.bench(1, 2, "hnd", "nhd", model="kvlab-tiny", context=48, repeats=2, warmup=1,
                               device="cpu", ceilings=ceil)
    df = pd.DataFrame(rows)
    assert set(df.method) == {"torch-index", "fused", "staging", "same-tp"} and len(df) == 8
    assert df.verified.all() and (df.ms > 0).all() and df.predicted_ms.notna().all()
    assert set(df[df.method == "same-tp"].decode_tp) == {1} and set(df[df.method != "same-tp"].decode_tp) == {2}
    acc = reshard.account(reshard.plan("kvlab-tiny", 1, 2), 48, "bf16", "staging", 16, "hnd", "nhd")
    stg = df[df.method == "staging"].iloc[0]
    assert stg.bytes == sum(acc.block_bytes_per_decode_rank) and stg.pieces == sum(acc.pieces_per_decode_rank)
    assert set(df.pool_layout) == {"hnd->nhd", "hnd"}
    for col in ("prefill_tp", "decode_tp", "pool_layout", "method", "context", "ms", "bytes", "pieces"):
        assert col in df.columns
    with pytest.raises(ValueError, match="host copies"):
        reshard_bench.bench(1, 2, methods=["block-slices"], context=32768, device="cpu")


@pytest.mark.gpu
def test_gpu_fused_and_staging_match_the_reference(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    pl = reshard.plan("qwen2.5-7b", 1, 2)
    src = reshard.make_pools(pl, "prefill", 1000, 16, "nhd", "bf16", device="cuda", fill="random")
    for method in ("fused", "staging"):
        dst = reshard.make_pools(pl, "decode", 1000, 16, "hnd", "bf16", device="cuda")
        assert reshard_movers.move(method, pl, src, dst)["backend"] == "triton"
        torch.cuda.synchronize()
        assert reshard.verify(pl, src, dst)["ok"]
    rows = reshard_bench.bench(1, 2, "hnd", context=1024, repeats=3, warmup=1)
    assert all(r["verified"] for r in rows)


def test_table_rows_are_layer_major():
    pl = reshard.plan("kvlab-tiny", 1, 1)
    (pool, table), = reshard.make_pools(pl, "prefill", 32, 16)
    rows = reshard.table_rows(pool, table).numpy()
    n = pool.num_blocks
    want = np.concatenate([(ls * n) + table.ids for ls in range(4)])
    assert np.array_equal(rows, want)


def test_an_fp8_pool_is_resharded_by_the_torch_reference_byte_exact():
    # torch has no float8 index_copy_: the reference moves FP8 heads as their bytes (issue 29)
    from kvlab.paged.reshard_kernels import Geometry, copy_heads_reference

    src_g, dst_g = Geometry(4, 4, 8, "nhd"), Geometry(2, 4, 8, "hnd")
    src = torch.randn(6, src_g.heads * 4 * 8).to(torch.float8_e4m3fn)
    dst = torch.full((5, dst_g.heads * 4 * 8), float("nan")).to(torch.float8_e4m3fn)
    copy_heads_reference(src, src_g, torch.tensor([4, 1]), 2, dst, dst_g, torch.tensor([0, 3]), 0, 2)
    got = dst_g.canonical(dst).view(torch.uint8)
    want = src_g.canonical(src).view(torch.uint8)
    assert torch.equal(got[[0, 3]], want[[4, 1], 2:4])
    assert torch.isnan(dst_g.canonical(dst)[[1, 2, 4]].float()).all()  # rows outside keep their poison


def test_make_pools_takes_fp8_by_name_and_moves_it_byte_exact():
    """'fp8' names e4m3 (kvlab.kvcache.as_dtype), as a torch dtype would; a re-shard of FP8 pools by torch indexing
    lands every shard's bytes (the poison check reads FP8 NaN too)."""
    pl = reshard.plan("kvlab-tiny", 1, 2)
    src = reshard.make_pools(pl, "prefill", 40, 16, "nhd", "fp8", fill="random")
    assert src[0][0].spec.dtype == torch.float8_e4m3fn
    dst = reshard.make_pools(pl, "decode", 40, 16, "hnd", "fp8")
    reshard_movers.make_mover("torch-index", pl, src, dst, backend="auto").run()
    check = reshard.verify(pl, src, dst)
    assert check["ok"], check
