"""``w8a8_gemm``: C = (A * sa) @ (B * sb)^T on FP8 tensor cores, sa per (row, 128-K group), sb per (weight row,
128-K group) (MXFP8 weights converted losslessly to 1x128 power-of-two scales). K need only be a multiple of 32: the
last K tile is masked."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .act_quant import GROUP_K


@triton.jit
def k_block(a_rows, mask_rows, b_rows, mask_n, K, kb, BLOCK_K: tl.constexpr):
    """K block ``kb`` of A's rows [rows, BLOCK_K] and of the [N, K] weight's rows, transposed [BLOCK_K, cols]; rows
    outside the masks and the K tail load as zeros (MXFP8's K is a multiple of 32, not always of BLOCK_K)."""
    k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    mk = k < K
    a = tl.load(a_rows + k[None, :], mask=mask_rows[:, None] & mk[None, :], other=0.0)
    b = tl.load(b_rows + k[:, None], mask=mask_n[None, :] & mk[:, None], other=0.0)
    return a, b


@triton.jit
def w8a8_dot(a_rows, mask_rows, sa_ptr, sa_offs, b_rows, mask_n, sb_ptr, sb_offs, K, KB,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """float32 sum over K blocks of (A block @ B block^T) * sa * sb: A rows e4m3 with a float32 scale per (row,
    block), B rows ([N, K] weight) e4m3 with one per (row or row block, block). The dense GEMM and the sorted-token
    MoE differ only in where their rows and scales start."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, KB):
        a, b = k_block(a_rows, mask_rows, b_rows, mask_n, K, kb, BLOCK_K)
        sa = tl.load(sa_ptr + sa_offs + kb, mask=mask_rows, other=0.0)
        sb = tl.load(sb_ptr + sb_offs + kb, mask=mask_n, other=0.0)
        acc += tl.dot(a, b) * sa[:, None] * sb[None, :]
    return acc


@triton.jit
def _w8a8_gemm_kernel(
    a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr,
    M, N, K, KB,
    stride_am, stride_bn, stride_cm,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n
    group = pid // width
    first_m = group * GROUP_M
    gm = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % gm
    pid_n = (pid % width) // gm

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = w8a8_dot(a_ptr + offs_m[:, None] * stride_am, mask_m, sa_ptr, offs_m * KB,
                    b_ptr + offs_n[None, :] * stride_bn, mask_n, sb_ptr, offs_n * KB, K, KB, BLOCK_M, BLOCK_N, BLOCK_K)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    c = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _config(m: int):
    """Tile config by M, from an H200 tile sweep:
    16x64 w4 s4 was best at M <= 16; 64x128 w4 s3/s4 from M = 128 to 8192 on both swept shapes."""
    if m <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=GROUP_K, GROUP_M=1, num_warps=4, num_stages=4)
    if m <= 128:
        return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=GROUP_K, GROUP_M=8, num_warps=4, num_stages=4)
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=GROUP_K, GROUP_M=8, num_warps=4, num_stages=3)


def w8a8_gemm(a_q, a_s, w, w_s, out_dtype=torch.bfloat16, bias=None):
    """a_q [M, K] e4m3, a_s [M, KB] f32, w [N, K] e4m3, w_s [N, KB] f32 -> [M, N] out_dtype."""
    m, k = a_q.shape
    n = w.shape[0]
    kb = triton.cdiv(k, GROUP_K)
    c = torch.empty((m, n), dtype=out_dtype, device=a_q.device)
    if m == 0:
        return c
    cfg = _config(m)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    _w8a8_gemm_kernel[grid](
        a_q, w, c, a_s, w_s, bias if bias is not None else c,
        m, n, k, kb, a_q.stride(0), w.stride(0), c.stride(0),
        HAS_BIAS=bias is not None, **cfg,
    )
    return c
