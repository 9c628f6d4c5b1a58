"""The decode side's half of a host-staged handoff: a paged cache held in pinned host memory is scattered into the
decode GPU's pool by block table (vLLM's swap-in), measured beside the prefill side's half, the GPU → host gather
(notebook 04's `chunked-gather-d2h`), each against one contiguous copy of the same bytes over the same link,
timed in the same run.

    kvlab swapin --model qwen2.5-7b --context 4k,32k --block-size 16 --repeats 9

The host side holds the blocks two ways: `scattered`, a host pool with its own block table (vLLM's CPU swap
space), and `packed`, the blocks in table order (what a prefill-side gather to host writes). Host → GPU methods:
    triton-uva      kvlab's Triton row kernel, launched on the GPU, reads each block straight from pinned host
                    memory (unified virtual addressing: the GPU reads over PCIe) and writes it to its block of the
                    GPU pool: one launch, no staging, no copy engine (both layouts; tile tuned on the first rows).
    staged          scattered: the CPU gathers the blocks into a pinned staging buffer (torch.index_select), one
                    copy-engine copy brings it to the GPU, the row kernel scatters it there.
    copy + scatter  packed: one copy-engine copy, then the row kernel's scatter on the GPU.
GPU → host, beside them: `chunked-gather-d2h` (kvlab.paged.triton_transports), the same blocks the other way, into a packed
host buffer (notebook 04's case) and into a scattered host pool.

Both pools hold twice the blocks the context needs and the tables are drawn at random in each (a busy server's
free lists). Before every send the destination pool is poisoned (NaN); after the first send of each method every
table block is compared with its source and every other block must still be poisoned. Times are host-clock
(synchronise, clock, send, synchronise, clock), the same way for a method and its ceiling, which is timed beside
every repeat of every method (before it, then after it, in turn); median of the repeats with min–max. (Runs
20261201-030223 and -030638 timed all the ceiling's repeats first.)
On a CPU the "GPU" pool is a second host pool: the staged path runs (CI checks it), the others say
they need CUDA.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import pandas as pd
import torch

from ... import plots
from ...paged import BlockAllocator, BlockPool, PoolSpec, kernels, registry
from ...timing import sync_device
from ...intervals import ratio_ci

__all__ = ["H2D_METHODS", "measure", "paged_rows", "summarise", "plot"]

H2D_METHODS = ("triton-uva", "staged")
_TUNE_ROWS = 16384  # tune triton-uva's tile on the first 16,384 rows (256 MiB of 16 KiB rows), as notebook 04 does


def _clock(fn, device: torch.device) -> float:
    sync_device(device)
    t0 = time.perf_counter()
    fn()
    sync_device(device)
    return (time.perf_counter() - t0) * 1e3


def _fill(pool: BlockPool, seed: int) -> None:
    """Distinct rows, cheaply: one random row everywhere, then each row's first 32-bit word set to its row number
    (a wrong or swapped row cannot match its source)."""
    w = pool.rows.view(torch.int32)
    g = torch.Generator().manual_seed(seed)
    w.copy_(torch.randint(-2**31, 2**31 - 1, (1, w.shape[1]), dtype=torch.int32, generator=g).expand_as(w))
    w[:, 0] = torch.arange(w.shape[0], dtype=torch.int32, device=w.device)


def _verify(dst: BlockPool, dst_ids, src: BlockPool, src_ids) -> bool:
    """Every table block of `dst` equals its source block, bit for bit; every other block is still poisoned."""
    s_ids, d_ids = torch.tensor(np.asarray(src_ids).tolist()), torch.tensor(np.asarray(dst_ids).tolist())
    s = src.rows.view(src.spec.layers * 2, src.num_blocks, -1)[:, s_ids.to(src.rows.device)].to("cpu")
    d_all = dst.rows.view(dst.spec.layers * 2, dst.num_blocks, -1).to("cpu")
    d = d_all[:, d_ids]
    word = torch.int16 if s.element_size() == 2 else torch.int32 if s.element_size() == 4 else torch.uint8
    same = torch.equal(s.view(word), d.view(word))
    rest = torch.ones(dst.num_blocks, dtype=torch.bool)
    rest[d_ids] = False
    return same and bool(torch.isnan(d_all[:, rest].float()).all())


def measure(spec: PoolSpec, contexts, device, repeats: int = 9, seed: int = 0, progress=None) -> pd.DataFrame:
    """One row per (context, direction, method, repeat): ms, bytes, GB/s, verified, note. Methods that cannot run
    here get one row with ms NaN and the reason in `note`."""
    dev = torch.device(device)
    rows = []
    for context in contexts:
        rows += _measure_one(spec, context, dev, repeats, seed)  # a context's pools are freed on return
        if progress:
            progress(context)
    return pd.DataFrame(rows)


def _measure_one(spec: PoolSpec, context: int, dev: torch.device, repeats: int, seed: int) -> list[dict]:
    gpu = dev.type == "cuda"
    rows = []
    n = spec.blocks_for(context)
    host = BlockPool(spec, 2 * n, device="cpu", pin_memory=gpu)
    pool = BlockPool(spec, 2 * n, device=dev)
    h_ids = BlockAllocator(2 * n, spec.block_size, seed=seed, order="random").allocate(context).ids
    d_ids = BlockAllocator(2 * n, spec.block_size, seed=seed + 1, order="random").allocate(context).ids
    _fill(host, seed)
    hr = torch.as_tensor(paged_rows(spec, 2 * n, h_ids))  # the host pool's rows of the table, layer side major
    dr = torch.as_tensor(paged_rows(spec, 2 * n, d_ids))
    packed = torch.empty((len(hr), host.rows.shape[1]), dtype=host.rows.dtype, pin_memory=gpu)
    torch.index_select(host.rows, 0, hr, out=packed)  # the same blocks in table order: a gather to host writes this
    nbytes = packed.numel() * packed.element_size()
    flat_h = torch.empty(nbytes, dtype=torch.uint8, pin_memory=gpu)
    flat_d = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    base = {"context": context, "block_size": spec.block_size, "bytes": nbytes}

    def add(direction, layout, method, ms, verified=None, note=""):
        rows.append({**base, "direction": direction, "host_layout": layout, "method": method, "ms": ms,
                     "gbps": nbytes / ms / 1e6 if ms == ms else float("nan"), "verified": verified, "note": note})

    # the ceilings: one contiguous copy of the same bytes each way, timed beside every repeat of every method
    # (before it in one repeat, after it in the next), so that drift over the run reaches both alike
    ceiling = {"host→gpu": lambda: flat_d.copy_(flat_h, non_blocking=True),
               "gpu→host": lambda: flat_h.copy_(flat_d, non_blocking=True)}

    def timed(direction, layout, method, fn, before=None, check=None):
        for r in range(repeats + 1):
            if before is not None:
                before()
            first = r % 2 == 0
            c = _clock(ceiling[direction], dev) if not first else None
            ms = _clock(fn, dev)
            c = _clock(ceiling[direction], dev) if first else c
            if r:
                add(direction, layout, method, ms)
                add(direction, "contiguous", "contiguous", c)
            elif check is not None and not check():
                raise RuntimeError(f"{method} ({layout}) wrote a wrong or stray block at context {context}")

    sends = {}
    hr_dev, dr_dev = hr.to(dev), dr.to(dev)
    staging_h = torch.empty_like(packed, pin_memory=gpu)
    staging_d = torch.empty_like(packed, device=dev)
    ar = torch.arange(len(hr), device=dev)
    triton_ok, why_not = kernels.triton_status(dev) if gpu else (False, "this run has no GPU")
    if triton_ok:
        k = slice(0, _TUNE_ROWS)
        cfg, _ = kernels.tune(host.rows, hr_dev[k], pool.rows, dr_dev[k], device=dev)
        cfg_p, _ = kernels.tune(packed, ar[k], pool.rows, dr_dev[k], device=dev)
        sends[("scattered", "triton-uva")] = lambda: kernels.launch_rows(host.rows, hr_dev, pool.rows, dr_dev, cfg)
        sends[("packed", "triton-uva")] = lambda: kernels.launch_rows(packed, ar, pool.rows, dr_dev, cfg_p)
    else:
        for layout in ("scattered", "packed"):
            add("host→gpu", layout, "triton-uva", float("nan"), note=f"needs a CUDA GPU with Triton: {why_not}")

    def staged():  # the CPU gathers, one copy, the GPU scatters
        torch.index_select(host.rows, 0, hr, out=staging_h)
        staging_d.copy_(staging_h, non_blocking=True)
        kernels.copy_rows(staging_d, ar, pool.rows, dr_dev, check_bounds=False)

    def copy_scatter():  # already packed: one copy, the GPU scatters
        staging_d.copy_(packed, non_blocking=True)
        kernels.copy_rows(staging_d, ar, pool.rows, dr_dev, check_bounds=False)

    sends[("scattered", "staged")] = staged
    sends[("packed", "copy + scatter")] = copy_scatter
    for (layout, method), fn in sends.items():  # packed holds the host pool's table blocks, in order
        timed("host→gpu", layout, method, fn, before=pool.poison, check=lambda: _verify(pool, d_ids, host, h_ids))
    # the other way, beside it: notebook 04's gather to pinned host, the same blocks from the GPU pool's table,
    # into a packed host buffer (what notebook 04 measured) and into the host pool's own table
    why = registry.unavailable("chunked-gather-d2h", dev, "pinned")
    if why:
        for layout in ("packed", "scattered"):
            add("gpu→host", layout, "chunked-gather-d2h", float("nan"), note=why)
        for _ in range(repeats):  # the ceiling alone, so the direction still has one
            add("gpu→host", "contiguous", "contiguous", _clock(ceiling["gpu→host"], dev))
        return rows
    _fill(pool, seed + 2)
    src_t = BlockAllocator(2 * n, spec.block_size, seed=seed + 1, order="random").allocate(context)
    host_t = BlockAllocator(2 * n, spec.block_size, seed=seed, order="random").allocate(context)
    for layout, dst_t in (("packed", None), ("scattered", host_t)):
        # a transport each: its pool's blocks belong to one sequence at a time
        back = registry.make_transport("chunked-gather-d2h", spec, "pinned", 2 * n, src_device=dev)
        back.prepare(pool, src_t, dst_t)
        want = np.arange(len(src_t.ids)) if dst_t is None else dst_t.ids
        timed("gpu→host", layout, "chunked-gather-d2h", lambda: back.send(pool, src_t, dst_t).wait(),
              before=back.poison, check=lambda: _verify(back.pool, want, pool, src_t.ids))
        back.close()
    return rows


def paged_rows(spec: PoolSpec, num_blocks: int, ids) -> np.ndarray:
    """Row numbers, in a pool's `.rows` view, of every layer side's blocks `ids` (layer side major, table order)."""
    ids = np.asarray(ids, dtype=np.int64)
    return (np.arange(2 * spec.layers, dtype=np.int64)[:, None] * num_blocks + ids[None, :]).reshape(-1)


def summarise(df: pd.DataFrame) -> pd.DataFrame:
    """Per (context, direction, host layout, method): median ms (min–max), GB/s, and % of the same direction's
    contiguous copy with the 95 % interval of that ratio (kvlab.intervals.ratio_ci)."""
    if "host_layout" not in df.columns:  # run 20261201-030223 (before the column): every host pool was scattered
        df = df.assign(host_layout=np.where(df["method"] == "contiguous", "contiguous", "scattered"))
    out = []
    for (context, direction), g in df.groupby(["context", "direction"], sort=False):
        ceil = g[g.method == "contiguous"]["ms"].dropna().tolist()
        for (layout, method), m in g.groupby(["host_layout", "method"], sort=False):
            ms = m["ms"].dropna().tolist()
            row = {"context": int(context), "direction": direction, "host_layout": layout, "method": method,
                   "n": len(ms),
                   "bytes": int(m["bytes"].iloc[0]), "note": "; ".join(sorted(set(m["note"].dropna().astype(str)) - {""}))}
            if ms:
                med = statistics.median(ms)
                lo, hi = ratio_ci(ceil, ms) if method != "contiguous" else (1.0, 1.0)
                row.update(ms=med, ms_min=min(ms), ms_max=max(ms), gbps=row["bytes"] / med / 1e6,
                           pct_of_ceiling=100 * statistics.median(ceil) / med, pct_lo=100 * lo, pct_hi=100 * hi)
            out.append(row)
    return pd.DataFrame(out)


def plot(summary: pd.DataFrame, title: str = ""):
    """Each method's share of the contiguous copy of the same bytes (median, 95 % interval), host → GPU on the
    left and GPU → host on the right, one bar per context; methods that did not run are left out."""
    import matplotlib.pyplot as plt

    s = summary[(summary["method"] != "contiguous") & (summary["n"] > 0)]
    if s.empty:
        raise ValueError("no method but the contiguous copy ran in this run: there is nothing to plot")
    contexts = sorted(s["context"].unique())
    colors = {c: plots.CYCLE[k % len(plots.CYCLE)] for k, c in enumerate(contexts)}
    dirs = [d for d in ("host→gpu", "gpu→host") if d in set(s["direction"])]
    fig, axes = plt.subplots(1, len(dirs), figsize=(10.5, 4.4), squeeze=False,
                             gridspec_kw={"width_ratios": [max(1, s[s.direction == d][["host_layout", "method"]]
                                                               .drop_duplicates().shape[0]) for d in dirs]})
    for ax, d in zip(axes[0], dirs):
        g = s[s.direction == d]
        names = {"chunked-gather-d2h": "chunked gather"}
        labels = list(dict.fromkeys(f"{names.get(m, m)}\n({lay})" for lay, m in zip(g["host_layout"], g["method"])))
        x = np.arange(len(labels))
        width = 0.8 / max(1, len(contexts))
        for k, c in enumerate(contexts):
            gc = g[g.context == c]
            key = {f"{names.get(m, m)}\n({lay})": r for lay, m, r in zip(gc["host_layout"], gc["method"],
                                                                           gc.itertuples())}
            v = np.array([key[lb].pct_of_ceiling if lb in key else np.nan for lb in labels])
            lo = np.array([key[lb].pct_lo if lb in key else np.nan for lb in labels])
            hi = np.array([key[lb].pct_hi if lb in key else np.nan for lb in labels])
            err = np.clip(np.vstack([np.nan_to_num(v - lo), np.nan_to_num(hi - v)]), 0, None)
            ax.bar(x + (k - (len(contexts) - 1) / 2) * width, v, width, yerr=err, color=colors[c], capsize=2,
                   label=f"{c // 1024}k tokens" if c >= 1024 else f"{c} tokens")
        ax.axhline(100, color="0.4", lw=0.8, ls="--")
        ax.set_xticks(x, labels)
        ax.set_ylim(0, 125)
        ax.set_title({"host→gpu": "pinned host → GPU pool", "gpu→host": "GPU pool → pinned host"}[d])
    axes[0][0].set_ylabel("% of a contiguous copy of the same bytes")
    axes[0][0].legend(loc="upper left", ncol=len(contexts), frameon=False)
    fig.suptitle(title or "A paged cache across PCIe: what each method keeps of the link")
    fig.tight_layout()
    return fig
