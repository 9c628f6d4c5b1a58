"""Reading a Hugging Face config.json for the KV-cache bill: which layers attend and which slide (layer_types,
transformers' own derivation where config.json leaves them implicit), which layers of a hybrid keep a fixed state
instead and its shape, whether lm_head is tied, and the parameter count as transformers builds the model. Pure
functions of a config dict; kvlab.models turns their answers into a ModelSpec."""

from __future__ import annotations

import functools
import json
import math
import reprlib
from collections.abc import Mapping
from typing import Any

__all__ = ["FIELD_NAMES", "first", "STATE_KINDS", "STATE_MODEL_TYPES", "state_layout", "PATTERN_KEYS", "NATIVE_LAYER_KINDS", "with_layer_types",
           "transformers_layer_types", "sliding", "gated_mlp", "TIED_BY_DEFAULT", "tied", "param_count", "COUNTED_BY_TRANSFORMERS",
           "transformers_param_count"]


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


# The layer kinds (transformers' layer_types names) that keep a fixed state per sequence instead of a KV cache,
# and the hybrids whose state kvlab can shape (state_layout): Gated DeltaNet (Qwen3-Next), Mamba (Jamba), Mamba-2
# (Bamba). transformers 5 names all three "linear_attention".
STATE_KINDS = ("linear_attention", "mamba", "mamba2")
STATE_MODEL_TYPES = ("qwen3_next", "jamba", "bamba")


def _with_defaults(cfg: Mapping[str, Any]) -> dict:
    """`cfg` over the defaults of transformers' config class for its model type (the values the model is built
    with when config.json leaves a field out)."""
    given = {k: v for k, v in cfg.items() if k != "layer_types"}  # derived already; some classes reject it
    conf = _transformers_config(json.dumps(given, sort_keys=True, default=str))
    return {**(conf.to_dict() if conf is not None else {}), **cfg}


def state_layout(cfg: Mapping[str, Any], layers: int, where: str) -> tuple[tuple[int, ...], tuple[int, ...],
                                                                              tuple[int, ...]]:
    """(state layers, conv-state shape, recurrent-state shape) of a hybrid whose ``layer_types`` (as
    ``with_layer_types`` gives them) mark linear-attention or state-space layers; three empty tuples otherwise.

    Shapes are per layer and sequence, as transformers' cache holds them (``LinearAttentionLayer``):
      * qwen3_next (Gated DeltaNet): conv ``(2·key_heads·key_dim + value_heads·value_dim, conv_kernel)``,
        recurrent ``(value_heads, key_dim, value_dim)``;
      * jamba (Mamba): with ``inner = mamba_expand · hidden_size``, conv ``(inner, mamba_d_conv)``, recurrent
        ``(inner, mamba_d_state)``;
      * bamba (Mamba-2): conv ``(inner + 2·mamba_n_groups·mamba_d_state, mamba_d_conv)``, recurrent
        ``(mamba_n_heads, mamba_d_head, mamba_d_state)``.
    Another model type with such layers is refused: kvlab would have to guess its state."""
    types = cfg.get("layer_types") or ()
    idx = tuple(i for i, t in enumerate(types) if t in STATE_KINDS)
    if not idx:
        return (), (), ()
    kind = cfg.get("model_type")
    if kind not in STATE_MODEL_TYPES:
        raise ValueError(f"model config ({where}): a hybrid model ({len(idx)} of {layers} layers keep a recurrent "
                         f"state, not KV) of model_type {kind!r}; kvlab knows the state of "
                         f"{', '.join(STATE_MODEL_TYPES)} only and would misstate this one")
    c = _with_defaults(cfg)

    def n(key: str) -> int:
        v = c.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or int(v) != v or v < 1:
            raise ValueError(f"model config ({where}): {key}={v!r} must be a positive integer (it shapes the "
                             "state a hybrid's linear layers keep)")
        return int(v)

    if kind == "qwen3_next":
        key, value = n("linear_num_key_heads") * n("linear_key_head_dim"), \
            n("linear_num_value_heads") * n("linear_value_head_dim")
        conv = (2 * key + value, n("linear_conv_kernel_dim"))
        rec = (n("linear_num_value_heads"), n("linear_key_head_dim"), n("linear_value_head_dim"))
    elif kind == "jamba":
        inner = n("mamba_expand") * n("hidden_size")
        conv, rec = (inner, n("mamba_d_conv")), (inner, n("mamba_d_state"))
    else:  # bamba
        inner = n("mamba_expand") * n("hidden_size")
        conv = (inner + 2 * n("mamba_n_groups") * n("mamba_d_state"), n("mamba_d_conv"))
        rec = (n("mamba_n_heads"), n("mamba_d_head"), n("mamba_d_state"))
    return idx, conv, rec


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
                         "layers keep a different cache or none; give layer_types (kvlab models the hybrids "
                         f"{', '.join(STATE_MODEL_TYPES)})")
    return cfg


@functools.lru_cache(maxsize=256)
def _transformers_config(cfg_json: str):
    """transformers' own config object for a config (given as JSON, so answers can be cached: a config class is
    slow to build), or None: transformers is absent, knows no such model type, or rejects the values."""
    import logging
    import warnings

    cfg = json.loads(cfg_json)
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
            return AutoConfig.for_model(str(cfg.get("model_type")),
                                        **{k: v for k, v in cfg.items() if k != "model_type"})
    except Exception:  # an unknown model type, or values its config class rejects: kvlab's own rules apply
        return None
    finally:
        hf_logging.set_verbosity(level)


def transformers_layer_types(cfg: Mapping[str, Any]) -> list | None:
    """The layer_types transformers' own config class gives this config (None: it knows no such model type, cannot
    build the config, or derives none)."""
    conf = _transformers_config(json.dumps(cfg, sort_keys=True, default=str))
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
        # state layers (STATE_KINDS) keep no window; state_layout shapes them
        other = sorted({str(t) for t in layer_types} - {"full_attention", "sliding_attention", *STATE_KINDS})
        hybrid = [t for t in other if any(k in t for k in ("linear", "mamba", "conv", "recurrent", "ssm"))]
        if hybrid:
            raise ValueError(f"layer_types holds {hybrid} layers: a hybrid model whose layers of that kind keep a "
                             f"state kvlab does not know (it knows {', '.join(STATE_KINDS)}), and would misstate "
                             "this cache")
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


# Model types whose layers kvlab's own count does not cover (linear-attention and state-space mixers, experts with
# biases and sinks): transformers builds the model on the meta device and its parameters are counted
COUNTED_BY_TRANSFORMERS = (*STATE_MODEL_TYPES, "gpt_oss")


@functools.lru_cache(maxsize=64)
def _meta_count(cfg_json: str) -> tuple[int, int]:
    import torch
    from transformers import AutoModelForCausalLM

    conf = _transformers_config(cfg_json)
    if conf is None:
        cfg = json.loads(cfg_json)
        raise ValueError(f"transformers cannot build a {cfg.get('model_type')!r} config from these values, so kvlab "
                         "cannot count its parameters")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(conf)
    experts = int(first(vars(conf), ("num_experts", "num_local_experts")) or 0)
    top_k = int(getattr(conf, "num_experts_per_tok", 0) or 0)
    total = routed = 0
    for name, t in model.named_parameters():
        total += t.numel()
        if experts and ".experts." in name and t.dim() and t.shape[0] == experts:  # fused routed experts
            routed += t.numel()
    return total, total - (routed * (experts - top_k) // experts if experts else 0)


def transformers_param_count(cfg: Mapping[str, Any]) -> tuple[int, int]:
    """(total, active) parameters of the model transformers builds from `cfg` (on the meta device: no memory):
    active leaves out the routed experts a token does not visit (``experts − top_k`` of each fused expert tensor)."""
    return _meta_count(json.dumps(dict(cfg), sort_keys=True, default=str))


def param_count(cfg: Mapping[str, Any]) -> tuple[int, int]:
    """(total, active) parameter counts computed from a config dict, as transformers builds it. The model types in
    ``COUNTED_BY_TRANSFORMERS`` are counted by transformers itself (``transformers_param_count``); the rest by the
    arithmetic below.

    Counted: token embeddings; per layer the attention projections (with biases where the
    architecture has them: Qwen2's q/k/v, ``attention_bias``), the MLP (a gated MLP — every
    registry architecture uses one), MoE routers and experts (Mixtral ``num_local_experts``;
    DeepSeek ``n_routed_experts`` + ``n_shared_experts``, dense for the first
    ``first_k_dense_replace`` layers), RMSNorm weights (2 per layer, 4 for Gemma-2 and -3, and Gemma-3's and
    Qwen3's per-head q and k norms); the final
    norm; ``lm_head`` unless tied (``tie_word_embeddings``, or the config class's default when
    config.json leaves it out: Gemma ties). Not counted: buffers (rotary tables,
    DeepSeek's router score-correction bias) and DeepSeek's multi-token-prediction module.

    Active = total minus the routed experts a token does not visit (``experts - top_k`` per MoE
    layer), so for dense models active == total.
    """
    d = dict(cfg)
    mt = d.get("model_type", "")
    if mt in COUNTED_BY_TRANSFORMERS:
        return transformers_param_count(d)
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
        if mt in ("gemma3", "gemma3_text", "qwen3", "qwen3_moe"):
            attn += 2 * hd  # q_norm and k_norm: an RMSNorm over each head's width
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
