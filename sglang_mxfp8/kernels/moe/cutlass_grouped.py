from __future__ import annotations

import functools
import types
from typing import Callable, Dict, Optional

import torch

from ... import error_line
from ..base import MoEKernel, WeightLayout
from .common import standard_sized_experts


class CutlassGroupedMoE:
    """SGLang's CUTLASS grouped block-FP8 MoE (sgl_kernel ``fp8_blockwise_scaled_grouped_mm``) on the
    converted weights, for prefill batches. It reads transposed views of the FP8 weights and their 128x128
    scales (nothing copied). Its pointer, problem-size and workspace tensors are rewritten by every call and
    its strides depend only on the layer shape, so the layers of one shape on one device, which run one
    after another on the stream, share one set.
    expert_specialized: both GEMMs through sgl_kernel's SM90 expert-specialized grouped GEMM; up_first: w13 holds
    [up; gate] rows (FlashInfer's fused-MoE order), through :func:`up_first_fused_experts`."""

    _scratch: Dict[tuple, Dict[str, torch.Tensor]] = {}
    activation_dtypes = (torch.bfloat16, torch.float16)

    def __init__(self, experts: int, hidden: int, intermediate: int, device, expert_specialized: bool = False,
                 up_first: bool = False):
        self.enable_es = (expert_specialized, expert_specialized)
        self.up_first = up_first
        key = (experts, hidden, intermediate, str(device))
        if key not in self._scratch:
            i64 = dict(dtype=torch.int64, device=device)
            i32 = dict(dtype=torch.int32, device=device)
            self._scratch[key] = dict(
                a1_strides=torch.full((experts,), hidden, **i64),
                c1_strides=torch.full((experts,), 2 * intermediate, **i64),
                a2_strides=torch.full((experts,), intermediate, **i64),
                c2_strides=torch.full((experts,), hidden, **i64),
                workspace=torch.empty(7182 * 1024, dtype=torch.uint8, device=device),  # the size SGLang allocates
                **{
                    n: torch.empty(experts, **i64)
                    for n in ("a_ptrs", "b_ptrs", "out_ptrs", "a_scales_ptrs", "b_scales_ptrs")
                },
                expert_offsets=torch.empty(experts + 1, **i32),
                problem_sizes1=torch.empty(experts, 3, **i32),
                problem_sizes2=torch.empty(experts, 3, **i32),
            )
        self.scratch = self._scratch[key]

    def __call__(self, x, topk_weights, topk_ids, w13, w2, w13_block_scale, w2_block_scale) -> torch.Tensor:
        from sglang.srt.layers.moe.cutlass_moe import cutlass_fused_experts_fp8

        fused_experts = up_first_fused_experts() if self.up_first else cutlass_fused_experts_fp8
        return fused_experts(
            x, w13.transpose(1, 2), w2.transpose(1, 2), w13_block_scale.transpose(1, 2), w2_block_scale.transpose(1, 2),
            topk_weights, topk_ids, use_fp8_blockscale=True, enable_es=self.enable_es, **self.scratch,
        )


@functools.lru_cache(maxsize=None)
def up_first_fused_experts() -> Optional[Callable]:
    """SGLang's ``cutlass_fused_experts_fp8`` as it is, but for its activation step: the same code, its module's names,
    but ``silu_and_mul`` reads GEMM1's output as [up | gate] (ops/triton_sm90/silu_and_mul.py). Every other call, and
    its sgl_kernel signatures, stay the installed SGLang's. None where that function calls no ``silu_and_mul``."""
    from sglang.srt.layers.moe import cutlass_moe

    from ...ops.triton_sm90.silu_and_mul import silu_and_mul_up_first

    original = cutlass_moe.cutlass_fused_experts_fp8
    if "silu_and_mul" not in original.__code__.co_names:
        return None
    names = dict(original.__globals__, silu_and_mul=silu_and_mul_up_first)
    clone = types.FunctionType(original.__code__, names, original.__name__, original.__defaults__,
                               original.__closure__)
    clone.__kwdefaults__ = original.__kwdefaults__
    return clone


class CutlassGroupedPrefillMoE(MoEKernel):
    """SGLang's CUTLASS grouped block-FP8 MoE for prefill batches, on the converted weights."""

    name = "cutlass_moe"
    title = "SGLang's CUTLASS grouped block-FP8 MoE"
    archs = ("sm90",)
    layout = WeightLayout(scale_rows=128)

    def can_implement(self, spec):
        return standard_sized_experts(spec, 128, "which its grouped GEMM needs (128x128 weight blocks)",
                                      "its batches go to the base kernel", CutlassGroupedMoE.activation_dtypes)

    def create_buffers(self, layer, spec, state):
        state.cutlass = CutlassGroupedMoE(spec.experts, spec.hidden, spec.intermediate, layer.w13_weight.device)

    def experts(self, layer, state, x, topk_weights, topk_ids):
        return state.cutlass(x, topk_weights, topk_ids, layer.w13_weight, layer.w2_weight, state.w13.block_scale,
                             state.w2.block_scale)


class CutlassGroupedUpFirstPrefillMoE(CutlassGroupedPrefillMoE):
    """SGLang's CUTLASS grouped block-FP8 MoE for prefill batches on w13 as FlashInfer's fused MoE loads it ([up;
    gate]): the base --moe-runner-backend flashinfer_cutlass writes on Hopper."""

    name = "cutlass_moe_up_first"
    title = "SGLang's CUTLASS grouped block-FP8 MoE, w13 as [up; gate]"
    layout = WeightLayout(scale_rows=128, up_first=True)

    def missing(self, gpu) -> Optional[str]:
        try:
            found = up_first_fused_experts()
        except ImportError as e:
            return f"SGLang's CUTLASS MoE does not import ({error_line(e)})"
        return None if found else "SGLang's cutlass_fused_experts_fp8 calls no silu_and_mul here"

    def create_buffers(self, layer, spec, state):
        state.cutlass = CutlassGroupedMoE(spec.experts, spec.hidden, spec.intermediate, layer.w13_weight.device,
                                          up_first=True)
