"""Notebook parameters: the one `parameters` cell of each notebook, read with `ast` (names, annotations,
defaults, the comment that explains each), values given on the command line checked against it (YAML, then
the annotation), and notebooks found by path or short name. `kvlab run` / `sweep` use it, and so does a
notebook that records its own parameters (`recorded(globals(), notebook)`), so none is retyped.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import io
import os
import tokenize
from collections.abc import Mapping
from pathlib import Path

from . import paths
from .parse import UsageError, YAMLInputError, yaml_load

__all__ = ["UsageError", "Parameter", "parameter_cells", "parse_parameter_cell", "notebook_parameters",
           "runnable_parameters", "coerce", "check_names", "parse_params", "notebooks_dir", "list_notebooks",
           "find_notebook"]

# annotation names a value given on the command line may be checked against
_TYPES: dict[str, type | tuple] = {
    "int": int, "float": (int, float), "str": str, "bool": bool,
    "list": list, "List": list, "tuple": (list, tuple), "Tuple": (list, tuple),
    "Sequence": (list, tuple), "dict": dict, "Dict": dict, "Mapping": dict,
}


@dataclasses.dataclass(frozen=True)
class Parameter:
    """One assignment of a notebook's ``parameters`` cell.

    ``annotation``: the type as written (``"list[int]"``), None when unannotated; ``default``: the
    source text of the value; ``help``: the comment on its line ("" when none).
    """

    name: str
    annotation: str | None
    default: str | None
    help: str

    def describe(self) -> str:
        text = f"{self.name}: {self.annotation or '?'} = {self.default}"
        return f"{text}  # {self.help}" if self.help else text


def parameter_cells(nb) -> list:
    """The code cells of a notebook (an nbformat node) tagged ``parameters``."""
    return [c for c in nb.cells
            if c.cell_type == "code" and "parameters" in c.get("metadata", {}).get("tags", [])]


def parse_parameter_cell(source: str, where: str = "parameters cell") -> dict[str, Parameter]:
    """``{name: Parameter}`` for each top-level assignment in a parameters cell, in order.

    Parsed with ``ast`` rather than papermill's inspector, which silently drops parameters whose
    annotation holds ``|`` (``size: int | str = "auto"``) — those would then be refused as unknown.
    """
    try:
        tree = ast.parse(source)
    except SyntaxError as err:
        raise UsageError(f"{where} is not valid Python (line {err.lineno}): {err.msg}") from None
    comments: dict[int, str] = {}
    with contextlib.suppress(tokenize.TokenError):
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT:
                comments.setdefault(tok.start[0], tok.string.lstrip("#").strip())
    found: dict[str, Parameter] = {}
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            name, annotation = node.target.id, ast.unparse(node.annotation)
        elif (isinstance(node, ast.Assign) and len(node.targets) == 1
              and isinstance(node.targets[0], ast.Name)):
            name, annotation = node.targets[0].id, None
        else:
            continue
        default = ast.get_source_segment(source, node.value) if node.value is not None else None
        help_ = next((comments[line] for line in range(node.lineno, node.end_lineno + 1)
                      if line in comments), "")
        found[name] = Parameter(name, annotation, default, help_)
    return found


def notebook_parameters(path: str | os.PathLike) -> dict[str, Parameter]:
    """The parameters a notebook declares (its first cell tagged ``parameters``, the one papermill
    injects after); empty when it has none."""
    import nbformat

    nb = nbformat.read(str(path), as_version=4)
    cells = parameter_cells(nb)
    if not cells:
        return {}
    if len(cells) > 1:  # papermill injects after the first, so the second would win in the kernel, unrecorded
        raise UsageError(f"{Path(path).name} has {len(cells)} cells tagged parameters; a notebook has exactly one "
                         "(remove the tag from the others)")
    return parse_parameter_cell(cells[0].source, f"the parameters cell of {Path(path).name}")


def runnable_parameters(path: Path) -> dict[str, Parameter]:
    """``notebook_parameters(path)``, or UsageError when the notebook lacks ``run_dir`` (its
    results would then not land in the run folder that kvlab made for it)."""
    declared = notebook_parameters(path)
    if "run_dir" not in declared:
        raise UsageError(f"{Path(path).name} declares no run_dir parameter, so its results would "
                         'not land in the run folder; add to its parameters cell: run_dir: str = ""'
                         "  # kvlab run sets it; empty = a new data/<study>/<run_id>/")
    return declared


def _accepts(value, node: ast.expr) -> bool | None:
    """Does ``value`` fit the annotation ``node``? None when the annotation is beyond this check
    (a class of the notebook's own, a TypeVar): then the notebook is trusted to cope."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        verdicts = [_accepts(value, node.left), _accepts(value, node.right)]
        return True if True in verdicts else (None if None in verdicts else False)
    if isinstance(node, ast.Constant) and node.value is None:
        return value is None
    if isinstance(node, ast.Subscript):
        base = node.value.attr if isinstance(node.value, ast.Attribute) else getattr(
            node.value, "id", None)
        inner = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        if base == "Optional":
            return True if value is None else _accepts(value, inner[0])
        if base == "Union":
            verdicts = [_accepts(value, n) for n in inner]
            return True if True in verdicts else (None if None in verdicts else False)
        if base == "Literal":
            try:
                return value in [ast.literal_eval(n) for n in inner]
            except ValueError:
                return None
        node = node.value
    base = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", None)
    if base in ("Any", "object"):
        return True
    kind = _TYPES.get(base)
    if kind is None:
        return None
    if isinstance(value, bool) and base in ("int", "float"):
        return False  # YAML's true/false are not numbers, though Python's bool subclasses int
    return isinstance(value, kind)


def coerce(param: Parameter, value, raw: str | None = None):
    """``value`` made to fit ``param``'s annotation, or UsageError naming both.

    ``raw`` is the text given on the command line. A parameter annotated ``str`` gets the raw text
    as is (``-p link 400`` means "400", not the int); a number YAML left as text (``1e3``: YAML 1.1
    wants ``1.0e3``) is converted when the annotation wants a number.
    """
    if param.annotation is None:
        return value
    node = ast.parse(param.annotation, mode="eval").body
    if isinstance(value, (list, tuple)) and param.annotation == "str" \
            and all(isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in value):
        # a list given to a comma-separated text parameter (`-p contexts "[1024, 4096]"`, a sweep grid's
        # `contexts: [[1024, 4096]]`) is that text
        return ",".join(str(v) for v in value)
    if _accepts(value, node) is not False:
        return value
    if isinstance(value, str):
        for convert in (int, float):
            try:
                number = convert(value)
            except ValueError:
                continue
            if _accepts(number, node):
                return number
    if not isinstance(value, (list, dict)) and _accepts("", node):
        return raw if raw is not None else str(value)
    raise UsageError(f"parameter {param.name} = {value!r} ({type(value).__name__}) does not fit "
                     f"its declared type {param.annotation}; declared as: {param.describe()}")


def _declared_list(declared: Mapping[str, Parameter]) -> str:
    lines = [f"  {p.describe()}" for p in declared.values() if p.name != "run_dir"]
    return "\n".join(lines) if lines else "  (none)"


RUN_DIR_IS_SET = ("run_dir is set by kvlab (each run gets its own folder); use --run-dir DIR "
                   "with `kvlab run` to choose it")


def check_names(names, declared: Mapping[str, Parameter], notebook: str) -> None:
    """UsageError listing the valid parameters when a name in ``names`` is not declared, or is
    ``run_dir`` (which kvlab sets itself; use --run-dir)."""
    if "run_dir" in names:
        raise UsageError(RUN_DIR_IS_SET)
    unknown = [n for n in names if n not in declared]
    if unknown:
        raise UsageError(f"unknown parameter {', '.join(map(repr, unknown))} for {notebook}; "
                         f"valid parameters:\n{_declared_list(declared)}")


def parse_params(pairs, declared: Mapping[str, Parameter], notebook: str) -> dict:
    """``-p NAME VALUE`` pairs → ``{name: value}``: names checked against ``declared``, values
    parsed as YAML (``-p contexts "[1024, 4096]"`` gives a list) and checked against the
    annotations."""
    check_names([name for name, _ in pairs], declared, notebook)
    values = {}
    for name, raw in pairs:
        if declared[name].annotation == "str" and not raw.strip().startswith("["):
            values[name] = raw
            continue
        try:
            value = yaml_load(raw, f"-p {name} {raw!r}")
        except YAMLInputError as err:
            hint = "; a list is written [1024, 4096] or 1024,4096" if "not valid YAML" in str(err) else ""
            raise UsageError(f"{err}{hint}") from None
        values[name] = coerce(declared[name], value, raw)
    return values


def notebooks_dir() -> Path:
    """``<repo_root>/notebooks``."""
    return paths.repo_root() / "notebooks"


def list_notebooks() -> list[Path]:
    """The workbook's notebooks, in run order (by file name: 00_…, 01_…)."""
    folder = notebooks_dir()
    return sorted(p for p in folder.glob("*.ipynb") if not p.name.startswith(".")) \
        if folder.is_dir() else []


def _short_names(nbs: list[Path]) -> str:
    return ", ".join(f"{nb.stem} ({paths.study_of(nb)})" for nb in nbs) or "(none)"


def find_notebook(ref: str) -> Path:
    """A notebook by path, file name, stem, study name or number: ``notebooks/02_handoff.ipynb``,
    ``02_handoff``, ``handoff`` and ``02`` name the same notebook."""
    path = Path(ref).expanduser()
    if path.suffix == ".ipynb" and (path.is_file() or path.parent != Path(".")):
        if not path.is_file():
            raise UsageError(f"notebook {ref!r} does not exist")
        return path.resolve()
    nbs = list_notebooks()
    key = ref.removesuffix(".ipynb")

    def number(nb: Path) -> int | None:
        head = nb.stem.split("_", 1)[0]
        return int(head) if head.isdigit() else None

    matches = [nb for nb in nbs if key in (nb.stem, paths.study_of(nb))
               or (key.isdigit() and number(nb) == int(key))]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise UsageError(f"no notebook {ref!r} in {notebooks_dir()}; known: {_short_names(nbs)}")
    raise UsageError(f"{ref!r} is ambiguous: {_short_names(matches)}")
