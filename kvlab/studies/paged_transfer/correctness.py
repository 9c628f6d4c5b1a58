"""The paged study's correctness check: a decode from a cache that travelled through each transport, bit for bit
against the colocated decode (notebook 04 runs it before anything is timed)."""

from __future__ import annotations

import pandas as pd
import torch

from ... import paged, timing
from ...hooks import LayerHooks
from ...kvcache import KVBuffer, layout_for
from ...paged import BlockAllocator, BlockPool, registry, verify_transfer
from ...steps import correctness_check, decode, make_prompt, prefill
from ...transfer import Destination
from .bench import METHODS, check_list, default_destinations

__all__ = ["decode_check"]


def decode_check(model, methods=METHODS, destinations=None, tokens: int = 64, block_size: int = 16,
                 steps: int = 8, device=None, pool_layout: str = "nhd", seed: int = 0,
                 layerwise: bool = True) -> pd.DataFrame:
    """For each method × destination: prefill into a paged pool, move the blocks, rebuild a contiguous
    cache from the destination blocks, decode `steps` greedy tokens, and compare tokens and logits with
    the colocated decode (prefill into one contiguous buffer, decode from it) bit for bit.

    layerwise=True also sends each stream-ordered method layer by layer from the forward hooks while the
    prefill writes the pages (mode "layerwise"). Returns one row per (method, destination, mode):
    tokens_match, logits_equal, logits_max_abs_diff, poison_left (NaNs in the rebuilt cache), blocks_ok
    (byte-exact check, poison outside the table), status, note.
    """
    device = timing.resolve_device(device)
    methods = [m for m in check_list("methods", methods, valid=METHODS) if m != "contiguous"]
    dests = [Destination.parse(d, device) for d in check_list(
        "destinations", destinations if destinations is not None else default_destinations(device))]
    dtype = next(model.parameters()).dtype
    layout = layout_for(model, tokens, dtype=dtype)
    vocab = model.config.get_text_config(decoder=True).vocab_size
    ids = make_prompt(vocab, tokens, device, seed)

    colocated = KVBuffer(layout, device=device).poison()
    first = prefill(model, ids, colocated).argmax(-1)
    ref_tokens, ref_logits = decode(model, colocated, first, steps)

    spec = paged.PoolSpec.from_kv_layout(layout, block_size, pool_layout)
    n = spec.blocks_for(tokens)
    src_table = BlockAllocator(2 * n, block_size, seed=seed).allocate(tokens)
    src_pool = BlockPool(spec, 2 * n, device=device).poison()
    paged_logits = paged.prefill_into_pages(model, ids, src_pool, src_table)
    rows = []

    def check(t, dst_table, mode, pool):
        got = t.pool.read(dst_table if dst_table is not None else paged.BlockTable.packed(tokens, block_size),
                          device=device)
        toks, lg = decode(model, got, first, steps)
        row = correctness_check(ref_tokens, ref_logits, toks, lg, got.count_poison())
        row["blocks_ok"] = verify_transfer(pool, src_table, t.pool, dst_table)["ok"]
        return row

    for dest in dests:
        host = dest.kind in ("pinned", "pageable")
        dst_table = None if host else BlockAllocator(2 * n, block_size, seed=seed + 1).allocate(tokens)
        for method in methods:
            cls = registry.TRANSPORTS[method]
            if dest.kind not in cls.kinds:
                continue
            base = dict(method=method, destination=dest.label)
            why = cls.unavailable(device, dest)
            if why is not None:
                rows.append({**base, "mode": "bulk", "status": "skipped", "note": why})
                continue
            t = registry.make_transport(method, spec, dest, n if host else 2 * n, device, tune=False) \
                if method in ("triton", "chunked-gather-d2h", "mapped-pinned") else \
                registry.make_transport(method, spec, dest, n if host else 2 * n, device)
            try:
                t.prepare(src_pool, src_table, dst_table)
                t.poison()
                t.send(src_pool, src_table, dst_table).wait()
                rows.append({**base, "mode": "bulk", "status": "ok", "note": "; ".join(t.notes),
                             **check(t, dst_table, "bulk", src_pool)})
                if layerwise and cls.stream_ordered:
                    lw_pool = BlockPool(spec, 2 * n, device=device).poison()
                    sender = t.layerwise(lw_pool, src_table, dst_table)
                    t.poison()
                    # the paged prefill writes through its own cache, so the signal is the attention hook
                    with LayerHooks(model, on_kv_ready=sender.on_layer, ranges=False, point="attention"):
                        sender.begin()
                        paged.prefill_into_pages(model, ids, lw_pool, src_table)
                        landing = sender.finish()
                    landing.wait()
                    rows.append({**base, "mode": "layerwise", "status": "ok", "note": "; ".join(t.notes),
                                 **check(t, dst_table, "layerwise", lw_pool)})
            finally:
                t.close()
    out = pd.DataFrame(rows)
    out.attrs["paged_prefill_logits_equal"] = bool(torch.equal(paged_logits.cpu(), prefill(
        model, ids, KVBuffer(layout, device=device)).cpu()))
    return out
