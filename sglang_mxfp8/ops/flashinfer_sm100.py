"""Host side of the Blackwell-native MXFP8 kernels on FlashInfer's real API (SM100/103/107; cutlass dense also
SM110/12x).

Written against FlashInfer 0.6.7.post3 (``mm_mxfp8``, ``mxfp8_quantize``, ``cutlass_fused_moe`` with
``use_mxfp8_act_scaling``). CPU-verified, not run on SM100: layouts and refit behaviour are verified
on CPU (tests/test_blackwell.py; the kernels: kernels/linear/flashinfer_sm100.py, kernels/moe/flashinfer_cutlass.py),
including an emulated forward that undoes every prepared layout.

Refit rules as on Hopper: the loader's parameters keep checkpoint shapes; swizzled scales live in
buffers allocated once and rewritten in place; the trtllm GEMM's row shuffle is applied to the FP8
weight in place (its storage is allocated padded to a multiple of 128 rows at creation, the
parameter being a view of the first N rows), tracked per row so it is never applied twice.
"""

from __future__ import annotations

import torch

from ..format.numerics import MX_BLOCK
from ..layouts.blackwell import CutlassMoeScales

SM100_ONLY_QUANTIZE = (100, 103, 107, 110, 120, 121)


def require_mxfp8_quantize_kernel(capability, gpu_name: str) -> None:
    """FlashInfer's CUDA ``mxfp8_quantize`` compiles to an empty body below SM100 and returns garbage."""
    major, minor = capability
    if major * 10 + minor not in SM100_ONLY_QUANTIZE:
        raise RuntimeError(
            f"FlashInfer mxfp8_quantize has no kernel body for SM{major}{minor} ({gpu_name}) and would return "
            "uninitialised memory; use the Hopper paths (--fp8-gemm-backend triton or flashinfer_trtllm)"
        )


def mxfp8_quantize_activation(x: torch.Tensor, layout: str):
    """x [M, K] bf16 -> (e4m3 [M, K], 1-D swizzled uint8 scales) with FlashInfer's SM100 kernel."""
    from flashinfer import SfLayout, mxfp8_quantize

    require_mxfp8_quantize_kernel(torch.cuda.get_device_capability(x.device), torch.cuda.get_device_name(x.device))
    sf_layout = {"8x4": SfLayout.layout_8x4, "128x4": SfLayout.layout_128x4}[layout]
    return mxfp8_quantize(x, is_sf_swizzled_layout=True, alignment=MX_BLOCK, sf_swizzle_layout=sf_layout)


def cutlass_mxfp8_moe(x, topk_weights, topk_ids, w13, w2, scales: CutlassMoeScales, *, tp_size=1, tp_rank=0,
                      ep_size=1, ep_rank=0):
    """FlashInfer CUTLASS fused MoE, MXFP8 weights x MXFP8 activations; w13 is [up; gate].

    Autotuning is capped at the batch in hand (next power of two, at most 8192), as SGLang does for
    its ModelOpt CUTLASS MoE, so CUDA-graph batch sizes never trigger tuning for larger shapes.
    """
    from flashinfer.fused_moe import cutlass_fused_moe

    a, a_sf = mxfp8_quantize_activation(x.contiguous(), "128x4")
    out = torch.empty_like(x)
    cutlass_fused_moe(
        input=a, token_selected_experts=topk_ids.to(torch.int32), token_final_scales=topk_weights.float(),
        fc1_expert_weights=w13, fc2_expert_weights=w2, output_dtype=x.dtype, quant_scales=scales.quant_scales(),
        input_sf=a_sf, use_mxfp8_act_scaling=True, tp_size=tp_size, tp_rank=tp_rank, ep_size=ep_size,
        ep_rank=ep_rank, output=out, tune_max_num_tokens=min(8192, 1 << max(0, x.shape[0] - 1).bit_length()),
    )
    return out
