"""The house style of kvlab figures, and ``save()``, which files each figure under its run.

Every figure is drawn for a blog post: large enough type, no chart junk, and the Okabe–Ito palette,
which stays distinguishable under the common colour-vision deficiencies. A method or destination
keeps one colour in every figure (``color("bulk")`` is always the same blue), so a reader who
learned it once can read the next figure without its legend.

``save(fig, name, run)`` writes PNG + SVG into the run folder and publishes them to
``figures/<study>/`` with a footer naming the run and its device. A CPU run never replaces a figure
that a GPU run published: a sidecar ``figures/<study>/<name>.json`` says which run published it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

from . import devices, pages, paths, provenance, results

# Okabe & Ito (2008), "Color Universal Design".
BLACK = "#000000"
ORANGE = "#E69F00"
SKY_BLUE = "#56B4E9"
GREEN = "#009E73"
YELLOW = "#F0E442"
BLUE = "#0072B2"
VERMILLION = "#D55E00"
PURPLE = "#CC79A7"
GREY = "#8C8C8C"  # not Okabe–Ito: reserved for ceilings and references, never for a measured series

# The order series take when nothing names their colour. Yellow is last: thin yellow lines are hard
# to see on white.
CYCLE = [BLUE, VERMILLION, GREEN, ORANGE, SKY_BLUE, PURPLE, BLACK, YELLOW]

# Fixed colours for the names that recur across studies. Names are normalised first (lowercase,
# '_' and spaces → '-'), so "layer_wise", "Layer wise" and "layer-wise" are one name.
_NAMED = {
    # handoff methods
    "colocated": BLACK,
    "bulk": BLUE,
    "layer-wise": VERMILLION,
    "layerwise": VERMILLION,
    # destinations of a transfer, under the labels kvlab.transfer gives them ("cuda:N" is
    # normalised to "peer"; "same-device" is the same destination on a CPU-only run)
    "same-gpu": GREEN,
    "same-device": GREEN,
    "peer": SKY_BLUE,
    "pinned": ORANGE,
    "pinned-host": ORANGE,
    "pageable": PURPLE,
    "pageable-host": PURPLE,
    # references
    "ceiling": GREY,
    "contiguous": GREY,
}

FIGURE_FORMATS = ("png", "svg")
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]*$")


def _normalise(name: str) -> str:
    key = re.sub(r"[\s_]+", "-", str(name).strip().lower())
    return "peer" if re.fullmatch(r"cuda:\d+", key) else key


def color(name: str) -> str:
    """The colour (hex string) of a method, destination or other series name.

    Known names (colocated, bulk, layer-wise, same-gpu/same-device, cuda:N/peer, pinned(-host),
    pageable(-host), ceiling) have fixed colours; any other name gets a colour from its hash,
    the same in every process.
    """
    key = _normalise(name)
    if key in _NAMED:
        return _NAMED[key]
    digest = hashlib.sha256(key.encode()).digest()
    return CYCLE[digest[0] % len(CYCLE)]


def palette(names) -> dict[str, str]:
    """``{name: colour}`` for the series of one figure (pass it as seaborn's ``palette=``).

    Known names keep their fixed colours; the others take the unused colours of ``CYCLE`` in the
    order given, so that, unlike hashing, no two series of the figure share a colour (while there
    are colours left).
    """
    names = list(dict.fromkeys(names))
    out = {n: _NAMED[_normalise(n)] for n in names if _normalise(n) in _NAMED}
    free = [c for c in CYCLE if c not in out.values()]
    for i, n in enumerate(n for n in names if n not in out):
        out[n] = free[i] if i < len(free) else CYCLE[i % len(CYCLE)]
    return {n: out[n] for n in names}


def style() -> None:
    """Apply the house style to matplotlib and seaborn (call once, at the top of a notebook)."""
    import matplotlib as mpl
    import seaborn as sns

    sns.set_theme(context="notebook", style="whitegrid", palette=CYCLE, font_scale=1.1)
    mpl.rcParams.update(
        {
            "figure.figsize": (7.0, 4.2),
            "figure.dpi": 110,
            "savefig.dpi": 200,
            "savefig.bbox": "tight",
            "savefig.pad_inches": 0.1,
            "axes.spines.top": False,
            "axes.spines.right": False,
            "axes.titleweight": "bold",
            "axes.titlesize": 13,
            "axes.titlelocation": "left",
            "legend.frameon": False,
            "lines.linewidth": 2.0,
            "lines.markersize": 6,
            # Text as paths: the SVG looks the same wherever it is shown, whatever fonts are there.
            "svg.fonttype": "path",
            # Fixed ids inside the SVG, so re-rendering the same figure gives the same file.
            "svg.hashsalt": "kvlab",
        }
    )


def _run_facts(run) -> tuple[Path, str, str, bool, str]:
    """(run folder, run id, study, is_gpu, device line) of a ``results.Run`` or a run folder."""
    if isinstance(run, results.Run):
        record, folder = run.record, run.dir
    elif isinstance(run, (str, os.PathLike)):
        folder = Path(run)
        record, _ = results.load(folder)
    else:
        raise TypeError(f"run must be a results.Run or a run folder path, got {type(run).__name__}")
    return (folder, record["run_id"], record["study"], record.get("device_kind") == "cuda",
            devices.summary(record))


def _git_ignores(path: Path) -> bool:
    import subprocess

    try:
        done = subprocess.run(["git", "-C", str(Path(path).parent), "check-ignore", "-q", str(path)],
                              capture_output=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def _run_parameters(run) -> dict:
    """The parameters a run was made with, less run_dir (which differs for every run)."""
    record = run.record if isinstance(run, results.Run) else \
        json.loads((Path(run) / results.RUN_JSON).read_text(encoding="utf-8"))
    return {k: v for k, v in (record.get("parameters") or {}).items() if k != "run_dir"}


BLOG_WIDTH_PX = 700  # a blog column: every published figure must read at this width
MIN_TEXT_PX = 6.5  # smallest text, in px, once the figure is scaled to that width


def readability(fig, width_px: int = BLOG_WIDTH_PX, min_px: float = MIN_TEXT_PX) -> list[str]:
    """What would not read when ``fig`` is shown ``width_px`` wide: text smaller than ``min_px`` pixels at that
    scale, and pieces of text that overlap one another. Empty when the figure reads. Draws the figure once."""
    from matplotlib.text import Text

    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    box = fig.get_tightbbox(renderer)  # in inches, what savefig(bbox_inches="tight") keeps
    scale = width_px / (box.width * 72)  # px per point once shown width_px wide
    hidden = set()  # tick labels of ticks outside an axis' view: matplotlib keeps them but never draws them
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                loc = tick.get_loc()
                if loc is None or not (lo - 1e-9 * abs(lo) <= loc <= hi + 1e-9 * abs(hi)):
                    hidden.update({id(tick.label1), id(tick.label2)})
            hidden.update(id(t) for t in (axis.get_majorticklabels() + axis.get_minorticklabels())
                          if not t.get_text().strip())
    texts = [t for t in fig.findobj(Text)
             if t.get_visible() and t.get_text().strip() and t.figure is fig and id(t) not in hidden]
    issues, boxes = [], []
    for t in texts:
        px = t.get_fontsize() * scale
        label = t.get_text().strip().replace("\n", " ")[:50]
        if px < min_px:
            issues.append(f"text {label!r} is {px:.1f} px at {width_px} px wide (< {min_px})")
        try:
            boxes.append((label, t.get_window_extent(renderer)))
        except RuntimeError:
            continue
    for i in range(len(boxes)):
        for j in range(i + 1, len(boxes)):
            (a, ba), (b, bb) = boxes[i], boxes[j]
            if ba.width and bb.width and ba.overlaps(bb):
                inter_w = min(ba.x1, bb.x1) - max(ba.x0, bb.x0)
                inter_h = min(ba.y1, bb.y1) - max(ba.y0, bb.y0)
                if inter_w > 1 and inter_h > 1:
                    issues.append(f"text {a!r} overlaps {b!r}")
    return issues


def footer_text(run_id: str, device: str, drawn: str | None = None) -> str:
    """The provenance line under every saved figure: ``kvlab · run <run_id> · <device>``, and
    ``· drawn by <commit>`` (kvlab.provenance.short) when ``drawn`` is given: the data's run and the
    code that drew it, which need not be the run's own."""
    text = f"kvlab · run {run_id} · {device}"
    return f"{text} · drawn by {drawn}" if drawn else text


def set_footer(fig, text: str) -> None:
    """Put `text` (a run's footer) under `fig`, replacing any footer it had."""
    # Hung just below the figure's bottom edge (va="top" at y=0): a tight bounding box takes it in,
    # and it can never sit on top of an x-axis label. Saving the same figure twice reuses it.
    existing = getattr(fig, "_kvlab_footer", None)
    if existing is not None:
        existing.set_text(text)
        return
    fig._kvlab_footer = fig.text(0.995, 0.0, text, ha="right", va="top", fontsize=7.5,
                                 color="#666666")


# an SVG larger than this is kept gzipped, as .svgz: every one. Matplotlib's SVGs shrink about 5× (132 of them in
# data/ took 10.9 MiB as .svg, 1.9 MiB as .svgz), and the PNG beside each is the copy to look at
SVG_GZIP_BYTES = 0


def _gzip_svg(path: Path) -> Path:
    import gzip

    out = path.with_suffix(".svgz")
    with open(path, "rb") as f, gzip.GzipFile(out, "wb", mtime=0) as g:
        shutil.copyfileobj(f, g)
    path.unlink()
    return out


def _drop_other_svg(folder: Path, name: str, kept: str) -> None:
    """Remove ``<folder>/<name>`` in the SVG form other than ``kept`` (".svg" or ".svgz"): left from an earlier
    drawing, it would be another figure under the same name."""
    (Path(folder) / f"{name}{'.svgz' if kept == '.svg' else '.svg'}").unlink(missing_ok=True)


def write(fig, folder: Path, name: str, footer: str) -> list[Path]:
    """Write ``fig`` with ``footer`` as ``<folder>/<name>.png`` and ``.svgz`` (gzipped SVG; plain ``.svg`` at
    or under SVG_GZIP_BYTES); returns the paths. What `save` does for a run folder, and `kvlab analyse` for an
    analysis folder."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"figure name {name!r} is not valid: use lowercase letters, digits, '-' "
                         "and '_' (e.g. 'exposure_vs_link'), without an extension")
    if pages.is_page(fig):  # an interactive page: one .html, its footer below the chart
        if fig.name != name:
            raise ValueError(f"page {fig.name!r} saved as {name!r}: a page is saved under its own name")
        return [pages.write(fig, folder, footer)]
    set_footer(fig, footer)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for ext in FIGURE_FORMATS:
        path = folder / f"{name}.{ext}"
        # No date in the SVG metadata, so the file changes only when the figure does.
        metadata = {"Title": name, "Date": None} if ext == "svg" else {"Title": name}
        fig.savefig(path, format=ext, metadata=metadata)
        if ext == "svg" and path.stat().st_size > SVG_GZIP_BYTES:
            path = _gzip_svg(path)
        if ext == "svg":
            _drop_other_svg(folder, name, path.suffix)
        written.append(path)
    return written


PUBLISH_ENV = "KVLAB_PUBLISH"


def publishing() -> str | None:
    """Whether figures are published now: ``"yes"`` when ``KVLAB_PUBLISH`` is 1 / yes / true (``kvlab run
    --publish`` sets it), ``"force"`` when it is "force", else None — a plain run, an interactive session or
    `make run` leaves figures/ alone."""
    v = os.environ.get(PUBLISH_ENV, "").strip().lower()
    if v == "force":
        return "force"
    return "yes" if v in ("1", "yes", "true", "on") else None


def save(fig, name: str, run, publish: bool | None = None) -> list[Path]:
    """Write ``fig`` as ``<run_dir>/figures/<name>.png`` and ``.svgz`` (gzipped SVG; see SVG_GZIP_BYTES), then
    publish both to
    ``<figures_root>/<study>/`` with a sidecar ``<name>.json`` (run id, device, is_gpu, and drawn_by: the
    commit and code hash of the code that drew it, kvlab.provenance.drawing).

    ``run`` is a ``results.Run`` or the path of a run folder (to redraw an older run's figure from
    its data). Publishing happens only when asked: ``publish=True``, or ``publish=None`` (the default)
    with ``KVLAB_PUBLISH`` set (`publishing()`; ``kvlab run --publish``). Even then it is skipped, with a
    printed note, when this is a CPU run and the published figure came from a GPU run, or when the
    published figure's run had other parameters than this one (``KVLAB_PUBLISH=force`` overrides that
    check): the README's figures change only on purpose, for a run made with the parameters they show. ``name``: lowercase letters, digits, '-' and '_'
    (e.g. ``"exposure_vs_link"``). Returns the paths written: the run's copies, then the published
    ones (if published).
    """
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"figure name {name!r} is not valid: use lowercase letters, digits, '-' "
                         "and '_' (e.g. 'exposure_vs_link'), without an extension")
    if not hasattr(fig, "savefig") and not pages.is_page(fig):
        raise TypeError(f"fig must be a matplotlib Figure or a kvlab.pages.Page, got {type(fig).__name__}")
    folder, run_id, study, is_gpu, device = _run_facts(run)
    drawn = provenance.drawing()
    written = write(fig, folder / "figures", name, footer_text(run_id, device, provenance.short(drawn)))
    mode = ("yes" if publish else None) if publish is not None else publishing()
    if not mode:
        return written
    return written + publish_files(written, name, run, mode=mode, drawn=drawn)


def publish_files(files: list[Path], name: str, run, mode: str = "yes", drawn: dict | None = None,
                  **extra) -> list[Path]:
    """Copy a figure's files (``<name>.png`` / ``.svg`` / ``.svgz``, drawn for ``run``) to
    ``<figures_root>/<study>/<name>.*`` with a sidecar ``<name>.json`` naming the run, its parameters, the code
    that drew it (``drawn``, default `provenance.drawing()`) and any ``extra`` fields; returns the copies, or
    [] with a printed note when the rules of `save` keep the published figure. A re-analysis publishes
    through this too (`kvlab analyse RUN --publish`)."""
    folder, run_id, study, is_gpu, device = _run_facts(run)
    params = _run_parameters(run)
    shown = ".html" if any(Path(f).suffix == ".html" for f in files) else ".png"  # the file the messages name
    drawn = drawn if drawn is not None else provenance.drawing()
    target = paths.figures_root() / study
    sidecar = target / f"{name}.json"
    published = {}
    if sidecar.is_file():
        try:
            published = json.loads(sidecar.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            published = {}
        if published.get("is_gpu") and not is_gpu:
            print(f"kept {target / name}{shown} from GPU run {published.get('run_id')}: a CPU run "
                  f"does not replace it (this run's copy: {files[0]})")
            return []
        theirs = published.get("parameters")
        if mode != "force" and theirs is not None and published.get("run_id") != run_id and theirs != params:
            differ = sorted(k for k in set(theirs) | set(params) if theirs.get(k) != params.get(k))
            print(f"kept {target / name}{shown} from run {published.get('run_id')}: this run's parameters differ "
                  f"({', '.join(differ)}); publish it anyway with KVLAB_PUBLISH=force (this run's copy: {files[0]})")
            return []
    if _git_ignores(folder):
        print(f"note: the run folder {folder} is ignored by git (a CPU run): commit it with the figures "
              f"(git add -f {folder}), or the published figure names a run nobody else has")
    target.mkdir(parents=True, exist_ok=True)
    copies = []
    for src in files:
        suffix = Path(src).suffix
        dst = target / f"{name}{suffix}"
        if suffix == ".html":  # a page links its chart library relative to where it lies
            dst.write_text(pages.relinked(Path(src).read_text(encoding="utf-8"), target), encoding="utf-8")
        else:
            shutil.copyfile(src, dst)
        copies.append(dst)
        if suffix in (".svg", ".svgz"):
            _drop_other_svg(target, name, suffix)
    # say what was replaced, and from which run: published figures change only on purpose, and visibly
    was = published.get("run_id")
    print(f"published {target / name}{shown} from run {run_id}"
          + (f", replacing the one from run {was}" if was and was != run_id else " (redrawn)" if was else " (new)"))
    sidecar.write_text(
        json.dumps({"figure": name, "study": study, "run_id": run_id, "is_gpu": is_gpu,
                    "device": device, "run": f"{study}/{run_id}", "parameters": params, "drawn_by": drawn, **extra},
                   indent=2) + "\n",
        encoding="utf-8",
    )
    return copies
