"""Shared test set-up: every test writes into its own temporary data and figures folders, never into
the repository, and tests marked ``gpu`` are skipped on a machine without CUDA."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvlab.disagg.launch import progress_of, worker_pids

# Variables a developer's shell may carry that would change what kvlab does under test.
_KVLAB_ENV = ("KVLAB_ROOT", "KVLAB_PRESET", "KVLAB_BATCH", "KVLAB_INVOCATION", "KVLAB_DEBUG", "KVLAB_PUBLISH",
              "KVLAB_GIT_COMMIT", "KVLAB_CELL_TIMEOUT")
# A notebook cell (or a kernel reply) that takes longer than this under test fails its test rather than hanging the
# suite: the small-parameter notebooks take seconds on a CPU.
CELL_TIMEOUT_S = "300"


@pytest.fixture(autouse=True)
def kvlab_dirs(tmp_path, monkeypatch):
    """KVLAB_DATA and KVLAB_FIGURES point at fresh folders under tmp_path (not yet created, so a
    test can tell whether anything was written at all)."""
    for name in _KVLAB_ENV:
        monkeypatch.delenv(name, raising=False)
    dirs = SimpleNamespace(data=tmp_path / "kvlab-data", figures=tmp_path / "kvlab-figures")
    monkeypatch.setenv("KVLAB_DATA", str(dirs.data))
    monkeypatch.setenv("KVLAB_FIGURES", str(dirs.figures))
    monkeypatch.setenv("KVLAB_CELL_TIMEOUT", CELL_TIMEOUT_S)
    return dirs


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return  # no torch import when nothing asks for a GPU
    from kvlab import devices

    if devices.has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; torch sees none here")
    for item in gpu_items:
        item.add_marker(skip)


def write_notebook(path: Path, parameters: str, *cells: str) -> Path:
    """Write a small notebook: a markdown title, a code cell tagged ``parameters`` holding
    ``parameters``, then one code cell per entry of ``cells``."""
    import nbformat
    from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

    nb = new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    tagged = new_code_cell(parameters)
    tagged.metadata["tags"] = ["parameters"]
    nb.cells = [new_markdown_cell(f"# {path.stem}"), tagged, *map(new_code_cell, cells)]
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, str(path))
    return path


TOY_PARAMETERS = '''\
size: int = 3  # rows in the table
scale: float = 1.0  # multiplier of every value, unitless
label: str = "x"  # a label carried into run.json
contexts: list[int] = [1, 2]  # prompt lengths, tokens
mode: int | str = "auto"  # "auto" or a number
run_dir: str = ""  # kvlab run sets it; empty = a new data/<study>/<run_id>/
'''

TOY_BODY = '''\
import pandas as pd
from kvlab import nbtools, results

run = results.start("toy", dict(size=size, scale=scale, label=label, contexts=contexts,
                                mode=mode), run_dir=run_dir)
run.save_table(pd.DataFrame({"i": range(size), "value_ms": [i * scale for i in range(size)]}))
run.update(interactive=nbtools.is_interactive())
if size == 13:
    raise RuntimeError("size 13 fails on purpose")
run.finish()
'''


@pytest.fixture
def toy_project(tmp_path, monkeypatch):
    """A throwaway workbook (KVLAB_ROOT) whose notebooks/ holds 00_toy.ipynb: parameters of each
    kind, a table, and a failure on demand (size=13)."""
    root = tmp_path / "project"
    write_notebook(root / "notebooks" / "00_toy.ipynb", TOY_PARAMETERS, TOY_BODY)
    monkeypatch.setenv("KVLAB_ROOT", str(root))
    return root


@pytest.fixture
def make_notebook():
    """``write_notebook(path, parameters, *cells)`` for tests that need a notebook of their own."""
    return write_notebook


REPO = Path(__file__).resolve().parent.parent


def cpu_env(tmp_path) -> dict:
    """The environment a test's `kvlab` command gets: data and figures under `tmp_path`, the CPU preset."""
    return {"KVLAB_DATA": str(tmp_path / "data"), "KVLAB_FIGURES": str(tmp_path / "figures"), "KVLAB_PRESET": "cpu"}


def cpu_process_env(tmp_path) -> dict:
    """The environment of a `kvlab` process a test starts itself (Popen): the developer's shell without its KVLAB_
    variables, then cpu_env and the repository on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVLAB_")}
    env.update(cpu_env(tmp_path), PYTHONPATH=str(REPO))
    return env


def kvlab_command(argv: list[str], env_extra: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run ``kvlab ARGV`` as a user would (a new process, the repository as working directory), with the data
    and figures roots and the published-figure switch taken from ``env_extra``, never the developer's shell."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVLAB_")}
    env["KVLAB_CELL_TIMEOUT"] = CELL_TIMEOUT_S
    env.update(env_extra or {})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-m", "kvlab", *argv], cwd=REPO, env=env, capture_output=True,
                          stdin=subprocess.DEVNULL, text=True, timeout=timeout, check=False)


@pytest.fixture(scope="session")
def workbook(tmp_path_factory):
    """`kvlab run-all` — what `make run` does and README shows — once per session, on the CPU preset, into
    temporary data and figures folders: (completed process, data root, figures root)."""
    root = tmp_path_factory.mktemp("workbook")
    data, figures = root / "data", root / "figures"
    done = kvlab_command(["run-all", "--no-progress"],
                         {"KVLAB_DATA": str(data), "KVLAB_FIGURES": str(figures), "KVLAB_PRESET": "cpu"})
    return SimpleNamespace(process=done, data=data, figures=figures)


# ------------------------------------------------------------- two-process runs (kvlab disagg) as a user starts them


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def requests_done(port: int) -> int:
    """Requests the decode worker has finished, from the launcher's control store: the signed `progress` value's
    body (read here without checking its MAC, which needs the run's key)."""
    return progress_of(port)


def disagg_workers(out) -> dict[str, int]:
    """pid of each disagg worker process whose run folder is `out`, by role."""
    return worker_pids(out)
