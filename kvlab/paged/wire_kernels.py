"""Triton kernels of the FP8 wire (format and rounding: kvlab.paged.wire's module doc), one pass each:

    quantize_gather     bf16 pool blocks of a block table → e4m3 payload + float32 scales, per-token-head scales
                        computed in the kernel; the packet may be GPU memory or pinned host memory, which the
                        kernel's stores reach through UVA (as kvlab.paged.triton_transports.MappedPinned's do)
    dequantize_scatter  packet (GPU or pinned host, read through UVA) → bf16 blocks of a destination pool

and `bench_wire`, which times them against a plain bf16 copy of the same cache. Layers of a batch-1 contiguous
cache, [n, 2, 1, H, T, D], are the one block of an n-layer hnd pool of block size T, so the same kernels quantize
and dequantize them in place of a gather (`quantize_contiguous`, `dequantize_contiguous`: the FP8 wire between two
processes, kvlab.disagg.wire_codec).

One program takes `pairs` (token, head) pairs of one block of one layer side, each a contiguous head_dim
vector in both pool layouts (a block is block_size · kv_heads such vectors, token-major in nhd, head-major in
hnd), so its loads are contiguous whatever the layout and only the wire-side offsets depend on it.

Rounding: Triton's interpreter rounds float32 → float8 and float32 → bf16 half-up (and truncates subnormals),
not to nearest even, so its `.to(tl.float8e4nv)` cannot agree with torch bit for bit. The kernels therefore
load and store raw bits (bf16 as int16, e4m3 as uint8) and, with WireConfig(convert="int"), round with integer
operations that mean the same on the interpreter and on a GPU; the only float operations are IEEE multiplies
and `tl.div_rn` divisions (one per scale), which round identically everywhere. On a GPU with native FP8
(compute capability ≥ 8.9) the default is the hardware casts (convert="hw", about 2.4× faster on an H200),
which also round to nearest even; both agreed with torch bit for bit on an H200 (Triton 3.6), every scale mode,
both layouts, 32k tokens of the Qwen2.5-7B shape.
CPU: the kernels run under TRITON_INTERPRET=1 (tests, tiny sizes); without it backend="auto" runs the torch
reference (kvlab.paged.wire) and `wire_backend` says so.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .. import timing
from . import kernels
from .pools import BlockPool, BlockTable, PoolSpec, positive_int
from .wire import (SCALE_MODES, WirePacket, calibrate_scales, check_mode, check_packet_for_pool,
                   check_static_scales, dequantize_scatter_reference, empty_packet, layer_range,
                   quantize_gather_reference)

__all__ = ["WireConfig", "wire_backend", "quantize_gather", "dequantize_scatter", "quantize_contiguous",
           "dequantize_contiguous", "bench_wire"]

_MODE_ID = {"per-token-head": 0, "per-head": 1, "per-tensor": 2}


@dataclass(frozen=True)
class WireConfig:
    """Tile and launch shape of both kernels.

    pairs: (token, head) vectors per program, a power of two; 0 = a whole block (capped at 8192 elements a
        program). A whole block keeps an hnd pool's per-token-head scale stores contiguous, which pinned host
        memory needs (H200, Qwen2.5-7B shape, 32k tokens: 29.5 ms to pinned with 16 pairs, 18.4 ms with 64).
    num_warps: per program (4 was fastest there).
    convert: how float32 becomes e4m3 and bf16. "int": integer rounding, the same bits on every backend (the
        interpreter included); "hw": Triton's float8e4nv / bfloat16 casts, GPU only (round to nearest even on
        Hopper; 2.3 TB/s of input instead of 0.95 for the quantize-gather there); "auto" = "hw" on a CUDA GPU of
        compute capability ≥ 8.9 (native FP8), else "int". bench_wire's check compares either with the torch
        reference bit for bit.
    """

    pairs: int = 0
    num_warps: int = 4
    convert: str = "auto"

    def __post_init__(self):
        if self.convert not in ("auto", "int", "hw"):
            raise ValueError(f"WireConfig.convert must be 'auto', 'int' or 'hw', got {self.convert!r}")
        if not isinstance(self.pairs, int) or self.pairs < 0 or (self.pairs and self.pairs & (self.pairs - 1)):
            raise ValueError(f"WireConfig.pairs must be 0 or a power of two, got {self.pairs!r}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"WireConfig.num_warps must be a power of two in 1…16, got {self.num_warps!r}")

    def resolved(self, block_pairs: int, d_pad: int) -> int:
        whole = 1 << max(block_pairs - 1, 0).bit_length()
        return min(whole, self.pairs or max(1, 8192 // d_pad))

    def hw_convert(self, device: torch.device) -> bool:
        """Whether kernels on `device` use the hardware casts; ValueError for "hw" on a CPU (the interpreter
        rounds float8 and bf16 casts half-up, not to nearest even)."""
        device = torch.device(device)
        if self.convert == "hw" and device.type != "cuda":
            raise ValueError("WireConfig(convert='hw') needs a GPU: Triton's interpreter rounds float8 and bf16 casts "
                             "half-up, not to nearest even; use convert='int' or 'auto'")
        if self.convert == "auto":
            return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
        return self.convert == "hw"


def wire_backend(device: torch.device | str, backend: str = "auto") -> tuple[str, str]:
    """("triton" | "torch", why) for kernels on `device` (kvlab.paged.kernels.triton_status decides "auto")."""
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend {backend!r} is not valid; use 'auto', 'triton' or 'torch'")
    ok, why = kernels.triton_status(device)
    if backend == "triton" and not ok:
        raise ValueError(f"backend='triton' is not available here: {why}")
    if backend == "torch" or not ok:
        return "torch", why if not ok else "torch reference asked for"
    return "triton", why


# ---------------------------------------------------------------------------------------------------
# the kernels

_KERNELS: dict = {}


def _kernels(interpret: bool):
    """(quantize-gather, dequantize-scatter) kernels, built on first use per mode; TRITON_INTERPRET is pinned
    while decorating (Triton reads it then), as kvlab.paged.kernels does, so a CPU test cannot make a GPU kernel Python."""
    k = _KERNELS.get(interpret)
    if k is None:
        saved = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
        try:
            k = _KERNELS[interpret] = _decorate()
        finally:
            if saved is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = saved
    return k


def _decorate():
    # a fresh copy of kvlab/paged/wire_triton.py per mode: its jit functions are decorated while TRITON_INTERPRET is
    # pinned, and each copy's kernels call that copy's combine function
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "wire_triton.py")
    mode = "interpreted" if os.environ["TRITON_INTERPRET"] == "1" else "compiled"
    spec = importlib.util.spec_from_file_location(f"kvlab.wire_triton_{mode}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.quantize_gather_kernel, mod.dequantize_scatter_kernel


def _launch_shape(spec, n_blocks: int, layers: int, config: WireConfig) -> tuple[int, int, int, int]:
    d_pad = 1 << max(spec.head_dim - 1, 0).bit_length()
    pairs = spec.block_size * spec.kv_heads
    tp = config.resolved(pairs, d_pad)
    n_chunks = -(-pairs // tp)
    return d_pad, tp, n_chunks, 2 * layers * n_blocks * n_chunks


def _reachable(t: torch.Tensor, kernel_device: torch.device) -> bool:
    """Can a kernel on `kernel_device` read and write `t`? (its own GPU, or pinned host memory for a GPU kernel)"""
    if kernel_device.type == "cpu":
        return t.device.type == "cpu"
    if t.device.type == "cpu":
        return t.is_pinned()
    return t.device == kernel_device


# ---------------------------------------------------------------------------------------------------
# launchers


def quantize_gather(pool: BlockPool, table: BlockTable, scales_mode: str, static_scales=None, *,
                    out: WirePacket | None = None, layers=None, backend: str = "auto",
                    config: WireConfig | None = None) -> WirePacket:
    """`table`'s blocks of a bf16 pool as a WirePacket (kvlab.paged.wire's format), in one kernel pass.

    static_scales: per-head [layers, 2, kv_heads] / per-tensor [layers, 2] float32 (kvlab.paged.wire.calibrate_scales),
    None for per-token-head. out: a packet to write (kvlab.paged.wire.empty_packet: GPU memory, or pinned host memory
    written through UVA); default a new one on the pool's device. layers: None or (first, end).
    backend: "auto" | "triton" | "torch" (kvlab.paged.wire.quantize_gather_reference). Enqueued on the current stream
    of the pool's device. Bad input raises ValueError before anything is written.
    """
    if not isinstance(pool, BlockPool) or pool.spec.dtype != torch.bfloat16:
        raise ValueError(f"pool must be a bfloat16 BlockPool, got {getattr(pool, 'spec', type(pool).__name__)}")
    if not isinstance(table, BlockTable):
        raise ValueError(f"table must be a BlockTable, got {type(table).__name__}")
    pool.check_table(table, "source table")
    check_mode(scales_mode)
    static = check_static_scales(static_scales, scales_mode, pool.spec)
    lo, hi = layer_range(layers, pool.spec.layers)
    config = config or WireConfig()
    if not isinstance(config, WireConfig):
        raise ValueError(f"config must be a WireConfig, got {type(config).__name__}")
    hw = config.hw_convert(pool.device)
    if out is not None:
        want = empty_packet(pool.spec, table, scales_mode, "meta", layers=(lo, hi))
        if not isinstance(out, WirePacket) or out.mode != scales_mode or out.payload.shape != want.payload.shape or \
                out.first_layer != lo or out.tokens != table.tokens or out.block_size != table.block_size:
            raise ValueError(f"out must be a {scales_mode} WirePacket of payload {tuple(want.payload.shape)} for "
                             f"layers {lo} … {hi - 1} and {table.tokens} tokens (kvlab.paged.wire.empty_packet)")
        for name, t in (("payload", out.payload), ("scales", out.scales)):
            if not _reachable(t, pool.device):
                raise ValueError(f"out.{name} on {t.device}{' (pageable)' if t.device.type == 'cpu' else ''} cannot "
                                 f"be written by a kernel on {pool.device}: use that device or pinned host memory")
    which, _ = wire_backend(pool.device, backend)
    if which == "torch":
        ref = quantize_gather_reference(pool, table, scales_mode, static, layers=(lo, hi))
        if out is None:
            return ref
        out.payload.copy_(ref.payload)
        out.scales.copy_(ref.scales)
        return out
    if out is None:
        out = empty_packet(pool.spec, table, scales_mode, pool.device, layers=(lo, hi))
    s = pool.spec
    d_pad, tp, n_chunks, grid = _launch_shape(s, table.num_blocks, hi - lo, config)
    sc_in = static.to(pool.device) if static is not None else out.scales
    quant, _ = _kernels(pool.device.type == "cpu")
    quant[(grid,)](pool.data.view(torch.int16), table.tensor(pool.device), out.payload, out.scales, sc_in,
                   table.num_blocks, pool.num_blocks, 2 * lo, n_chunks, BS=s.block_size, H=s.kv_heads, D=s.head_dim,
                   D_PAD=d_pad, TP=tp, HND=s.layout == "hnd", MODE=_MODE_ID[scales_mode], HW=hw,
                   num_warps=config.num_warps)
    return out


def dequantize_scatter(packet: WirePacket, dst_pool: BlockPool, dst_table: BlockTable, *, backend: str = "auto",
                       config: WireConfig | None = None) -> None:
    """`packet` → bf16 into `dst_table`'s blocks of `dst_pool` (either layout), whole blocks, its layers only, in
    one kernel pass on the pool's device; the packet may be on that GPU or in pinned host memory (read through
    UVA). backend as in quantize_gather. Ownership and landing records are the caller's (a transport's)."""
    if not isinstance(dst_table, BlockTable):
        raise ValueError(f"dst_table must be a BlockTable, got {type(dst_table).__name__}")
    check_packet_for_pool(packet, dst_pool, dst_table)
    config = config or WireConfig()
    if not isinstance(config, WireConfig):
        raise ValueError(f"config must be a WireConfig, got {type(config).__name__}")
    hw = config.hw_convert(dst_pool.device)
    for name, t in (("payload", packet.payload), ("scales", packet.scales)):
        if not _reachable(t, dst_pool.device):
            raise ValueError(f"packet.{name} on {t.device}{' (pageable)' if t.device.type == 'cpu' else ''} cannot be "
                             f"read by a kernel on {dst_pool.device}: copy it there or use pinned host memory")
    which, _ = wire_backend(dst_pool.device, backend)
    if which == "torch":
        dequantize_scatter_reference(packet, dst_pool, dst_table)
        return
    s = dst_pool.spec
    d_pad, tp, n_chunks, grid = _launch_shape(s, dst_table.num_blocks, packet.layers, config)
    _, deq = _kernels(dst_pool.device.type == "cpu")
    deq[(grid,)](packet.payload, packet.scales, dst_pool.data.view(torch.int16), dst_table.tensor(dst_pool.device),
                 dst_table.num_blocks, dst_pool.num_blocks, 2 * packet.first_layer, n_chunks, BS=s.block_size,
                 H=s.kv_heads, D=s.head_dim, D_PAD=d_pad, TP=tp, HND=s.layout == "hnd", MODE=_MODE_ID[packet.mode],
                 HW=hw, num_warps=config.num_warps)


# ---------------------------------------------------------------------------------------------------
# layers of a contiguous cache

_ONE_BLOCK: dict = {}  # (tokens, device) → the one-block table of contiguous layers (its ids tensor cached there)


def _as_pool(x: torch.Tensor) -> tuple[BlockPool, BlockTable]:
    """Contiguous bf16 layers x [n, 2, 1, H, T, D] as an n-layer hnd pool of one block of T tokens (no copy)."""
    if x.dim() != 6 or x.shape[1] != 2 or x.shape[2] != 1 or x.dtype != torch.bfloat16 or not x.is_contiguous():
        raise ValueError(f"contiguous bf16 layers [n, 2, 1, H, T, D] of a batch-1 cache are expected, got {x.dtype} "
                         f"{tuple(x.shape)} contiguous={x.is_contiguous()}")
    n, _, _, h, t, d = x.shape
    pool = BlockPool(PoolSpec(n, t, h, d, torch.bfloat16, "hnd"), 1, x.device, data=x)
    key = (t, str(x.device))
    if key not in _ONE_BLOCK:
        _ONE_BLOCK[key] = BlockTable([0], t, t)
    return pool, _ONE_BLOCK[key]


def _packet(x: torch.Tensor, mode: str, payload: torch.Tensor, scales: torch.Tensor) -> WirePacket:
    n, _, _, h, t, d = x.shape
    lead = {"per-token-head": (n, 2, t, h), "per-head": (n, 2, h), "per-tensor": (n, 2)}[mode]
    return WirePacket(payload.view(n, 2, t, h, d), scales.view(*lead), mode, t, t, 0)


def quantize_contiguous(x: torch.Tensor, mode: str, payload: torch.Tensor, scales: torch.Tensor,
                        static: torch.Tensor | None = None, config: WireConfig | None = None) -> None:
    """Layers x [n, 2, 1, H, T, D] (bf16, contiguous) of a batch-1 contiguous cache → `payload` (uint8, its
    elements' count: e4m3 bits [n, 2, T, H, D]) and `scales` (float32: per-token-head n·2·T·H, computed in the
    kernel; per-head n·2·H or per-tensor n·2, copied from `static`, float32 on x's device), in one kernel launch on
    the current stream of x's device; payload and scales may be views into a larger buffer. Shapes are checked;
    values are not (nothing here waits for the device: a NaN scale gives NaN codes, as the reference does)."""
    check_mode(mode)
    pool, table = _as_pool(x)
    out = _packet(x, mode, payload, scales)
    if (static is None) != (mode == "per-token-head") or \
            (static is not None and (static.dtype != torch.float32 or static.numel() != out.scales.numel())):
        raise ValueError(f"{mode} scales: static must be None for per-token-head, else float32 of "
                         f"{out.scales.numel()} values")
    config = config or WireConfig()
    s = pool.spec
    d_pad, tp, n_chunks, grid = _launch_shape(s, 1, s.layers, config)
    quant, _ = _kernels(x.device.type == "cpu")
    quant[(grid,)](pool.data.view(torch.int16), table.tensor(x.device), out.payload, out.scales,
                   static if static is not None else out.scales, 1, 1, 0, n_chunks, BS=s.block_size,
                   H=s.kv_heads, D=s.head_dim, D_PAD=d_pad, TP=tp, HND=True, MODE=_MODE_ID[mode],
                   HW=config.hw_convert(x.device), num_warps=config.num_warps)


def dequantize_contiguous(payload: torch.Tensor, scales: torch.Tensor, mode: str, out: torch.Tensor,
                          config: WireConfig | None = None) -> None:
    """The inverse of quantize_contiguous: `payload` and `scales` (on out's device) → bf16 into the layers `out`
    [n, 2, 1, H, T, D], one kernel launch on the current stream."""
    check_mode(mode)
    pool, table = _as_pool(out)
    packet = _packet(out, mode, payload, scales)
    config = config or WireConfig()
    s = pool.spec
    d_pad, tp, n_chunks, grid = _launch_shape(s, 1, s.layers, config)
    _, deq = _kernels(out.device.type == "cpu")
    deq[(grid,)](packet.payload, packet.scales, pool.data.view(torch.int16), table.tensor(out.device), 1, 1, 0,
                 n_chunks, BS=s.block_size, H=s.kv_heads, D=s.head_dim, D_PAD=d_pad, TP=tp, HND=True,
                 MODE=_MODE_ID[mode], HW=config.hw_convert(out.device), num_warps=config.num_warps)


# ---------------------------------------------------------------------------------------------------
# benchmark


def bench_wire(pool: BlockPool, table: BlockTable, dest: BlockPool, repeats: int = 9, *,
               dst_table: BlockTable | None = None, scales=SCALE_MODES, warmup: int = 2, static_scales=None,
               config: WireConfig | None = None, check: bool = True) -> list[dict]:
    """Time the FP8 wire's kernels and the bf16 yardsticks on one cache; tidy rows, one per timed call.

    pool, table: the sending side's bf16 cache (a GPU pool for the real run; a CPU pool runs the same code with
    the host clock, through Triton's interpreter under TRITON_INTERPRET=1, else the torch references). dest: the
    receiving bf16 pool on the same device (its layout may differ), dst_table its blocks (default 0 … n-1).
    scales: the modes to time; static_scales: {mode: tensor}, default calibrated from this very cache.
    check: first compare every kernel's packet and dequantized blocks with the torch references bit for bit
    (RuntimeError on a difference). Timed with kvlab.timing.interleave (CUDA events, every call from an idle
    GPU, variants in balanced rotating order so drift hits them alike), `warmup` untimed rounds first:

        kernel             direction  what
        quantize-gather    d2d        blocks → packet in GPU memory
        quantize-gather    d2h        blocks → packet in pinned host memory (the kernel's stores cross the link)
        dequantize-scatter d2d        GPU packet → dest blocks
        dequantize-scatter h2d        pinned packet → dest blocks (the kernel's loads cross the link)
        bf16-copy          d2d / d2h / h2d   copy_ of a contiguous bf16 tensor of the cache's bytes (the yardstick)
        bf16-gather        d2d / d2h  kvlab.paged.kernels' row copy of the blocks into a contiguous GPU / pinned buffer

    Rows: kernel, direction, context (tokens), scales ("none" for bf16 rows), round, ms, bytes (what crosses the
    wire: packet bytes with scales, or bf16 bytes), bf16_bytes, input_gbps (bf16_bytes / s / 1e9: every rate is
    in bytes of bf16 input, as kvlab.paged.wire.breakeven_gbps takes them), backend, convert (the FP8 kernels'
    WireConfig conversion: "hw" | "int", "reference" for the torch path, "none" for bf16 rows), device. On a CPU
    "pinned" buffers are ordinary host memory (pinning needs CUDA); the device column says cpu.
    """
    if not isinstance(pool, BlockPool) or not isinstance(dest, BlockPool):
        raise ValueError("pool and dest must be BlockPools")
    for role, p in (("pool", pool), ("dest", dest)):
        if p.spec.dtype != torch.bfloat16:
            raise ValueError(f"{role} is {p.spec.dtype}; bench_wire moves bfloat16 caches")
    if dest.device != pool.device:
        raise ValueError(f"dest is on {dest.device}, pool on {pool.device}: both sides' pools live on one device here")
    pool.check_table(table, "source table")
    if dst_table is None:
        if dest.num_blocks < table.num_blocks:
            raise ValueError(f"dest has {dest.num_blocks} blocks, fewer than the table's {table.num_blocks}")
        dst_table = BlockTable.packed(table.tokens, table.block_size)
    modes = [scales] if isinstance(scales, str) else list(scales)
    for m in modes:
        check_mode(m)
    if not modes or len(set(modes)) != len(modes):
        raise ValueError(f"scales={scales!r}: give one or more distinct modes of {list(SCALE_MODES)}")
    static_scales = dict(static_scales or {})
    dev = pool.device
    cuda = dev.type == "cuda"
    backend, _ = wire_backend(dev)
    convert = ("hw" if (config or WireConfig()).hw_convert(dev) else "int") if backend == "triton" else "reference"
    statics = {m: (static_scales.get(m) if m in static_scales else calibrate_scales(pool, m, table))
               if m != "per-token-head" else None for m in modes}
    dev_pk = {m: empty_packet(pool.spec, table, m, dev) for m in modes}
    host_pk = {m: empty_packet(pool.spec, table, m, "cpu", pin_memory=cuda) for m in modes}
    check_packet_for_pool(dev_pk[modes[0]], dest, dst_table)
    for m in modes:
        for pk in (dev_pk[m], host_pk[m]):
            quantize_gather(pool, table, m, statics[m], out=pk, config=config)
    if cuda:
        torch.cuda.synchronize(dev)
    if check:
        _check_against_reference(pool, table, dest, dst_table, modes, statics, dev_pk, host_pk, config)
    L, n = pool.spec.layers, table.num_blocks
    sidx = (torch.arange(2 * L, dtype=torch.int64, device=dev)[:, None] * pool.num_blocks
            + table.tensor(dev)[None, :]).reshape(-1)
    bf16_bytes = 2 * L * n * pool.spec.block_bytes
    contig = pool.rows.index_select(0, sidx)
    dev_out = torch.empty_like(contig)
    host = torch.empty(contig.shape, dtype=contig.dtype, pin_memory=cuda)

    fns, meta = {}, {}

    def add(kernel, direction, mode, nbytes, fn, used):
        name = f"{kernel}|{direction}|{mode}"
        fns[name], meta[name] = fn, (kernel, direction, mode, nbytes, used, convert if mode != "none" else "none")

    for m in modes:
        st, dpk, hpk, nb = statics[m], dev_pk[m], host_pk[m], dev_pk[m].nbytes
        add("quantize-gather", "d2d", m, nb, lambda m=m, st=st, o=dpk: quantize_gather(pool, table, m, st, out=o,
                                                                                        config=config), backend)
        add("quantize-gather", "d2h", m, nb, lambda m=m, st=st, o=hpk: quantize_gather(pool, table, m, st, out=o,
                                                                                        config=config), backend)
        add("dequantize-scatter", "d2d", m, nb, lambda pk=dpk: dequantize_scatter(pk, dest, dst_table, config=config),
            backend)
        add("dequantize-scatter", "h2d", m, nb, lambda pk=hpk: dequantize_scatter(pk, dest, dst_table, config=config),
            backend)
    add("bf16-copy", "d2d", "none", bf16_bytes, lambda: dev_out.copy_(contig), "torch")
    add("bf16-copy", "d2h", "none", bf16_bytes, lambda: host.copy_(contig, non_blocking=cuda), "torch")
    add("bf16-copy", "h2d", "none", bf16_bytes, lambda: dev_out.copy_(host, non_blocking=cuda), "torch")
    gather = "triton" if kernels.triton_status(dev)[0] else "torch"
    add("bf16-gather", "d2d", "none", bf16_bytes,
        lambda: kernels.copy_rows(pool.rows, sidx, dev_out, None, backend=gather, check_bounds=False), gather)
    add("bf16-gather", "d2h", "none", bf16_bytes,
        lambda: kernels.copy_rows(pool.rows, sidx, host, None, backend=gather, check_bounds=False), gather)
    samples = timing.interleave(fns, rounds=positive_int("repeats", repeats), warmup=warmup, device=dev,
                                rotate=True)
    rows = []
    for s in samples:
        kernel, direction, mode, nbytes, used, conv = meta[s.name]
        rows.append({"kernel": kernel, "direction": direction, "context": table.tokens, "scales": mode,
                     "round": s.round, "ms": s.ms, "bytes": nbytes, "bf16_bytes": bf16_bytes,
                     "input_gbps": bf16_bytes / (s.ms * 1e-3) / 1e9 if s.ms > 0 else float("inf"),
                     "backend": used, "convert": conv, "device": str(dev)})
    return rows


def _check_against_reference(pool, table, dest, dst_table, modes, statics, dev_pk, host_pk, config) -> None:
    """RuntimeError unless every packet and every dequantized block equals the torch reference bit for bit."""
    dst_ids = dst_table.tensor(dest.device)
    for m in modes:
        ref = quantize_gather_reference(pool, table, m, statics[m])
        for where, pk in (("gpu", dev_pk[m]), ("pinned", host_pk[m])):
            for part in ("payload", "scales"):
                got, want = getattr(pk, part), getattr(ref, part)
                if not torch.equal(got.to(want.device).view(torch.uint8), want.view(torch.uint8)):
                    raise RuntimeError(f"quantize-gather ({m}, packet in {where} memory): {part} differs from the "
                                       "torch reference")
        dequantize_scatter_reference(ref, dest, dst_table)
        want = dest.data.index_select(2, dst_ids).view(torch.int16).clone()
        for where, pk in (("gpu", dev_pk[m]), ("pinned", host_pk[m])):
            dest.data.index_fill_(2, dst_ids, float("nan"))
            dequantize_scatter(pk, dest, dst_table, config=config)
            if dest.device.type == "cuda":
                torch.cuda.synchronize(dest.device)
            if not torch.equal(dest.data.index_select(2, dst_ids).view(torch.int16), want):
                raise RuntimeError(f"dequantize-scatter ({m}, packet in {where} memory) differs from the torch "
                                   "reference")
