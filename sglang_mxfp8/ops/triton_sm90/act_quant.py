"""Activation quantization for the W8A8 kernels: one pass over a BF16/FP16 activation writes e4m3 and one float32
scale (amax / 448) per 128-element group of each row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GROUP_K = 128


@triton.jit
def e4m3_groups(x):
    """x [R, 128] float32 -> (e4m3 [R, 128], float32 scale per row: amax / 448). A row holding a NaN gets a NaN
    scale (its maximum alone would skip it), so the token's output comes out NaN."""
    amax = tl.max(tl.abs(x), axis=1)
    has_nan = tl.max((x != x).to(tl.int32), axis=1) > 0
    scale = tl.where(has_nan, float("nan"), tl.maximum(amax / 448.0, 1e-12))
    return tl.clamp(x / scale[:, None], -448.0, 448.0).to(tl.float8e4nv), scale


@triton.jit
def _quant_act_kernel(x_ptr, q_ptr, s_ptr, M, M_OUT, K, stride_xm, stride_qm, stride_sm, stride_sk,
                      ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Rows M..M_OUT (padding for a consumer that wants whole row groups) get zeros and the floor scale."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    g = tl.program_id(1)
    cols = g * BLOCK + tl.arange(0, BLOCK)
    col_ok = cols[None, :] < K
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=(rows < M)[:, None] & col_ok,
                other=0.0).to(tl.float32)
    q, scale = e4m3_groups(x)
    out_ok = rows < M_OUT
    tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], q, mask=out_ok[:, None] & col_ok)
    tl.store(s_ptr + rows * stride_sm + g * stride_sk, scale, mask=out_ok)


def act_quant_rows(m: int) -> int:
    """Rows per program: 1 for a single token; up to 16 (a [16, 128] tile, 4 warps) for batches, so a
    large M is not one 1-warp program per 128 elements."""
    return min(16, triton.next_power_of_2(max(m, 1)))


def quantize_act_1x128(x: torch.Tensor, rows: int | None = None, m_major: bool = False):
    """x [M, K] bf16/fp16 -> (e4m3 [M, K], float32 scales [M, ceil(K/128)]); ``rows``: tile height.

    ``m_major``: the layout cuBLAS's block-scaled GEMM reads: M rounded up to a multiple of 4 (the extra
    rows zero), scales stored token-fastest (stride (1, M))."""
    m, k = x.shape
    kb = triton.cdiv(k, GROUP_K)
    m_out = triton.cdiv(m, 4) * 4 if m_major else m
    q = torch.empty((m_out, k), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((kb, m_out), dtype=torch.float32, device=x.device).t() if m_major else \
        torch.empty((m, kb), dtype=torch.float32, device=x.device)
    if m_out:
        rows = rows or act_quant_rows(m_out)
        _quant_act_kernel[(triton.cdiv(m_out, rows), kb)](
            x, q, s, m, m_out, k, x.stride(0), q.stride(0), s.stride(0), s.stride(1), ROWS=rows, BLOCK=GROUP_K,
            num_warps=max(1, min(8, rows * GROUP_K // 512)),
        )
    return q, s
