"""Every notebook in notebooks/: committed clean with one well-declared parameters cell, and
executed end to end through papermill on the CPU with small parameters."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import nbformat
import pytest

from kvlab import cli, results
from kvlab import params as nbparams

# Small parameters per notebook (by file stem) so that each runs on a CPU in seconds. A notebook
# not listed runs with {}: its "auto" defaults resolve to the CPU preset (KVLAB_PRESET=cpu below).
SMALL: dict[str, dict] = {
    "00_calculator": {},
    "01_link_ceilings": {"sizes": "4K,64K,1M", "repeats": 3, "warmup": 1},
}

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
RUN_DIR_LINE = 'run_dir: str = ""  # kvlab run sets it; empty = a new data/<study>/<run_id>/'


def test_the_workbook_has_notebooks():
    assert NOTEBOOKS, f"no notebooks in {NOTEBOOK_DIR}"
    assert (NOTEBOOK_DIR / "00_calculator.ipynb") in NOTEBOOKS


def test_small_parameters_name_real_notebooks():
    stems = {nb.stem for nb in NOTEBOOKS}
    assert set(SMALL) <= stems, f"SMALL names notebooks that do not exist: {set(SMALL) - stems}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_without_outputs(path):
    nb = nbformat.read(str(path), as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{path.name} cell {i} has outputs: clear them"
            assert cell.execution_count is None, f"{path.name} cell {i} has an execution count"
    assert "papermill" not in nb.metadata, f"{path.name} is an executed copy (papermill metadata)"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_one_parameters_cell_every_parameter_annotated_and_commented(path):
    nb = nbformat.read(str(path), as_version=4)
    cells = nbparams.parameter_cells(nb)
    assert len(cells) == 1, f"{path.name} has {len(cells)} cells tagged parameters; need one"
    source = cells[0].source
    for node in ast.parse(source).body:
        assert isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name), (
            f"{path.name}: parameters cell line {node.lineno} is not an annotated assignment "
            f"(name: type = value  # comment): {ast.get_source_segment(source, node)!r}")
    declared = nbparams.parse_parameter_cell(source)
    for param in declared.values():
        assert param.annotation, f"{path.name}: {param.name} has no type annotation"
        assert param.default is not None, f"{path.name}: {param.name} has no default"
        assert param.help, f"{path.name}: {param.name} has no comment saying what it is"
    assert RUN_DIR_LINE in source.splitlines(), f"{path.name} lacks the line: {RUN_DIR_LINE}"
    # The test's own small values must still be parameters of the notebook, of the right types.
    cli.check_points([SMALL.get(path.stem, {})], declared, path.name)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_executes_on_cpu_with_small_parameters(path, kvlab_dirs, monkeypatch):
    # Small sizes even on a GPU machine: this is the logic check, not a measurement.
    monkeypatch.setenv("KVLAB_PRESET", "cpu")
    declared = nbparams.notebook_parameters(path)
    [params] = cli.check_points([SMALL.get(path.stem, {})], declared, path.name)
    outcome = cli.execute(path, params, progress=False,
                          invocation={"argv": ["pytest", path.name], "command": "test"})
    assert outcome.ok, f"{path.name} failed: {outcome.error}; executed copy: {outcome.output}"

    run_dir = outcome.run_dir
    assert run_dir.parent == kvlab_dirs.data / results.study_of(path)
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "finished", f"{path.name} never called run.finish()"
    assert record["study"] == results.study_of(path)
    assert record["device_kind"] == "cpu"
    assert list(run_dir.glob("*.csv")), f"{path.name} saved no table (Run.save_table)"
    assert list((run_dir / "figures").glob("*.png")), f"{path.name} saved no figure (plots.save)"
    executed = nbformat.read(str(outcome.output), as_version=4)
    errors = [o for c in executed.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "error"]
    assert errors == []
