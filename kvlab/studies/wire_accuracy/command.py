"""`kvlab wire-accuracy`: the FP8 wire's accuracy study from the command line — check, measure, analyse and write a
wire_accuracy run (prompts.csv, layers.csv, the analysis's wire_accuracy.csv and wire_layers.csv, run.json), then
print one line per weights and wire and the goals."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from ...study import add_options, run_from_args
from .. import wire_accuracy as face

__all__ = ["add_arguments", "run_args", "main"]

DESCRIPTION = """Prefill prompts of held-out text on a trained byte-level model (and on random weights of its shape), send each
    prompt's cache through paged pools as FP8 with each scale mode (and as bf16, the control), and decode from what
    arrived: greedy agreement with bf16 (free-running and teacher-forced), perplexity of the held-out bytes that
    follow, per-layer errors of the cache and of attention. Writes prompts.csv, layers.csv, wire_accuracy.csv,
    wire_layers.csv and run.json.

Example: kvlab wire-accuracy --context 128 --tokens 32 --prompts 4 --out /tmp/kvlab-wire-accuracy"""


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``kvlab wire-accuracy`` options to ``parser``: one per parameter of the study's PARAMS, and --out."""
    parser.description = DESCRIPTION
    return add_options(parser, face)


def run_args(args: argparse.Namespace) -> int:
    """Run ``kvlab wire-accuracy`` from parsed arguments; returns the exit status (bad input: ValueError, one line)."""
    path, analysis = run_from_args(face, args, "kvlab wire-accuracy")
    for r in analysis.tables["wire_accuracy"].itertuples():
        wire = {"bf16": "bf16 (control)", face.ULP: "bf16 ± 1 ulp"}.get(r.wire_dtype, f"fp8 {r.scales}")
        print(f"{r.weights:8} {wire:19} agreement {r.free_agreement_pct:6.2f} % free [{r.free_lo:.2f}, {r.free_hi:.2f}]"
              f"  {r.forced_agreement_pct:6.2f} % forced  ppl {r.ppl_bf16:.4f} → {r.ppl_wire:.4f} "
              f"({r.ppl_excess_pct:.3f} %)  cache max err {r.kv_max_rel_err:.3g}  {r.bytes_ratio:.3f}× bytes")
    for g in analysis.goals.itertuples():
        print(f"goal {g.id} ({g.weights}, {g.scales}): {g.value} — {g.verdict}")
    print(f"run: {path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``kvlab wire-accuracy [--context 256] [--tokens 256] [--prompts 32] [--out DIR]``: measure and write a
    wire_accuracy run; returns the exit status."""
    parser = add_arguments(argparse.ArgumentParser(prog="kvlab wire-accuracy", description=main.__doc__.splitlines()[0]))
    return run_args(parser.parse_args(argv))
