"""The paged-transfer measurement: every paged transport beside one contiguous copy of the same bytes.

For each context × block size × destination:

- a source pool twice the size the sequence needs, filled with random values, and a block table drawn
  at random from it (a busy server's scattered free list);
- the destination: a pool on the same GPU or a peer GPU, twice the size, with its own scattered table;
  or a pinned / pageable host pool of exactly the sequence's blocks, written packed (paged → contiguous);
- "contiguous": one copy of the same number of bytes between contiguous buffers on the same path — the
  ceiling every paged method is compared with, measured in the same run;
- each method: constructed once (destination allocated and poisoned), planned (and tuned on a GPU),
  poisoned again, sent once and verified byte for byte (every destination block equals its source block,
  every other destination block still NaN), then timed: `warmup` sends, `repeats` timed sends (CUDA events
  on a GPU for stream-ordered methods; the host clock for NIXL and on a CPU).

Slow methods are not timed 9 times: per-block copy at more than `slow_pieces` pieces, and any method whose
verified send took longer than `slow_call_s`, is timed once (the row's note says so); one that took longer
than `max_call_s` is recorded as skipped with the reason. A method that cannot run here (no CUDA, no
NIXL, old CUDA runtime, a destination it does not serve) gets one "skipped" row with the reason.

Results are tidy: one row per (context, block_size, method, destination, repeat) with pieces (blocks
moved, one per layer side), bytes, ms, gbps (decimal GB/s), verified, status, note.

Beside it: the decode check (kvlab.studies.paged_transfer.correctness), the access patterns of one kernel launch
(.patterns) and NIXL in a process of its own (.nixl_only).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from ... import paged, timing
from ...landing import Landing
from ...paged import BlockAllocator, BlockPool, PoolSpec, registry, verify_transfer
from ...parse import name_list, token_list
from ...timing import free_device as _free, sync_device as _sync
from ...transfer import Destination

__all__ = ["BenchLayout", "LAYOUTS", "METHODS", "GPU_CONTEXTS", "CPU_CONTEXTS", "BLOCK_SIZES", "COLUMNS",
           "default_destinations", "resolve", "check_list", "check_layout", "measure"]


@dataclass(frozen=True)
class BenchLayout:
    """The per-token KV shape being moved: layers, kv_heads, head_dim, dtype."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str = "bf16"

    def spec(self, block_size: int, pool_layout: str = "nhd") -> PoolSpec:
        return PoolSpec(self.layers, block_size, self.kv_heads, self.head_dim, self.dtype, pool_layout)

    @property
    def bytes_per_token(self) -> int:
        return self.spec(1).block_bytes * 2 * self.layers


LAYOUTS = {
    # Qwen2.5-7B: 28 layers, 4 KV heads of 128, bf16 → 57,344 bytes of KV per token
    "qwen2.5-7b": BenchLayout(28, 4, 128, "bf16"),
    # a CPU-sized stand-in with the same structure (2 layers, 2 KV heads of 16)
    "tiny": BenchLayout(2, 2, 16, "bf16"),
}

METHODS = ("contiguous", "per-block-copy", "torch-index", "triton", "chunked-gather-d2h", "chunked-gather-peer",
           "mapped-pinned", "cuda-memcpy-batch", "nixl")
GPU_CONTEXTS = (1024, 4096, 16384, 32768)
CPU_CONTEXTS = (64, 256)
BLOCK_SIZES = (16, 32, 64, 128)
COLUMNS = ["context", "block_size", "method", "destination", "pieces", "bytes", "repeat", "ms", "gbps",
           "verified", "status", "note", "backend", "plan_ms", "pool_layout", "dtype"]


def default_destinations(device: torch.device | str | None = None) -> list[str]:
    """same-gpu and pinned host on a GPU (plus cuda:1 as a peer when there are ≥ 2 GPUs with P2P);
    on a CPU: the same device and pageable host memory."""
    dev = timing.resolve_device(device)
    if dev.type != "cuda":
        return ["same-gpu", "pageable"]
    out = ["same-gpu", "pinned"]
    count = torch.cuda.device_count()
    if count >= 2:
        peer = 1 if (dev.index or 0) != 1 else 0
        if torch.cuda.can_device_access_peer(dev.index or 0, peer):
            out.append(f"cuda:{peer}")
    return out


def _split(value, cast=str) -> list:
    if not isinstance(value, (str, list, tuple)):
        value = [value]
    items = name_list(value) if not isinstance(value, (list, tuple)) or value else []
    try:
        return [cast(v) for v in items]
    except (TypeError, ValueError):
        raise ValueError(f"{value!r} is not a comma-separated list of {getattr(cast, '__name__', 'valid')} values") from None


def _tokens(v) -> int:
    # "32k" / "32K" = 32 × 1024 tokens, as the notebooks write contexts (kvlab.parse.token_list's rule)
    return token_list(str(v))[0]


def resolve(contexts="auto", block_sizes="auto", methods="auto", destinations="auto", layout="auto",
            device=None) -> dict:
    """Turn notebook parameters (comma-separated strings or "auto") into measure() arguments.

    "auto" by hardware — GPU: contexts 1k, 4k, 16k, 32k; Qwen2.5-7B layout; destinations
    default_destinations(); CPU: contexts 64, 256 tokens; the tiny layout. Both: block sizes 16, 32, 64,
    128 and every method. Returns {contexts, block_sizes, methods, destinations, layout, device}.
    """
    dev = timing.resolve_device(device)
    gpu = dev.type == "cuda"
    out = {
        "contexts": list(GPU_CONTEXTS if gpu else CPU_CONTEXTS) if contexts == "auto" else _split(contexts, _tokens),
        "block_sizes": list(BLOCK_SIZES) if block_sizes == "auto" else _split(block_sizes, _tokens),
        "methods": list(METHODS) if methods == "auto" else _split(methods),
        "destinations": default_destinations(dev) if destinations == "auto" else _split(destinations),
        "layout": ("qwen2.5-7b" if gpu else "tiny") if layout == "auto" else layout,
        "device": str(dev),
    }
    check_list("contexts", out["contexts"], positive_int=True)
    check_list("block_sizes", out["block_sizes"], positive_int=True)
    check_list("methods", out["methods"], valid=METHODS)
    check_layout(out["layout"])
    for d in out["destinations"]:
        Destination.parse(d, dev)
    return out


# ---------------------------------------------------------------------------------------------------
# the ceiling: one copy of the same bytes between contiguous buffers


class _Contiguous:
    """One contiguous copy of `nbytes` from the start of the source pool into a flat destination buffer."""

    name = "contiguous"
    stream_ordered = True

    def __init__(self, src_pool: BlockPool, nbytes: int, dest: Destination, src_device: torch.device):
        numel = nbytes // src_pool.spec.element_bytes
        self.src = src_pool.data.view(-1)[:numel]
        self.dst = torch.empty(numel, dtype=src_pool.spec.dtype, device=dest.device,
                               pin_memory=dest.kind == "pinned")
        self.cuda = src_device.type == "cuda"
        self.src_device = src_device
        self.layers = src_pool.spec.layers
        self.stream = torch.cuda.Stream(device=src_device) if self.cuda else None
        self._done = torch.cuda.Event() if self.cuda else None
        self.non_blocking = self.cuda and dest.kind != "pageable"
        self.backend = "copy_"
        self.notes: list[str] = []

    def poison(self):
        self.dst.fill_(float("nan"))

    def send(self, *_):
        if not self.cuda:
            self.dst.copy_(self.src)
            return Landing(self.layers)
        self.stream.wait_stream(torch.cuda.current_stream(self.src_device))
        with torch.cuda.stream(self.stream):
            self.dst.copy_(self.src, non_blocking=self.non_blocking)
        self._done.record(self.stream)
        return Landing(self.layers, [self._done] * self.layers)

    def verify(self) -> dict:
        view = {2: torch.int16, 4: torch.int32, 1: torch.uint8}[self.src.element_size()]
        step = 1 << 27  # compare 128 Mi elements at a time: bounded extra memory
        bad = 0
        for a in range(0, self.src.numel(), step):
            x = self.src[a:a + step].view(view)
            y = self.dst[a:a + step].to(x.device).view(view)
            bad += int((x != y).sum())
        return {"ok": bad == 0, "mismatched_elements": bad}

    def close(self):
        pass


# ---------------------------------------------------------------------------------------------------
# measurement


def check_list(name: str, values, valid=None, positive_int=False) -> list:
    """`values` (one value or a list) as a non-empty list, each a positive int (`positive_int`) or one of `valid`;
    ValueError naming `name` and the bad entry otherwise."""
    if isinstance(values, (str, int)):
        values = [values]
    values = list(values)
    if not values:
        raise ValueError(f"{name} is empty: give at least one value")
    for v in values:
        if positive_int and (isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1):
            raise ValueError(f"{name} entry {v!r} is not valid: give positive ints")
        if valid is not None and v not in valid:
            raise ValueError(f"{name} entry {v!r} is not valid; valid: {list(valid)}")
    return values


def check_layout(layout) -> BenchLayout:
    """The BenchLayout named by `layout` (a LAYOUTS name, a dict of BenchLayout fields, a BenchLayout; None: Qwen2.5-7B);
    ValueError naming the valid names otherwise."""
    if layout is None:
        return LAYOUTS["qwen2.5-7b"]
    if isinstance(layout, BenchLayout):
        return layout
    if isinstance(layout, str):
        try:
            return LAYOUTS[layout]
        except KeyError:
            raise ValueError(f"unknown layout {layout!r}; valid: {sorted(LAYOUTS)} or a BenchLayout") from None
    if isinstance(layout, dict):
        return BenchLayout(**layout)
    raise ValueError(f"layout must be a name {sorted(LAYOUTS)}, a dict or a BenchLayout, got {type(layout).__name__}")


def measure(contexts=GPU_CONTEXTS, block_sizes=BLOCK_SIZES, methods=METHODS, destinations=None, repeats: int = 9,
            warmup: int = 2, device=None, layout=None, pool_layout: str = "nhd", seed: int = 0,
            slow_pieces: int = 20_000, slow_call_s: float = 1.0, max_call_s: float = 120.0, tune: bool = True,
            options: dict | None = None, progress=None) -> pd.DataFrame:
    """Measure paged transports against the contiguous ceiling; returns the tidy results (see COLUMNS).

    contexts: tokens per sequence; block_sizes: tokens per block; methods: names from METHODS
    ("contiguous" is always measured, first, as the ceiling); destinations: "same-gpu", "cuda:N",
    "pinned", "pageable" (default: default_destinations(device)); layout: a LAYOUTS name, dict or
    BenchLayout (default Qwen2.5-7B); pool_layout: "nhd" | "hnd"; tune: tune Triton kernels on a GPU;
    options: {method: {option: value}} passed to the transports; progress: callable(str) for status lines.

    Columns: context (tokens), block_size (tokens), method, destination (label), pieces (blocks moved, one
    per layer side; 1 for contiguous), bytes (payload), repeat, ms (one send), gbps (bytes / ms / 10⁶),
    verified (byte-exact check before timing), status ("ok" | "skipped" | "failed"), note (fallbacks,
    tuned config, slow-method handling, skip reasons), backend (what actually ran), plan_ms (host time to
    construct the transport and build its plan: allocation, poisoning, index arrays, kernel tuning and
    compilation; not part of ms), pool_layout, dtype.
    `df.attrs["transports"]` holds each transport's configuration (backend, notes, tuning, NIXL setup).
    """
    device = timing.resolve_device(device)
    contexts = check_list("contexts", contexts, positive_int=True)
    block_sizes = check_list("block_sizes", block_sizes, positive_int=True)
    methods = check_list("methods", methods, valid=METHODS)
    if "contiguous" in methods:
        methods.remove("contiguous")
    methods = ["contiguous", *dict.fromkeys(methods)]
    dests = [Destination.parse(d, device) for d in check_list(
        "destinations", destinations if destinations is not None else default_destinations(device))]
    if pool_layout not in paged.LAYOUTS:
        raise ValueError(f"pool_layout {pool_layout!r} is not valid; use one of {list(paged.LAYOUTS)}")
    lay = check_layout(layout)
    for name, v, lo in (("repeats", repeats, 1), ("warmup", warmup, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{name}={v!r}: expected an int ≥ {lo}")
    options = dict(options or {})
    for m in options:
        if m not in METHODS:
            raise ValueError(f"options given for unknown method {m!r}; valid: {list(METHODS)}")
    say = progress or (lambda s: None)
    rows: list[dict] = []
    configs: list[dict] = []
    for context in contexts:
        for bs in block_sizes:
            spec = lay.spec(bs, pool_layout)
            n = spec.blocks_for(context)
            pieces = 2 * spec.layers * n
            nbytes = spec.payload_bytes(context)
            base = dict(context=context, block_size=bs, pieces=pieces, bytes=nbytes, pool_layout=pool_layout,
                        dtype=str(spec.dtype).removeprefix("torch."))
            src_pool = BlockPool(spec, 2 * n, device=device).fill_random(seed)
            src_table = BlockAllocator(2 * n, bs, seed=seed).allocate(context)
            for dest in dests:
                host = dest.kind in ("pinned", "pageable")
                dst_blocks = n if host else 2 * n
                dst_table = None if host else BlockAllocator(2 * n, bs, seed=seed + 1).allocate(context)
                for method in methods:
                    say(f"{context} tokens, {bs}-token blocks, {method} → {dest.label}")
                    opts = _options_for(method, options, tune, device, spec, nbytes)
                    got, cfg = _measure_one(method, opts, spec, dest, dst_blocks, device, src_pool, src_table,
                                            dst_table, nbytes, pieces, repeats, warmup, slow_pieces, slow_call_s,
                                            max_call_s)
                    for r in got:
                        rows.append({**base, "method": method, "destination": dest.label,
                                     "pieces": 1 if method == "contiguous" else pieces, **r})
                    if cfg is not None:
                        configs.append({"context": context, "block_size": bs, "destination": dest.label, **cfg})
            del src_pool
            _free(device)
    df = pd.DataFrame(rows, columns=COLUMNS)
    df.attrs["transports"] = configs
    return df


def _options_for(method, options, tune, device, spec, nbytes) -> dict:
    opts = dict(options.get(method, {}))
    if method in ("triton", "chunked-gather-d2h", "chunked-gather-peer", "mapped-pinned"):
        opts.setdefault("tune", bool(tune) and device.type == "cuda")
    if method == "chunked-gather-d2h" and device.type != "cuda":
        # a CPU-sized chunk so the ring really cycles (several chunks per send)
        opts.setdefault("chunk_mib", max(spec.block_bytes, nbytes // 4) / 2**20)
    return opts


def _row(ms=float("nan"), nbytes=0, repeat=0, verified=False, status="ok", note="", backend="", plan_ms=float("nan")):
    gbps = nbytes / (ms * 1e6) if ms == ms and ms > 0 else float("nan")
    return dict(repeat=repeat, ms=ms, gbps=gbps, verified=verified, status=status, note=note, backend=backend,
                plan_ms=plan_ms)


def _measure_one(method, opts, spec, dest, dst_blocks, device, src_pool, src_table, dst_table, nbytes, pieces,
                 repeats, warmup, slow_pieces, slow_call_s, max_call_s):
    """Rows for one method on one configuration, and the transport's configuration record."""
    if method != "contiguous":
        if dest.kind not in registry.TRANSPORTS[method].kinds:
            return [], None  # not a path this method serves (e.g. a host-only method to a GPU): no row
        why = registry.unavailable(method, device, dest)
        if why is not None:
            return [_row(status="skipped", note=why)], None
    t = None
    try:
        t0 = time.perf_counter()
        if method == "contiguous":
            t = _Contiguous(src_pool, nbytes, dest, device)
        else:
            t = registry.make_transport(method, spec, dest, dst_blocks, device, **opts)
            t.prepare(src_pool, src_table, dst_table)
        _sync(device)
        plan_ms = (time.perf_counter() - t0) * 1e3
        # verified send: poison after planning (tuning writes the destination rows), send once, check
        t.poison()
        _sync(device)
        t0 = time.perf_counter()
        t.send(src_pool, src_table, dst_table).wait()
        _sync(device)
        first_s = time.perf_counter() - t0
        check = t.verify() if method == "contiguous" else verify_transfer(src_pool, src_table, t.pool, dst_table)
        backend = t.backend
        notes = list(t.notes)
        if not check["ok"]:
            return [_row(nbytes=nbytes, status="failed", note=f"verification failed: {check}", backend=backend,
                         plan_ms=plan_ms)], _config(t, method)
        reps, warm = repeats, warmup
        if first_s > max_call_s:
            return [_row(nbytes=nbytes, verified=True, status="skipped", backend=backend, plan_ms=plan_ms,
                         note=f"one send took {first_s:.1f} s (> max_call_s={max_call_s:g}): not timed")], _config(t, method)
        if method == "per-block-copy" and pieces > slow_pieces:
            reps, warm = 1, 0
            notes.append(f"timed once: {pieces:,} pieces > {slow_pieces:,} (one send took {first_s:.2f} s)")
        elif first_s > slow_call_s:
            reps, warm = 1, 0
            notes.append(f"timed once: one send took {first_s:.2f} s (> {slow_call_s:g} s)")
        times = _time(t, src_pool, src_table, dst_table, reps, warm, device)
        note = "; ".join(notes)
        return [_row(ms, nbytes, r, True, "ok", note, backend, plan_ms) for r, ms in enumerate(times)], _config(t, method)
    except (RuntimeError, ValueError, OSError) as exc:
        # a method that fails here must not sink the other methods' measurements: record why
        return [_row(status="failed", note=f"{type(exc).__name__}: {exc}")], None
    finally:
        if t is not None:
            t.close()
        del t
        _free(device)


def _config(t, method) -> dict:
    info = {"method": method, "backend": t.backend, "notes": list(t.notes)}
    if hasattr(t, "config"):
        info["config"] = t.config
    return info


def _time(t, src_pool, src_table, dst_table, reps, warm, device) -> list[float]:
    if device.type == "cuda" and t.stream_ordered:
        cur = torch.cuda.current_stream(device)

        def fn():
            t.send(src_pool, src_table, dst_table).stream_wait(cur)

        return timing.time_fn(fn, n=reps, warmup=warm, device=device)

    def host_fn():
        t.send(src_pool, src_table, dst_table).wait()

    return timing.time_fn(host_fn, n=reps, warmup=warm, device="cpu")
