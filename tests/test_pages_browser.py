"""The interactive pages in a real browser (headless Chromium, tests/browser.py): each page written as its study
writes it, opened from disk with no network, its controls moved through the page, the numbers it then shows read back
from the page and compared with kvlab's own for the same inputs; no console errors; a screenshot of each page kept
under $KVLAB_TEST_ARTIFACTS (default: pytest's tmp folder). Skipped, with the reason, where there is no Chromium."""

from __future__ import annotations

import math
import os
import random
import re
import time
from pathlib import Path

import pytest

import browser
from kvlab import calculator, intervals, models, pages, units
from kvlab.studies.calculator import page as calc_page

# where a browser is required (CI sets KVLAB_REQUIRE_BROWSER=1, after installing one), its absence fails each of these
# tests instead of skipping it, so a failed install cannot pass unnoticed — and every other test still runs
REQUIRED = os.environ.get("KVLAB_REQUIRE_BROWSER") == "1"
pytestmark = pytest.mark.skipif(browser.missing() is not None and not REQUIRED,
                                reason=f"browser tests: {browser.missing()}")


@pytest.fixture(autouse=True)
def _a_browser_is_there():
    if browser.missing() is not None:  # only reached where one is required (else the mark skipped the test)
        pytest.fail(f"KVLAB_REQUIRE_BROWSER=1 but the browser tests cannot run: {browser.missing()}")

# set one control as a reader would (a range's input event, a select's or a radio's change), then wait until the
# view has run and the browser has painted; returns the milliseconds that took
SET = """
const [name, value, done] = arguments;
const t0 = performance.now();
const radio = document.querySelector(`input[type=radio][name="${name}"][value="${value}"]`);
if (radio) { radio.click(); }
else {
  const el = document.querySelector(`[name="${name}"]`);
  el.value = String(value);
  el.dispatchEvent(new Event(el.tagName === "SELECT" ? "change" : "input", {bubbles: true}));
}
window.kvlabView.runAsync().then(() => requestAnimationFrame(() => done(performance.now() - t0)));
"""
TEXTS = "return Array.from(document.querySelectorAll('#chart svg text')).map(t => t.textContent)"
# the same, a text's lines (tspans) joined by a line break
LINES = ("return Array.from(document.querySelectorAll('#chart svg text')).map(t => t.querySelector('tspan') ? "
         "Array.from(t.querySelectorAll('tspan')).map(s => s.textContent).join('\\n') : t.textContent)")


def _artifacts(tmp_path) -> Path:
    out = Path(os.environ.get("KVLAB_TEST_ARTIFACTS", tmp_path))
    out.mkdir(parents=True, exist_ok=True)
    return out


def _open(driver, path: Path) -> None:
    driver.get(path.resolve().as_uri())
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        state = driver.execute_script("return document.body.dataset.ready")
        if state:
            assert state == "1", driver.find_element("id", "chart").text
            return
        time.sleep(0.05)
    raise AssertionError(f"{path.name} did not draw its chart within 30 s")


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def _readout(driver) -> dict:
    """The calculator page's readout lines, parsed."""
    lines = [t for t in driver.execute_script(TEXTS) if t]
    out = {"lines": lines}
    for line in lines:
        for key, pattern in (("tokens", r"^Prompt: ([\d,]+) tokens$"), ("kv_bytes", r"^KV cache: ([\d,]+) bytes"),
                             ("state_bytes", r"^Recurrent state \(a hybrid's other layers\): ([\d,]+) bytes"),
                             ("gpu_bytes", r"^Sent by each GPU: ([\d,]+) bytes"), ("prefill_ms", r"^Prefill: ([\d,.e+-]+) ms$"),
                             ("bulk_ms", r"^Whole cache sent after prefill: ([\d,.e+-]+) ms$"),
                             ("ratio", r"^Transfer ÷ prefill compute: ([\d,.e+-]+)$"),
                             ("exposed_ms", r"^Layer by layer, exposed after prefill: ([\d,.e+-]+) ms$")):
            m = re.match(pattern, line)
            if m:
                out[key] = _number(m.group(1))
        out["link_bound"] = any(x.startswith("The link falls behind") for x in lines) or (
            False if any(x.startswith("The link keeps up") for x in lines) else None)
        out["refused"] = any("does not split" in x for x in lines)
        out["heads_note"] = any("engines refuse this TP" in x for x in lines)
    return out


def _close(shown: float, expected: float, what: str, inputs) -> None:
    # the page prints five significant digits
    assert abs(shown - expected) <= 6e-5 * abs(expected) + 1e-12, f"{what}: page {shown}, kvlab {expected} at {inputs}"


def _check(shown: dict, model: str, tokens: int, dtype: str, link: str, tp: int, tflops: float) -> None:
    inputs = (model, tokens, dtype, link, tp, tflops)
    assert shown["tokens"] == tokens, inputs
    assert shown["kv_bytes"] == calculator.kv_cache_bytes(model, tokens, dtype), inputs
    assert shown.get("state_bytes", 0) == calculator.recurrent_state_bytes(model), inputs
    try:
        e = calculator.handoff_estimate(model, tokens, link, dtype, tp=tp, tflops=tflops)
    except ValueError as err:
        assert "does not split" in str(err) and shown["refused"], (inputs, shown["lines"])
        return
    assert not shown["refused"], (inputs, shown["lines"])
    assert shown["gpu_bytes"] == round(e.kv_bytes_per_gpu + e.state_bytes / tp), inputs
    _close(shown["prefill_ms"], e.prefill_s * 1e3, "prefill", inputs)
    _close(shown["bulk_ms"], e.transfer_s * 1e3, "bulk", inputs)
    _close(shown["ratio"], e.ratio, "ratio", inputs)
    _close(shown["exposed_ms"], e.exposed_s * 1e3, "exposed", inputs)
    assert shown["link_bound"] == e.link_bound, (inputs, shown["lines"])
    assert shown["heads_note"] == (not e.shard.query_heads_split), (inputs, shown["lines"])


def test_calculator_page_shows_kvlabs_numbers_for_every_input_it_is_given(tmp_path):
    path = pages.write(calc_page.page(), tmp_path, "kvlab · test page")
    combos = []
    rng = random.Random(27)
    names = models.names()
    for i in range(240):  # every model and link several times, TP and dtype in every pairing, the slider's whole range
        combos.append((names[i % len(names)], rng.randrange(28, 69) / 4, rng.choice(["bf16", "fp8"]),
                       list(calculator.LINKS)[i % len(calculator.LINKS)], rng.choice(calc_page.TP_CHOICES),
                       float(rng.randrange(5, 101) * 10)))
    with browser.chromium() as d:
        _open(d, path)
        assert browser.errors(d) == []
        # the page's first state is the seed's example: Llama 2 7B, 8k tokens, bf16, 100G
        _check(_readout(d), "llama-2-7b", 8192, "bf16", "100G", 1, 400.0)
        # a dropdown and the slider moved as a reader would: Selenium's own select, arrow keys on the range
        from selenium.webdriver.common.keys import Keys
        from selenium.webdriver.support.ui import Select

        Select(d.find_element("css selector", "select[name=model]")).select_by_value("llama-3.1-8b")
        slider = d.find_element("css selector", "input[name=log2_tokens]")
        slider.send_keys(Keys.ARROW_RIGHT, Keys.ARROW_RIGHT, Keys.ARROW_RIGHT, Keys.ARROW_RIGHT)  # 2^13 → 2^14
        d.execute_async_script("window.kvlabView.runAsync().then(() => arguments[0]())")
        _check(_readout(d), "llama-3.1-8b", 16384, "bf16", "100G", 1, 400.0)
        d.save_screenshot(str(_artifacts(tmp_path) / "calculator_page.png"))
        # how fast the page answers is a benchmark (tools/page_latency.py records it with its goals), not a test
        for model, log2, dtype, link, tp, tflops in combos:
            for name, value in (("model", model), ("log2_tokens", log2), ("kv_dtype", dtype), ("link", link),
                                ("tp", tp), ("tflops", tflops)):
                d.execute_async_script(SET, name, value)
            _check(_readout(d), model, round(2 ** log2), dtype, link, tp, tflops)
        assert browser.errors(d) == []


def test_calculator_page_weighs_little_and_reaches_nothing_outside_the_disk(tmp_path):
    path = pages.write(calc_page.page(), tmp_path, "kvlab · test page")
    text = path.read_text(encoding="utf-8")
    assert len(text.encode()) <= pages.PAGE_BYTES
    assert not re.search(r"(src|href)=\"(https?:)?//", text), "a page loads nothing from the network"
    with browser.chromium() as d:
        _open(d, path)
        urls = d.execute_script("return Array.from(document.querySelectorAll('[src], [href]'))"
                                ".map(e => e.src || e.href)")
        assert len(urls) == len(pages.LIBRARY) and all(u.startswith("file://") for u in urls), urls
        assert browser.errors(d) == []


def _sig_close(shown: float, raw: float, digits: int) -> bool:
    # the page rounds to `digits` significant digits: within half a unit of the last one kept
    return raw == shown or abs(shown - raw) <= 0.5001 * 10 ** (math.floor(math.log10(abs(raw))) - digits + 1)


def _shown(texts: list[str]) -> list[float]:
    return sorted(_number(t.split(" ms (")[0]) for t in texts if " ms (" in t)


def test_seed004_page_shows_the_runs_raw_medians_at_every_context_the_slider_reaches(tmp_path):
    from selenium.webdriver.common.keys import Keys

    from kvlab import report
    from kvlab.studies.handoff import page as handoff_page

    a = report.analysis("handoff/20261201-092005-h200")  # the published 2×H200 NVLink run
    path = pages.write(handoff_page.page(a), tmp_path, "kvlab · test page")
    raw = a.raw["results"]  # the run's own rows: every median below is taken here, not read from the analysis
    dest = "peer-cuda:1"

    def rows(context, method, measure):
        g = raw[(raw.context == context) & (raw.destination == dest) & (raw.method == method) & (raw.measure == measure)]
        return g.set_index("repeat").ms

    contexts = sorted(raw.context.unique())
    with browser.chromium() as d:
        _open(d, path)
        slider = d.find_element("css selector", "input[name=ctx]")
        slider.send_keys(Keys.HOME)  # the shortest context, then one step right at a time, as a reader drags it
        for k, context in enumerate(contexts):
            if k:
                slider.send_keys(Keys.ARROW_RIGHT)
            d.execute_async_script("window.kvlabView.runAsync().then(() => arguments[0]())")
            texts = [t for t in d.execute_script(TEXTS) if t]
            prefill = float(rows(context, "colocated", "prefill").median())
            copy = float(rows(context, "bulk", "copy").median())
            paired = (rows(context, "layerwise", "wall") - rows(context, "colocated", "prefill")).dropna()
            extra = float(paired.median())
            lo, hi = intervals.median_ci(paired)
            nbytes = float(raw[raw.context == context].kv_bytes.iloc[0])
            nets = [1e3 * nbytes / calculator.LINKS[n].bytes_per_s for n in ("100G", "400G")]
            head = [t for t in texts if t.startswith(f"Context: {int(context):,} tokens; prefill ")]
            assert len(head) == 1, texts
            assert _sig_close(_number(head[0].rsplit(" ", 2)[1]), prefill, 4), (head, prefill)
            shown, expected = _shown(texts), sorted([prefill, copy, extra, *nets])
            assert len(shown) == len(expected) and all(_sig_close(s, e, 4) for s, e in zip(shown, expected)), (
                int(context), shown, expected)
            assert any(f"; 95 %: {units.sig(lo, 3)}–{units.sig(hi, 3)}" in t for t in texts), (texts, lo, hi)
        d.save_screenshot(str(_artifacts(tmp_path) / "seed004_table.png"))
        assert browser.errors(d) == []


def test_a_standalone_copy_draws_in_the_browser_with_nothing_beside_it(tmp_path):
    from kvlab.studies.handoff import page as handoff_page
    from kvlab import report

    written = pages.write(handoff_page.page(report.analysis("handoff/20261201-092005-h200")), tmp_path / "run",
                          "kvlab · test page")
    alone = tmp_path / "elsewhere" / "post.html"
    assert pages.main([str(written), str(alone)]) == 0
    with browser.chromium() as d:
        _open(d, alone)
        urls = d.execute_script("return Array.from(document.querySelectorAll('[src], [href]')).map(e => e.src || e.href)")
        assert urls == [], urls
        assert any(t.startswith("Context: 32,768 tokens") for t in d.execute_script(TEXTS)), "the longest context first"
        assert browser.errors(d) == []


def test_paged_page_shows_the_runs_medians_for_every_destination_and_block_size(tmp_path):
    from kvlab import report
    from kvlab.studies.paged_transfer import page as paged_page

    a = report.analysis("paged_transfer/20261201-052414-h200")  # the published one-H200 run
    path = pages.write(paged_page.page(a), tmp_path, "kvlab · test page")
    pct = a.tables["pct_of_ceiling"]  # the analysis's own % of the contiguous copy, per block size and method
    pct = pct[pct.context == pct.context.max()]
    headline = a.tables["summary"].set_index(["destination", "method"])  # 16-token blocks: GB/s as the docs show
    sizes = sorted(pct.block_size.unique())
    with browser.chromium() as d:
        _open(d, path)
        checked = 0
        for dest in dict.fromkeys(pct.destination):
            d.execute_async_script(SET, "destination", dest)
            for i, bs in enumerate(sizes):
                d.execute_async_script(SET, "block", i)
                texts = [t for t in d.execute_script(TEXTS) if t]
                assert f"32k tokens in {bs}-token blocks" in texts, texts
                row = pct[(pct.destination == dest) & (pct.block_size == bs)].iloc[0]
                for method in ("torch-index", "triton", "chunked-gather-d2h", "mapped-pinned", "cuda-memcpy-batch"):
                    if method not in row.index or row[method] != row[method]:
                        continue
                    pct_text = f"({units.sig(row[method], 3)} % "
                    shown = [t for t in texts if t.startswith(tuple("0123456789")) and pct_text in t]
                    assert shown, (dest, bs, method, row[method], texts)
                    checked += 1
                    if bs == 16 and (dest, method) in headline.index:
                        gbps = units.sig(headline.loc[(dest, method), "gbps"], 4)
                        assert any(t.startswith(f"{gbps} GB/s") for t in shown)
        d.save_screenshot(str(_artifacts(tmp_path) / "paged_gbps.png"))
        assert browser.errors(d) == []
    assert checked >= 20


def _report_page(name: str) -> Path:
    from kvlab import report

    made = {p.name: p for p in report.page_files()}
    return made[f"{name}.html"]  # the published file itself (test_pages holds it equal to what report makes)


def test_ttft_page_shows_each_runs_paired_medians_at_every_context_and_mode(tmp_path):
    from kvlab import report
    from kvlab.studies.disagg import page as disagg_page

    entry = report.manifest()["pages"]["ttft_by_backend"]
    expected: dict[tuple, dict] = {}
    for run in entry["runs"]:  # the runs' own requests: each median below is taken here, not read from the analysis
        a = report.analysis(run)
        labels = {(r["mode"], r["context"], r["layout"]): r["row"] for r in disagg_page.ttft_rows([a])}
        req = a.raw["requests"]
        timed = req[~req.warmup.astype(bool)]
        for (layout, context), g in timed.groupby(["layout", "context"]):
            co = g[g["mode"] == "colocated"].set_index("round").ttft_ms
            for mode, m in g[g["mode"] != "colocated"].groupby("mode"):
                diff = (m.set_index("round").ttft_ms - co).dropna()
                row = labels[(mode, int(context), layout)]
                expected.setdefault((mode, int(context)), {})[row] = (float(diff.median()), float(co.median()))
    contexts = sorted({c for _, c in expected})
    # each text with where it sits: a bar's value line sits just under its row's label
    placed = "return Array.from(document.querySelectorAll('#chart svg text')).map(t => [t.textContent, " \
             "t.getBoundingClientRect().top])"
    with browser.chromium() as d:
        _open(d, _report_page("ttft_by_backend"))
        for mode in ("bulk", "layerwise"):
            d.execute_async_script(SET, "mode", mode)
            for i, context in enumerate(contexts):
                d.execute_async_script(SET, "ctx", i)
                items = d.execute_script(placed)
                want = expected.get((mode, context), {})
                rows = [(top, t) for t, top in items if t in want]
                values = [(top, t) for t, top in items if " over colocated's " in t]
                assert len(rows) == len(values) == len(want), (mode, context, items)
                for top, text in values:
                    row = max((r for r in rows if r[0] < top), key=lambda r: r[0])[1]  # the label just above
                    extra, co = want[row]
                    s_extra = float(text.split(" ms [")[0])
                    s_co = _number(text.rsplit("'s ", 1)[1].removesuffix(" ms"))
                    assert abs(s_extra - extra) <= 0.0051 and _sig_close(s_co, co, 4), (mode, context, row, text)
            d.save_screenshot(str(_artifacts(tmp_path) / f"ttft_by_backend_{mode}.png"))
        assert browser.errors(d) == []


def test_faults_page_shows_each_campaigns_decision_times_from_its_runs(tmp_path):
    from kvlab import report
    from kvlab.studies.disagg import page as disagg_page

    entry = report.manifest()["pages"]["faults_by_kind"]
    analyses = [report.analysis(r) for r in entry["runs"]]
    campaigns: dict[str, list] = {}
    for a in analyses:
        campaigns.setdefault(disagg_page.fault_rows([a])[0]["campaign"], []).append(a)
    with browser.chromium() as d:
        _open(d, _report_page("faults_by_kind"))
        for campaign, members in campaigns.items():
            d.execute_async_script(SET, "campaign", campaign)
            # a line broken in two is drawn as one text element with a tspan per line
            lines = [t for t in d.execute_script(LINES) if " · " in t and ": median " in t]
            expected = sum(len(a.raw["faults"].groupby(["policy", "kind"])) for a in members)
            assert len(lines) == expected, (campaign, lines)
            for line in lines:
                label, text = line.split(": ", 1)
                kind, policy = label.split(" · ", 1)
                run = re.search(r"\(run (\S+)\)", policy)
                pol = policy.split(" (run ")[0]
                (a,) = [a for a in members if (run is None or a.run_id == run.group(1))
                        and pol in set(a.raw["faults"].policy)]
                f = a.raw["faults"]
                g = f[(f.policy == pol) & (f.kind == kind)].recover_ms  # the run's own faults, raw
                m = re.search(r"median ([\d,.]+) ms, slowest ([\d,.]+) ms", text)
                assert _sig_close(_number(m.group(1)), float(g.median()), 3), (line, g.median())
                assert _sig_close(_number(m.group(2)), float(g.max()), 3), (line, g.max())
                outcomes = text.split("\n")[1].split("; ")[:-1]  # "refused 20", "recovered (retry) 13", …
                assert sum(int(o.rsplit(" ", 1)[1]) for o in outcomes) == len(g), (line, len(g))
        d.save_screenshot(str(_artifacts(tmp_path) / "faults_by_kind.png"))
        assert browser.errors(d) == []


@pytest.mark.parametrize("path", sorted(p for p in (Path(__file__).resolve().parent.parent / "figures").glob("*/*.html")),
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_published_page_reads_at_700_px_without_scrolling_sideways(path):
    with browser.chromium() as d:
        d.set_window_size(700, 1400)
        _open(d, path)
        width = d.execute_script("return document.documentElement.scrollWidth")
        view = d.execute_script("return document.documentElement.clientWidth")
        assert width <= view, f"{path.name}: {width} px wide in a {view} px window"
        assert browser.errors(d) == []
