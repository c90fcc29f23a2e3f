"""Checks the Hopper GPU tests share: a CUDA graph replay against the eager call, and a refit of a MoE layer as
SGLang's loader does it (other MXFP8 weights copied into the layer's storage, then the plan's post-load processing)
with the checks every refit must pass."""

import torch

from sglang_mxfp8.format.numerics import quantize_mxfp8


def assert_graph_replay_equals_eager(run, x):
    """``run()`` captured in a CUDA graph, its input ``x`` then overwritten with fresh values: a replay gives exactly
    what ``run()`` gives eagerly on them (the graph reads x's storage, not the values at capture)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(captured, run())


def storage(layer, state):
    """Where the layer's weights and derived buffers live (CUDA graphs keep these pointers)."""
    return {n: t.data_ptr() for n, t in [("w13", layer.w13_weight), ("w2", layer.w2_weight), *state.tensors()]}


def load_other_experts(layer, plan, state, generator):
    """Fresh random MXFP8 experts written in place and processed; returns their checkpoint scales."""
    w13, s13 = quantize_mxfp8(torch.randn(layer.w13_weight.shape, device="cuda", generator=generator) * 0.05)
    w2, s2 = quantize_mxfp8(torch.randn(layer.w2_weight.shape, device="cuda", generator=generator) * 0.05)
    layer.w13_weight.data.copy_(w13)
    layer.w2_weight.data.copy_(w2)
    plan.process_weights_after_loading(layer, state, s13, s2)
    return s13, s2


def assert_processing_again_changes_nothing(layer, plan, state, scales, run, out):
    """Post-load processing run a second time on the same load converts no row, leaves the FP8 weights' bits and the
    output as they were."""
    before = layer.w13_weight.clone()
    stats = plan.process_weights_after_loading(layer, state, *scales)
    assert all(s.converted_rows == 0 for s in stats)
    assert torch.equal(before.view(torch.uint8), layer.w13_weight.view(torch.uint8))
    assert torch.equal(run(), out)
