"""The README's result tables are what `kvlab report` makes from the committed runs (issue 12)."""

from pathlib import Path

import pytest

from kvlab import report
from kvlab.cli import main

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_readme_matches_what_the_committed_runs_give():
    names = [m.group(2) for m in report._BLOCK_RE.finditer(README.read_text(encoding="utf-8"))]
    assert set(names) == set(report.BLOCKS), "every block is in the README once, and only known blocks"
    assert len(names) == len(set(names))
    assert report.check(README) == [], "run `kvlab report` and commit the README"


def test_a_hand_edited_number_is_caught(tmp_path):
    text = README.read_text(encoding="utf-8")
    old = report.render("handoff_2gpu")
    assert "+34.64 [+30.33, +37.29]" in old
    edited = tmp_path / "README.md"
    edited.write_text(text.replace(old, old.replace("+34.64 [+30.33, +37.29]", "+3.64 [+3.33, +3.29]")),
                      encoding="utf-8")
    assert report.check(edited) == ["handoff_2gpu"]
    assert main(["report", "--check", "--readme", str(edited)]) == 1
    assert main(["report", "--readme", str(edited)]) == 0  # rewrites it from data/
    assert edited.read_text(encoding="utf-8") == text


def test_verdicts_come_from_the_one_evaluator(monkeypatch):
    """Were the evaluator to say "met" for everything, the README's verdict table would change."""
    from kvlab import goals

    real = report.render("verdicts")
    assert "**missed**" in real and "**not resolved**" in real
    monkeypatch.setattr(goals, "judge", lambda *a, **k: ("met", "point"))
    assert report.render("verdicts") != real


def test_an_unknown_block_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown report block 'nope'; known: "):
        report.render("nope")


def test_evidence_runs_are_the_runs_the_tables_read(monkeypatch):
    """The second provenance goal judges the runs the results tables read; the list comes from rendering them, so a
    table switched to another run changes it, and the blocks about runs (verdicts, provenance) are not rendered."""
    def boom():
        raise AssertionError("a block about the runs was rendered")

    monkeypatch.setattr(report, "BLOCKS", {
        "one": lambda: report.ceilings("link_ceilings/20261201-051613-h200"),
        "two": lambda: report.handoff_table("handoff/20261201-051641-h200"),
        "again": lambda: report.handoff_table("handoff/20261201-051641-h200"),  # cached summary: still noted
        **{name: boom for name in report.META_BLOCKS}})
    assert report.evidence_runs() == ["handoff/20261201-051641-h200", "link_ceilings/20261201-051613-h200"]
    assert report._READ is None  # reading is noted only while evidence_runs() renders
    monkeypatch.setitem(report.BLOCKS, "one", lambda: report.ceilings("link_ceilings/20261129-091839-h200"))
    assert "link_ceilings/20261129-091839-h200" in report.evidence_runs()


def test_the_one_gpu_tables_read_runs_whose_code_can_be_rebuilt():
    from kvlab import provenance

    if report._shallow():
        pytest.skip("a shallow clone lacks the commits whose code provenance checks")
    used = [p for p in report.evidence_runs() if "-h200" in p and p.split("/")[1] >= "20261201"]
    assert {"handoff/20261201-051641-h200", "paged_transfer/20261201-052414-h200"} <= set(used)
    for p in used:
        record, d = report._run(p)
        assert provenance.status(record, d)[0] in provenance.PUBLISHABLE, p
