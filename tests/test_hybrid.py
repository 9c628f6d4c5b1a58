"""The bill of hybrid models (issue 29): attention layers hold KV per token (sliding ones capped at their window),
linear-attention and state-space layers a fixed state per sequence. Every hybrid in the registry is counted by hand
from its config, and kvlab's shapes are checked against the cache transformers itself fills."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from kvlab import calculator, models
from kvlab.model_config import STATE_MODEL_TYPES

BF16, FP32 = 2, 4


def test_qwen3_next_by_hand():
    """Qwen3-Next-80B-A3B: 48 layers, every fourth full attention (2 KV heads of 256); the other 36 Gated DeltaNet
    layers keep a causal-conv window over q, k and v (2·16·128 + 32·128 channels, kernel 4) and a recurrent state
    per value head (32 × 128 × 128)."""
    s = models.get("qwen3-next-80b-a3b")
    assert s.attention_layers == tuple(range(3, 48, 4)) and len(s.state_layers) == 36
    assert calculator.kv_bytes_per_token(s) == 12 * 2 * 2 * 256 * BF16 == 24_576
    conv, rec = (2 * 16 * 128 + 32 * 128) * 4, 32 * 128 * 128
    assert calculator.recurrent_state_bytes(s) == 36 * (conv * BF16 + rec * FP32) == 77_856_768
    assert calculator.recurrent_state_bytes(s, state_dtype="bf16") == 36 * (conv + rec) * BF16


def test_jamba_by_hand():
    """Jamba 1.5 Mini: one attention layer in every eight (offset 4: layers 4, 12, 20, 28; 8 KV heads of 128); the
    28 Mamba layers keep a conv window over 2·4096 channels (kernel 4) and a state of 8192 × 16."""
    s = models.get("jamba-mini-1.5")
    assert s.attention_layers == (4, 12, 20, 28)
    assert calculator.kv_bytes_per_token(s) == 4 * 2 * 8 * 128 * BF16 == 16_384
    assert calculator.recurrent_state_bytes(s) == 28 * (8192 * 4 * BF16 + 8192 * 16 * FP32) == 16_515_072


def test_bamba_by_hand():
    """Bamba-9B (Mamba-2): attention at layers 9, 18, 27 (8 KV heads of 128); the 29 Mamba-2 layers keep a conv
    window over x, B and C (8192 + 2·1·128 channels, kernel 4) and a state of 128 heads × 64 × 128."""
    s = models.get("bamba-9b")
    assert s.attention_layers == (9, 18, 27)
    assert calculator.kv_bytes_per_token(s) == 3 * 2 * 8 * 128 * BF16 == 12_288
    assert calculator.recurrent_state_bytes(s) == 29 * ((8192 + 256) * 4 * BF16 + 128 * 64 * 128 * FP32)


def test_sliding_models_by_hand():
    """gpt-oss-20b alternates 128-token sliding and full layers (8 KV heads of 64): at 8k a token costs 24,960 B,
    not the uncapped 49,152 B; gemma-3-1b slides 22 of 26 layers over 512 tokens. Neither keeps a state."""
    g = models.get("gpt-oss-20b")
    layer = 2 * 8 * 64 * BF16
    assert calculator.kv_bytes_per_token(g) == 24 * layer == 49_152
    assert calculator.kv_cache_bytes(g, 8192) == 12 * layer * 8192 + 12 * layer * 128
    assert calculator.kv_cache_bytes(g, 8192) / 8192 == 24_960
    gem = models.get("gemma-3-1b")
    assert calculator.kv_cache_bytes(gem, 8192) == 2 * 256 * BF16 * (4 * 8192 + 22 * 512)
    assert calculator.recurrent_state_bytes(g) == calculator.recurrent_state_bytes(gem) == 0


def test_every_hybrid_in_the_registry_is_counted_here():
    hybrids = {n for n in models.names() if models.get(n).is_hybrid}
    assert hybrids == {"qwen3-next-80b-a3b", "jamba-mini-1.5", "bamba-9b"}
    assert {models.get(n).architecture for n in hybrids} == set(STATE_MODEL_TYPES)


def test_the_handoff_carries_the_state_too():
    """A hybrid's transfer is its KV and its state: the bulk time is their sum over the link, each TP rank sending
    its share of both."""
    s = models.get("qwen3-next-80b-a3b")
    for tp in (1, 2):
        est = calculator.handoff_estimate(s, 8192, "400G", tp=tp)
        state = calculator.recurrent_state_bytes(s)
        assert est.state_bytes == state and est.as_row()["state_bytes"] == state
        want = (calculator.kv_cache_bytes(s, 8192) / tp + state / tp) / 50e9
        assert est.transfer_s == pytest.approx(want, rel=1e-12)
        assert sum(est.timeline.transfer_s) == pytest.approx(want, rel=1e-12)
    # state layers have no quadratic attention term
    fl = calculator.prefill_flops(s, 4096)
    assert all(fl.attention_per_layer[i] == 0 for i in s.state_layers)
    assert all(fl.attention_per_layer[i] > 0 for i in s.attention_layers)


# Small configs of each hybrid family: transformers builds them on a CPU in a second, and fills their cache
_TINY = {
    "qwen3_next": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8,
                       linear_value_head_dim=12, linear_num_key_heads=2, linear_num_value_heads=4,
                       full_attention_interval=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=32),
    "jamba": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, attn_layer_period=4, attn_layer_offset=2, expert_layer_period=2,
                  expert_layer_offset=1, num_experts=4, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2),
    "bamba": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16, mamba_d_state=8,
                  mamba_n_groups=2, mamba_d_conv=4, mamba_expand=2),
}


@pytest.mark.parametrize("model_type", STATE_MODEL_TYPES)
def test_bytes_and_shapes_equal_the_cache_transformers_fills(model_type):
    """A prompt through transformers' own model (bf16, random weights): its attention layers' keys and values and
    its state layers' conv and recurrent states are, layer by layer, the shapes kvlab reads from the config, and in
    all exactly the bytes the calculator bills (KV at this length plus the state)."""
    cfg = {"model_type": model_type, "vocab_size": 96, **_TINY[model_type]}
    spec = models.from_hf_config(cfg)
    torch.manual_seed(0)
    net = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{k: v for k, v in cfg.items()
                                                                                  if k != "model_type"}),
                                           dtype=torch.bfloat16).eval()
    tokens = 11
    with torch.no_grad():
        cache = net(torch.randint(0, 96, (1, tokens)), use_cache=True).past_key_values
    kv = state = 0
    for i, layer in enumerate(cache.layers):
        if i in spec.state_layers:
            conv, rec = layer.conv_states[0], layer.recurrent_states[0]
            assert tuple(conv.shape) == (1, *spec.conv_state) and tuple(rec.shape) == (1, *spec.recurrent_state), i
            assert (conv.dtype, rec.dtype) == (torch.bfloat16, torch.float32)
            state += conv.numel() * conv.element_size() + rec.numel() * rec.element_size()
        else:
            assert tuple(layer.keys.shape) == (1, spec.kv_heads, tokens, spec.head_dim), i
            kv += sum(t.numel() * t.element_size() for t in (layer.keys, layer.values))
    assert kv == calculator.kv_cache_bytes(spec, tokens)
    assert state == calculator.recurrent_state_bytes(spec) > 0
    assert spec.params == sum(p.numel() for p in net.parameters())


def test_layer_kinds_match_the_configs_own_rules():
    """transformers derives layer_types; the hand rules of each config say the same."""
    assert models.get("jamba-mini-1.5").attention_layers == tuple(i for i in range(32) if i % 8 == 4)
    assert models.get("qwen3-next-80b-a3b").attention_layers == tuple(i for i in range(48) if (i + 1) % 4 == 0)
    assert models.get("bamba-9b").attention_layers == tuple(models.get("bamba-9b").hf_config["attn_layer_indices"])


def test_paths_that_move_kv_refuse_a_hybrid_in_one_line():
    with pytest.raises(ValueError) as err:
        models.kv_model_ref("jamba-mini-1.5", "model")
    msg = str(err.value)
    assert msg.startswith("model = 'jamba-mini-1.5': jamba-mini-1.5 is a hybrid: 28 of its 32 layers keep a "
                          "recurrent state") and "\n" not in msg and "kvlab calc jamba-mini-1.5" in msg
    with pytest.raises(ValueError, match="contiguous KV buffers move attention KV only"):
        models.get("bamba-9b").kv_shape(8)
    assert models.kv_model_ref("qwen2.5-7b") == "qwen2.5-7b"


def test_kv_table_shows_the_figure_at_the_prompt_beside_the_uncapped_one():
    from kvlab.studies.calculator import calcviz

    t = calcviz.kv_table(["gpt-oss-20b", "qwen3-next-80b-a3b", "llama-3.1-8b"], tokens=8192).set_index("model")
    assert t.loc["gpt-oss-20b", "kv_bytes_per_token_at_prompt"] == 24_960
    assert t.loc["gpt-oss-20b", "kv_bytes_per_token"] == 49_152
    q = models.get("qwen3-next-80b-a3b")
    assert t.loc["qwen3-next-80b-a3b", "state_bytes"] == calculator.recurrent_state_bytes(q)
    assert t.loc["qwen3-next-80b-a3b", "cache_bytes"] == calculator.cache_bytes(q, 8192)
    assert t.loc["llama-3.1-8b", "kv_bytes_per_token_at_prompt"] == t.loc["llama-3.1-8b", "kv_bytes_per_token"]
    assert math.isclose(t.loc["llama-3.1-8b", "state_bytes"], 0)


def test_the_tp_transfer_and_the_fabric_simulator_carry_the_state_too():
    """Every figure that moves a hybrid's cache adds its state: the TP transfer time, and the bytes the fabric
    simulator's requests send (each state layer its state, beside the attention layers' KV)."""
    from kvlab.fabric.topology import TopologyConfig
    from kvlab.fabric.workload import SimConfig, draw

    s = models.get("bamba-9b")
    state, kv = calculator.recurrent_state_bytes(s), calculator.kv_cache_bytes(s, 2048)
    assert calculator.tp_transfer_time_s(s, 2048, "400G", tp=2) == pytest.approx((kv + state) / 2 / 50e9)
    topo = TopologyConfig(gpus=8, gpus_per_node=8, nodes_per_leaf=1)
    w = draw(SimConfig(topology=topo, prefill_workers=4, decode_workers=4, model="bamba-9b", requests=3,
                       prompt="fixed", prompt_tokens=2048))
    assert w.layer_bytes.sum(axis=1).tolist() == [kv + state]
    assert w.layer_bytes[0, list(s.state_layers)].tolist() == calculator.state_layer_bytes(s)[:1] * len(s.state_layers)
