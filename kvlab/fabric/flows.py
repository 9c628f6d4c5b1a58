"""Flows moving bytes over a fabric on a SimPy clock, at max-min fair rates.

Rates are piecewise constant: they change only when a flow starts or ends. At each such instant the
fabric brings every active flow's remaining bytes up to date, recomputes the rates
(:func:`kvlab.fabric.sharing.max_min_rates`) and schedules one SimPy timeout for the next completion;
a timeout made stale by a later change is ignored (a generation counter), since SimPy cannot cancel one.

Two things keep it fast with thousands of flows and millions of events:

* recomputing is deferred to a zero-delay event, so every flow that starts or ends at one instant
  (a burst, flows finishing together) costs one recomputation;
* most starts and ends change no other flow's rate, and need no recomputation at all. A new flow
  given the least spare capacity on its route, x, leaves the allocation max-min fair when x > 0 (it
  crosses no saturated link, so every other flow keeps its bottleneck) and x is its own ceiling or at
  least every other rate on the link where it is tightest (which it then saturates: its bottleneck).
  A flow that ends frees capacity only on its own links; when none of them that still carries a flow
  was saturated, no remaining flow had its bottleneck there, and every rate stands. The max-min fair
  allocation is unique, so both shortcuts give exactly what a recomputation would.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import simpy

from kvlab.fabric.sharing import max_min_rates

__all__ = ["Flow", "Fabric"]

# A flow with less than this much transfer time left at its scheduled end is done (float rounding).
_DONE_S = 1e-12
# A link within this fraction of its capacity counts as saturated, so the shortcuts err towards recomputing.
_FULL = 1e-7


class Flow:
    """One transfer on the fabric.

    Attributes:
        route: link indices it crosses.
        nbytes: bytes it carries (grows with :meth:`Fabric.extend`).
        start_s, end_s: when it started and when its last byte landed (None until then), seconds.
        done: a SimPy event that succeeds with ``end_s`` when the last byte lands.
        active: True while bytes remain.
        tag: anything the caller attached.
    """

    __slots__ = ("route", "key", "nbytes", "cap", "slot", "done", "start_s", "end_s", "active", "tag")

    def __init__(self, route: list[int], nbytes: float, cap: float, done: simpy.Event, start_s: float, tag):
        self.route, self.key, self.nbytes, self.cap, self.done = route, tuple(route), nbytes, cap, done
        self.start_s, self.end_s, self.active, self.tag, self.slot = start_s, None, True, tag, -1


class Fabric:
    """Active flows over links of fixed capacity, advanced on ``env``'s clock.

    Args:
        env: the simpy.Environment.
        capacity: float array ``(links,)``, bytes/s, each > 0.
        max_hops: the longest route a flow may have.
        shortcuts: skip recomputations that cannot change a rate (False: recompute at every start and end,
            for tests that check the shortcuts change nothing).

    Attributes:
        link_bytes: float array ``(links,)``: bytes every finished flow carried over each link.
        reallocations: how many times all rates were recomputed; ``shortcuts``: how many starts and ends
            needed none (no other rate changed; see the module docstring).
    """

    def __init__(self, env: simpy.Environment, capacity: Sequence[float], max_hops: int = 6,
                 shortcuts: bool = True) -> None:
        cap = np.asarray(capacity, dtype=np.float64)
        if cap.ndim != 1 or cap.size == 0 or not np.all(np.isfinite(cap)) or np.any(cap <= 0):
            raise ValueError("capacity: expected a non-empty 1-D array of finite link capacities > 0 (bytes/s)")
        if isinstance(max_hops, bool) or not isinstance(max_hops, int) or max_hops < 1:
            raise ValueError(f"max_hops={max_hops!r}: must be an integer ≥ 1")
        self.env = env
        self.capacity = cap
        self.max_hops = max_hops
        self._shortcuts = bool(shortcuts)
        self._route_bytes: dict[tuple[int, ...], float] = {}  # bytes landed per route, summed on demand
        # per-link state touched a few links at a time: plain lists beat numpy's fancy indexing there
        self._capl = cap.tolist()
        self._count = [0] * cap.size   # active flows on each link
        self._load = [0.0] * cap.size  # their summed rates, bytes/s
        self._rows: dict[tuple[int, ...], np.ndarray] = {}  # each route as a padded row of _routes
        size = 64
        self._routes = np.full((size, max_hops), -1, dtype=np.int64)
        self._left = np.zeros(size)   # bytes still to move
        self._rate = np.zeros(size)   # bytes/s
        self._cap = np.full(size, np.inf)
        self._flows: list[Flow] = []
        self._t = env.now             # when _left was last brought up to date
        self._gen = 0                 # the completion timeout that is still valid
        self._next: Flow | None = None  # the flow it ends (None: no valid timeout)
        self._next_at = math.inf      # and when
        self._pending = False         # a recomputation is scheduled at this instant
        self.reallocations = 0
        self.shortcuts = 0
        self.flows_started = 0

    @property
    def link_bytes(self) -> np.ndarray:
        """float64 ``(links,)``: bytes the landed flows carried over each link."""
        out = np.zeros(self.capacity.size)
        for key, nbytes in self._route_bytes.items():
            out[list(key)] += nbytes
        return out

    @property
    def active(self) -> int:
        """Flows moving bytes now."""
        return len(self._flows)

    def rates(self) -> dict[Flow, float]:
        """Each active flow's current rate, bytes/s (after any pending recomputation)."""
        if self._pending:
            self._reallocate()
        return {f: float(self._rate[f.slot]) for f in self._flows}

    # ---- public operations -------------------------------------------------------------------

    def send(self, route: Sequence[int], nbytes: float, flow_cap: float = math.inf, tag=None) -> Flow:
        """Start a flow of ``nbytes`` bytes over ``route`` now; its ``done`` event fires when the last byte lands.

        ``flow_cap``: the flow's own ceiling, bytes/s (inf: only the links limit it).
        """
        route = list(route)
        row = self._rows.get(tuple(route))
        if row is None:
            if not 1 <= len(route) <= self.max_hops or len(set(route)) != len(route):
                raise ValueError(f"route={route!r}: expected 1…{self.max_hops} distinct link indices")
            if not all(isinstance(x, (int, np.integer)) and 0 <= x < self.capacity.size for x in route):
                raise ValueError(f"route={route!r}: link indices must be integers in 0…{self.capacity.size - 1}")
            route = [int(x) for x in route]
            row = self._rows[tuple(route)] = np.array(route + [-1] * (self.max_hops - len(route)))
        if not (isinstance(nbytes, (int, float, np.floating, np.integer)) and math.isfinite(nbytes) and nbytes >= 0):
            raise ValueError(f"nbytes={nbytes!r}: must be a finite number of bytes ≥ 0")
        if not flow_cap > 0:
            raise ValueError(f"flow_cap={flow_cap!r}: must be > 0 bytes/s (inf for none)")
        env = self.env
        flow = Flow(route, float(nbytes), float(flow_cap), env.event(), env.now, tag)
        self.flows_started += 1
        if nbytes == 0:
            self._land(flow)
            return flow
        self._advance()
        slot = len(self._flows)
        if slot == self._left.size:
            self._grow()
        self._flows.append(flow)
        flow.slot = slot
        self._routes[slot] = row
        self._left[slot] = nbytes
        self._cap[slot] = flow_cap
        count = self._count
        for link in route:
            count[link] += 1
        x = self._fits(route, flow_cap)
        if x > 0:
            self.shortcuts += 1
            self._rate[slot] = x
            load = self._load
            for link in route:
                load[link] += x
            # no other rate moved: the scheduled completion stands unless this flow ends first
            end = env.now + flow.nbytes / x
            if self._next is None or end < self._next_at:
                self._arm(flow, end)
        else:
            self._rate[slot] = 0.0
            self._defer()
        return flow

    def extend(self, flow: Flow, nbytes: float) -> None:
        """Add ``nbytes`` to an active flow (its next layer joining the same connection).

        The set of active flows does not change, so no rate does; only its completion moves.
        """
        if not flow.active:
            raise ValueError("extend: the flow has already landed; start a new one")
        if not (math.isfinite(nbytes) and nbytes >= 0):
            raise ValueError(f"nbytes={nbytes!r}: must be a finite number of bytes ≥ 0")
        self._advance()
        self._left[flow.slot] += nbytes
        flow.nbytes += float(nbytes)
        if flow is self._next:  # it now ends later: another flow may end first
            self._reschedule()

    # ---- internals ---------------------------------------------------------------------------

    def _fits(self, route: list[int], flow_cap: float) -> float:
        """The new flow's max-min rate when no other rate changes (see the module docstring), else 0."""
        if self._pending or not self._shortcuts:
            return 0.0
        capl, load = self._capl, self._load
        tight, spare = min(((link, capl[link] - load[link]) for link in route), key=lambda pair: pair[1])
        x = min(spare, flow_cap)
        if x <= _FULL * min(capl[link] for link in route):
            return 0.0
        if x == flow_cap or self._count[tight] == 1:
            return x
        n = len(self._flows) - 1  # the others: every active flow but this one (the last slot)
        on = (self._routes[:n] == tight).any(axis=1)
        return x if x >= float(self._rate[:n][on].max()) * (1 - _FULL) else 0.0

    def _grow(self) -> None:
        size = 2 * self._left.size
        routes = np.full((size, self.max_hops), -1, dtype=np.int64)
        routes[:self._left.size] = self._routes
        self._routes = routes
        for name, fill in (("_left", 0.0), ("_rate", 0.0), ("_cap", np.inf)):
            old = getattr(self, name)
            new = np.full(size, fill)
            new[:old.size] = old
            setattr(self, name, new)

    def _advance(self) -> None:
        now = self.env.now
        dt = now - self._t
        if dt > 0 and self._flows:
            n = len(self._flows)
            self._left[:n] -= self._rate[:n] * dt
        self._t = now

    def _defer(self) -> None:
        self._gen += 1  # the scheduled completion may no longer be the next one
        self._next = None
        if not self._pending:
            self._pending = True
            self.env.timeout(0).callbacks.append(self._on_defer)

    def _on_defer(self, _event) -> None:
        if self._pending:
            self._reallocate()

    def _reallocate(self) -> None:
        self._pending = False
        self._advance()
        n = len(self._flows)
        if n:
            self.reallocations += 1
            rates = max_min_rates(self._routes[:n], self.capacity, self._cap[:n], check=False)
            self._rate[:n] = rates
            hops = self._routes[:n]
            used = hops >= 0
            self._load = np.bincount(hops[used], weights=np.broadcast_to(rates[:, None], hops.shape)[used],
                                     minlength=self.capacity.size).tolist()
        self._reschedule()

    def _reschedule(self) -> None:
        self._gen += 1
        self._next = None
        if self._pending or not self._flows:
            return
        n = len(self._flows)
        ttc = self._left[:n] / self._rate[:n]
        i = int(np.argmin(ttc))
        self._arm(self._flows[i], self.env.now + max(float(ttc[i]), 0.0))

    def _arm(self, flow: Flow, at: float) -> None:
        self._gen += 1
        self._next, self._next_at = flow, at
        gen = self._gen
        self.env.timeout(at - self.env.now).callbacks.append(lambda _e: self._on_timer(gen))

    def _on_timer(self, gen: int) -> None:
        if gen != self._gen:
            return
        self._advance()
        n = len(self._flows)
        done = self._left[:n] <= self._rate[:n] * _DONE_S
        done[self._next.slot] = True
        ended = [self._flows[slot] for slot in np.flatnonzero(done)[::-1].tolist()]
        count, load, capl = self._count, self._load, self._capl
        for flow in ended:
            for link in flow.route:
                count[link] -= 1
        # a link that still carries flows and was saturated: some remaining flow may speed up
        recompute = not self._shortcuts or any(count[link] > 0 and load[link] >= capl[link] * (1 - _FULL)
                                               for flow in ended for link in flow.route)
        for flow in ended:
            rate = float(self._rate[flow.slot])
            for link in flow.route:
                load[link] -= rate
            self._remove(flow.slot)
            self._land(flow)
        if recompute:
            self._defer()
        else:
            self.shortcuts += 1
            self._reschedule()

    def _remove(self, slot: int) -> None:
        last = len(self._flows) - 1
        if slot != last:
            moved = self._flows[last]
            self._flows[slot] = moved
            moved.slot = slot
            self._routes[slot] = self._routes[last]
            self._left[slot] = self._left[last]
            self._rate[slot] = self._rate[last]
            self._cap[slot] = self._cap[last]
        self._flows.pop()

    def _land(self, flow: Flow) -> None:
        flow.active = False
        flow.end_s = self.env.now
        self._route_bytes[flow.key] = self._route_bytes.get(flow.key, 0.0) + flow.nbytes
        flow.done.succeed(flow.end_s)
