"""The data path between the two processes, one class per backend.

A request's cache crosses in *units*: one unit of every layer (bulk) or one unit per layer (layer-wise).
`Source` (prefill side) says which bytes a unit is; `Sink` (decode side) where they land. Backends:

    ipc    CUDA IPC: the decode process shares its destination (torch's cudaIpcMemHandle sharing,
           torch.multiprocessing.reductions); the prefill process writes into it with its own copies — one
           copy engine `copy_` (contiguous; an FP8 wire: its bytes, quantized on the copy stream, into the
           decode side's staging tensor, dequantized there before the layer counts as landed) or kvlab's Triton
           row kernel (paged: rows gathered from the prefill pool and scattered into the decode pool in one pass). Between two GPUs a paged send *pulls*:
           Triton refuses to store to a peer GPU's IPC-mapped pointer ("cannot be accessed from Triton"), so the
           prefill process launches the row kernel on the decode GPU, reading its own pool over NVLink. A notifier thread waits for each
           unit's CUDA event and only then posts ``req{r}/landed/u{k}`` (the unit's layers): the decode side
           learns of a layer once its bytes are in its memory — one message a unit, so a bulk send is one. Same host; one GPU or two.
    nccl   torch.distributed isend/irecv on NCCL (two GPUs; across nodes too). Layer-wise sends are issued
           from the hook, so NCCL's stream waits for exactly that layer's writes.
    gloo   torch.distributed isend/irecv on gloo over TCP: the CPU path CI runs, and a stand-in for a network
           link. GPU tensors are staged through host memory on both sides.

nccl matches a send to a receive in the order both were posted (it ignores tags); gloo matches by tag, one per
unit, unless it is asked to match in order as NCCL does (`in_order`, so NCCL's fault protocol runs on a CPU).
On an in-order link a unit can never be skipped: the receive posted for it would take the next unit's bytes.

Paged caches travel as rows (one row = one block of one layer's K or V): gathered on the prefill side into a
staging tensor (nccl, gloo) and scattered into the decode pool's own blocks, or moved row to row (ipc).
"""

from __future__ import annotations

import queue
import threading

import torch

from ..paged import kernels
from ..paged.transports import enable_peer
from ..paged.triton_transports import finalists as fastest
from . import cuda_ipc
from .endpoints import Rows, Sink, Source, flip_first_byte, span

__all__ = ["DistLink", "IpcLink", "BULK_ORDERS", "bulk_perm", "event_ms", "unit_tag"]

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _receive_failed(request: int, unit, err: BaseException) -> TimeoutError:
    """A receive that ended in an error (a closed connection, a failed NCCL work), as the campaign reads it."""
    return TimeoutError(f"request {request}: the receive of layer(s) {list(unit)} failed "
                        f"({type(err).__name__}: {str(err).splitlines()[0][:160]})")


class DistLink:
    """nccl and gloo: torch.distributed point-to-point between rank `peer` and this rank.

    in_order: sends match receives in posting order, every unit with tag 0 (nccl always; gloo when asked, to run
    NCCL's protocol on a CPU). poll (nccl): wait for a receive by asking whether it has completed, against a
    host deadline, instead of blocking the host on the stream until it has (the fault campaign sets it: a layer
    that never comes must become a TimeoutError at the deadline, not a wait until NCCL's watchdog fires)."""

    def __init__(self, backend: str, peer: int, device: torch.device, timeout_s: float, in_order: bool = False,
                 group: str | None = None):
        self.name = backend
        self.group = group or backend  # the torch.distributed backend: "gloo" or "nccl"
        self.peer = peer
        self.device = device
        self.timeout_s = timeout_s
        self.in_order = in_order or self.group == "nccl"
        self.poll = False
        self.host_staged = self.group == "gloo" and device.type == "cuda"
        self._works: list = []
        self._recvs: list = []

    # prefill side
    def send(self, request: int, unit, src: Source, corrupt: bool = False) -> None:
        """Send one unit. corrupt=True (fault injection): the bytes leave with the first byte's bits flipped."""
        import torch.distributed as dist

        t = src.view(unit)
        if self.host_staged:
            t = t.to("cpu")  # gloo moves host memory only: the copy to the host is part of this link's cost
        if corrupt:
            t = flip_first_byte(t.clone())
        self._works.append((dist.isend(t.contiguous(), dst=self.peer, tag=self.tag(request, unit)), t))

    def tag(self, request: int, unit) -> int:
        """The unit's point-to-point tag: its own (unit_tag), or 0 on an in-order link."""
        return 0 if self.in_order else unit_tag(request, unit)

    def finish_sends(self, request: int) -> None:
        from datetime import timedelta

        for work, _ in self._works:
            if self.group == "gloo":
                work.wait(timedelta(seconds=self.timeout_s))
            else:
                work.wait()
        if self.group == "nccl":
            _sync(self.device)
        self._works = []

    # decode side
    def post_receive(self, request: int, plan, sink: Sink) -> None:
        """Post one receive per unit. gloo: a waiter thread waits for them in order and queues each unit as it
        completes — a gloo receive whose wait() timed out is dead for good, and the bytes sent for it later
        would match the next receive posted (another request's destination), so the deadline is kept on the
        queue instead, and a late unit still completes its own receive."""
        import queue
        import threading

        import torch.distributed as dist

        self._recvs = []
        for unit in plan:
            view = sink.landing_view(unit, host=self.host_staged)
            self._recvs.append((unit, dist.irecv(view, src=self.peer, tag=self.tag(request, unit)), view))
        self._arrived: queue.SimpleQueue | None = None
        if self.group == "gloo":
            self._arrived = queue.SimpleQueue()
            recvs, arrived = list(self._recvs), self._arrived

            def waiter():
                for unit, work, _ in recvs:
                    try:
                        work.wait()
                        arrived.put((unit, None))
                    except Exception as err:  # a closed connection
                        arrived.put((unit, err))
                        return

            threading.Thread(target=waiter, name="kvlab-gloo-recv", daemon=True).start()

    def _next(self, request: int, deadline: float, what: str):
        """The next unit's receive, complete (TimeoutError at the deadline; the receive stays posted)."""
        import queue
        import time

        unit, work, view = self._recvs[0]
        if self._arrived is not None:
            try:
                got, err = self._arrived.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"request {request}: layer(s) {list(unit)} {what}") from None
            if err is not None:
                raise _receive_failed(request, unit, err)
        else:
            if self.poll:  # NCCL's is_completed() asks the receive's CUDA event: it does not block
                while not work.is_completed():
                    if time.monotonic() >= deadline:
                        raise TimeoutError(f"request {request}: layer(s) {list(unit)} {what}")
                    time.sleep(5e-5)
                try:
                    work.wait()  # completed: the current stream is ordered after it (a failed one raises here)
                except Exception as err:
                    raise _receive_failed(request, unit, err) from None
            else:
                work.wait()  # NCCL: the current stream waits; the process group's timeout bounds it
        return self._recvs.pop(0)

    def wait_landed(self, request: int, sink: Sink, tracker, control=None, timeout_s: float | None = None) -> None:
        """Mark each unit landed as its receive completes, in order; TimeoutError at the first that does not
        complete within `timeout_s` (default: the link's). The units still posted stay in `pending` (see drain)."""
        import time

        t = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + t
        while self._recvs:
            unit, work, view = self._next(request, deadline, f"did not arrive within {t:g} s")
            if sink.staged or self.host_staged:
                sink.settle(unit, view)
            _sync(sink.device)  # landed = visible on the decode device
            for i in unit:
                tracker.mark(request, i)

    @property
    def pending(self) -> list:
        """The units whose receives are still posted (after a timeout)."""
        return [unit for unit, _, _ in self._recvs]

    def drain(self, request: int, timeout_s: float) -> list:
        """Wait for every receive still posted (the sender sends late units or filler for them), so none of them
        can land in a later request's destination; returns their units. TimeoutError if one never completes."""
        import time

        deadline = time.monotonic() + timeout_s
        done = []
        while self._recvs:
            unit, _, _ = self._next(request, deadline, "never completed: the channel to the prefill process is unusable")
            done.append(unit)
        return done

    def close(self) -> None:
        pass


class IpcLink:
    """CUDA IPC: the prefill process writes straight into the decode process's destination."""

    name = "ipc"

    def __init__(self, device: torch.device, control, timeout_s: float):
        self.device = device
        self.control = control
        self.timeout_s = timeout_s
        self._dst: dict = {}
        self._events: dict = {}
        self._q: queue.Queue = queue.Queue()
        self._error: list = []
        self._thread = None
        self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self.kernel_config = None  # the Triton row kernel's config (None: kernels.DEFAULT_CONFIG); see tune()
        self.graphs = True  # a paged bulk send replays one captured launch (see _graph)
        self._graphs: dict = {}
        self._tag, self._bound = None, None  # the destination and rows object of the last bind
        self.order = "table"  # the bulk send's row order (see tune())
        self._bulk_rows = None  # (source rows, destination rows) of a bulk send in that order, or None: the table's
        self._peer_stream = None  # a pull's stream, on the decode GPU (see _stream_for)
        self._peer_rows = None  # (source rows, their copy on the decode GPU) of the last pull

    # decode side
    def expose(self, tag: str, sink: Sink) -> None:
        self.control.post(f"ipc/{tag}", cuda_ipc.export(sink.tensor))  # plain fields, never a pickle

    def post_receive(self, request: int, plan, sink: Sink) -> None:
        self._plan = plan

    def wait_landed(self, request: int, sink: Sink, tracker, control, timeout_s: float | None = None) -> None:
        for unit in self._plan:
            key = f"req{request}/landed/u{0 if len(unit) > 1 else unit[0]}"  # as send() names it
            layers = control.wait(key, f"request {request}'s layer(s) {span(unit)} to land", timeout_s)
            if sink.wire is not None:  # FP8 wire bytes in the staging tensor: landed once dequantized into the cache
                sink.settle(unit, sink.landing_view(unit))
                _sync(sink.device)
            for i in layers:
                tracker.mark(request, i)

    pending: list = []  # CUDA IPC posts nothing in advance: nothing to drain

    def drain(self, request: int, timeout_s: float) -> list:
        return []

    # prefill side
    def attach(self, tag: str, sink_rows_ids=None) -> torch.Tensor:
        if tag not in self._dst:
            t = cuda_ipc.rebuild(self.control.wait(f"ipc/{tag}", f"the decode side's destination {tag}"))
            if t.device != self.device and t.device.type == "cuda":
                enable_peer(self.device, t.device)
            self._dst = {tag: t}  # the decode side has moved on: release the mapping of its previous destination
            self._peer_rows = None
        return self._dst[tag]

    def release(self, tag: str) -> None:
        """Let go of the decode side's destination `tag` (its mapping, and the graph and rows made for it), once
        every copy into it is done: the decode process can free that memory only after this process closed its
        handle (PyTorch counts the users of memory it shared)."""
        if tag not in self._dst:
            return
        for s in (self.stream, self._peer_stream):
            if s is not None:
                s.synchronize()
        self._dst.pop(tag)
        self._graphs = {}  # a graph keeps the address it writes to
        self._tag = self._bound = self._dst_rows = self._bulk_rows = self._peer_rows = None

    def pulls(self, src: Source) -> bool:
        """A paged send to another GPU: the row kernel runs on the decode GPU and reads this GPU's pool."""
        return src.paged and self._dst[self._tag].device != src.device

    def _stream_for(self, src: Source):
        if not self.pulls(src):
            return self.stream
        dev = self._dst[self._tag].device
        if self._peer_stream is None or self._peer_stream.device != dev:
            self._peer_stream = torch.cuda.Stream(device=dev)
        return self._peer_stream

    def _src_rows(self, src: Source) -> "Rows":
        """The source's row indices on the kernel's device (a pull: copied once to the decode GPU)."""
        if not self.pulls(src):
            return src.rows
        if self._peer_rows is None or self._peer_rows[0] is not src.rows:
            self._peer_rows = (src.rows, src.rows.to(self._dst[self._tag].device))
        return self._peer_rows[1]

    def bind(self, tag: str, dst_rows: "Rows | None", row_elems: int = 0) -> None:
        """The destination the next sends write into (and, paged, the decode pool's rows for them, each
        `row_elems` elements wide: they must all fit the destination the decode side shared). The same tag and
        the same rows object as the last bind keep what was tuned and captured for them."""
        if tag == self._tag and dst_rows is self._bound and tag in self._dst:
            return
        bound = dst_rows
        if dst_rows is not None:
            have = self._dst[tag].numel() // row_elems
            if dst_rows.top >= have:
                raise ValueError(f"the decode side's rows reach {dst_rows.top}, past the {have} rows of the "
                                 f"destination it shared ({tag})")
            dev = self._dst[tag].device
            if dev != dst_rows.all.device and dev.type == "cuda":  # a pull: the kernel and its indices on the decode GPU
                dst_rows = dst_rows.to(dev)
        self._tag, self._dst_rows, self._bound = tag, dst_rows, bound  # only once the rows were checked
        self.reset_tuning()  # a tuned order holds the rows of the tables it was tuned on

    def _rows_of(self, unit, src: Source) -> tuple[torch.Tensor, torch.Tensor]:
        """(source rows, destination rows) of a paged unit on the kernel's device: a bulk unit in the tuned order
        when tune() chose one (any order moves the same rows: destination rows are distinct)."""
        if len(unit) == src.layers and self._bulk_rows is not None:
            return self._bulk_rows
        return self._src_rows(src).of(unit), self._dst_rows.of(unit)

    def _copy(self, unit, src: Source, on_stream=None) -> None:
        dst = self._dst[self._tag]
        if src.wire is not None:  # FP8: the unit's wire bytes, made on this stream, in the decode side's staging
            a, b = src.wire_span(unit)  # one GPU (config refuses two): the kernel writes straight into the staging
            src.wire.encode_layers_into(src.buffer.data, unit, dst[a:b])
            return
        if not src.paged:
            view = dst if len(unit) == src.layers else dst[unit[0]]
            view.copy_(src.buffer.data if len(unit) == src.layers else src.buffer.data[unit[0]], non_blocking=True)
            return
        rows = dst.view(-1, src.pool.rows.shape[1])
        s_rows, d_rows = self._rows_of(unit, src)
        if len(unit) == src.layers and self.graphs and rows.is_cuda:
            self._graph(src, rows, s_rows, d_rows).replay()
        else:
            self._launch(src, rows, s_rows, d_rows)

    def _launch(self, src: Source, rows, s_rows, d_rows) -> None:
        # both row lists were checked on the host (Rows, bind): no bounds check, no sync on the timed path; a pull
        # runs on the decode GPU (the caller made _stream_for's stream current, so the device is that GPU)
        if self.pulls(src):
            kernels.launch_rows(src.pool.rows, s_rows, rows, d_rows, self.kernel_config or kernels.DEFAULT_CONFIG)
        else:
            kernels.copy_rows(src.pool.rows, s_rows, rows, d_rows, config=self.kernel_config, check_bounds=False)

    def _graph(self, src: Source, rows, s_rows, d_rows):
        """The bulk send's one kernel launch, captured once in a CUDA graph for these tensors and this config and
        replayed by every later bulk send: a Triton launch costs ~0.1 ms of host work, which a send from an idle
        stream waits for (the bench of run 20261201-030308: 1.02–1.04 ms a send against 0.926 ms back to back).
        The first call launches once (compiling the kernel; it writes the bytes the send writes), then captures on
        a side stream of the same device, ordered after the caller's stream (no device-wide synchronize)."""
        cfg = self.kernel_config.as_dict() if self.kernel_config is not None else None
        key = (rows.data_ptr(), tuple(rows.shape), rows.dtype, src.pool.rows.data_ptr(), tuple(src.pool.rows.shape),
               s_rows.data_ptr(), d_rows.data_ptr(), s_rows.numel(), tuple(sorted(cfg.items())) if cfg else None)
        if key not in self._graphs:
            here = torch.cuda.current_stream()  # _stream_for's stream: on the kernel's device
            self._launch(src, rows, s_rows, d_rows)
            # captured on a stream of our own on that device, without torch.cuda.graph's device-wide synchronize
            # and cache emptying
            cap = torch.cuda.Stream(device=here.device)
            cap.wait_stream(here)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.stream(cap):
                g.capture_begin(capture_error_mode="thread_local")
                try:
                    self._launch(src, rows, s_rows, d_rows)
                finally:
                    g.capture_end()
            here.wait_stream(cap)
            self._graphs = {key: g}  # the latest only: a graph keeps its tensors' addresses, not the tensors
        return self._graphs[key]

    def send(self, request: int, unit, src: Source, corrupt: bool = False) -> None:
        if self.stream is None:  # a CPU-only process cannot use CUDA IPC; make_link refuses earlier
            raise RuntimeError("CUDA IPC needs CUDA")
        self._start_notifier()
        compute = torch.cuda.current_stream(self.device)
        stream = self._stream_for(src)
        stream.wait_stream(compute)  # across GPUs too: an event of the prefill GPU's stream
        with torch.cuda.stream(stream):
            self._copy(unit, src)
            if corrupt:  # fault injection: flip the first byte of the unit where it landed
                dst = self._dst[self._tag]
                if src.wire is not None:
                    flip_first_byte(dst[src.wire_span(unit)[0]:])
                elif src.paged:
                    row = dst.view(-1, src.pool.rows.shape[1])[self._dst_rows.of(unit)[0]]
                    flip_first_byte(row)
                else:
                    flip_first_byte(dst if len(unit) == src.layers else dst[unit[0]])
            ev = torch.cuda.Event()
            ev.record(stream)
        self._q.put((request, 0 if len(unit) == src.layers else unit[0], unit, ev))

    def tune(self, src: Source, finalists: int = 6, repeats: int = 5) -> list[dict]:
        """Pick the row kernel's config and the bulk send's row order for this paged send on the real tensors
        (kernels.tune writes the same bytes a send writes), as notebook 04's triton transport does: every config
        in each order of BULK_ORDERS (the block table's; by destination row, by source row; block-major across
        the layer sides), then the `finalists` fastest timed again as sends (median of `repeats`, CUDA events on
        the copy stream). Only after a context's requests: run before them, it would fill the poisoned
        destination with the source's previous contents and hide a row a send fails to write. reset_tuning()
        goes back to the default config and the table's order."""

        rows = self._dst[self._tag].view(-1, src.pool.rows.shape[1])
        stream = self._stream_for(src)
        s_all, d_all = self._src_rows(src).all, self._dst_rows.all
        tried, cands = [], {}
        for order in BULK_ORDERS:
            perm = bulk_perm(order, s_all, d_all, 2 * src.layers)
            s, d = (s_all, d_all) if perm is None else (s_all[perm].contiguous(), d_all[perm].contiguous())
            cands[order] = (s, d)
            with torch.cuda.stream(stream):
                _, table = kernels.tune(src.pool.rows, s, rows, d, device=stream.device)
            tried += [{**row, "order": order} for row in table]
        timed = fastest(tried, finalists)
        fields = kernels.KernelConfig.__dataclass_fields__
        for row in timed:
            cfg = kernels.KernelConfig(**{f: row[f] for f in fields})
            s, d = cands[row["order"]]
            ms = sorted([event_ms(stream, lambda: kernels.launch_rows(src.pool.rows, s, rows, d, cfg))
                         for _ in range(repeats + 1)][1:])  # the first launch of a config warms it
            row["send_ms"] = ms[len(ms) // 2]
        pick = min(timed, key=lambda r: r["send_ms"])
        self.kernel_config = kernels.KernelConfig(**{f: pick[f] for f in fields})
        self.order = pick["order"]
        self._bulk_rows = None if self.order == "table" else cands[self.order]
        return tried

    def reset_tuning(self) -> None:
        self.kernel_config, self.order, self._bulk_rows = None, "table", None
        self._graphs = {}

    def time_copy(self, unit, src: Source) -> float:
        """One send alone on the copy stream (a pull's: on the decode GPU), in ms (CUDA events); no notification."""
        stream = self._stream_for(src)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        return event_ms(stream, lambda: self._copy(unit, src))

    def _start_notifier(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._notify, name="kvlab-ipc-notifier", daemon=True)
            self._thread.start()

    def _notify(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            request, k, unit, ev = item
            try:
                ev.synchronize()  # the bytes are in the decode process's memory now
                self.control.post(f"req{request}/landed/u{k}", list(unit))
            except Exception as err:  # reported by finish_sends
                self._error.append(err)
            finally:
                self._q.task_done()

    def finish_sends(self, request: int) -> None:
        self._q.join()
        if self._error:
            raise self._error.pop()

    def close(self) -> None:
        """Stop the notifier and unmap the decode side's memory (before the decode process frees it)."""
        if self._thread is not None:
            self._q.put(None)
            self._thread.join(timeout=5)
        if self._peer_stream is not None:
            self._peer_stream.synchronize()
        self._graphs = {}  # before the memory they write into is unmapped
        self._dst, self._peer_rows = {}, None
        if self.stream is not None:
            torch.cuda.synchronize(self.device)


# the orders a paged bulk send may move its rows in (any order moves the same rows; it decides which addresses the
# GPU's programs touch at once): the block table's (per layer side, K then V), ascending destination rows,
# ascending source rows, and block-major (the first block of every layer side, then the second, …)
BULK_ORDERS = ("table", "dst", "src", "interleaved")


def bulk_perm(order: str, s_rows: torch.Tensor, d_rows: torch.Tensor, sides: int) -> torch.Tensor | None:
    """The permutation of a bulk unit's rows for `order` (None: the table's own). `sides` = 2 · layers: the rows
    come as `sides` equal runs, one per layer side."""
    if order == "table":
        return None
    if order == "dst":
        return torch.argsort(d_rows, stable=True)
    if order == "src":
        return torch.argsort(s_rows, stable=True)
    if order == "interleaved":
        n = s_rows.numel() // sides
        return torch.arange(sides * n, device=s_rows.device).view(sides, n).t().reshape(-1)
    raise ValueError(f"unknown bulk order {order!r}; valid: {', '.join(BULK_ORDERS)}")


def event_ms(stream, fn) -> float:
    """`fn()`'s work queued on `stream` between two CUDA events, in ms (waits for it)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record(stream)
        fn()
        end.record(stream)
    end.synchronize()
    return start.elapsed_time(end)


def unit_tag(request: int, unit: tuple[int, ...]) -> int:
    """The point-to-point tag of one unit of one request. gloo matches a receive to a send by peer and tag, so
    with tags a layer that is never sent cannot let the next layer's bytes into its slot (without them, layer 1
    sent after a dropped layer 0 landed in layer 0's receive). NCCL ignores tags and matches in order: an
    in-order link never skips a unit (DistLink.in_order; a dropped layer holds back those behind it)."""
    layer = 4095 if len(unit) > 1 else unit[0]
    return (request % 500_000) * 4096 + layer
