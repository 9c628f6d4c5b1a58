"""The two processes: a prefill worker and a decode worker, each owning its device and its own copy of the
model (built from the same config with the same seed, so the weights are identical bit for bit).

The decode worker drives: for each layout and context it computes its colocated reference (prefill and
decode on its own device), allocates its destination (a contiguous buffer, or a pool with its own block
table), poisons it before every request, and posts ``req{r}/go``. The prefill worker prefills, sends in bulk
after prefill or layer by layer from the per-layer signal, and posts ``req{r}/done``. The decode worker waits
until every layer has landed (each wait bounded by the deadline), refuses to decode otherwise
(protocol.IncompleteCacheError), decodes, and compares tokens, logits and bytes with its reference.

Clocks: both processes read CLOCK_MONOTONIC (time.monotonic_ns), which one host shares, so "exposed" (last
layer known landed on the decode side − prefill end on the prefill side) and the decode side's TTFT are
differences of one clock. Across two nodes the clocks differ: `same_host` in the rows says which case a row is
(the host name and the kernel's boot id agree: one clock).
"""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import sys
import time
import traceback
from pathlib import Path

import torch

from ..paged import kernels
from ..timing import sync_device
from .config import DECODE, PREFILL, DisaggConfig
from .backends import BACKENDS
from .endpoints import Rows, Sink, Source, units
from .links import event_ms
from .memory import DecodeMemory
from .protocol import Control, IncompleteCacheError, LandedLayers

__all__ = ["entry", "connect", "ROWS_FILE"]

ROWS_FILE = "decode_rows.json"  # what the decode worker hands to the launcher (removed once tables are written)


def connect(host: str, port: int, prefix: str, timeout_s: float):
    """A client of the control store (the launcher's, or torchrun's agent store), under `prefix`."""
    import torch.distributed as dist
    from datetime import timedelta

    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
    return dist.PrefixStore(prefix, store)


@functools.lru_cache(maxsize=1)
def host_id() -> str:
    """This host's name and, where Linux gives it, its boot id: two processes whose ids agree read one monotonic
    clock (two network namespaces of one machine do; two machines that share a name do not)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}" if boot else socket.gethostname()


def _ns() -> int:
    return time.monotonic_ns()


def _build(cfg: DisaggConfig, dev: torch.device):
    from .. import models

    return models.build(cfg.model, weights=cfg.weights, device=dev, dtype=cfg.kv_dtype, seed=cfg.seed)


def _pool_for(model, context: int, cfg: DisaggConfig, dev: torch.device, seed: int):
    """A pool twice the blocks the context needs, and a table of its blocks: drawn at random, or the lowest ids
    in order (`cfg.block_order`)."""
    from ..kvcache import layout_for
    from ..paged import BlockAllocator, BlockPool, PoolSpec

    spec = PoolSpec.from_kv_layout(layout_for(model, context, dtype=cfg.kv_dtype), cfg.block_size)
    n = 2 * spec.blocks_for(context)
    pool = BlockPool(spec, n, device=dev).poison()
    table = BlockAllocator(n, cfg.block_size, seed=seed, order=cfg.block_order).allocate(context)
    return pool, table


# ------------------------------------------------------------------------------------------- prefill


class PrefillWorker:
    def __init__(self, cfg: DisaggConfig, model, dev: torch.device, control: Control, link, generation: int = 0):
        self.cfg, self.model, self.dev, self.control, self.link = cfg, model, dev, control, link
        self.generation = generation
        self._sources: dict = {}
        self._filled: set = set()  # the (layout, context) sources this process has prefilled
        self._dst_rows = None  # (the decode side's table, its Rows) of the last paged request

    def source(self, layout: str, context: int):
        from ..kvcache import KVBuffer, layout_for
        from ..steps import make_prompt

        key = (layout, context)
        if key not in self._sources:
            self._sources.clear()  # one context's buffers at a time: 32k of a 7B model is 1.9 GB
            ids = make_prompt(self.model.config.vocab_size, context, self.dev, seed=self.cfg.seed)
            self._filled.clear()
            if layout == "contiguous":
                src = Source(buffer=KVBuffer(layout_for(self.model, context, dtype=self.cfg.kv_dtype), self.dev))
                table = None
            else:
                pool, table = _pool_for(self.model, context, self.cfg, self.dev, seed=self.cfg.seed + 1)
                src = Source(pool=pool, block_ids=table.ids.tolist())
            self._sources[key] = (ids, src, table)
        return self._sources[key]

    def _prefill(self, ids, src: Source, table, hooks=None):
        from ..paged import prefill_into_pages
        from ..steps import prefill

        if src.paged:
            if hooks is not None:
                with hooks:
                    return prefill_into_pages(self.model, ids, src.pool, table)
            return prefill_into_pages(self.model, ids, src.pool, table)
        if hooks is not None:
            with hooks:
                return prefill(self.model, ids, src.buffer, hooks)
        return prefill(self.model, ids, src.buffer)

    def handle(self, n: int, msg: dict) -> dict:
        from ..hooks import LayerHooks

        ids, src, table = self.source(msg["layout"], msg["context"])
        mode = msg["mode"]
        if hasattr(self.link, "take_stats"):  # nixl: this request's counts start from nothing
            self.link.take_stats()
        if BACKENDS[self.link.name].one_sided and mode != "colocated":
            self.link.attach(msg["tag"])
            rows = None
            if src.paged:
                key = (msg["tag"], msg["dst_num_blocks"], tuple(msg["dst_blocks"]))
                if self._dst_rows is None or self._dst_rows[0] != key:  # the same table each request: one object,
                    self._dst_rows = (key, Rows.for_ids(src.layers, msg["dst_num_blocks"], msg["dst_blocks"],
                                                         self.dev))  # so what the link tuned and captured stays
                rows = self._dst_rows[1]
            self.link.bind(msg["tag"], rows, src.pool.rows.shape[1] if src.paged else 0)
        if msg.get("bench"):
            # a one-sided link is timed inside the prefill process, which issues the copies; the others across both
            return self.bench(src, msg) if BACKENDS[self.link.name].one_sided else self.bench_dist(n, src, msg)
        if mode == "resend":  # a retry: only the layers asked for, from the source the last prefill left
            if (msg["layout"], msg["context"]) not in self._filled:  # a new process (its predecessor died)
                self._first = int(self._prefill(ids, src, table).argmax(-1).view(-1)[0])
                self._filled.add((msg["layout"], msg["context"]))
            return self.resend(n, msg, src)
        fault = msg.get("fault") or {}
        drop = fault["layer"] if fault.get("kind") == "drop" else self.cfg.drop_layer
        # on an in-order link (nccl) a layer that is not sent holds back every layer behind it: the decode side's
        # receive for it would take the next layer's bytes. They leave at the fence (serve), in order.
        held = drop >= 0 and getattr(self.link, "in_order", False)
        sent: list[int] = []
        sync_device(self.dev)
        t0 = _ns()
        if mode == "layerwise":
            def on_layer(i):
                if i == drop or (held and i > drop):
                    return
                if fault.get("kind") == "delay" and i == fault["layer"]:
                    time.sleep(fault["seconds"])  # past the decode side's deadline
                if fault.get("kind") == "kill" and i == fault["layer"]:
                    self.link.finish_sends(n)  # the layers before this one are on their way
                    # the launcher restarts only a death announced here (a store set returns once stored): any
                    # other SIGKILL (the OOM killer, a user) stays a failure of the run
                    self.control.post(f"kill/{self.generation}", {"request": n, "layer": i})
                    os.kill(os.getpid(), signal.SIGKILL)  # a crash: nothing else posted, nothing closed
                self.link.send(n, (i,), src, corrupt=fault.get("kind") == "corrupt" and i == fault["layer"])
                sent.append(i)

            hooks = LayerHooks(self.model, on_layer, ranges=False, point="attention" if src.paged else "cache")
            logits = self._prefill(ids, src, table, hooks)
        else:
            logits = self._prefill(ids, src, table)
        self._filled.add((msg["layout"], msg["context"]))
        # prefill's end: its own stream only (a device-wide sync would wait for the layer-wise copies too)
        if self.dev.type == "cuda":
            torch.cuda.current_stream(self.dev).synchronize()
        t1 = _ns()
        if mode == "bulk":
            for unit in units("bulk", src.layers):
                self.link.send(n, unit, src)
            sent = list(range(src.layers))
        if mode != "colocated":
            self.link.finish_sends(n)
        t2 = _ns()
        first = int(logits.argmax(-1).view(-1)[0])
        self._first = first
        out = {"first_token": first, "t_prefill_start_ns": t0, "t_prefill_end_ns": t1, "t_sent_ns": t2,
               "prefill_ms": (t1 - t0) / 1e6, "send_host_ms": (t2 - t1) / 1e6, "host": host_id(),
               "bytes_moved": sum(src.nbytes(u) for u in units(mode if mode != "colocated" else "bulk", src.layers)),
               "sent": sent}
        if hasattr(self.link, "take_stats"):  # nixl: descriptors, transfers and posting time of this request
            out["link"] = self.link.take_stats()
        if msg.get("checksum"):
            out.update(self.checksums(src))
        return out

    def checksums(self, src: Source) -> dict:
        """Every layer's checksum of the true source (kvlab.disagg.faults.checksum), and its cost in ms."""
        from .faults import checksums

        sync_device(self.dev)
        t0 = _ns()
        sums = checksums([src.view((i,)) for i in range(src.layers)])  # ends in tolist(): the device is done
        return {"checksums": sums, "checksum_ms": (_ns() - t0) / 1e6,
                "checksum_bytes": sum(src.nbytes((i,)) for i in range(src.layers))}

    def resend(self, n: int, msg: dict, src: Source) -> dict:
        """Send the layers `msg["layers"]` again (a retry of a request whose other layers landed)."""
        t0 = _ns()
        for i in msg["layers"]:
            self.link.send(n, (i,), src)
        self.link.finish_sends(n)
        out = {"first_token": self._first, "t_prefill_start_ns": t0, "t_prefill_end_ns": t0, "t_sent_ns": _ns(),
               "prefill_ms": 0.0, "send_host_ms": (_ns() - t0) / 1e6, "host": host_id(),
               "bytes_moved": sum(src.nbytes((i,)) for i in msg["layers"]), "sent": list(msg["layers"])}
        if hasattr(self.link, "take_stats"):
            out["link"] = self.link.take_stats()
        if msg.get("checksum"):
            out.update(self.checksums(src))
        return out

    def bench(self, src: Source, msg: dict) -> dict:
        """The bulk send alone (into the decode process's destination) against a plain contiguous copy of the
        same bytes inside this process, on the same path (to the destination's device), A B / B A alternated."""
        allu = tuple(range(src.layers))
        nbytes = src.nbytes(allu)
        dst_dev = self.link._dst[msg["tag"]].device
        a = torch.empty(nbytes, dtype=torch.uint8, device=self.dev)
        b = torch.empty(nbytes, dtype=torch.uint8, device=dst_dev)
        stream = self.link.stream
        send, plain, layer = [], [], []

        def time_plain():
            return event_ms(stream, lambda: b.copy_(a, non_blocking=True))

        default = []
        tuned = None
        if src.paged:  # the default kernel config first, then the one tuned on these tensors
            self.link.reset_tuning()
            for k in range(msg["warmup"] + msg["n"]):
                ms = self.link.time_copy(allu, src)
                if k >= msg["warmup"]:
                    default.append(ms)
            tried = self.link.tune(src)
            tuned = {"config": self.link.kernel_config.as_dict(), "order": self.link.order, "candidates": len(tried),
                     "finalists": [{k: r[k] for k in ("order", "ms", "send_ms")} for r in tried if "send_ms" in r]}
            extra = self._paged_controls(src, msg)
        for k in range(msg["warmup"] + msg["n"]):
            order = (0, 1) if k % 2 == 0 else (1, 0)
            got = {}
            for which in order:
                got[which] = self.link.time_copy(allu, src) if which == 0 else time_plain()
            if k >= msg["warmup"]:
                send.append(got[0])
                plain.append(got[1])
                layer.append(self.link.time_copy((src.layers - 1,), src))
        if src.paged:
            tuned.update(extra)
        self.link.reset_tuning()
        kernel = "copy_"
        if src.paged:
            kernel = (f"triton row copy, tuned (order: {tuned['order']})"
                      + (", one CUDA graph" if self.link.graphs else "")
                      + (" (pulled by the decode GPU)" if self.link.pulls(src) else ""))
        return {"send_ms": send, "ceiling_ms": plain, "layer_ms": layer, "send_default_ms": default, "bytes": nbytes,
                "layer_bytes": src.nbytes((src.layers - 1,)), "tuned": tuned, "kernel": kernel, "timer": "cuda events"}

    def bench_dist(self, n: int, src: Source, msg: dict) -> dict:
        """nccl and gloo: the bulk send (and the last layer's) alone, each start read on this host's monotonic clock
        after the decode side has posted its receive (it reads the end once the bytes are on its device, scattered
        into its pool when paged), against a plain copy of the same bytes inside this process to the decode device
        (the peer GPU; a host copy on a CPU), timed the same way: sync, clock, copy, sync, clock. Rounds alternate
        copy-then-send and send-then-copy; a copy after a send waits until the decode side has landed it (its
        scatter would otherwise share the decode GPU with the copy)."""
        allu, last = tuple(range(src.layers)), (src.layers - 1,)
        nbytes = src.nbytes(allu)
        peer = torch.device(msg["decode_device"]) if msg.get("decode_host") == host_id() else None
        a = torch.empty(nbytes, dtype=torch.uint8, device=self.dev)
        b = torch.empty(nbytes, dtype=torch.uint8, device=peer) if peer is not None else None

        def plain() -> float:
            if b is None:  # another host: no copy to its device can be made here
                return float("nan")
            sync_device(self.dev), sync_device(b.device)
            t0 = _ns()
            b.copy_(a, non_blocking=True)
            sync_device(b.device), sync_device(self.dev)
            return (_ns() - t0) / 1e6

        starts: dict = {"send": [], "layer": []}
        ceiling = []
        for k in range(msg["warmup"] + msg["n"]):
            if k % 2:
                ceiling.append(plain())
            for kind, unit in (("send", allu), ("layer", last)):
                self.control.wait(f"req{n}/bench/{kind}{k}", f"the decode side's receive of bench round {k}")
                sync_device(self.dev)
                starts[kind].append(_ns())
                self.link.send(n, unit, src)
                self.link.finish_sends(n)
            if not k % 2:
                # after the decode side has its bytes (scattered into its pool, when paged) and its GPU is idle. In
                # run 092931 the copies after a send took 0.31 ms longer than those before; waiting halved that
                # (095437), and did not explain why the paged rounds' copy takes 6.6 ms against 5.0 in contiguous
                self.control.wait(f"req{n}/bench/landed{k}", f"the decode side's landing of bench round {k}")
                ceiling.append(plain())
        w = msg["warmup"]
        gather = " (Triton gather, Triton scatter on the decode side)" if src.paged and self.dev.type == "cuda" else ""
        return {"t_send_ns": starts["send"], "t_layer_ns": starts["layer"], "ceiling_ms": ceiling[w:],
                "send_default_ms": [], "bytes": nbytes, "layer_bytes": src.nbytes(last), "tuned": None,
                "kernel": f"{self.link.name} send{gather}", "timer": "host clock, two processes", "host": host_id()}

    def _paged_controls(self, src: Source, msg: dict) -> dict:
        """Where a paged IPC send's time goes, tuned config and order, one plain launch each (no CUDA graph), median
        of n each: the send's launch into the IPC pool, the same launch into a pool of this process (same shape,
        same rows: is it the IPC mapping?), and into the IPC pool with the rows sorted by source row (is it the
        order of the reads?)."""
        dst = self.link._dst[msg["tag"]].view(-1, src.pool.rows.shape[1])
        local = torch.empty_like(dst)  # on the decode GPU too, when the send pulls
        sidx, didx = self.link._rows_of(tuple(range(src.layers)), src)  # the send's rows, in its order
        perm = torch.argsort(sidx)
        cfg = self.link.kernel_config
        stream = self.link._stream_for(src)

        def one(d, si, di):
            return event_ms(stream, lambda: kernels.launch_rows(src.pool.rows, si, d, di, cfg))

        out = {"local_pool_ms": [], "ipc_src_order_ms": [], "ipc_send_order_ms": []}
        for k in range(msg["warmup"] + msg["n"]):
            got = (one(local, sidx, didx), one(dst, sidx[perm], didx[perm]), one(dst, sidx, didx))
            if k >= msg["warmup"]:
                for key, ms in zip(out, got):
                    out[key].append(ms)
        del local
        import statistics

        return {k: statistics.median(v) for k, v in out.items()}

    def serve(self, start: int = 0) -> None:
        """Answer requests start, start + 1, … until told to stop (a process that replaces a dead one starts at
        the request the decode side names)."""
        n = start
        while True:
            # the decode side computes its reference before the first request: allow it the model's time
            msg = self.control.wait(f"req{n}/go", f"request {n} from the decode process", self.cfg.timeout_s * 2)
            if msg.get("stop"):
                self.link.close()  # unmap the decode side's memory before it goes
                self.control.post("released", 1)
                return
            if msg.get("release"):  # the decode side is done with a destination (ipc)
                self.link.release(msg["release"])
                self.control.post(f"req{n}/done", {"released": msg["release"]})
                n += 1
                continue
            # in_order: how this side's sends match, which the decode side's campaign checks against its own
            done = self.handle(n, msg)
            self.control.post(f"req{n}/done", {**done, "in_order": getattr(self.link, "in_order", False)})
            if msg.get("fenced"):
                # the decode side says which posted receives never got their layer (dropped): fill them, so no
                # late byte can land in a later request's destination, then wait for the next request
                ack = self.control.wait(f"req{n}/ack", f"request {n}'s acknowledgement")
                ids, src, _ = self.source(msg["layout"], msg["context"])
                for i in ack["drain"]:
                    self.link.send(n, (i,), src)
                self.link.finish_sends(n)
            n += 1


# -------------------------------------------------------------------------------------------- decode


class DecodeWorker:
    def __init__(self, cfg: DisaggConfig, model, dev: torch.device, control: Control, link, progress: bool = True):
        self.cfg, self.model, self.dev, self.control, self.link = cfg, model, dev, control, link
        self.rows: list[dict] = []
        self.bench_rows: list[dict] = []
        self.tuned: list[dict] = []
        self.fault_rows: list[dict] = []
        self.n = 0
        self.progress = progress
        self.generation = 0  # of the prefill process now serving; a new one after each death (kill faults)
        self.peer_dead = False  # the launcher recorded the current prefill process's death
        self.mem = DecodeMemory(dev, cfg.decode_memory_gib)  # its phases, its cap, what an out-of-memory says

    def take_over(self) -> None:
        """The prefill process died: leave its process group and form the next with the process the launcher
        started in its place (it learns here which request to answer first), on a new link."""
        import torch.distributed as dist

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
        from ..kvcache import KVBuffer, layout_for
        from ..steps import decode, make_prompt, prefill

        ids = make_prompt(self.model.config.vocab_size, context, self.dev, seed=self.cfg.seed)
        ref = KVBuffer(layout_for(self.model, context, dtype=self.cfg.kv_dtype), self.dev)
        first = prefill(self.model, ids, ref).argmax(-1).view(1)
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
        from tqdm.auto import tqdm

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
                from ..kvcache import KVBuffer

                sink, table = Sink(buffer=KVBuffer(ref[0].layout, self.dev)), None
            else:
                pool, table = _pool_for(self.model, context, self.cfg, self.dev, seed=self.cfg.seed + 2)
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
                self.control.store.add("progress", 1)
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
            from .faults import run_campaign

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
                ends[kind].append(_ns())
            self.control.post(f"req{n}/bench/landed{k}", 1)  # the prefill side's plain copy waits for this
        got = self.control.wait(f"req{n}/done", f"the bench of {msg['tag']}")
        w = msg["warmup"]
        one_clock = got["host"] == host_id()  # across two nodes the two clocks differ: no time can be read
        for kind in ("send", "layer"):
            got[f"{kind}_ms"] = [(e - s) / 1e6 if one_clock else float("nan")
                                 for e, s in zip(ends[kind][w:], got[f"t_{kind}_ns"][w:])]
        return got

    def request(self, mode: str, base: dict, sink: Sink, table, ref) -> dict:
        from ..steps import decode

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
        t_landed = _ns()
        try:
            if late is not None:  # refused now: waiting for the prefill's end too would double the deadline
                tracker.require(n)
            done = self.control.wait(f"req{n}/done", f"request {n}'s prefill")
            tracker.require(n)  # nothing decodes from a cache whose send has not landed
        except IncompleteCacheError as err:
            raise IncompleteCacheError(f"{err} — {late}" if late else str(err)) from None
        t0 = _ns()
        mem.step = "reading"
        cache = sink.buffer if table is None else sink.pool.read(table)
        sync_device(self.dev)
        read_ms = (_ns() - t0) / 1e6
        first = done["first_token"]
        mem.step = "decode"
        step_ms = self._step(cache, first)
        t_first = _ns()
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
        if "link" in done:  # nixl: what it took to post the request's transfers
            row.update(descriptors=done["link"]["descriptors"], transfers=done["link"]["transfers"],
                       post_ms=done["link"]["post_ms"])
        return row

    def _step(self, cache, first: int) -> float:
        """One decode step from `cache` (host-timed, synchronised), in ms: the first token's own cost."""
        from ..steps import decode

        sync_device(self.dev)
        t0 = _ns()
        decode(self.model, cache, torch.tensor([first], device=self.dev), 1)
        sync_device(self.dev)
        return (_ns() - t0) / 1e6


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


# ----------------------------------------------------------------------------------------- entry


def init_group(cfg: DisaggConfig, dev: torch.device, store, rank: int, generation: int = 0) -> None:
    """The two processes' torch.distributed group; generation g > 0 is a new group with a prefill process that
    replaced a dead one (its own key prefix in the store)."""
    import torch.distributed as dist
    from datetime import timedelta

    pg = BACKENDS[cfg.backend].group
    kw = {"device_id": dev} if pg == "nccl" else {}
    timeout = cfg.timeout_s
    if pg == "nccl" and cfg.faults:
        # NCCL's watchdog counts from each receive's posting; a campaign attempt may wait up to its deadline, the
        # prefill's answer (timeout_s) and the drain (timeout_s) before a receive completes, and its own
        # TimeoutError must come first (the watchdog aborts the process without a word)
        timeout = 2 * cfg.timeout_s + cfg.fault_timeout_s + 10.0
    dist.init_process_group(pg, store=dist.PrefixStore("pg" if not generation else f"pg{generation}", store),
                            rank=rank, world_size=2, timeout=timedelta(seconds=timeout), **kw)


def entry(rank: int, cfg_dict: dict, host: str, port: int, prefix: str, run_dir: str, progress: bool = True,
          generation: int = 0) -> None:
    """One process of the pair (torch.multiprocessing calls it with the rank first; torchrun through the CLI).
    Errors are posted as ``error/<role>`` (one line) before they propagate, so the launcher can name them.
    generation > 0: a prefill process started in place of a dead one."""
    import torch.distributed as dist

    cfg = DisaggConfig(**cfg_dict)
    role = "decode" if rank == DECODE else "prefill"
    store = connect(host, port, prefix, cfg.timeout_s)
    control = Control(store, cfg.timeout_s)
    try:
        if cfg.threads or not torch.cuda.is_available():
            torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 2) // 2))
        pre, dec = cfg.devices()
        dev = torch.device(dec if rank == DECODE else pre)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        if generation:  # a successor builds its model first, so it is ready when the decode side joins it
            model = _build(cfg, dev)
        init_group(cfg, dev, store, rank, generation)
        if BACKENDS[cfg.backend].group == "nccl":
            # NCCL's first point-to-point call blocks until the peer makes one too; the decode side posts its
            # receives before it sends a request, so without this exchange both sides would wait for each other
            one = torch.zeros(1, device=dev)
            for step in ((DECODE, PREFILL), (PREFILL, DECODE)):
                if rank == step[0]:
                    dist.send(one, dst=step[1])
                else:
                    dist.recv(one, src=step[0])
            torch.cuda.synchronize(dev)
        if not generation:
            model = _build(cfg, dev)
        link = BACKENDS[cfg.backend].make_link(role, dev, control, cfg.timeout_s,
                                               peer=PREFILL if rank == DECODE else DECODE,
                                               nixl_descs=cfg.nixl_descs, in_order=cfg.in_order)
        w = None
        ok = False
        try:
            if rank == DECODE:
                w = DecodeWorker(cfg, model, dev, control, link, progress)
                w.run()
                out = {"rows": w.rows, "bench": w.bench_rows, "tuned": w.tuned, "faults": w.fault_rows,
                       "in_order": getattr(w.link, "in_order", False),
                       "memory": w.mem.rows, "pid": os.getpid(),
                       "peer_pid": control.wait("pid/prefill", "the prefill process's pid"),
                       "host": socket.gethostname()}
                control.wait("released", "the prefill process to let go of this process's memory")
                Path(run_dir, ROWS_FILE).write_text(json.dumps(out))
            else:
                start = control.wait(f"gen{generation}/from", "the request to answer first") if generation else 0
                control.post("pid/prefill", os.getpid())
                PrefillWorker(cfg, model, dev, control, link, generation).serve(start)
            ok = True
        finally:
            try:
                (w.link if w is not None else link).close()
            except Exception:
                if ok:
                    raise
                # an error is already on its way out: it, not a close that failed after it, is what gets posted
        dist.destroy_process_group()
    except BaseException as err:
        line = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        try:
            control.post(f"error/{role}", {"error": line, "traceback": traceback.format_exc()[-4000:],
                                           "memory": getattr(err, "memory_rows", None)})
        except Exception:
            pass
        raise

