"""kvlab.paged and the paged-transfer study (kvlab.studies.paged_transfer) on CPU: pools, tables, allocation, HF ↔ pages round trips, decode from
pages, every transport byte-exact (poison kept outside the table), bad input refused before any byte
moves, and the measurement's logic at tiny sizes.

The Triton transport runs its kernel through Triton's interpreter here: an autouse fixture sets
TRITON_INTERPRET=1 for each test (kvlab.paged.kernels builds the kernel lazily, so the variable is in place
before Triton decorates anything) and restores the environment after it.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlab import paged
from kvlab.studies.paged_transfer import bench as paged_bench
from kvlab.studies.paged_transfer import correctness, nixl_only, patterns
from kvlab.studies.paged_transfer import report as paged_report
from kvlab.paged import registry as paged_xport
from kvlab.paged import triton_transports as paged_triton
from kvlab.transfer import Destination
from kvlab.steps import decode, make_prompt, prefill
from kvlab.hooks import LayerHooks
from kvlab.kvcache import KVBuffer, KVLayout, layout_for
from kvlab.paged import BlockAllocator, BlockPool, BlockTable, PoolSpec, verify_transfer
from kvlab.paged.registry import make_transport, unavailable

CPU_DESTS = ("same-gpu", "pageable")
STREAM_METHODS = ("per-block-copy", "torch-index", "triton", "chunked-gather-d2h")


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def tiny_model():
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      intermediate_size=128, vocab_size=256, num_hidden_layers=2)
    return AutoModelForCausalLM.from_config(cfg).eval()


def _spec(layout="nhd", block_size=4, dtype=torch.bfloat16):
    return PoolSpec(layers=2, block_size=block_size, kv_heads=2, head_dim=8, dtype=dtype, layout=layout)


def _source(spec, tokens, seed=0):
    n = spec.blocks_for(tokens)
    pool = BlockPool(spec, 2 * n).poison().fill_random(seed)
    table = BlockAllocator(2 * n, spec.block_size, seed=seed).allocate(tokens)
    return pool, table


def _bits(t):
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _applicable(method, dest):
    return paged_xport.TRANSPORTS[method].unavailable("cpu", dest) is None


# ---------------------------------------------------------------------------------------------------
# shapes, tables, allocation


def test_qwen_block_is_16_kib_and_the_32k_cache_is_114688_pieces():
    spec = PoolSpec(28, 16, 4, 128, torch.bfloat16)
    assert spec.block_bytes == 16 * 4 * 128 * 2 == 16384
    assert 2 * spec.layers * spec.blocks_for(32768) == 114_688
    assert spec.payload_bytes(32768) == 32768 * 57344
    assert paged_bench.LAYOUTS["qwen2.5-7b"].bytes_per_token == 57344


@pytest.mark.parametrize("layout,block_shape", [("nhd", (4, 2, 8)), ("hnd", (2, 4, 8))])
def test_pool_layouts(layout, block_shape):
    pool = BlockPool(_spec(layout), 5)
    assert tuple(pool.data.shape) == (2, 2, 5, *block_shape)
    assert tuple(pool.rows.shape) == (2 * 2 * 5, 64)
    assert pool.rows.data_ptr() == pool.data.data_ptr()


@pytest.mark.parametrize("kw", [dict(layout="nchw"), dict(block_size=0), dict(dtype="int8")])
def test_pool_spec_validates(kw):
    base = dict(layers=2, block_size=4, kv_heads=2, head_dim=8)
    with pytest.raises(ValueError):
        PoolSpec(**{**base, **kw})


@pytest.mark.parametrize("ids,tokens,match", [([0, 1], 9, "need 3 block ids"), ([0, 1, 1], 9, "duplicate"),
                                              ([0, -1, 2], 9, "negative"), ([[0, 1, 2]], 9, "1-D"),
                                              ([0.5, 1, 2], 9, "1-D sequence of ints")])
def test_block_table_validates(ids, tokens, match):
    with pytest.raises(ValueError, match=match):
        BlockTable(ids, tokens, 4)


def test_random_allocator_scatters_reproducibly_and_frees():
    a = BlockAllocator(64, 16, seed=7)
    t1 = a.allocate(16 * 20)
    assert t1.num_blocks == 20 and len(set(t1.ids.tolist())) == 20
    assert not np.array_equal(t1.ids, np.sort(t1.ids))  # scattered, not packed
    assert np.array_equal(BlockAllocator(64, 16, seed=7).allocate(16 * 20).ids, t1.ids)
    t2 = a.allocate(16 * 44)
    assert not set(t1.ids.tolist()) & set(t2.ids.tolist())
    with pytest.raises(ValueError, match="free"):
        a.allocate(1)
    a.free(t1)
    assert a.free_blocks == 20
    with pytest.raises(ValueError):
        a.free(t1)


def test_packed_allocator_takes_the_lowest_ids():
    a = BlockAllocator(10, 4, order="packed")
    assert a.allocate(9).ids.tolist() == [0, 1, 2]
    assert a.allocate(4).ids.tolist() == [3]


# ---------------------------------------------------------------------------------------------------
# conversion


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tokens=st.integers(1, 40), block_size=st.sampled_from([1, 3, 4, 16]), layout=st.sampled_from(["nhd", "hnd"]),
       extra=st.integers(0, 5), seed=st.integers(0, 1000))
def test_buffer_pages_buffer_round_trip(tokens, block_size, layout, extra, seed):
    kv = KVLayout(2, 1, 2, tokens, 8, torch.bfloat16)
    buf = KVBuffer(kv)
    buf.data.copy_(torch.randn(kv.shape, generator=torch.Generator().manual_seed(seed)))
    spec = PoolSpec.from_kv_layout(kv, block_size, layout)
    n = spec.blocks_for(tokens)
    pool = BlockPool(spec, n + extra).poison()
    table = BlockAllocator(n + extra, block_size, seed=seed).allocate(tokens)
    pool.write(buf, table)
    back = pool.read(table)
    assert torch.equal(back.data, buf.data)
    # token t of layer l, side s lives in block ids[t // bs] at slot t % bs
    t = tokens - 1
    blk = pool.data[1, 0, table.ids[t // block_size]]
    slot = blk[t % block_size] if layout == "nhd" else blk[:, t % block_size]
    assert torch.equal(slot, buf.data[1, 0, 0, :, t])
    outside = np.setdiff1d(np.arange(n + extra), table.ids)
    assert torch.isnan(pool.data[:, :, outside]).all()


def test_hf_cache_to_pages_and_back_is_identical(tiny_model):
    ids = make_prompt(256, 21, "cpu", seed=3)
    buf = KVBuffer(layout_for(tiny_model, 21, dtype=torch.float32)).poison()
    prefill(tiny_model, ids, buf)
    hf = buf.as_hf_cache(filled=True)
    pool, table = BlockPool.from_kv_buffer(buf, block_size=4, layout="hnd", seed=1)
    pool2 = BlockPool(pool.spec, pool.num_blocks).poison()
    pool2.write_hf_cache(hf, table)
    assert torch.equal(pool2.blocks(table), pool.blocks(table))
    back = pool2.to_hf_cache(table)
    for a, b in zip(hf.layers, back.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_decode_from_pages_equals_colocated(tiny_model, layout):
    tokens, steps = 27, 10
    ids = make_prompt(256, tokens, "cpu", seed=5)
    kv = layout_for(tiny_model, tokens, dtype=torch.float32)
    colocated = KVBuffer(kv).poison()
    logits = prefill(tiny_model, ids, colocated)
    first = logits.argmax(-1)
    ref_tokens, ref_logits = decode(tiny_model, colocated, first, steps)

    spec = PoolSpec.from_kv_layout(kv, 8, layout)
    pool = BlockPool(spec, 9).poison()
    table = BlockAllocator(9, 8, seed=2).allocate(tokens)
    paged_logits = paged.prefill_into_pages(tiny_model, ids, pool, table)
    assert torch.equal(paged_logits, logits)
    rebuilt = pool.read(table)
    assert torch.equal(rebuilt.data, colocated.data)
    toks, lg = decode(tiny_model, rebuilt, first, steps)
    assert torch.equal(toks, ref_tokens) and torch.equal(lg, ref_logits)


def test_write_refuses_mismatched_buffers():
    pool, table = _source(_spec(), 9)
    before = pool.data.clone()
    bad = [KVBuffer(KVLayout(2, 1, 2, 10, 8, torch.bfloat16)),   # tokens ≠ table
           KVBuffer(KVLayout(2, 1, 2, 9, 8, torch.float16)),     # dtype
           KVBuffer(KVLayout(3, 1, 2, 9, 8, torch.bfloat16)),    # layers
           KVBuffer(KVLayout(2, 2, 2, 9, 8, torch.bfloat16))]    # batch
    for buf in bad:
        with pytest.raises(ValueError):
            pool.write(buf, table)
    with pytest.raises(ValueError, match="out of range"):
        pool.write(KVBuffer(KVLayout(2, 1, 2, 9, 8, torch.bfloat16)), BlockTable([0, 1, 99], 9, 4))
    assert torch.equal(_bits(pool.data), _bits(before))


# ---------------------------------------------------------------------------------------------------
# transports


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
@pytest.mark.parametrize("method,dest", [(m, d) for m in STREAM_METHODS for d in CPU_DESTS if _applicable(m, d)])
def test_transport_lands_every_block_and_nothing_else(method, dest, layout, dtype):
    # an FP8 pool too: torch has no float8 index_copy_, so the transports move its rows as their bytes (issue 29)
    spec = _spec(layout, dtype=dtype)
    src, table = _source(spec, 23, seed=4)
    n = table.num_blocks
    host = dest != "same-gpu"
    dst_table = None if host else BlockAllocator(2 * n + 3, 4, seed=9).allocate(23)
    opts = {"chunk_mib": 2.5 * spec.block_bytes / 2**20} if method == "chunked-gather-d2h" else {}
    t = make_transport(method, spec, dest, n + 2 if host else 2 * n + 3, "cpu", **opts)
    t.prepare(src, table, dst_table)
    t.poison()
    landing = t.send(src, table, dst_table)
    assert landing.wait().all_landed()
    check = verify_transfer(src, table, t.pool, dst_table)
    assert check["ok"], check
    assert check["blocks"] == 2 * 2 * n and check["outside_blocks"] == 2 * 2 * (t.pool.num_blocks - n)
    if method == "triton":
        assert t.backend == "triton"


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), method=st.sampled_from(STREAM_METHODS), tokens=st.integers(1, 30),
       block_size=st.sampled_from([1, 2, 5, 8]), layout=st.sampled_from(["nhd", "hnd"]))
def test_random_tables_land_byte_exact(data, method, tokens, block_size, layout):
    spec = _spec(layout, block_size, torch.float16)
    n = spec.blocks_for(tokens)
    src_blocks = data.draw(st.integers(n, n + 6), label="source pool blocks")
    src_ids = data.draw(st.permutations(range(src_blocks)), label="source order")[:n]
    src = BlockPool(spec, src_blocks).fill_random(tokens)
    table = BlockTable(src_ids, tokens, block_size)
    dest = data.draw(st.sampled_from([d for d in CPU_DESTS if _applicable(method, d)]), label="dest")
    dst_blocks = data.draw(st.integers(n, n + 6), label="destination pool blocks")
    packed = data.draw(st.booleans(), label="packed") if dest == "pageable" else False
    dst_table = None if packed else BlockTable(
        data.draw(st.permutations(range(dst_blocks)), label="destination order")[:n], tokens, block_size)
    chunk = data.draw(st.integers(1, 5), label="chunk rows") * spec.block_bytes / 2**20
    opts = {"chunk_mib": chunk} if method == "chunked-gather-d2h" else {}
    t = make_transport(method, spec, dest, dst_blocks, "cpu", **opts)
    t.send(src, table, dst_table).wait()
    assert verify_transfer(src, table, t.pool, dst_table)["ok"]


def test_verification_can_fail():
    spec = _spec()
    src, table = _source(spec, 16)
    t = make_transport("torch-index", spec, "same-gpu", 12, "cpu")
    dst_table = BlockTable([11, 3, 7, 0], 16, 4)
    t.send(src, table, dst_table).wait()
    assert verify_transfer(src, table, t.pool, dst_table)["ok"]
    t.pool.data[1, 1, 7, 0, 0, 0] += 1          # one element of one landed block
    t.pool.data[0, 0, 5].zero_()                # one block outside the table loses its poison
    check = verify_transfer(src, table, t.pool, dst_table)
    assert not check["ok"] and check["mismatched_blocks"] == 1 and check["unpoisoned_blocks"] == 1


def test_layerwise_send_from_the_hooks(tiny_model):
    tokens = 19
    ids = make_prompt(256, tokens, "cpu", seed=11)
    kv = layout_for(tiny_model, tokens, dtype=torch.float32)
    colocated = KVBuffer(kv).poison()
    first = prefill(tiny_model, ids, colocated).argmax(-1)
    ref_tokens, ref_logits = decode(tiny_model, colocated, first, 6)
    spec = PoolSpec.from_kv_layout(kv, 4)
    table = BlockAllocator(12, 4, seed=1).allocate(tokens)
    dst_table = BlockAllocator(10, 4, seed=2).allocate(tokens)
    src = BlockPool(spec, 12).poison()
    t = make_transport("triton", spec, "same-gpu", 10, "cpu")
    sender = t.layerwise(src, table, dst_table)
    t.poison()
    with LayerHooks(tiny_model, on_kv_ready=sender.on_layer, ranges=False, point="attention"):
        sender.begin()
        paged.prefill_into_pages(tiny_model, ids, src, table)
        landing = sender.finish()
    assert landing.wait().all_landed() and sender.sent == kv.layers
    assert verify_transfer(src, table, t.pool, dst_table)["ok"]
    toks, lg = decode(tiny_model, t.pool.read(dst_table), first, 6)
    assert torch.equal(toks, ref_tokens) and torch.equal(lg, ref_logits)


def test_layerwise_send_counts_layers():
    spec = _spec()
    src, table = _source(spec, 8)
    sender = make_transport("torch-index", spec, "same-gpu", 8, "cpu").layerwise(src, table, None)
    sender.begin()
    sender.on_layer(0)
    with pytest.raises(RuntimeError, match="1 of 2 layers"):
        sender.finish()


def test_triton_transport_falls_back_without_the_interpreter_and_says_so(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    spec = _spec()
    src, table = _source(spec, 10)
    t = make_transport("triton", spec, "same-gpu", 12, "cpu")
    assert t.backend.startswith("torch") and any("TRITON_INTERPRET" in n for n in t.notes)
    dst_table = BlockAllocator(12, 4, seed=3).allocate(10)
    t.send(src, table, dst_table).wait()
    assert verify_transfer(src, table, t.pool, dst_table)["ok"]


def _bad_cases(spec, src, table):
    n = table.num_blocks
    return {
        "source id out of range": lambda t: t.send(src, BlockTable([0, 1, src.num_blocks], 12, 4)),
        "destination id out of range": lambda t: t.send(src, table, BlockTable([0, 1, 40], 12, 4)),
        "length mismatch": lambda t: t.send(src, table, BlockTable([0, 1, 2, 3], 16, 4)),
        "block size mismatch": lambda t: t.send(src, table, BlockTable([0, 1, 2, 3, 4, 5], 12, 2)),
        "dtype mismatch": lambda t: t.send(BlockPool(_spec(dtype=torch.float16), src.num_blocks), table),
        "layout mismatch": lambda t: t.send(BlockPool(_spec(layout="hnd"), src.num_blocks), table),
        "not a pool": lambda t: t.send(src.data, table),
        "destination too small": lambda t: make_transport(t.name, spec, "pageable", n - 1, "cpu").send(src, table),
    }


@pytest.mark.parametrize("case", ["source id out of range", "destination id out of range", "length mismatch",
                                  "block size mismatch", "dtype mismatch", "layout mismatch", "not a pool",
                                  "destination too small"])
@pytest.mark.parametrize("method", ["per-block-copy", "triton", "chunked-gather-d2h"])
def test_bad_input_raises_before_any_byte_moves(method, case):
    spec = _spec()
    src, table = _source(spec, 12)
    dest = "pageable" if method == "chunked-gather-d2h" else "same-gpu"
    t = make_transport(method, spec, dest, 24, "cpu")
    with pytest.raises(ValueError):
        _bad_cases(spec, src, table)[case](t)
    assert torch.isnan(t.pool.data).all()


def test_duplicate_destination_ids_are_refused():
    with pytest.raises(ValueError, match="duplicate"):
        BlockTable([3, 5, 3], 12, 4)


@pytest.mark.parametrize("name,dest,kw,match", [
    ("memcpy", "same-gpu", {}, "unknown paged transport"),
    ("triton", "same-gpu", {"blocks": 1}, "unknown option"),
    ("triton", "pageable", {}, "does not apply"),
    ("chunked-gather-d2h", "same-gpu", {}, "does not apply"),
    ("cuda-memcpy-batch", "same-gpu", {}, "CUDA"),
    ("triton", "warp-drive", {}, "unknown destination"),
    ("chunked-gather-d2h", "pageable", {"ring": 1}, "ring"),
])
def test_construction_refuses_what_cannot_run(name, dest, kw, match):
    with pytest.raises(ValueError, match=match):
        make_transport(name, _spec(), dest, 8, "cpu", **kw)


def test_unavailable_reasons_name_the_missing_piece():
    assert "CUDA" in unavailable("mapped-pinned", "cpu", "pageable") or "apply" in unavailable(
        "mapped-pinned", "cpu", "pageable")
    assert "CUDA" in unavailable("cuda-memcpy-batch", "cpu", "same-gpu")
    assert unavailable("torch-index", "cpu", "same-gpu") is None


def test_nixl_transport_lands_blocks():
    if unavailable("nixl", "cpu", "pageable") is not None:
        pytest.skip(unavailable("nixl", "cpu", "pageable"))
    spec = _spec()
    src, table = _source(spec, 12)
    t = make_transport("nixl", spec, "pageable", table.num_blocks, "cpu")
    try:
        t.prepare(src, table)
        t.poison()
        t.send(src, table).wait()
        assert verify_transfer(src, table, t.pool, None)["ok"]
        assert t.config["descriptors"] == 2 * spec.layers * table.num_blocks
    finally:
        t.close()


# ---------------------------------------------------------------------------------------------------
# the measurement


@pytest.fixture(scope="module")
def bench():
    # module scope runs before the per-test interpreter fixture: set the variable here too
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        return paged_bench.measure(contexts=[32, 70], block_sizes=[8, 16], destinations=["same-gpu", "pageable"],
                                   repeats=3, warmup=1, device="cpu", layout="tiny", slow_pieces=30)


def test_measure_is_tidy_verified_and_has_its_ceiling(bench):
    df = bench
    assert list(df.columns) == paged_bench.COLUMNS
    ok = df[df.status == "ok"]
    assert ok.verified.all() and (ok.ms > 0).all()
    assert np.allclose(ok.gbps, ok.bytes / (ok.ms * 1e6))
    for _, g in df.groupby(["context", "block_size", "destination"]):
        assert (g[g.method == "contiguous"].status == "ok").any()
        assert g.bytes.nunique() == 1
    # the host-only method appears only for the host destination, the triton kernel only on the device one
    assert set(df[df.method == "chunked-gather-d2h"].destination) == {"pageable-host"}
    assert set(df[df.method == "triton"].destination) == {"same-device"}
    assert (df[df.method == "triton"].backend == "triton").all()
    skipped = df[df.status == "skipped"]
    assert set(skipped.method) >= {"cuda-memcpy-batch"} and skipped.note.str.len().gt(0).all()
    assert not (df.status == "failed").any(), df[df.status == "failed"].note.tolist()


def test_slow_methods_are_timed_once_and_say_so(bench):
    pb = bench[(bench.method == "per-block-copy") & (bench.status == "ok")]
    many = pb[pb.pieces > 30]
    few = pb[pb.pieces <= 30]
    assert len(many) and len(few)
    assert (many.groupby(["context", "block_size", "destination"]).size() == 1).all()
    assert many.note.str.contains("timed once").all()
    assert (few.groupby(["context", "block_size", "destination"]).size() == 3).all()


def test_too_slow_methods_are_skipped_with_the_reason():
    df = paged_bench.measure([16], [8], ["torch-index"], ["same-gpu"], repeats=2, warmup=0, device="cpu",
                             layout="tiny", max_call_s=0.0)
    row = df[df.method == "torch-index"]
    assert len(row) == 1 and row.status.iloc[0] == "skipped" and "max_call_s" in row.note.iloc[0]
    assert bool(row.verified.iloc[0])


def test_summary_goals_finding_and_figure(bench, tmp_path):
    s = paged_report.summary(bench)
    # headline: the longest context, 16-token blocks
    assert set(s.context) == {70} and set(s.block_size) == {16}
    assert set(paged_report.summary(bench, 32, 8).block_size) == {8}
    ceil = s[s.method == "contiguous"]
    assert np.allclose(ceil.pct_of_ceiling, 100)
    tri = s[s.method == "triton"].iloc[0]
    assert tri.pieces == 2 * 2 * 5 and "(" in tri.time and tri.gbps > 0
    assert isinstance(paged_report.goals(bench), pd.DataFrame)
    text = paged_report.finding(bench)
    assert "70 tokens in 16-token blocks" in text and "GB/s" in text
    pct = paged_report.pct_table(bench)
    assert {"destination", "context", "block_size", "triton"} <= set(pct.columns) and len(pct) == 8
    fig = paged_report.plot_gbps_vs_block_size(bench)
    assert len(fig.axes) == 4  # GB/s and % of the contiguous copy, per destination
    fig.savefig(tmp_path / "f.png")


def test_merge_replaces_and_adds_method_rows(bench):
    extra = bench[bench.method.isin(["contiguous", "torch-index"])].copy()
    extra.loc[extra.method == "torch-index", "ms"] = 1.0
    merged = paged_report.merge(bench, extra)
    assert len(merged) == len(bench)
    assert (merged[merged.method == "torch-index"].ms == 1.0).all()
    with pytest.raises(ValueError, match="columns"):
        paged_report.merge(bench, extra.drop(columns=["ms"]))


def test_resolve_auto_on_cpu():
    r = paged_bench.resolve(device="cpu")
    assert r["contexts"] == list(paged_bench.CPU_CONTEXTS) and r["layout"] == "tiny"
    assert r["destinations"] == ["same-gpu", "pageable"] and r["methods"] == list(paged_bench.METHODS)
    r = paged_bench.resolve("1k, 32K", "16", "triton,contiguous", "same-gpu", "qwen2.5-7b", device="cpu")
    assert r["contexts"] == [1024, 32768] and r["block_sizes"] == [16]
    for bad in (dict(contexts="1k,zero"), dict(methods="teleport"), dict(destinations="moon"),
                dict(layout="gpt-9")):
        with pytest.raises(ValueError):
            paged_bench.resolve(**bad, device="cpu")


@pytest.mark.parametrize("kw", [dict(contexts=[]), dict(block_sizes=[0]), dict(methods=["x"]), dict(repeats=0),
                                dict(pool_layout="nchw"), dict(options={"warp": {}})])
def test_measure_refuses_bad_arguments(kw):
    args = dict(contexts=[16], block_sizes=[8], methods=["torch-index"], destinations=["same-gpu"], device="cpu",
                layout="tiny")
    with pytest.raises(ValueError):
        paged_bench.measure(**{**args, **kw})


def test_decode_check_every_transport(tiny_model):
    df = correctness.decode_check(tiny_model, tokens=13, block_size=4, steps=4, device="cpu")
    ok = df[df.status == "ok"]
    assert set(ok["mode"]) == {"bulk", "layerwise"}
    # NIXL too where it loads (CI installs it): its two agents in this process pass the same check
    assert set(ok.method) == set(STREAM_METHODS) | ({"nixl"} if unavailable("nixl", "cpu", "pageable") is None else set())
    assert ok.tokens_match.all() and ok.logits_equal.all() and ok.blocks_ok.all() and (ok.poison_left == 0).all()
    assert df.attrs["paged_prefill_logits_equal"]


def test_run_nixl_only_writes_results(tmp_path):
    df = nixl_only.run_nixl_only(tmp_path / "nixl", contexts=[16], block_sizes=[8], destinations=["pageable"],
                                   repeats=2, warmup=0, device="cpu", layout="tiny")
    assert (tmp_path / "nixl" / "nixl_results.csv").is_file()
    record = json.loads((tmp_path / "nixl" / "nixl_config.json").read_text())
    assert record["nixl_available"] == (unavailable("nixl", "cpu", "pageable") is None)
    assert set(df.method) == {"contiguous", "nixl"}
    back = pd.read_csv(tmp_path / "nixl" / "nixl_results.csv")
    assert list(back.columns) == paged_bench.COLUMNS


# ---------------------------------------------------------------------------------------------------
# GPU (skipped without CUDA): run these first on a GPU machine, before the notebook


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("method", [m for m in paged_bench.METHODS if m != "contiguous"])
def test_gpu_transports_land_byte_exact(method, dtype, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")  # compiled kernels on the GPU
    dev = torch.device("cuda", torch.cuda.current_device())
    spec = PoolSpec(4, 16, 4, 128, dtype)  # 16 KiB rows in bf16, like Qwen2.5-7B; an FP8 pool's are 8 KiB
    tokens = 1000
    n = spec.blocks_for(tokens)
    src = BlockPool(spec, 2 * n, device=dev).fill_random(1)
    table = BlockAllocator(2 * n, 16, seed=1).allocate(tokens)
    ran = 0
    for dest in paged_bench.default_destinations(dev) + ["pageable"]:
        cls = paged_xport.TRANSPORTS[method]
        d = Destination.parse(dest, dev)
        if d.kind not in cls.kinds or cls.unavailable(dev, d) is not None:
            continue
        host = d.kind in ("pinned", "pageable")
        dst_table = None if host else BlockAllocator(2 * n, 16, seed=2).allocate(tokens)
        t = make_transport(method, spec, d, n if host else 2 * n, dev)
        try:
            t.prepare(src, table, dst_table)
            for _ in range(2):  # a second send through the cached plan must land too
                t.poison()
                t.send(src, table, dst_table).wait()
                torch.cuda.synchronize()
                check = verify_transfer(src, table, t.pool, dst_table)
                assert check["ok"], (dest, check, t.info)
            ran += 1
        finally:
            t.close()
    if not ran:
        pytest.skip(f"{method} cannot run on this machine: {paged_xport.TRANSPORTS[method].unavailable(dev, 'same-gpu')}")


@pytest.mark.gpu
def test_gpu_decode_check(tiny_model, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    dev = torch.device("cuda", torch.cuda.current_device())
    model = tiny_model.to(dev)
    try:
        df = correctness.decode_check(model, tokens=77, block_size=16, steps=8, device=dev)
    finally:
        tiny_model.to("cpu")
    ok = df[df.status == "ok"]
    assert len(ok) and ok.tokens_match.all() and ok.logits_equal.all() and ok.blocks_ok.all(), df.to_string()


@pytest.mark.gpu
def test_gpu_measure_smoke(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    df = paged_bench.measure([1024], [16], repeats=3, warmup=1, layout="qwen2.5-7b")
    assert not (df.status == "failed").any(), df[df.status == "failed"][["method", "destination", "note"]].to_string()
    assert df[df.status == "ok"].verified.all()


def test_bulk_orders_are_permutations_of_the_plan():
    spec = PoolSpec(layers=3, kv_heads=1, head_dim=4, block_size=4, dtype=torch.float32)
    table = BlockAllocator(12, 4, seed=1).allocate(20)
    dst_table = BlockAllocator(12, 4, seed=2).allocate(20)
    src = BlockPool(spec, 12).fill_random(0)
    t = make_transport("triton", spec, "same-gpu", 12, "cpu", tune=False)
    plan = t.prepare(src, table, dst_table)
    n, rpl = plan.rows, plan.n_blocks
    for order in paged_triton.BULK_ORDERS:
        perm = paged_triton.bulk_order(plan, order)
        assert sorted(perm.tolist()) == list(range(n)), order
    assert paged_triton.bulk_order(plan, "layer").tolist() == list(range(n))
    inter = paged_triton.bulk_order(plan, "interleaved")
    assert (inter[: 2 * spec.layers] % rpl == 0).all()  # block 0 of every layer side first
    src_sorted = plan.src_rows[paged_triton.bulk_order(plan, "src")]
    for side in range(2 * spec.layers):
        part = src_sorted[side * rpl:(side + 1) * rpl]
        assert (np.diff(part) > 0).all()
    with pytest.raises(ValueError, match="bulk order 'zigzag'"):
        paged_triton.bulk_order(plan, "zigzag")
    with pytest.raises(ValueError, match="bulk order 'zigzag'"):
        make_transport("triton", spec, "same-gpu", 12, "cpu", order="zigzag")


@pytest.mark.parametrize("order", ["layer", "interleaved", "src"])
def test_triton_bulk_in_every_order_is_byte_exact(order):
    spec = PoolSpec(layers=2, kv_heads=1, head_dim=4, block_size=4, dtype=torch.bfloat16)
    table = BlockAllocator(10, 4, seed=3).allocate(18)
    dst_table = BlockAllocator(12, 4, seed=4).allocate(18)
    src = BlockPool(spec, 10).fill_random(1)
    t = make_transport("triton", spec, "same-gpu", 12, "cpu", order=order)
    t.prepare(src, table, dst_table)
    t.poison()
    t.send(src, table, dst_table).wait()
    assert t.backend == "triton"
    assert verify_transfer(src, table, t.pool, dst_table)["ok"]
    assert t.config["order"] == order


def test_access_patterns_need_a_gpu_and_say_nothing_on_a_cpu():
    df = patterns.access_patterns(64, 16, device="cpu", layout="tiny")
    assert df.empty and {"pattern", "ms", "gbps"} <= set(df.columns)
    assert paged_report.pattern_summary(df).empty


@pytest.mark.gpu
def test_access_patterns_on_a_gpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    df = patterns.access_patterns(256, 16, device="cuda", layout="tiny", repeats=3, warmup=1)
    names = [p for p, _ in patterns.PATTERNS]
    assert list(dict.fromkeys(df.pattern)) == names and (df.ms > 0).all()
    s = paged_report.pattern_summary(df)
    assert s.set_index("pattern").pct_of_contiguous["contiguous copy_"] == pytest.approx(100)
    paged_report.plot_patterns(s)


def test_tuning_table_flattens_the_transport_records():
    df = pd.DataFrame()
    df.attrs["transports"] = [{"context": 32, "block_size": 16, "destination": "same-gpu", "method": "triton",
                               "config": {"order": "layer", "tuned_rows": 8,
                                          "tuning": [{"block": 256, "ms": 0.5, "order": "layer"},
                                                     {"block": 512, "ms": 0.4, "order": "src"}]}},
                              {"context": 32, "block_size": 16, "destination": "pinned", "method": "mapped-pinned"}]
    t = paged_report.tuning_table(df)
    assert len(t) == 2 and list(t.chosen_order) == ["layer", "layer"] and list(t.order) == ["layer", "src"]
    assert paged_report.tuning_table(pd.DataFrame()).empty


def test_pattern_summary_and_plot_from_a_table():
    rows = []
    for name, ms in (("contiguous copy_", 1.0), ("kernel: rows in place", 1.0), ("kernel: gather → packed", 1.025)):
        for r, jitter in enumerate((0.0, 0.01, -0.005)):
            rows.append(dict(pattern=name, description=dict(patterns.PATTERNS)[name], repeat=r, ms=ms + jitter,
                             gbps=1e9 / (ms + jitter) / 1e6, bytes=10**9, rows=10, config="{}"))
    s = paged_report.pattern_summary(pd.DataFrame(rows))
    assert list(s.pattern) == ["contiguous copy_", "kernel: rows in place", "kernel: gather → packed"]
    assert s.pct_of_contiguous.iloc[2] == pytest.approx(100 / 1.025)
    fig = paged_report.plot_patterns(s, title="t")
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["rows in place", "gather → packed"]


def test_finalists_are_the_fastest_timed_candidates():
    table = [{"block": 256, "ms": 0.95}, {"block": 512, "ms": None, "error": "no"}, {"block": 1024, "ms": 0.92},
             {"block": 2048, "ms": 0.99}]
    assert [r["block"] for r in paged_triton.finalists(table, 2)] == [1024, 256]
    assert paged_triton.finalists([{"ms": None}]) == []


def test_a_cpu_triton_transport_times_no_finalists():
    spec = PoolSpec(layers=2, kv_heads=1, head_dim=4, block_size=4, dtype=torch.bfloat16)
    table = BlockAllocator(10, 4, seed=3).allocate(18)
    t = make_transport("triton", spec, "same-gpu", 12, "cpu")
    t.prepare(BlockPool(spec, 10).fill_random(1), table, BlockAllocator(12, 4, seed=4).allocate(18))
    assert "tuning" not in t.config and t.config["order"] == "layer"


@pytest.mark.parametrize("lo,hi,chunk,edge", [(0, 100, 30, 5), (0, 64, 32, 32), (5, 6, 1, 1), (0, 10, 3, 8),
                                              (0, 1000, 64, 4), (7, 7, 4, 2)])
def test_chunk_bounds_cover_the_range_in_chunks_no_larger_than_asked(lo, hi, chunk, edge):
    from kvlab.paged.triton_transports import chunk_bounds

    b = chunk_bounds(lo, hi, chunk, edge)
    if hi <= lo:
        assert b == []
        return
    assert b[0][0] == lo and b[-1][1] == hi and all(x[1] == y[0] for x, y in zip(b, b[1:]))
    assert all(0 < e - s <= chunk for s, e in b)
    if hi - lo > 2 * min(edge, chunk):
        assert b[0][1] - b[0][0] == min(edge, chunk) == b[-1][1] - b[-1][0]  # short first and last chunks


def test_chunk_bounds_refuses_empty_chunks():
    from kvlab.paged.triton_transports import chunk_bounds

    for chunk, edge in ((0, 1), (1, 0), (2.5, 1)):
        with pytest.raises(ValueError, match="ints ≥ 1"):
            chunk_bounds(0, 10, chunk, edge)


def test_the_peer_paged_goal():
    def table(send_ms, n=9):
        rows = []
        for method, ms in (("contiguous", 4.74), ("chunked-gather-peer", send_ms)):
            for k in range(n):
                t = ms * (1 + 0.001 * (k - n // 2))  # a little spread, as sends have
                rows.append(dict(context=32768, block_size=16, method=method, destination="peer-cuda:1",
                                 pieces=114688, bytes=1879048192, repeat=k, ms=t, gbps=1879048192 / t / 1e6,
                                 verified=True, status="ok", note="", backend="", plan_ms=float("nan"),
                                 pool_layout="nhd", dtype="bf16"))
        return pd.DataFrame(rows)

    g = paged_report.goals(table(4.90))
    assert list(g.goal) == ["chunked-gather-peer ≥ 98 % of contiguous to the peer"]
    assert g.value.iloc[0].startswith("96.7 %") and g.verdict.iloc[0] == "missed"
    assert paged_report.goals(table(4.80)).verdict.iloc[0] == "met"
    assert paged_report.goals(table(4.837)).verdict.iloc[0] == "not resolved"  # 98.0 %: the interval straddles
    # one sample each: no interval, so the goal is not resolved whatever the point says
    assert paged_report.goals(table(4.80, n=1)).verdict.iloc[0] == "not resolved"


# ---------------------------------------------------------------------------------------------------
# the study's face (kvlab.studies.paged_transfer): NIXL's own-process rows merged, bad nixl_csv refused first


def test_the_run_merges_nixl_measured_in_a_process_of_its_own(tmp_path, kvlab_dirs, monkeypatch):
    from kvlab import results
    from kvlab.studies import paged_transfer as study

    monkeypatch.setenv("KVLAB_PRESET", "cpu")
    nixl_only.run_nixl_only(tmp_path / "nixl", contexts=[16], block_sizes=[8], destinations=["pageable"], repeats=2,
                            warmup=0, device="cpu", layout="tiny")
    given = {"contexts": "16", "block_sizes": "8", "methods": "torch-index", "destinations": "pageable",
             "repeats": 3, "warmup": 0, "check_model": "", "nixl_csv": str(tmp_path / "nixl" / "nixl_results.csv")}
    cfg = study.check(given)
    run = results.start(study.NAME, given, tmp_path / "run")
    study.measure(cfg, run)
    a = study.analyse(run.record, run.tables())
    df = a.raw["results"]
    assert set(df.method) == {"contiguous", "torch-index", "nixl"}
    assert len(df[df.method == "contiguous"]) == 3  # the ceiling of this run only; NIXL's own run's is dropped
    assert run.record["nixl"]["nixl_available"] == (unavailable("nixl", "cpu", "pageable") is None)
    assert run.record["resolved"]["layout"] == "tiny" and "decode_check" not in a.raw
    assert "nixl" in set(a.tables["summary"].method) and "access_pattern_summary" not in a.tables
    assert set(study.figures(a)) == {"gbps_vs_block_size", "paged_gbps"}  # no access patterns on a CPU run


def test_a_bad_nixl_csv_is_refused_in_one_line_before_anything_runs(tmp_path):
    from kvlab.studies import paged_transfer as study

    with pytest.raises(ValueError, match="^nixl_csv = '.*nope.csv': no such file"):
        study.check({"nixl_csv": str(tmp_path / "nope.csv")})
    (tmp_path / "other.csv").write_text("context,ms\n1,2\n")
    with pytest.raises(ValueError, match="lacks the columns") as err:
        study.check({"nixl_csv": str(tmp_path / "other.csv")})
    assert "\n" not in str(err.value)
