"""FlashInfer's CUTLASS fused MoE (``cutlass_fused_moe``): MXFP8 x MXFP8 on Blackwell, FP8 block scales on Hopper."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ...ops.flashinfer_jit import fused_moe, tile_configs
from ...layouts.blackwell import CutlassMoeScales
from ...ops.flashinfer_sm100 import cutlass_mxfp8_moe
from ... import platform
from ..base import OK, LayerState, MoEKernel, WeightLayout
from ..precompile import compile_before_flashinfer, precompile_batches
from ...flags import MOE_FLAG
from .common import BlockScaleExperts, experts_on_first_rows, routed_batch, standard_sized_experts


@dataclass(slots=True)
class CutlassMxfp8MoEState(LayerState):
    scales: Optional[CutlassMoeScales] = None  # per-expert 128x4-swizzled scales, rewritten in place


class FlashInferCutlassMxfp8MoE(MoEKernel):
    """``cutlass_fused_moe`` with MXFP8 weights and activations (``use_mxfp8_act_scaling``), w13 as [up; gate],
    per-expert 128x4-swizzled scales rewritten in place after every load. CPU-verified, not run on SM100."""

    name = "flashinfer_cutlass_mxfp8_moe"
    title = "FlashInfer cutlass_fused_moe MXFP8 x MXFP8, [up; gate] order"
    archs = ("sm100",)
    layout = WeightLayout(up_first=True)
    state_type = CutlassMxfp8MoEState
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


class FlashInferCutlassSm90MoE(BlockScaleExperts):
    """``cutlass_fused_moe`` in its DeepSeek FP8 block-scale mode on Hopper, from the trimmed JIT module
    (ops/flashinfer_jit/fused_moe.py: the BF16 x FP8 runner alone, 18 sources instead of FlashInfer's 181). The module
    is built into FlashInfer's cache once and reused after: at launch, in the background, and waited for at its first
    call (the load's precompile, else the first forward), so that the weights load and the other kernels compile
    meanwhile. Reads the same converted weights as the Triton MoE (128x128 power-of-two block scales), w13 as [up;
    gate]; quantizes the activations per 1x128 group itself. The base where --moe-runner-backend flashinfer_cutlass asks
    for it, not under auto: on the H200 it measured 0.55-0.87x the speed of SGLang's Triton MoE, so band kernels that
    read its w13 order take the batches where they measured faster (the registry)."""

    name = "flashinfer_cutlass_moe_sm90"
    title = "FlashInfer cutlass_fused_moe, DeepSeek FP8 block scales (trimmed SM90 build)"
    layout = WeightLayout(scale_rows=128, up_first=True)

    def missing(self, gpu):
        return platform.flashinfer_missing() or fused_moe.unsupported()

    def can_implement(self, spec):
        return standard_sized_experts(spec, 128, "which FlashInfer's FP8 block-scale MoE needs (128x128 weight blocks)",
                                      "the masked W8A8 MoE (triton_w8a8_moe) serves such layers")

    def prebuild(self):
        fused_moe.build()

    def experts(self, layer, state, x, topk_weights, topk_ids):
        return fused_moe.block_scale_moe(
            x, topk_weights, topk_ids, layer.w13_weight, layer.w2_weight, state.w13.block_scale, state.w2.block_scale,
            tp_size=layer.moe_tp_size, tp_rank=layer.moe_tp_rank)

    def precompile(self, layer, state, min_m, max_m):
        """One batch per tile config either grouped GEMM can pick for min_m..max_m tokens (the fused MoE compiles
        each with nvcc on first use, like the dense op: ops/flashinfer_jit/tile_configs.py), those not in FlashInfer's
        cache compiled first by concurrent nvcc processes."""
        top_k, dev = layer.top_k, layer.w13_weight.device
        experts, hidden, intermediate = layer.w2_weight.shape
        num_sms, firsts = platform.multiprocessors(dev), set()
        for shape in tile_configs.moe_gemm_shapes(experts, hidden, intermediate):
            configs = tile_configs.configs_for(shape, min_m, max_m, num_sms)
            compile_before_flashinfer(shape, configs)
            firsts.update(configs.values())
        return precompile_batches(
            (self.name, experts, hidden, intermediate, top_k, dev),
            f"FlashInfer SM90 fused MoE ({experts} experts, top-{top_k}) tile configs", sorted(firsts), dev,
            routed_batch(hidden, experts, top_k, dev), experts_on_first_rows(self, layer, state))

    def compile_ahead(self, spec, min_m, max_m, num_sms, jobs=None):
        return sum(tile_configs.compile_tile_configs(shape, tile_configs.configs_for(shape, min_m, max_m, num_sms),
                                                        jobs)
                   for shape in tile_configs.moe_gemm_shapes(spec.experts, spec.hidden, spec.intermediate))
