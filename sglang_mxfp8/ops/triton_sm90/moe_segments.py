"""``moe_segments``, ``moe_scatter_quant``, ``silu_mul_quant``, ``moe_gather``: the glue around a grouped GEMM
that reads each expert's token rows contiguously (DeepGEMM's, for prefill batches:
kernels.moe.deepgemm.DeepGemmGroupedMoE)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .act_quant import GROUP_K, e4m3_groups
from .silu_and_mul import silu_mul


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
        q, scale = e4m3_groups(x)
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
    a = silu_mul(gate, up).to(gate.dtype).to(tl.float32)
    q, scale = e4m3_groups(a)
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
