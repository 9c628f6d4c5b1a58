"""Analysis of a committed run, again, from what its measurement wrote — no GPU, no re-measuring.

    kvlab analyse data/overlap_timeline/20261130-142913-h200

A run folder keeps its original tables and figures as the code of its commit made them. When the analysis
code changes (a better decomposition, a clearer figure), `analyse(run_dir)` recomputes the analysis from
the run's raw tables into `<run>/analysis/<when>-<commit>/`, with `analysis.json` naming the commit, the
time and what was written, so a reader can always tell which code drew which figure. Every study's analysis is
its own `analyse` and `figures` (kvlab.studies.<study>), the very functions its notebook calls: tables, goals,
findings and every figure the notebook draws.
"""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path

import pandas as pd

from . import pages, plots, provenance, results, studies

__all__ = ["analyse", "add_arguments", "run_args"]


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

        out = []
        stems = [f.removesuffix(".png").removesuffix(".html") for f in self.meta["figures"]]
        mode = plots.publishing() or "yes"  # KVLAB_PUBLISH=force overrides the parameters check, as for a run
        for stem in stems:
            if only and stem not in only:
                continue
            files = [p for p in (self.dir / f"{stem}.png", self.dir / f"{stem}.svg", self.dir / f"{stem}.svgz",
                                 self.dir / f"{stem}.html") if p.is_file()]
            out += plots.publish_files(files, stem + suffix, run, mode=mode, drawn=self.drawn, drawn_as=stem,
                                       analysis=self.dir.relative_to(run).as_posix()
                                       if self.dir.is_relative_to(run) else str(self.dir))
        return out

    def figure(self, fig, name: str) -> None:
        import matplotlib.pyplot as plt

        footer = (f"{plots.footer_text(self.run_id, self.device_tag)} · re-analysed "
                  f"{self.meta['analysed_utc'][:10]} by {provenance.short(self.drawn)}")
        if pages.is_page(fig):  # an interactive page: written as .html, no matplotlib
            plots.write(fig, self.dir, name, footer)
            self.meta["figures"].append(f"{name}.html")
            return
        plots.set_footer(fig, footer)
        self.meta.setdefault("readability", {})[name] = plots.readability(fig)  # issues at 700 px wide
        plots.write(fig, self.dir, name, footer)
        plt.close(fig)
        self.meta["figures"].append(f"{name}.png")

    def done(self) -> Path:
        (self.dir / "analysis.json").write_text(json.dumps(results.jsonable(self.meta, "analysis"), indent=2) + "\n")
        return self.dir






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
    if study not in studies.NAMES:
        raise ValueError(f"run {run.name} is a {study!r} run; kvlab analyse knows {', '.join(studies.NAMES)}")
    face = studies.get(study)
    bad = sorted(set(only or []) - set(face.FIGURES))
    if bad:  # before anything is written
        raise ValueError(f"--only {', '.join(bad)}: a {study} analysis draws {', '.join(face.FIGURES)}")
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
    a = face.analyse(record, tables)  # the study's own analyse and figures, as its notebook calls them
    for name, df in a.tables.items():
        o.table(df, name)
    if len(a.goals):
        o.table(a.goals, "goals")
    o.meta["findings"] += a.findings
    o.meta["values"] = a.values
    # the run.json fields the analysis adds (e.g. decomposition_totals), as its run would keep them
    o.meta.update({k: v for k, v in a.fields.items() if k not in o.meta})
    plots.style()
    for name, fig in face.figures(a).items():
        if only and name not in only:  # publishing some figures: every one is built, only these are written
            if hasattr(fig, "savefig"):
                import matplotlib.pyplot as plt

                plt.close(fig)
            continue
        o.figure(fig, name)
    where = o.done()
    if publish:
        o.publish(run, suffix, only)  # each published figure says what it replaced (kvlab.plots.publish_files)
    return where


def add_arguments(parser) -> None:
    parser.add_argument("run_dir", help="a finished run folder, e.g. data/overlap_timeline/20261130-142913-h200")
    parser.add_argument("--out", default=None, help="where to write (default: <run>/analysis/<UTC>-<commit>/)")
    parser.add_argument("--publish", action="store_true",
                        help="also put the figures in figures/<study>/ as this run's published figures")
    parser.add_argument("--suffix", default="", help="with --publish: append this to each published name, e.g. _nvlink")
    parser.add_argument("--only", default="", help="with --publish: write and publish only these figures (comma-separated names; all are built)")


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
