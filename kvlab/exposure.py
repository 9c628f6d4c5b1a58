"""The layer-by-layer handoff as arithmetic: when each layer's KV is final, when the link sends it, and what the
send exposes after prefill ends (seconds in, seconds out; one entry per layer).

Pure Python, no kvlab import: kvlab.calculator prices a whole handoff with it (`handoff_estimate`), kvlab.sends
and kvlab.fabric take its release deadline, the overlap study compares a measured backlog with it.

The link sends one layer at a time, in layer order; a layer's send starts when that layer has computed and the
previous send has ended (eager), or later when it is held (`held_exposure`).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Exposure", "pipeline_exposure", "held_exposure", "deadline_release"]


# numbers.Real also admits numpy scalars (times read back from a DataFrame); bool is excluded on purpose
def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)

@dataclass(frozen=True)
class Exposure:
    """Timeline of sending each layer's KV as soon as that layer is final (times in seconds,
    measured from the start of prefill; tuples have one entry per layer).

    Fields:
        compute_end_s: when layer i finishes computing (its KV is final).
        send_start_s: ``max(compute_end_s[i], send_end_s[i-1])`` — the link sends one layer at
            a time, so a layer waits for the previous send.
        send_end_s: ``send_start_s[i] + transfer_s[i]``.
        backlog_s: ``send_start_s[i] − compute_end_s[i]``, how long layer i's KV waits for the
            link: 0 while the link keeps up, growing layer by layer when it does not.
        exposed_s: ``send_end_s[-1] − compute_end_s[-1]`` (≥ 0) — what the handoff adds to
            TTFT beyond prefill. Keeping up, this is only the last layer's transfer.
        compute_s, transfer_s: the per-layer inputs.
    """

    compute_s: tuple[float, ...]
    transfer_s: tuple[float, ...]
    compute_end_s: tuple[float, ...]
    send_start_s: tuple[float, ...]
    send_end_s: tuple[float, ...]
    backlog_s: tuple[float, ...]
    exposed_s: float

    @property
    def link_bound(self) -> bool:
        """True when the link fell behind compute at some layer (a layer had to wait)."""
        # Relative tolerance: equal compute and transfer times can differ by float rounding.
        tol = 1e-9 * max(self.compute_end_s[-1], self.send_end_s[-1])
        return any(b > tol for b in self.backlog_s)

    @property
    def hidden_fraction(self) -> float:
        """Share of the total transfer time that overlapped with compute (1 = fully hidden)."""
        total = sum(self.transfer_s)
        return 1.0 if total == 0 else max(0.0, 1.0 - self.exposed_s / total)


def _times(name: str, xs: Any) -> tuple[float, ...]:
    if isinstance(xs, (str, bytes)) or not isinstance(xs, Sequence):
        raise ValueError(f"{name} must be a sequence of seconds, one per layer; got {xs!r}")
    out = []
    for i, x in enumerate(xs):
        if not _is_real(x) or not math.isfinite(x) or x < 0:
            raise ValueError(f"{name}[{i}]={x!r}: must be a finite number of seconds ≥ 0")
        out.append(float(x))
    if not out:
        raise ValueError(f"{name} is empty: need one entry per layer")
    return tuple(out)


def pipeline_exposure(compute_s_per_layer: Sequence[float],
                      transfer_s_per_layer: Sequence[float]) -> Exposure:
    """Layer-by-layer handoff: layer i's KV is sent as soon as layer i has computed, one send at
    a time; returns the timeline and the time exposed after prefill ends.

    Args:
        compute_s_per_layer: compute time of each layer, seconds (prefill runs them in order).
        transfer_s_per_layer: transfer time of each layer's KV, seconds (same length).
    """
    c = _times("compute_s_per_layer", compute_s_per_layer)
    t = _times("transfer_s_per_layer", transfer_s_per_layer)
    if len(c) != len(t):
        raise ValueError(f"compute_s_per_layer has {len(c)} layers, transfer_s_per_layer {len(t)}")
    compute_end, start, end, backlog = [], [], [], []
    now, link_free = 0.0, 0.0
    for ci, ti in zip(c, t):
        now += ci
        s = max(now, link_free)
        link_free = s + ti
        compute_end.append(now)
        start.append(s)
        end.append(link_free)
        backlog.append(s - now)
    exposed = max(0.0, end[-1] - compute_end[-1])
    return Exposure(c, t, tuple(compute_end), tuple(start), tuple(end), tuple(backlog), exposed)


def held_exposure(compute_s_per_layer: Sequence[float], transfer_s_per_layer: Sequence[float],
                  release: int) -> float:
    """Seconds exposed after prefill when layers 0…`release` are held until layer `release` has computed and
    every later layer goes when it has computed; one send at a time, in layer order (release=0 is
    :func:`pipeline_exposure`'s eager schedule)."""
    c = _times("compute_s_per_layer", compute_s_per_layer)
    t = _times("transfer_s_per_layer", transfer_s_per_layer)
    if len(c) != len(t):
        raise ValueError(f"compute_s_per_layer has {len(c)} layers, transfer_s_per_layer {len(t)}")
    if isinstance(release, bool) or not isinstance(release, numbers.Integral) or not 0 <= release < len(c):
        raise ValueError(f"release={release!r}: expected a layer index (an int) in 0…{len(c) - 1}")
    ends, now = [], 0.0
    for ci in c:
        now += ci
        ends.append(now)
    link_free = 0.0
    for i, ti in enumerate(t):
        link_free = max(ends[max(i, release)], link_free) + ti
    return max(0.0, link_free - ends[-1])


def deadline_release(compute_s_per_layer: Sequence[float], transfer_s_per_layer: Sequence[float],
                     margin: float = 2.0) -> int:
    """The latest layer whose end can release every earlier layer's send at once without exposing more
    than eager, layer-by-layer sending — with every transfer `margin` (≥ 1) times slower than given, so a
    link that runs slower than modelled still finishes in time. Hold copies this long, and the link is
    busy only near prefill's end (kvlab.sends.release_plan's "deadline" policy)."""
    if not isinstance(margin, numbers.Real) or isinstance(margin, bool) or not 1 <= margin < math.inf:
        raise ValueError(f"margin={margin!r}: expected a finite number ≥ 1 (how much slower than modelled the link may be)")
    t = [x * margin for x in _times("transfer_s_per_layer", transfer_s_per_layer)]
    eager = held_exposure(compute_s_per_layer, t, 0)
    best = 0
    for r in range(len(t)):
        if held_exposure(compute_s_per_layer, t, r) <= eager + 1e-12:
            best = r
    return best
