"""What an FP8 wire does to decoding (`kvlab wire-accuracy`), on weights that mean something.

kvlab's wire study (wire_dtype) times FP8 on random values, which says nothing about accuracy: random weights give
flat next-token distributions, whose argmax a small error rarely moves and never moves for a reason. Here a model
trained for this (data/models/kvlab-bytes-py: a 4-layer Qwen2-architecture model over bytes, trained on a Python
standard library's sources; its folder holds the text, the training script, the loss curve and the weights),
loaded through kvlab.models.build as any checkpoint is, prefills prompts of held-out text; each prompt's bf16 cache
is written into a paged pool and crosses the wire as a transport carries it — quantized in the gather to e4m3 with
its scales (kvlab.paged.wire's torch reference, bit for bit what the Triton kernels send), dequantized on arrival
into a poisoned bf16 pool — and decode reads it from there. Beside it, the same cache through the same pools in
bf16 (a control that must agree exactly) and the same steps on random weights of the same shape, labelled as such.

Per weights and scale mode, over all prompts: greedy token agreement over `tokens` positions, free-running (each
side decodes from its own cache) and teacher-forced (both fed bf16's greedy tokens); the first position where the
free-running sequences part; perplexity of the held-out bytes that follow each prompt; the cache's relative error per
layer side, and each layer's attention output for the prompt's last queries with the wire's K and V against bf16's.
Static scales (per-head, per-tensor) are calibrated on a window of the training text, not on the prompts.
"""

from __future__ import annotations

import gzip
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from ... import devices, goals, models, plots
from ...intervals import mean_ci
from ...kvcache import KVBuffer
from ...paged import BlockPool, BlockTable
from ...paged.pools import check_layout
from ...paged.wire import (SCALE_MODES, attn_out_rel_err, calibrate_scales, causal_attention, check_modes,
                           dequantize_scatter_reference, kv_rel_err, quantize_gather_reference)
from ...paths import repo_root
from ...results import Run
from ...steps import cache_kw
from ...study import Analysis, Param, at_least, check_params, md_table, sig

__all__ = ["NAME", "NOTEBOOK", "TITLE", "QUESTION", "FIGURES", "PARAMS", "Config", "TRAINED", "check", "measure",
           "analyse", "figures", "BLOCKS", "summarise", "layer_table", "goal_table"]

NAME = "wire_accuracy"
NOTEBOOK = None
TITLE = "What an FP8 wire does to decoding"
QUESTION = ("Does decode from a cache that crossed the wire as FP8 give the tokens and the perplexity of decode from "
            "the bf16 cache, on a model whose weights are trained?")
FIGURES = ("wire_accuracy",)
TRAINED = "data/models/kvlab-bytes-py"  # the trained model's folder, from the repository's root
WEIGHTS = ("trained", "random")
QUERIES = 64  # the prompt's last queries the attention-output error is measured for
QUERY_CHECK = 0.02  # recomputed attention from the captured queries must be this close to the model's own
# the noise floor beside the FP8 rows: the bf16 cache with one bf16 ulp added to or taken from a share of its elements
# (seeded), an error far smaller than FP8's, so what the metrics make of a tiny change is measured, not guessed
ULP, ULP_SHARE = "bf16-1ulp", 0.10


def _weights(value, name):
    got = [v.strip() for v in str(value).split(",") if v.strip()]
    if not got or any(v not in WEIGHTS for v in got) or len(set(got)) != len(got):
        raise ValueError(f"{name} = {value!r}: give distinct weights of {', '.join(WEIGHTS)}, comma-separated")


def _folder(value, name):
    path = Path(value).expanduser()
    path = path if path.is_absolute() else repo_root() / path
    for need in ("config.json", "model.safetensors", "heldout.txt.gz", "train.txt.gz"):
        if not (path / need).is_file():
            raise ValueError(f"{name} = {value!r}: {path} has no {need}; give a trained model's folder such as "
                             f"{TRAINED} (its weights, config and the text it was trained and judged on)")


PARAMS = (
    Param("model", "str", TRAINED, "the trained model's folder (config.json, model.safetensors, train.txt.gz and "
          "heldout.txt.gz), from the repository's root or absolute", _folder),
    Param("weights", "str", ",".join(WEIGHTS), "which weights: trained (the folder's) and random (the same shape, "
          "seeded), comma-separated", _weights),
    Param("scales", "str", ",".join(SCALE_MODES), "scale modes, comma-separated: per-token-head (dynamic), per-head "
          "and per-tensor (static, calibrated on a window of the training text)", check_modes),
    Param("context", "int", 0, "prompt length in tokens (bytes), each prompt's cache the wire carries; 0: the "
          "window the model was trained on less the decoded tokens (prompt and decode stay inside it)", at_least(0)),
    Param("tokens", "int", 256, "positions decoded after each prompt, greedy agreement and perplexity counted over "
          "them", at_least(1)),
    Param("prompts", "int", 32, "prompts of held-out text, evenly spaced through it; the intervals are over prompts",
          at_least(3)),
    Param("layout", "str", "hnd", "both pools' layout: hnd or nhd", check_layout),
    Param("block_size", "int", 16, "tokens per block", at_least(1)),
    Param("device", "str", "cpu", "where the model runs: cpu, or cuda:N; \"auto\": cuda:0 where there is a GPU",
          devices.check_device_name),
    Param("seed", "int", 0, "seed of the random weights and the block tables", at_least(0)),
)


@dataclass(frozen=True)
class Config:
    """One run: the model folder, which weights and scale modes, the prompt and decode lengths, the pools' shape."""

    folder: Path
    weights: list
    scales: list
    context: int
    tokens: int
    prompts: int
    layout: str
    block_size: int
    device: torch.device
    seed: int

    def resolved(self) -> dict:
        try:
            shown = str(self.folder.relative_to(repo_root()))
        except ValueError:
            shown = str(self.folder)
        return {"model": shown, "weights": self.weights, "scales": self.scales, "context": self.context,
                "tokens": self.tokens, "prompts": self.prompts, "layout": self.layout, "block_size": self.block_size,
                "device": str(self.device), "seed": self.seed}


def _split(value) -> list:
    return [v.strip() for v in str(value).split(",") if v.strip()]


def _text(folder: Path, name: str) -> np.ndarray:
    return np.frombuffer(gzip.decompress((folder / name).read_bytes()), dtype=np.uint8)


def trained_window(folder: Path, positions: int) -> int:
    """The positions a trained model saw: its training run.json's `seq` (the windows it was trained on), else its
    config's `positions`. Past them a model extrapolates (a first run at 1,024 + 256 on a 512-byte window: bf16's own
    held-out perplexity 83, against 2.8 inside it)."""
    try:
        seq = int(json.loads((folder / "run.json").read_text(encoding="utf-8"))["seq"])
    except (OSError, ValueError, KeyError, TypeError):
        return positions
    return min(seq, positions)


def check(params) -> Config:
    """The run's Config: every value checked, the device held against this machine, the model's config read and the
    held-out text long enough for the prompts — before anything is loaded or written."""
    p = check_params(PARAMS, params, NAME)
    dev = devices.run_device(p["device"])
    folder = Path(p["model"]).expanduser()
    folder = folder if folder.is_absolute() else repo_root() / folder
    spec = models.from_hf_config(str(folder / "config.json"))
    if spec.attention == "mla":
        raise ValueError(f"model = {p['model']!r} keeps an MLA latent; the FP8 wire quantizes K and V heads")
    if spec.vocab_size != 256:
        raise ValueError(f"model = {p['model']!r} has a vocabulary of {spec.vocab_size}; this study feeds bytes, "
                         "so it needs a byte-level model (vocab_size 256)")
    window = trained_window(folder, spec.max_positions)
    if 0 < p["context"] < 2:
        raise ValueError(f"context = {p['context']}: a prompt needs at least 2 tokens; give 0 for the trained window "
                         "less the decoded tokens")
    context = p["context"] or window - p["tokens"]
    if context < 2:
        raise ValueError(f"tokens = {p['tokens']}: the model was trained on windows of {window} bytes, which leaves "
                         f"{context} for a prompt; give fewer tokens (at most {window - 2})")
    if context + p["tokens"] > window:
        raise ValueError(f"context = {context}: context + tokens = {context + p['tokens']} is past the {window} "
                         f"positions the model was trained on (its run.json's seq); give at most "
                         f"{window - p['tokens']}, or 0 for that")
    span = context + p["tokens"] + 1
    held = len(gzip.decompress((folder / "heldout.txt.gz").read_bytes()))
    if p["prompts"] * span > held:
        raise ValueError(f"prompts = {p['prompts']}: {p['prompts']} × {span} bytes is more than the held-out text's "
                         f"{held:,}; give fewer prompts or a shorter context")
    return Config(folder=folder, weights=_split(p["weights"]), scales=_split(p["scales"]), context=context,
                  tokens=p["tokens"], prompts=p["prompts"], layout=p["layout"], block_size=p["block_size"],
                  device=dev, seed=p["seed"])


# ---------------------------------------------------------------------------------------------------- measuring


def _rope(model):
    """The model's own apply_rotary_pos_emb (its modeling module's), and its rotary embedding."""
    attn = model.model.layers[0].self_attn
    return sys.modules[type(attn).__module__].apply_rotary_pos_emb, model.model.rotary_emb


@torch.inference_mode()
def _prefill(model, ids: torch.Tensor, queries: int):
    """Prefill ids [1, T]: (the bf16 cache as a KVBuffer, each layer's last `queries` queries after RoPE
    [Hq, queries, D], the last position's logits [vocab], the worst relative error of attention recomputed from those
    queries and the cache against the model's own attention output — the check that the queries are the model's)."""
    from transformers import DynamicCache

    spec_heads = model.config.num_attention_heads
    head_dim = getattr(model.config, "head_dim", None) or model.config.hidden_size // spec_heads
    t = ids.shape[1]
    q_out, o_in, hooks = {}, {}, []
    for i, layer in enumerate(model.model.layers):
        hooks.append(layer.self_attn.q_proj.register_forward_hook(
            lambda m, a, out, i=i: q_out.__setitem__(i, out[:, -queries:].detach())))
        hooks.append(layer.self_attn.o_proj.register_forward_pre_hook(
            lambda m, a, i=i: o_in.__setitem__(i, a[0][:, -queries:].detach())))
    try:
        cache = DynamicCache()
        logits = model(input_ids=ids, **{cache_kw(model): cache}, use_cache=True).logits[0, -1].float()
    finally:
        for h in hooks:
            h.remove()
    buf = KVBuffer.from_hf_cache(cache)
    apply, rotary = _rope(model)
    pos = torch.arange(t - queries, t, device=ids.device)[None]
    qs, worst = [], 0.0
    for i in range(len(model.model.layers)):
        q = q_out[i].reshape(1, queries, spec_heads, head_dim).transpose(1, 2)
        cos, sin = rotary(q, pos)
        q, _ = apply(q, q, cos, sin)
        qs.append(q[0])
        k, v = buf.layer(i)
        o = causal_attention(q[0].float(), k[0].float(), v[0].float())  # [Hq, queries, D], as the metric computes it
        mine = o.transpose(0, 1).reshape(1, queries, -1)
        ref = o_in[i].float()
        worst = max(worst, float((mine - ref).norm() / ref.norm()))
    return buf, qs, logits, worst


def _nudged(buf: KVBuffer, seed: int) -> KVBuffer:
    """`buf` with one bf16 ulp added to or taken from ULP_SHARE of its elements (seeded): the noise floor's cache."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    bits = buf.data.view(torch.int16)
    pick = (torch.rand(bits.shape, generator=gen) < ULP_SHARE).to(bits.device) & torch.isfinite(buf.data)
    step = (torch.randint(0, 2, bits.shape, generator=gen, dtype=torch.int32) * 2 - 1).to(bits.device)
    # the magnitude moves one step, the sign stays: a zero stays zero or becomes the smallest subnormal, the largest
    # finite value never becomes infinite, nothing becomes NaN
    b = bits.to(torch.int32) & 0xFFFF
    mag = torch.where(pick, ((b & 0x7FFF) + step).clamp(0, 0x7F7F), b & 0x7FFF)  # only the picked ones move
    new = (b & 0x8000) | mag
    bits.copy_(torch.where(new >= 0x8000, new - 0x10000, new).to(torch.int16))
    return buf


def _through_pools(buf: KVBuffer, cfg: Config, mode: str | None, static, seed: int) -> tuple[KVBuffer, int]:
    """`buf`'s cache as decode reads it after the wire: written into a paged bf16 pool (blocks drawn at random), sent
    as FP8 with `mode`'s scales (None: bf16, a copy of the blocks; ULP: that copy nudged by one ulp, the noise floor)
    into a poisoned pool, read back. Returns (the cache that arrived, the bytes that crossed). A poisoned element
    left is an error: the send did not complete."""
    pool, table = BlockPool.from_kv_buffer(buf, cfg.block_size, layout=cfg.layout, seed=seed)
    dst = BlockPool(pool.spec, table.num_blocks, device=pool.device).poison()
    dst_table = BlockTable.packed(table.tokens, cfg.block_size)
    if mode in (None, ULP):
        blocks = pool.data.index_select(2, table.tensor(pool.device))
        dst.data.index_copy_(2, dst_table.tensor(dst.device), blocks)
        sent = blocks.numel() * blocks.element_size()
    else:
        packet = quantize_gather_reference(pool, table, mode, static)
        dequantize_scatter_reference(packet, dst, dst_table)
        sent = packet.nbytes
    got = dst.read(dst_table)
    if mode is None and not torch.equal(got.data.view(torch.int16), buf.data.view(torch.int16)):
        raise RuntimeError("the bf16 cache that crossed the pools is not the prefill's byte for byte; the pools are "
                           "not lossless")
    left = got.count_poison()  # before the noise floor's nudge, which must not hide a send that did not complete
    if left:
        raise RuntimeError(f"{left} elements of the arrived cache are still poison: the {mode or 'bf16'} send did not "
                           "complete")
    if mode == ULP:
        got = _nudged(got, seed)
    return got, sent


def _batched(bufs: list[KVBuffer]):
    """One DynamicCache of batch len(bufs) holding each buffer's cache (a copy: decode appends to it)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    for i in range(bufs[0].layout.layers):
        k = torch.cat([b.layer(i)[0] for b in bufs]).clone()
        v = torch.cat([b.layer(i)[1] for b in bufs]).clone()
        cache.update(k, v, i)
    return cache


@torch.inference_mode()
def _forced(model, bufs: list[KVBuffer], inputs: torch.Tensor) -> torch.Tensor:
    """Log-probabilities [P, N, vocab] of one pass over inputs [P, N] on top of the caches (teacher-forced)."""
    logits = model(input_ids=inputs, **{cache_kw(model): _batched(bufs)}, use_cache=True).logits
    return torch.log_softmax(logits.float(), -1)


@torch.inference_mode()
def _greedy(model, bufs: list[KVBuffer], first: torch.Tensor, steps: int, bar) -> torch.Tensor:
    """Free-running greedy decode: from first [P] (prefill's token) on top of the caches, `steps` tokens [P, steps]
    (`bar` counts them)."""
    cache = _batched(bufs)
    token, out = first[:, None], []
    for _ in range(steps):
        logits = model(input_ids=token, **{cache_kw(model): cache}, use_cache=True).logits[:, -1]
        token = logits.argmax(-1, keepdim=True)
        out.append(token)
        bar.update(1)
    return torch.cat(out, 1)


def _model(cfg: Config, weights: str):
    if weights == "trained":
        return models.build(str(cfg.folder), weights=str(cfg.folder), device=cfg.device, dtype="bfloat16")
    return models.build(str(cfg.folder / "config.json"), weights="random", device=cfg.device, dtype="bfloat16",
                        seed=cfg.seed)


def measure(cfg: Config, run: Run) -> None:
    """Per weights (a progress bar over the prefills and greedy decode steps): each prompt prefilled in bf16, its
    cache through the pools in bf16 and as FP8 with each scale mode, then decoded from each. Raw tables:
    prompts.csv (one row per weights, wire, scales and prompt: matches, first divergence, log-likelihoods, bytes)
    and layers.csv (one row per weights, scales, prompt, layer and side: the cache's and the attention output's
    relative errors)."""
    run.update(resolved=cfg.resolved())
    held, train = _text(cfg.folder, "heldout.txt.gz"), _text(cfg.folder, "train.txt.gz")
    span = cfg.context + cfg.tokens + 1
    starts = np.linspace(0, held.size - span, cfg.prompts).astype(np.int64)
    windows = torch.from_numpy(np.stack([held[s:s + span] for s in starts]).astype(np.int64)).to(cfg.device)
    calib = torch.from_numpy(train[:cfg.context].astype(np.int64))[None].to(cfg.device)
    queries = min(QUERIES, cfg.context)
    rows, layer_rows, checks, self_agree = [], [], {}, {}
    # what takes the time: the prefills, then per weights the greedy decodes (the reference, the bf16 control, each mode)
    bar = tqdm(total=len(cfg.weights) * (cfg.prompts + (3 + len(cfg.scales)) * cfg.tokens), desc="wire accuracy",
               unit="step")
    for weights in cfg.weights:
        model = _model(cfg, weights)
        cal_buf = _prefill(model, calib, queries)[0]
        statics = {m: calibrate_scales(cal_buf, m) for m in cfg.scales if m != "per-token-head"}
        bufs, qs, first, worst = [], [], [], 0.0
        for p in range(cfg.prompts):
            buf, q, logits, err = _prefill(model, windows[p:p + 1, :cfg.context], queries)
            bufs.append(buf), qs.append(q), first.append(int(logits.argmax()))
            worst = max(worst, err)
            bar.update(1)
        checks[weights] = worst
        if worst > QUERY_CHECK:  # the attention-output error would be of some other attention than the model's
            raise RuntimeError(f"{weights} weights: attention recomputed from the captured queries is {worst:.3g} "
                               f"off the model's own (more than {QUERY_CHECK}); this model's attention is not the "
                               "plain RoPE attention the metric assumes")
        first_t = torch.tensor(first, device=cfg.device)
        truth = windows[:, cfg.context:]                     # c_0 … c_N: the held-out bytes after each prompt
        # the reference: decode from the prefill's own cache (colocated); bf16 through the pools must equal it
        ref_greedy = _greedy(model, bufs, first_t, cfg.tokens, bar)
        forced_in = torch.cat([first_t[:, None], ref_greedy[:, :-1]], 1)
        ref_forced = _forced(model, bufs, forced_in).argmax(-1)
        ref_lp = _forced(model, bufs, truth[:, :-1])
        ref_nll = -ref_lp.gather(-1, truth[:, 1:, None])[..., 0].double().sum(1)
        # bf16 against itself: its teacher-forced argmax over its own greedy tokens (the two ways of decoding)
        self_agree[weights] = 100 * float((ref_forced == ref_greedy).double().mean())
        for mode in (None, ULP, *cfg.scales):
            arrived = [_through_pools(b, cfg, mode, statics.get(mode), cfg.seed + p) for p, b in enumerate(bufs)]
            got = [a for a, _ in arrived]
            greedy = _greedy(model, got, first_t, cfg.tokens, bar)
            forced = _forced(model, got, forced_in).argmax(-1)
            lp = _forced(model, got, truth[:, :-1])
            nll = -lp.gather(-1, truth[:, 1:, None])[..., 0].double().sum(1)
            for p in range(cfg.prompts):
                same = (greedy[p] == ref_greedy[p]).cpu().numpy()
                rows.append({"weights": weights, "wire_dtype": {None: "bf16", ULP: ULP}.get(mode, "fp8"),
                             "scales": "none" if mode in (None, ULP) else mode, "prompt": p, "start": int(starts[p]), "tokens": cfg.tokens,
                             "free_matches": int(same.sum()),
                             "first_divergence": int(np.argmin(same)) if not same.all() else cfg.tokens,
                             "forced_matches": int((forced[p] == ref_forced[p]).sum()),
                             "nll_bf16": float(ref_nll[p]), "nll_wire": float(nll[p]),
                             "bytes": int(arrived[p][1]), "bf16_bytes": int(bufs[p].nbytes)})
                if mode is None:
                    continue
                ref, deq, mode_label = bufs[p], got[p], mode
                for e in kv_rel_err(ref, deq):
                    layer_rows.append({"weights": weights, "scales": mode_label, "prompt": p, "layer": e["layer"],
                                       "what": e["side"], "max_rel_err": e["max_rel_err"],
                                       "norm_rel_err": e["norm_rel_err"]})
                for i in range(ref.layout.layers):
                    (kr, vr), (kd, vd) = ref.layer(i), deq.layer(i)
                    e = attn_out_rel_err(qs[p][i], kr[0], vr[0], kd[0], vd[0])
                    layer_rows.append({"weights": weights, "scales": mode_label, "prompt": p, "layer": i,
                                       "what": "attention output", "max_rel_err": e["max_rel_err"],
                                       "norm_rel_err": e["norm_rel_err"]})
            if mode is None and not (greedy.equal(ref_greedy) and forced.equal(ref_forced) and nll.equal(ref_nll)):
                raise RuntimeError(f"{weights} weights: decode from the bf16 cache that crossed the pools differs from "
                                   "decode from the prefill's own cache; the pools are not lossless")
        del model
    bar.close()
    run.update(query_check_rel_err=checks, bf16_forced_vs_greedy_pct=self_agree)
    run.save_table(pd.DataFrame(rows), "prompts")
    run.save_table(pd.DataFrame(layer_rows), "layers")


# ---------------------------------------------------------------------------------------------------- analysis


def _pct_ci(shares) -> tuple[float, float]:
    lo, hi = mean_ci(shares)
    return 100 * lo, 100 * hi


def summarise(prompts: pd.DataFrame, layers: pd.DataFrame) -> pd.DataFrame:
    """Per (weights, wire_dtype, scales): the issue's wire_accuracy table — tokens, token_agreement (free-running, a
    share), ppl_bf16 and ppl_wire (pooled over the prompts' held-out bytes), kv_max_rel_err — and the goals' columns:
    free_agreement_pct and forced_agreement_pct with their intervals over prompts (free_lo/hi, forced_lo/hi),
    ppl_excess_pct = 100 · |ppl_wire ÷ ppl_bf16 − 1| with its interval (ppl_lo/hi), the median first divergence,
    bytes that crossed against bf16's."""
    out = []
    for (w, dt, sc), g in prompts.groupby(["weights", "wire_dtype", "scales"], sort=False):
        n = int(g["tokens"].iloc[0])
        free, forced = g["free_matches"] / n, g["forced_matches"] / n
        d = (g["nll_wire"] - g["nll_bf16"]) / n              # per prompt: the mean log-likelihood lost a token
        d_lo, d_hi = mean_ci(d)
        lo_x, hi_x = 100 * (math.exp(d_lo) - 1), 100 * (math.exp(d_hi) - 1)
        excess_lo = 0.0 if lo_x <= 0 <= hi_x else min(abs(lo_x), abs(hi_x))
        ppl_b = math.exp(g["nll_bf16"].sum() / (n * len(g)))
        ppl_w = math.exp(g["nll_wire"].sum() / (n * len(g)))
        key = dt if dt == ULP else sc  # the noise floor's layer rows go by its name
        kv = layers[(layers["weights"] == w) & (layers["scales"] == key) & layers["what"].isin(["K", "V"])]
        out.append({"weights": w, "wire_dtype": dt, "scales": sc, "tokens": n, "prompts": len(g),
                    "token_agreement": float(free.mean()),
                    "free_agreement_pct": 100 * float(free.mean()), **dict(zip(("free_lo", "free_hi"), _pct_ci(free))),
                    "forced_agreement_pct": 100 * float(forced.mean()),
                    **dict(zip(("forced_lo", "forced_hi"), _pct_ci(forced))),
                    "first_divergence_median": float(g["first_divergence"].median()),
                    "ppl_bf16": ppl_b, "ppl_wire": ppl_w, "ppl_excess_pct": 100 * abs(ppl_w / ppl_b - 1),
                    "ppl_lo": excess_lo, "ppl_hi": max(abs(lo_x), abs(hi_x)),
                    "kv_max_rel_err": float(kv["max_rel_err"].max()) if len(kv) else 0.0,
                    "kv_norm_rel_err": float(kv["norm_rel_err"].mean()) if len(kv) else 0.0,
                    "bytes": int(g["bytes"].iloc[0]), "bf16_bytes": int(g["bf16_bytes"].iloc[0]),
                    "bytes_ratio": float(g["bytes"].iloc[0] / g["bf16_bytes"].iloc[0])})
    return pd.DataFrame(out)


def layer_table(layers: pd.DataFrame) -> pd.DataFrame:
    """Per (weights, scales, layer): the issue's wire_layers table — kv_rel_err (the K and V sides' ‖error‖ ÷ ‖bf16‖,
    averaged over prompts and the two sides) and attn_out_rel_err (the attention output's, averaged over prompts) —
    with the worst element's error beside each."""
    kv = layers[layers["what"].isin(["K", "V"])].groupby(["weights", "scales", "layer"], sort=False)
    at = layers[layers["what"] == "attention output"].groupby(["weights", "scales", "layer"], sort=False)
    t = pd.DataFrame({"kv_rel_err": kv["norm_rel_err"].mean(), "kv_max_rel_err": kv["max_rel_err"].max(),
                      "attn_out_rel_err": at["norm_rel_err"].mean(), "attn_out_max_rel_err": at["max_rel_err"].max()})
    return t.reset_index()


def _wire_label(wire_dtype: str, scales: str) -> str:
    if wire_dtype == "bf16":
        return "bf16 through the same pools (the control)"
    if wire_dtype == ULP:
        return f"bf16 with one ulp on {100 * ULP_SHARE:.0f} % of its elements (the noise floor)"
    return f"FP8, {scales} scales"


def analyse(record: dict, tables: dict) -> Analysis:
    """The accuracy table per weights and scale mode, the per-layer errors, the goals (by those in force when the run
    started) and a finding per row."""
    s = summarise(tables["prompts"], tables["layers"])
    lt = layer_table(tables["layers"])
    g = goals.evaluate_run(NAME, record, s, keys=("weights", "wire_dtype", "scales"))
    res = record.get("resolved") or {}
    findings, values = [], {}
    for r in s.itertuples():
        label = "random weights (weak evidence: their output barely depends on the cache)" if r.weights == "random" \
            else "trained weights"
        what = _wire_label(r.wire_dtype, r.scales)
        findings.append(
            f"- {label}, {what}: greedy agreement {r.free_agreement_pct:.2f} % [{r.free_lo:.2f}, {r.free_hi:.2f}] "
            f"free-running (median first difference at position {r.first_divergence_median:.0f} of {r.tokens}), "
            f"{r.forced_agreement_pct:.2f} % teacher-forced; perplexity {sig(r.ppl_wire, 4)} against bf16's "
            f"{sig(r.ppl_bf16, 4)} ({r.ppl_excess_pct:.3f} % apart, [{r.ppl_lo:.3f}, {r.ppl_hi:.3f}]); worst element "
            f"of the cache {sig(r.kv_max_rel_err)} off; {r.bytes_ratio:.3f}× the bf16 bytes.")
        values[f"{r.weights}.{r.scales if r.wire_dtype == 'fp8' else r.wire_dtype}.agreement"] = \
            f"{r.free_agreement_pct:.2f} %"
    findings.append(f"- {res.get('prompts', '?')} prompts of {res.get('context', '?')} held-out bytes each, "
                    f"{res.get('tokens', '?')} positions decoded after each, on {res.get('device', '?')}.")
    for w, pct in (record.get("bf16_forced_vs_greedy_pct") or {}).items():
        findings.append(f"- {w} weights, bf16 against itself: its one-pass (teacher-forced) argmax equals its own "
                        f"step-by-step greedy token at {pct:.2f} % of positions — the two ways of decoding differ in "
                        "rounding alone.")
    return Analysis(NAME, record, raw=dict(tables), tables={"wire_accuracy": s, "wire_layers": lt}, goals=g,
                    findings=findings, values=values)


def goal_table(a: Analysis, study: str) -> pd.DataFrame:
    """The accuracy goals of run `a`, as the verdicts table shows them (`mode` says which row)."""
    g = a.goals.copy()
    if len(g):
        g["mode"] = g["weights"] + " weights, " + g["scales"]
    return g


def figures(a: Analysis) -> dict:
    """Left: greedy agreement with bf16 (free-running and teacher-forced) per scale mode, trained and random weights,
    with 95 % intervals; right: each layer's attention-output error with the wire's K and V (trained weights)."""
    import matplotlib.pyplot as plt  # matplotlib only when a figure is drawn

    s = a.tables["wire_accuracy"]
    if (s["wire_dtype"] == "fp8").sum() == 0:
        raise ValueError("the run sent nothing as FP8, so there is nothing to draw")
    # the FP8 modes and, where the run has it, the noise floor (drawn grey, under its own name)
    fp8 = s[s["wire_dtype"].isin(["fp8", ULP])].assign(
        scales=lambda t: t["scales"].where(t["wire_dtype"] == "fp8", ULP))
    lt = a.tables["wire_layers"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9.4, 4.6), layout="constrained")
    modes = list(dict.fromkeys(fp8["scales"]))
    colors = {**plots.palette([m for m in modes if m != ULP]), ULP: "#8C8C8C"}
    label = lambda m: "bf16 ± 1 ulp (noise floor)" if m == ULP else f"{m} scales"  # noqa: E731
    bars = [(w, how) for w in dict.fromkeys(fp8["weights"]) for how in ("free", "forced")]
    width = 0.8 / len(modes)
    for k, mode in enumerate(modes):
        xs, v, lo, hi = [], [], [], []
        for i, (w, how) in enumerate(bars):
            row = fp8[(fp8["weights"] == w) & (fp8["scales"] == mode)]
            if row.empty:
                continue
            r = row.iloc[0]
            m, a_lo, a_hi = r[f"{how}_agreement_pct"], r[f"{how}_lo"], r[f"{how}_hi"]
            xs.append(i + (k - (len(modes) - 1) / 2) * width)
            v.append(m), lo.append(m - a_lo), hi.append(a_hi - m)
        left.bar(xs, v, width * 0.9, yerr=[lo, hi], capsize=2.5, color=colors[mode], label=label(mode))
    left.set_xticks(range(len(bars)), [f"{w}\n{'free-running' if how == 'free' else 'forced'}"
                                       for w, how in bars], fontsize=9)
    left.set_xlabel("weights, and how agreement is counted (forced: fed bf16's tokens)", fontsize=9)
    trained_bars = [i for i, (w, _) in enumerate(bars) if w == "trained"] or [0]
    left.hlines(99, min(trained_bars) - 0.45, max(trained_bars) + 0.45, color="0.3", ls="--", lw=1)  # the goal
    left.annotate("goal: 99 %", (-0.45, 99), xytext=(0, -3), textcoords="offset points", fontsize=8.5, ha="left",
                  va="top", color="0.3")
    left.set_ylabel("tokens equal to bf16's greedy tokens (%)")
    left.set_ylim(max(0.0, min(v for v in fp8[["free_lo", "forced_lo"]].min()) - 5), 101)
    left.set_xlim(-0.5, len(bars) - 0.5)  # the scale modes' colours: the right panel's legend
    left.set_title("Greedy agreement with the bf16 cache")
    trained = lt[lt["weights"] == "trained"] if (lt["weights"] == "trained").any() else lt
    for mode in modes:
        t = trained[trained["scales"] == mode]
        right.plot(t["layer"], 100 * t["attn_out_rel_err"], marker="o", color=colors[mode], label=label(mode))
        right.plot(t["layer"], 100 * t["kv_rel_err"], marker="s", ls=":", color=colors[mode])
    right.set_xlabel("layer")
    right.set_ylabel("relative error (%)")
    right.set_xticks(sorted(trained["layer"].unique()))
    right.set_title(f"Error per layer, {trained['weights'].iloc[0]} weights:\nattention output (solid), K and V (dotted)",
                    fontsize=11)
    right.legend(fontsize=8.5, frameon=False, loc="lower right", bbox_to_anchor=(1.0, 0.12))  # between the lines
    res = a.record.get("resolved") or {}
    fig.suptitle(f"What an FP8 wire does to decoding: {res.get('prompts', '?')} prompts of "
                 f"{res.get('context', '?')} held-out bytes, {res.get('tokens', '?')} positions each", fontsize=12)
    return {"wire_accuracy": fig}


def _table(analyses: list[Analysis], link, **_) -> str:
    """Per run, weights and wire: agreement (free-running, teacher-forced) with intervals, perplexity, cache error,
    bytes."""
    rows = []
    for a in analyses:
        for r in a.tables["wire_accuracy"].itertuples():
            rows.append({"run": link(a.where), "weights": r.weights if r.weights == "trained" else "random (weak evidence)",
                         "wire": {"bf16": "bf16 (control)", ULP: "bf16 ± 1 ulp (noise floor)"}.get(
                             r.wire_dtype, f"FP8, {r.scales}"),
                         "greedy agreement, free-running % [95 %]": f"{r.free_agreement_pct:.2f} [{r.free_lo:.2f}, {r.free_hi:.2f}]",
                         "first difference (median position)": f"{r.first_divergence_median:.0f} of {r.tokens}",
                         "teacher-forced % [95 %]": f"{r.forced_agreement_pct:.2f} [{r.forced_lo:.2f}, {r.forced_hi:.2f}]",
                         "perplexity bf16 → wire": f"{sig(r.ppl_bf16, 4)} → {sig(r.ppl_wire, 4)}",
                         "apart % [95 %]": f"{r.ppl_excess_pct:.3f} [{r.ppl_lo:.3f}, {r.ppl_hi:.3f}]",
                         "worst cache element off": sig(r.kv_max_rel_err), "bytes ÷ bf16": f"{r.bytes_ratio:.3f}"})
    return md_table(pd.DataFrame(rows))


BLOCKS = {"table": _table}
