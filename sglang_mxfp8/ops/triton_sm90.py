"""Triton kernels for MXFP8 weights on Hopper FP8 tensor cores (W8A8, fp32 accumulate).

- ``quantize_act_1x128``: one pass over a BF16/FP16 activation, writes e4m3 and one float32 scale
  (amax / 448) per 128-element group of each row.
- ``w8a8_gemm``: C = (A * sa) @ (B * sb)^T with sa per (row, 128-K group) and sb per
  (weight row, 128-K group) (MXFP8 weights converted losslessly to 1x128 power-of-two scales).
  K need only be a multiple of 32: the last K tile is masked.
- ``w8a16_gemm``: C = X @ (B * sb)^T with X in BF16 as given (weight-only FP8, for small M). The
  weight is dequantized in registers: e4m3 times a power-of-two scale is exact in BF16, so one BF16
  tensor-core dot accumulates in float32 over all of K, with no activation quantization launch.
- ``moe_w8a16``: the same weight-only product for a fused MoE layer (SGLang's sorted-token layout,
  128x128 expert block scales), for decode batches where the MoE is launch-bound.
- ``moe_w8a8``: a W8A8 fused MoE in SGLang's sorted-token layout whose K and N tails are masked, for layers whose
  sizes are multiples of 32 but not of 128 (SGLang's block-FP8 MoE kernels need whole 128-blocks).
- ``w8a16_gemv``, ``moe_gemv``: one token (batch-1 decode), weight-only on CUDA cores: each program
  streams BLOCK_N weight rows, aiming at the FP8 weight bytes over the memory bandwidth; the MoE
  takes two launches (SiLU-and-mul fused into the first, routing weights and the sum over experts into the second).
- ``moe_segments``, ``moe_scatter_quant``, ``silu_mul_quant``, ``moe_gather``: the glue around a grouped GEMM
  that reads each expert's token rows contiguously (DeepGEMM's, for prefill batches:
  kernels.moe.deepgemm.DeepGemmGroupedMoE).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GROUP_K = 128


@triton.jit
def _e4m3_groups(x):
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
    q, scale = _e4m3_groups(x)
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


@triton.jit
def _k_block(a_rows, mask_rows, b_rows, mask_n, K, kb, BLOCK_K: tl.constexpr):
    """K block ``kb`` of A's rows [rows, BLOCK_K] and of the [N, K] weight's rows, transposed [BLOCK_K, cols]; rows
    outside the masks and the K tail load as zeros (MXFP8's K is a multiple of 32, not always of BLOCK_K)."""
    k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    mk = k < K
    a = tl.load(a_rows + k[None, :], mask=mask_rows[:, None] & mk[None, :], other=0.0)
    b = tl.load(b_rows + k[:, None], mask=mask_n[None, :] & mk[:, None], other=0.0)
    return a, b


@triton.jit
def _w8a8_dot(a_rows, mask_rows, sa_ptr, sa_offs, b_rows, mask_n, sb_ptr, sb_offs, K, KB,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """float32 sum over K blocks of (A block @ B block^T) * sa * sb: A rows e4m3 with a float32 scale per (row,
    block), B rows ([N, K] weight) e4m3 with one per (row or row block, block). The dense GEMM and the sorted-token
    MoE differ only in where their rows and scales start."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, KB):
        a, b = _k_block(a_rows, mask_rows, b_rows, mask_n, K, kb, BLOCK_K)
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
    acc = _w8a8_dot(a_ptr + offs_m[:, None] * stride_am, mask_m, sa_ptr, offs_m * KB,
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


@triton.jit
def _weight_only_dot(a_rows, mask_rows, b_rows, mask_n, s_rows, K, KB,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """float32 [BLOCK_M, BLOCK_N] = A[rows] @ (e4m3 W[cols] x its per-128-K power-of-two scale)^T over all
    of K. The weight is dequantized in A's dtype (exact in bf16) right before one tensor-core dot per tile."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, KB):
        a, b = _k_block(a_rows, mask_rows, b_rows, mask_n, K, kb, BLOCK_K)
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


@triton.jit
def _expert_tile(sorted_ids_ptr, expert_ids_ptr, num_valid, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's tile of SGLang's sorted-token layout (grid: N tiles, sorted-id blocks): its (token, slot) ids,
    which of them are real (the padding ids are >= num_valid), the expert they share, the output columns."""
    ids = tl.load(sorted_ids_ptr + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M))
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    return ids, ids < num_valid, tl.load(expert_ids_ptr + tl.program_id(1)).to(tl.int64), offs_n, offs_n < N


@triton.jit
def _store_expert_tile(acc, c_ptr, stride_cm, topk_w_ptr, ids, valid, offs_n, mask_n, MUL_ROUTED_WEIGHT: tl.constexpr):
    """C[id] = acc (times the router weight of (token, slot) id), real ids and columns only."""
    if MUL_ROUTED_WEIGHT:
        acc *= tl.load(topk_w_ptr + ids, mask=valid, other=0.0)[:, None]
    c = c_ptr + ids[:, None] * stride_cm + offs_n[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & mask_n[None, :])


@triton.jit
def _moe_w8a16_kernel(
    a_ptr, b_ptr, c_ptr, sb_ptr, topk_w_ptr, sorted_ids_ptr, expert_ids_ptr, padded_ptr,
    N, K, KB, num_valid,
    stride_am, stride_be, stride_bn, stride_cm, stride_se, stride_sn,
    A_ROW_DIV: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """C[id] = A[id // A_ROW_DIV] @ W[expert]^T for the BLOCK_M sorted (token, slot) ids of one expert."""
    if tl.program_id(1) * BLOCK_M >= tl.load(padded_ptr):
        return
    ids, valid, expert, offs_n, mask_n = _expert_tile(sorted_ids_ptr, expert_ids_ptr, num_valid, N, BLOCK_M, BLOCK_N)
    a_rows = a_ptr + (ids // A_ROW_DIV)[:, None] * stride_am
    b_rows = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn
    s_rows = sb_ptr + expert * stride_se + (offs_n // 128) * stride_sn  # 128x128 blocks
    acc = _weight_only_dot(a_rows, valid, b_rows, mask_n, s_rows, K, KB, BLOCK_M, BLOCK_N, BLOCK_K)
    _store_expert_tile(acc, c_ptr, stride_cm, topk_w_ptr, ids, valid, offs_n, mask_n, MUL_ROUTED_WEIGHT)


def _moe_gemm(a, w, w_s, out, sorted_ids, expert_ids, padded, topk_weights, a_row_div, config):
    n, k = w.shape[1], w.shape[2]
    grid = (triton.cdiv(n, config["BLOCK_N"]), triton.cdiv(sorted_ids.numel(), config["BLOCK_M"]))
    _moe_w8a16_kernel[grid](
        a, w, out, w_s, topk_weights, sorted_ids, expert_ids, padded,
        n, k, triton.cdiv(k, GROUP_K), out.shape[0],
        a.stride(0), w.stride(0), w.stride(1), out.stride(0), w_s.stride(0), w_s.stride(1),
        A_ROW_DIV=a_row_div, MUL_ROUTED_WEIGHT=a_row_div == 1, BLOCK_K=GROUP_K, **config,
    )


# untuned starting point: one 16-row tile per expert in decode
MOE_W8A16_CONFIG = dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=4)


def _moe_glue(align, silu_and_mul):
    """SGLang's token alignment (moe_align_block_size) and sgl_kernel's SiLU-and-mul, where the caller passes none."""
    if align is None:
        from ..sglang.compat import sglang_object

        align = sglang_object("moe_align_block_size")  # moved in SGLang 0.5.11
    if silu_and_mul is None:
        from sgl_kernel import silu_and_mul
    return align, silu_and_mul


def moe_w8a16(x, w13, s13, w2, s2, topk_weights, topk_ids, config=None, align=None, silu_and_mul=None):
    """Weight-only FP8 fused MoE: x [M, H] bf16; w13 [E, 2I, H] e4m3 ([gate; up] rows), w2 [E, H, I]
    e4m3, their 128x128 power-of-two scales [E, 2I/128, H/128] and [E, H/128, I/128]; topk_weights /
    topk_ids [M, top_k] -> [M, H]. ``align`` and ``silu_and_mul`` default to SGLang's / sgl_kernel's."""
    if x.dtype != torch.bfloat16:
        raise TypeError(f"moe_w8a16 needs a bfloat16 activation (got {x.dtype}): e4m3 x 2^k is exact in bf16 only")
    return _moe_w8a16(x, w13, s13, w2, s2, topk_weights, topk_ids, config, align, silu_and_mul)


def _moe_w8a16(x, w13, s13, w2, s2, topk_weights, topk_ids, config, align, silu_and_mul):
    """The launches, for any float activation dtype (Triton's CPU interpreter runs no bf16 dot)."""
    align, silu_and_mul = _moe_glue(align, silu_and_mul)
    m, top_k = topk_ids.shape
    cfg = config or MOE_W8A16_CONFIG
    sorted_ids, expert_ids, padded = align(topk_ids, cfg["BLOCK_M"], w13.shape[0])
    up = torch.empty((m * top_k, w13.shape[1]), dtype=x.dtype, device=x.device)
    _moe_gemm(x.contiguous(), w13, s13, up, sorted_ids, expert_ids, padded, topk_weights, top_k, cfg)
    act = silu_and_mul(up)
    down = torch.empty((m * top_k, w2.shape[1]), dtype=x.dtype, device=x.device)
    _moe_gemm(act, w2, s2, down, sorted_ids, expert_ids, padded, topk_weights.reshape(-1), 1, cfg)
    return down.view(m, top_k, -1).sum(dim=1)


@triton.jit
def _moe_w8a8_kernel(
    a_ptr, sa_ptr, b_ptr, c_ptr, sb_ptr, topk_w_ptr, sorted_ids_ptr, expert_ids_ptr, padded_ptr,
    N, K, KB, num_valid,
    stride_am, stride_sam, stride_be, stride_bn, stride_cm, stride_se, stride_sn,
    A_ROW_DIV: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, SWAP_HALVES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """C[id] = (A * sa)[id // A_ROW_DIV] @ (W[expert] * sb)^T for the BLOCK_M sorted (token, slot) ids of one expert;
    A e4m3 with a float32 scale per (row, 128 columns), W e4m3 with 128x128 block scales; K and N tails masked.
    SWAP_HALVES: W's first and second N / 2 rows are stored to C's second and first halves (w13 as [up; gate] in,
    [gate | up] out, as SiLU-and-mul reads it)."""
    if tl.program_id(1) * BLOCK_M >= tl.load(padded_ptr):
        return
    ids, valid, expert, offs_n, mask_n = _expert_tile(sorted_ids_ptr, expert_ids_ptr, num_valid, N, BLOCK_M, BLOCK_N)
    rows = ids // A_ROW_DIV
    acc = _w8a8_dot(a_ptr + rows[:, None] * stride_am, valid, sa_ptr, rows * stride_sam,
                    b_ptr + expert * stride_be + offs_n[None, :] * stride_bn, mask_n,
                    sb_ptr + expert * stride_se, (offs_n // 128) * stride_sn, K, KB, BLOCK_M, BLOCK_N, BLOCK_K)
    out_n = offs_n
    if SWAP_HALVES:
        half = N // 2
        out_n = tl.where(offs_n < half, offs_n + half, offs_n - half)
    _store_expert_tile(acc, c_ptr, stride_cm, topk_w_ptr, ids, valid, out_n, mask_n, MUL_ROUTED_WEIGHT)


def moe_w8a8_config(m: int, top_k: int, experts: int) -> dict:
    """16-row tiles while the average expert gets fewer than 32 (token, slot) rows, 64-row tiles after."""
    if m * top_k < 32 * experts:
        return dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=4)
    return dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=3)


def _moe_gemm_w8a8(a_q, a_s, w, w_s, out, sorted_ids, expert_ids, padded, topk_weights, a_row_div, config,
                   swap_halves=False):
    n, k = w.shape[1], w.shape[2]
    grid = (triton.cdiv(n, config["BLOCK_N"]), triton.cdiv(sorted_ids.numel(), config["BLOCK_M"]))
    _moe_w8a8_kernel[grid](
        a_q, a_s, w, out, w_s, topk_weights, sorted_ids, expert_ids, padded,
        n, k, triton.cdiv(k, GROUP_K), out.shape[0],
        a_q.stride(0), a_s.stride(0), w.stride(0), w.stride(1), out.stride(0), w_s.stride(0), w_s.stride(1),
        A_ROW_DIV=a_row_div, MUL_ROUTED_WEIGHT=a_row_div == 1, SWAP_HALVES=swap_halves, BLOCK_K=GROUP_K, **config,
    )


def moe_w8a8(x, w13, s13, w2, s2, topk_weights, topk_ids, config=None, align=None, silu_and_mul=None,
             up_first: bool = False):
    """W8A8 fused MoE for any hidden / intermediate size that is a multiple of 32 (MXFP8's block; K and N tails are
    masked, nothing padded): x [M, H] bf16/fp16 quantized per (row, 128 columns); w13 [E, 2I, H] e4m3 ([gate; up]
    rows), w2 [E, H, I] e4m3, their 128x128 power-of-two scales [E, ceil(2I/128), ceil(H/128)] and
    [E, ceil(H/128), ceil(I/128)]; topk_weights / topk_ids [M, top_k] -> [M, H]. ``align`` and ``silu_and_mul``
    default to SGLang's / sgl_kernel's. ``up_first``: w13 holds [up; gate] rows (as FlashInfer's fused MoE loads it);
    the up GEMM then stores each half where SiLU-and-mul reads it, nothing copied."""
    align, silu_and_mul = _moe_glue(align, silu_and_mul)
    m, top_k = topk_ids.shape
    cfg = config or moe_w8a8_config(m, top_k, w13.shape[0])
    sorted_ids, expert_ids, padded = align(topk_ids, cfg["BLOCK_M"], w13.shape[0])
    a_q, a_s = quantize_act_1x128(x.contiguous())
    up = torch.empty((m * top_k, w13.shape[1]), dtype=x.dtype, device=x.device)
    _moe_gemm_w8a8(a_q, a_s, w13, s13, up, sorted_ids, expert_ids, padded, topk_weights, top_k, cfg, up_first)
    act_q, act_s = quantize_act_1x128(silu_and_mul(up))
    down = torch.empty((m * top_k, w2.shape[1]), dtype=x.dtype, device=x.device)
    _moe_gemm_w8a8(act_q, act_s, w2, s2, down, sorted_ids, expert_ids, padded, topk_weights.reshape(-1), 1, cfg)
    return down.view(m, top_k, -1).sum(dim=1)


@triton.jit
def _gemv_dot(x_ptr, w_rows, mask_n, s_rows, K, KB, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr):
    """float32 [BLOCK_N] = W[rows] (e4m3 x its per-128-K power-of-two scale) . x[:K] over all of K, on CUDA
    cores. Each loop step loads one [BLOCK_N, GROUPS, 128] FP8 tile (16-byte loads per thread; GROUPS a power
    of two, up to all of K): one token's GEMV is bound by how many weight bytes are in flight, and a step's
    loads wait a whole memory latency, so few wide steps beat many narrow ones."""
    offs = tl.arange(0, 128)
    groups = tl.arange(0, GROUPS)
    acc = tl.zeros((BLOCK_N, GROUPS), dtype=tl.float32)
    for kb0 in range(0, KB, GROUPS):
        kb = kb0 + groups
        k = kb[:, None] * 128 + offs[None, :]
        mk = k < K
        a = tl.load(x_ptr + k, mask=mk, other=0.0).to(tl.float32)
        w = tl.load(w_rows[:, None, None] + k[None, :, :], mask=mask_n[:, None, None] & mk[None, :, :], other=0.0)
        s = tl.load(s_rows[:, None] + kb[None, :], mask=mask_n[:, None] & (kb < KB)[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * a[None, :, :], axis=2) * s
    return tl.sum(acc, axis=1)


@triton.jit
def _w8a16_gemv_kernel(x_ptr, w_ptr, s_ptr, bias_ptr, y_ptr, N, K, KB, stride_wn, stride_sn,
                       SCALE_ROWS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    acc = _gemv_dot(x_ptr, w_ptr + offs_n * stride_wn, mask_n, s_ptr + (offs_n // SCALE_ROWS) * stride_sn,
                    K, KB, BLOCK_N, GROUPS)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, acc.to(y_ptr.dtype.element_ty), mask=mask_n)


# H200 tile sweep: the fastest config per (N, K)
GEMV_TUNED = {
    (5120, 2048): dict(BLOCK_N=8, GROUPS=16, num_warps=8, num_stages=1),
    (2048, 4096): dict(BLOCK_N=2, GROUPS=16, num_warps=8, num_stages=1),
    (14336, 4096): dict(BLOCK_N=16, GROUPS=8, num_warps=4, num_stages=1),
    (4096, 14336): dict(BLOCK_N=2, GROUPS=16, num_warps=4, num_stages=1),
}


def gemv_config(n: int, k: int) -> dict:
    """The swept config of a [n, k] weight, else ``gemv_rule_config``."""
    return GEMV_TUNED.get((n, k)) or gemv_rule_config(n)


def gemv_rule_config(n: int) -> dict:
    """What the sweep's winners share: 16 K groups a step, 8 warps, one stage, and the widest BLOCK_N (8, 4
    or 2 rows) that still gives 640 programs (about 5 per SM of an H200)."""
    block_n = next((b for b in (8, 4) if triton.cdiv(n, b) >= 640), 2)
    return dict(BLOCK_N=block_n, GROUPS=16, num_warps=8, num_stages=1)


def w8a16_gemv(x, w, w_s, scale_rows: int = 1, bias=None, config: dict | None = None):
    """One token: x [1, K] bf16, w [N, K] e4m3, w_s [ceil(N / scale_rows), KB] f32 powers of two -> [1, N]
    bf16. A weight-streaming dot product per output row on CUDA cores: no 16-row tensor-core tile for
    one row and no activation quantization; what it should cost is the weight bytes over the memory bandwidth."""
    if x.dtype != torch.bfloat16 or x.shape[0] != 1:
        raise TypeError(f"w8a16_gemv takes one bfloat16 token (got {x.dtype} {tuple(x.shape)})")
    return _w8a16_gemv(x, w, w_s, scale_rows, bias, config)


def _w8a16_gemv(x, w, w_s, scale_rows, bias, config):
    """The launch, for any float activation dtype."""
    x = x.contiguous()
    n, k = w.shape
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    cfg = dict(config or gemv_config(n, k))
    _w8a16_gemv_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](
        x, w, w_s, bias if bias is not None else y, y, n, k, triton.cdiv(k, GROUP_K), w.stride(0), w_s.stride(0),
        SCALE_ROWS=scale_rows, HAS_BIAS=bias is not None, **cfg,
    )
    return y


@triton.jit
def _moe_gemv_up_kernel(x_ptr, w_ptr, s_ptr, ids_ptr, act_ptr, I, K, KB,
                        stride_we, stride_wn, stride_se, stride_sn, stride_act,
                        UP_FIRST: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr):
    """act[slot] = silu_and_mul(W13[expert of slot] . x) for BLOCK_N of the I outputs, one program per
    (BLOCK_N outputs, slot). A program's rows are its outputs' gate and up rows, interleaved, so the
    activation is computed once per output here rather than by every program of the down projection.
    UP_FIRST: W13 holds [up; gate] rows."""
    slot = tl.program_id(1)
    expert = tl.load(ids_ptr + slot).to(tl.int64)
    r = tl.arange(0, 2 * BLOCK_N)
    offs_i = tl.program_id(0) * BLOCK_N + r // 2
    rows = offs_i + ((r + UP_FIRST) % 2) * I  # even r: gate row, odd r: up row
    acc = _gemv_dot(x_ptr, w_ptr + expert * stride_we + rows * stride_wn, (offs_i < I) & (expert >= 0),
                    s_ptr + expert * stride_se + (rows // 128) * stride_sn, K, KB, 2 * BLOCK_N, GROUPS)
    # SGLang's silu_and_mul on the bf16 gate and up its fused MoE would have stored
    gate, up = tl.split(tl.reshape(acc.to(act_ptr.dtype.element_ty).to(tl.float32), (BLOCK_N, 2)))
    offs_o = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(act_ptr + slot * stride_act + offs_o, (gate * tl.sigmoid(gate) * up).to(act_ptr.dtype.element_ty),
             mask=offs_o < I)


@triton.jit
def _moe_gemv_down_kernel(act_ptr, w_ptr, s_ptr, ids_ptr, tw_ptr, y_ptr, N, I, KB, TOP_K,
                          stride_act, stride_we, stride_wn, stride_se, stride_sn,
                          SLOTS: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr):
    """y = sum over slots of weight[slot] * W2[expert of slot] . act[slot]: the down projection, the routing
    weights and the sum over experts in one launch. A program loads its BLOCK_N rows of every slot's expert
    at once ([SLOTS, BLOCK_N, GROUPS, 128] tiles): one token's down projection is only H rows, so walking the
    experts in turn leaves too few bytes in flight."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    slots = tl.arange(0, SLOTS)
    expert = tl.load(ids_ptr + slots, mask=slots < TOP_K, other=-1).to(tl.int64)
    live = expert >= 0  # an id < 0 (padding, or an expert on another rank) adds nothing
    expert = tl.maximum(expert, 0)
    rows = live[:, None] & (offs_n < N)[None, :]
    w_rows = w_ptr + expert[:, None] * stride_we + offs_n[None, :] * stride_wn
    s_rows = s_ptr + expert[:, None] * stride_se + (offs_n // 128)[None, :] * stride_sn
    act_rows = act_ptr + slots[:, None, None] * stride_act
    offs = tl.arange(0, 128)
    groups = tl.arange(0, GROUPS)
    acc = tl.zeros((SLOTS, BLOCK_N, GROUPS), dtype=tl.float32)
    for kb0 in range(0, KB, GROUPS):
        kb = kb0 + groups
        k = kb[:, None] * 128 + offs[None, :]
        mk = live[:, None, None] & (k < I)[None, :, :]
        a = tl.load(act_rows + k[None, :, :], mask=mk, other=0.0).to(tl.float32)
        w = tl.load(w_rows[:, :, None, None] + k[None, None, :, :], mask=rows[:, :, None, None] & mk[:, None, :, :],
                    other=0.0)
        s = tl.load(s_rows[:, :, None] + kb[None, None, :], mask=rows[:, :, None] & (kb < KB)[None, None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * a[:, None, :, :], axis=3) * s
    tw = tl.load(tw_ptr + slots, mask=live, other=0.0).to(tl.float32)
    total = tl.sum(tl.sum(acc, axis=2) * tw[:, None], axis=0)
    tl.store(y_ptr + offs_n, total.to(y_ptr.dtype.element_ty), mask=offs_n < N)


# H200 tile sweep of the Qwen3-30B-A3B MoE (E=128, H=2048, I=768, top-8), one config per launch.
# The down projection's 8 groups cover I = 768 (6 groups) in one step, the last two masked off.
MOE_GEMV_UP_CONFIG = dict(BLOCK_N=16, GROUPS=16, num_warps=8, num_stages=1)  # 16 outputs: 32 rows
MOE_GEMV_DOWN_CONFIG = dict(BLOCK_N=8, GROUPS=8, num_warps=8, num_stages=1)


def moe_gemv(x, w13, s13, w2, s2, topk_weights, topk_ids, up_config: dict | None = None,
             down_config: dict | None = None, up_first: bool = False):
    """One token's fused MoE in two launches, on the checkpoint's FP8 experts: x [1, H] bf16; w13 [E, 2I, H]
    e4m3 ([gate; up] rows), w2 [E, H, I] e4m3, their 128x128 power-of-two scales; topk_weights / topk_ids
    [1, top_k] (an id < 0 adds nothing) -> [1, H]. No token sorting, no activation quantization, no
    separate activation or sum kernel: what a batch-1 decode step's MoE is otherwise made of. ``up_first``: w13
    holds [up; gate] rows."""
    if x.dtype != torch.bfloat16 or x.shape[0] != 1:
        raise TypeError(f"moe_gemv takes one bfloat16 token (got {x.dtype} {tuple(x.shape)})")
    return _moe_gemv(x, w13, s13, w2, s2, topk_weights, topk_ids, up_config, down_config, up_first)


def _moe_gemv(x, w13, s13, w2, s2, topk_weights, topk_ids, up_config, down_config, up_first=False):
    """The launches, for any float activation dtype: the up projection with the activation ([top_k, I]), then
    the down projection, whose programs each cover BLOCK_N rows of every expert of the token."""
    up_cfg, down_cfg = up_config or MOE_GEMV_UP_CONFIG, down_config or MOE_GEMV_DOWN_CONFIG
    h, inter, top_k = x.shape[1], w2.shape[2], topk_ids.shape[1]
    ids, tw = topk_ids.reshape(-1).contiguous(), topk_weights.reshape(-1).contiguous()
    act = torch.empty((top_k, inter), dtype=x.dtype, device=x.device)
    _moe_gemv_up_kernel[(triton.cdiv(inter, up_cfg["BLOCK_N"]), top_k)](
        x.contiguous(), w13, s13, ids, act, inter, h, triton.cdiv(h, GROUP_K),
        w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1), act.stride(0), UP_FIRST=int(up_first), **up_cfg,
    )
    y = torch.empty((1, h), dtype=x.dtype, device=x.device)
    _moe_gemv_down_kernel[(triton.cdiv(h, down_cfg["BLOCK_N"]),)](
        act, w2, s2, ids, tw, y, h, inter, triton.cdiv(inter, GROUP_K), top_k,
        act.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1),
        SLOTS=triton.next_power_of_2(top_k), **down_cfg,
    )
    return y


# The glue around a grouped GEMM that takes each expert's token rows contiguously (DeepGEMM's "contiguous"
# layout, kernels.moe.deepgemm.DeepGemmGroupedMoE): rows sorted by expert, each expert's segment starting at a multiple
# of
# 128 rows; activation scales M-major (stride (1, rows)), as DeepGEMM's Hopper kernel reads them.
SCATTER_CHUNK = 8  # 128-column groups per step of the scatter kernel's K loop


@triton.jit
def _moe_segments_kernel(ids_ptr, n_ids, tally_ptr, cursor_ptr, seg_end_ptr, end_ptr, E, BINS: tl.constexpr,
                         ALIGN: tl.constexpr, BLOCK: tl.constexpr):
    """Each program counts the expert ids of BLOCK slots (a histogram) into a zeroed tally [E] + ticket [1]; the
    program that takes the last ticket pads each expert's count to ALIGN and lays the segments end to end in expert
    order: cursor = each segment's first row (the scatter's atomics advance it), seg_end = its padded end, end = the
    first row past its slots."""
    bins = tl.arange(0, BINS)
    real = bins < E
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ids = tl.load(ids_ptr + offs, mask=offs < n_ids, other=E)  # past the end: bin E, after every expert's
    tl.atomic_add(tally_ptr + bins, tl.histogram(ids, BINS), mask=real)
    tl.debug_barrier()  # every thread's counts before this program's ticket (release, cumulative)
    if tl.atomic_add(tally_ptr + E, 1) == tl.num_programs(0) - 1:
        tl.debug_barrier()
        counts = tl.where(real, tl.atomic_add(tally_ptr + bins, 0, mask=real), 0)
        padded = (counts + ALIGN - 1) // ALIGN * ALIGN
        seg_end = tl.cumsum(padded, 0)
        start = seg_end - padded
        tl.store(cursor_ptr + bins, start, mask=real)
        tl.store(seg_end_ptr + bins, seg_end, mask=real)
        tl.store(end_ptr + bins, start + counts, mask=real)


SEGMENT_ALIGN = 128  # DeepGEMM's M alignment for its contiguous layout (kernels.moe.deepgemm checks it)
SEGMENT_BLOCK = 1024  # slots per program of the segments' histogram


def moe_segments(topk_ids, experts: int):
    """topk_ids [M, top_k] int32 (every id a valid expert) -> int32 [experts] each: (cursor, seg_end, end). Expert
    e's rows are [seg_end[e] - padded count, seg_end[e]), its slots fill them from the start up to end[e]; cursor
    starts at the first row and is what moe_scatter_quant advances. A memset and one launch (the slots counted in
    parallel, the last program to finish lays out the segments) in place of the ten small torch ops (count, pad,
    cumsum, starts, ends) it replaces."""
    ids = topk_ids.contiguous()
    work = torch.zeros(4 * experts + 1, dtype=torch.int32, device=ids.device)
    cursor, seg_end, end = work[experts + 1:].view(3, experts)
    _moe_segments_kernel[(max(1, triton.cdiv(ids.numel(), SEGMENT_BLOCK)),)](
        ids, ids.numel(), work, cursor, seg_end, end, experts, BINS=triton.next_power_of_2(experts + 1),
        ALIGN=SEGMENT_ALIGN, BLOCK=SEGMENT_BLOCK, num_warps=4)
    return cursor, seg_end, end


@triton.jit
def _moe_scatter_quant_kernel(x_ptr, ids_ptr, next_row_ptr, q_ptr, s_ptr, slot_ptr, K, stride_xm, stride_qm,
                              stride_sk, TOP_K: tl.constexpr, SLOTS: tl.constexpr, CHUNK: tl.constexpr,
                              BLOCK: tl.constexpr):
    """Token t quantized 1x128 and written to one row of each of its experts' segments. The rows are claimed with
    one atomic add per slot on the expert's next free row, all slots at once; slot_ptr[t, k] keeps the row."""
    t = tl.program_id(0)
    k = tl.arange(0, SLOTS)
    k_ok = k < TOP_K
    experts = tl.load(ids_ptr + t * TOP_K + k, mask=k_ok, other=0)
    rows = tl.atomic_add(next_row_ptr + experts, 1, mask=k_ok)
    tl.store(slot_ptr + t * TOP_K + k, rows, mask=k_ok)
    rows = rows.to(tl.int64)
    for c0 in range(0, K, CHUNK * BLOCK):
        g = c0 // BLOCK + tl.arange(0, CHUNK)
        cols = g[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        x = tl.load(x_ptr + t * stride_xm + cols, mask=cols < K, other=0.0).to(tl.float32)
        q, scale = _e4m3_groups(x)
        tl.store(q_ptr + rows[:, None, None] * stride_qm + cols[None, :, :], q[None, :, :],
                 mask=k_ok[:, None, None] & (cols < K)[None, :, :])
        tl.store(s_ptr + rows[:, None] + g[None, :] * stride_sk, scale[None, :],
                 mask=k_ok[:, None] & (g * BLOCK < K)[None, :])


def moe_scatter_quant(x, topk_ids, cursor, rows: int):
    """x [M, K] bf16 (K a multiple of 128), topk_ids [M, top_k] int32 (every id a valid expert), cursor [E] int32
    (each expert's first row, moe_segments; advanced past its slots by the call) -> (e4m3 [rows, K], float32 scales
    [rows, K / 128] M-major, slot rows [M, top_k] int32: where each token slot went). Rows no slot claims are left
    as they were."""
    m, k = x.shape
    top_k = topk_ids.shape[1]
    q = torch.empty((rows, k), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((k // GROUP_K, rows), dtype=torch.float32, device=x.device).t()
    slots = torch.empty((m, top_k), dtype=torch.int32, device=x.device)
    if m:
        _moe_scatter_quant_kernel[(m,)](
            x, topk_ids.contiguous(), cursor, q, s, slots, k, x.stride(0), q.stride(0), s.stride(1),
            TOP_K=top_k, SLOTS=triton.next_power_of_2(top_k), CHUNK=SCATTER_CHUNK, BLOCK=GROUP_K, num_warps=8,
        )
    return q, s, slots


@triton.jit
def _silu_mul_quant_kernel(h_ptr, q_ptr, s_ptr, seg_end_ptr, end_ptr, E, I, stride_h, stride_q, stride_sk,
                           UP_FIRST: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, BINS: tl.constexpr):
    """silu(gate) * up for [ROWS] rows x one 128-column group, rounded to the activation dtype (what a separate
    SiLU-and-mul would write), then quantized 1x128. Only rows holding a slot: the block's expert is the first whose
    segment ends past it (ROWS divides the segments' alignment), and rows at or past that expert's end are skipped.
    UP_FIRST: h holds [up | gate]."""
    first = tl.program_id(0) * ROWS
    bins = tl.arange(0, BINS)
    seg_end = tl.load(seg_end_ptr + bins, mask=bins < E, other=2147483647)
    expert = tl.sum((seg_end <= first).to(tl.int32), 0)
    if expert >= E:
        return
    limit = tl.load(end_ptr + expert)
    if first >= limit:
        return
    rows = first + tl.arange(0, ROWS)
    ok = rows < limit
    rows = rows.to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    gate = tl.load(h_ptr + rows[:, None] * stride_h + UP_FIRST * I + cols[None, :], mask=ok[:, None], other=0.0)
    up = tl.load(h_ptr + rows[:, None] * stride_h + (1 - UP_FIRST) * I + cols[None, :], mask=ok[:, None], other=0.0)
    g32 = gate.to(tl.float32)
    a = (g32 / (1.0 + tl.exp(-g32)) * up.to(tl.float32)).to(gate.dtype).to(tl.float32)
    q, scale = _e4m3_groups(a)
    tl.store(q_ptr + rows[:, None] * stride_q + cols[None, :], q, mask=ok[:, None])
    tl.store(s_ptr + rows + tl.program_id(1) * stride_sk, scale, mask=ok)


SILU_ROWS = 16


def silu_mul_quant(h, seg_end, end, up_first: bool = False):
    """h [R, 2I] ([gate | up], or [up | gate] with ``up_first``; R a multiple of 16, I of 128) -> (e4m3 [R, I], float32
    scales [R, I / 128] M-major)
    of silu(gate) * up, on the rows that hold a slot (seg_end, end from moe_segments); the padding rows after each
    expert's slots are not computed (a grouped GEMM reads them as its tile's spare rows, whose outputs nothing uses)."""
    r, inter = h.shape[0], h.shape[1] // 2
    q = torch.empty((r, inter), dtype=torch.float8_e4m3fn, device=h.device)
    s = torch.empty((inter // GROUP_K, r), dtype=torch.float32, device=h.device).t()
    _silu_mul_quant_kernel[(r // SILU_ROWS, inter // GROUP_K)](
        h, q, s, seg_end, end, seg_end.numel(), inter, h.stride(0), q.stride(0), s.stride(1), UP_FIRST=int(up_first),
        ROWS=SILU_ROWS,
        BLOCK=GROUP_K, BINS=triton.next_power_of_2(seg_end.numel()), num_warps=4,
    )
    return q, s


@triton.jit
def _moe_gather_kernel(y_ptr, slot_ptr, tw_ptr, out_ptr, N, stride_y, stride_o, TOP_K: tl.constexpr,
                       SLOTS: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[t, cols] = sum over k of topk_weights[t, k] * y[slot row of (t, k), cols], in float32."""
    t = tl.program_id(0)
    k = tl.arange(0, SLOTS)
    k_ok = k < TOP_K
    rows = tl.load(slot_ptr + t * TOP_K + k, mask=k_ok, other=0).to(tl.int64)
    w = tl.load(tw_ptr + t * TOP_K + k, mask=k_ok, other=0.0).to(tl.float32)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    v = tl.load(y_ptr + rows[:, None] * stride_y + cols[None, :], mask=k_ok[:, None] & (cols < N)[None, :], other=0.0)
    acc = tl.sum(v.to(tl.float32) * w[:, None], axis=0)
    tl.store(out_ptr + t * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < N)


GATHER_BLOCK_N = 1024


def moe_gather(y, slots, topk_weights):
    """y [R, N] (each token slot's expert output at its slot row), slots [M, top_k], topk_weights [M, top_k]
    -> [M, N] in y's dtype: the routing-weighted sum of each token's slots."""
    m, top_k = slots.shape
    n = y.shape[1]
    out = torch.empty((m, n), dtype=y.dtype, device=y.device)
    if m:
        _moe_gather_kernel[(m, triton.cdiv(n, GATHER_BLOCK_N))](
            y, slots, topk_weights.contiguous(), out, n, y.stride(0), out.stride(0), TOP_K=top_k,
            SLOTS=triton.next_power_of_2(top_k), BLOCK_N=GATHER_BLOCK_N, num_warps=4,
        )
    return out
