"""Hopper MXFP8 layers for the benchmarks: a random weight laid out by one base kernel of the registry, and that
kernel alone at every batch size (the plans' other kernels are timed as columns of their own)."""

import torch

from sglang_mxfp8.format.numerics import quantize_mxfp8
from sglang_mxfp8.kernels.base import LayerState, LinearSpec


def linear(base, n, k):
    """(layer, its base kernel's forward x -> y) for a random [n, k] MXFP8 weight; base: registry.TRITON_W8A8 (per-row
    scales) or registry.FLASHINFER_SM90 (128x128 scales)."""
    q, s = quantize_mxfp8(torch.randn(n, k, device="cuda") * 0.02)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(q, requires_grad=False)
    layer.mxfp8_state = LayerState()
    base.create_buffers(layer, LinearSpec("bench", n, k), layer.mxfp8_state)
    base.process_weights_after_loading(layer, layer.mxfp8_state, s)
    return layer, lambda x: base.apply(layer, layer.mxfp8_state, x, None)


def block_scale(layer):
    """The layer's converted float32 weight scales, [N / rows, K / 128]."""
    return layer.mxfp8_state.converter.block_scale[0]
