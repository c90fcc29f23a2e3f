"""``w8a16_gemv``, ``moe_gemv``: one token (batch-1 decode), weight-only on CUDA cores: each program streams BLOCK_N
weight rows, aiming at the FP8 weight bytes over the memory bandwidth; the MoE takes two launches (SiLU-and-mul fused
into the first, routing weights and the sum over experts into the second)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .act_quant import GROUP_K


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
