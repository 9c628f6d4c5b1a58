"""The studies: each a package of one shape (kvlab.study says which), named as its data/<study>/ folder.

    calculator        00_calculator        the KV-cache bill as arithmetic (bytes, FLOPs, link time, overlap)
    link_ceilings     01_link_ceilings     how fast each link of this machine is, per copy size
    handoff           02_handoff           seed 004: colocated, bulk and layer-wise handoffs, decoded and timed
    overlap_timeline  03_overlap_timeline  where a layer-wise handoff's time goes, kernel by kernel
    paged_transfer    04_paged_transfer    a paged cache's blocks moved by every transport, against one copy
    disagg            05_disagg            prefill and decode as two processes, and faults across them
    swapin            (kvlab swapin)       a paged cache from pinned host memory back into a GPU pool
    tp_reshard        06_tp_reshard        a paged cache from P prefill ranks to D decode ranks (different TP), decoded
    wire_dtype        07_wire_dtype        a paged cache sent as FP8 with its scales, beside bf16
    wire_accuracy     (kvlab wire-accuracy) what the FP8 wire does to greedy decoding and perplexity (trained weights)
    contention        (kvlab contention)   N transfers sharing one path, and the fabric simulator validated on them
    congestion        08_congestion        a cluster's fabric simulated: where layer-wise stops hiding the transfer

`get(name)` imports a study when it is asked for: each pulls in torch and more, and `kvlab --help` must not wait.
No study imports another; the library imports no study (import-linter contracts in pyproject.toml).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

from .. import results
from ..parse import suggest
from ..paths import study_of
from ..study import Analysis

__all__ = ["NAMES", "get", "of_notebook", "has_face", "analyse_run"]

NAMES = ("calculator", "link_ceilings", "handoff", "overlap_timeline", "paged_transfer", "disagg", "swapin", "tp_reshard", "wire_dtype", "wire_accuracy", "contention",
         "congestion")


def get(name: str) -> ModuleType:
    """The study package `name` (kvlab.studies.<name>); ValueError naming the known ones otherwise."""
    if name not in NAMES:
        raise ValueError(f"unknown study {name!r}{suggest(str(name), NAMES)}; known: {', '.join(NAMES)}")
    return importlib.import_module(f"{__name__}.{name}")


def of_notebook(notebook: str) -> ModuleType | None:
    """The study whose NOTEBOOK is `notebook` (a stem such as "02_handoff"), or None."""
    name = study_of(notebook)
    return get(name) if name in NAMES else None


def has_face(module: ModuleType) -> bool:
    """Does `module` have the one shape (kvlab.study)? Studies are moved into it one at a time."""
    return all(hasattr(module, a) for a in ("NAME", "NOTEBOOK", "PARAMS", "check", "measure", "analyse", "figures", "FIGURES", "BLOCKS"))


def analyse_run(run_dir: str | Path, where: str = "") -> Analysis:
    """The analysis of the run in `run_dir` by its study's `analyse` (its record says which study), `where` noted
    (the run's folder under data/, "study/run_id")."""
    record, tables = results.load(run_dir)
    study = get(record.get("study"))
    a = study.analyse(record, tables)
    a.where = where or f"{record.get('study')}/{Path(run_dir).name}"
    return a
