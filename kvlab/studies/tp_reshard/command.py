"""`kvlab reshard`: the re-shard study from the command line — check, measure, analyse and write a tp_reshard run
(ceilings.csv, reshard_rows.csv, decode_check.csv, the analysis's reshard.csv, run.json), then print one line per
(pair, layout, mover) and per decode check."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence

import pandas as pd

from ...study import Analysis, add_options, run_command, run_from_args
from .. import tp_reshard as face

__all__ = ["add_arguments", "run", "run_args", "main"]

# what `kvlab reshard --help` says above its options
DESCRIPTION = """Move a paged cache from P prefill ranks' pools to D decode ranks' (fused Triton kernel, torch indexing,
    staging), each checked bit for bit on poisoned pools, then timed beside the same cache moved between equal TP on
    the same device, with the calculator's prediction; then D processes decode together from each re-sharded cache of a
    small model (CPU, gloo) against the colocated decode. Writes ceilings.csv, reshard_rows.csv, decode_check.csv,
    reshard.csv, run.json.

Example: kvlab reshard --model kvlab-tiny --context 256 --pairs 2-1,1-2 --layouts hnd --repeats 3 --out /tmp/kvlab-reshard"""


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``kvlab reshard`` options to ``parser``: one per parameter of the study's PARAMS, and --out."""
    parser.description = DESCRIPTION  # kvlab reshard --help: what it does, then its options
    return add_options(parser, face)


def run(params: Mapping, out: str = "") -> tuple[str, Analysis]:
    """Check every value (ValueError before a folder is made), then measure into a run folder (data/tp_reshard/
    <run_id>/ unless `out`), analyse and finish it. Returns (run folder, analysis). A run that stops says so."""
    return run_command(face, params, out, "kvlab reshard")


def run_args(args: argparse.Namespace) -> int:
    """Run ``kvlab reshard`` from parsed arguments; returns the exit status (bad input: ValueError, one line)."""
    path, analysis = run_from_args(face, args, "kvlab reshard")
    for r in analysis.tables["reshard"].itertuples():
        pred = f"  calculator {r.predicted_ms:8.3f} ms ({r.pred_err_pct:+.0f} %)" if r.predicted_ms == r.predicted_ms else ""
        print(f"TP {r.prefill_tp}→{r.decode_tp} {r.pool_layout:4} {r.method:12} {r.ms_median:9.3f} ms "
              f"({r.ms_min:.3f}–{r.ms_max:.3f})  {r.pct_of_same_tp:5.1f} % of same TP [{r.pct_lo:.1f}, {r.pct_hi:.1f}]"
              f"{pred}  shards {'exact' if r.verified else 'WRONG'}")
    for r in analysis.tables.get("decode_check", pd.DataFrame()).itertuples():
        print(f"TP {r.prefill_tp}→{r.decode_tp} {r.pool_layout:4} decode ({r.impl}, {r.backend}): tokens "
              f"{'equal' if r.tokens_match else 'DIFFER'}, logits within {r.logits_max_abs_diff:.1e} "
              f"(tolerance {r.logits_tolerance:.1e}) — {'passed' if r.passed else 'FAILED'}")
    for g in analysis.goals.itertuples():
        print(f"goal {g.id} ({g.mode}, {g.layout}): {g.value} — {g.verdict}")
    print(f"run: {path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``kvlab reshard [--model M] [--context 32k] [--pairs 1-2,2-1] [--layouts hnd,nhd] [--out DIR]``: measure and
    write a tp_reshard run; returns the exit status."""
    parser = add_arguments(argparse.ArgumentParser(prog="kvlab reshard", description=main.__doc__.splitlines()[0]))
    return run_args(parser.parse_args(argv))
