"""`kvlab trace`: take a timeline with Nsight Systems, or read one (Kineto or nsys), and print its summary.

A library tool, not a study: it knows the events table (kvlab.tracefmt) and nothing of any experiment.
"""

from __future__ import annotations

import argparse
import sys

import pandas as pd

from ..parse import OneLineParser  # its errors in one line, as every kvlab command's
from . import GPU_KINDS, TraceError, load, summarize
from .nsys import NsysUnavailable, run_nsys

__all__ = ["trace_main"]


def trace_main(argv: list[str] | None = None) -> int:
    """``kvlab trace``: take or read a timeline.

        kvlab trace nsys [--out DIR] [--name NAME] [--capture-range R] -- COMMAND …
        kvlab trace load FILE [--csv OUT]

    ``nsys`` profiles COMMAND with Nsight Systems (CUDA + NVTX, KVLAB_RANGES=1 for the child) and
    prints a summary of the loaded timeline; ``load`` reads a Kineto .json(.gz) or an nsys .sqlite
    and prints the same summary (``--csv`` also writes the events table). Returns the exit code:
    0 on success, 2 for bad input (the message says what is missing), 3 when nsys cannot be used.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    command = []
    if "--" in argv:
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1:]

    parser = OneLineParser(prog="kvlab trace", description=trace_main.__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    p_nsys = sub.add_parser("nsys", help="profile COMMAND (after --) with Nsight Systems",
                            description="Profile COMMAND (after --) with Nsight Systems (CUDA + NVTX) and print a "
                                        "summary of its timeline; needs nsys on PATH and a machine where it can "
                                        "make reports (exit 3 says why not otherwise).")
    p_nsys.add_argument("--out", default="nsys-trace", help="output folder (default: ./nsys-trace)")
    p_nsys.add_argument("--name", default="nsys", help="report name inside --out")
    p_nsys.add_argument("--capture-range", default="cudaProfilerApi", choices=["cudaProfilerApi", "none"],
                        help="cudaProfilerApi: record inside kvlab.tracefmt.profiler_range() only; none: all")
    p_load = sub.add_parser("load", help="read a Kineto .json(.gz) or nsys .sqlite and summarise it",
                            description="Read a timeline — a torch.profiler (Kineto) trace, .json or .json.gz, or an "
                                        "Nsight Systems .sqlite export — into kvlab's events table and print a "
                                        "summary by kind and stream.\n\n"
                                        "Example: kvlab trace load examples/trace_tiny_cpu.json.gz",
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    p_load.add_argument("file", help="the trace file (.json, .json.gz or .sqlite)")
    p_load.add_argument("--csv", default=None, help="also write the events table to this CSV")
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)

    try:
        if args.what == "nsys":
            if not command:
                print("kvlab trace nsys: error: give the command after --, e.g. "
                      "kvlab trace nsys -- python my_run.py", file=sys.stderr)
                return 2
            events, path = run_nsys(command, args.out, capture_range=args.capture_range, name=args.name)
            print(f"nsys export: {path}")
        else:
            events = load(args.file)
            if args.csv:
                events.to_csv(args.csv, index=False)
                print(f"events: {args.csv} ({len(events)} rows)")
    except NsysUnavailable as e:
        print(f"kvlab trace nsys: {e}", file=sys.stderr)
        return 3
    except (TraceError, FileNotFoundError) as e:
        print(f"kvlab trace {args.what}: error: {e}", file=sys.stderr)
        return 2
    _print_summary(events)
    return 0


def _print_summary(events: pd.DataFrame) -> None:
    span = (int(events.end_ns.max()) - int(events.start_ns.min())) / 1e6 if len(events) else 0.0
    print(f"{len(events)} events over {span:.3f} ms")
    with pd.option_context("display.width", 160, "display.max_columns", 20):
        print(summarize(events).to_string(index=False))
    layers = events.layer.dropna()
    if layers.empty:
        print("no kvlab/layer{i} or kvlab/send{i} ranges: run the hooks with ranges=True "
              "(or KVLAB_RANGES=1) to split the timeline by layer")
    else:
        print(f"layers {int(layers.min())}…{int(layers.max())} found in the hook ranges")
    if not events.kind.isin(GPU_KINDS).any():
        print("no GPU activity in this trace; run on a GPU for the timeline")
