"""`kvlab reshard`: the re-shard study from the command line — check, measure, analyse and write a tp_reshard run
(ceilings.csv, reshard_rows.csv, the analysis's reshard.csv, run.json), then print one line per (pair, layout,
mover)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence

from ... import runfolder
from ...study import Analysis, run_command
from .. import tp_reshard as face
from . import PARAMS

__all__ = ["add_arguments", "run", "run_args", "main"]

_DEFAULTS = {p.name: p.default for p in PARAMS}

# what `kvlab reshard --help` says above its options
DESCRIPTION = """Move a paged cache from P prefill ranks' pools to D decode ranks' (fused Triton kernel, torch indexing,
    staging), each checked bit for bit on poisoned pools, then timed beside the same cache moved between equal TP on
    the same device, with the calculator's prediction. Writes ceilings.csv, reshard_rows.csv, reshard.csv, run.json.

Example: kvlab reshard --model kvlab-tiny --context 256 --pairs 2-1,1-2 --layouts hnd --repeats 3 --out /tmp/kvlab-reshard"""


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``kvlab reshard`` options to ``parser``; defaults are the study's PARAMS'."""
    parser.description = DESCRIPTION  # kvlab <command> --help: what it does, then its options
    d = _DEFAULTS
    parser.add_argument("--model", default=d["model"], help="registry name or a config.json / model folder (default "
                        "auto: qwen2.5-7b on a GPU, kvlab-tiny on a CPU)")
    parser.add_argument("--context", default=d["context"], help="tokens in the cache (default auto: 32k on a GPU, "
                        "256 on a CPU)")
    parser.add_argument("--pairs", default=d["pairs"], help="prefill TP - decode TP pairs, comma-separated (default "
                        "auto: 1-2,2-1,1-4,4-1,2-4 on a GPU, 2-1,1-2,1-4 on a CPU)")
    parser.add_argument("--layouts", default=d["layouts"], help="pool layouts: hnd and/or nhd (default hnd,nhd)")
    parser.add_argument("--methods", default=d["methods"], help="movers timed beside the same-TP copy (default "
                        "fused,torch-index,staging)")
    parser.add_argument("--block-size", type=int, default=d["block_size"], help="tokens per block (default 16)")
    parser.add_argument("--kv-dtype", default=d["kv_dtype"], help="bf16, fp16 or fp32 (default bf16)")
    parser.add_argument("--device", default=d["device"], help="the device every rank's pool is on: auto (cuda:0), "
                        "cuda:N, or cpu (checks the logic)")
    parser.add_argument("--repeats", type=int, default=d["repeats"], help="timed rounds per pair and layout (default "
                        "0: 10 on a GPU, 3 on a CPU)")
    parser.add_argument("--seed", type=int, default=d["seed"], help="seed of the block tables and the data")
    parser.add_argument("--out", default=None, help="run folder (default: a new data/tp_reshard/<run_id>/)")
    return parser


def run(params: Mapping, out: str = "") -> tuple[str, Analysis]:
    """Check every value (ValueError before a folder is made), then measure into a run folder (data/tp_reshard/
    <run_id>/ unless `out`), analyse and finish it. Returns (run folder, analysis). A run that stops says so."""
    return run_command(face, params, out, "kvlab reshard")


def run_args(args: argparse.Namespace) -> int:
    """Run ``kvlab reshard`` from parsed arguments; returns the exit status (bad input: ValueError, one line)."""
    if args.out is not None:  # before anything is measured: a finished run is never overwritten
        runfolder.check_run_folder(args.out, "--out")
    params = {"model": args.model, "context": args.context, "pairs": args.pairs, "layouts": args.layouts,
              "methods": args.methods, "block_size": args.block_size, "kv_dtype": args.kv_dtype,
              "device": args.device, "repeats": args.repeats, "seed": args.seed}
    path, analysis = run(params, out=args.out or "")
    for r in analysis.tables["reshard"].itertuples():
        pred = f"  calculator {r.predicted_ms:8.3f} ms ({r.pred_err_pct:+.0f} %)" if r.predicted_ms == r.predicted_ms else ""
        print(f"TP {r.prefill_tp}→{r.decode_tp} {r.pool_layout:4} {r.method:12} {r.ms_median:9.3f} ms "
              f"({r.ms_min:.3f}–{r.ms_max:.3f})  {r.pct_of_same_tp:5.1f} % of same TP [{r.pct_lo:.1f}, {r.pct_hi:.1f}]"
              f"{pred}  shards {'exact' if r.verified else 'WRONG'}")
    for g in analysis.goals.itertuples():
        print(f"goal {g.id} ({g.mode}, {g.layout}): {g.value} — {g.verdict}")
    print(f"run: {path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``kvlab reshard [--model M] [--context 32k] [--pairs 1-2,2-1] [--layouts hnd,nhd] [--out DIR]``: measure and
    write a tp_reshard run; returns the exit status."""
    parser = add_arguments(argparse.ArgumentParser(prog="kvlab reshard", description=main.__doc__.splitlines()[0]))
    return run_args(parser.parse_args(argv))
