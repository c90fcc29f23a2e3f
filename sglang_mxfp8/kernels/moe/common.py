"""What the MoE kernels share: size checks, whether a layer's experts are the kind our own kernels compute, the
batches their precompile runs, and the Hopper MoE family's base kernel and layer state."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from ...layouts.hopper import BlockScaleConverter
from ..base import OK, Check, LayerState, MoEKernel, MoESpec, WeightLayout


def non_standard(config, ep_size: int) -> Optional[str]:
    """Why a MoE layer (SGLang's MoeRunnerConfig) cannot take our own MoE kernels, which compute SiLU-gated experts
    combined with the router weights on all experts of this rank, or None."""
    if config.activation != "silu" or not config.is_gated:
        return f"activation {config.activation} (gated {config.is_gated}); it runs SiLU-gated experts only"
    if config.apply_router_weight_on_input or config.no_combine:
        return "router weights on the input / no combine"
    if config.gemm1_alpha is not None or config.gemm1_clamp_limit is not None:
        return "a clamped or scaled gate"
    if ep_size != 1:
        return f"expert parallel size {ep_size}"
    return None


def standard_experts(spec: MoESpec, dtypes=(torch.bfloat16,)) -> Check:
    """Our own MoE kernels: standard experts (:func:`non_standard`), no expert parallelism, these activations."""
    if spec.non_standard:
        return False, spec.non_standard
    if spec.ep != 1:
        return False, f"expert parallel size {spec.ep}"
    if spec.dtype not in dtypes:
        return False, f"a {str(spec.dtype).replace('torch.', '')} model"
    return OK


def size_refusal(spec: MoESpec, multiple: int, needs: str, fix: str) -> Check:
    """The first of hidden and per-rank intermediate size that is not a multiple of ``multiple``, as one line. Where
    tensor parallelism split the intermediate size, the fix is another split (those that work are listed) or expert
    parallelism, which keeps each expert whole."""
    for name, dim in (("hidden size", spec.hidden), ("intermediate size", spec.intermediate)):
        if dim % multiple == 0:
            continue
        tp = spec.tp
        ways = [str(t) for t in range(1, 17) if dim * tp % t == 0 and (dim * tp // t) % multiple == 0]
        if tp > 1 and name == "intermediate size" and ways:
            listed = ", ".join(ways[:-1]) + " or " + ways[-1] if len(ways) > 1 else ways[0]
            return False, (
                f"intermediate size {dim * tp} split {tp} ways by tensor parallelism (--tp / --ep-size) leaves "
                f"{dim} per rank, not a multiple of {multiple}, {needs}; serve with --tp / --ep-size = {listed} "
                "(--ep-size equal to --tp keeps each expert whole on its rank)")
        full = f"{name} {dim * tp}, {dim} per rank," if tp > 1 and name == "intermediate size" else f"{name} {dim}"
        return False, f"{full} is not a multiple of {multiple}, {needs}; {fix}"
    return OK



def standard_sized_experts(spec: MoESpec, multiple: int, needs: str, fix: str, dtypes=(torch.bfloat16,)) -> Check:
    """:func:`standard_experts`, then :func:`size_refusal`: the checks of our own MoE kernels on a block grid."""
    ok, why = standard_experts(spec, dtypes)
    return size_refusal(spec, multiple, needs, fix) if ok else (ok, why)

@dataclass(slots=True)
class HopperMoEState(LayerState):
    w13: Optional[BlockScaleConverter] = None  # the experts' block scales, written by the base kernel
    w2: Optional[BlockScaleConverter] = None
    up_first: bool = False  # w13 holds [up; gate] rows (FlashInfer's fused MoE layout), not SGLang's [gate; up]
    runner: Any = None  # SGLang's MoeRunner (triton_moe)
    deepgemm: Any = None  # the prefill band's buffers (kernels.moe.deepgemm.DeepGemmGroupedMoE)
    cutlass: Any = None  # the prefill band's buffers (kernels.moe.cutlass_grouped.CutlassGroupedMoE)


class BlockScaleExperts(MoEKernel):
    """A Hopper MoE base kernel on the weights converted in place to 128x128 power-of-two block scales: the
    converters (``state.w13``, ``state.w2``) that every Hopper MoE kernel, band or base, reads."""

    archs = ("sm90",)
    layout = WeightLayout(scale_rows=128)
    state_type = HopperMoEState

    def create_buffers(self, layer, spec, state: HopperMoEState):
        """The base kernel's converters (it runs first); a band kernel of this family reads the same ones."""
        if state.w13 is not None:
            return
        state.up_first = self.layout.up_first  # the w13 order every kernel of the plan reads
        dev = layer.w13_weight.device
        state.w13 = BlockScaleConverter(
            spec.experts, layer.w13_weight.shape[1], spec.hidden, 128, dev, f"{spec.name}.w13"
        )
        state.w2 = BlockScaleConverter(spec.experts, spec.hidden, spec.intermediate, 128, dev, f"{spec.name}.w2")

    def process_weights_after_loading(self, layer, state, w13_scale, w2_scale):
        return [state.w13.refresh(layer.w13_weight.data, w13_scale.data),
                state.w2.refresh(layer.w2_weight.data, w2_scale.data)]


def routed_batch(hidden: int, experts: int, top_k: int, device):
    """``make(rows)`` for precompile_batches: zero activations [rows, hidden] (BF16) routed round-robin over all
    experts, equal router weights; returns (x, topk_weights float32, topk_ids int32), the order of ``experts``."""

    def make(rows):
        ids = (torch.arange(rows * top_k, device=device, dtype=torch.int32) % experts).view(-1, top_k)
        return (torch.zeros(rows, hidden, dtype=torch.bfloat16, device=device),
                torch.full(ids.shape, 1.0 / top_k, dtype=torch.float32, device=device), ids)

    return make


def experts_on_first_rows(kernel, layer, state):
    """``run(batch, m)`` for precompile_batches: the kernel's ``experts`` on the first m tokens of a routed_batch."""
    return lambda batch, m: kernel.experts(layer, state, *(t[:m] for t in batch))
