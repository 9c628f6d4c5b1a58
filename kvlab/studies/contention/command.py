"""`kvlab contention`: the contention study from the command line — check, measure, analyse and write a contention
run (ceiling.csv, flows.csv, the analysis's contention.csv and validation.csv, run.json), then print one line per
(path, flows)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence

from ...study import Analysis, add_options, run_command, run_from_args
from .. import contention as face

__all__ = ["add_arguments", "run", "run_args", "main"]

# what `kvlab contention --help` says above its options
DESCRIPTION = """N copies start together on N streams (GPU → pinned host, host → GPU, both at once); the aggregate and each
    flow's rate against the path's ceiling, Jain's index, and the fabric simulator fitted on 1 and 2 flows predicting
    the rest; beside them a prefill-like compute load, and (on a GPU where NIXL loads) NIXL posting from 1-8 threads or
    processes. Writes ceiling.csv, flows.csv, contention.csv, validation.csv, beside.csv, nixl_posting.csv, posting.csv
    and run.json.

Example: kvlab contention --device cpu --flows 1,2,4 --size 4M --repeats 3 --out /tmp/kvlab-contention"""


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``kvlab contention`` options to ``parser``: one per parameter of the study's PARAMS, and --out."""
    parser.description = DESCRIPTION  # kvlab contention --help: what it does, then its options
    return add_options(parser, face)


def run(params: Mapping, out: str = "") -> tuple[str, Analysis]:
    """Check every value (ValueError before a folder is made), then measure into a run folder (data/contention/
    <run_id>/ unless `out`), analyse and finish it. Returns (run folder, analysis). A run that stops says so."""
    return run_command(face, params, out, "kvlab contention")


def run_args(args: argparse.Namespace) -> int:
    """Run ``kvlab contention`` from parsed arguments; returns the exit status (bad input: ValueError, one line)."""
    path, analysis = run_from_args(face, args, "kvlab contention")
    v = analysis.tables["validation"].set_index(["path", "flows"])
    for r in analysis.tables["contention"].itertuples():
        sim = v.loc[(r.path, r.flows)]
        print(f"{r.path:8} {r.flows:2} flows {r.aggregate_gbps:8.1f} GB/s [{r.aggregate_lo:.1f}, {r.aggregate_hi:.1f}]"
              f" {r.pct_of_ceiling:5.0f} % of {r.ceiling_gbps:.1f}  Jain {r.jain:.2f}  simulated "
              f"{sim.simulated_gbps:8.1f} ({sim.role}, {sim.error_pct:+.1f} %)")
    for g in analysis.goals.itertuples():
        print(f"goal {g.id} ({g.path}, {g.flows} flows): {g.value} — {g.verdict}")
    print(f"run: {path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``kvlab contention [--flows 1,2,4,8] [--size 256M] [--out DIR]``: measure and write a contention run."""
    parser = add_arguments(argparse.ArgumentParser(prog="kvlab contention", description=main.__doc__.splitlines()[0]))
    return run_args(parser.parse_args(argv))
