"""Tests of kvlab.timing: statistics by hand, host-clock timing, marks, interleaving, host timer."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab import intervals, timing
from kvlab.timing import EventTimer, HostTimer, Sample, host_timer, interleave, time_fn
from kvlab.intervals import Stats, fmt_ms, stats

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# --------------------------------------------------------------------------- stats
def test_stats_odd_by_hand():
    s = stats([3.0, 1.0, 2.0, 5.0, 4.0])
    assert (s.n, s.median, s.min, s.max, s.mean) == (5, 3.0, 1.0, 5.0, 3.0)
    # sample std: squared deviations 4+1+0+1+4 = 10, / (5-1) = 2.5
    assert s.std == pytest.approx(math.sqrt(2.5))
    assert s.p10 is None and s.p90 is None  # fewer than 10 samples
    assert s.spread == 4.0
    assert s.unit == "ms"


def test_stats_even_median_is_mean_of_middle_two():
    s = stats([10.0, 1.0, 3.0, 2.0])
    assert s.median == 2.5
    assert s.mean == 4.0


def test_stats_percentiles_from_ten_samples():
    s = stats(list(range(1, 11)))
    # linear interpolation: position 0.1 * 9 = 0.9 → 1 + 0.9; position 8.1 → 9 + 0.1
    assert s.p10 == pytest.approx(1.9)
    assert s.p90 == pytest.approx(9.1)


def test_stats_single_sample_and_inputs():
    s = stats([7.5], unit="µs")
    assert (s.n, s.median, s.min, s.max, s.std) == (1, 7.5, 7.5, 7.5, 0.0)
    assert stats(np.array([1.0, 2.0, 3.0])).median == 2.0
    assert stats(torch.tensor([4.0, 6.0])).median == 5.0
    assert stats(x for x in [1, 2, 3]).mean == 2.0


def test_stats_format():
    s = stats([11.8, 11.2, 13.04])
    assert s.fmt() == "11.8 (11.2–13) ms"
    assert str(s) == "11.8 (11.2–13) ms"
    assert s.fmt(digits=2, unit=False) == "12 (11–13)"
    assert Stats(3, 1.0, 0.5, 2.0, 1.0, 0.1, unit="µs").fmt() == "1 (0.5–2) µs"
    assert stats([1.0]).to_dict()["median"] == 1.0


@pytest.mark.parametrize("bad", [[], [1.0, float("nan")], [float("inf")]])
def test_stats_rejects(bad):
    with pytest.raises(ValueError, match="sample"):
        stats(bad)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(min_value=-1e6, max_value=1e6, allow_nan=False), min_size=1, max_size=40))
def test_stats_order_properties(xs):
    s = stats(xs)
    assert s.min <= s.median <= s.max
    assert s.min - 1e-9 <= s.mean <= s.max + 1e-9
    assert s.n == len(xs)
    if s.p10 is not None:
        assert s.min <= s.p10 <= s.p90 <= s.max


def test_fmt_ms_units():
    assert fmt_ms(0.0118) == "11.8 µs"
    assert fmt_ms(3.4) == "3.4 ms"
    assert fmt_ms(826.0) == "826 ms"
    assert fmt_ms(1500.0) == "1.5 s"
    assert fmt_ms(0.0000005) == "0.5 ns"


# --------------------------------------------------------------------------- time_fn
def test_time_fn_cpu_counts_calls_and_excludes_warmup():
    calls = []
    out = time_fn(lambda: calls.append(1), n=5, warmup=2, device="cpu")
    assert len(out) == 5
    assert len(calls) == 7
    assert all(x >= 0 for x in out)


def test_time_fn_cpu_measures_sleep():
    out = time_fn(lambda: time.sleep(0.002), n=3, warmup=0, device="cpu")
    # a sleep never returns early, so each sample is at least 2 ms (it may be longer on a busy host)
    assert all(x >= 2.0 for x in out)
    assert all(x < 1000 for x in out)


def test_time_fn_warmup_is_not_timed():
    state = {"i": 0}

    def fn():
        state["i"] += 1
        if state["i"] <= 2:  # only the warm-up calls are slow
            time.sleep(0.05)

    out = time_fn(fn, n=3, warmup=2, device="cpu")
    assert max(out) < 50


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"n": 0}, "n=0"),
        ({"n": -1}, "n=-1"),
        ({"n": 2.5}, "n=2.5"),
        ({"n": True}, "n=True"),
        ({"warmup": -1}, "warmup=-1"),
        ({"device": "tpu"}, "device='tpu'"),
        ({"device": "not a device"}, "not a device"),
    ],
)
def test_time_fn_bad_input(kwargs, match):
    calls = []
    with pytest.raises(ValueError, match=match):
        time_fn(lambda: calls.append(1), **kwargs)
    assert calls == []  # refused before running anything


def test_time_fn_not_callable():
    with pytest.raises(ValueError, match="not callable"):
        time_fn(42)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_cuda_device_refused_without_cuda():
    with pytest.raises(ValueError, match="CUDA is not available"):
        time_fn(lambda: None, device="cuda")


def test_resolve_device_default_matches_hardware():
    dev = timing.resolve_device(None)
    assert dev.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert timing.resolve_device("cpu") == torch.device("cpu")


# --------------------------------------------------------------------------- EventTimer
def test_event_timer_cpu_marks():
    t = EventTimer("cpu", names=["a", "b"])
    t.mark("a")
    time.sleep(0.003)
    t.mark("b")
    assert t.elapsed_ms("a", "b") >= 3.0
    assert t.elapsed_ms("b", "a") == pytest.approx(-t.elapsed_ms("a", "b"))
    assert t.names == ["a", "b"]
    assert list(t.since("a")) == ["a", "b"]
    assert t.since("a")["a"] == 0.0


def test_event_timer_remark_overwrites_and_reset():
    t = EventTimer("cpu")
    t.mark("x")
    t.mark("y")
    time.sleep(0.002)
    t.mark("x")  # now after y
    assert t.elapsed_ms("y", "x") >= 2.0
    assert t.names == ["x", "y"]
    t.reset()
    assert t.names == []
    with pytest.raises(ValueError, match="never recorded"):
        t.elapsed_ms("x", "y")


def test_event_timer_bad_names():
    t = EventTimer("cpu")
    t.mark("a")
    with pytest.raises(ValueError, match="'zz' was never recorded; marked so far: \\['a'\\]"):
        t.elapsed_ms("a", "zz")
    with pytest.raises(ValueError, match="non-empty str"):
        t.mark("")
    with pytest.raises(ValueError, match="non-empty str"):
        EventTimer("cpu", names=[None])


# --------------------------------------------------------------------------- interleave
def test_interleave_order_and_rows():
    log = []
    fns = {"A": lambda: log.append("A"), "B": lambda: log.append("B")}
    out = interleave(fns, rounds=3, warmup=1, device="cpu")
    assert log == ["A", "B"] * 4  # one warm-up round + three timed rounds
    assert [(s.name, s.round) for s in out] == [("A", 0), ("B", 0), ("A", 1), ("B", 1), ("A", 2), ("B", 2)]
    assert all(isinstance(s, Sample) and s.ms >= 0 for s in out)


def test_interleave_rotate():
    log = []
    fns = {k: (lambda k=k: log.append(k)) for k in "ABCD"}
    interleave(fns, rounds=4, warmup=0, device="cpu", rotate=True)
    assert "".join(log) == "ABDC" + "BCAD" + "CDBA" + "DACB"  # a Williams square


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 7, 8])
def test_balanced_orders_balance_positions_and_predecessors(k):
    from collections import Counter

    from kvlab.timing import balanced_orders

    cycle = k if k % 2 == 0 or k == 1 else 2 * k
    rows = balanced_orders(k, 2 * cycle + 1)
    assert all(sorted(r) == list(range(k)) for r in rows)
    assert rows[cycle:2 * cycle] == rows[:cycle]  # the design repeats
    one = rows[:cycle]
    positions = Counter((i, v) for r in one for i, v in enumerate(r))
    assert len(set(positions.values())) == 1 and len(positions) == k * k
    if k > 1:
        follows = Counter((a, b) for r in one for a, b in zip(r, r[1:]))
        assert len(follows) == k * (k - 1) and len(set(follows.values())) == 1  # every ordered pair, equally often
    assert balanced_orders(2, 4) == [[0, 1], [1, 0], [0, 1], [1, 0]]
    with pytest.raises(ValueError):
        balanced_orders(0, 3)


def test_interleave_tidy_frame():
    import pandas as pd

    df = pd.DataFrame(interleave({"x": lambda: None}, rounds=2, warmup=0, device="cpu"))
    assert list(df.columns) == ["name", "round", "ms"]
    assert len(df) == 2


@pytest.mark.parametrize(
    "fns, kwargs, match",
    [
        ({}, {}, "non-empty dict"),
        ({"a": 3}, {}, "not callable"),
        ({"a": lambda: None}, {"rounds": 0}, "rounds=0"),
        ({"a": lambda: None}, {"warmup": -2}, "warmup=-2"),
    ],
)
def test_interleave_bad_input(fns, kwargs, match):
    with pytest.raises(ValueError, match=match):
        interleave(fns, device="cpu", **kwargs)


# --------------------------------------------------------------------------- host timer
def test_host_timer_sums_regions():
    ht = host_timer()
    assert isinstance(ht, HostTimer)
    for _ in range(3):
        with ht:
            time.sleep(0.001)
    assert ht.calls == 3
    assert ht.ns >= 3_000_000
    assert ht.ms == ht.ns / 1e6
    assert ht.us_per_call >= 1000
    ht.reset()
    assert (ht.ns, ht.calls) == (0, 0)
    assert math.isnan(ht.us_per_call)


def test_host_timer_excludes_time_outside_regions():
    ht = HostTimer()
    with ht:
        pass
    time.sleep(0.005)
    with ht:
        pass
    assert ht.ns < 5_000_000


def test_host_timer_refuses_nesting():
    ht = HostTimer()
    with pytest.raises(RuntimeError, match="cannot nest"):
        with ht:
            with ht:
                pass


# --------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@needs_cuda
def test_time_fn_cuda_copy():
    a = torch.empty(64 << 20, dtype=torch.uint8, device="cuda").random_(0, 256)
    b = torch.empty_like(a)
    out = time_fn(lambda: b.copy_(a), n=9, warmup=3, device="cuda")
    assert len(out) == 9 and all(x > 0 for x in out)
    assert torch.equal(a, b)


@pytest.mark.gpu
@needs_cuda
def test_event_timer_across_streams():
    side = torch.cuda.Stream()
    t = EventTimer("cuda", names=["start", "side_done", "main_done"])
    x = torch.randn(4096, 4096, device="cuda")
    t.mark("start")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(10):
            x @ x
    t.mark("side_done", side)
    t.mark("main_done")
    # the side stream did ten matmuls, the main stream nothing after start
    assert t.elapsed_ms("start", "side_done") > t.elapsed_ms("start", "main_done")


def test_adopt_takes_a_mark_now_on_a_cpu_and_orders_it():
    from kvlab.timing import EventTimer

    t = EventTimer("cpu")
    t.mark("start")
    t.adopt("copy_end", None)  # CPU: work is synchronous, the mark is now
    assert t.names == ["start", "copy_end"]
    assert t.elapsed_ms("start", "copy_end") >= 0
    with pytest.raises(ValueError, match="non-empty"):
        t.adopt("", None)


def test_median_ci_brackets_the_median_and_narrows_with_more_rounds():
    rng = np.random.default_rng(1)
    few = rng.normal(3.0, 5.0, 9)
    many = rng.normal(3.0, 5.0, 400)
    lo9, hi9 = intervals.median_ci(few)
    lo, hi = intervals.median_ci(many)
    assert lo9 <= np.median(few) <= hi9 and lo <= np.median(many) <= hi
    assert hi - lo < hi9 - lo9
    assert lo < 3.0 < hi  # the true median, with 400 samples
    assert intervals.median_ci(few) == (lo9, hi9)  # deterministic
    assert all(math.isnan(v) for v in intervals.median_ci([2.5])), "one sample has no interval"
    assert all(math.isnan(v) for v in intervals.median_ci([2.5, 2.6])), "nor two"
    lo, hi = intervals.ratio_ci([1.0, 1.01, 0.99, 1.0], [2.0, 2.02, 1.98, 2.0, 2.01])
    assert lo < 0.5 < hi and hi - lo < 0.02
    assert all(math.isnan(v) for v in intervals.ratio_ci([1.0], [2.0, 2.0, 2.0]))


@pytest.mark.parametrize("bad", [[], [1.0, float("nan")]])
def test_median_ci_rejects_bad_samples(bad):
    with pytest.raises(ValueError):
        intervals.median_ci(bad)
    with pytest.raises(ValueError, match="level"):
        intervals.median_ci([1.0, 2.0], level=1.5)


def test_quantile_ci_is_the_median_ci_at_one_half_and_covers_a_tail_quantile():
    x = np.random.default_rng(3).exponential(size=400)
    assert intervals.quantile_ci(x, 0.5) == intervals.median_ci(x)
    lo, hi = intervals.quantile_ci(x, 0.95)
    assert lo < np.quantile(x, 0.95) < hi and hi < x.max()
    assert lo > intervals.median_ci(x)[1]  # the tail's interval lies above the median's
    assert all(math.isnan(v) for v in intervals.quantile_ci([1.0, 2.0], 0.95))
    with pytest.raises(ValueError, match="q=1.5"):
        intervals.quantile_ci(x, 1.5)
    with pytest.raises(ValueError, match="non-finite"):
        intervals.quantile_ci([1.0, float("inf"), 2.0], 0.95)


def test_mean_ci_covers_the_mean_and_narrows_with_more_samples():
    rng = np.random.default_rng(5)
    few, many = rng.normal(10, 2, size=20), rng.normal(10, 2, size=2000)
    lo, hi = intervals.mean_ci(few)
    assert lo < few.mean() < hi
    lo2, hi2 = intervals.mean_ci(many)
    assert lo2 < 10 < hi2 and (hi2 - lo2) < (hi - lo) / 4
    with pytest.raises(ValueError, match="mean_ci"):
        intervals.mean_ci([])
