from __future__ import annotations

from ..base import OK, NativeKernel


class SglangTritonMxfp8(NativeKernel):
    """SGLang's own Triton ``tl.dot_scaled`` MXFP8 GEMM (tcgen05 on SM100, native on SM120): SGLang's method runs
    the layer; this package only picks it."""

    name = "sglang_triton_mxfp8"
    title = "SGLang's Triton tl.dot_scaled MXFP8 kernel"
    archs = ("sm100", "sm120")

    def can_implement(self, spec):
        return OK  # any K % 32 == 0, which select_linear checks for every kernel
