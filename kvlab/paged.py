"""Paged KV caches: block pools, block tables, conversion to and from HF caches, and paged transports.

Serving engines keep the KV cache in fixed-size blocks (pages) of `block_size` tokens, scattered over a
preallocated pool; a sequence owns a block table (its block ids in token order). A 32k-token Qwen2.5-7B
cache in 16-token blocks is 28 layers × (K, V) × 2048 blocks = 114,688 blocks of 16 KiB.

Pool storage (one tensor per pool, K and V side by side):

    layout "nhd" (vLLM-like):  data [layers, 2, num_blocks, block_size, kv_heads, head_dim]
    layout "hnd" (heads first): data [layers, 2, num_blocks, kv_heads, block_size, head_dim]

In both layouts one block of one layer's K (or V) is `block_bytes` contiguous bytes, so the pool is also
a 2-D tensor of rows, `pool.rows` = [layers · 2 · num_blocks, block_elems], with

    row(layer, side, block) = (layer · 2 + side) · num_blocks + block        (side 0 = K, 1 = V)

Every transport below moves rows by index: (layer, side, source block) → (layer, side, destination
block). A transfer "plan" lists the rows layer by layer (layer i's rows are one contiguous range, which
is what layer-wise sending needs), and within a layer in increasing destination block id (so a packed
destination is written in one run per layer side, or one run in total when the destination pool is
exactly the table's size).

Transports (paged → paged with other block ids, or paged → contiguous when `dst_table` is None: the
blocks land packed at ids 0 … n-1 of the destination pool):

    per-block-copy      one `copy_` per block (the baseline: launch-bound)
    torch-index         index_select into a staging tensor + index_copy_ (to host: gather, then one copy)
    triton              one Triton kernel that gathers and scatters rows (same GPU or peer GPU)
    chunked-gather-d2h  to host: gather chunks into a small device ring while the previous chunk is
                        copied device → pinned host on a copy stream (the link never idles)
    mapped-pinned       to host: the Triton kernel stores straight into pinned host memory (UVA)
    cuda-memcpy-batch   cudaMemcpyBatchAsync, one descriptor per block (cuda-bindings, CUDA ≥ 12.8)
    nixl                NIXL with the UCX backend: one prepared request, one descriptor per block

Each is constructed once for a destination (its pool is allocated and NaN-poisoned there), and
`send(src_pool, src_table, dst_table)` returns a kvlab.transfer.Landing, like kvlab.transfer.Transport.
Bad input (block ids out of range, duplicate ids, length / dtype / layout mismatch, a destination that
is too small) raises ValueError before any byte moves.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from . import kernels, timing
from .kvcache import KVBuffer, KVLayout, as_dtype
from .transfer import Destination, Landing, check_capacity

__all__ = [
    "LAYOUTS", "PoolSpec", "BlockTable", "BlockAllocator", "BlockPool",
    "paged_prefill_cache", "prefill_into_pages", "verify_transfer",
    "PagedTransport", "PerBlockCopy", "TorchIndex", "TritonCopy", "ChunkedGatherD2H", "MappedPinned",
    "CudaMemcpyBatch", "NixlTransport", "PagedLayerwiseSend", "TRANSPORTS", "make_transport", "unavailable",
]

LAYOUTS = ("nhd", "hnd")
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _pos_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


# ---------------------------------------------------------------------------------------------------
# pool shape, block tables, allocation


@dataclass(frozen=True)
class PoolSpec:
    """Everything about a pool's shape except how many blocks it holds.

    layers, block_size (tokens per block), kv_heads, head_dim, dtype, layout ("nhd" | "hnd").
    """

    layers: int
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16
    layout: str = "nhd"

    def __post_init__(self):
        for name in ("layers", "block_size", "kv_heads", "head_dim"):
            _pos_int(f"PoolSpec.{name}", getattr(self, name))
        object.__setattr__(self, "dtype", as_dtype(self.dtype))
        if self.layout not in LAYOUTS:
            raise ValueError(f"pool layout {self.layout!r} is not valid; use one of {list(LAYOUTS)}")

    @classmethod
    def from_kv_layout(cls, layout: KVLayout, block_size: int, pool_layout: str = "nhd") -> "PoolSpec":
        """The pool shape that holds caches of `layout` (batch must be 1: a block table is per sequence)."""
        if layout.batch != 1:
            raise ValueError(f"paged pools hold one sequence per block table; the KV layout has batch={layout.batch}, "
                             "use batch=1")
        return cls(layout.layers, block_size, layout.kv_heads, layout.head_dim, layout.dtype, pool_layout)

    @property
    def block_shape(self) -> tuple[int, int, int]:
        """Shape of one block of one layer side: (block_size, kv_heads, head_dim) for nhd, heads first for hnd."""
        if self.layout == "nhd":
            return (self.block_size, self.kv_heads, self.head_dim)
        return (self.kv_heads, self.block_size, self.head_dim)

    @property
    def element_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def block_elems(self) -> int:
        return self.block_size * self.kv_heads * self.head_dim

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer's K (or V): one row of the pool."""
        return self.block_elems * self.element_bytes

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.layers, 2, num_blocks, *self.block_shape)

    def blocks_for(self, tokens: int) -> int:
        """Blocks a sequence of `tokens` tokens needs (the last one may be partly filled)."""
        return -(-_pos_int("tokens", tokens) // self.block_size)

    def pool_bytes(self, num_blocks: int) -> int:
        return self.layers * 2 * num_blocks * self.block_bytes

    def payload_bytes(self, tokens: int) -> int:
        """Bytes a transfer of one sequence moves: whole blocks, all layers, K and V."""
        return self.pool_bytes(self.blocks_for(tokens))

    def compatible(self, other: "PoolSpec") -> str | None:
        """None when pools of these specs can exchange blocks; else what differs."""
        diffs = [f"{name} {getattr(self, name)!r} vs {getattr(other, name)!r}"
                 for name in ("layers", "block_size", "kv_heads", "head_dim", "dtype", "layout")
                 if getattr(self, name) != getattr(other, name)]
        return "; ".join(diffs) or None


class BlockTable:
    """The blocks of one sequence, in token order: tokens t … lie in block `ids[t // block_size]`.

    block_ids: 1-D ints ≥ 0, unique, exactly ceil(tokens / block_size) of them.
    `ids` is a read-only numpy int64 array; `tensor(device)` a cached int64 tensor of the same ids.
    """

    __slots__ = ("ids", "tokens", "block_size", "_tensors")

    def __init__(self, block_ids, tokens: int, block_size: int):
        tokens = _pos_int("tokens", tokens)
        block_size = _pos_int("block_size", block_size)
        if isinstance(block_ids, torch.Tensor):
            block_ids = block_ids.detach().cpu().numpy()
        ids = np.asarray(block_ids)
        if ids.ndim != 1 or not (ids.dtype.kind in "iu" or ids.size == 0):
            raise ValueError(f"block ids must be a 1-D sequence of ints, got dtype {ids.dtype} shape {ids.shape}")
        ids = ids.astype(np.int64, copy=True)
        need = -(-tokens // block_size)
        if ids.size != need:
            raise ValueError(f"{tokens} tokens in blocks of {block_size} need {need} block ids, got {ids.size}")
        if ids.size and ids.min() < 0:
            raise ValueError(f"block id {int(ids.min())} is negative; block ids are 0 … num_blocks-1")
        uniq, counts = np.unique(ids, return_counts=True)
        if uniq.size != ids.size:
            dup = uniq[counts > 1][:5].tolist()
            raise ValueError(f"duplicate block ids {dup}: a block can hold only one part of a sequence")
        ids.setflags(write=False)
        self.ids = ids
        self.tokens = tokens
        self.block_size = block_size
        self._tensors: dict = {}

    @classmethod
    def packed(cls, tokens: int, block_size: int, start: int = 0) -> "BlockTable":
        """Blocks start, start+1, …: a contiguous (packed) table."""
        n = -(-_pos_int("tokens", tokens) // _pos_int("block_size", block_size))
        return cls(np.arange(start, start + n, dtype=np.int64), tokens, block_size)

    @property
    def num_blocks(self) -> int:
        return int(self.ids.size)

    def __len__(self) -> int:
        return self.num_blocks

    def tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The ids as an int64 tensor on `device` (cached per device)."""
        device = torch.device(device)
        t = self._tensors.get(device)
        if t is None:
            t = torch.from_numpy(self.ids.copy()).to(device)
            self._tensors[device] = t
        return t

    def __repr__(self) -> str:
        head = ", ".join(str(i) for i in self.ids[:6]) + (", …" if self.ids.size > 6 else "")
        return f"BlockTable({self.num_blocks} blocks of {self.block_size} for {self.tokens} tokens: [{head}])"


class BlockAllocator:
    """Hands out block ids of a pool of `num_blocks` blocks.

    order="random": each block is drawn at random from the free list (seeded), which models a busy server
    whose free blocks are scattered over the pool; order="packed": the lowest free ids in order.
    """

    def __init__(self, num_blocks: int, block_size: int, seed: int = 0, order: str = "random"):
        self.num_blocks = _pos_int("num_blocks", num_blocks)
        self.block_size = _pos_int("block_size", block_size)
        if order not in ("random", "packed"):
            raise ValueError(f"allocation order {order!r} is not valid; use 'random' or 'packed'")
        self.order = order
        self._rng = np.random.default_rng(seed)
        self._used = np.zeros(self.num_blocks, dtype=bool)

    @property
    def free_blocks(self) -> int:
        return int(self.num_blocks - self._used.sum())

    def allocate(self, tokens: int) -> BlockTable:
        """A table for `tokens` tokens; ValueError when the pool has too few free blocks."""
        n = -(-_pos_int("tokens", tokens) // self.block_size)
        free = np.flatnonzero(~self._used)
        if n > free.size:
            raise ValueError(f"{tokens} tokens need {n} blocks of {self.block_size}, but only {free.size} of "
                             f"{self.num_blocks} are free")
        if self.order == "random":
            ids = self._rng.choice(free, size=n, replace=False)
        else:
            ids = free[:n]
        self._used[ids] = True
        return BlockTable(ids, tokens, self.block_size)

    def free(self, table: BlockTable) -> None:
        """Return a table's blocks to the free list."""
        if table.ids.size and (table.ids.max() >= self.num_blocks or not self._used[table.ids].all()):
            raise ValueError(f"{table!r} holds blocks this allocator did not hand out (or already freed)")
        self._used[table.ids] = False


# ---------------------------------------------------------------------------------------------------
# the pool


class BlockPool:
    """A block pool on one device: `data` = spec.shape(num_blocks) (see the module doc), K = side 0.

    device: where it lives; pin_memory=True: page-locked host memory (needs CUDA).
    """

    def __init__(self, spec: PoolSpec, num_blocks: int, device: torch.device | str = "cpu",
                 pin_memory: bool = False, data: torch.Tensor | None = None):
        if not isinstance(spec, PoolSpec):
            raise ValueError(f"spec must be a PoolSpec, got {type(spec).__name__}")
        self.spec = spec
        self.num_blocks = _pos_int("num_blocks", num_blocks)
        if data is None:
            device = torch.device(device)
            if pin_memory and device.type != "cpu":
                raise ValueError(f"pin_memory=True needs a host pool, got device {device}")
            if pin_memory and not torch.cuda.is_available():
                raise ValueError("pin_memory=True needs CUDA (page-locked memory is a CUDA feature)")
            data = torch.empty(spec.shape(num_blocks), dtype=spec.dtype, device=device, pin_memory=pin_memory)
        elif tuple(data.shape) != spec.shape(num_blocks) or data.dtype != spec.dtype or not data.is_contiguous():
            raise ValueError(f"data must be a contiguous {spec.dtype} tensor of shape {spec.shape(num_blocks)}, got "
                             f"{data.dtype} {tuple(data.shape)} contiguous={data.is_contiguous()}")
        self.data = data

    @classmethod
    def from_kv_buffer(cls, buffer: KVBuffer, block_size: int, num_blocks: int | None = None,
                       layout: str = "nhd", seed: int = 0, order: str = "random",
                       device: torch.device | str | None = None) -> tuple["BlockPool", BlockTable]:
        """A new pool (default twice the blocks the cache needs) holding `buffer`'s cache in blocks
        allocated by a BlockAllocator(order, seed). Returns (pool, table)."""
        spec = PoolSpec.from_kv_layout(buffer.layout, block_size, layout)
        need = spec.blocks_for(buffer.layout.tokens)
        num_blocks = 2 * need if num_blocks is None else num_blocks
        pool = cls(spec, num_blocks, device=buffer.device if device is None else device).poison()
        table = BlockAllocator(num_blocks, block_size, seed=seed, order=order).allocate(buffer.layout.tokens)
        pool.write(buffer, table)
        return pool, table

    # -- properties -------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def is_pinned(self) -> bool:
        return self.data.device.type == "cpu" and self.data.is_pinned()

    @property
    def num_rows(self) -> int:
        return self.spec.layers * 2 * self.num_blocks

    @property
    def rows(self) -> torch.Tensor:
        """The pool as [layers · 2 · num_blocks, block_elems] (a view: row = one block of one layer side)."""
        return self.data.view(self.num_rows, self.spec.block_elems)

    @property
    def nbytes(self) -> int:
        return self.spec.pool_bytes(self.num_blocks)

    def __repr__(self) -> str:
        s = self.spec
        return (f"BlockPool({self.num_blocks} blocks × {s.block_size} tokens, {s.layers} layers, {s.layout}, "
                f"{s.dtype}, {self.nbytes / 2**20:.1f} MiB on {self.device}{' pinned' if self.is_pinned else ''})")

    # -- filling ----------------------------------------------------------------------------------
    def poison(self) -> "BlockPool":
        """NaN everywhere (KV dtypes are floating), so a block a transport failed to write shows."""
        self.data.fill_(float("nan"))
        return self

    def fill_random(self, seed: int = 0) -> "BlockPool":
        """Standard-normal values from a seeded generator, layer by layer (no full-size float32 temporary)."""
        gen = torch.Generator(device=self.device).manual_seed(seed)
        for layer in range(self.spec.layers):
            self.data[layer].normal_(generator=gen)
        return self

    # -- checks -----------------------------------------------------------------------------------
    def check_table(self, table: BlockTable, role: str = "block table") -> None:
        """ValueError unless `table` is a BlockTable of this pool's block size with ids in range."""
        if not isinstance(table, BlockTable):
            raise ValueError(f"{role} must be a BlockTable, got {type(table).__name__}")
        if table.block_size != self.spec.block_size:
            raise ValueError(f"{role} uses blocks of {table.block_size} tokens, the pool blocks of {self.spec.block_size}")
        if table.num_blocks and table.ids.max() >= self.num_blocks:
            bad = table.ids[table.ids >= self.num_blocks][:5].tolist()
            raise ValueError(f"{role} has block ids {bad} out of range for a pool of {self.num_blocks} blocks "
                             f"(valid 0 … {self.num_blocks - 1})")

    def _check_buffer(self, layout: KVLayout, table: BlockTable) -> None:
        s = self.spec
        if layout.batch != 1:
            raise ValueError(f"a block table holds one sequence; the KV buffer has batch={layout.batch}")
        for name, mine, theirs in (("layers", s.layers, layout.layers), ("kv_heads", s.kv_heads, layout.kv_heads),
                                   ("head_dim", s.head_dim, layout.head_dim), ("dtype", s.dtype, layout.dtype)):
            if mine != theirs:
                raise ValueError(f"KV buffer {name}={theirs} does not match the pool's {name}={mine}")
        if layout.tokens != table.tokens:
            raise ValueError(f"KV buffer holds {layout.tokens} tokens but the block table is for {table.tokens}")

    # -- conversion to and from contiguous caches -------------------------------------------------
    def _to_pages(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """[..., kv_heads, tokens, head_dim] → [..., n, *block_shape], zero-padding the last block."""
        s = self.spec
        pad = n * s.block_size - x.shape[-2]
        if pad:
            x = torch.nn.functional.pad(x, (0, 0, 0, pad))
        lead = x.shape[:-3]
        x = x.reshape(*lead, s.kv_heads, n, s.block_size, s.head_dim)
        k = len(lead)
        if s.layout == "nhd":   # [..., H, n, bs, D] → [..., n, bs, H, D]
            order = (k + 1, k + 2, k, k + 3)
        else:                   # [..., H, n, bs, D] → [..., n, H, bs, D]
            order = (k + 1, k, k + 2, k + 3)
        return x.permute(*range(k), *order).contiguous()

    def _from_pages(self, pages: torch.Tensor, tokens: int) -> torch.Tensor:
        """[..., n, *block_shape] → [..., kv_heads, tokens, head_dim] (inverse of _to_pages)."""
        s = self.spec
        k = pages.dim() - 4
        n = pages.shape[k]
        if s.layout == "nhd":   # [..., n, bs, H, D] → [..., H, n, bs, D]
            order = (k + 2, k, k + 1, k + 3)
        else:                   # [..., n, H, bs, D] → [..., H, n, bs, D]
            order = (k + 1, k, k + 2, k + 3)
        x = pages.permute(*range(k), *order).reshape(*pages.shape[:k], s.kv_heads, n * s.block_size, s.head_dim)
        return x[..., :tokens, :]

    def write(self, buffer: KVBuffer, table: BlockTable) -> None:
        """Store a contiguous cache ([layers, 2, 1, kv_heads, tokens, head_dim]) into the table's blocks.

        The last block's unused token slots are written with zeros (a whole block is always defined).
        """
        self.check_table(table, "block table")
        self._check_buffer(buffer.layout, table)
        x = buffer.data[:, :, 0].to(self.device)
        pages = self._to_pages(x, table.num_blocks)
        self.data.index_copy_(2, table.tensor(self.device), pages)

    def write_layer(self, layer: int, keys: torch.Tensor, values: torch.Tensor, table: BlockTable) -> None:
        """Store one layer's K and V ([1, kv_heads, tokens, head_dim] each) into the table's blocks."""
        if not 0 <= layer < self.spec.layers:
            raise ValueError(f"layer {layer} is out of range (valid 0 … {self.spec.layers - 1})")
        self.check_table(table, "block table")
        s = self.spec
        want = (1, s.kv_heads, table.tokens, s.head_dim)
        for name, t in (("keys", keys), ("values", values)):
            if tuple(t.shape) != want or t.dtype != s.dtype:
                raise ValueError(f"{name} of layer {layer} is {t.dtype} {tuple(t.shape)}; the pool needs {s.dtype} {want}")
        x = torch.stack((keys[0], values[0])).to(self.device)
        self.data[layer].index_copy_(1, table.tensor(self.device), self._to_pages(x, table.num_blocks))

    def read(self, table: BlockTable, device: torch.device | str | None = None) -> KVBuffer:
        """The table's blocks as a new contiguous KVBuffer on `device` (default: the pool's device)."""
        self.check_table(table, "block table")
        s = self.spec
        pages = self.data.index_select(2, table.tensor(self.device))
        layout = KVLayout(s.layers, 1, s.kv_heads, table.tokens, s.head_dim, s.dtype)
        out = KVBuffer(layout, device=self.device if device is None else device)
        out.data[:, :, 0].copy_(self._from_pages(pages, table.tokens))
        return out

    def blocks(self, table: BlockTable) -> torch.Tensor:
        """A copy of the table's blocks: [layers, 2, n, *block_shape]."""
        self.check_table(table, "block table")
        return self.data.index_select(2, table.tensor(self.device))

    def to_hf_cache(self, table: BlockTable, device: torch.device | str | None = None):
        """A transformers DynamicCache for decode, holding the table's tokens (rebuilt contiguous)."""
        return self.read(table, device).as_hf_cache(filled=True)

    def write_hf_cache(self, cache, table: BlockTable) -> None:
        """Store a transformers cache (per-layer .keys/.values [1, kv_heads, tokens, head_dim]) into blocks."""
        self.write(KVBuffer.from_hf_cache(cache), table)


# ---------------------------------------------------------------------------------------------------
# prefill straight into pages


def _paged_layer_class():
    from transformers.cache_utils import DynamicLayer

    class _PagedPrefillLayer(DynamicLayer):
        """A cache layer whose prefill update writes K and V into pool blocks (attention reads the states
        as computed); later updates append like a DynamicLayer."""

        def __init__(self, pool: BlockPool, table: BlockTable, index: int):
            super().__init__()
            self._pool, self._table, self._index = pool, table, index

        def update(self, key_states, value_states, *args, **kwargs):
            if self.is_initialized:
                return super().update(key_states, value_states, *args, **kwargs)
            self._pool.write_layer(self._index, key_states, value_states, self._table)
            self.device = key_states.device
            self.keys, self.values = key_states, value_states
            self.is_initialized = True
            return self.keys, self.values

    return _PagedPrefillLayer


_PAGED_LAYER = None


def paged_prefill_cache(pool: BlockPool, table: BlockTable):
    """An empty DynamicCache whose prefill writes each layer's K and V into `table`'s blocks of `pool`
    (the prompt must have exactly table.tokens tokens). Layer i's blocks are final when its attention
    returns, which is when kvlab.hooks.LayerHooks(point="attention") calls on_kv_ready(i)."""
    global _PAGED_LAYER
    from transformers import DynamicCache

    pool.check_table(table, "block table")
    if _PAGED_LAYER is None:
        _PAGED_LAYER = _paged_layer_class()
    cache = DynamicCache()
    cache.layers.clear()
    for i in range(pool.spec.layers):
        cache.layers.append(_PAGED_LAYER(pool, table, i))
    return cache


@torch.inference_mode()
def prefill_into_pages(model, input_ids: torch.Tensor, pool: BlockPool, table: BlockTable) -> torch.Tensor:
    """Prefill `input_ids` [1, tokens] writing K and V into the table's blocks; returns the last
    position's logits [1, vocab]."""
    from .steps import cache_kw

    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] != table.tokens:
        raise ValueError(f"input_ids must be [1, {table.tokens}] for this block table, got {tuple(input_ids.shape)}")
    cache = paged_prefill_cache(pool, table)
    out = model(input_ids=input_ids, **{cache_kw(model): cache}, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1]


# ---------------------------------------------------------------------------------------------------
# byte-exact verification


def verify_transfer(src_pool: BlockPool, src_table: BlockTable, dst_pool: BlockPool,
                    dst_table: BlockTable | None = None) -> dict:
    """Did a transfer land every byte, and only where it should?

    Compares every destination block with its source block as raw bits (NaN-safe), layer by layer so
    memory stays at one layer's blocks, and checks that every destination block outside the table still
    holds its NaN poison. dst_table None: the blocks were expected packed at ids 0 … n-1.
    Returns {ok, blocks, mismatched_blocks, outside_blocks, unpoisoned_blocks}.
    """
    if dst_table is None:
        dst_table = BlockTable.packed(src_table.tokens, src_table.block_size)
    src_pool.check_table(src_table, "source table")
    dst_pool.check_table(dst_table, "destination table")
    if src_table.num_blocks != dst_table.num_blocks:
        raise ValueError(f"source table has {src_table.num_blocks} blocks, destination table {dst_table.num_blocks}")
    if (why := src_pool.spec.compatible(dst_pool.spec)) is not None:
        raise ValueError(f"pools differ: {why}")
    spec = src_pool.spec
    view = _INT_VIEW[spec.element_bytes]
    where = src_pool.device
    sids = src_table.tensor(where)
    dids = dst_table.tensor(dst_pool.device)
    outside = torch.ones(dst_pool.num_blocks, dtype=torch.bool)
    outside[dst_table.tensor("cpu")] = False
    outside = outside.to(dst_pool.device)
    n_out = int(outside.sum())
    mismatched = unpoisoned = 0
    # a host pool is brought to the source GPU a layer at a time: indexing there is far faster than on the CPU
    moved = dst_pool.device.type == "cpu" and where.type == "cuda"
    if moved:
        dids, outside = dids.to(where), outside.to(where)
    for layer in range(spec.layers):
        a = src_pool.data[layer].index_select(1, sids)
        d = dst_pool.data[layer].to(where) if moved else dst_pool.data[layer]
        b = d.index_select(1, dids).to(where)
        diff = (a.view(view) != b.view(view)).flatten(2).any(-1)
        mismatched += int(diff.sum())
        if n_out:
            rest = d[:, outside]
            unpoisoned += int((~torch.isnan(rest)).flatten(2).any(-1).sum())
    blocks = 2 * spec.layers * src_table.num_blocks
    return {"ok": mismatched == 0 and unpoisoned == 0, "blocks": blocks, "mismatched_blocks": mismatched,
            "outside_blocks": 2 * spec.layers * n_out, "unpoisoned_blocks": unpoisoned}


# ---------------------------------------------------------------------------------------------------
# transfer plans


@dataclass
class _Plan:
    """Which rows move where, for one (source pool, source table, destination table) triple.

    Rows are ordered layer, side, then destination block id: layer i's rows are [i·rpl, (i+1)·rpl)
    with rpl = 2·n. src_rows / dst_rows are numpy int64 row ids into src_pool.rows / the destination rows.
    """

    src_pool: BlockPool
    src_table: BlockTable
    dst_table: BlockTable | None
    n_blocks: int
    src_rows: np.ndarray
    dst_rows: np.ndarray
    extra: dict = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return int(self.src_rows.size)

    @property
    def rows_per_layer(self) -> int:
        return 2 * self.n_blocks

    def layer_range(self, layer: int) -> tuple[int, int]:
        return layer * self.rows_per_layer, (layer + 1) * self.rows_per_layer


def _row_ids(layers: int, pool_blocks: int, block_ids: np.ndarray) -> np.ndarray:
    sides = np.arange(2 * layers, dtype=np.int64)[:, None] * pool_blocks
    return (sides + block_ids[None, :]).reshape(-1)


def _runs(dst_rows: np.ndarray, limit: int | None = None) -> list[tuple[int, int, int]]:
    """Split a row list into runs of consecutive destination rows: [(plan offset, first dst row, count)].

    limit: also cut at every multiple of `limit` plan rows (chunk boundaries)."""
    n = dst_rows.size
    if n == 0:
        return []
    cuts = np.flatnonzero(np.diff(dst_rows) != 1) + 1
    if limit:
        cuts = np.union1d(cuts, np.arange(limit, n, limit, dtype=np.int64))
    starts = np.concatenate(([0], cuts)).astype(np.int64)
    ends = np.concatenate((cuts, [n])).astype(np.int64)
    return list(zip(starts.tolist(), dst_rows[starts].tolist(), (ends - starts).tolist()))


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    return a.type != "cuda" or (a.index or 0) == (b.index or 0)


# ---------------------------------------------------------------------------------------------------
# transports


class PagedTransport:
    """Move a sequence's blocks from a source pool to this transport's destination pool.

    spec: the pools' shape; dest: "same-gpu" | "cuda:N" | "pinned" | "pageable" (kvlab.transfer.Destination);
    dst_blocks: blocks in the destination pool (allocated once, here, and NaN-poisoned);
    src_device: where source pools live. Options are per transport (see each class).

    `send(src_pool, src_table, dst_table=None)` enqueues the copy after the work already queued on the
    current stream and returns a Landing (stream-ordered transports: a CUDA event on the copy stream;
    CPU: already complete). dst_table None = packed at blocks 0 … n-1 (paged → contiguous).
    `prepare(...)` builds (and caches) the plan of a table pair — index arrays, pointer lists, tuning —
    so repeated sends of the same tables measure the transfer, not the planning.
    """

    name = "base"
    kinds: tuple[str, ...] = ("device", "peer", "pinned", "pageable")
    needs_cuda = False
    stream_ordered = True
    options: dict = {}

    @classmethod
    def unavailable(cls, src_device: torch.device | str, dest) -> str | None:
        """None when this transport can run from `src_device` to `dest`; else the reason it cannot."""
        src = torch.device(src_device)
        try:
            d = Destination.parse(dest, src)
        except ValueError as exc:
            return str(exc)
        if d.kind not in cls.kinds:
            return f"{cls.name} does not apply to a {d.label} destination (it moves to: {', '.join(cls.kinds)})"
        if (cls.needs_cuda or d.kind in ("pinned", "peer")) and src.type != "cuda":
            return f"{cls.name} to {d.label} needs a CUDA source device; the source is {src}"
        return cls._unavailable_here(src, d)

    @classmethod
    def _unavailable_here(cls, src: torch.device, dest: Destination) -> str | None:
        return None

    def __init__(self, spec: PoolSpec, dest, dst_blocks: int, src_device: torch.device | str = "cpu", **options):
        if not isinstance(spec, PoolSpec):
            raise ValueError(f"spec must be a PoolSpec, got {type(spec).__name__}")
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            raise ValueError(f"unknown option(s) {unknown} for transport {self.name!r}; valid: {sorted(self.options)}")
        self.opts = {**self.options, **options}
        self.spec = spec
        src = torch.device(src_device)
        if src.type == "cuda" and src.index is None:
            src = torch.device("cuda", torch.cuda.current_device())
        self.src_device = src
        self.dest = Destination.parse(dest, src)
        why = self.unavailable(src, self.dest)
        if why is not None:
            raise ValueError(f"transport {self.name!r} cannot run here: {why}")
        dst_blocks = _pos_int("dst_blocks", dst_blocks)
        self.cuda = src.type == "cuda"
        self._check_capacity(spec.pool_bytes(dst_blocks))
        self.pool = BlockPool(spec, dst_blocks, device=self.dest.device, pin_memory=self.dest.kind == "pinned")
        self.pool.poison()
        if self.dest.kind == "peer":
            _enable_peer(src, self.dest.device)
        self.stream = torch.cuda.Stream(device=src) if self.cuda else None
        self._done = torch.cuda.Event(enable_timing=True) if self.cuda else None
        self._plans: OrderedDict = OrderedDict()
        self.backend = self.name
        self.notes: list[str] = []
        self.config: dict = {}
        self._setup()

    # -- hooks for subclasses ---------------------------------------------------------------------
    def _setup(self) -> None:
        """Allocate per-transport resources (streams, staging) after the destination pool exists."""

    def _prepare(self, plan: _Plan) -> None:
        """Build what `_copy` needs for this plan (index tensors, pointer lists, tuning)."""

    def _copy(self, plan: _Plan, lo: int, hi: int) -> None:
        """Copy plan rows [lo, hi); runs with the copy stream current (GPU) or synchronously (CPU)."""
        raise NotImplementedError

    # -- public -----------------------------------------------------------------------------------
    @property
    def label(self) -> str:
        return self.dest.label

    @property
    def info(self) -> dict:
        """What ran: name, backend actually used, notes (fallbacks, tuning), configuration."""
        return {"method": self.name, "backend": self.backend, "notes": list(self.notes), "config": dict(self.config)}

    def poison(self) -> None:
        """NaN-fill the destination pool (run before a verified send)."""
        self.pool.poison()

    def close(self) -> None:
        """Release external resources (NIXL registrations); the pool is freed with the object."""
        self._plans.clear()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: nothing left to release
            pass

    def prepare(self, src_pool: BlockPool, src_table: BlockTable, dst_table: BlockTable | None = None) -> _Plan:
        """Validate a send and build its plan (cached for the last two table pairs).

        Invalid input raises ValueError before any byte moves. On a GPU, building a plan may tune the
        kernel, which writes the plan's destination rows (with the right bytes): poison the destination
        after prepare() when a verification must prove what send() wrote.
        """
        key = (id(src_pool), id(src_table), id(dst_table))
        plan = self._plans.get(key)
        if plan is not None and plan.src_pool is src_pool and plan.src_table is src_table and plan.dst_table is dst_table:
            self._plans.move_to_end(key)
            return plan
        plan = self._build_plan(src_pool, src_table, dst_table)
        self._prepare(plan)
        self._plans[key] = plan
        while len(self._plans) > 2:
            self._plans.popitem(last=False)
        return plan

    def _build_plan(self, src_pool, src_table, dst_table) -> _Plan:
        if not isinstance(src_pool, BlockPool):
            raise ValueError(f"src_pool must be a BlockPool, got {type(src_pool).__name__}")
        if (why := self.spec.compatible(src_pool.spec)) is not None:
            raise ValueError(f"source pool does not match the transport's pool spec: {why}")
        if not _same_device(src_pool.device, self.src_device):
            raise ValueError(f"source pool is on {src_pool.device}, the transport sends from {self.src_device}")
        src_pool.check_table(src_table, "source table")
        n = src_table.num_blocks
        if dst_table is None:
            if n > self.pool.num_blocks:
                raise ValueError(f"destination too small: {n} blocks to land packed, the destination pool has "
                                 f"{self.pool.num_blocks}")
            dst_ids = np.arange(n, dtype=np.int64)
        else:
            self.pool.check_table(dst_table, "destination table")
            if dst_table.num_blocks != n or dst_table.tokens != src_table.tokens:
                raise ValueError(f"length mismatch: source table {n} blocks / {src_table.tokens} tokens, destination "
                                 f"table {dst_table.num_blocks} blocks / {dst_table.tokens} tokens")
            dst_ids = dst_table.ids
        # order each layer side by destination block: packed destinations then form long runs
        order = np.argsort(dst_ids, kind="stable")
        src_ids, dst_ids = src_table.ids[order], dst_ids[order]
        L = self.spec.layers
        return _Plan(src_pool, src_table, dst_table, n,
                     _row_ids(L, src_pool.num_blocks, src_ids), _row_ids(L, self.pool.num_blocks, dst_ids))

    def send(self, src_pool: BlockPool, src_table: BlockTable, dst_table: BlockTable | None = None) -> Landing:
        """Move the table's blocks (all layers, K and V) into the destination pool."""
        plan = self.prepare(src_pool, src_table, dst_table)
        L = self.spec.layers
        if not self.cuda:
            self._copy(plan, 0, plan.rows)
            return Landing(L)
        self._wait_for_destination()
        compute = torch.cuda.current_stream(self.src_device)
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            self._copy(plan, 0, plan.rows)
        self._done.record(self.stream)
        return Landing(L, [self._done] * L)

    def _wait_for_destination(self) -> None:
        """A peer pool is written (poisoned, read by decode) on the peer's own streams; the copy stream must
        not overtake that work. Same ordering as torch's cross-device copy_, one event per send."""
        if self.cuda and self.dest.kind == "peer":
            self.stream.wait_stream(torch.cuda.current_stream(self.dest.device))

    def layerwise(self, src_pool: BlockPool, src_table: BlockTable, dst_table: BlockTable | None = None
                  ) -> "PagedLayerwiseSend":
        """A per-layer sender for kvlab.hooks.LayerHooks: on_layer(i) sends layer i's blocks."""
        if not self.stream_ordered:
            raise ValueError(f"transport {self.name!r} is not stream-ordered and cannot send layer by layer")
        return PagedLayerwiseSend(self, src_pool, src_table, dst_table)

    # -- helpers ----------------------------------------------------------------------------------
    def _check_capacity(self, need: int) -> None:
        check_capacity(self.dest, need, "destination pool", hint="use fewer dst_blocks")

    def _indices(self, plan: _Plan) -> tuple[torch.Tensor, torch.Tensor]:
        """Row ids as int64 tensors on the source device (cached on the plan)."""
        idx = plan.extra.get("idx")
        if idx is None:
            idx = (self._on_stream(torch.from_numpy(plan.src_rows).to(self.src_device)),
                   self._on_stream(torch.from_numpy(plan.dst_rows).to(self.src_device)))
            plan.extra["idx"] = idx
        return idx

    def _on_stream(self, t: torch.Tensor) -> torch.Tensor:
        """Mark a tensor made on the current stream as used on the copy stream, so the caching allocator
        does not hand its memory out again (when the plan is dropped) while a copy may still read it."""
        if self.cuda and t.device.type == "cuda" and _same_device(t.device, self.src_device):
            t.record_stream(self.stream)
        return t

    def _note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)


def _enable_peer(src: torch.device, dst: torch.device) -> None:
    """Turn on peer access both ways with a one-element copy: torch's copy path enables it on first use,
    and kernels that store to the peer's memory need it on before they launch."""
    if not torch.cuda.can_device_access_peer(src.index or 0, dst.index or 0):
        raise ValueError(f"{src} cannot access {dst} directly (no P2P between them); a peer transport needs P2P")
    a = torch.zeros(1, device=src)
    b = torch.zeros(1, device=dst)
    b.copy_(a)
    a.copy_(b)
    torch.cuda.synchronize(src)
    torch.cuda.synchronize(dst)


# -- 1. per-block copy_ ------------------------------------------------------------------------------


class PerBlockCopy(PagedTransport):
    """One `copy_` per block (per layer side): 2 · layers · n Python-level copies; the baseline."""

    name = "per-block-copy"

    def _prepare(self, plan):
        plan.extra["pairs"] = (plan.src_rows.tolist(), plan.dst_rows.tolist())

    def _copy(self, plan, lo, hi):
        src, dst = plan.src_pool.rows, self.pool.rows
        s, d = plan.extra["pairs"]
        nb = self.cuda
        for i in range(lo, hi):
            dst[d[i]].copy_(src[s[i]], non_blocking=nb)


# -- 2. torch indexing -------------------------------------------------------------------------------


class TorchIndex(PagedTransport):
    """index_select into a staging tensor on the source device, then index_copy_ into the destination
    (peer: the staging rows are copied to the peer first); host destinations: gather, then one copy per
    run of consecutive destination rows (one in total for a packed, exactly-sized destination)."""

    name = "torch-index"

    def _setup(self):
        self.dst_stream = torch.cuda.Stream(device=self.dest.device) if self.dest.kind == "peer" else None

    def _prepare(self, plan):
        sidx, didx = self._indices(plan)
        E = self.spec.block_elems
        plan.extra["tmp"] = self._on_stream(torch.empty((plan.rows, E), dtype=self.spec.dtype, device=self.src_device))
        if self.dest.kind == "peer":
            plan.extra["tmp_dst"] = torch.empty((plan.rows, E), dtype=self.spec.dtype, device=self.dest.device)
            plan.extra["didx_dst"] = didx.to(self.dest.device)
            for t in (plan.extra["tmp_dst"], plan.extra["didx_dst"]):
                t.record_stream(self.dst_stream)
        if self.dest.kind in ("pinned", "pageable"):
            plan.extra["runs"] = {}

    def _copy(self, plan, lo, hi):
        sidx, didx = self._indices(plan)
        src, dst = plan.src_pool.rows, self.pool.rows
        tmp = plan.extra["tmp"][lo:hi]
        torch.index_select(src, 0, sidx[lo:hi], out=tmp)
        kind = self.dest.kind
        if kind == "device":
            dst.index_copy_(0, didx[lo:hi], tmp)
        elif kind == "peer":
            ds = self.dst_stream
            ds.wait_stream(self.stream)
            with torch.cuda.stream(ds):
                tmp_dst = plan.extra["tmp_dst"][lo:hi]
                tmp_dst.copy_(tmp, non_blocking=True)
                dst.index_copy_(0, plan.extra["didx_dst"][lo:hi], tmp_dst)
            self.stream.wait_stream(ds)
        else:
            runs = plan.extra["runs"].get((lo, hi))
            if runs is None:
                runs = plan.extra["runs"][(lo, hi)] = _runs(plan.dst_rows[lo:hi])
            nb = self.cuda and kind == "pinned"
            for off, row, cnt in runs:
                dst[row:row + cnt].copy_(tmp[off:off + cnt], non_blocking=nb)


# -- 3. Triton kernel --------------------------------------------------------------------------------

_TUNED: dict = {}


def _kernel_config(transport: PagedTransport, key: tuple, tune_args) -> kernels.KernelConfig:
    """The kernel config for this transport: given, cached from an earlier tuning, or tuned now (GPU)."""
    given = transport.opts.get("config")
    if given is not None:
        cfg = given if isinstance(given, kernels.KernelConfig) else kernels.KernelConfig(**given)
        transport.config["kernel"] = cfg.as_dict()
        return cfg
    tune = transport.opts.get("tune")
    if tune is None:
        tune = transport.cuda
    if not tune or not transport.cuda:
        transport.config["kernel"] = kernels.DEFAULT_CONFIG.as_dict()
        return kernels.DEFAULT_CONFIG
    hit = _TUNED.get(key)
    if hit is None:
        hit = _TUNED[key] = kernels.tune(*tune_args, repeats=transport.opts.get("tune_repeats", 5))
    cfg, table = hit
    transport.config["tuning"] = table
    transport._note(f"kernel tuned on this GPU: {cfg.as_dict()}")
    transport.config["kernel"] = cfg.as_dict()
    return cfg


# tune on the first ≤ 16,384 rows of a plan (256 MiB of 16 KiB rows): long enough that launch overhead does
# not pick the winner, short enough to be cheap even over PCIe; a tuned config is reused for plans of the
# same (method, row size, destination kind, device, tuned rows)
_TUNE_ROWS = 16384


# a bulk send may move its rows in any order (destination rows are distinct); the order decides which
# addresses the GPU's concurrently running programs read and write, and so how evenly the memory
# channels are loaded
BULK_ORDERS = ("layer", "interleaved", "src")

# the tuner launches back to back on one stream, where each launch can start while the previous one
# drains; a send starts cold, after a hand-off from the caller's stream (run 20261129-103427-h200: 923 µs
# back to back, 936 µs through the send). The fastest few are timed again the way a send runs.
_FINALISTS = 6


def finalists(table: list, k: int = _FINALISTS) -> list:
    """The k fastest timed candidates of a tuning table (rows with "ms"), fastest first."""
    return sorted((r for r in table if r.get("ms") is not None), key=lambda r: r["ms"])[:k]


# tune a device-to-device plan on all of its rows up to this many bytes (a prefix would miss how the
# whole pattern loads the memory, and 2 GiB takes ~1 ms a launch on an H200)
_TUNE_FULL_BYTES = 2 << 30


def bulk_order(plan: "_Plan", order: str) -> np.ndarray:
    """A permutation of a plan's rows for a bulk send.

    "layer": the plan's own order — layer, K/V side, then destination block (writes ascend through each
        layer side's pool, reads jump);
    "interleaved": block-major — the first block of every layer side, then the second, … (the programs
        running at any moment spread over all 2·layers pools at once);
    "src": layer, side, then source block (reads ascend, writes jump).
    """
    n = plan.rows
    rpl = plan.n_blocks  # rows per layer side
    side = np.arange(n) // rpl
    if order == "layer":
        return np.arange(n)
    if order == "interleaved":
        return np.lexsort((side, np.arange(n) % rpl))
    if order == "src":
        return np.lexsort((plan.src_rows, side))
    raise ValueError(f"unknown bulk order {order!r}; valid: {list(BULK_ORDERS)}")


class TritonCopy(PagedTransport):
    """One Triton kernel launch gathers the source rows and scatters them to their destination rows in one
    pass (no staging), on the same GPU or into a peer GPU's pool (stores over NVLink/PCIe P2P).

    Options: config (KernelConfig or dict; default: tuned on the GPU at the first prepare),
    order (a BULK_ORDERS name for bulk sends; default: tuned with the config on a GPU, else "layer"),
    tune (bool; default True on a GPU), tune_repeats. Layer-wise sends keep the plan's per-layer order.
    On a CPU without TRITON_INTERPRET=1 the torch path runs instead and `backend`/`notes` say so.
    """

    name = "triton"
    kinds = ("device", "peer")
    options = {"config": None, "order": None, "tune": None, "tune_repeats": 5}

    def _setup(self):
        ok, why = kernels.triton_status(self.src_device)
        self.use_triton = ok
        self.backend = "triton" if ok else "torch fallback"
        if not ok:
            self._note(f"fallback to torch index_select/index_copy_: {why}")
        order = self.opts.get("order")
        if order is not None and order not in BULK_ORDERS:
            raise ValueError(f"unknown bulk order {order!r}; valid: {list(BULK_ORDERS)}")

    def _prepare(self, plan):
        sidx, didx = self._indices(plan)
        if self.dest.kind == "peer" and not self.use_triton:
            plan.extra["didx_dst"] = didx.to(self.dest.device)
        if not self.use_triton:
            return
        given = self.opts.get("order")
        tune = self.opts.get("tune")
        tune = self.cuda if tune is None else bool(tune) and self.cuda
        orders = [given] if given is not None else (list(BULK_ORDERS) if tune and self.opts.get("config") is None
                                                    else ["layer"])
        full = plan.rows * self.spec.block_bytes <= _TUNE_FULL_BYTES and self.dest.kind in ("device", "peer")
        n = plan.rows if full else min(plan.rows, _TUNE_ROWS)
        best = None
        tables = []
        rows = {}
        for order in orders:
            perm = torch.from_numpy(bulk_order(plan, order)).to(sidx.device)
            s, d = self._on_stream(sidx[perm].contiguous()), self._on_stream(didx[perm].contiguous())
            rows[order] = (s, d)
            key = (self.name, self.spec.block_bytes, self.dest.kind, str(self.src_device), n, order, plan.rows)
            cfg = _kernel_config(self, key, (plan.src_pool.rows, s[:n], self.pool.rows, d[:n]))
            table = self.config.pop("tuning", None) or []
            tables += [{**row, "order": order} for row in table]
            ms = min((row["ms"] for row in table if row.get("ms") is not None), default=None)
            if best is None or (ms is not None and (best[0] is None or ms < best[0])):
                best = (ms, order, cfg, s, d)
        _, order, cfg, s, d = best
        final = finalists(tables) if tune else []
        if len(final) > 1:
            fields = kernels.KernelConfig.__dataclass_fields__
            for row in final:
                fs, fd = rows[row["order"]]
                row["send_ms"] = self._time_send(plan, fs[:n], fd[:n], kernels.KernelConfig(**{f: row[f] for f in fields}))
            pick = min(final, key=lambda r: r["send_ms"])
            order, cfg = pick["order"], kernels.KernelConfig(**{f: pick[f] for f in fields})
            s, d = rows[order]
        plan.extra["cfg"] = cfg
        plan.extra["bulk"] = (s, d)
        self.config["order"] = order
        self.config["kernel"] = cfg.as_dict()
        if tables:
            self.config["tuning"] = tables
            self.config["tuned_rows"] = n
        self.notes = [x for x in self.notes if not x.startswith("kernel tuned on this GPU")]
        if tune:
            self._note(f"kernel tuned on this GPU ({n:,} rows, {len(orders)} orders; the {len(final)} fastest "
                       f"timed again as sends): {cfg.as_dict()}, order={order}")

    def _time_send(self, plan, s, d, cfg, repeats: int = 5) -> float:
        """Median ms of one launch the way send() runs it: the copy stream waits for the caller's stream,
        the kernel runs there, the caller's stream waits for it (CUDA events on the caller's stream)."""
        cur = torch.cuda.current_stream(self.src_device)
        done = torch.cuda.Event()

        def run():
            self.stream.wait_stream(cur)
            with torch.cuda.stream(self.stream):
                kernels.launch_rows(plan.src_pool.rows, s, self.pool.rows, d, cfg)
            done.record(self.stream)
            cur.wait_event(done)

        times = sorted(timing.time_fn(run, n=repeats, warmup=1, device=self.src_device))
        return times[len(times) // 2]

    def _copy(self, plan, lo, hi):
        if (lo, hi) == (0, plan.rows) and "bulk" in plan.extra:
            sidx, didx = plan.extra["bulk"]
        else:
            sidx, didx = self._indices(plan)
        if self.use_triton:
            kernels.launch_rows(plan.src_pool.rows, sidx[lo:hi], self.pool.rows, didx[lo:hi], plan.extra["cfg"])
        else:
            kernels.copy_rows_reference(plan.src_pool.rows, sidx[lo:hi], self.pool.rows,
                                        plan.extra.get("didx_dst", didx)[lo:hi])


# -- 4. host: chunked gather overlapped with device→host copies ---------------------------------------


class ChunkedGatherD2H(PagedTransport):
    """To host memory: gather `chunk_mib` of rows at a time into a ring of `ring` device staging chunks
    (compute side: the transport's stream), and copy each gathered chunk device → host on a second copy
    stream; events order them (gather k → copy k; copy k → the gather that reuses its slot), so while
    chunk k crosses the link chunk k+1 is being gathered and the copy engine never waits.

    Options: chunk_mib (default 64), ring (chunks, default 3), gather ("triton" | "torch", default
    triton when available), config / tune / tune_repeats (for the gather kernel).
    """

    name = "chunked-gather-d2h"
    kinds = ("pinned", "pageable")
    options = {"chunk_mib": 64, "ring": 3, "gather": None, "config": None, "tune": None, "tune_repeats": 5}

    def _setup(self):
        chunk_bytes = int(float(self.opts["chunk_mib"]) * 2**20)
        ring = self.opts["ring"]
        if chunk_bytes < self.spec.block_bytes:
            raise ValueError(f"chunk_mib={self.opts['chunk_mib']} is smaller than one block row "
                             f"({self.spec.block_bytes} bytes)")
        if not isinstance(ring, int) or ring < 2:
            raise ValueError(f"ring must be an int ≥ 2 (one chunk gathering while another is copied), got {ring!r}")
        self.chunk_rows = chunk_bytes // self.spec.block_bytes
        ok, why = kernels.triton_status(self.src_device)
        gather = self.opts["gather"] or ("triton" if ok else "torch")
        if gather not in ("triton", "torch"):
            raise ValueError(f"gather {gather!r} is not valid; use 'triton' or 'torch'")
        if gather == "triton" and not ok:
            self._note(f"gather falls back to torch index_select: {why}")
            gather = "torch"
        self.gather = gather
        self.backend = f"{gather} gather + {'copy engine' if self.cuda else 'host copy'}"
        E = self.spec.block_elems
        # the staging ring lives on the source GPU: allocated once here, never inside a send
        self.staging = [torch.empty((self.chunk_rows, E), dtype=self.spec.dtype, device=self.src_device)
                        for _ in range(ring)]
        self.copy_stream = torch.cuda.Stream(device=self.src_device) if self.cuda else None
        self._gathered = [torch.cuda.Event() for _ in range(ring)] if self.cuda else None
        self._free = [torch.cuda.Event() for _ in range(ring)] if self.cuda else None
        self.config.update(chunk_rows=self.chunk_rows, chunk_bytes=self.chunk_rows * self.spec.block_bytes, ring=ring)

    def _prepare(self, plan):
        sidx, _ = self._indices(plan)
        plan.extra["chunks"] = {}
        if self.gather == "triton":
            n = min(plan.rows, self.chunk_rows)
            key = (self.name, self.spec.block_bytes, "gather", str(self.src_device), n)
            plan.extra["cfg"] = _kernel_config(self, key, (plan.src_pool.rows, sidx[:n], self.staging[0], None))

    def _chunks(self, plan, lo, hi):
        chunks = plan.extra["chunks"].get((lo, hi))
        if chunks is None:
            # runs of consecutive host rows, also cut at chunk boundaries; grouped per chunk
            chunks = []
            for off, row, cnt in _runs(plan.dst_rows[lo:hi], self.chunk_rows):
                k = off // self.chunk_rows
                if k == len(chunks):
                    chunks.append((lo + k * self.chunk_rows, min(hi, lo + (k + 1) * self.chunk_rows), []))
                chunks[k][2].append((off - k * self.chunk_rows, row, cnt))
            plan.extra["chunks"][(lo, hi)] = chunks
        return chunks

    def _copy(self, plan, lo, hi):
        sidx, _ = self._indices(plan)
        src, host = plan.src_pool.rows, self.pool.rows
        ring = len(self.staging)
        pinned = self.dest.kind == "pinned"
        last = None
        for k, (a, b, pieces) in enumerate(self._chunks(plan, lo, hi)):
            slot = k % ring
            stage = self.staging[slot]
            if self.cuda:
                self.stream.wait_event(self._free[slot])  # the copy that last read this slot is done
            if self.gather == "triton":
                kernels.launch_rows(src, sidx[a:b], stage, None, plan.extra["cfg"])
            else:
                torch.index_select(src, 0, sidx[a:b], out=stage[: b - a])
            if not self.cuda:
                for off, row, cnt in pieces:
                    host[row:row + cnt].copy_(stage[off:off + cnt])
                continue
            self._gathered[slot].record(self.stream)
            self.copy_stream.wait_event(self._gathered[slot])
            with torch.cuda.stream(self.copy_stream):
                for off, row, cnt in pieces:
                    host[row:row + cnt].copy_(stage[off:off + cnt], non_blocking=pinned)
            self._free[slot].record(self.copy_stream)
            last = self._free[slot]
        if last is not None:
            self.stream.wait_event(last)  # the send's done event (recorded on self.stream) covers the copies


# -- 4b. peer: gather, copy engine over NVLink, scatter on the peer --------------------------------


def chunk_bounds(lo: int, hi: int, chunk: int, edge: int) -> list[tuple[int, int]]:
    """Plan rows [lo, hi) cut into pipeline chunks of at most `chunk` rows: a small first and last chunk of
    `edge` rows (≤ chunk; the gather of the first and the scatter of the last cannot overlap anything, so
    they are kept short) and near-equal chunks between them. A range of at most 2 × edge rows is cut into
    near-equal pieces of at most `chunk` rows. chunk, edge ≥ 1."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1 or \
            isinstance(edge, bool) or not isinstance(edge, int) or edge < 1:
        raise ValueError(f"chunk={chunk!r}, edge={edge!r}: both must be ints ≥ 1 (rows)")
    edge = min(edge, chunk)

    def even(a: int, b: int) -> list[tuple[int, int]]:
        if b <= a:
            return []
        k = -(-(b - a) // chunk)
        step = -(-(b - a) // k)
        return [(x, min(b, x + step)) for x in range(a, b, step)]

    n = hi - lo
    if n <= 0:
        return []
    if n <= 2 * edge:
        return even(lo, hi)
    return [(lo, lo + edge)] + even(lo + edge, hi - edge) + [(hi - edge, hi)]


class ChunkedGatherPeer(PagedTransport):
    """To a peer GPU's paged pool at the copy engine's rate: gather a chunk of rows on the source GPU into
    a staging ring (SMs, HBM speed), copy it to a staging ring on the peer with the copy engine
    (cudaMemcpyAsync, no SM stores over NVLink), and scatter it into the peer's pool with a kernel on the
    peer — three stages in flight at once, ordered by events (gather k → copy k → scatter k; copy k frees
    the source slot for gather k+ring, scatter k the peer slot for copy k+ring). Copies alternate over
    `copy_streams` streams so one copy's fixed start-up cost hides under the other's bytes.

    Why not the direct store (method "triton" to a peer): SMs cross NVLink in 128-byte stores and reach
    ~94 % of the copy engine's rate there; here only the copy engine crosses the link.

    The host issues five to ten driver calls and two kernel launches per chunk — in run
    20261130-144458-h200 about 0.2 ms of Python a chunk, so 16 MiB chunks (112 of them) took 23 ms and the
    link waited for the host. Chunks must therefore carry more bytes than the link moves in one chunk's
    host time (≳ 80 MB at 395 GB/s); the first gather and the last scatter, which nothing overlaps, grow
    with them. The tuner times those trade-offs on the real tables and records the host's issue time
    beside each (config["pipeline_tuning"]).

    Options: chunk_mib (middle chunks; None = tuned among CHUNKS_MIB on a GPU, else 128), edge_mib (first
    and last chunk; None = tuned among EDGES_MIB, else 32), copy_streams (1 or 2; None = tuned), ring
    (slots per side, default 3), config (gather/scatter KernelConfig; default: tuned for the gather), tune,
    tune_repeats.
    """

    name = "chunked-gather-peer"
    kinds = ("peer",)
    needs_cuda = True
    options = {"chunk_mib": None, "edge_mib": None, "copy_streams": None, "ring": 3, "config": None, "tune": None,
               "tune_repeats": 5}
    CHUNKS_MIB = (128, 256)
    EDGES_MIB = (16, 64)

    @classmethod
    def _unavailable_here(cls, src, dest):
        ok, why = kernels.triton_status(src)
        if not ok:
            return f"{cls.name} gathers and scatters with the Triton kernel: {why}"
        cudart, why = _cudart_plain()
        return why

    def _setup(self):
        ring = self.opts["ring"]
        if not isinstance(ring, int) or ring < 2:
            raise ValueError(f"ring must be an int ≥ 2, got {ring!r}")
        streams = self.opts["copy_streams"]
        if streams not in (None, 1, 2):
            raise ValueError(f"copy_streams must be 1, 2 or None (tuned), got {streams!r}")
        chunk = self.opts["chunk_mib"]
        for name, v in (("chunk_mib", chunk), ("edge_mib", self.opts["edge_mib"])):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or
                                  v * 2**20 < self.spec.block_bytes):
                raise ValueError(f"{name}={v!r}: give a size in MiB of at least one block row "
                                 f"({self.spec.block_bytes} bytes)")
        edge = self.opts["edge_mib"]
        largest = max(max(self.CHUNKS_MIB) if chunk is None else chunk, max(self.EDGES_MIB) if edge is None else edge)
        rows = int(largest * 2**20) // self.spec.block_bytes
        E = self.spec.block_elems
        peer = self.dest.device
        self.rt, _ = _cudart_plain()
        self.stage_src = [torch.empty((rows, E), dtype=self.spec.dtype, device=self.src_device) for _ in range(ring)]
        self.stage_dst = [torch.empty((rows, E), dtype=self.spec.dtype, device=peer) for _ in range(ring)]
        self.copy_streams = [torch.cuda.Stream(device=self.src_device) for _ in range(2)]
        self.scatter_stream = torch.cuda.Stream(device=peer)
        self._gathered = [torch.cuda.Event() for _ in range(ring)]
        self._copied = [torch.cuda.Event() for _ in range(ring)]
        with torch.cuda.device(peer):
            self._scattered = [torch.cuda.Event() for _ in range(ring)]
        self._peer_arange = torch.arange(rows, dtype=torch.int64, device=peer)
        self.backend = "triton gather + copy engine + triton scatter"
        self.config.update(ring=ring)

    def _prepare(self, plan):
        sidx, _ = self._indices(plan)
        plan.extra["didx_peer"] = torch.from_numpy(plan.dst_rows).to(self.dest.device)
        n = min(plan.rows, self.stage_src[0].shape[0])
        key = (self.name, self.spec.block_bytes, "gather", str(self.src_device), n)
        plan.extra["cfg"] = _kernel_config(self, key, (plan.src_pool.rows, sidx[:n], self.stage_src[0], None))
        plan.extra["chunks"] = {}
        chunk, edge, streams = self.opts["chunk_mib"], self.opts["edge_mib"], self.opts["copy_streams"]
        tune = self.opts.get("tune")
        tune = self.cuda if tune is None else bool(tune)
        chunks = [chunk] if chunk is not None else (list(self.CHUNKS_MIB) if tune else [128])
        edges = [edge] if edge is not None else (list(self.EDGES_MIB) if tune else [32])
        stream_opts = [streams] if streams is not None else ([1, 2] if tune else [2])
        settings = [(c, e, k) for c in chunks for e in edges for k in stream_opts if e <= c]
        settings = settings or [(chunks[0], min(edges[0], chunks[0]), stream_opts[0])]
        trials = []
        for c, e, k in settings:
            self._use(plan, c, e, k)
            ms = host_ms = None
            if len(settings) > 1:
                ms, host_ms = self._time_send(plan)
            trials.append({"chunk_mib": c, "edge_mib": e, "copy_streams": k, "ms": ms, "host_issue_ms": host_ms,
                           "chunks": len(self._bounds(plan, 0, plan.rows))})
        best = min(trials, key=lambda t: t["ms"] if t["ms"] is not None else 0.0)
        self._use(plan, best["chunk_mib"], best["edge_mib"], best["copy_streams"])
        self.config.update(chunk_mib=best["chunk_mib"], edge_mib=best["edge_mib"], copy_streams=best["copy_streams"])
        if len(trials) > 1:
            self.config["pipeline_tuning"] = trials
            self._note(f"pipeline tuned on these tables: chunk {best['chunk_mib']} MiB, edges {best['edge_mib']} MiB, "
                       f"{best['copy_streams']} copy stream(s) ({len(trials)} settings, median of "
                       f"{self.opts.get('tune_repeats', 5)} sends each)")

    def _use(self, plan, chunk_mib, edge_mib, streams) -> None:
        rows = lambda mib: max(1, int(mib * 2**20) // self.spec.block_bytes)  # noqa: E731
        plan.extra.update(chunk_rows=rows(chunk_mib), edge_rows=min(rows(edge_mib), rows(chunk_mib)), streams=streams)

    def _bounds(self, plan, lo, hi):
        """The chunks of plan rows [lo, hi) with their index slices, made once per setting."""
        key = (lo, hi, plan.extra["chunk_rows"], plan.extra["edge_rows"])
        got = plan.extra["chunks"].get(key)
        if got is None:
            sidx, _ = self._indices(plan)
            didx = plan.extra["didx_peer"]
            got = [(b - a, sidx[a:b], didx[a:b], self._peer_arange[:b - a])
                   for a, b in chunk_bounds(lo, hi, plan.extra["chunk_rows"], plan.extra["edge_rows"])]
            plan.extra["chunks"][key] = got
        return got

    def _time_send(self, plan) -> tuple[float, float]:
        """(median ms, median host ms) of whole sends of this plan with the current settings, run the way
        send() runs them (send() itself would prepare the plan again); host ms = the Python time issuing one."""
        cur = torch.cuda.current_stream(self.src_device)
        done = torch.cuda.Event()
        host = []

        def run():
            t0 = time.perf_counter_ns()
            self._wait_for_destination()
            self.stream.wait_stream(cur)
            with torch.cuda.stream(self.stream):
                self._copy(plan, 0, plan.rows)
            done.record(self.stream)
            cur.wait_event(done)
            host.append((time.perf_counter_ns() - t0) / 1e6)

        n = self.opts.get("tune_repeats", 5)
        ms = sorted(timing.time_fn(run, n=n, warmup=1, device=self.src_device))[n // 2]
        return ms, sorted(host)[len(host) // 2]

    def _copy(self, plan, lo, hi):
        cfg = plan.extra["cfg"]
        n_streams = plan.extra["streams"]
        bounds = self._bounds(plan, lo, hi)
        src_rows, pool_rows = plan.src_pool.rows, self.pool.rows
        row_bytes = self.spec.block_bytes
        ring = len(self.stage_src)
        memcpy, kind = self.rt.cudaMemcpyAsync, self.rt.cudaMemcpyKind.cudaMemcpyDefault

        def gather(k):
            # 1. gather on the source GPU (the transport's stream), once the copy that last read the slot is done
            slot = k % ring
            self.stream.wait_event(self._copied[slot])
            kernels.launch_rows(src_rows, bounds[k][1], self.stage_src[slot], None, cfg)
            self._gathered[slot].record(self.stream)

        # gathers are issued one chunk ahead of their copies: the host's issue time (~0.2 ms a chunk in run
        # 20261130-144848-h200) then runs while the copy engine moves the chunk before, instead of leaving the
        # link idle until the next gather has been issued and run. Every event is recorded before a wait on it
        # is issued (gather k+1 waits for copy k+1-ring, issued earlier), so no wait binds to a stale record.
        if bounds:
            gather(0)
        for k, (n, s_idx, d_idx, p_idx) in enumerate(bounds):
            slot = k % ring
            stage0, stage1 = self.stage_src[slot], self.stage_dst[slot]
            if k + 1 < len(bounds):
                gather(k + 1)
            # 2. the copy engine moves chunk k to the peer's staging slot, once that slot's last scatter is done
            cs = self.copy_streams[k % n_streams]
            cs.wait_event(self._gathered[slot])
            cs.wait_event(self._scattered[slot])
            (err,) = memcpy(stage1.data_ptr(), stage0.data_ptr(), n * row_bytes, kind, cs.cuda_stream)
            if int(err) != 0:
                raise RuntimeError(f"cudaMemcpyAsync to {self.dest.device} failed: {err}")
            self._copied[slot].record(cs)
            # 3. the peer scatters it into its pool
            self.scatter_stream.wait_event(self._copied[slot])
            with torch.cuda.stream(self.scatter_stream):
                kernels.launch_rows(stage1, p_idx, pool_rows, d_idx, cfg)
            self._scattered[slot].record(self.scatter_stream)
        if bounds:
            self.stream.wait_event(self._scattered[(len(bounds) - 1) % ring])  # the send ends when the peer has it


def _cudart_plain():
    """(cuda-bindings' runtime module, None), or (None, why it cannot be had)."""
    try:
        from cuda.bindings import runtime as cudart
    except Exception:
        try:
            from cuda import cudart  # cuda-python < 12.6 layout
        except Exception:
            return None, "cuda-python (cuda-bindings) is not installed: pip install 'kvlab[cuda]'"
    return cudart, None


# -- 5. host: the kernel stores into mapped pinned memory ------------------------------------------


class MappedPinned(PagedTransport):
    """To pinned host memory with no staging and no copy engine: the Triton kernel's stores go straight
    to the page-locked pool through unified virtual addressing (the GPU writes over PCIe).

    Options: config / tune / tune_repeats.
    """

    name = "mapped-pinned"
    kinds = ("pinned",)
    needs_cuda = True
    options = {"config": None, "tune": None, "tune_repeats": 3}

    @classmethod
    def _unavailable_here(cls, src, dest):
        ok, why = kernels.triton_status(src)
        return None if ok else why

    def _prepare(self, plan):
        sidx, didx = self._indices(plan)
        n = min(plan.rows, _TUNE_ROWS)
        key = (self.name, self.spec.block_bytes, self.dest.kind, str(self.src_device), n)
        plan.extra["cfg"] = _kernel_config(self, key, (plan.src_pool.rows, sidx[:n], self.pool.rows, didx[:n]))

    def _copy(self, plan, lo, hi):
        sidx, didx = self._indices(plan)
        kernels.launch_rows(plan.src_pool.rows, sidx[lo:hi], self.pool.rows, didx[lo:hi], plan.extra["cfg"])


# -- 6. cudaMemcpyBatchAsync -------------------------------------------------------------------------


def _cudart():
    """(module, None) for cuda-bindings' runtime with cudaMemcpyBatchAsync, else (None, reason)."""
    cudart, why = _cudart_plain()
    if cudart is None:
        return None, why
    if not hasattr(cudart, "cudaMemcpyBatchAsync"):
        return None, "these cuda-bindings have no cudaMemcpyBatchAsync (it needs CUDA 12.8 or newer bindings)"
    err, runtime = cudart.cudaRuntimeGetVersion()
    if int(err) != 0:
        return None, f"cudaRuntimeGetVersion failed: {err}"
    err, driver = cudart.cudaDriverGetVersion()
    if int(err) != 0:
        return None, f"cudaDriverGetVersion failed: {err}"
    if runtime < 12080 or driver < 12080:
        return None, f"cudaMemcpyBatchAsync needs CUDA ≥ 12.8; runtime {runtime}, driver {driver}"
    return cudart, None


class CudaMemcpyBatch(PagedTransport):
    """All blocks in one cudaMemcpyBatchAsync call (one descriptor per block, stream-ordered source
    access), through cuda-bindings. The pointer arrays are computed with numpy per plan; the bindings
    take Python lists, so each call still converts 3 × R list entries (host time, in the measurement)."""

    name = "cuda-memcpy-batch"
    needs_cuda = True

    @classmethod
    def _unavailable_here(cls, src, dest):
        return _cudart()[1]

    def _setup(self):
        self.cudart, _ = _cudart()
        cudart = self.cudart
        attr = cudart.cudaMemcpyAttributes()
        attr.srcAccessOrder = cudart.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
        self._attrs = [attr]
        self.config.update(runtime=cudart.cudaRuntimeGetVersion()[1], driver=cudart.cudaDriverGetVersion()[1])

    def _prepare(self, plan):
        rb = np.uint64(self.spec.block_bytes)
        src = np.uint64(plan.src_pool.data.data_ptr()) + plan.src_rows.astype(np.uint64) * rb
        dst = np.uint64(self.pool.data.data_ptr()) + plan.dst_rows.astype(np.uint64) * rb
        plan.extra["batch"] = (dst.tolist(), src.tolist(), [int(rb)] * plan.rows)
        self.config["descriptors"] = plan.rows
        self._note(f"cudaMemcpyBatchAsync (runtime {self.config['runtime']}, driver {self.config['driver']}): "
                   f"{plan.rows:,} descriptors in one call; the bindings convert Python lists on every call")

    def _copy(self, plan, lo, hi):
        cudart = self.cudart
        dsts, srcs, sizes = plan.extra["batch"]
        if (lo, hi) != (0, plan.rows):
            dsts, srcs, sizes = dsts[lo:hi], srcs[lo:hi], sizes[lo:hi]
        res = cudart.cudaMemcpyBatchAsync(dsts, srcs, sizes, hi - lo, self._attrs, [0], 1, self.stream.cuda_stream)
        err = res[0]
        if err != cudart.cudaError_t.cudaSuccess:
            fail = res[1] if len(res) > 1 else None
            raise RuntimeError(f"cudaMemcpyBatchAsync failed: {err!r} (failed copy index {fail}) for {hi - lo} copies")


# -- 7. NIXL -----------------------------------------------------------------------------------------


def _nixl_version() -> str | None:
    from importlib import metadata

    for dist in ("nixl", "nixl-cu12", "nixl-cu13"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


_NIXL_AGENTS = itertools.count()


class NixlTransport(PagedTransport):
    """NIXL (UCX backend) writing the same descriptor list — one descriptor per block — from one agent
    (it registers the source pool) to a second agent in this process (it registers the destination pool),
    as a peer would: one prepared request (initialize_xfer), posted per send and polled to completion.

    Not stream-ordered: send() waits for the source GPU's queued work, posts, and returns once NIXL says
    DONE (the Landing is complete). Options: backend (default "UCX").
    """

    name = "nixl"
    stream_ordered = False
    options = {"backend": "UCX"}

    @classmethod
    def _unavailable_here(cls, src, dest):
        try:
            import nixl  # noqa: F401
            from nixl._api import nixl_agent  # noqa: F401
        except Exception as exc:
            return f"nixl is not installed or does not load ({type(exc).__name__}: {exc}): pip install 'kvlab[nixl]'"
        return None

    def _setup(self):
        from nixl._api import nixl_agent, nixl_agent_config

        k = next(_NIXL_AGENTS)
        backend = self.opts["backend"]
        conf = nixl_agent_config(backends=[backend])
        self.target_name = f"kvlab-dst-{k}"
        self.initiator = nixl_agent(f"kvlab-src-{k}", conf)
        self.target = nixl_agent(self.target_name, conf)
        self._dst_reg = self.target.register_memory(self.pool.data)
        self.initiator.add_remote_agent(self.target.get_agent_metadata())
        self._src_regs: dict = {}
        self._handles: list = []
        self._closed = False
        self.backend = f"nixl {backend}"
        self.config.update(nixl_version=_nixl_version(), backend=backend, agents=2, operation="WRITE",
                           dst_mem=self._mem(self.pool.device))

    @staticmethod
    def _mem(device: torch.device) -> str:
        return "VRAM" if device.type == "cuda" else "DRAM"

    def _descs(self, agent, pool: BlockPool, rows: np.ndarray):
        mem = self._mem(pool.device)
        dev = (pool.device.index or 0) if pool.device.type == "cuda" else 0
        rb = self.spec.block_bytes
        arr = np.empty((rows.size, 3), dtype=np.int64)
        arr[:, 0] = pool.data.data_ptr() + rows * rb
        arr[:, 1] = rb
        arr[:, 2] = dev
        try:
            descs = agent.get_xfer_descs(arr, mem)
        except (TypeError, ValueError, IndexError):
            descs = None
        if descs is None:  # older nixl: a list of (addr, len, dev) tuples only
            descs = agent.get_xfer_descs([tuple(r) for r in arr.tolist()], mem)
        if descs is None:
            raise RuntimeError(f"nixl get_xfer_descs returned None for {rows.size} {mem} descriptors")
        return descs

    def _prepare(self, plan):
        key = id(plan.src_pool)
        if key not in self._src_regs:
            self._src_regs[key] = (plan.src_pool, self.initiator.register_memory(plan.src_pool.data))
        local = self._descs(self.initiator, plan.src_pool, plan.src_rows)
        remote = self._descs(self.target, self.pool, plan.dst_rows)
        handle = self.initiator.initialize_xfer("WRITE", local, remote, self.target_name, b"")
        if not handle:
            raise RuntimeError("nixl initialize_xfer failed (no handle)")
        self._handles.append(handle)
        plan.extra["handle"] = handle
        self.config.update(descriptors=plan.rows, src_mem=self._mem(plan.src_pool.device))
        try:
            self.config["chosen_backend"] = self.initiator.query_xfer_backend(handle)
        except Exception:  # older nixl: no query; the configured backend is the only one
            self.config["chosen_backend"] = self.opts["backend"]
        c = self.config
        self._note(f"nixl {c['nixl_version']}, backend {c['chosen_backend']}, {plan.rows:,} descriptors "
                   f"({c['src_mem']}→{c['dst_mem']}), one prepared {c['operation']} request between 2 agents")

    def _copy(self, plan, lo, hi):
        if (lo, hi) != (0, plan.rows):
            raise ValueError("nixl transport sends whole plans only")
        agent, handle = self.initiator, plan.extra["handle"]
        state = agent.transfer(handle)
        while state == "PROC":
            state = agent.check_xfer_state(handle)
        if state != "DONE":
            raise RuntimeError(f"nixl transfer ended in state {state!r}")

    def send(self, src_pool, src_table, dst_table=None) -> Landing:
        plan = self.prepare(src_pool, src_table, dst_table)
        if self.cuda:
            torch.cuda.current_stream(self.src_device).synchronize()  # NIXL does not follow torch streams
        self._copy(plan, 0, plan.rows)
        return Landing(self.spec.layers)

    def close(self):
        if getattr(self, "_closed", True):  # never set up, or already closed
            return
        self._closed = True
        for h in self._handles:
            try:
                self.initiator.release_xfer_handle(h)
            except Exception:
                pass
        self._handles.clear()
        for _, reg in self._src_regs.values():
            self.initiator.deregister_memory(reg)
        self._src_regs.clear()
        self.target.deregister_memory(self._dst_reg)
        try:
            self.initiator.remove_remote_agent(self.target_name)
        except Exception:
            pass
        super().close()


# ---------------------------------------------------------------------------------------------------
# layer-wise sending from the hooks


class PagedLayerwiseSend:
    """Sends layer i's blocks as soon as the hook says they are final, on the transport's copy stream.

    Built by `transport.layerwise(src_pool, src_table, dst_table)`: the plan (index tensors, kernel
    config) is prepared here, before prefill, so a hook costs an event record, a stream wait and one
    kernel launch (triton) per layer. Use with kvlab.hooks.LayerHooks(model, on_kv_ready=send.on_layer,
    point="attention")
    and a prefill that writes into the source pool (paged_prefill_cache / prefill_into_pages).
    """

    def __init__(self, transport: PagedTransport, src_pool: BlockPool, src_table: BlockTable,
                 dst_table: BlockTable | None = None):
        self.t = transport
        self.plan = transport.prepare(src_pool, src_table, dst_table)
        self.layers = transport.spec.layers
        self.cuda = transport.cuda
        if self.cuda:
            self._ready = [torch.cuda.Event() for _ in range(self.layers)]
            self._done = [torch.cuda.Event(enable_timing=True) for _ in range(self.layers)]
        self._compute = None
        self.sent = 0

    def begin(self) -> "PagedLayerwiseSend":
        """Call right before prefill: captures the compute stream."""
        self.sent = 0
        if self.cuda:
            self._compute = torch.cuda.current_stream(self.t.src_device)
            self.t._wait_for_destination()
        return self

    def on_layer(self, i: int) -> None:
        """Layer i's K and V are final in the source pool (on the compute stream): send them."""
        lo, hi = self.plan.layer_range(i)
        self.sent += 1
        if not self.cuda:
            self.t._copy(self.plan, lo, hi)
            return
        self._ready[i].record(self._compute)
        stream = self.t.stream
        stream.wait_event(self._ready[i])
        torch.cuda.set_stream(stream)
        try:
            self.t._copy(self.plan, lo, hi)
        finally:
            torch.cuda.set_stream(self._compute)
        self._done[i].record(stream)

    def finish(self) -> Landing:
        """After prefill returns: the Landing (per-layer events; layers not landed yet are in flight)."""
        if self.sent != self.layers:
            raise RuntimeError(f"layer-wise paged send saw {self.sent} of {self.layers} layers: "
                               "were the hooks installed on every decoder layer?")
        if not self.cuda:
            return Landing(self.layers)
        return Landing(self.layers, list(self._done))


# ---------------------------------------------------------------------------------------------------
# registry

TRANSPORTS: dict[str, type[PagedTransport]] = {
    cls.name: cls for cls in (PerBlockCopy, TorchIndex, TritonCopy, ChunkedGatherD2H, ChunkedGatherPeer,
                              MappedPinned, CudaMemcpyBatch, NixlTransport)
}


def _transport_class(name: str) -> type[PagedTransport]:
    try:
        return TRANSPORTS[name]
    except KeyError:
        raise ValueError(f"unknown paged transport {name!r}; valid: {sorted(TRANSPORTS)}") from None


def unavailable(name: str, src_device: torch.device | str, dest) -> str | None:
    """None when transport `name` can run from `src_device` to `dest`; else why not."""
    return _transport_class(name).unavailable(src_device, dest)


def make_transport(name: str, spec: PoolSpec, dest, dst_blocks: int, src_device: torch.device | str = "cpu",
                   **options) -> PagedTransport:
    """Construct transport `name` (see TRANSPORTS) with its destination pool of `dst_blocks` blocks."""
    return _transport_class(name)(spec, dest, dst_blocks, src_device, **options)
