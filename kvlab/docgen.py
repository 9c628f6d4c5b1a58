"""The generated parts of the documents that are not results tables: the results at a glance, each study's
findings, how to reproduce each published run, which code measured and analysed it, and the named values that
prose quotes. `kvlab.report` renders them beside the tables; every word of them comes from data/PUBLISHED.yaml,
the runs it names and the studies' own code.

    glance                  the README's results at a glance (manifest `glance`: question, run, goal, where)
    findings_<block>        the findings of the first run a block reads, as its study's analyse wrote them
    reproduce               the exact command of every run the document's own tables read, with its commit
    code_<study>            the functions that measured and analysed the study, with their files
    <!-- kvlab-value:BLOCK.KEY -->…<!-- /kvlab-value -->   a number in prose: value KEY of the first run of BLOCK
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pandas as pd

from . import studies
from .paths import read_json, repo_root
from .study import md_table, run_link

__all__ = ["VALUE_RE", "is_generated", "render_generated", "value", "update_values", "typed_numbers",
           "SETUP_CONSTANTS"]

VALUE_RE = re.compile(r"<!-- kvlab-value:([a-z0-9_]+)\.(\S+?) -->(.*?)<!-- /kvlab-value -->", re.S)
_PREFIXES = ("findings_", "code_")


def is_generated(name: str) -> bool:
    """Is `name` one of this module's blocks (rather than a results table or a verdict block)?"""
    return name in ("glance", "reproduce") or name.startswith(_PREFIXES)


def _command(record: dict) -> str:
    """The command line run.json recorded, as a user types it: the program (kvlab, or python -m kvlab's
    __main__.py) as `kvlab`, arguments quoted where a shell needs it."""
    argv = [str(a) for a in (record.get("argv") or [])]
    if not argv:
        return "(not recorded)"
    return " ".join(["kvlab", *(a if re.fullmatch(r"[\w./:,=@+-]+", a) else repr(a) for a in argv[1:])])


def reproduce(blocks: list[str], manifest: dict, prefix: str) -> str:
    """Per run that `blocks` (the tables of one document) read: the command that made it (as its run.json recorded
    it) and its commit."""
    runs = []
    for name in blocks:
        entry = manifest["blocks"].get(name)
        for r in (entry or {}).get("runs", []):
            run = r if isinstance(r, str) else r["run"]
            if run not in runs:
                runs.append(run)
    rows = []
    for run in runs:
        rec = read_json(repo_root() / "data" / run / "run.json")
        git = rec.get("git") or {}
        commit = f"`{(git.get('commit') or '?')[:10]}`"
        if git.get("diff_file"):  # the code that ran was the commit with this difference on top (gzipped in git
            name = git["diff_file"]  # when it is large: kvlab.provenance.read_diff reads either)
            kept = name if (repo_root() / "data" / run / name).is_file() else f"{name}.gz"
            commit += f" + its [{kept}]({prefix}data/{run}/{kept})"
        rows.append({"run": run_link(run, prefix), "commit": commit, "command": f"`{_command(rec)}`"})
    diffed = any("+ its" in r["commit"] for r in rows)
    return md_table(pd.DataFrame(rows)) + (
        "\nTo rerun one: `git checkout` its commit" + (" (and `git apply` the run's diff where it names one)" if diffed
                                                         else "") +
        ", `make run` once (the venv), then its command; a run's folder holds its run.json (host, GPUs, versions, "
        "parameters) and raw tables.\n")


def code(study: str) -> str:
    """The functions of `study` that check, measure and analyse, with the file each lives in."""
    module = studies.get(study)
    rows = []
    for name in ("check", "measure", "analyse", "figures"):
        fn = getattr(module, name)
        file = Path(inspect.getsourcefile(fn)).resolve().relative_to(repo_root().resolve()).as_posix()
        doc = (inspect.getdoc(fn) or "").split("\n")[0]
        rows.append({"function": f"`{fn.__module__}.{fn.__name__}`", "file": f"`{file}`", "what it does": doc})
    for kind, fn in module.BLOCKS.items():
        doc = (inspect.getdoc(fn) or "").split("\n")[0]
        rows.append({"function": f"`{fn.__module__}.{fn.__name__}` (table `{kind}`)", "file": "", "what it does": doc})
    return md_table(pd.DataFrame(rows))


def findings(block: str, manifest: dict, analysis) -> str:
    """The findings of the first run that `block` reads, as its study's analyse wrote them."""
    entry = manifest["blocks"][block]
    first = entry["runs"][0]
    a = analysis(first if isinstance(first, str) else first["run"])
    return "\n".join(a.findings) + "\n"


def glance(manifest: dict, analysis, goals_of, prefix: str) -> str:
    """The README's results at a glance: per question of the manifest's `glance`, the answer (the goal's value with
    its interval) against its yardstick, the verdict under the one rule, and where to read more."""
    rows = []
    for q in manifest.get("glance") or []:
        g = goals_of(q["study"], q["run"])
        sel = g[g.id == q["goal"]]
        for k, v in (q.get("where") or {}).items():
            sel = sel[sel[k].astype(str) == str(v)]
        if len(sel) != 1:
            raise ValueError(f"glance {q['question']!r}: {len(sel)} goal rows match {q['goal']} {q.get('where')} in "
                             f"{q['run']}; give a 'where' that picks one")
        r = sel.iloc[0]
        value, _, yardstick = str(r.value).partition(" >= " if " >= " in str(r.value) else " <= ")
        verdict = r.verdict if r.verdict == "met" else f"**{r.verdict}**"
        rows.append({"question": q["question"], "answer [95 % interval]": value,
                     "yardstick": f"{'≥' if ' >= ' in str(r.value) else '≤'} {yardstick}", "verdict": verdict,
                     "run": run_link(q["run"], prefix), "more": f"[{Path(q['doc']).stem}]({prefix}{q['doc']})"})
    return md_table(pd.DataFrame(rows))


def render_generated(name: str, manifest: dict, analysis, goals_of, prefix: str, shown: list[str] = ()) -> str:
    """Generated block `name`; `shown`: the blocks of the document it is in (what `reproduce` lists the runs of)."""
    if name == "glance":
        return glance(manifest, analysis, goals_of, prefix)
    if name.startswith("findings_"):
        return findings(name.removeprefix("findings_"), manifest, analysis)
    if name == "reproduce":
        return reproduce(list(shown), manifest, prefix)
    if name.startswith("code_"):
        return code(name.removeprefix("code_"))
    raise ValueError(f"unknown generated block {name!r}")


def value(block: str, key: str, manifest: dict, analysis) -> str:
    """Value `key` of the first run block `block` reads (its study's analyse names it in Analysis.values)."""
    if block not in manifest["blocks"]:
        raise ValueError(f"kvlab-value {block}.{key}: no block {block!r} in the manifest")
    first = manifest["blocks"][block]["runs"][0]
    a = analysis(first if isinstance(first, str) else first["run"])
    if key not in a.values:
        raise ValueError(f"kvlab-value {block}.{key}: the analysis of {a.where} has no value {key!r}; it has "
                         f"{', '.join(sorted(a.values)) or 'none'}")
    return a.values[key]


def update_values(text: str, manifest: dict, analysis) -> tuple[str, list[str]]:
    """`text` with every value marker rewritten from data; and the markers that changed."""
    changed = []

    def sub(m):
        new = value(m.group(1), m.group(2), manifest, analysis)
        if new != m.group(3):
            changed.append(f"{m.group(1)}.{m.group(2)}")
        return f"<!-- kvlab-value:{m.group(1)}.{m.group(2)} -->{new}<!-- /kvlab-value -->"

    return VALUE_RE.sub(sub, text), changed


# ------------------------------------------------------------------------------ numbers typed by hand

# What prose may type: constants of the set-up, each with what it is. A measured number goes through a marker.
SETUP_CONSTANTS = {
    "16 KiB": "one 16-token block of one layer's K or V of the Qwen2.5-7B shape",
    "1 GiB": "the size of the largest copy in a ceiling sweep",
    "4 MiB": "the bytes a batched ceiling sample moves (kvlab.ceilings batches copies smaller than that)",
    "100 Gb/s": "a 100G NIC's line rate", "400 Gb/s": "a 400G NIC's line rate",
}
# the confidence level of every interval kvlab reports passes where it names an interval, and nowhere else (a measured
# 95 % typed by hand is still caught)
_LEVEL = re.compile(r"\b95 %(?=\s+(?:interval|bootstrap|confidence))")
_UNIT = (r"(?:ms|µs|us|ns|s|GB/s|GiB/s|MB/s|Gb/s|TB/s|GiB|MiB|KiB|GB|MB|KB|TB|%|MHz|GHz|W|TFLOP/s|×)")
_NUMBER = re.compile(r"(?<![\w.≥≤<>=~])[-+−]?\d[\d,]*(?:\.\d+)?\s?" + _UNIT + r"(?![\w/])")
_STRIP = [re.compile(p, re.S) for p in (
    r"```.*?```",                                                    # code blocks
    r"<!-- kvlab-report:[a-z0-9_]+ -->.*?<!-- /kvlab-report -->",    # generated tables
    r"<!-- kvlab-value:[^>]*-->.*?<!-- /kvlab-value -->",            # generated values
    r"<!-- source: [^>]*-->.*?<!-- /source -->",                     # figures quoted from a named source
    r"<!--.*?-->",                                                   # other comments
    r"`[^`\n]*`",                                                    # inline code
    r"\]\([^)]*\)",                                                  # link targets
)]


def typed_numbers(text: str) -> list[str]:
    """Measured-looking numbers (a number with a unit or a percent sign) in `text`'s prose that no marker made:
    outside code, generated tables and values, quotes of a named source (<!-- source: … -->…<!-- /source -->),
    and goal thresholds (a number after ≥ or ≤, which a goal declares); set-up constants (SETUP_CONSTANTS) pass."""
    for rx in _STRIP:
        text = rx.sub(" ", text)
    text = _LEVEL.sub(" ", text)
    return [m.group(0) for m in _NUMBER.finditer(text)
            if m.group(0).replace("\u202f", " ").strip() not in SETUP_CONSTANTS]
