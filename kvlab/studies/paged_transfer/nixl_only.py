"""NIXL in a call of its own: it is installed separately from the notebook's environment, so its sends are measured
in a process of their own and merged into notebook 04's results through its `nixl_csv` parameter.

    python -c "from kvlab.studies.paged_transfer.nixl_only import run_nixl_only; run_nixl_only('data/paged_transfer_nixl/RUN')"
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from pathlib import Path

import pandas as pd

from ... import devices, provenance, timing
from ...paged import nixl, registry
from .bench import GPU_CONTEXTS, check_layout, measure

__all__ = ["run_nixl_only"]


def run_nixl_only(out_dir, contexts=GPU_CONTEXTS, block_sizes=(16,), destinations=None, repeats: int = 9,
                  warmup: int = 2, device=None, layout=None, pool_layout: str = "nhd", seed: int = 0,
                  max_call_s: float = 120.0, slow_call_s: float = 1.0) -> pd.DataFrame:
    """Measure NIXL (and the contiguous ceiling beside it) and write the results to `out_dir`:
    `nixl_results.csv` (the same columns as measure()) and `nixl_config.json` (NIXL version, backend,
    descriptor counts per configuration, UCX_* environment, the device). Returns the results.

    The notebook can merge the CSV (its `nixl_csv` parameter) so NIXL appears beside the other methods.
    slow_call_s: a send slower than this is timed once (measure()'s rule); raise it to time NIXL's
    multi-second sends `repeats` times.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    why = registry.unavailable("nixl", timing.resolve_device(device), "same-gpu")
    t0 = time.time()
    df = measure(contexts, block_sizes, ["contiguous", "nixl"], destinations, repeats, warmup, device, layout,
                 pool_layout, seed, max_call_s=max_call_s, slow_call_s=slow_call_s)
    df.to_csv(out / "nixl_results.csv", index=False)
    record = {
        "git": provenance.git_state(), "seconds": round(time.time() - t0, 1),
        "parameters": {"contexts": list(contexts), "block_sizes": list(block_sizes), "destinations": destinations,
                       "repeats": repeats, "warmup": warmup, "slow_call_s": slow_call_s, "max_call_s": max_call_s},
        "nixl_available": why is None, "nixl_unavailable_reason": why,
        "nixl_version": nixl.nixl_version(),
        "ucx_env": {k: v for k, v in os.environ.items() if k.startswith("UCX_")},
        "layout": asdict(check_layout(layout)), "pool_layout": pool_layout,
        "transports": df.attrs.get("transports", []),
        "devices": devices.describe(),
    }
    (out / "nixl_config.json").write_text(json.dumps(record, indent=2, default=str) + "\n", encoding="utf-8")
    return df
