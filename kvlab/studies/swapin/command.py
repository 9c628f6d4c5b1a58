"""`kvlab swapin`: the swap-in study from the command line — check, measure, analyse and write a swapin run
(results.csv, the analysis's summary.csv, run.json), then print one line per method."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence

from ... import runfolder
from ...study import Analysis, run_command
from .. import swapin as face
from . import PARAMS

__all__ = ["add_arguments", "run", "run_args", "main"]

_DEFAULTS = {p.name: p.default for p in PARAMS}

# what `kvlab swapin --help` says above its options
DESCRIPTION = """Scatter a paged cache held in pinned host memory into a GPU pool by block table (vLLM's swap-in): Triton's
    row kernel reading the host pool over PCIe (triton-uva), and a CPU gather + one copy + a GPU scatter (staged);
    beside them the GPU → host gather (chunked-gather-d2h), each against a contiguous copy of the same bytes the
    same way, timed in the same run. Every method is checked on a poisoned pool. Writes results.csv, summary.csv
    and run.json.

Example: kvlab swapin --model kvlab-tiny --context 256 --repeats 3"""


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``kvlab swapin`` options to ``parser`` (for a CLI subparser); defaults are the study's PARAMS'."""
    parser.description = DESCRIPTION  # kvlab <command> --help: what it does, then its options
    d = _DEFAULTS
    parser.add_argument("--model", default=d["model"], help="registry name or a config.json / model folder: the "
                        "cache's shape (default auto: qwen2.5-7b on a GPU, kvlab-tiny on a CPU)")
    parser.add_argument("--context", default=d["contexts"], help="tokens in the cache; a list runs each (default "
                        "auto: 4k,32k on a GPU, 256 on a CPU)")
    parser.add_argument("--block-size", type=int, default=d["block_size"], help="tokens per block (default 16)")
    parser.add_argument("--kv-dtype", default=d["kv_dtype"], help="bf16, fp16 or fp32 (default bf16)")
    parser.add_argument("--device", default=d["device"], help="the GPU the pool is on: auto (cuda:0), cuda:N, or cpu "
                        "(checks the logic)")
    parser.add_argument("--repeats", type=int, default=d["repeats"], help="timed sends per method and context "
                        "(default 9)")
    parser.add_argument("--seed", type=int, default=d["seed"], help="seed of the block tables and the data")
    parser.add_argument("--out", default=None, help="run folder (default: a new data/swapin/<run_id>/)")
    return parser


def run(params: Mapping, out: str = "") -> tuple[str, Analysis]:
    """Check every value (ValueError before a folder is made), then measure into a run folder (data/swapin/<run_id>/
    unless `out`), analyse and finish it. Returns (run folder, analysis). A run that stops says so in its folder."""
    return run_command(face, params, out, "kvlab swapin")


def run_args(args: argparse.Namespace) -> int:
    """Run ``kvlab swapin`` from parsed arguments; returns the exit status (bad input: ValueError, one line)."""
    if args.out is not None:  # before anything is measured: a finished run is never overwritten
        runfolder.check_run_folder(args.out, "--out")
    params = {"model": args.model, "contexts": args.context, "block_size": args.block_size, "kv_dtype": args.kv_dtype,
              "device": args.device, "repeats": args.repeats, "seed": args.seed}
    path, analysis = run(params, out=args.out or "")
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
