"""Blackwell MXFP8 kernel layouts, from the spec, in pure torch (CPU and GPU), with their inverses, and the in-place
forms a load rewrites: the trtllm GEMM's row shuffle of the FP8 weight (its storage padded to 128 rows once, at
creation), and the CUTLASS fused MoE's swizzled scales in buffers allocated once.

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

from ..format.numerics import MX_BLOCK
from .fingerprints import PartialReloadError, row_fingerprints

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


class InPlaceRowShuffle:
    """Applies trtllm-gen's 32-row-block shuffle to a padded FP8 weight in place, once per load."""

    def __init__(self, storage: torch.Tensor, logical_rows: int, name: str):
        self.storage, self.n, self.name = storage, logical_rows, name
        rows = storage.shape[0]
        self.src = shuffle_source_indices(rows, storage.device)
        self._sig_done = torch.zeros(rows, dtype=torch.int64, device=storage.device)
        self._sig_before = torch.zeros_like(self._sig_done)
        self._ever = False

    def refresh(self) -> int:
        """Shuffle the blocks the loader rewrote; returns how many rows were shuffled."""
        w = self.storage.view(torch.uint8)
        rows = w.shape[0]
        cur = row_fingerprints(w, torch.empty_like(self._sig_done))
        if self._ever:
            touched = cur != self._sig_done
            stale = ~touched & (self._sig_done != self._sig_before)
            touched[self.n :] = False  # padding rows are never loaded
            stale[self.n :] = False
            blk = touched.view(-1, SHUFFLE_BLOCK).any(-1)
            mixed = blk & stale.view(-1, SHUFFLE_BLOCK).any(-1)
            if bool(mixed.any()):
                b = int(mixed.nonzero()[0])
                raise PartialReloadError(
                    f"{self.name}: rows {b * 32}..{b * 32 + 31} were partly reloaded inside one 32-row shuffle block; "
                    "reload the whole layer"
                )
        else:
            blk = torch.ones(rows // SHUFFLE_BLOCK, dtype=torch.bool, device=w.device)
        if not bool(blk.any()):
            return 0
        rows_todo = blk.repeat_interleave(SHUFFLE_BLOCK)
        w[self.n :][rows_todo[self.n :]] = 0  # padding back to canonical zeros before re-shuffling
        row_fingerprints(w, cur)
        self._sig_before[rows_todo] = cur[rows_todo]
        for b in blk.nonzero().flatten().tolist():  # 32-row blocks: temporaries stay tiny
            r0 = b * SHUFFLE_BLOCK
            w[r0 : r0 + 32] = w[self.src[r0 : r0 + 32]]
        row_fingerprints(w, cur)
        self._sig_done[rows_todo] = cur[rows_todo]
        self._ever = True
        return int(rows_todo.sum())


def pad_weight_storage(layer: torch.nn.Module, n: int, k: int) -> torch.Tensor:
    """Re-home ``layer.weight`` ([n, k]) as a view of zeroed [ceil(n/128)*128, k] storage (done once, at creation)."""
    n_pad = -(-n // 128) * 128
    storage = torch.zeros((n_pad, k), dtype=layer.weight.dtype, device=layer.weight.device)
    layer.weight.data = storage[:n]
    return storage


class CutlassMoeScales:
    """Per-expert 128x4-swizzled scales packed as int32, the ``quant_scales`` of MXFP8 ``cutlass_fused_moe``.

    fc1: [E, align128(2I), align128(H)/32/4] int32, fc2: [E, align128(H), align128(I)/32/4] int32,
    global scales 1.0 (E8M0 block scales carry everything). Rewritten in place after every load.
    """

    def __init__(self, experts: int, hidden: int, inter: int, device):
        def buf(rows, k):
            n = swizzled_len(rows, k // MX_BLOCK, 128)
            return torch.zeros((experts, n), dtype=torch.uint8, device=device)

        self.shapes = ((2 * inter, hidden), (hidden, inter))
        self.fc1, self.fc2 = buf(2 * inter, hidden), buf(hidden, inter)
        self.ones = torch.ones(experts, dtype=torch.float32, device=device)

    def refresh(self, w13_scale: torch.Tensor, w2_scale: torch.Tensor) -> None:
        for out, s in ((self.fc1, w13_scale), (self.fc2, w2_scale)):
            for e in range(s.shape[0]):
                out[e].copy_(swizzle_128x4(s[e]))

    def quant_scales(self):
        (r1, k1), (r2, k2) = self.shapes
        fc1 = self.fc1.view(torch.int32).view(self.fc1.shape[0], -(-r1 // 128) * 128, -1)
        fc2 = self.fc2.view(torch.int32).view(self.fc2.shape[0], -(-r2 // 128) * 128, -1)
        return [fc1, self.ones, fc2, self.ones]
