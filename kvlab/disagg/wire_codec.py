"""FP8 on the wire between the two processes (`kvlab disagg --wire-dtype fp8 --wire-scales MODE`).

The prefill process sends each layer of its bf16 cache as e4m3 bytes with their scales; the decode process
dequantizes them on arrival into its bf16 cache. The format and the rounding are kvlab.paged.wire's (its module
doc), a layer at a time: a contiguous layer [2, 1, kv_heads, tokens, head_dim] is taken as [2, tokens, kv_heads,
head_dim] (side, token, head, element) and travels as

    payload  uint8  [2, tokens, kv_heads, head_dim]   e4m3fn bits
    scales   float32, per-token-head [2, tokens, kv_heads] | per-head [2, kv_heads] | per-tensor [2]

payload first, then the scales' bytes, in one uint8 tensor (`layer_bytes` long); a bulk send is every layer's in
layer order. Where Triton runs (a GPU), kvlab.paged.wire_kernels' kernels encode and decode a layer in one pass
each (a contiguous layer is the one block of an hnd pool of block size T); elsewhere the torch reference does, with
the same bits. Per-token-head scales are dynamic (amax over head_dim). Per-head and per-tensor scales are static
within a request: computed by the same rule from the request's own layer (amax over its tokens; and heads, for
per-tensor) when the layer is sent, so a layer-wise send needs nothing from later layers — the calibration set is
the request itself, where an engine would calibrate once on other text.

What "identical" means with a lossy wire: the decode side's reference is its colocated cache passed through
`roundtrip` (encode then decode, the same code and bits), so bytes, tokens and logits must equal that reference
exactly and a transfer fault is still caught; agreement with the bf16 colocated decode is measured, not required.
"""

from __future__ import annotations

import torch

from ..paged.wire import SCALE_MODES, check_mode, dequantize_layer, dynamic_scale, quantize_layer
from ..paged.wire_kernels import dequantize_contiguous_layer, quantize_contiguous_layer, wire_backend

__all__ = ["WIRE_DTYPES", "WireCodec", "check_wire", "wire_codec"]

WIRE_DTYPES = ("bf16", "fp8")


def check_wire(wire_dtype: str, scales: str) -> None:
    """ValueError (one line) unless `wire_dtype` is one of WIRE_DTYPES and `scales` one of SCALE_MODES."""
    if wire_dtype not in WIRE_DTYPES:
        raise ValueError(f"--wire-dtype {wire_dtype!r} is not valid; valid: {', '.join(WIRE_DTYPES)}")
    if scales not in SCALE_MODES:
        raise ValueError(f"--wire-scales {scales!r} is not valid; valid: {', '.join(SCALE_MODES)}")


class WireCodec:
    """Encode a bf16 layer of a contiguous cache into its wire bytes, and decode them back (module doc).

    backend: "auto" (kvlab.paged.wire_kernels' Triton kernels, one pass each way, wherever
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

    def _static(self, x: torch.Tensor) -> torch.Tensor:
        """Per-head [2, H] or per-tensor [2] float32 scales of layer x [2, 1, H, T, D] by the module's rule, from the
        layer's own amax (exact in bf16; two reductions, nothing waits for the device)."""
        dims = (1, 3, 4) if self.scales == "per-head" else (1, 2, 3, 4)
        amax = torch.maximum(x.amax(dim=dims), -x.amin(dim=dims)).float()
        return dynamic_scale(amax.unsqueeze(-1)).contiguous()

    @staticmethod
    def _canonical(x: torch.Tensor) -> torch.Tensor:
        """[2, 1, H, T, D] → [2, T, H, D] (a view, not a copy)."""
        if x.dim() != 5 or x.shape[0] != 2 or x.shape[1] != 1:
            raise ValueError(f"a layer of a batch-1 contiguous cache [2, 1, H, T, D] is expected, got {tuple(x.shape)}")
        return x[:, 0].permute(0, 2, 1, 3)

    def _scale_shape(self, tokens: int, heads: int) -> tuple[int, int, int]:
        """The scales of a layer, shaped to broadcast against its canonical [2, T, H]."""
        return {"per-token-head": (2, tokens, heads), "per-head": (2, 1, heads), "per-tensor": (2, 1, 1)}[self.scales]

    def scale_count(self, x: torch.Tensor) -> int:
        _, _, h, t, _ = x.shape
        a, b, c = self._scale_shape(t, h)
        return a * b * c

    def layer_bytes(self, x: torch.Tensor) -> int:
        """Wire bytes of the layer `x` ([2, 1, H, T, D]): one byte an element, four a scale."""
        return x.numel() + 4 * self.scale_count(x)

    def _scale(self, c: torch.Tensor) -> torch.Tensor:
        """The scales of a canonical layer c [2, T, H, D], float32, shaped to broadcast against [2, T, H]."""
        f = c.float()
        if self.scales == "per-token-head":
            return dynamic_scale(f)                                            # [2, T, H]
        two, t, h, d = f.shape
        if self.scales == "per-head":
            return dynamic_scale(f.permute(0, 2, 1, 3).reshape(two, h, t * d)).reshape(two, 1, h)
        return dynamic_scale(f.reshape(two, t * h * d)).reshape(two, 1, 1)

    def offsets(self, data: torch.Tensor) -> list[int]:
        """Where each layer's wire bytes begin in a whole cache's wire bytes (every layer in order, as a bulk send
        lays them out), and where they end: L + 1 numbers for data [L, 2, 1, H, T, D]."""
        out = [0]
        for i in range(data.shape[0]):
            out.append(out[-1] + self.layer_bytes(data[i]))
        return out

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """The wire bytes of one bf16 layer `x` [2, 1, H, T, D]: a new uint8 tensor of layer_bytes(x)."""
        if x.dtype != torch.bfloat16:
            raise ValueError(f"an FP8 wire quantizes a bf16 cache; this one is {x.dtype}")
        if self._kernels(x):
            out = torch.empty(self.layer_bytes(x), dtype=torch.uint8, device=x.device)
            self.encode_into(x, out)
            return out
        c = self._canonical(x)
        scale = self._scale(c)
        q = quantize_layer(c, scale)                                           # [2, T, H, D] uint8
        s = scale.expand(2, c.shape[1], c.shape[2]) if self.scales == "per-token-head" else scale
        return torch.cat([q.reshape(-1), s.contiguous().reshape(-1).view(torch.uint8)])

    def encode_into(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """encode(x) written into `out` (uint8, layer_bytes(x) long, on x's device: a view into a larger buffer,
        such as the decode side's staging tensor); with the kernels, in one pass and no temporary."""
        n = x.numel()
        if out.dtype != torch.uint8 or out.numel() != self.layer_bytes(x) or out.device != x.device:
            raise ValueError(f"an FP8 layer's wire bytes need a uint8 tensor of {self.layer_bytes(x):,} bytes on "
                             f"{x.device}, got {out.dtype} of {out.numel():,} on {out.device}")
        if not self._kernels(x):
            out.copy_(self.encode(x))
            return
        if x.dtype != torch.bfloat16:
            raise ValueError(f"an FP8 wire quantizes a bf16 cache; this one is {x.dtype}")
        static = None if self.scales == "per-token-head" else self._static(x)
        quantize_contiguous_layer(x, self.scales, out[:n], out[n:].view(torch.float32), static)

    def decode(self, wire: torch.Tensor, out: torch.Tensor) -> None:
        """Dequantize one layer's wire bytes into `out` [2, 1, H, T, D] (bf16), in place."""
        c = self._canonical(out)
        n = c.numel()
        if self._kernels(out) and wire.device == out.device:
            dequantize_contiguous_layer(wire[:n], wire[n:].view(torch.float32), self.scales, out)
            return
        q = wire[:n].view(c.shape)
        scale = wire[n:].contiguous().view(torch.float32).view(self._scale_shape(c.shape[1], c.shape[2]))
        c.copy_(dequantize_layer(q, scale))

    def encode_layers(self, data: torch.Tensor, layers) -> torch.Tensor:
        """The wire bytes of `layers` of a cache's data [L, 2, 1, H, T, D], in order, one uint8 tensor."""
        parts = [self.encode(data[i]) for i in layers]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def encode_layers_into(self, data: torch.Tensor, layers, out: torch.Tensor) -> None:
        """encode_layers(data, layers) written into `out` (uint8, on data's device)."""
        at = 0
        for i in layers:
            n = self.layer_bytes(data[i])
            self.encode_into(data[i], out[at:at + n])
            at += n
        if at != out.numel():
            raise ValueError(f"layers {list(layers)} have {at:,} wire bytes; out holds {out.numel():,}")

    def decode_layers(self, wire: torch.Tensor, data: torch.Tensor, layers) -> None:
        """Dequantize the wire bytes of `layers` (as encode_layers wrote them) into `data`'s layers, in place."""
        at = 0
        for i in layers:
            n = self.layer_bytes(data[i])
            self.decode(wire[at:at + n], data[i])
            at += n

    def roundtrip(self, data: torch.Tensor) -> None:
        """Every layer of `data` [L, 2, 1, H, T, D] replaced by what crossing the wire makes of it (the reference)."""
        for i in range(data.shape[0]):
            self.decode(self.encode(data[i]), data[i])


def wire_codec(cfg) -> WireCodec | None:
    """The codec a run's cache crosses with (a DisaggConfig's wire_dtype and wire_scales), or None for bf16."""
    return WireCodec(cfg.wire_scales) if cfg.wire_dtype == "fp8" else None
