from __future__ import annotations

import torch

from ...ops.flashinfer_jit import blockscale_gemm, tile_configs
from ... import platform
from ..base import OK, WeightLayout
from ..precompile import compile_before_flashinfer, precompile_batches
from .hopper_layout import HopperBlockScaleKernel, block_scale


class FlashInferSm90(HopperBlockScaleKernel):
    """FlashInfer ``fp8_blockscale_gemm_sm90``: BF16 input (quantized 1x128 inside), 128x128 weight scales. On
    FlashInfer 0.6.7.post3 the only input combination of that op measured numerically right on an H200 (per-row
    weight scales and external FP8 inputs gave 23-39% error). Its module is built with the DeepGEMM path alone
    (ops/flashinfer_jit/blockscale_gemm.py)."""

    name = "flashinfer_sm90"
    title = "FlashInfer fp8_blockscale_gemm_sm90, BF16 in, 128x128 weight scales"
    layout = WeightLayout(scale_rows=128)

    def missing(self, gpu):
        return platform.flashinfer_missing()

    def can_implement(self, spec):
        if spec.k % 128 or spec.n % 64:
            return False, f"needs K % 128 == 0 and N % 64 == 0 (N={spec.n}, K={spec.k})"
        return OK

    def prebuild(self):
        blockscale_gemm.build_dense()

    def gemm(self, layer, state, x, bias):
        out = blockscale_gemm.blockscale_gemm(x, layer.weight, block_scale(state), x.dtype)
        return out if bias is None else out + bias

    def precompile(self, layer, state, min_m, max_m):
        """Every tile config the op can select for min_m..max_m tokens: it compiles each with nvcc on first use, and
        a served batch that meets a new one stalls for seconds (ops/flashinfer_jit/tile_configs.py). Those not in
        FlashInfer's cache are compiled first by concurrent nvcc processes; running each batch size then loads them."""
        w, dtype = layer.weight, getattr(layer, "orig_dtype", torch.bfloat16)
        n, k = w.shape
        shape = tile_configs.GemmShape(n, k)
        configs = tile_configs.configs_for(shape, min_m, max_m, platform.multiprocessors(w.device))
        compile_before_flashinfer(shape, configs)
        return precompile_batches(
            ("flashinfer_sm90", n, k, dtype, w.device), f"FlashInfer SM90 GEMM [{n} x {k}] tile configs",
            sorted(configs.values()), w.device,
            lambda rows: torch.zeros(rows, k, dtype=dtype, device=w.device),
            lambda x, m: blockscale_gemm.blockscale_gemm(x[:m], w, block_scale(state), dtype))

    def compile_ahead(self, spec, min_m, max_m, num_sms, jobs=None):
        shape = tile_configs.GemmShape(spec.n, spec.k)
        return tile_configs.compile_tile_configs(shape, tile_configs.configs_for(shape, min_m, max_m, num_sms), jobs)
