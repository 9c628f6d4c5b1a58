"""Faults across the process boundary, and what the decode side does about them (issue 16).

A campaign (`kvlab disagg --faults N --policy P`) sends N layer-wise requests, each with one fault the prefill
side injects, drawn (seeded) from:

    drop      layer k is never sent; on an in-order link (nccl, or gloo with in_order) the layers behind it are
              held back too, as a stalled sender's would be, since a receive takes whatever is sent next
    delay     layer k leaves after the decode side's deadline (fault_timeout_s + 0.5 s)
    corrupt   layer k's first byte arrives with its bits flipped
    kill      the prefill process sends the layers before k, then kills itself (SIGKILL: no goodbye); the launcher
              starts a new prefill process (same seed, same weights) and the decode side forms a new process
              group with it (gloo; only when asked for with --fault-kinds)
    oom       the decode side runs out of memory as layer k arrives: torch.OutOfMemoryError where the layer
              would be marked landed (injected; memory is not really exhausted, and it is there again for a
              retry or a recompute). Layer k and the layers not yet recorded as landed are not trusted; receives
              still posted (gloo, nccl) are drained (only when asked for with --fault-kinds)

The decode side detects a fault by its deadline (a layer that has not landed), by a per-layer checksum
computed on both sides, by its own allocation failing (oom), or by the launcher's record that the prefill process died (`dead/prefill/<generation>`),
and after a death it trusts no layer of that request (none was checksummed by a sender that is gone).
Otherwise it fences the channel (late layers are waited for, dropped or held-back ones are filled by the sender,
in the order their receives were posted, so no byte of this request can land in a later request's destination).
On nccl every wait of the campaign polls the receive against a host deadline (DistLink.poll), and one fenced
request without a fault comes first (_warm_up). Then it follows the policy, named as
vLLM's kv_load_failure_policy names them:

    fail       refuse: the request is not decoded (an IncompleteCacheError naming it and its layers)
    retry      ask again for the missing or corrupt layers only, up to `retries` times with doubling backoff; when
               the prefill process died, recompute (its successor's start is not bounded by the deadline)
    recompute  prefill on the decode side itself, into the same destination

Each fault's row (faults.csv): kind, layer, detected_by, outcome, attempts, recover_ms, and whether the decode
that followed (if any) matched the colocated one exactly. `decoded_from_partial` counts decodes made from a cache
that differed from the reference's bytes — the number that must be 0.
"""

from __future__ import annotations

import json
import random
import time

import torch

from ..paged import prefill_into_pages
from ..steps import decode, make_prompt, prefill
from ..timing import sync_device
from .backends import BACKENDS
from .protocol import IncompleteCacheError, LandedLayers

__all__ = ["KINDS", "DEFAULT_KINDS", "POLICIES", "checksum", "plan", "run_campaign"]

KINDS = ("drop", "delay", "corrupt", "kill", "oom")
DEFAULT_KINDS = ("drop", "delay", "corrupt")
POLICIES = ("fail", "retry", "recompute")


def checksum(t: torch.Tensor) -> str:
    """A per-layer integrity check computed where the bytes are (GPU or CPU): the sum of the tensor's 32-bit words
    and the sum of each word times its position (1, 2, …; int64, wrapping), as text. Any single flipped bit
    changes the first; a swap of two different words anywhere changes the second. (A CRC would be stronger
    against many errors at once; this one is two reductions on the device.)"""
    words = _words(t).to(torch.int64)
    pos = torch.arange(1, words.numel() + 1, device=words.device, dtype=torch.int64)
    return f"{int(words.sum())}:{int((words * pos).sum())}"


def _words(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes as 32-bit words (or bytes, when its size is not a multiple of 4), flat."""
    flat = t.contiguous().view(-1)
    return flat.view(torch.int32) if flat.numel() * flat.element_size() % 4 == 0 else flat.view(torch.uint8)


def checksums(ts: list[torch.Tensor], chunk_bytes: int = 256 << 20) -> list[str]:
    """`checksum` of each tensor, the same strings, computed together: tensors of one size on one device go
    through the two reductions a chunk of them at a time (about `chunk_bytes` of words), and the host waits once at
    the end. Per tensor, two syncs and eight small kernels had cost 5.5–7.2 ms for a 1k cache of 28 layers on the
    H200 (campaign runs 20261201-024052 / 025205 / 024517)."""
    if not ts:
        return []
    words = [_words(t) for t in ts]
    if len({(w.numel(), w.dtype, w.device) for w in words}) > 1:
        return [checksum(t) for t in ts]
    n, dev = words[0].numel(), words[0].device
    pos = torch.arange(1, n + 1, device=dev, dtype=torch.int64)
    per = max(1, chunk_bytes // max(1, n * 8))
    sums = []
    for i in range(0, len(words), per):
        w = torch.stack(words[i:i + per]).to(torch.int64)
        sums.append(torch.stack([w.sum(1), (w * pos).sum(1)], 1))
    return [f"{a}:{b}" for a, b in torch.cat(sums).tolist()]


def plan(n: int, layers: int, seed: int = 0, kinds=DEFAULT_KINDS) -> list[dict]:
    """n faults, `kinds` in turn (so every kind is exercised) and layers drawn at random (seeded)."""
    rng = random.Random(seed)
    return [{"kind": kinds[k % len(kinds)], "layer": rng.randrange(layers)} for k in range(n)]


def _sink_checksums(sink, layers) -> dict[int, str]:
    layers = list(layers)
    views = [sink.buffer.data[i] if not sink.paged else sink.pool.rows.index_select(0, sink.rows.of((i,)))
             for i in layers]  # where decode reads each layer (an FP8 wire's: dequantized)
    return dict(zip(layers, checksums(views)))


def run_campaign(w, base: dict, sink, table, ref) -> list[dict]:
    """The campaign on one (layout, context), by the decode worker `w` (kvlab.disagg.decode.DecodeWorker)."""

    cfg = w.cfg
    ref_buf, ref_first, ref_toks, ref_logits = ref
    L = sink.layers
    rows = []
    if BACKENDS[w.link.name].polls:
        _warm_up(w, base, sink)
    for k, fault in enumerate(plan(cfg.faults, L, cfg.seed, tuple(cfg.fault_kinds))):
        fault = dict(fault, seconds=cfg.fault_timeout_s + 0.5)
        t0 = time.monotonic()
        sink.poison()
        good: set[int] = set()
        row = {"fault": k, "kind": fault["kind"], "layer": fault["layer"], "policy": cfg.policy,
               "layout": base["layout"], "context": base["context"], "fault_timeout_s": cfg.fault_timeout_s}
        attempts, detected, outcome, error = 0, "", "", ""
        want = list(range(L))
        while True:
            attempts += 1
            first_try = attempts == 1
            bad, how, done = _attempt(w, base, sink, want, fault if first_try else None, good)
            if first_try:
                detected = how or "not detected"
                if done is not None:  # the layers the prefill side sent before the fence (a drop: not those held),
                    # and what the per-layer checksums cost on each side (all layers; those landed)
                    row["sent"] = json.dumps(done["sent"])
                    row.update(checksum_send_ms=done["checksum_ms"], checksum_send_bytes=done["checksum_bytes"],
                               checksum_recv_ms=done["checksum_recv_ms"],
                               checksum_recv_bytes=done["checksum_recv_bytes"])
            if not bad:
                outcome = "delivered" if first_try else "recovered (retry)"
                break
            if cfg.policy == "retry" and attempts <= cfg.retries and not w.peer_dead:
                time.sleep(0.05 * 2 ** (attempts - 1))
                want = sorted(bad)
                continue
            # a retry needs the sender: when it died, the start of its successor (seconds: a new process builds its
            # model and joins a new group) is not bounded by the fault's deadline, so the decode side prefills
            # itself, as recompute does, and joins the successor after the decision (takeover_ms)
            if cfg.policy == "recompute" or (cfg.policy == "retry" and w.peer_dead):
                _recompute(w, base, sink, table)
                good = set(range(L))
                outcome = "recovered (recompute)" if cfg.policy == "recompute" else "recovered (recompute: sender died)"
                break
            missing = sorted(bad)
            why = ("the prefill process died mid-send, so no layer of it is trusted" if w.peer_dead
                   else f"the decode side ran out of memory as they landed: missing {missing}"
                   if detected == "decode out of memory" else f"missing or corrupt {missing}")
            error = str(IncompleteCacheError(f"request {w.n - 1}: {len(missing)} of {L} layers did not land intact on "
                                             f"{w.dev} ({why}); decode refused"))
            outcome = "refused"
            break
        row.update(detected_by=detected, outcome=outcome, attempts=attempts, error=error,
                   recover_ms=(time.monotonic() - t0) * 1e3, takeover_ms=float("nan"))
        if w.peer_dead:  # fail and recompute decided without the peer; the next request needs one
            t1 = time.monotonic()
            w.take_over()
            row["takeover_ms"] = (time.monotonic() - t1) * 1e3
        if outcome != "refused":
            tracker = LandedLayers(L, str(w.dev))
            tracker.begin(0)
            for i in sorted(good):
                tracker.mark(0, i)
            tracker.require(0)  # the one gate before any decode
            cache = sink.buffer if table is None else sink.pool.read(table)
            toks, logits = decode(w.model, cache, torch.tensor([ref_first], device=w.dev), cfg.decode_tokens)
            row.update(decoded=True, bytes_equal=bool(torch.equal(cache.data, ref_buf.data)),
                       tokens_match=bool(torch.equal(toks.cpu(), ref_toks.cpu())),
                       logits_equal=bool(torch.equal(logits.cpu(), ref_logits.cpu())))
        else:
            row.update(decoded=False, bytes_equal=None, tokens_match=None, logits_equal=None)
        rows.append(row)
        w.count_done()
    return rows


def _attempt(w, base, sink, layers: list[int], fault, good: set[int]):
    """One request for `layers`, fenced: returns (bad layers, how the first problem was detected, done)."""

    cfg = w.cfg
    plan_units = [(i,) for i in layers]
    n = w.n
    oom = fault is not None and fault["kind"] == "oom"
    tracker = (_OutOfMemoryAt(sink.layers, str(w.dev), fault["layer"]) if oom else LandedLayers(sink.layers, str(w.dev)))
    tracker.begin(n)
    with _polling(w.link):  # nccl: every wait below against a host deadline
        w.link.post_receive(n, plan_units, sink)
        # the first attempt prefills and sends every layer (with the fault); a retry asks for the bad layers only
        mode = "layerwise" if fault is not None else "resend"
        msg = dict(base, mode=mode, layers=layers, checksum=True, fenced=True)
        if fault is not None:
            msg["fault"] = fault
        w._go(msg)
        how = ""
        try:
            w.link.wait_landed(n, sink, tracker, w.control, cfg.fault_timeout_s)
        except TimeoutError as err:
            how = "receive failed" if "failed" in str(err) else "deadline"
        except torch.OutOfMemoryError:
            if not oom:  # a real one: not this campaign's to handle
                raise
            how = "decode out of memory"
        landed_in_time = {i for i in layers if i not in tracker.missing(n)}
        done = _done_or_dead(w, n)
        if done is None:  # the prefill process died: no layer of this request was checksummed by a live sender
            w.peer_dead = True  # its successor is joined when the peer is next needed (take_over)
            return set(layers), how or "peer died", None
        if bool(done.get("in_order")) != bool(getattr(w.link, "in_order", False)):
            raise RuntimeError(f"request {n}: the prefill side's link matches "
                               f"{'in order' if done.get('in_order') else 'by tag'} and this side's does not: "
                               "both processes must be started with the same backend and --in-order")
        sent = set(done["sent"])
        drain = [u[0] for u in w.link.pending if u[0] not in sent]
        w.control.post(f"req{n}/ack", {"drain": drain})
        w.link.drain(n, cfg.timeout_s)  # late layers and filler: the channel is clean before the next request
        sync_device(w.dev)
        t0 = time.perf_counter()
        sums = _sink_checksums(sink, sorted(landed_in_time))  # ends in tolist(): the device is done
        done["checksum_recv_ms"] = (time.perf_counter() - t0) * 1e3
        done["checksum_recv_bytes"] = len(landed_in_time) * done["checksum_bytes"] // sink.layers
        corrupt = {i for i, c in sums.items() if c != done["checksums"][i]}
        if corrupt and not how:
            how = "checksum"
        ok = landed_in_time - corrupt
        good |= ok
        bad = set(layers) - ok
        return bad, how, done


def _warm_up(w, base, sink) -> None:
    """nccl: one fenced request without a fault before the campaign, not counted. Within an attempt a receive may
    spin on the decode GPU while its send waits for this process's acknowledgement; a kernel launched then for
    the first time (CUDA loads modules lazily, and a load may synchronize the whole context) would wait for that
    receive, and the acknowledgement would never be posted. This request launches the attempt's kernels once
    (the per-layer landing and scatter, the checksums) while nothing is held back."""
    bad, how, done = _attempt(w, base, sink, list(range(sink.layers)), None, set())
    if bad or done is None:
        raise RuntimeError(f"the campaign's warm-up request (no fault) did not land intact: layers {sorted(bad)} "
                           f"({how or 'checksum'}); the link is not usable for a campaign")


class _polling:
    """Within it, a DistLink on nccl waits for each receive against the host deadline (DistLink.poll), and the
    flag is put back as it was on the way out (an exception too); other links are left as they are."""

    def __init__(self, link):
        self.link = link if BACKENDS[link.name].polls and hasattr(link, "poll") else None
        self.was = None

    def __enter__(self):
        if self.link is not None:
            self.was, self.link.poll = self.link.poll, True

    def __exit__(self, *exc):
        if self.link is not None:
            self.link.poll = self.was


class _OutOfMemoryAt(LandedLayers):
    """LandedLayers whose layer `layer` cannot land: marking it raises torch.OutOfMemoryError once, as the decode
    side's allocation for it would (the oom fault)."""

    def __init__(self, layers: int, device: str, layer: int):
        super().__init__(layers, device)
        self.oom_layer: int | None = layer

    def mark(self, request: int, layer: int) -> None:
        if layer == self.oom_layer:
            self.oom_layer = None
            raise torch.OutOfMemoryError(f"request {request}: out of memory on {self.device} while layer {layer} "
                                         "landed (injected)")
        super().mark(request, layer)


def _done_or_dead(w, n: int):
    """Request n's `done` from the prefill process, or None when the launcher has recorded that process's death
    first (a SIGKILL posts nothing); TimeoutError after the run's timeout."""
    deadline = time.monotonic() + w.cfg.timeout_s
    dead = f"dead/prefill/{w.generation}"
    while time.monotonic() < deadline:
        if w.control.ready(f"req{n}/done"):
            return w.control.wait(f"req{n}/done", f"request {n}'s prefill")
        if w.control.read(dead) is not None:  # checked: only the launcher, holding the run key, records a death
            planned = w.control.wait(f"kill/{w.generation}", "the prefill process's announced kill")
            if planned["request"] != n:
                raise RuntimeError(f"the prefill process died at request {planned['request']}, not at request {n} "
                                   "whose kill was planned")
            return None
        time.sleep(0.01)
    raise TimeoutError(f"waited {w.cfg.timeout_s:g} s for request {n}'s prefill, and its process is neither done "
                       "nor dead: it is stuck")


def _recompute(w, base, sink, table) -> None:
    """The decode side prefills the prompt itself, into its own destination."""

    ids = make_prompt(w.model.config.vocab_size, base["context"], w.dev, seed=w.cfg.seed)
    if table is None:
        prefill(w.model, ids, sink.buffer)
    else:
        prefill_into_pages(w.model, ids, sink.pool, table)
