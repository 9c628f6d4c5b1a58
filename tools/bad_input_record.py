"""Record the bad-input and fault suites' cases and outcomes for the reliability page:
`python tools/bad_input_record.py [OUT]` (from the repository root, in the venv; OUT defaults to
data/probes/bad_input/<UTC time>-<commit>). Runs the suites kvlab.reliability.SUITES names through pytest with a JUnit
report and writes OUT/cases.csv (suite, case, outcome, seconds) and OUT/meta.json (commit, host, versions, the
Hypothesis examples per parser). The page counts the newest record; a record is never overwritten."""

from __future__ import annotations

import csv
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kvlab.reliability import SUITES  # noqa: E402


def main(argv: list[str]) -> int:
    commit = subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                                capture_output=True, text=True).stdout.strip())
    out = Path(argv[0]) if argv else REPO / "data" / "probes" / "bad_input" / f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{commit}"
    out.mkdir(parents=True, exist_ok=False)  # never overwrite a record
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp, "junit.xml")
        t0 = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
                               *SUITES], cwd=REPO, stdin=subprocess.DEVNULL)
        seconds = time.monotonic() - t0
        if not report.is_file():  # pytest itself failed (a collection error): nothing to record
            out.rmdir()
            print(f"pytest wrote no report (exit {done.returncode}): nothing recorded", file=sys.stderr)
            return done.returncode or 1
        rows = []
        for case in ET.parse(report).getroot().iter("testcase"):
            parts = case.get("classname", "").split(".")  # tests.test_x (a function) or tests.test_x.TestY
            suite = f"tests/{next((q for q in parts if q.startswith('test_')), parts[-1])}.py"
            tags = {child.tag for child in case}
            outcome = ("failed" if "failure" in tags else "error" if "error" in tags else
                       "skipped" if "skipped" in tags else "passed")
            rows.append({"suite": suite, "case": case.get("name"), "outcome": outcome,
                         "seconds": round(float(case.get("time", 0)), 3)})
    with open(out / "cases.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["suite", "case", "outcome", "seconds"])
        w.writeheader()
        w.writerows(rows)
    import torch

    (out / "meta.json").write_text(json.dumps({
        "commit": commit, "dirty": dirty, "host": socket.gethostname(), "cpus": os.cpu_count(),
        "host_kind": f"{os.cpu_count()} CPU cores, no GPU" if not torch.cuda.is_available() else "with a GPU",
        "platform": platform.platform(), "python": sys.version.split()[0], "torch": torch.__version__,
        "hypothesis_examples": int(os.environ.get("HYPOTHESIS_EXAMPLES", "10000")) *
        (10 if os.environ.get("HYPOTHESIS_PROFILE") == "big" else 1),
        "pytest_exit": done.returncode, "seconds": round(seconds, 1), "suites": list(SUITES),
        "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=2) + "\n")
    print(f"{len(rows)} cases, pytest exit {done.returncode}: {out}")
    return done.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
