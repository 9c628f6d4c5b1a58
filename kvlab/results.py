"""Runs: where results go, and the run.json that says where and how they were made.

A run is one folder ``data/<study>/<run_id>/`` holding ``run.json``, tidy CSV tables (one row per
configuration × repeat, units in the column names), the executed notebook and the run's own copy
of its figures. The run id is ``YYYYMMDD-HHMMSS-<device tag>`` in UTC, e.g.
``20261129-093012-h200``; two runs started in the same second get ``-2``, ``-3``… appended.

Typical use, in a notebook::

    run = results.start("handoff", {"model": model, "contexts": contexts}, run_dir=run_dir)
    run.save_table(df)                  # data/handoff/<run_id>/results.csv
    run.update(ceilings=ceilings)       # extra fields in run.json
    run.finish()

and for analysis of what another study measured: ``record, tables = results.load(
results.latest("link_ceilings"))``. A CPU run never stands in for a GPU result: ``latest`` prefers
the newest GPU run and ``kvlab.plots`` never lets a CPU run replace a figure published by a GPU run.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import enum
import json
import math
import os
import re
import reprlib
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from . import __version__, claims, devices, goals, paths, provenance
from .runfolder import RUN_JSON, check_run_folder, set_aside_stopped

SCHEMA = 1
STATUSES = ("running", "finished", "failed")

_TABLE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
# Arrays and tensors up to this many elements may be recorded as parameters (as lists); a larger
# one is data, not a parameter, and belongs in a table.
_MAX_ARRAY_PARAM = 10_000
# Fields that say where and how a run was made; Run.update must not rewrite them after the fact.
_PROTECTED = frozenset(
    {
        "schema", "run_id", "study", "status", "started_utc", "finished_utc", "duration_s", "git",
        "kvlab_version", "device_kind", "device_tag", "host", "devices", "p2p", "topology", "driver_version",
        "cuda_runtime", "versions", "parameters", "argv", "invocation", "tables", "host_state_start",
        "host_state_end", "host_usage", "pid", "goals",
    }
)


# ---------------------------------------------------------------------------------- run ids


def _utc_now() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc)


def _iso(when: _dt.datetime) -> str:
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def run_tag() -> str:
    """The device part of a new run id: the GPU model ("h200") on a GPU preset, else "cpu"."""
    return devices.device_tag() if devices.preset() == "gpu" else "cpu"


def new_run_id(tag: str | None = None, when: _dt.datetime | None = None) -> str:
    """``YYYYMMDD-HHMMSS-<tag>`` for ``when`` (default now) in UTC; ``tag`` defaults to
    ``run_tag()``."""
    tag = run_tag() if tag is None else tag
    if not re.fullmatch(r"[a-z0-9]+", tag):
        raise ValueError(f"run id tag {tag!r} is not valid: use lowercase letters and digits only")
    when = (when or _utc_now()).astimezone(_dt.timezone.utc)
    return f"{when:%Y%m%d-%H%M%S}-{tag}"


def new_run_dir(study: str) -> Path:
    """Create and return a fresh, empty ``<data_root>/<study>/<run_id>/``.

    Creation is exclusive, so two runs started in the same second (a fast sweep) get distinct
    folders: the second one's id carries ``-2``.
    """
    paths.check_study(study)
    parent = paths.data_root() / study
    parent.mkdir(parents=True, exist_ok=True)
    base = new_run_id()
    for n in range(1, 1000):
        path = parent / (base if n == 1 else f"{base}-{n}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        claims.claim(path)  # a new folder: ours, and marked so before anything else is written
        return path
    raise RuntimeError(f"could not find a free run folder for {base} under {parent}")


# ------------------------------------------------------------------------------ JSON values


def jsonable(value, where: str = "value"):
    """``value`` converted to plain JSON types, or TypeError naming ``where`` and the bad type.

    Converted: paths → str; numpy scalars → Python numbers; numpy arrays and torch tensors of at
    most 10,000 elements → lists; torch dtypes and devices → their str ("torch.bfloat16");
    enums → their value; dates → ISO strings; dataclasses → dicts; tuples and sets → lists;
    NaN and ±inf → the strings "nan", "inf", "-inf" (strict JSON has no such numbers).
    """
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else str(value)
    if isinstance(value, enum.Enum):
        return jsonable(value.value, where)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, (_dt.datetime, _dt.date)):
        return value.isoformat()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return jsonable(dataclasses.asdict(value), where)
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not isinstance(key, (str, int, float, bool)) and key is not None:
                raise TypeError(f"{where}: key {key!r} of type {type(key).__name__} is not valid; "
                                "use str keys")
            out[str(key)] = jsonable(item, f"{where}[{key!r}]")
        return out
    if isinstance(value, (list, tuple)):
        return [jsonable(item, f"{where}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, (set, frozenset)):
        return [jsonable(item, f"{where}{{}}") for item in sorted(value, key=repr)]

    # numpy and torch values can only exist when their module is already imported; checking
    # sys.modules keeps this function from importing either.
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        if isinstance(value, numpy.dtype):
            return str(value)
        if isinstance(value, numpy.generic):
            return jsonable(value.item(), where)
        if isinstance(value, numpy.ndarray):
            return jsonable(_small_array(value, int(value.size), "numpy array", where), where)
    torch = sys.modules.get("torch")
    if torch is not None:
        if isinstance(value, (torch.dtype, torch.device)):
            return str(value)
        if isinstance(value, torch.Tensor):
            return jsonable(_small_array(value, int(value.numel()), "torch tensor", where), where)
    kind = type(value)
    raise TypeError(
        f"{where}: {reprlib.repr(value)} of type {kind.__module__}.{kind.__qualname__} cannot be "
        "recorded in run.json; valid: None, bool, int, float, str, list, tuple, dict, set, paths, enums, dates, "
        "dataclasses, numpy scalars/arrays, torch dtypes/devices/tensors"
    )


def _small_array(value, size: int, what: str, where: str) -> list:
    if size > _MAX_ARRAY_PARAM:
        raise TypeError(f"{where}: a {what} of {size:,} elements is data, not a parameter (at most "
                        f"{_MAX_ARRAY_PARAM:,}); save it with Run.save_table instead")
    return value.tolist()


# ------------------------------------------------------------------------------------ runs


def _invocation() -> tuple[list, dict | None]:
    """(argv, invocation) of what started this run. ``kvlab run`` passes its own command line to
    the notebook's kernel in ``KVLAB_INVOCATION`` (JSON), because the kernel's sys.argv only names
    the kernel launcher."""
    raw = os.environ.get("KVLAB_INVOCATION", "").strip()
    if raw:
        try:
            invocation = json.loads(raw)
        except json.JSONDecodeError:
            invocation = {"raw": raw}
        if isinstance(invocation, dict):
            return list(invocation.get("argv") or sys.argv), invocation
    # papermill run directly: with --inject-paths it defines PAPERMILL_INPUT_PATH / PAPERMILL_OUTPUT_PATH in the
    # notebook's namespace (the kernel's __main__), which says where the executed notebook of this run is written
    main = sys.modules.get("__main__")
    paths_given = {key: getattr(main, f"PAPERMILL_{key.upper()}_PATH", None) for key in ("input", "output")}
    if all(isinstance(v, str) for v in paths_given.values()):
        return list(sys.argv), {"tool": "papermill", "notebook": paths_given["input"],
                                "executed": paths_given["output"]}
    return list(sys.argv), None


class Run:
    """One run: its folder, and its run.json kept in step with every change.

    Attributes: ``dir`` (Path of the run folder), ``run_id`` (str), ``study`` (str), ``is_gpu``
    (bool: the run measured on a CUDA device), ``record`` (a copy of run.json as a dict).
    Made by ``start()``; not constructed directly.
    """

    def __init__(self, path: Path, record: dict):
        self.dir = Path(path)
        self._record = record
        self._t0 = time.monotonic()

    @property
    def run_id(self) -> str:
        return self._record["run_id"]

    @property
    def study(self) -> str:
        return self._record["study"]

    @property
    def is_gpu(self) -> bool:
        return self._record["device_kind"] == "cuda"

    @property
    def record(self) -> dict:
        return json.loads(json.dumps(self._record))

    @property
    def json_path(self) -> Path:
        return self.dir / RUN_JSON

    def _write(self) -> None:
        paths.write_json(self.json_path, self._record)

    def save_table(self, df, name: str = "results", compress: bool = False) -> Path:
        """Write ``df`` to ``<run_dir>/<name>.csv`` (``.csv.gz`` with compress=True, for big tables) and
        list it in run.json; returns the path.

        Tidy tables: one row per configuration × repeat, units in column names (``bytes``, ``ms``,
        ``gbps``). A named index (as after ``groupby``) is data and is written as columns; an
        unnamed one is just row numbers and is dropped.
        """
        import pandas as pd

        if not isinstance(df, pd.DataFrame):
            raise TypeError(f"save_table needs a pandas DataFrame, got {type(df).__name__}")
        if not isinstance(name, str):
            raise TypeError(f"table name must be a str, got {type(name).__name__}")
        stem = name.removesuffix(".csv")
        if not _TABLE_RE.match(stem):
            raise ValueError(f"table name {name!r} is not valid: use letters, digits, '_', '-' "
                             "and '.', starting with a letter or digit (e.g. 'results')")
        if any(level is not None for level in df.index.names):
            df = df.reset_index()
        path = self.dir / (f"{stem}.csv.gz" if compress else f"{stem}.csv")
        # gzip without a timestamp, so the same table gives the same bytes (and sha256)
        df.to_csv(path, index=False, compression={"method": "gzip", "mtime": 0} if compress else None)
        self._record.setdefault("tables", {})[stem] = {
            "file": path.name,
            "rows": int(len(df)),
            "columns": [str(c) for c in df.columns],
            "sha256": _sha256(path),  # what every reader checks the file against (`load`)
        }
        self._write()
        return path

    def tables(self) -> dict:
        """``{name: DataFrame}`` of every table in the run folder (what `measure` wrote), as `load` reads them."""
        return load(self.dir)[1]

    def save_analysis(self, analysis) -> None:
        """Keep a study's analysis (kvlab.study.Analysis) with its run: each derived table as ``<name>.csv``, the goal
        table as goals.csv, the findings and named values in run.json — what the notebook showed, as its code made
        it (`kvlab analyse` recomputes them later into a folder of their own)."""
        for name, df in analysis.tables.items():
            self.save_table(df, name)
        if len(analysis.goals):
            self.save_table(analysis.goals, "goals")
        self.update(findings=list(analysis.findings), values=dict(analysis.values), **analysis.fields)

    def update(self, **fields) -> None:
        """Add or replace fields of run.json (e.g. ``ceilings=...``, ``resolved={...}``) and write
        it at once. Provenance fields (run_id, git, devices, parameters, …) cannot be replaced."""
        clash = sorted(set(fields) & _PROTECTED)
        if clash:
            raise ValueError(f"run.json fields {clash} are written by kvlab and cannot be updated; "
                             f"protected: {sorted(_PROTECTED)}")
        converted = {key: jsonable(value, key) for key, value in fields.items()}
        self._record.update(converted)
        self._write()

    def reload(self) -> None:
        """Read run.json back from disk, after something else wrote it (record_execution, amend): a later update
        or finish then starts from what is there, not from this object's older copy."""
        self._record = paths.read_json(self.dir / RUN_JSON)

    def finish(self) -> None:
        """Mark the run finished (UTC time, duration in seconds) and write run.json. Only finished
        runs are found by ``latest()``; calling it again re-stamps the finish time."""
        self._record["status"] = "finished"
        self._record["finished_utc"] = _iso(_utc_now())
        self._record["duration_s"] = round(time.monotonic() - self._t0, 3)
        end = devices.host_state()
        self._record["host_state_end"] = end
        # what the whole machine's CPUs did during the run: a busy or stolen-from host shows here
        self._record["host_usage"] = devices.host_usage(self._record.get("host_state_start"), end)
        self._write()

    def __repr__(self) -> str:
        return f"Run({self.study!r}, {self.run_id!r}, dir={str(self.dir)!r}, is_gpu={self.is_gpu})"


def start(study: str, params: Mapping, run_dir: str | os.PathLike = "") -> Run:
    """Begin a run of ``study`` with ``params`` (the notebook's parameters) and write run.json.

    ``run_dir`` empty: a new ``<data_root>/<study>/<run_id>/``; otherwise that folder (created if
    missing) is the run, and its name is the run id. Bad input (an invalid study name, params
    that are not a mapping or hold a value JSON cannot record) raises before anything is written.

    run.json holds: schema, run_id, study, status ("running" until ``finish()``), started_utc,
    finished_utc, duration_s, git (commit, dirty flag, every dirty path, code_sha256; git.diff and its hash where the code is not the commit's), kvlab_version, device_kind
    ("cuda" | "cpu"), device_tag, host, devices (GPUs), p2p, driver_version, cuda_runtime,
    versions, parameters, goals (those in force now, kvlab.goals.recorded), argv, invocation, host_state_start
    (devices.host_state()); ``finish()`` adds
    host_state_end and host_usage (busy / iowait / steal % of the machine's CPU time during the run).
    """
    paths.check_study(study)
    if not isinstance(params, Mapping):
        raise TypeError(f"params must be a mapping of parameter name to value, got "
                        f"{type(params).__name__}")
    parameters = jsonable(dict(params), "params")
    if not isinstance(run_dir, (str, os.PathLike)):
        raise TypeError(f"run_dir must be a str or path, got {type(run_dir).__name__}")

    hardware = devices.describe()
    # A CPU preset forced on a GPU host (KVLAB_PRESET=cpu) measures on the CPU: it is a CPU run,
    # and must not be mistaken for a GPU result.
    if hardware["device_kind"] == "cuda" and devices.preset() == "cpu":
        hardware["device_kind"], hardware["device_tag"] = "cpu", "cpu"

    if os.fspath(run_dir) == "":
        path = new_run_dir(study)
    else:
        path = Path(run_dir).expanduser().resolve()
        if not claims.owns(path):  # kvlab run claimed it for this kernel already, and handed the claim on
            check_run_folder(path)
            claims.claim(path, set_aside=set_aside_stopped)
        set_aside_stopped(path)

    argv, invocation = _invocation()
    git = provenance.git_state()
    try:
        _record_diff(path, git)
    except OSError as err:  # a full disk: the error names the folder (a write's own error names no file)
        err.filename = err.filename or str(path)
        raise
    record = {
        "schema": SCHEMA,
        "run_id": path.name,
        "study": study,
        "status": "running",
        "pid": os.getpid(),  # while "running": which process writes the folder (check_run_folder)
        "started_utc": _iso(_utc_now()),
        "finished_utc": None,
        "duration_s": None,
        "git": git,
        "kvlab_version": __version__,
        **hardware,
        "parameters": parameters,
        # the goals in force as the run starts (kvlab.goals): it is judged by these; a goal declared later, beside
        "goals": goals.recorded(study),
        "argv": argv,
        "invocation": invocation,
        "host_state_start": devices.host_state(),
    }
    run = Run(path, record)
    try:
        run._write()
    except OSError as err:
        err.filename = err.filename or str(path)
        raise
    return run


DIFF_GZIP_BYTES = 256 << 10  # a recorded diff larger than this is kept as git.diff.gz


def _record_diff(run_dir: Path, git: dict) -> None:
    """Where the code on disk is not its commit's, write the difference to ``<run_dir>/git.diff`` and name
    it (and its sha256) in ``git``: a reader can then rebuild the code that ran. Nothing when the code is
    the commit's, or when the commit is not known here (a sent tree whose .git is older): `kvlab provenance`
    checks the code hash against the commit later, on a machine that has it."""
    import hashlib

    commit, code = git.get("commit"), git.get("code_sha256")
    if not commit or not code:
        return
    expected = provenance.commit_hash(commit)
    git["code_matches_commit"] = None if expected is None else code == expected
    if expected is None or code == expected:
        return
    patch = provenance.code_diff(base=commit).encode("utf-8")
    (run_dir / "git.diff").write_bytes(patch)
    git["diff_file"] = "git.diff"
    git["diff_sha256"] = hashlib.sha256(patch).hexdigest()
    # does commit + diff give back the code on disk? (a binary or unreadable change would not)
    git["diff_rebuilds_code"] = provenance.rebuilt_hash(commit, run_dir / "git.diff") == code
    if len(patch) > DIFF_GZIP_BYTES:  # kept compressed (the sha256 stays the patch's; provenance.read_diff reads it)
        import gzip

        (run_dir / "git.diff.gz").write_bytes(gzip.compress(patch, mtime=0))
        (run_dir / "git.diff").unlink()


def amend(run_dir: str | os.PathLike, **fields) -> None:
    """Add fields to run.json as it is on disk, keeping what others wrote there since (a Run's own `update`
    writes its record back whole, and would undo record_execution's "failed"). Provenance fields are refused as in
    Run.update."""
    clash = sorted(set(fields) & _PROTECTED)
    if clash:
        raise ValueError(f"run.json fields {clash} are written by kvlab and cannot be amended; "
                         f"protected: {sorted(_PROTECTED)}")
    path = Path(run_dir) / RUN_JSON
    record = paths.read_json(path)
    record.update({key: jsonable(value, key) for key, value in fields.items()})
    paths.write_json(path, record)


# ----------------------------------------------------------------------------------- reading


def runs(study: str, gpu: bool | None = None, finished: bool = True) -> list[Path]:
    """Run folders of ``study``, newest first (by start time, then id).

    ``gpu``: True → GPU runs only, False → CPU runs only, None → both. ``finished``: only runs
    whose run.json says "finished" (a crashed or still-running run is not a result).
    """
    paths.check_study(study)
    found = []
    parent = paths.data_root() / study
    if not parent.is_dir():
        return []
    for path in parent.iterdir():
        meta = path / RUN_JSON
        if not meta.is_file():
            continue
        try:
            record = paths.read_json(meta)
        except (OSError, json.JSONDecodeError):
            continue  # a run.json being written by a run in progress, or damaged: not a result
        if finished and record.get("status") != "finished":
            continue
        is_gpu = record.get("device_kind") == "cuda"
        if gpu is not None and is_gpu != gpu:
            continue
        found.append((record.get("started_utc") or "", path.name, path))
    found.sort(reverse=True)
    return [path for _, _, path in found]


def latest(study: str, gpu: bool = True) -> Path:
    """The newest finished run folder of ``study``: with ``gpu=True`` the newest GPU run, falling
    back to the newest CPU run when no GPU run exists; with ``gpu=False`` the newest of any kind.

    FileNotFoundError (naming the study and where it looked) when the study has no finished run.
    """
    found = (runs(study, gpu=True) if gpu else []) or runs(study)
    if not found:
        raise FileNotFoundError(
            f"no finished run of study {study!r} under {paths.data_root() / study}; "
            f"make one with: kvlab run {study}"
        )
    return found[0]


def _sha256(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class DamagedTable(ValueError):
    """A run's table is not what its run.json recorded (cut short, edited, replaced): its readers refuse it."""


def verify_table(run_dir: Path, name: str, entry: dict, df) -> str:
    """Check table `name` of a run against its run.json entry: its sha256 where the run recorded one, else (a run
    from before tables were hashed) its rows and columns. Returns how it was checked ("sha256" | "rows and
    columns"); DamagedTable naming the file and what differs otherwise."""
    file = Path(run_dir) / str(entry.get("file", f"{name}.csv"))
    digest = entry.get("sha256")
    if digest:
        got = _sha256(file)
        if got != digest:
            raise DamagedTable(f"{file}: its sha256 is {got[:12]}…, run.json recorded {digest[:12]}… — the table was "
                               "changed or cut short after the run wrote it; kvlab does not read it")
        return "sha256"
    rows, cols = entry.get("rows"), entry.get("columns")
    if rows is not None and int(rows) != len(df):
        raise DamagedTable(f"{file}: {len(df):,} rows, run.json recorded {int(rows):,} — the table was cut short or "
                           "changed after the run wrote it; kvlab does not read it")
    if cols is not None and [str(c) for c in df.columns] != [str(c) for c in cols]:
        raise DamagedTable(f"{file}: its columns are not the {len(cols)} run.json recorded; kvlab does not read it")
    return "rows and columns"


def load(run_dir: str | os.PathLike) -> tuple[dict, dict]:
    """``(record, tables)`` of a run: run.json as a dict, and ``{name: DataFrame}`` for every
    ``<name>.csv`` and ``<name>.csv.gz`` in the run folder. Every table run.json lists is checked against it first
    (`verify_table`: its sha256, or for older runs its rows and columns): a table cut short, edited or missing is a
    DamagedTable (one line, naming the file), never read as if whole."""
    import pandas as pd

    path = Path(run_dir)
    meta = path / RUN_JSON
    if not meta.is_file():
        raise FileNotFoundError(f"{path} is not a run folder: it has no {RUN_JSON}")
    record = paths.read_json(meta)
    if not isinstance(record, dict):
        raise ValueError(f"{meta}: not a run's record (a JSON object)")
    listed = record.get("tables") if isinstance(record.get("tables"), dict) else {}
    tables = {}
    for csv in sorted([*path.glob("*.csv"), *path.glob("*.csv.gz")]):
        name = csv.name.removesuffix(".gz").removesuffix(".csv")
        entry = listed.get(name)
        if entry is not None and entry.get("sha256"):
            verify_table(path, name, entry, None)  # before pandas reads it: a gzip cut short is refused by hash
        try:
            tables[name] = pd.read_csv(csv)
        except (EOFError, OSError, UnicodeDecodeError, pd.errors.ParserError, pd.errors.EmptyDataError) as err:
            raise DamagedTable(f"{csv}: cannot be read as a table ({type(err).__name__}: {str(err)[:120]})") from None
        if entry is not None and not entry.get("sha256"):
            verify_table(path, name, entry, tables[name])
    missing = [n for n, e in listed.items() if n not in tables and isinstance(e, dict)]
    if missing:
        raise DamagedTable(f"{path}: run.json lists table(s) {', '.join(missing)}, which are not in the folder")
    return record, tables
