"""The shape every study has: its parameters declared once, and what its analysis returns.

A study is a package ``kvlab/studies/<name>/`` whose face is the same for all of them::

    NAME        the study (its data/<study>/ folder)
    NOTEBOOK    the notebook that runs it ("01_link_ceilings"), or None (a study run from the command line only)
    TITLE       a few words; QUESTION: what it asks, in one sentence
    PARAMS      its parameters, declared once (`Param`): the notebook's parameters cell is made from them and
                `kvlab run -p NAME VALUE` is checked against them
    check(params) -> Config                  every value parsed and checked, "auto" resolved by hardware, before
                                             anything is allocated or written (ValueError: one line)
    measure(cfg, run)                        measures and writes raw tables into the run (nothing derived)
    analyse(record, tables) -> Analysis      pure, on a CPU: from run.json and the raw tables to the tables, goals,
                                             findings and named values a reader sees
    figures(analysis) -> {name: Figure}      every figure of the study
    BLOCKS = {kind: fn(analyses) -> str}     the markdown tables the docs show, from one or more analyses

The notebook, `kvlab analyse` and `kvlab report` all call these same functions, so an analysis is written once.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from . import results, runfolder
from .parse import suggest

__all__ = ["Param", "Analysis", "parameters_cell", "check_params", "cell_params", "RUN_DIR_LINE", "md_table",
           "host_label", "at_least", "one_of", "run_command", "add_options", "run_from_args",
           "ctx_label", "sig", "fmt_or_dash", "run_link"]

RUN_DIR_LINE = 'run_dir: str = ""  # kvlab run sets it; empty: a new data/<study>/<run_id>/'


@dataclass(frozen=True)
class Param:
    """One parameter of a study: `name`, its `type` as the notebook annotates it ("str", "int", "float", "bool",
    "list": one name papermill reads, no unions), its `default` (a Python literal), `help` (what it is, with units;
    no "=", which papermill's reading of the parameters cell splits a line at), and
    `check(value, name)`, which raises ValueError (one line, naming the value and what is valid) for a value the
    study cannot take. "auto" is never checked: the study's `check` resolves it by hardware."""

    name: str
    type: str
    default: Any
    help: str
    check: Callable[[Any, str], Any] | None = None

    def __post_init__(self):
        if self.type not in _TYPES:
            raise ValueError(f"Param {self.name}: type {self.type!r} is not one of {sorted(_TYPES)}")
        if not _fits(self.default, self.type):
            raise ValueError(f"Param {self.name}: default {self.default!r} is not a {self.type}")
        if "=" in self.help or "\n" in self.help:
            raise ValueError(f"Param {self.name}: help {self.help!r} holds '=' or a line break; papermill cannot read "
                             "such a line of the parameters cell (write ':' or 'at least')")

    def line(self) -> str:
        """The parameter's line in the notebook's parameters cell."""
        return f"{self.name}: {self.type} = {_literal(self.default)}  # {self.help}"


def _literal(value) -> str:
    """A default as the parameters cell writes it: strings in double quotes, lists of them too."""
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(_literal(v) for v in value) + "]"
    return repr(value)


# the annotations a parameter may carry, and the Python values each accepts (papermill injects literals)
_TYPES = {"str": (str,), "int": (int,), "float": (int, float), "bool": (bool,), "list": (list,)}


def _fits(value, type_: str) -> bool:
    if type_ in ("int", "float") and isinstance(value, bool):
        return False
    if type_ == "float" and isinstance(value, float) and not math.isfinite(value):
        return False
    return isinstance(value, _TYPES[type_])


def parameters_cell(params: Sequence[Param]) -> str:
    """The source of a notebook's parameters cell: one line per parameter, then run_dir (which kvlab run sets)."""
    return "\n".join([*(p.line() for p in params), RUN_DIR_LINE])


def check_params(params: Sequence[Param], values: Mapping[str, Any], study: str) -> dict[str, Any]:
    """``values`` (a notebook's or a command line's) checked against the study's ``params``: an unknown name or a value
    of the wrong type or range is a ValueError naming it, the valid names or values, and the study. Returns every
    parameter's value, defaults filled in, "auto" left for the study's `check` to resolve."""
    declared = {p.name: p for p in params}
    unknown = [n for n in values if n not in declared and n != "run_dir"]
    if unknown:
        raise ValueError(f"unknown parameter {unknown[0]!r} for study {study}{suggest(unknown[0], declared)}; valid: "
                         f"{', '.join(declared)}")
    out = {}
    for p in params:
        v = values.get(p.name, p.default)
        if isinstance(v, str) and v.strip() == "auto":
            out[p.name] = "auto"
            continue
        if not _fits(v, p.type):
            raise ValueError(f"{p.name} = {v!r}: give a {p.type} ({p.help})")
        if p.check is not None:
            try:
                p.check(v, p.name)
            except ValueError as err:
                text = str(err).splitlines()[0] if str(err) else repr(err)
                raise ValueError(text if p.name in text else f"{p.name} = {v!r}: {text}") from None
        out[p.name] = v
    return out


def cell_params(source: str) -> dict[str, tuple[str, str, str]]:
    """``{name: (annotation, default source, comment)}`` of a parameters cell's lines, for the test that holds each
    notebook's cell to its study's PARAMS."""
    out = {}
    for line in source.splitlines():
        if not line.strip():
            continue
        code, _, comment = line.partition("  # ")
        node = ast.parse(code).body[0]
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = (ast.unparse(node.annotation), ast.unparse(node.value), comment.strip())
    return out


@dataclass
class Analysis:
    """What a study's `analyse` returns, from one run: the run's record (run.json), the raw tables it read (`raw`: what
    measure wrote), its derived tables by name, the goal table (kvlab.goals.evaluate's, possibly empty), findings
    (markdown sentences, every number from the data), named values (text, already formatted, for the docs'
    inline markers and the results at a glance) and the run.json fields it adds (Run.save_analysis)."""

    study: str
    record: dict
    raw: dict[str, pd.DataFrame] = field(default_factory=dict)
    where: str = ""  # the run's folder under data/ ("handoff/20261201-051641-h200"), when it was read from there
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)
    goals: pd.DataFrame = field(default_factory=pd.DataFrame)
    findings: list[str] = field(default_factory=list)
    values: dict[str, str] = field(default_factory=dict)
    fields: dict[str, Any] = field(default_factory=dict)  # run.json fields it adds when kept with its run (JSON)

    @property
    def run_id(self) -> str:
        return str(self.record.get("run_id", ""))

    @property
    def device_tag(self) -> str:
        return str(self.record.get("device_tag", ""))


# ------------------------------------------------------------------------------ the markdown the docs show


def md_table(df: pd.DataFrame) -> str:
    """`df` as a GitHub markdown table (every cell as its str; the caller formats numbers), with a trailing newline."""
    head = "| " + " | ".join(str(c) for c in df.columns) + " |"
    rule = "|" + "|".join("---" for _ in df.columns) + "|"
    body = ["| " + " | ".join(str(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join([head, rule, *body]) + "\n"


def ctx_label(tokens) -> str:
    """A context length as people write it: 1024 → "1k", 32768 → "32k", 100 → "100"."""
    c = int(tokens)
    return f"{c // 1024}k" if c >= 1024 and c % 1024 == 0 else f"{c:,}"


def fmt_or_dash(x, fmt: str) -> str:
    """`x` formatted with `fmt`, or "—" for None / NaN."""
    return "—" if x is None or (isinstance(x, float) and x != x) else format(x, fmt)


def sig(x, digits: int = 3) -> str:
    """Significant digits, thousands separated, one decimal from 100 up: 1,186.1 / 4.74 / 0.0309; "—" for NaN."""
    if x is None or (isinstance(x, float) and x != x):
        return "—"
    x = float(x)
    if abs(x) >= 100:
        return f"{x:,.1f}"
    return f"{x:.{digits}g}"


def run_link(path: str, prefix: str = "") -> str:
    """A link to a committed run ("study/run_id") as the docs write it: [run_id](<prefix>data/study/run_id/)."""
    return f"[{path.split('/')[-1]}]({prefix}data/{path}/)"


def host_label(record: dict) -> str:
    """The host a run ran on, as the verdicts name it: "1×H200 host (16 vCPU)", "CPU host (2 vCPU)"."""
    devices = record.get("devices") or []
    cpus = (record.get("host") or {}).get("cpu_count")
    if not devices:
        return f"CPU host ({cpus} vCPU)"
    name = str(devices[0].get("name", "GPU")).removeprefix("NVIDIA ")
    return f"{len(devices)}×{name} host ({cpus} vCPU)"


def at_least(n: int) -> Callable[[Any, str], None]:
    """A Param check: an int ≥ n (ValueError naming the parameter and the bound otherwise)."""
    def check(value, name):
        if value < n:
            raise ValueError(f"{name} = {value!r}: give an int ≥ {n}")
    return check


def one_of(*choices: str) -> Callable[[Any, str], None]:
    """A Param check: one of `choices` (ValueError naming the parameter and the choices otherwise)."""
    def check(value, name):
        if value not in choices:
            said = f"{', '.join(choices[:-1])} or {choices[-1]}" if len(choices) > 1 else choices[0]
            raise ValueError(f"{name} = {value!r}: give {said}")
    return check


def run_command(face, params: Mapping[str, Any], out: str = "", label: str = "") -> tuple[str, Analysis]:
    """A study run from the command line (a study with no notebook, as swapin and tp_reshard): every value checked by
    `face.check` (ValueError before a folder is made), then measured into a run folder (data/<study>/<run_id>/ unless
    `out`), analysed, the analysis kept with the run, and finished. Returns (run folder, analysis). A run that stops
    — an error, Ctrl-C, SIGTERM — says so in its folder, naming `label` (the command, "kvlab swapin")."""
    cfg = face.check(params)
    given = {**{p.name: p.default for p in face.PARAMS}, **params}
    r = None
    try:
        r = results.start(face.NAME, given, run_dir=out)
        face.measure(cfg, r)
        analysis = face.analyse(r.record, r.tables())
        r.save_analysis(analysis)
        r.finish()
        return str(r.dir), analysis
    except BaseException as err:
        if r is not None:
            runfolder.record_execution(r.dir, label or f"kvlab {face.NAME}", ok=False, seconds=0.0,
                                       error=runfolder.stop_reason(err))
        raise


_ARG_TYPES = {"int": int, "float": float}


def add_options(parser: argparse.ArgumentParser, face, flags: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The command-line options of a study run from the command line, made from its PARAMS (declared once): one
    ``--name`` per parameter (underscores as dashes; `flags` renames one, such as contexts → context), with its
    default and help, and ``--out``."""
    for p in face.PARAMS:
        flag = "--" + (flags or {}).get(p.name, p.name).replace("_", "-")
        parser.add_argument(flag, dest=p.name, default=p.default, type=_ARG_TYPES.get(p.type, str),
                            help=f"{p.help} (default {p.default})".replace("%", "%%"))
    parser.add_argument("--out", default=None, help=f"run folder (default: a new data/{face.NAME}/<run_id>/)")
    return parser


def run_from_args(face, args: argparse.Namespace, label: str) -> tuple[str, Analysis]:
    """`run_command` from the options `add_options` made: --out checked first (a finished run is never
    overwritten), then every parameter's value as parsed."""
    if args.out is not None:
        runfolder.check_run_folder(args.out, "--out")
    return run_command(face, {p.name: getattr(args, p.name) for p in face.PARAMS}, args.out or "", label)
