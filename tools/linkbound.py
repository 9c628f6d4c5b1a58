"""The link-bound regime, measured: `kvlab disagg` over gloo between two network stacks (two namespaces joined by a
veth pair, kvlab.netns) whose link the kernel's token-bucket shaper holds to a rate slower than compute, bulk and
layer-wise, beside the calculator's pipelined model (kvlab.exposure.pipeline_exposure) at each rate.

    sudo PYTHONPATH=. .venv/bin/python tools/linkbound.py                       # ratios 0.25 … 4, 9 rounds each
    sudo PYTHONPATH=. .venv/bin/python tools/linkbound.py --ratios 0.5,2 --repeats 9 --out /tmp/lb

How it goes: a first, unshaped run measures the colocated prefill (the same model, context and threads) and sets
each rate so that one layer's send over the shaped link takes `ratio` × one layer's compute; then one shaped run
per rate, every round a colocated prefill, a bulk and a layer-wise request (kvlab disagg's own interleaving), the
exposure being its own: the last layer landed on the decode side minus the end of prefill, one clock (both
namespaces share this host's kernel).

The model, fixed before any shaped run: layer i computes for the request's measured prefill time × its share of
the prefill FLOPs (calculator.prefill_flops), and its K and V cross at the shaped rate × TCP's payload share of a
frame (kvlab.netns.payload_share: 1448 of 1514 bytes at MTU 1500; tbf counts headers). Bulk: all bytes after
prefill. Layer-wise: the pipelined exposure. Nothing is fitted to the shaped runs.

The model is kvlab-linkbound, an 8-layer Qwen2-shaped config written into the result folder (random weights):
kvlab-tiny's two layers leave nothing to pipeline. Writes linkbound.csv (issue 30's columns, plus the error and
its interval), goals.csv (kvlab.goals' linkbound goals), meta.json (host, commit, status: running until done, so a
stopped run says so) and runs/ (each `kvlab disagg` run folder, and in runs/logs/ each rank's torchrun output).
Needs root and iproute2; a CPU host.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from kvlab import calculator, goals, models, netns, provenance  # noqa: E402
from kvlab.exposure import pipeline_exposure  # noqa: E402
from kvlab.intervals import median_ci  # noqa: E402

MODEL = {  # 8 layers of 2 KV heads × 64, fp32: 1 KiB of K and V a token a layer
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "torch_dtype": "float32", "use_sliding_window": False, "sliding_window": None, "max_window_layers": 8,
}
PORT = 29500


def _parse_list(text: str, name: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--{name} {text!r}: give numbers separated by commas, such as 0.25,1,4") from None
    if not vals or any(not np.isfinite(v) or v <= 0 for v in vals):
        raise SystemExit(f"--{name} {text!r}: give positive numbers separated by commas, such as 0.25,1,4")
    return vals


def _disagg(nodes, out: Path, model: Path, args, tag: str) -> dict:
    """One `kvlab disagg` run across the two namespaces (rank 0, decode, in node 0; rank 1, prefill, in node 1)."""
    common = ["-m", "kvlab", "disagg", "--backend", "gloo", "--model", str(model), "--kv-dtype", "fp32",
              "--context", str(args.context), "--device", "cpu", "--decode-device", "cpu", "--mode", "bulk,layerwise",
              "--repeats", str(args.repeats_now), "--warmup", "1",
              "--decode-tokens", "4", "--timeout", "600", "--quiet"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVLAB_", "GLOO_", "MASTER_"))}
    env.update(KVLAB_CONTROL_KEY=secrets.token_hex(32),
               PYTHONPATH=os.pathsep.join(x for x in (str(ROOT), env.get("PYTHONPATH")) if x),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")
    logs_dir = out.parent / "logs"  # beside the run folder, which kvlab disagg makes itself (and never reuses)
    logs_dir.mkdir(parents=True, exist_ok=True)
    procs, paths = [], [logs_dir / f"{out.name}-rank{rank}.log" for rank in range(2)]
    for rank, (ns, _, _) in enumerate(nodes):
        argv = ["torchrun", "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(rank), "--master-addr",
                nodes[0][2], "--master-port", str(PORT), *common, *(["--out", str(out)] if rank == 0 else [])]
        with open(paths[rank], "w", encoding="utf-8") as log:  # each rank's output straight to its file: no pipe
            procs.append(subprocess.Popen(["ip", "netns", "exec", ns, *argv], cwd=ROOT, env=env, text=True,
                                          stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + args.timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"kvlab disagg ({tag}) took longer than --timeout {args.timeout:g} s; its output: "
                           f"{', '.join(map(str, paths))}") from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    logs = [path.read_text(encoding="utf-8", errors="replace") for path in paths]
    if any(p.returncode for p in procs):
        said = [ln for log in logs for ln in log.splitlines()
                if ("Error" in ln or "error:" in ln) and "torch/distributed/elastic" not in ln]
        tail = "\n".join(said[-12:])
        raise RuntimeError(f"kvlab disagg ({tag}) failed: return codes {[p.returncode for p in procs]}\n{tail}")
    return json.loads((out / "summary.json").read_text())


def _requests(run: Path) -> pd.DataFrame:
    r = pd.read_csv(run / "requests.csv")
    r = r[~r["warmup"].astype(bool)]
    if not r[r["mode"] != "colocated"]["same_host"].astype(bool).all():
        raise RuntimeError(f"{run}: rows without one clock (same_host false): no exposure to compare")
    bad = r[(r["mode"] != "colocated") & ~r["tokens_match"].astype(bool)]
    if len(bad):
        raise RuntimeError(f"{run}: {len(bad)} requests decoded differently from the colocated run")
    return r


def ready_share(spec, tokens: int) -> float:
    """The share of a layer's prefill FLOPs done when its K and V are ready: kvlab disagg's layer-wise hook fires
    at the cache write (contiguous layout), after the q, k and v projections and before attention, its output
    projection and the MLP. 2·T·hidden·(q + 2·kv widths) of the layer's FLOPs (calculator.prefill_flops)."""
    per_layer = calculator.prefill_flops(spec, tokens).per_layer()[0]
    qkv = 2 * tokens * spec.hidden_size * (spec.heads + 2 * spec.kv_heads) * spec.head_dim
    return qkv / per_layer


def released_exposure(compute, transfer, share: float) -> float:
    """Exposure (s, end of the last send minus the end of prefill; negative when it lands first) of layer sends
    released `share` of the way through each layer's compute, each waiting for the link: share 1 is the
    calculator's pipelined model (kvlab.exposure.pipeline_exposure)."""
    ends = np.cumsum(compute)
    ready = ends - np.asarray(compute) * (1 - share)
    end = 0.0
    for r, t in zip(ready, transfer):
        end = max(end, r) + t
    return float(end - ends[-1])


def bucket_exposure(compute, nbytes, share: float, rate: float, bucket: float) -> float:
    """As `released_exposure`, over tbf's token bucket: `bucket` bytes (full when a request starts: the link was
    idle before it) pass at once, the rest at `rate` bytes a second; the bucket refills at the rate while the link
    is idle, up to its size. Bytes here are payload bytes (the bucket and rate × netns.payload_share())."""
    ends = np.cumsum(compute)
    ready = ends - np.asarray(compute) * (1 - share)
    free, level, last = 0.0, bucket, 0.0
    for r, n in zip(ready, nbytes):
        start = max(r, free)
        level = min(bucket, level + (start - last) * rate)
        took = max(0.0, n - level) / rate
        level, free = max(0.0, level - n), start + took
        last = free
    return float(free - ends[-1])


def _predict(spec, tokens: int, prefill_ms: float, rate_bps: float, mode: str,
             burst_bytes: float) -> tuple[float, float, float, float]:
    """(predicted exposed ms as linkbound.model declares it, the same with sends released at the hook point, that
    with tbf's bucket of `burst_bytes`, mean per-layer transfer ÷ compute) for one request at one shaped rate."""
    shares = np.array(calculator.prefill_flops(spec, tokens).per_layer())
    compute = prefill_ms / 1e3 * shares / shares.sum()
    rate = rate_bps / 8 * netns.payload_share()
    nbytes = np.array(calculator.kv_layer_bytes(spec, tokens, "fp32"), dtype=float)
    transfer = nbytes / rate
    ratio = float(transfer.mean() / compute.mean())
    bucket = burst_bytes * netns.payload_share()
    if mode == "bulk":  # sent after prefill: where the hook fires does not matter
        after = bucket_exposure([prefill_ms / 1e3], [nbytes.sum()], 1.0, rate, bucket)
        return float(transfer.sum() * 1e3), float(transfer.sum() * 1e3), after * 1e3, ratio
    declared = pipeline_exposure(list(compute), list(transfer)).exposed_s
    if abs(released_exposure(compute, transfer, 1.0) - declared) > 1e-9:
        raise AssertionError("released_exposure at share 1 is not the pipelined model")
    at = ready_share(spec, tokens)
    return (declared * 1e3, released_exposure(compute, transfer, at) * 1e3,
            bucket_exposure(compute, nbytes, at, rate, bucket) * 1e3, ratio)


def _abs_err(med: float, lo: float, hi: float, pred: float, scale: float | None = None) -> tuple[float, float, float]:
    """|measured − predicted| ÷ scale in % (scale: the prediction unless given, i.e. |measured ÷ predicted − 1|), and
    its interval from the median's (the prediction and the scale held fixed)."""
    scale = pred if scale is None else scale
    e, a, b = (med - pred) / scale * 100, (lo - pred) / scale * 100, (hi - pred) / scale * 100
    if np.isnan(a) or np.isnan(b):
        return abs(e), float("nan"), float("nan")
    a, b = min(a, b), max(a, b)  # a negative prediction turns the interval round
    return abs(e), (0.0 if a <= 0 <= b else min(abs(a), abs(b))), max(abs(a), abs(b))


def rejudge(out: Path, why: str) -> None:
    """Work the errors, their intervals and the verdicts out again from a finished folder's linkbound.csv (its
    measured medians, intervals and predictions are kept as they are), and say so in meta.json."""
    t = pd.read_csv(out / "linkbound.csv")
    for col in ("", "_hooked", "_bucket"):
        pred = f"predicted{col}_ms"
        if pred not in t:
            continue
        errs = [_abs_err(r.exposed_ms, r.exposed_lo, r.exposed_hi, getattr(r, pred)) for r in t.itertuples()]
        t[f"abs_err{col}_pct"], t[f"abs_err{col}_lo"], t[f"abs_err{col}_hi"] = zip(*errs)
    if "err_ttft_pct" in t:  # only in folders made since linkbound.model_bucket_ttft was declared
        errs = [_abs_err(r.exposed_ms, r.exposed_lo, r.exposed_hi, r.predicted_bucket_ms, r.prefill_ms)
                for r in t.itertuples()]
        t["err_ttft_pct"], t["err_ttft_lo"], t["err_ttft_hi"] = zip(*errs)
    t.to_csv(out / "linkbound.csv", index=False)
    before = pd.read_csv(out / "goals.csv")
    judged = goals.evaluate(goals.for_study("linkbound"), t, keys=("rate_gbps", "mode"))
    judged.to_csv(out / "goals.csv", index=False)
    key = ["id", "rate_gbps", "mode"]
    both = before.merge(judged, on=key, how="outer", suffixes=("_before", "_after"))
    changed = [f"{r.id} {r.rate_gbps * 1e3:.2f} Mbit/s {r.mode}: {r.verdict_before} → {r.verdict_after}"
               for r in both.itertuples() if r.verdict_before != r.verdict_after]
    meta = json.loads((out / "meta.json").read_text(encoding="utf-8"))
    meta.setdefault("rejudged", []).append({"utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                                            "commit": provenance.git_state(ROOT).get("commit"), "why": why,
                                            "verdicts_changed": changed})
    _write_meta(out, meta)
    draw(out)


def draw(out: Path) -> None:
    """summary.md (the table and the verdicts, written from linkbound.csv and goals.csv) and linkbound.png (measured
    exposure with its interval against the per-layer ratio, both models beside it) into a finished result folder."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    t = pd.read_csv(out / "linkbound.csv")
    judged = pd.read_csv(out / "goals.csv")
    meta = json.loads((out / "meta.json").read_text(encoding="utf-8"))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharex=True)
    for ax, mode in zip(axes, ("bulk", "layerwise")):
        m = t[t["mode"] == mode].sort_values("per_layer_ratio")
        ax.errorbar(m["per_layer_ratio"], m["exposed_ms"], yerr=[m["exposed_ms"] - m["exposed_lo"],
                    m["exposed_hi"] - m["exposed_ms"]], fmt="o", color="#0072B2", label="measured (median, 95 %)")
        ax.plot(m["per_layer_ratio"], m["predicted_ms"], "s--", color="#D55E00", mfc="none",
                label="pipelined model (send at layer end)")
        if mode == "layerwise":
            ax.plot(m["per_layer_ratio"], m["predicted_hooked_ms"], "^:", color="#009E73", mfc="none",
                    label="sends released at the cache write")
        if "predicted_bucket_ms" in m:
            ax.plot(m["per_layer_ratio"], m["predicted_bucket_ms"], "x-", color="#CC79A7",
                    label="… and tbf's bucket" if mode == "layerwise" else "tbf's bucket")
        ax.axhline(0, color="#999999", lw=0.6)
        ax.set_xscale("log")
        ax.set_xticks(sorted(m["per_layer_ratio"]), [f"{v:.2g}" for v in sorted(m["per_layer_ratio"])])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("one layer's send ÷ one layer's compute")
        ax.set_title(f"{mode}: exposed after prefill")
        ax.set_ylabel("ms")
        ax.legend(fontsize=8)
    fig.suptitle(f"A link slower than compute: kvlab disagg over a shaped veth, {meta['context']:,} tokens, "
                 f"8 layers (CPU, {meta['host']['cpus']} cores)", fontsize=10)
    fig.text(0.99, 0.01, f"tools/linkbound.py · {out.name}", ha="right", fontsize=7, color="#666666")
    fig.tight_layout()
    fig.savefig(out / "linkbound.png", dpi=130)
    plt.close(fig)
    commit = str(meta["git"]["commit"])[:10]
    where = f"host {meta['host']['node']} ({meta['host']['cpus']} CPUs)"
    if (out / "device.json").exists():  # a run on a lent machine: what ran there is recorded beside it
        dev = json.loads((out / "device.json").read_text(encoding="utf-8"))
        commit, where = dev["code_commit"], f"{dev['host']} (device.json)"
    lines = [f"# The link-bound regime: {out.name}", "",
             f"Written by tools/linkbound.py from linkbound.csv and goals.csv; {where}, commit {commit}, "
             f"status {meta['status']}.", "",
             "| Mbit/s | mode | per-layer ratio | exposed ms [95 %] | model ms (error) | model, hook release ms (error) "
             "| model, hook and bucket ms (error) |", "|---|---|---|---|---|---|---|"]
    for r in t.itertuples():
        hooked = f"{r.predicted_hooked_ms:,.1f} ({r.abs_err_hooked_pct:.1f} %)" if r.mode == "layerwise" else "—"
        bucket = (f"{r.predicted_bucket_ms:,.1f} ({r.abs_err_bucket_pct:.1f} %)" if "predicted_bucket_ms" in t
                  else "—")
        lines.append(f"| {r.rate_gbps * 1e3:,.2f} | {r.mode} | {r.per_layer_ratio:.2f} | {r.exposed_ms:,.1f} "
                     f"[{r.exposed_lo:,.1f}, {r.exposed_hi:,.1f}] | {r.predicted_ms:,.1f} ({r.abs_err_pct:.1f} %) | "
                     f"{hooked} | {bucket} |")
    lines += ["", "| goal | Mbit/s | mode | value | verdict |", "|---|---|---|---|---|"]
    for r in judged.itertuples():
        lines.append(f"| {r.id} | {r.rate_gbps * 1e3:,.2f} | {r.mode} | {r.value} | {r.verdict} |")
    lines += ["", "Where a deployment sits on the same axis (kvlab.calculator, Qwen2.5-7B at 400 TFLOP/s, bf16, one GPU: the "
              "transfer ÷ prefill ratio, which is the mean per-layer ratio):", "",
              "| prompt | 100G NIC | 400G NIC |", "|---|---|---|"]
    for tokens in (4096, 32768):
        r = [calculator.handoff_estimate("qwen2.5-7b", tokens, lk, tflops=400.0).ratio for lk in ("100G", "400G")]
        lines.append(f"| {tokens:,} | {r[0]:.2f} | {r[1]:.2f} |")
    (out / "summary.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


def _write_meta(out: Path, meta: dict) -> None:
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ratios", default="0.25,0.5,1,2,4", help="per-layer transfer ÷ per-layer compute to set the "
                   "rates by (default 0.25,0.5,1,2,4)")
    p.add_argument("--context", type=int, default=1024, help="prompt tokens (default 1024)")
    p.add_argument("--repeats", type=int, default=9, help="timed rounds a rate, each colocated + bulk + layer-wise "
                   "(default 9: n ≥ 9 for a median's interval)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one disagg run may take (default 900)")
    p.add_argument("--out", default=None, help="the result folder to make (default data/probes/linkbound/"
                   "<UTC>-<commit>/)")
    p.add_argument("--redraw", default=None, metavar="DIR", help="only write summary.md and linkbound.png again in "
                   "the finished result folder DIR")
    p.add_argument("--rejudge", default=None, metavar="DIR", help="work the errors and verdicts out again in the "
                   "finished result folder DIR from its linkbound.csv (with --why)")
    p.add_argument("--why", default="", help="with --rejudge: why, for meta.json")
    args = p.parse_args(argv)
    if args.rejudge:
        if not args.why:
            raise SystemExit("--rejudge needs --why: meta.json says why a folder's verdicts were worked out again")
        rejudge(Path(args.rejudge), args.why)
        return 0
    if args.redraw:
        draw(Path(args.redraw))
        return 0
    ratios = _parse_list(args.ratios, "ratios")
    if args.repeats < 9:
        raise SystemExit(f"--repeats {args.repeats}: give at least 9 (a median and its 95 % interval need them)")
    if not 16 <= args.context <= MODEL["max_position_embeddings"]:
        raise SystemExit(f"--context {args.context}: give 16 … {MODEL['max_position_embeddings']} tokens")
    why = netns.unavailable()
    if why:
        raise SystemExit(f"tools/linkbound.py: {why}")
    swept = netns.sweep()
    state = provenance.git_state(ROOT)
    out = Path(args.out) if args.out else (ROOT / "data" / "probes" / "linkbound" /
                                           f"{datetime.now(timezone.utc):%Y%m%d-%H%M%S}-{str(state.get('commit'))[:7]}")
    out.mkdir(parents=True, exist_ok=False)
    model = out / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(MODEL, indent=1) + "\n", encoding="utf-8")
    spec = models.from_hf_config(model / "config.json", name="kvlab-linkbound")
    meta = {"tool": "tools/linkbound.py", "argv": sys.argv[1:] if argv is None else argv,
            "started_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "host": {"machine": platform.machine(), "cpus": len(os.sched_getaffinity(0)), "node": platform.node(),
                     "python": platform.python_version(), "loadavg_start": list(os.getloadavg())},
            "git": {"commit": state.get("commit"), "dirty": state.get("dirty")}, "swept_namespaces": swept,
            "goals": goals.recorded("linkbound"), "model": "model/config.json", "context": args.context,
            "payload_share": netns.payload_share(), "status": "running"}
    _write_meta(out, meta)
    rows = []
    try:
        with netns.namespaces("lb") as nodes:
            prefill_ns, prefill_dev = nodes[1][0], nodes[1][1]
            args.repeats_now = 3
            print("calibrating: an unshaped run for the colocated prefill time …", flush=True)
            _disagg(nodes, out / "runs" / "unshaped", model, args, "unshaped")
            cal = _requests(out / "runs" / "unshaped")
            prefill_ms = float(cal[cal["mode"] == "colocated"]["prefill_ms"].median())
            layer_bytes = calculator.kv_cache_bytes(spec, args.context, "fp32") / spec.layers
            compute_layer_s = prefill_ms / 1e3 / spec.layers
            rates = {r: layer_bytes * 8 / netns.payload_share() / (r * compute_layer_s) for r in ratios}
            for r, rate in rates.items():  # every rate checked before the first shaped run
                netns.check_rate(rate, f"the rate for ratio {r:g} (this host's prefill: {prefill_ms:.1f} ms)")
            meta.update(calibration={"colocated_prefill_ms": prefill_ms, "layer_bytes": layer_bytes,
                                     "rates_bps": {str(k): v for k, v in rates.items()}})
            _write_meta(out, meta)
            args.repeats_now = args.repeats
            for i, (ratio, rate) in enumerate(rates.items(), 1):
                shaped = netns.shape(prefill_ns, prefill_dev, rate)
                t0 = time.perf_counter()
                print(f"[{i}/{len(rates)}] ratio {ratio:g}: {rate / 1e6:,.2f} Mbit/s …", end="", flush=True)
                tag = f"rate-{rate / 1e6:.3f}mbit"
                _disagg(nodes, out / "runs" / tag, model, args, tag)
                req = _requests(out / "runs" / tag)
                for mode in ("bulk", "layerwise"):
                    m = req[req["mode"] == mode]
                    exp = m["exposed_ms"].to_numpy(float)
                    med = float(np.median(exp))
                    lo, hi = median_ci(exp)
                    pre = float(m["prefill_ms"].median())
                    pred, hooked, bucketed, per_layer = _predict(spec, args.context, pre, rate, mode,
                                                                 shaped["burst_bytes"])
                    err, err_lo, err_hi = _abs_err(med, lo, hi, pred)
                    herr, herr_lo, herr_hi = _abs_err(med, lo, hi, hooked)
                    berr, berr_lo, berr_hi = _abs_err(med, lo, hi, bucketed)
                    terr, terr_lo, terr_hi = _abs_err(med, lo, hi, bucketed, pre)  # in units of the prefill
                    rows.append({"rate_gbps": rate / 1e9, "mode": mode, "context": args.context,
                                 "exposed_ms": med, "exposed_lo": lo, "exposed_hi": hi, "predicted_ms": pred,
                                 "per_layer_ratio": per_layer, "target_ratio": ratio, "prefill_ms": pre, "n": len(m),
                                 "abs_err_pct": err, "abs_err_lo": err_lo, "abs_err_hi": err_hi,
                                 "predicted_hooked_ms": hooked, "ready_share": ready_share(spec, args.context),
                                 "abs_err_hooked_pct": herr, "abs_err_hooked_lo": herr_lo,
                                 "abs_err_hooked_hi": herr_hi, "burst_bytes": shaped["burst_bytes"],
                                 "predicted_bucket_ms": bucketed, "abs_err_bucket_pct": berr,
                                 "abs_err_bucket_lo": berr_lo, "abs_err_bucket_hi": berr_hi,
                                 "err_ttft_pct": terr, "err_ttft_lo": terr_lo, "err_ttft_hi": terr_hi,
                                 "kv_bytes": calculator.kv_cache_bytes(spec, args.context, "fp32"),
                                 "run": f"runs/{tag}", "tc": shaped["tc"]})
                print(f" {time.perf_counter() - t0:.0f} s", flush=True)
    except ValueError as err:  # a rate the shaper cannot set: one line, the folder says it stopped
        meta.update(status="stopped", stopped_by=f"ValueError: {err}",
                    stopped_utc=datetime.now(timezone.utc).isoformat(timespec="seconds"))
        _write_meta(out, meta)
        raise SystemExit(f"tools/linkbound.py: {err}") from None
    except BaseException as err:
        meta.update(status="stopped", stopped_by=f"{type(err).__name__}: {str(err)[:300]}",
                    stopped_utc=datetime.now(timezone.utc).isoformat(timespec="seconds"))
        _write_meta(out, meta)
        if rows:
            pd.DataFrame(rows).to_csv(out / "linkbound.partial.csv", index=False)
        raise
    table = pd.DataFrame(rows)
    table.to_csv(out / "linkbound.csv", index=False)
    judged = goals.evaluate(goals.for_study("linkbound"), table, keys=("rate_gbps", "mode"))
    judged.to_csv(out / "goals.csv", index=False)
    meta.update(status="done", finished_utc=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                loadavg_end=list(os.getloadavg()))
    _write_meta(out, meta)
    draw(out)
    for r in table.itertuples():
        print(f"{r.rate_gbps * 1e3:9.2f} Mbit/s {r.mode:>9}: exposed {r.exposed_ms:8.1f} ms "
              f"[{r.exposed_lo:.1f}, {r.exposed_hi:.1f}], model {r.predicted_ms:8.1f} ms, per-layer ratio "
              f"{r.per_layer_ratio:.2f}, |error| {r.abs_err_pct:.1f} % [{r.abs_err_lo:.1f}, {r.abs_err_hi:.1f}]")
    for r in judged.itertuples():
        print(f"{r.id} {r.rate_gbps * 1e3:.2f} Mbit/s {r.mode}: {r.value}: {r.verdict}")
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
