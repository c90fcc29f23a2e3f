"""``w8a16_gemm``: C = X @ (B * sb)^T with X in BF16 as given (weight-only FP8, for small M). The weight is
dequantized in registers: e4m3 times a power-of-two scale is exact in BF16, so one BF16 tensor-core dot accumulates in
float32 over all of K, with no activation quantization launch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .act_quant import GROUP_K
from .dense_w8a8 import k_block


@triton.jit
def _weight_only_dot(a_rows, mask_rows, b_rows, mask_n, s_rows, K, KB,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """float32 [BLOCK_M, BLOCK_N] = A[rows] @ (e4m3 W[cols] x its per-128-K power-of-two scale)^T over all
    of K. The weight is dequantized in A's dtype (exact in bf16) right before one tensor-core dot per tile."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, KB):
        a, b = k_block(a_rows, mask_rows, b_rows, mask_n, K, kb, BLOCK_K)
        sb = tl.load(s_rows + kb, mask=mask_n, other=0.0)
        acc = tl.dot(a, (b.to(tl.float32) * sb[None, :]).to(a.dtype), acc)
    return acc


@triton.jit
def _w8a16_gemm_kernel(
    x_ptr, b_ptr, c_ptr, sb_ptr, bias_ptr,
    M, N, K, KB,
    stride_xm, stride_bn, stride_cm,
    SCALE_ROWS: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    b_rows = b_ptr + offs_n[None, :] * stride_bn
    s_rows = sb_ptr + (offs_n // SCALE_ROWS) * KB
    acc = _weight_only_dot(x_rows, mask_m, b_rows, mask_n, s_rows, K, KB, BLOCK_M, BLOCK_N, BLOCK_K)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    c = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def w8a16_config(m: int) -> dict:
    """16x32 tiles, 4 warps, 5 stages: best of 16 configs at M = 1 and 16 on 2048->5120, 4096->2048 and
    14336->4096 on the H200 (a tile sweep); larger M, where the
    kernel is not dispatched, keeps M-sized tiles."""
    if m <= 16:
        return dict(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=5)
    return dict(BLOCK_M=min(64, triton.next_power_of_2(m)), BLOCK_N=32, num_warps=4, num_stages=4)


def w8a16_gemm(x, w, w_s, scale_rows: int = 1, bias=None, config: dict | None = None):
    """x [M, K] bf16, w [N, K] e4m3, w_s [ceil(N / scale_rows), KB] f32 powers of two -> [M, N] bf16."""
    if x.dtype != torch.bfloat16:
        raise TypeError(f"w8a16_gemm needs a bfloat16 activation (got {x.dtype}): e4m3 x 2^k is exact in bf16 only")
    return _w8a16(x, w, w_s, scale_rows, bias, config)


def _w8a16(x, w, w_s, scale_rows, bias, config):
    """The launch, for any float activation dtype (Triton's CPU interpreter runs no bf16 dot)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = w.shape[0]
    c = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return c
    cfg = config or w8a16_config(m)
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]))
    _w8a16_gemm_kernel[grid](
        x, w, c, w_s, bias if bias is not None else c,
        m, n, k, triton.cdiv(k, GROUP_K), x.stride(0), w.stride(0), c.stride(0),
        SCALE_ROWS=scale_rows, HAS_BIAS=bias is not None, BLOCK_K=GROUP_K, **cfg,
    )
    return c
