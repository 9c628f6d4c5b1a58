"""The re-shard movers: one sequence's paged cache moved from P prefill ranks' pools to D decode ranks' pools, by the
plan of kvlab.paged.reshard (which heads each decode rank reads from which prefill rank):

    torch-index   the reference: index_select the blocks, slice the heads, index_copy_ into the head-sliced view
    fused         kvlab.paged.reshard_kernels' Triton kernel: gather + head split (+ layout change) in one pass, one
                  launch per (prefill rank, decode rank) piece, straight into the destination pool
    staging       SGLang's way: per decode rank, source rank and layer side one contiguous buffer (the kernel
                  gathers into it), one send per buffer (`send_fn`, a copy_ here), a scatter on arrival
    block-slices  vLLM NIXL's way: one copy per block slice (a block's head slice is one run in hnd, block_size
                  runs in nhd); bytes as they are, so both layouts must match
    nixl-staging  staging with its sends as NIXL WRITEs (kvlab.paged.nixl.NixlLink): one prepared request per piece,
                  one descriptor per layer side
    nixl-staging-bulk  the same with one descriptor per piece: its whole staging buffer (a bulk handoff: nothing
                  can be sent before every layer is gathered)
    nixl-slices   block-slices as NIXL WRITEs: one prepared request per piece, one descriptor per block slice

Each mover counts the pieces it issues (copies, sends or descriptors) per decode rank. The NIXL movers hold two
agents in this process; `close()` releases them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .nixl import NixlLink
from .pools import indexable
from .reshard import (METHODS, Piece, Plan, check_pools, contiguous, dst_map, heads_first, table_rows)
from .reshard_kernels import Geometry, HeadsConfig, copy_heads

__all__ = ["Mover", "TorchIndex", "Fused", "Staging", "BlockSlices", "NixlStaging", "NixlStagingBulk", "NixlSlices",
           "make_mover", "move"]

class Mover:
    """One prepared move of one sequence (indices and buffers made once); `run()` moves it again. `report()`: method,
    backend, pieces_per_decode_rank (as the last run issued them), block_bytes_per_decode_rank (bytes written).
    `close()` releases what it holds (the NIXL movers' agents); a mover is also a context manager."""

    method = ""

    def __init__(self, pl: Plan, src, dst, backend: str = "auto", config: HeadsConfig | None = None, send_fn=None):
        if backend not in ("auto", "triton", "torch"):
            raise ValueError(f"backend {backend!r} is not valid; use 'auto', 'triton' or 'torch'")
        self.plan, self.src, self.dst = pl, list(src), dst_map(pl, dst)
        check_pools(pl, self.src, self.dst, self.method)
        self.backend, self.config, self.used = backend, config, "torch"
        self.send_fn = send_fn or (lambda a, b: b.copy_(a, non_blocking=b.device.type == "cuda"))
        self.counts: dict = {}
        self._jobs = [(r, pc) + self._prepare(r, pc) for r in self.dst for pc in pl.pieces[r]]

    def _prepare(self, r: int, pc: Piece) -> tuple:
        return ()

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def run(self) -> None:
        self.counts = {r: 0 for r in self.dst}
        for job in self._jobs:
            self.counts[job[0]] += self._move(*job)

    def report(self) -> dict:
        spec = self.plan.spec
        per = {r: sum(pc.heads for pc in self.plan.pieces[r]) * spec.layers * 2 * self.dst[r][1].num_blocks
               * self.dst[r][0].spec.block_size * spec.head_dim * self.dst[r][0].spec.element_bytes for r in self.dst}
        return {"method": self.method, "backend": self.used, "pieces_per_decode_rank": dict(self.counts),
                "block_bytes_per_decode_rank": per}


class TorchIndex(Mover):
    """The reference: per piece, index_select the source blocks (all layers at once), slice the heads in the
    heads-first view, move to the destination's device, index_copy_ into its head-sliced view. One piece each."""

    method = "torch-index"

    def _move(self, r, pc) -> int:
        (sp, st), (dp, dt) = self.src[pc.src_rank], self.dst[r]
        x = heads_first(sp.data.index_select(2, st.tensor(sp.device)), sp.spec.layout)
        x = x[:, :, :, pc.src_head:pc.src_head + pc.heads]
        view = heads_first(dp.data, dp.spec.layout)[:, :, :, pc.dst_head:pc.dst_head + pc.heads]
        indexable(view).index_copy_(2, dt.tensor(dp.device), indexable(x.to(dp.device)))  # float8 as its bytes
        return 1


class Fused(Mover):
    """kvlab.paged.reshard_kernels.copy_heads from the source pool straight into the destination pool: one launch per
    piece moves every layer, side and block of its head slice, converting the layout in the same pass."""

    method = "fused"

    def _prepare(self, r, pc):
        (sp, st), (dp, dt) = self.src[pc.src_rank], self.dst[r]
        dev = sp.device if sp.device.type == "cuda" else dp.device
        return table_rows(sp, st, dev), table_rows(dp, dt, dev)

    def _move(self, r, pc, s_rows, d_rows) -> int:
        (sp, _), (dp, _) = self.src[pc.src_rank], self.dst[r]
        self.used = copy_heads(sp.rows, Geometry.of(sp.spec), s_rows, pc.src_head, dp.rows, Geometry.of(dp.spec),
                               d_rows, pc.dst_head, pc.heads, backend=self.backend, config=self.config, check=False)
        return 1


class Staging(Mover):
    """Per piece: the kernel gathers the head slice of every block into a send buffer on the source's device (one
    contiguous [blocks, heads, …] region per layer side, in the destination's layout), each region is sent once
    (`send_fn(src_view, dst_view)`, a copy_ by default: what a link replaces) into a receive buffer on the
    destination's device, and the kernel scatters it into the pool. layers × 2 sends per piece."""

    method = "staging"

    def _prepare(self, r, pc):
        (sp, st), (dp, dt) = self.src[pc.src_rank], self.dst[r]
        s = dp.spec
        geom = Geometry(pc.heads, s.block_size, s.head_dim, s.layout)
        n = st.num_blocks
        send = torch.empty((s.layers * 2 * n, geom.row_elems), dtype=s.dtype, device=sp.device)
        recv = torch.empty_like(send, device=dp.device)
        return (geom, n, send, recv, table_rows(sp, st),
                torch.arange(send.shape[0], device=sp.device), torch.arange(send.shape[0], device=dp.device),
                table_rows(dp, dt))

    def _gather(self, r, pc, geom, n, send, recv, s_rows, s_ar, d_ar, d_rows) -> None:
        sp = self.src[pc.src_rank][0]
        self.used = copy_heads(sp.rows, Geometry.of(sp.spec), s_rows, pc.src_head, send, geom, s_ar, 0, pc.heads,
                               backend=self.backend, config=self.config, check=False)

    def _scatter(self, r, pc, geom, n, send, recv, s_rows, s_ar, d_ar, d_rows) -> int:
        dp = self.dst[r][0]
        copy_heads(recv, geom, d_ar, 0, dp.rows, Geometry.of(dp.spec), d_rows, pc.dst_head, pc.heads,
                   backend=self.backend, config=self.config, check=False)
        return send.shape[0] // n

    def _move(self, *job) -> int:
        self._gather(*job)
        n, send, recv = job[3:6]
        for j in range(send.shape[0] // n):
            self.send_fn(send[j * n:(j + 1) * n], recv[j * n:(j + 1) * n])
        return self._scatter(*job)


class BlockSlices(Mover):
    """One copy per contiguous run of a block's head slice (vLLM's descriptors): hnd, or the whole block, is one
    run per block; an nhd head split is block_size runs. Slow by construction (a host loop of copies): CPU tests
    use it to count descriptors; kvlab.paged.reshard_bench predicts it rather than timing it."""

    method = "block-slices"

    def _prepare(self, r, pc):
        (sp, st), (dp, dt) = self.src[pc.src_rank], self.dst[r]
        gs, gd = Geometry.of(sp.spec), Geometry.of(dp.spec)
        srow = table_rows(sp, st, "cpu").numpy() * gs.row_elems + pc.src_head * gs.strides[0]
        drow = table_rows(dp, dt, "cpu").numpy() * gd.row_elems + pc.dst_head * gd.strides[0]
        if contiguous(self.plan, pc, sp.spec.layout):
            return srow, drow, pc.heads * gs.block_size * gs.head_dim
        t = np.arange(gs.block_size, dtype=np.int64)
        return ((srow[:, None] + t * gs.strides[1]).reshape(-1), (drow[:, None] + t * gd.strides[1]).reshape(-1),
                pc.heads * gs.head_dim)

    def _move(self, r, pc, s_off, d_off, length) -> int:
        s, d = self.src[pc.src_rank][0].data.view(-1), self.dst[r][0].data.view(-1)
        for a, b in zip(s_off.tolist(), d_off.tolist()):
            d[b:b + length].copy_(s[a:a + length])
        return len(s_off)


def _devices_done(*sides) -> None:
    """NIXL does not follow torch streams: wait for the work queued on every GPU of the pools given (what wrote the
    sources, and what last wrote the destinations: a poison fill must not land after NIXL's bytes)."""
    for dev in {pool.device for side in sides for pool, _ in side if pool.device.type == "cuda"}:
        torch.cuda.current_stream(dev).synchronize()


class _OverNixl:
    """What both NIXL movers share: their NixlLink's post and wait times in the report, reset after a check run,
    and the agents released on close."""

    link: NixlLink

    def reset_stats(self) -> None:
        self.link.reset()

    def report(self) -> dict:
        return super().report() | {"nixl": self.link.stats()}

    def close(self) -> None:
        self.link.close()


class NixlStaging(_OverNixl, Staging):
    """Staging whose sends are NIXL WRITEs (kvlab.paged.nixl.NixlLink, two agents in this process, UCX by default):
    per piece one prepared request of one descriptor per layer side, from the send buffer into the receive buffer.
    A run gathers every piece, waits for both sides' GPUs, posts every request, polls each to DONE, then scatters.
    `report()["nixl"]`: requests, descriptors per request, median post and wait times (µs) since `reset_stats`."""

    method = "nixl-staging"
    per_layer_side = True  # one descriptor per layer side (what layer-wise sending needs); False: one per piece

    def __init__(self, pl: Plan, src, dst, nixl_backend: str = "UCX", **kw):
        super().__init__(pl, src, dst, **kw)
        self.link = NixlLink([j[4] for j in self._jobs], [j[5] for j in self._jobs], backend=nixl_backend)
        try:
            self._handles = []
            for job in self._jobs:
                n, send = job[3], job[4]
                region = (n * send.shape[1] if self.per_layer_side else send.numel()) * send.element_size()
                offs = np.arange(send.nbytes // region, dtype=np.int64) * region
                self._handles.append(self.link.prepare(send, offs, job[5], offs, region))
        except BaseException:
            self.link.close()
            raise

    def run(self) -> None:
        self.counts = {r: 0 for r in self.dst}
        for job in self._jobs:
            self._gather(*job)
        _devices_done(self.src, self.dst.values())
        self.link.run(self._handles)
        for job in self._jobs:
            n = self._scatter(*job)
            self.counts[job[0]] += n if self.per_layer_side else 1


class NixlStagingBulk(NixlStaging):
    """nixl-staging with one descriptor per piece, its whole staging buffer (every layer side of the piece's head
    slice), so posting costs one descriptor a piece: a bulk handoff, not a layer-wise one."""

    method = "nixl-staging-bulk"
    per_layer_side = False


class NixlSlices(_OverNixl, BlockSlices):
    """block-slices as NIXL WRITEs from the source pools straight into the destination pools (vLLM's NixlConnector):
    per piece one prepared request of one descriptor per block slice (hnd: a block's head slice; nhd split by heads:
    block_size of them per block). A run waits for both sides' GPUs, posts every request and polls each to DONE."""

    method = "nixl-slices"

    def __init__(self, pl: Plan, src, dst, nixl_backend: str = "UCX", **kw):
        super().__init__(pl, src, dst, **kw)
        self.link = NixlLink([p.data for p, _ in self.src], [p.data for p, _ in self.dst.values()],
                             backend=nixl_backend)
        try:
            self._handles = []
            for r, pc, s_off, d_off, length in self._jobs:
                sp, dp = self.src[pc.src_rank][0].data, self.dst[r][0].data
                esz = sp.element_size()
                self._handles.append(self.link.prepare(sp, s_off * esz, dp, d_off * esz, length * esz))
        except BaseException:
            self.link.close()
            raise

    def run(self) -> None:
        _devices_done(self.src, self.dst.values())
        self.link.run(self._handles)
        self.counts = {r: 0 for r in self.dst}
        for job in self._jobs:
            self.counts[job[0]] += len(job[2])


_MOVERS = {m.method: m for m in (TorchIndex, Fused, Staging, BlockSlices, NixlStaging, NixlStagingBulk, NixlSlices)}


def make_mover(method: str, pl: Plan, src: Sequence, dst, **kw) -> Mover:
    """A prepared mover: method one of METHODS; src: P (BlockPool, BlockTable) pairs in prefill-rank order; dst:
    D pairs (or a dict decode rank → pair, to move only some ranks). kw: backend ("auto" | "triton" | "torch",
    fused / staging), config (reshard_kernels.HeadsConfig), send_fn (staging), nixl_backend (the NIXL movers: "UCX").
    Every check runs here; close() the mover when done (NIXL agents)."""
    if method not in _MOVERS:
        raise ValueError(f"method {method!r} is not valid; use one of {list(METHODS)}")
    return _MOVERS[method](pl, src, dst, **kw)


def move(method: str, pl: Plan, src: Sequence, dst, **kw) -> dict:
    """Prepare and run one move; returns the mover's report."""
    with make_mover(method, pl, src, dst, **kw) as m:
        m.run()
        return m.report()


