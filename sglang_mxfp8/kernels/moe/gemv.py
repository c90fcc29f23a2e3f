from __future__ import annotations

from ..base import OK, MoEKernel, WeightLayout
from .common import standard_experts


class GemvMoE(MoEKernel):
    """One-token batches in two launches (up with SiLU-and-mul, down with the router weights), the weights streamed
    once, no activation quantization; on the layer shapes it measured faster than the Triton fused MoE."""

    name = "moe_gemv"
    title = "two-launch GEMV MoE"
    archs = ("sm90",)
    layout = WeightLayout(scale_rows=128, either_w13_order=True)

    def __init__(self, shapes):
        self.shapes = frozenset(shapes)  # (hidden, intermediate per rank)

    def can_implement(self, spec):
        ok, why = standard_experts(spec)
        if ok and (spec.hidden, spec.intermediate) not in self.shapes:
            return (
                False,
                f"hidden {spec.hidden} / intermediate {spec.intermediate} is not a shape it measured faster on",
            )
        return (ok, why) if not ok else OK

    def experts(self, layer, state, x, topk_weights, topk_ids):
        from ...ops.triton_sm90.gemv import moe_gemv

        return moe_gemv(x, layer.w13_weight, state.w13.block_scale, layer.w2_weight, state.w2.block_scale,
                        topk_weights, topk_ids, up_first=state.up_first)
