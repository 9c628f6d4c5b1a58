"""Paged KV caches: block pools, block tables, allocators, conversion to and from HF caches, verification.

Serving engines keep the KV cache in fixed-size blocks (pages) of `block_size` tokens, scattered over a
preallocated pool; a sequence owns a block table (its block ids in token order). A 32k-token Qwen2.5-7B
cache in 16-token blocks is 28 layers × (K, V) × 2048 blocks = 114,688 blocks of 16 KiB.

Pool storage (one tensor per pool, K and V side by side):

    layout "nhd" (vLLM-like):  data [layers, 2, num_blocks, block_size, kv_heads, head_dim]
    layout "hnd" (heads first): data [layers, 2, num_blocks, kv_heads, block_size, head_dim]

In both layouts one block of one layer's K (or V) is `block_bytes` contiguous bytes, so the pool is also
a 2-D tensor of rows, `pool.rows` = [layers · 2 · num_blocks, block_elems], with

    row(layer, side, block) = (layer · 2 + side) · num_blocks + block        (side 0 = K, 1 = V)

Transports that move blocks between pools live in kvlab.paged.transports (the interface, per-block-copy,
torch-index, cuda-memcpy-batch), kvlab.paged.triton_transports (the Triton kernel's transports: triton,
chunked-gather-d2h, chunked-gather-peer, mapped-pinned) and kvlab.paged.nixl; kvlab.paged.registry builds any of
them by name (`make_transport(name, ...)`).
Bad input (block ids out of range, duplicate ids, length / dtype / layout mismatch) raises ValueError before
anything is written.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..kvcache import KVBuffer, KVLayout, as_dtype
from ..landing import TransferError

__all__ = ["LAYOUTS", "PoolSpec", "BlockTable", "BlockAllocator", "BlockPool", "paged_prefill_cache",
           "prefill_into_pages", "verify_transfer", "positive_int", "indexable", "check_layout"]

LAYOUTS = ("nhd", "hnd")
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_FLOAT8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
                if hasattr(torch, n))


def indexable(t: torch.Tensor) -> torch.Tensor:
    """`t`, or for a float8 tensor a uint8 view of the same bytes: torch has no index_copy_ (nor normal_) kernel
    for the float8 dtypes, and moving bytes needs none of their arithmetic."""
    return t.view(torch.uint8) if t.dtype in _FLOAT8 else t


def check_layout(value, name: str = "layout") -> None:
    """ValueError (one line, naming `name`) unless `value` is a pool layout of LAYOUTS."""
    if value not in LAYOUTS:
        raise ValueError(f"{name} = {value!r} is not a pool layout; give one of {', '.join(LAYOUTS)}")


def positive_int(name: str, value) -> int:
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
            positive_int(f"PoolSpec.{name}", getattr(self, name))
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
        return -(-positive_int("tokens", tokens) // self.block_size)

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

    __slots__ = ("ids", "tokens", "block_size", "_tensors", "__weakref__")

    def __init__(self, block_ids, tokens: int, block_size: int):
        tokens = positive_int("tokens", tokens)
        block_size = positive_int("block_size", block_size)
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
        n = -(-positive_int("tokens", tokens) // positive_int("block_size", block_size))
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
        self.num_blocks = positive_int("num_blocks", num_blocks)
        self.block_size = positive_int("block_size", block_size)
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
        n = -(-positive_int("tokens", tokens) // self.block_size)
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
        self.num_blocks = positive_int("num_blocks", num_blocks)
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
        self._sends: list = []  # (destination block ids, Landing) of recent sends into this pool
        self._owners: dict = {}  # block id → weakref of the BlockTable (the live sequence) holding it
        self.owner_epoch = 0  # changes whenever a block changes owner (transports re-check their claims then)
        self._written: np.ndarray | None = None  # per block, written since made or poisoned (track_writes())

    def track_writes(self) -> "BlockPool":
        """From now on reads refuse blocks that nothing has written since the pool was made or last poisoned (a
        transport's destination pool: a block no send reached holds poison, not a cache)."""
        self._written = np.zeros(self.num_blocks, dtype=bool)
        return self

    def _wrote(self, block_ids) -> None:
        if self._written is not None:
            self._written[np.asarray(block_ids, dtype=np.int64)] = True

    # -- transfer states and ownership --------------------------------------------------------------
    def expect(self, block_ids, landing) -> None:
        """A send (its kvlab.landing.Landing) is writing `block_ids`: reads of them wait on its fate."""
        ids = np.asarray(block_ids, dtype=np.int64)
        self._wrote(ids)
        # a send into the very same blocks replaces the last record cheaply (repeated sends of one plan); otherwise
        # a send that landed (or was waited for) and is now fully covered by this one needs no record
        if self._sends and self._sends[-1][0] is ids:
            self._sends[-1] = (ids, landing)
            return
        self._sends = [(b, lnd) for b, lnd in self._sends
                       if not (lnd.state == "landed" or lnd.waited) or not np.isin(b, ids).all()]
        self._sends.append((ids, landing))

    def require_landed(self, table: "BlockTable") -> None:
        """TransferError when a send into any of `table`'s blocks failed, was aborted or is still in flight
        (unwaited): the blocks would be read half written."""

        left = np.asarray(table.ids)
        if self._written is not None and not self._written[left].all():
            never = left[~self._written[left]]
            raise TransferError(f"blocks {never[:8].tolist()}{'…' if never.size > 8 else ''} ({never.size} of "
                                f"{left.size}) have not been written since the pool was made or poisoned: nothing "
                                "was sent to them, they hold poison")
        for ids, landing in reversed(self._sends):  # per block, the newest send that wrote it decides
            hit = np.intersect1d(ids, left)
            if not hit.size:
                continue
            landing.check()
            if landing.state != "landed" and not landing.waited:
                raise TransferError(f"{landing.name()} into blocks {hit[:8].tolist()}{'…' if hit.size > 8 else ''} "
                                    "is still in flight: wait for its landing before reading them")
            left = np.setdiff1d(left, hit)
            if not left.size:
                return

    def check_unowned(self, block_ids, what: str) -> None:
        """ValueError when a live sequence holds any of `block_ids` (`what` would overwrite it)."""
        if not self._owners:
            return
        taken = [int(b) for b in np.asarray(block_ids).tolist()
                 if (o := self._owners.get(int(b))) is not None and o() is not None]
        if taken:
            raise ValueError(f"{what} would overwrite blocks {taken[:8]}{'…' if len(taken) > 8 else ''} "
                             f"({len(taken)} of {len(block_ids)}), which hold a live sequence of this pool: release it "
                             "(pool.release(table)) or send into a table of free blocks")

    def claim(self, table: "BlockTable") -> None:
        """Hold `table`'s blocks for its sequence; ValueError when another live sequence holds any of them (a send
        would overwrite it). A table that is garbage or was released frees its blocks."""
        import weakref

        taken = [int(b) for b in table.ids if (o := self._owners.get(int(b))) is not None
                 and (t := o()) is not None and t is not table]
        if taken:
            raise ValueError(f"blocks {taken[:8]}{'…' if len(taken) > 8 else ''} ({len(taken)} of {table.num_blocks}) "
                             "hold another live sequence of this pool: release it (pool.release(table)) or take "
                             "blocks from a BlockAllocator")
        ref = weakref.ref(table)
        changed = False
        for b in table.ids:
            o = self._owners.get(int(b))
            if o is None or o() is not table:
                self._owners[int(b)] = ref
                changed = True
        if changed:
            self.owner_epoch += 1

    def release(self, table: "BlockTable") -> None:
        """Give `table`'s blocks back (their sequence is done)."""
        for b in table.ids:
            o = self._owners.get(int(b))
            if o is not None and o() is table:
                del self._owners[int(b)]
        self.owner_epoch += 1

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
        if self._written is not None:
            self._written[:] = False
        return self

    def fill_random(self, seed: int = 0) -> "BlockPool":
        """Standard-normal values from a seeded generator, layer by layer (no full-size float32 temporary); a
        float8 pool draws each layer in bfloat16 and rounds it to its dtype (torch has no float8 normal_)."""
        gen = torch.Generator(device=self.device).manual_seed(seed)
        for layer in range(self.spec.layers):
            if self.spec.dtype in _FLOAT8:
                self.data[layer].copy_(torch.empty(self.data[layer].shape, dtype=torch.bfloat16,
                                                   device=self.device).normal_(generator=gen))
            else:
                self.data[layer].normal_(generator=gen)
        if self._written is not None:
            self._written[:] = True
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
        self.claim(table)  # refused if another live sequence holds any of the blocks
        x = buffer.data[:, :, 0].to(self.device)
        pages = self._to_pages(x, table.num_blocks)
        indexable(self.data).index_copy_(2, table.tensor(self.device), indexable(pages))
        self._wrote(table.ids)

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
        pages = self._to_pages(x, table.num_blocks)
        indexable(self.data[layer]).index_copy_(1, table.tensor(self.device), indexable(pages))
        self._wrote(table.ids)

    def read(self, table: BlockTable, device: torch.device | str | None = None) -> KVBuffer:
        """The table's blocks as a new contiguous KVBuffer on `device` (default: the pool's device); refused
        (kvlab.landing.TransferError) while a send into them has failed, was aborted or is in flight."""
        self.check_table(table, "block table")
        self.require_landed(table)
        s = self.spec
        pages = self.data.index_select(2, table.tensor(self.device))
        layout = KVLayout(s.layers, 1, s.kv_heads, table.tokens, s.head_dim, s.dtype)
        out = KVBuffer(layout, device=self.device if device is None else device)
        out.data[:, :, 0].copy_(self._from_pages(pages, table.tokens))
        return out

    def blocks(self, table: BlockTable) -> torch.Tensor:
        """A copy of the table's blocks: [layers, 2, n, *block_shape]."""
        self.check_table(table, "block table")
        self.require_landed(table)
        return self.data.index_select(2, table.tensor(self.device))

    def to_hf_cache(self, table: BlockTable, device: torch.device | str | None = None):
        """A transformers DynamicCache for decode, holding the table's tokens (rebuilt contiguous)."""
        return self.read(table, device).as_hf_cache(filled=True)

    def write_hf_cache(self, cache, table: BlockTable) -> None:
        """Store a transformers cache (per-layer .keys/.values [1, kv_heads, tokens, head_dim]) into blocks."""
        self.write(KVBuffer.from_hf_cache(cache), table)


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
