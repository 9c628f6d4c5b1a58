"""Two GPUs: the peer handoff decodes on the destination GPU with its own copy of the model, every send
policy lands a cache that decodes identically, and the send-pattern experiment runs end to end. Skipped
without two CUDA GPUs (they ran on 2×H200)."""

from __future__ import annotations

import pytest
import torch

from kvlab import steps
from kvlab.studies.handoff import analysis, experiment
from kvlab.studies.overlap_timeline import pattern_report, patterns

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs two CUDA GPUs")]


@pytest.fixture(scope="module")
def tiny_gpu():
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      intermediate_size=128, vocab_size=256, num_hidden_layers=4, max_position_embeddings=512,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to("cuda:0", torch.bfloat16).eval()


def test_replicas_are_the_same_weights_on_the_peer(tiny_gpu):
    rep = steps.Replicas(tiny_gpu)
    assert rep("cuda:0") is tiny_gpu
    peer = rep("cuda:1")
    assert peer is rep(torch.device("cuda", 1)) and next(peer.parameters()).device == torch.device("cuda", 1)
    for (n, a), (_, b) in zip(tiny_gpu.state_dict().items(), peer.state_dict().items()):
        assert torch.equal(a.cpu(), b.cpu()), n


@pytest.mark.parametrize("policy", ["eager", "deadline", "batch:2"])
def test_peer_handoff_decodes_on_the_destination_gpu(tiny_gpu, policy):
    cfg = experiment.HandoffConfig(contexts=[128], destinations=["cuda:1"], repeats=2, warmup=1, decode_tokens=5,
                                interleave_short=2, interleave=2, short_context=128, policy=policy)
    timings, checks = experiment.run_handoff(tiny_gpu, cfg, device="cuda:0")
    moved = checks[checks.destination == "peer-cuda:1"]
    assert len(moved) == 2 and set(moved.decode_device) == {"cuda:1"}
    assert checks.tokens_match.all() and checks.logits_equal.all() and (checks.poison_left == 0).all()
    assert moved.decode_gpu_logits_equal.all() and moved.bytes_equal.all()
    assert (timings[(timings.destination == "peer-cuda:1") & (timings.measure == "decode_step")].ms > 0).all()
    summary = analysis.summarize(timings)
    assert list(summary.destination) == ["peer-cuda:1"]


def test_send_patterns_run_on_two_gpus(tiny_gpu):
    run = patterns.send_patterns(tiny_gpu, 128, "cuda:1", rounds=2, warmup=1, device="cuda:0", interval_ms=2.0)
    assert set(run.rounds.variant) == set(patterns.PATTERNS)
    assert (run.rounds.prefill_ms > 0).all() and run.rounds.groupby("variant").size().eq(2).all()
    sends = run.rounds[run.rounds.variant != "colocated"]
    assert sends.exposed_ms.notna().all()
    assert len(run.timeline) == 4 and (run.timeline.copy_end_ms >= run.timeline.copy_start_ms).all()
    s = pattern_report.pattern_summary(run.rounds)
    assert len(s) == len(patterns.PATTERNS)
    if run.meta["nvml"]:
        assert (run.rounds.samples_g0 >= 0).all() and len(run.samples) > 0


@pytest.mark.parametrize("opts", [dict(chunk_mib=None, copy_streams=None),  # tuned
                                  dict(chunk_mib=1 / 16, edge_mib=1 / 64, copy_streams=2, ring=2),  # many chunks
                                  dict(chunk_mib=1, copy_streams=1)])
def test_chunked_gather_peer_lands_every_block_and_nothing_else(opts):
    from kvlab.paged import BlockAllocator, BlockPool, PoolSpec, verify_transfer
    from kvlab.paged.registry import make_transport

    spec = PoolSpec(layers=3, block_size=16, kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    tokens = 16 * 200 - 5
    n = spec.blocks_for(tokens)
    src = BlockPool(spec, 2 * n + 7, device="cuda:0").fill_random(3)
    table = BlockAllocator(2 * n + 7, 16, seed=1).allocate(tokens)
    dst_table = BlockAllocator(2 * n + 11, 16, seed=2).allocate(tokens)
    t = make_transport("chunked-gather-peer", spec, "cuda:1", 2 * n + 11, "cuda:0", **opts)
    t.prepare(src, table, dst_table)
    for _ in range(2):  # twice: the second send reuses slots whose events the first recorded
        t.poison()
        landing = t.send(src, table, dst_table)
        landing.wait()
        torch.cuda.synchronize("cuda:1")
        check = verify_transfer(src, table, t.pool, dst_table)
        assert check["ok"], check
    assert t.config["copy_streams"] in (1, 2) and t.config["chunk_mib"] > 0


def test_peer_sm_ceiling_path_copies_every_byte():
    from kvlab import ceilings

    assert "d2d_peer_sm:0->1" in ceilings.available_paths("cuda:0")
    df = ceilings.measure(["d2d_peer_sm:0->1", "d2d_peer:0->1"], [1 << 20, (1 << 20) + 3], n=2, warmup=1,
                          device="cuda:0")
    assert set(df.mechanism) == {"sm_store_p2p", "copy_engine_p2p"} and (df.gbps > 0).all()
