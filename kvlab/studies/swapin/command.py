"""`kvlab swapin`: the swap-in study from the command line — check, measure, analyse and write a swapin run
(results.csv, the analysis's summary.csv, run.json), then print one line per method."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence

from ...study import Analysis, add_options, run_command, run_from_args
from .. import swapin as face

__all__ = ["add_arguments", "run", "run_args", "main"]

# what `kvlab swapin --help` says above its options
DESCRIPTION = """Scatter a paged cache held in pinned host memory into a GPU pool by block table (vLLM's swap-in): Triton's
    row kernel reading the host pool over PCIe (triton-uva), and a CPU gather + one copy + a GPU scatter (staged);
    beside them the GPU → host gather (chunked-gather-d2h), each against a contiguous copy of the same bytes the
    same way, timed in the same run. Every method is checked on a poisoned pool. Writes results.csv, summary.csv
    and run.json.

Example: kvlab swapin --model kvlab-tiny --context 256 --repeats 3"""


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``kvlab swapin`` options to ``parser``: one per parameter of the study's PARAMS, and --out."""
    parser.description = DESCRIPTION  # kvlab swapin --help: what it does, then its options
    return add_options(parser, face, {"contexts": "context"})


def run(params: Mapping, out: str = "") -> tuple[str, Analysis]:
    """Check every value (ValueError before a folder is made), then measure into a run folder (data/swapin/<run_id>/
    unless `out`), analyse and finish it. Returns (run folder, analysis). A run that stops says so in its folder."""
    return run_command(face, params, out, "kvlab swapin")


def run_args(args: argparse.Namespace) -> int:
    """Run ``kvlab swapin`` from parsed arguments; returns the exit status (bad input: ValueError, one line)."""
    path, analysis = run_from_args(face, args, "kvlab swapin")
    for r in analysis.tables["summary"].itertuples():
        what = f"{r.context:>6} {r.direction:9} {r.host_layout:10} {r.method:19}"
        if r.n:
            print(f"{what} {r.ms:9.3f} ms ({r.ms_min:.3f}–{r.ms_max:.3f}) {r.gbps:8.1f} GB/s  "
                  f"{r.pct_of_ceiling:5.1f} % of the contiguous copy [{r.pct_lo:.1f}, {r.pct_hi:.1f}]")
        else:
            print(f"{what} not run: {r.note}")
    print(f"run: {path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``kvlab swapin [--model M] [--context 4k,32k] [--block-size 16] [--repeats 9] [--out DIR]``: measure and write
    a swapin run; returns the exit status."""
    parser = add_arguments(argparse.ArgumentParser(prog="kvlab swapin", description=main.__doc__.splitlines()[0]))
    return run_args(parser.parse_args(argv))
