"""FlashInfer's CUTLASS fused MoE (``cutlass_fused_moe``): MXFP8 x MXFP8 on Blackwell; its Hopper FP8 block-scale
build is not started at launch."""

from __future__ import annotations

from ...ops.flashinfer_sm100 import CutlassMoeScales, cutlass_mxfp8_moe
from ... import platform
from ..base import MOE_FLAG, OK, MoEKernel


class FlashInferCutlassMxfp8MoE(MoEKernel):
    """``cutlass_fused_moe`` with MXFP8 weights and activations (``use_mxfp8_act_scaling``), w13 as [up; gate],
    per-expert 128x4-swizzled scales rewritten in place after every load. CPU-verified, not run on SM100."""

    name = "flashinfer_cutlass_mxfp8_moe"
    title = "FlashInfer cutlass_fused_moe MXFP8 x MXFP8, [up; gate] order"
    archs = ("sm100",)
    up_proj_first = True
    scales_output = True  # returned as the kernel writes it (routed_scaling_factor not applied on this path)

    def missing(self, gpu):
        return platform.flashinfer_missing()

    def can_implement(self, spec):
        if spec.intermediate % 128 or spec.hidden % 128:
            return False, (f"it pads gate and up to 128 rows each: hidden {spec.hidden} and intermediate "
                           f"{spec.intermediate} must be multiples of 128; use {MOE_FLAG} flashinfer_trtllm")
        return OK

    def create_buffers(self, layer, spec, state):
        state.scales = CutlassMoeScales(spec.experts, spec.hidden, spec.intermediate, layer.w13_weight.device)

    def process_weights_after_loading(self, layer, state, w13_scale, w2_scale):
        state.scales.refresh(w13_scale.data, w2_scale.data)
        return []

    def experts(self, layer, state, x, topk_weights, topk_ids):
        return cutlass_mxfp8_moe(x, topk_weights, topk_ids, layer.w13_weight, layer.w2_weight, state.scales,
                                 tp_size=layer.moe_tp_size, tp_rank=layer.moe_tp_rank, ep_size=layer.moe_ep_size,
                                 ep_rank=layer.moe_ep_rank)


class FlashInferCutlassSm90MoE(MoEKernel):
    """``cutlass_fused_moe`` in its DeepSeek FP8 block-scale mode on Hopper: FlashInfer's SM90 fused_moe module is a
    JIT build of 181 objects (about 40 min on 16 cores), which this package does not start at launch."""

    name = "flashinfer_cutlass_moe_sm90"
    title = "FlashInfer cutlass_fused_moe, DeepSeek FP8 block scales"
    archs = ("sm90",)
    up_proj_first = True

    def missing(self, gpu):
        return (f"{MOE_FLAG} flashinfer_cutlass on {gpu.label}: FlashInfer's SM90 fused_moe module is a JIT build of "
                f"181 objects (about 40 min on 16 cores) that sglang_mxfp8 does not start at launch; use {MOE_FLAG} "
                "triton (the same block-FP8 weights, SGLang's Triton fused MoE)")
