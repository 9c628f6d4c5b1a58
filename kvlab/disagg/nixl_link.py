"""The `nixl` backend: one NIXL agent in each process, the UCX backend, the prefill agent writing into memory
the decode agent registered.

Set up as vLLM's NixlConnector sets its agents up (one agent per worker, ``nixl_agent_config(backends=["UCX"])``,
the cache registered whole, the peer's agent metadata exchanged through a side channel — here the control
store), with two differences a reader should know: vLLM's decode side *reads* the finished cache from the
prefill side, while kvlab's prefill side *writes* unit by unit (so that layer-wise sends exist at all), and each
write carries a NIXL notification, ``req<r>/u<k>:<layers>``, which the decode agent receives once the bytes
are in its memory (the decode side learns of a layer only then, as with ipc).

Descriptors: a contiguous cache moves one descriptor per unit (all layers, or one layer; with an FP8 wire the
unit's e4m3 bytes and scales, quantized on the prefill stream into a registered buffer of their own and
dequantized by the decode side from its registered staging tensor once the notification arrives); a paged cache one
descriptor per row (one block of one layer's K or V), as a block-table transport posts them — or, with
``descs="merged"``, one per run of rows adjacent in both pools. Every request records its descriptor count and
the host time spent building descriptor lists and posting (``initialize_xfer`` + ``transfer``).

NIXL does not follow torch streams: a unit's transfer is posted by a poster thread once a CUDA event recorded
after the unit's writes has completed, so the prefill stream is never stalled by a post. Which UCX transport
carried the bytes (cma, cuda_ipc, tcp…) is read from UCX's own protocol report (`UCX_PROTO_INFO=y`, set by the
launcher) in the worker logs: `ucx_transports`.
"""

from __future__ import annotations

import base64
import os
import queue
import re
import threading
import time
from pathlib import Path

import numpy as np
import torch

from ..paged.nixl import nixl_api
from .endpoints import Rows, Sink, Source, flip_first_byte, span

__all__ = ["NixlLink", "ucx_transports", "DESCS"]

DESCS = ("block", "merged")


def _mem(device: torch.device) -> tuple[str, int]:
    return ("VRAM", device.index or 0) if device.type == "cuda" else ("DRAM", 0)


def merge_runs(src: np.ndarray, dst: np.ndarray, row_bytes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows moved in order, as (first source row, first destination row, bytes) of each run of rows that are
    adjacent in both pools (a run breaks where either side's next row is not the one after)."""
    if src.size == 0:
        return src, dst, np.zeros(0, dtype=np.int64)
    brk = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], brk))
    lengths = np.diff(np.concatenate((starts, [src.size])))
    return src[starts], dst[starts], lengths * row_bytes


class NixlLink:
    """One process's NIXL agent. Decode side: `expose` registers a destination and posts its metadata;
    `wait_landed` collects the notifications. Prefill side: `attach`/`bind` load the destination, `send` queues a
    unit for the poster thread, `finish_sends` waits until every posted transfer is DONE."""

    name = "nixl"
    pending: list = []  # a write lands or fails with its notification: no receive is posted in advance

    def __init__(self, role: str, device: torch.device, control, timeout_s: float, descs: str = "block"):

        if descs not in DESCS:
            raise ValueError(f"nixl descriptors = {descs!r} is not valid; valid: {', '.join(DESCS)}")
        api = nixl_api()
        self.role, self.device, self.control, self.timeout_s, self.descs = role, device, control, timeout_s, descs
        self.agent_name = f"kvlab-{role}-{os.getpid()}"
        self.agent = api.nixl_agent(self.agent_name, api.nixl_agent_config(backends=["UCX"]))
        # the agent is configured without NIXL's own locking (its default without a listener thread) and the
        # poster thread and the main thread both call it: every call holds this lock
        self._lock = threading.RLock()
        self._reg = None  # (tensor, registration) of the memory this side registered
        self._remote: dict = {}  # attach: tag -> destination info (prefill side)
        self._remote_name: str | None = None
        self._q: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._error: list = []
        self._stats = {"descriptors": 0, "post_ms": 0.0, "transfers": 0}
        self._notes: dict[int, list] = {}  # decode side: request -> notifications not yet consumed
        self._plan: list = []

    # ----------------------------------------------------------------------------------------- both sides
    def _register(self, t: torch.Tensor) -> None:
        """Register `t` (whole) with this agent, releasing what was registered before."""
        if self._reg is not None and self._reg[0] is t:
            return
        self._deregister()
        with self._lock:
            self._reg = (t, self.agent.register_memory(t))

    def _deregister(self) -> None:
        if self._reg is not None:
            with self._lock:
                self.agent.deregister_memory(self._reg[1])
            self._reg = None

    # ------------------------------------------------------------------------------------------ decode side
    def expose(self, tag: str, sink: Sink) -> None:
        """Register the destination and post what the prefill agent needs to write into it."""
        t = sink.tensor
        self._register(t)
        mem, dev = _mem(t.device)
        with self._lock:
            meta = self.agent.get_agent_metadata()
        self.control.post(f"nixl/{tag}", {"meta": base64.b64encode(meta).decode(),
                                          "addr": t.data_ptr(), "nbytes": t.nbytes, "elem_bytes": t.element_size(),
                                          "mem": mem, "dev": dev})

    def post_receive(self, request: int, plan, sink: Sink) -> None:
        self._plan = list(plan)

    def _poll(self) -> None:
        with self._lock:
            notifs = self.agent.get_new_notifs()
        for msgs in notifs.values():
            for m in msgs:
                m = m.decode() if isinstance(m, (bytes, bytearray)) else str(m)
                hit = re.fullmatch(r"req(\d+)/u(\d+):([\d,]*)", m)
                if hit:  # a write of an older request that landed late is kept under its own id and never read
                    self._notes.setdefault(int(hit[1]), []).append([int(x) for x in hit[3].split(",") if x])

    def wait_landed(self, request: int, sink: Sink, tracker, control=None, timeout_s: float | None = None) -> None:
        """Mark each unit's layers landed as its notification arrives; TimeoutError naming the units still
        missing at the deadline (default: the link's)."""
        t = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + t
        want = len(self._plan)
        got = 0
        while True:
            self._poll()
            for layers in self._notes.pop(request, []):
                if sink.wire is not None:  # FP8 wire bytes in the staging tensor: landed once dequantized
                    sink.settle(tuple(layers), sink.landing_view(tuple(layers)))
                    if sink.device.type == "cuda":
                        torch.cuda.current_stream(sink.device).synchronize()
                for i in layers:
                    tracker.mark(request, i)
                got += 1
            if got >= want:
                break
            if time.monotonic() > deadline:
                missing = tracker.missing(request)
                raise TimeoutError(f"request {request}: layer(s) {missing} did not land within {t:g} s "
                                   "(no NIXL notification)")
            time.sleep(0.0002)
        for old in [r for r in self._notes if r < request]:  # late writes of requests already decided
            del self._notes[old]
        if sink.device.type == "cuda":
            torch.cuda.synchronize(sink.device)

    def drain(self, request: int, timeout_s: float) -> list:
        return []

    # ----------------------------------------------------------------------------------------- prefill side
    def attach(self, tag: str) -> dict:
        """Load the decode agent's metadata for destination `tag` (once per tag)."""
        if tag not in self._remote:
            info = self.control.wait(f"nixl/{tag}", f"the decode side's destination {tag}")
            with self._lock:
                if self._remote_name is not None:
                    self.agent.remove_remote_agent(self._remote_name)
                name = self.agent.add_remote_agent(base64.b64decode(info["meta"]))
            self._remote_name = name.decode() if isinstance(name, bytes) else name
            self._remote = {tag: info}  # the decode side has moved on from its previous destination
        return self._remote[tag]

    def bind(self, tag: str, dst_rows: Rows | None, row_elems: int = 0) -> None:
        """The destination the next sends write into; paged: the decode pool's rows for them, each `row_elems`
        elements wide, which must all fit the destination the decode side registered."""
        info = self._remote[tag]
        if dst_rows is not None:
            have = info["nbytes"] // (row_elems * info["elem_bytes"])
            if dst_rows.top >= have:
                raise ValueError(f"the decode side's rows reach {dst_rows.top}, past the {have} rows of the "
                                 f"destination it registered ({tag})")
        self._tag, self._dst_rows = tag, dst_rows

    def _descs(self, unit, src: Source, staged: torch.Tensor | None = None):
        """(local, remote) descriptor arrays (addr, bytes, device) of one unit; `staged`: the unit's bytes in a
        tensor of their own (src.view(unit), rows in table order) to write from instead of the source."""
        info = self._remote[self._tag]
        mem, dev = _mem(src.device)
        if list(unit) != list(range(unit[0], unit[0] + len(unit))):
            raise ValueError(f"a unit is a run of consecutive layers, got {list(unit)}")
        if not src.paged:
            if src.wire is not None:  # FP8: the unit's wire bytes, from the source's wire_out into the staging
                off, end = src.wire_span(unit)
                n, first = end - off, src.wire_out.data_ptr() + off
            else:
                layer_bytes = src.buffer.data[0].nbytes
                off = 0 if len(unit) == src.layers else unit[0] * layer_bytes
                n, first = layer_bytes * len(unit), src.buffer.data.data_ptr() + off
            if off + n > info["nbytes"]:
                raise ValueError(f"layers {span(unit)} ({off + n:,} bytes in) do not fit the {info['nbytes']:,} bytes "
                                 f"the decode side registered ({self._tag})")
            base = first if staged is None else staged.data_ptr()
            loc = np.array([[base, n, dev]], dtype=np.int64)
            rem = np.array([[info["addr"] + off, n, info["dev"]]], dtype=np.int64)
            return loc, rem
        rb = src.pool.rows.shape[1] * src.pool.rows.element_size()
        drows = np.concatenate([self._dst_rows.host[i] for i in unit])
        if staged is None:
            srows, base = np.concatenate([src.rows.host[i] for i in unit]), src.pool.data.data_ptr()
        else:
            srows, base = np.arange(drows.size, dtype=np.int64), staged.data_ptr()
        if self.descs == "merged":
            srows, drows, lengths = merge_runs(srows, drows, rb)
        else:
            lengths = np.full(srows.size, rb, dtype=np.int64)
        loc = np.empty((srows.size, 3), dtype=np.int64)
        loc[:, 0] = base + srows * rb
        loc[:, 1] = lengths
        loc[:, 2] = dev
        rem = np.empty_like(loc)
        rem[:, 0] = info["addr"] + drows * rb
        rem[:, 1] = lengths
        rem[:, 2] = info["dev"]
        return loc, rem

    def send(self, request: int, unit, src: Source, corrupt: bool = False) -> None:
        """Queue one unit: the poster thread posts its WRITE once the unit's bytes are written (a CUDA event on
        the current stream). corrupt=True (fault injection): the unit leaves with its first byte's bits flipped,
        written from a copy of its own (the source stays true: prefill's attention may still be reading it)."""
        if src.wire is not None:  # FP8: quantized on the current stream into registered memory of its own
            a, b = src.wire_span(unit)
            src.wire.encode_layers_into(src.buffer.data, unit, src.wire_out[a:b])
            self._register(src.wire_out)
        else:
            self._register(src.buffer.data if not src.paged else src.pool.data)
        ev = None
        if self.device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
        self._start_poster()
        self._q.put(("send", request, tuple(unit), src, corrupt, ev))

    def _start_poster(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._post_loop, name="kvlab-nixl-poster", daemon=True)
            self._thread.start()

    def _post_loop(self) -> None:
        inflight: list = []  # (handle, request, unit, staged copy or None)
        while True:
            try:
                item = self._q.get(timeout=0.0005 if inflight else None)
            except queue.Empty:
                item = None
            try:
                if item is not None and item[0] == "send":
                    inflight.append(self._post(*item[1:]))
                inflight = self._progress(inflight)
                if item is not None and item[0] == "flush":
                    deadline = time.monotonic() + self.timeout_s
                    while inflight:
                        if time.monotonic() > deadline:
                            raise TimeoutError(f"{len(inflight)} NIXL transfer(s) not DONE within {self.timeout_s:g} s")
                        inflight = self._progress(inflight)
                        time.sleep(0.0002)
                    item[1].set()
                elif item is not None and item[0] == "stop":
                    deadline = time.monotonic() + 5
                    while inflight and time.monotonic() < deadline:  # nothing is left after a flush; an abort
                        inflight = self._progress(inflight)
                        time.sleep(0.0002)
                    for h, _, _, staged in inflight:
                        self._release(h, staged)
                    return
            except BaseException as err:  # reported by finish_sends
                self._error.append(err)
                for h, _, _, staged in inflight:
                    self._release(h, staged)
                inflight = []
                if item is not None and item[0] == "flush":
                    item[1].set()

    def _post(self, request, unit, src, corrupt, ev):
        if ev is not None:
            ev.synchronize()  # the unit's bytes are written: NIXL reads them as they are now
        staged = None
        if corrupt:  # a copy of the unit with its first byte flipped, registered for this one transfer
            if src.wire is not None:  # the wire bytes this unit sent, not a second quantize on this thread
                a, b = src.wire_span(unit)
                copy = flip_first_byte(src.wire_out[a:b].clone())
            else:
                copy = flip_first_byte(src.view(unit).clone().contiguous())
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
            with self._lock:
                staged = (copy, self.agent.register_memory(copy))
        handle = None
        try:
            t0 = time.perf_counter()
            loc, rem = self._descs(unit, src, staged[0] if staged else None)
            k = 0 if len(unit) == src.layers else unit[0]
            note = f"req{request}/u{k}:{','.join(map(str, unit))}".encode()
            with self._lock:
                local = self.agent.get_xfer_descs(loc, _mem(src.device)[0])
                remote = self.agent.get_xfer_descs(rem, self._remote[self._tag]["mem"])
                handle = self.agent.initialize_xfer("WRITE", local, remote, self._remote_name, note)
                state = self.agent.transfer(handle)
            self._stats["post_ms"] += (time.perf_counter() - t0) * 1e3
            self._stats["descriptors"] += len(loc)
            self._stats["transfers"] += 1
            if state not in ("PROC", "DONE"):
                raise RuntimeError(f"request {request}: NIXL transfer of layer(s) {span(unit)} ended in state {state!r}")
        except BaseException:
            self._release(handle, staged)
            raise
        return (handle, request, unit, staged)

    def _progress(self, inflight: list) -> list:
        left = []
        for h, request, unit, staged in inflight:
            with self._lock:
                state = self.agent.check_xfer_state(h)
            if state == "PROC":
                left.append((h, request, unit, staged))
                continue
            self._release(h, staged)
            if state != "DONE":
                raise RuntimeError(f"request {request}: NIXL transfer of layer(s) {span(unit)} ended in state {state!r}")
        return left

    def _release(self, h, staged=None) -> None:
        """Release a transfer handle (NIXL cancels it if it is still in flight) and the staged copy's registration."""
        with self._lock:
            if h is not None:
                try:
                    self.agent.release_xfer_handle(h)
                except Exception:
                    pass
            if staged is not None:
                try:
                    self.agent.deregister_memory(staged[1])
                except Exception:
                    pass

    def finish_sends(self, request: int) -> None:
        """Wait until every queued unit is posted and DONE (the notifications are then on their way)."""
        if self._thread is not None:
            done = threading.Event()
            self._q.put(("flush", done))
            if not done.wait(self.timeout_s + 5):
                raise TimeoutError(f"request {request}: the NIXL poster did not finish within {self.timeout_s:g} s")
        if self._error:
            err = self._error[0]
            self._error.clear()
            raise err

    def take_stats(self) -> dict:
        """This request's descriptors, transfers and posting time (ms), and reset them."""
        out, self._stats = self._stats, {"descriptors": 0, "post_ms": 0.0, "transfers": 0}
        return out

    def close(self) -> None:
        """Stop the poster (it finishes or releases what is in flight), forget the peer, release the memory. A poster
        that does not stop within 10 s is left with its registrations, rather than have them pulled from under it."""
        if self._thread is not None:
            self._q.put(("stop",))
            self._thread.join(timeout=10)
            if self._thread.is_alive():
                return
            self._thread = None
        with self._lock:
            if self._remote_name is not None:
                try:
                    self.agent.remove_remote_agent(self._remote_name)
                except Exception:
                    pass
                self._remote_name = None
        self._remote = {}
        self._deregister()


_PROTO = re.compile(r"\|\s*(\S+)\s+(intra-node|inter-node)\s+cfg#\d+\s*\|")
# "from host memory to host", and on a GPU "from cuda/GPU0 to cuda/dev[1]" (UCX names the devices, not "memory")
_WHAT = re.compile(r"\|\s*remote memory write by ucp_put\S* from (\w+)(?:/\S+)?(?: memory)? to (\w+)")
_ROW = re.compile(r"\|\s*[\d.]+(?:\.\.\S+)?\s*\|\s*[^|]+\|\s*([^|]+?)\s*\|$")


def cache_transports(found: list[dict], device: str, dst_device: str | None = None) -> list[str]:
    """The transports of the writes between the cache's memory kinds (cuda for a GPU device, else host: from the
    prefill `device`, to `dst_device` when given), from `ucx_transports`' entries. UCX also reports tables for other
    memory pairs it met (on the H200, writes from host memory to the GPU over tcp/lo, beside the cuda → cuda tables
    over cuda_ipc): those are not the pair the cache's descriptors name."""
    def kind(d):
        return "cuda" if str(d).startswith("cuda") else "host"

    return sorted({t for e in found if e["from"] == kind(device) and (dst_device is None or e["to"] == kind(dst_device))
                   for t in e["transports"]})


def ucx_transports(log: str | os.PathLike) -> list[dict]:
    """The transports UCX chose for the remote writes between the two agents, from its protocol report in a worker
    log (UCX_PROTO_INFO=y): one entry per (peer kind, memory pair) with the transports named in its table, e.g.
    {"peer": "intra-node", "from": "host", "to": "host", "transports": ["cma/memory"]}. Empty if the log has none."""
    try:
        text = Path(log).read_text(errors="replace")
    except OSError:
        return []
    out: list[dict] = []
    lines = [re.sub(r"^\[[^\]]*\]\s*\[[^\]]*\]\s*", "", ln).rstrip() for ln in text.splitlines()]
    i = 0
    while i < len(lines):
        head = _PROTO.search(lines[i])
        what = _WHAT.search(lines[i + 1]) if head and i + 1 < len(lines) else None
        if head and what:
            ts: list[str] = []
            j = i + 2
            while j < len(lines) and lines[j].lstrip().startswith(("|", "+")) and "cfg#" not in lines[j]:
                if "Range" not in lines[j]:
                    row = _ROW.search(lines[j])
                    if row:
                        ts += [t.strip() for t in row[1].split(",") if t.strip() and "/" in t]
                j += 1
            entry = {"peer": head[2], "from": what[1], "to": what[2], "transports": sorted(set(ts))}
            if entry not in out:
                out.append(entry)
            i = j
        else:
            i += 1
    return out
