"""Where kvlab's files are, and how kvlab reads and writes its own JSON: the bottom of the package.

``repo_root()`` (the workbook), ``data_root()`` (runs), ``figures_root()`` (published figures), the study a
notebook writes (``study_of``), a study name checked (``check_study``), and ``read_json`` / ``write_json``
(atomic) for run.json and the other records kvlab writes. Nothing here imports another kvlab module.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

__all__ = ["repo_root", "data_root", "figures_root", "study_of", "check_study", "read_json", "write_json"]

# Study names become folder names and are derived from notebook names ("02_handoff" → "handoff").
_STUDY_RE = re.compile(r"^[a-z0-9][a-z0-9_]*$")



def repo_root() -> Path:
    """The workbook's root: ``KVLAB_ROOT``, else the folder above the kvlab package when it holds
    pyproject.toml (a source checkout), else the current directory (an installed wheel)."""
    env = os.environ.get("KVLAB_ROOT", "").strip()
    if env:
        return Path(env).expanduser().resolve()
    checkout = Path(__file__).resolve().parent.parent
    if (checkout / "pyproject.toml").is_file():
        return checkout
    return Path.cwd()


def data_root() -> Path:
    """Where runs live: ``KVLAB_DATA``, else ``<repo_root>/data``."""
    env = os.environ.get("KVLAB_DATA", "").strip()
    return Path(env).expanduser().resolve() if env else repo_root() / "data"


def figures_root() -> Path:
    """Where published figures live: ``KVLAB_FIGURES``, else ``<repo_root>/figures``."""
    env = os.environ.get("KVLAB_FIGURES", "").strip()
    return Path(env).expanduser().resolve() if env else repo_root() / "figures"


def study_of(notebook: str | os.PathLike) -> str:
    """The study a notebook writes: its file name without the number prefix and extension,
    ``notebooks/02_handoff.ipynb`` → ``"handoff"``."""
    stem = Path(notebook).name.removesuffix(".ipynb")
    return re.sub(r"^\d+[_-]", "", stem)


def check_study(study) -> str:
    """``study`` if it is a valid study name (lowercase letters, digits, underscores); else
    ValueError naming it."""
    if not isinstance(study, str) or not _STUDY_RE.match(study):
        raise ValueError(
            f"study name {study!r} is not valid: use lowercase letters, digits and underscores, "
            "starting with a letter or digit (e.g. 'handoff', 'link_ceilings')"
        )
    return study


def write_json(path: str | os.PathLike, record: dict) -> None:
    """Write ``record`` to ``path`` atomically: a crash mid-write must not leave a truncated file behind."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(record, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def read_json(path: str | os.PathLike) -> dict:
    """A JSON file kvlab wrote (run.json, summary.json); ValueError naming the file when it is not valid JSON."""
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as err:  # name the file: a run folder holds several
            raise ValueError(f"{path}: not valid JSON ({err})") from None
