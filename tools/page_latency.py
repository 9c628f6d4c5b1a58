"""How fast the published pages answer a reader: `python tools/page_latency.py` (needs chromium, chromedriver and
selenium, as the browser tests do).

Each page in figures/<study>/*.html is opened from disk in headless Chromium; its controls (sliders, dropdowns,
radio buttons: whatever the page binds) are read from the page itself, then moved ROUNDS times each to a random
other value, one at a time, as a reader would. Each move is timed inside the page with performance.now(), from the
control's event until the view has run and the next frame is painted (tests/test_pages_browser.py's SET). The
rounds were chosen before the first run: 240 a page puts about 12 moves in the tail the 95th percentile rests on.

Writes data/probes/page_latency/<UTC time>-<commit>/: latency.csv (page, control, value, ms, one row a move),
summary.csv (per page: moves, median and 95th percentile with their 95 % bootstrap intervals), goals.csv (the
pages goals of kvlab.goals judged per page under the one rule), meta.json (host, Chromium, commit, whether the tree
was dirty, the goals recorded before the run). A time here holds for the host it names: headless, no GPU,
software rendering.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

import browser  # noqa: E402  (tests/browser.py: Debian's chromium through Selenium)

from kvlab import goals, intervals, provenance  # noqa: E402

ROUNDS = 240
# the controls a page binds, as the page lists them: a range's bounds and step, a select's options, a radio group's
# values (vega-embed puts every binding inside .vega-bindings)
CONTROLS = """
const out = {};
for (const el of document.querySelectorAll('.vega-bindings input, .vega-bindings select')) {
  const name = el.getAttribute('name');
  if (!name) continue;
  if (el.type === 'range') out[name] = {kind: 'range', min: +el.min, max: +el.max, step: +(el.step || 1)};
  else if (el.tagName === 'SELECT') out[name] = {kind: 'select', values: Array.from(el.options).map(o => o.value)};
  else if (el.type === 'radio') (out[name] = out[name] || {kind: 'radio', values: []}).values.push(el.value);
}
return out;
"""
CURRENT = """
const name = arguments[0];
const radio = document.querySelector(`input[type=radio][name="${name}"]:checked`);
return radio ? radio.value : document.querySelector(`[name="${name}"]`).value;
"""


def _values(control: dict) -> list:
    if control["kind"] != "range":
        return list(control["values"])
    n = int(round((control["max"] - control["min"]) / control["step"]))
    return [round(control["min"] + i * control["step"], 10) for i in range(n + 1)]


def _open(driver, path: Path) -> None:
    driver.get(path.resolve().as_uri())
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        state = driver.execute_script("return document.body.dataset.ready")
        if state:
            if state != "1":
                raise SystemExit(f"page_latency: {path} did not draw: {driver.find_element('id', 'chart').text}")
            return
        time.sleep(0.05)
    raise SystemExit(f"page_latency: {path} did not draw its chart within 60 s")


def measure(driver, path: Path, rounds: int, rng: random.Random, bar) -> list[dict]:
    """`rounds` moves of each control of the page at `path`: one row a move."""
    from test_pages_browser import SET  # the browser tests' way of moving a control, timed in the page

    _open(driver, path)
    controls = driver.execute_script(CONTROLS)
    if not controls:
        raise SystemExit(f"page_latency: {path} binds no control")
    plan = [name for name in controls for _ in range(rounds)]
    rng.shuffle(plan)
    rows = []
    for name in plan:
        now = str(driver.execute_script(CURRENT, name))
        choices = [v for v in _values(controls[name]) if str(v) != now and f"{v}" != now.rstrip("0").rstrip(".")]
        value = rng.choice(choices or _values(controls[name]))
        ms = float(driver.execute_async_script(SET, name, value))
        rows.append({"page": f"{path.parent.name}/{path.name}", "control": name, "value": value, "ms": ms})
        bar.update(1)
    errors = browser.errors(driver)
    if errors:
        raise SystemExit(f"page_latency: {path} logged console errors: {errors[:3]}")
    return rows


def summarise(latency: pd.DataFrame) -> pd.DataFrame:
    out = []
    for page, g in latency.groupby("page", sort=True):
        ms = g.ms.to_numpy()
        lo, hi = intervals.median_ci(ms)
        p_lo, p_hi = intervals.quantile_ci(ms, 0.95)
        out.append({"page": page, "controls": g.control.nunique(), "moves": len(g),
                    "median_ms": float(pd.Series(ms).median()), "median_lo": lo, "median_hi": hi,
                    "p95_ms": float(pd.Series(ms).quantile(0.95)), "p95_lo": p_lo, "p95_hi": p_hi,
                    "max_ms": float(ms.max())})
    return pd.DataFrame(out)


def _chromium_version() -> str:
    exe = next((c for c in browser.CHROMIUM if subprocess.run(["which", c], capture_output=True).returncode == 0), None)
    if exe is None:
        return "?"
    return subprocess.run([exe, "--version"], capture_output=True, text=True).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/page_latency.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=ROUNDS, help=f"moves of each control a page ({ROUNDS})")
    parser.add_argument("--out", default=str(ROOT / "data" / "probes" / "page_latency"),
                        help="the folder a new result folder is made in")
    parser.add_argument("--seed", type=int, default=27)
    parser.add_argument("pages", nargs="*", help="pages to time (default: every published page, figures/*/*.html)")
    args = parser.parse_args(argv)
    if args.rounds < 9:
        parser.error(f"--rounds {args.rounds}: a median with an interval needs at least 9 moves a control")
    why = browser.missing()
    if why:
        parser.error(f"no browser to time the pages in: {why}")
    paths = [Path(p) for p in args.pages] or sorted(p for p in (ROOT / "figures").glob("*/*.html")
                                                    if p.parent.name != "vendor")
    for p in paths:
        if not p.is_file():
            parser.error(f"page {str(p)!r}: no such file; give a page kvlab wrote (figures/<study>/<name>.html)")
    state = provenance.git_state(ROOT)
    commit = str(state.get("commit") or "nogit")[:7]
    out = Path(args.out) / f"{datetime.now(timezone.utc):%Y%m%d-%H%M%S}-{commit}"
    out.mkdir(parents=True, exist_ok=False)
    meta = {"tool": "tools/page_latency.py", "started_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "host": {"machine": platform.machine(), "node_cpus": _cpus(), "python": platform.python_version(),
                     "note": "a host-bound number: headless Chromium, software rendering, on this host only"},
            "loadavg_start": list(os.getloadavg()), "chromium": _chromium_version(), "rounds_per_control": args.rounds, "seed": args.seed,
            "git": {"commit": state.get("commit"), "dirty": state.get("dirty")},
            "goals": goals.recorded("pages"), "status": "running"}
    (out / "meta.json").write_text(json.dumps(meta, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    rng = random.Random(args.seed)
    rows: list[dict] = []
    with browser.chromium() as driver:
        counts = []
        for p in paths:  # the controls of each page, to size the progress bar before anything is timed
            _open(driver, p)
            counts.append(len(driver.execute_script(CONTROLS)))
        with tqdm(total=sum(counts) * args.rounds, desc="page moves", unit="move") as bar:
            for p in paths:
                rows += measure(driver, p, args.rounds, rng, bar)
    latency = pd.DataFrame(rows)
    latency.to_csv(out / "latency.csv", index=False)
    summary = summarise(latency)
    summary.to_csv(out / "summary.csv", index=False)
    judged = goals.evaluate(goals.for_study("pages"), summary, keys=("page",))
    judged.to_csv(out / "goals.csv", index=False)
    meta.update(status="done", loadavg_end=list(os.getloadavg()), finished_utc=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    (out / "meta.json").write_text(json.dumps(meta, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    with pd.option_context("display.width", 160, "display.max_columns", 20):
        print(summary.round(2).to_string(index=False))
        print(judged[["id", "page", "value", "verdict"]].to_string(index=False))
    print(f"wrote {out}")
    return 0


def _cpus() -> int:
    return len(os.sched_getaffinity(0))


if __name__ == "__main__":
    raise SystemExit(main())
