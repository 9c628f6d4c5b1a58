"""The published tables are what `kvlab report` makes from the committed runs (issue 12), and which runs each reads is
said once, in data/PUBLISHED.yaml (issue 25)."""

from pathlib import Path

import pytest
import yaml

from kvlab import report
from kvlab.cli import main

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"


def _documents() -> list[Path]:
    return [README, *sorted((REPO / "docs" / "results").glob("*.md"))]


def test_every_block_is_shown_once_and_every_document_matches_the_committed_runs():
    shown = []
    for doc in _documents():
        shown += [m.group(2) for m in report.BLOCK_RE.finditer(doc.read_text(encoding="utf-8"))]
        assert report.check(doc) == [], f"run `kvlab report` and commit {doc.relative_to(REPO)}"
    tables = [name for name in shown if name in report.block_names()]
    assert set(tables) == set(report.block_names()), "every table is shown, and only known ones"
    assert len(tables) == len(set(tables)), "a table is shown in one place only"
    generated = [name for name in shown if name not in report.block_names() and name != "reproduce"]
    assert len(generated) == len(set(generated)), "findings and code are shown once, each beside its table"


def test_no_document_holds_a_number_typed_by_hand():
    from kvlab import docgen

    for doc in _documents():
        assert docgen.typed_numbers(doc.read_text(encoding="utf-8")) == [], doc.relative_to(REPO)
    assert docgen.typed_numbers("the copy took 12.5 ms") == ["12.5 ms"]  # the checker does catch one
    # the confidence level passes only where it names an interval: a measured 95 % typed by hand is caught
    assert docgen.typed_numbers("met when the whole 95 % interval, a 95 %\nbootstrap one") == []
    assert docgen.typed_numbers("the send reached 95 % of the link") == ["95 %"]


def test_a_hand_edited_number_is_caught(tmp_path):
    text = README.read_text(encoding="utf-8")
    old = report.render("glance")
    assert "34.64 ms [30.33, 37.29]" in old
    edited = tmp_path / "README.md"
    edited.write_text(text.replace(old, old.replace("34.64 ms [30.33, 37.29]", "3.64 ms [3.33, 3.29]")),
                      encoding="utf-8")
    assert report.check(edited) == ["glance"]
    assert main(["report", "--check", "--readme", str(edited)]) == 1
    assert main(["report", "--readme", str(edited)]) == 0  # rewrites it from data/
    assert edited.read_text(encoding="utf-8") == text


def test_verdicts_come_from_the_one_evaluator(monkeypatch):
    """Were the evaluator to say "met" for everything, the verdict table would change."""
    from kvlab import verdicts  # the rule every goal is judged by (kvlab.goals names it too)

    real = report.render("verdicts")
    assert "**missed**" in real and "**not resolved**" in real
    monkeypatch.setattr(verdicts, "judge", lambda *a, **k: ("met", "point"))
    report._analysis.cache_clear()
    try:
        assert report.render("verdicts") != real
    finally:
        report._analysis.cache_clear()


def test_an_unknown_block_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown report block 'nope'; known: "):
        report.render("nope")


def test_the_manifest_names_each_run_a_table_reads_and_every_run_exists():
    m = yaml.safe_load((REPO / report.MANIFEST).read_text(encoding="utf-8"))
    for name, entry in m["blocks"].items():
        assert entry["runs"], name
        for run in report._runs(entry):
            assert (REPO / "data" / run / "run.json").is_file(), f"{name}: {run}"
    assert report.evidence_runs() == sorted({r for e in m["blocks"].values() for r in report._runs(e)})


def test_a_run_switched_in_the_manifest_switches_the_table(monkeypatch):
    """A block reads the runs the manifest names and no other: pointing it at another run changes the table."""
    m = report.manifest()
    entry = dict(m["blocks"]["ceilings_1gpu"], runs=["link_ceilings/20261201-091906-h200"])
    monkeypatch.setitem(m["blocks"], "ceilings_1gpu", entry)
    assert report.render("ceilings_1gpu") == report.render("ceilings_2gpu")


def test_links_to_runs_are_written_from_where_the_document_is():
    top = report.render("ceilings_1gpu")
    assert report.render("verdicts", prefix="../../").count("(../../data/") > 10
    assert "](data/" in report.render("verdicts") and top == report.render("ceilings_1gpu", prefix="")


def test_the_one_gpu_tables_read_runs_whose_code_can_be_rebuilt():
    from kvlab import provenance
    from kvlab.paths import read_json

    if report.shallow():
        pytest.skip("a shallow clone lacks the commits whose code provenance checks")
    used = [p for p in report.evidence_runs() if "-h200" in p and p.split("/")[1] >= "20261201"]
    assert {"handoff/20261201-051641-h200", "paged_transfer/20261201-052414-h200"} <= set(used)
    for p in used:
        d = REPO / "data" / p
        assert provenance.status(read_json(d / "run.json"), d)[0] in provenance.PUBLISHABLE, p


def test_a_run_is_named_with_the_probe_result_it_is_kept_in():
    data = report._data()
    assert report._run_label(data / "handoff" / "20261201-051641-h200" / "run.json") == "20261201-051641-h200"
    assert report._run_label(data / "probes" / "p" / "r1" / "run.json") == "r1"
    assert report._run_label(data / "probes" / "p" / "r1" / "ipc2" / "run.json") == "r1/ipc2"
    assert report._run_label(data / "probes" / "p" / "r1" / "runs" / "rate-1" / "run.json") == "r1/rate-1"


def test_the_tools_goals_table_has_a_row_for_every_committed_goal_check():
    import pandas as pd

    files = report._probe_goal_files()
    assert any("linkbound" in str(f) for f in files) and any("page_latency" in str(f) for f in files)
    rows = [ln for ln in report.probe_verdicts().splitlines()[2:] if ln.startswith("|")]
    assert len(rows) == sum(len(pd.read_csv(f)) for f in files)
    # what a goals.csv says is what the table says, row for row (a verdict written by hand would differ)
    said = [v for f in files for v in pd.read_csv(f)["verdict"]]
    assert [r.rsplit("|", 2)[1].strip().strip("*") for r in rows] == said
