"""One read of a loaded MXFP8 weight on the GPU for everything post-load processing must know before converting: its
rows' fingerprints, which 32-element blocks hold a nonzero element, and per row whether a weight byte is NaN, a
scale byte is NaN (255) or a scale is zero under nonzero weights (never loaded). The torch steps it replaces
(``format.checkpoint.validate_loaded`` and ``fingerprints.row_fingerprints``) read the weight about ten times over
through int64 and byte-wide temporaries as large as the weight; the results are the same bit for bit (the
fingerprints are sums modulo 2**64, so their order does not matter)."""

from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl

from ..format.checkpoint import MISSING_SCALE, NAN_SCALE, NAN_WEIGHT
from ..format.numerics import MX_BLOCK

ROWS = 16  # rows per program
BLOCKS = 32  # 32-element blocks per row read at a time: 1 KB of each row
WORD_BLOCK = MX_BLOCK // 4  # int32 words per 32-element block


@triton.jit
def _coefficients(j):
    """Each word's odd coefficient below 2**31 (``fingerprints.row_fingerprints``'s, word ``j`` counted from 0)."""
    return (((j.to(tl.int64) + 1) * 2654435761) & 0x7FFFFFFF) | 1


@triton.jit
def _has_byte_7f(mag):
    return (((mag & 0xFF) == 0x7F) | (((mag >> 8) & 0xFF) == 0x7F) | (((mag >> 16) & 0xFF) == 0x7F)
            | (((mag >> 24) & 0xFF) == 0x7F))


@triton.jit
def _scan_kernel(w_ptr, s_ptr, s_words_ptr, nz_ptr, flags_ptr, sig_w_ptr, sig_s_ptr, R, KS,
                 ROWS: tl.constexpr, BLOCKS: tl.constexpr, WB: tl.constexpr, CHECK: tl.constexpr,
                 SCALE_SIG: tl.constexpr, NAN_W: tl.constexpr, NAN_S: tl.constexpr, MISSING: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < R
    kw = KS * WB  # words per weight row
    acc = tl.zeros((ROWS,), dtype=tl.int64)
    flags = tl.zeros((ROWS,), dtype=tl.int32)
    for b0 in range(0, KS, BLOCKS):
        blocks = b0 + tl.arange(0, BLOCKS)
        block_ok = row_ok[:, None] & (blocks[None, :] < KS)
        j = blocks[None, :, None] * WB + tl.arange(0, WB)[None, None, :]  # [1, BLOCKS, WB] word index in the row
        ok = block_ok[:, :, None]
        words = tl.load(w_ptr + rows[:, None, None].to(tl.int64) * kw + j, mask=ok, other=0)
        acc += tl.sum(tl.sum(words.to(tl.int64) * _coefficients(j), axis=2), axis=1)
        if CHECK:
            mag = words & 0x7F7F7F7F  # each byte's magnitude: 0x7F is e4m3's NaN, the largest there is
            nonzero = tl.max(mag, axis=2) != 0
            nan_w = tl.max(_has_byte_7f(mag).to(tl.int32), axis=2) != 0
            at = rows[:, None].to(tl.int64) * KS + blocks[None, :]
            tl.store(nz_ptr + at, nonzero.to(tl.uint8), mask=block_ok)
            sc = tl.load(s_ptr + at, mask=block_ok, other=1).to(tl.int32)
            flags = (flags | tl.max(tl.where(nan_w & block_ok, NAN_W, 0), axis=1)
                     | tl.max(tl.where(sc == 255, NAN_S, 0), axis=1)
                     | tl.max(tl.where((sc == 0) & nonzero & block_ok, MISSING, 0), axis=1))
    tl.store(sig_w_ptr + rows, acc, mask=row_ok)
    if CHECK:
        tl.store(flags_ptr + rows, flags, mask=row_ok)
    if SCALE_SIG:  # the scale row's own fingerprint (its width a multiple of 4 bytes)
        sw = KS // 4
        acc_s = tl.zeros((ROWS,), dtype=tl.int64)
        for k0 in range(0, sw, BLOCKS * WB):
            js = k0 + tl.arange(0, BLOCKS * WB)
            ok_s = row_ok[:, None] & (js[None, :] < sw)
            sw_words = tl.load(s_words_ptr + rows[:, None].to(tl.int64) * sw + js[None, :], mask=ok_s, other=0)
            acc_s += tl.sum(sw_words.to(tl.int64) * _coefficients(js)[None, :], axis=1)
        tl.store(sig_s_ptr + rows, acc_s, mask=row_ok)


def _launch(w: torch.Tensor, s: torch.Tensor, check: bool, scale_sig: bool, sig_w: torch.Tensor,
            sig_s: torch.Tensor):
    r, k = w.shape
    ks = k // MX_BLOCK
    nonzero = torch.empty((r, ks) if check else (1, 1), dtype=torch.bool, device=w.device)
    flags = torch.empty(r if check else 1, dtype=torch.int32, device=w.device)
    if r == 0:
        return nonzero, flags
    words, s = w.view(torch.uint8).view(torch.int32), s.view(torch.uint8)
    s_words = s.view(torch.int32) if scale_sig else s
    _scan_kernel[(triton.cdiv(r, ROWS),)](words, s, s_words, nonzero.view(torch.uint8), flags, sig_w, sig_s, r, ks,
                                           ROWS=ROWS, BLOCKS=BLOCKS, WB=WORD_BLOCK, CHECK=check, SCALE_SIG=scale_sig,
                                           NAN_W=NAN_WEIGHT, NAN_S=NAN_SCALE, MISSING=MISSING_SCALE)
    return nonzero, flags


def scan_loaded(w: torch.Tensor, s: torch.Tensor, sig_w: torch.Tensor,
                sig_s: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, bool]:
    """For e4m3 ``w [R, K]`` and its UE8M0 ``s [R, K/32]`` (contiguous): writes the rows' fingerprints of ``w`` into
    ``sig_w`` and, where a scale row is a multiple of 4 bytes, of ``s`` into ``sig_s``; returns (which blocks hold a
    nonzero element, bool ``[R, K/32]``; per row the bits NAN_WEIGHT | NAN_SCALE | MISSING_SCALE, int32 ``[R]``;
    whether ``sig_s`` was written). One launch, no host sync."""
    if not (w.is_contiguous() and s.is_contiguous()) or w.shape[1] % MX_BLOCK or (
            s.shape != (w.shape[0], w.shape[1] // MX_BLOCK)):
        raise ValueError(f"scan_loaded: a contiguous weight [R, K] with K % 32 == 0 and its scale [R, K/32], got "
                         f"{tuple(w.shape)} and {tuple(s.shape)}")
    scale_sig = (w.shape[1] // MX_BLOCK) % 4 == 0
    nonzero, flags = _launch(w, s, True, scale_sig, sig_w, sig_s)
    return nonzero, flags, scale_sig


def fingerprint_rows(w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``fingerprints.row_fingerprints`` of a contiguous ``w [R, K]`` of bytes (K % 32 == 0) in one read."""
    _launch(w, w, False, False, out, out)
    return out
