"""FP8 on the wire: the format of a quantized paged KV transfer, its exact byte count, torch references of the
quantize-gather and the dequantize-scatter, scale calibration, error metrics and the break-even link bandwidth.

The Triton kernels that do the same in one pass each, and their benchmark, are in kvlab.paged.wire_kernels.

Wire format of one request
--------------------------
A request carries the blocks of one sequence's block table (kvlab.paged.BlockTable), for all layers (or a
range `layers=(first, end)`), K and V. It carries whole blocks, as a paged transfer does: S = n_blocks ·
block_size token slots per layer side (slots past `tokens` in the last block are sent too). Two tensors:

    payload  uint8 [layers, 2, S, kv_heads, head_dim]   e4m3fn bit patterns (torch.float8_e4m3fn, max 448)
    scales   float32, one of                             (SCALE_MODES)
             "per-token-head" [layers, 2, S, kv_heads]   dynamic: one per token slot and KV head
             "per-head"       [layers, 2, kv_heads]      static: calibrated, one per layer side and head
             "per-tensor"     [layers, 2]                static: calibrated, one per layer side

both C-ordered: layer, side (0 = K, 1 = V), token slot (block-table order, then slot within the block), KV
head, element. The order is the same whatever the pool layout (nhd or hnd) of either side, so a request from
an hnd pool lands in an nhd pool and back (conversion is supported, not refused). Layer i of a layer-wise send
is payload[i] (2·S·H·D bytes) and scales[i]. Static scales travel with every request (8·H or 8 bytes a layer),
so a receiver needs no state: bytes = L·2·S·H·D + 4·L·2·(S·H | H | 1), `wire_bytes`.

Quantization (identical bits in the torch reference and the Triton kernels; fl32 = IEEE float32 rounding)
    x      the bf16 element as float32 (exact)
    scale  per-token-head: fl32(amax / 448), amax = max over head_dim of |x| (exact); 1 where amax = 0 (a zero
           token-head: every element is 0 and nothing divides 0 by 0). Static modes: given (calibrate_scales
           applies the same rule to the amax over a calibration cache's tokens, and heads for per-tensor).
    inv    fl32(1 / scale): one division per scale, not per element
    y      fl32(x · inv), clamped to [-448, 448] (a static scale saturates values past its calibration)
    q      e4m3fn(y), round to nearest, ties to even; a NaN y is sent as 0x7F
Dequantization: x̂ = bf16(fl32(e4m3 value of q · scale)), round to nearest even; NaN as 0x7FC0.
Inputs are expected finite. A NaN in a token-head makes its per-token-head scale NaN (sent as 0x7FC00000) and
the whole token-head NaN after the round trip (a poisoned block stays poisoned); an infinity makes its scale
inf and the token-head NaN after the round trip (inf · 0); a static scale maps ±inf to ±448 · scale and NaN to
NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..kvcache import KVBuffer
from .pools import BlockPool, BlockTable, PoolSpec, positive_int

__all__ = ["E4M3_MAX", "SCALE_MODES", "E4M3_NAN", "BF16_NAN", "check_mode", "check_modes", "wire_bytes", "raw_bytes",
           "scale_shape", "WirePacket", "empty_packet", "check_static_scales", "calibrate_scales", "layer_range", "dynamic_scale",
           "quantize_layer", "dequantize_layer",
           "quantize_gather_reference", "dequantize_scatter_reference", "kv_rel_err", "causal_attention", "attn_out_rel_err",
           "breakeven_gbps"]

E4M3_MAX = 448.0
SCALE_MODES = ("per-token-head", "per-head", "per-tensor")
STATIC_MODES = ("per-head", "per-tensor")
E4M3_NAN = 0x7F     # the canonical e4m3fn NaN on the wire
BF16_NAN = 0x7FC0   # the canonical bf16 NaN a dequantize writes


def check_modes(value, name: str = "scales") -> None:
    """ValueError (one line, naming `name`) unless `value` is distinct scale modes of SCALE_MODES, comma-separated."""
    got = [v.strip() for v in str(value).split(",") if v.strip()]
    bad = [v for v in got if v not in SCALE_MODES]
    if not got or bad or len(set(got)) != len(got):
        raise ValueError(f"{name} = {value!r}: give distinct scale modes of {', '.join(SCALE_MODES)}, comma-separated")


def check_mode(mode) -> str:
    if mode not in SCALE_MODES:
        raise ValueError(f"wire scales {mode!r} are not valid; use one of {list(SCALE_MODES)}")
    return mode


# ---------------------------------------------------------------------------------------------------
# bytes


def _shape_of(spec_or_shape) -> tuple[int, int, int, int | None]:
    """(layers, kv_heads, head_dim, block_size or None) of a PoolSpec, a (layers, kv_heads, head_dim) tuple or
    anything with those attributes (kvlab.models.ModelSpec)."""
    if isinstance(spec_or_shape, PoolSpec):
        s = spec_or_shape
        return s.layers, s.kv_heads, s.head_dim, s.block_size
    if isinstance(spec_or_shape, (tuple, list)) and len(spec_or_shape) == 3:
        vals = spec_or_shape
    elif all(hasattr(spec_or_shape, a) for a in ("layers", "kv_heads", "head_dim")):
        vals = (spec_or_shape.layers, spec_or_shape.kv_heads, spec_or_shape.head_dim)
    else:
        raise ValueError(f"spec_or_shape {spec_or_shape!r} is not valid; give a PoolSpec, a (layers, kv_heads, "
                         "head_dim) tuple or a model spec with those attributes")
    layers, heads, dim = (positive_int(n, v) for n, v in zip(("layers", "kv_heads", "head_dim"), vals))
    return layers, heads, dim, None


def _layer_count(layers, total: int) -> int:
    if layers is None:
        return total
    if isinstance(layers, (tuple, list)):
        lo, hi = layer_range(layers, total)
        return hi - lo
    n = positive_int("layers", layers)
    if n > total:
        raise ValueError(f"layers={n} is more than the {total} layers of the shape")
    return n


def _slots(block_size, tokens) -> int:
    tokens = positive_int("tokens", tokens)
    return tokens if block_size is None else -(-tokens // block_size) * block_size


def scale_shape(mode: str, layers: int, slots: int, kv_heads: int) -> tuple[int, ...]:
    """The shape of a request's scales (module doc)."""
    check_mode(mode)
    if mode == "per-token-head":
        return (layers, 2, slots, kv_heads)
    return (layers, 2, kv_heads) if mode == "per-head" else (layers, 2)


def wire_bytes(spec_or_shape, tokens: int, scales: str, layers=None) -> int:
    """Bytes of one FP8 request, payload + float32 scales, exactly (module doc).

    spec_or_shape: a PoolSpec (whole blocks are sent: S = ceil(tokens / block_size) · block_size slots), or a
    (layers, kv_heads, head_dim) tuple / model spec (S = tokens). layers: None (all), a count, or a (first, end)
    range (a layer-wise send's share). Example: Qwen2.5-7B (28, 4, 128) sends 28,672 B of payload and 896 B of
    per-token-head scales a token, 0.5156× its 57,344 B of bf16; kvlab-tiny (2, 2, 16) 0.625× (4 B of scale per
    16 B of payload).
    """
    check_mode(scales)
    total, heads, dim, block = _shape_of(spec_or_shape)
    n = _layer_count(layers, total)
    slots = _slots(block, tokens)
    return n * 2 * slots * heads * dim + 4 * math.prod(scale_shape(scales, n, slots, heads))


def raw_bytes(spec_or_shape, tokens: int, element_bytes: int = 2, layers=None) -> int:
    """Bytes of the same request sent unquantized (element_bytes 2: bf16), counted like `wire_bytes`."""
    total, heads, dim, block = _shape_of(spec_or_shape)
    return _layer_count(layers, total) * 2 * _slots(block, tokens) * heads * dim * positive_int("element_bytes",
                                                                                            element_bytes)


# ---------------------------------------------------------------------------------------------------
# the packet


@dataclass
class WirePacket:
    """One request on the wire (module doc): payload uint8 [layers, 2, S, kv_heads, head_dim] of e4m3fn bits,
    scales float32 of `scale_shape(mode, ...)`, for layers first … first + layers - 1 of a sequence of `tokens`
    tokens in blocks of `block_size`. Both tensors may live on a GPU or in (pinned) host memory."""

    payload: torch.Tensor
    scales: torch.Tensor
    mode: str
    tokens: int
    block_size: int
    first_layer: int = 0

    def __post_init__(self):
        check_mode(self.mode)
        p, s = self.payload, self.scales
        if p.dtype != torch.uint8 or p.dim() != 5 or p.shape[1] != 2 or not p.is_contiguous():
            raise ValueError("packet payload must be a contiguous uint8 [layers, 2, slots, kv_heads, head_dim] "
                             f"tensor, got {p.dtype} {tuple(p.shape)}")
        if p.shape[2] % positive_int("block_size", self.block_size) or \
                not 0 < positive_int("tokens", self.tokens) <= p.shape[2] < self.tokens + self.block_size:
            raise ValueError(f"packet of {p.shape[2]} slots does not hold {self.tokens} tokens in whole blocks of "
                             f"{self.block_size}")
        want = scale_shape(self.mode, p.shape[0], p.shape[2], p.shape[3])
        if s.dtype != torch.float32 or tuple(s.shape) != want or not s.is_contiguous():
            raise ValueError(f"{self.mode} scales must be a contiguous float32 tensor of shape {want}, got {s.dtype} "
                             f"{tuple(s.shape)}")

    @property
    def layers(self) -> int:
        return int(self.payload.shape[0])

    @property
    def slots(self) -> int:
        return int(self.payload.shape[2])

    @property
    def n_blocks(self) -> int:
        return self.slots // self.block_size

    @property
    def kv_heads(self) -> int:
        return int(self.payload.shape[3])

    @property
    def head_dim(self) -> int:
        return int(self.payload.shape[4])

    @property
    def nbytes(self) -> int:
        """Payload + scales: what crosses the wire."""
        return self.payload.numel() + 4 * self.scales.numel()

    @property
    def e4m3(self) -> torch.Tensor:
        """The payload as torch.float8_e4m3fn (a view of the same bytes)."""
        return self.payload.view(torch.float8_e4m3fn)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(payload, scales) of packet layer i (views): one message of a layer-wise send."""
        if not 0 <= i < self.layers:
            raise ValueError(f"packet layer {i} is out of range (valid 0 … {self.layers - 1})")
        return self.payload[i], self.scales[i]


def layer_range(layers, total: int) -> tuple[int, int]:
    """(first, end) of a `layers` argument: None = all `total` layers, or a (first, end) pair with
    0 ≤ first < end ≤ total."""
    if layers is None:
        return 0, total
    if not isinstance(layers, (tuple, list)) or len(layers) != 2 or \
            not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in layers):
        raise ValueError(f"layers={layers!r} is not valid; give None or a (first, end) pair of ints")
    lo, hi = int(layers[0]), int(layers[1])
    if not 0 <= lo < hi <= total:
        raise ValueError(f"layers=({lo}, {hi}) is not a range of the {total} layers "
                         f"(need 0 ≤ first < end ≤ {total})")
    return lo, hi


def empty_packet(spec: PoolSpec, table: BlockTable, mode: str, device: torch.device | str = "cpu",
                 pin_memory: bool = False, layers=None) -> WirePacket:
    """An uninitialised packet for `table`'s blocks (a kernel's destination); pin_memory: page-locked host
    memory, which a GPU kernel writes through UVA (needs CUDA)."""
    check_mode(mode)
    lo, hi = layer_range(layers, spec.layers)
    slots = table.num_blocks * spec.block_size
    device = torch.device(device)
    if pin_memory and (device.type != "cpu" or not torch.cuda.is_available()):
        raise ValueError(f"pin_memory=True needs a host packet and CUDA, got device {device} "
                         f"(CUDA available: {torch.cuda.is_available()})")
    kw = dict(device=device, pin_memory=pin_memory)
    payload = torch.empty((hi - lo, 2, slots, spec.kv_heads, spec.head_dim), dtype=torch.uint8, **kw)
    scales = torch.empty(scale_shape(mode, hi - lo, slots, spec.kv_heads), dtype=torch.float32, **kw)
    return WirePacket(payload, scales, mode, table.tokens, spec.block_size, lo)


# ---------------------------------------------------------------------------------------------------
# scales


def check_static_scales(static_scales, mode: str, spec: PoolSpec) -> torch.Tensor | None:
    """None for per-token-head (its scales are computed per request; giving some is an error); else the
    static scales as a contiguous float32 tensor [layers, 2, kv_heads] (per-head) or [layers, 2] (per-tensor),
    every value finite and > 0."""
    check_mode(mode)
    if mode == "per-token-head":
        if static_scales is not None:
            raise ValueError("per-token-head scales are computed for each request; static_scales must be None")
        return None
    want = scale_shape(mode, spec.layers, 1, spec.kv_heads)
    if static_scales is None:
        raise ValueError(f"{mode} scales are static: pass static_scales of shape {want} (calibrate_scales gives them)")
    if not isinstance(static_scales, torch.Tensor) or tuple(static_scales.shape) != want or \
            not static_scales.dtype.is_floating_point:
        raise ValueError(f"static_scales for {mode} must be a float tensor of shape {want}, got "
                         f"{getattr(static_scales, 'dtype', type(static_scales).__name__)} "
                         f"{tuple(getattr(static_scales, 'shape', ()))}")
    s = static_scales.detach().to(torch.float32).contiguous()
    if not bool(torch.isfinite(s).all()) or not bool((s > 0).all()):
        raise ValueError(f"static_scales for {mode} must all be finite and > 0 (min {float(s.min())}, "
                         f"max {float(s.max())})")
    return s


def _per_layer_wire(pool: BlockPool, ids: torch.Tensor, layer: int) -> torch.Tensor:
    """One layer's blocks of `ids` in wire order: [2, S, kv_heads, head_dim] (the pool's dtype)."""
    blocks = pool.data[layer].index_select(1, ids)          # [2, n, *block_shape]
    if pool.spec.layout == "hnd":
        blocks = blocks.transpose(2, 3)                    # [2, n, H, bs, D] → [2, n, bs, H, D]
    return blocks.reshape(2, -1, pool.spec.kv_heads, pool.spec.head_dim)


def dynamic_scale(xf: torch.Tensor) -> torch.Tensor:
    """fl32(amax / 448) over the last dim, 1 where amax = 0, NaN as 0x7FC00000 (module doc); tensor / tensor,
    elementwise IEEE."""
    amax = xf.abs().amax(-1)
    scale = amax / torch.full_like(amax, E4M3_MAX)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return torch.where(torch.isnan(scale), torch.full_like(scale, float("nan")), scale)


def calibrate_scales(cache, mode: str, table: BlockTable | None = None) -> torch.Tensor:
    """Static scales from a calibration cache: per-head [layers, 2, kv_heads] = fl32(amax / 448) with amax over
    the cache's tokens and head_dim; per-tensor [layers, 2] with amax over tokens, heads and head_dim (1 where
    amax = 0). cache: a BlockPool with the `table` of the calibration sequence (its tokens only, not the last
    block's unused slots), or a KVBuffer of batch 1. Float32, on the cache's device."""
    if check_mode(mode) not in STATIC_MODES:
        raise ValueError(f"{mode} scales are computed per request, not calibrated; calibrate per-head or per-tensor")
    if isinstance(cache, BlockPool):
        if table is None:
            raise ValueError("calibrating from a BlockPool needs the calibration sequence's block table")
        cache.check_table(table, "calibration table")
        ids = table.tensor(cache.device)
        x = torch.stack([_per_layer_wire(cache, ids, i)[:, :table.tokens] for i in range(cache.spec.layers)])
    elif isinstance(cache, KVBuffer):
        if cache.layout.batch != 1:
            raise ValueError(f"calibrate from one sequence: the KV buffer has batch={cache.layout.batch}")
        x = cache.data[:, :, 0].transpose(2, 3)            # [L, 2, H, T, D] → [L, 2, T, H, D]
    else:
        raise ValueError(f"cache must be a BlockPool (with its table) or a KVBuffer, got {type(cache).__name__}")
    amax = x.float().abs().amax(dim=(2, 4))                # [L, 2, H]
    if mode == "per-tensor":
        amax = amax.amax(-1)
    scale = amax / torch.full_like(amax, E4M3_MAX)
    return torch.where(scale == 0, torch.ones_like(scale), scale).contiguous()


# ---------------------------------------------------------------------------------------------------
# torch references


def _check_bf16_pool(pool, role: str) -> None:
    if not isinstance(pool, BlockPool):
        raise ValueError(f"{role} must be a BlockPool, got {type(pool).__name__}")
    if pool.spec.dtype != torch.bfloat16:
        raise ValueError(f"{role} is {pool.spec.dtype}; the FP8 wire quantizes from and dequantizes into "
                         "bfloat16 pools")


def _as_table(table, block_size: int) -> BlockTable:
    if isinstance(table, BlockTable):
        return table
    ids = np.asarray(table.detach().cpu() if isinstance(table, torch.Tensor) else table)
    if ids.ndim != 1 or ids.size == 0:
        raise ValueError(f"block ids must be a non-empty 1-D sequence or a BlockTable, got shape {ids.shape}")
    return BlockTable(ids, ids.size * block_size, block_size)   # bare ids: every slot of every block is a token


def quantize_layer(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3fn bits (uint8) of x [..., H, D] (bf16) with scales broadcastable to [..., H] (module doc's rule)."""
    xf = x.float()
    inv = torch.ones_like(scale) / scale
    y = (xf * inv.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX)
    q = y.to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.where(torch.isnan(y), torch.full_like(q, E4M3_NAN), q)


def quantize_gather_reference(pool: BlockPool, table, scales_mode: str, static_scales=None,
                              layers=None) -> WirePacket:
    """The torch reference of the fused quantize-gather: `table`'s blocks (a BlockTable, or bare block ids = all
    slots are tokens) of a bf16 pool as a new WirePacket on the pool's device (module doc's format and rounding).
    static_scales: required for per-head / per-tensor ([layers, 2, kv_heads] / [layers, 2], finite, > 0), None for
    per-token-head. Works a layer at a time (float32 temporaries of one layer)."""
    _check_bf16_pool(pool, "source pool")
    table = _as_table(table, pool.spec.block_size)
    pool.check_table(table, "source table")
    static = check_static_scales(static_scales, scales_mode, pool.spec)
    lo, hi = layer_range(layers, pool.spec.layers)
    out = empty_packet(pool.spec, table, scales_mode, pool.device, layers=(lo, hi))
    ids = table.tensor(pool.device)
    if static is not None:
        static = static.to(pool.device)
        out.scales.copy_(static[lo:hi])
    for i, layer in enumerate(range(lo, hi)):
        x = _per_layer_wire(pool, ids, layer)               # [2, S, H, D]
        if static is None:
            scale = dynamic_scale(x.float())               # [2, S, H]
            out.scales[i].copy_(scale)
        else:
            scale = static[layer].reshape(2, 1, -1)         # [2, 1, H] or [2, 1, 1]
        out.payload[i].copy_(quantize_layer(x, scale))
    return out


def dequantize_layer(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """bf16 of e4m3fn bits q [..., H, D] (uint8) times scales broadcastable to [..., H]; NaN as BF16_NAN."""
    y = q.view(torch.float8_e4m3fn).float() * scale.unsqueeze(-1)
    bits = y.to(torch.bfloat16).view(torch.int16)
    return torch.where(torch.isnan(y), torch.full_like(bits, BF16_NAN), bits).view(torch.bfloat16)


def check_packet_for_pool(packet: WirePacket, dst_pool: BlockPool, dst_table: BlockTable) -> None:
    """ValueError unless `packet` can land in `dst_table`'s blocks of `dst_pool` (shapes, block size, layers)."""
    if not isinstance(packet, WirePacket):
        raise ValueError(f"packet must be a WirePacket, got {type(packet).__name__}")
    _check_bf16_pool(dst_pool, "destination pool")
    s = dst_pool.spec
    dst_pool.check_table(dst_table, "destination table")
    for name, mine, theirs in (("kv_heads", s.kv_heads, packet.kv_heads), ("head_dim", s.head_dim, packet.head_dim),
                               ("block_size", s.block_size, packet.block_size)):
        if mine != theirs:
            raise ValueError(f"packet {name}={theirs} does not match the destination pool's {name}={mine}")
    if packet.first_layer + packet.layers > s.layers:
        raise ValueError(f"packet layers {packet.first_layer} … {packet.first_layer + packet.layers - 1} are past "
                         f"the destination pool's {s.layers} layers")
    if dst_table.num_blocks != packet.n_blocks:
        raise ValueError(f"packet holds {packet.n_blocks} blocks, the destination table {dst_table.num_blocks}")


def dequantize_scatter_reference(packet: WirePacket, dst_pool: BlockPool, dst_table) -> None:
    """The torch reference of the dequantize-scatter: `packet` → bf16 into `dst_table`'s blocks (a BlockTable or
    bare block ids) of `dst_pool`, whole blocks, for the packet's layers; the pool's layout (nhd or hnd) may differ
    from the sender's. Ownership and landing records are the caller's (a transport's)."""
    _check_bf16_pool(dst_pool, "destination pool")
    dst_table = _as_table(dst_table, dst_pool.spec.block_size)
    check_packet_for_pool(packet, dst_pool, dst_table)
    s = dst_pool.spec
    ids = dst_table.tensor(dst_pool.device)
    for i in range(packet.layers):
        q, sc = packet.layer(i)
        scale = sc if packet.mode == "per-token-head" else sc.reshape(2, 1, -1)
        y = dequantize_layer(q, scale).to(dst_pool.device)  # [2, S, H, D]
        pages = y.reshape(2, packet.n_blocks, s.block_size, s.kv_heads, s.head_dim)
        if s.layout == "hnd":
            pages = pages.transpose(2, 3)
        dst_pool.data[packet.first_layer + i].index_copy_(1, ids, pages.contiguous())


# ---------------------------------------------------------------------------------------------------
# error metrics


def _kv_tensor(x, role: str) -> torch.Tensor:
    if isinstance(x, KVBuffer):
        x = x.data
    if not isinstance(x, torch.Tensor) or x.dim() < 3 or x.shape[1] != 2:
        raise ValueError(f"{role} must be a KVBuffer or a tensor [layers, 2, ...], got "
                         f"{tuple(getattr(x, 'shape', ())) or type(x).__name__}")
    return x


def kv_rel_err(ref, deq, eps: float = 1e-3) -> list[dict]:
    """Relative error of a dequantized cache, per layer side.

    ref, deq: KVBuffers or tensors [layers, 2, ...] of one shape (any dtype; compared in float32). Elementwise
    e = |deq - ref| / max(|ref|, eps), eps = 1e-3 by default (an absolute floor: elements below it are judged
    by their absolute error over eps, so values that e4m3 sends as subnormals or zero do not blow the ratio up).
    Rows {layer, side ("K" | "V"), max_rel_err = max e, mean_rel_err = mean e, norm_rel_err = ‖deq - ref‖₂ /
    ‖ref‖₂ (0 when both are zero)}. NaN anywhere gives NaN.
    """
    ref, deq = _kv_tensor(ref, "ref"), _kv_tensor(deq, "deq")
    if ref.shape != deq.shape:
        raise ValueError(f"ref {tuple(ref.shape)} and deq {tuple(deq.shape)} must have the same shape")
    if not (isinstance(eps, (int, float)) and eps > 0):
        raise ValueError(f"eps={eps!r} must be a number > 0")
    rows = []
    for layer in range(ref.shape[0]):
        for side in range(2):
            r = ref[layer, side].float()
            d = deq[layer, side].to(r.device).float()
            diff = (d - r).abs()
            e = diff / r.abs().clamp_min(eps)
            num, den = float(diff.double().norm()), float(r.double().norm())
            norm = 0.0 if num == 0 else (num / den if den else math.inf)
            rows.append({"layer": layer, "side": "KV"[side], "max_rel_err": float(e.max()),
                         "mean_rel_err": float(e.mean(dtype=torch.float64)), "norm_rel_err": norm})
    return rows


def _heads_first(t: torch.Tensor, role: str) -> torch.Tensor:
    if isinstance(t, torch.Tensor) and t.dim() == 4 and t.shape[0] == 1:
        t = t[0]
    if not isinstance(t, torch.Tensor) or t.dim() != 3:
        raise ValueError(f"{role} must be [heads, tokens, head_dim] (or [1, heads, tokens, head_dim]), got "
                         f"{tuple(getattr(t, 'shape', ())) or type(t).__name__}")
    return t.float()


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal scaled-dot-product attention of q [Hq, Tq, D] at the last Tq of the keys k, v [Hkv, Tk, D] (GQA: query
    head h reads KV head h // (Hq / Hkv)), softmax scale 1/√D: [Hq, Tq, D] in q's dtype."""
    hq, tq, _ = q.shape
    hkv, tk, _ = k.shape
    rep = hq // hkv
    k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)   # query head h reads KV head h // rep
    pos = torch.arange(tk - tq, tk, device=q.device)
    mask = torch.arange(tk, device=q.device)[None, :] <= pos[:, None]  # [Tq, Tk]: query i sits at tk - tq + i
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def attn_out_rel_err(q, k_ref, v_ref, k_deq, v_deq, eps: float = 1e-6) -> dict:
    """Relative error of one layer's causal scaled-dot-product attention output with dequantized K and V.

    q: [Hq, Tq, D] (or [1, Hq, Tq, D]) queries at the last Tq positions of the Tk keys; k_*, v_*: [Hkv, Tk, D]
    (or [1, ...]), Hq a multiple of Hkv (GQA: query head h uses KV head h // (Hq / Hkv)), Tq ≤ Tk. Softmax scale
    1/√D; computed in float32. With o = attention(q, k_ref, v_ref), ô = attention(q, k_deq, v_deq) per query head
    and position: e = ‖ô - o‖₂ / max(‖o‖₂, eps). Returns {max_rel_err: max e, mean_rel_err: mean e,
    norm_rel_err: ‖ô - o‖_F / ‖o‖_F (0 when both are zero)}.
    """
    q = _heads_first(q, "q")
    kr, vr, kd, vd = (_heads_first(t, n) for t, n in ((k_ref, "k_ref"), (v_ref, "v_ref"), (k_deq, "k_deq"),
                                                        (v_deq, "v_deq")))
    if not (kr.shape == vr.shape == kd.shape == vd.shape):
        shapes = [tuple(t.shape) for t in (kr, vr, kd, vd)]
        raise ValueError(f"k_ref, v_ref, k_deq, v_deq must share one shape, got {shapes}")
    if q.shape[2] != kr.shape[2] or q.shape[0] % kr.shape[0] or q.shape[1] > kr.shape[1]:
        raise ValueError(f"q {tuple(q.shape)} does not fit keys {tuple(kr.shape)}: need the same head_dim, query "
                         "heads a multiple of KV heads, and no more queries than keys")
    dev = q.device
    o = causal_attention(q, kr.to(dev), vr.to(dev))
    od = causal_attention(q, kd.to(dev), vd.to(dev))
    diff = (od - o).norm(dim=-1)
    e = diff / o.norm(dim=-1).clamp_min(eps)
    num, den = float((od - o).double().norm()), float(o.double().norm())
    return {"max_rel_err": float(e.max()), "mean_rel_err": float(e.mean(dtype=torch.float64)),
            "norm_rel_err": 0.0 if num == 0 else (num / den if den else math.inf)}


# ---------------------------------------------------------------------------------------------------
# break-even


def breakeven_gbps(quant_gbps_input, dequant_gbps_input, ratio, overlap: bool = False):
    """The link bandwidth below which sending `ratio`× fewer bytes, with a quantize and a dequantize pass, beats
    sending bf16.

    B bf16 bytes cross a link of W; the quantize runs at Q and the dequantize at R, both in bytes of bf16 input
    per second (kvlab.paged.wire_kernels.bench_wire's input_gbps), and B / ratio bytes cross the wire.
    Serial (quantize, then send, then dequantize): FP8 wins iff B/Q + B/(ratio·W) + B/R < B/W, i.e.
        W < W* = (1 - 1/ratio) / (1/Q + 1/R).
    Overlapped (the passes pipelined with the copy in fine chunks, or fused into it: each resource busy at once,
    the slowest sets the time, pipeline fill and drain neglected): FP8 wins iff max(B/Q, B/(ratio·W), B/R) < B/W,
    i.e. (for ratio > 1) W < W* = min(Q, R).
    ratio ≤ 1 never wins: W* = 0. Units pass through (GB/s in, GB/s out); the rates may be math.inf (free
    passes). W* grows with Q and R, so the interval of W* is W* at the intervals' ends. Scalars give a float,
    arrays broadcast (numpy).
    """
    q, r, k = (np.asarray(v, dtype=np.float64) for v in (quant_gbps_input, dequant_gbps_input, ratio))
    for name, v in (("quant_gbps_input", q), ("dequant_gbps_input", r), ("ratio", k)):
        if np.isnan(v).any() or (v <= 0).any() or (name == "ratio" and np.isinf(v).any()):
            raise ValueError(f"{name}={v.tolist()!r} must be > 0{' and finite' if name == 'ratio' else ''}")
    if overlap:
        w = np.minimum(q, r)
    else:
        with np.errstate(divide="ignore"):
            w = (1 - 1 / k) / (1 / q + 1 / r)
    w = np.where(k > 1, w, 0.0)
    return float(w) if w.ndim == 0 else w
