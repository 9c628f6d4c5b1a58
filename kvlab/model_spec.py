"""The shape of one decoder-only model as far as its cache and prefill cost go: :class:`ModelSpec`, a frozen
dataclass of counts (no torch, no transformers). kvlab.models reads configs into it; kvlab.calculator does the
arithmetic. Hybrid models are specs too: ``state_layers`` keep a fixed state per sequence (a convolution window and a
recurrent state) instead of a KV cache, so the KV fields describe the attention layers only."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["ModelSpec", "ATTENTION_KINDS", "MLA_MODEL_TYPES", "MAX_LAYERS"]


ATTENTION_KINDS = ("mha", "gqa", "mqa", "mla")
# model_type values whose attention is always MLA (transformers' DeepSeek-V2 and -V3 configs)
MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
# The deepest decoders published have a few hundred layers; a config asking for more than this is a typo, and
# what reads it (transformers' config classes among them) builds a list per layer, which at 2**40 layers takes
# every byte of memory before anything can refuse it.
MAX_LAYERS = 10_000


@dataclass(frozen=True)
class ModelSpec:
    """The shape of one decoder-only model, as far as KV cache and prefill cost are concerned.

    Fields (all counts are plain ints):
        name: registry name (e.g. ``"llama-3.1-8b"``) or the config's ``_name_or_path``.
        architecture: Hugging Face ``model_type`` (``"llama"``, ``"qwen2"``, ``"deepseek_v3"`` …).
        layers: decoder layers. Each keeps a KV cache, except the ``state_layers`` of a hybrid.
        hidden_size: residual-stream width, elements.
        heads: query heads per layer.
        kv_heads: key/value heads per layer as the config states them. For MLA this is the number
            of heads the latent is expanded into; the cache itself holds one latent vector.
        head_dim: elements per query/key head. For MLA: ``qk_nope_head_dim + qk_rope_head_dim``
            (the width a query is dotted with); :attr:`v_head_dim` gives the value width.
        intermediate_size: MLP inner width of a dense layer, elements.
        vocab_size: tokens in the vocabulary.
        params: total parameters (embeddings, every expert, lm_head unless tied).
        active_params: parameters a single token passes through (MoE: shared + top-k routed
            experts); equal to ``params`` for dense models. Prefill FLOPs use this.
        attention: ``"mha"`` (kv_heads == heads), ``"gqa"``, ``"mqa"`` (one KV head) or ``"mla"``
            (multi-head latent attention: a compressed latent is cached instead of K and V).
        kv_lora_rank: MLA latent width, elements (``None`` unless MLA).
        qk_rope_head_dim: MLA decoupled RoPE key width, elements, cached next to the latent.
        sliding_window: window length in tokens for the layers in ``sliding_layers``.
        sliding_layers: indices (0-based) of layers that keep only the last ``sliding_window``
            tokens; empty when every layer attends to the whole context.
        state_layers: indices (0-based) of a hybrid's linear-attention or state-space layers: each keeps a fixed
            state per sequence instead of a KV cache; empty for a transformer.
        conv_state: per state layer and sequence, the shape of its convolution window (channels, kernel).
        recurrent_state: per state layer and sequence, the shape of its recurrent state (for Gated DeltaNet
            value heads × key width × value width; for Mamba channels × state size; for Mamba-2 heads × head
            width × state size).
        max_positions: ``max_position_embeddings`` (tokens).
        source: where the numbers came from (config URL, how params were obtained).
        hf_config: the config.json values as a plain dict; enough to rebuild the model with
            ``transformers`` (``AutoConfig.for_model(**hf_config)``). Excluded from equality and
            hashing; treat it as read-only.
    """

    name: str
    architecture: str
    layers: int
    hidden_size: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    params: int
    active_params: int
    attention: str
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    state_layers: tuple[int, ...] = ()
    conv_state: tuple[int, ...] = ()
    recurrent_state: tuple[int, ...] = ()
    max_positions: int | None = None
    source: str = ""
    hf_config: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"attention={self.attention!r} is not one of {ATTENTION_KINDS}")
        for fname in ("layers", "hidden_size", "heads", "kv_heads", "head_dim", "vocab_size"):
            value = getattr(self, fname)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelSpec {fname}={value!r}: must be a positive int")
        if self.layers > MAX_LAYERS:
            raise ValueError(f"ModelSpec layers={self.layers}: at most {MAX_LAYERS:,} decoder layers")
        if self.kv_heads > self.heads:
            raise ValueError(f"ModelSpec kv_heads={self.kv_heads} > heads={self.heads}: a layer cannot have more KV "
                             "heads than query heads")
        if self.heads % self.kv_heads:
            raise ValueError(f"ModelSpec kv_heads={self.kv_heads} must divide heads={self.heads} (each KV head serves "
                             "a whole group of query heads)")
        for fname in ("intermediate_size", "params", "active_params", "max_positions", "kv_lora_rank",
                      "qk_rope_head_dim", "sliding_window"):
            value = getattr(self, fname)
            if value is None or (fname in ("qk_rope_head_dim", "sliding_window") and value == 0):
                continue  # not given (a window or a RoPE width of 0 means none)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelSpec {fname}={value!r}: must be a positive int (or None)")
        if self.active_params > self.params:
            raise ValueError(f"ModelSpec active_params={self.active_params} > params={self.params}: a token cannot "
                             "pass through more parameters than the model has")
        if self.attention == "mla" and not (self.kv_lora_rank
                                            and self.qk_rope_head_dim is not None):
            raise ValueError("attention='mla' needs kv_lora_rank and qk_rope_head_dim")
        implied = "mha" if self.kv_heads == self.heads else ("mqa" if self.kv_heads == 1 else "gqa")
        if self.attention != "mla" and self.attention != implied:
            raise ValueError(f"ModelSpec attention={self.attention!r} but kv_heads={self.kv_heads} of heads="
                             f"{self.heads} is {implied!r}")
        odd = [i for i in self.sliding_layers if not isinstance(i, int) or isinstance(i, bool)]
        if odd:
            raise ValueError(f"sliding_layers {odd} are not layer indices (ints)")
        bad = [i for i in self.sliding_layers if not 0 <= i < self.layers]
        if bad:
            raise ValueError(f"sliding_layers {bad} are outside 0..{self.layers - 1}")
        if self.sliding_layers and not self.sliding_window:
            raise ValueError("sliding_layers given without a sliding_window")
        for fname in ("state_layers", "conv_state", "recurrent_state"):
            odd = [i for i in getattr(self, fname) if not isinstance(i, int) or isinstance(i, bool) or i < 0]
            if odd:
                raise ValueError(f"ModelSpec {fname} {odd}: give whole numbers ≥ 0")
        bad = [i for i in self.state_layers if i >= self.layers]
        if bad:
            raise ValueError(f"state_layers {bad} are outside 0..{self.layers - 1}")
        if len(set(self.state_layers)) == self.layers:
            raise ValueError("every layer is a state layer: kvlab models hybrids, which keep at least one attention "
                             "layer (a pure state-space model has no KV cache to bill)")
        both = sorted(set(self.state_layers) & set(self.sliding_layers))
        if both:
            raise ValueError(f"layers {both} are both sliding-attention and state layers")
        if bool(self.state_layers) != bool(self.conv_state or self.recurrent_state):
            raise ValueError("state_layers and a conv_state or recurrent_state shape go together")
        # Coerce to sorted tuples so two specs built from a list and a tuple compare equal.
        object.__setattr__(self, "sliding_layers", tuple(sorted(set(self.sliding_layers))))
        object.__setattr__(self, "state_layers", tuple(sorted(set(self.state_layers))))
        object.__setattr__(self, "conv_state", tuple(self.conv_state))
        object.__setattr__(self, "recurrent_state", tuple(self.recurrent_state))

    # ---- derived shapes -------------------------------------------------------------------

    @property
    def is_hybrid(self) -> bool:
        """True when some layers keep a fixed state per sequence instead of a KV cache."""
        return bool(self.state_layers)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Indices of the layers that keep a KV cache (all of them unless the model is a hybrid)."""
        state = set(self.state_layers)
        return tuple(i for i in range(self.layers) if i not in state)

    def require_kv_only(self, what: str = "kvlab's transfers") -> None:
        """Refuse a hybrid where kvlab moves or builds KV layer by layer: its state layers hold no K and V."""
        if self.state_layers:
            raise ValueError(f"{self.name} is a hybrid: {len(self.state_layers)} of its {self.layers} layers keep a "
                             f"recurrent state, not KV; {what} move attention KV only (the calculator bills both: "
                             f"kvlab calc {self.name})")

    @property
    def is_moe(self) -> bool:
        """True when some layers route tokens to a subset of experts (active < total params)."""
        return self.active_params < self.params

    @property
    def v_head_dim(self) -> int:
        """Elements per value head (MLA may differ from the query/key width)."""
        if self.attention == "mla":
            return int(self.hf_config.get("v_head_dim") or self.head_dim)
        return self.head_dim

    @property
    def kv_elements_per_token_layer(self) -> int:
        """Cached elements for one token in one layer.

        ``2 · kv_heads · head_dim`` (a K and a V vector per KV head); for MLA
        ``kv_lora_rank + qk_rope_head_dim`` (one compressed latent plus the shared RoPE key).
        """
        if self.attention == "mla":
            return int(self.kv_lora_rank) + int(self.qk_rope_head_dim)
        return 2 * self.kv_heads * self.head_dim

    def kv_shape(self, tokens: int = 1, batch: int = 1) -> tuple[int, ...]:
        """Shape of a whole contiguous KV buffer in kvlab's layout, ignoring sliding windows.

        Standard attention: ``[layers, 2, batch, kv_heads, tokens, head_dim]`` (K = index 0, V = 1),
        the layout of ``kvcache.KVBuffer``. MLA: ``[layers, 1, batch, 1, tokens, kv_lora_rank +
        qk_rope_head_dim]`` (one latent vector per token). A hybrid is refused (``require_kv_only``): the buffer
        has a K and V for every layer.
        """
        self.require_kv_only("kvlab's contiguous KV buffers")
        if self.attention == "mla":
            return (self.layers, 1, batch, 1, tokens, self.kv_elements_per_token_layer)
        return (self.layers, 2, batch, self.kv_heads, tokens, self.head_dim)

    def is_sliding(self, layer: int) -> bool:
        """Whether layer ``layer`` (0-based) keeps only the last ``sliding_window`` tokens."""
        return layer in self.sliding_layers

    def summary(self) -> dict[str, Any]:
        """A flat dict for tables: counts as ints, parameters in billions (``_b`` columns)."""
        if self.attention == "mla":
            kv = f"{self.layers} × latent {self.kv_lora_rank}+{self.qk_rope_head_dim}"
        else:
            kv = f"{len(self.attention_layers)} × {self.kv_heads} × {self.head_dim}"
        if self.state_layers:
            kv += f" + {len(self.state_layers)} state layers"
        return {
            "model": self.name,
            "architecture": self.architecture,
            "attention": self.attention,
            "layers": self.layers,
            "hidden_size": self.hidden_size,
            "heads": self.heads,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "kv_layout": kv,
            "params_b": self.params / 1e9,
            "active_params_b": self.active_params / 1e9,
            "sliding_window": self.sliding_window,
            "sliding_layers": len(self.sliding_layers),
            "state_layers": len(self.state_layers),
            "max_positions": self.max_positions,
        }
