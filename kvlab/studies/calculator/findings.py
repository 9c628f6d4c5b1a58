"""What the calculator study says about one run: a summary table per figure and the findings written from them.

Every function takes tables as the run wrote them (kv_table.csv, and results.csv's rows of one figure through
calcviz.finding_rows) or as `calcviz.timeline_table` makes them, and returns a DataFrame or markdown lines; every
number in a line comes from those tables (model shapes such as a context length come from kvlab.models).
"""

from __future__ import annotations

import pandas as pd

from ... import models
from ...units import fmt_bytes

__all__ = ["kv_shown", "ratio_summary", "tp_summary", "exposure_summary", "kv_lines", "ratio_lines", "tp_lines",
           "exposure_lines", "hybrid_lines"]


def kv_shown(kv: pd.DataFrame) -> pd.DataFrame:
    """The KV table as the notebook shows it: model, attention, layout, KV per token, KV of the prompt, sliding
    layers, parameters (billions)."""
    tokens = int(kv["tokens"].iloc[0])
    at = ["kv_per_token_at_prompt"] if "kv_per_token_at_prompt" in kv else []  # runs since the hybrid bill
    state = ["state"] if "state" in kv else []
    return kv[["model", "attention", "kv_layout", *at, "kv_per_token", "kv_cache", *state, "sliding_layers",
               "params_b"]].rename(
        columns={"kv_layout": "layers × KV heads × dim", "kv_per_token": "KV / token (uncapped)" if at else "KV / token",
                 "kv_per_token_at_prompt": f"KV / token at {tokens:,}", "kv_cache": f"{tokens:,}-token prompt",
                 "state": "state / sequence"})


def kv_lines(kv: pd.DataFrame) -> list[str]:
    """The spread of KV bytes per token across the table's models, and which ones a sliding window caps."""
    tokens = int(kv["tokens"].iloc[0])
    # runs since the hybrid bill rank by what a token costs at the prompt's length (windows full), as the table leads
    col, label, how = (("kv_bytes_per_token_at_prompt", "kv_per_token_at_prompt", f"At {tokens:,} tokens, per token")
                       if "kv_bytes_per_token_at_prompt" in kv else ("kv_bytes_per_token", "kv_per_token", "Per token"))
    big, small = kv.loc[kv[col].idxmax()], kv.loc[kv[col].idxmin()]
    capped = kv[kv["sliding_layers"] > 0]
    text = (f"{how}, **{big.model}** stores the most ({getattr(big, label)}) and **{small.model}** the least "
            f"({getattr(small, label)}), a {getattr(big, col) / getattr(small, col):.0f}× spread. ")
    if len(capped):
        text += ("Sliding windows cap " + ", ".join(f"{r.model} ({r.sliding_layers} of {r.layers} layers)"
                                                   for r in capped.itertuples())
                 + f": at {tokens:,} tokens their caches hold fewer bytes than the uncapped figure × tokens.")
    hybrids = hybrid_lines(kv)
    return [text.rstrip(), *(["", *hybrids] if hybrids else [])]


def hybrid_lines(kv: pd.DataFrame) -> list[str]:
    """What each hybrid of the table saves: its KV layers, its cache at the prompt (KV and per-sequence state), and
    that beside what the same layers would hold if every one attended (per-layer KV × all layers × tokens)."""
    if "state_bytes" not in kv:  # a run from before the hybrid bill
        return []
    tokens = int(kv["tokens"].iloc[0])
    out = []
    for r in kv[kv["state_layers"] > 0].itertuples():
        kv_layers = int(r.layers - r.state_layers)
        dense = r.kv_bytes_per_token / kv_layers * r.layers * tokens
        out.append(f"- **{r.model}** is a hybrid: {kv_layers} of its {r.layers} layers keep KV, the other "
                   f"{r.state_layers} a fixed state of {r.state} per sequence that crosses the wire with it. At "
                   f"{tokens:,} tokens its cache is {r.cache} ({r.kv_cache} KV + {r.state} state), "
                   f"{r.cache_bytes / dense:.1%} of the {fmt_bytes(dense)} its layers would hold if all attended.")
    return out


def ratio_summary(ratio: pd.DataFrame) -> pd.DataFrame:
    """Per model, on the first link of the ratio figure: the transfer / prefill ratio at the shortest prompt, at the
    longest one up to 4,096 tokens (or the shortest, if longer) and at the longest, with attention's share of the
    prefill FLOPs there and whether that prompt is beyond the model's context."""
    link = ratio["link"].iloc[0]
    lengths = sorted(set(ratio["tokens"]))
    mid = max(t for t in lengths if t <= max(4096, lengths[0]))
    rows = []
    for name in dict.fromkeys(ratio["model"]):
        g = ratio[(ratio["model"] == name) & (ratio["link"] == link)].sort_values("tokens").set_index("tokens")
        rows.append({"model": name, "link": link, "tflops": float(g["tflops"].iloc[0]),
                     "short_tokens": int(g.index[0]), "short_ratio": float(g["ratio"].iloc[0]),
                     "mid_tokens": int(mid), "mid_ratio": float(g.loc[mid, "ratio"]),
                     "long_tokens": int(g.index[-1]), "long_ratio": float(g["ratio"].iloc[-1]),
                     "long_attention_fraction": float(g["attention_fraction"].iloc[-1]),
                     "long_beyond_context": bool(g["beyond_context"].iloc[-1])})
    return pd.DataFrame(rows)


def ratio_lines(summary: pd.DataFrame) -> list[str]:
    """How far each model's ratio moves from short to long prompts, and how far apart the models' levels are."""
    first = summary.iloc[0]
    lines = [f"On {first.link}, at {first.tflops:g} TFLOP/s:", ""]
    for r in summary.itertuples():
        beyond = (f", beyond its {models.get(r.model).max_positions:,}-token context" if r.long_beyond_context
                  else "")
        lines.append(f"- **{r.model}**: {r.short_ratio:.3g} at {r.short_tokens:,} tokens, {r.mid_ratio:.3g} at "
                     f"{r.mid_tokens:,} ({(r.mid_ratio / r.short_ratio - 1) * 100:+.0f} %), {r.long_ratio:.3g} at "
                     f"{r.long_tokens:,} ({r.long_ratio / r.short_ratio:.0%} of the short-prompt value; attention is "
                     f"{r.long_attention_fraction:.0%} of prefill FLOPs there{beyond})")
    short = summary.set_index("model")["short_ratio"]
    lines += ["", (f"Across models the level differs by {short.max() / short.min():.0f}× ({short.idxmax()} highest, "
                   f"{short.idxmin()} lowest): that is KV bytes per active parameter (prefill FLOPs per token), not "
                   "prompt length.")]
    return lines


def tp_summary(tp: pd.DataFrame) -> pd.DataFrame:
    """Per model of the TP figure: the per-GPU KV bytes and transfer time at the smallest and largest TP it splits
    over, whether its KV heads run out (replicated) or it is MLA, and the TP degrees its query heads do not split
    over (comma-separated, "" when none)."""
    rows = []
    for name in dict.fromkeys(tp["model"]):
        g = tp[tp["model"] == name].set_index("tp")
        lo, hi = int(g.index.min()), int(g.index.max())
        rows.append({"model": name, "attention": g["attention"].iloc[0], "kv_heads": int(g["kv_heads"].iloc[0]),
                     "heads": models.get(name).heads, "link": g["link"].iloc[0],
                     "link_gbyte_per_s": float(g["link_gbyte_per_s"].iloc[0]), "tokens": int(g["tokens"].iloc[0]),
                     "kv_dtype": g["kv_dtype"].iloc[0], "tp_lo": lo, "tp_hi": hi,
                     "kv_bytes_per_gpu_lo": int(g.loc[lo, "kv_bytes_per_gpu"]),
                     "kv_bytes_per_gpu_hi": int(g.loc[hi, "kv_bytes_per_gpu"]),
                     "transfer_ms_lo": float(g.loc[lo, "transfer_ms"]),
                     "transfer_ms_hi": float(g.loc[hi, "transfer_ms"]),
                     "replicated": bool(g["replicated"].any()),
                     "query_heads_not_split": ", ".join(str(t) for t in g.index[~g["query_heads_split"]])})
    return pd.DataFrame(rows)


def tp_lines(summary: pd.DataFrame) -> list[str]:
    """What TP does to each model's per-GPU share, and what the largest TP's NICs move together."""
    first = summary.iloc[0]
    lines = [f"{first.tokens:,}-token prompt, {first.kv_dtype} KV:", ""]
    for r in summary.itertuples():
        b0, b1 = r.kv_bytes_per_gpu_lo, r.kv_bytes_per_gpu_hi
        shrink = f"{b0 / b1:.0f}× less" if b1 < b0 else "no less"
        line = (f"- **{r.model}**: {fmt_bytes(b0)} per GPU at TP={r.tp_lo} → {fmt_bytes(b1)} at TP={r.tp_hi} "
                f"({shrink}; {r.transfer_ms_lo:.1f} → {r.transfer_ms_hi:.1f} ms on {r.link})")
        if r.attention == "mla":
            line += ": the latent is replicated on every rank, so TP does not shrink it"
        elif r.replicated:
            line += (f": its {r.kv_heads} KV heads run out at TP={r.kv_heads}, beyond which each head is replicated "
                     "and the share stops shrinking")
        if r.query_heads_not_split:
            line += f" (its {r.heads} query heads do not split over TP={r.query_heads_not_split})"
        lines.append(line)
    most = int(summary["tp_hi"].max())
    lines += ["", f"At TP={most}, {most} NICs of {first.link} move {first.link_gbyte_per_s * most:,.0f} GB/s together."]
    return lines


def exposure_summary(exp: pd.DataFrame, timelines: pd.DataFrame) -> pd.DataFrame:
    """Per case on the exposure figure's first link (the link of `timelines`): the TTFT added, as ms and as % of
    prefill, whether the link falls behind, and the mean per-layer compute and transfer time and the last layer's
    wait for the link (from the case's timeline). ValueError when a timeline's exposed time differs from the
    run's own (then the calculator's arithmetic changed since the run)."""
    at_first = exp[exp["link"] == exp["link"].iloc[0]]
    rows = []
    for r in at_first.itertuples():
        tl = timelines[timelines["case"] == r.case].sort_values("layer")
        if not len(tl):
            raise ValueError(f"case {r.case!r}: no timeline on {exp['link'].iloc[0]}")
        if abs(tl["exposed_s"].iloc[0] * 1e3 - r.exposed_ms) > 1e-9 * max(1.0, r.exposed_ms):
            raise ValueError(f"case {r.case!r}: the timeline exposes {tl['exposed_s'].iloc[0] * 1e3:.6g} ms, the run "
                             f"{r.exposed_ms:.6g} ms: the calculator changed since this run")
        rows.append({"case": r.case, "link": tl["link"].iloc[0], "tokens": int(r.tokens), "tflops": float(r.tflops),
                     "exposed_ms": float(r.exposed_ms), "exposed_pct_of_prefill": float(r.exposed_pct_of_prefill),
                     "prefill_ms": float(r.prefill_ms), "link_bound": bool(r.link_bound),
                     "compute_ms_per_layer": float(tl["compute_s"].mean() * 1e3),
                     "transfer_ms_per_layer": float(tl["transfer_s"].mean() * 1e3),
                     "last_backlog_ms": float(tl["backlog_s"].iloc[-1] * 1e3)})
    return pd.DataFrame(rows)


def exposure_lines(summary: pd.DataFrame, exp: pd.DataFrame) -> list[str]:
    """Each case on the first link — link-bound or keeping up, and by how much — and the most any case exposes on
    the last link."""
    first = summary.iloc[0]
    lines = [f"On **{first.link}**, {first.tokens:,}-token prompt, {first.tflops:g} TFLOP/s:", ""]
    for r in summary.itertuples():
        per_c, per_t = r.compute_ms_per_layer, r.transfer_ms_per_layer
        if r.link_bound:
            verdict = (f"**link-bound**: {per_t:.2f} ms of transfer per layer against {per_c:.2f} ms of compute, so "
                       f"the last layer waits {r.last_backlog_ms:.1f} ms for the link")
        else:
            verdict = (f"keeps up ({per_t:.2f} ms of transfer per layer under {per_c:.2f} ms of compute): only the "
                       "last layer is exposed")
        lines.append(f"- **{r.case}** exposes {r.exposed_ms:,.2f} ms ({r.exposed_pct_of_prefill:.1f} % of its "
                     f"{r.prefill_ms:,.0f} ms prefill); {verdict}")
    last = exp["link"].iloc[-1]
    at_last = exp[exp["link"] == last]["exposed_ms"]
    lines += ["", f"On {last} every case exposes at most {at_last.max():.2f} ms."]
    return lines
