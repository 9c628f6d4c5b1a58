"""kvlab.pages without a browser: what a page holds, where it links its chart library from (relative to the page,
also after publishing), its size limit, the one-file copy, and that pages are saved and published like figures."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import altair as alt
import pytest

from kvlab import calculator, pages, plots, report, results, studies, units
from kvlab.paths import read_json
from kvlab.studies.calculator import page as calc_page


def _toy_page(name: str = "toy_page", rows: int = 3) -> pages.Page:
    chart = alt.Chart(alt.Data(values=[{"x": i, "y": i * i} for i in range(rows)])).mark_bar().encode(x="x:O", y="y:Q")
    return pages.Page(name, "A toy </script> title", "Intro & more.", chart)


def _links(text: str) -> list[str]:
    return re.findall(r'<script src="([^"]*)" data-kvlab-library></script>', text)


def test_a_page_holds_its_spec_and_data_and_links_the_vendored_library_relatively(tmp_path):
    out = pages.write(_toy_page(), tmp_path / "a" / "b", "kvlab · run r · cpu")
    text = out.read_text(encoding="utf-8")
    links = _links(text)
    assert [p.rsplit("/", 1)[-1] for p in links] == list(pages.LIBRARY)
    assert all(not p.startswith(("/", "http")) and (out.parent / p).resolve().is_file() for p in links)
    spec = re.search(r'<script id="kvlab-spec" type="application/json">(.*?)</script>', text, re.S).group(1)
    assert json.loads(spec)["data"]["values"][2] == {"x": 2, "y": 4}
    assert "A toy &lt;/script&gt; title" in text and "Intro &amp; more." in text and "kvlab · run r · cpu" in text
    assert not re.search(r"https?://(?!vega\.github\.io/schema)", text)  # only the spec's $schema names a URL


def test_a_copy_links_the_library_from_where_it_lies_and_a_standalone_copy_needs_nothing(tmp_path):
    out = pages.write(_toy_page(), tmp_path / "run", "footer")
    moved = tmp_path / "x" / "y" / "z"
    text = pages.relinked(out.read_text(encoding="utf-8"), moved)
    assert all((moved / p).resolve().is_file() for p in _links(text))
    one = pages.standalone(text)
    assert _links(one) == [] and "<script src=" not in one
    assert len(one) > sum((pages.vendor_dir() / f).stat().st_size for f in pages.LIBRARY)
    with pytest.raises(ValueError, match="not a kvlab page"):
        pages.relinked("<html></html>", moved)


def test_a_standalone_copy_escapes_every_spelling_of_a_closing_script_tag(tmp_path, monkeypatch):
    vendor = tmp_path / "vendor"
    vendor.mkdir()
    for i, f in enumerate(pages.LIBRARY):  # a library whose code holds the tag in three cases
        (vendor / f).write_text(f'var s{i} = "</script>", t = "</SCRIPT >", u = "</ScRiPt";', encoding="utf-8")
    monkeypatch.setattr(pages, "vendor_dir", lambda: vendor)
    one = pages.standalone(pages.write(_toy_page(), tmp_path / "run", "footer").read_text(encoding="utf-8"))
    scripts = len(re.findall(r"<script\b", one))
    assert len(re.findall(r"</script", one, re.I)) == scripts, "only each script's own end tag remains"
    assert one.count("<\\/SCRIPT >") == len(pages.LIBRARY)


def test_destinations_and_links_are_named_in_a_readers_words():
    assert pages.where("peer-cuda:1", "cuda") == "GPU 0 → GPU 1 over NVLink"
    assert pages.where("peer-cuda:0", "cuda:1") == "GPU 1 → GPU 0 over NVLink"
    assert pages.where("pinned-host", "cuda:1") == "GPU 1 → pinned host memory"
    assert pages.where("somewhere") == "somewhere"
    for name, lk in calculator.LINKS.items():  # the rates come from the calculator, not typed again
        label = calc_page.link_label(name)
        assert f"({lk.gbyte_per_s:g} GB/s" in label and ("µs a copy" in label) == bool(lk.fixed_us), label


def _published_pages(sidecar: bool = True):
    """The pages under figures/: those published from one run (with a sidecar), or those kvlab report makes."""
    return sorted(p for p in (Path(__file__).resolve().parent.parent / "figures").glob("*/*.html")
                  if p.with_suffix(".json").is_file() == sidecar)


def test_every_page_kvlab_report_makes_is_the_published_one_and_nothing_else_is_there():
    made = report.page_files()
    assert sorted(made) == _published_pages(sidecar=False)  # a page without a sidecar is a report page
    for path, text in made.items():
        assert path.read_text(encoding="utf-8") == text, f"{path}: run kvlab report"
        assert [p.rsplit("/", 1)[-1] for p in _links(text)] == list(pages.LIBRARY)
        assert all((path.parent / p).resolve().is_file() for p in _links(text)), _links(text)
        assert "peer-cuda" not in text and "seed 004" not in text.lower()


@pytest.mark.parametrize("path", _published_pages(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_each_published_page_is_what_its_run_gives_today_and_links_the_vendored_library(path):
    # the page as this checkout's study draws it from the run its sidecar names, written where it lies, with the
    # published footer: byte for byte the published file (so a change to a page's code is published, or fails here)
    side = json.loads(path.with_suffix(".json").read_text(encoding="utf-8"))
    text = path.read_text(encoding="utf-8")
    assert all((path.parent / p).resolve().is_file() for p in _links(text)), _links(text)
    assert [p.rsplit("/", 1)[-1] for p in _links(text)] == list(pages.LIBRARY)
    footer = re.search(r"<footer>(.*?)</footer>", text, re.S).group(1)
    assert side["run_id"] in footer
    a = report.analysis(side["run"])
    drawn = studies.get(side["study"]).figures(a)
    page = drawn[side["drawn_as"]]
    for fig in drawn.values():
        if hasattr(fig, "savefig"):
            import matplotlib.pyplot as plt

            plt.close(fig)
    assert pages.render(page, path.parent, html.unescape(footer)) == text


def test_bad_pages_are_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError, match="page name 'Bad Name'"):
        pages.Page("Bad Name", "t", "i", alt.Chart())
    with pytest.raises(TypeError, match="must be an Altair chart"):
        pages.Page("ok", "t", "i", {"mark": "bar"})
    with pytest.raises(ValueError, match=r"would be [\d,]+ bytes"):
        pages.write(_toy_page(rows=40_000), tmp_path, "footer")
    assert not (tmp_path / "toy_page.html").exists()


def test_the_calculator_page_covers_every_registry_model_and_is_small():
    from kvlab import models

    page = calc_page.page()
    spec = page.chart.to_dict()
    rows = spec["data"]["values"]  # the page's own data: one row per registry model, its layers as arrays
    assert [r["model"] for r in rows] == models.names()
    assert all(len(r["layer"]) == len(r["sliding"]) == models.get(r["model"]).layers for r in rows)
    bound = {p["name"]: p.get("bind", {}) for p in spec["params"]}
    assert bound["model"]["options"] == models.names() and bound["link"]["options"] == list(calculator.LINKS)
    assert bound["log2_tokens"]["min"] == 7 and bound["log2_tokens"]["max"] == 17  # 128 to 128k tokens
    assert "peer-cuda" not in json.dumps(spec) and "seed 004" not in json.dumps(spec).lower()


def test_a_page_is_saved_beside_the_figures_and_published_like_them(kvlab_dirs, capsys):
    run = results.start("toy", {})
    page = _toy_page()
    written = plots.save(page, "toy_page", run)
    assert written == [run.dir / "figures" / "toy_page.html"]
    assert f"kvlab · run {run.run_id} · cpu · drawn by" in written[0].read_text(encoding="utf-8")
    assert not (kvlab_dirs.figures / "toy").exists(), "a plain run publishes nothing"
    paths = plots.save(page, "toy_page", run, publish=True)
    published = kvlab_dirs.figures / "toy" / "toy_page.html"
    assert paths[-1] == published
    assert all((published.parent / p).resolve().is_file() for p in _links(published.read_text(encoding="utf-8")))
    assert read_json(kvlab_dirs.figures / "toy" / "toy_page.json")["run_id"] == run.run_id
    assert f"published {published} from run {run.run_id}" in capsys.readouterr().out
    with pytest.raises(ValueError, match="saved under its own name"):
        plots.save(page, "other", run)


@pytest.mark.parametrize("x, digits, text", [
    (1167.3, 4, "1,167"), (12346, 4, "12,350"), (0.15757, 4, "0.1576"), (5.70, 3, "5.7"), (-2.345, 2, "-2.3"),
    (1234567.0, 3, "1,230,000"), (0.000123456, 3, "0.000123"), (0.0, 3, "0"), (-0.0, 3, "0"), (100.0, 3, "100")])
def test_sig_rounds_to_significant_digits_without_exponent_form(x, digits, text):
    assert units.sig(x, digits) == text
