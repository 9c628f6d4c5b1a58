"""Paged KV caches and the transports that move them.

    pools.py              block pools, block tables, allocators, HF-cache glue, byte-exact verification (the
                          names below are its own, handed on here)
    transports.py         the paged transport interface and per-block-copy, torch-index, cuda-memcpy-batch
    triton_transports.py  the Triton kernel's transports (triton, chunked-gather-d2h, chunked-gather-peer,
                          mapped-pinned)
    nixl.py               NIXL as a paged transport
    kernels.py            the Triton row-copy kernel, its torch reference and tuner
    registry.py           every transport by name: make_transport, transports, unavailable
"""

from .pools import LAYOUTS, BlockAllocator, BlockPool, BlockTable, PoolSpec, positive_int, verify_transfer
from .prefill import paged_prefill_cache, prefill_into_pages

__all__ = ["LAYOUTS", "PoolSpec", "BlockTable", "BlockAllocator", "BlockPool", "paged_prefill_cache",
           "prefill_into_pages", "verify_transfer", "positive_int"]
