"""`kvlab disagg`: the two-process study from the command line — start both workers, move the cache, decode,
compare, print what came of it, and write a disagg run (requests.csv, bench.csv, faults.csv, summary.json,
run.json). Under torchrun (2 processes; rank 0 decodes) the same command runs across two nodes."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ... import disagg, runfolder
from ...units import fmt_bytes

__all__ = ["add_arguments", "run_args", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``kvlab disagg`` options to ``parser`` (for a CLI subparser)."""
    add = parser.add_argument
    add("--backend", default="gloo",
        help="gloo (TCP; CPU or GPU via the host), ipc (CUDA IPC, one host, 1–2 GPUs), nccl (two GPUs; two nodes "
             "under torchrun), nixl (two NIXL agents, UCX; pip install 'kvlab[nixl]') (default gloo)")
    add("--model", default="kvlab-tiny", help="registry name or a config.json / model folder (default kvlab-tiny)")
    add("--weights", default="random", help="'random' (seeded, identical in both processes) or a local checkpoint")
    add("--context", default="128", help="prompt tokens; a list runs each: 128 or 4k,32k (default 128)")
    add("--mode", default="bulk,layerwise", help="bulk, layerwise or both (default both)")
    add("--layout", default="contiguous", help="contiguous, paged or both (default contiguous)")
    add("--block-size", type=int, default=16, help="tokens per block of a paged cache (default 16)")
    add("--kv-dtype", default="bf16", help="the model's and cache's dtype: bf16, fp16, fp32 (default bf16)")
    add("--device", default="auto", help="the prefill process's device: auto (cuda:0, else cpu), cpu, cuda:N")
    add("--decode-device", default="auto",
        help="the decode process's device (auto: cuda:1 for nccl, else the prefill device)")
    add("--repeats", type=int, default=3,
        help="timed rounds; each round is every mode and a colocated prefill, in rotated order (default 3; ≥ 9 for "
             "published numbers)")
    add("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    add("--decode-tokens", type=int, default=20, help="greedy tokens compared with the colocated decode (default 20)")
    add("--timeout", type=float, default=120.0,
        help="deadline in seconds of every wait across the boundary (default 120)")
    add("--bench", action="store_true",
        help="ipc: also time the bulk send alone beside an in-process copy of the same bytes (its ceiling)")
    add("--nixl-descs", default="block",
        help="nixl, paged: one descriptor per block (block) or per run of blocks adjacent in both pools (merged) "
             "(default block)")
    add("--block-order", default="random",
        help="paged: both sides' allocators hand out blocks at random (a busy server) or packed, lowest ids first (a "
             "fresh one) (default random)")
    add("--in-order", action="store_true",
        help="gloo: match sends to receives in order, as nccl does (every unit tag 0), to run nccl's fault protocol "
             "on a CPU")
    add("--port", type=int, default=0, help="port of the control store (default 0: a free one)")
    add("--seed", type=int, default=0, help="seed of the weights, the prompt, the block tables and the fault plan")
    add("--faults", type=int, default=0,
        help="a fault-injection campaign of N layer-wise requests (drop, delay, corrupt a layer) after the "
             "measurement; writes faults.csv")
    add("--fault-kinds", default="drop,delay,corrupt",
        help="the campaign's fault kinds, in turn: drop, delay, corrupt, kill (the prefill process dies mid-send and "
             "a new one takes over; gloo), oom (the decode side runs out of memory as a layer lands; injected: for a "
             "real one, --decode-memory-gib) "
             "(default drop,delay,corrupt)")
    add("--policy", default="fail", help="what decode does about a fault: fail, retry, recompute (default fail)")
    add("--retries", type=int, default=2, help="retry: attempts after the first (default 2)")
    add("--fault-timeout", type=float, default=1.0,
        help="the campaign's deadline for a request's layers, counted from the request, prefill included: above the "
             "prefill time (default 1 s)")
    add("--decode-memory-gib", type=float, default=0.0,
        help="cap the decode process's allocator at this many GiB while it serves (its weights, the reference it "
             "keeps, its destination, every request); past it a real out-of-memory stops the run with one line "
             "naming the request and step (default 0: no cap; a GPU decode device only)")
    add("--wire-dtype", default="bf16",
        help="what crosses: bf16 (the cache as it is) or fp8 (e4m3 with its scales, quantized by the sender and "
             "dequantized on arrival; gloo, ipc or nixl with both processes on one device, a contiguous bf16 cache, no "
             "--bench) (default bf16)")
    add("--wire-scales", default="per-token-head",
        help="fp8: per-token-head (dynamic), per-head or per-tensor (from the request's own amax) "
             "(default per-token-head)")
    add("--prefill-tp", type=int, default=1,
        help="prefill ranks, each its own process holding its KV-head shard (gloo, CPU, contiguous) (default 1)")
    add("--decode-tp", type=int, default=1,
        help="decode ranks, each its own process receiving the heads it needs, decoding together with TP (default 1)")
    add("--out", default=None, help="run folder (default: a new data/disagg/<run_id>/)")
    add("--quiet", action="store_true", help="no progress bar")
    return parser


def run_args(args: argparse.Namespace) -> int:
    """Run ``kvlab disagg`` from parsed arguments; returns the exit status (0: every decode identical to colocated
    and no fault decoded from a partial cache; 1: a check failed or a worker stopped; a bad value is a ValueError,
    which ``kvlab`` prints in one line with exit 2)."""
    if args.out is not None:  # before anything starts: a finished run is never overwritten
        runfolder.check_run_folder(args.out, "--out")
    cfg = disagg.DisaggConfig(
        backend=args.backend, model=args.model, weights=args.weights, contexts=args.context, modes=args.mode,
        layouts=args.layout, block_size=args.block_size, kv_dtype=args.kv_dtype, device=args.device,
        decode_device=args.decode_device, repeats=args.repeats, warmup=args.warmup,
        decode_tokens=args.decode_tokens, timeout_s=args.timeout, bench=args.bench, port=args.port,
        faults=args.faults, policy=args.policy, retries=args.retries, fault_timeout_s=args.fault_timeout,
        fault_kinds=args.fault_kinds, nixl_descs=args.nixl_descs, block_order=args.block_order,
        seed=args.seed, decode_memory_gib=args.decode_memory_gib, in_order=args.in_order,
        wire_dtype=args.wire_dtype, wire_scales=args.wire_scales, prefill_tp=args.prefill_tp, decode_tp=args.decode_tp)
    try:
        summary = disagg.run(cfg, args.out or "", progress=not args.quiet)
    except (disagg.DisaggError, disagg.IncompleteCacheError, TimeoutError) as err:
        print(f"kvlab disagg: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as err:
        print(f"kvlab disagg: stopped ({runfolder.stop_reason(err)}); the run folder says so", file=sys.stderr)
        return 143 if isinstance(err, runfolder.Terminated) else 130
    if not summary:  # the prefill rank under torchrun: rank 0 reports
        return 0
    if "decode_tp" in summary:  # P + D processes (kvlab.disagg.tp_handoff)
        print(f"TP {summary['prefill_tp']} → {summary['decode_tp']} ({summary['processes']} processes, gloo, "
              f"{summary['impl']} split): tokens {'match' if summary['tokens_match'] else 'DIFFER'}, logits within "
              f"{summary['logits_max_abs_diff']:.1e} (tolerance {summary['logits_tolerance']:.1e}), shards "
              f"{'exact' if summary['shards_exact'] else 'WRONG'}, poison left {summary['poison_left']}")
        for r, (b, rep, n) in enumerate(zip(summary["bytes_per_decode_rank"], summary["replica_bytes"],
                                            summary["pieces_per_decode_rank"])):
            print(f"  decode rank {r}: {fmt_bytes(b)} in {n} piece(s){' (a replica)' if rep else ''}")
        return 0 if summary["passed"] else 1
    ok = summary["tokens_match"] and summary["logits_equal"] and summary["poison_left"] == 0
    print(f"{summary['backend']}: {summary['requests']} requests, {fmt_bytes(summary['bytes_moved'])} a request, "
          f"tokens {'match' if summary['tokens_match'] else 'DIFFER'}, logits "
          f"{'equal' if summary['logits_equal'] else 'DIFFER'}, poison left {summary['poison_left']}")
    if summary.get("wire_dtype") == "fp8":
        num = lambda x, f: "—" if x is None else format(x, f)  # noqa: E731 (JSON has no NaN: summary says None)
        print(f"  FP8 wire, {summary['wire_scales']} scales: {num(summary['wire_bytes_ratio'], '.3f')}× the bf16 "
              f"bytes, checked against the colocated decode through quantize → dequantize; token agreement with bf16 "
              f"{num(summary['token_agreement'], '.3f')}, largest K/V relative error "
              f"{num(summary['kv_max_rel_err'], '.3g')}")
    for c in summary["configs"]:
        ex = f", exposed {c['exposed_ms']:.3f} ms" if c.get("exposed_ms") is not None else ""
        print(f"  {c['layout']:10} {c['mode']:9} {c['context']:>6} tokens: TTFT {c['ttft_ms']:.2f} ms"
              f" (prefill {c['prefill_ms']:.2f} ms{ex})")
    if summary.get("faults_injected"):
        print(f"faults: {summary['faults_injected']} injected (policy {summary['policy']}): {summary['recovered']} "
              f"recovered, {summary['refused']} refused, {summary['undetected']} undetected, "
              f"{summary['decoded_from_partial']} decoded from a partial or corrupt cache")
        ok = ok and summary["decoded_from_partial"] == 0 and summary["undetected"] == 0
    return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    """``kvlab disagg [--backend gloo] [--context 128] [--layout contiguous] [--faults N] [--out DIR] ...``: both
    processes, the requests, the checks; returns the exit status."""
    parser = add_arguments(argparse.ArgumentParser(prog="kvlab disagg", description=main.__doc__.splitlines()[0]))
    return run_args(parser.parse_args(argv))
