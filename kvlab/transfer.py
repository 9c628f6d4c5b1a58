"""Transports: move a KV cache from the prefill device to a destination, in bulk or layer by layer.

One interface, many links. A Transport owns its destination buffer (allocated once, poisoned on
request) and a copy stream on the source GPU, so no allocation and no host synchronisation happen
while prefill runs. Destinations:

    "same-gpu"    a second buffer on the prefill GPU (device→device)
    "cuda:N"      another GPU (peer copy over NVLink / PCIe)
    "pinned"      page-locked host memory: the copy engine at PCIe speed, a stand-in for a ~400 Gb/s NIC
    "pageable"    ordinary host memory: the driver stages it through its own pinned buffers, a slow link

Granularity says how many copies one bulk send issues: "buffer" (one copy of the whole contiguous
cache), "layer" (one per layer: K and V are adjacent) or "tensor" (K and V separately, 2 × layers
copies — what a per-tensor DynamicCache forces, and what seed 004 measured).

Completion semantics: every send returns a Landing, which records a CUDA event per layer on the
copy stream. The receiver asks `landed(i)` / `all_landed()` or makes its stream wait on the events;
decode never starts on a partly written cache (`receive` waits for every layer).

Transfer states: each send into a destination has an id (1, 2, … per Transport) and its Landing is tied to it;
a Landing is in-flight, then landed — or failed (a layer-wise send that did not see every layer: `missing`
names them) or aborted (prefill raised, Ctrl-C). The destination's readers — `receive`, and a decode through
the buffer's transformers cache (`KVBuffer.as_hf_cache(filled=True)`) — refuse it, with a TransferError naming
the send and the missing layers, unless its latest send has landed or been waited for; a Landing that is not
the latest one is refused too (its layers may be a later request's). A new Transport's destination is poisoned.
Layer-wise sending (`Transport.layerwise`) and its policies live in kvlab.sends.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import devices
from .kvcache import KVBuffer, KVLayout
from .landing import Landing, TransferError, dst_stream_context
from .sends import LayerwiseSend

__all__ = ["Destination", "Transport", "GRANULARITIES", "DESTINATIONS", "check_capacity"]


GRANULARITIES = ("buffer", "layer", "tensor")
DESTINATIONS = ("same-gpu", "cuda:N", "pinned", "pageable")


@dataclass(frozen=True)
class Destination:
    """Where the bytes land. kind: "device" (same GPU), "peer", "pinned" or "pageable"."""

    kind: str
    device: torch.device
    label: str

    @classmethod
    def parse(cls, spec: "str | Destination", src_device: torch.device | str) -> "Destination":
        """Turn "same-gpu" / "cuda:1" / "pinned" / "pageable" into a Destination, checking it exists."""
        if isinstance(spec, Destination):
            return spec
        src = torch.device(src_device)
        s = str(spec).strip().lower()
        if s in ("same-gpu", "same-device", "same", "device"):
            return cls("device", src, "same-gpu" if src.type == "cuda" else "same-device")
        if s in ("pinned", "pinned-host", "host-pinned"):
            if not torch.cuda.is_available():
                raise ValueError("destination 'pinned' needs CUDA (page-locked memory is a CUDA feature); "
                                 "on this machine use one of ['same-device', 'pageable']")
            return cls("pinned", torch.device("cpu"), "pinned-host")
        if s in ("pageable", "pageable-host", "host", "cpu"):
            return cls("pageable", torch.device("cpu"), "pageable-host")
        if s.startswith("cuda"):
            try:
                dev = torch.device(s)
            except RuntimeError:
                raise ValueError(f"unknown destination {spec!r}; valid: 'same-gpu', 'cuda:N' (N a GPU index), "
                                 "'pinned', 'pageable'") from None
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            index = 0 if dev.index is None else dev.index
            if index >= count:
                raise ValueError(f"destination {spec!r} does not exist: this machine has {count} CUDA device(s)"
                                 + (f" (cuda:0 … cuda:{count - 1})" if count else ""))
            dev = torch.device("cuda", index)
            if src.type == "cuda" and dev == torch.device("cuda", src.index or 0):
                return cls("device", dev, "same-gpu")
            return cls("peer", dev, f"peer-{dev}")
        raise ValueError(f"unknown destination {spec!r}; valid: 'same-gpu', 'cuda:N', 'pinned', 'pageable'")


class Transport:
    """Move a contiguous KVBuffer to one destination.

    layout: the cache's shape; dest: a destination spec (see module doc); src_device: the prefill device.
    granularity: copies per bulk send ("buffer" | "layer" | "tensor").
    The destination buffer is allocated here, once.
    """

    name = "copy"

    def __init__(self, layout: KVLayout, dest: "str | Destination", src_device: torch.device | str,
                 granularity: str = "buffer", poison: bool = True):
        if granularity not in GRANULARITIES:
            raise ValueError(f"unknown granularity {granularity!r}; valid: {list(GRANULARITIES)}")
        self.layout = layout
        self.src_device = torch.device(src_device)
        self.dest = Destination.parse(dest, self.src_device)
        self.granularity = granularity
        self.cuda = self.src_device.type == "cuda"
        if not self.cuda and self.dest.kind not in ("device", "pageable"):
            raise ValueError(f"destination {self.dest.label!r} needs a CUDA source; the source is {self.src_device}")
        self._check_capacity()
        self.buffer = KVBuffer(layout, device=self.dest.device, pin_memory=self.dest.kind == "pinned")
        if poison:  # an unwritten byte shows, from the first send on
            self.buffer.poison()
        self._sends = 0
        self.latest: Landing | None = None
        self.buffer.guard = self.readable  # a decode through this buffer's cache asks first
        self.stream = torch.cuda.Stream(device=self.src_device) if self.cuda else None
        # the destination GPU's side of a peer copy gets its own stream, so the copy never
        # synchronises with whatever runs on that GPU's default stream
        self.dst_stream = torch.cuda.Stream(device=self.dest.device) if self.dest.kind == "peer" else None
        n_events = layout.layers
        # timing-enabled: handoff reads elapsed time up to the last layer's landing
        self._events = [torch.cuda.Event(enable_timing=True) for _ in range(n_events)] if self.cuda else None

    @property
    def label(self) -> str:
        return self.dest.label

    @property
    def copies_per_send(self) -> int:
        return {"buffer": 1, "layer": self.layout.layers, "tensor": 2 * self.layout.layers}[self.granularity]

    def _check_capacity(self) -> None:
        check_capacity(self.dest, self.layout.nbytes, f"destination {self.dest.label}")

    def staging(self) -> KVBuffer:
        """A pinned host buffer the size of the cache, for staged sends to pageable memory (made once)."""
        if getattr(self, "_staging", None) is None:
            self._staging = KVBuffer(self.layout, device="cpu", pin_memory=True)
        return self._staging

    def poison(self) -> None:
        """NaN-fill the destination so an unwritten byte shows in the decode check. The destination is unreadable
        until the next send lands (an earlier send's Landing no longer vouches for it)."""
        self.buffer.poison()
        self.latest = None

    # -- transfer states --------------------------------------------------------------------------
    def new_landing(self, events: list | None = None, worker=None) -> Landing:
        """The Landing of a new send into this destination: the next send id, and the latest from now on."""
        self._sends += 1
        self.latest = Landing(self.layout.layers, events, worker, send_id=self._sends, dest=self.dest.label)
        return self.latest

    def readable(self, landing: Landing | None = None) -> None:
        """TransferError unless the destination may be read: something was sent, the latest send (which
        `landing` must be, when given) has not failed or been aborted, and it has landed or been waited for."""
        latest = self.latest
        if latest is None:
            since = "since it was poisoned" if self._sends else "yet"
            raise TransferError(f"nothing has been sent to {self.dest.label} {since}: its buffer holds poison")
        self.readable_landing(landing if landing is not None else latest)
        if latest.state != "landed" and not latest.waited:
            raise TransferError(f"{latest.name()} is still in flight: wait for its landing (receive(), wait() or "
                                "stream_wait()) before reading the destination")

    def _check_src(self, src: KVBuffer) -> None:
        if src.layout != self.layout:
            raise ValueError(f"source layout {src.layout} does not match the transport's {self.layout}")
        if src.device != self.src_device and not (src.device.type == self.src_device.type == "cuda"
                                                  and (src.device.index or 0) == (self.src_device.index or 0)):
            raise ValueError(f"source buffer is on {src.device}, transport expects {self.src_device}")

    # -- bulk -------------------------------------------------------------------------------------
    def send(self, src: KVBuffer) -> Landing:
        """Copy the whole cache after the work already queued on the current stream (bulk mode)."""
        self._check_src(src)
        L = self.layout.layers
        if not self.cuda:
            landing = self.new_landing()
            try:
                self._copy_all(src)
            except BaseException as err:
                landing.abort(range(L), f"{type(err).__name__} during the copy")
                raise
            return landing
        compute = torch.cuda.current_stream(self.src_device)
        self.stream.wait_stream(compute)
        events = [self._events[-1]] * L if self.granularity == "buffer" else list(self._events)
        landing = self.new_landing(events)  # before the copies: a send that fails while queuing is not readable
        try:
            with torch.cuda.stream(self.stream), dst_stream_context(self.dst_stream):
                if self.granularity == "buffer":
                    self.buffer.data.copy_(src.data, non_blocking=True)
                    self._events[-1].record(self.stream)
                else:
                    for i in range(L):
                        if self.granularity == "layer":
                            self.buffer.data[i].copy_(src.data[i], non_blocking=True)
                        else:
                            self.buffer.data[i, 0].copy_(src.data[i, 0], non_blocking=True)
                            self.buffer.data[i, 1].copy_(src.data[i, 1], non_blocking=True)
                        self._events[i].record(self.stream)
        except BaseException as err:
            landing.abort(range(L), f"{type(err).__name__} while queuing the copies")
            raise
        return landing

    def _copy_all(self, src: KVBuffer) -> None:
        if self.granularity == "buffer":
            self.buffer.data.copy_(src.data)
        else:
            for i in range(self.layout.layers):
                if self.granularity == "layer":
                    self.buffer.data[i].copy_(src.data[i])
                else:
                    self.buffer.data[i, 0].copy_(src.data[i, 0])
                    self.buffer.data[i, 1].copy_(src.data[i, 1])

    # -- layer-wise -------------------------------------------------------------------------------
    def layerwise(self, src: KVBuffer, mode: str = "auto", wakes: str = "halving",
                  timeline: bool = False, release: "list[int] | None" = None) -> LayerwiseSend:
        """A per-layer sender for forward hooks (see kvlab.hooks): call `on_layer(i)` when layer i's K and V
        are final; `finish()` returns the Landing. mode, wakes, timeline, release: see LayerwiseSend
        (`release_plan` turns a send policy into `release`)."""
        self._check_src(src)
        return LayerwiseSend(self, src, mode, wakes, timeline, release)

    # -- receiving --------------------------------------------------------------------------------
    def receive(self, landing: Landing, device: torch.device | str | None = None) -> KVBuffer:
        """The cache on the decode device, once every layer has landed.

        GPU destinations: the decode stream waits on the landing's events (no host sync) and the
        destination buffer itself is returned. Host destinations: wait, then copy into a fresh, poisoned
        buffer on `device` (default: the source device) — the decode GPU reading from the "NIC".
        """
        self.readable_landing(landing)
        if self.dest.kind in ("device", "peer"):
            if self.cuda:
                landing.stream_wait(torch.cuda.current_stream(self.dest.device))
            else:
                landing.wait()
            return self.buffer
        landing.wait()
        device = torch.device(device) if device is not None else self.src_device
        out = KVBuffer(self.layout, device=device).poison()
        out.data.copy_(self.buffer.data, non_blocking=self.dest.kind == "pinned")
        return out


    def readable_landing(self, landing: Landing) -> None:
        """TransferError unless `landing` is the latest send into this destination and has not failed."""
        if not isinstance(landing, Landing):
            raise TypeError(f"expected the Landing that send() returned, got {landing!r} "
                            f"({type(landing).__name__}); the decode device is receive()'s second argument")
        if landing is not self.latest:
            latest = self.latest.name() if self.latest is not None else "none"
            raise TransferError(f"{landing.name()} is not the latest send into {self.dest.label} (latest: {latest}): "
                                "its layers may have been overwritten; receive the latest send's landing")
        landing.check()


def check_capacity(dest: Destination, need: int, what: str, hint: str = "") -> None:
    """Refuse, before allocating, `need` bytes at `dest` that its device (free GPU memory) or the host
    (MemAvailable) cannot hold. `what` names the buffer in the message; `hint` says what to change."""
    hint = f": {hint}" if hint else ""
    if dest.kind in ("device", "peer"):
        if dest.device.type != "cuda":
            return
        free, _ = torch.cuda.mem_get_info(dest.device)
        if need > free:
            raise ValueError(f"{what} needs {need / 2**30:.2f} GiB, but only {free / 2**30:.2f} GiB is free "
                             f"on {dest.device}{hint}")
    else:
        avail = devices.host_available_bytes()
        if avail is not None and need > avail:
            raise ValueError(f"{what} needs {need / 2**30:.2f} GiB of host memory, but only "
                             f"{avail / 2**30:.2f} GiB is available{hint}")

