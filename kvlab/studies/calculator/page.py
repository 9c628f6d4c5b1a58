"""The calculator as a page a blog post can embed (kvlab.pages): the same arithmetic as kvlab.calculator's
`handoff_estimate`, written as Vega-Lite transforms over the registry's models, so a reader moves the prompt length
and picks a model, a KV dtype, a link, the TP degree and the achieved TFLOP/s in the page, with no kernel.

Each model is one data row (its layers as arrays: which are sliding-window layers), flattened to one row per layer
in the page. Per layer, as the calculator: tokens held (capped by a sliding window), KV bytes, each GPU's share
(heads split while TP ≤ KV heads, replicated beyond; MLA's latent is not split), dense FLOPs shared equally plus that
layer's attention, compute and transfer seconds. The layer-by-layer send (kvlab.exposure.pipeline_exposure) is a
recurrence; the page uses its closed form, which Vega-Lite's running windows can compute: with C and S the running
sums of compute and transfer time, layer i's send ends ``S_i − C_i + max_{k ≤ i}(C_k − S_{k−1})`` after its compute
does, and the last layer's gap is what the handoff exposes after prefill. The browser tests read the numbers back
and compare them with kvlab.calculator for the same inputs.
"""

from __future__ import annotations

import math

from ... import calculator, models
from ...pages import Page

__all__ = ["NAME", "TP_CHOICES", "LINK_KINDS", "link_label", "model_rows", "link_expr", "page"]

NAME = "calculator_page"
TP_CHOICES = (1, 2, 4, 8, 16, 32, 64)
# what each preset is, in words a reader of a post shares (its rate comes from calculator.LINKS)
LINK_KINDS = {"nvlink-h100": "GPU to GPU over NVLink, H100 nominal",
              "nvlink-h100-measured": "GPU to GPU over NVLink, as measured on 2×H100", "pcie5-x16": "PCIe 5.0 x16"}


def link_label(name: str) -> str:
    """A preset in words, its rates from calculator.LINKS: "100G" → "100 Gb/s network card (12.5 GB/s)"."""
    lk = calculator.LINKS[name]
    fixed = f", {lk.fixed_us:g} µs a copy" if lk.fixed_us else ""
    if name not in LINK_KINDS:  # the NIC presets, quoted in bits as NICs are
        return f"{lk.gbit_per_s:g} Gb/s network card ({lk.gbyte_per_s:g} GB/s{fixed})"
    return f"{LINK_KINDS[name]} ({lk.gbyte_per_s:g} GB/s{fixed})"


def model_rows() -> list[dict]:
    """One row per registry model: what the page's arithmetic needs, the per-layer facts as arrays."""
    rows = []
    for name in models.names():
        s = models.get(name)
        layout = s.summary()["kv_layout"]
        rows.append({
            "model": name, "label": f"{name} ({layout}{', MLA' if s.attention == 'mla' else ''})",
            "layers": s.layers, "kv_elements": s.kv_elements_per_token_layer, "heads": s.heads,
            "kv_heads": s.kv_heads, "width": s.head_dim + s.v_head_dim, "active_params": s.active_params,
            "mla": s.attention == "mla", "window": s.sliding_window or 0,
            "layer": list(range(s.layers)), "sliding": [1 if s.is_sliding(i) else 0 for i in range(s.layers)],
            # a hybrid's state layers: no KV, a fixed state per sequence (bytes as calculator.state_layer_bytes)
            "kvl": [0 if i in s.state_layers else 1 for i in range(s.layers)],
            "state": calculator.state_layer_bytes(s)})
    return rows


def link_expr(field: str) -> str:
    """A Vega expression giving the chosen preset's `field` (bytes_per_s, efficiency, fixed_us)."""
    expr = "0"
    for name, lk in reversed(list(calculator.LINKS.items())):
        expr = f"link === {name!r} ? {getattr(lk, field)!r} : ({expr})"
    return expr


def page(model: str = "llama-2-7b", tokens: int = 8192, kv_dtype: str = "bf16", link: str = "100G", tp: int = 1,
         tflops: float = 400.0) -> Page:
    """The calculator page, starting from these inputs (the seed's example: Llama 2 7B on a 100 Gb/s NIC)."""
    import altair as alt

    names = models.names()
    rows = model_rows()
    p_model = alt.param(name="model", value=model, bind=alt.binding_select(
        options=names, labels=[r["label"] for r in rows], name="Model (layers × KV heads × head dim)"))
    p_tokens = alt.param(name="log2_tokens", value=math.log2(tokens), bind=alt.binding_range(
        min=7, max=17, step=0.25, name="Prompt length, log₂ tokens (7 = 128, 17 = 128k)"))
    p_dtype = alt.param(name="kv_dtype", value=kv_dtype, bind=alt.binding_radio(
        options=["bf16", "fp8"], labels=["bf16 (2 bytes)", "fp8 (1 byte)"], name="KV element type"))
    p_link = alt.param(name="link", value=link, bind=alt.binding_select(
        options=list(calculator.LINKS), labels=[link_label(k) for k in calculator.LINKS],
        name="Link from prefill to decode"))
    p_tp = alt.param(name="tp", value=tp, bind=alt.binding_select(
        options=list(TP_CHOICES), name="Tensor parallelism (GPUs, each with its own link)"))
    p_tflops = alt.param(name="tflops", value=tflops, bind=alt.binding_range(
        min=50, max=1000, step=10, name="Achieved prefill TFLOP/s per GPU"))
    params = [p_model, p_tokens, p_dtype, p_link, p_tp, p_tflops]

    base = alt.Chart(alt.Data(values=rows)).transform_filter("datum.model === model").transform_flatten(
        ["layer", "sliding", "kvl", "state"]).transform_calculate(
        T="round(pow(2, log2_tokens))",
        dtype_bytes="kv_dtype === 'fp8' ? 1 : 2",
        # TP: heads split while tp ≤ KV heads (which it must divide), replicated beyond (a multiple of them); MLA's
        # latent is held whole by every GPU
        valid_tp="datum.mla || (tp <= datum.kv_heads ? datum.kv_heads % tp === 0 : tp % datum.kv_heads === 0)",
        share="datum.mla ? 1 : max(floor(datum.kv_heads / tp), 1) / datum.kv_heads",
        replication="datum.mla ? tp : max(floor(tp / datum.kv_heads), 1)",
        held="datum.sliding ? min(datum.T, datum.window) : datum.T",
        layer_bytes="datum.kvl * datum.kv_elements * datum.dtype_bytes * datum.held",
        gpu_bytes="datum.layer_bytes * datum.share + datum.state / tp",  # each rank sends 1/tp of a state
        pairs="datum.sliding && datum.window < datum.T ? datum.window * (datum.window + 1) / 2 + "
              "(datum.T - datum.window) * datum.window : datum.T * (datum.T + 1) / 2",
        flops="2 * datum.active_params * datum.T / datum.layers + datum.kvl * 2 * datum.heads * datum.width * "
              "datum.pairs",
        compute_s="datum.flops / (tp * tflops * 1e12)",
        rate=f"({link_expr('bytes_per_s')}) * ({link_expr('efficiency')})",
        fixed_s=f"({link_expr('fixed_us')}) * 1e-6",
        transfer_s="datum.fixed_s + datum.gpu_bytes / datum.rate",
    ).transform_window(
        C="sum(compute_s)", S="sum(transfer_s)", sort=[{"field": "layer"}], frame=[None, 0],
    ).transform_calculate(
        g="datum.C - datum.S + datum.transfer_s",
    ).transform_window(
        M="max(g)", sort=[{"field": "layer"}], frame=[None, 0],
    ).transform_calculate(
        gap_s="datum.S - datum.C + datum.M",  # layer i's send ends this long after its compute
        wait_s="datum.gap_s - datum.transfer_s",  # how long layer i's KV waited for the link
        last_gap="datum.layer === datum.layers - 1 ? datum.gap_s : -1e300",
    ).transform_joinaggregate(
        prefill_s="sum(compute_s)", kv_bytes="sum(layer_bytes)", gpu_total="sum(gpu_bytes)",
        state_total="sum(state)",
        exposed_s="max(last_gap)", max_wait="max(wait_s)", end_s="max(C)", send_end="max(S)",
    ).transform_calculate(
        bulk_s="datum.fixed_s + datum.gpu_total / datum.rate",
        link_bound="datum.max_wait > 1e-9 * max(datum.end_s, datum.end_s + datum.exposed_s)",
    )

    lines = {
        "a_tokens": "'Prompt: ' + format(datum.T, ',d') + ' tokens'",
        "b_kv": "'KV cache: ' + format(datum.kv_bytes, ',d') + ' bytes (' + format(datum.kv_bytes / 1073741824, "
                "',.4~f') + ' GiB)'",
        "bb_state": "datum.state_total > 0 ? 'Recurrent state (a hybrid\\'s other layers): ' + "
                    "format(datum.state_total, ',d') + ' bytes, whatever the length' : ''",
        "c_gpu": "datum.valid_tp ? 'Sent by each GPU: ' + format(round(datum.gpu_total), ',d') + ' bytes' + "
                 "(datum.replication > 1 ? ' (each KV ' + (datum.mla ? 'latent' : 'head') + ' held by ' + "
                 "datum.replication + ' GPUs)' : '') : 'TP ' + tp + ' does not split ' + datum.model + \"'s \" + "
                 "datum.kv_heads + ' KV heads evenly'",
        "d_prefill": "'Prefill: ' + format(datum.prefill_s * 1e3, ',.5~r') + ' ms'",
        "e_bulk": "'Whole cache sent after prefill: ' + format(datum.bulk_s * 1e3, ',.5~r') + ' ms'",
        "f_ratio": "'Transfer ÷ prefill compute: ' + format(datum.bulk_s / datum.prefill_s, ',.5~r')",
        "g_exposed": "'Layer by layer, exposed after prefill: ' + format(datum.exposed_s * 1e3, ',.5~r') + ' ms'",
        "h_bound": "datum.link_bound ? 'The link falls behind compute: a backlog grows layer by layer' : "
                   "'The link keeps up: only the last layer\\'s send is exposed'",
        "i_heads": "datum.heads % tp === 0 ? '' : datum.heads + ' query heads do not split over ' + tp + "
                   "' GPUs: engines refuse this TP'",
    }
    readout = base.transform_filter("datum.layer === datum.layers - 1").transform_calculate(**lines).transform_fold(
        list(lines), as_=["line", "text"]).transform_filter("datum.valid_tp || datum.line <= 'c_gpu'").mark_text(
        align="left", baseline="middle", fontSize=14, dx=0).encode(
        x=alt.value(0), y=alt.Y("line:N", axis=None, sort=list(lines)), text="text:N",
        description="text:N").properties(width=620, height=22 * len(lines), title="The handoff of one prompt")
    per_layer = base.transform_filter("datum.valid_tp").transform_calculate(
        gap_ms="datum.gap_s * 1e3", compute_ms="datum.compute_s * 1e3", transfer_ms="datum.transfer_s * 1e3",
    ).mark_bar(color="#D55E00").encode(
        x=alt.X("layer:O", title="layer (0 = first)", axis=alt.Axis(labelOverlap=True)),
        y=alt.Y("gap_ms:Q", title="send ends after the layer's compute, ms"),
        tooltip=[alt.Tooltip("layer:O", title="layer"),
                 alt.Tooltip("compute_ms:Q", title="compute, ms", format=",.4~r"),
                 alt.Tooltip("transfer_ms:Q", title="transfer, ms", format=",.4~r"),
                 alt.Tooltip("gap_ms:Q", title="send ends after compute by, ms", format=",.4~r")],
    ).properties(width=620, height=220, title="Per layer: when each layer's send ends, after its compute")
    chart = alt.vconcat(readout, per_layer).add_params(*params).configure_view(stroke=None).configure_title(
        anchor="start", fontSize=15)
    intro = ("How many bytes one prompt's KV cache is, how long the link takes to move it against the prefill that "
             "built it, and what sending it layer by layer, while later layers compute, leaves exposed after "
             "prefill. Move the prompt length, or switch the model, the KV element type, the link or the "
             "tensor parallelism. Sliding-window layers hold only their window; DeepSeek's MLA latent is not split "
             "by TP; a hybrid's linear-attention or Mamba layers hold a fixed state instead, sent with the KV. An "
             "estimate from each model's published shape, not a measurement.")
    return Page(NAME, "The KV-cache bill of one prompt: bytes, link time, and what layer-wise sending hides",
                intro, chart)
