"""The decode process's device memory: what each phase of its work holds, a cap on it, and what a real
out-of-memory says (issue 16).

`--decode-memory-gib G` caps PyTorch's caching allocator in the decode process at G GiB
(torch.cuda.set_per_process_memory_fraction), from the moment the decode side starts to serve: its weights, the
colocated reference it keeps for the comparison, its destination for the cache, and everything a request needs
(receives, the read of a paged pool into the cache decode reads, decode itself). The reference is computed before
the cap is put on (it is the measurement's, not the server's), and the cap is lifted while the next context's
reference is computed. An allocation past the cap fails as an allocation past the device's end would: the
allocator frees its cached blocks, tries again, and raises torch.OutOfMemoryError. Outside the cap: the CUDA
context and what libraries allocate themselves (NCCL's buffers, for one).

An out-of-memory in the decode process, capped or not, becomes one `DecodeOutOfMemory` line naming the request
(or the layout and context, before any request), the step it was in, the memory in use, and what came of the
request: nothing decoded from its cache, a decode that did not finish, or — when it hit the check after decode —
a decode that finished but is not counted. The decode process then stops, the launcher stops the prefill process,
and the run folder says why.

Several contexts in one run: each context's reference and destination are freed before the next context's
reference. Over ipc the decode side first asks the prefill process to let go of the destination (`{"release":
tag}`: PyTorch frees memory shared with another process only once that process has closed its handle), then
collects it (torch.cuda.ipc_collect); run 20261201-074648 shows the 32k reference after a 4k context ending where
it ends in a run of its own. Over nixl the decode side keeps the previous destination registered (and so
allocated) until it registers the next, so there it still counts while the next is allocated.

Per (layout, context) the phases are recorded (`rows`): reference, destination, requests, each with the memory
allocated at its end and the peaks allocated and reserved during it. summary.json carries them as
`decode_memory`, and a stopped run's run.json carries those recorded before the stop.
"""

from __future__ import annotations

import contextlib
import re

import torch

__all__ = ["DecodeMemory", "DecodeOutOfMemory", "STEPS"]

GiB = 1 << 30

# what the decode side was doing, for the error line
STEPS = {
    "starting": "building its model",
    "reference": "computing its colocated reference (prefill and decode on this device, before the cap)",
    "capping": "taking up its cap",
    "destination": "allocating its destination for the cache",
    "landing": "receiving the layers",
    "reading": "reading the landed cache into the cache decode reads",
    "decode": "decoding from the landed cache",
    "colocated": "taking the colocated request's decode step (from its own reference cache)",
    "checking": "checking the decode against the colocated reference (tokens, logits, bytes, poison)",
    "campaign": "in the fault campaign",
}


class DecodeOutOfMemory(RuntimeError):
    """The decode process ran out of device memory; the message says where, and what came of the request."""


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


class DecodeMemory:
    """The decode process's memory on `device`: phases recorded, the cap (`cap_gib`, 0: none) put on and lifted,
    the step now under way (`step`) and the request (`where`) for the error line."""

    def __init__(self, device: torch.device, cap_gib: float = 0.0):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.cap = int(round(cap_gib * GiB)) if cap_gib else 0
        self.rows: list[dict] = []
        self.step = "starting"
        self.where = ""  # "request 7 (paged, 32768 tokens, layerwise)" or "paged, 32768 tokens"
        self.landed = ""  # while landing: which layers had landed when it failed
        self.capped = False  # the cap is on now (it is lifted while a reference is computed)

    def total(self) -> int:
        return torch.cuda.get_device_properties(self.device).total_memory if self.cuda else 0

    @contextlib.contextmanager
    def phase(self, name: str, **keys):
        """Record the memory of one phase: allocated at its end, peaks during it (CUDA only)."""
        self.step = name
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        yield
        if self.cuda:
            torch.cuda.synchronize(self.device)
            self.rows.append({**keys, "phase": name, **self._held()})

    def _held(self) -> dict:
        """What the allocator holds now, its peaks since the phase began, and the cap (one row's numbers)."""
        return {"allocated_bytes": torch.cuda.memory_allocated(self.device),
                "peak_allocated_bytes": torch.cuda.max_memory_allocated(self.device),
                "peak_reserved_bytes": torch.cuda.max_memory_reserved(self.device), "cap_bytes": self.cap or None}

    def cap_on(self) -> None:
        """Put the cap on (nothing without one, or on a CPU). What the process already holds must fit under it:
        the allocator's cap counts what it has reserved from the device, which after empty_cache is what is
        allocated plus what is free inside the segments still in use."""
        if not self.cap or not self.cuda:
            return
        self.step = "capping"
        torch.cuda.empty_cache()  # the reference's cached blocks go back; what is still allocated stays
        held, reserved = torch.cuda.memory_allocated(self.device), torch.cuda.memory_reserved(self.device)
        if reserved >= self.cap:
            err = DecodeOutOfMemory(
                f"{self.where or 'the decode side'}: the decode process already holds {_gib(reserved)} on "
                f"{self.device} ({_gib(held)} of it allocated: its weights and the colocated reference) before it "
                f"serves a request, at or over its cap of {_gib(self.cap)} (--decode-memory-gib); nothing was sent "
                f"or decoded. Give a cap above {_gib(reserved)}")
            err.memory_rows = list(self.rows)
            raise err
        torch.cuda.set_per_process_memory_fraction(min(1.0, self.cap / self.total()), self.device)
        self.capped = True

    def cap_off(self) -> None:
        if self.capped:
            torch.cuda.set_per_process_memory_fraction(1.0, self.device)
            self.capped = False

    def explain(self, err: BaseException) -> DecodeOutOfMemory:
        """The one line for an out-of-memory `err` raised during the current step."""
        first = str(err).splitlines()[0] if str(err) else ""
        m = re.search(r"Tried to allocate ([\d.]+ [KMGT]?i?B)", first)
        asked = f"it asked for {m.group(1)}" if m else "an allocation failed"
        use = ""
        if self.cuda:
            use = f", {_gib(torch.cuda.memory_allocated(self.device))} allocated"
            use += (f" under its cap of {_gib(self.cap)} (--decode-memory-gib)" if self.capped
                    else f" of the device's {_gib(self.total())}"
                    + (" (its cap is lifted while a reference is computed)" if self.cap else ""))
        landed = f" ({self.landed})" if self.step == "landing" and self.landed else ""
        nothing = {"landing": "nothing was decoded from its cache", "reading": "nothing was decoded from its cache",
                   "decode": "its decode did not finish and none of it is kept",
                   "campaign": "the fault being handled was not decoded",
                   "colocated": "the colocated request was not served",
                   "checking": "its decode had finished but could not be checked, so it is not counted",
                   "reference": "this context's requests were not served",
                   "starting": "no request was served",
                   }.get(self.step, "no request was decoded from this destination")
        more = "a larger --decode-memory-gib, or none," if self.capped else "a device with more free memory"
        out = DecodeOutOfMemory(
            f"{self.where or 'the decode side'}: the decode process ran out of memory on {self.device} while "
            f"{STEPS.get(self.step, self.step)}{landed}: {asked}{use}; {nothing}. Give it {more} or a shorter "
            f"context")
        failed = []
        if self.cuda:  # the step that failed, with what it held and its phase's peaks until then
            failed = [{"phase": self.step, "where": self.where, "failed": True, **self._held()}]
        out.memory_rows = list(self.rows) + failed  # the phases recorded before it: the launcher puts them in run.json
        return out
