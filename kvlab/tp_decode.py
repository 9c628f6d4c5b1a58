"""Decode with tensor parallelism on the decode side: D ranks decode one sequence together, each holding its shard
of the weights and of the KV cache (the shard kvlab.paged.reshard moved to it), their collectives over torch.distributed
(gloo on a CPU; NCCL across GPUs).

How a model is split (`shard_model`):
- "transformers": the model class's own tensor-parallel plan (`model.tp_plan`: q/k/v, gate/up column-parallel, o and
  down row-parallel with an all-reduce, the embedding vocabulary-parallel, lm_head column-parallel and gathered),
  applied with transformers' `apply_tensor_parallelism` on a DeviceMesh over the process group. Used where the class
  has a plan and D divides both the query and the KV heads (a column split of k_proj cannot replicate a head).
- "kvlab": kvlab's own split, for the rest (KV heads < D): each rank keeps query heads [r·H/D, (r+1)·H/D) and the KV
  heads kvlab.paged.reshard.plan gives decode rank r (sharded, or one head replicated), o_proj's matching input columns;
  gate/up keep rows [r·I/D, (r+1)·I/D), down_proj the matching columns; o_proj and down_proj are row-parallel
  (`RowParallel`: a local matmul, an all-reduce, the bias once); embedding, norms and lm_head are replicated.
"auto" picks the first that applies. Both keep transformers' attention: it reshapes with -1 heads, so a layer with
fewer heads needs only its projections and its `num_key_value_groups` changed.

`run` is the whole CPU check: one process prefills (the prefill side, which also decodes colocated for the
reference), splits its cache into P prefill pools, re-shards them into D decode pools with a kvlab.paged.reshard method
(verified bit for bit), then D new processes (forked for gloo, spawned for NCCL) — each with its own copy of the
model, built from the same config and seed (kvlab.models.build) — read their pools and decode `steps` tokens
together. The pass rule: tokens equal to the colocated decode at every step, logits within `logits_tolerance`, every
shard byte-exact, no poison left.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from . import models
from .paged import reshard, reshard_movers
from .kvcache import KVBuffer, layout_for
from .paged import BlockPool, BlockTable, PoolSpec
from .steps import decode, make_prompt, model_device, prefill, text_config

__all__ = ["IMPLS", "RowParallel", "transformers_supported", "shard_model", "logits_tolerance", "compare", "check_pair", "run", "run_ranks"]

IMPLS = ("auto", "transformers", "kvlab")


class RowParallel(nn.Module):
    """A row-parallel linear layer: this rank's input columns [lo, hi) of `linear`'s weight; forward = local matmul,
    all-reduce (sum) over `group`, then the bias, added once. Input [..., hi - lo], output [..., out_features]."""

    def __init__(self, linear: nn.Linear, lo: int, hi: int, group=None):
        super().__init__()
        self.weight = nn.Parameter(linear.weight.detach()[:, lo:hi].clone(), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = nn.functional.linear(x, self.weight)
        dist.all_reduce(y, group=self.group)
        return y if self.bias is None else y + self.bias


def _rows(linear: nn.Linear, lo: int, hi: int) -> nn.Linear:
    """A column-parallel slice: output features [lo, hi) of `linear` (weight rows and bias)."""
    out = nn.Linear(linear.in_features, hi - lo, bias=linear.bias is not None, device=linear.weight.device,
                    dtype=linear.weight.dtype)
    with torch.no_grad():
        out.weight.copy_(linear.weight[lo:hi])
        if linear.bias is not None:
            out.bias.copy_(linear.bias[lo:hi])
    return out.requires_grad_(False)


def _shape(model) -> tuple[int, int, int, int]:
    cfg = text_config(model)
    heads = cfg.num_attention_heads
    return heads, getattr(cfg, "num_key_value_heads", None) or heads, getattr(cfg, "head_dim", None) or \
        cfg.hidden_size // heads, cfg.intermediate_size


def _tp_api() -> str | None:
    """None where transformers' apply_tensor_parallelism(model, tp_mesh, tp_plan) shards a built model's weights as
    kvlab calls it (transformers 5.2x); else why not. transformers 5.17 (the GPU image's) has
    apply_tensor_parallelism(model, tp_mesh): it makes placeholders for a checkpoint loader to fill, which would
    drop the weights a random-weight model already holds."""
    import inspect

    import transformers
    from transformers.integrations import tensor_parallel

    fn = getattr(tensor_parallel, "apply_tensor_parallelism", None)
    if fn is None or "tp_plan" not in inspect.signature(fn).parameters:
        return (f"transformers {transformers.__version__} has no apply_tensor_parallelism(model, tp_mesh, tp_plan) "
                "that shards a built model's weights")
    return None


def transformers_supported(model, decode_tp: int) -> tuple[bool, str]:
    """Can transformers' own tensor-parallel plan split `model` over `decode_tp` ranks? Returns (ok, why)."""
    heads, kv, _, _ = _shape(model)
    takes = _tp_api()
    if takes is not None:
        return False, takes
    if not getattr(model, "supports_tp_plan", False) or not model.tp_plan:
        return False, f"{type(model).__name__} has no tensor-parallel plan in transformers"
    if heads % decode_tp or kv % decode_tp:
        return False, (f"decode_tp={decode_tp} does not divide {heads} query and {kv} KV heads: a column split of "
                       "k_proj would cut a head, and kvlab's split replicates it instead")
    return True, "transformers tp_plan"


def _expand(model, plan: dict) -> dict:
    """The plan's wildcard rules (`model.layers.*.self_attn.q_proj`) for this model's own module names, each module's
    parameters before the module itself (apply_tensor_parallelism shards the parameters, then hooks the module)."""
    rules = [(re.compile(re.escape(k).replace(r"\*", r"\d+")), v) for k, v in plan.items()]
    out = {}
    for name, mod in model.named_modules():
        style = next((v for rx, v in rules if rx.fullmatch(name)), None)
        if style is not None:
            out.update({f"{name}.{p}": style for p, _ in mod.named_parameters(recurse=False)})
            out[name] = style
    return out


def _kvlab_split(model, tp: int, rank: int, group) -> None:
    heads, kv, hd, inter = _shape(model)
    if inter % tp:
        raise ValueError(f"decode_tp={tp} does not divide intermediate_size={inter}: kvlab's MLP split needs it to")
    spec = models.from_hf_config(text_config(model))
    k0, k1 = reshard.plan(spec, tp, tp).dst_global[rank]  # the KV heads the re-shard hands this decode rank
    q0, q1 = rank * heads // tp, (rank + 1) * heads // tp
    m0, m1 = rank * inter // tp, (rank + 1) * inter // tp
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        if not all(isinstance(getattr(attn, n, None), nn.Linear) for n in ("q_proj", "k_proj", "v_proj", "o_proj")) \
                or not all(isinstance(getattr(mlp, n, None), nn.Linear) for n in ("gate_proj", "up_proj", "down_proj")):
            raise ValueError(f"layer {i} of {type(model).__name__} is not q/k/v/o attention with a gate/up/down MLP: "
                             "kvlab's split does not know it (MoE and MLA layers are not split)")
        attn.q_proj = _rows(attn.q_proj, q0 * hd, q1 * hd)
        attn.k_proj = _rows(attn.k_proj, k0 * hd, k1 * hd)
        attn.v_proj = _rows(attn.v_proj, k0 * hd, k1 * hd)
        attn.o_proj = RowParallel(attn.o_proj, q0 * hd, q1 * hd, group)
        attn.num_key_value_groups = (q1 - q0) // (k1 - k0)  # local query heads per local KV head (GQA repeat)
        mlp.gate_proj, mlp.up_proj = _rows(mlp.gate_proj, m0, m1), _rows(mlp.up_proj, m0, m1)
        mlp.down_proj = RowParallel(mlp.down_proj, m0, m1, group)


def shard_model(model, group=None, impl: str = "auto") -> str:
    """Split `model` in place for this rank of `group` (default: the whole world; torch.distributed initialised).

    impl: "auto" | "transformers" | "kvlab" (see the module doc). Returns the split used ("none" for one rank).
    ValueError: an unknown impl, "transformers" where it does not apply, a model kvlab's split does not know.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl {impl!r} is not valid; use one of {list(IMPLS)}")
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    if tp == 1:
        return "none"
    ok, why = transformers_supported(model, tp)
    if impl == "transformers" and not ok:
        raise ValueError(f"impl='transformers' does not apply: {why}")
    if impl == "kvlab" or not ok:
        _kvlab_split(model, tp, rank, group)
        return "kvlab"
    from torch.distributed.device_mesh import DeviceMesh
    from transformers.integrations.tensor_parallel import apply_tensor_parallelism

    mesh = DeviceMesh.from_group(group or dist.group.WORLD, model_device(model).type)
    apply_tensor_parallelism(model, mesh, _expand(model, model.tp_plan))
    return "transformers"


def logits_tolerance(model, context: int, steps: int, dtype: torch.dtype | None = None) -> tuple[float, str]:
    """The largest |logit(TP decode) − logit(colocated decode)| the reduction order can explain; (atol, the rule).

    What differs: TP changes the order of floating-point sums, nothing else — a row-parallel layer (o_proj,
    down_proj) sums D partial sums of K/D terms in the all-reduce instead of one K-term sum, and every narrower
    matmul or attention over fewer heads may be blocked differently by the CPU's kernels. Higham's bound for any
    order of an n-term sum: |fl(Σ x_i) − Σ x_i| ≤ γ_(n−1) Σ|x_i|, γ_n = n·u / (1 − n·u), u the unit roundoff
    (2^-24 in fp32); two orders differ by at most 2·γ_n Σ|x_i|, taken with n = K, the longest sum on a token's path
    (hidden, heads·head_dim, intermediate, head_dim, or the context + steps an attention averages over).
    Sums whose order TP may change, per layer: q, k, v, QKᵀ, the softmax's sum, P·V, o, gate, up, down (10), plus
    k and v once more for the cached tokens the earlier steps wrote (2); then lm_head: R = 12·layers + 1.
    First order, each such perturbation reaches the final normalised state n = g ⊙ h / rms(h) with a gain of at
    most 1 relative to ‖n‖ (an assumption, not a theorem: it holds when no sublayer's terms outgrow the residual
    stream, as with kvlab's seeded random weights; a trained model with outlier activations can exceed it). Then
    |Δlogit_j| ≤ ‖W_j‖₂ ‖Δn‖₂ ≤ 2·γ_K·R · max|g| · √hidden · max_j ‖W_j‖₂ (‖n‖₂ ≤ max|g|·√hidden): that is atol.
    kvlab-tiny in fp32 over 128 + 20 tokens: K = 148, R = 25, atol ≈ 7e-4 for logits of ~0.5; its TP decodes
    measured on a CPU differ by 1–2e-7, far inside it (the bound is worst case; random rounding errors mostly cancel).
    What it still catches (kvlab-tiny, measured): two KV heads swapped move the logits by 0.87, one token's V of one
    head in one layer zeroed by 3e-3; a 1e-3 nudge of one token's K and V moves them by 4e-5, inside the tolerance —
    small corruptions of the cache are what the byte-exact shard check (kvlab.paged.reshard.verify) is for.
    """
    cfg = text_config(model)
    heads, _, hd, inter = _shape(model)
    dtype = dtype or next(model.parameters()).dtype
    u = torch.finfo(dtype).eps / 2
    k = max(cfg.hidden_size, heads * hd, inter, hd, context + steps)
    if k * u >= 0.1:  # Higham's γ_k needs k·u ≪ 1: in bf16 (u = 2^-9) past ~50 terms the bound says nothing
        raise ValueError(f"a {dtype} decode sums up to {k:,} terms: the reduction-order bound needs k·u < 0.1 (here "
                         f"{k * u:.2f}); decode in float32")
    gamma = k * u / (1 - k * u)
    r = 12 * cfg.num_hidden_layers + 1
    g = float(model.model.norm.weight.detach().abs().max())
    w = float(model.get_output_embeddings().weight.detach().float().norm(dim=1).max())
    atol = 2 * gamma * r * g * math.sqrt(cfg.hidden_size) * w
    rule = (f"|Δlogit| ≤ 2·γ_K·R·max|g|·√hidden·max‖W_lm‖ = 2·{gamma:.3g}·{r}·{g:.3g}·√{cfg.hidden_size}·"
            f"{w:.3g} = {atol:.3g} (K={k}, u={u:.3g}: reduction-order bound, kvlab.tp_decode.logits_tolerance)")
    return atol, rule


def compare(ref_tokens, ref_logits, tokens, logits, atol: float) -> dict:
    """Tokens equal at every step, logits within atol (the TP decode's pass rule, beside steps.correctness_check)."""
    same = bool(torch.equal(ref_tokens.cpu(), tokens.cpu()))
    diff = float((ref_logits.cpu() - logits.cpu()).abs().nan_to_num(float("inf")).max())
    return {"tokens_match": same, "logits_max_abs_diff": diff, "logits_tolerance": atol,
            "logits_within_tolerance": diff <= atol, "logits_equal": bool(torch.equal(ref_logits.cpu(), logits.cpu()))}


# ---------------------------------------------------------------------------------------------------
# the multi-process check


def _rank_main(rank: int, world: int, port: int, folder: str) -> None:
    """One decode rank (a process of its own): join the group, then `_decode_rank`."""
    job = json.loads((Path(folder) / "job.json").read_text())
    torch.set_num_threads(1)  # D processes share the host's cores
    dev = torch.device("cuda", rank) if job["backend"] == "nccl" else torch.device("cpu")
    dist.init_process_group(job["backend"], init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=job["timeout_s"]), device_id=dev if dev.type == "cuda" else None)
    try:
        _decode_rank(job, folder, rank, dev, split=True)
    finally:
        dist.destroy_process_group()


def _decode_rank(job: dict, folder: str, rank: int, dev: torch.device, split: bool) -> None:
    """Build the model (same config and seed as the prefill side), split it (split=False: one rank, no group),
    read this rank's pool as the re-shard wrote it, decode, save tokens, logits and the split used."""
    model = models.build(job["model"], device=dev, dtype=job["dtype"], seed=job["seed"])
    impl = shard_model(model, impl=job["impl"]) if split else "none"
    saved = torch.load(Path(folder) / f"pool{rank}.pt", weights_only=True)
    spec = PoolSpec(**{**saved["spec"], "dtype": getattr(torch, saved["spec"]["dtype"])})
    pool = BlockPool(spec, saved["data"].shape[2], data=saved["data"].to(dev))
    cache = pool.read(BlockTable(saved["ids"].numpy(), job["context"], spec.block_size))
    toks, logits = decode(model, cache, torch.tensor([job["first"]]), job["steps"])
    torch.save({"tokens": toks.cpu(), "logits": logits.cpu(), "impl": impl}, Path(folder) / f"out{rank}.pt")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_pair(model, prefill_tp: int, decode_tp: int, context: int = 128, steps: int = 20) -> reshard.Plan:
    """The re-shard plan of `model` from `prefill_tp` to `decode_tp` ranks, refused in one line (ValueError) where
    reshard.plan refuses it or the prompt and its steps pass the model's positions: what `run` checks first."""
    pl = reshard.plan(model, prefill_tp, decode_tp)
    if pl.spec.max_positions and context + steps > pl.spec.max_positions:
        raise ValueError(f"context={context} + steps={steps} exceeds {pl.model}'s {pl.spec.max_positions} positions")
    s = pl.spec
    if decode_tp > 1 and (s.attention == "mla" or s.is_moe or s.intermediate_size % decode_tp):
        raise ValueError(f"decode_tp={decode_tp}: {s.name} needs a split kvlab's TP decode does not make (MLA, MoE "
                         f"experts, or an intermediate_size of {s.intermediate_size:,} the ranks do not divide)")
    return pl


def run(model: str = "kvlab-tiny", prefill_tp: int = 1, decode_tp: int = 2, context: int = 128, steps: int = 20,
        src_layout: str = "hnd", dst_layout: str = "hnd", method: str = "fused", impl: str = "auto",
        block_size: int = 16, dtype: str = "float32", seed: int = 0, backend: str = "gloo",
        mover_backend: str = "auto", timeout_s: float = 120.0) -> dict:
    """Prefill here, re-shard P → D with `method`, decode in `decode_tp` new processes (one rank: here), compare.

    backend: "gloo" (CPU) or "nccl" (one GPU per decode rank; not run on kvlab's CPU machines). Returns a summary:
    prefill_tp, decode_tp, tokens_match (every rank), logits_max_abs_diff, logits_tolerance and its rule, shards_exact,
    poison_left, bytes_per_decode_rank, replica_bytes, pieces_per_decode_rank (counted by the mover), impl, method,
    passed and rule. Refused before any process starts: whatever reshard.plan refuses, an unknown method / impl /
    backend, NCCL with fewer GPUs than decode ranks, a context past the model's positions, impl="transformers" where
    it does not apply.
    """
    pl = check_pair(model, prefill_tp, decode_tp, context, steps)
    if method not in reshard.METHODS or impl not in IMPLS or backend not in ("gloo", "nccl"):
        raise ValueError(f"method={method!r}, impl={impl!r}, backend={backend!r}: valid methods "
                         f"{list(reshard.METHODS)}, impls {list(IMPLS)}, backends ['gloo', 'nccl']")
    if backend == "nccl" and torch.cuda.device_count() < decode_tp:
        raise ValueError(f"backend='nccl' needs one GPU per decode rank: decode_tp={decode_tp}, "
                         f"{torch.cuda.device_count()} GPU(s) here; use backend='gloo'")
    full = models.build(model, device="cpu", dtype=dtype, seed=seed)
    ok, why = transformers_supported(full, decode_tp)
    if impl == "transformers" and not ok and decode_tp > 1:
        raise ValueError(f"impl='transformers' does not apply to decode_tp={decode_tp}: {why}")
    ids = make_prompt(full.config.vocab_size, context, "cpu", seed=seed)
    buf = KVBuffer(layout_for(full, context, dtype=dtype))
    first = prefill(full, ids, buf).argmax(-1)
    ref_tokens, ref_logits = decode(full, buf, first, steps)
    atol, rule = logits_tolerance(full, context, steps)
    src = reshard.shard_pools(buf, pl, block_size, src_layout, seed=seed)
    dst = reshard.make_pools(pl, "decode", context, block_size, dst_layout, dtype, seed=seed)
    report = reshard_movers.move(method, pl, src, dst, backend=mover_backend)
    check = reshard.verify(pl, src, dst)
    acc = reshard.account(pl, context, dtype, method, block_size, src_layout, dst_layout)
    with tempfile.TemporaryDirectory(prefix="kvlab-tp-") as folder:
        job = {"model": model, "dtype": dtype, "seed": seed, "impl": impl, "context": context, "steps": steps,
               "first": int(first), "backend": backend, "timeout_s": timeout_s}
        (Path(folder) / "job.json").write_text(json.dumps(job))
        for r, (pool, table) in enumerate(dst):
            s = pool.spec
            torch.save({"data": pool.data, "ids": torch.from_numpy(table.ids.copy()), "spec": {
                "layers": s.layers, "block_size": s.block_size, "kv_heads": s.kv_heads, "head_dim": s.head_dim,
                "dtype": str(s.dtype).removeprefix("torch."), "layout": s.layout}}, Path(folder) / f"pool{r}.pt")
        if decode_tp == 1:  # one decode rank needs no collectives: it decodes here, from its own pool all the same
            _decode_rank(job, folder, 0, torch.device("cpu"), split=False)
            outs = [torch.load(Path(folder) / "out0.pt", weights_only=True)]
        else:
            # gloo ranks fork (the children start with torch and transformers already imported: ~6 s each saved on
            # a CPU); CUDA cannot be forked, so NCCL ranks are spawned
            outs = _spawn(decode_tp, folder, timeout_s, "fork" if backend == "gloo" and os.name == "posix" else "spawn")
    rows = [compare(ref_tokens, ref_logits, o["tokens"], o["logits"], atol) for o in outs]
    agree = all(torch.equal(outs[0]["tokens"], o["tokens"]) for o in outs)
    poison = sum(v["poison_left"] for v in check["ranks"].values())
    out = {"prefill_tp": prefill_tp, "decode_tp": decode_tp, "model": model, "context": context, "steps": steps,
           "method": method, "mover_backend": report["backend"], "impl": outs[0]["impl"],
           "tokens_match": all(r["tokens_match"] for r in rows) and agree,
           "logits_max_abs_diff": max(r["logits_max_abs_diff"] for r in rows), "logits_tolerance": atol,
           "logits_within_tolerance": all(r["logits_within_tolerance"] for r in rows),
           "logits_equal": all(r["logits_equal"] for r in rows), "tolerance_rule": rule,
           "shards_exact": check["ok"], "poison_left": poison, **{k: v for k, v in acc.as_dict().items() if k in (
               "bytes_per_decode_rank", "replica_bytes", "block_bytes_per_decode_rank")},
           "pieces_per_decode_rank": [report["pieces_per_decode_rank"][r] for r in range(decode_tp)],
           "pieces_accounted": list(acc.pieces_per_decode_rank), "notes": list(pl.notes)}
    out["passed"] = out["tokens_match"] and out["logits_within_tolerance"] and out["shards_exact"] and poison == 0
    out["rule"] = ("TP decode: tokens equal at every step, logits within the reduction-order tolerance, every shard "
                   "byte-exact, no poison left")
    return out


def run_ranks(target, world: int, folder: str, timeout_s: float, start_method: str, what: str = "ranks") -> None:
    """Start `world` processes of `target(rank, world, port, folder)` (a free port for their group), wait for them
    (a rank that fails raises here, and torch.multiprocessing stops the others), stop them all at the deadline
    (TimeoutError naming `what`). Used by `run` and by kvlab.disagg.tp_handoff."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(target, args=(world, _free_port(), folder), nprocs=world, join=False,
                             start_method=start_method)
    limit = timeout_s + 60  # + start-up: each process imports torch and transformers and builds its model
    deadline = time.monotonic() + limit
    try:
        while not ctx.join(timeout=0.5):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world} {what} did not finish within {limit:g} s")
    finally:  # the deadline, a failed rank, Ctrl-C or SIGTERM here: no rank outlives the call
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
        for p in ctx.processes:
            p.join(5)


def _spawn(world: int, folder: str, timeout_s: float, start_method: str) -> list[dict]:
    """Start `world` decode ranks (run_ranks) and read their outputs, in rank order."""
    run_ranks(_rank_main, world, folder, timeout_s, start_method, "decode ranks")
    return [torch.load(Path(folder) / f"out{r}.pt", weights_only=True) for r in range(world)]
