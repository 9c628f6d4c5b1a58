"""Running notebooks for `kvlab run`, `run-all` and `sweep`: each through papermill into a run folder claimed before
its kernel starts, with kvlab's environment for the kernel (batch mode, the command line, the claim); how each ended
(`Outcome`); the per-cell timeout; and sweep grids, read totally (kvlab.parse.yaml_load, or JSON without repeated
keys) and checked point by point before any run."""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import os
import reprlib
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from . import claims, paths, results, runfolder
from .params import Parameter, check_names, coerce
from .parse import MAX_YAML_BYTES, UsageError, yaml_load

__all__ = ["environment", "Outcome", "execute", "summary", "report_failure", "outcome_row", "cell_timeout",
           "MAX_GRID_POINTS", "load_grid", "parse_grid", "check_points"]


@contextlib.contextmanager
def environment(**values: str) -> Iterator[None]:
    """Set environment variables for the kernels started inside, restoring them afterwards (the
    tests call main() in-process, so nothing may leak)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


# A logger's filters see only the records logged on it, not its children's: name each one.
_PAPERMILL_LOGGERS = ("papermill", "papermill.translators")


class _QuietInspection(logging.Filter):
    """Drops papermill's own parameter-inspection warnings. Its regex cannot read lines such as
    ``x: int | str = ...`` or one whose comment holds "=" (kvlab's own notebooks have none: kvlab.study.Param
    refuses them, but a user's notebook may), so it warns about them and calls their parameters unknown; kvlab has
    already checked every name with ``notebook_parameters``, so these lines would only be noise."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not message.startswith(("Unable to parse line", "Passed unknown parameter"))


@dataclass
class Outcome:
    """How one notebook execution ended: ``ok`` (bool), ``seconds`` (wall time, s), ``error``
    (one line, or None), ``output`` (the executed notebook, kept even when it failed)."""

    notebook: str
    run_dir: Path
    ok: bool
    seconds: float
    error: str | None
    output: Path


def execute(notebook: Path, params: Mapping, run_dir: str | os.PathLike | None = None,
            progress: bool = True, invocation: Mapping | None = None,
            cell_timeout: float | None = None) -> Outcome:
    """Execute ``notebook`` through papermill with ``params`` (already validated) into
    ``run_dir`` (default: a new ``data/<study>/<run_id>/``), which the notebook gets as its
    ``run_dir`` parameter.

    The kernel runs with the notebook's folder as working directory, ``KVLAB_BATCH=1`` (so
    ``nbtools.is_interactive()`` is False) and this command line in ``KVLAB_INVOCATION`` (for
    run.json). A failure is returned, not raised: the partial notebook stays for debugging.
    """
    import papermill

    from kvlab import nbexec  # jupyter_client: imported only when a notebook runs

    notebook = Path(notebook)
    study = paths.check_study(paths.study_of(notebook))
    folder = Path(run_dir).expanduser().resolve() if run_dir else results.new_run_dir(study)
    if run_dir:  # claimed here, before the kernel starts, and handed on to it (KVLAB_CLAIM): one run a folder
        try:
            claims.claim(folder, "--run-dir", set_aside=runfolder.set_aside_stopped)
        except ValueError as err:
            raise UsageError(str(err)) from None
    token = (claims.held(folder) or {}).get("token", "")
    runfolder.set_aside_stopped(folder)  # an earlier attempt that stopped here: its files kept apart, not mixed in
    output = folder / notebook.name
    invocation = dict(invocation or {"argv": sys.argv})
    invocation.setdefault("notebook", notebook.name)
    # The kernel must import this very kvlab, even from a source tree that was never installed.
    package_parent = str(Path(__file__).resolve().parent.parent)
    python_path = os.pathsep.join(p for p in (package_parent, os.environ.get("PYTHONPATH")) if p)
    t0 = time.monotonic()
    error = None
    quiet = _QuietInspection()
    for name in _PAPERMILL_LOGGERS:
        logging.getLogger(name).addFilter(quiet)
    with environment(KVLAB_BATCH="1", KVLAB_INVOCATION=json.dumps(invocation),
                      PYTHONPATH=python_path, **{claims.ENV: token}):
        try:
            nbexec.execute_notebook(
                str(notebook), str(output), parameters={**params, "run_dir": str(folder)},
                kernel_name="python3", cwd=str(notebook.parent), progress_bar=progress,
                request_save_on_cell_execute=True,
                execution_timeout=math.ceil(cell_timeout) if cell_timeout else None,  # nbclient takes whole seconds
                # the kernel's own start-up warnings ("running over TCP without encryption": a local
                # kernel that papermill started for this run) are not the user's business
                extra_arguments=["--IPKernelApp.log_level=ERROR"],
            )
        except papermill.PapermillExecutionError as err:
            error = f"{err.ename}: {err.evalue} (cell {err.exec_count})"
        except KeyboardInterrupt as err:  # Ctrl-C, or SIGTERM (main() turns it into runfolder.Terminated)
            runfolder.record_execution(folder, notebook.name, False, time.monotonic() - t0, runfolder.stop_reason(err))
            err.run_dir = folder  # main's one line names the folder that says it stopped
            raise
        except Exception as err:  # the kernel died, would not start or timed out: still a failed run
            first = (str(err).strip().splitlines() or [""])[0]
            error = (f"{type(err).__name__}: a cell or the kernel's reply took longer than the cell timeout "
                     f"({math.ceil(cell_timeout)} s)" if cell_timeout and "execution timed out" in str(err)
                     else f"{type(err).__name__}: {first}")
        finally:
            for name in _PAPERMILL_LOGGERS:
                logging.getLogger(name).removeFilter(quiet)
    seconds = time.monotonic() - t0
    runfolder.record_execution(folder, notebook.name, error is None, seconds, error)
    return Outcome(notebook.name, folder, error is None, seconds, error, output)


def summary(rows: list[dict]) -> str:
    """A plain-text table of ``rows`` (dicts with the same keys), for the terminal."""
    if not rows:
        return "(nothing ran)"
    keys = list(rows[0])
    cells = [[str(r[k]) for k in keys] for r in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]

    def line(values: list[str]) -> str:
        return "  ".join(v.ljust(w) for v, w in zip(values, widths)).rstrip()

    return "\n".join([line(keys), line(["-" * w for w in widths]), *map(line, cells)])


def report_failure(outcome: Outcome) -> None:
    if outcome.ok:
        return
    print(f"FAILED {outcome.notebook}: {outcome.error}\n  partial notebook: {outcome.output}",
          file=sys.stderr)


def outcome_row(outcome: Outcome, **extra) -> dict:
    return {"notebook": outcome.notebook, **extra,
            "status": "ok" if outcome.ok else "FAILED",
            "seconds": f"{outcome.seconds:.1f}", "run dir": str(outcome.run_dir)}




def cell_timeout(value: str | float | None) -> float | None:
    """--cell-timeout S (or KVLAB_CELL_TIMEOUT when the flag is not given): seconds > 0, or None for no limit."""
    source = "--cell-timeout"
    if value is None:
        value, source = os.environ.get("KVLAB_CELL_TIMEOUT", "").strip() or None, "KVLAB_CELL_TIMEOUT"
    if value is None:
        return None
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise UsageError(f"{source} = {value!r}: give a number of seconds > 0 (e.g. 600), or leave it out for no limit")
    return seconds




MAX_GRID_POINTS = 10_000  # each point is a notebook run: more is a typing mistake, and expanding it could fill memory


def _no_repeated_keys(path):
    def hook(pairs):
        keys = [k for k, _ in pairs]
        dup = next((k for k in keys if keys.count(k) > 1), None)
        if dup is not None:
            raise ValueError(f"grid file {path}: key {dup!r} is given twice; give each key once")
        return dict(pairs)
    return hook


def load_grid(path: str | os.PathLike) -> list[dict]:
    """The points of a sweep grid file (YAML, or JSON for a ``.json`` file).

    Either a mapping ``name: [values]`` (every combination, the first name varying slowest) or a
    list of mappings (one point each). A value that is itself a list is written as a list of lists:
    ``contexts: [[1024], [1024, 4096]]`` is two points.
    """
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"grid file {str(path)!r} does not exist (or is not a regular file)")
    if path.stat().st_size > MAX_YAML_BYTES:
        raise UsageError(f"grid file {path} is {path.stat().st_size:,} bytes; a grid is at most {MAX_YAML_BYTES:,}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"grid file {path} is not text (UTF-8)") from None
    return parse_grid(text, path, as_json=path.suffix == ".json")


def parse_grid(text: str, path: str | os.PathLike = "grid", as_json: bool = False) -> list[dict]:
    """`load_grid` of a grid's text: its points, or a one-line UsageError naming `path`."""
    try:
        if as_json:
            grid = json.loads(text, object_pairs_hook=_no_repeated_keys(path))
        else:
            grid = yaml_load(text, f"grid file {path}")
    except json.JSONDecodeError as err:
        raise UsageError(f"grid file {path} is not valid JSON ({err.msg} at line {err.lineno})") from None
    except (ValueError, RecursionError) as err:  # YAMLInputError, a repeated key, nesting too deep
        raise UsageError(str(err) if str(err).startswith("grid file") else f"grid file {path}: {err}") from None
    forms = ("a mapping of parameter name to a list of values (every combination), or a list of "
             "mappings (one point each)")
    if isinstance(grid, dict):
        if not grid:
            raise UsageError(f"grid file {path} is empty; write {forms}")
        for name, values in grid.items():
            if not isinstance(values, list) or not values:
                raise UsageError(
                    f"grid {path}: {reprlib.repr(name)} must map to a non-empty list of values, got "
                    f"{reprlib.repr(values)}; write e.g. "
                    f"{name if isinstance(name, str) and name.isidentifier() else reprlib.repr(name)}: "
                    f"[{reprlib.repr(values)}]")
        names = list(grid)
        size = 1
        for values in grid.values():
            size *= len(values)
        if size > MAX_GRID_POINTS:
            raise UsageError(f"grid {path} has {size:,} points ({' × '.join(str(len(v)) for v in grid.values())}); "
                             f"kvlab sweep takes at most {MAX_GRID_POINTS:,}: split it, or list the points you want")
        return [{str(n): v for n, v in zip(names, combo)}
                for combo in itertools.product(*grid.values())]
    if isinstance(grid, list):
        if not grid:
            raise UsageError(f"grid file {path} is an empty list; write {forms}")
        if len(grid) > MAX_GRID_POINTS:
            raise UsageError(f"grid {path} lists {len(grid):,} points; kvlab sweep takes at most {MAX_GRID_POINTS:,}")
        for i, point in enumerate(grid):
            if not isinstance(point, dict):
                raise UsageError(f"grid {path}: point {i} is {reprlib.repr(point)}, not a mapping of "
                                 "parameter name to value")
        return [{str(n): v for n, v in point.items()} for point in grid]
    raise UsageError(f"grid file {path} holds {type(grid).__name__}; write {forms}")


def check_points(points: list[dict], declared: Mapping[str, Parameter],
                 notebook: str) -> list[dict]:
    """Every point's names checked against ``declared`` and its values coerced, before any run;
    one UsageError lists every problem found."""
    problems, checked = [], []
    for i, point in enumerate(points):
        try:
            check_names([str(n) for n in point], declared, notebook)
            checked.append({n: coerce(declared[n], v) for n, v in point.items()})
        except UsageError as err:
            problems.append(f"point {i} {reprlib.repr(point)}: {err}")
    if problems:
        more = f"\n… and {len(problems) - 10:,} more" if len(problems) > 10 else ""
        raise UsageError(f"the grid has {len(problems):,} point(s) the notebook cannot take:\n"
                         + "\n".join(problems[:10]) + more)
    return checked
