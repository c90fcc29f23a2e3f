"""Blackwell-native paths, verified without an SM100 GPU: layouts, emulated forward, API contract, refit."""

import inspect

import pytest
import torch

from sglang_mxfp8.layouts import blackwell as layouts
from sglang_mxfp8.format.numerics import dequantize_mxfp8, quantize_mxfp8
from sglang_mxfp8.layouts.fingerprints import PartialReloadError
from sglang_mxfp8.kernels.base import LinearSpec
from sglang_mxfp8.kernels.linear.flashinfer_sm100 import FlashInferCutlassMxfp8, FlashInferTrtllmMxfp8
from sglang_mxfp8.layouts.blackwell import CutlassMoeScales
from sglang_mxfp8.ops.flashinfer_sm100 import require_mxfp8_quantize_kernel

flashinfer = pytest.importorskip("flashinfer")


# ---- layouts ------------------------------------------------------------------------------------

@pytest.mark.parametrize("m,kv", [(1, 1), (7, 4), (200, 12), (256, 64), (130, 3)])
def test_swizzles_match_trtllm_offset_functions_and_invert(m, kv):
    sf = torch.randint(0, 255, (m, kv), dtype=torch.uint8)
    for swz, unswz, offset, tile in (
        (layouts.swizzle_128x4, layouts.unswizzle_128x4, layouts.flashinfer_sf_offset_128x4, 128),
        (layouts.swizzle_8x4, layouts.unswizzle_8x4, layouts.flashinfer_sf_offset_8x4, 8),
    ):
        buf = swz(sf)
        assert buf.numel() == layouts.swizzled_len(m, kv, tile)
        idx = torch.tensor([[offset(i, j, kv) for j in range(kv)] for i in range(m)])
        assert torch.equal(buf[idx], sf)
        assert int(buf.sum()) == int(sf.sum())  # padding is zero
        assert torch.equal(unswz(buf, m, kv), sf)


def test_128x4_matches_flashinfer_mxfp8_length_rule():
    from flashinfer import SfLayout
    from flashinfer.gemm.gemm_base import _mxfp8_swizzled_scale_len

    for m, k in ((1, 256), (130, 2048), (4096, 4096)):
        assert layouts.swizzled_len(m, k // 32, 128) == _mxfp8_swizzled_scale_len(m, k, SfLayout.layout_128x4)
        assert layouts.swizzled_len(m, k // 32, 8) == _mxfp8_swizzled_scale_len(m, k, SfLayout.layout_8x4)


@pytest.mark.parametrize("rows", [32, 128, 384])
def test_row_shuffle_matches_flashinfer_host_helpers(rows):
    from flashinfer import shuffle_matrix_a
    from flashinfer.utils import get_shuffle_matrix_a_row_indices

    w = torch.randint(0, 255, (rows, 64), dtype=torch.uint8)
    ours = layouts.shuffle_source_indices(rows)
    assert torch.equal(ours, get_shuffle_matrix_a_row_indices(w, 128))
    assert torch.equal(w[ours], shuffle_matrix_a(w, 128))
    assert torch.equal(w[ours][layouts.inverse_permutation(ours)], w)


# ---- dense backends on CPU ----------------------------------------------------------------------

class Layer(torch.nn.Module):
    pass


class Kernel:
    """A Blackwell kernel bound to one layer's state, as its plan calls it."""

    def __init__(self, kernel, state):
        self.kernel, self.state = kernel, state

    def __getattr__(self, name):  # the state's buffers: storage, scale_shuffled, scale_swizzled, shuffle
        return getattr(self.state, name)

    def process_weights_after_loading(self, layer, scale):
        return self.kernel.process_weights_after_loading(layer, self.state, scale)

    def emulate(self, layer, x):
        return self.kernel.emulate(layer, self.state, x)


def _layer(cls, n, k, seed=0, ckpt=None):
    g = torch.Generator().manual_seed(seed)
    q, s = ckpt if ckpt is not None else quantize_mxfp8(torch.randn(n, k, generator=g))
    layer = Layer()
    layer.weight = torch.nn.Parameter(torch.empty(n, k, dtype=torch.float8_e4m3fn), requires_grad=False)
    layer.weight_scale_inv = torch.nn.Parameter(torch.zeros(n, k // 32, dtype=torch.uint8), requires_grad=False)
    be = Kernel(cls(), cls.state_type())
    be.kernel.create_buffers(layer, LinearSpec("model.layers.0.mlp.down_proj", n, k), be.state)
    layer.weight.data.copy_(q)  # what SGLang's loader does
    layer.weight_scale_inv.data.copy_(s)
    be.process_weights_after_loading(layer, layer.weight_scale_inv)
    return layer, be, q, s


@pytest.mark.parametrize("cls", [FlashInferTrtllmMxfp8, FlashInferCutlassMxfp8])
@pytest.mark.parametrize("n,k,m", [(200, 256, 7), (256, 512, 1), (130, 768, 33)])
def test_emulated_sm100_forward_equals_mxfp8_reference(cls, n, k, m):
    layer, be, q, s = _layer(cls, n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(3))
    qa, sa = quantize_mxfp8(x)
    ref = dequantize_mxfp8(qa, sa) @ dequantize_mxfp8(q, s).t()
    got = be.emulate(layer, x)
    assert got.shape == (m, n)
    assert ((got - ref).norm() / ref.norm()).item() < 1e-6


def test_trtllm_prep_matches_flashinfer_recipe_and_keeps_one_fp8_copy():
    from flashinfer import shuffle_matrix_a

    n, k = 200, 256
    layer, be, q, s = _layer(FlashInferTrtllmMxfp8, n, k)
    padded = torch.zeros(256, k, dtype=torch.uint8)
    padded[:n] = q.view(torch.uint8)
    assert torch.equal(be.storage.view(torch.uint8), shuffle_matrix_a(padded, 128))  # FlashInfer's own helper
    assert layer.weight.shape == (n, k) and layer.weight.dtype == torch.float8_e4m3fn  # checkpoint shape
    assert layer.weight.data_ptr() == be.storage.data_ptr()  # the parameter is a view, not a copy
    fp8 = [t for _, t in be.state.tensors() if t.dtype == torch.float8_e4m3fn] + list(layer.buffers())
    storage = layer.weight.untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == storage for t in fp8)  # no second FP8 tensor anywhere
    n_pad_rows = layouts.unswizzle_128x4(be.scale_shuffled, 256, k // 32)
    assert (n_pad_rows != 0).all()  # padding rows carry scale 1.0, not a zero byte


def test_trtllm_refit_is_idempotent_and_in_place():
    n, k = 200, 256
    layer, be, q, s = _layer(FlashInferTrtllmMxfp8, n, k)
    snap = (be.storage.clone(), be.scale_shuffled.clone())
    ptrs = (be.storage.data_ptr(), be.scale_shuffled.data_ptr())
    be.process_weights_after_loading(layer, layer.weight_scale_inv)  # twice: no double shuffle
    assert torch.equal(be.storage.view(torch.uint8), snap[0].view(torch.uint8))
    layer.weight.data.copy_(q)  # full reload of the same checkpoint
    layer.weight_scale_inv.data.copy_(s)
    be.process_weights_after_loading(layer, layer.weight_scale_inv)
    assert torch.equal(be.storage.view(torch.uint8), snap[0].view(torch.uint8))
    assert torch.equal(be.scale_shuffled, snap[1])
    assert (be.storage.data_ptr(), be.scale_shuffled.data_ptr()) == ptrs
    q2, s2 = quantize_mxfp8(torch.randn(n, k))  # refit to another checkpoint == fresh load
    layer.weight.data.copy_(q2)
    layer.weight_scale_inv.data.copy_(s2)
    be.process_weights_after_loading(layer, layer.weight_scale_inv)
    fresh, fresh_be, _, _ = _layer(FlashInferTrtllmMxfp8, n, k, ckpt=(q2, s2))
    assert torch.equal(be.storage.view(torch.uint8), fresh_be.storage.view(torch.uint8))
    assert torch.equal(be.scale_shuffled, fresh_be.scale_shuffled)


def test_trtllm_partial_reload_inside_a_shuffle_block_is_refused():
    layer, be, q, s = _layer(FlashInferTrtllmMxfp8, 256, 256)
    layer.weight.data[:16].copy_(q[:16])
    with pytest.raises(PartialReloadError, match=r"down_proj: rows 0\.\.31 were partly reloaded"):
        be.process_weights_after_loading(layer, layer.weight_scale_inv)


def test_cutlass_scale_buffer_is_rewritten_in_place():
    layer, be, q, s = _layer(FlashInferCutlassMxfp8, 200, 256)
    ptr = be.scale_swizzled.data_ptr()
    assert torch.equal(layer.weight.view(torch.uint8), q.view(torch.uint8))  # weight untouched
    _, s2 = quantize_mxfp8(torch.randn(200, 256) * 10)
    layer.weight_scale_inv.data.copy_(s2)
    be.process_weights_after_loading(layer, layer.weight_scale_inv)
    assert be.scale_swizzled.data_ptr() == ptr
    assert torch.equal(layouts.unswizzle_128x4(be.scale_swizzled, 200, 8), s2)


# ---- MoE ----------------------------------------------------------------------------------------

def test_cutlass_moe_quant_scales_have_the_binding_shapes_and_invert():
    e, hidden, inter = 4, 256, 128
    _, w13s = quantize_mxfp8(torch.randn(e, 2 * inter, hidden))
    _, w2s = quantize_mxfp8(torch.randn(e, hidden, inter))
    sc = CutlassMoeScales(e, hidden, inter, "cpu")
    ptrs = (sc.fc1.data_ptr(), sc.fc2.data_ptr())
    sc.refresh(w13s, w2s)
    fc1, g1, fc2, g2 = sc.quant_scales()
    # flashinfer_cutlass_fused_moe_binding.cu: (E, align128(I)*2, align128(H)/32/4) and (E, align128(H),
    # align128(I)/32/4), int32
    assert fc1.dtype == torch.int32 and fc1.shape == (e, 2 * inter, hidden // 32 // 4)
    assert fc2.dtype == torch.int32 and fc2.shape == (e, hidden, inter // 32 // 4)
    assert g1.shape == g2.shape == (e,) and torch.all(g1 == 1)
    for i in range(e):
        assert torch.equal(layouts.unswizzle_128x4(sc.fc1[i], 2 * inter, hidden // 32), w13s[i])
        assert torch.equal(layouts.unswizzle_128x4(sc.fc2[i], hidden, inter // 32), w2s[i])
    sc.refresh(w13s, w2s)
    assert (sc.fc1.data_ptr(), sc.fc2.data_ptr()) == ptrs


# ---- FlashInfer API contract and guards ---------------------------------------------------------

CALLS = {
    "mm_mxfp8": ("flashinfer", {"a", "b", "a_descale", "b_descale", "out_dtype", "use_8x4_sf_layout", "backend"}),
    "mxfp8_quantize": ("flashinfer", {"input", "is_sf_swizzled_layout", "alignment", "sf_swizzle_layout"}),
    "cutlass_fused_moe": ("flashinfer.fused_moe", {
        "input", "token_selected_experts", "token_final_scales", "fc1_expert_weights", "fc2_expert_weights",
        "output_dtype", "quant_scales", "input_sf", "use_mxfp8_act_scaling", "tp_size", "tp_rank", "ep_size",
        "ep_rank", "output", "tune_max_num_tokens"}),
    "shuffle_matrix_a": ("flashinfer", {"input_tensor", "epilogue_tile_m"}),
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_flashinfer_functions_accept_the_arguments_we_pass(name):
    import importlib

    module, params = CALLS[name]
    fn = getattr(importlib.import_module(module), name)
    assert params <= set(inspect.signature(fn).parameters), params - set(inspect.signature(fn).parameters)


def test_flashinfer_capability_gates_reject_sm90():
    from flashinfer import SfLayout, mm_mxfp8

    assert {b: mm_mxfp8.is_backend_supported(b, 90) for b in ("trtllm", "cutlass")} == {
        "trtllm": False,
        "cutlass": False,
    }
    assert mm_mxfp8.is_backend_supported("trtllm", 100) and mm_mxfp8.is_backend_supported("cutlass", 100)
    assert {l.name for l in SfLayout} >= {"layout_128x4", "layout_8x4"}


def test_mxfp8_quantize_guard_refuses_hopper():
    with pytest.raises(RuntimeError, match=r"no kernel body for SM90 \(NVIDIA H200\).*uninitialised memory"):
        require_mxfp8_quantize_kernel((9, 0), "NVIDIA H200")
    require_mxfp8_quantize_kernel((10, 0), "NVIDIA B200")
