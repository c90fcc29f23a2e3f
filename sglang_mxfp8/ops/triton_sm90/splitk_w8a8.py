"""``splitk_w8a8_gemm``: a few tokens (up to 128) through an FP8 weight at the speed of its bytes.

At 16-128 tokens a dense layer's time is the weight's bytes over the memory bandwidth, if enough of them are in flight:
tiles of M x N leave most SMs idle (N=5120 in tiles of 64 is 80 programs on 132 SMs) and read the weight once per M
tile. Here one program owns BLOCK_N weight rows and a K range (``split`` programs share each row block), every token
at once: the weight is read exactly once, by ``N / BLOCK_N * split`` programs. The product is computed transposed,
``W [BLOCK_N, 128] @ xq^T [128, M]``, so the weight rows fill the tensor core's wide side and the few tokens its
narrow one. The activation is quantized inside (amax / 448 per token and 128-K group, as ``act_quant`` does, from
the same BF16 values: bit for bit its e4m3 and scales), so a layer is one launch. Split programs add their float32
partials atomically into a zeroed sum buffer and take a ticket for their row block; the one that takes the last ticket
reads the sums, zeroes them, writes them in the output's dtype and clears the ticket, so the buffers are ready for the
next call without a launch to zero them or one to cast (a :class:`SplitKWorkspace`, allocated once, shared by the
layers of one width, which run one after another on the stream). From 64 tokens on (``QUANT_FIRST``) the
activation is quantized once by ``act_quant`` before the launch instead: a [64+, 128] float32 tile quantized inside
every program spills registers, and each of the ``N / BLOCK_N`` programs would redo the same work.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .act_quant import GROUP_K, e4m3_groups, quantize_act_1x128

MAX_TOKENS = 128
MIN_BLOCK_N = 16  # the tickets: one per row block of the narrowest tile


@triton.jit
def _splitk_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, sum_ptr, ticket_ptr, M, N, K, KB, stride_xm,
                   stride_xsm, stride_wn, stride_sn, stride_om, BLOCKS_PER_SPLIT, HAS_BIAS: tl.constexpr,
                   ATOMIC: tl.constexpr, SCALE_ROWS: tl.constexpr, QUANT_FIRST: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, GROUP: tl.constexpr):
    """QUANT_FIRST: x_ptr holds e4m3 and xs_ptr its float32 scales [M, KB]; else x_ptr holds BF16/FP16, quantized
    here."""
    pid_n, split = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    mask_n, mask_m = offs_n < N, offs_m < M
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    first = split * BLOCKS_PER_SPLIT
    for kb in range(first, tl.minimum(first + BLOCKS_PER_SPLIT, KB)):
        k = kb * GROUP + tl.arange(0, GROUP)
        mk = k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=mask_m[:, None] & mk[None, :], other=0.0)
        if QUANT_FIRST:
            xq = x
            xs = tl.load(xs_ptr + offs_m * stride_xsm + kb, mask=mask_m, other=0.0)
        else:
            xq, xs = e4m3_groups(x.to(tl.float32))
        w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + k[None, :], mask=mask_n[:, None] & mk[None, :],
                    other=0.0)
        ws = tl.load(ws_ptr + (offs_n // SCALE_ROWS) * stride_sn + kb, mask=mask_n, other=0.0)
        acc += tl.dot(w, tl.trans(xq)) * ws[:, None] * xs[None, :]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=mask_n & (split == 0), other=0.0).to(tl.float32)
        acc += bias[:, None]
    out = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
    ok = mask_n[:, None] & mask_m[None, :]
    if ATOMIC:
        sums = sum_ptr + offs_m[None, :] * N + offs_n[:, None]
        tl.atomic_add(sums, acc, mask=ok, sem="relaxed")
        tl.debug_barrier()  # every thread's partial issued before the ticket (its release makes them visible)
        if tl.atomic_add(ticket_ptr + pid_n, 1, sem="acq_rel") == tl.num_programs(1) - 1:
            acc = tl.atomic_add(sums, tl.zeros_like(acc), mask=ok, sem="relaxed")  # read where the atomics summed
            tl.store(sums, tl.zeros_like(acc), mask=ok)
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=ok)
            tl.atomic_xchg(ticket_ptr + pid_n, 0)
    else:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=ok)


def splitk_config(m: int, n: int, k: int, sms: int = 132) -> dict:
    """BLOCK_M: the tokens rounded up to 16 (the tensor core's narrow side; 16 is its least). BLOCK_N 64, and as many
    splits of K as it takes to give every SM about two programs, no split shorter than 4 groups of 128, and no more
    than keep the partials' atomic traffic (split x M x N float32) within a quarter of the weight's bytes (N x K):
    at 128 tokens 4 splits of a 2048-wide K would move as many bytes in atomics as the weight itself. QUANT_FIRST
    from 64 tokens (see the module's docstring)."""
    kb = triton.cdiv(k, GROUP_K)
    block_n = 64
    tiles = triton.cdiv(n, block_n)
    split = max(1, min(triton.cdiv(2 * sms, tiles), kb // 4, k // (16 * max(m, 1))))
    block_m = max(16, triton.next_power_of_2(m))
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, SPLIT=split, QUANT_FIRST=block_m >= 64, num_warps=4, num_stages=4)


class SplitKWorkspace:
    """The float32 sums [MAX_TOKENS, n] and row-block tickets of split calls of width ``n``: zero between calls
    (each call leaves them so), never reallocated (CUDA graphs keep their addresses)."""

    def __init__(self, n: int, device):
        self.n = n
        self.sums = torch.zeros((MAX_TOKENS, n), dtype=torch.float32, device=device)
        self.tickets = torch.zeros(triton.cdiv(n, MIN_BLOCK_N), dtype=torch.int32, device=device)


def splitk_w8a8_gemm(x: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor, bias=None, config: dict | None = None,
                     scale_rows: int = 1, workspace: SplitKWorkspace | None = None):
    """x [M, K] bf16/fp16 (M <= 128), w [N, K] e4m3, w_s [ceil(N / scale_rows), ceil(K/128)] float32 power-of-two
    scales (``scale_rows`` 1: per row x 128 columns; 128: 128x128 blocks) -> [M, N] of x's dtype. ``config``:
    BLOCK_M, BLOCK_N, SPLIT, QUANT_FIRST, num_warps, num_stages (default :func:`splitk_config`). ``workspace``: one
    of width N (a fresh one per call without it)."""
    m, k = x.shape
    n = w.shape[0]
    if m > MAX_TOKENS:
        raise ValueError(f"splitk_w8a8_gemm takes up to {MAX_TOKENS} tokens, got {m}")
    kb = triton.cdiv(k, GROUP_K)
    cfg = dict(config or splitk_config(m, n, k, _sms(x.device)))
    split = cfg.pop("SPLIT")
    quant_first = cfg.pop("QUANT_FIRST", False)
    if cfg["BLOCK_N"] < MIN_BLOCK_N:
        raise ValueError(f"splitk_w8a8_gemm: BLOCK_N {cfg['BLOCK_N']} is under {MIN_BLOCK_N}")
    per_split = triton.cdiv(kb, split)
    split = triton.cdiv(kb, per_split)  # no program without a K group
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m:
        if split > 1 and workspace is None:
            workspace = SplitKWorkspace(n, x.device)
        elif split > 1 and workspace.n != n:
            raise ValueError(f"splitk_w8a8_gemm: a workspace of width {workspace.n} for a layer of width {n}")
        sums, tickets = (workspace.sums, workspace.tickets) if split > 1 else (out, out)
        a, a_s = quantize_act_1x128(x) if quant_first else (x.contiguous(), w_s)
        _splitk_kernel[(triton.cdiv(n, cfg["BLOCK_N"]), split)](
            a, a_s, w, w_s, bias if bias is not None else w_s, out, sums, tickets, m, n, k, kb, a.stride(0),
            a_s.stride(0), w.stride(0), w_s.stride(0), out.stride(0), per_split, HAS_BIAS=bias is not None,
            ATOMIC=split > 1, SCALE_ROWS=scale_rows, QUANT_FIRST=quant_first, GROUP=GROUP_K, **cfg)
    return out


_SMS: dict = {}


def _sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device]
