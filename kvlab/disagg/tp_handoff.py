"""Different TP on each side across processes (`kvlab disagg --prefill-tp P --decode-tp D`, issue 28): P prefill ranks
and D decode ranks, each its own process, over gloo on a CPU.

Every process builds the same model (same config, same seed: the same weights). Each prefill rank prefills the prompt
and keeps its KV-head shard of the cache (a real TP prefill is not required: one prefill's cache, each rank its
heads, kvlab.paged.reshard.plan's split); each decode rank allocates its own shard (poisoned) and receives exactly the
head slices the plan gives it, from the prefill ranks that hold them — P > D gathers from P/D ranks, P < D feeds D/P
decode ranks from one, fewer KV heads than D replicates (the replicas' bytes counted) — one send per piece (all layers,
K and V). Then the D decode ranks decode together (kvlab.tp_decode.shard_model over a group of the decode ranks:
transformers' tensor-parallel plan where it applies, else kvlab's split) and compare with the colocated decode each
computed first: tokens equal at every step, logits within the reduction-order tolerance (tp_decode.logits_tolerance),
every shard byte-exact against the colocated cache's head slice, no poison left. The pass rule says which judged it.

World ranks: 0 … D-1 decode (rank 0 is the run's reporter), D … D+P-1 prefill. Outputs: summary.json (prefill_tp,
decode_tp, tokens_match, bytes_per_decode_rank, replica_bytes, pieces_per_decode_rank, …), ranks.csv, run.json.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import pandas as pd
import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import ProcessException

from .. import models, results, runfolder
from ..kvcache import KVBuffer, KVLayout, layout_for
from ..paged import reshard
from ..steps import decode, make_prompt, prefill
from ..tp_decode import check_pair, compare, logits_tolerance, run_ranks, shard_model
from .config import DisaggConfig, is_default

__all__ = ["check_tp", "run_tp", "RULE", "RankError"]

RULE = ("TP decode: the first token and the tokens of every step equal to the colocated decode's, logits within the reduction-order tolerance, "
        "every shard byte-exact against the colocated cache's head slice, no poison left")
_FIRST_TAG = 1 << 20  # the first token's send, beside the pieces' tags (their index in the decode rank's plan)


def check_tp(cfg: DisaggConfig) -> reshard.Plan:
    """The plan of a run with prefill_tp or decode_tp above 1, every option checked against what this path runs:
    gloo on a CPU, a contiguous cache, one context, no bench, faults, FP8 wire or memory cap; P + D processes this
    machine can hold. ValueError, one line, before any process starts."""
    p, d = cfg.prefill_tp, cfg.decode_tp
    changed = [flag for flag, name in (("--port", "port"), ("--weights", "weights"), ("--repeats", "repeats"),
                                       ("--warmup", "warmup"), ("--threads", "threads"),
                                       ("--drop-layer", "drop_layer"), ("--in-order", "in_order"))
               if not is_default(cfg, name)]
    bad = [flag for flag, why in (
        ("--backend", cfg.backend != "gloo"), ("--layout", tuple(cfg.layouts) != ("contiguous",)),
        ("--device", cfg.devices() != ("cpu", "cpu")), ("--context", len(cfg.contexts) != 1),
        ("--bench", cfg.bench), ("--faults", cfg.faults), ("--wire-dtype", cfg.wire_dtype != "bf16"),
        ("--decode-memory-gib", cfg.decode_memory_gib),
        ("--mode", not is_default(cfg, "modes") and tuple(cfg.modes) != ("bulk",))) if why] + changed
    if bad:
        raise ValueError(f"--prefill-tp {p} --decode-tp {d} runs one request over gloo on a CPU (--device cpu), one "
                         f"context, a contiguous cache sent in bulk (one send a piece), random weights, so far; leave "
                         f"out or change {', '.join(bad)}")
    if cfg.kv_dtype != "float32":
        raise ValueError(f"--prefill-tp {p} --decode-tp {d}: kv-dtype {cfg.kv_dtype!r}; the TP decode is judged by a "
                         "float32 reduction-order tolerance (kvlab.tp_decode.logits_tolerance): give --kv-dtype float32")
    pl = check_pair(cfg.spec(), p, d, cfg.contexts[0], cfg.decode_tokens)  # the plan, and the TP decode's split
    if pl.attention == "mla":
        raise ValueError(f"{pl.model} keeps an MLA latent: its re-shard is measured by kvlab reshard; "
                         "--prefill-tp/--decode-tp move KV heads")
    cores = os.cpu_count() or 1
    spec = cfg.spec()
    need = (p + d) * 3 * spec.params * 4  # each process: its fp32-sized copy of the weights and room around it
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else None
    if p + d > 8 * cores or (free is not None and need > free):
        raise ValueError(f"--prefill-tp {p} --decode-tp {d} starts {p + d} processes, each with its own {spec.name}: "
                         f"more than this machine holds ({cores} cores, {(free or 0) / 2**30:.1f} GiB free); give "
                         "smaller TP degrees or a smaller --model")
    return pl


def _shard_layout(model, context: int, heads: int, dtype) -> KVLayout:
    full = layout_for(model, context, dtype=dtype)
    return KVLayout(full.layers, 1, heads, context, full.head_dim, full.dtype)


def _prefill_rank(job: dict, p: int, world: int) -> dict:
    """Prefill, keep this rank's KV heads, send each decode rank the pieces it reads from here; its counts."""
    pl = reshard.plan(job["model"], job["prefill_tp"], job["decode_tp"])
    model = models.build(job["model"], device="cpu", dtype=job["dtype"], seed=job["seed"])
    ids = make_prompt(model.config.vocab_size, job["context"], "cpu", seed=job["seed"])
    cache = KVBuffer(layout_for(model, job["context"], dtype=job["dtype"]))
    first = prefill(model, ids, cache).argmax(-1).view(-1)[:1].to(torch.int64)
    lo, hi = pl.src_global[p]
    mine = cache.data[:, :, :, lo:hi].contiguous()  # this rank's KV-head shard: all it keeps
    del cache
    works, sent = [], []
    d_tp = job["decode_tp"]
    for d in range(d_tp):
        if p == 0:
            works.append(dist.isend(first, dst=d, tag=_FIRST_TAG))
        for k, pc in enumerate(pl.pieces[d]):
            if pc.src_rank != p:
                continue
            t = mine[:, :, :, pc.src_head:pc.src_head + pc.heads].contiguous()
            works.append(dist.isend(t, dst=d, tag=k))
            sent.append({"decode_rank": d, "heads": pc.heads, "bytes": t.nbytes, "tensor": t})
    for w in works:
        w.wait(timedelta(seconds=job["timeout_s"]))
    return {"role": "prefill", "rank": p, "heads": [lo, hi], "pieces_sent": len(sent),
            "bytes_sent": sum(s["bytes"] for s in sent)}


def _decode_rank(job: dict, d: int, group) -> dict:
    """The colocated reference, then this rank's shard received piece by piece, then the TP decode and the checks."""
    pl = reshard.plan(job["model"], job["prefill_tp"], job["decode_tp"])
    model = models.build(job["model"], device="cpu", dtype=job["dtype"], seed=job["seed"])
    ctx, steps = job["context"], job["decode_tokens"]
    ids = make_prompt(model.config.vocab_size, ctx, "cpu", seed=job["seed"])
    ref = KVBuffer(layout_for(model, ctx, dtype=job["dtype"]))
    ref_first = int(prefill(model, ids, ref).argmax(-1).view(-1)[0])
    ref_tokens, ref_logits = decode(model, ref, torch.tensor([ref_first]), steps)
    atol, rule = logits_tolerance(model, ctx, steps)
    lo, hi = pl.dst_global[d]
    shard = KVBuffer(_shard_layout(model, ctx, hi - lo, job["dtype"]))
    shard.poison()
    first = torch.zeros(1, dtype=torch.int64)
    recvs = [(None, dist.irecv(first, src=job["decode_tp"], tag=_FIRST_TAG))]  # prefill rank 0 is world rank D
    for k, pc in enumerate(pl.pieces[d]):
        view = torch.empty_like(shard.data[:, :, :, pc.dst_head:pc.dst_head + pc.heads])
        recvs.append(((pc, view), dist.irecv(view, src=job["decode_tp"] + pc.src_rank, tag=k)))
    t0 = time.perf_counter()
    for got, w in recvs:
        w.wait(timedelta(seconds=job["timeout_s"]))
        if got is not None:
            pc, view = got
            shard.data[:, :, :, pc.dst_head:pc.dst_head + pc.heads].copy_(view)
    landed_ms = (time.perf_counter() - t0) * 1e3
    exact = bool(torch.equal(shard.data, ref.data[:, :, :, lo:hi]))
    poison = int(shard.count_poison())
    impl = shard_model(model, group=group, impl="auto") if job["decode_tp"] > 1 else "none"
    toks, logits = decode(model, shard, torch.tensor([int(first[0])]), steps)
    cmp = compare(ref_tokens, ref_logits, toks, logits, atol)
    nbytes = sum(view.nbytes for (_pc, view), _w in recvs[1:])
    return {"role": "decode", "rank": d, "heads": [lo, hi], "impl": impl, "pieces": len(pl.pieces[d]),
            "bytes": nbytes, "replica": bool(pl.replica[d]), "first_token_match": int(first[0]) == ref_first,
            "shard_exact": exact, "poison_left": poison, "landed_ms": landed_ms, "logits_tolerance_rule": rule, **cmp,
            "tokens": toks.view(-1).tolist()}


def _rank_main(rank: int, world: int, port: int, folder: str) -> None:
    """One rank (a process of its own): join the gloo group of P + D ranks, then prefill or decode."""
    job = json.loads((Path(folder) / "job.json").read_text())
    torch.set_num_threads(1)  # P + D processes share the host's cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=job["timeout_s"]))
    role = f"decode rank {rank}" if rank < job["decode_tp"] else f"prefill rank {rank - job['decode_tp']}"
    try:
        group = dist.new_group(ranks=list(range(job["decode_tp"])))  # every rank takes part in making it
        if rank < job["decode_tp"]:
            out = _decode_rank(job, rank, group)
        else:
            out = _prefill_rank(job, rank - job["decode_tp"], world)
        (Path(folder) / f"rank{rank}.json").write_text(json.dumps(out))
    except BaseException as err:  # when it failed and why, so the launcher can name the first cause, not an echo
        first = (str(err).strip().splitlines() or [""])[0][:240]
        (Path(folder) / f"rank{rank}.error").write_text(json.dumps(
            {"t": time.time(), "rank": role, "error": f"{type(err).__name__}: {first}"}))
        raise
    finally:
        dist.destroy_process_group()


class RankError(RuntimeError):
    """A rank of a TP run failed; the message names the first rank that failed and its error, in one line."""


def _first_failure(folder: str, p: int, d: int) -> str:
    """The earliest failure the ranks recorded (a peer's later error, such as a closed connection, is its echo)."""
    found = [json.loads(f.read_text()) for f in Path(folder).glob("rank*.error")]
    if not found:
        return "a rank ended without saying why"
    e = min(found, key=lambda x: x["t"])
    return f"{e['rank']} failed first: {e['error']}"


def run_tp(cfg: DisaggConfig, out: str | os.PathLike = "", progress: bool = True) -> dict:
    """Run `cfg` (prefill_tp, decode_tp) as P + D processes; the summary (also <run>/summary.json). Refused before
    anything starts: whatever check_tp refuses. A rank that fails raises RankError naming the first rank that failed
    (kvlab.disagg.run turns it into a DisaggError), the deadline a TimeoutError; the run folder then says it stopped."""
    pl = check_tp(cfg)
    p, d = cfg.prefill_tp, cfg.decode_tp
    params = {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.__dict__.items()}
    run = results.start("disagg", params, run_dir=out)
    try:
        with tempfile.TemporaryDirectory(prefix="kvlab-tp-disagg-") as folder:
            job = {"model": cfg.model, "dtype": cfg.kv_dtype, "seed": cfg.seed, "context": cfg.contexts[0],
                   "decode_tokens": cfg.decode_tokens, "prefill_tp": p, "decode_tp": d, "timeout_s": cfg.timeout_s}
            (Path(folder) / "job.json").write_text(json.dumps(job))
            t0 = time.monotonic()
            try:
                run_ranks(_rank_main, p + d, folder, cfg.timeout_s, "fork" if os.name == "posix" else "spawn",
                          f"prefill and decode ranks ({p} + {d})")
            except ProcessException as err:
                raise RankError(f"TP {p} → {d}: {_first_failure(folder, p, d)}") from err
            ranks = [json.loads((Path(folder) / f"rank{r}.json").read_text()) for r in range(p + d)]
        dec = [r for r in ranks if r["role"] == "decode"]
        agree = all(r["tokens"] == dec[0]["tokens"] for r in dec)
        summary = {"backend": "gloo", "processes": p + d, "mode": "bulk", "prefill_tp": p, "decode_tp": d, "model": cfg.model,
                   "context": cfg.contexts[0], "kv_dtype": cfg.kv_dtype, "decode_tokens": cfg.decode_tokens,
                   "tokens_match": all(r["tokens_match"] for r in dec) and agree,
                   "first_token_match": all(r["first_token_match"] for r in dec),
                   "logits_within_tolerance": all(r["logits_within_tolerance"] for r in dec),
                   "logits_equal": all(r["logits_equal"] for r in dec),
                   "logits_max_abs_diff": max(r["logits_max_abs_diff"] for r in dec),
                   "logits_tolerance": dec[0]["logits_tolerance"], "tolerance_rule": dec[0]["logits_tolerance_rule"],
                   "shards_exact": all(r["shard_exact"] for r in dec), "poison_left": sum(r["poison_left"] for r in dec),
                   "bytes_per_decode_rank": [r["bytes"] for r in dec],
                   "replica_bytes": [r["bytes"] if r["replica"] else 0 for r in dec],
                   "pieces_per_decode_rank": [r["pieces"] for r in dec], "impl": dec[0]["impl"],
                   # the calculator's count beside the measured one (kvlab.paged.reshard.account, per KV head)
                   "calculated_bytes_per_decode_rank": list(reshard.account(pl, cfg.contexts[0], cfg.kv_dtype)
                                                            .bytes_per_decode_rank),
                   "heads_per_decode_rank": [r["heads"] for r in dec], "notes": list(pl.notes),
                   "seconds": round(time.monotonic() - t0, 3), "rule": RULE}
        summary["passed"] = (summary["tokens_match"] and summary["first_token_match"]
                             and summary["logits_within_tolerance"] and summary["shards_exact"]
                             and summary["poison_left"] == 0)
        run.save_table(pd.DataFrame([{k: v for k, v in r.items() if k not in ("tokens", "logits_tolerance_rule")}
                                     for r in ranks]), "ranks")
        (run.dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        run.update(summary=summary)
        run.finish()
        return summary
    except BaseException as err:  # the folder says it stopped (run.json `stopped`, STOPPED.txt), as kvlab disagg's
        with runfolder.shielded():
            run.update(stopped=runfolder.stop_reason(err))
            runfolder.record_execution(run.dir, "kvlab disagg", ok=False, seconds=0.0, error=runfolder.stop_reason(err))
        raise
