"""The ``kvlab`` command (also ``python -m kvlab``).

    kvlab run NOTEBOOK [-p NAME VALUE ...] [--run-dir DIR]   one notebook through papermill
    kvlab run-all [-p NAME VALUE ...]                         every notebook, in order
    kvlab sweep NOTEBOOK --grid FILE [-p NAME VALUE ...]      one run per point of a grid
    kvlab calc MODEL --tokens N [--link 400G] ...             the KV-cache calculator's answer (MODEL or config.json)
    kvlab info                                                hardware, versions, P2P matrix
    kvlab analyse RUN_DIR                                     a committed run's analysis, again
    kvlab report [--check]                                    the README's and docs' tables from the committed runs
    kvlab provenance [RUN_DIR ...] [--check]                  which code made each run; can it be rebuilt
    kvlab disagg --backend gloo|ipc|nccl|nixl ...             prefill and decode as two processes
    kvlab swapin --context 4k,32k                             paged host → GPU scatter (swap-in) beside the gather
    kvlab reshard --pairs 1-2,2-1 | kvlab wire --context 32k  a paged cache between different TP | sent as FP8
    kvlab wire-accuracy --prompts 32                          what the FP8 wire does to decoding (a trained model)
    kvlab simulate --gpus 16 --requests 200 --out DIR         KV handoffs on a cluster fabric, simulated (no GPU)

Adding a subcommand is one function and its registration, with its options given either as
``arg(...)`` entries or by a module's own ``add_arguments(parser)`` (named as "module:function",
imported only when that subcommand runs)::

    @subcommand("ceilings", "measure link ceilings on this machine",
                configure="kvlab.studies.link_ceilings.command:add_arguments")
    def _cmd_ceilings(args) -> int:
        from kvlab.studies.link_ceilings import command   # heavy imports inside, so `kvlab --help` stays fast
        return command.run_args(args)

Bad input raises ``UsageError``; ``main`` prints it as ``kvlab <command>: error: ...`` and exits 2,
before any folder is created. Set ``KVLAB_DEBUG=1`` to see the traceback instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

from kvlab import (__version__, analyse, calculator, devices, models, paths, provenance, report, runfolder, runner,
                   studies)
from kvlab.fabric import command as simulate_command
from kvlab.nbtools import format_number
from kvlab.tracefmt import command as trace_command
from kvlab.parse import OneLineParser, UsageError, token_list
from kvlab.params import (RUN_DIR_IS_SET, find_notebook,
                          list_notebooks, notebooks_dir, parse_params, runnable_parameters)
from kvlab.units import fmt_bytes


# --------------------------------------------------------------------- subcommand registry


@dataclasses.dataclass(frozen=True)
class _Command:
    name: str
    help: str
    args: tuple
    func: Callable[[argparse.Namespace], int]
    configure: Callable[[argparse.ArgumentParser], object] | str | None


_COMMANDS: list[_Command] = []


def arg(*flags: str, **kwargs) -> tuple:
    """One ``add_argument`` call for ``subcommand``: ``arg("--tp", type=int, default=1)``."""
    return flags, kwargs


def subcommand(name: str, help: str, *args: tuple,
               configure: Callable[[argparse.ArgumentParser], object] | str | None = None):
    """Register the decorated ``func(args) -> exit code`` as ``kvlab <name>``; the function's
    docstring becomes the description shown by ``kvlab <name> --help``.

    ``args``: ``arg(...)`` entries. ``configure``: a function that adds options to the
    subcommand's parser, or its ``"module:function"`` name; a name is imported only when that
    subcommand is parsed, so a module that imports torch does not slow down ``kvlab --help``.
    """

    def register(func):
        if any(c.name == name for c in _COMMANDS):
            raise ValueError(f"kvlab subcommand {name!r} is registered twice")
        _COMMANDS.append(_Command(name, help, args, func, configure))
        return func

    return register


def _configure(cmd: _Command, parser: argparse.ArgumentParser) -> None:
    for flags, kwargs in cmd.args:
        parser.add_argument(*flags, **kwargs)
    configure = cmd.configure
    if isinstance(configure, str):
        import importlib

        module, _, function = configure.partition(":")
        configure = getattr(importlib.import_module(module), function)
    if configure is not None:
        configure(parser)


def command_names() -> list[str]:
    """The registered subcommands, in the order ``kvlab --help`` lists them."""
    return [c.name for c in _COMMANDS]


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The argparse parser of every registered subcommand. With ``only``, the options of that
    subcommand alone are added (the others are listed, with no options), which keeps a module's
    heavy imports out of every other command."""
    parser = OneLineParser(
        prog="kvlab",
        description="kvlab: the KV-cache bill of disaggregated LLM inference, as a workbook.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"kvlab {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for cmd in _COMMANDS:
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.func.__doc__ or cmd.help,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        # a "module:function" configure imports its module (ceilings: torch), so it runs only for its own
        # subcommand; the top-level --help lists names and one-line helps and needs none of them
        if only == cmd.name or (only is None and not isinstance(cmd.configure, str)):
            _configure(cmd, p)
        p.set_defaults(_func=cmd.func, _parser=p)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kvlab`` and ``python -m kvlab``; returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    # The subcommand is the first word that is not an option (kvlab has no option with a value).
    only = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(only if only in command_names() else None)
    args, extra = parser.parse_known_args(argv)
    if "--version" in extra:
        parser.exit(2, f"kvlab {args.command}: error: --version is kvlab's own option, before any command: "
                       "kvlab --version\n")
    if extra:  # named by the parser they were given to: kvlab's own (before the command) or the subcommand's
        before = argv[:argv.index(args.command)] if args.command in argv else []
        (parser if any(e in before for e in extra) else args._parser).error(
            f"unrecognized arguments: {' '.join(extra)}")
    # What run.json records as the command line (the kernel's own sys.argv names only itself).
    args.argv = ["kvlab", *argv]
    # SIGTERM (`timeout`, a batch system) ends a command the way Ctrl-C does, so a run folder it had started says
    # it stopped rather than "running" (a notebook run under `timeout` on the H200 did, 2026-12-01)
    restore_term = runfolder.raise_on_sigterm()
    try:
        return int(args._func(args) or 0)
    except KeyboardInterrupt as err:
        if os.environ.get("KVLAB_DEBUG"):
            raise
        where = getattr(err, "run_dir", None)
        print(f"kvlab {args.command}: {runfolder.stop_reason(err)}; "
              + (f"{where} says it stopped ({runfolder.STOPPED})" if where else "a run folder it had started says it stopped"),
              file=sys.stderr)
        return 143 if isinstance(err, runfolder.Terminated) else 130
    except OSError as err:  # PermissionError, NotADirectoryError, a full disk: one line, the path named
        if os.environ.get("KVLAB_DEBUG"):
            raise
        where = " → ".join(str(f) for f in (err.filename, err.filename2) if f)
        print(f"kvlab {args.command}: error: {err.strerror or err}" + (f": {where}" if where else ""), file=sys.stderr)
        # a timeout or a lost connection is not the user's input: exit 1, as a failed run does
        return 1 if isinstance(err, (TimeoutError, ConnectionError)) else 2
    except (UsageError, ValueError) as err:
        # ValueError: the library's own bad-input errors (an unknown model, tokens <= 0) already
        # name the value and what is valid; a traceback would only bury that line.
        if os.environ.get("KVLAB_DEBUG"):
            raise
        print(f"kvlab {args.command}: error: {err}", file=sys.stderr)
        return 2
    finally:
        restore_term()


# ----------------------------------------------------------------------- notebook params


# ------------------------------------------------------------------------------- notebooks


def _preflight(notebook: Path, params: Mapping) -> None:
    """Every value given for ``notebook`` checked the way the notebook will read it — by its study's own `check`
    (kvlab.study) — before a kernel starts or a folder is made; a bad value is a one-line UsageError."""
    name = paths.study_of(notebook)
    if name not in studies.NAMES:  # a notebook of no study (a user's own): papermill and the notebook check it
        return
    try:
        studies.get(name).check(params)
    except ValueError as err:
        raise UsageError(str(err).splitlines()[0]) from None


_PARAM = arg("-p", "--param", dest="params", nargs=2, action="append", default=[],
             metavar=("NAME", "VALUE"),
             help="set a notebook parameter; VALUE is YAML: 4096, 1e-3, true, '[1024, 4096]', "
                  "'{a: 1}' (a str parameter takes VALUE as written); repeatable")
_NO_PROGRESS = arg("--no-progress", action="store_true", help="hide papermill's progress bar")
_CELL_TIMEOUT = arg("--cell-timeout", metavar="S", default=None,
                    help="stop a notebook whose cell (or kernel reply) takes longer than S seconds: the run is marked "
                         "failed instead of waiting for ever (default: no limit, or KVLAB_CELL_TIMEOUT)")


# --------------------------------------------------------------------------- run, run-all


def _refuse_finished(folder: "str | Path", flag: str = "--run-dir") -> None:
    """A run folder option (`flag`) naming a folder that holds a finished run (or anything that is not a run
    folder): refused, so a result is never overwritten without a word (kvlab.runfolder.check_run_folder)."""
    try:
        runfolder.check_run_folder(folder, flag)
    except ValueError as err:
        raise UsageError(str(err)) from None


@subcommand(
    "run", "execute one notebook through papermill into data/<study>/<run_id>/",
    arg("notebook", metavar="NOTEBOOK",
        help="a path, or a short name: handoff, 02_handoff and 02 all mean "
             "notebooks/02_handoff.ipynb"),
    _PARAM,
    arg("--run-dir", default=None, metavar="DIR",
        help="the run folder (default: a new data/<study>/<run_id>/)"),
    arg("--publish", action="store_true",
        help="also replace the README's figures in figures/<study>/ with this run's (only when the published "
             "ones came from a run with the same parameters; KVLAB_PUBLISH=force overrides)"),
    _NO_PROGRESS,
    _CELL_TIMEOUT,
)
def _cmd_run(args) -> int:
    """Execute NOTEBOOK through papermill with its parameters (-p NAME VALUE) into a run folder.

Every -p name and value is checked before anything is created; the executed notebook is written to
<run_dir>/<notebook>.ipynb and kept when a cell fails (exit 1). Figures go to the run folder only;
--publish also puts them in figures/<study>/. The run folder is printed at the end.

Example: kvlab run handoff -p contexts 64,128 -p destinations same-gpu"""
    notebook = find_notebook(args.notebook)
    declared = runnable_parameters(notebook)
    params = parse_params(args.params, declared, notebook.name)
    _preflight(notebook, params)
    timeout = runner.cell_timeout(args.cell_timeout)
    if args.run_dir is not None:
        _refuse_finished(args.run_dir)
    keep_force = os.environ.get("KVLAB_PUBLISH", "").strip().lower() == "force"
    with runner.environment(**({"KVLAB_PUBLISH": "force" if keep_force else "1"} if args.publish else {})):
        outcome = runner.execute(notebook, params, run_dir=args.run_dir or None,
                          progress=not args.no_progress, cell_timeout=timeout,
                          invocation={"argv": args.argv, "command": "run"})
    runner.report_failure(outcome)
    print(outcome.run_dir)
    return 0 if outcome.ok else 1


@subcommand(
    "run-all", "execute every notebook in notebooks/, in order, with default parameters",
    _PARAM,
    _NO_PROGRESS,
    _CELL_TIMEOUT,
)
def _cmd_run_all(args) -> int:
    """Execute every notebook of notebooks/ in file-name order (00_…, 01_…), each into its own run
    folder, with its default parameters ("auto" sizes follow the hardware).

A -p NAME VALUE goes to every notebook that declares NAME, and must be declared by at least one.
A failed notebook does not stop the rest; the exit code is 1 if any failed. `make run` runs this."""
    nbs = list_notebooks()
    if not nbs:
        raise UsageError(f"no notebooks in {notebooks_dir()}")
    declared = {nb: runnable_parameters(nb) for nb in nbs}
    names = [name for name, _ in args.params]
    if "run_dir" in names:
        raise UsageError(RUN_DIR_IS_SET)
    unknown = [n for n in names if not any(n in params for params in declared.values())]
    if unknown:
        listing = "\n".join(f"  {nb.name}: {', '.join(n for n in params if n != 'run_dir')}"
                            for nb, params in declared.items())
        raise UsageError(f"no notebook declares {', '.join(map(repr, unknown))}; the notebooks' "
                         f"parameters:\n{listing}")
    timeout = runner.cell_timeout(args.cell_timeout)
    plans = []
    for nb in nbs:
        mine = [(n, v) for n, v in args.params if n in declared[nb]]
        plans.append((nb, parse_params(mine, declared[nb], nb.name)))
        _preflight(nb, plans[-1][1])
    outcomes = []
    for nb, params in plans:
        print(f"== {nb.name}", flush=True)
        outcome = runner.execute(nb, params, progress=not args.no_progress, cell_timeout=timeout,
                          invocation={"argv": args.argv, "command": "run-all"})
        runner.report_failure(outcome)
        outcomes.append(outcome)
    print()
    print(runner.summary([runner.outcome_row(o) for o in outcomes]))
    failed = [o.notebook for o in outcomes if not o.ok]
    if failed:
        print(f"\n{len(failed)} of {len(outcomes)} notebooks failed: {', '.join(failed)}",
              file=sys.stderr)
    return 1 if failed else 0


# ----------------------------------------------------------------------------------- sweep


@subcommand(
    "sweep", "run a notebook once per point of a parameter grid (YAML or JSON)",
    arg("notebook", metavar="NOTEBOOK", help="a path or short name, as for `kvlab run`"),
    arg("--grid", required=True, metavar="FILE",
        help="YAML/JSON: {name: [values, ...]} for every combination, or [{name: value}, ...]"),
    _PARAM,
    arg("--dry-run", action="store_true", help="validate and list the points; run nothing"),
    _NO_PROGRESS,
    _CELL_TIMEOUT,
)
def _cmd_sweep(args) -> int:
    """Run NOTEBOOK once per point of the grid in FILE, each point in its own run folder.

    # examples/grid.yaml
    contexts: [[1024, 4096], [16384]]     # each point's contexts: a list per point
    policy: [eager, deadline]             # 2 × 2 = 4 runs

Example: kvlab sweep handoff --grid examples/grid.yaml --dry-run

Every point is validated before the first run; -p NAME VALUE fixes a parameter for all points
(a grid value wins over it). A summary table ends the sweep; exit 1 if any point failed."""
    notebook = find_notebook(args.notebook)
    declared = runnable_parameters(notebook)
    fixed = parse_params(args.params, declared, notebook.name)
    points = runner.check_points(runner.load_grid(args.grid), declared, notebook.name)
    timeout = runner.cell_timeout(args.cell_timeout)
    for i, point in enumerate(points):
        try:
            _preflight(notebook, {**fixed, **point})
        except (ValueError, UsageError) as err:
            raise UsageError(f"grid point {i} {json.dumps(point)}: {err}") from None
    print(f"{notebook.name}: {len(points)} point(s) from {args.grid}")
    if args.dry_run:
        print(runner.summary([{"point": i, "parameters": json.dumps(p)} for i, p in enumerate(points)]))
        return 0
    outcomes = []
    for i, point in enumerate(points):
        print(f"== point {i + 1}/{len(points)}: {json.dumps(point)}", flush=True)
        outcome = runner.execute(notebook, {**fixed, **point}, progress=not args.no_progress, cell_timeout=timeout,
                          invocation={"argv": args.argv, "command": "sweep",
                                      "grid": str(args.grid), "point": i, "points": len(points)})
        runner.report_failure(outcome)
        outcomes.append((point, outcome))
    print()
    print(runner.summary([runner.outcome_row(o, point=json.dumps(p)) for p, o in outcomes]))
    failed = sum(not o.ok for _, o in outcomes)
    if failed:
        print(f"\n{failed} of {len(outcomes)} points failed", file=sys.stderr)
    return 1 if failed else 0


# ------------------------------------------------------------------------------------ calc


def _one_token_count(text: str) -> int:
    try:
        counts = token_list(text, "--tokens", minimum=-2**62)  # the calculator names a bad count
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if len(counts) != 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give one prompt length, e.g. 8192 or 8k")
    return counts[0]


def _show(name: str, value) -> str:

    if isinstance(value, bool) or value is None or isinstance(value, str):
        return str(value)
    if isinstance(value, (int, float)):
        text = format_number(value, 4)
        if "bytes" in name and abs(value) >= 1024:
            return f"{text} ({fmt_bytes(value)})"
        if "flops" in name and name != "tflops":
            return f"{text} ({value / 1e12:,.4g} TFLOP)"
        return text
    return str(value)


@subcommand(
    "calc", "the KV-cache calculator: bytes, link time and exposure for one model and prompt",
    arg("model", metavar="MODEL",
        help="a registry model name, e.g. llama-3.1-8b (case-insensitive), or a config.json path or a model folder "
             "holding one"),
    arg("--tokens", required=True, type=_one_token_count, metavar="N",
        help="prompt length in tokens: 8192 or 8k"),
    arg("--link", default="400G",
        help="the link: a preset (100G, 200G, 400G, 800G, nvlink, pcie5) or a rate (400Gb/s, "
             "50GB/s) (default 400G)"),
    arg("--kv-dtype", default="bf16", help="KV-cache dtype: fp32, bf16, fp16, fp8, int8 "
                                           "(default bf16)"),
    arg("--tp", type=int, default=1, help="tensor-parallel degree of the prefill side (default 1)"),
    arg("--tflops", type=float, default=400.0,
        help="achieved prefill compute per GPU, TFLOP/s (default 400)"),
)
def _cmd_calc(args) -> int:
    """Print the calculator's answer for MODEL and a prompt of N tokens: KV bytes per token and in
    all, prefill time, transfer time over the link, and what a layer-by-layer handoff exposes.

Example: kvlab calc qwen2.5-7b --tokens 32k --link nvlink-h100
         kvlab calc path/to/Llama-3.2-1B/config.json --tokens 8k"""

    spec = models.from_ref(args.model, "MODEL")
    if args.link.strip().replace(".", "", 1).isdigit():
        raise UsageError(f"--link {args.link!r} has no unit: write {args.link}G for Gb/s (as NICs are quoted) or "
                         f"{args.link}GB/s for bytes per second, or a preset: 100G, 200G, 400G, 800G, nvlink, pcie5")
    link = calculator.link(args.link)
    if args.tp < 1:
        raise UsageError(f"--tp {args.tp}: give a TP degree ≥ 1 (the ranks a model is split over)")
    if spec.heads % args.tp:  # what serving engines refuse (the query heads split evenly over the TP ranks)
        raise UsageError(f"--tp {args.tp:,}: {spec.name}'s {spec.heads} query heads do not split over {args.tp:,} "
                         f"ranks; give a TP that divides {spec.heads}")
    estimate = calculator.handoff_estimate(spec, args.tokens, link, kv_dtype=args.kv_dtype,
                                           tp=args.tp, tflops=args.tflops)
    row = estimate.as_row()
    rows = []
    for key, value in row.items():
        rows.append((key, _show(key, value)))
        if key == "kv_dtype":  # per token at this prompt (windows full, state layers none), the uncapped beside
            rows.append(("kv_bytes_per_token", _show("bytes", row["kv_bytes"] / args.tokens) + " at this prompt"))
            rows.append(("kv_bytes_per_token_uncapped",
                         _show("bytes", calculator.kv_bytes_per_token(spec, args.kv_dtype))))
        elif key == "link":
            rows.append(("link_gbit_per_s", _show("gbps", link.gbit_per_s)))
    rows.append(("note", estimate.shard.note))
    if spec.max_positions and args.tokens > spec.max_positions:  # arithmetic for a prompt the model cannot hold
        rows.append(("positions", f"{args.tokens:,} tokens are more than {spec.name}'s {spec.max_positions:,} "
                                  "positions (max_position_embeddings): arithmetic only, no such prompt runs"))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key.ljust(width)}  {value}")
    return 0


# ------------------------------------------------------------------------------------ info


def format_info(info: Mapping) -> str:
    """``devices.describe()`` as text: host, GPUs, P2P matrix, driver/CUDA, versions."""
    h = info["host"]
    memory = fmt_bytes(h["memory_bytes"]) if h.get("memory_bytes") else "unknown"
    lines = [
        f"host      {h['hostname']}  ({h['os']})",
        f"cpu       {h['cpu_model']}  ({h['cpu_usable']} of {h['cpu_count']} logical CPUs usable)",
        f"memory    {memory}",
        f"device    {info['device_kind']}  (run-id tag: {info['device_tag']})",
        f"driver    {info.get('driver_version') or '-'}",
        f"cuda      {info.get('cuda_runtime') or '-'}",
    ]
    gpus = info.get("devices") or []
    lines.append("")
    if gpus:
        lines.append(runner.summary([{"gpu": g["index"], "name": g["name"],
                                "memory": fmt_bytes(g["memory_bytes"]),
                                "cc": g["compute_capability"], "SMs": g["sm_count"]}
                               for g in gpus]))
        lines += ["", "P2P access (row → column): Y = direct peer access, . = none"]
        lines.append("      " + " ".join(f"{j:>3}" for j in range(len(gpus))))
        for i, row in enumerate(info.get("p2p") or []):
            marks = ["  -" if v is None else ("  Y" if v else "  .") for v in row]
            lines.append(f"  {i:>3} " + " ".join(marks))
        topo = info.get("topology") or {}
        for title, key in (("topology (nvidia-smi topo -m)", "matrix"), ("NVLink (nvidia-smi nvlink -s)", "nvlink")):
            if topo.get(key):
                lines += ["", title, topo[key]]
    else:
        lines.append("no CUDA device (CPU-only: notebooks use the tiny model and small sizes)")
    lines += ["", "versions"]
    lines += [f"  {name:<12} {version or '-'}" for name, version in info["versions"].items()]
    return "\n".join(lines)


@subcommand("ceilings", "measure link ceilings: GB/s and fixed cost per copy, for each path here",
            configure="kvlab.studies.link_ceilings.command:add_arguments")
def _cmd_ceilings(args) -> int:
    """Time plain copies over a size sweep on every path this machine has (same-GPU, peer, pinned and
    pageable host), fit fixed cost + bandwidth per path, and write a link_ceilings run under
    data/link_ceilings/<run_id>/ — the ceilings every later bandwidth is compared with."""
    from kvlab.studies.link_ceilings import command  # imports torch: only when this subcommand runs

    return command.run_args(args)


@subcommand("analyse", "recompute a committed run's analysis (tables, goals, figures) with this code; no GPU",
            configure="kvlab.analyse:add_arguments")
def _cmd_analyse(args) -> int:
    """Re-run the analysis half of a finished run from the tables its measurement wrote, into
    <run>/analysis/<UTC time>-<commit>/ with analysis.json naming the code that drew it; the run's own
    tables and figures stay as they were. Any study's run: its run.json names the study.

Example: kvlab analyse data/overlap_timeline/20261130-142913-h200 --out /tmp/reanalysis"""

    return analyse.run_args(args)


@subcommand("report", "rewrite the README's result tables from the committed runs (--check: only compare)",
            configure="kvlab.report:add_arguments")
def _cmd_report(args) -> int:
    """Regenerate every table the README marks with <!-- kvlab-report:NAME --> from data/ (the runs each
    block names, the goals' verdicts under kvlab.goals' one rule). --check compares instead and exits 1
    when the README differs from what the committed runs give (the test suite runs it)."""

    return report.run_args(args)


@subcommand("provenance", "say which code made each run and whether it can be reconstructed (--check: exit 1 if not)",
            configure="kvlab.provenance:add_arguments")
def _cmd_provenance(args) -> int:
    """Check each run's recorded code hash against its commit (kvlab.provenance.status)."""

    return provenance.run_args(args)


@subcommand("trace", "timelines: profile a command with Nsight Systems, or load a trace",
            arg("rest", nargs=argparse.REMAINDER, metavar="nsys|load ...",
                help="`nsys [--out DIR] -- COMMAND ...` or `load FILE [--csv OUT]` "
                     "(see `kvlab trace nsys --help`)"))
def _cmd_trace(args) -> int:
    """Take or read a timeline into kvlab's events table. Where Nsight Systems cannot make a report,
    it says so: torch.profiler (kvlab.tracefmt.capture, notebook 03) is the path that always works."""

    return trace_command.trace_main(args.rest or ["--help"])


@subcommand("disagg",
            "prefill and decode as two processes: move the cache across (gloo, ipc, nccl, nixl), decode, compare",
            configure="kvlab.studies.disagg.command:add_arguments")
def _cmd_disagg(args) -> int:
    """Start a prefill process and a decode process, each with its own copy of the model (same seed, same
    weights). The decode process allocates its cache (poisoned), the prefill process prefills and sends it
    in bulk or layer by layer, and the decode process decodes once every layer has landed, comparing tokens,
    logits and bytes with its own colocated run. Writes <out>/requests.csv, summary.json and run.json.
    Under torchrun (2 processes; rank 0 decodes) the same command runs across two nodes: see docs/results/disagg.md.

Example: kvlab disagg --backend gloo --model kvlab-tiny --context 128 --decode-tokens 20 --out /tmp/kvlab-disagg"""
    from kvlab.studies.disagg import command  # imports torch: only when this subcommand runs

    return command.run_args(args)


@subcommand("simulate", "KV handoffs of a whole cluster on its fabric, simulated (no GPU): NICs, leaves and spines "
            "shared max-min fair", configure="kvlab.fabric.command:add_arguments")
def _simulate(args) -> int:
    """Simulate prefill workers handing KV caches to decode workers over a cluster fabric (NVLink inside a node, a
    NIC per GPU, leaf and spine switches with an oversubscription), flows sharing every link max-min fair, with
    kvlab's calculator timing each prefill. Writes summary.json, requests.csv (one row per request: TTFT, transfer,
    exposed time) and links.csv (one row per link: bytes, utilisation) into --out, a new or empty folder.

Example: kvlab simulate --gpus 16 --requests 200 --out /tmp/kvlab-sim"""
    return simulate_command.run_args(args)


def _study_command(name: str, help: str, study: str) -> None:
    """Register ``kvlab <name>`` for a study run from the command line: its options, its --help text (the module's
    DESCRIPTION, set by its add_arguments) and its run are kvlab.studies.<study>.command's, imported only when the
    subcommand is used (those modules import torch)."""
    module = f"kvlab.studies.{study}.command"

    def run(args) -> int:
        return importlib.import_module(module).run_args(args)

    subcommand(name, help, configure=f"{module}:add_arguments")(run)


_study_command("swapin", "a paged cache from pinned host memory into a GPU pool by block table (swap-in), beside the "
            "GPU → host gather", "swapin")
_study_command("reshard", "a paged cache re-sharded from P prefill ranks to D decode ranks (different TP), beside the "
            "same-TP copy", "tp_reshard")
_study_command("wire", "a paged cache sent as FP8 with its scales (quantize in the gather, dequantize on arrival), "
            "beside bf16", "wire_dtype")
_study_command("wire-accuracy", "what an FP8 wire does to greedy decoding and perplexity, on a trained model", "wire_accuracy")
_study_command("contention", "N transfers sharing one path at once, and the fabric simulator validated on them", "contention")


@subcommand(
    "info", "hardware, driver, CUDA, package versions and the GPU P2P matrix",
    arg("--json", action="store_true", help="print the record as JSON (what run.json holds)"),
)
def _cmd_info(args) -> int:
    """Print what kvlab sees on this machine: host, CPUs, memory, GPUs (memory, compute capability,
    SM count), the peer-access matrix, driver and CUDA versions, and package versions — the same
    record every run.json carries."""

    info = devices.describe()
    print(json.dumps(info, indent=2) if args.json else format_info(info))
    return 0
