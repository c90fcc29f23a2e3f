"""``moe_w8a8``: a W8A8 fused MoE in SGLang's sorted-token layout whose K and N tails are masked, for layers whose
sizes are multiples of 32 but not of 128 (SGLang's block-FP8 MoE kernels need whole 128-blocks)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .act_quant import GROUP_K, quantize_act_1x128
from .dense_w8a8 import w8a8_dot


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


def _moe_glue(align, silu_and_mul):
    """SGLang's token alignment (moe_align_block_size) and sgl_kernel's SiLU-and-mul, where the caller passes none."""
    if align is None:
        from ...compat import sglang_object

        align = sglang_object("moe_align_block_size")  # moved in SGLang 0.5.11
    if silu_and_mul is None:
        from sgl_kernel import silu_and_mul
    return align, silu_and_mul


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
    acc = w8a8_dot(a_ptr + rows[:, None] * stride_am, valid, sa_ptr, rows * stride_sam,
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
