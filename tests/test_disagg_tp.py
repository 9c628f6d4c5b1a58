"""Different TP on each side across processes (`kvlab disagg --prefill-tp P --decode-tp D`, issue 28): its CPU
contract over gloo for (2, 1), (1, 2) and (1, 4), what each decode rank received, and the refusals."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from conftest import cpu_env as _env
from conftest import kvlab_command
from kvlab import calculator, models, studies


@pytest.mark.parametrize("p, d", [(2, 1), (1, 2), (1, 4)])
def test_issue_28s_cpu_contract(p, d, tmp_path):
    out = tmp_path / "run"
    done = kvlab_command(["disagg", "--backend", "gloo", "--model", "kvlab-tiny", "--kv-dtype", "float32", "--context",
                          "128", "--prefill-tp", str(p), "--decode-tp", str(d), "--out", str(out)], _env(tmp_path))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert (s["prefill_tp"], s["decode_tp"], s["processes"]) == (p, d, p + d)
    assert s["tokens_match"] and s["first_token_match"] and s["logits_within_tolerance"] and s["passed"]
    assert s["shards_exact"] and s["poison_left"] == 0 and "reduction-order" in s["tolerance_rule"]
    spec = models.get("kvlab-tiny")  # 2 KV heads
    cache = calculator.kv_cache_bytes(spec, 128, "float32")
    per_rank = cache // min(d, spec.kv_heads)  # D ≤ 2: a share of the heads; D = 4: one head each
    assert s["bytes_per_decode_rank"] == [per_rank] * d == s["calculated_bytes_per_decode_rank"]
    replicas = max(d - spec.kv_heads, 0)  # two ranks per head at D = 4: the second of each pair is a replica
    assert sum(1 for b in s["replica_bytes"] if b) == replicas
    assert sum(s["bytes_per_decode_rank"]) - sum(s["replica_bytes"]) == cache  # each head lands once, replicas aside
    assert s["pieces_per_decode_rank"] == [max(p // d, 1)] * d  # P > D: a piece from each of its P/D prefill ranks
    # one rank: no split; more ranks than KV heads: kvlab's own; else transformers' plan where the installed
    # transformers can apply it to a built model (5.2x), kvlab's where it cannot (5.17)
    assert s["impl"] in (("none",) if d == 1 else ("kvlab",) if d > spec.kv_heads else ("transformers", "kvlab"))
    ranks = pd.read_csv(out / "ranks.csv")
    assert sorted(ranks["role"].tolist()) == ["decode"] * d + ["prefill"] * p
    assert ranks.loc[ranks.role == "prefill", "bytes_sent"].sum() == sum(s["bytes_per_decode_rank"])
    record = json.loads((out / "run.json").read_text())
    assert record["status"] == "finished" and record["summary"]["passed"]
    a = studies.analyse_run(out)  # kvlab analyse reads it back: the ranks and one finding
    assert "ranks" in a.tables and any(f.startswith(f"TP {p} → {d}") for f in a.findings)


@pytest.mark.parametrize("argv, says", [
    (["--decode-tp", "3"], "decode_tp=3 does not split kvlab-tiny's 4 query heads"),
    (["--prefill-tp", "2", "--decode-tp", "4", "--layout", "paged"], "leave out or change --layout"),
    (["--decode-tp", "2", "--mode", "layerwise"], "leave out or change --mode"),
    (["--decode-tp", "2", "--faults", "2"], "leave out or change --faults"),
    (["--decode-tp", "2", "--model", "llama-3.1-70b"], "more than this machine holds"),
    (["--decode-tp", "0"], "decode-tp = 0: give an int ≥ 1"),
    (["--decode-tp", "2", "--kv-dtype", "bf16"], "give --kv-dtype float32"),
    (["--decode-tp", "2", "--repeats", "5"], "leave out or change --repeats"),
    (["--decode-tp", "2", "--weights", "/nonexistent/ckpt"], "weights"),
])
def test_bad_tp_input_is_one_line_before_anything_is_written(argv, says, tmp_path):
    done = kvlab_command(["disagg", "--kv-dtype", "float32", *argv, "--out", str(tmp_path / "run")], _env(tmp_path))
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert done.returncode == 2 and len(lines) == 1 and says in lines[0], done.stderr
    assert not (tmp_path / "run").exists()


def test_a_rank_that_fails_is_one_line_and_the_folder_says_it_stopped(tmp_path, monkeypatch):
    from kvlab import disagg, runfolder
    from kvlab.disagg import tp_handoff

    def broken(job, d, group):
        raise RuntimeError(f"decode rank {d} broke on purpose")

    monkeypatch.setattr(tp_handoff, "_decode_rank", broken)  # the forked ranks inherit it
    cfg = disagg.DisaggConfig(model="kvlab-tiny", kv_dtype="float32", decode_tp=2, timeout_s=30)
    # the decode ranks fail first; the prefill rank's later error (its peers are gone) is an echo, not the cause
    with pytest.raises(disagg.DisaggError, match=r"TP 1 → 2: decode rank [01] failed first: RuntimeError: decode "
                                                 r"rank [01] broke on purpose") as err:
        disagg.run(cfg, tmp_path / "run")
    assert "\n" not in str(err.value)
    assert (tmp_path / "run" / runfolder.STOPPED).exists()
    assert json.loads((tmp_path / "run" / "run.json").read_text())["status"] != "finished"
