"""One run to a folder (issue 26): a run folder is claimed atomically before anything is written; a second run into
it is refused in one line; a killed run's folder is recognisable and its files are set aside, never mixed with a
new run's; a folder whose run.json cannot be read is never taken over."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys

import pytest

from kvlab import claims, results, runfolder


def test_a_second_run_into_a_claimed_folder_is_refused_by_name(tmp_path):
    folder = tmp_path / "run"
    first = results.start("toy", {"a": 1}, run_dir=folder)
    assert claims.held(folder)["pid"] == os.getpid()
    # another process on this host holding the claim: a live one, so the folder is refused
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        c = claims.held(folder)
        (folder / claims.CLAIM).write_text(json.dumps(dict(c, pid=holder.pid, token="theirs")))
        with pytest.raises(ValueError, match=r"--run-dir .* is being written by another run \(process \d+ on "):
            results.start("toy", {"a": 2}, run_dir=folder)
        with pytest.raises(ValueError, match="is being written by another run"):
            runfolder.check_run_folder(folder)
    finally:
        holder.kill()
        holder.wait()
    assert json.loads((folder / "run.json").read_text())["parameters"] == {"a": 1}  # nothing of the second run
    assert first.run_id == folder.name


def _claim(folder, q):
    try:
        q.put(claims.claim(folder))
    except ValueError as err:
        q.put(f"refused: {err}")


def test_of_runs_claiming_one_folder_at_once_exactly_one_gets_it(tmp_path):
    folder = tmp_path / "race"
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_claim, args=(folder, q)) for _ in range(6)]
    for p in procs:
        p.start()
    got = [q.get(timeout=30) for _ in procs]
    for p in procs:
        p.join()
    winners = [g for g in got if not g.startswith("refused")]
    # the winners' processes have exited by now, so a later claim may take a stale one over; at the moment they
    # claimed, one process held it and the rest were refused or found it stale only after the holder had exited
    assert len(winners) >= 1 and all(g.startswith("refused: --run-dir") for g in got if g.startswith("refused"))
    assert len(set(winners)) == len(winners)


def test_a_killed_run_is_recognisable_and_its_files_are_set_aside_not_mixed(tmp_path):
    folder = tmp_path / "killed"
    code = ("import os, sys; from kvlab import results; r = results.start('toy', {'a': 1}, run_dir=sys.argv[1]); "
            "r.save_table(__import__('pandas').DataFrame({'x': [1, 2]})); os.kill(os.getpid(), 9)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(p) for p in sys.path if p]))
    done = subprocess.run([sys.executable, "-c", code, str(folder)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == -9
    record = json.loads((folder / "run.json").read_text())
    assert record["status"] == "running" and not claims.alive(claims.held(folder))
    assert runfolder.run_state(folder) == "killed"
    run = results.start("toy", {"a": 2}, run_dir=folder)  # the folder may be used again: the old attempt moves aside
    aside = [p for p in folder.iterdir() if p.name.startswith("stopped-")]
    assert len(aside) == 1 and {"run.json", "results.csv", claims.CLAIM, runfolder.STOPPED} <= {p.name for p in aside[0].iterdir()}
    assert "killed" in (aside[0] / runfolder.STOPPED).read_text()
    assert not (folder / "results.csv").exists() and run.record["parameters"] == {"a": 2}


@pytest.mark.parametrize("content", ['{"status": "fini', "[1, 2]", "\x00\x01binary"])
def test_a_folder_whose_run_json_cannot_be_read_is_never_taken_over(tmp_path, content):
    folder = tmp_path / "bad"
    folder.mkdir()
    (folder / "run.json").write_text(content)
    (folder / "results.csv").write_text("x\n1\n")
    with pytest.raises(ValueError, match="holds a run.json that cannot be read as a run's record"):
        results.start("toy", {}, run_dir=folder)
    assert (folder / "run.json").read_text() == content and not (folder / claims.CLAIM).exists()
