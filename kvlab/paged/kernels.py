"""Triton kernels that move rows of bytes by index: the engine under kvlab's paged transports.

A paged KV pool viewed as a 2-D tensor is rows of `block_bytes` (one block of one layer's K or V, e.g.
16 tokens × 4 heads × 128 × 2 B = 16 KiB for Qwen2.5-7B). Moving a paged cache — to other block ids on
the same GPU, to a peer GPU, into a contiguous staging buffer, into mapped pinned host memory — is then
one operation:

    dst[dst_idx[i], :] = src[src_idx[i], :]      for i in 0 … R-1          (copy_rows)
    out[i, :]          = src[src_idx[i], :]      (dst_idx=None: a gather into consecutive rows)

Why one kernel instead of R `copy_` calls: each `copy_` costs launch and driver work (11.8 µs for one
16 KiB copy in docs/REFERENCE.md; the per-block loop over 114,688 blocks took 1.08 s in run
20261129-092633-h200); one kernel launch reads and writes the same bytes in close to the time of one
contiguous copy (94 % of it in run 20261129-093127-h200).

How the kernel reaches the copy ceiling:
- Rows are reinterpreted as the widest integer word that divides the row (int64 for every real KV
  layout), so each thread moves contiguous words and the compiler emits 16-byte vector loads/stores
  (it can prove 16-byte alignment: the pointers are allocation bases and `row * ROW` is a multiple of a
  power-of-two constexpr).
- A program copies a tile of `rows_per_program` rows × `block` words: all loads are issued before any
  store, so each thread has several 16-byte requests in flight (memory-level parallelism), and the one
  dependent load of the row index is amortised over more bytes.
- Offsets are computed in int64 (row ids are int64 and multiply a constexpr), so pools over 2 GiB
  (2^31 bytes) do not wrap around.
- Optional streaming hints (loads evict-first, stores `.cs`): the data is touched once, so it should
  not push anything else out of L2.

The best tile depends on the GPU and the row size, so `tune()` times a small set of configurations on
the real tables (GPU only) and returns the fastest; the transports record which one they used.

CPU: Triton's interpreter runs the same kernel on CPU tensors when TRITON_INTERPRET=1 is set (tests do
that, with tiny sizes: the interpreter is slow). Without it, `copy_rows(backend="auto")` uses the torch
reference and says so through its return value.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import torch

from .pools import indexable

__all__ = [
    "KernelConfig",
    "DEFAULT_CONFIG",
    "triton_status",
    "word_dtype",
    "as_words",
    "gather_rows_reference",
    "copy_rows_reference",
    "copy_rows",
    "launch_rows",
    "tune",
    "candidate_configs",
]

_WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)  # widest first
_MAX_WORDS_PER_THREAD = 32  # 256 B of int64 per thread: beyond this registers spill


@dataclass(frozen=True)
class KernelConfig:
    """Tile and launch shape of the row-copy kernel.

    block: words (elements of the word dtype, usually int64) per program along a row; a power of two.
        0 = the whole row rounded up to a power of two, capped at 4096 words (32 KiB of int64).
    rows_per_program: rows per tile (power of two); >1 amortises the index load over more bytes.
    num_warps: warps per program (4 or 8 are the useful values for a pure copy).
    streaming: evict-first loads and streaming (.cs) stores; the bytes are touched once.
    persistent: 0 = one program per tile (the hardware schedules ~R × row/block programs); n > 0 = a
        persistent grid of n programs per SM, each looping over tiles with a grid stride, so no program
        is ever scheduled twice and the index load of the next tile can overlap the current one's copy.
    stages: software-pipelining depth of the persistent loop (Triton's `tl.range(num_stages=…)`);
        1 = no pipelining. Ignored when persistent is 0.
    """

    block: int = 1024
    rows_per_program: int = 2
    num_warps: int = 4
    streaming: bool = True
    persistent: int = 0
    stages: int = 1

    def __post_init__(self):
        for name in ("block", "rows_per_program"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0 or (v and v & (v - 1)):
                raise ValueError(f"KernelConfig.{name} must be 0 or a power of two, got {v!r}")
        if self.rows_per_program < 1:
            raise ValueError(f"KernelConfig.rows_per_program must be ≥ 1, got {self.rows_per_program}")
        if self.num_warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"KernelConfig.num_warps must be a power of two in 1…32, got {self.num_warps!r}")
        if not isinstance(self.persistent, int) or not 0 <= self.persistent <= 64:
            raise ValueError(f"KernelConfig.persistent must be an int in 0…64 (programs per SM; 0 = one per "
                             f"tile), got {self.persistent!r}")
        if not isinstance(self.stages, int) or not 1 <= self.stages <= 8:
            raise ValueError(f"KernelConfig.stages must be an int in 1…8, got {self.stages!r}")

    def resolved_block(self, row_words: int) -> int:
        """The block actually used for rows of `row_words` words: never wider than the row needs."""
        whole = 1 << max(row_words - 1, 0).bit_length()
        return min(whole, 4096) if self.block == 0 else min(self.block, whole)

    def as_dict(self) -> dict:
        return asdict(self)


DEFAULT_CONFIG = KernelConfig()


# ---------------------------------------------------------------------------------------------------
# availability


def _interpret_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")


def triton_status(device: torch.device | str) -> tuple[bool, str]:
    """Can the Triton kernel run for tensors on `device`? Returns (ok, why).

    GPU: Triton must import. CPU: Triton must import and TRITON_INTERPRET=1 must be set — the explicit
    opt-in to run the kernel through Triton's interpreter (slow; tests use it at tiny sizes). The kernel
    itself is built in the right mode for its tensors whatever the variable says (see _kernel).
    """
    device = torch.device(device)
    try:
        import triton  # noqa: F401
    except Exception as exc:  # ImportError, or a triton whose backend cannot load
        return False, f"triton cannot be imported ({type(exc).__name__}: {exc})"
    if device.type == "cuda":
        return True, "triton on CUDA"
    if device.type == "cpu":
        if _interpret_requested():
            return True, "triton interpreter (TRITON_INTERPRET=1) on CPU"
        return False, "no GPU and TRITON_INTERPRET is not set: the torch path runs instead"
    return False, f"device type {device.type!r} is not supported by these kernels"


_KERNELS: dict[bool, object] = {}


def _kernel(interpret: bool):
    """The kernel for CPU tensors (interpret=True: Triton's interpreter) or GPU tensors (compiled), built
    on first use and cached per mode (importing kvlab.paged.kernels does not import Triton)."""
    k = _KERNELS.get(interpret)
    if k is not None:
        return k
    # Triton decides compiled vs interpreted when a function is decorated, from TRITON_INTERPRET; pin it to
    # the mode asked for, so a CPU test's interpreter setting can never turn the GPU kernel into Python
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        k = _decorate()
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved
    _KERNELS[interpret] = k
    return k


def _decorate():
    import triton
    import triton.language as tl

    @triton.jit
    def _copy_rows_kernel(src_ptr, dst_ptr, src_idx_ptr, dst_idx_ptr, n_rows, n_col_tiles, n_tiles,
                          ROW: tl.constexpr, BLOCK: tl.constexpr, RPP: tl.constexpr,
                          EVEN: tl.constexpr, DST_CONTIG: tl.constexpr, STREAMING: tl.constexpr,
                          PERSISTENT: tl.constexpr, STAGES: tl.constexpr):
        # tile t covers rows (t // n_col_tiles)*RPP … +RPP-1 of the index lists and words
        # (t % n_col_tiles)*BLOCK … +BLOCK-1 of each row. One tile per program, or (persistent) a fixed
        # grid where consecutive programs take consecutive tiles and all step by the grid size.
        pid = tl.program_id(0)
        if PERSISTENT:
            step = tl.num_programs(0)
            end = n_tiles
        else:
            step = 1
            end = pid + 1
        for t in tl.range(pid, end, step, num_stages=STAGES):
            pid_r = t // n_col_tiles
            pid_c = t % n_col_tiles
            r = pid_r * RPP + tl.arange(0, RPP)
            rmask = r < n_rows
            # row ids are int64 in memory; keep them int64 so row * ROW cannot overflow past 2^31 words
            s = tl.load(src_idx_ptr + r, mask=rmask, other=0).to(tl.int64)
            if DST_CONTIG:
                d = r.to(tl.int64)
            else:
                d = tl.load(dst_idx_ptr + r, mask=rmask, other=0).to(tl.int64)
            cols = pid_c * BLOCK + tl.arange(0, BLOCK)
            src_off = s[:, None] * ROW + cols[None, :]
            dst_off = d[:, None] * ROW + cols[None, :]
            if EVEN:
                # the row mask is constant along a row, so it does not stop 16-byte vectorisation
                mask = rmask[:, None]
            else:
                mask = rmask[:, None] & (cols < ROW)[None, :]
            if STREAMING:
                x = tl.load(src_ptr + src_off, mask=mask, eviction_policy="evict_first")
                tl.store(dst_ptr + dst_off, x, mask=mask, cache_modifier=".cs")
            else:
                x = tl.load(src_ptr + src_off, mask=mask)
                tl.store(dst_ptr + dst_off, x, mask=mask)

    return _copy_rows_kernel


# ---------------------------------------------------------------------------------------------------
# words


def word_dtype(row_bytes: int, *tensors: torch.Tensor) -> torch.dtype:
    """The widest integer dtype (int64 → uint8) that divides `row_bytes` and the byte offset of every
    tensor's first element (so a view in that dtype is legal and aligned)."""
    for w in _WORDS:
        size = torch.empty((), dtype=w).element_size()
        if row_bytes % size:
            continue
        if all((t.storage_offset() * t.element_size()) % size == 0 for t in tensors):
            return w
    return torch.uint8


def as_words(rows: torch.Tensor, word: torch.dtype) -> torch.Tensor:
    """Reinterpret a contiguous 2-D tensor [rows, elems] as [rows, row_bytes / word_size] of `word`."""
    if rows.dim() != 2 or not rows.is_contiguous():
        raise ValueError(f"rows must be a contiguous 2-D tensor, got shape {tuple(rows.shape)} "
                         f"contiguous={rows.is_contiguous()}")
    if rows.dtype == word:
        return rows
    return rows.view(word)


# ---------------------------------------------------------------------------------------------------
# torch references


def gather_rows_reference(src: torch.Tensor, src_idx: torch.Tensor) -> torch.Tensor:
    """out[i] = src[src_idx[i]]: the torch reference for a gather into consecutive rows.

    src: [N, E] any dtype; src_idx: [R] int64 on src's device. Returns a new [R, E] tensor.
    """
    return src.index_select(0, src_idx)


def copy_rows_reference(src: torch.Tensor, src_idx: torch.Tensor, dst: torch.Tensor,
                        dst_idx: torch.Tensor | None = None) -> None:
    """dst[dst_idx[i]] = src[src_idx[i]] (dst_idx None: dst[i] = ...) with torch indexing.

    Works across devices (gathers on src's device, then moves the gathered rows once).
    """
    rows = src.index_select(0, src_idx)
    if rows.device != dst.device:
        rows = rows.to(dst.device, non_blocking=dst.device.type == "cuda" or dst.is_pinned())
    if dst_idx is None:
        dst[: rows.shape[0]].copy_(rows)
    else:  # float8 rows move as their bytes: torch has no float8 index_copy_
        indexable(dst).index_copy_(0, dst_idx.to(dst.device), indexable(rows))


# ---------------------------------------------------------------------------------------------------
# the launcher


def _check(src, src_idx, dst, dst_idx, device=None):
    dev = device if device is not None else _kernel_device(src, dst)
    for name, t in (("src", src), ("dst", dst)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous 2-D tensor [rows, elems], got "
                             f"{getattr(t, 'shape', type(t).__name__)}")
    if src.dtype != dst.dtype or src.shape[1] != dst.shape[1]:
        raise ValueError(f"src and dst rows differ: src {src.dtype} × {src.shape[1]} elems, "
                         f"dst {dst.dtype} × {dst.shape[1]} elems; they must match")
    for name, t in (("src_idx", src_idx), ("dst_idx", dst_idx)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a 1-D int64 tensor, got {type(t).__name__}")
    if src_idx.dim() != 1 or src_idx.dtype != torch.int64:
        raise ValueError(f"src_idx must be a 1-D int64 tensor, got {src_idx.dtype} {tuple(src_idx.shape)}")
    if src_idx.device != dev:
        raise ValueError(f"src_idx is on {src_idx.device}; it must be on the kernel's device {dev}")
    if dst_idx is None:
        if src_idx.shape[0] > dst.shape[0]:
            raise ValueError(f"dst has {dst.shape[0]} rows, too few for {src_idx.shape[0]} gathered rows")
    else:
        if dst_idx.dim() != 1 or dst_idx.dtype != torch.int64 or dst_idx.shape[0] != src_idx.shape[0]:
            raise ValueError(f"dst_idx must be 1-D int64 with {src_idx.shape[0]} entries (one per source row), "
                             f"got {dst_idx.dtype} {tuple(dst_idx.shape)}")
        if dst_idx.device != dev:
            raise ValueError(f"dst_idx is on {dst_idx.device}; it must be on the kernel's device {dev}")


def _check_bounds(src, src_idx, dst, dst_idx):
    # a host sync; hot paths whose indices were validated on the host turn it off
    if src_idx.numel():
        lo, hi = int(src_idx.min()), int(src_idx.max())
        if lo < 0 or hi >= src.shape[0]:
            raise ValueError(f"src_idx spans {lo}…{hi}, outside the {src.shape[0]} rows of src (valid 0…{src.shape[0] - 1})")
        if dst_idx is not None:
            lo, hi = int(dst_idx.min()), int(dst_idx.max())
            if lo < 0 or hi >= dst.shape[0]:
                raise ValueError(f"dst_idx spans {lo}…{hi}, outside the {dst.shape[0]} rows of dst (valid 0…{dst.shape[0] - 1})")


def _kernel_device(src: torch.Tensor, dst: torch.Tensor) -> torch.device:
    return src.device if src.device.type == "cuda" else dst.device


def copy_rows(src: torch.Tensor, src_idx: torch.Tensor, dst: torch.Tensor, dst_idx: torch.Tensor | None = None,
              *, config: KernelConfig | None = None, backend: str = "auto", check_bounds: bool = True) -> str:
    """dst[dst_idx[i], :] = src[src_idx[i], :] for i < len(src_idx); dst_idx None → dst[i, :].

    src: [N_src, E], dst: [N_dst, E] contiguous, same dtype (any; rows are moved as raw words).
    src_idx, dst_idx: [R] int64 on src's device (the kernel runs there; dst may be a peer GPU's memory
    with peer access enabled, or pinned host memory, which the GPU reaches through UVA).
    Indices are bounds-checked before the launch by default (a min and a max, then a host sync): the Triton
    kernel itself does not check, so an index past the end would write or read memory it does not own without
    an error. A caller whose indices are already validated on the host (kvlab.disagg's ipc send) passes
    check_bounds=False to keep the sync off its timed path; kvlab.paged's plans call launch_rows directly.

    backend: "auto" (Triton when `triton_status` allows, else torch), "triton" or "torch".
    Enqueues on the current stream of src's device. Returns the backend used: "triton" or "torch".
    """
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend {backend!r} is not valid; use 'auto', 'triton' or 'torch'")
    _check(src, src_idx, dst, dst_idx)
    if check_bounds:
        _check_bounds(src, src_idx, dst, dst_idx)
    dev = _kernel_device(src, dst)
    ok, why = triton_status(dev)
    if backend == "triton" and not ok:
        raise ValueError(f"backend='triton' is not available here: {why}")
    if backend == "torch" or (backend == "auto" and not ok):
        copy_rows_reference(src, src_idx, dst, dst_idx)
        return "torch"
    launch_rows(src, src_idx, dst, dst_idx, config or DEFAULT_CONFIG)
    return "triton"


def launch_rows(src, src_idx, dst, dst_idx, config: KernelConfig, programs: int | None = None) -> None:
    """Launch the Triton kernel without argument checks (transports check their plans once, up front).

    Same contract as `copy_rows`. R = 0 is a no-op. programs: run a persistent grid of at most this many
    programs whatever `config.persistent` says — a copy throttled to a few SMs (kvlab.clocks uses 8).
    """
    n = int(src_idx.shape[0])
    if n == 0:
        return
    row_bytes = src.shape[1] * src.element_size()
    word = word_dtype(row_bytes, src, dst)
    s = as_words(src, word)
    d = as_words(dst, word)
    row_words = s.shape[1]
    block = config.resolved_block(row_words)
    rpp = config.rows_per_program
    # clamp the tile so a thread never holds more than _MAX_WORDS_PER_THREAD words
    while rpp > 1 and rpp * block > _MAX_WORDS_PER_THREAD * 32 * config.num_warps:
        rpp //= 2
    n_col = (row_words + block - 1) // block
    n_tiles = ((n + rpp - 1) // rpp) * n_col
    interpret = src.device.type == "cpu" and dst.device.type == "cpu"
    persistent = bool(config.persistent) or programs is not None
    if programs is not None:
        if isinstance(programs, bool) or not isinstance(programs, int) or programs < 1:
            raise ValueError(f"programs={programs!r}: expected an int ≥ 1 (the grid's size)")
        programs = min(n_tiles, programs)
    elif config.persistent:
        programs = min(n_tiles, config.persistent * _sm_count(src_idx.device))  # the indices live on the kernel's device
    else:
        programs = n_tiles
    kernel = _kernel(interpret)
    kernel[(programs,)](s, d, src_idx, src_idx if dst_idx is None else dst_idx, n, n_col, n_tiles,
                        ROW=row_words, BLOCK=block, RPP=rpp, EVEN=row_words % block == 0,
                        DST_CONTIG=dst_idx is None, STREAMING=config.streaming,
                        PERSISTENT=persistent, STAGES=config.stages if persistent else 1,
                        num_warps=config.num_warps)


_SMS: dict = {}


def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (a persistent grid's unit); 4 on a CPU (the interpreter)."""
    if device.type != "cuda":
        return 4
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _SMS:
        _SMS[key] = torch.cuda.get_device_properties(key).multi_processor_count
    return _SMS[key]


# ---------------------------------------------------------------------------------------------------
# tuning


def candidate_configs(row_words: int) -> list[KernelConfig]:
    """A small search space for rows of `row_words` words: tiles of 2–16 KiB of int64 per program, 2–8
    warps, plain loads and stores; plus, so the tuning table keeps them in view, the streaming cache hints
    and a persistent grid on the default tile (a 32k-token Qwen2.5-7B gather on the H200 was fastest with
    small tiles, no hints and one program per tile)."""
    out = []
    for block in (256, 512, 1024, 2048):
        if block > 2 * max(row_words, 1):
            continue
        for rpp in (1, 2, 4):
            for warps in (2, 4, 8):
                if rpp * block > _MAX_WORDS_PER_THREAD * 32 * warps or rpp * block < 32 * warps:
                    continue
                out.append(KernelConfig(block=block, rows_per_program=rpp, num_warps=warps, streaming=False))
    extra = [KernelConfig(block=1024, rows_per_program=2, num_warps=4, streaming=True),
             KernelConfig(block=512, rows_per_program=1, num_warps=4, streaming=False, persistent=4)]
    out += [c for c in extra if c.block <= 2 * max(row_words, 1)]  # the same rule as the tiles above
    return out or [DEFAULT_CONFIG]


def tune(src, src_idx, dst, dst_idx=None, candidates=None, repeats: int = 5, warmup: int = 1, device=None):
    """Time each candidate config on these exact tensors (CUDA events, median of `repeats`); GPU only.
    device: the GPU the kernel runs on (default src's; a pull from a peer GPU: dst's), which holds both index tensors.

    Writes dst rows exactly as copy_rows would (the same bytes each time), nothing else.
    Returns (best KernelConfig, [ {config…, "ms": median} ... ]) — on CPU: (DEFAULT_CONFIG, []).
    """
    _check(src, src_idx, dst, dst_idx, device)
    dev = torch.device(device) if device is not None else _kernel_device(src, dst)
    if dev.type != "cuda":
        return DEFAULT_CONFIG, []
    with torch.cuda.device(dev):
        return _tune(src, src_idx, dst, dst_idx, dev, candidates, repeats, warmup)


def _tune(src, src_idx, dst, dst_idx, dev, candidates, repeats, warmup):
    row_words = as_words(src, word_dtype(src.shape[1] * src.element_size(), src, dst)).shape[1]
    candidates = list(candidates) if candidates is not None else candidate_configs(row_words)
    stream = torch.cuda.current_stream(dev)
    results = []
    failure = None
    for cfg in candidates:
        try:
            for _ in range(warmup):
                launch_rows(src, src_idx, dst, dst_idx, cfg)
            ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
            for a, b in ev:
                a.record(stream)
                launch_rows(src, src_idx, dst, dst_idx, cfg)
                b.record(stream)
            stream.synchronize()
        except Exception as exc:  # a shape this Triton cannot compile: record it, try the others
            failure = exc
            results.append({**cfg.as_dict(), "ms": None, "error": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        times = sorted(a.elapsed_time(b) for a, b in ev)
        results.append({**cfg.as_dict(), "ms": times[len(times) // 2]})
    timed = [r for r in results if r["ms"] is not None]
    if not timed:
        raise RuntimeError(f"no kernel configuration ran on {dev}") from failure
    best = min(timed, key=lambda r: r["ms"])
    cfg = KernelConfig(**{k: best[k] for k in ("block", "rows_per_program", "num_warps", "streaming", "persistent",
                                               "stages")})
    return cfg, results
