"""Every notebook in notebooks/: committed clean with one well-declared parameters cell, and
executed end to end on the CPU preset by `kvlab run-all`, as `make run` does (the session fixture `workbook`)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import nbformat
import pytest

from kvlab import paths, results, runfolder
from kvlab import params as nbparams

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
RUN_DIR_LINE = 'run_dir: str = ""  # kvlab run sets it; empty: a new data/<study>/<run_id>/'


def test_the_workbook_has_notebooks():
    assert NOTEBOOKS, f"no notebooks in {NOTEBOOK_DIR}"
    assert (NOTEBOOK_DIR / "00_calculator.ipynb") in NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_without_outputs(path):
    nb = nbformat.read(str(path), as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{path.name} cell {i} has outputs: clear them"
            assert cell.execution_count is None, f"{path.name} cell {i} has an execution count"
    assert "papermill" not in nb.metadata, f"{path.name} is an executed copy (papermill metadata)"


def test_the_output_filter_strips_the_workbook_and_never_a_runs_record():
    """.gitattributes puts nbstripout on notebooks/ and takes it off data/: an executed notebook is a run's record."""
    import subprocess
    root = NOTEBOOK_DIR.parent
    if not (root / ".git").exists():
        pytest.skip("not a git checkout")
    record = next(iter(sorted((root / "data").glob("*/*/*.ipynb"))), None)
    assert record is not None, "no executed notebook committed under data/"
    out = subprocess.run(["git", "-C", str(root), "check-attr", "filter", "--", str(NOTEBOOKS[0].relative_to(root)),
                          str(record.relative_to(root))], capture_output=True, text=True, check=True).stdout
    lines = out.strip().splitlines()
    assert lines[0].endswith("filter: nbstripout"), lines[0]
    assert lines[1].endswith("filter: unset"), lines[1]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_papermill_reads_every_parameter_as_declared(path):
    """`papermill --help-notebook` (and JupyterLab's papermill tools) read the parameters cell with a regex that drops
    a line whose annotation is a union or whose comment holds "=": every parameter must come through, typed."""
    papermill = pytest.importorskip("papermill")
    seen = papermill.inspect_notebook(str(path))
    declared = nbparams.notebook_parameters(path)
    assert sorted(seen) == sorted(declared), f"papermill reads {sorted(seen)}, the cell declares {sorted(declared)}"
    for name, p in declared.items():
        assert seen[name]["inferred_type_name"] == p.annotation, (name, seen[name], p)


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


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_executes_on_cpu_through_run_all(path, workbook):
    """Each notebook as `kvlab run-all` (make run) executed it on the CPU preset: finished, with tables and
    figures in its run folder, no error output, and nothing published to figures/."""
    done = workbook.process
    assert f"{path.name}" in done.stdout, f"run-all did not run {path.name}:\n{done.stdout}\n{done.stderr}"
    folders = sorted((workbook.data / paths.study_of(path)).glob("*"))
    assert len(folders) == 1, f"{path.name}: expected one run folder, found {folders}\n{done.stderr[-3000:]}"
    run_dir = folders[0]
    executed = nbformat.read(str(run_dir / path.name), as_version=4)
    errors = [o for c in executed.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "error"]
    assert errors == [], f"{path.name}: {errors[0].get('ename')}: {errors[0].get('evalue')}" if errors else ""
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "finished", f"{path.name} never called run.finish()"
    assert record["study"] == paths.study_of(path)
    assert record["device_kind"] == "cpu"
    assert not (run_dir / runfolder.STOPPED).exists()
    assert list(run_dir.glob("*.csv")), f"{path.name} saved no table (Run.save_table)"
    assert list((run_dir / "figures").glob("*.png")), f"{path.name} saved no figure (plots.save)"
    assert not workbook.figures.exists(), "a plain run-all published figures; only --publish may"
    # nothing a user did not cause: no warnings in the cells' stderr (progress bars aside)
    noise = [o.text for c in executed.cells if c.cell_type == "code" for o in c.outputs
             if o.output_type == "stream" and o.name == "stderr" and "it/s" not in o.text and "%|" not in o.text
             and o.text.strip()]
    assert noise == [], f"{path.name} printed to stderr: {noise[:3]}"


def test_run_all_succeeds_and_says_nothing_it_need_not(workbook):
    done = workbook.process
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert lines == [], f"run-all wrote to stderr: {lines[:5]}"
