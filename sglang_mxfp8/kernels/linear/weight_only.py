from __future__ import annotations

import torch

from ..base import OK, LinearKernel
from .hopper_layout import block_scale


class WeightOnly(LinearKernel):
    """Weight-only FP8 GEMM for small BF16 batches: the activation stays BF16, no quantizer runs."""

    name = "weight_only"
    title = "weight-only FP8 GEMM, BF16 activations"
    archs = ("sm90",)

    def __init__(self, max_n: int):
        self.max_n = max_n

    def can_implement(self, spec):
        if spec.dtype != torch.bfloat16:
            return False, f"a {str(spec.dtype).replace('torch.', '')} model (it reads bf16 activations)"
        if spec.n > self.max_n:
            return False, f"N = {spec.n} > {self.max_n}, where it measured slower than the W8A8 GEMM"
        return OK

    def gemm(self, layer, state, x, bias):
        from ...ops.triton_sm90.dense_w8a16 import w8a16_gemm

        return w8a16_gemm(x, layer.weight, block_scale(state), state.converter.block_rows, bias)
