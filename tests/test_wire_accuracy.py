"""The FP8 wire's accuracy study (kvlab.studies.wire_accuracy, `kvlab wire-accuracy`): bad input refused in one line
before a folder is made; a CPU run on the committed trained model writes the issue's tables, its bf16 control
equals the colocated decode exactly, an incomplete send is caught, and `kvlab analyse` gives the same analysis; the
trained model loads through kvlab's loading path and is a real model of its text."""

from __future__ import annotations

import gzip
import json
import math

import numpy as np
import pandas as pd
import pytest
import torch

from kvlab import analyse, goals, models, studies
from kvlab.cli import main
from kvlab.paths import repo_root
from kvlab.studies import wire_accuracy as study

SMALL = ["--context", "48", "--tokens", "12", "--prompts", "3"]


@pytest.mark.parametrize("params,match", [
    ({"scales": "per-block"}, "give distinct scale modes"),
    ({"weights": "trained,trained"}, "give distinct weights"),
    ({"weights": "pretrained"}, "give distinct weights"),
    ({"layout": "thd"}, "is not a pool layout"),
    ({"model": "data/nowhere"}, "has no config.json"),
    ({"device": "cuda:7"}, "does not exist"),
    ({"context": -1}, "give an int ≥ 0"),
    ({"context": 1}, "context = 1: a prompt needs at least 2 tokens"),
    ({"context": 400, "tokens": 200}, "past the 512 positions the model was trained on"),
    ({"tokens": 511}, "leaves 1 for a prompt"),
    ({"prompts": 2}, "give an int ≥ 3"),
    ({"prompts": 1000}, "more than the held-out text's"),
])
def test_bad_input_is_one_line_and_names_the_value(params, match):
    with pytest.raises(ValueError, match=match) as e:
        study.check(params)
    assert "\n" not in str(e.value)


def test_the_trained_model_loads_through_kvlabs_path_and_knows_its_text():
    folder = repo_root() / study.TRAINED
    model = models.build(str(folder), weights=str(folder))
    held = np.frombuffer(gzip.decompress((folder / "heldout.txt.gz").read_bytes()), dtype=np.uint8)
    ids = torch.from_numpy(held[:257].astype(np.int64))[None]
    with torch.inference_mode():
        nll = torch.nn.functional.cross_entropy(model(input_ids=ids[:, :-1]).logits[0].float(), ids[0, 1:])
    record = json.loads((folder / "run.json").read_text())
    # far below a uniform byte's ln 256 = 5.55 nats: the weights are trained, not random
    assert float(nll) < 2.5 and record["heldout_loss_nats_per_byte"] < 2.5
    random = models.build(str(folder / "config.json"), weights="random")
    with torch.inference_mode():
        flat = torch.nn.functional.cross_entropy(random(input_ids=ids[:, :-1]).logits[0].float(), ids[0, 1:])
    assert float(flat) > 5.0


def test_a_cpu_run_writes_the_tables_its_control_is_exact_and_it_is_analysed_again_the_same(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["wire-accuracy", *SMALL, "--out", str(out)]) == 0
    assert f"run: {out}" in capsys.readouterr().out
    record = json.loads((out / "run.json").read_text())
    assert record["status"] == "finished" and [g["id"] for g in record["goals"]] == [
        g.id for g in goals.for_study("wire_accuracy")]
    acc = pd.read_csv(out / "wire_accuracy.csv")
    issue = ["weights", "wire_dtype", "scales", "tokens", "token_agreement", "ppl_bf16", "ppl_wire", "kv_max_rel_err"]
    assert set(issue) <= set(acc.columns) and len(acc) == 2 * 5
    control = acc[acc.wire_dtype == "bf16"]
    assert (control.free_agreement_pct == 100).all() and (control.ppl_excess_pct == 0).all()
    assert (control.kv_max_rel_err == 0).all() and (control.bytes_ratio == 1).all()
    floor = acc[acc.wire_dtype == study.ULP]  # one ulp on a tenth of the elements: a tiny error, and not zero
    assert ((floor.kv_max_rel_err > 0) & (floor.kv_max_rel_err < 0.01)).all() and (floor.bytes_ratio == 1).all()
    assert set(record["bf16_forced_vs_greedy_pct"]) == {"trained", "random"}
    fp8 = acc[acc.wire_dtype == "fp8"].set_index(["weights", "scales"])
    # bytes: e4m3 elements plus float32 scales, one per token and head (head_dim 64: 68 / 128) or a few per layer
    assert fp8.loc[("trained", "per-token-head"), "bytes_ratio"] == pytest.approx((64 + 4) / 128)
    assert 0.5 < fp8.loc[("trained", "per-head"), "bytes_ratio"] < 0.51
    assert ((fp8.kv_max_rel_err > 0) & (fp8.kv_max_rel_err < 0.3)).all()
    assert (fp8.ppl_lo <= fp8.ppl_excess_pct).all() and (fp8.ppl_excess_pct <= fp8.ppl_hi).all()
    layers = pd.read_csv(out / "wire_layers.csv")
    assert {"kv_rel_err", "attn_out_rel_err"} <= set(layers.columns) and len(layers) == 2 * 4 * 4
    assert ((layers.attn_out_rel_err > 0) & (layers.attn_out_rel_err < 0.2)).all()
    assert max(record["query_check_rel_err"].values()) < 0.02  # the captured queries are the model's own
    g = pd.read_csv(out / "goals.csv")
    assert set(g.id) == {g.id for g in goals.for_study("wire_accuracy")} and (g.weights == "trained").all()
    again = analyse.analyse(out, tmp_path / "again")
    pd.testing.assert_frame_equal(pd.read_csv(again / "wire_accuracy.csv"), acc)
    assert studies.has_face(study) and "wire_accuracy" in studies.NAMES


def test_a_send_that_leaves_poison_is_an_error_not_a_result(tmp_path, monkeypatch):
    real = study.dequantize_scatter_reference

    def half(packet, dst, table):  # the last layer never lands: its blocks keep their poison
        real(packet, dst, table)
        dst.data[-1].fill_(float("nan"))

    monkeypatch.setattr(study, "dequantize_scatter_reference", half)
    with pytest.raises(RuntimeError, match="still poison"):
        main(["wire-accuracy", *SMALL, "--weights", "random", "--scales", "per-head", "--out", str(tmp_path / "r")])
    assert json.loads((tmp_path / "r" / "run.json").read_text())["status"] != "finished"


def test_a_bf16_copy_that_is_not_the_cache_stops_the_run(tmp_path, monkeypatch):
    real = study.BlockPool.read

    def swapped(self, table, device=None):  # what lands has its first two blocks' contents swapped
        out = real(self, table, device)
        b = self.spec.block_size
        out.data[..., :b, :], out.data[..., b:2 * b, :] = out.data[..., b:2 * b, :].clone(), out.data[..., :b, :].clone()
        return out

    # attention reads its keys as a set, so swapping whole tokens decodes the same: the bytes are checked, not only
    # the decode
    monkeypatch.setattr(study.BlockPool, "read", swapped)
    with pytest.raises(RuntimeError, match="byte for byte"):
        main(["wire-accuracy", *SMALL, "--weights", "trained", "--scales", "per-head", "--out", str(tmp_path / "r")])


def test_queries_that_are_not_the_models_stop_the_run_before_any_table(tmp_path, monkeypatch):
    real = study._rope

    def off(model):  # RoPE at the wrong positions: recomputed attention is not the model's own
        apply, rotary = real(model)
        return apply, lambda x, pos: rotary(x, pos + 7)

    monkeypatch.setattr(study, "_rope", off)
    with pytest.raises(RuntimeError, match="not the plain RoPE attention"):
        main(["wire-accuracy", *SMALL, "--weights", "trained", "--out", str(tmp_path / "r")])
    assert not (tmp_path / "r" / "prompts.csv").exists()


def test_the_perplexity_interval_is_of_the_distance_from_bf16_and_touches_zero_when_it_spans_it():
    rows = []
    for p, d in enumerate([0.01, -0.02, 0.015, -0.005, 0.0]):  # per prompt, the mean log-likelihood lost a token
        rows.append(dict(weights="trained", wire_dtype="fp8", scales="per-head", prompt=p, tokens=10, free_matches=10,
                         first_divergence=10, forced_matches=9, nll_bf16=10.0, nll_wire=10.0 + 10 * d, bytes=1,
                         bf16_bytes=2))
    s = study.summarise(pd.DataFrame(rows), pd.DataFrame(columns=["weights", "scales", "what", "max_rel_err",
                                                                   "norm_rel_err"]))
    r = s.iloc[0]
    assert r.ppl_lo == 0.0 and r.ppl_hi > r.ppl_excess_pct
    assert r.ppl_excess_pct == pytest.approx(100 * abs(math.exp(np.mean([0.01, -0.02, 0.015, -0.005, 0.0])) - 1))
    assert r.forced_agreement_pct == 90.0 and r.free_agreement_pct == 100.0


def test_the_noise_floor_moves_a_tenth_of_the_finite_elements_by_one_ulp_and_nothing_else():
    from kvlab.kvcache import KVBuffer, KVLayout

    buf = KVBuffer(KVLayout(2, 1, 2, 64, 16, torch.bfloat16))
    buf.data.copy_(torch.randn(buf.data.shape))
    buf.data.view(-1)[:50] = 0.0
    buf.data.view(-1)[50:60] = float("nan")  # poison is never nudged into a number
    before = buf.data.clone()
    study._nudged(buf, 3)
    moved = before.view(torch.int16) != buf.data.view(torch.int16)
    assert 0.07 < float(moved.float().mean()) < 0.13
    assert torch.isnan(buf.data.view(-1)[50:60]).all() and torch.isfinite(buf.data.view(-1)[60:]).all()
    a, b = before.view(torch.int16).int() & 0x7FFF, buf.data.view(torch.int16).int() & 0x7FFF
    assert ((a - b).abs() <= 1).all() and torch.equal(torch.signbit(before[moved]), torch.signbit(buf.data[moved]))
