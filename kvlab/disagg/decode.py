"""The decode worker, which drives the pair: for each layout and context it computes its colocated reference,
allocates its destination (a contiguous buffer, or a pool with its own block table), poisons it before every
request, posts ``req{r}/go``, waits until every layer has landed (each wait bounded by the deadline), refuses to
decode otherwise (protocol.IncompleteCacheError), decodes, and compares tokens, logits and bytes with its reference;
then the bench and the fault campaign (kvlab.disagg.faults). kvlab.disagg.workers starts it in its own process."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from ..kvcache import KVBuffer, layout_for
from ..paged.wire import kv_rel_err
from ..steps import decode, make_prompt, prefill
from ..timing import sync_device
from .backends import BACKENDS
from .config import DECODE, PREFILL, DisaggConfig
from .endpoints import Sink, units
from .faults import run_campaign
from .group import host_id, init_group, now_ns, pool_for
from .memory import DecodeMemory
from .protocol import Control, IncompleteCacheError, LandedLayers
from .wire_codec import wire_codec

__all__ = ["DecodeWorker"]


class DecodeWorker:
    def __init__(self, cfg: DisaggConfig, model, dev: torch.device, control: Control, link, progress: bool = True):
        self.cfg, self.model, self.dev, self.control, self.link = cfg, model, dev, control, link
        self.rows: list[dict] = []
        self.bench_rows: list[dict] = []
        self.tuned: list[dict] = []
        self.fault_rows: list[dict] = []
        self.n = 0
        self.progress = progress
        self.finished = 0  # requests finished (and faults decided), posted signed as `progress` for the launcher's bar
        self.generation = 0  # of the prefill process now serving; a new one after each death (kill faults)
        self.peer_dead = False  # the launcher recorded the current prefill process's death
        self.mem = DecodeMemory(dev, cfg.decode_memory_gib)  # its phases, its cap, what an out-of-memory says
        self.wire = wire_codec(cfg)  # FP8 on the wire (contiguous only), or None
        self.wire_ref: dict = {}

    def count_done(self) -> None:
        """One more request finished: the launcher's progress bar reads it (`progress`, signed like every value)."""
        self.finished += 1
        self.control.post("progress", self.finished)

    def take_over(self) -> None:
        """The prefill process died: leave its process group and form the next with the process the launcher
        started in its place (it learns here which request to answer first), on a new link."""
        g = self.generation + 1
        self.link.close()
        dist.destroy_process_group()
        self.control.post(f"gen{g}/from", self.n)
        init_group(self.cfg, self.dev, self.control.store, DECODE, g)
        self.link = BACKENDS[self.cfg.backend].make_link("decode", self.dev, self.control, self.cfg.timeout_s,
                                                         peer=PREFILL, nixl_descs=self.cfg.nixl_descs,
                                                         in_order=self.cfg.in_order)
        self.generation, self.peer_dead = g, False

    def _go(self, msg: dict) -> int:
        n = self.n
        self.n += 1
        self.control.post(f"req{n}/go", msg)
        return n

    def reference(self, context: int):
        """(cache, first token, tokens, logits) of the colocated run a moved cache must reproduce exactly. With an FP8
        wire: the cache passed through quantize → dequantize (kvlab.disagg.wire_codec) and its decode; the bf16
        decode's tokens and the round trip's largest relative error are kept beside it (`self.wire_ref`)."""
        ids = make_prompt(self.model.config.vocab_size, context, self.dev, seed=self.cfg.seed)
        ref = KVBuffer(layout_for(self.model, context, dtype=self.cfg.kv_dtype), self.dev)
        first = prefill(self.model, ids, ref).argmax(-1).view(1)
        if self.wire is not None:
            bf16_toks, _ = decode(self.model, ref, first, self.cfg.decode_tokens)
            before = ref.data.clone()
            self.wire.roundtrip(ref.data)
            err = max(r["max_rel_err"] for r in kv_rel_err(before, ref.data))
            self.wire_ref = {"bf16_tokens": bf16_toks.cpu(), "kv_max_rel_err": err}
            del before
        toks, logits = decode(self.model, ref, first, self.cfg.decode_tokens)
        return ref, int(first[0]), toks, logits

    def run(self) -> None:
        """Every (layout, context): the reference, the destination, the requests (and the bench, the campaign).
        A real out-of-memory anywhere in it becomes one DecodeOutOfMemory line (kvlab.disagg.memory)."""
        try:
            self._run()
        except torch.OutOfMemoryError as err:
            raise self.mem.explain(err) from err

    def _run(self) -> None:
        cfg = self.cfg
        per = (cfg.warmup + cfg.repeats) * (1 + len(cfg.modes))
        total = per * len(cfg.layouts) * len(cfg.contexts)
        bar = tqdm(total=total, desc=f"disagg {cfg.backend}", unit="req", disable=not self.progress or None,
                   file=sys.stderr)
        for layout in cfg.layouts:
            for context in cfg.contexts:
                self._context(layout, context, bar)  # its reference and destination are freed on return
        bar.close()
        self._go({"stop": True})

    def _context(self, layout: str, context: int, bar) -> None:
        """One (layout, context): its reference (without the cap), its destination and its requests (under it)."""
        mem = self.mem
        where = {"layout": layout, "context": context}
        mem.where = f"{layout}, {context} tokens"
        mem.cap_off()  # the reference is the measurement's, not the server's: computed without the cap
        with mem.phase("reference", **where):
            ref = self.reference(context)
        mem.cap_on()
        with mem.phase("destination", **where):
            if layout == "contiguous":
                sink, table = Sink(buffer=KVBuffer(ref[0].layout, self.dev), wire=self.wire), None
            else:
                pool, table = pool_for(self.model, context, self.cfg, self.dev, seed=self.cfg.seed + 2)
                sink = Sink(pool=pool, block_ids=table.ids.tolist())
                del pool  # the sink holds it: one reference to drop below
        tag = f"{layout}-{context}"
        with mem.phase("requests", **where):
            self._serve(layout, context, tag, sink, table, ref, bar)
        if BACKENDS[self.link.name].releases_destination:  # the prefill process lets go of it, so it can be freed
            n = self._go({"release": tag})  # takes a request number: requests.csv skips it
            self.control.wait(f"req{n}/done", f"the prefill process to let go of {tag}")
            del sink, table, ref  # the destination and the reference, with no other holder left
            torch.cuda.ipc_collect()  # what this process shared goes back once the other process has let go

    def _serve(self, layout: str, context: int, tag: str, sink: Sink, table, ref, bar) -> None:
        """The requests of one (layout, context), whose destination is known as `tag`, then its bench and its
        campaign."""
        cfg = self.cfg
        if BACKENDS[self.link.name].one_sided:
            self.link.expose(tag, sink)
        base = {"layout": layout, "context": context, "tag": tag}
        if table is not None:
            base.update(dst_blocks=table.ids.tolist(), dst_num_blocks=sink.pool.num_blocks)
        kinds = ["colocated", *cfg.modes]
        for r in range(cfg.warmup + cfg.repeats):
            k = r % len(kinds)
            for mode in kinds[k:] + kinds[:k]:  # rotated each round: no mode always first
                row = self.request(mode, base, sink, table, ref)
                row.update(round=r, warmup=r < cfg.warmup)
                self.rows.append(row)
                bar.update(1)
                self.count_done()
        if cfg.bench:
            self.mem.where, self.mem.step = f"the bench of {tag}", "landing"
            msg = dict(base, mode="bulk", bench=True, n=cfg.bench_repeats, warmup=3)
            if BACKENDS[self.link.name].one_sided:
                n = self._go(msg)
                got = self.control.wait(f"req{n}/done", f"the bench of {tag}")
            else:
                got = self.bench_dist(msg, sink)
            if got["tuned"]:
                self.tuned.append({"layout": layout, "context": context, **got["tuned"]})
            for kind in ("send", "ceiling", "layer", "send_default"):
                for i, ms in enumerate(got[f"{kind}_ms"]):
                    nbytes = got["layer_bytes"] if kind == "layer" else got["bytes"]
                    kernel = "triton row copy, default config" if kind == "send_default" else got["kernel"]
                    self.bench_rows.append({"backend": cfg.backend, "layout": layout, "context": context,
                                            "kind": kind, "sample": i, "ms": ms, "bytes": nbytes,
                                            "gbps": nbytes / ms / 1e6, "kernel": kernel, "timer": got["timer"]})
        if cfg.faults and (layout, context) == (cfg.layouts[0], cfg.contexts[0]):
            self.mem.where, self.mem.step = f"the fault campaign on {layout}, {context} tokens", "campaign"
            self.fault_rows += run_campaign(self, base, sink, table, ref)

    def bench_dist(self, msg: dict, sink: Sink) -> dict:
        """The decode side of PrefillWorker.bench_dist: each round, post the receive of the bulk send (then of the
        last layer), say so, and read the clock once the bytes are on this device; the send times are these ends
        minus the prefill side's starts (one host: one monotonic clock)."""
        plan = {"send": units("bulk", sink.layers), "layer": [(sink.layers - 1,)]}
        ends: dict = {"send": [], "layer": []}
        n = self._go(dict(msg, decode_device=str(self.dev), decode_host=host_id()))
        for k in range(msg["warmup"] + msg["n"]):
            for kind in ("send", "layer"):
                self.link.post_receive(n, plan[kind], sink)
                self.control.post(f"req{n}/bench/{kind}{k}", 1)
                self.link.wait_landed(n, sink, _Uncounted(), self.control)
                ends[kind].append(now_ns())
            self.control.post(f"req{n}/bench/landed{k}", 1)  # the prefill side's plain copy waits for this
        got = self.control.wait(f"req{n}/done", f"the bench of {msg['tag']}")
        w = msg["warmup"]
        one_clock = got["host"] == host_id()  # across two nodes the two clocks differ: no time can be read
        for kind in ("send", "layer"):
            got[f"{kind}_ms"] = [(e - s) / 1e6 if one_clock else float("nan")
                                 for e, s in zip(ends[kind][w:], got[f"t_{kind}_ns"][w:])]
        return got

    def request(self, mode: str, base: dict, sink: Sink, table, ref) -> dict:
        cfg = self.cfg
        ref_buf, ref_first, ref_toks, ref_logits = ref
        row = {"backend": cfg.backend, "layout": base["layout"], "mode": mode, "context": base["context"],
               "prefill_device": cfg.devices()[0], "decode_device": str(self.dev)}
        mem = self.mem
        mem.where = f"request {self.n} ({base['layout']}, {base['context']} tokens, {mode})"
        mem.step, mem.landed = ("colocated" if mode == "colocated" else "landing"), ""
        if mode == "colocated":
            n = self._go(dict(base, mode=mode))
            done = self.control.wait(f"req{n}/done", f"request {n}'s prefill")
            step_ms = self._step(ref_buf, ref_first)
            row.update(request=n, prefill_ms=done["prefill_ms"], step_ms=step_ms,
                       ttft_ms=done["prefill_ms"] + step_ms, same_host=done["host"] == host_id())
            return row
        sink.poison()
        sync_device(self.dev)
        tracker = LandedLayers(sink.layers, str(self.dev))
        n = self.n
        tracker.begin(n)
        plan = units(mode, sink.layers)
        self.link.post_receive(n, plan, sink)
        self._go(dict(base, mode=mode))
        late = None
        try:
            self.link.wait_landed(n, sink, tracker, self.control)
        except TimeoutError as err:
            late = err
        except torch.OutOfMemoryError:
            gone = tracker.missing(n)
            mem.landed = f"{sink.layers - len(gone)} of {sink.layers} layers had landed; missing {_layers_text(gone)}"
            raise
        t_landed = now_ns()
        try:
            if late is not None:  # refused now: waiting for the prefill's end too would double the deadline
                tracker.require(n)
            done = self.control.wait(f"req{n}/done", f"request {n}'s prefill")
            tracker.require(n)  # nothing decodes from a cache whose send has not landed
        except IncompleteCacheError as err:
            raise IncompleteCacheError(f"{err} — {late}" if late else str(err)) from None
        t0 = now_ns()
        mem.step = "reading"
        cache = sink.buffer if table is None else sink.pool.read(table)
        sync_device(self.dev)
        read_ms = (now_ns() - t0) / 1e6
        first = done["first_token"]
        mem.step = "decode"
        step_ms = self._step(cache, first)
        t_first = now_ns()
        toks, logits = decode(self.model, cache, torch.tensor([first], device=self.dev), cfg.decode_tokens)
        mem.step = "checking"
        same = done["host"] == host_id()
        row.update(
            request=n, kv_bytes=ref_buf.nbytes, bytes_moved=done["bytes_moved"], prefill_ms=done["prefill_ms"],
            send_host_ms=done["send_host_ms"],
            exposed_ms=(t_landed - done["t_prefill_end_ns"]) / 1e6 if same else float("nan"),
            read_ms=read_ms, step_ms=step_ms,
            ttft_ms=(t_first - done["t_prefill_start_ns"]) / 1e6 - read_ms if same else float("nan"),
            first_token_match=first == ref_first,
            tokens_match=bool(torch.equal(toks.cpu(), ref_toks.cpu())),
            logits_equal=bool(torch.equal(logits.cpu(), ref_logits.cpu())),
            bytes_equal=bool(torch.equal(cache.data, ref_buf.data)),
            poison_left=int(cache.count_poison()), same_host=same)
        if self.wire is not None:  # the lossy wire against the bf16 decode: measured, not required
            bf16 = self.wire_ref["bf16_tokens"]
            row.update(wire_dtype="fp8", wire_scales=self.wire.scales,
                       token_agreement=float((toks.cpu().view(-1) == bf16.view(-1)).float().mean()),
                       kv_max_rel_err=self.wire_ref["kv_max_rel_err"])
        if "link" in done:  # nixl: what it took to post the request's transfers
            row.update(descriptors=done["link"]["descriptors"], transfers=done["link"]["transfers"],
                       post_ms=done["link"]["post_ms"])
        return row

    def _step(self, cache, first: int) -> float:
        """One decode step from `cache` (host-timed, synchronised), in ms: the first token's own cost."""
        sync_device(self.dev)
        t0 = now_ns()
        decode(self.model, cache, torch.tensor([first], device=self.dev), 1)
        sync_device(self.dev)
        return (now_ns() - t0) / 1e6


def _layers_text(layers: list[int]) -> str:
    """[3, 4, 5, 9] → '3…5, 9'."""
    out, i = [], 0
    while i < len(layers):
        j = i
        while j + 1 < len(layers) and layers[j + 1] == layers[j] + 1:
            j += 1
        out.append(f"{layers[i]}" if i == j else f"{layers[i]}…{layers[j]}")
        i = j + 1
    return ", ".join(out) or "none"


class _Uncounted:
    """A landed-layer tracker that records nothing (a bench's receives are not requests)."""

    def mark(self, request: int, layer: int) -> None:
        pass
