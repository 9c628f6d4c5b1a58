"""Timing helpers: CUDA events on a GPU, ``time.perf_counter_ns`` on the host.

Everything here returns milliseconds (float) unless a name says otherwise
(``ns`` for host nanosecond counters). Every function works on a CPU-only
machine: the device ``"cpu"`` (the default when CUDA is absent) switches to the
host clock, so tests exercise the same logic that runs on the GPU.

Why CUDA events rather than a host clock around ``torch.cuda.synchronize()``:
an event pair measures when the *stream* reached each point, so a repeat costs
no host round trip and back-to-back repeats keep the GPU busy. A host clock
with a synchronize per repeat adds launch latency and idle gaps to every
sample.

Contents
--------
- (the statistics of the samples are kvlab.intervals': Stats, median_ci, ratio_ci.)
- :func:`time_fn` — time one callable ``n`` times after ``warmup`` calls.
- :class:`EventTimer` — named marks on any stream, elapsed between marks.
- :func:`interleave` — A B A B … rounds of several callables (cancels drift).
- :class:`HostTimer` / :func:`host_timer` — sum host nanoseconds over many
  short regions (e.g. the host work of a forward hook).
"""

from __future__ import annotations

import gc
import time
from typing import Callable, Iterable, Mapping, NamedTuple

import torch

from .parse import check_int

__all__ = [
    "balanced_orders",
    "schedule",
    "resolve_device",
    "time_fn",
    "EventTimer",
    "Sample",
    "interleave",
    "HostTimer",
    "host_timer",
]


# --------------------------------------------------------------------------- #
# devices and argument checks
# --------------------------------------------------------------------------- #
def resolve_device(device: str | int | torch.device | None = None) -> torch.device:
    """Turn a device argument into a concrete ``torch.device``.

    ``None`` → the current CUDA device when CUDA is available, else ``cpu``.
    An int ``i`` or ``"cuda"`` → ``cuda:i`` / the current CUDA device.

    Raises:
        ValueError: an unparsable name, a CUDA device without CUDA, an index
            beyond the visible GPUs, or a device type other than cpu/cuda.
    """
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    try:
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device={device!r} is not a device name; valid: 'cpu', 'cuda', 'cuda:N', an int N, or None") from exc
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise ValueError(f"device={device!r}: only 'cpu' and 'cuda[:N]' are timed here")
    if not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available on this machine; use device='cpu' or None")
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if not 0 <= index < count:
        raise ValueError(f"device={device!r}: this machine has {count} GPU(s), valid indices 0..{count - 1}")
    return torch.device("cuda", index)


def sync_device(device: torch.device) -> None:
    """Wait for all work on `device` (a no-op on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_device(device: torch.device) -> None:
    """Give cached GPU memory back to the driver between configurations (a no-op on a CPU).

    A full gc pass costs ~0.2 s, which only pays off when there is device memory to give back.
    """
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def _check_callable(name: str, fn: object) -> None:
    if not callable(fn):
        raise ValueError(f"{name}={fn!r} is not callable: pass a function taking no arguments")


# --------------------------------------------------------------------------- #
# time_fn
# --------------------------------------------------------------------------- #
def time_fn(
    fn: Callable[[], object],
    n: int = 9,
    warmup: int = 3,
    device: str | int | torch.device | None = None,
    sync: bool = True,
    sync_each: bool = False,
    stream: "torch.cuda.Stream | None" = None,
) -> list[float]:
    """Time ``fn()`` ``n`` times after ``warmup`` untimed calls.

    Args:
        fn: a callable with no arguments; its return value is ignored.
        n: timed repeats, >= 1 (notebooks use >= 9 and report the median).
        warmup: untimed calls first (allocator, cuBLAS handles, page faults,
            lazy peer-access set-up), >= 0.
        device: where ``fn`` does its work. A CUDA device → CUDA events
            recorded on ``stream`` (default: that device's current stream)
            around each call; ``cpu`` → ``time.perf_counter_ns``. ``None`` →
            the current CUDA device if there is one, else cpu.
        sync: CUDA only. True: ``torch.cuda.synchronize(device)`` after the
            warm-up and after the last repeat, so the first sample does not
            queue behind warm-up work on other streams and every stream is
            drained before returning. False: only wait for the last end event
            (work ``fn`` left on other streams may still be running).
        sync_each: CUDA only. Wait for each repeat's end event before the next
            call. Default False: repeats are enqueued back to back, so a sample
            is GPU time whenever the host keeps ahead of the GPU. True: each
            sample starts from an idle GPU and includes the launch latency of
            ``fn``'s first kernel.
        stream: CUDA only; the stream the events go on. ``fn`` is called with
            this stream made current, so its default-stream work lands there.

    Returns:
        ``n`` durations in ms, one per timed repeat, in call order.

    Raises:
        ValueError: ``fn`` not callable, ``n < 1``, ``warmup < 0``, or a bad
            device (see :func:`resolve_device`).
    """
    _check_callable("fn", fn)
    n = check_int("n", n, 1)
    warmup = check_int("warmup", warmup, 0)
    dev = resolve_device(device)
    if dev.type == "cpu":
        for _ in range(warmup):
            fn()
        out = []
        for _ in range(n):
            t0 = time.perf_counter_ns()
            fn()
            out.append((time.perf_counter_ns() - t0) / 1e6)
        return out
    return _time_cuda(fn, n, warmup, dev, sync, sync_each, stream)


def _time_cuda(fn, n, warmup, dev, sync, sync_each, stream) -> list[float]:
    with torch.cuda.device(dev):
        s = stream if stream is not None else torch.cuda.current_stream(dev)
        # Events are created before any timed call: creating one costs a driver
        # call that would otherwise land between start and end.
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        with torch.cuda.stream(s):
            for _ in range(warmup):
                fn()
            if sync:
                torch.cuda.synchronize(dev)
            for i in range(n):
                starts[i].record(s)
                fn()
                ends[i].record(s)
                if sync_each:
                    ends[i].synchronize()
        if sync:
            torch.cuda.synchronize(dev)
        else:
            ends[-1].synchronize()
        return [float(a.elapsed_time(b)) for a, b in zip(starts, ends)]


# --------------------------------------------------------------------------- #
# EventTimer
# --------------------------------------------------------------------------- #
class EventTimer:
    """Named time marks inside a larger region, on any stream of one device.

    ``mark(name, stream)`` records a CUDA event on ``stream`` (GPU) or reads
    ``perf_counter_ns`` (CPU); after the work is done, ``elapsed_ms(a, b)``
    gives the signed time from mark ``a`` to mark ``b``. Marks may sit on
    different streams of the same GPU — that is how the handoff measures
    exposure = (last copy done on the side stream) − (prefill's last kernel
    done on the compute stream). Marking the same name again overwrites it.

    Pass every name you will mark in ``names`` to pre-create the events, so a
    mark inside a forward hook is one dict lookup plus one ``cudaEventRecord``
    with no allocation. Not thread-safe.

    CUDA events only compare within one device: marks for an elapsed time must
    be recorded on streams of ``device`` (a peer copy issued from GPU 0 runs on
    a GPU 0 stream, so it qualifies).
    """

    def __init__(self, device: str | int | torch.device | None = None, names: Iterable[str] = ()):
        self.device = resolve_device(device)
        self.is_cuda = self.device.type == "cuda"
        self._events: dict[str, object] = {}
        self._host_ns: dict[str, int] = {}
        self._order: list[str] = []
        self._marked: set[str] = set()
        for name in names:
            self._check_name(name)
            if self.is_cuda:
                self._events[name] = torch.cuda.Event(enable_timing=True)

    @staticmethod
    def _check_name(name: object) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"mark name {name!r}: expected a non-empty str")

    def mark(self, name: str, stream: "torch.cuda.Stream | None" = None) -> None:
        """Record mark ``name`` now (CPU) or at this point of ``stream`` (GPU).

        ``stream`` defaults to the current stream of the timer's device; pass
        it explicitly inside hot hooks (looking up the current stream costs a
        little host time). A stream of another device raises ValueError.
        """
        if self.is_cuda:
            ev = self._events.get(name)
            if ev is None:
                self._check_name(name)
                ev = self._events[name] = torch.cuda.Event(enable_timing=True)
            s = stream if stream is not None else torch.cuda.current_stream(self.device)
            if s.device_index != self.device.index:
                raise ValueError(f"mark {name!r} on a stream of {s.device}, but this timer's marks are on {self.device}")
            ev.record(s)
        else:
            if name not in self._host_ns:
                self._check_name(name)
            self._host_ns[name] = time.perf_counter_ns()
        if name not in self._marked:
            self._marked.add(name)
            self._order.append(name)

    def adopt(self, name: str, event) -> None:
        """Use an event recorded elsewhere as mark ``name`` — e.g. a transport's per-layer completion event,
        recorded on the copy stream right behind the copy. On a CPU (``event`` None, work synchronous) the
        mark is taken now."""
        if self.is_cuda:
            if event is None:
                raise ValueError(f"mark {name!r}: a GPU timer needs a recorded CUDA event, got None")
            self._check_name(name)
            self._events[name] = event
        else:
            self._check_name(name)
            self._host_ns[name] = time.perf_counter_ns()
        if name not in self._marked:
            self._marked.add(name)
            self._order.append(name)

    @property
    def names(self) -> list[str]:
        """Names marked so far, in first-marked order."""
        return list(self._order)

    def synchronize(self) -> None:
        """Wait until every recorded CUDA event has happened (no-op on CPU)."""
        if self.is_cuda:
            for name in self._order:
                self._events[name].synchronize()

    def elapsed_ms(self, start: str, end: str) -> float:
        """Signed ms from mark ``start`` to mark ``end`` (negative if ``end`` came first).

        Waits for both CUDA events first. Raises ValueError for a name that
        was never marked (the message lists those that were).
        """
        for name in (start, end):
            if name not in self._marked:
                raise ValueError(f"mark {name!r} was never recorded; marked so far: {self._order}")
        if not self.is_cuda:
            return (self._host_ns[end] - self._host_ns[start]) / 1e6
        a, b = self._events[start], self._events[end]
        a.synchronize()
        b.synchronize()
        return float(a.elapsed_time(b))

    def since(self, origin: str) -> dict[str, float]:
        """Every mark's signed ms after mark ``origin`` (a timeline), in mark order."""
        return {name: self.elapsed_ms(origin, name) for name in self._order}

    def reset(self) -> None:
        """Forget all marks (pre-created events are kept for reuse)."""
        self._order.clear()
        self._marked.clear()
        self._host_ns.clear()


# --------------------------------------------------------------------------- #
# interleave
# --------------------------------------------------------------------------- #
class Sample(NamedTuple):
    """One timed call in :func:`interleave`: ``pd.DataFrame(samples)`` is tidy."""

    name: str
    round: int
    ms: float


def balanced_orders(k: int, rounds: int) -> list[list[int]]:
    """Run orders of ``k`` variants for ``rounds`` rounds, from a Williams design.

    Over one cycle of the design (k rounds for even k, 2k for odd k) every variant runs in every position
    equally often and, within the rounds, directly follows every other variant equally often, so what one
    run leaves behind for the next (the GPU's clock and power state, a warm cache) does not always land on
    the same variant. Across a round boundary (the last run of one round, the first of the next) the pairs
    are not balanced: a variant that opens a round follows the same neighbour each cycle, so it has one
    predecessor twice per cycle and the others once. A cyclic rotation (A B C, B C A, C A B) balances
    positions only: there B always follows A.
    Rounds past one cycle repeat it; k = 2 gives A B, B A, A B, …

    Raises ValueError for k < 1 or rounds < 0.
    """
    k = check_int("k", k, 1)
    rounds = check_int("rounds", rounds, 0)
    first, lo, hi = [0], 1, k - 1
    while len(first) < k:
        if len(first) % 2:
            first.append(lo)
            lo += 1
        else:
            first.append(hi)
            hi -= 1
    rows = [[(x + i) % k for x in first] for i in range(k)]
    if k % 2 and k > 1:
        rows += [row[::-1] for row in rows]
    return [list(rows[r % len(rows)]) for r in range(rounds)]


def schedule(names, rounds: int, warmup: int = 0) -> list[tuple[int, str]]:
    """The run order of a paired measurement: ``[(round, name), ...]``, warm-up rounds first with negative
    round numbers (-warmup … -1: run, then discard), then rounds 0 … rounds-1. Every round runs every name
    once, in the order of :func:`balanced_orders` (two names: A B, B A, A B, …). Every A/B or A/B/C…
    measurement in kvlab walks this list, so they all share one ordering rule.

    Raises ValueError for no names, duplicate names, rounds < 1 or warmup < 0.
    """
    names = list(names)
    if not names or len(set(names)) != len(names):
        raise ValueError(f"names={names!r}: expected one or more distinct names")
    rounds = check_int("rounds", rounds, 1)
    warmup = check_int("warmup", warmup, 0)
    orders = balanced_orders(len(names), warmup + rounds)
    return [(r - warmup, names[i]) for r in range(warmup + rounds) for i in orders[r]]


def interleave(
    fns: Mapping[str, Callable[[], object]],
    rounds: int = 9,
    warmup: int = 1,
    device: str | int | torch.device | None = None,
    sync_each: bool = True,
    rotate: bool = False,
) -> list[Sample]:
    """Time several callables in alternation: A B A B … (or balanced orders with ``rotate``).

    Drift (clock boost, thermal state, a neighbour's job) then hits every
    variant alike instead of whichever happened to run last, so the paired
    difference of medians is meaningful.

    Args:
        fns: name → callable with no arguments; at least one, in the order run.
        rounds: timed rounds, >= 1; each round calls every function once.
        warmup: untimed rounds first, >= 0.
        device: as in :func:`time_fn` (CUDA events, or the host clock on cpu).
        sync_each: CUDA only. Wait for each call to finish before starting the
            next (default True), so one variant's queued work never overlaps
            another's timed window. False enqueues everything and waits once.
        rotate: run round r in the order of :func:`balanced_orders` (a Williams
            design: every variant follows every other equally often per cycle).

    Returns:
        ``rounds × len(fns)`` :class:`Sample` rows ``(name, round, ms)`` in run order.
    """
    if not isinstance(fns, Mapping) or len(fns) == 0:
        raise ValueError(f"fns={fns!r}: expected a non-empty dict of name -> callable")
    for name, fn in fns.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"fns key {name!r}: expected a non-empty str")
        _check_callable(f"fns[{name!r}]", fn)
    rounds = check_int("rounds", rounds, 1)
    warmup = check_int("warmup", warmup, 0)
    dev = resolve_device(device)
    names = list(fns)
    k = len(names)

    orders = balanced_orders(k, rounds + warmup)

    def order(r: int) -> list[str]:
        return [names[i] for i in orders[r]] if rotate else names

    for r in range(warmup):
        for name in order(r):
            fns[name]()
    if dev.type == "cpu":
        out = []
        for r in range(rounds):
            for name in order(r):
                t0 = time.perf_counter_ns()
                fns[name]()
                out.append(Sample(name, r, (time.perf_counter_ns() - t0) / 1e6))
        return out

    with torch.cuda.device(dev):
        s = torch.cuda.current_stream(dev)
        pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(rounds * k)]
        torch.cuda.synchronize(dev)
        plan: list[tuple[str, int]] = []
        for r in range(rounds):
            for name in order(r):
                start, end = pairs[len(plan)]
                start.record(s)
                fns[name]()
                end.record(s)
                if sync_each:
                    # a whole-device sync: the callable may use side streams
                    torch.cuda.synchronize(dev)
                plan.append((name, r))
        torch.cuda.synchronize(dev)
        return [Sample(name, r, float(a.elapsed_time(b))) for (name, r), (a, b) in zip(plan, pairs)]


# --------------------------------------------------------------------------- #
# host timer
# --------------------------------------------------------------------------- #
class HostTimer:
    """Sums host wall time over many short regions: ``with t: ...`` adds to ``t.ns``.

    Used to measure the host cost of per-layer hooks directly (prefill at 1k
    tokens is host-bound, so every microsecond of hook work shows up in the
    end-to-end time). One enter/exit pair costs well under a microsecond.
    Regions must not nest on the same timer (RuntimeError).

    Attributes:
        ns: total host nanoseconds inside the regions (int).
        calls: number of completed regions (int).
    """

    __slots__ = ("ns", "calls", "_t0")

    def __init__(self) -> None:
        self.ns = 0
        self.calls = 0
        self._t0: int | None = None

    def __enter__(self) -> "HostTimer":
        if self._t0 is not None:
            raise RuntimeError("HostTimer regions cannot nest: use a second HostTimer for the inner region")
        self._t0 = time.perf_counter_ns()
        return self

    def __exit__(self, *exc) -> bool:
        self.ns += time.perf_counter_ns() - self._t0
        self.calls += 1
        self._t0 = None
        return False

    @property
    def ms(self) -> float:
        """Total in ms."""
        return self.ns / 1e6

    @property
    def us_per_call(self) -> float:
        """Mean µs per region (NaN before the first region)."""
        return self.ns / 1e3 / self.calls if self.calls else float("nan")

    def reset(self) -> None:
        """Zero the totals."""
        self.ns = 0
        self.calls = 0
        self._t0 = None

    def __repr__(self) -> str:
        return f"HostTimer(ns={self.ns}, calls={self.calls})"


def host_timer() -> HostTimer:
    """A fresh :class:`HostTimer` (``ht = host_timer(); with ht: ...; ht.ms``)."""
    return HostTimer()
