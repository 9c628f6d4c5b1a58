"""Paged transports built on kvlab's Triton row-copy kernel (kvlab.paged.kernels): one launch that gathers and
scatters every row (`triton`, same GPU or peer), pipelines that gather on the GPU and let the copy engine
cross the link (`chunked-gather-d2h` to host, `chunked-gather-peer` to another GPU), and stores straight into
mapped pinned host memory (`mapped-pinned`). The kernel's tile and the row order are tuned on the real tables
(`kernel_config`, `bulk_order`, `finalists`); what was tried is kept in each transport's `config`.
See kvlab.paged.transports for the transport interface.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from .. import timing
from . import kernels
from .transports import PagedTransport, Plan, cuda_runtime, row_runs

__all__ = ["TritonCopy", "ChunkedGatherD2H", "ChunkedGatherPeer", "MappedPinned", "BULK_ORDERS", "bulk_order",
           "finalists", "kernel_config", "chunk_bounds"]


_TUNED: dict = {}


def kernel_config(transport: PagedTransport, key: tuple, tune_args) -> kernels.KernelConfig:
    """The kernel config for this transport: given, cached from an earlier tuning, or tuned now (GPU)."""
    given = transport.opts.get("config")
    if given is not None:
        cfg = given if isinstance(given, kernels.KernelConfig) else kernels.KernelConfig(**given)
        transport.config["kernel"] = cfg.as_dict()
        return cfg
    tune = transport.opts.get("tune")
    if tune is None:
        tune = transport.cuda
    if not tune or not transport.cuda:
        transport.config["kernel"] = kernels.DEFAULT_CONFIG.as_dict()
        return kernels.DEFAULT_CONFIG
    hit = _TUNED.get(key)
    if hit is None:
        hit = _TUNED[key] = kernels.tune(*tune_args, repeats=transport.opts.get("tune_repeats", 5))
    cfg, table = hit
    transport.config["tuning"] = table
    transport._note(f"kernel tuned on this GPU: {cfg.as_dict()}")
    transport.config["kernel"] = cfg.as_dict()
    return cfg


# tune on the first ≤ 16,384 rows of a plan (256 MiB of 16 KiB rows): long enough that launch overhead does
# not pick the winner, short enough to be cheap even over PCIe; a tuned config is reused for plans of the
# same (method, row size, destination kind, device, tuned rows)
_TUNE_ROWS = 16384


# a bulk send may move its rows in any order (destination rows are distinct); the order decides which
# addresses the GPU's concurrently running programs read and write, and so how evenly the memory
# channels are loaded
BULK_ORDERS = ("layer", "interleaved", "src")


# the tuner launches back to back on one stream, where each launch can start while the previous one
# drains; a send starts cold, after a hand-off from the caller's stream (run 20261129-103427-h200: 923 µs
# back to back, 936 µs through the send). The fastest few are timed again the way a send runs.
_FINALISTS = 6


def finalists(table: list, k: int = _FINALISTS) -> list:
    """The k fastest timed candidates of a tuning table (rows with "ms"), fastest first."""
    return sorted((r for r in table if r.get("ms") is not None), key=lambda r: r["ms"])[:k]


# tune a device-to-device plan on all of its rows up to this many bytes (a prefix would miss how the
# whole pattern loads the memory, and 2 GiB takes ~1 ms a launch on an H200)
_TUNE_FULL_BYTES = 2 << 30


def bulk_order(plan: "Plan", order: str) -> np.ndarray:
    """A permutation of a plan's rows for a bulk send.

    "layer": the plan's own order — layer, K/V side, then destination block (writes ascend through each
        layer side's pool, reads jump);
    "interleaved": block-major — the first block of every layer side, then the second, … (the programs
        running at any moment spread over all 2·layers pools at once);
    "src": layer, side, then source block (reads ascend, writes jump).
    """
    n = plan.rows
    rpl = plan.n_blocks  # rows per layer side
    side = np.arange(n) // rpl
    if order == "layer":
        return np.arange(n)
    if order == "interleaved":
        return np.lexsort((side, np.arange(n) % rpl))
    if order == "src":
        return np.lexsort((plan.src_rows, side))
    raise ValueError(f"unknown bulk order {order!r}; valid: {list(BULK_ORDERS)}")


class TritonCopy(PagedTransport):
    """One Triton kernel launch gathers the source rows and scatters them to their destination rows in one
    pass (no staging), on the same GPU or into a peer GPU's pool (stores over NVLink/PCIe P2P).

    Options: config (KernelConfig or dict; default: tuned on the GPU at the first prepare),
    order (a BULK_ORDERS name for bulk sends; default: tuned with the config on a GPU, else "layer"),
    tune (bool; default True on a GPU), tune_repeats. Layer-wise sends keep the plan's per-layer order.
    On a CPU without TRITON_INTERPRET=1 the torch path runs instead and `backend`/`notes` say so.
    """

    name = "triton"
    kinds = ("device", "peer")
    options = {"config": None, "order": None, "tune": None, "tune_repeats": 5}

    def _setup(self):
        ok, why = kernels.triton_status(self.src_device)
        self.use_triton = ok
        self.backend = "triton" if ok else "torch fallback"
        if not ok:
            self._note(f"fallback to torch index_select/index_copy_: {why}")
        order = self.opts.get("order")
        if order is not None and order not in BULK_ORDERS:
            raise ValueError(f"unknown bulk order {order!r}; valid: {list(BULK_ORDERS)}")

    def _prepare(self, plan):
        sidx, didx = self._indices(plan)
        if self.dest.kind == "peer" and not self.use_triton:
            plan.extra["didx_dst"] = didx.to(self.dest.device)
        if not self.use_triton:
            return
        given = self.opts.get("order")
        tune = self.opts.get("tune")
        tune = self.cuda if tune is None else bool(tune) and self.cuda
        orders = [given] if given is not None else (list(BULK_ORDERS) if tune and self.opts.get("config") is None
                                                    else ["layer"])
        full = plan.rows * self.spec.block_bytes <= _TUNE_FULL_BYTES and self.dest.kind in ("device", "peer")
        n = plan.rows if full else min(plan.rows, _TUNE_ROWS)
        best = None
        tables = []
        rows = {}
        for order in orders:
            perm = torch.from_numpy(bulk_order(plan, order)).to(sidx.device)
            s, d = self._on_stream(sidx[perm].contiguous()), self._on_stream(didx[perm].contiguous())
            rows[order] = (s, d)
            key = (self.name, self.spec.block_bytes, self.dest.kind, str(self.src_device), n, order, plan.rows)
            cfg = kernel_config(self, key, (plan.src_pool.rows, s[:n], self.pool.rows, d[:n]))
            table = self.config.pop("tuning", None) or []
            tables += [{**row, "order": order} for row in table]
            ms = min((row["ms"] for row in table if row.get("ms") is not None), default=None)
            if best is None or (ms is not None and (best[0] is None or ms < best[0])):
                best = (ms, order, cfg, s, d)
        _, order, cfg, s, d = best
        final = finalists(tables) if tune else []
        if len(final) > 1:
            fields = kernels.KernelConfig.__dataclass_fields__
            for row in final:
                fs, fd = rows[row["order"]]
                row["send_ms"] = self._time_send(plan, fs[:n], fd[:n], kernels.KernelConfig(**{f: row[f] for f in fields}))
            pick = min(final, key=lambda r: r["send_ms"])
            order, cfg = pick["order"], kernels.KernelConfig(**{f: pick[f] for f in fields})
            s, d = rows[order]
        plan.extra["cfg"] = cfg
        plan.extra["bulk"] = (s, d)
        self.config["order"] = order
        self.config["kernel"] = cfg.as_dict()
        if tables:
            self.config["tuning"] = tables
            self.config["tuned_rows"] = n
        self.notes = [x for x in self.notes if not x.startswith("kernel tuned on this GPU")]
        if tune:
            self._note(f"kernel tuned on this GPU ({n:,} rows, {len(orders)} orders; the {len(final)} fastest "
                       f"timed again as sends): {cfg.as_dict()}, order={order}")

    def _time_send(self, plan, s, d, cfg, repeats: int = 5) -> float:
        """Median ms of one launch the way send() runs it: the copy stream waits for the caller's stream,
        the kernel runs there, the caller's stream waits for it (CUDA events on the caller's stream)."""
        cur = torch.cuda.current_stream(self.src_device)
        done = torch.cuda.Event()

        def run():
            self.stream.wait_stream(cur)
            with torch.cuda.stream(self.stream):
                kernels.launch_rows(plan.src_pool.rows, s, self.pool.rows, d, cfg)
            done.record(self.stream)
            cur.wait_event(done)

        times = sorted(timing.time_fn(run, n=repeats, warmup=1, device=self.src_device))
        return times[len(times) // 2]

    def _copy(self, plan, lo, hi):
        if (lo, hi) == (0, plan.rows) and "bulk" in plan.extra:
            sidx, didx = plan.extra["bulk"]
        else:
            sidx, didx = self._indices(plan)
        if self.use_triton:
            kernels.launch_rows(plan.src_pool.rows, sidx[lo:hi], self.pool.rows, didx[lo:hi], plan.extra["cfg"])
        else:
            kernels.copy_rows_reference(plan.src_pool.rows, sidx[lo:hi], self.pool.rows,
                                        plan.extra.get("didx_dst", didx)[lo:hi])


class ChunkedGatherD2H(PagedTransport):
    """To host memory: gather `chunk_mib` of rows at a time into a ring of `ring` device staging chunks
    (compute side: the transport's stream), and copy each gathered chunk device → host on a second copy
    stream; events order them (gather k → copy k; copy k → the gather that reuses its slot), so while
    chunk k crosses the link chunk k+1 is being gathered and the copy engine never waits.

    Options: chunk_mib (default 64), ring (chunks, default 3), gather ("triton" | "torch", default
    triton when available), config / tune / tune_repeats (for the gather kernel).
    """

    name = "chunked-gather-d2h"
    kinds = ("pinned", "pageable")
    options = {"chunk_mib": 64, "ring": 3, "gather": None, "config": None, "tune": None, "tune_repeats": 5}

    def _setup(self):
        chunk_bytes = int(float(self.opts["chunk_mib"]) * 2**20)
        ring = self.opts["ring"]
        if chunk_bytes < self.spec.block_bytes:
            raise ValueError(f"chunk_mib={self.opts['chunk_mib']} is smaller than one block row "
                             f"({self.spec.block_bytes} bytes)")
        if not isinstance(ring, int) or ring < 2:
            raise ValueError(f"ring must be an int ≥ 2 (one chunk gathering while another is copied), got {ring!r}")
        self.chunk_rows = chunk_bytes // self.spec.block_bytes
        ok, why = kernels.triton_status(self.src_device)
        gather = self.opts["gather"] or ("triton" if ok else "torch")
        if gather not in ("triton", "torch"):
            raise ValueError(f"gather {gather!r} is not valid; use 'triton' or 'torch'")
        if gather == "triton" and not ok:
            self._note(f"gather falls back to torch index_select: {why}")
            gather = "torch"
        self.gather = gather
        self.backend = f"{gather} gather + {'copy engine' if self.cuda else 'host copy'}"
        E = self.spec.block_elems
        # the staging ring lives on the source GPU: allocated once here, never inside a send
        self.staging = [torch.empty((self.chunk_rows, E), dtype=self.spec.dtype, device=self.src_device)
                        for _ in range(ring)]
        self.copy_stream = torch.cuda.Stream(device=self.src_device) if self.cuda else None
        self._gathered = [torch.cuda.Event() for _ in range(ring)] if self.cuda else None
        self._free = [torch.cuda.Event() for _ in range(ring)] if self.cuda else None
        self.config.update(chunk_rows=self.chunk_rows, chunk_bytes=self.chunk_rows * self.spec.block_bytes, ring=ring)

    def _prepare(self, plan):
        sidx, _ = self._indices(plan)
        plan.extra["chunks"] = {}
        if self.gather == "triton":
            n = min(plan.rows, self.chunk_rows)
            key = (self.name, self.spec.block_bytes, "gather", str(self.src_device), n)
            plan.extra["cfg"] = kernel_config(self, key, (plan.src_pool.rows, sidx[:n], self.staging[0], None))

    def _chunks(self, plan, lo, hi):
        chunks = plan.extra["chunks"].get((lo, hi))
        if chunks is None:
            # runs of consecutive host rows, also cut at chunk boundaries; grouped per chunk
            chunks = []
            for off, row, cnt in row_runs(plan.dst_rows[lo:hi], self.chunk_rows):
                k = off // self.chunk_rows
                if k == len(chunks):
                    chunks.append((lo + k * self.chunk_rows, min(hi, lo + (k + 1) * self.chunk_rows), []))
                chunks[k][2].append((off - k * self.chunk_rows, row, cnt))
            plan.extra["chunks"][(lo, hi)] = chunks
        return chunks

    def _copy(self, plan, lo, hi):
        sidx, _ = self._indices(plan)
        src, host = plan.src_pool.rows, self.pool.rows
        ring = len(self.staging)
        pinned = self.dest.kind == "pinned"
        last = None
        for k, (a, b, pieces) in enumerate(self._chunks(plan, lo, hi)):
            slot = k % ring
            stage = self.staging[slot]
            if self.cuda:
                self.stream.wait_event(self._free[slot])  # the copy that last read this slot is done
            if self.gather == "triton":
                kernels.launch_rows(src, sidx[a:b], stage, None, plan.extra["cfg"])
            else:
                torch.index_select(src, 0, sidx[a:b], out=stage[: b - a])
            if not self.cuda:
                for off, row, cnt in pieces:
                    host[row:row + cnt].copy_(stage[off:off + cnt])
                continue
            self._gathered[slot].record(self.stream)
            self.copy_stream.wait_event(self._gathered[slot])
            with torch.cuda.stream(self.copy_stream):
                for off, row, cnt in pieces:
                    host[row:row + cnt].copy_(stage[off:off + cnt], non_blocking=pinned)
            self._free[slot].record(self.copy_stream)
            last = self._free[slot]
        if last is not None:
            self.stream.wait_event(last)  # the send's done event (recorded on self.stream) covers the copies


def chunk_bounds(lo: int, hi: int, chunk: int, edge: int) -> list[tuple[int, int]]:
    """Plan rows [lo, hi) cut into pipeline chunks of at most `chunk` rows: a small first and last chunk of
    `edge` rows (≤ chunk; the gather of the first and the scatter of the last cannot overlap anything, so
    they are kept short) and near-equal chunks between them. A range of at most 2 × edge rows is cut into
    near-equal pieces of at most `chunk` rows. chunk, edge ≥ 1."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1 or \
            isinstance(edge, bool) or not isinstance(edge, int) or edge < 1:
        raise ValueError(f"chunk={chunk!r}, edge={edge!r}: both must be ints ≥ 1 (rows)")
    edge = min(edge, chunk)

    def even(a: int, b: int) -> list[tuple[int, int]]:
        if b <= a:
            return []
        k = -(-(b - a) // chunk)
        step = -(-(b - a) // k)
        return [(x, min(b, x + step)) for x in range(a, b, step)]

    n = hi - lo
    if n <= 0:
        return []
    if n <= 2 * edge:
        return even(lo, hi)
    return [(lo, lo + edge)] + even(lo + edge, hi - edge) + [(hi - edge, hi)]


class ChunkedGatherPeer(PagedTransport):
    """To a peer GPU's paged pool at the copy engine's rate: gather a chunk of rows on the source GPU into
    a staging ring (SMs, HBM speed), copy it to a staging ring on the peer with the copy engine
    (cudaMemcpyAsync, no SM stores over NVLink), and scatter it into the peer's pool with a kernel on the
    peer — three stages in flight at once, ordered by events (gather k → copy k → scatter k; copy k frees
    the source slot for gather k+ring, scatter k the peer slot for copy k+ring). Copies alternate over
    `copy_streams` streams so one copy's fixed start-up cost hides under the other's bytes.

    Why not the direct store (method "triton" to a peer): SMs cross NVLink in 128-byte stores and reach
    ~94 % of the copy engine's rate there; here only the copy engine crosses the link.

    The host issues five to ten driver calls and two kernel launches per chunk — in run
    20261130-144458-h200 about 0.2 ms of Python a chunk, so 16 MiB chunks (112 of them) took 23 ms and the
    link waited for the host. Chunks must therefore carry more bytes than the link moves in one chunk's
    host time (≳ 80 MB at 395 GB/s); the first gather and the last scatter, which nothing overlaps, grow
    with them. The tuner times those trade-offs on the real tables and records the host's issue time
    beside each (config["pipeline_tuning"]).

    Options: chunk_mib (middle chunks; None = tuned among CHUNKS_MIB on a GPU, else 128), edge_mib (first
    and last chunk; None = tuned among EDGES_MIB, else 32), copy_streams (1 or 2; None = tuned), ring
    (slots per side, default 3), config (gather/scatter KernelConfig; default: tuned for the gather), tune,
    tune_repeats.
    """

    name = "chunked-gather-peer"
    kinds = ("peer",)
    needs_cuda = True
    options = {"chunk_mib": None, "edge_mib": None, "copy_streams": None, "ring": 3, "config": None, "tune": None,
               "tune_repeats": 5}
    CHUNKS_MIB = (128, 256)
    EDGES_MIB = (16, 64)

    @classmethod
    def _unavailable_here(cls, src, dest):
        ok, why = kernels.triton_status(src)
        if not ok:
            return f"{cls.name} gathers and scatters with the Triton kernel: {why}"
        cudart, why = cuda_runtime()
        return why

    def _setup(self):
        ring = self.opts["ring"]
        if not isinstance(ring, int) or ring < 2:
            raise ValueError(f"ring must be an int ≥ 2, got {ring!r}")
        streams = self.opts["copy_streams"]
        if streams not in (None, 1, 2):
            raise ValueError(f"copy_streams must be 1, 2 or None (tuned), got {streams!r}")
        chunk = self.opts["chunk_mib"]
        for name, v in (("chunk_mib", chunk), ("edge_mib", self.opts["edge_mib"])):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or
                                  v * 2**20 < self.spec.block_bytes):
                raise ValueError(f"{name}={v!r}: give a size in MiB of at least one block row "
                                 f"({self.spec.block_bytes} bytes)")
        edge = self.opts["edge_mib"]
        largest = max(max(self.CHUNKS_MIB) if chunk is None else chunk, max(self.EDGES_MIB) if edge is None else edge)
        rows = int(largest * 2**20) // self.spec.block_bytes
        E = self.spec.block_elems
        peer = self.dest.device
        self.rt, _ = cuda_runtime()
        self.stage_src = [torch.empty((rows, E), dtype=self.spec.dtype, device=self.src_device) for _ in range(ring)]
        self.stage_dst = [torch.empty((rows, E), dtype=self.spec.dtype, device=peer) for _ in range(ring)]
        self.copy_streams = [torch.cuda.Stream(device=self.src_device) for _ in range(2)]
        self.scatter_stream = torch.cuda.Stream(device=peer)
        self._gathered = [torch.cuda.Event() for _ in range(ring)]
        self._copied = [torch.cuda.Event() for _ in range(ring)]
        with torch.cuda.device(peer):
            self._scattered = [torch.cuda.Event() for _ in range(ring)]
        self._peer_arange = torch.arange(rows, dtype=torch.int64, device=peer)
        self.backend = "triton gather + copy engine + triton scatter"
        self.config.update(ring=ring)

    def _prepare(self, plan):
        sidx, _ = self._indices(plan)
        plan.extra["didx_peer"] = torch.from_numpy(plan.dst_rows).to(self.dest.device)
        n = min(plan.rows, self.stage_src[0].shape[0])
        key = (self.name, self.spec.block_bytes, "gather", str(self.src_device), n)
        plan.extra["cfg"] = kernel_config(self, key, (plan.src_pool.rows, sidx[:n], self.stage_src[0], None))
        plan.extra["chunks"] = {}
        chunk, edge, streams = self.opts["chunk_mib"], self.opts["edge_mib"], self.opts["copy_streams"]
        tune = self.opts.get("tune")
        tune = self.cuda if tune is None else bool(tune)
        chunks = [chunk] if chunk is not None else (list(self.CHUNKS_MIB) if tune else [128])
        edges = [edge] if edge is not None else (list(self.EDGES_MIB) if tune else [32])
        stream_opts = [streams] if streams is not None else ([1, 2] if tune else [2])
        settings = [(c, e, k) for c in chunks for e in edges for k in stream_opts if e <= c]
        settings = settings or [(chunks[0], min(edges[0], chunks[0]), stream_opts[0])]
        trials = []
        for c, e, k in settings:
            self._use(plan, c, e, k)
            ms = host_ms = None
            if len(settings) > 1:
                ms, host_ms = self._time_send(plan)
            trials.append({"chunk_mib": c, "edge_mib": e, "copy_streams": k, "ms": ms, "host_issue_ms": host_ms,
                           "chunks": len(self._bounds(plan, 0, plan.rows))})
        best = min(trials, key=lambda t: t["ms"] if t["ms"] is not None else 0.0)
        self._use(plan, best["chunk_mib"], best["edge_mib"], best["copy_streams"])
        self.config.update(chunk_mib=best["chunk_mib"], edge_mib=best["edge_mib"], copy_streams=best["copy_streams"])
        if len(trials) > 1:
            self.config["pipeline_tuning"] = trials
            self._note(f"pipeline tuned on these tables: chunk {best['chunk_mib']} MiB, edges {best['edge_mib']} MiB, "
                       f"{best['copy_streams']} copy stream(s) ({len(trials)} settings, median of "
                       f"{self.opts.get('tune_repeats', 5)} sends each)")

    def _use(self, plan, chunk_mib, edge_mib, streams) -> None:
        rows = lambda mib: max(1, int(mib * 2**20) // self.spec.block_bytes)  # noqa: E731
        plan.extra.update(chunk_rows=rows(chunk_mib), edge_rows=min(rows(edge_mib), rows(chunk_mib)), streams=streams)

    def _bounds(self, plan, lo, hi):
        """The chunks of plan rows [lo, hi) with their index slices, made once per setting."""
        key = (lo, hi, plan.extra["chunk_rows"], plan.extra["edge_rows"])
        got = plan.extra["chunks"].get(key)
        if got is None:
            sidx, _ = self._indices(plan)
            didx = plan.extra["didx_peer"]
            got = [(b - a, sidx[a:b], didx[a:b], self._peer_arange[:b - a])
                   for a, b in chunk_bounds(lo, hi, plan.extra["chunk_rows"], plan.extra["edge_rows"])]
            plan.extra["chunks"][key] = got
        return got

    def _time_send(self, plan) -> tuple[float, float]:
        """(median ms, median host ms) of whole sends of this plan with the current settings, run the way
        send() runs them (send() itself would prepare the plan again); host ms = the Python time issuing one."""
        cur = torch.cuda.current_stream(self.src_device)
        done = torch.cuda.Event()
        host = []

        def run():
            t0 = time.perf_counter_ns()
            self._wait_for_destination()
            self.stream.wait_stream(cur)
            with torch.cuda.stream(self.stream):
                self._copy(plan, 0, plan.rows)
            done.record(self.stream)
            cur.wait_event(done)
            host.append((time.perf_counter_ns() - t0) / 1e6)

        n = self.opts.get("tune_repeats", 5)
        ms = sorted(timing.time_fn(run, n=n, warmup=1, device=self.src_device))[n // 2]
        return ms, sorted(host)[len(host) // 2]

    def _copy(self, plan, lo, hi):
        cfg = plan.extra["cfg"]
        n_streams = plan.extra["streams"]
        bounds = self._bounds(plan, lo, hi)
        src_rows, pool_rows = plan.src_pool.rows, self.pool.rows
        row_bytes = self.spec.block_bytes
        ring = len(self.stage_src)
        memcpy, kind = self.rt.cudaMemcpyAsync, self.rt.cudaMemcpyKind.cudaMemcpyDefault

        def gather(k):
            # 1. gather on the source GPU (the transport's stream), once the copy that last read the slot is done
            slot = k % ring
            self.stream.wait_event(self._copied[slot])
            kernels.launch_rows(src_rows, bounds[k][1], self.stage_src[slot], None, cfg)
            self._gathered[slot].record(self.stream)

        # gathers are issued one chunk ahead of their copies: the host's issue time (~0.2 ms a chunk in run
        # 20261130-144848-h200) then runs while the copy engine moves the chunk before, instead of leaving the
        # link idle until the next gather has been issued and run. Every event is recorded before a wait on it
        # is issued (gather k+1 waits for copy k+1-ring, issued earlier), so no wait binds to a stale record.
        if bounds:
            gather(0)
        for k, (n, s_idx, d_idx, p_idx) in enumerate(bounds):
            slot = k % ring
            stage0, stage1 = self.stage_src[slot], self.stage_dst[slot]
            if k + 1 < len(bounds):
                gather(k + 1)
            # 2. the copy engine moves chunk k to the peer's staging slot, once that slot's last scatter is done
            cs = self.copy_streams[k % n_streams]
            cs.wait_event(self._gathered[slot])
            cs.wait_event(self._scattered[slot])
            (err,) = memcpy(stage1.data_ptr(), stage0.data_ptr(), n * row_bytes, kind, cs.cuda_stream)
            if int(err) != 0:
                raise RuntimeError(f"cudaMemcpyAsync to {self.dest.device} failed: {err}")
            self._copied[slot].record(cs)
            # 3. the peer scatters it into its pool
            self.scatter_stream.wait_event(self._copied[slot])
            with torch.cuda.stream(self.scatter_stream):
                kernels.launch_rows(stage1, p_idx, pool_rows, d_idx, cfg)
            self._scattered[slot].record(self.scatter_stream)
        if bounds:
            self.stream.wait_event(self._scattered[(len(bounds) - 1) % ring])  # the send ends when the peer has it


class MappedPinned(PagedTransport):
    """To pinned host memory with no staging and no copy engine: the Triton kernel's stores go straight
    to the page-locked pool through unified virtual addressing (the GPU writes over PCIe).

    Options: config / tune / tune_repeats.
    """

    name = "mapped-pinned"
    kinds = ("pinned",)
    needs_cuda = True
    options = {"config": None, "tune": None, "tune_repeats": 3}

    @classmethod
    def _unavailable_here(cls, src, dest):
        ok, why = kernels.triton_status(src)
        return None if ok else why

    def _prepare(self, plan):
        sidx, didx = self._indices(plan)
        n = min(plan.rows, _TUNE_ROWS)
        key = (self.name, self.spec.block_bytes, self.dest.kind, str(self.src_device), n)
        plan.extra["cfg"] = kernel_config(self, key, (plan.src_pool.rows, sidx[:n], self.pool.rows, didx[:n]))

    def _copy(self, plan, lo, hi):
        sidx, didx = self._indices(plan)
        kernels.launch_rows(plan.src_pool.rows, sidx[lo:hi], self.pool.rows, didx[lo:hi], plan.extra["cfg"])
