"""Does papermill stall on a reply that has already arrived, and does kvlab.nbexec's sliced wait stop it?

Run from the repository root:  python3 data/probes/notebook_stalls/<run>/probe.py OUT [N]
It keeps both cores busy (two spinning processes, as a loaded 2-core CI machine is) and runs, under pytest, 2·N
executions of the calculator notebook with the tests' small parameters, alternating plain papermill and
kvlab.nbexec (plain first), each with a 60-s cell timeout. A run that takes more than 50 s stalled: a stall
ends when the timeout fires and pyzmq's poll looks once more. Writes OUT/results.csv (i, variant, seconds,
stalled) and prints the count per variant.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path.cwd()
N = int(os.environ.get("PROBE_N", "20"))
TIMEOUT_S = 60


@pytest.mark.parametrize("i", range(2 * N))
def test_execute(i, tmp_path, monkeypatch):
    import papermill

    from kvlab import nbexec

    variant = "sliced" if i % 2 else "plain"
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.setenv("KVLAB_DATA", str(tmp_path / "d"))
    monkeypatch.setenv("KVLAB_FIGURES", str(tmp_path / "f"))
    run = nbexec.execute_notebook if variant == "sliced" else papermill.execute_notebook
    t0 = time.monotonic()
    run(str(REPO / "notebooks" / "00_calculator.ipynb"), str(tmp_path / "out.ipynb"), kernel_name="python3",
        cwd=str(REPO), progress_bar=False, execution_timeout=TIMEOUT_S,
        parameters={"run_dir": str(tmp_path / "run"), "models": ["llama-2-7b", "gemma-2-9b"], "prompt_tokens": 2048,
                    "ratio_models": ["llama-3.1-8b"], "ratio_links": ["100G"], "ratio_max_tokens": 1024,
                    "tp_max": 4, "tp_models": ["qwen2.5-7b"], "links": ["100G", "50GB/s"],
                    "exposure_cases": ["llama-2-7b:bf16", "llama-3.1-8b:fp8"]})
    took = time.monotonic() - t0
    with open(os.environ["PROBE_OUT"] + "/results.csv", "a") as f:
        f.write(f"{i},{variant},{took:.2f},{took > 50}\n")


if __name__ == "__main__":
    out = Path(sys.argv[1]).resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.csv").write_text("i,variant,seconds,stalled\n")
    env = {**os.environ, "PROBE_OUT": str(out), "PROBE_N": sys.argv[2] if len(sys.argv) > 2 else "20"}
    spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "timeout=0",
                        "--rootdir", str(Path(__file__).parent), __file__], env=env, stdin=subprocess.DEVNULL)
    finally:
        for p in spin:
            p.kill()
    import csv

    rows = list(csv.DictReader(open(out / "results.csv")))
    for v in ("plain", "sliced"):
        mine = [r for r in rows if r["variant"] == v]
        print(f"{v}: {sum(r['stalled'] == 'True' for r in mine)} of {len(mine)} stalled; longest "
              f"{max(float(r['seconds']) for r in mine):.1f} s")
