"""Seed 004's results figure as a page a blog post can embed (kvlab.pages), from a handoff run: per context (a
slider), the colocated prefill, the one copy of the whole cache after prefill, and what layer-by-layer sending added
(with its 95 % interval), each as a bar scaled to prefill; beside them, dashed and marked as such, what the same
cache would take over a 400 Gb/s and a 100 Gb/s network card at their nominal rates (the calculator's prediction,
not a measurement). The page shows one destination the run measured (its peer GPU when it measured one); the run
and its commit are in the page."""

from __future__ import annotations

import pandas as pd

from ... import calculator, units
from ...pages import Page, gpu_name, run_facts, source_device, where
from ...study import Analysis, ctx_label

__all__ = ["NAME", "rows", "page"]

NAME = "seed004_table"
ROWS = ("prefill on {gpu}", "one copy after prefill", "layer by layer: extra")


def _bar(ctx_i: int, context: int, order: int, label: str, kind: str, ms: float, prefill: float,
         lo: float | None = None, hi: float | None = None) -> dict:
    pct = 100.0 * ms / prefill
    return {"i": ctx_i, "context": context, "order": order, "row": label, "kind": kind, "ms": ms, "pct": pct,
            "pct_lo": None if lo is None else 100.0 * lo / prefill, "pct_hi": None if hi is None else 100.0 * hi / prefill,
            "text": f"{units.sig(ms, 4)} ms ({units.sig(pct, 3)} %)"
                    + ("" if lo is None else f"; 95 %: {units.sig(lo, 3)}–{units.sig(hi, 3)}")}


def rows(a: Analysis, destination: str) -> list[dict]:
    """The page's bars for one destination: per context, prefill, bulk copy, layer-wise extra, then the network
    predictions (ms, and % of that context's prefill)."""
    s = a.tables["summary"]
    s = s[s.destination == destination].sort_values("context")
    preds = a.tables.get("predictions")
    out = []
    for i, r in enumerate(s.itertuples()):
        c, pf = int(r.context), float(r.prefill_ms)
        lo = getattr(r, "copy_ci_lo_ms", None)
        hi = getattr(r, "copy_ci_hi_ms", None)
        has_ci = lo is not None and pd.notna(lo)
        out.append(_bar(i, c, 0, ROWS[0].format(gpu=gpu_name(source_device(a.record))), "measured", pf, pf))
        out[-1]["text"] += f"; spread {units.sig(float(r.prefill_spread_ms), 3)} ms"
        out[-1]["heading"] = f"Context: {c:,d} tokens; prefill {units.sig(pf, 4)} ms"
        out.append(_bar(i, c, 1, ROWS[1], "measured", float(r.copy_ms), pf,
                        float(lo) if has_ci else None, float(hi) if has_ci else None))
        out.append(_bar(i, c, 2, ROWS[2], "measured", float(r.layerwise_extra_ms), pf,
                        float(r.extra_ci_lo_ms), float(r.extra_ci_hi_ms)))
        if preds is not None:
            net = preds[(preds.destination == "network") & (preds.context == c)]
            for k, p in enumerate(net.sort_values("ms").itertuples()):
                nic = calculator.LINKS[str(p.link)]
                out.append(_bar(i, c, 3 + k, f"predicted: {nic.gbit_per_s:g} Gb/s network card", "predicted",
                                float(p.ms), pf))
    return out


def page(a: Analysis, destination: str | None = None) -> Page:
    """The page for `destination` (default: the run's peer GPU if it measured one, else its first destination)."""
    import altair as alt

    dests = list(dict.fromkeys(a.tables["summary"].destination))
    dest = destination or next((d for d in dests if str(d).startswith("peer-")), dests[0])
    data = rows(a, dest)
    contexts = sorted({r["context"] for r in data})
    labels = ", ".join(f"{i} = {ctx_label(c)}" for i, c in enumerate(contexts))
    p_ctx = alt.param(name="ctx", value=len(contexts) - 1, bind=alt.binding_range(
        min=0, max=len(contexts) - 1, step=1, name=f"Context length ({labels} tokens)"))
    model = (a.record.get("resolved") or {}).get("model", "the model")
    device, commit = run_facts(a.record, a.device_tag)
    base = alt.Chart(alt.Data(values=data)).transform_filter("datum.i === ctx")
    order = list(dict.fromkeys(r["row"] for r in sorted(data, key=lambda r: r["order"])))
    y = alt.Y("row:N", sort=order, title=None, axis=alt.Axis(labelLimit=250, labelFontSize=12))
    bars = base.mark_bar(height=18).encode(
        x=alt.X("pct:Q", title="% of that context's prefill time", scale=alt.Scale(domainMin=-5, domainMax=105)),
        y=y,
        color=alt.Color("kind:N", scale=alt.Scale(domain=["measured", "predicted"], range=["#0072B2", "#FFFFFF"]),
                        legend=alt.Legend(title=None, orient="bottom")),
        stroke=alt.Stroke("kind:N", scale=alt.Scale(domain=["measured", "predicted"], range=["#0072B2", "#555555"]),
                          legend=None),
        strokeDash=alt.StrokeDash("kind:N", scale=alt.Scale(domain=["measured", "predicted"], range=[[1, 0], [4, 3]]),
                                  legend=None),
        tooltip=["row:N", "text:N"])
    whiskers = base.transform_filter("datum.pct_lo != null").mark_rule(color="#000000").encode(
        x="pct_lo:Q", x2="pct_hi:Q", y=y)
    text = base.mark_text(align="left", fontSize=11).encode(x=alt.value(250), y=y, text="text:N")
    heading = base.transform_filter("datum.order === 0").mark_text(align="left", fontSize=14, fontWeight="bold").encode(
        x=alt.value(0), y=alt.value(-12), text=alt.Text("heading:N"))
    chart = alt.layer(bars, whiskers, text, heading).add_params(p_ctx).properties(
        width=240, height=alt.Step(30)).configure_view(stroke=None).configure_axis(labelFontSize=12, titleFontSize=12)
    intro = (f"{model} on {device}: what moving the KV cache to the decode side costs against the prefill that "
             f"built it, {where(dest, source_device(a.record))}. Drag the slider to change the context length. Bars are scaled to prefill; "
             "the black line on a bar is its 95 % interval. The dashed rows are predictions for the same cache over "
             f"a network card (its bytes at the card's nominal rate), not measurements. Run {a.run_id}, code {commit}.")
    return Page(NAME, f"Cost of moving the cache to the decode GPU, against prefill ({model}, median ms)", intro,
                chart)
