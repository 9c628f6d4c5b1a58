"""NIXL as a paged transport (`nixl`): two NIXL agents with the UCX backend in one process, one prepared
transfer request of one descriptor per block, writing from the source pool into the destination pool. `NixlLink`:
the same two agents for any registered tensors, prepared requests of byte ranges posted together (the re-shard's
NIXL movers). NIXL is optional (`pip install 'kvlab[nixl]'`); without it either says why it cannot run.
"""

from __future__ import annotations

import itertools
import os
import statistics
import time

import numpy as np
import torch

from ..landing import Landing
from .pools import BlockPool
from .transports import PagedTransport

__all__ = ["NixlTransport", "NixlLink", "nixl_version", "nixl_api", "nixl_missing", "xfer_descs", "SAME_PROCESS_ENV",
           "same_process_env"]


def nixl_version() -> str | None:
    from importlib import metadata

    for dist in ("nixl", "nixl-cu12", "nixl-cu13"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def nixl_api():
    """NIXL's Python API module (`nixl_agent`, `nixl_agent_config`): through the `nixl` meta package, or straight
    from a CUDA build's own package (`nixl_cu13`, `nixl_cu12`) when only that is installed (kvlab's dev extra
    installs nixl-cu13 alone: the meta package pulls both builds)."""
    import importlib

    errors = []
    for mod in ("nixl._api", "nixl_cu13._api", "nixl_cu12._api"):
        try:
            return importlib.import_module(mod)
        except ImportError as exc:
            errors.append(f"{mod}: {exc}")
    raise ImportError("; ".join(errors))


def nixl_missing() -> str | None:
    """Why NIXL cannot be used here (not installed, or its library does not load), or None."""
    try:
        nixl_api()
    except Exception as exc:
        return f"nixl is not installed or does not load ({type(exc).__name__}: {str(exc)[:200]}): pip install 'kvlab[nixl]'"
    return None


_NIXL_AGENTS = itertools.count()
# Both agents live in this one process. UCX's cuda_ipc refuses a peer in its own process unless told otherwise and
# then moves GPU memory over tcp on loopback: a 4k-token TP 1 → 2 re-shard's 112 descriptors took 579 ms that way on
# an H200, 3.1 ms with this set (data/probes/nixl_same_process). Set unless the environment already says.
SAME_PROCESS_ENV = {"UCX_CUDA_IPC_ENABLE_SAME_PROCESS": "y"}


def same_process_env() -> dict:
    """Set SAME_PROCESS_ENV's variables that the environment leaves unset (UCX reads them when an agent starts);
    returns each variable's value as the agents will see it."""
    for k, v in SAME_PROCESS_ENV.items():
        os.environ.setdefault(k, v)
    return {k: os.environ[k] for k in SAME_PROCESS_ENV}


def _mem(device: torch.device) -> str:
    return "VRAM" if device.type == "cuda" else "DRAM"


def xfer_descs(agent, tensor: torch.Tensor, offsets, nbytes: int):
    """NIXL transfer descriptors for byte ranges [offset, offset + nbytes) of `tensor`'s storage (offsets: bytes
    from its data_ptr), VRAM on a GPU, DRAM on the host."""
    offsets = np.asarray(offsets, dtype=np.int64).reshape(-1)
    mem, dev = _mem(tensor.device), (tensor.device.index or 0) if tensor.device.type == "cuda" else 0
    arr = np.empty((offsets.size, 3), dtype=np.int64)
    arr[:, 0] = tensor.data_ptr() + offsets
    arr[:, 1] = nbytes
    arr[:, 2] = dev
    try:
        descs = agent.get_xfer_descs(arr, mem)
    except (TypeError, ValueError, IndexError):
        descs = None
    if descs is None:  # older nixl: a list of (addr, len, dev) tuples only
        descs = agent.get_xfer_descs([tuple(r) for r in arr.tolist()], mem)
    if descs is None:
        raise RuntimeError(f"nixl get_xfer_descs returned None for {offsets.size} {mem} descriptors")
    return descs


def _release(agent, handles: list) -> None:
    """Release every prepared request in `handles` (a failure to release one does not keep the others), and forget
    them."""
    for h in handles:
        try:
            agent.release_xfer_handle(h)
        except Exception:
            pass
    handles.clear()


class NixlLink:
    """Two NIXL agents in this process (UCX by default): WRITEs from tensors registered on the first (`sources`) into
    tensors registered on the second (`destinations`), which is then made known to the first, as a peer would be.
    `prepare` makes one request of many descriptors, once; `run(handles)` posts them all, then polls each to DONE.
    Per run, `post_s` (the posting calls) and `wait_s` (posted → all DONE) are kept, in seconds.
    Not stream-ordered: the caller waits for the GPU work that wrote the sources before `run`. `progress_thread`:
    NIXL's progress thread in each agent (its default), or none. `thread_safe`: strict synchronisation in both agents
    (for several threads posting through them at once)."""

    def __init__(self, sources, destinations, backend: str = "UCX", progress_thread: bool = True,
                 thread_safe: bool = False):
        why = nixl_missing()
        if why:
            raise RuntimeError(why)
        api = nixl_api()
        k = next(_NIXL_AGENTS)
        # progress_thread: NIXL's default, a thread per agent that polls the backend (it keeps a core busy while the
        # agent lives); without it `wait` makes the progress of both agents while it polls
        self.progress_thread = bool(progress_thread)
        # thread_safe: NIXL's strict synchronisation, for agents that several threads call at once (its default for
        # an agent without a listener thread is none: concurrent calls are not its business, and crash without it)
        sync = api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT if thread_safe else None
        conf = api.nixl_agent_config(enable_prog_thread=self.progress_thread, backends=[backend], sync_mode=sync)
        self.env = same_process_env()
        self.backend, self.target_name = backend, f"kvlab-link-dst-{k}"
        self.initiator = api.nixl_agent(f"kvlab-link-src-{k}", conf)
        self.target = api.nixl_agent(self.target_name, conf)
        self._regs, self._handles, self._closed = [], [], False
        self.post_s: list[float] = []
        self.wait_s: list[float] = []
        self.descriptors: list[int] = []
        self.chosen_backend = backend
        try:
            for agent, tensors in ((self.initiator, sources), (self.target, destinations)):
                for t in {t.data_ptr(): t for t in tensors}.values():  # a pool read by several pieces: once
                    self._regs.append((agent, agent.register_memory(t)))
            self.initiator.add_remote_agent(self.target.get_agent_metadata())
        except BaseException:
            self.close()
            raise

    def prepare(self, src: torch.Tensor, src_offsets, dst: torch.Tensor, dst_offsets, nbytes: int):
        """One prepared WRITE request: byte ranges of `src` (at src_offsets) to those of `dst`, `nbytes` each."""
        local = xfer_descs(self.initiator, src, src_offsets, nbytes)
        remote = xfer_descs(self.target, dst, dst_offsets, nbytes)
        handle = self.initiator.initialize_xfer("WRITE", local, remote, self.target_name, b"")
        if not handle:
            raise RuntimeError("nixl initialize_xfer failed (no handle)")
        self._handles.append(handle)
        self.descriptors.append(int(np.asarray(src_offsets).size))
        try:
            self.chosen_backend = self.initiator.query_xfer_backend(handle)
        except Exception:  # older nixl: no query; the configured backend is the only one
            pass
        return handle

    def run(self, handles) -> None:
        """Post every request, then poll each until NIXL says DONE; any other state is an error."""
        agent = self.initiator
        t0 = time.perf_counter()
        states = [agent.transfer(h) for h in handles]
        t1 = time.perf_counter()
        for h, state in zip(handles, states):
            self.wait(h, state)
        self.post_s.append(t1 - t0)
        self.wait_s.append(time.perf_counter() - t1)

    def wait(self, handle, state: str = "PROC", timeout_s: float = 120.0) -> None:
        """Poll a posted request until NIXL says DONE (any other end, or still PROC after `timeout_s`, is an error).
        Without progress threads the target agent is progressed here too (a peer's own thread would do it), through
        its notification check."""
        deadline = time.monotonic() + timeout_s
        while state == "PROC":
            if not self.progress_thread:
                self.target.get_new_notifs()
            state = self.initiator.check_xfer_state(handle)
            if state == "PROC" and time.monotonic() > deadline:
                raise RuntimeError(f"nixl transfer still in progress after {timeout_s:g} s")
        if state != "DONE":
            raise RuntimeError(f"nixl transfer ended in state {state!r}")

    def reset(self) -> None:
        """Forget the runs' post and wait times (after a check run, before the timed ones)."""
        self.post_s.clear()
        self.wait_s.clear()

    def stats(self) -> dict:
        """Medians over the runs since the last reset, in µs; requests and descriptors per request."""
        med = lambda xs: 1e6 * statistics.median(xs) if xs else float("nan")  # noqa: E731
        return {"requests": len(self.descriptors), "descriptors": sum(self.descriptors),
                "descriptors_per_request": max(self.descriptors, default=0), "post_us": med(self.post_s),
                "wait_us": med(self.wait_s), "runs": len(self.post_s), "backend": str(self.chosen_backend),
                "env": dict(self.env)}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        _release(self.initiator, self._handles)
        for agent, reg in reversed(self._regs):
            try:
                agent.deregister_memory(reg)
            except Exception:
                pass
        self._regs.clear()
        try:
            self.initiator.remove_remote_agent(self.target_name)
        except Exception:
            pass
        # the agents go now, not when this link is collected: each one's progress thread keeps a core busy
        self.initiator = self.target = None


class NixlTransport(PagedTransport):
    """NIXL (UCX backend) writing the same descriptor list — one descriptor per block — from one agent
    (it registers the source pool) to a second agent in this process (it registers the destination pool),
    as a peer would: one prepared request (initialize_xfer), posted per send and polled to completion.

    Not stream-ordered: send() waits for the source GPU's queued work, posts, and returns once NIXL says
    DONE (the Landing is complete). Options: backend (default "UCX").
    """

    name = "nixl"
    stream_ordered = False
    options = {"backend": "UCX"}

    @classmethod
    def _unavailable_here(cls, src, dest):
        return nixl_missing()

    def _setup(self):
        api = nixl_api()
        nixl_agent, nixl_agent_config = api.nixl_agent, api.nixl_agent_config
        k = next(_NIXL_AGENTS)
        backend = self.opts["backend"]
        conf = nixl_agent_config(backends=[backend])
        env = same_process_env()
        self.target_name = f"kvlab-dst-{k}"
        self.initiator = nixl_agent(f"kvlab-src-{k}", conf)
        self.target = nixl_agent(self.target_name, conf)
        self._dst_reg = self.target.register_memory(self.pool.data)
        self.initiator.add_remote_agent(self.target.get_agent_metadata())
        self._src_regs: dict = {}
        self._handles: list = []
        self._closed = False
        self.backend = f"nixl {backend}"
        self.config.update(nixl_version=nixl_version(), backend=backend, agents=2, operation="WRITE", env=env,
                           dst_mem=_mem(self.pool.device))

    def _descs(self, agent, pool: BlockPool, rows: np.ndarray):
        rb = self.spec.block_bytes
        return xfer_descs(agent, pool.data, np.asarray(rows, dtype=np.int64) * rb, rb)

    def _prepare(self, plan):
        key = id(plan.src_pool)
        if key not in self._src_regs:
            self._src_regs[key] = (plan.src_pool, self.initiator.register_memory(plan.src_pool.data))
        local = self._descs(self.initiator, plan.src_pool, plan.src_rows)
        remote = self._descs(self.target, self.pool, plan.dst_rows)
        handle = self.initiator.initialize_xfer("WRITE", local, remote, self.target_name, b"")
        if not handle:
            raise RuntimeError("nixl initialize_xfer failed (no handle)")
        self._handles.append(handle)
        plan.extra["handle"] = handle
        self.config.update(descriptors=plan.rows, src_mem=_mem(plan.src_pool.device))
        try:
            self.config["chosen_backend"] = self.initiator.query_xfer_backend(handle)
        except Exception:  # older nixl: no query; the configured backend is the only one
            self.config["chosen_backend"] = self.opts["backend"]
        c = self.config
        self._note(f"nixl {c['nixl_version']}, backend {c['chosen_backend']}, {plan.rows:,} descriptors "
                   f"({c['src_mem']}→{c['dst_mem']}), one prepared {c['operation']} request between 2 agents")

    def _copy(self, plan, lo, hi):
        if (lo, hi) != (0, plan.rows):
            raise ValueError("nixl transport sends whole plans only")
        agent, handle = self.initiator, plan.extra["handle"]
        state = agent.transfer(handle)
        while state == "PROC":
            state = agent.check_xfer_state(handle)
        if state != "DONE":
            raise RuntimeError(f"nixl transfer ended in state {state!r}")

    def send(self, src_pool, src_table, dst_table=None) -> Landing:
        plan = self.prepare(src_pool, src_table, dst_table)
        if self.cuda:
            torch.cuda.current_stream(self.src_device).synchronize()  # NIXL does not follow torch streams
        landing = self.new_landing(plan)
        try:
            self._copy(plan, 0, plan.rows)
        except BaseException as err:
            landing.abort(range(self.spec.layers), f"{type(err).__name__} during the NIXL transfer")
            raise
        return landing

    def close(self):
        if getattr(self, "_closed", True):  # never set up, or already closed
            return
        self._closed = True
        _release(self.initiator, self._handles)
        for _, reg in self._src_regs.values():
            self.initiator.deregister_memory(reg)
        self._src_regs.clear()
        self.target.deregister_memory(self._dst_reg)
        try:
            self.initiator.remove_remote_agent(self.target_name)
        except Exception:
            pass
        super().close()
