"""The best ceiling a host's links have shown, for a run that measured only its own yardstick.

A two-process send is timed against a copy of the same bytes in the same run; the link itself was measured by a
link_ceilings run on the same machine (`kvlab run link_ceilings`: 1 GiB copies, the best median GB/s of the
sweep). `peer_ceiling(record)` finds that run among the committed ones and gives the best GB/s any of its peer
paths reached in the direction of `record`'s send. The same machine means the same host fingerprint (host name,
CPU model and count, memory, the GPUs by name, the driver) and a start within `WITHIN_HOURS` of the run: a lent
machine has no stable name, and a day later the same fingerprint may be another machine. Reads committed runs;
never measures.
"""

from __future__ import annotations

import datetime as _dt
import re

from . import paths, results
from .runfolder import RUN_JSON

__all__ = ["peer_ceiling", "fingerprint", "WITHIN_HOURS"]

WITHIN_HOURS = 12.0
_DEVICE = re.compile(r"^cuda:(\d+)$")


def fingerprint(record: dict) -> tuple:
    """What must match for two runs to count as one machine: host name, CPU model and count, memory, the GPUs'
    names in order, the driver."""
    host = record.get("host") or {}
    gpus = tuple(str(d.get("name")) for d in record.get("devices") or [] if isinstance(d, dict))
    return (host.get("hostname"), host.get("cpu_model"), host.get("cpu_count"), host.get("memory_bytes"), gpus,
            record.get("driver_version"))


def _started(record: dict) -> _dt.datetime | None:
    try:
        return _dt.datetime.strptime(str(record.get("started_utc")), "%Y-%m-%dT%H:%M:%SZ")
    except ValueError:
        return None


def _ceiling_runs() -> list:
    """(folder, run.json) of every finished GPU run of link_ceilings under this workbook's data folder and, where
    that is elsewhere (KVLAB_DATA), under the repository's committed data/ too."""
    roots = list(dict.fromkeys([paths.data_root(), paths.repo_root() / "data"]))
    found = []
    for root in roots:
        for meta in sorted((root / "link_ceilings").glob("*/" + RUN_JSON)):
            try:
                record = paths.read_json(meta)
            except (OSError, ValueError):
                continue  # being written, or damaged: not a result
            if record.get("status") == "finished" and record.get("device_kind") == "cuda":
                found.append((meta.parent, record))
    return found


def peer_ceiling(record: dict, src: str, dst: str) -> dict | None:
    """The best peer ceiling of `record`'s host from `src` to `dst` (devices such as "cuda:0", "cuda:1"): {"gbps",
    "path", "run"} from the nearest link_ceilings GPU run (this workbook's or the repository's) of the same fingerprint started within
    WITHIN_HOURS, the largest `ceiling_gbps` of its fit over the paths d2d_peer*:<src>-><dst> (copy engine and SM
    stores alike). None where the devices are not two GPUs or no such run is committed."""
    a, b = _DEVICE.match(str(src)), _DEVICE.match(str(dst))
    when = _started(record)
    if not a or not b or a.group(1) == b.group(1) or when is None:
        return None
    arrow = f":{a.group(1)}->{b.group(1)}"
    mine = fingerprint(record)
    best = None
    for run_dir, meta in _ceiling_runs():  # the machine and the time from run.json; tables only of a match
        started = _started(meta)
        if fingerprint(meta) != mine or started is None or abs((started - when).total_seconds()) > WITHIN_HOURS * 3600:
            continue
        fit = results.load(run_dir)[1].get("fit")
        if fit is None or not {"path", "ceiling_gbps"} <= set(fit.columns):
            continue
        peer = fit[fit["path"].astype(str).str.startswith("d2d_peer") & fit["path"].astype(str).str.endswith(arrow)]
        if not len(peer):
            continue
        top = peer.loc[peer["ceiling_gbps"].idxmax()]
        near = abs((started - when).total_seconds())
        if best is None or near < best[0]:
            best = (near, {"gbps": float(top["ceiling_gbps"]), "path": str(top["path"]), "run": run_dir.name})
    return None if best is None else best[1]
