"""Max-min fair rates of flows over shared links (progressive filling), and what a flow pays before it moves.

Max-min fairness: no flow's rate can rise without lowering the rate of a flow that already has less.
Equivalently every flow has a *bottleneck*: a saturated link on its route where no other flow gets more,
or its own ceiling (``flow_cap``). Progressive filling finds it: raise every unfrozen flow's rate
together; when a link fills, freeze the flows crossing it; repeat.

Vectorised over flows with numpy (thousands of flows, a few links each). Each round freezes, at once,
the flows of every link whose fair share is the smallest share any of its flows sees — those links fill
before anything around them changes, so freezing them together is exact and the rounds number the
distinct bottleneck levels, not the flows.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

__all__ = ["max_min_rates", "start_delay_s", "NIXL_POST_S_MEASURED"]

# What posting one NIXL descriptor cost here (seconds, low and high of the measured range).
NIXL_POST_S_MEASURED = (6.8e-6, 12.8e-6)

# Relative tolerance for "this link is the tightest one": shares equal up to float rounding tie.
_TIE = 1e-9


def _validate(routes: np.ndarray, capacity: np.ndarray, flow_cap: np.ndarray | None) -> None:
    if routes.ndim != 2 or not np.issubdtype(routes.dtype, np.integer):
        raise ValueError(f"routes: expected a 2-D integer array (flows, hops), got dtype {routes.dtype} "
                         f"shape {routes.shape}")
    if capacity.ndim != 1 or not np.all(np.isfinite(capacity)) or np.any(capacity <= 0):
        raise ValueError("capacity: expected a 1-D array of finite link capacities > 0 (bytes/s)")
    n_links = capacity.shape[0]
    if routes.size and (routes.max() >= n_links or routes.min() < -1):
        raise ValueError(f"routes: link indices must be in 0…{n_links - 1}, or -1 for an unused hop")
    for row in routes:
        real = row[row >= 0]
        if np.unique(real).size != real.size:
            raise ValueError(f"routes: a route crosses one link twice ({row.tolist()})")
    if flow_cap is not None:
        if flow_cap.shape != (routes.shape[0],) or np.any(np.isnan(flow_cap)) or np.any(flow_cap <= 0):
            raise ValueError("flow_cap: expected one ceiling > 0 (bytes/s, inf for none) per flow")
    unbounded = (routes < 0).all(axis=1)
    if flow_cap is not None:
        unbounded &= ~np.isfinite(flow_cap)
    if unbounded.any():
        raise ValueError(f"routes: flow {int(np.argmax(unbounded))} crosses no link and has no ceiling "
                         "(its rate would be infinite)")


def max_min_rates(routes: Any, capacity: Any, flow_cap: Any = None, *, check: bool = True) -> np.ndarray:
    """Max-min fair rate of each flow.

    Args:
        routes: integer array ``(flows, hops)``: the links each flow crosses, padded with -1.
        capacity: float array ``(links,)``: each link's capacity (bytes/s, > 0).
        flow_cap: optional float array ``(flows,)``: each flow's own ceiling (bytes/s; ``inf`` for none),
            e.g. a single copy engine or queue pair that cannot fill the path alone.
        check: validate the inputs (a hot loop that built them itself passes False).

    Returns:
        float64 array ``(flows,)`` of rates in bytes/s: no link over capacity, each flow bottlenecked.
    """
    routes = np.asarray(routes)
    capacity = np.asarray(capacity, dtype=np.float64)
    cap = None if flow_cap is None else np.asarray(flow_cap, dtype=np.float64)
    if check:
        _validate(routes, capacity, cap)
    n_flows, hops = routes.shape
    n_links = capacity.shape[0]
    rates = np.zeros(n_flows)
    if n_flows == 0:
        return rates
    # -1 → a dummy link of infinite capacity that is never the bottleneck
    rr = np.where(routes < 0, n_links, routes)
    left = np.append(capacity, np.inf)
    cc = np.full(n_flows, np.inf) if cap is None else cap.copy()
    todo = np.arange(n_flows)
    share = np.empty(n_links + 1)
    while todo.size:
        flat = rr.ravel()
        count = np.bincount(flat, minlength=n_links + 1)
        share.fill(np.inf)
        np.divide(left, count, out=share, where=count > 0)
        share[n_links] = np.inf
        level = share[rr].min(axis=1)
        np.minimum(level, cc, out=level)
        # the smallest level among each link's flows; a link is a bottleneck when that is its own share
        lowest = np.full(n_links + 1, np.inf)
        np.minimum.at(lowest, flat, np.repeat(level, hops))
        tight = lowest >= share * (1 - _TIE)
        tight[n_links] = False
        frozen = tight[rr].any(axis=1) | (cc <= level * (1 + _TIE))
        rates[todo[frozen]] = level[frozen]
        used = np.bincount(rr[frozen].ravel(), weights=np.repeat(level[frozen], hops), minlength=n_links + 1)
        left = np.maximum(left - used, 0.0)
        left[n_links] = np.inf
        keep = ~frozen
        todo, rr, cc = todo[keep], rr[keep], cc[keep]
    return rates


def start_delay_s(descriptors: Any, fixed_s: float = 0.0, post_s: float = 0.0) -> Any:
    """Seconds before a flow of ``descriptors`` descriptors moves its first byte: ``fixed_s + descriptors · post_s``.

    ``fixed_s``: a per-flow start cost (connection set-up, doorbell, completion); ``post_s``: posting one
    descriptor (NIXL here: :data:`NIXL_POST_S_MEASURED`, 6.8–12.8 µs). Scalars or numpy arrays (elementwise).
    """
    for name, v in (("fixed_s", fixed_s), ("post_s", post_s)):
        if not isinstance(v, numbers.Real) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{name}={v!r}: must be a finite number of seconds ≥ 0")
    d = np.asarray(descriptors)
    if not np.issubdtype(d.dtype, np.integer) or np.any(d < 0):
        raise ValueError(f"descriptors={descriptors!r}: must be integers ≥ 0")
    out = fixed_s + d * post_s
    return float(out) if out.ndim == 0 else out
