"""kvlab.calculator against numbers worked out by hand (seed 000's table, seed 004's copy model)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import CELL_TIMEOUT_S
from kvlab import calculator as calc
from kvlab import exposure, models

KiB, MiB, GiB = 1024, 1024**2, 1024**3


# ---- dtypes -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name,nbytes", [("fp32", 4), ("bf16", 2), ("fp16", 2), ("fp8", 1),
                                         ("fp8_e4m3", 1), ("fp8_e5m2", 1), ("int8", 1),
                                         ("bfloat16", 2), ("torch.float8_e4m3fn", 1),
                                         ("FP8-E5M2", 1)])
def test_dtype_bytes(name, nbytes):
    assert calc.dtype_bytes(name) == nbytes


def test_unknown_dtype_lists_valid():
    with pytest.raises(ValueError) as e:
        calc.dtype_bytes("fp4")
    assert "fp4" in str(e.value) and "bf16" in str(e.value) and "int8" in str(e.value)


def test_calculator_does_not_import_torch():
    code = "import sys, kvlab.calculator; print('torch' in sys.modules)"
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=env)
    assert out.stdout.strip() == "False"


# ---- seed 000's table -------------------------------------------------------------------------


@pytest.mark.parametrize("name,per_token,tokens,total", [
    # layers · 2 · kv_heads · head_dim · 2 bytes
    ("llama-2-7b", 32 * 2 * 32 * 128 * 2, 8192, 4 * GiB),      # 512 KiB/token
    ("llama-3.1-8b", 32 * 2 * 8 * 128 * 2, 8192, 1 * GiB),     # 128 KiB/token
    ("llama-3.1-70b", 80 * 2 * 8 * 128 * 2, 8192, 5 * GiB // 2),  # 320 KiB/token, 2.5 GiB
    ("qwen2.5-7b", 28 * 2 * 4 * 128 * 2, 32768, 1792 * MiB),   # 56 KiB/token
])
def test_seed_table(name, per_token, tokens, total):
    spec = models.get(name)
    assert calc.kv_bytes_per_token(spec) == per_token
    assert calc.kv_cache_bytes(spec, tokens) == total


def test_seed_table_in_binary_units():
    assert calc.kv_bytes_per_token("llama-2-7b") == 512 * KiB == 524288
    assert calc.kv_bytes_per_token("llama-3.1-8b") == 128 * KiB
    assert calc.kv_bytes_per_token("llama-3.1-70b") == 320 * KiB
    assert calc.kv_bytes_per_token("qwen2.5-7b") == 56 * KiB == 57344
    assert calc.fmt_bytes(calc.kv_cache_bytes("llama-3.1-70b", 8192)) == "2.5 GiB"
    assert calc.fmt_bytes(524288) == "512 KiB"
    assert calc.fmt_bytes(1792 * MiB) == "1.75 GiB"
    assert calc.fmt_bytes(100) == "100 B"


def test_kv_dtype_scales_bytes():
    bf16 = calc.kv_cache_bytes("llama-2-7b", 4096)
    assert calc.kv_cache_bytes("llama-2-7b", 4096, "fp8") * 2 == bf16
    assert calc.kv_cache_bytes("llama-2-7b", 4096, "fp32") == 2 * bf16


def test_deepseek_v3_mla_bytes():
    # One latent (512) plus the shared RoPE key (64) per layer, 61 layers, 2 bytes.
    assert calc.kv_bytes_per_token("deepseek-v3") == 61 * (512 + 64) * 2 == 70272
    assert calc.kv_bytes_per_token("deepseek-v3", "fp8") == 35136
    assert calc.kv_cache_bytes("deepseek-v3", 1000) == 70272 * 1000


def test_gemma2_sliding_layers_are_capped():
    per_layer_token = 2 * 8 * 256 * 2  # 8192 bytes: K and V, 8 heads of 256, bf16
    assert calc.kv_bytes_per_token("gemma-2-9b") == 42 * per_layer_token
    # Up to the window nothing is capped.
    assert calc.kv_cache_bytes("gemma-2-9b", 4096) == 42 * per_layer_token * 4096
    # At 8K, the 21 even-indexed layers keep 4096 tokens, the 21 odd ones keep 8192.
    assert calc.kv_cache_bytes("gemma-2-9b", 8192) == per_layer_token * 21 * (4096 + 8192) \
        == 2_113_929_216
    layers = calc.kv_layer_bytes("gemma-2-9b", 8192)
    assert layers[0] == per_layer_token * 4096 and layers[1] == per_layer_token * 8192
    assert len(layers) == 42


def test_mistral_v01_window_caps_every_layer():
    # 32 layers · 2 · 8 · 128 · 2 B = 128 KiB/token; all layers stop growing at 4096 tokens.
    assert calc.kv_cache_bytes("mistral-7b", 4096) == 512 * MiB
    assert calc.kv_cache_bytes("mistral-7b", 32768) == 512 * MiB


@pytest.mark.parametrize("tokens", [0, -1, 1.5, True, "8k"])
def test_bad_tokens(tokens):
    with pytest.raises(ValueError, match="tokens"):
        calc.kv_cache_bytes("llama-2-7b", tokens)
    with pytest.raises(ValueError, match="tokens"):
        calc.prefill_flops("llama-2-7b", tokens)


def test_unknown_model_in_calculator():
    with pytest.raises(ValueError, match="unknown model"):
        calc.kv_bytes_per_token("nope-13b")


# ---- FLOPs ------------------------------------------------------------------------------------


def test_attended_pairs_by_hand():
    assert calc.attended_pairs(4) == 1 + 2 + 3 + 4
    assert calc.attended_pairs(10, 4) == (1 + 2 + 3 + 4) + 6 * 4
    assert calc.attended_pairs(4, 10) == 10


@given(st.integers(1, 300), st.integers(1, 300))
def test_attended_pairs_matches_brute_force(tokens, window):
    assert calc.attended_pairs(tokens, window) == sum(min(i, window) for i in range(1, tokens + 1))


def test_prefill_flops_tiny_by_hand():
    f = calc.prefill_flops("kvlab-tiny", 8)
    assert f.dense == 2 * 107072 * 8
    # per layer: 2 · 4 heads · (16 + 16) · (8·9/2 pairs)
    assert f.attention_per_layer == (2 * 4 * 32 * 36,) * 2
    assert f.total == f.dense + 2 * 9216


def test_prefill_flops_llama2_7b_8k():
    t = 8192
    f = calc.prefill_flops("llama-2-7b", t)
    assert f.dense == 2 * 6_738_415_616 * t
    assert f.attention == 32 * 2 * 32 * (128 + 128) * (t * (t + 1) // 2)
    assert sum(f.per_layer()) == pytest.approx(f.total, rel=1e-12)
    assert 0.13 < f.attention_fraction < 0.14  # 1.76e13 of 1.28e14


def test_prefill_flops_mla_and_moe():
    s = models.get("deepseek-v3")
    f = calc.prefill_flops(s, 1000)
    assert f.dense == 2 * s.active_params * 1000  # active (37.6B), not total (671B)
    assert f.attention_per_layer[0] == 2 * 128 * (192 + 128) * (1000 * 1001 // 2)


def test_prefill_flops_sliding_layers_cheaper():
    f = calc.prefill_flops("gemma-2-9b", 8192)
    sliding, full = f.attention_per_layer[0], f.attention_per_layer[1]
    pairs_full = 8192 * 8193 // 2
    pairs_win = 4096 * 4097 // 2 + 4096 * 4096
    assert full == 2 * 16 * 512 * pairs_full and sliding == 2 * 16 * 512 * pairs_win


def test_ratio_flat_then_falls():
    """Seed finding 1: bytes and dense FLOPs both scale with tokens; attention bends it late."""
    r = {t: calc.handoff_estimate("llama-3.1-8b", t, "400G").ratio
         for t in (128, 1024, 8192, 131072)}
    assert r[1024] == pytest.approx(r[128], rel=0.02)
    assert r[8192] < r[1024] and r[131072] < 0.5 * r[8192]


# ---- links ------------------------------------------------------------------------------------


def test_link_units():
    assert calc.Link.from_gbps(400).bytes_per_s == 50e9
    assert calc.Link.from_GBps(450).bytes_per_s == 450e9
    assert calc.LINKS["100G"].bytes_per_s == 12.5e9
    assert calc.LINKS["800G"].gbyte_per_s == 100
    assert calc.LINKS["nvlink-h100"].gbit_per_s == 3600


@pytest.mark.parametrize("text,bps", [
    ("400G", 50e9), ("400g", 50e9), ("400Gb/s", 50e9), ("400 Gbps", 50e9), ("400gbit/s", 50e9),
    ("50GB/s", 50e9), ("50 GBps", 50e9), ("1.6Tb/s", 200e9), ("400", 50e9), (400, 50e9),
    (12.5, 12.5e9 / 8), ("nvlink-h100", 450e9), ("NVLink", 450e9), ("PCIE5-X16", 64e9),
    ("100Mb/s", 12.5e6),
])
def test_link_parser(text, bps):
    assert calc.link(text).bytes_per_s == pytest.approx(bps, rel=1e-12)


@pytest.mark.parametrize("bad", [0, -5, "0G", "-5G", "fast", "400 furlongs", None, True,
                                 float("inf")])
def test_link_parser_rejects(bad):
    with pytest.raises(ValueError):
        calc.link(bad)


@pytest.mark.parametrize("kwargs", [{"efficiency": 0}, {"efficiency": 1.5}, {"fixed_us": -1},
                                    {"bytes_per_s": 0}])
def test_link_validation(kwargs):
    with pytest.raises(ValueError):
        calc.Link(**{"name": "x", "bytes_per_s": 1e9, **kwargs})


def test_transfer_time_by_hand():
    assert calc.transfer_time_s(GiB, "400G") == GiB / 50e9
    half = calc.LINKS["100G"].with_(efficiency=0.5)
    assert calc.transfer_time_s(1e9, half) == 1e9 / 6.25e9
    assert calc.transfer_time_s(0, calc.Link("x", 1e9, fixed_us=10), copies=3) == pytest.approx(
        30e-6)


def test_seed_004_copy_model():
    """Seed 004: 56 copies at ~18 µs plus the bytes at 395 GB/s → 1.15 ms at 1k, 5.76 ms at 32k."""
    nv = calc.LINKS["nvlink-h100-measured"]
    t1k = calc.transfer_time_s(calc.kv_cache_bytes("qwen2.5-7b", 1024), nv, copies=56)
    t32k = calc.transfer_time_s(calc.kv_cache_bytes("qwen2.5-7b", 32768), nv, copies=56)
    assert t1k == pytest.approx(56 * 18e-6 + 56 * MiB / 395e9)
    assert t1k * 1e3 == pytest.approx(1.15, abs=0.01)
    assert t32k * 1e3 == pytest.approx(5.76, abs=0.01)


@pytest.mark.parametrize("nbytes,copies", [(-1, 1), (float("nan"), 1), (10, 0), (10, 1.5)])
def test_transfer_time_bad_inputs(nbytes, copies):
    with pytest.raises(ValueError):
        calc.transfer_time_s(nbytes, "400G", copies)


# ---- tensor parallelism -----------------------------------------------------------------------


def test_tp_shards_shrink_until_kv_heads():
    per_gpu = {tp: calc.tp_shard_bytes("llama-3.1-8b", 8192, tp).bytes_per_gpu
               for tp in (1, 2, 4, 8, 16)}
    assert per_gpu == {1: GiB, 2: GiB // 2, 4: GiB // 4, 8: GiB // 8, 16: GiB // 8}
    s16 = calc.tp_shard_bytes("llama-3.1-8b", 8192, 16)
    assert s16.replicated and s16.replication == 2 and s16.kv_heads_per_gpu == 1
    assert s16.total_bytes == 2 * GiB and s16.unique_bytes == GiB
    assert "replicated 2×" in s16.note
    assert not calc.tp_shard_bytes("llama-3.1-8b", 8192, 8).replicated


def test_tp_knee_for_qwen_with_four_kv_heads():
    s8 = calc.tp_shard_bytes("qwen2.5-7b", 32768, 8)
    assert s8.bytes_per_gpu == 1792 * MiB // 4 and s8.replication == 2
    assert not s8.query_heads_split and "28 query heads" in s8.note
    assert calc.tp_shard_bytes("qwen2.5-7b", 32768, 4).query_heads_split


def test_tp_mla_latent_is_replicated():
    one = calc.kv_cache_bytes("deepseek-v3", 4096)
    s = calc.tp_shard_bytes("deepseek-v3", 4096, 8)
    assert s.bytes_per_gpu == one and s.total_bytes == 8 * one and s.replication == 8


def test_tp_transfer_time_in_parallel():
    # 2.5 GiB over 8 GPUs = 320 MiB each, over its own 400 Gb/s NIC.
    t = calc.tp_transfer_time_s("llama-3.1-70b", 8192, "400G", tp=8)
    assert t == 320 * MiB / 50e9


@pytest.mark.parametrize("tp,match", [(0, "tp=0"), (-2, "tp=-2"), (3, "valid tp: 1, 2, 4, 8, 16"),
                                      (12, "does not split")])
def test_tp_bad(tp, match):
    with pytest.raises(ValueError, match=match):
        calc.tp_shard_bytes("llama-3.1-8b", 1024, tp)


# ---- pipelined exposure -----------------------------------------------------------------------


def test_pipeline_link_faster_exposes_only_last_layer():
    e = exposure.pipeline_exposure([1.0] * 4, [0.5] * 4)
    assert e.compute_end_s == (1, 2, 3, 4)
    assert e.send_start_s == (1, 2, 3, 4)
    assert e.send_end_s == (1.5, 2.5, 3.5, 4.5)
    assert e.backlog_s == (0, 0, 0, 0)
    assert e.exposed_s == 0.5 and not e.link_bound
    assert e.hidden_fraction == pytest.approx(0.75)


def test_pipeline_link_slower_backlog_grows_linearly():
    e = exposure.pipeline_exposure([1.0] * 4, [1.5] * 4)
    assert e.send_start_s == (1, 2.5, 4, 5.5)
    assert e.send_end_s == (2.5, 4, 5.5, 7)
    assert e.backlog_s == (0, 0.5, 1.0, 1.5)  # +0.5 s per layer
    assert e.exposed_s == 3.0  # 4 · 1.5 − 3 · 1: all but the first layer's compute is unhidden
    assert e.link_bound


def test_pipeline_uneven_layers():
    # Slow middle layer transfer, then the link catches up during a long compute.
    e = exposure.pipeline_exposure([1, 1, 3], [0.5, 2, 0.5])
    assert e.send_start_s == (1, 2, 5)
    assert e.send_end_s == (1.5, 4, 5.5)
    assert e.exposed_s == 0.5


@pytest.mark.parametrize("c,t", [([1, 2], [1]), ([], []), ([1, -1], [1, 1]),
                                 ([1, float("nan")], [1, 1]), ("12", "12"), ([True], [1])])
def test_pipeline_bad_inputs(c, t):
    with pytest.raises(ValueError):
        exposure.pipeline_exposure(c, t)


@settings(max_examples=200)
@given(st.lists(st.tuples(st.floats(0, 10), st.floats(0, 10)), min_size=1, max_size=40))
def test_pipeline_bounds(pairs):
    c = [p[0] for p in pairs]
    t = [p[1] for p in pairs]
    e = exposure.pipeline_exposure(c, t)
    tol = 1e-9 * (1 + sum(c) + sum(t))
    # Never worse than sending everything after prefill; never better than the last layer alone
    # or than the link's total work minus the compute it can overlap with.
    assert e.exposed_s <= sum(t) + tol
    assert e.exposed_s >= t[-1] - tol
    assert e.exposed_s >= c[0] + sum(t) - sum(c) - tol
    assert all(b >= 0 for b in e.backlog_s)


# ---- handoff estimates: seed finding 3 --------------------------------------------------------


def test_llama2_7b_on_100g_is_link_bound():
    t = 8192
    e = calc.handoff_estimate("llama-2-7b", t, "100G", tflops=400)
    flops = 2 * 6_738_415_616 * t + 32 * 2 * 32 * 256 * (t * (t + 1) // 2)
    c = flops / 400e12 / 32           # per-layer compute: uniform (no sliding layers)
    x = 4 * GiB / 32 / 12.5e9         # per-layer transfer: 128 MiB at 12.5 GB/s
    assert x > c
    assert e.prefill_s == pytest.approx(flops / 400e12)
    assert e.transfer_s == pytest.approx(4 * GiB / 12.5e9)
    assert e.exposed_s == pytest.approx(32 * x - 31 * c)  # ≈ 33.6 ms
    assert e.link_bound and e.ratio > 1


def test_gqa_and_fp8_hide_the_transfer():
    t = 8192
    e = calc.handoff_estimate("llama-3.1-8b", t, "100G")
    assert not e.link_bound
    assert e.exposed_s == pytest.approx(GiB / 32 / 12.5e9)  # only the last layer: 2.68 ms
    f = calc.handoff_estimate("llama-2-7b", t, "100G", kv_dtype="fp8")
    assert not f.link_bound and f.kv_bytes == 2 * GiB
    assert f.exposed_s == pytest.approx(2 * GiB / 32 / 12.5e9)


def test_70b_keeps_up():
    e = calc.handoff_estimate("llama-3.1-70b", 8192, "100G")
    assert not e.link_bound and e.ratio < 0.1
    assert e.exposed_s == pytest.approx(2.5 * GiB / 80 / 12.5e9)


def test_handoff_tp_splits_compute_and_bytes():
    one = calc.handoff_estimate("llama-3.1-70b", 8192, "400G", tp=1)
    eight = calc.handoff_estimate("llama-3.1-70b", 8192, "400G", tp=8)
    assert eight.prefill_s == pytest.approx(one.prefill_s / 8)
    assert eight.transfer_s == pytest.approx(one.transfer_s / 8)
    assert eight.kv_bytes_per_gpu == 320 * MiB and eight.kv_bytes == 5 * GiB // 2
    row = eight.as_row()
    assert row["exposed_ms"] == pytest.approx(eight.exposed_s * 1e3) and row["tp"] == 8


def test_handoff_sliding_model_per_layer_times_differ():
    e = calc.handoff_estimate("gemma-2-9b", 8192, "400G")
    tl = e.timeline
    assert tl.transfer_s[0] == pytest.approx(tl.transfer_s[1] / 2)  # window holds half
    assert tl.compute_s[0] < tl.compute_s[1]
    assert sum(tl.compute_s) == pytest.approx(e.prefill_s)


@pytest.mark.parametrize("kwargs", [{"tflops": 0}, {"tflops": -1}, {"tp": 0}, {"kv_dtype": "fp4"},
                                    {"link_": "0G"}, {"tokens": 0}])
def test_handoff_bad_inputs(kwargs):
    args = {"model": "llama-3.1-8b", "tokens": 1024, "link_": "400G", **kwargs}
    with pytest.raises(ValueError):
        calc.handoff_estimate(**args)


def test_fmt_bytes_rejects_negative():
    with pytest.raises(ValueError):
        calc.fmt_bytes(-1)
    # kvlab-tiny: 2 layers · 2 · 2 KV heads · 16 · 2 bytes = 256 B/token.
    assert calc.fmt_bytes(calc.kv_cache_bytes("kvlab-tiny", 4096)) == "1 MiB"


# ---- the calculator notebook and its helpers (kvlab.studies.calculator.calcviz) ----------------------------------

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "notebooks" / "00_calculator.ipynb"


def test_calcviz_tables_match_the_calculator():
    from kvlab.studies.calculator import calcviz

    kv = calcviz.kv_table(["llama-2-7b", "gemma-2-9b"], 8192)
    assert list(kv["kv_bytes_per_token"]) == [524288, 42 * 8192]
    assert list(kv["kv_cache"]) == ["4 GiB", calc.fmt_bytes(2_113_929_216)]
    tp = calcviz.tp_table(["llama-3.1-8b"], 8192, "400G", [1, 3, 16])
    assert list(tp["tp"]) == [1, 16]  # tp=3 cannot split 8 KV heads: skipped
    assert list(tp["kv_bytes_per_gpu"]) == [GiB, GiB // 8]
    exp = calcviz.exposure_table(["llama-2-7b:fp8"], ["100G"], 8192)
    assert exp["case"].iloc[0] == "llama-2-7b fp8" and exp["kv_bytes"].iloc[0] == 2 * GiB
    assert calcviz.powers_of_two(128, 1000) == [128, 256, 512, 1000]
    assert calcviz.resolve_models("all") == [n for n in models.names() if n != "kvlab-tiny"]
    with pytest.raises(ValueError):
        calcviz.parse_case("llama-2-7b:fp4")
    with pytest.raises(ValueError):
        calcviz.resolve_models([])


def test_notebook_is_committed_without_outputs():
    import nbformat

    nb = nbformat.read(str(NOTEBOOK), as_version=4)
    tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1
    assert 'run_dir: str = ""' in tagged[0].source
    for line in tagged[0].source.splitlines():
        assert ":" in line.split("=")[0] and "#" in line, f"untyped or uncommented: {line}"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code)


@pytest.mark.slow
def test_notebook_runs_with_small_parameters(tmp_path, monkeypatch, kvlab_dirs):
    import nbformat
    import pandas as pd
    from kvlab import nbexec

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p))
    run_dir = tmp_path / "run"
    out = tmp_path / "out.ipynb"
    nbexec.execute_notebook(
        str(NOTEBOOK), str(out), kernel_name="python3", cwd=str(REPO), progress_bar=False,
        execution_timeout=int(CELL_TIMEOUT_S),
        parameters={"run_dir": str(run_dir), "models": "llama-2-7b,gemma-2-9b",
                    "prompt_tokens": 2048, "ratio_models": ["llama-3.1-8b"],
                    "ratio_links": ["100G"], "ratio_max_tokens": 1024, "tp_max": 4,
                    "tp_models": ["qwen2.5-7b"], "links": ["100G", "50GB/s"],
                    "exposure_cases": ["llama-2-7b:bf16", "llama-3.1-8b:fp8"]})
    for name in ("kv_table", "ratio_vs_length", "tp_scaling", "exposure_vs_link"):
        assert (run_dir / "figures" / f"{name}.png").is_file()
    assert not (kvlab_dirs.figures / "calculator").exists(), "published without being asked to"
    table = pd.read_csv(run_dir / "results.csv")
    exp = table[table["finding"] == "exposure_vs_link"]
    row = exp[(exp["case"] == "llama-2-7b bf16") & (exp["link"] == "100G")].iloc[0]
    est = calc.handoff_estimate("llama-2-7b", 2048, "100G")
    assert row["exposed_ms"] == pytest.approx(est.exposed_s * 1e3)
    assert bool(row["link_bound"]) is True  # 2.68 ms per layer to send, 2.2 ms to compute
    assert sorted(set(table.loc[table["finding"] == "tp_scaling", "tp"])) == [1, 2, 4]
    kv = pd.read_csv(run_dir / "kv_table.csv")
    assert list(kv["model"]) == ["llama-2-7b", "gemma-2-9b"]
    text = "\n".join(o["data"]["text/markdown"] for c in nbformat.read(str(out), 4).cells
                     if c.cell_type == "code" for o in c.outputs
                     if "data" in o and "text/markdown" in o["data"])
    assert "**llama-2-7b bf16** exposes" in text and "**link-bound**" in text
    assert f"{est.exposed_s * 1e3:,.2f} ms" in text


def test_pipeline_equal_times_is_not_link_bound():
    # 126 layers of 0.1 s each way: rounding in the running sums must not read as a backlog.
    e = exposure.pipeline_exposure([0.1] * 126, [0.1] * 126)
    assert not e.link_bound
    assert e.exposed_s == pytest.approx(0.1)
