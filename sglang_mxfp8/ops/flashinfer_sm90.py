"""Host side of FlashInfer's SM90 block-scale GEMM (``fp8_blockscale_gemm_sm90``, FlashInfer 0.6.7.post3).

That op compiles one kernel per tile config with NVRTC the first time the config is used, and keeps
it in memory only, so every server process compiles again. The config follows from M (the tokens in
the batch) by DeepGEMM's wave heuristic: a prefill batch whose M selects a config not seen yet stalls
the server while it compiles (3 s stalls seen on the H200, benchmarks/RESULTS.md). :func:`configs_up_to`
lists every config a layer shape can select up to the largest batch the server runs, so the kernel runs each once at load.

The heuristic is FlashInfer's ``gemm_dispatch`` (csrc/nv_internal/tensorrt_llm/kernels/cutlass_kernels/
fp8_blockscale_gemm/fp8_blockscale_gemm_kernel.cuh) and ``get_best_gemm_config``
(csrc/nv_internal/tensorrt_llm/deep_gemm/jit_utils.cuh), restated here.
"""

from __future__ import annotations

from typing import Dict, NamedTuple

SM90_SMEM_BYTES = 232448
BLOCK_K = 128
SWAP_AB_BELOW_M = 32  # smaller M runs the swap-AB kernel (weight rows as the "M" side)


class TileConfig(NamedTuple):
    swap_ab: bool
    block_m: int
    block_n: int
    stages: int
    multicast: int


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _smem_bytes(stages: int, k: int, block_m: int, block_n: int, swap_ab: bool) -> int:
    scales_k = _cdiv(k, BLOCK_K) * 4
    if not swap_ab:
        per_stage = block_m * BLOCK_K + block_m * 4 + block_n * BLOCK_K
        scales_b = _cdiv(scales_k * (1 if BLOCK_K % block_n == 0 else 2), 8) * 8
        return block_m * block_n * 2 + stages * per_stage + scales_b + stages * 16
    per_stage = block_m * BLOCK_K + _cdiv(block_n * 4, 128) * 128 + block_n * BLOCK_K
    return block_n * block_m * 2 + stages * per_stage + _cdiv(scales_k, 8) * 8 + stages * 16


def _best(m: int, n: int, k: int, num_sms: int, swap_ab: bool) -> TileConfig:
    """DeepGEMM's choice for an [m x k] @ [k x n] problem: fewest waves, then the fullest last wave."""
    block_m = 64 if m <= 64 else 128

    def waves(bn):
        return _cdiv(_cdiv(m, block_m) * _cdiv(n, bn), num_sms)

    def last_wave(bn):
        return (_cdiv(m, block_m) * _cdiv(n, bn)) % num_sms or num_sms

    best = 16
    for bn in range(24, 129, 8):  # 16 is the first candidate; later ones replace it only when strictly better
        if waves(bn) < waves(best) or (waves(bn) == waves(best) and last_wave(bn) > last_wave(best)):
            best = bn
    stages = next(s for s in ((6, 5, 4) if BLOCK_K % best else (8, 7, 6, 5, 4))
                  if _smem_bytes(s, k, block_m, best, swap_ab) <= SM90_SMEM_BYTES)
    wide, other, tile = (n, m, block_m) if swap_ab else (m, n, best)
    multicast = 2 if wide >= 1024 and other % (tile * 2) == 0 and num_sms % 2 == 0 else 1
    return TileConfig(swap_ab, block_m, best, stages, multicast)


def tile_config(m: int, n: int, k: int, num_sms: int) -> TileConfig:
    """The kernel ``fp8_blockscale_gemm_sm90`` compiles and runs for an [m, k] x [n, k]^T product."""
    if m >= SWAP_AB_BELOW_M:
        return _best(m, n, k, num_sms, swap_ab=False)
    return _best(n, m, k, num_sms, swap_ab=True)


def jit_kernel_name(n: int, k: int, cfg: TileConfig) -> str:
    """The name FlashInfer's JIT gives the compiled kernel (its cache key; with TRTLLM_DG_JIT_DUMP_CUBIN=1
    also a folder under $TRTLLM_DG_CACHE_DIR/cache)."""
    g, st = 1, cfg.stages
    return (f"{'gemm_swapAB_' if cfg.swap_ab else 'gemm_'}{n}_{k}_{cfg.block_m}_{cfg.block_n}_{BLOCK_K}_{g}_{st}"
            f"{g}_{st}_{cfg.multicast}_Normal")


def configs_up_to(n: int, k: int, max_m: int, num_sms: int) -> Dict[TileConfig, int]:
    """{config: the smallest M that selects it} over M = 1 .. max_m."""
    seen: Dict[TileConfig, int] = {}
    for m in range(1, max_m + 1):
        seen.setdefault(tile_config(m, n, k, num_sms), m)
    return seen
