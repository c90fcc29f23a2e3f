from __future__ import annotations

from ..base import OK, LinearKernel, WeightLayout
from .hopper_layout import block_scale


class CublasBlockScale(LinearKernel):
    """cuBLAS's block-scaled FP8 GEMM through torch's ``scaled_mm`` (cuBLASLt 12.9+): the same operands and scales
    as FlashInfer's GEMM, our 1x128 activation quantizer in front."""

    name = "cublas"
    title = "cuBLAS block-scaled FP8 GEMM (torch scaled_mm)"
    archs = ("sm90",)
    layout = WeightLayout(scale_rows=128)

    def missing(self, gpu):
        from ...ops import cublas_sm90

        return cublas_sm90.unsupported()

    def can_implement(self, spec):
        if spec.k % 512 or spec.n % 128:
            return False, f"needs whole 128x128 blocks with K / 128 a multiple of 4 (N={spec.n}, K={spec.k})"
        return OK

    def gemm(self, layer, state, x, bias):
        from ...ops.cublas_sm90 import blockscale_gemm

        return blockscale_gemm(x, layer.weight, block_scale(state), bias, x.dtype)
