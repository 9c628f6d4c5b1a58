"""The published tables, made from the committed runs — no number copied by hand.

A document (the README, a docs/results page) marks each generated table with a pair of comments:

    <!-- kvlab-report:NAME -->
    ...the table, as `render(NAME)` makes it...
    <!-- /kvlab-report -->

Which runs a block reads, and which study's table draws it, is said once, in data/PUBLISHED.yaml (`manifest()`):
a block is drawn by that study's BLOCKS[kind] from its analyses of those runs (kvlab.studies.analyse_run). `kvlab report` rewrites every marked block of the
documents it is given; `kvlab report --check` (a test runs it) fails when one differs from what the committed runs
give. The verdicts come from kvlab.goals, under its one rule.
"""

from __future__ import annotations

import functools
import re
import subprocess
from pathlib import Path

import pandas as pd
import yaml

from . import docgen, goals, pages, provenance, reliability, studies
from .paths import read_json, repo_root
from .study import ctx_label, host_label, md_table, run_link

__all__ = ["MANIFEST", "manifest", "block_names", "render", "update", "check", "evidence_runs", "page_files",
           "add_arguments", "run_args"]

BLOCK_RE = re.compile(r"(<!-- kvlab-report:([a-z0-9_]+) -->\n)(.*?)(<!-- /kvlab-report -->)", re.S)
MANIFEST = "data/PUBLISHED.yaml"
MODELS = "models"  # data/models/<name>/: trained weights with their training run.json, not a study's runs


def _data() -> Path:
    """The committed runs: the repository's data/ (not KVLAB_DATA, which is where new runs go)."""
    return repo_root() / "data"


@functools.lru_cache(maxsize=None)
def _manifest(path: str) -> dict:
    text = Path(path).read_text(encoding="utf-8")
    m = yaml.safe_load(text)
    if not isinstance(m, dict) or not isinstance(m.get("blocks"), dict):
        raise ValueError(f"{path}: not a manifest of published runs (a mapping with 'blocks' and 'verdicts')")
    for name, entry in m["blocks"].items():
        if not isinstance(entry, dict) or not {"study", "kind", "runs"} <= set(entry):
            raise ValueError(f"{path}: block {name!r} needs study, kind and runs")
    return m


def manifest() -> dict:
    """data/PUBLISHED.yaml: `blocks` (name → study, kind, runs), `verdicts` (study → the runs whose goals are judged)."""
    return _manifest(str(repo_root() / MANIFEST))


def _runs(entry: dict) -> list[str]:
    return [r if isinstance(r, str) else r["run"] for r in entry["runs"]]


def _labels(entry: dict) -> list[str]:
    return [("" if isinstance(r, str) else r.get("label", "")) for r in entry["runs"]]


@functools.lru_cache(maxsize=None)
def _analysis(path: str, _root: str):  # committed runs do not change: once a process
    return studies.analyse_run(_data() / path, where=path)


def analysis(path: str):
    """The analysis of committed run `path` ("study/run_id") by its study (cached: a committed run does not change)."""
    return _analysis(path, str(_data()))


def _render_block(name: str, prefix: str) -> str:
    entry = manifest()["blocks"][name]
    runs, labels = _runs(entry), _labels(entry)
    study = studies.get(entry["study"])
    fn = study.BLOCKS.get(entry["kind"])
    if fn is None:
        raise ValueError(f"{MANIFEST}: block {name}: study {entry['study']} has no table {entry['kind']!r}; it "
                         f"has {', '.join(study.BLOCKS)}")
    return fn([analysis(r) for r in runs], link=lambda p: run_link(p, prefix), labels=labels)


# ------------------------------------------------------------------------------------- the verdicts


def goals_of(study: str, path: str) -> pd.DataFrame:
    """The goal table of committed run `path` as its study judges it ("faults": a fault campaign's goals)."""
    return studies.get("disagg" if study == "faults" else study).goal_table(analysis(path), study)


def host_bound_label(record: dict) -> str:
    """'1k colocated prefill X ms' of a run: its record's host_bound, "" when it has none."""
    hb = record.get("host_bound")
    return f"1k colocated prefill {hb['colocated_prefill_ms']:.1f} ms" if hb else ""


def _with_host_bound(study: str, path: str, record: dict) -> dict:
    """`record` with its host-bound prefill rate: run.json's, or (older runs) what its study's analysis finds."""
    if record.get("host_bound") is not None:
        return record
    return {**record, "host_bound": analysis(path).fields.get("host_bound")}


def verdicts(prefix: str = "") -> str:
    """Every goal of every run in the manifest's verdicts under kvlab.goals' one rule. Goals at 1k (host-bound) name
    the host's 1k prefill time: they hold on that host, not on an H200 in general."""
    rows = []
    for study, runs in manifest()["verdicts"].items():
        for path in runs:
            record = read_json(_data() / path / "run.json")
            for r in goals_of(study, path).itertuples():
                ctx = getattr(r, "context", None)
                has_ctx = ctx is not None and ctx == ctx
                where = ", ".join(x for x in (ctx_label(ctx) if has_ctx else "",
                                              getattr(r, "destination", "") or "", getattr(r, "layout", "") or "",
                                              getattr(r, "mode", "") or "",
                                              f"policy {r.policy}" if getattr(r, "policy", "") else "") if x)
                host = host_label(record)
                if has_ctx and int(ctx) <= goals.HOST_BOUND_CONTEXT:
                    host += "; " + host_bound_label(_with_host_bound(study, path, record)) + \
                        " (host-bound: holds on this host)"
                # a goal declared after the run started is judged beside the run's own goals, and says so
                later = " (declared after this run; judged beside its goals)" if getattr(r, "later", False) else ""
                rows.append({"goal": r.goal + later, "run": run_link(path, prefix), "host": host, "where": where or "—",
                             "value [95 % interval] vs goal": r.value,
                             "verdict": f"**{r.verdict}**" if r.verdict != "met" else r.verdict})
    return md_table(pd.DataFrame(rows))


def verdict_counts(prefix: str = "") -> str:
    """How many goal checks are met, missed and not resolved, by study."""
    rows = []
    for study, runs in manifest()["verdicts"].items():
        v = pd.concat([goals_of(study, p) for p in runs]).verdict.value_counts()
        rows.append({"study": study, "runs": len(runs), "checks": int(v.sum()),
                     **{k: int(v.get(k, 0)) for k in ("met", "missed", "not resolved")}})
    return md_table(pd.DataFrame(rows))


def _committed_runs() -> list[Path]:
    """run.json of every run git tracks under data/ (a checkout's own, ignored CPU runs are not published);
    every run.json under data/ where git cannot say. A trained model's folder (data/models/) is not a run."""
    tracked = [repo_root() / p for p in _git_tracked("data/*/*/run.json") or ()
               if not p.startswith(f"data/{MODELS}/")]
    if tracked:
        return sorted(tracked)
    return sorted(p for p in _data().glob("*/*/run.json") if p.parent.parent.name != MODELS)


def _git_tracked(pattern: str) -> list[str] | None:
    """The paths git tracks that match `pattern` (git's pathspec: `*` crosses folders), relative to the
    repository; None where git cannot say."""
    try:
        done = subprocess.run(["git", "-C", str(repo_root()), "ls-files", "-z", "--", pattern],
                              capture_output=True, text=True, timeout=60, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return [p for p in done.stdout.split("\0") if p]


def evidence_runs() -> list[str]:
    """The runs ("study/run_id") that the published results tables read: every run of every block in the manifest."""
    return sorted({r for entry in manifest()["blocks"].values() for r in _runs(entry)})


def _run_label(f: Path) -> str:
    """A committed run's name in the provenance table: its folder's; for a run kept inside a probe's result folder
    (data/probes/<probe>/<result>/[runs/]<run>/), the result folder's and its own."""
    parts = f.parent.relative_to(_data()).parts  # (study, run) or (probes, probe, result, …, run)
    outer = [p for p in parts[2:-1] if p != "runs"]
    return "/".join([*outer, parts[-1]])


def provenance_table(prefix: str = "") -> str:
    """Every committed run by provenance status (kvlab.provenance): can a reader get the code that ran?"""
    rows = {}
    for f in _committed_runs():
        st = provenance.status(read_json(f), f.parent)[0]
        rows.setdefault(st, []).append(_run_label(f))
    order = ["verified", "diff", "clean", "unverified", "dirty", "mismatch", "unknown", "no commit"]
    out = [{"status": st, "code can be rebuilt": "yes" if st in provenance.PUBLISHABLE else "**no**",
            "runs": len(rows[st]), "which": ", ".join(rows[st])}
           for st in order if st in rows]
    total = sum(len(v) for v in rows.values())
    bad = sum(len(v) for st, v in rows.items() if st not in provenance.PUBLISHABLE)
    used = evidence_runs()
    cannot = [p for p in used if provenance.status(read_json(_data() / p / "run.json"), _data() / p)[0]
              not in provenance.PUBLISHABLE]
    g = goals.evaluate(goals.for_study("provenance"), pd.DataFrame([{
        "cannot_rebuild": bad, "tables_cannot_rebuild": len(cannot)}]), keys=()).set_index("id").verdict
    return (md_table(pd.DataFrame(out))
            + f"\nGoal (issue 12): every published run can be rebuilt — {bad} of {total} cannot: "
              f"**{g['provenance.every_run']}**.\n"
            + f"\nGoal beside it (2026-12-01; the one above keeps its verdict): every run that a results table in this "
              f"README reads can be rebuilt — {len(cannot)} of {len(used)} cannot: **{g['provenance.tables']}**"
            + (f" ({', '.join(p.split('/')[1] for p in cannot)}).\n" if cannot else ".\n"))


def _probe_goal_files() -> list[Path]:
    """goals.csv of every probe or tool result git tracks (data/probes/<probe>/<result>/goals.csv)."""
    tracked = _git_tracked("data/probes/*/*/goals.csv")
    if tracked is None:
        return sorted(_data().glob("probes/*/*/goals.csv"))
    return sorted(repo_root() / p for p in tracked if p.count("/") == 4)


def probe_verdicts(prefix: str = "") -> str:
    """The goals judged by tools and probes that are not a study's runs (tools/page_latency.py, fabric_speed.py,
    linkbound.py …), as each result's goals.csv recorded them: goal, result folder, host (its meta.json, or the
    device.json beside it for a lent machine), where (the row's own keys), value, verdict."""
    rows = []
    for f in _probe_goal_files():
        try:
            g = pd.read_csv(f)
        except pd.errors.EmptyDataError:
            continue
        if g.empty or "value" not in g.columns:
            continue
        meta = read_json(f.parent / "meta.json") if (f.parent / "meta.json").exists() else {}
        if (f.parent / "device.json").exists():
            host = read_json(f.parent / "device.json").get("host", "")
        else:
            h = meta.get("host", {})
            cpus = h.get("cpus", h.get("node_cpus", "?"))
            host = (f"{cpus} CPUs" + (f" ({h['node']})" if h.get("node") else "")) if h else "—"
        keys = [c for c in g.columns[2:list(g.columns).index("value")]]
        rel = f.parent.relative_to(repo_root()).as_posix()
        for r in g.itertuples(index=False):
            where = ", ".join(f"{getattr(r, k) * 1e3:,.2f} Mbit/s" if k == "rate_gbps" else
                              f"{k} {getattr(r, k):.4g}" if isinstance(getattr(r, k), float) else
                              f"{k} {getattr(r, k)}" for k in keys)
            rows.append({"goal": f"{r.id}: {r.goal}", "result": f"[{f.parent.parent.name}/{f.parent.name}]"
                         f"({prefix}{rel}/)", "host": host, "where": where or "—", "value vs goal": r.value,
                         "verdict": f"**{r.verdict}**" if r.verdict != "met" else r.verdict})
    return md_table(pd.DataFrame(rows))


# blocks about the runs rather than tables of results
META_BLOCKS = {"verdicts": verdicts, "verdict_counts": verdict_counts, "probe_verdicts": probe_verdicts,
               "provenance": provenance_table,
               "reliability_campaigns": lambda prefix: reliability.campaigns(prefix, manifest(), goals_of),
               "reliability_sigstop": reliability.sigstop, "reliability_cases": reliability.cases}
# blocks that need the commits of the runs (to check their code): a shallow clone lacks them
NEEDS_HISTORY = ("provenance",)


def block_names() -> list[str]:
    """Every block a document may show: the manifest's blocks, then META_BLOCKS (read when asked: importing this
    module reads no file)."""
    return [*manifest()["blocks"], *META_BLOCKS]


def render(name: str, prefix: str = "", shown: list[str] = ()) -> str:
    """The markdown of block `name` (a table and its trailing newline), its links to runs written as seen from a
    file whose way up to the repository is `prefix` ("" for the README, "../../" for docs/results/*.md); `shown`:
    the other blocks of that file (a `reproduce` block lists their runs)."""
    if name in META_BLOCKS:
        return META_BLOCKS[name](prefix)
    if docgen.is_generated(name):
        return docgen.render_generated(name, manifest(), analysis, goals_of, prefix, shown)
    if name not in manifest()["blocks"]:
        raise ValueError(f"unknown report block {name!r}; known: {sorted([*manifest()['blocks'], *META_BLOCKS])}")
    return _render_block(name, prefix)


def _prefix_for(path: Path) -> str:
    try:
        depth = len(Path(path).resolve().relative_to(repo_root().resolve()).parts) - 1
    except ValueError:
        depth = 0
    return "../" * depth


def update(text: str, prefix: str = "") -> tuple[str, list[str]]:
    """`text` with every marked block regenerated; and the names of the blocks that changed. ValueError when
    the markers do not pair up (a block without its end would swallow the next)."""
    starts = re.findall(r"<!-- kvlab-report:([a-z0-9_]+) -->", text)
    ends = text.count("<!-- /kvlab-report -->")
    found = [m.group(2) for m in BLOCK_RE.finditer(text)]
    if len(starts) != ends or found != starts or any("<!-- kvlab-report:" in m.group(3) for m in BLOCK_RE.finditer(text)):
        raise ValueError(f"report markers do not pair up: {len(starts)} starts ({', '.join(starts)}), {ends} "
                         "ends; each <!-- kvlab-report:NAME --> needs its own <!-- /kvlab-report --> before the next")
    changed = []

    def sub(m):
        new = render(m.group(2), prefix, found)
        if new != m.group(3):
            changed.append(m.group(2))
        return m.group(1) + new + m.group(4)

    text = BLOCK_RE.sub(sub, text)
    text, values = docgen.update_values(text, manifest(), analysis)
    return text, changed + values


def documents() -> list[Path]:
    """The documents kvlab report keeps: the README and every page under docs/results/."""
    return [repo_root() / "README.md", *sorted((repo_root() / "docs" / "results").glob("*.md"))]


def shallow() -> bool:
    """Is this checkout a shallow clone (without the commits provenance checks)?"""
    try:
        done = subprocess.run(["git", "-C", str(repo_root()), "rev-parse", "--is-shallow-repository"],
                              capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.stdout.strip() == "true"


def check(readme: str | Path | None = None) -> list[str]:
    """The names of the document's blocks that differ from what the committed runs give (empty: it matches). In a
    shallow clone the blocks of NEEDS_HISTORY are not compared: the commits they check are not there."""
    path = Path(readme) if readme is not None else repo_root() / "README.md"
    changed = update(path.read_text(encoding="utf-8"), _prefix_for(path))[1]
    return [c for c in changed if c not in NEEDS_HISTORY] if shallow() else changed


def page_files() -> dict[Path, str]:
    """The interactive pages made from several committed runs (manifest `pages`: a name, the study whose PAGES[kind]
    draws it, the runs): each page's path under figures/<study>/ and its HTML. The footer names the runs and no
    date or commit, so the same runs give the same bytes and `--check` can compare them."""
    out = {}
    for name, entry in (manifest().get("pages") or {}).items():
        study = studies.get(entry["study"])
        fn = (getattr(study, "PAGES", None) or {}).get(entry["kind"])
        if fn is None:
            raise ValueError(f"{MANIFEST}: page {name}: study {entry['study']} has no page {entry['kind']!r}")
        runs = _runs(entry)
        page = fn([analysis(r) for r in runs])
        if page.name != name:
            raise ValueError(f"{MANIFEST}: page {name}: {entry['study']}'s {entry['kind']} page is named {page.name!r}")
        folder = repo_root() / "figures" / entry["study"]
        footer = f"kvlab · made by kvlab report from the committed runs {', '.join(r.split('/')[-1] for r in runs)}"
        out[folder / f"{name}.html"] = pages.check_size(page, pages.render(page, folder, footer))
    return out


def _pages(check_only: bool) -> int:
    bad = 0
    for path, text in page_files().items():
        where = path.relative_to(repo_root())
        same = path.is_file() and path.read_text(encoding="utf-8") == text
        if check_only:
            print(f"{where}: {'matches the committed runs' if same else 'differs from what the committed runs give'}")
            bad |= not same
        elif not same:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            print(f"{where}: rewritten")
    return int(bad)


def add_arguments(parser) -> None:
    parser.add_argument("--check", action="store_true", help="only say which blocks differ; exit 1 if any")
    parser.add_argument("--readme", default=None, help="one document to read (default: the README and every page "
                                                       "of docs/results/)")


def _one(path: Path, check_only: bool) -> int:
    text = path.read_text(encoding="utf-8")
    found = [m.group(2) for m in BLOCK_RE.finditer(text)] + [f"{a}.{b}" for a, b, _ in docgen.VALUE_RE.findall(text)]
    if not found:  # nothing to compare is not a match
        raise ValueError(f"{path} has no <!-- kvlab-report:NAME --> blocks; give a document whose tables kvlab "
                         "report makes")
    new, changed = update(text, _prefix_for(path))
    typed = docgen.typed_numbers(new)
    where = path.relative_to(repo_root()) if path.is_relative_to(repo_root()) else path
    if check_only:
        if shallow():
            skipped = [c for c in changed if c in NEEDS_HISTORY]
            changed = [c for c in changed if c not in NEEDS_HISTORY]
            if skipped:
                print(f"{where}: shallow clone: not compared: {', '.join(skipped)} (it checks the runs' commits)")
        print(f"{where}: {len(found)} blocks and values; "
              f"{'differ: ' + ', '.join(changed) if changed else 'all match the committed runs'}"
              + (f"; numbers typed by hand: {'; '.join(typed[:5])}" if typed else ""))
        return 1 if changed or typed else 0
    if changed:
        path.write_text(new, encoding="utf-8")
    print(f"{where}: {len(found)} blocks and values; rewritten: {', '.join(changed) or 'none'}"
          + (f"; numbers typed by hand (write them through a marker): {'; '.join(typed[:5])}" if typed else ""))
    return 0


def run_args(args) -> int:
    docs = [Path(args.readme)] if args.readme else documents()
    status = max(_one(p, args.check) for p in docs)
    return status if args.readme else max(status, _pages(args.check))
