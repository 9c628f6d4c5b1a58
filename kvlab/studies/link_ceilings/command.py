"""`kvlab ceilings`: the link-ceilings study from the command line — measure, print the tables and the finding, and
write a link_ceilings run (results.csv, the analysis's fit.csv and sizes.csv, `ceilings` in run.json)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import pandas as pd

from ... import ceilings, results, runfolder
from . import NAME, analyse

__all__ = ["add_arguments", "run_args", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``kvlab ceilings`` options to ``parser`` (for a CLI subparser)."""
    parser.add_argument("--paths", nargs="+", default=["auto"],
                        help="path names (space- or comma-separated), 'd2d_peer' for every GPU pair, or auto")
    parser.add_argument("--sizes", nargs="+", default=["auto"],
                        help="bytes per copy, e.g. 4K 1M 1G (binary units), or auto (GPU 4K..1G, CPU 4K..16M)")
    parser.add_argument("-n", "--repeats", type=int, default=9, help="timed samples per (path, size) (default 9)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed samples first (default 3)")
    parser.add_argument("--copies", default="auto", help="copies per sample: auto or an int")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: current GPU, else cpu)")
    parser.add_argument("--run-dir", default=None, help="write into this run directory (default: a new one)")
    parser.add_argument("--no-save", action="store_true", help="print only; write no run")
    return parser


def _join(values: list[str]) -> str:
    return ",".join(v for item in values for v in item.split(",") if v)


def run_args(args: argparse.Namespace) -> int:
    """Run ``kvlab ceilings`` from parsed arguments; returns the exit status."""
    try:
        copies = args.copies if args.copies == "auto" else int(args.copies)
    except ValueError:
        print(f"kvlab ceilings: error: --copies {args.copies!r}: expected 'auto' or an int >= 1", file=sys.stderr)
        return 2
    params = {"paths": _join(args.paths), "sizes": _join(args.sizes), "repeats": args.repeats,
              "warmup": args.warmup, "copies": copies, "device": args.device}
    if args.run_dir is not None and not args.no_save:
        try:  # before anything is measured: a finished run is never overwritten
            runfolder.check_run_folder(args.run_dir, "--run-dir")
        except ValueError as exc:
            print(f"kvlab ceilings: error: {exc}", file=sys.stderr)
            return 2
    try:
        df = ceilings.measure(params["paths"], params["sizes"], n=args.repeats, warmup=args.warmup,
                              device=args.device, copies=copies)
    except ValueError as exc:
        print(f"kvlab ceilings: error: {exc}", file=sys.stderr)
        return 2
    record = {"study": NAME, "run_id": "", "parameters": params}
    analysis = analyse(record, {"results": df})
    with pd.option_context("display.width", 200, "display.max_columns", 30):
        print(analysis.tables["sizes"].drop(columns=["size_bytes"]).to_string(index=False))
        print()
        print(analysis.tables["fit"].to_string(index=False))
    print()
    print(analysis.findings[0])
    if not args.no_save:
        run = results.start(NAME, params, args.run_dir or "")
        run.save_table(df, "results")
        run.save_analysis(analysis)
        run.finish()
        print(f"\nwrote {run.dir}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``kvlab ceilings [--paths ...] [--sizes ...] [-n 9] [--warmup 3] [--run-dir DIR] [--no-save]``.

    Measures, fits, prints the tables and the finding, and writes a
    ``link_ceilings`` run (results.csv, fit.csv, ``ceilings`` in run.json).
    Returns the exit status (0 ok, 2 bad input).
    """
    parser = add_arguments(argparse.ArgumentParser(prog="kvlab ceilings", description=main.__doc__.splitlines()[0]))
    return run_args(parser.parse_args(argv))
