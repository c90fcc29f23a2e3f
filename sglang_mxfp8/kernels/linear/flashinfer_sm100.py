"""FlashInfer's ``mm_mxfp8`` on Blackwell: MXFP8 weights x MXFP8 activations, scales in the layouts the kernels read
(written against FlashInfer 0.6.7.post3; CPU-verified through :meth:`emulate`, not run on SM100)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ...layouts import blackwell as layouts
from ...format.numerics import MX_BLOCK
from ...format.checkpoint import validate_loaded
from ...layouts.hopper import ConversionStats
from ...layouts.blackwell import InPlaceRowShuffle, pad_weight_storage
from ...ops.flashinfer_sm100 import mxfp8_quantize_activation
from ... import platform
from ..base import OK, LayerState, LinearKernel


@dataclass(slots=True)
class Sm100LinearState(LayerState):
    name: str = ""
    n: int = 0
    k: int = 0
    storage: Optional[torch.Tensor] = None  # the weight's storage padded to whole 128-row tiles (trtllm)
    shuffle: Optional[InPlaceRowShuffle] = None  # its in-place row shuffle (trtllm)
    scale_shuffled: Optional[torch.Tensor] = None  # row-shuffled, 128x4-swizzled scales (trtllm)
    scale_swizzled: Optional[torch.Tensor] = None  # 128x4-swizzled scales (cutlass)


class _FlashInferMxfp8(LinearKernel):
    state_type = Sm100LinearState

    def missing(self, gpu):
        return platform.flashinfer_missing()


class FlashInferTrtllmMxfp8(_FlashInferMxfp8):
    """``mm_mxfp8(backend="trtllm")``: shuffled weight (in place), shuffled 128x4 scales, 8x4 activation scales."""

    name = "flashinfer_trtllm_mxfp8"
    title = "FlashInfer mm_mxfp8 trtllm, shuffled weight, 8x4 activation scales"
    archs = ("sm100",)

    def can_implement(self, spec):
        if spec.k % 256 or spec.n < 128:
            return False, f"needs K % 256 == 0 and N >= 128 (N={spec.n}, K={spec.k})"
        if spec.dtype != torch.bfloat16:
            return False, "writes bf16 (this model runs in fp16)"
        return OK

    def create_buffers(self, layer, spec, state):
        state.n, state.k = spec.n, spec.k
        state.storage = pad_weight_storage(layer, spec.n, spec.k)
        state.shuffle = InPlaceRowShuffle(state.storage, spec.n, spec.name)
        state.scale_shuffled = torch.empty(layouts.swizzled_len(state.storage.shape[0], spec.k // MX_BLOCK, 128),
                                           dtype=torch.uint8, device=layer.weight.device)
        state.name = spec.name

    @staticmethod
    def prepared_scale(state, scale: torch.Tensor) -> torch.Tensor:
        """shuffle_matrix_sf_a on the N-padded linear scales: row shuffle, then 128x4 swizzle."""
        # padding rows hold zero weights; scale byte 127 (1.0) there, never a zero byte the kernel could reject
        padded = torch.full((state.storage.shape[0], state.k // MX_BLOCK), 127, dtype=torch.uint8, device=scale.device)
        padded[: state.n] = scale
        return layouts.swizzle_128x4(padded[state.shuffle.src])

    def process_weights_after_loading(self, layer, state, scale):
        validate_loaded(layer.weight.data, scale.data, state.name)
        state.scale_shuffled.copy_(self.prepared_scale(state, scale.data))
        return ConversionStats(state.shuffle.refresh(), 0)

    def gemm(self, layer, state, x, bias):
        from flashinfer import mm_mxfp8

        a, a_sf = mxfp8_quantize_activation(x, "8x4")
        out = mm_mxfp8(a, state.storage.t(), a_sf, state.scale_shuffled, out_dtype=torch.bfloat16,
                       use_8x4_sf_layout=True, backend="trtllm")[:, : state.n]
        return out if bias is None else out + bias

    @staticmethod
    def emulate(layer, state, x: torch.Tensor) -> torch.Tensor:
        """What the kernel computes, from the prepared buffers only (float32, CPU-friendly)."""
        from ...format.numerics import dequantize_mxfp8, quantize_mxfp8

        inv = layouts.inverse_permutation(state.shuffle.src)
        rows = state.storage.shape[0]
        sf = layouts.unswizzle_128x4(state.scale_shuffled, rows, state.k // MX_BLOCK)[inv]
        w = dequantize_mxfp8(state.storage.view(torch.uint8)[inv].view(state.storage.dtype), sf)  # e4m3: no CPU gather
        qa, sa = quantize_mxfp8(x.float())
        return (dequantize_mxfp8(qa, sa) @ w.t())[:, : state.n]


class FlashInferCutlassMxfp8(_FlashInferMxfp8):
    """``mm_mxfp8(backend="cutlass")``: canonical weight, 128x4-swizzled scales in a separate buffer."""

    name = "flashinfer_cutlass_mxfp8"
    title = "FlashInfer mm_mxfp8 cutlass, 128x4 swizzled scales"
    archs = ("sm100", "sm110", "sm120")

    def can_implement(self, spec):
        if spec.n < 128 or spec.k < 128:
            return False, f"needs N, K >= 128 (N={spec.n}, K={spec.k})"
        return OK

    def create_buffers(self, layer, spec, state):
        state.n, state.k, state.name = spec.n, spec.k, spec.name
        state.scale_swizzled = torch.empty(layouts.swizzled_len(spec.n, spec.k // MX_BLOCK, 128), dtype=torch.uint8,
                                           device=layer.weight.device)

    def process_weights_after_loading(self, layer, state, scale):
        validate_loaded(layer.weight.data, scale.data, state.name)
        state.scale_swizzled.copy_(layouts.swizzle_128x4(scale.data))
        return ConversionStats(0, 0)

    def gemm(self, layer, state, x, bias):
        from flashinfer import mm_mxfp8

        a, a_sf = mxfp8_quantize_activation(x, "128x4")
        out = mm_mxfp8(a, layer.weight.t(), a_sf, state.scale_swizzled, out_dtype=x.dtype, backend="cutlass")
        return out if bias is None else out + bias

    @staticmethod
    def emulate(layer, state, x):
        from ...format.numerics import dequantize_mxfp8, quantize_mxfp8

        sf = layouts.unswizzle_128x4(state.scale_swizzled, state.n, state.k // MX_BLOCK)
        qa, sa = quantize_mxfp8(x.float())
        return dequantize_mxfp8(qa, sa) @ dequantize_mxfp8(layer.weight, sf).t()
