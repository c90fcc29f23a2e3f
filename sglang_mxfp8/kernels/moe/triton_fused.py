from __future__ import annotations

from ...format.refit import BlockScaleConverter
from ..base import MoEKernel
from .common import size_refusal


class TritonFusedMoE(MoEKernel):
    """SGLang's Triton fused MoE on the weights converted in place to 128x128 power-of-two block scales."""

    name = "triton_moe"
    title = "SGLang's Triton fused MoE, block FP8 128x128 after lossless scale conversion"
    archs = ("sm90",)
    scale_rows = 128
    scales_output = True  # SGLang's runner applies routed_scaling_factor

    def can_implement(self, spec):
        return size_refusal(spec, 128, "which Hopper block-FP8 MoE kernels need",
                            "keep this MoE layer BF16 (modules_to_not_convert)")

    def create_buffers(self, layer, spec, state):
        dev = layer.w13_weight.device
        state.w13 = BlockScaleConverter(spec.experts, layer.w13_weight.shape[1], spec.hidden, 128, dev, f"{spec.name}.w13")
        state.w2 = BlockScaleConverter(spec.experts, spec.hidden, spec.intermediate, 128, dev, f"{spec.name}.w2")

    def process_weights_after_loading(self, layer, state, w13_scale, w2_scale):
        return [state.w13.refresh(layer.w13_weight.data, w13_scale.data),
                state.w2.refresh(layer.w2_weight.data, w2_scale.data)]

    def create_runner(self, layer, state, moe_runner_config):
        from sglang.srt.layers.moe import MoeRunner, MoeRunnerBackend

        state.runner = MoeRunner(MoeRunnerBackend.TRITON, moe_runner_config)

    def apply(self, layer, state, x, dispatch_output, moe_runner_config):
        """SGLang's combine input, as its runner returns it."""
        from sglang.srt.layers.moe.moe_runner.triton import TritonMoeQuantInfo

        quant_info = TritonMoeQuantInfo(
            w13_weight=layer.w13_weight, w2_weight=layer.w2_weight, use_fp8_w8a8=True,
            w13_scale=state.w13.block_scale, w2_scale=state.w2.block_scale, block_shape=[128, 128])
        return state.runner.run(dispatch_output, quant_info)
