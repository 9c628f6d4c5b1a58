"""Interactive pages a blog post can embed: one Vega-Lite chart (made with Altair) in a standalone HTML file, its
data inside the page, sliders and dropdowns bound to the chart's parameters, no server and no kernel.

A page loads the chart library from ``figures/vendor/`` (Vega, Vega-Lite, vega-embed; vendored once by
``tools/vendor_vega.py``) by a path relative to the page, so it opens from disk with no network; ``standalone``
inlines the library instead, for a post that wants one file. A page's own HTML (spec, data, text) is kept under
PAGE_BYTES. The page marks itself ready (``<body data-ready="1">``) once the chart is drawn and keeps the chart's
Vega view in ``window.kvlabView``, which the browser tests read; a chart that fails to draw says so in the page.

    page = Page("calculator", title, intro, chart)     # chart: an altair chart
    write(page, folder, footer)                        # -> folder/calculator.html
    relinked(html, new_folder)                         # the same page, linking the library from new_folder
"""

from __future__ import annotations

import html
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from . import paths

__all__ = ["Page", "PAGE_BYTES", "LIBRARY", "is_page", "vendor_dir", "render", "check_size", "write", "relinked", "standalone",
           "run_facts", "source_device", "gpu_name", "WHERE", "where"]

# what a page may weigh without the chart library (its spec, data and text): small enough for a post
PAGE_BYTES = 300_000
# the library, in the order the scripts must load
LIBRARY = ("vega.min.js", "vega-lite.min.js", "vega-embed.min.js")
_SCRIPT = re.compile(r'<script src="([^"]*)" data-kvlab-library></script>')
_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]*$")
_END_SCRIPT = re.compile(r"</(script)", re.IGNORECASE)
# each destination kvlab's runs name, in words a reader of a post shares ("{src}" is the sending GPU, "{dst}" the
# receiving one)
WHERE = {"same-gpu": "within GPU {src} (device memory to device memory)",
         "pinned-host": "GPU {src} → pinned host memory", "pageable-host": "GPU {src} → pageable host memory",
         "peer": "GPU {src} → GPU {dst} over NVLink", "same-device": "within one device (a CPU run)"}

_STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; color: #1a1a1a; max-width: 700px;
       margin: 1em auto; padding: 0 10px; line-height: 1.45; }
h1 { font-size: 1.3em; margin: 0.2em 0 0.4em; }
p.intro { margin: 0 0 0.8em; }
.vega-bindings { display: grid; grid-template-columns: 1fr; gap: 4px; margin: 0.6em 0; }
.vega-bind { display: flex; align-items: center; gap: 8px; flex-wrap: wrap; }
.vega-bind-name { min-width: 15em; font-weight: 600; }
.vega-bind input[type=range] { width: 16em; }
#chart .vega-embed { display: flex; flex-direction: column; }
#chart .vega-bindings { order: -1; }
footer { font-size: 12px; color: #4d4d4d; margin-top: 1em; border-top: 1px solid #ddd; padding-top: 0.4em; }
.kvlab-error { color: #a00; font-weight: 600; }
"""

_BOOT = """
const spec = JSON.parse(document.getElementById("kvlab-spec").textContent);
vegaEmbed("#chart", spec, {renderer: "svg", actions: false})
  .then((result) => { window.kvlabView = result.view; document.body.dataset.ready = "1"; })
  .catch((err) => {
    const box = document.getElementById("chart");
    box.className = "kvlab-error";
    box.textContent = "This chart could not be drawn: " + err;
    document.body.dataset.ready = "error";
    console.error(err);
  });
"""


@dataclass(frozen=True)
class Page:
    """One interactive page: ``name`` (the file's stem: lowercase letters, digits, '-', '_'), its ``title`` and
    ``intro`` (plain text, one paragraph), and ``chart``, an Altair chart (anything with ``to_dict()`` giving a
    Vega-Lite spec)."""

    name: str
    title: str
    intro: str
    chart: object

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ValueError(f"page name {self.name!r} is not valid: use lowercase letters, digits, '-' and '_'")
        if not hasattr(self.chart, "to_dict"):
            raise TypeError(f"page {self.name!r}: chart must be an Altair chart, got {type(self.chart).__name__}")


def is_page(x) -> bool:
    return isinstance(x, Page)


def vendor_dir() -> Path:
    """Where the chart library is: this checkout's figures/vendor/ (the published figures' folder when kvlab is not
    run from a checkout)."""
    here = Path(__file__).resolve().parent.parent / "figures" / "vendor"
    return here if (here / LIBRARY[0]).is_file() else paths.figures_root() / "vendor"


def _library_links(folder: Path) -> list[str]:
    vendor = vendor_dir()
    missing = [f for f in LIBRARY if not (vendor / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{vendor / missing[0]} is missing: the pages' chart library is vendored by "
                                "`python tools/vendor_vega.py` (needs npm)")
    rel = Path(os.path.relpath(vendor, Path(folder).resolve()))
    return [(rel / f).as_posix() for f in LIBRARY]


def _json_for_script(spec: dict) -> str:
    # inside <script type="application/json">, "</" would end the element early; "<\\/" reads back the same
    return json.dumps(spec, separators=(",", ":"), ensure_ascii=False).replace("</", "<\\/")


def render(page: Page, folder: Path, footer: str) -> str:
    """The page's HTML as it would be written into ``folder`` (the library linked relative to it)."""
    spec = page.chart.to_dict()
    scripts = "\n".join(f'<script src="{html.escape(src)}" data-kvlab-library></script>'
                        for src in _library_links(folder))
    return (f'<!doctype html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">\n'
            f"<title>{html.escape(page.title)}</title>\n<style>{_STYLE}</style>\n{scripts}\n</head>\n<body>\n"
            f"<h1>{html.escape(page.title)}</h1>\n<p class=\"intro\">{html.escape(page.intro)}</p>\n"
            f'<div id="chart" role="figure" aria-label="{html.escape(page.title)}"></div>\n'
            f"<footer>{html.escape(footer)}</footer>\n"
            f'<script id="kvlab-spec" type="application/json">{_json_for_script(spec)}</script>\n'
            f"<script>{_BOOT}</script>\n</body>\n</html>\n")


def check_size(page: Page, text: str) -> str:
    """`text` (the page's HTML as render gives it), or ValueError when it exceeds PAGE_BYTES (the chart library is
    not counted: it is linked, not inlined)."""
    size = len(text.encode("utf-8"))
    if size > PAGE_BYTES:
        raise ValueError(f"page {page.name!r} would be {size:,} bytes without its chart library; a page is kept "
                         f"under {PAGE_BYTES:,} (fewer data rows, or a coarser grid)")
    return text


def write(page: Page, folder: Path, footer: str) -> Path:
    """Write ``<folder>/<name>.html``; ValueError when the page's own HTML exceeds PAGE_BYTES (the chart library is
    not counted: it is linked, not inlined)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    text = check_size(page, render(page, folder, footer))
    out = folder / f"{page.name}.html"
    out.write_text(text, encoding="utf-8")
    return out


def run_facts(record: dict, device_tag: str) -> tuple[str, str]:
    """What a page's text says of the run it shows: its device ("2× H200", or the tag alone for one device) and its
    commit (ten characters, "?" when the record has none)."""
    gpus = len(record.get("devices") or [])
    device = f"{gpus}× {device_tag.upper()}" if gpus > 1 else device_tag.upper()
    return device, str((record.get("git") or {}).get("commit") or "?")[:10]


def _gpu_index(device: str | None) -> str:
    m = re.fullmatch(r"(?:peer-)?cuda(?::(\d+))?", str(device or "cuda"))
    return (m.group(1) or "0") if m else "0"


def gpu_name(device: str | None) -> str:
    """A device as a reader names it: "cuda:1" → "GPU 1", "cuda" → "GPU 0", "cpu" → "the CPU"."""
    return "the CPU" if str(device) == "cpu" else f"GPU {_gpu_index(device)}"


def where(destination: str, source: str | None = None) -> str:
    """A destination in words a reader of a post shares, e.g. ``where("peer-cuda:1", "cuda:0")`` → "GPU 0 → GPU 1
    over NVLink". ``source`` is the sending device as the run recorded it ("cuda", "cuda:0"; GPU 0 when None); a
    destination kvlab does not know is shown as it is."""
    d = str(destination)
    key = "peer" if d.startswith("peer-") else d
    if key not in WHERE:
        return d
    return WHERE[key].format(src=_gpu_index(source), dst=_gpu_index(d) if key == "peer" else "")


def source_device(record: dict) -> str:
    """The device a run sent from, as its record says ("cuda" when it does not)."""
    return str((record.get("resolved") or {}).get("device") or "cuda")


def _swap_library(text: str, script) -> str:
    """``text`` with each library script tag replaced by ``script(match)``; ValueError unless all are there."""
    out, n = _SCRIPT.subn(script, text)
    if n != len(LIBRARY):
        raise ValueError(f"this is not a kvlab page: it links {n} of the {len(LIBRARY)} library scripts")
    return out


def relinked(text: str, folder: Path) -> str:
    """A written page's HTML with its library links made relative to ``folder`` (where a copy of it goes)."""
    links = iter(_library_links(folder))
    return _swap_library(text, lambda m: f'<script src="{html.escape(next(links))}" data-kvlab-library></script>')


def standalone(text: str) -> str:
    """A written page with the chart library inlined: one file that needs nothing beside it."""
    vendor = vendor_dir()

    def inline(m: re.Match) -> str:
        code = (vendor / Path(m.group(1)).name).read_text(encoding="utf-8")
        return "<script>" + _END_SCRIPT.sub(r"<\\/\1", code) + "</script>"

    return _swap_library(text, inline)


def main(argv: list[str] | None = None) -> int:
    """``python -m kvlab.pages PAGE OUT``: write a one-file copy of a written page (the chart library inlined), for a
    post that wants a single file; refuses to overwrite OUT."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m kvlab.pages", description=main.__doc__)
    parser.add_argument("page", help="a page kvlab wrote, e.g. figures/calculator/calculator_page.html")
    parser.add_argument("out", help="the one-file copy to write (a new file)")
    args = parser.parse_args(argv)
    src, out = Path(args.page), Path(args.out)
    if not src.is_file():
        parser.error(f"page {str(src)!r}: no such file; give a page kvlab wrote (figures/<study>/<name>.html)")
    if out.exists():
        parser.error(f"out {str(out)!r} already exists; give a new file name (nothing is overwritten)")
    try:
        text = standalone(src.read_text(encoding="utf-8"))
    except ValueError as err:
        parser.error(f"page {str(src)!r}: {err}")
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "x", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {out} ({len(text.encode('utf-8')):,} bytes, the chart library inlined)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
