from __future__ import annotations

import torch

from ...ops import deepgemm_sm90
from ... import platform
from ..base import OK, LinearKernel, WeightLayout
from ..precompile import precompile_batches
from .hopper_layout import block_scale


class DeepGemmDense(LinearKernel):
    """DeepGEMM's dense FP8 GEMM (``fp8_gemm_nt``) with our 1x128 activation quantizer, on the 128x128 block scales
    the FlashInfer layout keeps (nothing copied)."""

    name = "deepgemm"
    title = "DeepGEMM fp8_gemm_nt"
    archs = ("sm90",)
    layout = WeightLayout(scale_rows=128)

    def missing(self, gpu):
        return platform.deep_gemm_missing("fp8_gemm_nt")

    def can_implement(self, spec):
        if spec.dtype != torch.bfloat16:
            return False, f"a {str(spec.dtype).replace('torch.', '')} model (DeepGEMM writes bf16)"
        if spec.k % 128 or spec.n % 64:
            return False, f"[{spec.n} x {spec.k}] is not a multiple of 128 in K and 64 in N"
        return OK

    def gemm(self, layer, state, x, bias):
        return deepgemm_sm90.dense_gemm(x, layer.weight, block_scale(state), bias)

    def precompile(self, layer, state, min_m, max_m):
        """One batch per 64-row bucket of min_m..max_m: DeepGEMM compiles each tile config with nvcc on first use."""
        w = layer.weight
        n, k = w.shape
        return precompile_batches(
            ("deepgemm", n, k, w.device), f"DeepGEMM FP8 GEMM [{n} x {k}] tile configs",
            deepgemm_sm90.precompile_ms(min_m, max_m), w.device,
            lambda rows: torch.zeros(rows, k, dtype=torch.bfloat16, device=w.device),
            lambda x, m: deepgemm_sm90.dense_gemm(x[:m], w, block_scale(state)))
