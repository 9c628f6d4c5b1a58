"""Timing the re-shard movers (kvlab.paged.reshard) beside the same-TP transfer, on one device.

`bench(P, D, layout)` builds P prefill pools of a model's shape (random values, blocks drawn at random) and D decode
pools on one device, checks every method's shards once (reshard.verify: bit for bit, no poison left, nothing written
outside), then times each method's move of the whole sequence and the yardstick — the homogeneous P → P transfer of
the same cache on the same path and layout: one whole-row copy per rank with kvlab.paged.kernels' row kernel, the copy
kvlab disagg's ipc path makes for a paged cache — in interleaved rounds (kvlab.timing.interleave: CUDA events on a
GPU, each call waited for before the next; balanced orders). Every rank's pool sits on one GPU in one process, so
the times are the kernels' and copies' own, with no link between ranks.

GPU sizes (the issue's goals): Qwen2.5-7B's shape at 32k tokens, bf16, blocks of 16: 1.88 GB per sequence. The
CPU path runs the same code at tiny sizes (tests: kvlab-tiny, TRITON_INTERPRET=1 for the fused kernel).
"""

from __future__ import annotations

from . import kernels, reshard, reshard_movers
from ..timing import free_device, interleave, resolve_device, sync_device

__all__ = ["bench", "refusal", "DEFAULT_METHODS"]

DEFAULT_METHODS = ("torch-index", "fused", "staging")
_MAX_HOST_PIECES = 20_000  # block-slices is a host loop of copies: past this, predict it (reshard.predict) instead
_MAX_NIXL_DESCRIPTORS = 500_000  # nixl-slices per repeat: an nhd head split at 32k is millions; count, do not time


def refusal(method: str, pl, context: int, block_size: int = 16, layout: str = "hnd", dst_layout: str | None = None,
            kv_dtype="bf16") -> str | None:
    """Why `bench` would not time `method` for this plan (an unknown method, a layout change a method cannot make,
    block-slices past 20,000 host copies, nixl-slices past 500,000 descriptors a repeat), or None."""
    dst_layout = layout if dst_layout is None else dst_layout
    if method not in reshard.METHODS:
        return f"method {method!r} is not valid; use some of {list(reshard.METHODS)}"
    try:
        acc = reshard.account(pl, context, kv_dtype, method, block_size, layout, dst_layout)
    except ValueError as err:
        return str(err)
    n = sum(acc.pieces_per_decode_rank)
    if method == "block-slices" and n > _MAX_HOST_PIECES:
        return (f"block-slices would issue {n:,} host copies per repeat; time it at a smaller context or predict it "
                "with reshard.predict")
    if method == "nixl-slices" and n > _MAX_NIXL_DESCRIPTORS:
        return (f"nixl-slices would post {n:,} descriptors per repeat (over {_MAX_NIXL_DESCRIPTORS:,}): a head split "
                "of nhd blocks is block_size descriptors a block; count it with reshard.account, time it on hnd")
    return None


def bench(prefill_tp: int, decode_tp: int, layout: str = "hnd", dst_layout: str | None = None,
          methods=DEFAULT_METHODS, model="qwen2.5-7b", context: int = 32768, block_size: int = 16,
          kv_dtype="bf16", repeats: int = 10, warmup: int = 2, device=None, seed: int = 0, backend: str = "auto",
          ceilings=None, path: str = "d2d_same") -> list[dict]:
    """Time each of `methods` moving one `context`-token cache P → D (source pools `layout`, destination pools
    `dst_layout`, default the same), and the same-TP yardstick (method "same-tp", decode_tp = P, both sides `layout`).

    Returns tidy rows, one per timed repeat: prefill_tp, decode_tp, pool_layout ("hnd", or "nhd->hnd" when the
    sides differ), method, context, repeat, ms, bytes (whole-block bytes written into all destination pools),
    pieces (copies / launches / sends issued, all ranks), pieces_per_decode_rank (the most any rank got), backend
    (triton | torch), verified (the check before timing passed), device; and predicted_ms (reshard.predict over
    `path` of `ceilings`, a kvlab.ceilings_fit.Ceilings, all ranks sharing the device) when ceilings are given.
    The NIXL movers' rows add descriptors_per_request (the most in one prepared request: one decode rank's piece
    from one prefill rank), descriptors (all a move posts), post_us and wait_us (medians over the timed calls: posting every request, then posted →
    all DONE). Refused before anything is allocated: whatever `refusal` names.
    """
    dev = resolve_device(device)
    methods = list(methods)
    pl, same_pl = reshard.plan(model, prefill_tp, decode_tp), reshard.plan(model, prefill_tp, prefill_tp)
    dst_layout = layout if dst_layout is None else dst_layout
    for m in methods:
        why = refusal(m, pl, context, block_size, layout, dst_layout, kv_dtype)
        if why:
            raise ValueError(why)
    if ceilings is not None:
        ceilings[path]  # refuses a path the ceilings did not measure
    lay = layout if layout == dst_layout else f"{layout}->{dst_layout}"
    src = reshard.make_pools(pl, "prefill", context, block_size, layout, kv_dtype, dev, seed, fill="random")
    dst = reshard.make_pools(pl, "decode", context, block_size, dst_layout, kv_dtype, dev, seed)
    same_dst = reshard.make_pools(same_pl, "decode", context, block_size, layout, kv_dtype, dev, seed)
    fns, info, movers, nixl = {}, {}, [], {}
    try:
        for m in methods:
            mover = reshard_movers.make_mover(m, pl, src, dst, backend=backend)
            movers.append(mover)
            for pool, _ in dst:
                pool.poison()
            mover.run()
            sync_device(dev)
            ok = reshard.verify(pl, src, dst)["ok"]
            fns[m], info[m] = mover.run, (mover.report(), ok, pl.decode_tp, lay)
            if hasattr(mover, "reset_stats"):
                mover.reset_stats()  # the timed calls' post and wait times only
        fns["same-tp"] = _same_tp(src, same_dst)
        fns["same-tp"]()
        sync_device(dev)
        same_rep = {"backend": "triton" if kernels.triton_status(dev)[0] else "torch",
                    "pieces_per_decode_rank": {p: 1 for p in range(prefill_tp)},
                    "block_bytes_per_decode_rank": {p: pool.spec.block_bytes * 2 * pool.spec.layers * t.num_blocks
                                                    for p, (pool, t) in enumerate(same_dst)}}
        info["same-tp"] = (same_rep, reshard.verify(same_pl, src, same_dst)["ok"], prefill_tp, layout)
        samples = interleave(fns, rounds=repeats, warmup=warmup, device=dev, rotate=True)
        nixl = {mv.method: mv.report()["nixl"] for mv in movers if hasattr(mv, "reset_stats")}
    finally:
        for mv in movers:
            mv.close()
        del src, dst, same_dst, fns, movers
        free_device(dev)
    pred = {}
    for m in methods if ceilings is not None else ():
        p = reshard.predict(model, context, prefill_tp, decode_tp, m, path, src_layout=layout, dst_layout=dst_layout,
                            kv_dtype=kv_dtype, block_size=block_size, ceilings=ceilings)
        pred[m], pred["same-tp"] = p["predicted_ms"], p["same_tp_ms"]
    rows = []
    for s in samples:
        rep, ok, d, lay_m = info[s.name]
        pieces = rep["pieces_per_decode_rank"]
        row = {"prefill_tp": prefill_tp, "decode_tp": d, "pool_layout": lay_m, "method": s.name, "context": context,
               "repeat": s.round, "ms": s.ms, "bytes": sum(rep["block_bytes_per_decode_rank"].values()),
               "pieces": sum(pieces.values()), "pieces_per_decode_rank": max(pieces.values()),
               "backend": rep["backend"], "verified": ok, "device": str(dev)}
        if s.name in pred:
            row["predicted_ms"] = pred[s.name]
        if s.name in nixl:
            nx = nixl[s.name]
            row.update(descriptors_per_request=nx["descriptors_per_request"], descriptors=nx["descriptors"],
                       post_us=nx["post_us"],
                       wait_us=nx["wait_us"], nixl_backend=nx["backend"],
                       nixl_env=" ".join(f"{k}={v}" for k, v in nx["env"].items()))
        rows.append(row)
    return rows


def _same_tp(src, dst):
    """The homogeneous transfer: rank p's whole rows into rank p's destination pool, one row-kernel launch each
    (kernels.copy_rows; indices made once, bounds checked here, not in the timed call)."""
    jobs = []
    for (sp, st), (dp, dt) in zip(src, dst):
        if sp.spec.compatible(dp.spec) is not None:
            raise ValueError(f"same-TP pools differ: {sp.spec.compatible(dp.spec)}")
        dev = sp.device if sp.device.type == "cuda" else dp.device
        jobs.append((sp.rows, reshard.table_rows(sp, st, dev), dp.rows, reshard.table_rows(dp, dt, dev)))

    def run() -> None:
        for s, si, d, di in jobs:
            kernels.copy_rows(s, si, d, di, check_bounds=False)

    return run
