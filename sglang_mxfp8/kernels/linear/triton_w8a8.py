from __future__ import annotations

from ...ops.triton_sm90.act_quant import quantize_act_1x128
from ...ops.triton_sm90.dense_w8a8 import w8a8_gemm
from ..base import OK, WeightLayout
from .hopper_layout import HopperBlockScaleKernel, block_scale


class TritonW8A8(HopperBlockScaleKernel):
    """Our Triton FP8 GEMM: 1x128 dynamic activation scales x per-row 1x128 weight scales. Any K % 32 == 0
    (the 128-column groups are masked), so it is the Hopper fallback for shapes FlashInfer's GEMM cannot take."""

    name = "triton_w8a8"
    title = "Triton W8A8 FP8 GEMM, 1x128 activation and per-row 1x128 weight scales"
    layout = WeightLayout(scale_rows=1)

    def can_implement(self, spec):
        return OK  # any K % 32 == 0, which select_linear checks for every kernel

    def gemm(self, layer, state, x, bias):
        a_q, a_s = quantize_act_1x128(x)
        return w8a8_gemm(a_q, a_s, layer.weight, block_scale(state), x.dtype, bias)
