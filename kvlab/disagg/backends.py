"""The backends of `kvlab disagg`, one record each: what it is, what it can do, what it needs, and its link.

Every site that used to compare a backend's name asks its record instead: `BACKENDS["nccl"].in_order`,
`backend(name).unavailable(prefill, decode)`, `backend(name).make_link(...)`.

    gloo   torch.distributed on gloo over TCP: the CPU path CI runs, a stand-in for a network link (GPU tensors are
           staged through host memory on both sides)
    ipc    CUDA IPC on one host: the prefill process writes into the decode process's shared destination (one GPU
           or two)
    nccl   torch.distributed on NCCL: two GPUs (two nodes under torchrun); sends match receives in posting order
    nixl   two NIXL agents over UCX: the prefill agent writes into memory the decode agent registered
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..paged import nixl as paged_nixl
from ..parse import suggest
from .links import DistLink, IpcLink
from .nixl_link import NixlLink

__all__ = ["Backend", "BACKENDS", "NAMES", "backend"]


@dataclass(frozen=True)
class Backend:
    """One backend's traits.

    group: the torch.distributed backend the two processes' group runs on (the control messages of ipc and nixl
    travel over the store, their group is gloo). in_order: sends match receives in the order both were posted
    (a unit can never be skipped). one_sided: the prefill side writes into the decode side's memory, which the
    decode side exposes first (no receives are posted). gpus: GPUs it needs on this host. decode_gpu: the decode
    device "auto" means (1: cuda:1; 0: the prefill device). can_bench: the bulk send can be timed alone beside a
    copy of the same bytes. can_kill: a new prefill process can take a dead one's place (a new gloo group).
    can_in_order: it can be asked to match in order (gloo, to run NCCL's fault protocol on a CPU). polls: in a
    fault campaign, its receives are polled against a host deadline (NCCL's would block the host).
    releases_destination: the prefill process lets go of the decode side's destination between contexts.
    """

    name: str
    help: str
    group: str = "gloo"
    in_order: bool = False
    one_sided: bool = False
    gpus: int = 0
    decode_gpu: int = 0
    can_bench: bool = False
    can_kill: bool = False
    can_in_order: bool = False
    polls: bool = False
    releases_destination: bool = False
    descriptors: bool = False  # a NIXL option (--nixl-descs) applies

    def unavailable(self, prefill: str, decode: str, paged: bool = False) -> str | None:
        """Why this backend cannot move a cache from `prefill` to `decode` on this machine, or None."""
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if self.name == "nixl":
            why = paged_nixl.nixl_missing()
            if why:
                return f"backend 'nixl': {why}; or use gloo" + (", ipc" if n else "")
        if self.gpus and n < self.gpus:
            if self.gpus == 1:
                return f"backend {self.name!r} is CUDA IPC and needs a GPU; this machine has none: use --backend gloo"
            return (f"backend {self.name!r} needs two GPUs (NCCL cannot put both processes on one GPU); this machine has "
                    f"{n}: use --backend ipc (one GPU) or gloo")
        if self.gpus > 1 and prefill == decode:
            return f"backend {self.name!r} needs two different GPUs, got {prefill} for both: pass --decode-device cuda:1"
        if self.gpus and not (prefill.startswith("cuda") and decode.startswith("cuda")):
            return f"backend {self.name!r} moves GPU memory: both devices must be GPUs, got {prefill} → {decode}"
        return None

    def make_link(self, role: str, device: torch.device, control, timeout_s: float, peer: int,
                  nixl_descs: str = "block", in_order: bool = False):
        """This backend's link for one process (`role` "prefill" or "decode") on `device`."""
        if self.name == "ipc":
            return IpcLink(device, control, timeout_s)
        if self.name == "nixl":
            return NixlLink(role, device, control, timeout_s, descs=nixl_descs)
        return DistLink(self.name, peer, device, timeout_s, in_order or self.in_order, self.group)


BACKENDS: dict[str, Backend] = {b.name: b for b in (
    Backend("gloo", "TCP; CPU or GPU via the host", can_bench=True, can_kill=True, can_in_order=True),
    Backend("ipc", "CUDA IPC, one host, 1–2 GPUs", one_sided=True, gpus=1, can_bench=True,
            releases_destination=True),
    Backend("nccl", "two GPUs; two nodes under torchrun", group="nccl", in_order=True, gpus=2, decode_gpu=1,
            can_bench=True, polls=True),
    Backend("nixl", "two NIXL agents, UCX; pip install 'kvlab[nixl]'", one_sided=True, descriptors=True),
)}
NAMES = tuple(BACKENDS)


def backend(name: str) -> Backend:
    """The record of backend `name`; ValueError naming the valid ones (and the closest) otherwise."""
    try:
        return BACKENDS[name]
    except (KeyError, TypeError):
        raise ValueError(f"backend = {name!r} is not valid; valid: {', '.join(NAMES)}{suggest(str(name), NAMES)}") from None
