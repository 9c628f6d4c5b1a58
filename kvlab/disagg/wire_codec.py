"""FP8 on the wire between the two processes (`kvlab disagg --wire-dtype fp8 --wire-scales MODE`).

The prefill process sends its bf16 cache as e4m3 bytes with their scales; the decode process dequantizes them on
arrival into its bf16 cache. The format and the rounding are kvlab.paged.wire's (its module doc): a layer of the
contiguous cache [2, 1, kv_heads, tokens, head_dim] is taken as [2, tokens, kv_heads, head_dim] (side, token,
head, element), and a unit of n consecutive layers (one layer of a layer-wise send, every layer of a bulk one)
travels as one uint8 tensor (`unit_bytes` long):

    payload  uint8  [n, 2, tokens, kv_heads, head_dim]   e4m3fn bits
    scales   float32, per-token-head [n, 2, tokens, kv_heads] | per-head [n, 2, kv_heads] | per-tensor [n, 2]

payload first, then the scales' bytes. A unit's bytes are as many as its layers' (`layer_bytes` each), so where
a unit lands in the decode side's staging tensor (every layer's bytes, in layer order) depends only on its layers.
Where Triton runs (a GPU), kvlab.paged.wire_kernels' kernels encode and decode a unit in one launch each (the
unit's layers are the one block of an hnd pool of block size T); elsewhere the torch reference does, a layer at a
time, with the same bits. Per-token-head scales are dynamic (amax over head_dim). Per-head and per-tensor scales
are static within a request: computed by the same rule from the request's own layer (amax over its tokens; and
heads, for per-tensor) when the layer is sent, so a layer-wise send needs nothing from later layers — the
calibration set is the request itself, where an engine would calibrate once on other text.

What "identical" means with a lossy wire: the decode side's reference is its colocated cache passed through
`roundtrip` (encode then decode, the same code and bits), so bytes, tokens and logits must equal that reference
exactly and a transfer fault is still caught; agreement with the bf16 colocated decode is measured, not required.
"""

from __future__ import annotations

import torch

from ..paged.wire import SCALE_MODES, check_mode, dequantize_layer, dynamic_scale, quantize_layer
from ..paged.wire_kernels import dequantize_contiguous, quantize_contiguous, wire_backend

__all__ = ["WIRE_DTYPES", "WireCodec", "check_wire", "wire_codec"]

WIRE_DTYPES = ("bf16", "fp8")


def check_wire(wire_dtype: str, scales: str) -> None:
    """ValueError (one line) unless `wire_dtype` is one of WIRE_DTYPES and `scales` one of SCALE_MODES."""
    if wire_dtype not in WIRE_DTYPES:
        raise ValueError(f"--wire-dtype {wire_dtype!r} is not valid; valid: {', '.join(WIRE_DTYPES)}")
    if scales not in SCALE_MODES:
        raise ValueError(f"--wire-scales {scales!r} is not valid; valid: {', '.join(SCALE_MODES)}")


def _run(layers) -> tuple[int, int]:
    """(first, end) of a unit, which must be a run of consecutive layers."""
    layers = list(layers)
    if not layers or layers != list(range(layers[0], layers[0] + len(layers))):
        raise ValueError(f"a unit is a run of consecutive layers, got {layers}")
    return layers[0], layers[-1] + 1


class WireCodec:
    """Encode a unit (a run of layers) of a contiguous bf16 cache into its wire bytes, and decode them back (module
    doc).

    backend: "auto" (kvlab.paged.wire_kernels' Triton kernels, one launch a unit each way, wherever
    wire_kernels.wire_backend says they run — a GPU, or a CPU under TRITON_INTERPRET=1 — else the torch
    reference), "torch" or "triton". Both give the same bits (tests)."""

    def __init__(self, scales: str, backend: str = "auto"):
        self.scales = check_mode(scales)
        if backend not in ("auto", "torch", "triton"):
            raise ValueError(f"backend {backend!r} is not valid; use 'auto', 'torch' or 'triton'")
        self.backend = backend
        self._which: dict = {}  # device → "triton" | "torch"

    def _kernels(self, t: torch.Tensor) -> bool:
        """Do the Triton kernels encode and decode tensors on t's device?"""
        key = str(t.device)
        if key not in self._which:
            self._which[key] = wire_backend(t.device, self.backend)[0]
        return self._which[key] == "triton"

    @staticmethod
    def _check(data: torch.Tensor) -> None:
        if data.dim() != 6 or data.shape[1] != 2 or data.shape[2] != 1:
            raise ValueError(f"a batch-1 contiguous cache [L, 2, 1, H, T, D] is expected, got {tuple(data.shape)}")

    def _scale_shape(self, n: int, tokens: int, heads: int) -> tuple[int, ...]:
        """The scales of n layers."""
        return {"per-token-head": (n, 2, tokens, heads), "per-head": (n, 2, heads), "per-tensor": (n, 2)}[self.scales]

    def scale_count(self, x: torch.Tensor) -> int:
        """Scales of one layer x [2, 1, H, T, D]."""
        _, _, h, t, _ = x.shape
        return {"per-token-head": 2 * t * h, "per-head": 2 * h, "per-tensor": 2}[self.scales]

    def layer_bytes(self, x: torch.Tensor) -> int:
        """Wire bytes of the layer `x` ([2, 1, H, T, D]): one byte an element, four a scale. The scales are read as
        float32 from the bytes after the payload, so the payload must be a multiple of four bytes (2·H·T·D is for
        any even head_dim)."""
        if x.numel() % 4:
            raise ValueError(f"an FP8 wire's scales follow the payload as float32: a layer of {x.numel()} elements "
                             "(not a multiple of 4) would misalign them; kvlab's models have even head dims")
        return x.numel() + 4 * self.scale_count(x)

    def unit_bytes(self, data: torch.Tensor, layers) -> int:
        """Wire bytes of a unit of `data` [L, 2, 1, H, T, D]: its layers' bytes."""
        lo, hi = _run(layers)
        return (hi - lo) * self.layer_bytes(data[lo])

    def offsets(self, data: torch.Tensor) -> list[int]:
        """Where each layer's wire bytes begin in a whole cache's wire bytes (every layer in order), and where they
        end: L + 1 numbers for data [L, 2, 1, H, T, D]."""
        out = [0]
        for i in range(data.shape[0]):
            out.append(out[-1] + self.layer_bytes(data[i]))
        return out

    def _static(self, x: torch.Tensor) -> torch.Tensor:
        """Per-head [n, 2, H] or per-tensor [n, 2] float32 scales of layers x [n, 2, 1, H, T, D] by the module's
        rule, from each layer's own amax (exact in bf16; one pass over contiguous rows, nothing waits for the
        device)."""
        n, _, _, h, t, d = x.shape
        rows = x.reshape(n * 2 * h, t * d) if self.scales == "per-head" else x.reshape(n * 2, h * t * d)
        lo, hi = torch.aminmax(rows, dim=1)
        amax = torch.maximum(hi, -lo).float()
        shape = (n, 2, h) if self.scales == "per-head" else (n, 2)
        return dynamic_scale(amax.unsqueeze(-1)).reshape(shape).contiguous()

    # the torch reference, a layer at a time
    @staticmethod
    def _canonical(x: torch.Tensor) -> torch.Tensor:
        """[2, 1, H, T, D] → [2, T, H, D] (a view, not a copy)."""
        return x[:, 0].permute(0, 2, 1, 3)

    def _layer_scale(self, c: torch.Tensor) -> torch.Tensor:
        """The scales of a canonical layer c [2, T, H, D], float32, shaped to broadcast against [2, T, H]."""
        f = c.float()
        if self.scales == "per-token-head":
            return dynamic_scale(f)                                            # [2, T, H]
        two, t, h, d = f.shape
        if self.scales == "per-head":
            return dynamic_scale(f.permute(0, 2, 1, 3).reshape(two, h, t * d)).reshape(two, 1, h)
        return dynamic_scale(f.reshape(two, t * h * d)).reshape(two, 1, 1)

    def _encode_torch(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(payload, scales) of one layer, flat."""
        c = self._canonical(x)
        scale = self._layer_scale(c)
        q = quantize_layer(c, scale)                                           # [2, T, H, D] uint8
        s = scale.expand(2, c.shape[1], c.shape[2]) if self.scales == "per-token-head" else scale
        return q.reshape(-1), s.contiguous().reshape(-1)

    def encode_layers(self, data: torch.Tensor, layers) -> torch.Tensor:
        """The wire bytes of a unit (`layers`, consecutive) of a cache's data [L, 2, 1, H, T, D]: a new uint8 tensor."""
        self._check(data)
        out = torch.empty(self.unit_bytes(data, layers), dtype=torch.uint8, device=data.device)
        self.encode_layers_into(data, layers, out)
        return out

    def encode_layers_into(self, data: torch.Tensor, layers, out: torch.Tensor) -> None:
        """encode_layers(data, layers) written into `out` (uint8, unit_bytes long, on data's device: a view into a
        larger buffer, such as the decode side's staging tensor); with the kernels, one quantize launch writing
        straight into `out` (per-head and per-tensor scales: an aminmax pass and a few small launches first)."""
        self._check(data)
        if data.dtype != torch.bfloat16:
            raise ValueError(f"an FP8 wire quantizes a bf16 cache; this one is {data.dtype}")
        lo, hi = _run(layers)
        want = self.unit_bytes(data, layers)
        if out.dtype != torch.uint8 or out.numel() != want or out.device != data.device:
            raise ValueError(f"layers {lo} … {hi - 1} have {want:,} wire bytes on {data.device}; got {out.dtype} of "
                             f"{out.numel():,} on {out.device}")
        x = data[lo:hi]
        n = x.numel()
        if self._kernels(x):
            static = None if self.scales == "per-token-head" else self._static(x)
            quantize_contiguous(x, self.scales, out[:n], out[n:].view(torch.float32), static)
            return
        per = n // (hi - lo)
        scales = out[n:].view(torch.float32)
        k = scales.numel() // (hi - lo)
        for j in range(hi - lo):
            q, s = self._encode_torch(x[j])
            out[j * per:(j + 1) * per].copy_(q)
            scales[j * k:(j + 1) * k].copy_(s)

    def decode_layers(self, wire: torch.Tensor, data: torch.Tensor, layers) -> None:
        """Dequantize a unit's wire bytes (as encode_layers wrote them) into `data`'s layers, in place."""
        self._check(data)
        lo, hi = _run(layers)
        want = self.unit_bytes(data, layers)
        if wire.dtype != torch.uint8 or wire.numel() != want:
            raise ValueError(f"layers {lo} … {hi - 1} have {want:,} wire bytes; got {wire.dtype} of {wire.numel():,}")
        x = data[lo:hi]
        n = x.numel()
        if self._kernels(x) and wire.device == x.device:
            dequantize_contiguous(wire[:n], wire[n:].view(torch.float32), self.scales, x)
            return
        _, _, _, h, t, d = x.shape
        scales = wire[n:].contiguous().view(torch.float32).view(self._scale_shape(hi - lo, t, h))
        q = wire[:n].view(hi - lo, 2, t, h, d)
        for j in range(hi - lo):
            s = scales[j] if self.scales == "per-token-head" else scales[j].view(2, 1, -1)
            self._canonical(x[j]).copy_(dequantize_layer(q[j].to(x.device), s.to(x.device)))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """The wire bytes of one bf16 layer `x` [2, 1, H, T, D]: a new uint8 tensor of layer_bytes(x)."""
        if x.dim() != 5 or x.shape[0] != 2 or x.shape[1] != 1:
            raise ValueError(f"a layer of a batch-1 contiguous cache [2, 1, H, T, D] is expected, got {tuple(x.shape)}")
        return self.encode_layers(x.unsqueeze(0), (0,))

    def decode(self, wire: torch.Tensor, out: torch.Tensor) -> None:
        """Dequantize one layer's wire bytes into `out` [2, 1, H, T, D] (bf16), in place."""
        self.decode_layers(wire, out.unsqueeze(0), (0,))

    def roundtrip(self, data: torch.Tensor) -> None:
        """Every layer of `data` [L, 2, 1, H, T, D] replaced by what crossing the wire makes of it (the reference)."""
        every = tuple(range(data.shape[0]))
        self.decode_layers(self.encode_layers(data, every), data, every)


def wire_codec(cfg) -> WireCodec | None:
    """The codec a run's cache crosses with (a DisaggConfig's wire_dtype and wire_scales), or None for bf16."""
    return WireCodec(cfg.wire_scales) if cfg.wire_dtype == "fp8" else None
