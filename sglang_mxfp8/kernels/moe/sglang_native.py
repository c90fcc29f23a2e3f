from __future__ import annotations

from ... import platform
from ..base import NativeKernel
from .common import size_refusal


class SglangNativeMoE(NativeKernel):
    """SGLang's own MXFP8 MoE runner for one ``--moe-runner-backend`` value (flashinfer_trtllm(_routed), cutlass):
    SGLang's method runs the layer; this package only picks it."""

    title = "SGLang's own MXFP8 MoE runner"
    archs = ("sm100",)

    def __init__(self, runner: str):
        self.runner = runner
        self.name = f"sglang_{runner}_moe"
        self.title = f"SGLang's own MXFP8 MoE runner ({runner})"

    def missing(self, gpu):
        return platform.flashinfer_missing() if self.runner.startswith("flashinfer") else None

    def can_implement(self, spec):
        return size_refusal(spec, 32, "the MXFP8 scale block", "MXFP8 MoE cannot hold it")
