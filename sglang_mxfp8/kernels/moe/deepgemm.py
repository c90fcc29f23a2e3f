from __future__ import annotations

from typing import Optional

import torch

from ...ops.deepgemm_sm90 import grouped_precompile_ms
from ... import error_line, platform
from ..base import MoEKernel, WeightLayout
from ..precompile import precompile_batches
from .common import experts_on_first_rows, routed_batch, standard_sized_experts


class DeepGemmGroupedMoE:
    """A prefill batch's MoE on DeepGEMM's grouped FP8 GEMM (contiguous layout; on Hopper its kernel takes 1x128
    activation and 128x128 weight scales in float32: the converted weights and scales as they are, nothing
    copied). Our Triton glue (ops/triton_sm90/moe_segments.py): the tokens quantized and scattered to their experts'
    row segments in one pass, SiLU-and-mul with the quantizer, and the routing-weighted gather. No host sync: the
    buffers take the most rows a routing can need (each expert padded to 128), and DeepGEMM gets each expert's end row
    (its "psum" layout), so it schedules only the rows the routing fills."""

    activation_dtypes = (torch.bfloat16,)  # DeepGEMM writes bf16

    def __init__(self, experts: int, hidden: int, intermediate: int):
        self.experts, self.hidden = experts, hidden

    def __call__(self, x, topk_weights, topk_ids, w13, w2, w13_block_scale, w2_block_scale,
                 up_first: bool = False) -> torch.Tensor:
        """``up_first``: w13 holds [up; gate] (as FlashInfer's fused MoE loads it)."""
        from ...ops.triton_sm90.moe_segments import (SEGMENT_ALIGN, moe_gather, moe_scatter_quant, moe_segments,
                                                     silu_mul_quant)

        deep_gemm = platform.load_deep_gemm()

        m, top_k = topk_ids.shape
        rows = -(-(m * top_k + self.experts * (SEGMENT_ALIGN - 1)) // SEGMENT_ALIGN) * SEGMENT_ALIGN
        cursor, seg_end, ends = moe_segments(topk_ids, self.experts)
        per_expert = dict(use_psum_layout=True, expected_m_for_psum_layout=-(-m * top_k // self.experts))
        a, a_scale, slots = moe_scatter_quant(x, topk_ids, cursor, rows)
        h = torch.empty((rows, w13.shape[1]), dtype=x.dtype, device=x.device)
        up = ((a, a_scale), (w13, w13_block_scale), h, ends)
        deep_gemm.m_grouped_fp8_gemm_nt_contiguous(*up, **per_expert)
        a2, a2_scale = silu_mul_quant(h, seg_end, ends, up_first)
        y = torch.empty((rows, self.hidden), dtype=x.dtype, device=x.device)
        down = ((a2, a2_scale), (w2, w2_block_scale), y, ends)
        deep_gemm.m_grouped_fp8_gemm_nt_contiguous(*down, **per_expert)
        return moe_gather(y, slots, topk_weights)


class DeepGemmPrefillMoE(MoEKernel):
    """DeepGEMM's grouped FP8 GEMM with our Triton glue for prefill batches, on the converted weights."""

    name = "deepgemm_moe"
    title = "DeepGEMM m_grouped_fp8_gemm_nt_contiguous with our Triton glue"
    archs = ("sm90",)
    layout = WeightLayout(scale_rows=128, either_w13_order=True)

    def missing(self, gpu) -> Optional[str]:
        """deep_gemm does not import, or its build lacks the per-expert end-row ("psum") layout of the contiguous
        grouped GEMM or the 128-row alignment our glue writes."""
        why = platform.deep_gemm_missing("m_grouped_fp8_gemm_nt_contiguous", "use_psum_layout")
        if why:
            return why
        from ...ops.triton_sm90.moe_segments import SEGMENT_ALIGN

        try:
            align = platform.load_deep_gemm().get_mk_alignment_for_contiguous_layout()
        except Exception as e:  # noqa: BLE001 - a build whose library does not load here: say why, run without it
            return f"deep_gemm does not run here ({error_line(e)})"
        return None if align == SEGMENT_ALIGN else f"deep_gemm's M alignment is {align}, not {SEGMENT_ALIGN}"

    def can_implement(self, spec):
        return standard_sized_experts(spec, 128, "which its grouped GEMM needs (128x128 weight blocks)",
                                      "its batches go to the base kernel", DeepGemmGroupedMoE.activation_dtypes)

    def create_buffers(self, layer, spec, state):
        state.deepgemm = DeepGemmGroupedMoE(spec.experts, spec.hidden, spec.intermediate)

    def experts(self, layer, state, x, topk_weights, topk_ids):
        return state.deepgemm(x, topk_weights, topk_ids, layer.w13_weight, layer.w2_weight, state.w13.block_scale,
                              state.w2.block_scale, up_first=state.up_first)

    def precompile(self, layer, state, min_m, max_m):
        """One batch per tile config the two grouped GEMMs can pick for min_m..max_m tokens."""
        moe, top_k, dev = state.deepgemm, layer.top_k, layer.w13_weight.device
        return precompile_batches(
            ("deepgemm_moe", moe.experts, moe.hidden, layer.w2_weight.shape[2], top_k, dev),
            f"DeepGEMM grouped MoE ({moe.experts} experts, top-{top_k}) tile configs",
            grouped_precompile_ms(min_m, max_m, top_k, moe.experts), dev,
            routed_batch(moe.hidden, moe.experts, top_k, dev), experts_on_first_rows(self, layer, state))
