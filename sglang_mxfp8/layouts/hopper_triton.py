"""MXFP8 weights converted in place to power-of-two block scales in one pass on the GPU: each program reads one tile
of e4m3 bytes with its UE8M0 scales, takes the tile's block exponent (the largest exponent of its sub-blocks that hold
a nonzero element), moves every element to it, and writes the bytes back where they were.

The move is integer arithmetic on the e4m3 bits, the rounding of a float cast spelled out: an element moves down by
``d = min(sub-block exponent - block exponent, 0)`` binary places, exactly while it stays normal, else rounded to
nearest even into e4m3's subnormals (what ``torch.ldexp`` then a cast to e4m3 gives, bit for bit; tests/test_triton_cpu
checks every byte at every move)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..format.numerics import E8M0_BIAS, MX_BLOCK

NO_EXPONENT = -(1 << 20)  # a sub-block of zeros: no exponent
ROW_TILE = 32  # rows per program where every row has its own scale (block_rows 1)


@triton.jit
def shift_e4m3(b, d):
    """e4m3 bits ``b`` (int32) times 2**d, d <= 0 (int32, same shape): (new bits, whether the value changed)."""
    sign = b & 0x80
    ex = (b >> 3) & 0xF
    m = b & 7
    sig = tl.where(ex > 0, m + 8, m)  # the value is sig * 2**(max(ex, 1) - 10)
    moved = ex + d
    normal = (ex > 0) & (moved >= 1)
    r = tl.minimum(tl.maximum(1 - tl.maximum(ex, 1) - d, 0), 6)  # places dropped into the subnormals
    q = sig >> r
    rem = sig & ((1 << r) - 1)
    half = (1 << r) >> 1
    up = (r > 0) & ((rem > half) | ((rem == half) & ((q & 1) == 1)))
    mag = tl.where(normal, (moved << 3) | m, q + up.to(tl.int32))  # q + up == 8 is the smallest normal, 0x08
    return sign | mag, (~normal) & (rem != 0)


@triton.jit
def _to_block_scales_kernel(w_ptr, s_ptr, nz_ptr, exps_ptr, changed_ptr, R, K, KS, KB,
                            BLOCK_ROWS: tl.constexpr, TILE_ROWS: tl.constexpr, NO_EXP: tl.constexpr,
                            BIAS: tl.constexpr, SUB: tl.constexpr):
    pid_r, pid_k = tl.program_id(0), tl.program_id(1)
    rows = pid_r * TILE_ROWS + tl.arange(0, TILE_ROWS)
    subs = pid_k * (128 // SUB) + tl.arange(0, 128 // SUB)
    row_ok = rows < R
    sub_ok = row_ok[:, None] & (subs[None, :] < KS)
    sub_at = rows[:, None].to(tl.int64) * KS + subs[None, :]
    sub_exp = tl.load(s_ptr + sub_at, mask=sub_ok, other=0).to(tl.int32) - BIAS
    nonzero = tl.load(nz_ptr + sub_at, mask=sub_ok, other=0) != 0
    e = tl.where(nonzero, sub_exp, NO_EXP)
    if BLOCK_ROWS == 1:
        row_block = tl.max(e, axis=1)
        row_block = tl.where(row_block == NO_EXP, 0, row_block)
        tl.store(exps_ptr + rows.to(tl.int64) * KB + pid_k, row_block, mask=row_ok)
        target = row_block[:, None]
    else:  # one block of TILE_ROWS == BLOCK_ROWS rows
        block = tl.max(tl.max(e, axis=1), axis=0)
        block = tl.where(block == NO_EXP, 0, block)
        tl.store(exps_ptr + pid_r.to(tl.int64) * KB + pid_k, block)
        target = block
    cols = pid_k * 128 + tl.arange(0, 128)
    ok = row_ok[:, None] & (cols[None, :] < K)
    elem_exp = tl.load(s_ptr + rows[:, None].to(tl.int64) * KS + cols[None, :] // SUB, mask=ok, other=0)
    d = tl.minimum(elem_exp.to(tl.int32) - BIAS - target, 0)
    at = rows[:, None].to(tl.int64) * K + cols[None, :]
    bits = tl.load(w_ptr + at, mask=ok, other=0).to(tl.int32)
    new, changed = shift_e4m3(bits, d)
    tl.store(w_ptr + at, new.to(tl.uint8), mask=ok)
    tl.store(changed_ptr + pid_r * tl.num_programs(1) + pid_k, tl.sum((changed & ok).to(tl.int32)))


def to_block_scales_(w: torch.Tensor, scale: torch.Tensor, nonzero: torch.Tensor, block_rows: int,
                     exps: torch.Tensor) -> torch.Tensor:
    """Convert e4m3 ``w [R, K]`` (its UE8M0 ``scale [R, K/32]``; ``nonzero [R, K/32]``: which sub-blocks hold a
    nonzero element) in place to one exponent per (block_rows x 128) block, written into int32
    ``exps [ceil(R / block_rows), ceil(K / 128)]``; returns how many elements changed value (int64, on the GPU: no
    host sync). The rows of one block are consecutive rows of ``w`` (a whole matrix, or experts stacked whose row
    count is a multiple of block_rows)."""
    if not (w.is_contiguous() and scale.is_contiguous() and nonzero.is_contiguous()):
        raise ValueError("to_block_scales_: the weight, its scales and the nonzero map must be contiguous rows")
    r, k = w.shape
    tile = ROW_TILE if block_rows == 1 else block_rows
    grid = (triton.cdiv(r, tile), triton.cdiv(k, 128))
    changed = torch.empty(grid[0] * grid[1], dtype=torch.int32, device=w.device)
    _to_block_scales_kernel[grid](w.view(torch.uint8), scale, nonzero.view(torch.uint8), exps, changed, r, k,
                                  k // MX_BLOCK, grid[1], BLOCK_ROWS=block_rows, TILE_ROWS=tile,
                                  NO_EXP=NO_EXPONENT, BIAS=E8M0_BIAS, SUB=MX_BLOCK)
    return changed.sum(dtype=torch.int64)
