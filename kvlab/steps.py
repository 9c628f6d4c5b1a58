"""Model steps every study shares: the prompt, prefill into kvlab's KV arena, decode, the correctness check,
and the timed versions of these steps that the paired measurements are built from.

A study (kvlab.studies.handoff, overlap_timeline, paged_transfer; kvlab.clocks) composes these; nothing here knows
about a particular experiment. Timed steps return milliseconds: CUDA events on a GPU, perf_counter on a CPU.

    make_prompt, cache_kw, model_device, Replicas       inputs and where things live
    prefill, prefill_or_abort, warm_prefill              prefill writing K and V straight into a KVBuffer
    decode_attention, decode                             greedy decode from a filled buffer
    correctness_check, check_moved                       decode from a moved cache vs colocated, bit for bit
    time_prefill, time_layerwise_round, time_layerwise   one timed prefill / layer-wise request
    hold, time_copy, time_plain_copy, time_decode_step   timed copies (held stream) and one decode step
"""

from __future__ import annotations

import contextlib
import time

import torch

from .hooks import LayerHooks
from .kvcache import KVBuffer, layout_for
from .sends import check_policy
from .timing import EventTimer, sync_device
from .transfer import Destination

__all__ = ["make_prompt", "cache_kw", "model_device", "text_config", "request_wall", "Replicas", "prefill", "prefill_or_abort",
           "warm_prefill", "decode_attention", "decode", "correctness_check", "check_moved", "time_prefill",
           "time_layerwise_round", "time_layerwise", "hold", "time_copy", "time_plain_copy", "time_decode_step"]


def request_wall(prefill_ms: float, exposed_ms: float) -> float:
    """A layer-wise request's time to the first decode step's input: prefill, plus whatever of the send was
    still in flight when prefill ended (exposed; negative = the copies landed first, which saves nothing)."""
    return prefill_ms + max(exposed_ms, 0.0)


def text_config(model):
    """The decoder's config of a transformers model (multimodal configs nest it)."""
    return model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config


def make_prompt(vocab_size: int, tokens: int, device, seed: int = 0) -> torch.Tensor:
    """Random prompt ids [1, tokens] (int64) from a seeded generator (timing does not depend on content)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (1, tokens), generator=g).to(device)


def cache_kw(model) -> str:
    """The forward() keyword for the cache: transformers ≥ 5.2x renamed past_key_values to cache."""
    import inspect

    name = getattr(model, "_kvlab_cache_kw", None)
    if name is None:
        params = inspect.signature(model.forward).parameters
        name = "cache" if "cache" in params else "past_key_values"
        model._kvlab_cache_kw = name
    return name


@torch.inference_mode()
def prefill(model, input_ids: torch.Tensor, buffer: KVBuffer, hooks: LayerHooks | None = None) -> torch.Tensor:
    """Run prefill writing K and V straight into `buffer`; returns the last position's logits [1, vocab].

    hooks: installed LayerHooks with point="cache" get their per-layer signal from the buffer's cache
    (other hooks work through their module hooks and need nothing here)."""
    cache = buffer.as_hf_cache(filled=False, on_write=hooks.cache_callback if hooks is not None else None)
    out = model(input_ids=input_ids, **{cache_kw(model): cache}, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1]


def warm_prefill(model, input_ids: torch.Tensor, buffer: KVBuffer) -> None:
    """One prefill with no send armed, before the first armed (flag or staged mode) request of a process.

    An armed copy stream waits on flags that only the running prefill writes, so anything in that prefill
    that waits for the whole device never returns. On our H200, kvlab.studies.overlap_timeline.events.event_handoff's first GPU test
    hung that way: a tiny model's first bf16 prefill, behind an armed copy stream, did not finish in 40 s,
    with lazy or eager kernel loading alike, and with no synchronisation torch's sync-debug mode reports;
    after one unarmed prefill the same test ran in 1 s (data/probes/armed_first_prefill). Whatever the
    first prefill initialises, it is initialised after this call.
    """
    prefill(model, input_ids, buffer)
    if input_ids.device.type == "cuda":
        torch.cuda.synchronize(input_ids.device)


def decode_attention():
    """Attention backends for decode steps: everything but cuDNN.

    Seen in trial runs on our H200 (torch 2.11): with cuDNN attention allowed, two decodes from the same
    bytes gave different logits once the caching allocator's state differed, so a bit-exact
    comparison of caches would fail for a reason that has nothing to do with the transfer. Flash, memory-
    efficient and math attention gave identical logits every time. Seed 004 also kept cuDNN off for decode.
    Prefill keeps PyTorch's default (cuDNN on): two prefills of the same prompt gave identical caches.
    """
    if not torch.cuda.is_available():
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def model_device(model) -> torch.device:
    return next(model.parameters()).device


class Replicas:
    """The decode side's own copy of the model, one per device, made once: in disaggregation the decode GPU
    holds its own weights, so a cache moved to cuda:1 is decoded by a model on cuda:1.

    `replicas(device)` returns the model itself for its own device, else a copy of it on `device` — the
    same weights bit for bit (copy.deepcopy, then .to(device): random and real weights alike, tied weights
    kept tied). The copy is made on the model's device first, so that device needs room for a second copy
    for a moment.
    """

    def __init__(self, model):
        self.model = model
        self._made: dict = {}

    def __call__(self, device) -> "torch.nn.Module":
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device == model_device(self.model):
            return self.model
        if device not in self._made:
            import copy

            self._made[device] = copy.deepcopy(self.model).to(device)
        return self._made[device]


@torch.inference_mode()
def decode(model, buffer: KVBuffer, first_token: torch.Tensor, steps: int):
    """Greedy decode `steps` tokens from a filled buffer (which is not modified).

    model: on the buffer's device (kvlab.steps.Replicas gives one there).
    first_token: [1] int64, the token prefill chose (on any device). Returns (tokens [steps] int64,
    logits [steps, vocab] fp32), on the model's device.
    """
    dev = model_device(model)
    if buffer.device.type != dev.type or (dev.type == "cuda" and buffer.device.index != dev.index):
        raise ValueError(f"the cache is on {buffer.device} but the decode model on {dev}: decode where the "
                         "cache is (kvlab.steps.Replicas makes the decode device's copy of the model)")
    cache = buffer.as_hf_cache(filled=True)
    tok = first_token.view(1, 1).to(dev)
    toks, logits = [], []
    with decode_attention():
        for _ in range(steps):
            out = model(input_ids=tok, **{cache_kw(model): cache}, use_cache=True)
            step = out.logits[:, -1].float()
            tok = step.argmax(-1, keepdim=True)
            toks.append(tok.view(1))
            logits.append(step)
    return torch.cat(toks), torch.cat(logits)


def prefill_or_abort(model, ids, src, sender, hooks=None):
    try:
        return prefill(model, ids, src, hooks)
    except BaseException:
        sender.abort()  # an armed copy stream must not wait forever for flags that never come
        raise


def check_moved(model, src, got, first, ref_tokens, steps, replicas: "Replicas | None" = None) -> dict:
    """Decode from the moved cache (on its own device, by that device's model) and from the source cache of
    the same prefill (colocated, on the prefill device) and compare; also say whether this prefill
    reproduced the reference prefill's tokens.

    When the cache moved to another GPU, `decode_gpu_logits_equal` also compares with a decode on that GPU
    from a plain copy of the source cache: if it holds while `logits_equal` fails, the transport moved the
    bytes right and the two GPUs computed differently."""
    replicas = replicas or Replicas(model)
    dec = replicas(got.device)
    toks, lg = decode(dec, got, first, steps)
    col_toks, col_lg = decode(model, src, first, steps)
    out = correctness_check(col_toks, col_lg, toks, lg, got.count_poison())
    out["bytes_equal"] = bool(torch.equal(got.data, src.data.to(got.device)))
    out["prefill_reproduced"] = bool(torch.equal(col_toks.cpu(), ref_tokens.cpu()))
    out["decode_device"] = str(got.device)
    if dec is not model:
        plain = KVBuffer(src.layout, device=got.device)
        plain.data.copy_(src.data)
        p_toks, p_lg = decode(dec, plain, first, steps)
        out["decode_gpu_logits_equal"] = bool(torch.equal(p_toks.cpu(), toks.cpu()) and torch.equal(p_lg.cpu(), lg.cpu()))
        del plain
    return out


def correctness_check(ref_tokens, ref_logits, tokens, logits, poison_left: int) -> dict:
    """Compare a decode from a moved cache with the colocated decode: exact equality is the bar."""
    same_tokens = bool(torch.equal(ref_tokens.cpu(), tokens.cpu()))
    diff = (ref_logits.cpu() - logits.cpu()).abs()
    max_diff = float(diff.nan_to_num(float("inf")).max()) if diff.numel() else 0.0
    return {"tokens_match": same_tokens, "logits_equal": bool(torch.equal(ref_logits.cpu(), logits.cpu())),
            "logits_max_abs_diff": max_diff, "poison_left": int(poison_left)}


def time_prefill(model, ids, src, device, begin=None, hooks=None) -> float:
    clock = EventTimer(device)
    sync_device(device)
    clock.mark("start")
    if begin is not None:
        begin()
    prefill(model, ids, src, hooks)
    clock.mark("end")
    return clock.elapsed_ms("start", "end")


def time_layerwise_round(model, ids, src, sender, hooks, device) -> dict:
    """One timed layer-wise request as the A/B rounds run it: counters reset, the last device sync, the
    send armed (flag modes queue their copies here, before the request: timed apart as arm_host), then
    the request with the hooks installed."""
    hooks.reset_counters()
    sync_device(device)  # the last device sync before the request: never between arm() and prefill
    sender.arm()
    with hooks:
        return time_layerwise(model, ids, src, sender, device, hooks)


def time_layerwise(model, ids, src, sender, device, hooks=None) -> dict:
    """One layer-wise request. The end mark goes on the copy stream after the send has been handed over,
    so it follows every layer's copy (armed, hooked or issued by the worker).

    No device-wide synchronisation here: the caller synchronises *before* arming, because an armed copy
    stream waits for flags that only this prefill writes, and a device sync in between would never return.
    """
    clock = EventTimer(device)
    clock.mark("start")
    sender.begin()
    prefill_or_abort(model, ids, src, sender, hooks)
    clock.mark("prefill_end")
    landing = sender.finish()
    # the copy's end is the last layer's own completion event (recorded on the copy stream right behind
    # its copy), not an event queued after the host has waited, which would add the host's wake-up time
    if sender.mode == "staged":
        # the last step is a host memcpy, which no CUDA event sees: compare host clocks instead, taking
        # prefill's end as the moment the host saw its event complete
        clock.synchronize()
        prefill_seen_ns = time.perf_counter_ns()
        landing.wait()
        p = clock.elapsed_ms("start", "prefill_end")
        exposed = (sender.host_done_ns - prefill_seen_ns) / 1e6
        return {"prefill": p, "exposed": exposed, "wall": request_wall(p, exposed)}
    landing.wait()
    clock.adopt("copy_end", landing.done_event)
    p = clock.elapsed_ms("start", "prefill_end")
    exposed = clock.elapsed_ms("prefill_end", "copy_end")
    return {"prefill": p, "exposed": exposed, "wall": request_wall(p, exposed)}


def hold(stream) -> None:
    """Keep `stream` busy (a ~1 ms spin) while the host queues the copy that is timed next.

    Without it the start event runs the moment it is queued and the interval also holds the host's
    issue latency (the Python and driver work of the send, tens of µs) — seen in run
    20261129-091903-h200, where the 32k same-GPU copy timed 938 µs against 887 µs for the same bytes in
    the paged benchmark, which queues its copies back to back.
    """
    if stream is not None:
        with torch.cuda.stream(stream):
            torch.cuda._sleep(2_000_000)  # clock cycles, ~1 ms at H200 clocks; outside the timed interval


def time_copy(transport, src, device) -> float:
    clock = EventTimer(device)
    sync_device(device)
    hold(transport.stream)
    clock.mark("start", stream=transport.stream)
    landing = transport.send(src)
    landing.wait()
    clock.adopt("end", landing.done_event)  # recorded right behind the copy, before the host waited
    return clock.elapsed_ms("start", "end")


def time_plain_copy(stream, dst: torch.Tensor, src: torch.Tensor, dest: Destination, device) -> float:
    """One plain dst.copy_(src), timed as time_copy times a transport's send: on `stream` (the transport's
    copy stream), held while the host queues it. Used for one layer alone and for the bulk send's paired
    reference copy of the same bytes."""
    clock = EventTimer(device)
    sync_device(device)
    hold(stream)
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        clock.mark("start", stream=stream)
        dst.copy_(src, non_blocking=dest.kind != "pageable")
        clock.mark("end", stream=stream)
    return clock.elapsed_ms("start", "end")


def time_decode_step(model, buffer, first, device) -> float:
    """One decode step by `model` (on `device`, where `buffer` is) from the filled buffer."""
    cache = buffer.as_hf_cache(filled=True)
    first = first.to(device)
    clock = EventTimer(device)
    sync_device(device)
    clock.mark("start")
    with torch.inference_mode(), decode_attention():
        model(input_ids=first.view(1, 1), **{cache_kw(model): cache}, use_cache=True)
    clock.mark("end")
    return clock.elapsed_ms("start", "end")


# ---------------------------------------------------------------------------------------------------
# before a request: what it may ask for


def ceiling_path(dest: Destination, src_device) -> str:
    """The kvlab.ceilings path that bounds a destination (peer paths are named per direction)."""
    if dest.kind == "peer":
        return f"d2d_peer:{torch.device(src_device).index or 0}->{dest.device.index}"
    if torch.device(src_device).type != "cuda":
        return "h2h"
    return {"device": "d2d_same", "pinned": "d2h_pinned", "pageable": "d2h_pageable"}[dest.kind]


def check_request(model, contexts, destinations, device, n_gpu_buffers: int | None = None,
                  policy: str = "eager") -> list:
    """Refuse, before allocating, contexts the model cannot take or the device cannot hold, and a send
    policy the model or a destination cannot take (a policy other than "eager" needs a GPU destination or
    pinned host: pageable sends go through a worker that lands layers in order as they come).

    Returns the parsed destinations. Memory estimate per context: the source KV buffer, one buffer per
    GPU destination, one decode-side copy for host destinations, activations of the widest layer
    (≈ tokens × (3·intermediate + 8·hidden) elements) — against the device's free memory.
    """
    device = torch.device(device)
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    max_pos = getattr(cfg, "max_position_embeddings", None)
    if not contexts:
        raise ValueError("contexts is empty: give at least one prompt length in tokens")
    for c in contexts:
        if not isinstance(c, int) or c < 2:
            raise ValueError(f"context {c!r} is not valid: give an int ≥ 2 (tokens)")
        if max_pos is not None and c > max_pos:
            raise ValueError(f"context {c} exceeds the model's max positions ({max_pos}); valid: 2…{max_pos}")
    dests = [Destination.parse(d, device) for d in destinations]
    policy = check_policy(policy)
    layers = getattr(cfg, "num_hidden_layers", None)
    if policy.startswith("batch:") and layers is not None and int(policy[6:]) > layers:
        raise ValueError(f"policy {policy!r}: N must be an int in 1…{layers} (the model has {layers} layers)")
    if policy != "eager":
        bad = [d.label for d in dests if d.kind == "pageable"]
        if bad:
            raise ValueError(f"policy {policy!r} cannot send to {bad[0]}: a policy other than 'eager' needs a GPU "
                             "destination or pinned host; drop pageable from the destinations or use policy='eager'")
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        elem = torch.empty((), dtype=model.dtype).element_size()
        gpu_dests = sum(d.kind == "device" for d in dests)
        host_dests = sum(d.kind in ("pinned", "pageable") for d in dests)
        for c in contexts:
            kv = layout_for(model, c).nbytes
            acts = c * (3 * cfg.intermediate_size + 8 * cfg.hidden_size) * elem
            # the source, one buffer per GPU destination, a staging or reference buffer while one
            # destination is measured (the bulk copy's paired reference copy lands beside it)
            buffers = 1 + gpu_dests + (1 if host_dests or gpu_dests else 0)
            need = kv * buffers + acts
            if need > 0.9 * free:
                raise ValueError(
                    f"context {c} needs about {need / 2**30:.1f} GiB on {device} (KV {kv / 2**30:.2f} GiB × "
                    f"{buffers} buffers + activations), but {free / 2**30:.1f} GiB is free: "
                    f"use a shorter context or fewer GPU destinations")
    return dests
