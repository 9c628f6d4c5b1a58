"""Paged transports: move a sequence's blocks from one kvlab.paged.BlockPool to a destination pool.

Every transport moves rows by index: (layer, side, source block) → (layer, side, destination block) — see
kvlab.paged for the row numbering. A transfer "plan" lists the rows layer by layer (layer i's rows are one
contiguous range, which is what layer-wise sending needs), and within a layer in increasing destination block
id (so a packed destination is written in one run per layer side, or one run in total when the destination
pool is exactly the table's size).

Transports (paged → paged with other block ids, or paged → contiguous when `dst_table` is None: the blocks land
packed at ids 0 … n-1 of the destination pool), by module:

    here                per-block-copy (one `copy_` per block: the launch-bound baseline), torch-index
                        (index_select into staging + index_copy_), cuda-memcpy-batch (cudaMemcpyBatchAsync,
                        one descriptor per block; cuda-bindings, CUDA ≥ 12.8)
    kvlab.paged.triton_transports  triton (one kernel gathers and scatters rows, same GPU or peer), chunked-gather-d2h
                        (to host: gather chunks on the GPU while the copy engine moves the previous one),
                        chunked-gather-peer (to a peer: gather, copy engine over the link, scatter on the
                        peer), mapped-pinned (the kernel stores straight into pinned host memory)
    kvlab.paged.nixl          nixl (NIXL with the UCX backend: one prepared request, one descriptor per block)

Each is constructed once for a destination (its pool is allocated and NaN-poisoned there), and
`send(src_pool, src_table, dst_table)` returns a kvlab.landing.Landing, like kvlab.transfer.Transport.
Bad input (block ids out of range, duplicate ids, length / dtype / layout mismatch, a destination that is
too small) raises ValueError before any byte moves. `make_transport(name, ...)` builds any of them by name;
`transports()` (also the module attribute `TRANSPORTS`) maps names to classes.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import weakref

import numpy as np
import torch

from ..landing import Landing
from ..transfer import Destination, check_capacity
from .pools import BlockPool, BlockTable, PoolSpec, indexable, positive_int

__all__ = ["Plan", "PagedTransport", "PagedLayerwiseSend", "PerBlockCopy", "TorchIndex", "CudaMemcpyBatch",
           "enable_peer", "row_runs", "same_device", "cuda_runtime"]


@dataclass
class Plan:
    """Which rows move where, for one (source pool, source table, destination table) triple.

    Rows are ordered layer, side, then destination block id: layer i's rows are [i·rpl, (i+1)·rpl)
    with rpl = 2·n. src_rows / dst_rows are numpy int64 row ids into src_pool.rows / the destination rows.
    """

    src_pool: BlockPool
    src_table: BlockTable
    dst_ref: "weakref.ref | None"  # the destination table, held weakly: a cached plan must not keep a sequence
    n_blocks: int                  # the caller has dropped alive (its blocks would stay claimed)
    src_rows: np.ndarray
    dst_rows: np.ndarray
    extra: dict = field(default_factory=dict)
    dst_ids: np.ndarray | None = None  # the destination block ids (packed 0 … n-1 when there is no table)

    @property
    def dst_table(self) -> BlockTable | None:
        return self.dst_ref() if self.dst_ref is not None else None

    @property
    def rows(self) -> int:
        return int(self.src_rows.size)

    @property
    def rows_per_layer(self) -> int:
        return 2 * self.n_blocks

    def layer_range(self, layer: int) -> tuple[int, int]:
        return layer * self.rows_per_layer, (layer + 1) * self.rows_per_layer


def _row_ids(layers: int, pool_blocks: int, block_ids: np.ndarray) -> np.ndarray:
    sides = np.arange(2 * layers, dtype=np.int64)[:, None] * pool_blocks
    return (sides + block_ids[None, :]).reshape(-1)


def row_runs(dst_rows: np.ndarray, limit: int | None = None) -> list[tuple[int, int, int]]:
    """Split a row list into runs of consecutive destination rows: [(plan offset, first dst row, count)].

    limit: also cut at every multiple of `limit` plan rows (chunk boundaries)."""
    n = dst_rows.size
    if n == 0:
        return []
    cuts = np.flatnonzero(np.diff(dst_rows) != 1) + 1
    if limit:
        cuts = np.union1d(cuts, np.arange(limit, n, limit, dtype=np.int64))
    starts = np.concatenate(([0], cuts)).astype(np.int64)
    ends = np.concatenate((cuts, [n])).astype(np.int64)
    return list(zip(starts.tolist(), dst_rows[starts].tolist(), (ends - starts).tolist()))


def same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    return a.type != "cuda" or (a.index or 0) == (b.index or 0)


class PagedTransport:
    """Move a sequence's blocks from a source pool to this transport's destination pool.

    spec: the pools' shape; dest: "same-gpu" | "cuda:N" | "pinned" | "pageable" (kvlab.transfer.Destination);
    dst_blocks: blocks in the destination pool (allocated once, here, and NaN-poisoned);
    src_device: where source pools live. Options are per transport (see each class).

    `send(src_pool, src_table, dst_table=None)` enqueues the copy after the work already queued on the
    current stream and returns a Landing (stream-ordered transports: a CUDA event on the copy stream;
    CPU: already complete). dst_table None = packed at blocks 0 … n-1 (paged → contiguous).
    `prepare(...)` builds (and caches) the plan of a table pair — index arrays, pointer lists, tuning —
    so repeated sends of the same tables measure the transfer, not the planning.
    """

    name = "base"
    kinds: tuple[str, ...] = ("device", "peer", "pinned", "pageable")
    needs_cuda = False
    stream_ordered = True
    options: dict = {}

    @classmethod
    def unavailable(cls, src_device: torch.device | str, dest) -> str | None:
        """None when this transport can run from `src_device` to `dest`; else the reason it cannot."""
        src = torch.device(src_device)
        try:
            d = Destination.parse(dest, src)
        except ValueError as exc:
            return str(exc)
        if d.kind not in cls.kinds:
            return f"{cls.name} does not apply to a {d.label} destination (it moves to: {', '.join(cls.kinds)})"
        if (cls.needs_cuda or d.kind in ("pinned", "peer")) and src.type != "cuda":
            return f"{cls.name} to {d.label} needs a CUDA source device; the source is {src}"
        return cls._unavailable_here(src, d)

    @classmethod
    def _unavailable_here(cls, src: torch.device, dest: Destination) -> str | None:
        return None

    def __init__(self, spec: PoolSpec, dest, dst_blocks: int, src_device: torch.device | str = "cpu", **options):
        if not isinstance(spec, PoolSpec):
            raise ValueError(f"spec must be a PoolSpec, got {type(spec).__name__}")
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            raise ValueError(f"unknown option(s) {unknown} for transport {self.name!r}; valid: {sorted(self.options)}")
        self.opts = {**self.options, **options}
        self.spec = spec
        src = torch.device(src_device)
        if src.type == "cuda" and src.index is None:
            src = torch.device("cuda", torch.cuda.current_device())
        self.src_device = src
        self.dest = Destination.parse(dest, src)
        why = self.unavailable(src, self.dest)
        if why is not None:
            raise ValueError(f"transport {self.name!r} cannot run here: {why}")
        dst_blocks = positive_int("dst_blocks", dst_blocks)
        self.cuda = src.type == "cuda"
        self._check_capacity(spec.pool_bytes(dst_blocks))
        self.pool = BlockPool(spec, dst_blocks, device=self.dest.device, pin_memory=self.dest.kind == "pinned")
        self.pool.track_writes().poison()  # a block no send reached is refused by every read
        if self.dest.kind == "peer":
            enable_peer(src, self.dest.device)
        self.stream = torch.cuda.Stream(device=src) if self.cuda else None
        self._done = torch.cuda.Event(enable_timing=True) if self.cuda else None
        self._plans: OrderedDict = OrderedDict()
        self._sends = 0
        self.backend = self.name
        self.notes: list[str] = []
        self.config: dict = {}
        self._setup()

    # -- hooks for subclasses ---------------------------------------------------------------------
    def _setup(self) -> None:
        """Allocate per-transport resources (streams, staging) after the destination pool exists."""

    def _prepare(self, plan: Plan) -> None:
        """Build what `_copy` needs for this plan (index tensors, pointer lists, tuning)."""

    def _copy(self, plan: Plan, lo: int, hi: int) -> None:
        """Copy plan rows [lo, hi); runs with the copy stream current (GPU) or synchronously (CPU)."""
        raise NotImplementedError

    # -- public -----------------------------------------------------------------------------------
    @property
    def label(self) -> str:
        return self.dest.label

    @property
    def info(self) -> dict:
        """What ran: name, backend actually used, notes (fallbacks, tuning), configuration."""
        return {"method": self.name, "backend": self.backend, "notes": list(self.notes), "config": dict(self.config)}

    def poison(self) -> None:
        """NaN-fill the destination pool (run before a verified send)."""
        self.pool.poison()

    def close(self) -> None:
        """Release external resources (NIXL registrations); the pool is freed with the object."""
        self._plans.clear()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: nothing left to release
            pass

    def prepare(self, src_pool: BlockPool, src_table: BlockTable, dst_table: BlockTable | None = None) -> Plan:
        """Validate a send and build its plan (cached for the last two table pairs).

        Invalid input raises ValueError before any byte moves. On a GPU, building a plan may tune the
        kernel, which writes the plan's destination rows (with the right bytes): poison the destination
        after prepare() when a verification must prove what send() wrote.
        """
        key = (id(src_pool), id(src_table), id(dst_table))
        plan = self._plans.get(key)
        if (plan is not None and plan.src_pool is src_pool and plan.src_table is src_table
                and (plan.dst_ref is None) == (dst_table is None) and plan.dst_table is dst_table):
            self._plans.move_to_end(key)
            return plan
        plan = self._build_plan(src_pool, src_table, dst_table)
        self._prepare(plan)
        self._plans[key] = plan
        while len(self._plans) > 2:
            self._plans.popitem(last=False)
        return plan

    def _build_plan(self, src_pool, src_table, dst_table) -> Plan:
        if not isinstance(src_pool, BlockPool):
            raise ValueError(f"src_pool must be a BlockPool, got {type(src_pool).__name__}")
        if (why := self.spec.compatible(src_pool.spec)) is not None:
            raise ValueError(f"source pool does not match the transport's pool spec: {why}")
        if not same_device(src_pool.device, self.src_device):
            raise ValueError(f"source pool is on {src_pool.device}, the transport sends from {self.src_device}")
        src_pool.check_table(src_table, "source table")
        n = src_table.num_blocks
        if dst_table is None:
            if n > self.pool.num_blocks:
                raise ValueError(f"destination too small: {n} blocks to land packed, the destination pool has "
                                 f"{self.pool.num_blocks}")
            dst_ids = np.arange(n, dtype=np.int64)
        else:
            self.pool.check_table(dst_table, "destination table")
            if dst_table.num_blocks != n or dst_table.tokens != src_table.tokens:
                raise ValueError(f"length mismatch: source table {n} blocks / {src_table.tokens} tokens, destination "
                                 f"table {dst_table.num_blocks} blocks / {dst_table.tokens} tokens")
            dst_ids = dst_table.ids
        # order each layer side by destination block: packed destinations then form long runs
        order = np.argsort(dst_ids, kind="stable")
        src_ids, dst_ids = src_table.ids[order], dst_ids[order]
        L = self.spec.layers
        return Plan(src_pool, src_table, weakref.ref(dst_table) if dst_table is not None else None, n,
                    _row_ids(L, src_pool.num_blocks, src_ids), _row_ids(L, self.pool.num_blocks, dst_ids),
                    dst_ids=np.asarray(dst_ids, dtype=np.int64))

    def new_landing(self, plan: Plan, events: list | None = None) -> Landing:
        """The Landing of a new send of `plan`: the next send id; the destination pool's reads of its blocks wait
        on it; a destination table's blocks are claimed for its sequence (refused if another live one holds them)."""
        table = plan.dst_table
        if plan.extra.get("owner_epoch") != self.pool.owner_epoch:
            # again whenever the pool's ownership changed since this plan last claimed (a release, another
            # sequence's claim); otherwise the check stays out of timed sends
            if table is not None:
                self.pool.claim(table)
            elif plan.dst_ref is None:  # packed into blocks 0 … n-1, which no live sequence may hold
                self.pool.check_unowned(plan.dst_ids, f"a packed send of {plan.n_blocks} blocks (no destination table)")
            plan.extra["owner_epoch"] = self.pool.owner_epoch
        self._sends += 1
        landing = Landing(self.spec.layers, events, send_id=self._sends, dest=f"{self.name} → {self.dest.label}")
        self.pool.expect(plan.dst_ids, landing)
        return landing

    def send(self, src_pool: BlockPool, src_table: BlockTable, dst_table: BlockTable | None = None) -> Landing:
        """Move the table's blocks (all layers, K and V) into the destination pool."""
        plan = self.prepare(src_pool, src_table, dst_table)
        L = self.spec.layers
        if not self.cuda:
            landing = self.new_landing(plan)
            try:
                self._copy(plan, 0, plan.rows)
            except BaseException as err:
                landing.abort(range(L), f"{type(err).__name__} during the copy")
                raise
            return landing
        self._wait_for_destination()
        compute = torch.cuda.current_stream(self.src_device)
        self.stream.wait_stream(compute)
        landing = self.new_landing(plan, [self._done] * L)
        try:
            with torch.cuda.stream(self.stream):
                self._copy(plan, 0, plan.rows)
            self._done.record(self.stream)
        except BaseException as err:
            landing.abort(range(L), f"{type(err).__name__} while queuing the copy")
            raise
        return landing

    def _wait_for_destination(self) -> None:
        """A peer pool is written (poisoned, read by decode) on the peer's own streams; the copy stream must
        not overtake that work. Same ordering as torch's cross-device copy_, one event per send."""
        if self.cuda and self.dest.kind == "peer":
            self.stream.wait_stream(torch.cuda.current_stream(self.dest.device))

    def layerwise(self, src_pool: BlockPool, src_table: BlockTable, dst_table: BlockTable | None = None
                  ) -> "PagedLayerwiseSend":
        """A per-layer sender for kvlab.hooks.LayerHooks: on_layer(i) sends layer i's blocks."""
        if not self.stream_ordered:
            raise ValueError(f"transport {self.name!r} is not stream-ordered and cannot send layer by layer")
        return PagedLayerwiseSend(self, src_pool, src_table, dst_table)

    # -- helpers ----------------------------------------------------------------------------------
    def _check_capacity(self, need: int) -> None:
        check_capacity(self.dest, need, "destination pool", hint="use fewer dst_blocks")

    def _indices(self, plan: Plan) -> tuple[torch.Tensor, torch.Tensor]:
        """Row ids as int64 tensors on the source device (cached on the plan)."""
        idx = plan.extra.get("idx")
        if idx is None:
            idx = (self._on_stream(torch.from_numpy(plan.src_rows).to(self.src_device)),
                   self._on_stream(torch.from_numpy(plan.dst_rows).to(self.src_device)))
            plan.extra["idx"] = idx
        return idx

    def _on_stream(self, t: torch.Tensor) -> torch.Tensor:
        """Mark a tensor made on the current stream as used on the copy stream, so the caching allocator
        does not hand its memory out again (when the plan is dropped) while a copy may still read it."""
        if self.cuda and t.device.type == "cuda" and same_device(t.device, self.src_device):
            t.record_stream(self.stream)
        return t

    def _note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)


def enable_peer(src: torch.device, dst: torch.device) -> None:
    """Turn on peer access both ways with a one-element copy: torch's copy path enables it on first use,
    and kernels that store to the peer's memory need it on before they launch."""
    if not torch.cuda.can_device_access_peer(src.index or 0, dst.index or 0):
        raise ValueError(f"{src} cannot access {dst} directly (no P2P between them); a peer transport needs P2P")
    a = torch.zeros(1, device=src)
    b = torch.zeros(1, device=dst)
    b.copy_(a)
    a.copy_(b)
    torch.cuda.synchronize(src)
    torch.cuda.synchronize(dst)


class PerBlockCopy(PagedTransport):
    """One `copy_` per block (per layer side): 2 · layers · n Python-level copies; the baseline."""

    name = "per-block-copy"

    def _prepare(self, plan):
        plan.extra["pairs"] = (plan.src_rows.tolist(), plan.dst_rows.tolist())

    def _copy(self, plan, lo, hi):
        src, dst = plan.src_pool.rows, self.pool.rows
        s, d = plan.extra["pairs"]
        nb = self.cuda
        for i in range(lo, hi):
            dst[d[i]].copy_(src[s[i]], non_blocking=nb)


class TorchIndex(PagedTransport):
    """index_select into a staging tensor on the source device, then index_copy_ into the destination
    (peer: the staging rows are copied to the peer first); host destinations: gather, then one copy per
    run of consecutive destination rows (one in total for a packed, exactly-sized destination)."""

    name = "torch-index"

    def _setup(self):
        self.dst_stream = torch.cuda.Stream(device=self.dest.device) if self.dest.kind == "peer" else None

    def _prepare(self, plan):
        sidx, didx = self._indices(plan)
        E = self.spec.block_elems
        plan.extra["tmp"] = self._on_stream(torch.empty((plan.rows, E), dtype=self.spec.dtype, device=self.src_device))
        if self.dest.kind == "peer":
            plan.extra["tmp_dst"] = torch.empty((plan.rows, E), dtype=self.spec.dtype, device=self.dest.device)
            plan.extra["didx_dst"] = didx.to(self.dest.device)
            for t in (plan.extra["tmp_dst"], plan.extra["didx_dst"]):
                t.record_stream(self.dst_stream)
        if self.dest.kind in ("pinned", "pageable"):
            plan.extra["runs"] = {}

    def _copy(self, plan, lo, hi):
        sidx, didx = self._indices(plan)
        src, dst = plan.src_pool.rows, self.pool.rows
        tmp = plan.extra["tmp"][lo:hi]
        torch.index_select(src, 0, sidx[lo:hi], out=tmp)
        kind = self.dest.kind
        if kind == "device":  # float8 rows move as their bytes: torch has no float8 index_copy_
            indexable(dst).index_copy_(0, didx[lo:hi], indexable(tmp))
        elif kind == "peer":
            ds = self.dst_stream
            ds.wait_stream(self.stream)
            with torch.cuda.stream(ds):
                tmp_dst = plan.extra["tmp_dst"][lo:hi]
                tmp_dst.copy_(tmp, non_blocking=True)
                indexable(dst).index_copy_(0, plan.extra["didx_dst"][lo:hi], indexable(tmp_dst))
            self.stream.wait_stream(ds)
        else:
            runs = plan.extra["runs"].get((lo, hi))
            if runs is None:
                runs = plan.extra["runs"][(lo, hi)] = row_runs(plan.dst_rows[lo:hi])
            nb = self.cuda and kind == "pinned"
            for off, row, cnt in runs:
                dst[row:row + cnt].copy_(tmp[off:off + cnt], non_blocking=nb)


def cuda_runtime():
    """(cuda-bindings' runtime module, None), or (None, why it cannot be had)."""
    try:
        from cuda.bindings import runtime as cudart
    except Exception:
        try:
            from cuda import cudart  # cuda-python < 12.6 layout
        except Exception:
            return None, "cuda-python (cuda-bindings) is not installed: pip install 'kvlab[cuda]'"
    return cudart, None


def _cudart():
    """(module, None) for cuda-bindings' runtime with cudaMemcpyBatchAsync, else (None, reason)."""
    cudart, why = cuda_runtime()
    if cudart is None:
        return None, why
    if not hasattr(cudart, "cudaMemcpyBatchAsync"):
        return None, "these cuda-bindings have no cudaMemcpyBatchAsync (it needs CUDA 12.8 or newer bindings)"
    err, runtime = cudart.cudaRuntimeGetVersion()
    if int(err) != 0:
        return None, f"cudaRuntimeGetVersion failed: {err}"
    err, driver = cudart.cudaDriverGetVersion()
    if int(err) != 0:
        return None, f"cudaDriverGetVersion failed: {err}"
    if runtime < 12080 or driver < 12080:
        return None, f"cudaMemcpyBatchAsync needs CUDA ≥ 12.8; runtime {runtime}, driver {driver}"
    return cudart, None


class CudaMemcpyBatch(PagedTransport):
    """All blocks in one cudaMemcpyBatchAsync call (one descriptor per block, stream-ordered source
    access), through cuda-bindings. The pointer arrays are computed with numpy per plan; the bindings
    take Python lists, so each call still converts 3 × R list entries (host time, in the measurement)."""

    name = "cuda-memcpy-batch"
    needs_cuda = True

    @classmethod
    def _unavailable_here(cls, src, dest):
        return _cudart()[1]

    def _setup(self):
        self.cudart, _ = _cudart()
        cudart = self.cudart
        attr = cudart.cudaMemcpyAttributes()
        attr.srcAccessOrder = cudart.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
        self._attrs = [attr]
        self.config.update(runtime=cudart.cudaRuntimeGetVersion()[1], driver=cudart.cudaDriverGetVersion()[1])

    def _prepare(self, plan):
        rb = np.uint64(self.spec.block_bytes)
        src = np.uint64(plan.src_pool.data.data_ptr()) + plan.src_rows.astype(np.uint64) * rb
        dst = np.uint64(self.pool.data.data_ptr()) + plan.dst_rows.astype(np.uint64) * rb
        plan.extra["batch"] = (dst.tolist(), src.tolist(), [int(rb)] * plan.rows)
        self.config["descriptors"] = plan.rows
        self._note(f"cudaMemcpyBatchAsync (runtime {self.config['runtime']}, driver {self.config['driver']}): "
                   f"{plan.rows:,} descriptors in one call; the bindings convert Python lists on every call")

    def _copy(self, plan, lo, hi):
        cudart = self.cudart
        dsts, srcs, sizes = plan.extra["batch"]
        if (lo, hi) != (0, plan.rows):
            dsts, srcs, sizes = dsts[lo:hi], srcs[lo:hi], sizes[lo:hi]
        res = cudart.cudaMemcpyBatchAsync(dsts, srcs, sizes, hi - lo, self._attrs, [0], 1, self.stream.cuda_stream)
        err = res[0]
        if err != cudart.cudaError_t.cudaSuccess:
            fail = res[1] if len(res) > 1 else None
            raise RuntimeError(f"cudaMemcpyBatchAsync failed: {err!r} (failed copy index {fail}) for {hi - lo} copies")


class PagedLayerwiseSend:
    """Sends layer i's blocks as soon as the hook says they are final, on the transport's copy stream.

    Built by `transport.layerwise(src_pool, src_table, dst_table)`: the plan (index tensors, kernel
    config) is prepared here, before prefill, so a hook costs an event record, a stream wait and one
    kernel launch (triton) per layer. Use with kvlab.hooks.LayerHooks(model, on_kv_ready=send.on_layer,
    point="attention")
    and a prefill that writes into the source pool (paged_prefill_cache / prefill_into_pages).
    """

    _landing = None  # the current send's Landing, from begin() on

    def __init__(self, transport: PagedTransport, src_pool: BlockPool, src_table: BlockTable,
                 dst_table: BlockTable | None = None):
        self.t = transport
        self.plan = transport.prepare(src_pool, src_table, dst_table)
        self.layers = transport.spec.layers
        self.cuda = transport.cuda
        if self.cuda:
            self._ready = [torch.cuda.Event() for _ in range(self.layers)]
            self._done = [torch.cuda.Event(enable_timing=True) for _ in range(self.layers)]
        self._compute = None
        self.sent = 0

    def begin(self) -> "PagedLayerwiseSend":
        """Call right before prefill: captures the compute stream; the send (and its Landing) starts here."""
        self.sent = 0
        self._landing = self.t.new_landing(self.plan, list(self._done) if self.cuda else None).start_issuing()
        if self.cuda:
            self._compute = torch.cuda.current_stream(self.t.src_device)
            self.t._wait_for_destination()
        return self

    def on_layer(self, i: int) -> None:
        """Layer i's K and V are final in the source pool (on the compute stream): send them. Each layer once."""
        if self._landing is None:
            raise RuntimeError("layer-wise paged send: on_layer() before begin(); call begin() right before prefill")
        i = self._landing.issue(i)
        lo, hi = self.plan.layer_range(i)
        self.sent += 1
        if not self.cuda:
            self.t._copy(self.plan, lo, hi)
            return
        self._ready[i].record(self._compute)
        stream = self.t.stream
        stream.wait_event(self._ready[i])
        torch.cuda.set_stream(stream)
        try:
            self.t._copy(self.plan, lo, hi)
        finally:
            torch.cuda.set_stream(self._compute)
        self._done[i].record(stream)

    def abort(self, why: str = "aborted") -> None:
        """Prefill failed: the send is aborted and its blocks refused until a later send lands."""
        landing = getattr(self, "_landing", None)
        if landing is not None:
            landing.abort_issuing(why)

    def finish(self) -> Landing:
        """After prefill returns: the Landing (per-layer events; layers not landed yet are in flight)."""
        if self._landing is None:
            raise RuntimeError("layer-wise paged send: finish() before begin(); call begin() right before prefill")
        if self.sent != self.layers:
            missing = self._landing.unissued
            self._landing.fail(missing, f"the send saw {self.sent} of {self.layers} layers")
            raise RuntimeError(f"layer-wise paged send saw {self.sent} of {self.layers} layers (missing {missing}): "
                               "were the hooks installed on every decoder layer?")
        return self._landing.end_issuing()
