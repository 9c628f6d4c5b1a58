"""The paged transports by name: `make_transport(name, ...)`, `transports()`, `unavailable(name, ...)`.

Each transport is a class (kvlab.paged.transports: per-block-copy, torch-index, cuda-memcpy-batch;
kvlab.paged.triton_transports: triton, chunked-gather-d2h, chunked-gather-peer, mapped-pinned; kvlab.paged.nixl:
nixl); this module gathers them, so the modules that define them need not know each other.
"""

from __future__ import annotations

import torch

from .nixl import NixlTransport
from .pools import PoolSpec
from .transports import CudaMemcpyBatch, PagedTransport, PerBlockCopy, TorchIndex
from .triton_transports import ChunkedGatherD2H, ChunkedGatherPeer, MappedPinned, TritonCopy

__all__ = ["transports", "transport_class", "unavailable", "make_transport", "TRANSPORTS"]


def transports() -> dict[str, type[PagedTransport]]:
    """Every paged transport by name."""
    return {cls.name: cls for cls in (PerBlockCopy, TorchIndex, TritonCopy, ChunkedGatherD2H, ChunkedGatherPeer,
                                      MappedPinned, CudaMemcpyBatch, NixlTransport)}


def transport_class(name: str) -> type[PagedTransport]:
    known = transports()
    try:
        return known[name]
    except KeyError:
        raise ValueError(f"unknown paged transport {name!r}; valid: {sorted(known)}") from None


def unavailable(name: str, src_device: torch.device | str, dest) -> str | None:
    """None when transport `name` can run from `src_device` to `dest`; else why not."""
    return transport_class(name).unavailable(src_device, dest)


def make_transport(name: str, spec: PoolSpec, dest, dst_blocks: int, src_device: torch.device | str = "cpu",
                   **options) -> PagedTransport:
    """Construct transport `name` (see transports()) with its destination pool of `dst_blocks` blocks."""
    return transport_class(name)(spec, dest, dst_blocks, src_device, **options)


# every transport by name, as a module attribute
TRANSPORTS = transports()
