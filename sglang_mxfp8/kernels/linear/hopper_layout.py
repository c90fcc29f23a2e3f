"""What the Hopper base kernels share: the MXFP8 weight converted in place to power-of-two block scales
(``layouts.hopper.BlockScaleConverter``), with the float32 scales in a buffer allocated once."""

from __future__ import annotations

from ...layouts.hopper import BlockScaleConverter
from ..base import LayerState, LinearKernel


class HopperBlockScaleKernel(LinearKernel):
    archs = ("sm90",)

    def create_buffers(self, layer, spec, state: LayerState) -> None:
        state.converter = BlockScaleConverter(1, spec.n, spec.k, self.scale_rows, layer.weight.device, spec.name)

    def process_weights_after_loading(self, layer, state: LayerState, scale):
        return state.converter.refresh(layer.weight.data, scale.data)


def block_scale(state: LayerState):
    """The converted [N / rows, K / 128] float32 scales of a Hopper layer (whichever rows its base kernel wrote)."""
    return state.converter.block_scale[0]
