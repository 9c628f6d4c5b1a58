"""The disagg study's interactive pages, each made from several committed runs (`kvlab report` writes them, from the
runs data/PUBLISHED.yaml's `pages` names):

- ttft_by_backend: what the decode side's time to first token adds over colocated, one bar per backend and layout
  (the runs), with its 95 % interval; a slider for the context, a switch between bulk and layer-wise sending.
- faults: a fault campaign's time from each faulty request to its decision (refused, or recovered with the
  colocated tokens), by fault kind and policy, median with the slowest beside; a dropdown picks the campaign (a
  backend on a host), and the text says what came of every fault."""

from __future__ import annotations

from ... import units
from ...pages import Page, where
from ...study import Analysis, ctx_label, host_label

__all__ = ["TTFT", "FAULTS", "ttft_rows", "ttft_page", "fault_rows", "faults_page", "PAGES"]

TTFT, FAULTS = "ttft_by_backend", "faults_by_kind"  # beside the figures disagg_ttft and faults
MODES = {"bulk": "one send after prefill", "layerwise": "layer by layer, during prefill"}


def _backend(a: Analysis, layout: str) -> str:
    s = a.record.get("summary") or {}
    b = str(s.get("backend", "?"))
    label = {"ipc": "CUDA IPC", "nccl": "NCCL", "gloo": "gloo (through the CPU)", "nixl": "NIXL"}.get(b, b)
    descs = (a.record.get("parameters") or {}).get("nixl_descs")
    if b == "nixl" and layout == "paged" and descs:
        label += f", {descs} descriptors"
    return f"{label}, {layout} cache"


def ttft_rows(analyses: list[Analysis]) -> list[dict]:
    """One row per (run, layout, mode, context): the paired TTFT extra over colocated with its interval, as text too."""
    out = []
    for a in analyses:
        for r in a.tables["summary"].itertuples():
            out.append({"row": _backend(a, r.layout), "run": a.run_id, "layout": r.layout, "mode": r.mode,
                        "context": int(r.context),
                        "extra_ms": float(r.ttft_extra_ms), "lo": float(r.ttft_extra_ms_lo),
                        "hi": float(r.ttft_extra_ms_hi),
                        "text": f"{r.ttft_extra_ms:+.2f} ms [{r.ttft_extra_ms_lo:+.2f}, {r.ttft_extra_ms_hi:+.2f}] over "
                                f"colocated's {units.sig(r.colocated_ttft_ms, 4)} ms"})
    return out


def _facts(analyses: list[Analysis]) -> tuple[str, str, str]:
    """(model, where the cache goes, run ids) of the runs a page shows."""
    s = [a.record.get("summary") or {} for a in analyses]
    model = ", ".join(dict.fromkeys(str(x.get("model", "?")) for x in s))
    paths = ", ".join(dict.fromkeys(where("peer-" + str(x.get("decode_device")) if x.get("decode_device") !=
                                          x.get("prefill_device") else "same-gpu", str(x.get("prefill_device")))
                                    for x in s))
    return model, paths, ", ".join(a.run_id for a in analyses)


def ttft_page(analyses: list[Analysis]) -> Page:
    """What each backend adds to the time to first token, by context and send mode."""
    import altair as alt

    data = ttft_rows(analyses)
    contexts = sorted({r["context"] for r in data})
    for r in data:
        r["i"] = contexts.index(r["context"])
    modes = [m for m in MODES if any(r["mode"] == m for r in data)]
    p_ctx = alt.param(name="ctx", value=len(contexts) - 1, bind=alt.binding_range(
        min=0, max=len(contexts) - 1, step=1,
        name="Context (" + ", ".join(f"{i} = {ctx_label(c)}" for i, c in enumerate(contexts)) + " tokens)"))
    p_mode = alt.param(name="mode", value=modes[0], bind=alt.binding_radio(
        options=modes, labels=[MODES[m] for m in modes], name="How the cache is sent"))
    base = alt.Chart(alt.Data(values=data)).transform_filter("datum.i === ctx && datum.mode === mode")
    y = alt.Y("row:N", title=None, sort=list(dict.fromkeys(r["row"] for r in data)),
              axis=alt.Axis(labelFontSize=12, labelLimit=260))
    bars = base.mark_bar(height=14, color="#0072B2").encode(
        x=alt.X("extra_ms:Q", title="time to first token − colocated (ms, median of paired rounds)"), y=y,
        tooltip=["row:N", "text:N"])
    whiskers = base.mark_rule(color="black", strokeWidth=1.5).encode(x="lo:Q", x2="hi:Q", y=y)
    text = base.mark_text(align="left", fontSize=11, dy=14).encode(x=alt.value(0), y=y, text="text:N")
    heading = base.transform_aggregate(n="count()", groupby=["context"]).transform_calculate(
        label="'Context: ' + format(datum.context, ',d') + ' tokens'").mark_text(
        align="left", fontSize=14, fontWeight="bold").encode(x=alt.value(0), y=alt.value(-14), text="label:N")
    chart = alt.layer(bars, whiskers, text, heading).add_params(p_ctx, p_mode).properties(
        width=320, height=alt.Step(44)).configure_view(stroke=None)
    model, paths, runs = _facts(analyses)
    wrong = sum(int(a.tables["summary"]["mismatched"].sum()) for a in analyses)
    intro = (f"Prefill and decode as two processes, {model}, {paths}: what handing the cache over adds to the decode "
             "side's time to first token, against the same prompt prefilled and decoded in one process in the same "
             "round. One bar per backend and cache layout; the black line is its 95 % interval. Drag the slider to "
             "change the context; switch between one send after prefill and layer-by-layer sending. Decodes that "
             f"differed from colocated, over all runs: {wrong}. Runs {runs}.")
    return Page(TTFT, "What moving the KV cache adds to the first token, by backend", intro, chart)


def _campaign(a: Analysis) -> str:
    s = a.record.get("summary") or {}
    b = str(s.get("backend", "?")) + (" in order" if s.get("in_order") else "")
    kinds = ", ".join(sorted((s.get("outcomes_by_kind") or {})))
    return f"{b} on a {host_label(a.record)}: {kinds}"


def fault_rows(analyses: list[Analysis]) -> list[dict]:
    """One row per (campaign, policy, kind): faults, the median and slowest time to a decision, what came of them."""
    out = []
    for a in analyses:  # each run's fault table, as its analysis made it (kvlab.studies.disagg.analysis.fault_table)
        f = a.raw["faults"]
        deadline = float(f["fault_timeout_s"].iloc[0]) * 1e3 if "fault_timeout_s" in f else float("nan")
        for r in a.tables["fault_summary"].to_dict("records"):
            median, slowest, wrong = r["decision median ms"], r["decision max ms"], r["decodes ≠ colocated"]
            outcomes = r["outcome"].replace(", ", "; ")  # no outcome's name holds a comma
            out.append({"campaign": _campaign(a), "run": a.run_id, "policy": str(r["policy"]),
                        "base": str(r["policy"]), "kind": str(r["kind"]), "faults": int(r["faults"]),
                        "median_ms": float(median), "max_ms": float(slowest), "deadline_ms": deadline,
                        "text": f"median {units.sig(median, 3)} ms, slowest {units.sig(slowest, 3)} ms\n{outcomes}; "
                                f"{wrong} decodes ≠ colocated"})
    # a campaign may hold two runs of one policy (a rerun after a change): their bars are told apart by run
    seen: dict[tuple, set] = {}
    for r in out:
        seen.setdefault((r["campaign"], r["policy"]), set()).add(r["run"])
    for r in out:
        if len(seen[(r["campaign"], r["policy"])]) > 1:
            r["policy"] = f"{r['policy']} (run {r['run']})"
    for r in out:
        r["row"] = f"{r['kind']} · {r['policy']}"
    return out


def faults_page(analyses: list[Analysis]) -> Page:
    """A fault campaign's time to each decision, by kind and policy."""
    import altair as alt

    data = fault_rows(analyses)
    campaigns = list(dict.fromkeys(r["campaign"] for r in data))
    bases = list(dict.fromkeys(r["base"] for r in data))
    p_camp = alt.param(name="campaign", value=campaigns[0], bind=alt.binding_select(options=campaigns,
                                                                                     name="Campaign"))
    base = alt.Chart(alt.Data(values=data)).transform_filter("datum.campaign === campaign")
    # one row per fault kind and policy, named in words (the colour repeats the policy, never alone)
    y = alt.Y("row:N", title=None, axis=alt.Axis(labelFontSize=11, labelLimit=230))
    colour = alt.Color("base:N", legend=None, scale=alt.Scale(domain=bases, range=["#0072B2", "#D55E00", "#009E73",
                                                                                  "#E69F00"][:len(bases)]))
    x = alt.X("median_ms:Q", title="request → decision (ms): bar the median, tick the slowest; log axis",
              scale=alt.Scale(type="log", domainMin=1))
    bars = base.transform_calculate(floor="1").mark_bar(height=12).encode(
        x=x, x2="floor:Q", y=y, color=colour, tooltip=["row:N", "text:N"])
    ticks = base.mark_tick(color="black", thickness=2, size=14).encode(x="max_ms:Q", y=y)
    deadline = base.transform_aggregate(d="max(deadline_ms)").mark_rule(strokeDash=[4, 3], color="#555").encode(x="d:Q")
    chart = alt.layer(bars, ticks, deadline).add_params(p_camp).properties(width=380, height=alt.Step(18))
    # each fault kind and policy in two lines of words (a line break Vega draws), none cut short
    lines = base.transform_calculate(line="datum.row + ': ' + datum.text").mark_text(
        align="left", baseline="top", fontSize=10.5, lineBreak="\n").encode(
        x=alt.value(0), y=alt.Y("line:N", title=None, axis=None, sort="ascending"), text="line:N")
    page_chart = alt.vconcat(chart, lines.properties(width=380, height=alt.Step(30))).configure_view(stroke=None)
    partial = sum(int((a.record.get("summary") or {}).get("decoded_from_partial", 0)) for a in analyses)
    intro = ("A fault campaign injects faults into the handoff between the prefill and decode processes — a layer "
             "dropped, delayed or corrupted, the sender killed, the decode side out of memory — and holds the decode "
             "side to a policy: fail (refuse the request), retry (send again) or recompute (prefill again on the "
             "decode side). Each bar is the median time from a faulty request to its decision, the tick the "
             "slowest; the dashed line is the deadline the decode side waits before it calls a send lost. Below, "
             f"what came of every fault; decodes from a partial cache, over all campaigns: {partial}. Pick a campaign in "
             f"the list ({len(analyses)} runs, named below).")
    return Page(FAULTS, "Faults between prefill and decode: time to refuse or recover", intro, page_chart)


PAGES = {"ttft_by_backend": ttft_page, "faults": faults_page}
