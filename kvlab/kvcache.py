"""One contiguous KV buffer per sequence, and the glue that lets a transformers model prefill into it.

Why one buffer: transformers' DynamicCache keeps one K and one V tensor per layer, so moving a 28-layer
cache is 56 copies, each with its own fixed cost (seed 004 measured about 18 µs each over NVLink, which
is why its 32k copy reached 330 of 395 GB/s). Here the cache is a single tensor

    data: [layers, 2, batch, kv_heads, tokens, head_dim]   (index 0 of dim 1 = K, 1 = V)

and each layer's K and V are views into it. Prefill writes straight into those views, so the whole
cache moves in one copy (bulk) or one copy per layer (layer-wise: K and V of a layer are adjacent).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["KVLayout", "KVBuffer", "ArenaLayer", "layout_for"]

_DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    # FP8 pools (kvlab.paged): e4m3, the format serving engines keep KV in
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "e4m3": torch.float8_e4m3fn,
}


def as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """Accept a torch dtype or a short name ("bf16", "fp16", "fp32", "fp8" for e4m3)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"unknown KV dtype {dtype!r}; valid: {sorted(_DTYPES)} or a torch.dtype") from None


@dataclass(frozen=True)
class KVLayout:
    """Shape of one sequence's KV cache.

    layers × (K, V) × batch × kv_heads × tokens × head_dim elements of `dtype`.
    """

    layers: int
    batch: int
    kv_heads: int
    tokens: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self):
        for name in ("layers", "batch", "kv_heads", "tokens", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        object.__setattr__(self, "dtype", as_dtype(self.dtype))

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.layers, 2, self.batch, self.kv_heads, self.tokens, self.head_dim)

    @property
    def element_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_layer(self) -> int:
        """Bytes of one layer's K and V together."""
        return 2 * self.batch * self.kv_heads * self.tokens * self.head_dim * self.element_bytes

    @property
    def nbytes(self) -> int:
        """Bytes of the whole cache (all layers, K and V)."""
        return self.layers * self.bytes_per_layer

    def with_tokens(self, tokens: int) -> "KVLayout":
        return KVLayout(self.layers, self.batch, self.kv_heads, tokens, self.head_dim, self.dtype)


def layout_for(model_or_config, tokens: int, batch: int = 1, dtype: torch.dtype | str | None = None) -> KVLayout:
    """The KVLayout a transformers model (or its config) produces for `tokens` prompt tokens."""
    config = getattr(model_or_config, "config", model_or_config)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    if dtype is None:
        dtype = getattr(model_or_config, "dtype", None) or torch.bfloat16
    return KVLayout(text.num_hidden_layers, batch, kv_heads, tokens, head_dim, as_dtype(dtype))


class KVBuffer:
    """One contiguous KV cache on one device (GPU, pinned host or pageable host memory).

    `data` has shape `layout.shape` = [layers, 2, batch, kv_heads, tokens, head_dim].
    """

    def __init__(self, layout: KVLayout, device: torch.device | str = "cpu", pin_memory: bool = False,
                 data: torch.Tensor | None = None):
        self.layout = layout
        if data is None:
            device = torch.device(device)
            if pin_memory and device.type != "cpu":
                raise ValueError(f"pin_memory=True needs a host buffer, got device {device}")
            data = torch.empty(layout.shape, dtype=layout.dtype, device=device,
                               pin_memory=pin_memory and torch.cuda.is_available())
        elif tuple(data.shape) != layout.shape or data.dtype != layout.dtype or not data.is_contiguous():
            raise ValueError(f"data must be a contiguous {layout.dtype} tensor of shape {layout.shape}, "
                             f"got {data.dtype} {tuple(data.shape)} contiguous={data.is_contiguous()}")
        self.data = data
        # a transfer destination's guard (kvlab.transfer.Transport.readable): asked before a decode reads the
        # buffer, so a cache whose send failed, was aborted or is not the latest is refused, not decoded
        self.guard = None

    @classmethod
    def from_hf_cache(cls, cache, layout: KVLayout | None = None) -> "KVBuffer":
        """Copy a transformers cache (any per-layer .keys/.values) into a new contiguous buffer."""
        layers = cache.layers
        k0 = layers[0].keys
        if layout is None:
            b, h, t, d = k0.shape
            layout = KVLayout(len(layers), b, h, t, d, k0.dtype)
        buf = cls(layout, device=k0.device)
        for i, layer in enumerate(layers):
            buf.data[i, 0].copy_(layer.keys)
            buf.data[i, 1].copy_(layer.values)
        return buf

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    @property
    def is_pinned(self) -> bool:
        return self.data.device.type == "cpu" and self.data.is_pinned()

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of layer i, each a view [batch, kv_heads, tokens, head_dim]."""
        return self.data[i, 0], self.data[i, 1]

    def layer_block(self, i: int) -> torch.Tensor:
        """Layer i's K and V as one contiguous view [2, batch, kv_heads, tokens, head_dim]."""
        return self.data[i]

    def poison(self) -> "KVBuffer":
        """Fill with NaN, so any byte a transport failed to write shows up in the decode check."""
        self.data.fill_(float("nan"))
        return self

    def count_poison(self) -> int:
        """How many elements are still NaN (0 after a complete transfer of finite values). Counted 16 M elements at
        a time: a sum of the whole mask at once makes an int64 copy of it, 4× the bf16 cache (7 GiB for 32k tokens
        of Qwen2.5-7B, which ran a capped decode process out of memory on the H200, run 20261201-071033)."""
        flat = self.data.reshape(-1)
        total = torch.zeros((), dtype=torch.int64, device=flat.device)
        for part in flat.split(1 << 24):
            total += torch.isnan(part).sum()
        return int(total.item())

    def as_hf_cache(self, filled: bool = True, on_write=None):
        """A transformers DynamicCache whose layers are views into this buffer.

        filled=False: an empty cache for prefill; each layer's first update writes its K and V into the
        buffer (the prompt must have exactly `layout.tokens` tokens). filled=True: a cache that already
        holds the buffer's tokens, for decode. Decode steps append by concatenation into new tensors, so
        the buffer itself is never modified after prefill.
        on_write: optional callable(i), called once layer i's prefill K and V writes are queued on the
        current stream (kvlab.hooks.LayerHooks(point="cache").cache_callback): the earliest moment a copy
        queued behind it on that stream reads final bytes.
        """
        from transformers import DynamicCache

        if filled and self.guard is not None:
            self.guard()
        cache = DynamicCache()
        cache.layers.clear()
        for i in range(self.layout.layers):
            k, v = self.layer(i)
            cache.layers.append(ArenaLayer(k, v, filled=filled, on_write=on_write, index=i))
        return cache


def _arena_layer_class():
    from transformers.cache_utils import DynamicLayer

    class _ArenaLayer(DynamicLayer):
        """A DynamicLayer whose first (prefill) update lands in preallocated views."""

        def __init__(self, k_view: torch.Tensor, v_view: torch.Tensor, filled: bool, on_write=None, index=0):
            super().__init__()
            self._k_view, self._v_view = k_view, v_view
            self._on_write, self._index = on_write, index
            if filled:
                self.device = k_view.device
                self.keys, self.values = k_view, v_view
                self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            if self.is_initialized:
                return super().update(key_states, value_states, *args, **kwargs)
            n = key_states.shape[-2]
            if key_states.shape != self._k_view.shape:
                raise ValueError(
                    f"prefill of {n} tokens with K shape {tuple(key_states.shape)} does not fit the KV buffer "
                    f"{tuple(self._k_view.shape)}: allocate the buffer for exactly the prompt length")
            self._k_view.copy_(key_states)
            self._v_view.copy_(value_states)
            if self._on_write is not None:
                self._on_write(self._index)
            self.device = key_states.device
            self.keys, self.values = self._k_view, self._v_view
            self.is_initialized = True
            return self.keys, self.values

    return _ArenaLayer


_ARENA_LAYER = None


def ArenaLayer(k_view: torch.Tensor, v_view: torch.Tensor, filled: bool = True, on_write=None, index: int = 0):
    """Build an arena-backed cache layer (class created lazily so importing kvlab stays light)."""
    global _ARENA_LAYER
    if _ARENA_LAYER is None:
        _ARENA_LAYER = _arena_layer_class()
    return _ARENA_LAYER(k_view, v_view, filled, on_write, index)

