"""Prefill straight into pages: a transformers cache whose prefill writes each layer's K and V into a block pool as
attention computes them, so the pages are final layer by layer (what layer-wise sending of a paged cache reads)."""

from __future__ import annotations

import torch

from ..steps import cache_kw
from .pools import BlockPool, BlockTable

__all__ = ["paged_prefill_cache", "prefill_into_pages"]


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
    pool.claim(table)  # the prefill writes these blocks: refused if another live sequence holds any of them
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

    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] != table.tokens:
        raise ValueError(f"input_ids must be [1, {table.tokens}] for this block table, got {tuple(input_ids.shape)}")
    cache = paged_prefill_cache(pool, table)
    out = model(input_ids=input_ids, **{cache_kw(model): cache}, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1]
