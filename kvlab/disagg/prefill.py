"""The prefill worker: prefills each request, sends its cache in bulk after prefill or layer by layer from the
per-layer signal, posts ``req{r}/done``, and times the bulk send alone beside a plain copy of the same bytes (its
ceiling) when the decode side asks for a bench. kvlab.disagg.workers starts it in its own process."""

from __future__ import annotations

import os
import signal
import statistics
import time

import torch

from ..hooks import LayerHooks
from ..kvcache import KVBuffer, layout_for
from ..paged import kernels, prefill_into_pages
from ..steps import make_prompt, prefill
from ..timing import sync_device
from .backends import BACKENDS
from .config import DisaggConfig
from .endpoints import Rows, Source, units
from .faults import checksums
from .group import host_id, now_ns, pool_for
from .links import event_ms
from .protocol import Control
from .wire_codec import wire_codec

__all__ = ["PrefillWorker"]


class PrefillWorker:
    def __init__(self, cfg: DisaggConfig, model, dev: torch.device, control: Control, link, generation: int = 0):
        self.cfg, self.model, self.dev, self.control, self.link = cfg, model, dev, control, link
        self.generation = generation
        self._sources: dict = {}
        self._filled: set = set()  # the (layout, context) sources this process has prefilled
        self._dst_rows = None  # (the decode side's table, its Rows) of the last paged request

    def source(self, layout: str, context: int):
        key = (layout, context)
        if key not in self._sources:
            self._sources.clear()  # one context's buffers at a time: 32k of a 7B model is 1.9 GB
            ids = make_prompt(self.model.config.vocab_size, context, self.dev, seed=self.cfg.seed)
            self._filled.clear()
            if layout == "contiguous":
                src = Source(buffer=KVBuffer(layout_for(self.model, context, dtype=self.cfg.kv_dtype), self.dev),
                             wire=wire_codec(self.cfg))
                table = None
            else:
                pool, table = pool_for(self.model, context, self.cfg, self.dev, seed=self.cfg.seed + 1)
                src = Source(pool=pool, block_ids=table.ids.tolist())
            self._sources[key] = (ids, src, table)
        return self._sources[key]

    def _prefill(self, ids, src: Source, table, hooks=None):
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
        t0 = now_ns()
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
        t1 = now_ns()
        if mode == "bulk":
            for unit in units("bulk", src.layers):
                self.link.send(n, unit, src)
            sent = list(range(src.layers))
        if mode != "colocated":
            self.link.finish_sends(n)
        t2 = now_ns()
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
        """Every layer's checksum of what the decode side must hold (kvlab.disagg.faults.checksum), and its cost in
        ms."""
        sync_device(self.dev)
        t0 = now_ns()
        # what the decode side must hold (an FP8 wire's: dequantized); ends in tolist(): the device is done
        sums = checksums([src.truth((i,)) for i in range(src.layers)])
        return {"checksums": sums, "checksum_ms": (now_ns() - t0) / 1e6,
                "checksum_bytes": sum(src.truth_nbytes((i,)) for i in range(src.layers))}

    def resend(self, n: int, msg: dict, src: Source) -> dict:
        """Send the layers `msg["layers"]` again (a retry of a request whose other layers landed)."""
        t0 = now_ns()
        for i in msg["layers"]:
            self.link.send(n, (i,), src)
        self.link.finish_sends(n)
        out = {"first_token": self._first, "t_prefill_start_ns": t0, "t_prefill_end_ns": t0, "t_sent_ns": now_ns(),
               "prefill_ms": 0.0, "send_host_ms": (now_ns() - t0) / 1e6, "host": host_id(),
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
            t0 = now_ns()
            b.copy_(a, non_blocking=True)
            sync_device(b.device), sync_device(self.dev)
            return (now_ns() - t0) / 1e6

        starts: dict = {"send": [], "layer": []}
        ceiling = []
        for k in range(msg["warmup"] + msg["n"]):
            if k % 2:
                ceiling.append(plain())
            for kind, unit in (("send", allu), ("layer", last)):
                self.control.wait(f"req{n}/bench/{kind}{k}", f"the decode side's receive of bench round {k}")
                sync_device(self.dev)
                starts[kind].append(now_ns())
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
