"""Every study has the one shape (kvlab.study): its parameters declared once — the notebook's parameters cell is made
from them —, a check that refuses bad input in one line, and the published tables the manifest asks of it."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from kvlab import params as nbparams
from kvlab import report, studies
from kvlab.study import Param, cell_params, check_params, parameters_cell

REPO = Path(__file__).resolve().parent.parent


def _faced():
    out = []
    for name in studies.NAMES:
        try:
            module = studies.get(name)
        except ModuleNotFoundError:
            continue
        if studies.has_face(module):
            out.append(module)
    return out


FACED = _faced()


def test_the_registry_knows_every_study_and_refuses_others():
    assert set(studies.NAMES) >= {"link_ceilings"} and FACED
    with pytest.raises(ValueError, match="unknown study 'handof'; did you mean 'handoff'"):
        studies.get("handof")


@pytest.mark.parametrize("study", [s for s in FACED if s.NOTEBOOK], ids=lambda s: s.NAME)
def test_the_notebook_parameters_cell_is_made_from_params(study):
    nb = nbformat.read(str(REPO / "notebooks" / f"{study.NOTEBOOK}.ipynb"), as_version=4)
    (cell,) = nbparams.parameter_cells(nb)
    assert cell.source == parameters_cell(study.PARAMS), (
        f"{study.NOTEBOOK}'s parameters cell differs from kvlab.studies.{study.NAME}.PARAMS; it should read:\n"
        + parameters_cell(study.PARAMS))
    assert list(cell_params(cell.source)) == [p.name for p in study.PARAMS] + ["run_dir"]


@pytest.mark.parametrize("study", FACED, ids=lambda s: s.NAME)
def test_the_defaults_pass_the_check_on_a_cpu(study, monkeypatch):
    monkeypatch.setenv("KVLAB_PRESET", "cpu")
    assert len({p.name for p in study.PARAMS}) == len(study.PARAMS)
    study.check({})


@pytest.mark.parametrize("study", FACED, ids=lambda s: s.NAME)
def test_an_unknown_or_mistyped_parameter_is_one_line_naming_it(study):
    first = study.PARAMS[0]
    with pytest.raises(ValueError, match=f"unknown parameter '{first.name}x' for study {study.NAME}") as err:
        study.check({f"{first.name}x": 1})
    assert "\n" not in str(err.value) and f"did you mean '{first.name}'" in str(err.value)
    wrong = 1.5 if first.type in ("str", "list", "bool") else "not a number"
    with pytest.raises(ValueError, match=f"^{first.name} = "):
        study.check({first.name: wrong})


@pytest.mark.parametrize("study", FACED, ids=lambda s: s.NAME)
def test_every_table_the_manifest_asks_of_a_study_is_one_it_draws(study):
    kinds = {e["kind"] for e in report.manifest()["blocks"].values() if e["study"] == study.NAME}
    assert kinds <= set(study.BLOCKS), sorted(kinds - set(study.BLOCKS))


def test_params_refuse_a_default_of_the_wrong_type_and_render_as_the_notebook_writes_them():
    with pytest.raises(ValueError, match="default 'x' is not a int"):
        Param("n", "int", "x", "a count")
    p = Param("links", "list", ["100G", "400G"], "links, presets")
    assert p.line() == 'links: list = ["100G", "400G"]  # links, presets'
    assert check_params([p], {}, "s") == {"links": ["100G", "400G"]}
    assert check_params([Param("m", "str", "auto", "model")], {"m": " auto"}, "s") == {"m": "auto"}
