"""The Hopper MoE path's prefill kernel: SGLang's CUTLASS grouped block-FP8 MoE on the converted weights,
and which layers and batches take it or the one-token GEMV (the rest run SGLang's Triton fused MoE, set up
in quant_methods).

SGLang is imported only when the kernel runs, so this module loads before SGLang's own modules do
(the benchmarks, the tests and ``sglang-mxfp8 doctor`` import it directly).
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

from .envs import env_switch

CUTLASS_PREFILL_ENV = "SGLANG_MXFP8_CUTLASS_PREFILL_MOE"
# H200, Qwen3-30B-A3B MoE layer, CUDA-graph GPU time (benchmarks/RESULTS.md, "CUTLASS grouped MoE for prefill"):
# SGLang's CUTLASS grouped block-FP8 MoE vs its Triton fused MoE: 435.9 vs 447.3 us at 2048 tokens, 719.5 vs
# 769.9 at 4096, 1293.0 vs 1480.3 at 8192; slower at 1024 (303.8 vs 292.2) and below.
CUTLASS_PREFILL_MIN_TOKENS = 2048


# H200, one token, Qwen3-30B-A3B MoE layer (128 experts, top-8), CUDA-graph GPU time over 16 routings
# (benchmarks/RESULTS.md, "GEMV MoE with SiLU-and-mul in its up launch"): the GEMV MoE 16.8 us vs SGLang's Triton
# fused MoE 31.5 (MXFP8) and 36.5 (BF16); served, 4 layers: 65.1 vs 112.4 us of MoE kernels per decode step.
GEMV_MOE_SHAPES = frozenset({(2048, 768)})  # (hidden, intermediate per rank)
MOE_GEMV_ENV = "SGLANG_MXFP8_MOE_GEMV"


def gemv_moe_runs(hidden: int, intermediate: int) -> bool:
    """Whether one-token batches of a Hopper MoE layer take the GEMV MoE: on the shapes it measured faster
    on the H200, unless SGLANG_MXFP8_MOE_GEMV=0."""
    return (hidden, intermediate) in GEMV_MOE_SHAPES and env_switch(MOE_GEMV_ENV, default=True)


def cutlass_prefill_min_tokens() -> int:
    """Smallest batch the Hopper MoE runs on SGLang's CUTLASS grouped MoE instead of its Triton fused MoE
    (0: never; SGLANG_MXFP8_CUTLASS_PREFILL_MOE=0 turns it off)."""
    return CUTLASS_PREFILL_MIN_TOKENS if env_switch(CUTLASS_PREFILL_ENV, default=True) else 0


def fused_moe_unsupported(config, ep_size: int) -> Optional[str]:
    """Why a MoE layer cannot take our own paths, the CUTLASS grouped prefill MoE and the one-token GEMV (they
    compute SiLU-gated experts, combined with the router weights, on all experts of this rank), or None."""
    if config.activation != "silu" or not config.is_gated:
        return f"activation {config.activation} (gated {config.is_gated}); it runs SiLU-gated experts only"
    if config.apply_router_weight_on_input or config.no_combine:
        return "router weights on the input / no combine"
    if config.gemm1_alpha is not None or config.gemm1_clamp_limit is not None:
        return "a clamped or scaled gate"
    if ep_size != 1:
        return f"expert parallel size {ep_size}"
    return None


class CutlassGroupedMoE:
    """SGLang's CUTLASS grouped block-FP8 MoE (sgl_kernel ``fp8_blockwise_scaled_grouped_mm``) on the
    converted weights, for prefill batches. It reads transposed views of the FP8 weights and their 128x128
    scales (nothing copied). Its pointer, problem-size and workspace tensors are rewritten by every call and
    its strides depend only on the layer shape, so the layers of one shape on one device, which run one
    after another on the stream, share one set.
    expert_specialized: both GEMMs through sgl_kernel's SM90 expert-specialized grouped GEMM."""

    _scratch: Dict[tuple, Dict[str, torch.Tensor]] = {}

    def __init__(self, experts: int, hidden: int, intermediate: int, device, expert_specialized: bool = False):
        self.enable_es = (expert_specialized, expert_specialized)
        key = (experts, hidden, intermediate, str(device))
        if key not in self._scratch:
            i64 = dict(dtype=torch.int64, device=device)
            i32 = dict(dtype=torch.int32, device=device)
            self._scratch[key] = dict(
                a1_strides=torch.full((experts,), hidden, **i64), c1_strides=torch.full((experts,), 2 * intermediate, **i64),
                a2_strides=torch.full((experts,), intermediate, **i64), c2_strides=torch.full((experts,), hidden, **i64),
                workspace=torch.empty(7182 * 1024, dtype=torch.uint8, device=device),  # the size SGLang allocates
                **{n: torch.empty(experts, **i64) for n in ("a_ptrs", "b_ptrs", "out_ptrs", "a_scales_ptrs", "b_scales_ptrs")},
                expert_offsets=torch.empty(experts + 1, **i32),
                problem_sizes1=torch.empty(experts, 3, **i32), problem_sizes2=torch.empty(experts, 3, **i32),
            )
        self.scratch = self._scratch[key]

    def __call__(self, x, topk_weights, topk_ids, w13, w2, w13_block_scale, w2_block_scale) -> torch.Tensor:
        from sglang.srt.layers.moe.cutlass_moe import cutlass_fused_experts_fp8

        return cutlass_fused_experts_fp8(
            x, w13.transpose(1, 2), w2.transpose(1, 2), w13_block_scale.transpose(1, 2), w2_block_scale.transpose(1, 2),
            topk_weights, topk_ids, use_fp8_blockscale=True, enable_es=self.enable_es, **self.scratch,
        )
