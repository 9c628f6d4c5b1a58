"""Fit the fabric simulator's few parameters to measured contention, then predict what it was not fitted to.

Rows (a DataFrame, one per measurement): ``path``, ``flows``, ``role``, ``measured_gbps``, ``measured_lo``,
``measured_hi``, and optionally ``bytes`` (bytes per flow) and ``descriptors`` (descriptors each flow posts,
default 1). ``measured_gbps`` is the aggregate rate, decimal GB/s: all the row's bytes over the time from
the common start until the last flow lands (``lo``/``hi``: its interval). ``role`` is "calibrate" (fitted:
single paths, N = 1 and 2) or "validate" (predicted: N = 4, 8, mixed directions, incast). ``path`` names
one path ("d2h") or several joined by "+" ("d2h+h2d", "peer01+h2d1"): ``flows`` flows on each of them.

The model, per path P: a link of capacity C_P, each flow capped at r_P (one copy engine or queue pair may
not fill the path alone); every flow pays ``fixed_s + descriptors · post_s`` before its bytes move (shared
by all paths); flows share links max-min fairly (:mod:`kvlab.fabric.flows`, the simulator's own engine).
N flows of b bytes on P alone take ``T = fixed_s + k · post_s + b · max(1/r_P, N/C_P)``, linear in the
unknowns ``fixed_s``, ``post_s`` and one inverse rate per (path, N): a least-squares fit on relative
error, with ``fixed_s, post_s ≥ 0``; then r_P from N = 1 and C_P from N = 2. Paths share no link in this
model: a validate row on several paths is predicted as their independent sum, so a shared bottleneck the
model lacks shows up as a validation error rather than being fitted away.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import pandas as pd
import simpy

from kvlab.fabric.flows import Fabric
from kvlab.fabric.sharing import start_delay_s

__all__ = ["ROW_COLUMNS", "VALIDATION_COLUMNS", "PathFit", "Calibration", "fit", "simulate_rows",
           "validation_table", "errors"]

ROW_COLUMNS = ("path", "flows", "role", "measured_gbps", "measured_lo", "measured_hi")
VALIDATION_COLUMNS = (*ROW_COLUMNS, "simulated_gbps")
ROLES = ("calibrate", "validate")
# Bytes per flow assumed when a row does not say (the rate model without fixed costs does not depend on it).
DEFAULT_BYTES = 1 << 30
# Two flows within this fraction of one flow's rate: the per-flow ceiling still binds at N = 2.
_CAP_BINDS = 0.02


@dataclass(frozen=True)
class PathFit:
    """One path's fitted rates (decimal GB/s).

    Fields:
        path: its name.
        capacity_gbps: C, the path's aggregate capacity.
        flow_gbps: r, one flow's ceiling (== capacity when one flow fills the path).
        capacity_lower_bound: True when the measurements only bound C from below (two flows were still
            flow-capped, or no N = 2 row): predictions for more flows are then a floor.
    """

    path: str
    capacity_gbps: float
    flow_gbps: float
    capacity_lower_bound: bool


@dataclass(frozen=True)
class Calibration:
    """The fitted parameters.

    Fields:
        paths: path name → :class:`PathFit`.
        fixed_s: per-flow start cost, seconds; post_s: per-descriptor posting cost, seconds.
        costs_fitted: whether the rows identified fixed_s / post_s (they need several sizes per (path, N),
            and several descriptor counts for post_s); an unidentified cost is 0.
        max_rel_error: the largest relative error of the fit on its own rows.
    """

    paths: dict[str, PathFit]
    fixed_s: float
    post_s: float
    costs_fitted: tuple[bool, bool]
    max_rel_error: float


def _check_rows(rows: pd.DataFrame) -> pd.DataFrame:
    if not isinstance(rows, pd.DataFrame):
        raise ValueError(f"rows: expected a pandas DataFrame with columns {', '.join(ROW_COLUMNS)}")
    missing = [c for c in ROW_COLUMNS if c not in rows.columns]
    if missing:
        raise ValueError(f"rows: missing column(s) {', '.join(missing)}; need {', '.join(ROW_COLUMNS)}")
    if rows.empty:
        raise ValueError("rows: no measurements")
    df = rows.reset_index(drop=True).copy()
    bad_role = sorted(set(df["role"]) - set(ROLES))
    if bad_role:
        raise ValueError(f"rows: role {bad_role[0]!r} is not known; valid: {', '.join(ROLES)}")
    flows = df["flows"].to_numpy()
    if not np.issubdtype(flows.dtype, np.integer) or (flows < 1).any():
        raise ValueError("rows: flows must be integers ≥ 1")
    gbps = df["measured_gbps"].to_numpy(dtype=float)
    if not np.isfinite(gbps).all() or (gbps <= 0).any():
        raise ValueError("rows: measured_gbps must be finite numbers > 0 (GB/s)")
    if "bytes" not in df:
        df["bytes"] = DEFAULT_BYTES
    if "descriptors" not in df:
        df["descriptors"] = 1
    if (df["bytes"].to_numpy(dtype=float) <= 0).any() or not np.isfinite(df["bytes"].to_numpy(dtype=float)).all():
        raise ValueError("rows: bytes (per flow) must be finite numbers > 0")
    desc = df["descriptors"].to_numpy()
    if not np.issubdtype(desc.dtype, np.integer) or (desc < 1).any():
        raise ValueError("rows: descriptors (per flow) must be integers ≥ 1")
    for p in df["path"]:
        if not isinstance(p, str) or not p or any(not part for part in p.split("+")):
            raise ValueError(f"rows: path {p!r}: expected a name, or names joined by '+'")
    return df


def fit(rows: pd.DataFrame) -> Calibration:
    """Fit capacities, per-flow ceilings and the two start costs to the rows whose role is "calibrate".

    Calibrate rows must each be one path with 1 or 2 flows (more flows are what validation predicts).
    """
    df = _check_rows(rows)
    cal = df[df["role"] == "calibrate"].reset_index(drop=True)
    if cal.empty:
        raise ValueError("rows: no row has role 'calibrate'; the fit needs single-path rows with flows 1 and 2")
    if cal["path"].str.contains("+", regex=False).any():
        raise ValueError(f"rows: calibrate path {cal['path'][cal['path'].str.contains('+', regex=False)].iloc[0]!r} "
                         "joins several paths; calibrate on single paths, validate on joined ones")
    if (cal["flows"] > 2).any():
        raise ValueError(f"rows: a calibrate row has flows={int(cal['flows'].max())}; calibrate on N = 1 and 2, "
                         "validate on more")
    for path, group in cal.groupby("path"):
        if not (group["flows"] == 1).any():
            raise ValueError(f"rows: path {path!r} has no single-flow calibrate row (flows=1)")
    b = cal["bytes"].to_numpy(dtype=float)
    k = cal["descriptors"].to_numpy(dtype=float)
    n = cal["flows"].to_numpy()
    t = n * b / (cal["measured_gbps"].to_numpy(dtype=float) * 1e9)  # seconds until the last flow lands
    groups = sorted(set(zip(cal["path"], n.tolist())))
    gcol = {g: j for j, g in enumerate(groups)}
    x_rate = np.zeros((len(cal), len(groups)))
    for i, g in enumerate(zip(cal["path"], n.tolist())):
        x_rate[i, gcol[g]] = b[i]
    best = None
    # fixed_s and post_s must be ≥ 0 and identified: try each subset of them, keep the best admissible fit
    for use_fixed, use_post in itertools.product((True, False), repeat=2):
        cols = [c for c, use in ((np.ones(len(cal)), use_fixed), (k, use_post)) if use]
        x = np.column_stack([*cols, x_rate])
        if np.linalg.matrix_rank(x / t[:, None]) < x.shape[1]:
            continue
        coef = np.linalg.lstsq(x / t[:, None], np.ones(len(cal)), rcond=None)[0]
        if (coef[:len(cols)] < 0).any() or (coef[len(cols):] <= 0).any():
            continue
        err = float(np.abs(x @ coef / t - 1).max())
        if best is None or err < best[0] - 1e-12:
            best = (err, use_fixed, use_post, coef)
    if best is None:
        raise ValueError("rows: the calibrate rows do not determine the rates (need, per path, flows=1 rows "
                         "whose sizes or counts let the fit tell fixed costs from bandwidth)")
    err, use_fixed, use_post, coef = best
    fixed_s = float(coef[0]) if use_fixed else 0.0
    post_s = float(coef[int(use_fixed)]) if use_post else 0.0
    inv = {g: float(coef[int(use_fixed) + int(use_post) + j]) for g, j in gcol.items()}
    paths = {}
    for path in sorted({p for p, _ in groups}):
        flow = 1.0 / inv[(path, 1)]
        if (path, 2) in inv:
            cap = max(2.0 / inv[(path, 2)], flow)
            lower = inv[(path, 2)] <= inv[(path, 1)] * (1 + _CAP_BINDS)
        else:
            cap, lower = flow, True
        paths[path] = PathFit(path, cap / 1e9, flow / 1e9, bool(lower))
    return Calibration(paths=paths, fixed_s=fixed_s, post_s=post_s, costs_fitted=(use_fixed, use_post),
                       max_rel_error=err)


def _simulate_one(cal: Calibration, parts: list[str], flows: int, nbytes: float, descriptors: int) -> float:
    """Aggregate GB/s of ``flows`` flows on each of ``parts``, all starting at 0, on the simulator's engine."""
    names = sorted(set(parts))
    link = {p: i for i, p in enumerate(names)}
    env = simpy.Environment()
    fabric = Fabric(env, [cal.paths[p].capacity_gbps * 1e9 for p in names], max_hops=1)
    delay = start_delay_s(int(descriptors), cal.fixed_s, cal.post_s)
    landed: list[float] = []

    def one(path: str):
        yield env.timeout(delay)
        flow = fabric.send([link[path]], nbytes, cal.paths[path].flow_gbps * 1e9)
        landed.append((yield flow.done))

    for path in parts:
        for _ in range(flows):
            env.process(one(path))
    env.run()
    return len(parts) * flows * nbytes / max(landed) / 1e9


def simulate_rows(cal: Calibration, rows: pd.DataFrame) -> np.ndarray:
    """The simulated aggregate GB/s of every row (calibrate and validate), float64 ``(rows,)``."""
    if not isinstance(cal, Calibration):
        raise ValueError(f"cal={cal!r}: expected a Calibration from fit()")
    df = _check_rows(rows)
    out = np.empty(len(df))
    for i, row in enumerate(df.itertuples(index=False)):
        parts = row.path.split("+")
        unknown = [p for p in parts if p not in cal.paths]
        if unknown:
            raise ValueError(f"rows: path {unknown[0]!r} (row {i}, {row.path!r}) was not calibrated; "
                             f"calibrated: {', '.join(cal.paths)}")
        out[i] = _simulate_one(cal, parts, int(row.flows), float(row.bytes), int(row.descriptors))
    return out


def validation_table(rows: pd.DataFrame, cal: Calibration | None = None) -> pd.DataFrame:
    """validation.csv's rows: every input row with its ``simulated_gbps`` (fitted on the calibrate rows
    unless ``cal`` is given), columns :data:`VALIDATION_COLUMNS`."""
    df = _check_rows(rows)
    cal = fit(df) if cal is None else cal
    out = df.loc[:, list(ROW_COLUMNS)].copy()
    out["simulated_gbps"] = simulate_rows(cal, df)
    return out


def errors(table: pd.DataFrame) -> dict[str, float]:
    """Relative error of the simulation on the validate rows of a validation table: ``median_pct``,
    ``max_pct`` (issue 30's goal: every row within 10 %, median ≤ 5 %) and ``rows``."""
    v = table[table["role"] == "validate"]
    if v.empty:
        raise ValueError("table: no validate rows")
    rel = (v["simulated_gbps"] / v["measured_gbps"] - 1).abs() * 100
    return {"rows": int(len(v)), "median_pct": float(rel.median()), "max_pct": float(rel.max())}
