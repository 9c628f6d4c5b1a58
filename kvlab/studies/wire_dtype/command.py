"""`kvlab wire`: the FP8-wire study from the command line — check, measure, analyse and write a wire_dtype run
(wire_rows.csv, the analysis's wire.csv, wire_rates.csv and breakeven.csv, run.json), then print one line per FP8
kernel and the break-even bandwidths."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence

from ...study import Analysis, add_options, run_command, run_from_args
from .. import wire_dtype as face

__all__ = ["add_arguments", "run", "run_args", "main"]

# what `kvlab wire --help` says above its options
DESCRIPTION = """Quantize a paged bf16 cache to FP8 in the gather (to GPU or pinned host memory) and dequantize it on arrival,
    each kernel checked bit for bit, then timed beside a bf16 copy of the same cache the same way; the link bandwidth
    below which FP8 wins. Writes wire_rows.csv, wire.csv, wire_rates.csv, breakeven.csv and run.json.

Example: kvlab wire --model kvlab-tiny --context 256 --repeats 3 --out /tmp/kvlab-wire"""


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``kvlab wire`` options to ``parser``: one per parameter of the study's PARAMS, and --out."""
    parser.description = DESCRIPTION  # kvlab wire --help: what it does, then its options
    return add_options(parser, face, {"contexts": "context"})


def run(params: Mapping, out: str = "") -> tuple[str, Analysis]:
    """Check every value (ValueError before a folder is made), then measure into a run folder (data/wire_dtype/
    <run_id>/ unless `out`), analyse and finish it. Returns (run folder, analysis). A run that stops says so."""
    return run_command(face, params, out, "kvlab wire")


def run_args(args: argparse.Namespace) -> int:
    """Run ``kvlab wire`` from parsed arguments; returns the exit status (bad input: ValueError, one line)."""
    path, analysis = run_from_args(face, args, "kvlab wire")
    for r in analysis.tables["wire"].itertuples():
        print(f"{r.context:>6} {r.kernel:19} {r.direction} {r.scales:15} {r.ms_median:9.3f} ms "
              f"[{r.ms_lo:.3f}, {r.ms_hi:.3f}]  {r.pct_of_bf16:5.0f} % of bf16  {r.input_gbps:8.1f} GB/s of input  "
              f"{r.bytes_ratio:.3f}× bytes")
    for r in analysis.tables["breakeven"].itertuples():
        print(f"{r.context:>6} {r.scales:15} FP8 wins below {r.breakeven_gbps:.1f} GB/s [{r.lo:.1f}, {r.hi:.1f}]"
              f" ({'overlapped' if r.overlap else 'serial'})")
    for g in analysis.goals.itertuples():
        print(f"goal {g.id} ({g.kernel} {g.direction}, {g.scales}): {g.value} — {g.verdict}")
    print(f"run: {path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``kvlab wire [--model M] [--context 4k,32k] [--scales per-token-head] [--out DIR]``: measure and write a
    wire_dtype run; returns the exit status."""
    parser = add_arguments(argparse.ArgumentParser(prog="kvlab wire", description=main.__doc__.splitlines()[0]))
    return run_args(parser.parse_args(argv))
