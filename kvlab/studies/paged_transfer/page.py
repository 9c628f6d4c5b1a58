"""The paged transfer as a page a blog post can embed (kvlab.pages): a paged cache of the run's longest context moved
by each method, at the block size the reader picks on a slider and to the destination picked from a list; each
method's GB/s (the median send's) as a bar, with its share of one contiguous copy of the same bytes over the same
path, which stands beside them as the ceiling."""

from __future__ import annotations

import math

import pandas as pd

from ... import units
from ...pages import Page, run_facts, source_device, where
from ...study import Analysis, ctx_label

__all__ = ["NAME", "rows", "page"]

NAME = "paged_gbps"


def rows(results: pd.DataFrame) -> list[dict]:
    """Per destination, block size and method at the longest context: the median send's GB/s and its % of the
    contiguous copy of the same bytes (both from the run's raw rows, as the block-size figure draws them)."""
    context = int(results.context.max())
    sub = results[(results.context == context) & (results.status == "ok")]
    med = (sub.groupby(["destination", "block_size", "method"], sort=False)
           .agg(nbytes=("bytes", "first"), ms=("ms", "median"), n=("ms", "size")).reset_index())
    med["gbps"] = med.nbytes / (med.ms * 1e6)
    out = []
    for (dest, bs), g in med.groupby(["destination", "block_size"], sort=False):
        ceiling = g[g.method == "contiguous"].gbps
        ceil = float(ceiling.iloc[0]) if len(ceiling) else float("nan")
        for r in g.itertuples():
            pct = 100.0 * r.gbps / ceil if ceil == ceil else None
            out.append({"destination": str(dest), "block_size": int(bs), "method": str(r.method),
                        "kind": "ceiling" if r.method == "contiguous" else "paged", "gbps": float(r.gbps),
                        "text": f"{units.sig(r.gbps, 4)} GB/s" + ("" if pct is None or r.method == "contiguous"
                                                            else f" ({units.sig(pct, 3)} % of the contiguous copy)")
                        + (f", timed {int(r.n)}×" if r.n < 9 else "")})
    return out


def page(a: Analysis) -> Page:
    """The page of a paged_transfer run."""
    import altair as alt

    results = a.raw["results"]
    data = rows(results)
    dests = list(dict.fromkeys(r["destination"] for r in data))
    sizes = sorted({r["block_size"] for r in data})
    context = int(results.context.max())
    p_dest = alt.param(name="destination", value=dests[0], bind=alt.binding_select(
        options=dests, labels=[where(d, source_device(a.record)) for d in dests], name="Where the cache goes"))
    p_block = alt.param(name="block", value=sizes.index(16) if 16 in sizes else 0, bind=alt.binding_range(
        min=0, max=len(sizes) - 1, step=1,
        name="Block size (" + ", ".join(f"{i} = {b}" for i, b in enumerate(sizes)) + " tokens a block)"))
    methods = list(dict.fromkeys(r["method"] for r in data if r["method"] != "contiguous"))
    sizes_expr = "[" + ", ".join(str(b) for b in sizes) + "]"
    base = alt.Chart(alt.Data(values=data)).transform_filter(
        f"datum.destination === destination && datum.block_size === {sizes_expr}[block]")
    y = alt.Y("method:N", sort=["contiguous", *methods], title=None, axis=alt.Axis(labelFontSize=12, labelLimit=160))
    # bars on a log axis start from a floor below every value, not from 0 (which a log axis cannot show)
    floor = 10 ** math.floor(math.log10(min(r["gbps"] for r in data) / 2))
    bars = base.transform_calculate(floor=repr(floor)).mark_bar(height=16).encode(
        x=alt.X("gbps:Q", title="GB/s (decimal), median send; log axis",
                scale=alt.Scale(type="log", domainMin=floor),
                axis=alt.Axis(values=[floor * 10 ** k for k in range(7)], format=",~g")), x2="floor:Q",
        y=y, color=alt.Color("kind:N", scale=alt.Scale(domain=["ceiling", "paged"], range=["#8C8C8C", "#0072B2"]),
                             legend=alt.Legend(title=None, orient="bottom",
                                               labelExpr="datum.label === 'ceiling' ? 'one contiguous copy (the "
                                                         "ceiling)' : 'a method moving the blocks'")),
        tooltip=["method:N", "text:N"])
    text = base.mark_text(align="left", fontSize=11).encode(x=alt.value(228), y=y, text="text:N")
    heading = base.transform_filter("datum.method === 'contiguous'").transform_calculate(
        label=f"'{ctx_label(context)} tokens in ' + datum.block_size + '-token blocks'").mark_text(
        align="left", fontSize=14, fontWeight="bold").encode(x=alt.value(0), y=alt.value(-12), text="label:N")
    chart = alt.layer(bars, text, heading).add_params(p_dest, p_block).properties(
        width=220, height=alt.Step(26)).configure_view(stroke=None)
    device, commit = run_facts(a.record, a.device_tag)
    intro = (f"A paged KV cache ({ctx_label(context)} tokens of the run's model) sits in small blocks scattered over a "
             "pool; each method below moves the same blocks to the destination you pick, on "
             f"{device}. Move the slider to change the block size. The grey bar is one contiguous copy of the same "
             f"bytes over the same path, the ceiling; every move was checked byte for byte. Run {a.run_id}, code "
             f"{commit}.")
    return Page(NAME, "Moving a paged KV cache: GB/s by method and block size", intro, chart)
