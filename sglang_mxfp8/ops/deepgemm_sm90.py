"""DeepGEMM's dense FP8 GEMM on Hopper (``deep_gemm.fp8_gemm_nt``; the ``sgl-deep-gemm`` wheel or a source build).
It takes the FlashInfer layout's operands as they are: the e4m3 weight with one float32 scale per 128x128 block, the
activation quantized per (token, 128 columns) by our Triton kernel with its scales token-fastest.

DeepGEMM compiles one kernel per tile config with nvcc the first time the config runs (cached on disk under
$DG_JIT_CACHE_DIR, default ~/.deep_gemm). On SM90 the config of an [M, K] x [N, K]^T product with M > 32 depends on
M only through ceil(M / 64) (csrc/jit_kernels/heuristics/sm90.hpp: block M 64, 128 or 256, waves counted from
ceil(M / block M)), so :func:`precompile_ms` lists one M per 64 rows of a batch range.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from ..platform import load_deep_gemm

M_BUCKET = 64  # rows of M that share one DeepGEMM tile config above 32 (module docstring)


def dense_gemm(x: torch.Tensor, w: torch.Tensor, w_block_scale: torch.Tensor,
               bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] bf16 -> [M, N] bf16: x quantized per (token, 128 columns) (rows padded to a multiple of 4, as
    DeepGEMM's TMA reads the token-fastest scales), times w [N, K] e4m3 with w_block_scale [ceil(N / 128), K / 128]
    float32 (one per 128x128 block), float32 accumulation in DeepGEMM."""
    from .triton_sm90.act_quant import quantize_act_1x128

    q, s = quantize_act_1x128(x, m_major=True)
    out = torch.empty((q.shape[0], w.shape[0]), dtype=torch.bfloat16, device=x.device)
    load_deep_gemm().fp8_gemm_nt((q, s), (w, w_block_scale), out)
    out = out[: x.shape[0]]
    return out if bias is None else out + bias


def precompile_ms(min_m: int, max_m: int) -> List[int]:
    """One M per 64-row bucket that a batch of min_m..max_m tokens can fall in (each bucket's largest M)."""
    return list(range(-(-min_m // M_BUCKET) * M_BUCKET, max_m + M_BUCKET, M_BUCKET)) if max_m >= min_m else []


def grouped_precompile_ms(min_m: int, max_m: int, top_k: int, experts: int) -> List[int]:
    """One batch size per tile config DeepGEMM's grouped GEMM can pick for batches of min_m..max_m tokens. On SM90
    its block M is the 128-row alignment and the rest follows from the expected rows per expert we pass,
    ceil(m * top_k / experts), through ceil(that / 128) (csrc/jit_kernels/heuristics/sm90.hpp)."""
    first = {}
    for m in range(min_m, max_m + 1):
        first.setdefault(-(-(-(-m * top_k // experts)) // 128), m)
    return sorted(first.values())
