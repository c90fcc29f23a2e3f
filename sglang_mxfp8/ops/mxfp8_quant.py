"""Float weights (BF16, FP16, FP32) quantized to MXFP8 on the GPU in one Triton pass: each program reads 64 blocks of
32 elements, writes their e4m3 bytes and UE8M0 scale bytes, byte for byte what ``format.numerics.quantize_mxfp8``
gives (a trainer's BF16 tensor sent for an MXFP8 layer is served as ``convert`` would have written it).

Everything after the load is integer arithmetic on the float32 bits: the block maximum of the magnitudes' bits (NaN
and Inf are the largest), its exponent (fp32 subnormals normalised through an exact int-to-float conversion), and
each element's e4m3 byte rounded to nearest even from its own significand, clamped to 448 where the spec's "floor"
rounding lets a block exceed it. No float multiply: no flush-to-zero, and Triton's interpreter on a CPU runs the same
bits as the GPU (tests/test_triton_cpu.py checks every BF16 value and both roundings)."""

from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl

from ..format.checkpoint import E8M0_NAN, MX_BLOCK
from ..format.numerics import E8M0_BIAS, ScaleRounding, check_k

BLOCKS_PER_PROGRAM = 64


@triton.jit
def _normalized(mag):
    """float32 magnitude bits (finite, > 0) -> (unbiased exponent, 23 mantissa bits) of the value as 1.m * 2**u."""
    biased = mag >> 23
    man = mag & 0x7FFFFF
    as_float = man.to(tl.float32).to(tl.int32, bitcast=True)  # a subnormal's mantissa, exactly, as a normal float
    u = tl.where(biased > 0, biased - 127, (as_float >> 23) - 127 - 149)
    m = tl.where(biased > 0, man, as_float & 0x7FFFFF)
    return u, m


@triton.jit
def _to_e4m3(bits, e):
    """float32 bits times 2**-e, as e4m3 bytes (int32): round to nearest even, 448 where it is above."""
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    u, m = _normalized(tl.maximum(mag, 1))
    uv = u - e
    # normal e4m3 (uv >= -6): 3 mantissa bits kept, 20 dropped
    q = ((uv + 7) << 3) | (m >> 20)
    rem = m & 0xFFFFF
    q += ((rem > 0x80000) | ((rem == 0x80000) & ((q & 1) == 1))).to(tl.int32)
    q = tl.where((uv > 8) | ((uv == 8) & (m > 0x600000)), 0x7E, q)
    # subnormal e4m3 (uv < -6): the 24-bit significand in units of 2**-9
    sig = m | 0x800000
    shift = tl.minimum(tl.maximum(14 - uv, 1), 30)  # 21 or more where used; 30 and above all round to 0
    qs = sig >> shift
    rs = sig & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    qs += ((rs > half) | ((rs == half) & ((qs & 1) == 1))).to(tl.int32)
    q = tl.where(uv >= -6, q, qs)
    return sign | tl.where(mag == 0, 0, q)


@triton.jit
def _f16_to_f32_bits(h):
    """IEEE half bits (int32, 16 significant) -> float32 bits of the same value (subnormals included)."""
    e5 = (h >> 10) & 0x1F
    m = h & 0x3FF
    sub = m.to(tl.float32).to(tl.int32, bitcast=True)  # m * 2**-24: m as a float, 24 binary places lower
    mag = tl.where(e5 == 31, 0x7F800000 | (m << 13), ((e5 + 112) << 23) | (m << 13))
    mag = tl.where(e5 == 0, tl.where(m == 0, 0, sub - (24 << 23)), mag)
    return ((h & 0x8000) << 16) | mag


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, s_ptr, NB, SRC: tl.constexpr, CEIL: tl.constexpr, TB: tl.constexpr,
                     BLOCK: tl.constexpr, BIAS: tl.constexpr, NAN_BYTE: tl.constexpr):
    """``x_ptr``: the input's bits (int32 for FP32; int16 for BF16, SRC 1, and FP16, SRC 2), widened here without a
    float conversion, which keeps subnormals on every backend."""
    blocks = tl.program_id(0).to(tl.int64) * TB + tl.arange(0, TB)
    ok = blocks < NB
    at = blocks[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    raw = tl.load(x_ptr + at, mask=ok[:, None], other=0).to(tl.int32)
    if SRC == 1:
        bits = (raw & 0xFFFF) << 16
    elif SRC == 2:
        bits = _f16_to_f32_bits(raw & 0xFFFF)
    else:
        bits = raw
    amax = tl.max(bits & 0x7FFFFFFF, axis=1)  # magnitude bits order as the magnitudes; NaN and Inf above all
    finite = amax < 0x7F800000
    u, m = _normalized(tl.maximum(tl.where(finite, amax, 0x3F800000), 1))
    e = u - 8  # the spec's floor(log2(amax)) - 8; "ceil": up one where amax / 2**e exceeds 448 (1.75 * 2**8)
    if CEIL:
        e += (m > 0x600000).to(tl.int32)
    e = tl.minimum(tl.maximum(e, -BIAS), BIAS)
    e = tl.where(amax > 0, e, 0)  # a block of zeros: scale byte 127
    q = _to_e4m3(bits, e[:, None])
    q = tl.where(finite[:, None], q, 0x7F)  # a block holding NaN or Inf: NaN elements, NaN scale
    tl.store(q_ptr + at, q.to(tl.uint8), mask=ok[:, None])
    tl.store(s_ptr + blocks, tl.where(finite, e + BIAS, NAN_BYTE).to(tl.uint8), mask=ok)


def quantize_mxfp8(x: torch.Tensor, rounding: ScaleRounding = "ceil") -> Tuple[torch.Tensor, torch.Tensor]:
    """``format.numerics.quantize_mxfp8`` of a BF16 / FP16 / FP32 tensor ``x [..., K]`` on its device, in one pass:
    (e4m3 ``[..., K]``, uint8 ``[..., K/32]``)."""
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"quantize_mxfp8: a BF16, FP16 or FP32 tensor, got {x.dtype}")
    check_k(x, "quantize_mxfp8")
    if rounding not in ("ceil", "floor"):
        raise ValueError(f"scale rounding must be 'ceil' or 'floor', got {rounding!r}")
    x = x.contiguous()
    q = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    scale = torch.empty((*x.shape[:-1], x.shape[-1] // MX_BLOCK), dtype=torch.uint8, device=x.device)
    blocks = x.numel() // MX_BLOCK
    if blocks:
        src = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}[x.dtype]
        _quantize_kernel[(triton.cdiv(blocks, BLOCKS_PER_PROGRAM),)](
            x.view(torch.int32 if src == 0 else torch.int16), q, scale, blocks, SRC=src, CEIL=rounding == "ceil",
            TB=BLOCKS_PER_PROGRAM, BLOCK=MX_BLOCK, BIAS=E8M0_BIAS, NAN_BYTE=E8M0_NAN)
    return q.view(torch.float8_e4m3fn), scale
