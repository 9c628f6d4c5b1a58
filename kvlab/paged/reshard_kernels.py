"""A Triton kernel that gathers paged KV blocks and splits their heads in one pass, and its torch reference.

Re-sharding a paged cache between tensor-parallel degrees moves, for every (layer, K/V, block) row of a source
pool, a contiguous range of KV heads into a row of a destination (a decode rank's pool, or a staging buffer),
possibly at another head offset and in the other layout:

    dst[dst_rows[i], dst_head + h, t, :] = src[src_rows[i], src_head + h, t, :]    i < R, h < heads, t < block_size

where a row of a `Geometry` is one block of one layer side, stored `nhd` ([block_size, heads, head_dim], vLLM's
layout) or `hnd` ([heads, block_size, head_dim]). `copy_heads` is that one operation; kvlab.paged.reshard builds its
fused path (source pool → each destination pool) and its staging path (pool → staging buffer, buffer → pool) from
it. The row kernel of kvlab.paged.kernels moves whole rows and cannot split heads or transpose; this one can.

How the kernel is laid out: one program per (row, chunk of heads); it reads every word of its (heads × tokens ×
head_dim) tile, masked to the real sizes (tile dims are padded to powers of two), then writes them, so loads are
issued before stores. Elements are moved as the widest integer word dividing one head-token vector (int64 for
bf16 head_dim 128: 32 words), so NaN poison and any payload bits travel unchanged and the innermost run is
contiguous on both sides. Row ids are int64 and multiply constexpr row sizes, so pools past 2^31 words do not wrap.

CPU: Triton's interpreter runs the same kernel when TRITON_INTERPRET=1 (the tests set it, at tiny sizes).
`copy_heads(backend="auto")` falls back to the torch reference when kvlab.paged.kernels.triton_status says Triton cannot
run, and returns which one ran.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch

from .kernels import triton_status, word_dtype
from .pools import LAYOUTS, indexable, positive_int

__all__ = ["Geometry", "HeadsConfig", "copy_heads", "copy_heads_reference", "launch_heads"]

_MAX_TILE_WORDS = 4096  # words one program holds: 32 KiB of int64, 32 words a thread at 4 warps


@dataclass(frozen=True)
class Geometry:
    """How the rows of a tensor of blocks are laid out: heads per row, tokens per block, head_dim, layout.

    A row holds heads · block_size · head_dim elements. Strides are in elements: nhd has tokens outermost
    (stride_token = heads · head_dim, stride_head = head_dim), hnd heads outermost (stride_head = block_size ·
    head_dim, stride_token = head_dim).
    """

    heads: int
    block_size: int
    head_dim: int
    layout: str = "nhd"

    def __post_init__(self):
        for name in ("heads", "block_size", "head_dim"):
            positive_int(f"Geometry.{name}", getattr(self, name))
        if self.layout not in LAYOUTS:
            raise ValueError(f"Geometry.layout {self.layout!r} is not valid; use one of {list(LAYOUTS)}")

    @classmethod
    def of(cls, spec) -> "Geometry":
        """The geometry of a kvlab.paged.PoolSpec's rows."""
        return cls(spec.kv_heads, spec.block_size, spec.head_dim, spec.layout)

    @property
    def row_elems(self) -> int:
        return self.heads * self.block_size * self.head_dim

    @property
    def strides(self) -> tuple[int, int]:
        """(stride_head, stride_token) in elements."""
        if self.layout == "nhd":
            return self.head_dim, self.heads * self.head_dim
        return self.block_size * self.head_dim, self.head_dim

    def canonical(self, rows: torch.Tensor) -> torch.Tensor:
        """[R, row_elems] rows as a [R, heads, block_size, head_dim] view (heads first, whatever the layout)."""
        if self.layout == "nhd":
            return rows.view(-1, self.block_size, self.heads, self.head_dim).transpose(1, 2)
        return rows.view(-1, self.heads, self.block_size, self.head_dim)


@dataclass(frozen=True)
class HeadsConfig:
    """Launch shape: rows_per_program (power of two) rows per program; num_warps warps per program."""

    rows_per_program: int = 1
    num_warps: int = 4

    def __post_init__(self):
        r = self.rows_per_program
        if not isinstance(r, int) or r < 1 or r & (r - 1):
            raise ValueError(f"HeadsConfig.rows_per_program must be a power of two ≥ 1, got {r!r}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"HeadsConfig.num_warps must be a power of two in 1…16, got {self.num_warps!r}")


# ---------------------------------------------------------------------------------------------------
# checks and the torch reference


def _check(src, src_geom, src_rows, src_head, dst, dst_geom, dst_rows, dst_head, heads):
    for name, t, g in (("src", src, src_geom), ("dst", dst, dst_geom)):
        if not isinstance(g, Geometry):
            raise ValueError(f"{name}_geom must be a Geometry, got {type(g).__name__}")
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or not t.is_contiguous() or t.shape[1] != g.row_elems:
            raise ValueError(f"{name} must be a contiguous [rows, {g.row_elems}] tensor for {g}, got "
                             f"{getattr(t, 'shape', type(t).__name__)}")
    if src.dtype != dst.dtype:
        raise ValueError(f"src is {src.dtype} and dst {dst.dtype}: copy_heads moves bits, it does not convert dtypes")
    if (src_geom.block_size, src_geom.head_dim) != (dst_geom.block_size, dst_geom.head_dim):
        raise ValueError(f"block_size/head_dim differ: src {src_geom.block_size}/{src_geom.head_dim}, dst "
                         f"{dst_geom.block_size}/{dst_geom.head_dim}; copy_heads does not re-block")
    heads = positive_int("heads", heads)
    for name, h0, g in (("src_head", src_head, src_geom), ("dst_head", dst_head, dst_geom)):
        if isinstance(h0, bool) or not isinstance(h0, int) or h0 < 0 or h0 + heads > g.heads:
            raise ValueError(f"{name}={h0!r} with heads={heads} is outside the {g.heads} heads of a row (valid "
                             f"0 … {g.heads - heads})")
    for name, idx, t in (("src_rows", src_rows, src), ("dst_rows", dst_rows, dst)):
        if not isinstance(idx, torch.Tensor) or idx.dim() != 1 or idx.dtype != torch.int64:
            raise ValueError(f"{name} must be a 1-D int64 tensor, got {getattr(idx, 'dtype', type(idx).__name__)}")
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= t.shape[0]):
            raise ValueError(f"{name} spans {int(idx.min())}…{int(idx.max())}, outside the {t.shape[0]} rows "
                             f"(valid 0 … {t.shape[0] - 1})")
    if src_rows.shape != dst_rows.shape:
        raise ValueError(f"src_rows has {src_rows.numel()} entries and dst_rows {dst_rows.numel()}: one per row moved")
    if src.device != dst.device and not (src.device.type == "cuda" and dst.device.type == "cuda"):
        raise ValueError(f"src on {src.device} and dst on {dst.device}: copy_heads runs on one device (or a GPU "
                         "writing a peer GPU); move the rows first")


def copy_heads_reference(src, src_geom, src_rows, src_head, dst, dst_geom, dst_rows, dst_head, heads) -> None:
    """The torch reference of `copy_heads`: index_select the rows, slice the heads (in the canonical heads-first
    view, which also converts the layout), index_copy_ into the destination's head-sliced view (in place)."""
    x = src_geom.canonical(src.index_select(0, src_rows.to(src.device)))[:, src_head:src_head + heads]
    view = dst_geom.canonical(dst)[:, dst_head:dst_head + heads]
    indexable(view).index_copy_(0, dst_rows.to(dst.device), indexable(x.to(dst.device)))  # float8 as its bytes


# ---------------------------------------------------------------------------------------------------
# the kernel


_KERNELS: dict = {}


def _kernel(interpret: bool):
    """The kernel for CPU tensors (Triton's interpreter) or GPU tensors (compiled), built on first use. Triton
    reads TRITON_INTERPRET when a function is decorated, so it is set to the mode wanted for that moment only."""
    if interpret in _KERNELS:
        return _KERNELS[interpret]
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        _KERNELS[interpret] = _decorate()
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved
    return _KERNELS[interpret]


def _decorate():
    import triton
    import triton.language as tl

    @triton.jit
    def _heads_kernel(src_ptr, dst_ptr, src_rows_ptr, dst_rows_ptr, n_rows,
                      S_ROW: tl.constexpr, S_H: tl.constexpr, S_T: tl.constexpr, S_H0: tl.constexpr,
                      D_ROW: tl.constexpr, D_H: tl.constexpr, D_T: tl.constexpr, D_H0: tl.constexpr,
                      HEADS: tl.constexpr, BS: tl.constexpr, W: tl.constexpr,
                      HT: tl.constexpr, BSP: tl.constexpr, WP: tl.constexpr, RPP: tl.constexpr):
        # program (pid_r, pid_h): rows pid_r*RPP … +RPP-1 of the index lists, heads pid_h*HT … +HT-1 of the slice.
        # The tile is HT × BSP × WP words flattened; BSP and WP are powers of two, so // and % are shifts and masks.
        pid_r = tl.program_id(0)
        pid_h = tl.program_id(1)
        r = pid_r * RPP + tl.arange(0, RPP)
        rmask = r < n_rows
        s = tl.load(src_rows_ptr + r, mask=rmask, other=0).to(tl.int64)
        d = tl.load(dst_rows_ptr + r, mask=rmask, other=0).to(tl.int64)
        k = tl.arange(0, HT * BSP * WP)
        h = pid_h * HT + k // (BSP * WP)
        t = (k // WP) % BSP
        e = k % WP
        kmask = (h < HEADS) & (t < BS) & (e < W)
        src_off = s[:, None] * S_ROW + ((S_H0 + h) * S_H + t * S_T + e)[None, :]
        dst_off = d[:, None] * D_ROW + ((D_H0 + h) * D_H + t * D_T + e)[None, :]
        mask = rmask[:, None] & kmask[None, :]
        x = tl.load(src_ptr + src_off, mask=mask)
        tl.store(dst_ptr + dst_off, x, mask=mask)

    return _heads_kernel


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def launch_heads(src, src_geom, src_rows, src_head, dst, dst_geom, dst_rows, dst_head, heads,
                 config: HeadsConfig | None = None) -> None:
    """Launch the Triton kernel without argument checks (kvlab.paged.reshard checks its plans once, up front). Same
    contract as `copy_heads`; R = 0 is a no-op. Enqueues on the current stream of the kernel's device."""
    n = int(src_rows.shape[0])
    if n == 0:
        return
    config = config or HeadsConfig()
    esize = src.element_size()
    word = word_dtype(src_geom.head_dim * esize, src, dst)
    scale = esize / torch.empty((), dtype=word).element_size()  # words per element (≤ 1 … a fraction when wider)

    def words(x: int) -> int:
        return int(x * scale)

    s = src.view(-1).view(word)
    d = dst.view(-1).view(word)
    w = words(src_geom.head_dim)
    bsp, wp = _pow2(src_geom.block_size), _pow2(w)
    # heads per program: as many as fit the tile budget, at least one
    ht = 1
    while ht * 2 <= _pow2(heads) and ht * 2 * bsp * wp <= _MAX_TILE_WORDS:
        ht *= 2
    rpp = config.rows_per_program
    while rpp > 1 and rpp * ht * bsp * wp > _MAX_TILE_WORDS:
        rpp //= 2
    sh, st = src_geom.strides
    dh, dt = dst_geom.strides
    interpret = src.device.type == "cpu" and dst.device.type == "cpu"
    grid = ((n + rpp - 1) // rpp, (heads + ht - 1) // ht)
    dev = src.device if src.device.type == "cuda" else dst.device
    # Triton launches on the current CUDA device: make it the kernel's (the one holding the row indices)
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
        _kernel(interpret)[grid](s, d, src_rows, dst_rows, n,
                                 S_ROW=words(src_geom.row_elems), S_H=words(sh), S_T=words(st), S_H0=src_head,
                                 D_ROW=words(dst_geom.row_elems), D_H=words(dh), D_T=words(dt), D_H0=dst_head,
                                 HEADS=heads, BS=src_geom.block_size, W=w, HT=ht, BSP=bsp, WP=wp, RPP=rpp,
                                 num_warps=config.num_warps)


def copy_heads(src: torch.Tensor, src_geom: Geometry, src_rows: torch.Tensor, src_head: int,
               dst: torch.Tensor, dst_geom: Geometry, dst_rows: torch.Tensor, dst_head: int, heads: int,
               *, backend: str = "auto", config: HeadsConfig | None = None, check: bool = True) -> str:
    """dst[dst_rows[i], dst_head + h] = src[src_rows[i], src_head + h] for every token and element of the heads.

    src: [N_src, src_geom.row_elems], dst: [N_dst, dst_geom.row_elems], contiguous, one dtype (any: moved as
    raw words), on one device (CPU, or the GPU the kernel runs on; dst may be a peer GPU's memory with peer access
    on). src_rows, dst_rows: [R] int64 on that device. block_size and head_dim must agree; the layouts may differ
    (nhd ↔ hnd is converted in the same pass). heads: how many consecutive heads each row contributes.
    check=False skips the bounds checks (each is a host sync), for callers whose indices were checked on the host.
    backend: "auto" (Triton when kvlab.paged.kernels.triton_status allows, else torch), "triton" or "torch".
    Returns the backend used.
    """
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend {backend!r} is not valid; use 'auto', 'triton' or 'torch'")
    if check:
        _check(src, src_geom, src_rows, src_head, dst, dst_geom, dst_rows, dst_head, heads)
    ok, why = triton_status(src.device if src.device.type == "cuda" else dst.device)
    if backend == "triton" and not ok:
        raise ValueError(f"backend='triton' is not available here: {why}")
    if backend == "torch" or not ok:
        copy_heads_reference(src, src_geom, src_rows, src_head, dst, dst_geom, dst_rows, dst_head, heads)
        return "torch"
    launch_heads(src, src_geom, src_rows, src_head, dst, dst_geom, dst_rows, dst_head, heads, config)
    return "triton"
