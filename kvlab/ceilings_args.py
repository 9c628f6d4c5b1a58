"""The options of ``kvlab ceilings``, apart from kvlab.ceilings so that ``kvlab ceilings --help`` does not wait
for torch to import."""

from __future__ import annotations

import argparse


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
