"""Tables that prove they are whole (issue 26): run.json records each table's sha256 beside its rows and columns, and
every reader refuses a table cut short, edited or missing in one line — never re-judging goals on half the data."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from kvlab import cli, results

DATA = Path(__file__).resolve().parent.parent / "data"


def _run(tmp_path, compress=False):
    run = results.start("toy", {}, run_dir=tmp_path / "run")
    run.save_table(pd.DataFrame({"x": range(1000), "ms": [0.5] * 1000}), "results", compress=compress)
    run.finish()
    return run


@pytest.mark.parametrize("compress", [False, True])
def test_a_table_cut_short_is_refused_by_its_hash(tmp_path, compress):
    run = _run(tmp_path, compress)
    entry = run.record["tables"]["results"]
    assert len(entry["sha256"]) == 64 and entry["rows"] == 1000
    assert len(results.load(run.dir)[1]["results"]) == 1000
    f = run.dir / entry["file"]
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(results.DamagedTable, match=f"{entry['file']}: its sha256 is .* run.json recorded"):
        results.load(run.dir)


def test_the_same_table_gives_the_same_bytes(tmp_path):
    a = _run(tmp_path / "a", compress=True)
    b = _run(tmp_path / "b", compress=True)
    assert a.record["tables"]["results"]["sha256"] == b.record["tables"]["results"]["sha256"]


def test_an_older_run_without_hashes_is_checked_on_rows_and_columns(tmp_path):
    """A run committed before tables were hashed keeps its record as it is: checked on rows and columns."""
    src = DATA / "handoff" / "20261129-103726-h200"
    dst = tmp_path / "old"
    shutil.copytree(src, dst)
    record, tables = results.load(dst)
    entry = record["tables"]["results"]
    assert "sha256" not in entry and results.verify_table(dst, "results", entry, tables["results"]) == "rows and columns"
    half = pd.read_csv(dst / "results.csv")
    half.iloc[: len(half) // 2].to_csv(dst / "results.csv", index=False)
    with pytest.raises(results.DamagedTable, match=r"results.csv: [\d,]+ rows, run.json recorded [\d,]+"):
        results.load(dst)
    assert cli.main(["analyse", str(dst), "--out", str(tmp_path / "a")]) == 2
    assert not (tmp_path / "a").exists()


def test_a_listed_table_that_is_missing_or_unreadable_is_named(tmp_path):
    run = _run(tmp_path)
    (run.dir / "results.csv").unlink()
    with pytest.raises(results.DamagedTable, match="lists table.s. results, which are not in the folder"):
        results.load(run.dir)
    run2 = _run(tmp_path / "two", compress=True)
    rec = json.loads((run2.dir / "run.json").read_text())
    del rec["tables"]["results"]["sha256"]  # as an older run's record
    (run2.dir / "run.json").write_text(json.dumps(rec))
    (run2.dir / "results.csv.gz").write_bytes(gzip.compress(b"x,ms\n1,0.5\n")[:20])
    with pytest.raises(results.DamagedTable, match="cannot be read as a table"):
        results.load(run2.dir)
