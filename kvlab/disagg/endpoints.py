"""Both ends of the data path between the two processes, whatever the backend: which bytes a unit is on the prefill
side (`Source`), where they land on the decode side (`Sink`), and a paged cache's rows (`Rows`).

A request's cache crosses in *units*: one unit of every layer (bulk) or one unit per layer (layer-wise,
`units`). A paged cache travels as rows (one row = one block of one layer's K or V; kvlab.paged's row numbering).
"""

from __future__ import annotations

import numpy as np
import torch

from ..kvcache import KVBuffer
from ..paged import BlockPool, kernels
from ..paged.pools import indexable

__all__ = ["layer_rows", "Rows", "Source", "Sink", "span", "units", "flip_first_byte"]


def layer_rows(num_blocks: int, block_ids: list[int], layer: int) -> list[int]:
    """Row numbers, in the `.rows` view of a pool of `num_blocks` blocks, of one layer's K then V blocks, in
    table order."""
    return [(layer * 2 + side) * num_blocks + b for side in (0, 1) for b in block_ids]

class Rows:
    """Row indices of a paged cache: per layer and for all layers (in layer order), on a device."""

    def __init__(self, layers: int, num_blocks: int, block_ids: list[int], device):
        bad = [b for b in block_ids if not 0 <= int(b) < num_blocks]
        if bad:  # checked here, on the host, once: the row kernel that uses these rows does not check
            raise ValueError(f"block ids {bad[:8]} are outside a pool of {num_blocks} blocks (valid 0…{num_blocks - 1})")
        per = [layer_rows(num_blocks, block_ids, i) for i in range(layers)]
        self.top = max((max(p) for p in per if len(p)), default=-1)  # the highest row named, known on the host
        self.host = [np.asarray(p, dtype=np.int64) for p in per]  # the same rows on the host (NIXL's descriptors)
        dev = torch.device(device)
        self.layer = [torch.tensor(p, dtype=torch.int64, device=dev) for p in per]
        self.all = torch.cat(self.layer)
        self.per_layer = len(per[0])

    def of(self, unit: tuple[int, ...]) -> torch.Tensor:
        return self.all if len(unit) == len(self.layer) else self.layer[unit[0]]

    def to(self, device) -> "Rows":
        """The same rows, their index tensors on `device`."""
        out = object.__new__(Rows)
        out.top, out.host, out.per_layer = self.top, self.host, self.per_layer
        out.layer = [t.to(device) for t in self.layer]
        out.all = torch.cat(out.layer)
        return out

    @classmethod
    def for_pool(cls, pool: BlockPool, block_ids) -> "Rows":
        return cls(pool.spec.layers, pool.num_blocks, list(block_ids), pool.device)

    @classmethod
    def for_ids(cls, layers: int, num_blocks: int, block_ids, device) -> "Rows":
        return cls(layers, num_blocks, list(block_ids), device)

class Source:
    """The prefill side's cache: a KVBuffer (contiguous) or a pool and its table's block ids (paged). `wire`: a
    kvlab.disagg.wire_codec.WireCodec when the cache crosses as FP8 with its scales (contiguous only), else None."""

    def __init__(self, buffer: KVBuffer | None = None, pool: BlockPool | None = None, block_ids=None, wire=None):
        if wire is not None and buffer is None:
            raise ValueError("an FP8 wire moves a contiguous cache; a paged pool crosses as it is")
        self.buffer, self.pool, self.wire = buffer, pool, wire
        self.layers = buffer.layout.layers if buffer is not None else pool.spec.layers
        self.rows = Rows.for_pool(pool, block_ids) if pool is not None else None
        self.device = buffer.device if buffer is not None else pool.device
        self._offsets = None  # an FP8 wire: where each layer's wire bytes begin (WireCodec.offsets)
        self._wire_out = None  # an FP8 wire: its bytes in a tensor of their own (wire_out), made on first use

    @property
    def paged(self) -> bool:
        return self.pool is not None

    def wire_span(self, unit: tuple[int, ...]) -> tuple[int, int]:
        """An FP8 wire: the byte range of `unit`'s wire bytes within the whole cache's (where a one-sided write —
        ipc, nixl — puts them in the decode side's staging tensor)."""
        if self._offsets is None:
            self._offsets = self.wire.offsets(self.buffer.data)
        return self._offsets[unit[0]], self._offsets[unit[-1] + 1]

    @property
    def wire_out(self) -> torch.Tensor:
        """An FP8 wire: a uint8 tensor on the source's device that holds the whole cache's wire bytes, made once
        (a write that needs its bytes in registered memory, nixl, sends from here)."""
        if self._wire_out is None:
            self._wire_out = torch.empty(self.wire_span(tuple(range(self.layers)))[1], dtype=torch.uint8,
                                         device=self.device)
        return self._wire_out

    def truth(self, unit: tuple[int, ...]) -> torch.Tensor:
        """What the decode side must hold for `unit` once it has landed (a layer-wise checksum's input): the unit's
        own bytes, or with an FP8 wire what dequantizing its wire bytes gives (a new bf16 tensor)."""
        if self.wire is None:
            return self.view(unit)
        out = self.buffer.data[unit[0]:unit[-1] + 1].clone()  # a unit is a run of layers (units())
        self.wire.roundtrip(out)
        return out if len(unit) > 1 else out[0]

    def truth_nbytes(self, unit: tuple[int, ...]) -> int:
        """The bytes of `truth(unit)`, counted without making it."""
        if self.wire is None:
            return self.nbytes(unit)
        return sum(self.buffer.data[i].nbytes for i in unit)

    def view(self, unit: tuple[int, ...]) -> torch.Tensor:
        """The unit's bytes as one contiguous tensor (paged: gathered rows, a new tensor; an FP8 wire: its e4m3
        bytes and scales, kvlab.disagg.wire_codec, a new uint8 tensor)."""
        if self.wire is not None:
            return self.wire.encode_layers(self.buffer.data, unit)
        if not self.paged:
            return self.buffer.data if len(unit) == self.layers else self.buffer.data[unit[0]]
        rows = self.rows.of(unit)
        if self.pool.rows.device.type != "cuda":
            return self.pool.rows.index_select(0, rows)
        out = torch.empty((len(rows), self.pool.rows.shape[1]), dtype=self.pool.rows.dtype, device=self.pool.rows.device)
        kernels.copy_rows(self.pool.rows, rows, out, check_bounds=False)  # Triton gather; rows checked in Rows
        return out

    def nbytes(self, unit: tuple[int, ...]) -> int:
        if self.wire is not None:
            return sum(self.wire.layer_bytes(self.buffer.data[i]) for i in unit)
        if not self.paged:
            return self.view(unit).nbytes
        return len(self.rows.of(unit)) * self.pool.rows.shape[1] * self.pool.rows.element_size()

class Sink:
    """The decode side's destination: a KVBuffer, or a pool and the block ids this request owns there. `wire`: the
    WireCodec whose bytes land here (received into a staging tensor, dequantized into the buffer by `settle`)."""

    def __init__(self, buffer: KVBuffer | None = None, pool: BlockPool | None = None, block_ids=None, wire=None):
        if wire is not None and buffer is None:
            raise ValueError("an FP8 wire lands in a contiguous cache; a paged pool receives rows as they are")
        self.buffer, self.pool, self.wire = buffer, pool, wire
        self.layers = buffer.layout.layers if buffer is not None else pool.spec.layers
        self.block_ids = list(block_ids) if block_ids is not None else None
        self.rows = Rows.for_pool(pool, self.block_ids) if pool is not None else None
        self.device = buffer.device if buffer is not None else pool.device
        self._staging = None
        self._arange = None  # 0 … rows − 1 on the device: the staging tensor's rows, for the scatter

    @property
    def paged(self) -> bool:
        return self.pool is not None

    @property
    def staged(self) -> bool:
        """Does a received unit land in a staging tensor that `settle` must put in place (paged, an FP8 wire)?"""
        return self.paged or self.wire is not None

    @property
    def tensor(self) -> torch.Tensor:
        """What is shared with the prefill process (ipc, nixl): the whole destination — with an FP8 wire, the
        staging tensor its wire bytes land in (settle dequantizes them into the buffer)."""
        if self.wire is not None:
            return self.landing_view(tuple(range(self.layers)))
        return self.buffer.data if not self.paged else self.pool.data

    def poison(self) -> None:
        """Poison the destination — and an FP8 wire's staging tensor too (0xFF: NaN as an e4m3 code and as a float32
        scale), so a unit whose bytes this request did not write cannot dequantize the previous request's identical
        bytes into a cache that passes."""
        if self.paged:
            self.pool.poison()
        else:
            self.buffer.poison()
        if self.wire is not None and self._staging is not None:
            self._staging.fill_(0xFF)

    def landing_view(self, unit: tuple[int, ...], host: bool = False) -> torch.Tensor:
        """Where a received unit is written: the buffer itself (contiguous), else a staging tensor that
        `settle(unit)` scatters into the pool (an FP8 wire: uint8 wire bytes `settle` dequantizes). host=True: a host
        tensor (gloo with a GPU destination)."""
        if self.wire is not None:
            return self._wire_view(unit, host)
        if not self.paged and not host:
            return self.buffer.data if len(unit) == self.layers else self.buffer.data[unit[0]]
        if self._staging is None or self._staging.device.type != ("cpu" if host else self.device.type):
            shape = (self.layers * self.rows.per_layer, self.pool.rows.shape[1]) if self.paged else tuple(self.buffer.data.shape)
            dtype = self.pool.data.dtype if self.paged else self.buffer.data.dtype
            self._staging = torch.empty(shape, dtype=dtype, device="cpu" if host else self.device,
                                        pin_memory=host and torch.cuda.is_available())
        if len(unit) == self.layers:
            return self._staging
        if self.paged:
            n = self.rows.per_layer
            return self._staging[unit[0] * n:(unit[0] + 1) * n]
        return self._staging[unit[0]]

    def _wire_view(self, unit: tuple[int, ...], host: bool) -> torch.Tensor:
        """The slice of a uint8 staging tensor (every layer's wire bytes, in order) where `unit`'s wire bytes land."""
        data = self.buffer.data
        if self._staging is None or self._staging.device.type != ("cpu" if host else self.device.type):
            self._offsets = self.wire.offsets(data)
            self._staging = torch.empty(self._offsets[-1], dtype=torch.uint8, device="cpu" if host else self.device,
                                        pin_memory=host and torch.cuda.is_available())
        return self._staging[self._offsets[unit[0]]:self._offsets[unit[-1] + 1]]

    def settle(self, unit: tuple[int, ...], staged: torch.Tensor | None) -> None:
        """Put a unit received into `staged` (a landing_view) where decode reads it."""
        if self.wire is not None:
            self.wire.decode_layers(staged.to(self.device, non_blocking=True), self.buffer.data, unit)
            return
        if self.paged:
            staged, rows = staged.to(self.device, non_blocking=True), self.rows.of(unit)
            if self.device.type != "cuda":
                indexable(self.pool.rows).index_copy_(0, rows, indexable(staged))  # float8 as its bytes
                return
            if self._arange is None or len(self._arange) < len(rows):
                self._arange = torch.arange(self.layers * self.rows.per_layer, device=self.device)
            # Triton scatter; the pool's rows were checked in Rows
            kernels.copy_rows(staged, self._arange[:len(rows)], self.pool.rows, rows, check_bounds=False)
        elif staged is not None:
            dst = self.buffer.data if len(unit) == self.layers else self.buffer.data[unit[0]]
            dst.copy_(staged, non_blocking=True)

def span(unit) -> str:
    """A unit's layers as text: "3" or "0…27"."""
    return f"{unit[0]}" if len(unit) == 1 else f"{unit[0]}…{unit[-1]}"

def units(mode: str, layers: int) -> list[tuple[int, ...]]:
    """A request's units: one of every layer (bulk) or one per layer (layer-wise)."""
    return [tuple(range(layers))] if mode == "bulk" else [(i,) for i in range(layers)]

def flip_first_byte(t: torch.Tensor) -> torch.Tensor:
    """Flip every bit of the first byte of `t` (in place; contiguous), as a corrupted wire would."""
    b = t.view(-1).view(torch.uint8)
    b[:1].bitwise_not_()
    return t
