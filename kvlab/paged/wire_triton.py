"""The Triton source of kvlab.paged.wire_kernels' two kernels (see that module for what they do and why the rounding is
integer arithmetic). Not imported as a module: kvlab.paged.wire_kernels loads this file once per mode (Triton's
interpreter for CPU tensors, compiled for GPU tensors) under its own name with TRITON_INTERPRET pinned, because
Triton fixes a jit function's mode when it is decorated and a kernel finds the jit functions it calls (the amax
reduction's combine function) among its module's globals.
"""

import triton
import triton.language as tl


@triton.jit
def max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def quantize_gather_kernel(src_ptr, ids_ptr, pay_ptr, sc_out_ptr, sc_in_ptr, n_blocks, pool_blocks, rs0, n_chunks,
                           BS: tl.constexpr, H: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                           TP: tl.constexpr, HND: tl.constexpr, MODE: tl.constexpr,
                           HW: tl.constexpr):
    # program → (packet row side rs, table block j, chunk c of the block's BS·H pairs)
    pid = tl.program_id(0)
    c = pid % n_chunks
    rest = pid // n_chunks
    j = rest % n_blocks
    rs = (rest // n_blocks).to(tl.int64)
    blk = tl.load(ids_ptr + j).to(tl.int64)
    row = (rs0 + rs) * pool_blocks + blk
    p = c * TP + tl.arange(0, TP)
    pmask = p < BS * H
    d = tl.arange(0, D_PAD)
    mask = pmask[:, None] & (d < D)[None, :]
    raw = tl.load(src_ptr + row * (BS * H * D) + p[:, None] * D + d[None, :], mask=mask, other=0)
    bits = raw.to(tl.int32) & 0xFFFF
    x = (bits << 16).to(tl.float32, bitcast=True)
    if HND:
        h = p // BS
        t = p % BS
    else:
        t = p // H
        h = p % H
    pair = (rs * (n_blocks * BS) + j * BS + t) * H + h  # the pair's index in the packet's [layers, 2, S, H]
    if MODE == 0:
        # amax on the bits: for |x| (sign cleared) integer order is float order, NaN above inf, and exact.
        # tl.reduce with a combine function built here, not tl.max: tl.max is a jit function of Triton's own,
        # compiled or interpreted as TRITON_INTERPRET was when Triton was first imported
        amax = (tl.reduce(bits & 0x7FFF, 1, max_combine) << 16).to(tl.float32, bitcast=True)
        scale = tl.div_rn(amax, tl.full([TP], 448.0, tl.float32))
        scale = tl.where(scale == 0.0, 1.0, scale)
        scale = tl.where(scale != scale, tl.full([TP], 0x7FC00000, tl.int32).to(tl.float32, bitcast=True), scale)
        tl.store(sc_out_ptr + pair, scale, mask=pmask)
    elif MODE == 1:
        scale = tl.load(sc_in_ptr + (rs0 + rs) * H + h, mask=pmask, other=1.0)
        tl.store(sc_out_ptr + rs * H + h, scale, mask=pmask & (t + j == 0))
    else:
        scale = tl.load(sc_in_ptr + (rs0 + rs) + p * 0, mask=pmask, other=1.0)
        tl.store(sc_out_ptr + rs + p * 0, scale, mask=pmask & (p + j == 0))
    inv = tl.div_rn(tl.full([TP], 1.0, tl.float32), scale)
    y = x * inv[:, None]
    ynan = y != y
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    if HW:
        # the GPU's own conversion (cvt.rn.satfinite on Hopper): round to nearest even as well
        q = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
    else:
        # float32 → e4m3fn, round to nearest even, |y| ≤ 448. Normal (|y| ≥ 2^-6): round away 20 mantissa bits
        # (the carry may bump the exponent) and rebias 127 → 7 (120 << 3 = 960). Subnormal: m · 2^(e-150) · 2^9
        # rounded to an integer 0 … 8 (8 is the smallest normal's encoding).
        yi = y.to(tl.int32, bitcast=True)
        a = yi & 0x7FFFFFFF
        normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - 960
        e = a >> 23
        m = tl.where(e > 0, (a & 0x7FFFFF) | 0x800000, a)
        sh = tl.minimum(tl.maximum(141 - tl.maximum(e, 1), 1), 31)
        one = sh * 0 + 1
        qs = m >> sh
        rem = m & ((one << sh) - 1)
        half = one << (sh - 1)
        qs = qs + ((rem > half) | ((rem == half) & ((qs & 1) == 1))).to(tl.int32)
        q = tl.where(a >= 0x3C800000, normal, qs) | ((yi >> 24) & 0x80)
    q = tl.where(ynan, 0x7F, q)
    tl.store(pay_ptr + pair[:, None] * D + d[None, :], q.to(tl.uint8), mask=mask)


@triton.jit
def dequantize_scatter_kernel(pay_ptr, sc_ptr, dst_ptr, ids_ptr, n_blocks, pool_blocks, rs0, n_chunks,
                              BS: tl.constexpr, H: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                              TP: tl.constexpr, HND: tl.constexpr, MODE: tl.constexpr,
                              HW: tl.constexpr):
    pid = tl.program_id(0)
    c = pid % n_chunks
    rest = pid // n_chunks
    j = rest % n_blocks
    rs = (rest // n_blocks).to(tl.int64)
    blk = tl.load(ids_ptr + j).to(tl.int64)
    row = (rs0 + rs) * pool_blocks + blk
    p = c * TP + tl.arange(0, TP)
    pmask = p < BS * H
    d = tl.arange(0, D_PAD)
    mask = pmask[:, None] & (d < D)[None, :]
    if HND:
        h = p // BS
        t = p % BS
    else:
        t = p // H
        h = p % H
    pair = (rs * (n_blocks * BS) + j * BS + t) * H + h
    q = tl.load(pay_ptr + pair[:, None] * D + d[None, :], mask=mask, other=0).to(tl.int32) & 0xFF
    if MODE == 0:
        scale = tl.load(sc_ptr + pair, mask=pmask, other=1.0)
    elif MODE == 1:
        scale = tl.load(sc_ptr + rs * H + h, mask=pmask, other=1.0)
    else:
        scale = tl.load(sc_ptr + rs + p * 0, mask=pmask, other=1.0)
    if HW:
        val = q.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        # e4m3fn → float32 exactly: normals by their bits (rebias 7 → 127), subnormals as m · 2^-9; the sign goes
        # on the bits in both cases (negating the subnormal as a float made the kernel differ from torch at 32k
        # tokens on an H200 with Triton 3.6; -0.0 becoming +0.0 is the likely case)
        sign = (q & 0x80) << 24
        e = (q >> 3) & 0xF
        m = q & 7
        nb = sign | ((e + 120) << 23) | (m << 20)
        sub = (m.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True) | sign
        val = tl.where(e == 0, sub, nb).to(tl.float32, bitcast=True)
    out = val * scale[:, None]
    if HW:
        r = out.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    else:
        # float32 → bf16, round to nearest even on the bits (finite values; NaN is set below)
        oi = out.to(tl.int32, bitcast=True)
        r = ((oi + 0x7FFF + ((oi >> 16) & 1)) >> 16) & 0xFFFF
    r = tl.where(((q & 0x7F) == 0x7F) | (out != out), 0x7FC0, r)
    tl.store(dst_ptr + row * (BS * H * D) + p[:, None] * D + d[None, :], r.to(tl.int16), mask=mask)
