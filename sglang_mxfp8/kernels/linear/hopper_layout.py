"""What the Hopper base kernels share: the MXFP8 weight converted in place to power-of-two block scales
(``layouts.hopper.BlockScaleConverter``), with the float32 scales in a buffer allocated once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ...layouts.hopper import BlockScaleConverter
from ..base import LayerState, LinearKernel


@dataclass(slots=True)
class HopperLinearState(LayerState):
    converter: Optional[BlockScaleConverter] = None  # the weight's block scales, written by the base kernel


class HopperBlockScaleKernel(LinearKernel):
    archs = ("sm90",)
    state_type = HopperLinearState

    def create_buffers(self, layer, spec, state: HopperLinearState) -> None:
        state.converter = BlockScaleConverter(1, spec.n, spec.k, self.layout.scale_rows, layer.weight.device, spec.name)

    def process_weights_after_loading(self, layer, state: HopperLinearState, scale):
        return state.converter.refresh(layer.weight.data, scale.data)


def block_scale(state: HopperLinearState):
    """The converted [N / rows, K / 128] float32 scales of a Hopper layer (whichever rows its base kernel wrote)."""
    return state.converter.block_scale[0]
