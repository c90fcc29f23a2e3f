from __future__ import annotations

from typing import Dict, Tuple

import torch

from ..base import OK, LinearKernel
from .hopper_layout import block_scale


class SplitKW8A8(LinearKernel):
    """W8A8 GEMM for 2-128 tokens that reads the FP8 weight once, split along K so every SM streams it, the activation
    quantized inside (before the launch from 64 tokens); reads either Hopper scale layout. The layers of one width
    share one workspace (allocated when the first is built, never during a capture), as they run one after another
    on the stream."""

    name = "splitk_w8a8"
    title = "split-K W8A8 GEMM for up to 128 tokens, the weight read once"
    archs = ("sm90",)
    _workspaces: Dict[Tuple[int, str], object] = {}

    def can_implement(self, spec):
        if spec.dtype not in (torch.bfloat16, torch.float16):
            return False, f"a {str(spec.dtype).replace('torch.', '')} model (it reads bf16 or fp16 activations)"
        return OK

    def create_buffers(self, layer, spec, state):
        from ...ops.triton_sm90.splitk_w8a8 import SplitKWorkspace

        key = _workspace_key(layer.weight)
        if key not in self._workspaces:
            self._workspaces[key] = SplitKWorkspace(spec.n, layer.weight.device)

    def gemm(self, layer, state, x, bias):
        from ...ops.triton_sm90.splitk_w8a8 import splitk_w8a8_gemm

        return splitk_w8a8_gemm(x, layer.weight, block_scale(state), bias, scale_rows=state.converter.block_rows,
                                workspace=self._workspaces[_workspace_key(layer.weight)])


def _workspace_key(weight: torch.Tensor) -> Tuple[int, str]:
    """The workspace a layer shares with the others of its width on its device."""
    return weight.shape[0], str(weight.device)
