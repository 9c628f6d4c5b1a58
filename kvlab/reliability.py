"""The reliability page's tables (docs/results/reliability.md), each read from what is committed: the fault
campaigns the published blocks name (their goal verdicts), the SIGSTOP probe's rows (data/probes/sigstop/), and the
record of the bad-input suites' cases and outcomes (data/probes/bad_input/, written by tools/bad_input_record.py).

    campaigns(prefix)   one row per fault campaign: backend, host, faults, partial decodes, unhandled, slowest
                        decision's excess over its deadlines, and the verdict of each fault goal
    sigstop(prefix)     per probe run, load and stopped role: trials, the deadline, when the launcher said why and
                        when it had exited (median, max), the worst excess over the deadline
    cases(prefix)       per suite of the newest record: what it covers, cases, passed, failed, skipped
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from .paths import read_json, repo_root
from .study import host_label, md_table, run_link

__all__ = ["loads", "campaigns", "sigstop", "sigstop_rows", "cases", "SUITES"]

# what each suite of the bad-input record covers (the record names the files; this says what they are for)
SUITES = {
    "tests/test_bad_input.py": "bad input refused in one line before anything is written (both campaigns' cases)",
    "tests/test_parsers_hypothesis.py": "parsers that are total: generated input gives a value or kvlab's one-line error",
    "tests/test_claims.py": "one run to a folder: claimed atomically, never taken over, a killed run recognised",
    "tests/test_tables.py": "tables that prove they are whole: rows, columns and sha256 checked by every reader",
    "tests/test_control_channel.py": "the control channel: signed values, no pickle, loopback, a third process forging",
    "tests/test_untried_faults.py": "SIGSTOP of either side, the run folder removed, a full disk, a microsecond deadline",
}


def _probes(name: str) -> list[Path]:
    return sorted(p for p in (repo_root() / "data" / "probes" / name).glob("*") if p.is_dir())


def loads() -> dict[str, int]:
    """Run id → busy-looping processes beside it, for the campaigns run under load (data/probes/loaded_faults/)."""
    out = {}
    for folder in _probes("loaded_faults"):
        if (folder / "meta.json").is_file():
            meta = read_json(folder / "meta.json")
            out.update({run: int(meta.get("busy_processes", 0)) for run in meta.get("runs", [])})
    return out


def campaigns(prefix: str, manifest: dict, goals_of) -> str:
    """The published fault campaigns, one row each, with their goals' verdicts (kvlab.report passes its manifest and
    its goal reader); a campaign run under load says how many busy processes ran beside it."""
    rows = []
    busy = loads()
    for name, entry in manifest["blocks"].items():
        if entry["kind"] != "faults":
            continue
        for r in entry["runs"]:
            path = r if isinstance(r, str) else r["run"]
            rec = read_json(repo_root() / "data" / path / "run.json")
            s = rec.get("summary") or {}
            g = goals_of("faults", path).set_index("id")
            verdict = lambda gid: g.loc[gid, "verdict"] if gid in g.index else "—"  # noqa: E731
            rows.append({"run": run_link(path, prefix), "block": name, "backend": s.get("backend", "?"),
                         "host": host_label(rec) + (f", {busy[rec['run_id']]} busy processes beside it"
                                                    if rec.get("run_id") in busy else ", load not recorded"),
                         "policy": s.get("policy", "?"),
                         "faults": s.get("faults_injected", 0), "kinds": ", ".join(sorted(s.get("outcomes_by_kind") or {})),
                         "partial decodes": s.get("decoded_from_partial"),
                         "slowest over its deadlines": g.loc["faults.deadline", "value"] if "faults.deadline" in g.index else "—",
                         "verdicts (count, partial, handled, deadline)": " · ".join(
                             verdict(k) for k in ("faults.count", "faults.no_partial_decode", "faults.handled",
                                                  "faults.deadline"))})
    return md_table(pd.DataFrame(rows))


def sigstop_rows() -> pd.DataFrame:
    """Every committed SIGSTOP probe row, with its run's folder name and host (meta.json)."""
    frames = []
    for folder in _probes("sigstop"):
        if not (folder / "results.csv").is_file():
            continue
        meta = read_json(folder / "meta.json")
        t = pd.read_csv(folder / "results.csv")
        t.insert(0, "probe", folder.name)
        t["cpus"], t["backend"] = meta.get("cpus"), meta.get("backend")
        t["code"] = f"`{str(meta.get('commit', '?'))[:10]}`" + ("" if meta.get("dirty") is False else " + changes")
        frames.append(t)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def sigstop(prefix: str = "") -> str:
    t = sigstop_rows()
    if t.empty:
        return "(no SIGSTOP probe is committed)\n"
    rows = []
    for (probe, load, role), g in t.groupby(["probe", "load", "role"], sort=False):
        rows.append({"probe": f"[{probe}]({prefix}data/probes/sigstop/{probe}/)", "code": g["code"].iloc[0],
                     "backend": g["backend"].iloc[0],
                     "cores": int(g["cpus"].iloc[0]), "load": f"{load} ({int(g['busy_processes'].iloc[0])} busy)",
                     "stopped": role, "trials": len(g), "deadline s": float(g["deadline_s"].iloc[0]),
                     "said why, median s": round(float(g["said_s"].median()), 2),
                     "said why, max s": round(float(g["said_s"].max()), 2),
                     "exited, max s": round(float(g["ended_s"].max()), 2),
                     "worst over the deadline s": round(float(g["said_over_s"].max()), 2),
                     "within deadline + 1 s": f"{int((g['said_over_s'] <= 1.0).sum())} of {len(g)}",
                     "named as stopped": f"{int(g['named_stopped'].sum())} of {len(g)}"})
    return md_table(pd.DataFrame(rows))


def cases(prefix: str = "") -> str:
    records = [p for p in _probes("bad_input") if (p / "cases.csv").is_file()]
    if not records:
        return "(no record of the bad-input suites is committed)\n"
    folder = records[-1]
    meta = read_json(folder / "meta.json")
    t = pd.read_csv(folder / "cases.csv")
    rows = []
    for suite, g in t.groupby("suite", sort=False):
        n = g["outcome"].value_counts()
        rows.append({"suite": f"`{suite}`", "covers": SUITES.get(suite, ""), "cases": len(g),
                     "passed": int(n.get("passed", 0)), "failed": int(n.get("failed", 0) + n.get("error", 0)),
                     "skipped": int(n.get("skipped", 0))})
    code = f"commit `{meta.get('commit', '?')[:10]}`" + (" with uncommitted changes" if meta.get("dirty", True) else "")
    head = (f"Record [{folder.name}]({prefix}data/probes/bad_input/{folder.name}/): {code}, {meta.get('host_kind', '?')}, "
            f"Hypothesis examples per parser: {meta.get('hypothesis_examples', '?')}, pytest's exit code "
            f"{meta.get('pytest_exit', '?')}.\n\n")
    return head + md_table(pd.DataFrame(rows))

