"""Analysis of a committed run, again, from what its measurement wrote — no GPU, no re-measuring.

    kvlab analyse data/overlap_timeline/20261130-142913-h200

A run folder keeps its original tables and figures as the code of its commit made them. When the analysis
code changes (a better decomposition, a clearer figure), `analyse(run_dir)` recomputes the analysis from
the run's raw tables into `<run>/analysis/<when>-<commit>/`, with `analysis.json` naming the commit, the
time and what was written, so a reader can always tell which code drew which figure. Studies:

    overlap_timeline   decomposition (with the SM-clock term when the run sampled clocks), causes,
                       backlog, findings; the send-pattern summary, findings and figures when it ran them
    handoff            the seed-004 summary, the goals, the figure
    paged_transfer     summary, goals
    link_ceilings      the fit and its figure
    disagg             the goal rows, bench, NIXL and campaign tables; the TTFT and fault figures
    swapin             the summary and the share-of-the-link figure
"""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path

import pandas as pd

from . import plots, provenance, results, studies

__all__ = ["analyse", "STUDIES", "FIGURES", "add_arguments", "run_args"]

STUDIES = ("overlap_timeline", "handoff", "paged_transfer", "link_ceilings", "disagg", "swapin")
# the figures each study's analysis can draw (which of them it draws depends on the run's tables)
FIGURES = {"overlap_timeline": ("decomposition", "event_timeline", "patterns", "clock_timeline"),
           "handoff": ("handoff_ttft",), "paged_transfer": ("gbps_vs_block_size", "access_patterns"),
           "swapin": ("swapin_pct",)}


def _need(tables: dict, run: Path, name: str) -> pd.DataFrame:
    if name not in tables:
        raise FileNotFoundError(f"{run} has no {name}.csv(.gz): this run did not write what its analysis needs")
    return tables[name]


class _Out:
    """The analysis folder: tables and figures, and what was written."""

    def __init__(self, run: Path, record: dict, out: Path | None):
        git = provenance.git_state()
        commit = git.get("commit") or "nogit"
        when = _dt.datetime.now(_dt.timezone.utc)
        self.dir = out or run / "analysis" / f"{when:%Y%m%d-%H%M%S}-{commit[:7]}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.meta = {"source_run": record.get("run_id"), "study": record.get("study"),
                     "analysed_utc": when.isoformat(timespec="seconds"), "git": git, "tables": [], "figures": [],
                     "findings": []}
        self.drawn = provenance.drawing()
        self.meta["drawn_by"] = self.drawn
        self.run_id = record.get("run_id", run.name)
        self.device_tag = record.get("device_tag", "")

    def table(self, df: pd.DataFrame, name: str) -> None:
        df.to_csv(self.dir / f"{name}.csv", index=False)
        self.meta["tables"].append(f"{name}.csv")

    def publish(self, run: Path, suffix: str = "", only: list[str] | None = None) -> list[Path]:
        """Copy this analysis's figures (those named in ``only``, default all) to figures/<study>/<name><suffix>.*
        as the source run's published figures, the sidecar naming this analysis folder and the code that drew
        them."""
        from . import plots

        out = []
        stems = [f.removesuffix(".png") for f in self.meta["figures"]]
        mode = plots.publishing() or "yes"  # KVLAB_PUBLISH=force overrides the parameters check, as for a run
        for stem in stems:
            if only and stem not in only:
                continue
            files = [p for p in (self.dir / f"{stem}.png", self.dir / f"{stem}.svg", self.dir / f"{stem}.svgz")
                     if p.is_file()]
            out += plots.publish_files(files, stem + suffix, run, mode=mode, drawn=self.drawn,
                                       analysis=self.dir.relative_to(run).as_posix()
                                       if self.dir.is_relative_to(run) else str(self.dir))
        return out

    def figure(self, fig, name: str) -> None:
        import matplotlib.pyplot as plt

        from . import plots

        footer = (f"{plots.footer_text(self.run_id, self.device_tag)} · re-analysed "
                  f"{self.meta['analysed_utc'][:10]} by {provenance.short(self.drawn)}")
        plots.set_footer(fig, footer)
        self.meta.setdefault("readability", {})[name] = plots.readability(fig)  # issues at 700 px wide
        plots.write(fig, self.dir, name, footer)
        plt.close(fig)
        self.meta["figures"].append(f"{name}.png")

    def done(self) -> Path:
        (self.dir / "analysis.json").write_text(json.dumps(results.jsonable(self.meta, "analysis"), indent=2) + "\n")
        return self.dir


def _prefill_gpu(record: dict) -> int:
    """The prefill GPU's index from run.json (its resolved device, or the pattern run's first GPU)."""
    meta = record.get("patterns_meta") or {}
    if meta.get("gpus"):
        return int(meta["gpus"][0])
    dev = str((record.get("resolved") or {}).get("device", "cuda:0"))
    return int(dev.split(":")[1]) if ":" in dev else 0


def _overlap_timeline(run: Path, record: dict, tables: dict, out: _Out) -> None:
    from . import clocks, overlap, overlap_report, plots

    plots.style()
    walls = _need(tables, run, "walls")
    timeline = tables.get("timeline")
    samples = tables.get("clock_samples")
    kept = record.get("analysed_repeat")
    gpu = _prefill_gpu(record)
    totals = None
    if timeline is not None and kept is not None and "variant" in timeline.columns:
        co = timeline[timeline.variant == "colocated"].drop(columns="variant")
        lw = timeline[timeline.variant == "layerwise"].drop(columns="variant")
        if overlap.has_gpu_activity(lw):
            w = walls[walls.traced & (walls["repeat"] == kept)].set_index("variant")
            kw = {}
            if samples is not None and len(samples) and "t0_ns" in walls.columns:
                kw = dict(clock_co=overlap.clock_on_trace(samples, gpu, int(w.t0_ns["colocated"]), co),
                          clock_lw=overlap.clock_on_trace(samples, gpu, int(w.t0_ns["layerwise"]), lw))
            dec = overlap.decompose(co, lw, ceiling_gbps=record.get("ceiling_gbps"),
                                    wall_co_ns=int(round(w.wall_ms["colocated"] * 1e6)),
                                    wall_lw_ns=int(round(w.wall_ms["layerwise"] * 1e6)), **kw)
            backlog = overlap_report.backlog_comparison(dec, layer_copy_ms=record.get("layer_copy_ms"))
            out.table(dec.summary(), "decomposition")
            out.table(dec.segments, "segments")
            out.table(overlap.causes(dec), "causes")
            out.table(backlog, "backlog")
            out.meta["decomposition_totals"] = {k: v for k, v in dec.totals.items() if not isinstance(v, tuple)}
            totals = dec.totals
            out.meta["findings"] += overlap.findings(dec, backlog)
            res = record.get("resolved") or {}
            # the notebook's title: the model and the context are in `resolved` (run.json has no top-level context)
            ax = overlap_report.decomposition_chart(dec, title=f"Δ time per layer vs colocated: {res.get('model', '')}, "
                                                        f"{int(res.get('context', 0)):,} tokens → "
                                                        f"{record.get('destination_label', '')}")
            out.figure(ax.figure, "decomposition")
    layers = tables.get("event_layers")
    if layers is not None and len(layers):
        res = record.get("resolved") or {}
        out.figure(overlap_report.event_gantt(
            layers, overlap_report.prefill_end_of(layers),
            title=f"{res.get('model', '')}, {int(res.get('context', 0)):,} tokens → {record.get('destination_label', '')}: "
                  "per-layer timeline from CUDA events (no profiler)"), "event_timeline")
    goal_table = overlap_report.goals(overlap_report.goal_summary(overlap_report.tracing_overhead(walls), totals,
                                                                  tables.get("event_overhead")))
    out.table(goal_table, "goals")
    rounds = tables.get("pattern_rounds")
    if rounds is not None and len(rounds):
        meta = record.get("patterns_meta") or {}
        summ = clocks.pattern_summary(rounds)
        out.table(summ, "patterns")
        out.meta["findings"] += clocks.pattern_findings(summ, meta)
        ctx = meta.get("context", "")
        out.figure(clocks.plot_patterns(summ, title=f"{ctx:,} tokens → {meta.get('destination', '')}: what each send "
                                                    "pattern costs prefill, beside what its SM clock predicts"
                                        if isinstance(ctx, int) else ""), "patterns")
        ps = tables.get("pattern_samples")
        tl = tables.get("pattern_timeline")
        if ps is not None and len(ps):
            out.figure(clocks.plot_clock_timeline(ps, rounds, tl if tl is not None else pd.DataFrame(),
                                                  gpu=gpu,
                                                  title=f"{ctx:,} tokens: the prefill GPU's SM clock and power, "
                                                        f"colocated vs every layer to the peer"
                                                  if isinstance(ctx, int) else ""), "clock_timeline")


def _handoff(run: Path, record: dict, tables: dict, out: _Out) -> None:
    from . import handoff_report, plots

    plots.style()
    timings = _need(tables, run, "results")
    ceil, paths = handoff_report.run_ceilings(record)
    summary = handoff_report.summarize(timings, ceil or None, paths or None)
    goals = handoff_report.goals(summary)
    out.table(summary, "summary")
    out.table(goals, "goals")
    out.meta["findings"] += handoff_report.findings(summary, goals)
    model = (record.get("resolved") or {}).get("model", "")
    gpus = len(record.get("devices") or [])
    where = f"{gpus}×{out.device_tag.upper()}" if gpus else out.device_tag
    out.figure(handoff_report.plot_ttft(summary, title=f"{model} on {where} (run {out.run_id}): what moving the KV "
                                                      "cache adds to the time to first token"), "handoff_ttft")


def _paged(run: Path, record: dict, tables: dict, out: _Out) -> None:
    from . import paged_report, plots

    plots.style()
    df = _need(tables, run, "results")
    out.table(paged_report.summary(df), "summary")
    goals = paged_report.goals(df)
    out.table(goals, "goals")
    out.meta["findings"] += [paged_report.finding(df)]
    out.figure(paged_report.plot_gbps_vs_block_size(df), "gbps_vs_block_size")
    patterns = tables.get("access_patterns")
    if patterns is not None and len(patterns):
        pat = paged_report.pattern_summary(patterns)
        out.table(pat, "access_pattern_summary")
        out.figure(paged_report.plot_patterns(pat, title=f"{int(df.context.max()):,} tokens in 16-token blocks: what "
                                                         "the access pattern costs one kernel launch"), "access_patterns")


def _swapin(run: Path, record: dict, tables: dict, out: _Out) -> None:
    from . import plots, swapin

    plots.style()
    s = swapin.summarise(_need(tables, run, "results"))
    fig = swapin.plot(s)  # before anything is written: a run with nothing to plot says so in one line
    out.table(s, "summary")
    out.figure(fig, "swapin_pct")


_DISPATCH = {"overlap_timeline": _overlap_timeline, "handoff": _handoff, "paged_transfer": _paged,
             "swapin": _swapin}


def _face(study: str):
    """The study's package when it has the one shape (kvlab.study); None for a study still analysed here."""
    try:
        module = studies.get(study)
    except (ModuleNotFoundError, ValueError):
        return None
    return module if studies.has_face(module) else None


def analyse(run_dir, out: str | Path | None = None, publish: bool = False, suffix: str = "",
            only: list[str] | None = None) -> Path:
    """Recompute the analysis of the run in `run_dir` with this checkout's code; returns the folder written
    (default `<run>/analysis/<UTC time>-<commit>/`). Raises FileNotFoundError for a folder that is not a run
    or lacks the tables its analysis reads, ValueError for a study with no analysis here."""
    run = Path(run_dir)
    if not (run / "run.json").is_file():
        raise FileNotFoundError(f"{run} is not a run folder: it has no run.json")
    record, tables = results.load(run)
    study = record.get("study")
    if study not in _DISPATCH and _face(study) is None:
        raise ValueError(f"run {run.name} is a {study!r} run; kvlab analyse knows {list(_DISPATCH)}")
    drawn = face.FIGURES if (face := _face(study)) is not None else FIGURES[study]
    bad = sorted(set(only or []) - set(drawn))
    if bad:  # before anything is written
        raise ValueError(f"--only {', '.join(bad)}: a {study} analysis draws {', '.join(drawn)}")
    if record.get("status") != "finished":
        raise ValueError(f"run {run.name} did not finish (status {record.get('status')!r}): its tables may be "
                         "partial; analyse a finished run")
    if out is not None:  # before anything is written: never into another run, or over another analysis
        target = Path(out).expanduser()
        if str(out).strip() == "" or (target.exists() and not target.is_dir()):
            raise ValueError(f"--out {str(out)!r}: give a new or empty folder")
        if target.is_dir() and any(target.iterdir()):
            raise ValueError(f"--out {str(target)!r} already holds files"
                             f"{' (a run: it has a run.json)' if (target / 'run.json').is_file() else ''}; give a "
                             "new or empty folder — kvlab analyse does not overwrite")
    o = _Out(run, record, Path(out) if out is not None else None)
    face = _face(study)
    if face is not None:  # a study of the one shape: its own analyse and figures, as the notebook calls them
        a = face.analyse(record, tables)
        for name, df in a.tables.items():
            o.table(df, name)
        if len(a.goals):
            o.table(a.goals, "goals")
        o.meta["findings"] += a.findings
        o.meta["values"] = a.values
        plots.style()
        for name, fig in face.figures(a).items():
            o.figure(fig, name)
    else:
        _DISPATCH[study](run, record, tables, o)
    where = o.done()
    if publish:
        for p in o.publish(run, suffix, only):
            print(f"published {p}")
    return where


def add_arguments(parser) -> None:
    parser.add_argument("run_dir", help="a finished run folder, e.g. data/overlap_timeline/20261130-142913-h200")
    parser.add_argument("--out", default=None, help="where to write (default: <run>/analysis/<UTC>-<commit>/)")
    parser.add_argument("--publish", action="store_true",
                        help="also put the figures in figures/<study>/ as this run's published figures")
    parser.add_argument("--suffix", default="", help="with --publish: append this to each published name, e.g. _nvlink")
    parser.add_argument("--only", default="", help="with --publish: only these figures (comma-separated names)")


def run_args(args) -> int:
    import re

    if args.suffix and not re.fullmatch(r"[a-z0-9_-]+", args.suffix):
        raise ValueError(f"--suffix {args.suffix!r}: use lowercase letters, digits, '-' and '_'")
    if (args.suffix or args.only) and not args.publish:
        raise ValueError("--suffix and --only say how to publish: add --publish")
    only = [x.strip() for x in args.only.split(",") if x.strip()] or None
    where = analyse(args.run_dir, args.out, publish=args.publish, suffix=args.suffix, only=only)
    print(f"analysis written to {where}")
    return 0
