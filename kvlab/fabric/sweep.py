"""Many fabric simulations at once — load × policy × oversubscription × link, or any fields — on Dask's
distributed scheduler: a ``LocalCluster`` on this machine by default, or a running scheduler's address.

Each grid point is one :func:`kvlab.fabric.sim.simulate` call on one worker; only its summary comes back,
one row per point. Dask rather than a pool of our own: the same call runs on a laptop or on a cluster's
scheduler, with its retries, its dashboard and its progress reporting.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd
from tqdm.auto import tqdm

from kvlab import calculator
from kvlab.fabric.sim import simulate
from kvlab.fabric.workload import SimConfig

__all__ = ["AXIS_ALIASES", "points", "run_point", "run_points", "sweep"]

# Short axis names a sweep may use beside the config's own field names.
AXIS_ALIASES = {"link": "nic_gbit_s", "policy": "send", "oversub": "oversubscription"}


def _axis_value(field: str, value: Any) -> Any:
    if field == "nic_gbit_s" and not isinstance(value, bool) and isinstance(value, str):
        return calculator.link(value).gbit_per_s  # "100G", "400Gb/s", "50GB/s"
    return value


def points(base: SimConfig, grid: Mapping[str, Sequence[Any]]) -> list[tuple[dict[str, Any], SimConfig]]:
    """Every combination of ``grid``'s values applied to ``base``, in order, each config validated.

    ``grid``: axis name → values; a name is a SimConfig or TopologyConfig field, or one of
    :data:`AXIS_ALIASES` (``link`` takes anything :func:`kvlab.calculator.link` parses: ``"100G"``, ``400``).
    Returns ``(axis values as given, config)`` pairs. Bad input raises ValueError naming the axis.
    """
    if not isinstance(base, SimConfig):
        raise ValueError(f"base={base!r}: expected a SimConfig")
    if not isinstance(grid, Mapping) or not grid:
        raise ValueError("grid: expected a non-empty mapping of axis name → list of values")
    axes = list(grid)
    for name in axes:
        vals = grid[name]
        if isinstance(vals, (str, bytes)) or not isinstance(vals, Sequence) or len(vals) == 0:
            raise ValueError(f"grid[{name!r}]={vals!r}: expected a non-empty list of values")
    out = []
    for combo in itertools.product(*(grid[a] for a in axes)):
        given = dict(zip(axes, combo))
        changes = {}
        for name, value in given.items():
            field = AXIS_ALIASES.get(name, name)
            try:
                changes[field] = _axis_value(field, value)
            except ValueError as err:
                raise ValueError(f"grid[{name!r}] value {value!r}: {err}") from None
        try:
            cfg = base.with_(**changes)
        except (ValueError, TypeError) as err:
            raise ValueError(f"grid point {given}: {err}") from None
        out.append((given, cfg))
    return out


def run_point(cfg: SimConfig) -> dict[str, Any]:
    """One simulation's summary (what a sweep's worker runs)."""
    return simulate(cfg).summary


def sweep(base: SimConfig, grid: Mapping[str, Sequence[Any]], *, scheduler: str | None = None,
          n_workers: int | None = None, processes: bool = True, progress: bool = True) -> pd.DataFrame:
    """Simulate every point of ``grid`` over ``base`` on Dask; one row per point, in grid order.

    Args:
        base: the configuration every point starts from.
        grid: axis → values (see :func:`points`), e.g. ``{"load": [0.5, 0.9], "send": ["bulk", "layerwise"],
            "oversubscription": [1, 4], "link": ["100G", "400G"]}``.
        scheduler: a running Dask scheduler's address (``"tcp://host:8786"``); None starts a LocalCluster.
        n_workers: LocalCluster workers (None: one per CPU core), one thread each (a simulation is
            pure Python: threads would share one interpreter lock).
        processes: LocalCluster workers as processes (True) or threads of this one (False: for tests).
        progress: a tqdm bar of points done.

    Returns:
        DataFrame: ``point`` (index in the grid), the axis values as given, then the summary's columns.
    """
    todo = points(base, grid)  # every point validated before any worker starts
    return run_points(todo, scheduler=scheduler, n_workers=n_workers, processes=processes, progress=progress)


def run_points(todo: Sequence[tuple[Mapping[str, Any], SimConfig]], *, scheduler: str | None = None,
               n_workers: int | None = None, processes: bool = True, progress: bool = True) -> pd.DataFrame:
    """Simulate each ``(labels, config)`` of ``todo`` on Dask; one row per point, in order: ``point``, its labels,
    then the summary's columns. What :func:`sweep` runs after building its grid; a caller with points that are not
    one grid's product (a study's variants) gives them here. The other arguments as for :func:`sweep`."""
    if not todo or not all(isinstance(c, SimConfig) for _, c in todo):
        raise ValueError("todo: expected a non-empty list of (labels, SimConfig) pairs")
    if scheduler is not None and (not isinstance(scheduler, str) or not scheduler.strip()):
        raise ValueError(f"scheduler={scheduler!r}: expected a Dask scheduler address such as 'tcp://host:8786'")
    if n_workers is not None and (isinstance(n_workers, bool) or not isinstance(n_workers, int) or n_workers < 1):
        raise ValueError(f"n_workers={n_workers!r}: must be an integer ≥ 1")
    from dask.distributed import Client, LocalCluster, as_completed  # heavy: only when a sweep runs

    cluster = None
    if scheduler is None:
        cluster = LocalCluster(n_workers=n_workers or os.cpu_count() or 1, threads_per_worker=1,
                               processes=processes, dashboard_address=None)
        client = Client(cluster)
    else:
        client = Client(scheduler)
    try:
        futures = client.map(run_point, [cfg for _, cfg in todo], pure=False)
        index = {f.key: i for i, f in enumerate(futures)}
        rows: list[dict[str, Any] | None] = [None] * len(todo)
        with tqdm(total=len(todo), disable=not progress, unit="point", desc="sweep") as bar:
            for future in as_completed(futures):
                i = index[future.key]
                rows[i] = {"point": i, **todo[i][0], **future.result()}
                bar.update(1)
    finally:
        client.close()
        if cluster is not None:
            cluster.close()
    return pd.DataFrame(rows)
