"""The prefill→decode handoff experiment (seed 004, reproduced and extended): what the handoff study measures.

For each context length and each destination, three ways to reach the first decode step:

    colocated   prefill and decode on the prefill device (the baseline)
    bulk        prefill, then one copy of the whole cache to the destination, then decode there
    layerwise   prefill with a hook per layer that sends the layer's K and V as soon as they are final

What is measured (all CUDA events on a GPU, perf_counter on a CPU):
    prefill       colocated prefill alone (start → logits ready)
    copy          the bulk copy alone, from a cache that is already built (one copy of the contiguous
                  buffer), and copy_tensor: the same bytes as 2 × layers copies, seed 004's method;
                  the copy stream is held by a spin while the host queues the copy, so the interval
                  is the copy's own time, not the host's issue latency
    copy_layer    one layer's K and V alone (the unit the layer-wise goal is measured against)
    wall          layer-wise: start → max(prefill done, last layer landed)
    exposed       layer-wise: last layer landed − prefill done (what layer-wise adds to TTFT;
                  negative when the copies finished before prefill's final kernels)
    hook_host     host time spent inside the hooks, summed over layers
    decode_step   one decode step from the cache on the decode device
Colocated and layer-wise prefills are interleaved (A B A B …) so drift cancels in the difference.

Correctness: for every method and destination the destination is poisoned (NaN) first, the cache is
moved, 20 greedy tokens are decoded from it, and tokens and logits are compared with the colocated
decode bit for bit.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import pandas as pd
import torch

from ...hooks import POINTS, LayerHooks
from ...kvcache import KVBuffer, layout_for
from ...sends import HookCostProbe, release_plan, stream_memops_available
from ...steps import (Replicas, check_moved, check_request, correctness_check, decode, make_prompt, model_device, prefill,
                      prefill_or_abort, time_copy, time_decode_step, time_layerwise_round,
                      time_plain_copy, time_prefill)
from ...timing import free_device as _free, schedule
from ...transfer import Transport

__all__ = ["HandoffConfig", "run_handoff", "attribute_extra", "config_dict",
           "ATTRIBUTION_VARIANTS"]

@dataclass
class HandoffConfig:
    """Parameters of one handoff run. contexts in tokens; repeats ≥ 9 for published numbers."""

    contexts: list = field(default_factory=lambda: [1024, 4096, 16384, 32768])
    destinations: list = field(default_factory=lambda: ["same-gpu", "pinned", "pageable"])
    repeats: int = 9
    warmup: int = 2
    decode_tokens: int = 20
    interleave_short: int = 30      # A/B rounds at contexts ≤ short_context (host-bound regime)
    interleave: int = 15            # A/B rounds at longer contexts (never fewer than repeats)
    short_context: int = 1024
    seed: int = 0
    ranges: bool = False            # trace ranges in the hooks (off for timing)
    point: str = "cache"            # where layer i is signalled: "cache" (kvlab's KV arena) or "attention" (module hook)
    policy: str = "eager"           # when layers go: "eager", "deadline" or "batch:N" (kvlab.sends.release_plan)


# ---------------------------------------------------------------------------------------------------
# the experiment


def run_handoff(model, cfg: HandoffConfig, device=None, progress=None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Run the handoff experiment. Returns (timings, checks), both tidy.

    timings: context, kv_bytes, destination, method, measure, repeat, ms
    checks:  context, destination, method, tokens_match, logits_equal, logits_max_abs_diff, poison_left
    progress: optional callable(str) for status lines (the notebook passes a tqdm write).
    """
    device = torch.device(device if device is not None else model_device(model))
    if cfg.point not in POINTS:
        raise ValueError(f"HandoffConfig.point {cfg.point!r} is not valid; use one of {list(POINTS)}")
    dests = check_request(model, cfg.contexts, cfg.destinations, device, policy=cfg.policy)
    if cfg.repeats < 1:
        raise ValueError(f"repeats must be ≥ 1 (≥ 9 for published numbers), got {cfg.repeats}")
    say = progress or (lambda s: None)
    vocab = model.config.get_text_config(decoder=True).vocab_size
    replicas = Replicas(model)
    for dest in dests:
        if dest.kind == "peer":
            replicas(dest.device)  # the decode GPU's own model, made once, before anything is timed
            say(f"decode model copied to {dest.device}")
    rows, checks = [], []
    for context in cfg.contexts:
        layout = layout_for(model, context)
        ids = make_prompt(vocab, context, device, cfg.seed)
        src = KVBuffer(layout, device=device)
        base = dict(context=context, kv_bytes=layout.nbytes)

        def add(dest, method, measure, repeat, ms):
            rows.append(dict(base, destination=dest, method=method, measure=measure, repeat=repeat, ms=float(ms)))

        # -- colocated reference: prefill into a poisoned buffer, decode from it
        src.poison()
        logits0 = prefill(model, ids, src)
        first = logits0.argmax(-1)
        ref_tokens, ref_logits = decode(model, src, first, cfg.decode_tokens)
        ref2_tokens, ref2_logits = decode(model, src, first, cfg.decode_tokens)
        checks.append(dict(context=context, destination="colocated", method="colocated",
                           **correctness_check(ref_tokens, ref_logits, ref2_tokens, ref2_logits, src.count_poison())))
        say(f"{context} tokens: colocated reference decoded")

        for i in range(cfg.repeats + cfg.warmup):
            ms = time_decode_step(model, src, first, device)
            if i >= cfg.warmup:
                add("colocated", "colocated", "decode_step", i - cfg.warmup, ms)

        for dest in dests:
            label = dest.label
            t_buf = Transport(layout, dest, device, granularity="buffer")
            # -- bulk: correctness
            t_buf.poison()
            src.poison()
            prefill(model, ids, src)
            landing = t_buf.send(src)
            got = t_buf.receive(landing, device)
            checks.append(dict(context=context, destination=label, method="bulk",
                               **check_moved(model, src, got, first, ref_tokens, cfg.decode_tokens, replicas)))
            for i in range(cfg.repeats + cfg.warmup):
                ms = time_decode_step(replicas(got.device), got, first, got.device)
                if i >= cfg.warmup:
                    add(label, "bulk", "decode_step", i - cfg.warmup, ms)
            del got

            # -- bulk copy alone, one copy, interleaved (A B, B A, …) with a plain copy_ of the same bytes
            # over the same path into a second buffer of the destination's kind: the ceiling at this size,
            # measured seconds apart rather than minutes (the pageable path's rate drifts by ±10 % on our
            # host: data/probes/pageable_destination); then seed 004's 2 × layers copies; then one layer
            ref = KVBuffer(layout, device=dest.device, pin_memory=dest.kind == "pinned").poison()
            pair = {"copy": lambda: time_copy(t_buf, src, device),
                    "copy_ref": lambda: time_plain_copy(t_buf.stream, ref.data, src.data, dest, device)}
            for k, measure in schedule(list(pair), cfg.repeats, cfg.warmup):
                ms = pair[measure]()
                if k >= 0:
                    add(label, "bulk", measure, k, ms)
            del ref
            t = Transport(layout, dest, device, granularity="tensor")
            for i in range(cfg.repeats + cfg.warmup):
                ms = time_copy(t, src, device)
                if i >= cfg.warmup:
                    add(label, "bulk", "copy_tensor", i - cfg.warmup, ms)
            del t
            for i in range(cfg.repeats + cfg.warmup):
                ms = time_plain_copy(t_buf.stream, t_buf.buffer.data[0], src.data[0], dest, device)
                if i >= cfg.warmup:
                    add(label, "bulk", "copy_layer", i - cfg.warmup, ms)
            say(f"{context} tokens → {label}: bulk checked and timed")

            # -- layer-wise: correctness, then A/B interleaved with colocated prefill
            release = None
            if cfg.policy != "eager":
                # the policy's pace: one layer's prefill time (this context's colocated prefill / L, median
                # of 3) and one layer's copy timed alone, just above
                pre = sorted(time_prefill(model, ids, src, device) for _ in range(3))[1]
                one = [r["ms"] for r in rows if r["destination"] == label and r["measure"] == "copy_layer"
                       and r["context"] == context]
                release = release_plan(cfg.policy, layout.layers, compute_ms=pre / layout.layers,
                                       transfer_ms=float(pd.Series(one).median()))
            sender = t_buf.layerwise(src, release=release)
            hooks = LayerHooks(model, sender.on_layer, ranges=cfg.ranges, bytes_per_layer=layout.bytes_per_layer,
                               point=cfg.point)
            t_buf.poison()
            src.poison()
            with hooks:
                sender.begin()
                prefill_or_abort(model, ids, src, sender, hooks)
                landing = sender.finish()
            got = t_buf.receive(landing, device)
            checks.append(dict(context=context, destination=label, method="layerwise",
                               mode=sender.mode, signal=cfg.point + (f", {sender._write.api}"
                                                                     if hasattr(sender, "_write") else ""),
                               policy=cfg.policy, first_release=sender.release[0],
                               **check_moved(model, src, got, first, ref_tokens, cfg.decode_tokens, replicas)))
            del got

            rounds = cfg.interleave_short if context <= cfg.short_context else cfg.interleave
            rounds = max(rounds, cfg.repeats)
            # counterbalanced order (A B, B A, A B …: timing.schedule): the GPU's clocks drift over back-to-back
            # prefills (power and temperature), and with A always first that drift lands in B − A; in run
            # 20261129-091903-h200 the first 16k pairs differed by +10…+17 ms, the last by −4…+5 ms
            ab = {"colocated": lambda: time_prefill(model, ids, src, device),
                  "layerwise": lambda: time_layerwise_round(model, ids, src, sender, hooks, device)}
            for k, name in schedule(list(ab), rounds, cfg.warmup):
                out = ab[name]()
                if k < 0:
                    continue
                if name == "colocated":
                    add(label, "colocated", "prefill", k, out)
                    continue
                for measure in ("wall", "prefill", "exposed"):
                    add(label, "layerwise", measure, k, out[measure])
                add(label, "layerwise", "hook_host", k, hooks.host_ns / 1e6)
                add(label, "layerwise", "arm_host", k, sender.arm_host_ns / 1e6)
            say(f"{context} tokens → {label}: layer-wise checked and timed ({rounds} A/B rounds)")
            del sender, hooks, t_buf
            _free(device)
        del src
        _free(device)
    return pd.DataFrame(rows), pd.DataFrame(checks)


# ---------------------------------------------------------------------------------------------------
# where the layer-wise cost comes from at a short context


ATTRIBUTION_VARIANTS = ("colocated", "signal only", "layer-wise", "layer-wise, attention hooks",
                        "layer-wise, per-layer wakes")


def attribute_extra(model, context: int, destinations, rounds: int = 30, warmup: int = 2, device=None,
                    seed: int = 0, progress=None) -> pd.DataFrame:
    """Split layer-wise sending's extra prefill time into its parts, with interleaved rounds.

    At a short context prefill is bound by the host launching kernels, so whatever the send does on the
    host shows. Per destination, every round times, in the orders of kvlab.timing.balanced_orders (every
    variant follows every other equally often over a cycle; before this was fixed the order was rotated
    cyclically, so each variant followed the same neighbour in most rounds):
        colocated                     prefill alone
        signal only                   the per-layer signal from the KV arena making the flag send's one
                                      driver call to a flag nothing waits on (kvlab.sends.HookCostProbe):
                                      the host cost of signalling, nothing sent
        layer-wise                    the real send (flag, or staged for pageable host), signalled from
                                      the KV arena (the default point)
        layer-wise, attention hooks   the same send signalled from forward hooks on the attention
                                      modules (the classic hook point, seed 004's)
        layer-wise, per-layer wakes   pageable host only: the staged worker woken after every layer
                                      instead of the default halving plan (GIL hand-offs)
    Then (signal only − colocated) is the signal's price, (layer-wise − signal only) the copies' price,
    (attention hooks − layer-wise) what PyTorch's module-hook path adds, and (per-layer wakes −
    layer-wise) what the wake plan saves. "signal only" needs cuda-bindings' stream memory operations and
    is left out without them (and on a CPU).

    Returns tidy rows: context, destination, variant, round, ms (prefill: start → logits on the compute
    stream), wall_ms (layer-wise: until the last layer landed), hook_host_ms, mode.
    """
    device = torch.device(device if device is not None else model_device(model))
    dests = check_request(model, [context], destinations, device)
    if rounds < 1 or warmup < 0:
        raise ValueError(f"rounds must be ≥ 1 and warmup ≥ 0, got rounds={rounds}, warmup={warmup}")
    say = progress or (lambda s: None)
    vocab = model.config.get_text_config(decoder=True).vocab_size
    layout = layout_for(model, context)
    ids = make_prompt(vocab, context, device, seed)
    src = KVBuffer(layout, device=device)
    rows = []
    probe_ok = device.type == "cuda" and stream_memops_available(device)
    for dest in dests:
        t = Transport(layout, dest, device, granularity="buffer")
        variants = {"colocated": None}
        if probe_ok:
            probe = HookCostProbe(device)
            variants["signal only"] = (probe, LayerHooks(model, probe.on_layer, ranges=False))
        sender = t.layerwise(src)
        variants["layer-wise"] = (sender, LayerHooks(model, sender.on_layer, ranges=False))
        variants["layer-wise, attention hooks"] = (sender, LayerHooks(model, sender.on_layer, ranges=False,
                                                                      point="attention"))
        if sender.mode == "staged":
            per_layer = t.layerwise(src, wakes="layer")
            variants["layer-wise, per-layer wakes"] = (per_layer, LayerHooks(model, per_layer.on_layer, ranges=False))
        names = list(variants)
        for k, name in schedule(names, rounds, warmup):
            v = variants[name]
            row = dict(context=context, destination=dest.label, variant=name, round=k,
                       mode="", wall_ms=float("nan"), hook_host_ms=float("nan"))
            if v is None:
                row["ms"] = time_prefill(model, ids, src, device)
            elif isinstance(v[0], HookCostProbe):
                probe, hooks = v
                hooks.reset_counters()
                with hooks:
                    row["ms"] = time_prefill(model, ids, src, device, begin=probe.begin, hooks=hooks)
                row["hook_host_ms"] = hooks.host_ns / 1e6
            else:
                snd, hooks = v
                b = time_layerwise_round(model, ids, src, snd, hooks, device)
                row.update(ms=b["prefill"], wall_ms=b["wall"], hook_host_ms=hooks.host_ns / 1e6,
                           mode=f"{snd.mode}, {hooks.point}"
                                + (f", wakes={snd.wakes}" if snd.mode == "staged" else ""))
            if k >= 0:
                rows.append(row)
        say(f"{context} tokens → {dest.label}: attribution timed ({rounds} rounds × {len(names)} variants)")
        del variants, sender, t
        _free(device)
    del src
    _free(device)
    return pd.DataFrame(rows)


def config_dict(cfg: HandoffConfig) -> dict:
    """The run's HandoffConfig as run.json records it (resolved.config)."""
    return asdict(cfg)

