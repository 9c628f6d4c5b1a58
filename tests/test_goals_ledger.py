"""Goals travel with their run (issue 25, item 6): the ledger holds what a goal may never change, GOALS is held to
the ledger and the ledger to its own history, a run records the goals in force when it started and is judged by
those, and a goal declared later is judged beside them, never instead."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pandas as pd
import pytest

from kvlab import goals as G
from kvlab import results

REPO = Path(__file__).resolve().parent.parent
LEDGER = "kvlab/goals_ledger.json"


def test_every_goal_is_in_the_ledger_as_declared_and_no_goal_ever_leaves_it():
    book = G.ledger()
    assert set(G.GOALS) <= set(book), f"goals missing from the ledger: {sorted(set(G.GOALS) - set(book))}"
    assert set(book) <= set(G.GOALS), f"a goal left GOALS (its verdicts would go with it): {sorted(set(book) - set(G.GOALS))}"
    for gid, goal in G.GOALS.items():
        entry = book[gid]
        assert {k: entry[k] for k in G.FIXED} == G.fixed(goal), (
            f"goal {gid} changed its {', '.join(k for k in G.FIXED if entry[k] != getattr(goal, k))}: a changed goal "
            "is a new goal with a new id, declared beside the old one")
        assert len(entry["in_force_from"]) == 10 and entry["first_commit"]


def _git(*args) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=60, check=False)


def test_no_ledger_entry_changed_since_the_commit_that_added_it():
    """GOALS and the ledger edited together would pass the test above: each entry is held to the ledger as it was
    committed when the entry first appeared in it (an entry not yet committed has nothing to be held to)."""
    if _git("rev-parse", "--is-shallow-repository").stdout.strip() != "false":
        pytest.skip("needs the repository's history (not a shallow clone)")
    book = G.ledger()
    for gid, entry in book.items():
        added = _git("log", "--reverse", "--format=%H", "-S", f'"{gid}": {{', "--", LEDGER).stdout.split()
        if not added:
            continue  # declared in this change, not yet committed
        then = json.loads(_git("show", f"{added[0]}:{LEDGER}").stdout)[gid]
        assert {k: then[k] for k in G.FIXED} == {k: entry[k] for k in G.FIXED}, (
            f"ledger entry {gid} changed since {added[0][:10]}, which added it")
        assert then["in_force_from"] == entry["in_force_from"], f"{gid}: in_force_from changed since {added[0][:10]}"


def test_a_run_records_the_goals_in_force_and_is_judged_by_them(kvlab_dirs):
    run = results.start("handoff", {"x": 1})
    rec = run.record["goals"]
    assert [r["id"] for r in rec] == [g.id for g in G.for_study("handoff")]
    assert all({k: r[k] for k in G.FIXED} == G.fixed(G.GOALS[r["id"]]) for r in rec)
    now, later = G.for_run("handoff", run.record)
    assert [g.id for g in now] == [r["id"] for r in rec] and later == []
    # a run that recorded fewer goals (one was declared after it started) has the newer one judged beside
    old = dict(run.record, goals=rec[:2])
    now, later = G.for_run("handoff", old)
    assert [g.id for g in now] == [r["id"] for r in rec[:2]] and [g.id for g in later] == [r["id"] for r in rec[2:]]
    # a run.json whose recorded goal was edited is refused by name
    bent = dict(run.record, goals=[dict(rec[0], threshold=1.0)])
    with pytest.raises(ValueError, match=f"goal {rec[0]['id']} as recorded .* differs from its declaration"):
        G.for_run("handoff", bent)
    assert [r["id"] for r in results.start("disagg", {}).record["goals"]] == [
        g.id for g in (*G.for_study("disagg"), *G.for_study("faults"))]


def test_a_run_from_before_goals_were_recorded_is_judged_by_the_ledger_of_its_day():
    before = {"started_utc": "2026-11-29T10:37:26Z"}  # a handoff run of issue 3's day, before issue 14's goals
    now, later = G.for_run("handoff", before)
    assert {g.id for g in later} == {"handoff.peer_ttft_extra", "handoff.peer_exposed", "handoff.peer_bulk"}
    assert "handoff.bulk_link" in {g.id for g in now}
    table = pd.DataFrame([dict(context=32768, destination="peer-cuda:1", copy_pct_ceiling=99.0, copy_pct_ceiling_lo=98.5,
                               copy_pct_ceiling_hi=99.5)])
    out = G.evaluate_run("handoff", before, table).set_index("id")
    assert out.loc["handoff.bulk_link", "later"] == False  # noqa: E712
    assert out.loc["handoff.peer_bulk", "later"] == True and out.loc["handoff.peer_bulk", "verdict"] == "met"  # noqa: E712
