"""Re-sharding a paged KV cache between prefill TP = P and decode TP = D: the plan, its bytes and pieces, the movers.

Prefill rank p holds KV heads [p·kv/P, (p+1)·kv/P) (one head, replicated P/kv times, once P > kv); decode rank d
needs [d·kv/D, (d+1)·kv/D) (one head once D > kv). `plan` says, per decode rank, which head slices it reads from
which prefill ranks: P > D gathers from P/D ranks, P < D feeds D/P decode ranks from one, KV heads < D replicates
(a replica: a decode rank holding heads an earlier one holds; its bytes are counted), MLA's latent (not split by
heads) is read once per decode rank from one prefill rank, the other holders skipped.

The movers (kvlab.paged.reshard_movers) take P source and D destination (BlockPool, BlockTable) pairs and move one
sequence: torch-index (the reference), fused (kvlab's Triton gather + head split), staging (SGLang's buffers),
block-slices (vLLM's one copy per block slice), and the last two's NIXL forms, nixl-staging (one descriptor per
layer side of a staging buffer), nixl-staging-bulk (one descriptor per staging buffer: a bulk handoff's) and
nixl-slices (one descriptor per block slice).

`account`: bytes per decode rank (calculator.kv_cache_bytes per head: it agrees with calculator.tp_shard_bytes),
replica bytes, pieces (separate copies / sends / descriptors a rank's data arrives in) per method; each mover counts
the pieces it issues. `verify`: every shard bit for bit against the source's head slice, no NaN poison left in it,
nothing written outside it. `predict`: time from pieces and bytes. GPU benchmark: kvlab.paged.reshard_bench.
Bad input is refused in one line (ValueError) before anything is allocated or written.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from .. import calculator, models
from ..kvcache import KVBuffer, KVLayout, as_dtype
from .pools import LAYOUTS, BlockAllocator, BlockPool, BlockTable, PoolSpec, positive_int

__all__ = ["METHODS", "AS_IS", "Piece", "Plan", "plan", "Accounting", "account", "shard_pools", "make_pools",
           "contiguous", "dst_map", "check_pools", "heads_first",
           "make_mover", "move", "verify", "predict", "table_rows"]

METHODS = ("torch-index", "fused", "staging", "block-slices", "nixl-staging", "nixl-staging-bulk", "nixl-slices")
AS_IS = ("block-slices", "nixl-slices")  # move a block's bytes as they are: both sides' layouts must match

# config keys and model types that mark Mamba / SSM / linear-attention layers: their state is not split by heads
_SSM_KEYS = ("ssm_state_size", "mamba_d_state", "mamba_expand", "state_size", "attn_layer_period",
             "layers_block_type", "hybrid_override_pattern", "linear_num_value_heads")
_SSM_TYPES = ("mamba", "mamba2", "falcon_mamba", "jamba", "zamba", "zamba2", "bamba", "falcon_h1", "nemotron_h",
              "granitemoehybrid", "qwen3_next", "recurrent_gemma", "lfm2", "plamo2")


def _is_ssm(cfg: Mapping) -> bool:
    kinds = " ".join(str(t) for t in (cfg.get("layer_types") or ()))
    return (str(cfg.get("model_type")) in _SSM_TYPES or any(cfg.get(k) is not None for k in _SSM_KEYS)
            or any(w in kinds for w in ("mamba", "linear", "ssm", "recurrent", "conv")))


def _spec(model, p: int, d: int) -> models.ModelSpec:
    """The model's spec; Mamba/SSM configs are refused for unequal TP before kvlab's own refusal of hybrids."""
    cfg = model.hf_config if isinstance(model, models.ModelSpec) else model if isinstance(model, Mapping) else None
    if cfg is not None and _is_ssm(cfg) and p != d:
        raise ValueError(f"prefill_tp={p}, decode_tp={d}: this model has Mamba/SSM layers, whose state is not split "
                         "by KV heads; re-sharding needs equal TP on both sides")
    if isinstance(model, Mapping):
        return models.from_hf_config(model)
    return models.get(model)


# ---------------------------------------------------------------------------------------------------
# the plan


@dataclass(frozen=True)
class Piece:
    """A head slice one decode rank reads from one prefill rank: `heads` heads from local head `src_head` of
    prefill rank `src_rank`'s pool to local head `dst_head` of the decode rank's pool (global head `global_head` on)."""

    src_rank: int
    src_head: int
    dst_head: int
    heads: int
    global_head: int


@dataclass(frozen=True)
class Plan:
    """Who reads what. Per prefill rank: `src_global[p]` = its global KV heads [lo, hi); per decode rank:
    `dst_global[d]`, `pieces[d]` (Pieces in destination head order), `replica[d]` (an earlier decode rank holds the
    same heads), `skipped[d]` (prefill ranks that hold its heads but are not read: redundant replicas).
    src_heads / dst_heads: KV heads in one prefill / decode rank's pool (MLA: 1, the latent)."""

    model: str
    attention: str
    heads: int
    kv_heads: int
    prefill_tp: int
    decode_tp: int
    src_heads: int
    dst_heads: int
    src_global: tuple
    dst_global: tuple
    pieces: tuple
    replica: tuple
    skipped: tuple
    notes: tuple
    spec: models.ModelSpec = field(compare=False, repr=False)


def _holds(tp: int, kv: int, rank: int) -> tuple[int, int]:
    if tp <= kv:
        per = kv // tp
        return rank * per, (rank + 1) * per
    head = rank // (tp // kv)
    return head, head + 1


def plan(model, prefill_tp: int, decode_tp: int) -> Plan:
    """The re-shard plan for `model` (a registry name, a ModelSpec or a config dict) from P to D ranks.

    Refused (ValueError, one line): a TP that is not an int ≥ 1; P and D that neither divide nor multiply each
    other; query heads not divisible by P or D (Qwen2.5-7B's 28: TP 8 refused); KV heads that a TP does not split
    evenly (calculator.tp_shard_bytes' rule); Mamba/SSM layers with P ≠ D.
    """
    p, d = positive_int("prefill_tp", prefill_tp), positive_int("decode_tp", decode_tp)
    spec = _spec(model, p, d)
    if max(p, d) % min(p, d):
        raise ValueError(f"prefill_tp={p} and decode_tp={d} neither divide nor multiply each other: a decode rank's "
                         "heads would straddle prefill ranks unevenly; use TP degrees where one is a multiple of the "
                         "other")
    mla = spec.attention == "mla"
    kv = 1 if mla else spec.kv_heads
    ok = [t for t in range(1, spec.heads + 1) if spec.heads % t == 0 and (mla or max(t, kv) % min(t, kv) == 0)]
    for name, tp in (("prefill_tp", p), ("decode_tp", d)):
        if tp not in ok:
            what = "query heads" if spec.heads % tp else "KV heads (evenly)"
            raise ValueError(f"{name}={tp} does not split {spec.name}'s {spec.heads} query heads / {spec.kv_heads} KV "
                             f"heads: not its {what}; valid TP: {ok}")
    src_global = tuple((0, 1) if mla else _holds(p, kv, r) for r in range(p))
    dst_global = tuple((0, 1) if mla else _holds(d, kv, r) for r in range(d))
    pieces, replica, skipped = [], [], []
    for r in range(d):
        group = list(range(r * p // d, (r + 1) * p // d)) if p >= d else [r // (d // p)]
        order = group + [q for q in range(p) if q not in group]
        out: list[Piece] = []
        holders: set[int] = set()
        for j, g in enumerate(range(*dst_global[r])):
            have = [q for q in order if src_global[q][0] <= g < src_global[q][1]]
            holders.update(have)
            q, local = have[0], g - src_global[have[0]][0]
            if out and out[-1].src_rank == q and out[-1].src_head + out[-1].heads == local:  # extend the last piece
                out[-1] = Piece(q, out[-1].src_head, out[-1].dst_head, out[-1].heads + 1, out[-1].global_head)
            else:
                out.append(Piece(q, local, j, 1, g))
        pieces.append(tuple(out))
        replica.append(dst_global[r] in dst_global[:r])
        skipped.append(tuple(sorted(holders - {pc.src_rank for pc in out})))
    notes = []
    if p > d:
        notes.append(f"P > D: each decode rank gathers its heads from its group of {p // d} prefill ranks"
                     + (" (prefill ranks holding the same head are read once, the others skipped)" if any(skipped)
                        else ""))
    elif p < d:
        notes.append(f"P < D: each prefill rank feeds {d // p} decode ranks")
    if mla:
        notes.append(f"MLA: the latent is not split by heads; every decode rank reads it once from one prefill rank "
                     f"({p - 1} redundant prefill rank(s) skipped per decode rank), {d - 1} replica(s) counted")
    elif d > kv:
        notes.append(f"{kv} KV heads < decode_tp={d}: each head replicated {d // kv}×, the replicas' bytes counted")
    return Plan(spec.name, spec.attention, spec.heads, spec.kv_heads, p, d, src_global[0][1] - src_global[0][0],
                dst_global[0][1] - dst_global[0][0], src_global, dst_global, tuple(pieces), tuple(replica),
                tuple(skipped), tuple(notes), spec)


# ---------------------------------------------------------------------------------------------------
# bytes and pieces


@dataclass(frozen=True)
class Accounting:
    """What each decode rank receives of one `tokens`-long sequence (tuples: one entry per decode rank).

    bytes_per_decode_rank: KV bytes of its heads (calculator.kv_cache_bytes per head: sliding windows capped,
        replicas included) — equal to calculator.tp_shard_bytes(model, tokens, D).bytes_per_gpu.
    block_bytes_per_decode_rank: what a paged move carries: whole blocks (the last one partly filled), all layers.
    replica_bytes: the part of bytes_per_decode_rank another (earlier) decode rank also receives.
    pieces_per_decode_rank: separate copies / sends / descriptors its data arrives in, for `method`.
    """

    model: str
    prefill_tp: int
    decode_tp: int
    method: str
    tokens: int
    kv_dtype: str
    block_size: int
    src_layout: str
    dst_layout: str
    bytes_per_decode_rank: tuple
    block_bytes_per_decode_rank: tuple
    replica_bytes: tuple
    pieces_per_decode_rank: tuple
    sources_per_decode_rank: tuple
    skipped_per_decode_rank: tuple
    notes: tuple

    def as_dict(self) -> dict:
        """JSON-ready (lists for tuples): the keys kvlab disagg's summary.json takes."""
        return {k: (list(map(list, v)) if k in ("sources_per_decode_rank", "skipped_per_decode_rank")
                    else list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items()}


def contiguous(pl: Plan, pc: Piece, layout: str) -> bool:
    """Is one block's head slice one contiguous run on both sides? (hnd: always; nhd: only the whole block)"""
    return layout == "hnd" or pc.heads == pl.src_heads == pl.dst_heads


def _pieces(pl: Plan, r: int, method: str, blocks: int, block_size: int, layout: str) -> int:
    layers, sides = pl.spec.layers, 1 if pl.attention == "mla" else 2
    if method in ("torch-index", "fused", "nixl-staging-bulk"):
        return len(pl.pieces[r])
    if method in ("staging", "nixl-staging"):
        return len(pl.pieces[r]) * layers * sides
    if method == "same-tp":
        return 1
    return sum(layers * sides * blocks * (1 if contiguous(pl, pc, layout) else block_size) for pc in pl.pieces[r])


def account(pl: Plan, tokens: int, kv_dtype="bf16", method: str = "fused", block_size: int = 16,
            src_layout: str = "hnd", dst_layout: str | None = None) -> Accounting:
    """Bytes and pieces per decode rank for moving one sequence by `method` (METHODS, or "same-tp": one
    whole-row copy per rank, the homogeneous yardstick). dst_layout None: the source's. Refused: an unknown
    method or layout, block-slices between different layouts (it moves bytes as they are)."""
    dst_layout = src_layout if dst_layout is None else dst_layout
    if method not in METHODS + ("same-tp",):
        raise ValueError(f"method {method!r} is not valid; use one of {list(METHODS)} or 'same-tp'")
    for name, lay in (("src_layout", src_layout), ("dst_layout", dst_layout)):
        if lay not in LAYOUTS:
            raise ValueError(f"{name}={lay!r} is not valid; use one of {list(LAYOUTS)}")
    if method in AS_IS + ("same-tp",) and src_layout != dst_layout:
        raise ValueError(f"method {method!r} moves blocks as they are and cannot convert {src_layout} to "
                         f"{dst_layout}; use fused, staging or torch-index")
    if method == "same-tp" and pl.prefill_tp != pl.decode_tp:
        raise ValueError(f"'same-tp' is the homogeneous yardstick: it needs prefill_tp == decode_tp, got "
                         f"{pl.prefill_tp} → {pl.decode_tp}")
    block_size = positive_int("block_size", block_size)
    spec, kvb = pl.spec, calculator.dtype_bytes(kv_dtype)
    per_head = calculator.kv_cache_bytes(spec, tokens, kv_dtype) // (1 if pl.attention == "mla" else spec.kv_heads)
    blocks = -(-tokens // block_size)
    width = spec.kv_elements_per_token_layer // (1 if pl.attention == "mla" else spec.kv_heads)
    per_head_blocks = spec.layers * blocks * block_size * width * kvb
    heads = [sum(pc.heads for pc in pcs) for pcs in pl.pieces]
    bts = tuple(h * per_head for h in heads)
    return Accounting(pl.model, pl.prefill_tp, pl.decode_tp, method, tokens, str(kv_dtype), block_size, src_layout,
                      dst_layout, bts, tuple(h * per_head_blocks for h in heads),
                      tuple(b if rep else 0 for b, rep in zip(bts, pl.replica)),
                      tuple(_pieces(pl, r, method, blocks, block_size, src_layout) for r in range(pl.decode_tp)),
                      tuple(tuple(pc.src_rank for pc in pcs) for pcs in pl.pieces), pl.skipped, pl.notes)


# extra passes over the bytes and launches per piece a method makes on its own device
_LOCAL = {"torch-index": (1, 1), "staging": (2, 2), "nixl-staging": (2, 2), "nixl-staging-bulk": (2, 2)}


def _cost(path: str, ceilings):
    """ms(nbytes, copies) for `path`, and a sentence saying which model it is."""
    if ceilings is not None:
        pc = ceilings[path]  # kvlab.ceilings_fit.Ceilings: refuses a path it did not measure
        return (lambda b, n: ceilings.predict_ms(path, b, n),
                f"ceilings fit of {path!r}: {pc.fixed_us:.2f} µs per piece + bytes / {pc.bandwidth_gbps:.0f} GB/s")
    lk = calculator.link(path)
    return (lambda b, n: calculator.transfer_time_s(b, lk, n) * 1e3,
            f"calculator link {lk.name!r}: {lk.fixed_us:g} µs per piece + bytes / "
            f"{lk.effective_bytes_per_s / 1e9:g} GB/s")


def predict(model, context: int, prefill_tp: int, decode_tp: int, method: str = "fused", path: str = "d2d_same", *,
            src_layout: str = "hnd", dst_layout: str | None = None, kv_dtype="bf16", block_size: int = 16,
            ceilings=None, local_path: str | None = None, shared: bool = True) -> dict:
    """The calculator's prediction for moving one `context`-token sequence P → D by `method` over `path`, beside
    the same-TP yardstick (P → P, one whole-row copy per rank, same path, source layout).

    Per decode rank: pieces · t0 + block bytes / B over `path`, plus the passes a method makes on its own device
    (torch-index gathers into a temporary: one pass, one launch per piece; staging gathers and scatters: two, two)
    at `local_path`'s t0 and B (default: d2d_same if the ceilings hold it, else `path`). t0 and B: kvlab.ceilings_fit's
    fit (time = t0 + bytes / B per copy, fitted to the link-ceilings sweep) when `ceilings` (a Ceilings) is given and
    `path` names one of its paths (d2d_same: one GPU); else calculator.link(path)'s fixed_us and bandwidth.
    shared=True: every rank's move shares one device or link (times add: all pools on one GPU); False: each decode
    rank has its own (the slowest counts). Returns a flat dict (lists per decode rank; ms; pct_of_same_tp = same-TP
    time / re-shard time × 100; model / local_model: the cost models used, in words).
    """
    pl = plan(model, prefill_tp, decode_tp)
    acc = account(pl, context, kv_dtype, method, block_size, src_layout, dst_layout)
    same = account(plan(model, prefill_tp, prefill_tp), context, kv_dtype, "same-tp", block_size, src_layout)
    if local_path is None:
        local_path = "d2d_same" if ceilings is not None and "d2d_same" in ceilings else path
    (link, used), (local, used_local) = _cost(path, ceilings), _cost(local_path, ceilings)
    passes, launches = _LOCAL.get(method, (0, 0))

    def rank_ms(b: int, n: int, srcs: int) -> float:
        return link(b, n) + (local(b * passes, launches * srcs) if passes else 0.0)

    ms = [rank_ms(b, n, len(s)) for b, n, s in zip(acc.block_bytes_per_decode_rank, acc.pieces_per_decode_rank,
                                                   acc.sources_per_decode_rank)]
    same_ms = [link(b, 1) for b in same.block_bytes_per_decode_rank]
    total, yard = (sum(ms), sum(same_ms)) if shared else (max(ms), max(same_ms))
    lay = acc.src_layout if acc.src_layout == acc.dst_layout else f"{acc.src_layout}->{acc.dst_layout}"
    return {"prefill_tp": pl.prefill_tp, "decode_tp": pl.decode_tp, "pool_layout": lay, "method": method,
            "path": path, "context": context, "bytes_per_decode_rank": list(acc.block_bytes_per_decode_rank),
            "pieces_per_decode_rank": list(acc.pieces_per_decode_rank), "replica_bytes": list(acc.replica_bytes),
            "predicted_ms": total, "same_tp_ms": yard, "same_tp_bytes": sum(same.block_bytes_per_decode_rank),
            "pct_of_same_tp": 100.0 * yard / total, "shared": shared, "model": used, "local_model": used_local}


# ---------------------------------------------------------------------------------------------------
# pools for each side


def shard_pools(buffer: KVBuffer, pl: Plan, block_size: int = 16, layout: str = "nhd", seed: int = 0,
                order: str = "random", device=None) -> list[tuple[BlockPool, BlockTable]]:
    """The P prefill ranks' pools from one prefill's contiguous cache ([layers, 2, 1, kv_heads, tokens, head_dim]):
    rank p's pool holds its KV heads (pl.src_global[p]) in blocks drawn by its own BlockAllocator(seed + p)."""
    _no_mla(pl)
    lay = buffer.layout
    if lay.kv_heads != pl.kv_heads or lay.layers != pl.spec.layers or lay.head_dim != pl.spec.head_dim:
        raise ValueError(f"the buffer holds {lay.layers} layers × {lay.kv_heads} KV heads × {lay.head_dim}; the "
                         f"plan's model {pl.model} has {pl.spec.layers} × {pl.kv_heads} × {pl.spec.head_dim}")
    out = []
    for p, (lo, hi) in enumerate(pl.src_global):
        sub = KVBuffer(KVLayout(lay.layers, 1, hi - lo, lay.tokens, lay.head_dim, lay.dtype),
                       data=buffer.data[:, :, :, lo:hi].contiguous())
        out.append(BlockPool.from_kv_buffer(sub, block_size, layout=layout, seed=seed + p, order=order,
                                            device=device))
    return out


def make_pools(pl: Plan, side: str, tokens: int, block_size: int = 16, layout: str = "nhd", dtype="bf16",
               device="cpu", seed: int = 0, fill: str = "poison", num_blocks: int | None = None,
               order: str = "random") -> list[tuple[BlockPool, BlockTable]]:
    """One (pool, table) per rank of `side` ("prefill": P pools of pl.src_heads heads, "decode": D of pl.dst_heads),
    each twice the blocks the sequence needs unless num_blocks is given, its table from BlockAllocator(seed + rank
    (+ 1000 on the decode side)), filled with NaN poison ("poison") or seeded normal values ("random")."""
    if side not in ("prefill", "decode") or fill not in ("poison", "random"):
        raise ValueError(f"side={side!r}, fill={fill!r}: use side 'prefill' | 'decode', fill 'poison' | 'random'")
    _no_mla(pl)
    n, heads = (pl.prefill_tp, pl.src_heads) if side == "prefill" else (pl.decode_tp, pl.dst_heads)
    spec = PoolSpec(pl.spec.layers, block_size, heads, pl.spec.head_dim, as_dtype(dtype), layout)
    blocks = num_blocks or 2 * spec.blocks_for(tokens)
    out = []
    for r in range(n):
        s = seed + r + (1000 if side == "decode" else 0)
        pool = BlockPool(spec, blocks, device=device)
        pool.poison() if fill == "poison" else pool.fill_random(s)
        out.append((pool, BlockAllocator(blocks, block_size, seed=s, order=order).allocate(tokens)))
    return out


# ---------------------------------------------------------------------------------------------------
# checks shared by every mover


def _no_mla(pl: Plan) -> None:
    if pl.attention == "mla":
        raise ValueError(f"{pl.model} is MLA: kvlab's pools hold K and V per head, an MLA latent pool is not modelled; "
                         "MLA plans are accounted (account, predict) but not moved")


def dst_map(pl: Plan, dst) -> dict:
    d = dict(dst) if isinstance(dst, Mapping) else dict(enumerate(dst))
    bad = [k for k in d if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 <= k < pl.decode_tp]
    if not d or bad:
        raise ValueError(f"destinations must be decode ranks 0 … {pl.decode_tp - 1} (a list of D pairs or a dict "
                         f"rank → (pool, table)); got keys {sorted(map(str, d))}")
    return {int(k): v for k, v in d.items()}


def check_pools(pl: Plan, src, dst: dict, method: str) -> None:
    _no_mla(pl)
    if len(src) != pl.prefill_tp:
        raise ValueError(f"{len(src)} source pools for prefill_tp={pl.prefill_tp}: one (pool, table) per prefill rank")
    spec = pl.spec
    ref = None
    for role, pairs, heads in (("prefill", dict(enumerate(src)), pl.src_heads), ("decode", dst, pl.dst_heads)):
        for r, pair in pairs.items():
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and isinstance(pair[0], BlockPool)):
                raise ValueError(f"{role} rank {r}: expected a (BlockPool, BlockTable) pair, got {type(pair).__name__}")
            pool, table = pair
            s = pool.spec
            if (s.layers, s.kv_heads, s.head_dim) != (spec.layers, heads, spec.head_dim):
                raise ValueError(f"{role} rank {r}'s pool is {s.layers} layers × {s.kv_heads} KV heads × "
                                 f"{s.head_dim}; the plan needs {spec.layers} × {heads} × {spec.head_dim}")
            pool.check_table(table, f"{role} rank {r}'s table")
            ref = ref or (s, table.tokens)
            if s.block_size != ref[0].block_size:
                raise ValueError(f"{role} rank {r}: block_size {s.block_size} vs {ref[0].block_size}; no method "
                                 "re-blocks a cache, so every pool must use one block size")
            if s.dtype != ref[0].dtype:
                raise ValueError(f"{role} rank {r}: dtype {s.dtype} vs {ref[0].dtype}; no method converts dtypes")
            if table.tokens != ref[1]:
                raise ValueError(f"{role} rank {r}'s table is for {table.tokens} tokens, the others' for {ref[1]}")
            if method in AS_IS and s.layout != ref[0].layout:
                raise ValueError(f"{method} moves blocks as they are and cannot convert {ref[0].layout} to "
                                 f"{s.layout}; use fused, staging or torch-index")
    srcs = {id(pool.data) for pool, _ in src}
    if any(id(pool.data) in srcs for pool, _ in dst.values()):
        raise ValueError("a destination pool is also a source pool: the move would overwrite what it reads")
    for r, (pool, _) in dst.items():
        for a, b, q in ((src[pc.src_rank][0].device, pool.device, pc.src_rank) for pc in pl.pieces[r]):
            if method == "fused" and a != b and not (a.type == b.type == "cuda"):
                raise ValueError(f"fused needs the source and destination on one device (or GPUs); prefill rank "
                                 f"{q} is on {a}, decode rank {r} on {b}: use staging or torch-index")


def table_rows(pool: BlockPool, table: BlockTable, device=None) -> torch.Tensor:
    """Rows of `pool.rows` holding `table`'s blocks, every (layer, side), layer-major: int64 [layers·2·blocks]."""
    ls = np.arange(pool.spec.layers * 2, dtype=np.int64)[:, None] * pool.num_blocks
    return torch.from_numpy((ls + table.ids[None, :]).reshape(-1)).to(pool.device if device is None else device)


def heads_first(data: torch.Tensor, layout: str) -> torch.Tensor:
    """Pool data [layers, 2, blocks, *block_shape] as a heads-first view [layers, 2, blocks, heads, bs, head_dim]."""
    return data.transpose(3, 4) if layout == "nhd" else data


# ---------------------------------------------------------------------------------------------------
# verification


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def verify(pl: Plan, src: Sequence, dst) -> dict:
    """Every destination shard against the source's head slice, bit for bit, from the global head ranges alone
    (not from the plan's pieces): decode rank d's local head j must equal global head dst_global[d][0] + j as the
    first prefill rank holding it stores it. Also: NaN poison left inside the table's blocks, and blocks outside the
    table that are no longer all NaN (written where nothing should be). Returns {ok, ranks: {d: {...}}}."""
    dst = dst_map(pl, dst)
    check_pools(pl, list(src), dst, "torch-index")
    out = {}
    for r, (dp, dt) in dst.items():
        dev = dp.device
        got = heads_first(dp.data.index_select(2, dt.tensor(dev)), dp.spec.layout)
        want = torch.empty_like(got)
        for j in range(pl.dst_heads):
            g = pl.dst_global[r][0] + j
            q = next(q for q, (lo, hi) in enumerate(pl.src_global) if lo <= g < hi)
            sp, st = src[q]
            x = heads_first(sp.data.index_select(2, st.tensor(sp.device)), sp.spec.layout)[:, :, :, g - pl.src_global[q][0]]
            want[:, :, :, j] = x.to(dev)
        outside = torch.ones(dp.num_blocks, dtype=torch.bool)
        outside[torch.from_numpy(dt.ids.copy())] = False
        rest = dp.data[:, :, outside.to(dev)]
        rec = {"mismatched_elements": int((_bits(got) != _bits(want)).sum()),
               "poison_left": int(torch.isnan(got).sum()), "written_outside": int((~torch.isnan(rest)).sum()),
               "elements": got.numel()}
        rec["ok"] = rec["mismatched_elements"] == rec["poison_left"] == rec["written_outside"] == 0
        out[r] = rec
    return {"ok": all(v["ok"] for v in out.values()), "ranks": out}
