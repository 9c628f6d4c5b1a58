"""Congestion at cluster scale: at what offered load does a layer-wise send stop hiding the KV transfer, and how far
do FP8 on the wire and admission control move that point (notebook 08, simulated: no GPU).

Seed 000 ends its agenda with congestion ("KV bursts share a fabric with everything else") and says layer-wise
pipelining hides the transfer "until the link falls behind". One prompt on an idle link is the calculator's case
(kvlab.calculator.handoff_estimate); many prompts on a shared fabric are kvlab's fabric simulator's
(kvlab.fabric: SimPy, flows shared max-min fairly over NICs, leaves and spines; validated against measured contention
in the contention study and against a rate-limited link by tools/linkbound.py). Here one cluster is swept over
offered load for each link rate and send variant (bulk, layer-wise, deadline; `+fp8`: FP8 with its scales on the
wire; `+admission`: at most `max_inflight` handoffs into a decode worker at once), the points run on Dask
(kvlab.fabric.sweep.run_points). Per point the simulator's TTFT and exposed-transfer percentiles; beside them the
calculator's single-flow exposure of the median prompt. The knee of a (link, variant): the lowest swept load at which
the p99 exposed transfer passes KNEE_SHARE of the median prompt's prefill time (the calculator's, at the same
TFLOP/s) — the load where the transfer stops being hidden for the slowest requests.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pandas as pd

from ... import calculator, devices, models, plots
from ...fabric.sweep import run_points
from ...fabric.topology import TopologyConfig
from ...fabric.workload import SimConfig
from ...results import Run
from ...study import Analysis, Param, at_least, check_params, md_table, sig

__all__ = ["NAME", "NOTEBOOK", "TITLE", "QUESTION", "FIGURES", "PARAMS", "Config", "check", "measure", "analyse",
           "figures", "BLOCKS", "goal_table", "parse_variant", "knees", "KNEE_SHARE"]

NAME = "congestion"
NOTEBOOK = "08_congestion"
TITLE = "Congestion on a cluster's fabric"
QUESTION = ("At what offered load does a layer-wise send stop hiding the KV transfer on a 100G and a 400G NIC, and "
            "how far do FP8 on the wire and admission control move that point?")
FIGURES = ("congestion_knee",)

KNEE_SHARE = 0.10  # the knee: p99 exposed transfer > this share of the median prompt's prefill time
SENDS = ("bulk", "layerwise", "deadline")
MODIFIERS = ("fp8", "admission")
# "full": the cluster of the question, 1,000 requests a point (a few minutes on 2 cores); "small": the logic in seconds
SIZES = {
    "full": {"gpus": 64, "nodes_per_leaf": 2, "prefill_workers": 48, "decode_workers": 16, "requests": 1000,
             "loads": "0.2,0.35,0.5,0.65,0.8,0.9,0.95"},
    "small": {"gpus": 16, "nodes_per_leaf": 1, "prefill_workers": 12, "decode_workers": 4, "requests": 120,
              "loads": "0.3,0.9"},
}


def parse_variant(value: str, name: str = "variants") -> tuple[str, bool, bool]:
    """ "layerwise+fp8" → ("layerwise", fp8=True, admission=False): a send (bulk, layerwise, deadline) and any of the
    modifiers +fp8 (FP8 with its scales on the wire) and +admission (the decode side's cap on handoffs in flight)."""
    send, *mods = [v.strip() for v in str(value).split("+")]
    bad = [m for m in mods if m not in MODIFIERS]
    if send not in SENDS or bad or len(set(mods)) != len(mods):
        raise ValueError(f"{name}: {value!r} is not a send variant; give one of {', '.join(SENDS)}, optionally with "
                         f"{' and '.join('+' + m for m in MODIFIERS)} (\"layerwise+fp8\")")
    return send, "fp8" in mods, "admission" in mods


def _variants(value, name):
    got = [v.strip() for v in str(value).split(",") if v.strip()]
    if not got or len(set(got)) != len(got):
        raise ValueError(f"{name} = {value!r}: give distinct send variants, comma-separated (\"bulk,layerwise+fp8\")")
    for v in got:
        parse_variant(v, name)


def _loads(value, name):
    if value == "auto":
        return
    try:
        got = [float(v) for v in str(value).split(",") if v.strip()]
    except ValueError:
        got = []
    if not got or not all(0 < v < 1 for v in got) or got != sorted(set(got)):
        raise ValueError(f"{name} = {value!r}: give increasing offered loads between 0 and 1 (exclusive), "
                         "comma-separated, such as 0.2,0.5,0.8; or \"auto\"")


def _links(value, name):
    got = [v.strip() for v in str(value).split(",") if v.strip()]
    if not got:
        raise ValueError(f"{name} = {value!r}: give link rates such as 100G,400G")
    rates = []
    for v in got:
        try:
            rates.append(calculator.link(v).gbit_per_s)
        except ValueError as err:
            raise ValueError(f"{name}: {v!r}: {err}") from None
    if len(set(rates)) != len(rates):
        raise ValueError(f"{name} = {value!r}: a link rate is given twice; give each once")


def _model(value, name):
    try:
        models.get(value)
    except ValueError as err:
        raise ValueError(f"{name}: {err}") from None


def _above(lo: float, inclusive: bool):
    def check(value, name):
        if not (value >= lo if inclusive else value > lo):
            raise ValueError(f"{name} = {value!r}: must be {'≥' if inclusive else '>'} {lo:g}")
    return check


def _size(value, name):
    if value not in ("auto", *SIZES):
        raise ValueError(f"{name} = {value!r} is not valid; valid: auto, {', '.join(SIZES)}")


PARAMS = (
    Param("size", "str", "auto", "\"full\" (64 GPUs in 4 leaves, 48 prefill → 16 decode, 7 loads, 1,000 requests a "
          "point: minutes on 2 cores) or \"small\" (16 GPUs, 2 loads, 120 requests: seconds); \"auto\": full where "
          "a GPU is (the preset), else small; no GPU is used", _size),
    Param("model", "str", "llama-2-7b", "registry name: the cache each request sends (seed 000's example model)",
          _model),
    Param("links", "str", "100G,400G", "each GPU's NIC, comma-separated (\"100G\", \"400Gb/s\")", _links),
    Param("variants", "str", "bulk,layerwise,layerwise+fp8,layerwise+admission", "send variants, comma-separated: "
          "bulk, layerwise or deadline, each optionally +fp8 and/or +admission", _variants),
    Param("loads", "str", "auto", "offered prefill loads, comma-separated, increasing, in (0, 1); \"auto\": the "
          "size's", _loads),
    Param("max_inflight", "int", 2, "+admission: handoffs into one decode worker at once, the rest queue", at_least(1)),
    Param("oversubscription", "float", 1.0, "each leaf's downlink over its uplink capacity (1: non-blocking)",
          _above(1, True)),
    Param("prompt_tokens", "int", 2048, "the median prompt (lognormal, log-σ 0.8, clipped to 128–32k)", at_least(1)),
    Param("tflops", "float", 400.0, "achieved prefill TFLOP/s per GPU", _above(0, False)),
    Param("seed", "int", 0, "the simulation's seed (the same seed and parameters give the same results)",
          at_least(0)),
    Param("workers", "int", 0, "Dask workers of the local cluster; 0: one per core", at_least(0)),
    Param("scheduler", "str", "", "a running Dask scheduler's address (\"tcp://host:8786\"); \"\": a local cluster",
          lambda v, n: None),
)


@dataclass(frozen=True)
class Config:
    """One run: the size and what it resolved to, the model, links and variants, the loads, the admission cap, the
    fabric's oversubscription, the median prompt, TFLOP/s, the seed, and where the points run."""

    size: str
    model: str
    links: list
    variants: list
    loads: list
    max_inflight: int
    oversubscription: float
    prompt_tokens: int
    tflops: float
    seed: int
    workers: int
    scheduler: str

    def resolved(self) -> dict:
        s = SIZES[self.size]
        return {"size": self.size, **{k: v for k, v in s.items() if k != "loads"}, "model": self.model,
                "links": self.links, "variants": self.variants, "loads": self.loads,
                "max_inflight": self.max_inflight, "oversubscription": self.oversubscription,
                "prompt_tokens": self.prompt_tokens, "tflops": self.tflops, "seed": self.seed,
                "workers": self.workers or os.cpu_count() or 1, "scheduler": self.scheduler or "local",
                "knee_share": KNEE_SHARE, "points": len(self.links) * len(self.variants) * len(self.loads)}

    def points(self) -> list[tuple[dict, SimConfig]]:
        """Every (labels, SimConfig) of the run, in order: link × variant × load."""
        s = SIZES[self.size]
        out = []
        for link in self.links:
            topo = TopologyConfig(gpus=s["gpus"], nodes_per_leaf=s["nodes_per_leaf"],
                                  nic_gbit_s=calculator.link(link).gbit_per_s, oversubscription=self.oversubscription)
            for variant in self.variants:
                send, fp8, admission = parse_variant(variant)
                for load in self.loads:
                    cfg = SimConfig(topology=topo, prefill_workers=s["prefill_workers"],
                                    decode_workers=s["decode_workers"], model=self.model, tflops=self.tflops,
                                    requests=s["requests"], load=load, prompt_tokens=self.prompt_tokens, send=send,
                                    fp8=fp8, max_inflight=self.max_inflight if admission else None, seed=self.seed)
                    out.append(({"link": link, "variant": variant, "load": load}, cfg))
        return out


def check(params) -> Config:
    """The run's Config: each value checked, "auto" resolved, and every point's SimConfig built (so a bad
    combination is refused in one line) — before anything is written."""
    p = check_params(PARAMS, params, NAME)
    size = p["size"] if p["size"] != "auto" else ("small" if devices.preset() == "cpu" else "full")
    loads = SIZES[size]["loads"] if p["loads"] == "auto" else p["loads"]
    split = lambda s: [v.strip() for v in str(s).split(",") if v.strip()]  # noqa: E731
    cfg = Config(size=size, model=models.get(p["model"]).name, links=split(p["links"]), variants=split(p["variants"]),
                 loads=[float(v) for v in split(loads)], max_inflight=p["max_inflight"],
                 oversubscription=float(p["oversubscription"]), prompt_tokens=p["prompt_tokens"],
                 tflops=float(p["tflops"]), seed=p["seed"], workers=p["workers"], scheduler=p["scheduler"])
    try:
        cfg.points()
    except ValueError as err:
        raise ValueError(f"{NAME}: {err}") from None
    return cfg


def single_flow(cfg: Config) -> pd.DataFrame:
    """The calculator's one prompt on an idle link, per (link, variant): the median prompt's prefill time and its
    exposed transfer (bulk: the whole transfer; layer-wise and deadline: the pipelined backlog), in bf16 or FP8 (the
    calculator counts FP8 without its scales, where the simulator sends its `fp8_factor` of the bf16 bytes)."""
    out = []
    for link in cfg.links:
        for variant in cfg.variants:
            send, fp8, _ = parse_variant(variant)
            e = calculator.handoff_estimate(cfg.model, cfg.prompt_tokens, link, "fp8" if fp8 else "bf16",
                                            tflops=cfg.tflops)
            out.append({"link": link, "variant": variant, "prompt_tokens": cfg.prompt_tokens,
                        "prefill_ms": e.prefill_s * 1e3, "transfer_ms": e.transfer_s * 1e3,
                        "calc_exposed_ms": (e.bulk_exposed_s if send == "bulk" else e.exposed_s) * 1e3})
    return pd.DataFrame(out)


def measure(cfg: Config, run: Run) -> None:
    """The calculator's single-flow answers (single_flow.csv), then every point on Dask with a progress bar
    (points.csv: one row per link × variant × load, the simulator's summary)."""
    run.update(resolved=cfg.resolved())
    run.save_table(single_flow(cfg), "single_flow")
    rows = run_points(cfg.points(), scheduler=cfg.scheduler or None, n_workers=cfg.workers or None)
    run.save_table(rows, "points")


def knees(t: pd.DataFrame) -> pd.DataFrame:
    """Per (link, variant): the threshold (KNEE_SHARE of the median prompt's prefill time), the knee — the lowest load
    whose p99 exposed transfer passes it — and the load below it that did not (`below`: NaN when the lowest load
    already does), or NaN and `beyond` True when no swept load does."""
    out = []
    for (link, variant), g in t.groupby(["link", "variant"], sort=False):
        g = g.sort_values("load")
        limit = KNEE_SHARE * float(g["prefill_ms"].iloc[0])
        over = g[g["transfer_exposed_p99_ms"] > limit]
        knee = float(over["load"].iloc[0]) if len(over) else float("nan")
        under = g[g["load"] < knee] if len(over) else g
        out.append({"link": link, "variant": variant, "threshold_ms": limit, "knee_load": knee,
                    "below": float(under["load"].iloc[-1]) if len(under) else float("nan"),
                    "beyond": not len(over), "max_load": float(g["load"].max())})
    return pd.DataFrame(out)


def _knee_words(r) -> str:
    if r.beyond:
        return f"no knee up to load {r.max_load:g}"
    if r.below != r.below:
        return f"past the threshold already at the lowest load ({r.knee_load:g})"
    return f"knee between load {r.below:g} and {r.knee_load:g}"


def analyse(record: dict, tables: dict) -> Analysis:
    """The points joined to the calculator's single-flow answers (`congestion`), the knees, and a finding per
    (link, variant): where its knee lies, and at the lowest load the simulated median exposed transfer beside the
    calculator's."""
    t = tables["points"].merge(tables["single_flow"], on=["link", "variant"], how="left")
    k = knees(t)
    findings, values = [], {}
    lowest = t[t["load"] == t["load"].min()].set_index(["link", "variant"])
    for r in k.itertuples():
        lo = lowest.loc[(r.link, r.variant)]
        values[f"{r.link}.{r.variant}.knee"] = _knee_words(r)
        findings.append(f"- {r.link}, {r.variant}: {_knee_words(r)} (p99 exposed transfer > {sig(r.threshold_ms)} ms, "
                        f"{100 * KNEE_SHARE:.0f} % of the median prompt's prefill). At load {lo.load:g} the median exposed "
                        f"transfer is {sig(lo.transfer_exposed_p50_ms)} ms simulated, {sig(lo.calc_exposed_ms)} ms by "
                        "the calculator for the median prompt alone.")
    for link, g in k.groupby("link", sort=False):  # the answer: how far each modifier moves layer-wise's knee
        base = g[g["variant"] == "layerwise"]
        moved = g[g["variant"].str.startswith("layerwise+")]
        if len(base) and len(moved):
            parts = "; ".join(f"{r.variant}: {_knee_words(r)}" for r in moved.itertuples())
            findings.append(f"- On {link}, layer-wise: {_knee_words(base.iloc[0])}; {parts}.")
    return Analysis(NAME, record, raw=dict(tables), tables={"congestion": t, "knees": k}, findings=findings,
                    values=values)


def goal_table(a: Analysis, study: str) -> pd.DataFrame:
    """No goals judge this study's runs: it answers a question with a figure (issue 30's last goal)."""
    return pd.DataFrame()


def figures(a: Analysis) -> dict:
    """Per link (columns): the p99 exposed transfer against offered load, one line per variant, the knee threshold
    dashed and each knee marked (top), and the p50 and p99 TTFT (bottom)."""
    import matplotlib.pyplot as plt  # matplotlib only when a figure is drawn

    t, k = a.tables["congestion"], a.tables["knees"]
    links = list(dict.fromkeys(t["link"]))
    variants = list(dict.fromkeys(t["variant"]))
    colors = plots.palette(variants)
    fig, axes = plt.subplots(2, len(links), figsize=(5.4 * len(links), 7.9), squeeze=False, sharex=True,
                             layout="constrained")
    for j, link in enumerate(links):
        top, bottom = axes[0][j], axes[1][j]
        for v in variants:
            g = t[(t["link"] == link) & (t["variant"] == v)].sort_values("load")
            top.plot(g["load"], g["transfer_exposed_p99_ms"], marker="o", ms=3.5, color=colors[v],
                     label=v if j == 0 else None)
            bottom.plot(g["load"], g["ttft_p99_ms"], marker="o", ms=3.5, color=colors[v])
            bottom.plot(g["load"], g["ttft_p50_ms"], ls="--", color=colors[v], alpha=0.7)
            kr = k[(k["link"] == link) & (k["variant"] == v)].iloc[0]
            if not kr.beyond:
                y = g.loc[g["load"] == kr.knee_load, "transfer_exposed_p99_ms"].iloc[0]
                top.scatter([kr.knee_load], [y], s=90, facecolors="none", edgecolors=colors[v], linewidths=1.6,
                            zorder=3)
        thr = k[k["link"] == link]["threshold_ms"].iloc[0]
        top.axhline(thr, color="0.4", lw=0.9, ls=":", label=f"knee: {100 * KNEE_SHARE:.0f} % of prefill" if j == 0 else None)
        top.set_yscale("log")
        bottom.set_yscale("log")
        top.set_title(f"{link} NIC per GPU")
        top.set_ylabel("exposed transfer, p99 (ms)") if j == 0 else None
        bottom.set_ylabel("TTFT (ms)") if j == 0 else None
        bottom.set_xlabel("offered prefill load")
    from matplotlib.lines import Line2D

    extra = [Line2D([], [], color="0.3", marker="o", ms=3.5, label="TTFT p99"),
             Line2D([], [], color="0.3", ls="--", label="TTFT p50")]
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles + extra, labels + [h.get_label() for h in extra], loc="outside lower center",
               ncol=min(len(handles) + 2, 4), fontsize=8.5, frameon=False)
    r = a.record.get("resolved") or {}
    fig.suptitle(f"{r.get('model', '')}: {r.get('prefill_workers', '?')} prefill → {r.get('decode_workers', '?')} "
                 f"decode GPUs, {r.get('requests', '?')} requests a point (simulated); a ring marks each knee",
                 fontsize=11.5)
    return {"congestion_knee": fig}


def _table(analyses: list[Analysis], link, **_) -> str:
    """Per run, link and variant: the knee, its threshold, and at the lowest and highest load the p99 exposed
    transfer and p99 TTFT; the calculator's single-flow exposure of the median prompt beside the lowest load's
    median."""
    rows = []
    for a in analyses:
        t = a.tables["congestion"]
        for r in a.tables["knees"].itertuples():
            g = t[(t["link"] == r.link) & (t["variant"] == r.variant)].sort_values("load")
            lo, hi = g.iloc[0], g.iloc[-1]
            rows.append({"run": link(a.where), "NIC": r.link, "send": r.variant, "knee": _knee_words(r),
                         "threshold ms": sig(r.threshold_ms),
                         f"exposed p50 ms at {lo.load:g} (calculator)": f"{sig(lo.transfer_exposed_p50_ms)} "
                                                                        f"({sig(lo.calc_exposed_ms)})",
                         f"exposed p99 ms at {lo.load:g} / {hi.load:g}": f"{sig(lo.transfer_exposed_p99_ms)} / "
                                                                         f"{sig(hi.transfer_exposed_p99_ms)}",
                         f"TTFT p99 ms at {lo.load:g} / {hi.load:g}": f"{sig(lo.ttft_p99_ms)} / {sig(hi.ttft_p99_ms)}"})
    return md_table(pd.DataFrame(rows))


BLOCKS = {"table": _table}
