"""Tables, figures and the interactive widget of the calculator study (notebook 00_calculator).

The arithmetic lives in :mod:`kvlab.calculator` and :mod:`kvlab.exposure`; this module only sweeps it into tidy
pandas tables (one row per configuration, units in column names) and draws them. Each ``*_table`` function
returns a DataFrame; each ``plot_*`` function takes that DataFrame and returns a matplotlib Figure (the study's
`figures`, which the notebook saves with ``kvlab.plots.save``). `finding_rows` reads one figure's rows back from
a run's results.csv with the types the plots expect.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import pandas as pd

from ... import calculator as calc
from ... import models as _models
from ... import plots
from ...exposure import Exposure

__all__ = [
    "public_models",
    "resolve_models",
    "parse_case",
    "powers_of_two",
    "kv_table",
    "ratio_table",
    "tp_table",
    "exposure_table",
    "timeline_table",
    "timelines_of",
    "finding_rows",
    "plot_kv_table",
    "plot_ratio",
    "plot_tp",
    "plot_exposure",
    "plot_timeline",
    "estimate_html",
    "calculator_widget",
]

TEST_MODELS = ("kvlab-tiny",)


def public_models() -> list[str]:
    """Registry names of published models (the built-in test config left out)."""
    return [n for n in _models.names() if n not in TEST_MODELS]


def resolve_models(names: str | Sequence[str]) -> list[str]:
    """``"all"`` → :func:`public_models`; otherwise each name checked against the registry and
    returned as its registry name (aliases resolved). Unknown → ValueError listing known names."""
    if isinstance(names, str):
        if names.strip().lower() == "all":
            return public_models()
        names = [n for n in names.split(",") if n.strip()]
    if not isinstance(names, Sequence) or not names:
        raise ValueError(f"models={names!r}: give 'all' or a non-empty list of registry names "
                         f"({', '.join(_models.names())})")
    return list(dict.fromkeys(_models.get(n).name for n in names))


def parse_case(case: str | Sequence[str]) -> tuple[str, str]:
    """``"llama-2-7b:fp8"`` or ``["llama-2-7b", "fp8"]`` → (registry name, kv dtype); the dtype
    defaults to bf16. Bad model or dtype → ValueError."""
    if isinstance(case, str):
        model, _, dtype = case.partition(":")
    elif isinstance(case, Sequence) and len(case) in (1, 2):
        model, dtype = case[0], (case[1] if len(case) == 2 else "")
    else:
        raise ValueError(f"exposure case {case!r}: use 'model' or 'model:kv_dtype'")
    dtype = dtype.strip() or "bf16"
    calc.dtype_bytes(dtype)
    return _models.get(model.strip()).name, dtype


def powers_of_two(lo: int, hi: int) -> list[int]:
    """``lo, 2·lo, 4·lo … ≤ hi`` (``lo`` ≥ 1, ``hi`` ≥ ``lo``), plus ``hi`` if it is not one."""
    if not isinstance(lo, int) or not isinstance(hi, int) or lo < 1 or hi < lo:
        raise ValueError(f"need integers 1 ≤ lo ≤ hi, got lo={lo!r}, hi={hi!r}")
    out = [lo]
    while out[-1] * 2 <= hi:
        out.append(out[-1] * 2)
    if out[-1] != hi:
        out.append(hi)
    return out


def _link_label(lk: calc.Link) -> str:
    if lk.name in calc.LINKS:
        return lk.name
    return f"{lk.gbit_per_s:g} Gb/s"


# ---- tables -----------------------------------------------------------------------------------


def kv_table(names: Iterable[str], tokens: int = 8192, kv_dtype: str = "bf16"):
    """Seed 000's table: one row per model — layout, KV bytes per token and for one prompt.

    Columns: model, attention, layers, kv_heads, head_dim, kv_layout (text), kv_bytes_per_token (uncapped: every
    attention layer's K and V for one more token), kv_per_token (text, KiB), tokens, kv_cache_bytes (window-capped),
    kv_cache (text), kv_bytes_per_token_at_prompt (``kv_cache_bytes / tokens``: what a token costs at this prompt's
    length once windows are full), kv_per_token_at_prompt (text), state_layers, state_bytes (a hybrid's
    per-sequence state, ``calculator.recurrent_state_bytes``), state (text), cache_bytes (KV + state), cache (text),
    sliding_layers, sliding_window, params_b, active_params_b, kv_dtype.
    """
    rows = []
    for name in names:
        s = _models.get(name)
        per_token = calc.kv_bytes_per_token(s, kv_dtype)
        total = calc.kv_cache_bytes(s, tokens, kv_dtype)
        state = calc.recurrent_state_bytes(s)
        summ = s.summary()
        rows.append({
            "model": s.name, "attention": s.attention, "layers": s.layers,
            "kv_heads": s.kv_heads, "head_dim": s.head_dim, "kv_layout": summ["kv_layout"],
            "kv_bytes_per_token": per_token, "kv_per_token": calc.fmt_bytes(per_token),
            "tokens": tokens, "kv_cache_bytes": total, "kv_cache": calc.fmt_bytes(total),
            "kv_bytes_per_token_at_prompt": total / tokens, "kv_per_token_at_prompt": calc.fmt_bytes(total / tokens),
            "state_layers": len(s.state_layers), "state_bytes": state,
            "state": calc.fmt_bytes(state) if state else "—",
            "cache_bytes": total + state, "cache": calc.fmt_bytes(total + state),
            "sliding_layers": len(s.sliding_layers), "sliding_window": s.sliding_window,
            "params_b": s.params / 1e9, "active_params_b": s.active_params / 1e9,
            "kv_dtype": kv_dtype,
        })
    return pd.DataFrame(rows)


def plot_kv_table(df):
    """Horizontal bars: KV bytes per token (KiB) per model at the prompt's length (sliding windows full, a hybrid's
    state layers adding none), the uncapped figure as an outline beside it, labelled with the prompt's whole cache
    (KV, plus a hybrid's state)."""
    import matplotlib.pyplot as plt

    d = df.iloc[::-1]
    fig, ax = plt.subplots(figsize=(7.0, 0.42 * len(d) + 1.2))
    colors = {"mha": "#D55E00", "gqa": "#0072B2", "mqa": "#56B4E9", "mla": "#009E73"}
    at_prompt = d["kv_bytes_per_token_at_prompt"] / 1024
    ax.barh(d["model"], d["kv_bytes_per_token"] / 1024, color="none", edgecolor="#999999", linewidth=0.8)
    ax.barh(d["model"], at_prompt, color=[colors[a] for a in d["attention"]])
    for y, r in enumerate(d.itertuples()):
        label = r.cache if not r.state_bytes else f"{r.kv_cache} KV + {r.state} state"
        ax.text(max(r.kv_bytes_per_token, r.kv_bytes_per_token_at_prompt) / 1024, y, f"  {label}", va="center",
                fontsize=8)
    tokens, dtype = int(df["tokens"].iloc[0]), df["kv_dtype"].iloc[0]
    ax.set_xlabel(f"KV per token at a {tokens:,}-token prompt (KiB, {dtype}); label: the prompt's cache\n"
                  "outline: uncapped (every attention layer's K and V for one more token)")
    ax.set_xlim(0, d["kv_bytes_per_token"].max() / 1024 * 1.45)
    ax.set_title("KV cache per token")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[a]) for a in colors
               if a in set(d["attention"])]
    ax.legend(handles, [a.upper() for a in colors if a in set(d["attention"])], fontsize=8,
              loc="lower right")
    ax.grid(axis="y", visible=False)
    fig.tight_layout()
    return fig


def _row(est: calc.HandoffEstimate, lk: calc.Link, **extra: Any) -> dict[str, Any]:
    return {**est.as_row(), "link": _link_label(lk), "link_gbyte_per_s": lk.gbyte_per_s, **extra}


def ratio_table(names: Iterable[str], links: Iterable[Any], lengths: Iterable[int],
                kv_dtype: str = "bf16", tflops: float = 400.0):
    """Transfer-to-prefill ratio over prompt lengths (seed finding 1): one row per
    (model, link, tokens); adds ``attention_fraction`` (share of prefill FLOPs in attention) and
    ``beyond_context`` (tokens > the model's max_position_embeddings)."""
    rows = []
    for name in names:
        s = _models.get(name)
        for ln in links:
            lk = calc.link(ln)
            for t in lengths:
                est = calc.handoff_estimate(s, t, lk, kv_dtype, tp=1, tflops=tflops)
                rows.append(_row(est, lk, finding="ratio_vs_length",
                                 attention_fraction=calc.prefill_flops(s, t).attention_fraction,
                                 beyond_context=bool(s.max_positions and t > s.max_positions)))
    return pd.DataFrame(rows)


def tp_table(names: Iterable[str], tokens: int, link_: Any, tps: Iterable[int],
             kv_dtype: str = "bf16", tflops: float = 400.0):
    """Per-GPU KV bytes and transfer time over TP degrees, each GPU on its own NIC (seed finding
    2). One row per (model, tp); TP degrees that cannot split a model's KV heads are skipped.
    Adds kv_heads, kv_heads_per_gpu, replicated, query_heads_split and the shard's note."""
    lk = calc.link(link_)
    rows = []
    for name in names:
        s = _models.get(name)
        for tp in tps:
            try:
                est = calc.handoff_estimate(s, tokens, lk, kv_dtype, tp=tp, tflops=tflops)
            except ValueError:
                continue  # e.g. tp=3 on 8 KV heads: not a configuration anyone can run
            sh = est.shard
            rows.append(_row(est, lk, finding="tp_scaling", kv_heads=s.kv_heads,
                             attention=s.attention, kv_heads_per_gpu=sh.kv_heads_per_gpu,
                             replicated=sh.replicated, query_heads_split=sh.query_heads_split,
                             note=sh.note))
    return pd.DataFrame(rows)


def exposure_table(cases: Iterable[Any], links: Iterable[Any], tokens: int,
                   tflops: float = 400.0, tp: int = 1):
    """Exposed time of a layer-by-layer handoff over links (seed finding 3): one row per
    (case, link), a case being ``"model:kv_dtype"``. Adds ``case``, ``hidden_fraction`` and
    ``exposed_pct_of_prefill``."""
    rows = []
    for case in cases:
        model, dtype = parse_case(case)
        for ln in links:
            lk = calc.link(ln)
            est = calc.handoff_estimate(model, tokens, lk, dtype, tp=tp, tflops=tflops)
            rows.append(_row(est, lk, finding="exposure_vs_link", case=f"{model} {dtype}",
                             hidden_fraction=est.timeline.hidden_fraction,
                             exposed_pct_of_prefill=100 * est.exposed_s / est.prefill_s))
    return pd.DataFrame(rows)


def timeline_table(cases: Iterable[Any], link_: Any, tokens: int, tflops: float = 400.0, tp: int = 1):
    """The layer-by-layer timeline of each case's handoff over one link (the exposure figure's right panel): one
    row per (case, layer), seconds from the start of prefill. Columns: case ("model kv_dtype"), link (its name),
    layer, compute_s, transfer_s, compute_end_s, send_start_s, send_end_s, backlog_s (kvlab.exposure.Exposure's
    per-layer fields) and exposed_s (the case's, on every row)."""
    lk = calc.link(link_)
    rows = []
    for case in cases:
        model, dtype = parse_case(case)
        tl = calc.handoff_estimate(model, tokens, lk, dtype, tp=tp, tflops=tflops).timeline
        for i in range(len(tl.compute_s)):
            rows.append({"case": f"{model} {dtype}", "link": lk.name, "layer": i, "compute_s": tl.compute_s[i],
                         "transfer_s": tl.transfer_s[i], "compute_end_s": tl.compute_end_s[i],
                         "send_start_s": tl.send_start_s[i], "send_end_s": tl.send_end_s[i],
                         "backlog_s": tl.backlog_s[i], "exposed_s": tl.exposed_s})
    return pd.DataFrame(rows)


def timelines_of(df) -> dict[str, Exposure]:
    """`timeline_table`'s rows back as one kvlab.exposure.Exposure per case, in the table's order."""
    out = {}
    for case, g in df.groupby("case", sort=False):
        g = g.sort_values("layer")
        out[case] = Exposure(*(tuple(float(v) for v in g[c]) for c in (
            "compute_s", "transfer_s", "compute_end_s", "send_start_s", "send_end_s", "backlog_s")),
            exposed_s=float(g["exposed_s"].iloc[0]))
    return out


# the columns of results.csv each figure's rows carry (the tidy table holds all three, NaN where a row has none)
_BOOL_COLUMNS = ("link_bound", "beyond_context", "replicated", "query_heads_split")
_INT_COLUMNS = ("tokens", "tp", "kv_bytes", "kv_bytes_per_gpu", "kv_replication", "kv_heads", "kv_heads_per_gpu")
FINDINGS = ("ratio_vs_length", "tp_scaling", "exposure_vs_link")


def finding_rows(results, finding: str):
    """The rows of one figure (`finding`: one of FINDINGS) from a run's tidy results table, as read back from
    results.csv: the columns no row of it has dropped, flags as bool and counts as int again (a CSV column holding
    NaN for the other figures' rows reads as float or object), the index 0…n-1. ValueError for an unknown
    `finding`; a run without such rows gives an empty table."""
    if finding not in FINDINGS:
        raise ValueError(f"finding = {finding!r}: valid: {', '.join(FINDINGS)}")
    rows = results[results["finding"] == finding].dropna(axis=1, how="all").reset_index(drop=True)
    for col in _BOOL_COLUMNS:
        if col in rows.columns:
            rows[col] = rows[col].map(lambda v: v if isinstance(v, bool) else str(v).strip() == "True").astype(bool)
    for col in _INT_COLUMNS:
        if col in rows.columns:
            rows[col] = rows[col].astype("int64")
    return rows


# ---- figures ----------------------------------------------------------------------------------


def _colors(names: Iterable[str]) -> dict[str, str]:
    return plots.palette(list(names))


def _log2_ticks(ax, values: Sequence[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(values))
    ax.set_xticklabels([f"{v // 1024}K" if v >= 1024 and v % 1024 == 0 else str(v)
                        for v in values])
    ax.minorticks_off()


def plot_ratio(df, tflops: float | None = None):
    """Ratio (transfer / prefill) against prompt length: one panel per link, a line per model;
    dashed beyond a model's context length."""
    import matplotlib.pyplot as plt

    links = list(dict.fromkeys(df["link"]))
    colors = _colors(dict.fromkeys(df["model"]))
    fig, axes = plt.subplots(1, len(links), figsize=(5.2 * len(links), 4.2), sharey=True,
                             squeeze=False)
    for ax, ln in zip(axes[0], links):
        sub = df[df["link"] == ln]
        for model, g in sub.groupby("model", sort=False):
            g = g.sort_values("tokens")
            inside = g[~g["beyond_context"]]
            ax.plot(inside["tokens"], inside["ratio"], marker="o", ms=3.5, color=colors[model],
                    label=model)
            # Continue dashed past max_position_embeddings: arithmetic, not a usable prompt.
            tail = g[g["tokens"] >= (inside["tokens"].max() if len(inside) else 0)]
            if g["beyond_context"].any():
                ax.plot(tail["tokens"], tail["ratio"], ls="--", lw=1.2, color=colors[model])
        _log2_ticks(ax, sorted(set(sub["tokens"]))[::2])
        ax.set_yscale("log")
        ax.set_title(f"{ln} link")
        ax.set_xlabel("prompt length (tokens)")
        ax.axhline(1.0, color="#8C8C8C", lw=1, ls=":")
    axes[0][0].set_ylabel("transfer time / prefill time")
    note = f" at {tflops:g} TFLOP/s" if tflops else ""
    fig.suptitle(f"KV transfer vs prefill compute{note}: flat until attention's T² term "
                 "(dashed: beyond the model's context)", x=0.01, ha="left", fontsize=11)
    fig.tight_layout()
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0),
               ncol=min(len(labels), 5), fontsize=9)
    return fig


def plot_tp(df):
    """Per-GPU transfer time against TP (each GPU on its own NIC), with the ideal 1/TP line;
    hollow markers where the model's query heads do not split over that many GPUs."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.0, 4.4))
    colors = _colors(dict.fromkeys(df["model"]))
    for model, g in df.groupby("model", sort=False):
        g = g.sort_values("tp")
        c = colors[model]
        kv = "latent" if g["attention"].iloc[0] == "mla" else f"{g['kv_heads'].iloc[0]} KV heads"
        ax.plot(g["tp"], g["transfer_ms"], color=c, marker="o", label=f"{model} ({kv})")
        odd = g[~g["query_heads_split"]]
        if len(odd):
            ax.plot(odd["tp"], odd["transfer_ms"], ls="none", marker="o", mfc="white", mec=c,
                    ms=8)
        base = g[g["tp"] == g["tp"].min()]
        ax.plot(g["tp"], base["transfer_ms"].iloc[0] * base["tp"].iloc[0] / g["tp"], ls=":",
                lw=1, color=c)
        knee = g[g["replicated"]]
        if len(knee) and g["attention"].iloc[0] != "mla":
            first = knee.iloc[0]
            ax.annotate("KV heads replicated", (first["tp"], first["transfer_ms"]),
                        textcoords="offset points", xytext=(-10, 12), ha="right", fontsize=8,
                        color=c)
    _log2_ticks(ax, sorted(set(df["tp"])))
    ax.set_yscale("log")
    ax.set_xlabel("tensor-parallel degree (GPUs, one NIC each)")
    ax.set_ylabel("transfer time per GPU (ms)")
    tokens, ln = int(df["tokens"].iloc[0]), df["link"].iloc[0]
    ax.set_title(f"TP shards the KV cache and the network ({tokens:,} tokens, {ln} per GPU)")
    ax.legend(fontsize=8, loc="lower left")
    ax.text(0.99, 0.99, "dotted: ideal 1/TP · hollow: query heads do not split",
            transform=ax.transAxes, ha="right", va="top", fontsize=8, color="#666666")
    fig.tight_layout()
    return fig


def plot_exposure(df, timelines: dict[str, Exposure] | None = None,
                  timeline_link: str | None = None):
    """Left: exposed time against link per case (filled = link-bound). Right (when
    ``timelines`` is given): each case's per-layer backlog on ``timeline_link``."""
    import matplotlib.pyplot as plt

    panels = 2 if timelines else 1
    fig, axes = plt.subplots(1, panels, figsize=(5.4 * panels, 4.2), squeeze=False)
    ax = axes[0][0]
    links = list(dict.fromkeys(df["link"]))
    colors = _colors(dict.fromkeys(df["case"]))
    x = {ln: i for i, ln in enumerate(links)}
    for case, g in df.groupby("case", sort=False):
        xs = [x[ln] for ln in g["link"]]
        ys = g["exposed_pct_of_prefill"].to_numpy()
        bound = g["link_bound"].to_numpy(dtype=bool)
        ax.plot(xs, ys, color=colors[case], label=case, lw=1.5)
        for xi, yi, b in zip(xs, ys, bound):
            ax.scatter([xi], [yi], zorder=3, s=36, edgecolor=colors[case],
                       facecolor=colors[case] if b else "white")
    ax.set_xticks(range(len(links)))
    ax.set_xticklabels(links, rotation=20)
    ax.set_yscale("log")
    ax.set_ylabel("TTFT added, % of prefill time")
    tokens = int(df["tokens"].iloc[0])
    ax.set_title(f"Layer-wise handoff, {tokens:,}-token prompt")
    ax.legend(fontsize=8, loc="lower left")
    ax.text(0.99, 0.99, "filled: link-bound", transform=ax.transAxes, ha="right", va="top",
            fontsize=8, color="#666666")
    if timelines:
        ax2 = axes[0][1]
        for case, tl in timelines.items():
            # How long after a layer is final its KV has landed: its own transfer while the link
            # keeps up, plus a backlog that grows layer by layer when it does not.
            lag = [(e - c) * 1e3 for e, c in zip(tl.send_end_s, tl.compute_end_s)]
            ax2.plot(range(len(lag)), lag, color=colors.get(case),
                     label=f"{case}: {tl.exposed_s * 1e3:.1f} ms exposed")
        ax2.set_xlabel("layer")
        ax2.set_ylabel("layer done → its KV landed (ms)")
        ax2.set_title(f"Layer by layer on {timeline_link}")
        ax2.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    return fig


def plot_timeline(est: calc.HandoffEstimate):
    """One handoff, layer by layer. Top: when each layer's KV is final and when it has landed. Bottom: the gap
    between the two (landed − computed), which the top panel hides when the lines coincide: it is what the
    link adds per layer, and its value at the last layer is what the first token waits for."""
    import matplotlib.pyplot as plt

    tl = est.timeline
    layers = list(range(len(tl.compute_end_s)))
    fig, (ax, gap_ax) = plt.subplots(2, 1, figsize=(7.0, 4.8), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    done = [v * 1e3 for v in tl.compute_end_s]
    landed = [v * 1e3 for v in tl.send_end_s]
    ax.plot(layers, done, label="layer computed (KV final)", color="#000000")
    ax.plot(layers, landed, label="layer's KV landed on decode GPU", color="#D55E00", ls="--")
    ax.fill_between(layers, done, landed, color="#D55E00", alpha=0.15)
    ax.set_ylabel("ms since prefill start")
    verdict = "link-bound" if est.link_bound else "link keeps up"
    ax.set_title(f"{est.model}, {est.tokens:,} tokens, {est.kv_dtype}, {est.link}, TP={est.tp}: "
                 f"{est.exposed_s * 1e3:.2f} ms exposed ({verdict})", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    gaps = [b - a for a, b in zip(done, landed)]
    gap_ax.bar(layers, gaps, color="#D55E00", width=0.8)
    gap_ax.set_ylabel("landed − computed\n(ms)", fontsize=9)
    gap_ax.set_xlabel("layer")
    gap_ax.annotate(f"last layer: {gaps[-1]:.2f} ms = the exposed time", (layers[-1], gaps[-1]),
                    xytext=(-4, 4), textcoords="offset points", ha="right", va="bottom", fontsize=8)
    gap_ax.set_ylim(0, max(gaps + [1e-3]) * 1.6)
    fig.tight_layout()
    return fig


def estimate_html(est: calc.HandoffEstimate) -> str:
    """The calculator's numbers for one configuration as a small HTML table."""
    verdict = "link-bound" if est.link_bound else "all hidden but the last layer"
    rows = [
        ("KV cache (whole model)", calc.fmt_bytes(est.kv_bytes)),
        ("KV sent per GPU", f"{calc.fmt_bytes(est.kv_bytes_per_gpu)}"
                            + (f" ({est.shard.note})" if est.tp > 1 else "")),
        ("prefill", f"{est.prefill_s * 1e3:,.1f} ms ({est.prefill_flops / 1e12:,.0f} TFLOP)"),
        ("bulk transfer after prefill", f"{est.transfer_s * 1e3:,.2f} ms"),
        ("transfer / prefill", f"{est.ratio:.3f}"),
        ("layer-wise: TTFT added", f"{est.exposed_s * 1e3:,.2f} ms ({verdict})"),
    ]
    body = "".join(f"<tr><td style='text-align:left'>{k}</td><td style='text-align:left'>{v}</td>"
                   "</tr>" for k, v in rows)
    return f"<table>{body}</table>"


def calculator_widget(model: str = "llama-2-7b", tokens: int = 8192, kv_dtype: str = "bf16",
                      link_: str = "100G", tp: int = 1, tflops: float = 400.0):
    """An ipywidgets calculator: model, prompt length, KV dtype, link, TP and achieved TFLOP/s;
    every change redraws the numbers and the layer-by-layer timeline. Returns the widget box
    (display it). Bad combinations (a TP that does not split the KV heads) show their error."""
    import ipywidgets as w
    import matplotlib.pyplot as plt
    from IPython.display import HTML, display

    lengths = powers_of_two(128, 131072)
    if tokens not in lengths:
        lengths = sorted({*lengths, tokens})
    controls = {
        "model": w.Dropdown(options=public_models(), value=_models.get(model).name,
                            description="model"),
        "tokens": w.SelectionSlider(options=lengths, value=tokens, description="prompt tokens",
                                    continuous_update=False),
        "kv_dtype": w.Dropdown(options=list(calc.DTYPE_BYTES), value=kv_dtype,
                               description="KV dtype"),
        "link_": w.Dropdown(options=list(calc.LINKS), value=calc.link(link_).name,
                            description="link"),
        "tp": w.Dropdown(options=[1, 2, 4, 8, 16], value=tp, description="TP"),
        "tflops": w.FloatSlider(value=tflops, min=50, max=2000, step=25,
                                description="TFLOP/s/GPU", continuous_update=False),
    }

    def redraw(model, tokens, kv_dtype, link_, tp, tflops):
        try:
            est = calc.handoff_estimate(model, tokens, link_, kv_dtype, tp=tp, tflops=tflops)
        except ValueError as err:
            display(HTML(f"<b>not a valid configuration:</b> {err}"))
            return
        display(HTML(estimate_html(est)))
        fig = plot_timeline(est)
        plt.show()
        plt.close(fig)

    for c in controls.values():  # labels at their full width: "prompt tokens", not "prompt to…"
        c.style = {"description_width": "initial"}
    out = w.interactive_output(redraw, controls)
    boxes = list(controls.values())
    return w.VBox([w.HBox(boxes[:3]), w.HBox(boxes[3:]), out])
