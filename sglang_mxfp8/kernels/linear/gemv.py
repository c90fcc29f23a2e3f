from __future__ import annotations

import torch

from ..base import OK, LinearKernel
from .hopper_layout import block_scale


class Gemv(LinearKernel):
    """Weight-streaming GEMV for one-token batches (batch-1 decode): no activation quantization, on the layer
    shapes it measured faster than the base kernel beside it."""

    name = "gemv"
    title = "weight-streaming one-token GEMV"
    archs = ("sm90",)

    def __init__(self, shapes):
        self.shapes = frozenset(shapes)  # served (N, K)

    def can_implement(self, spec):
        if spec.dtype != torch.bfloat16:
            return False, f"a {str(spec.dtype).replace('torch.', '')} model (it reads bf16 activations)"
        if (spec.n, spec.k) not in self.shapes:
            return False, f"[{spec.n} x {spec.k}] is not among the shapes it measured faster on"
        return OK

    def gemm(self, layer, state, x, bias):
        from ...ops.triton_sm90.gemv import w8a16_gemv

        return w8a16_gemv(x, layer.weight, block_scale(state), state.converter.block_rows, bias)
