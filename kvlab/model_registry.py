"""The published model configs kvlab knows by name: each entry is the model's own Hugging Face config.json
(as published, minus fields kvlab does not use), where it came from, and the parameter count its page
states. Pure data; kvlab.models turns an entry into a ModelSpec through the same code path as any config.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

__all__ = ["REGISTRY", "HF_CONFIG_URL", "norm_name", "alias_table", "names", "aliases", "registry_source"]

# Each entry is the published config.json of the model (fields that do not change the model's shape, such as
# token ids, are kept as published so the dict can rebuild the model; DeepSeek-V3's fp8
# ``quantization_config`` and ``auto_map`` are left out because kvlab builds it in bf16 with transformers' own
# class). ``published`` is the parameter count shown on the model's Hugging Face page (from its safetensors)
# or, for DeepSeek-V3, stated in its paper; it is used only to cross-check the count computed from the config
# (tests compare them, within 1 %).


HF_CONFIG_URL = "https://huggingface.co/{}/blob/main/config.json"


_LLAMA2_COMMON = {
    "architectures": ["LlamaForCausalLM"],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 4096,
    "model_type": "llama",
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
    "vocab_size": 32000,
}


_LLAMA31_COMMON = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}


_QWEN25_COMMON = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 131072,
    "model_type": "qwen2",
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_mrope": False,
    "use_sliding_window": False,
    "vocab_size": 152064,
}


REGISTRY: dict[str, dict[str, Any]] = {
    "llama-2-7b": {
        "repo": "meta-llama/Llama-2-7b-hf",
        "config": {**_LLAMA2_COMMON, "hidden_size": 4096, "intermediate_size": 11008,
                   "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32},
        "published": {"params": 6.74e9},
        "aliases": ["llama2-7b", "llama-2-7b-hf", "llama-2-7b-chat", "llama-2-7b-chat-hf"],
    },
    "llama-2-70b": {
        "repo": "meta-llama/Llama-2-70b-hf",
        "config": {**_LLAMA2_COMMON, "hidden_size": 8192, "intermediate_size": 28672,
                   "num_attention_heads": 64, "num_hidden_layers": 80, "num_key_value_heads": 8},
        "published": {"params": 68.98e9},
        "aliases": ["llama2-70b", "llama-2-70b-hf", "llama-2-70b-chat", "llama-2-70b-chat-hf"],
    },
    "llama-3.1-8b": {
        "repo": "meta-llama/Llama-3.1-8B",
        "config": {**_LLAMA31_COMMON, "hidden_size": 4096, "intermediate_size": 14336,
                   "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8},
        "published": {"params": 8.03e9},
        "aliases": ["llama3.1-8b", "llama-3.1-8b-instruct", "meta-llama-3.1-8b",
                    "meta-llama-3.1-8b-instruct"],
    },
    "llama-3.1-70b": {
        "repo": "meta-llama/Llama-3.1-70B",
        "config": {**_LLAMA31_COMMON, "hidden_size": 8192, "intermediate_size": 28672,
                   "num_attention_heads": 64, "num_hidden_layers": 80, "num_key_value_heads": 8},
        "published": {"params": 70.6e9},
        "aliases": ["llama3.1-70b", "llama-3.1-70b-instruct", "meta-llama-3.1-70b",
                    "meta-llama-3.1-70b-instruct"],
    },
    "llama-3.1-405b": {
        "repo": "meta-llama/Llama-3.1-405B",
        "config": {**_LLAMA31_COMMON, "hidden_size": 16384, "intermediate_size": 53248,
                   "num_attention_heads": 128, "num_hidden_layers": 126, "num_key_value_heads": 8},
        "published": {"params": 405.9e9},
        "aliases": ["llama3.1-405b", "llama-3.1-405b-instruct", "meta-llama-3.1-405b",
                    "meta-llama-3.1-405b-instruct"],
    },
    "qwen2.5-7b": {
        "repo": "Qwen/Qwen2.5-7B",
        "config": {**_QWEN25_COMMON, "hidden_size": 3584, "intermediate_size": 18944,
                   "max_window_layers": 28, "num_attention_heads": 28, "num_hidden_layers": 28,
                   "num_key_value_heads": 4},
        "published": {"params": 7.62e9},
        "aliases": ["qwen2.5-7b-instruct", "qwen25-7b"],
    },
    "qwen2.5-72b": {
        "repo": "Qwen/Qwen2.5-72B",
        "config": {**_QWEN25_COMMON, "hidden_size": 8192, "intermediate_size": 29568,
                   "max_window_layers": 80, "num_attention_heads": 64, "num_hidden_layers": 80,
                   "num_key_value_heads": 8},
        "published": {"params": 72.7e9},
        "aliases": ["qwen2.5-72b-instruct", "qwen25-72b"],
    },
    "mistral-7b": {
        # v0.1: its 4096-token sliding window applies to every layer (v0.2/v0.3 dropped it).
        "repo": "mistralai/Mistral-7B-v0.1",
        "config": {
            "architectures": ["MistralForCausalLM"],
            "bos_token_id": 1,
            "eos_token_id": 2,
            "hidden_act": "silu",
            "hidden_size": 4096,
            "initializer_range": 0.02,
            "intermediate_size": 14336,
            "max_position_embeddings": 32768,
            "model_type": "mistral",
            "num_attention_heads": 32,
            "num_hidden_layers": 32,
            "num_key_value_heads": 8,
            "rms_norm_eps": 1e-05,
            "rope_theta": 10000.0,
            "sliding_window": 4096,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "vocab_size": 32000,
        },
        "published": {"params": 7.24e9},
        "aliases": ["mistral-7b-v0.1", "mistral-7b-instruct-v0.1"],
    },
    "mixtral-8x7b": {
        "repo": "mistralai/Mixtral-8x7B-v0.1",
        "config": {
            "architectures": ["MixtralForCausalLM"],
            "attention_dropout": 0.0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "hidden_act": "silu",
            "hidden_size": 4096,
            "initializer_range": 0.02,
            "intermediate_size": 14336,
            "max_position_embeddings": 32768,
            "model_type": "mixtral",
            "num_attention_heads": 32,
            "num_experts_per_tok": 2,
            "num_hidden_layers": 32,
            "num_key_value_heads": 8,
            "num_local_experts": 8,
            "output_router_logits": False,
            "rms_norm_eps": 1e-05,
            "rope_theta": 1000000.0,
            "router_aux_loss_coef": 0.02,
            "sliding_window": None,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "vocab_size": 32000,
        },
        "published": {"params": 46.7e9, "active_params": 12.9e9},
        "aliases": ["mixtral-8x7b-v0.1", "mixtral-8x7b-instruct-v0.1"],
    },
    "deepseek-v3": {
        "repo": "deepseek-ai/DeepSeek-V3",
        "config": {
            "architectures": ["DeepseekV3ForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": 0,
            "eos_token_id": 1,
            "ep_size": 1,
            "first_k_dense_replace": 3,
            "hidden_act": "silu",
            "hidden_size": 7168,
            "initializer_range": 0.02,
            "intermediate_size": 18432,
            "kv_lora_rank": 512,
            "max_position_embeddings": 163840,
            "model_type": "deepseek_v3",
            "moe_intermediate_size": 2048,
            "moe_layer_freq": 1,
            "n_group": 8,
            "n_routed_experts": 256,
            "n_shared_experts": 1,
            "norm_topk_prob": True,
            "num_attention_heads": 128,
            "num_experts_per_tok": 8,
            "num_hidden_layers": 61,
            "num_key_value_heads": 128,
            "num_nextn_predict_layers": 1,
            "q_lora_rank": 1536,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "rms_norm_eps": 1e-06,
            "rope_scaling": {
                "beta_fast": 32,
                "beta_slow": 1,
                "factor": 40,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "original_max_position_embeddings": 4096,
                "type": "yarn",
            },
            "rope_theta": 10000,
            "routed_scaling_factor": 2.5,
            "scoring_func": "sigmoid",
            "tie_word_embeddings": False,
            "topk_group": 4,
            "topk_method": "noaux_tc",
            "torch_dtype": "bfloat16",
            "v_head_dim": 128,
            "vocab_size": 129280,
        },
        # The paper's 671B total / 37B activated exclude the 14B multi-token-prediction module,
        # which transformers does not build either.
        "published": {"params": 671e9, "active_params": 37e9},
        "aliases": ["deepseek-v3-base", "deepseek-v3-0324", "deepseek-ai/deepseek-v3"],
    },
    "gemma-2-9b": {
        "repo": "google/gemma-2-9b",
        "config": {
            "architectures": ["Gemma2ForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "attn_logit_softcapping": 50.0,
            "bos_token_id": 2,
            "cache_implementation": "hybrid",
            "eos_token_id": 1,
            "final_logit_softcapping": 30.0,
            "head_dim": 256,
            "hidden_act": "gelu_pytorch_tanh",
            "hidden_activation": "gelu_pytorch_tanh",
            "hidden_size": 3584,
            "initializer_range": 0.02,
            "intermediate_size": 14336,
            "max_position_embeddings": 8192,
            "model_type": "gemma2",
            "num_attention_heads": 16,
            "num_hidden_layers": 42,
            "num_key_value_heads": 8,
            "pad_token_id": 0,
            "query_pre_attn_scalar": 256,
            "rms_norm_eps": 1e-06,
            "rope_theta": 10000.0,
            "sliding_window": 4096,
            "sliding_window_size": 4096,
            "torch_dtype": "float32",
            "use_cache": True,
            "vocab_size": 256000,
        },
        "published": {"params": 9.24e9},
        "aliases": ["gemma2-9b", "gemma-2-9b-it"],
    },
    "gemma-3-1b": {
        # Five of every six layers slide over 512 tokens (sliding_window_pattern 6, as transformers derives
        # layer_types).
        "repo": "google/gemma-3-1b-pt",
        "config": {
            "architectures": ["Gemma3ForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "attn_logit_softcapping": None,
            "bos_token_id": 2,
            "cache_implementation": "hybrid",
            "eos_token_id": [1, 106],
            "final_logit_softcapping": None,
            "head_dim": 256,
            "hidden_activation": "gelu_pytorch_tanh",
            "hidden_size": 1152,
            "initializer_range": 0.02,
            "intermediate_size": 6912,
            "max_position_embeddings": 32768,
            "model_type": "gemma3_text",
            "num_attention_heads": 4,
            "num_hidden_layers": 26,
            "num_key_value_heads": 1,
            "pad_token_id": 0,
            "query_pre_attn_scalar": 256,
            "rms_norm_eps": 1e-06,
            "rope_local_base_freq": 10000,
            "rope_scaling": None,
            "rope_theta": 1000000,
            "sliding_window": 512,
            "sliding_window_pattern": 6,
            "torch_dtype": "bfloat16",
            "transformers_version": "4.50.0.dev0",
            "use_cache": True,
            "vocab_size": 262144,
        },
        "published": {"params": 1e9},
        "aliases": ["gemma3-1b", "gemma-3-1b-it", "google/gemma-3-1b-it"],
    },
    "gpt-oss-20b": {
        # Alternating 128-token sliding and full layers; quantization_config (MXFP4 experts) left out: kvlab
        # builds bf16. Its page states 21B total; its 3.6B active leave out the embedding, which kvlab's active
        # count keeps (as for every model here), so only the total is compared.
        "repo": "openai/gpt-oss-20b",
        "config": {
            "architectures": ["GptOssForCausalLM"],
            "attention_bias": True,
            "attention_dropout": 0.0,
            "eos_token_id": 200002,
            "experts_per_token": 4,
            "head_dim": 64,
            "hidden_act": "silu",
            "hidden_size": 2880,
            "initial_context_length": 4096,
            "initializer_range": 0.02,
            "intermediate_size": 2880,
            "layer_types": ["sliding_attention", "full_attention"] * 12,
            "max_position_embeddings": 131072,
            "model_type": "gpt_oss",
            "num_attention_heads": 64,
            "num_experts_per_tok": 4,
            "num_hidden_layers": 24,
            "num_key_value_heads": 8,
            "num_local_experts": 32,
            "output_router_logits": False,
            "pad_token_id": 199999,
            "rms_norm_eps": 1e-05,
            "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                             "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
            "rope_theta": 150000,
            "router_aux_loss_coef": 0.9,
            "sliding_window": 128,
            "swiglu_limit": 7.0,
            "tie_word_embeddings": False,
            "transformers_version": "4.55.0.dev0",
            "use_cache": True,
            "vocab_size": 201088,
        },
        "published": {"params": 21e9},
        "aliases": ["gpt-oss", "gptoss-20b"],
    },
    "qwen3-next-80b-a3b": {
        # A hybrid: three Gated DeltaNet (linear-attention) layers to each attention layer (full_attention_interval 4).
        # Its page states 80B total (the multi-token-prediction layer, which transformers does not build, not
        # counted) and a rounded 3B active, which is not compared.
        "repo": "Qwen/Qwen3-Next-80B-A3B-Instruct",
        "config": {
            "architectures": ["Qwen3NextForCausalLM"],
            "attention_dropout": 0.0,
            "bos_token_id": 151643,
            "decoder_sparse_step": 1,
            "eos_token_id": 151645,
            "full_attention_interval": 4,
            "head_dim": 256,
            "hidden_act": "silu",
            "hidden_size": 2048,
            "initializer_range": 0.02,
            "intermediate_size": 5120,
            "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 128,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
            "linear_value_head_dim": 128,
            "max_position_embeddings": 262144,
            "mlp_only_layers": [],
            "model_type": "qwen3_next",
            "moe_intermediate_size": 512,
            "norm_topk_prob": True,
            "num_attention_heads": 16,
            "num_experts": 512,
            "num_experts_per_tok": 10,
            "num_hidden_layers": 48,
            "num_key_value_heads": 2,
            "output_router_logits": False,
            "partial_rotary_factor": 0.25,
            "rms_norm_eps": 1e-06,
            "rope_scaling": None,
            "rope_theta": 10000000,
            "router_aux_loss_coef": 0.001,
            "shared_expert_intermediate_size": 512,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "transformers_version": "4.57.0.dev0",
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": 151936,
        },
        "published": {"params": 80e9},
        "aliases": ["qwen3-next", "qwen3-next-80b", "qwen3-next-80b-a3b-thinking"],
    },
    "jamba-mini-1.5": {
        # A hybrid: one attention layer in every eight (attn_layer_period 8, offset 4), the others Mamba; MoE on every
        # second layer. Its page states 52B total and 12B active.
        "repo": "ai21labs/AI21-Jamba-1.5-Mini",
        "config": {
            "architectures": ["JambaForCausalLM"],
            "attention_dropout": 0.0,
            "attn_layer_offset": 4,
            "attn_layer_period": 8,
            "bos_token_id": 1,
            "eos_token_id": [2, 518],
            "expert_layer_offset": 1,
            "expert_layer_period": 2,
            "hidden_act": "silu",
            "hidden_size": 4096,
            "initializer_range": 0.02,
            "intermediate_size": 14336,
            "mamba_conv_bias": True,
            "mamba_d_conv": 4,
            "mamba_d_state": 16,
            "mamba_dt_rank": 256,
            "mamba_expand": 2,
            "mamba_proj_bias": False,
            "max_position_embeddings": 262144,
            "model_type": "jamba",
            "num_attention_heads": 32,
            "num_experts": 16,
            "num_experts_per_tok": 2,
            "num_hidden_layers": 32,
            "num_key_value_heads": 8,
            "num_logits_to_keep": 1,
            "output_router_logits": False,
            "pad_token_id": 0,
            "rms_norm_eps": 1e-06,
            "router_aux_loss_coef": 0.001,
            "sliding_window": None,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "transformers_version": "4.40.2",
            "use_cache": True,
            "vocab_size": 65536,
        },
        "published": {"params": 52e9, "active_params": 12e9},
        "aliases": ["jamba-1.5-mini", "ai21-jamba-mini-1.5", "jamba"],
    },
    "bamba-9b": {
        # A Mamba-2 hybrid: attention at layers 9, 18 and 27. The shape fields are those of the authors' training config
        # (fms-fsdp `mamba_9.8b`) as transformers' conversion script writes them, with the position limit it writes
        # (BambaConfig's default; the model was trained at 4k); token ids, which kvlab does not use, are left out
        # rather than guessed. Its authors state 9.78B parameters.
        "repo": "ibm-ai-platform/Bamba-9B",
        "config": {
            "architectures": ["BambaForCausalLM"],
            "attention_dropout": 0.0,
            "attn_layer_indices": [9, 18, 27],
            "attn_rotary_emb": 64,
            "hidden_act": "silu",
            "hidden_size": 4096,
            "initializer_range": 0.02,
            "intermediate_size": 14336,
            "mamba_chunk_size": 256,
            "mamba_conv_bias": True,
            "mamba_d_conv": 4,
            "mamba_d_head": 64,
            "mamba_d_state": 128,
            "mamba_expand": 2,
            "mamba_n_groups": 1,
            "mamba_n_heads": 128,
            "mamba_proj_bias": False,
            "max_position_embeddings": 262144,
            "model_type": "bamba",
            "num_attention_heads": 32,
            "num_hidden_layers": 32,
            "num_key_value_heads": 8,
            "num_logits_to_keep": 1,
            "rms_norm_eps": 1e-05,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "use_cache": True,
            "vocab_size": 128256,
        },
        "published": {"params": 9.78e9},
        "aliases": ["bamba", "ibm-fms/bamba-9b"],
    },
    "kvlab-tiny": {
        # Not a published model: a 2-layer Qwen2-architecture config for CPU runs and tests
        # (GQA with 2 KV heads, so KV-head arithmetic is exercised even at this size).
        "repo": None,
        "config": {
            "architectures": ["Qwen2ForCausalLM"],
            "attention_dropout": 0.0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "hidden_act": "silu",
            "hidden_size": 64,
            "initializer_range": 0.02,
            "intermediate_size": 128,
            "max_position_embeddings": 4096,
            "max_window_layers": 2,
            "model_type": "qwen2",
            "num_attention_heads": 4,
            "num_hidden_layers": 2,
            "num_key_value_heads": 2,
            "rms_norm_eps": 1e-06,
            "rope_theta": 10000.0,
            "sliding_window": None,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": 256,
        },
        "published": {},
        "aliases": ["tiny"],
    },
}


# ---- access by name ---------------------------------------------------------------------------


def norm_name(name: str) -> str:
    """Lower-case, drop an ``org/`` prefix, and unify separators so aliases match loosely."""
    n = name.strip().lower()
    if "/" in n:
        n = n.rsplit("/", 1)[1]
    return re.sub(r"[\s_]+", "-", n)


def alias_table() -> dict[str, str]:
    """Every accepted spelling (normalised) → registry name: names, repo ids and aliases."""
    table: dict[str, str] = {}
    for key, entry in REGISTRY.items():
        table[norm_name(key)] = key
        if entry.get("repo"):
            table[norm_name(entry["repo"])] = key
        for alias in entry.get("aliases", ()):
            table[norm_name(alias)] = key
    return table


def names() -> list[str]:
    """Registry names, in the order they are defined (the order tables use)."""
    return list(REGISTRY)


def aliases() -> dict[str, str]:
    """Every accepted spelling (normalised) → registry name."""
    return alias_table()


def registry_source(key: str, entry: Mapping[str, Any]) -> str:
    """Where a registry entry's numbers come from, as a ModelSpec's `source` says it."""
    where = HF_CONFIG_URL.format(entry["repo"]) if entry.get("repo") else "kvlab built-in test config"
    pub = entry.get("published") or {}
    parts = [f"config: {where}", "params: computed from the config"]
    if "params" in pub:
        note = f"published {pub['params'] / 1e9:g}B"
        if "active_params" in pub:
            note += f", {pub['active_params'] / 1e9:g}B active"
        parts[-1] += f" ({note})"
    return "; ".join(parts)
