"""Reading a Hugging Face config.json for the KV-cache bill: which layers attend and which slide (layer_types,
transformers' own derivation where config.json leaves them implicit), whether a config is a hybrid kvlab refuses,
whether lm_head is tied, and the parameter count as transformers builds the model. Pure functions of a config dict;
kvlab.models turns their answers into a ModelSpec."""

from __future__ import annotations

import math
import reprlib
from collections.abc import Mapping
from typing import Any

__all__ = ["FIELD_NAMES", "first", "refuse_hybrid", "PATTERN_KEYS", "NATIVE_LAYER_KINDS", "with_layer_types",
           "transformers_layer_types", "sliding", "gated_mlp", "TIED_BY_DEFAULT", "tied", "param_count"]


# the names config.json families give the fields every spec needs
FIELD_NAMES: dict[str, tuple[str, ...]] = {
    "layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "heads": ("num_attention_heads", "n_head", "num_heads"),
    "vocab_size": ("vocab_size",),
}


def first(cfg: Mapping[str, Any], keys: tuple[str, ...]) -> Any:
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return None


def refuse_hybrid(cfg: Mapping[str, Any]) -> None:
    """Jamba-style configs name their attention layers by period and offset; the others are Mamba layers."""
    if cfg.get("attn_layer_period") is not None or cfg.get("attn_layer_offset") is not None:
        raise ValueError(f"{cfg.get('model_type', 'this')} config has attn_layer_period/attn_layer_offset: a hybrid "
                         "model whose other layers keep no KV cache; kvlab would count them all and overstate the "
                         "cache, so hybrid models are refused until they are modelled")


# Keys by which a config.json says which layers attend (and so keep a KV cache) without listing layer_types:
# sliding-window patterns (Gemma 3, Cohere 2, EXAONE 4), full-attention intervals (Qwen3-Next), and the hybrids'
# own markers (Jamba, Zamba2, Nemotron-H, RecurrentGemma, Bamba).
PATTERN_KEYS = ("sliding_window_pattern", "full_attention_interval", "attn_layer_period", "attn_layer_offset",
                 "layers_block_type", "hybrid_override_pattern", "block_types", "attn_layer_indices")

# Model types whose layer kinds kvlab reads from the config's own fields exactly as transformers does (sliding);
# any other type without layer_types asks transformers which layers are which.
NATIVE_LAYER_KINDS = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe",
                                 "gemma", "gemma2", "deepseek_v2", "deepseek_v3"})


def with_layer_types(cfg: dict, where: str) -> dict:
    """`cfg` with layer_types, derived as transformers derives them when config.json leaves them out (Gemma 3's
    sliding_window_pattern, Qwen3-Next's full_attention_interval, defaults included). A config that marks its layer
    kinds in a way neither kvlab nor transformers can read is refused: counting every layer as attention would
    misstate its cache."""
    if cfg.get("layer_types") is not None:
        return cfg
    marked = [k for k in PATTERN_KEYS if cfg.get(k) is not None]
    kind = cfg.get("model_type")
    if kind in NATIVE_LAYER_KINDS and not marked:
        return cfg
    derived = transformers_layer_types(cfg)
    if derived is not None:
        return {**cfg, "layer_types": derived}
    if marked:
        raise ValueError(f"model config ({where}): {', '.join(marked)} mark which layers attend, and transformers does "
                         f"not derive layer_types for model_type {kind!r}: a hybrid or patterned model whose other "
                         "layers keep a different cache or none; give layer_types (hybrid models are refused until "
                         "they are modelled)")
    return cfg


def transformers_layer_types(cfg: Mapping[str, Any]) -> list | None:
    """The layer_types transformers' own config class gives this config (None: it knows no such model type, cannot
    build the config, or derives none)."""
    import logging
    import warnings

    try:
        from transformers import AutoConfig
        from transformers.utils import logging as hf_logging
    except ImportError:
        return None
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            conf = AutoConfig.for_model(str(cfg.get("model_type")),
                                        **{k: v for k, v in cfg.items() if k != "model_type"})
    except Exception:  # an unknown model type, or values its config class rejects: kvlab's own rules apply
        return None
    finally:
        hf_logging.set_verbosity(level)
    types = getattr(conf, "layer_types", None)
    return [str(t) for t in types] if isinstance(types, (list, tuple)) else None


def sliding(cfg: Mapping[str, Any], layers: int) -> tuple[int | None, tuple[int, ...]]:
    """Which layers use a sliding window, and its length (tokens).

    Precedence, matching how transformers reads the same configs:
      1. ``layer_types``: layers marked ``"sliding_attention"``;
      2. Gemma-2 (no layer_types): even-indexed layers (0, 2, …) are sliding;
      3. Qwen2 semantics (``use_sliding_window`` present): only when it is true, layers with
         index ≥ ``max_window_layers`` slide;
      4. otherwise a non-null ``sliding_window`` applies to every layer (Mistral v0.1).
    """
    window = cfg.get("sliding_window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, (int, float))
                               or not math.isfinite(window) or window < 0 or int(window) != window):
        raise ValueError(f"sliding_window = {window!r}: a window is a whole number of tokens ≥ 0 (0 or null: none)")
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, (list, tuple)) or not all(isinstance(t, str) for t in layer_types):
            raise ValueError(f"layer_types = {reprlib.repr(layer_types)}: give a list of layer kinds such as "
                             "'full_attention', one per layer")
        if len(layer_types) != layers:
            raise ValueError(f"layer_types has {len(layer_types)} entries for {layers} layers")
        other = sorted({str(t) for t in layer_types} - {"full_attention", "sliding_attention"})
        hybrid = [t for t in other if any(k in t for k in ("linear", "mamba", "conv", "recurrent", "ssm"))]
        if hybrid:
            raise ValueError(f"layer_types holds {hybrid} layers: a hybrid model (linear-attention or state-space "
                             "layers keep no KV cache); kvlab counts every layer as an attention layer and would "
                             "overstate this cache, so hybrid models are refused until they are modelled")
        if other:
            raise ValueError(f"layer_types holds {other} layers; kvlab models full and sliding attention only, and "
                             "would misstate this cache")
        idx = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
        if idx and not window:
            raise ValueError("layer_types marks sliding_attention layers but sliding_window is "
                             f"{window!r}")
        return (int(window) if idx else None), idx
    if not window:
        return None, ()
    if cfg.get("model_type") == "gemma2":
        return int(window), tuple(range(0, layers, 2))
    if "use_sliding_window" in cfg:
        if not cfg["use_sliding_window"]:
            return None, ()
        first = cfg.get("max_window_layers", 0) or 0
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise ValueError(f"max_window_layers = {first!r}: give a whole number of layers ≥ 0")
        idx = tuple(range(first, layers))
        return (int(window) if idx else None), idx
    return int(window), tuple(range(layers))


def gated_mlp(hidden: int, inter: int, bias: bool = False) -> int:
    """gate, up (hidden→inter) and down (inter→hidden) projections of a SwiGLU/GeGLU MLP."""
    return 3 * hidden * inter + (2 * inter + hidden if bias else 0)


# Config classes disagree on whether lm_head shares the embedding matrix when config.json does
# not say: Gemma ties it, the Llama/Qwen2/Mistral/DeepSeek families do not.
TIED_BY_DEFAULT = {"gemma": True, "gemma2": True, "gemma3": True, "gemma3_text": True,
                    "llama": False, "qwen2": False, "qwen2_moe": False, "qwen3": False,
                    "mistral": False, "mixtral": False, "deepseek_v2": False,
                    "deepseek_v3": False}


def tied(cfg: Mapping[str, Any]) -> bool:
    """Whether lm_head reuses the embedding weights (missing key → the config class default)."""
    if cfg.get("tie_word_embeddings") is not None:
        return bool(cfg["tie_word_embeddings"])
    mt = cfg.get("model_type", "")
    if mt in TIED_BY_DEFAULT:
        return TIED_BY_DEFAULT[mt]
    try:  # an architecture kvlab does not know: ask transformers for its class default
        from transformers import AutoConfig

        return bool(AutoConfig.for_model(mt).tie_word_embeddings)
    except Exception:  # noqa: BLE001 - unknown to transformers too; untied is the common case
        return False


def param_count(cfg: Mapping[str, Any]) -> tuple[int, int]:
    """(total, active) parameter counts computed from a config dict, as transformers builds it.

    Counted: token embeddings; per layer the attention projections (with biases where the
    architecture has them: Qwen2's q/k/v, ``attention_bias``), the MLP (a gated MLP — every
    registry architecture uses one), MoE routers and experts (Mixtral ``num_local_experts``;
    DeepSeek ``n_routed_experts`` + ``n_shared_experts``, dense for the first
    ``first_k_dense_replace`` layers), RMSNorm weights (2 per layer, 4 for Gemma-2); the final
    norm; ``lm_head`` unless tied (``tie_word_embeddings``, or the config class's default when
    config.json leaves it out: Gemma ties). Not counted: buffers (rotary tables,
    DeepSeek's router score-correction bias) and DeepSeek's multi-token-prediction module.

    Active = total minus the routed experts a token does not visit (``experts - top_k`` per MoE
    layer), so for dense models active == total.
    """
    d = dict(cfg)
    mt = d.get("model_type", "")
    hidden = int(first(d, FIELD_NAMES["hidden_size"]))
    layers = int(first(d, FIELD_NAMES["layers"]))
    heads = int(first(d, FIELD_NAMES["heads"]))
    kv = int(d.get("num_key_value_heads") or heads)
    vocab = int(d["vocab_size"])
    inter = int(d.get("intermediate_size") or 0)

    # Attention.
    if d.get("kv_lora_rank") is not None:
        q_rank = d.get("q_lora_rank")
        nope, rope = int(d["qk_nope_head_dim"]), int(d["qk_rope_head_dim"])
        v_dim, kv_rank = int(d["v_head_dim"]), int(d["kv_lora_rank"])
        ab = bool(d.get("attention_bias", False))
        qk = nope + rope
        if q_rank:
            attn = hidden * q_rank + (q_rank if ab else 0) + q_rank + q_rank * heads * qk
        else:
            attn = hidden * heads * qk
        attn += hidden * (kv_rank + rope) + ((kv_rank + rope) if ab else 0)  # kv_a_proj_with_mqa
        attn += kv_rank  # kv_a_layernorm
        attn += kv_rank * heads * (nope + v_dim)  # kv_b_proj
        attn += heads * v_dim * hidden + (hidden if ab else 0)  # o_proj
    else:
        hd = int(d.get("head_dim") or hidden // heads)
        q_out, kv_out = heads * hd, kv * hd
        attn = hidden * q_out + 2 * hidden * kv_out + q_out * hidden
        if mt == "qwen2":
            attn += q_out + 2 * kv_out  # q/k/v carry a bias, o_proj does not
        elif d.get("attention_bias"):
            attn += q_out + 2 * kv_out + hidden

    # Feed-forward, per layer: (total, active).
    mlp_bias = bool(d.get("mlp_bias", False))
    ffn_total: list[int] = []
    ffn_active: list[int] = []
    if mt == "mixtral" or d.get("num_local_experts"):
        # MixtralConfig's defaults (8 experts, top-2) apply when config.json leaves them out.
        e = int(d.get("num_local_experts") or 8)
        k = int(d.get("num_experts_per_tok") or 2)
        expert = gated_mlp(hidden, inter)
        for _ in range(layers):
            ffn_total.append(e * expert + e * hidden)  # experts + router (no bias)
            ffn_active.append(k * expert + e * hidden)
    elif d.get("n_routed_experts"):
        e, k = int(d["n_routed_experts"]), int(d.get("num_experts_per_tok") or 0)
        shared = int(d.get("n_shared_experts") or 0)
        moe_inter = int(d["moe_intermediate_size"])
        first_dense = int(d.get("first_k_dense_replace") or 0)
        expert = gated_mlp(hidden, moe_inter)
        for i in range(layers):
            if i < first_dense:
                ffn_total.append(gated_mlp(hidden, inter))
                ffn_active.append(ffn_total[-1])
            else:
                common = gated_mlp(hidden, moe_inter * shared) + e * hidden  # shared + router
                ffn_total.append(common + e * expert)
                ffn_active.append(common + k * expert)
    else:
        ffn_total = [gated_mlp(hidden, inter, mlp_bias)] * layers
        ffn_active = ffn_total

    norms = (4 if mt in ("gemma2", "gemma3", "gemma3_text") else 2) * hidden
    embed = vocab * hidden
    head = 0 if tied(d) else vocab * hidden
    fixed = embed + head + hidden + layers * (attn + norms)
    return fixed + sum(ffn_total), fixed + sum(ffn_active)
