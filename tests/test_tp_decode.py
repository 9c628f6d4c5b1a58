"""Decode with TP on the decode side (kvlab.tp_decode): real multi-process runs over gloo on kvlab-tiny in float32
with a 128-token prompt — one process prefills and decodes colocated, re-shards its cache P → D, D forked processes
(each its own model from the same seed) decode 20 steps together — against the pass rule: tokens equal at every
step, logits within the reduction-order tolerance, every shard byte-exact, no poison left.

Runs: (1, 2) with transformers' own tensor-parallel plan (kvlab-tiny's 2 KV heads split over 2 ranks), the fused
kernel, hnd → nhd; (2, 4) with kvlab's split (4 ranks > 2 KV heads: each head replicated), staging, nhd → hnd;
(2, 1) one decode rank (no collectives, decoded in this process), torch-index. TRITON_INTERPRET=1 is set so the
fused and staging paths run the Triton kernel through its interpreter (the decode ranks inherit it and never use it).
"""

from __future__ import annotations

import math

import pytest
import torch

from kvlab import calculator, models, tp_decode

pytest.importorskip("triton")


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _passes(out, p, d):
    assert out["prefill_tp"] == p and out["decode_tp"] == d
    assert out["tokens_match"], out
    assert out["logits_within_tolerance"], out
    assert out["shards_exact"] and out["poison_left"] == 0
    assert out["passed"]
    shard = calculator.tp_shard_bytes("kvlab-tiny", 128, d, "float32")
    assert out["bytes_per_decode_rank"] == [shard.bytes_per_gpu] * d
    assert sum(out["replica_bytes"]) == shard.total_bytes - shard.unique_bytes
    assert out["pieces_per_decode_rank"] == out["pieces_accounted"]
    # the rule is a bound, not a measured fit: the decodes differ, and by far less
    assert 0 < out["logits_max_abs_diff"] < out["logits_tolerance"] / 10 or out["decode_tp"] == 1


def test_two_ranks_with_transformers_tp_plan():
    out = tp_decode.run("kvlab-tiny", 1, 2, context=128, steps=20, src_layout="hnd", dst_layout="nhd",
                        method="fused")
    _passes(out, 1, 2)
    assert out["impl"] == "transformers" and out["mover_backend"] == "triton"
    assert out["pieces_per_decode_rank"] == [1, 1] and out["replica_bytes"] == [0, 0]


def test_four_ranks_replicate_the_kv_heads_with_kvlabs_split():
    out = tp_decode.run("kvlab-tiny", 2, 4, context=128, steps=20, src_layout="nhd", dst_layout="hnd",
                        method="staging")
    _passes(out, 2, 4)
    assert out["impl"] == "kvlab"
    assert out["replica_bytes"] == [0, 32768, 0, 32768]  # ranks 1 and 3 hold copies of heads 0 and 1
    assert out["pieces_per_decode_rank"] == [4, 4, 4, 4]  # 2 layers × K, V from one prefill rank
    assert any("replicated" in n for n in out["notes"])


def test_one_decode_rank_gathers_from_two_prefill_ranks():
    out = tp_decode.run("kvlab-tiny", 2, 1, context=128, steps=20, method="torch-index")
    _passes(out, 2, 1)
    assert out["impl"] == "none" and out["logits_equal"]  # one rank, the colocated model's sums: bit-equal
    assert out["pieces_per_decode_rank"] == [2]


def test_tolerance_follows_its_rule():
    model = models.build("kvlab-tiny", dtype="float32")
    atol, rule = tp_decode.logits_tolerance(model, 128, 20)
    u = 2.0 ** -24
    gamma = 148 * u / (1 - 148 * u)  # K = max(64, 4·16, 128, 16, 148)
    g = float(model.model.norm.weight.detach().abs().max())
    w = float(model.lm_head.weight.detach().norm(dim=1).max())
    assert atol == pytest.approx(2 * gamma * 25 * g * math.sqrt(64) * w) and "K=148" in rule
    assert tp_decode.logits_tolerance(model, 1000, 20)[0] > atol  # longer attention sums, wider bound
    assert tp_decode.logits_tolerance(model.double(), 128, 20)[0] < atol * 1e-8  # fp64's unit roundoff


def test_which_split_applies():
    model = models.build("kvlab-tiny", dtype="float32")
    assert tp_decode.transformers_supported(model, 2) == (True, "transformers tp_plan")
    ok, why = tp_decode.transformers_supported(model, 4)
    assert not ok and "replicates" in why


def test_compare_fails_outside_the_tolerance():
    t = torch.arange(3)
    lg = torch.zeros(3, 5)
    assert tp_decode.compare(t, lg, t, lg + 1e-4, 1e-3)["logits_within_tolerance"]
    bad = tp_decode.compare(t, lg, t.flip(0), lg + 1e-2, 1e-3)
    assert not bad["logits_within_tolerance"] and not bad["tokens_match"]


@pytest.mark.parametrize("kw,match", [(dict(prefill_tp=3, decode_tp=2), "neither divide"),
                                      (dict(decode_tp=8), "query heads"), (dict(method="rdma"), "method"),
                                      (dict(impl="megatron"), "impl"), (dict(backend="nccl"), "one GPU per"),
                                      (dict(context=4090), "positions"),
                                      (dict(decode_tp=4, impl="transformers"), "does not apply")])
def test_refused_before_any_process_starts(kw, match):
    if kw.get("backend") == "nccl" and torch.cuda.device_count() >= 2:
        pytest.skip("this machine has a GPU per decode rank: nccl is not refused here")
    with pytest.raises(ValueError, match=match):
        tp_decode.run(**{"model": "kvlab-tiny", **kw})


def test_shard_model_refuses_an_unknown_split():
    with pytest.raises(ValueError, match="impl"):
        tp_decode.shard_model(None, impl="megatron")


def test_a_transformers_without_the_plan_taking_api_falls_back_to_kvlabs_split(monkeypatch):
    """transformers 5.17 (the GPU image's) has apply_tensor_parallelism(model, tp_mesh): placeholders for a loader,
    which would drop random weights. There "auto" takes kvlab's own split, and "transformers" is refused."""
    from transformers.integrations import tensor_parallel

    monkeypatch.setattr(tensor_parallel, "apply_tensor_parallelism", lambda model, tp_mesh: model)
    model = models.build("kvlab-tiny", device="cpu", dtype="float32")
    ok, why = tp_decode.transformers_supported(model, 2)
    assert not ok and "apply_tensor_parallelism(model, tp_mesh, tp_plan)" in why
    out = tp_decode.run("kvlab-tiny", 1, 2, context=64, steps=8)
    assert out["impl"] == "kvlab" and out["passed"]


def test_a_bf16_decode_has_no_reduction_order_bound_and_says_so():
    """Higham's γ_k = k·u / (1 − k·u) needs k·u ≪ 1: bf16's u = 2^-9 over kvlab-tiny's sums gives k·u > 0.1."""
    model = models.build("kvlab-tiny", device="cpu", dtype="bfloat16")
    with pytest.raises(ValueError, match="reduction-order bound needs k·u < 0.1.*decode in float32"):
        tp_decode.logits_tolerance(model, 128, 20)
