"""What the two worker processes share: the control store's client (`connect`), their torch.distributed group
(`init_group`), this host's id and monotonic clock (`host_id`, `now_ns`), the model both build (`build_model`) and
the paged pool either side allocates (`pool_for`)."""

from __future__ import annotations

import functools
import socket
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from .. import models
from ..kvcache import layout_for
from ..paged import BlockAllocator, BlockPool, PoolSpec
from .backends import BACKENDS
from .config import DisaggConfig

__all__ = ["connect", "init_group", "host_id", "now_ns", "build_model", "pool_for"]


def connect(host: str, port: int, prefix: str, timeout_s: float):
    """A client of the control store (the launcher's, or torchrun's agent store), under `prefix`."""
    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
    return dist.PrefixStore(prefix, store)



def init_group(cfg: DisaggConfig, dev: torch.device, store, rank: int, generation: int = 0) -> None:
    """The two processes' torch.distributed group; generation g > 0 is a new group with a prefill process that
    replaced a dead one (its own key prefix in the store)."""
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


@functools.lru_cache(maxsize=1)
def host_id() -> str:
    """This host's name and, where Linux gives it, its boot id: two processes whose ids agree read one monotonic
    clock (two network namespaces of one machine do; two machines that share a name do not)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}" if boot else socket.gethostname()


def now_ns() -> int:
    """This host's monotonic clock (CLOCK_MONOTONIC), in ns: one clock for both processes of one host."""
    return time.monotonic_ns()


def build_model(cfg: DisaggConfig, dev: torch.device):
    """The model of `cfg` on `dev`: the same config and seed in both processes, so the same weights."""
    return models.build(cfg.model, weights=cfg.weights, device=dev, dtype=cfg.kv_dtype, seed=cfg.seed)


def pool_for(model, context: int, cfg: DisaggConfig, dev: torch.device, seed: int):
    """A pool twice the blocks the context needs, and a table of its blocks: drawn at random, or the lowest ids
    in order (`cfg.block_order`)."""
    spec = PoolSpec.from_kv_layout(layout_for(model, context, dtype=cfg.kv_dtype), cfg.block_size)
    n = 2 * spec.blocks_for(context)
    pool = BlockPool(spec, n, device=dev).poison()
    table = BlockAllocator(n, cfg.block_size, seed=seed, order=cfg.block_order).allocate(context)
    return pool, table
