"""Blackwell MXFP8 kernel layouts, from the spec, in pure torch (CPU and GPU), with their inverses.

- 128x4 scale swizzle (CUTLASS ``mm_mxfp8``, ``cutlass_fused_moe``, trtllm weights): scales of an
  [M, K/32] matrix padded to [128*ceil(M/128), 4*ceil(K/128)] and stored as
  [M/128, Kv/4, 32, 4, 4] = (m-tile, k-tile, row%32, (row%128)//32, col%4) — TRT-LLM's
  ``get_sf_out_offset_128x4``.
- 8x4 scale swizzle (activations of the trtllm GEMM): [M/8, Kv/4, 8, 4] — ``get_sf_out_offset_8x4``.
- trtllm-gen ``shuffleMatrixA`` for epilogue tile 128: within each 32-row block, source row r goes
  to position (r % 4) * 8 + r // 4.

:func:`flashinfer_sf_offset_128x4` and :func:`flashinfer_sf_offset_8x4` are line-by-line ports of the
C++ offset functions; tests check the vectorised swizzles against them and against FlashInfer's own
host helpers where those run on a CPU.
"""

from __future__ import annotations

import torch

SHUFFLE_BLOCK = 32


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def swizzled_len(m: int, kv: int, tile_m: int) -> int:
    return _ceil(m, tile_m) * tile_m * _ceil(kv, 4) * 4


def swizzle_128x4(sf: torch.Tensor) -> torch.Tensor:
    """[M, Kv] uint8 -> 1-D 128x4-swizzled (zero padded)."""
    m, kv = sf.shape
    mt, kt = _ceil(m, 128), _ceil(kv, 4)
    p = torch.nn.functional.pad(sf, (0, kt * 4 - kv, 0, mt * 128 - m))
    return p.view(mt, 4, 32, kt, 4).permute(0, 3, 2, 1, 4).reshape(-1)


def unswizzle_128x4(buf: torch.Tensor, m: int, kv: int) -> torch.Tensor:
    mt, kt = _ceil(m, 128), _ceil(kv, 4)
    return buf.view(mt, kt, 32, 4, 4).permute(0, 3, 2, 1, 4).reshape(mt * 128, kt * 4)[:m, :kv]


def swizzle_8x4(sf: torch.Tensor) -> torch.Tensor:
    m, kv = sf.shape
    mt, kt = _ceil(m, 8), _ceil(kv, 4)
    p = torch.nn.functional.pad(sf, (0, kt * 4 - kv, 0, mt * 8 - m))
    return p.view(mt, 8, kt, 4).permute(0, 2, 1, 3).reshape(-1)


def unswizzle_8x4(buf: torch.Tensor, m: int, kv: int) -> torch.Tensor:
    mt, kt = _ceil(m, 8), _ceil(kv, 4)
    return buf.view(mt, kt, 8, 4).permute(0, 2, 1, 3).reshape(mt * 8, kt * 4)[:m, :kv]


def flashinfer_sf_offset_128x4(m_idx: int, k_idx: int, num_col_vecs: int) -> int:
    inner_k, inner_m, outer_m = k_idx % 4, (m_idx % 128) // 32, m_idx % 32
    k_tile, m_tile = k_idx // 4, m_idx // 128
    num_k_tiles = (num_col_vecs + 3) // 4
    return m_tile * num_k_tiles * 512 + k_tile * 512 + outer_m * 16 + inner_m * 4 + inner_k


def flashinfer_sf_offset_8x4(m_idx: int, k_idx: int, num_cols: int) -> int:
    num_k_tiles = (num_cols + 3) // 4
    return (m_idx // 8) * num_k_tiles * 32 + (k_idx // 4) * 32 + (m_idx % 8) * 4 + k_idx % 4


def shuffle_destination(r: int) -> int:
    """Position within a 32-row block that trtllm-gen's shuffleMatrixA gives source row r."""
    return (r % 4) * 8 + r // 4


def shuffle_source_indices(rows: int, device=None) -> torch.Tensor:
    """``idx`` with ``shuffled = w[idx]`` (rows a multiple of 32)."""
    if rows % SHUFFLE_BLOCK:
        raise ValueError(f"trtllm row shuffle needs rows % 32 == 0, got {rows}")
    src = torch.empty(SHUFFLE_BLOCK, dtype=torch.long)
    for r in range(SHUFFLE_BLOCK):
        src[shuffle_destination(r)] = r
    blocks = torch.arange(rows // SHUFFLE_BLOCK).repeat_interleave(SHUFFLE_BLOCK) * SHUFFLE_BLOCK
    return (blocks + src.repeat(rows // SHUFFLE_BLOCK)).to(device)


def inverse_permutation(idx: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(idx)
    inv[idx] = torch.arange(idx.numel(), device=idx.device)
    return inv
