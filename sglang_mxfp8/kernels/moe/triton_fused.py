from __future__ import annotations

from .common import BlockScaleExperts, size_refusal


class TritonFusedMoE(BlockScaleExperts):
    """SGLang's Triton fused MoE on the weights converted in place to 128x128 power-of-two block scales."""

    name = "triton_moe"
    title = "SGLang's Triton fused MoE, block FP8 128x128 after lossless scale conversion"
    scales_output = True  # SGLang's runner applies routed_scaling_factor

    def can_implement(self, spec):
        return size_refusal(spec, 128, "which SGLang's block-FP8 Triton MoE needs",
                            "the masked W8A8 MoE (triton_w8a8_moe) serves such layers")

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

    def experts(self, layer, state, x, topk_weights, topk_ids):
        """The same fused MoE called directly (what the runner runs, without SGLang's dispatch objects)."""
        from ...compat import sglang_object

        return sglang_object("fused_experts")(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
                                              use_fp8_w8a8=True, w1_scale=state.w13.block_scale,
                                              w2_scale=state.w2.block_scale, block_shape=[128, 128])
