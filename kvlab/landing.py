"""Completion: the handle of one send, saying which layers have landed at its destination, and the refusal to read
a destination whose send did not complete.

Every send (kvlab.transfer.Transport, kvlab.sends.LayerwiseSend, the paged transports) returns a `Landing`, which
records a CUDA event per layer on the copy stream; the receiver asks `landed(i)` / `all_landed()` or makes its
stream wait on the events. A Landing is in flight, then landed — or failed (a layer-wise send that did not see
every layer: `missing` names them) or aborted (prefill raised, Ctrl-C); readers refuse a destination whose
latest send has not landed with a `TransferError` naming the send and the missing layers.
"""

from __future__ import annotations

import operator
import threading

import torch

__all__ = ["Landing", "TransferError", "dst_stream_context"]


class TransferError(RuntimeError):
    """A destination was read whose latest send has not landed (failed, aborted, never sent, or superseded)."""


class Landing:
    """Completion handle for one send: which layers have landed at the destination.

    events[i] is a CUDA event recorded on the copy stream after layer i's bytes were copied (None on a
    CPU-only machine, where copies are synchronous). A pageable layer-wise send also has a worker
    thread; `wait()` joins it.
    """

    def __init__(self, layers: int, events: list | None = None, worker: "threading.Thread | None" = None,
                 send_id: int = 0, dest: str = ""):
        self.layers = layers
        self.events = events if events is not None else [None] * layers
        self.worker = worker
        self.landed_layers = 0 if worker is not None else layers  # updated by a worker as it goes
        self.send_id = send_id
        self.dest = dest
        self._end: str | None = None  # "failed" | "aborted" once the send is known not to land
        self.missing: list[int] = []
        self.why = ""
        self.waited = False
        self.issuing = False  # a layer-wise send between begin() and finish(): not landed, whatever the events say
        self._issued: list[bool] = []

    # -- state --------------------------------------------------------------------------------------
    @property
    def state(self) -> str:
        """"in-flight", "landed", "failed" or "aborted"."""
        if self._end is not None:
            return self._end
        return "landed" if not self.issuing and self.all_landed() else "in-flight"

    def fail(self, missing, why: str) -> "Landing":
        """The send ended with layers `missing` never sent (they hold whatever was there before)."""
        self._end, self.missing, self.why = "failed", sorted(int(i) for i in missing), why
        return self

    def abort(self, missing, why: str = "aborted") -> "Landing":
        """The send was stopped (prefill raised, Ctrl-C): layers `missing` may be unwritten or half written."""
        self._end, self.missing, self.why = "aborted", sorted(int(i) for i in missing), why
        return self

    # -- a layer-wise send, between its begin() and finish() ----------------------------------------
    def start_issuing(self) -> "Landing":
        """The send's layers are issued one by one from now on (LayerwiseSend, PagedLayerwiseSend): it is in
        flight until end_issuing(), whatever its events say."""
        self.issuing = True
        self._issued = [False] * self.layers
        return self

    def issue(self, i: int) -> int:
        """Layer i leaves now: each of 0 … L-1 exactly once (ValueError for a repeat, a negative, out of range, or
        not an integer). Returns i as an int."""
        try:
            if isinstance(i, bool):
                raise TypeError
            i = operator.index(i)  # ints and numpy integers
        except TypeError:
            raise ValueError(f"layer-wise send: layer {i!r} is not a layer index (an int in 0 … {self.layers - 1})") \
                from None
        if not 0 <= i < self.layers:
            raise ValueError(f"layer-wise send: layer {i!r} is out of range (valid 0 … {self.layers - 1})")
        if self._issued[i]:
            raise ValueError(f"layer-wise send: layer {i} signalled twice in {self.name()}")
        self._issued[i] = True
        return i

    @property
    def unissued(self) -> list[int]:
        return [i for i, sent in enumerate(self._issued) if not sent]

    def end_issuing(self) -> "Landing":
        self.issuing = False
        return self

    def abort_issuing(self, why: str) -> None:
        """An issuing send was stopped: aborted, missing every layer not issued or not known to have landed (a
        layer already released may be half written). A no-op once the send has ended."""
        if self.state == "in-flight":
            self.issuing = False
            self.abort(sorted(set(self.unissued) | {i for i in range(self.layers) if not self.landed(i)}), why)

    def name(self) -> str:
        return f"send {self.send_id}" + (f" to {self.dest}" if self.dest else "")

    def check(self) -> None:
        """TransferError if this send failed or was aborted (naming the missing layers)."""
        if self._end is not None:
            shown = self.missing if len(self.missing) <= 12 else self.missing[:12] + ["…"]
            raise TransferError(f"{self.name()} {self._end} ({self.why}): layers {shown} of {self.layers} did not "
                                "land; the destination cannot be read until a later send lands")

    def landed(self, i: int) -> bool:
        if self._end is not None and i in self.missing:
            return False
        if self.issuing and not self._issued[i]:  # its event may still hold an earlier send's record
            return False
        if self.worker is not None and i >= self.landed_layers:
            return False
        ev = self.events[i]
        return True if ev is None else bool(ev.query())

    def all_landed(self) -> bool:
        return all(self.landed(i) for i in range(self.layers))

    def _not_issuing(self) -> None:
        """TransferError while a layer-wise send is still being issued: its unsignalled layers are not on their
        way yet (waiting for them from the thread that signals them would never return)."""
        if self.issuing:
            left = self.unissued
            shown = left if len(left) <= 12 else left[:12] + ["…"]
            raise TransferError(f"{self.name()} is still being sent: layers {shown} of {self.layers} have not been "
                                "signalled yet; wait for the Landing that finish() returns")

    def wait(self) -> "Landing":
        """Block the host until every layer has landed (TransferError for a failed or aborted send, or for a
        layer-wise send whose finish() has not been called)."""
        self.check()
        self._not_issuing()
        if self.worker is not None:
            self.worker.join()
        for ev in self.events:
            if ev is not None:
                ev.synchronize()
        self.check()
        self.waited = True
        return self

    def stream_wait(self, stream) -> None:
        """Make `stream` (on the destination side) wait for every layer, without a host sync."""
        self.check()
        self._not_issuing()
        if self.worker is not None:
            self.worker.join()
        last = None
        for ev in self.events:
            if ev is not None and ev is not last:
                stream.wait_event(ev)
                last = ev
        self.check()
        self.waited = True

    @property
    def done_event(self):
        """The event of the last layer (None on CPU)."""
        return self.events[-1]


class dst_stream_context:
    """Context: make `stream` current on its own device (a no-op for None)."""

    def __init__(self, stream):
        self.stream = stream
        self.ctx = torch.cuda.stream(stream) if stream is not None else None

    def __enter__(self):
        if self.ctx is not None:
            self.ctx.__enter__()

    def __exit__(self, *exc):
        if self.ctx is not None:
            self.ctx.__exit__(*exc)
