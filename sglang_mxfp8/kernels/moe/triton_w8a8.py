from __future__ import annotations

from ..base import WeightLayout
from .common import BlockScaleExperts, standard_sized_experts


class TritonW8A8MoE(BlockScaleExperts):
    """Our Triton W8A8 fused MoE (ops/triton_sm90/moe_sorted.py) on the converted 128x128 block scales, its K and N
    tails masked: it serves the layers whose hidden or intermediate size is a multiple of MXFP8's 32 but not of the
    128 that SGLang's block-FP8 MoE kernels need (gpt-oss's hidden 2880, SmolLM-class 576 / 960), nothing padded.
    Ran on the H100 and H200 (tests/gpu)."""

    name = "triton_w8a8_moe"
    title = "our Triton W8A8 fused MoE, K and N tails masked"
    layout = WeightLayout(scale_rows=128, either_w13_order=True)

    def can_implement(self, spec):
        return standard_sized_experts(
            spec, 32, "MXFP8's scale block", "keep this MoE layer BF16 (modules_to_not_convert)"
        )

    def experts(self, layer, state, x, topk_weights, topk_ids):
        from ...ops.triton_sm90.moe_sorted import moe_w8a8

        return moe_w8a8(x, layer.w13_weight, state.w13.block_scale, layer.w2_weight, state.w2.block_scale,
                        topk_weights, topk_ids, up_first=state.up_first)
