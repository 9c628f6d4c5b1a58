"""The row-copy Triton kernel against its torch reference, on CPU through Triton's interpreter.

TRITON_INTERPRET=1 is set for every test here by an autouse fixture, before anything imports or
decorates a Triton kernel: kvlab.paged.kernels builds its kernel lazily on first use (Triton reads the
variable when a function is decorated), and the fixture restores the environment afterwards so the
rest of the suite (notebooks executed in subprocesses) does not inherit it. Sizes are tiny: the
interpreter runs each program in Python.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlab.paged import kernels
from kvlab.paged.kernels import KernelConfig

triton = pytest.importorskip("triton")


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _rows(n, elems, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(n, elems, generator=g).to(dtype)
    return torch.randint(0, 255, (n, elems), generator=g, dtype=torch.int64).to(dtype)


def _poisoned(n, elems, dtype):
    t = torch.empty(n, elems, dtype=dtype)
    if dtype.is_floating_point:
        t.fill_(float("nan"))
    else:
        t.fill_(123)
    return t


def _bits(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def test_interpreter_is_what_runs_here():
    ok, why = kernels.triton_status("cpu")
    assert ok, why
    assert "interpreter" in why


@pytest.mark.parametrize("dtype,elems", [(torch.bfloat16, 64), (torch.float16, 24), (torch.float32, 10),
                                         (torch.uint8, 7)])
@pytest.mark.parametrize("config", [KernelConfig(block=1024, rows_per_program=2, num_warps=4),
                                    KernelConfig(block=4, rows_per_program=1, num_warps=1, streaming=False),
                                    KernelConfig(block=0, rows_per_program=4, num_warps=2),
                                    # persistent: 4 "SMs" on a CPU × 1 program each, so programs loop over tiles
                                    KernelConfig(block=4, rows_per_program=1, num_warps=1, persistent=1),
                                    KernelConfig(block=2, rows_per_program=2, num_warps=1, persistent=1, stages=3)])
def test_scatter_matches_reference(dtype, elems, config):
    src = _rows(9, elems, dtype)
    sidx = torch.tensor([4, 0, 8, 3, 7], dtype=torch.int64)
    didx = torch.tensor([1, 10, 5, 2, 9], dtype=torch.int64)
    got = _poisoned(11, elems, dtype)
    want = got.clone()
    assert kernels.copy_rows(src, sidx, got, didx, config=config, backend="triton") == "triton"
    kernels.copy_rows_reference(src, sidx, want, didx)
    assert torch.equal(_bits(got), _bits(want))
    # rows outside dst_idx keep their poison
    untouched = [i for i in range(11) if i not in didx.tolist()]
    assert torch.equal(_bits(got[untouched]), _bits(_poisoned(len(untouched), elems, dtype)))


@pytest.mark.parametrize("config", [KernelConfig(), KernelConfig(block=2, rows_per_program=4, num_warps=1)])
def test_gather_into_consecutive_rows(config):
    src = _rows(6, 12, torch.float16)
    sidx = torch.tensor([5, 2, 2, 0], dtype=torch.int64)  # a gather may read a row twice
    out = _poisoned(6, 12, torch.float16)
    kernels.copy_rows(src, sidx, out, None, config=config, backend="triton")
    assert torch.equal(out[:4], kernels.gather_rows_reference(src, sidx))
    assert torch.isnan(out[4:]).all()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), n_src=st.integers(1, 12), n_dst=st.integers(1, 12), elems=st.integers(1, 40),
       block=st.sampled_from([0, 2, 8, 64]), rpp=st.sampled_from([1, 2, 4]),
       dtype=st.sampled_from([torch.bfloat16, torch.float32, torch.uint8]))
def test_random_tables_match_reference(data, n_src, n_dst, elems, block, rpp, dtype):
    r = data.draw(st.integers(0, min(n_src, n_dst)), label="rows moved")
    sidx = data.draw(st.lists(st.integers(0, n_src - 1), min_size=r, max_size=r), label="src rows")
    didx = data.draw(st.permutations(range(n_dst)), label="dst order")[:r]
    src = _rows(n_src, elems, dtype, seed=n_src * 31 + elems)
    got = _poisoned(n_dst, elems, dtype)
    want = got.clone()
    s, d = torch.tensor(sidx, dtype=torch.int64), torch.tensor(didx, dtype=torch.int64)
    kernels.copy_rows(src, s, got, d, config=KernelConfig(block=block, rows_per_program=rpp, num_warps=1),
                      backend="triton", check_bounds=True)
    kernels.copy_rows_reference(src, s, want, d)
    assert torch.equal(_bits(got), _bits(want))


def test_word_dtype_is_the_widest_that_divides():
    assert kernels.word_dtype(16384) == torch.int64  # a Qwen2.5-7B 16-token block row
    assert kernels.word_dtype(12) == torch.int32
    assert kernels.word_dtype(6) == torch.int16
    assert kernels.word_dtype(7) == torch.uint8
    base = torch.zeros(16, dtype=torch.bfloat16)
    assert kernels.word_dtype(8, base[1:]) == torch.int16  # a 2-byte offset rules out wider words


def test_resolved_block_never_exceeds_the_row():
    assert KernelConfig(block=1024).resolved_block(2048) == 1024
    assert KernelConfig(block=1024).resolved_block(3) == 4
    assert KernelConfig(block=0).resolved_block(2048) == 2048
    assert KernelConfig(block=0).resolved_block(1 << 20) == 4096


def test_candidates_respect_the_register_budget():
    for row_words in (16, 2048, 16384):
        cands = kernels.candidate_configs(row_words)
        assert cands
        for c in cands:
            words_per_thread = c.block * c.rows_per_program / (32 * c.num_warps)
            assert 1 <= words_per_thread <= 32, c


def test_tune_on_cpu_keeps_the_default():
    src = _rows(4, 8)
    cfg, table = kernels.tune(src, torch.tensor([1, 2]), _poisoned(4, 8, torch.bfloat16), torch.tensor([0, 3]))
    assert cfg == kernels.DEFAULT_CONFIG and table == []


def test_without_interpreter_auto_falls_back_and_triton_refuses(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    ok, why = kernels.triton_status("cpu")
    assert not ok and "TRITON_INTERPRET" in why
    src, dst = _rows(3, 4), _poisoned(3, 4, torch.bfloat16)
    idx = torch.tensor([2, 0], dtype=torch.int64)
    assert kernels.copy_rows(src, idx, dst, idx, backend="auto") == "torch"
    assert torch.equal(dst[[2, 0]], src[[2, 0]])
    with pytest.raises(ValueError, match="not available"):
        kernels.copy_rows(src, idx, dst, idx, backend="triton")


@pytest.mark.parametrize("case", ["elems", "dtype", "idx_dtype", "idx_2d", "dst_len", "not_contig", "bounds_src",
                                  "bounds_dst", "too_few_rows", "backend", "idx_list", "dst_idx_list"])
def test_bad_input_raises_before_writing(case):
    src = _rows(5, 8, torch.float32)
    dst = _poisoned(5, 8, torch.float32)
    sidx = torch.tensor([0, 1], dtype=torch.int64)
    didx = torch.tensor([2, 3], dtype=torch.int64)
    kw = {}
    if case == "elems":
        dst = _poisoned(5, 6, torch.float32)
    elif case == "dtype":
        dst = _poisoned(5, 8, torch.float16)
    elif case == "idx_dtype":
        sidx = sidx.int()
    elif case == "idx_2d":
        sidx = sidx.view(1, 2)
    elif case == "dst_len":
        didx = torch.tensor([2], dtype=torch.int64)
    elif case == "not_contig":
        src = _rows(8, 10, torch.float32)[:, :8]
    elif case == "bounds_src":  # checked by default: the Triton kernel would not notice
        sidx = torch.tensor([0, 5], dtype=torch.int64)
    elif case == "bounds_dst":
        didx = torch.tensor([-1, 3], dtype=torch.int64)
    elif case == "too_few_rows":
        didx = None
        sidx = torch.tensor([0, 1, 2, 3, 4, 0], dtype=torch.int64)
    elif case == "backend":
        kw["backend"] = "cuda"
    elif case == "idx_list":  # an audit found lists raising a raw AttributeError
        sidx = [0, 1]
    elif case == "dst_idx_list":
        didx = [2, 3]
    with pytest.raises(ValueError):
        kernels.copy_rows(src, sidx, dst, didx, **kw)
    assert torch.isnan(dst).all()


@pytest.mark.parametrize("kw", [dict(block=3), dict(rows_per_program=0), dict(num_warps=3), dict(block=-2),
                                dict(persistent=-1), dict(persistent=65), dict(stages=0)])
def test_kernel_config_validates(kw):
    with pytest.raises(ValueError):
        KernelConfig(**kw)


def test_gpu_mode_kernel_is_compiled_even_under_the_interpreter_setting():
    # the autouse fixture set TRITON_INTERPRET=1; the kernel built for CUDA tensors must still be a JIT kernel
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(kernels._kernel(True), InterpretedFunction)
    assert not isinstance(kernels._kernel(False), InterpretedFunction)


@pytest.mark.gpu
def test_gpu_kernel_matches_reference_and_tunes(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    dev = torch.device("cuda")
    src = _rows(64, 8192, torch.bfloat16).to(dev)  # 16 KiB rows
    sidx = torch.randperm(64)[:40].to(dev)
    didx = torch.randperm(80)[:40].to(dev)
    got = _poisoned(80, 8192, torch.bfloat16).to(dev)
    want = got.clone()
    cfg, table = kernels.tune(src, sidx, got, didx, repeats=2)
    assert table and cfg in kernels.candidate_configs(2048)
    got.fill_(float("nan"))
    kernels.copy_rows(src, sidx, got, didx, config=cfg, backend="triton")
    kernels.copy_rows_reference(src, sidx, want, didx)
    torch.cuda.synchronize()
    assert torch.equal(_bits(got), _bits(want))
