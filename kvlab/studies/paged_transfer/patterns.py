"""What the access pattern costs (GPU): one Triton launch, the same bytes, rows in different orders, beside one
contiguous copy of the same bytes."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import torch

from ... import timing
from ...paged import BlockAllocator, BlockPool, kernels, registry, triton_transports
from ...timing import free_device as _free
from .bench import check_layout

__all__ = ["PATTERNS", "access_patterns"]


PATTERNS = (
    ("contiguous copy_", "one copy of the same bytes between contiguous buffers (the ceiling)"),
    ("kernel: rows in place", "the row-copy kernel with source row i → destination row i (no scatter)"),
    ("kernel: gather → packed", "the sequence's scattered source blocks → consecutive destination rows"),
    ("kernel: paged → paged, layer order", "scattered → scattered; layer, side, destination block (the plan)"),
    ("kernel: paged → paged, interleaved", "scattered → scattered; block-major across all layer sides"),
    ("kernel: paged → paged, source order", "scattered → scattered; layer, side, source block"),
    ("kernel: paged → paged, random order", "scattered → scattered; rows in a random order"),
)


def access_patterns(context: int = 32768, block_size: int = 16, device=None, layout="auto", repeats: int = 9,
                    warmup: int = 2, seed: int = 0, progress=None) -> pd.DataFrame:
    """What the access pattern costs the row-copy kernel (GPU only; an empty table elsewhere).

    The same rows — one sequence of `context` tokens in `block_size`-token blocks, every layer's K and V,
    scattered over a pool twice the size as in measure() — moved by one Triton launch with the source and
    destination rows in different orders (PATTERNS), beside one contiguous copy of the same bytes. Each
    kernel pattern is tuned on its own rows (kvlab.paged.kernels.tune over candidate_configs) and then timed
    `repeats` times with CUDA events. Every pattern's result is checked on a sample of rows.

    Rows: pattern, description, repeat, ms, gbps, bytes, rows, config (the tuned kernel).
    """
    dev = timing.resolve_device(device)
    if dev.type != "cuda":
        return pd.DataFrame(columns=["pattern", "description", "repeat", "ms", "gbps", "bytes", "rows", "config"])

    say = progress or (lambda s: None)
    lay = check_layout("qwen2.5-7b" if layout == "auto" else layout)
    spec = lay.spec(block_size)
    n = spec.blocks_for(context)
    src_pool = BlockPool(spec, 2 * n, device=dev).fill_random(seed)
    src_table = BlockAllocator(2 * n, block_size, seed=seed).allocate(context)
    dst_table = BlockAllocator(2 * n, block_size, seed=seed + 1).allocate(context)
    t = registry.make_transport("triton", spec, "same-gpu", 2 * n, dev, tune=False, order="layer")
    plan = t.prepare(src_pool, src_table, dst_table)
    src, dst = src_pool.rows, t.pool.rows
    R = plan.rows
    packed = torch.empty((R, src.shape[1]), dtype=src.dtype, device=dev)
    nbytes = R * spec.block_bytes
    on = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dev)  # noqa: E731
    ident = torch.arange(R, device=dev)
    s_plan, d_plan = on(plan.src_rows), on(plan.dst_rows)
    rng = np.random.default_rng(seed)
    cases = {
        "kernel: rows in place": (ident, ident, dst),
        "kernel: gather → packed": (s_plan, None, packed),
    }
    for name, order in (("layer order", "layer"), ("interleaved", "interleaved"), ("source order", "src")):
        perm = triton_transports.bulk_order(plan, order)
        cases[f"kernel: paged → paged, {name}"] = (on(plan.src_rows[perm]), on(plan.dst_rows[perm]), dst)
    perm = rng.permutation(R)
    cases["kernel: paged → paged, random order"] = (on(plan.src_rows[perm]), on(plan.dst_rows[perm]), dst)
    desc = dict(PATTERNS)
    rows = []

    def add(name, times, config=""):
        for r, ms in enumerate(times):
            rows.append(dict(pattern=name, description=desc[name], repeat=r, ms=ms, gbps=nbytes / ms / 1e6,
                             bytes=nbytes, rows=R, config=config))

    flat_src = src.view(-1)[: R * src.shape[1]]
    flat_dst = packed.view(-1)
    say("contiguous copy")
    add("contiguous copy_", timing.time_fn(lambda: flat_dst.copy_(flat_src), n=repeats, warmup=warmup, device=dev))
    for name, (s, d, out) in cases.items():
        say(name)
        cfg, _ = kernels.tune(src, s, out, d, repeats=5)
        times = timing.time_fn(lambda: kernels.launch_rows(src, s, out, d, cfg), n=repeats, warmup=warmup, device=dev)
        k = torch.randint(0, R, (512,), device=dev)
        got = out[k if d is None else d[k]]
        if not torch.equal(got.view(torch.int16), src[s[k]].view(torch.int16)):
            raise RuntimeError(f"access pattern {name!r}: the kernel moved the wrong bytes")
        add(name, times, json.dumps(cfg.as_dict()))
    del src_pool, t, packed
    _free(dev)
    return pd.DataFrame(rows)
