"""Hopper MXFP8 dense kernels vs a float32 reference, on the GPU (python -m pytest tests/gpu on an H100/H200)."""

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
    reason="needs a Hopper (SM90) GPU; run python -m pytest tests/gpu on an H100/H200",
)

from sglang_mxfp8 import platform  # noqa: E402
from sglang_mxfp8.format.numerics import dequantize_block_fp8, moe_reference, quantize_mxfp8  # noqa: E402
from sglang_mxfp8.kernels import registry  # noqa: E402
from sglang_mxfp8.kernels.base import LinearSpec, MoESpec  # noqa: E402
from sglang_mxfp8.kernels.moe.common import HopperMoEState  # noqa: E402
from sglang_mxfp8.kernels.plan import Entry, Plan  # noqa: E402
from sglang_mxfp8.settings import Settings  # noqa: E402
from gpu_checks import (  # noqa: E402
    assert_graph_replay_equals_eager, assert_processing_again_changes_nothing, load_other_experts, storage)

TRITON, FLASHINFER = registry.TRITON_W8A8, registry.FLASHINFER_SM90  # the two Hopper dense layouts' base kernels

SHAPES = [(5120, 2048), (2048, 4096), (1000, 2080), (200, 352)]  # N not % 128, K % 32 but not % 128


class Layer(torch.nn.Module):
    pass


class Dense:
    """A layer's registry plan as the linear method runs it: apply() picks the kernel by batch size."""

    def __init__(self, plan):
        self.plan = plan

    @property
    def block_rows(self):
        return self.plan.base.layout.scale_rows

    def apply(self, layer, x, bias=None):
        return self.plan.apply(layer, layer.mxfp8_state, x, bias)

    def process_weights_after_loading(self, layer, scale):
        return self.plan.process_weights_after_loading(layer, layer.mxfp8_state, scale)


def _layer(base, n, k, seed=0, disabled=()):
    """A layer with base's weight layout: the registry's plan for base's flag on this GPU (``disabled``: kernels left
    out), or base alone where it cannot run the shape (its layout only, for kernels that read it)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.02
    q, s = quantize_mxfp8(w)
    layer = Layer()
    layer.weight = torch.nn.Parameter(q, requires_grad=False)
    layer.weight_scale_inv = torch.nn.Parameter(s, requires_grad=False)
    spec, gpu = LinearSpec("test.layer", n, k), platform.visible_gpu()
    flag = "triton" if base is TRITON else "flashinfer_trtllm"
    plan = registry.select_linear(spec, gpu, flag, Settings(disabled_kernels=frozenset(disabled)))
    be = Dense(plan if plan.base is base else Plan(spec, gpu, flag, (Entry(base),)))
    layer.mxfp8_state = be.plan.create_buffers(layer)
    layer.mxfp8_converter = layer.mxfp8_state.converter
    be.process_weights_after_loading(layer, layer.weight_scale_inv)
    return layer, be


def _kernels_launched(fn):
    """Names of the CUDA kernels fn() launches, from torch's profiler: which path ran, not what it returned."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}


def _reference(layer, be, x):
    """float32 product of the operands the kernel sees: 1x128-quantized activation x converted weight."""
    from sglang_mxfp8.format.numerics import quantize_activation_1x128

    w = dequantize_block_fp8(layer.weight, layer.mxfp8_converter.block_scale[0], be.block_rows)
    qa, sa = quantize_activation_1x128(x)
    a = qa.float() * sa.repeat_interleave(128, 1)[:, : x.shape[1]]
    return a @ w.t()


# FlashInfer's fp8_blockscale_gemm_sm90 needs K % 128 == 0 and N % 64 == 0 (the registry gives the rest to Triton)
CASES = [(TRITON, n, k) for n, k in SHAPES] + [(FLASHINFER, n, k) for n, k in SHAPES[:2]]


@pytest.mark.parametrize("m", [1, 7, 128, 1000])
@pytest.mark.parametrize("backend_cls,n,k", CASES)
def test_backend_matches_reference(m, backend_cls, n, k):
    if backend_cls is FLASHINFER:
        pytest.importorskip("flashinfer")
    # the base kernel at one token too: the one-token GEMV and small batches' weight-only product are tested below
    layer, be = _layer(backend_cls, n, k, disabled=("gemv", "weight_only"))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = be.apply(layer, x).float()
    ref = _reference(layer, be, x)
    rel = ((out - ref).norm() / ref.norm()).item()
    assert torch.isfinite(out).all() and rel < 1e-2, rel


@pytest.mark.parametrize("m", [1, 7, 128, 1000])
@pytest.mark.parametrize("n,k", [(5120, 2048), (2048, 4096)])
def test_cublas_blockscale_matches_reference(m, n, k):
    """cuBLAS's block-scaled GEMM (torch scaled_mm) on the FlashInfer backend's 128x128 scales, our quantizer in
    front (M padded to a multiple of 4): the float32 product of the same operands; a NaN token's row is NaN, the
    others untouched."""
    from sglang_mxfp8.ops.cublas_sm90 import blockscale_gemm

    from sglang_mxfp8.ops.cublas_sm90 import unsupported

    assert unsupported() is None
    layer, be = _layer(FLASHINFER, n, k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    if m > 1:
        x[-1, 3] = float("nan")
    out = blockscale_gemm(x, layer.weight, layer.mxfp8_converter.block_scale[0], bias).float()
    finite = 1 if m == 1 else m - 1
    ref = _reference(layer, be, x[:finite]) + bias.float()
    rel = ((out[:finite] - ref).norm() / ref.norm()).item()
    assert out.shape == (m, n) and torch.isfinite(out[:finite]).all() and rel < 1e-2, rel
    if m > 1:
        assert out[-1].isnan().all()  # the quantizer gives the NaN's group a NaN scale: the token's row is NaN


def test_flashinfer_backend_takes_cublas_for_prefill_batches(monkeypatch):
    """DeepGEMM disabled: batches of 1024 tokens or more run cuBLAS's GEMM, smaller ones FlashInfer's (each output
    bit-equal to its kernel called directly; the two differ)."""
    pytest.importorskip("flashinfer")
    from sglang_mxfp8.ops.flashinfer_jit import blockscale_gemm as fi_gemm
    from sglang_mxfp8.ops.cublas_sm90 import blockscale_gemm

    layer, be = _layer(FLASHINFER, 2048, 4096, disabled=("deepgemm",))
    assert be.plan.kernel_for(1024) is registry.CUBLAS and be.plan.kernel_for(1023) is FLASHINFER
    scale = layer.mxfp8_converter.block_scale[0]
    x = torch.randn(1024, 4096, device="cuda", dtype=torch.bfloat16)
    cublas, small = be.apply(layer, x), be.apply(layer, x[1:])
    assert torch.equal(cublas, blockscale_gemm(x, layer.weight, scale))
    assert torch.equal(small, fi_gemm.blockscale_gemm(x[1:], layer.weight, scale, x.dtype))
    assert not torch.equal(cublas[1:], small)


@pytest.mark.parametrize("m", [1024, 1500])
@pytest.mark.parametrize("n,k", [(5120, 2048), (2048, 4096), (1088, 2048)])
def test_flashinfer_backend_takes_deepgemm_for_prefill_batches(m, n, k, monkeypatch):
    """Where deep_gemm imports: batches of 1024+ tokens run DeepGEMM's dense FP8 GEMM (bit-equal to it called
    directly, within FP8 accuracy of the float32 product of the same operands, bias added; N = 1088 leaves a
    partial 128-row weight block), smaller ones FlashInfer's GEMM; a NaN token's row is NaN, the others untouched."""
    pytest.importorskip("flashinfer")
    from sglang_mxfp8.ops import deepgemm_sm90
    from sglang_mxfp8.ops.flashinfer_jit import blockscale_gemm as fi_gemm

    why = platform.deep_gemm_missing("fp8_gemm_nt")
    if why:
        pytest.skip(why)
    layer, be = _layer(FLASHINFER, n, k)
    assert be.plan.kernel_for(1024) is registry.DEEPGEMM and be.plan.kernel_for(1023) is FLASHINFER
    scale = layer.mxfp8_converter.block_scale[0]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    out = be.apply(layer, x, bias)
    assert torch.equal(out, deepgemm_sm90.dense_gemm(x, layer.weight, scale, bias))
    ref = _reference(layer, be, x) + bias.float()
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    assert out.shape == (m, n) and torch.isfinite(out).all() and rel < 1e-2, rel
    small = be.apply(layer, x[:1023])
    assert torch.equal(small, fi_gemm.blockscale_gemm(x[:1023], layer.weight, scale, x.dtype))
    x[-1, 3] = float("nan")
    again = be.apply(layer, x, bias)
    assert torch.equal(again[:-1], out[:-1]) and again[-1].isnan().all()


def test_trimmed_flashinfer_module_gives_the_bits_of_flashinfers_full_module():
    """The dense module built from the DeepGEMM-only GEMM source (ops/flashinfer_jit/blockscale_gemm.py) against
    FlashInfer's own ``fp8_blockscale_gemm_sm90`` and full module (compiled here, over a minute on an empty cache):
    the same bits for swap-AB (M < 32) and normal batches, several shapes, a partial last weight block."""
    pytest.importorskip("flashinfer")
    from flashinfer.gemm import fp8_blockscale_gemm_sm90

    from sglang_mxfp8.format.numerics import convert_to_block_scales
    from sglang_mxfp8.ops.flashinfer_jit import blockscale_gemm as fb

    assert fb.unsupported() is None and fb.dense_spec().name == fb.DENSE_MODULE
    torch.manual_seed(0)
    for n, k in [(2048, 4096), (1088, 2048), (6144, 1024)]:
        q, s = quantize_mxfp8(torch.randn(n, k, device="cuda") * 0.02)
        bs, _ = convert_to_block_scales(q, s, 128)
        for m in (1, 13, 31, 32, 200, 1023):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ours = fb.blockscale_gemm(x, q, bs, torch.bfloat16)
            assert torch.isfinite(ours).all() and ours.abs().max() > 0
            assert torch.equal(ours, fp8_blockscale_gemm_sm90(x, q, None, bs, out_dtype=torch.bfloat16)), (n, k, m)


def test_deepgemm_precompile_runs_once_per_shape():
    """At load: one GEMM per 64-row bucket of the prefill range, once per layer shape in the process."""
    from sglang_mxfp8.ops import deepgemm_sm90

    why = platform.deep_gemm_missing("fp8_gemm_nt")
    if why:
        pytest.skip(why)
    layer, be = _layer(FLASHINFER, 2048, 4096)
    run = registry.DEEPGEMM.precompile
    assert run(layer, layer.mxfp8_state, 1024, 2000) == len(deepgemm_sm90.precompile_ms(1024, 2000)) == 17
    assert run(layer, layer.mxfp8_state, 1024, 2000) is None


def test_triton_bias_and_cuda_graph_replay_equal_eager():
    layer, be = _layer(TRITON, 1000, 2080)
    bias = torch.randn(1000, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(16, 2080, device="cuda", dtype=torch.bfloat16)
    eager = be.apply(layer, x, bias)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        be.apply(layer, x, bias)  # warm up (Triton compile) outside capture
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        graphed = be.apply(layer, x, bias)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(graphed, eager)
    # a refit rewrites weights and scales in place: the captured graph sees the new values
    ptr = layer.mxfp8_converter.block_scale.data_ptr()
    q2, s2 = quantize_mxfp8(torch.randn(1000, 2080, device="cuda") * 0.03)
    layer.weight.data.copy_(q2)
    layer.weight_scale_inv.data.copy_(s2)
    be.process_weights_after_loading(layer, layer.weight_scale_inv)
    assert layer.mxfp8_converter.block_scale.data_ptr() == ptr
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(graphed, be.apply(layer, x, bias))


@pytest.mark.parametrize("m", [1, 7, 16, 64])
@pytest.mark.parametrize("backend_cls,n,k", [(TRITON, n, k) for n, k in SHAPES]
                         + [(FLASHINFER, n, k) for n, k in SHAPES])
def test_weight_only_gemm_matches_reference(m, backend_cls, n, k):
    """Weight-only FP8 on either backend's converted scales: BF16 activation as given, no quantization."""
    from sglang_mxfp8.ops.triton_sm90.dense_w8a16 import w8a16_gemm

    layer, be = _layer(backend_cls, n, k)  # FlashInfer's 128x128 layout is only converted, not run, here
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    if m > 1:
        x[-1, 3] = float("nan")
    out = w8a16_gemm(x, layer.weight, layer.mxfp8_converter.block_scale[0], be.block_rows).float()
    w = dequantize_block_fp8(layer.weight, layer.mxfp8_converter.block_scale[0], be.block_rows)
    finite = 1 if m == 1 else m - 1
    ref = x[:finite].float() @ w.t()
    rel = ((out[:finite] - ref).norm() / ref.norm()).item()
    assert torch.isfinite(out[:finite]).all() and rel < 5e-3, rel  # bf16 output rounding only
    if m > 1:
        assert out[-1].isnan().all()  # a NaN activation row stays in its row


def test_apply_serves_small_batches_weight_only():
    """The Triton plan's apply() runs the weight-only kernel up to 16 tokens, W8A8 above."""
    from sglang_mxfp8.ops.triton_sm90.dense_w8a16 import w8a16_gemm

    layer, be = _layer(TRITON, 2048, 4096, disabled=("gemv",))  # one token would take the GEMV (tested below)
    w8a8_only = Dense(registry.select_linear(be.plan.spec, be.plan.gpu, "triton",
                                             Settings(disabled_kernels=frozenset({"gemv", "weight_only"}))))
    limit = 16
    assert be.plan.kernel_for(limit) is registry.WEIGHT_ONLY and be.plan.kernel_for(limit + 1) is TRITON
    for m in (1, limit, limit + 1):
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        got = be.apply(layer, x)
        weight_only = w8a16_gemm(x, layer.weight, layer.mxfp8_converter.block_scale[0], be.block_rows)
        w8a8 = w8a8_only.apply(layer, x)
        assert torch.equal(got, weight_only if m <= limit else w8a8), m
        assert not torch.equal(weight_only, w8a8)  # the two paths are distinguishable


def _moe_case(m, seed, e_count=16, h=512, inter=256, top_k=4):
    """Random MXFP8 experts converted as the Hopper MoE path converts them, activations and routing."""
    from sglang_mxfp8.layouts.hopper import BlockScaleConverter

    g = torch.Generator(device="cuda").manual_seed(seed)
    w13, s13 = quantize_mxfp8(torch.randn(e_count, 2 * inter, h, device="cuda", generator=g) * 0.05)
    w2, s2 = quantize_mxfp8(torch.randn(e_count, h, inter, device="cuda", generator=g) * 0.05)
    c13 = BlockScaleConverter(e_count, 2 * inter, h, 128, "cuda", "w13")
    c13.refresh(w13, s13)
    c2 = BlockScaleConverter(e_count, h, inter, 128, "cuda", "w2")
    c2.refresh(w2, s2)
    x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16, generator=g)
    tw, ids = torch.topk(torch.softmax(torch.randn(m, e_count, device="cuda", generator=g), -1), top_k, dim=-1)
    return x, w13, c13, w2, c2, (tw / tw.sum(-1, keepdim=True)).float(), ids.int()


def _moe_reference(x, w13, c13, w2, c2, tw, ids, fp8_activations: bool):
    """The host MoE reference (format.numerics.moe_reference) on the converted weights."""
    return moe_reference(x, w13, c13.block_scale, w2, c2.block_scale, tw, ids, fp8_activations)


@pytest.mark.parametrize("backend_cls,n,k", [(TRITON, n, k) for n, k in SHAPES]
                         + [(FLASHINFER, n, k) for n, k in SHAPES]
                         + [(TRITON, 14336, 4096), (FLASHINFER, 4096, 14336)])  # Llama-3-8B MLP
def test_gemv_matches_reference_and_replays_in_cuda_graph(backend_cls, n, k):
    """One-token weight-streaming GEMV on either backend's converted scales vs float32; a CUDA graph replays it."""
    from sglang_mxfp8.ops.triton_sm90.gemv import w8a16_gemv

    layer, be = _layer(backend_cls, n, k)
    scale = layer.mxfp8_converter.block_scale[0]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    out = w8a16_gemv(x, layer.weight, scale, be.block_rows, bias)
    ref = x.float() @ dequantize_block_fp8(layer.weight, scale, be.block_rows).t() + bias.float()
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    assert out.shape == (1, n) and torch.isfinite(out).all() and rel < 5e-3, rel  # bf16 output rounding only
    assert_graph_replay_equals_eager(lambda: w8a16_gemv(x, layer.weight, scale, be.block_rows, bias), x)


def test_moe_gemv_matches_reference():
    """One token's MoE in two launches (SiLU-and-mul, routing weights and the expert sum fused) vs float32."""
    from sglang_mxfp8.ops.triton_sm90.gemv import moe_gemv

    for seed in range(3):
        x, w13, c13, w2, c2, tw, ids = _moe_case(1, seed=seed)
        out = moe_gemv(x, w13, c13.block_scale, w2, c2.block_scale, tw, ids).float()
        ref = _moe_reference(x, w13, c13, w2, c2, tw, ids, fp8_activations=False)
        rel = ((out - ref).norm() / ref.norm()).item()
        assert out.shape == x.shape and torch.isfinite(out).all() and rel < 1e-2, (seed, rel)


@pytest.mark.parametrize("up_first", [False, True])
@pytest.mark.parametrize("m", [37, 2048])
def test_cutlass_grouped_moe_matches_reference(m, up_first):
    """The prefill MoE (SGLang's CUTLASS grouped block-FP8 MoE on our converted weights) vs float32 with
    1x128 FP8 activations; a NaN in one token leaves every other token's output as it was. up_first: w13 and its
    scales as [up; gate] (FlashInfer's order), through the clone of SGLang's function with our activation."""
    from sglang_mxfp8.kernels.moe.cutlass_grouped import CutlassGroupedMoE

    x, w13, c13, w2, c2, tw, ids = _moe_case(m, seed=m)
    ref = _moe_reference(x, w13, c13, w2, c2, tw, ids, fp8_activations=True)
    w13_in, s13_in = w13, c13.block_scale
    if up_first:
        halves = lambda t: torch.cat(t.chunk(2, dim=1)[::-1], 1)  # noqa: E731 - rows (and 128-row scale blocks)
        w13_in, s13_in = halves(w13), halves(c13.block_scale)
    run = CutlassGroupedMoE(w13.shape[0], x.shape[1], w2.shape[2], "cuda", up_first=up_first)
    out = run(x, tw, ids, w13_in, w2, s13_in, c2.block_scale).float()
    rel = ((out - ref).norm() / ref.norm()).item()
    # measured on the H200: 0.011-0.015 here, SGLang's Triton fused MoE 0.016-0.018 on the same inputs;
    # a wrong scale layout or expert order gives O(1)
    assert torch.isfinite(out).all() and rel < 3e-2, rel
    x[-1, 5] = float("nan")  # SGLang's quantizer makes that token's own output finite (its Triton MoE too)
    again = run(x, tw, ids, w13_in, w2, s13_in, c2.block_scale).float()
    assert torch.equal(again[:-1], out[:-1])


@pytest.mark.parametrize("m", [37, 1024, 2048])
def test_deepgemm_grouped_moe_matches_reference(m):
    """The prefill MoE on DeepGEMM's grouped GEMM (psum layout) with our glue vs float32 with 1x128 FP8
    activations; a NaN in one token makes that token's output NaN and leaves every other token's as it was."""
    from sglang_mxfp8.kernels.moe.deepgemm import DeepGemmGroupedMoE

    why = _deepgemm_moe_missing()
    if why:
        pytest.skip(why)
    x, w13, c13, w2, c2, tw, ids = _moe_case(m, seed=m)
    run = DeepGemmGroupedMoE(w13.shape[0], x.shape[1], w2.shape[2])
    out = run(x, tw, ids, w13, w2, c13.block_scale, c2.block_scale).float()
    ref = _moe_reference(x, w13, c13, w2, c2, tw, ids, fp8_activations=True)
    rel = ((out - ref).norm() / ref.norm()).item()
    assert torch.isfinite(out).all() and rel < 3e-2, rel  # a wrong scale layout, row or expert gives O(1)
    x[-1, 5] = float("nan")
    again = run(x, tw, ids, w13, w2, c13.block_scale, c2.block_scale).float()
    assert torch.equal(again[:-1], out[:-1]) and again[-1].isnan().all()


@pytest.mark.parametrize("m, skewed", [(1, False), (37, True), (1024, False), (8192, False), (8192, True)])
def test_moe_segments_match_torch_and_silu_skips_only_padding(m, skewed):
    """The grouped MoE's segments (one Triton launch of 1-64 programs) against torch's count / pad / cumsum on 128
    experts, top-8 (skewed: every other token routed to expert 5), twenty times over; SiLU-and-mul on the slot rows
    alone equals, row for row and bit for bit, the same kernel run over every padded row."""
    from sglang_mxfp8.ops.triton_sm90.moe_segments import moe_segments, silu_mul_quant

    g = torch.Generator(device="cuda").manual_seed(m)
    scores = torch.rand(m, 128, device="cuda", generator=g)
    if skewed:
        scores[::2, 5] += 2.0
    ids = torch.argsort(scores, dim=1, descending=True)[:, :8].int()
    counts = torch.bincount(ids.flatten().long(), minlength=128).int()
    padded = (counts + 127) // 128 * 128
    for _ in range(20):  # the programs finish in a different order each time: the last one lays out the segments
        cursor, seg_end, end = moe_segments(ids, 128)
        assert torch.equal(seg_end, torch.cumsum(padded, 0).int())
        assert torch.equal(cursor, seg_end - padded) and torch.equal(end, seg_end - padded + counts)
    rows = int(seg_end[-1]) + 128
    h = torch.randn(rows, 2 * 256, device="cuda", generator=g).to(torch.bfloat16)
    q, s = silu_mul_quant(h, seg_end, end)
    q_all, s_all = silu_mul_quant(h, seg_end, seg_end)  # every padded row, as before the skip
    slot_rows = torch.cat([torch.arange(int(a), int(b), device="cuda") for a, b in zip(seg_end - padded, end)])
    assert slot_rows.numel() == m * 8
    assert torch.equal(q[slot_rows].view(torch.uint8), q_all[slot_rows].view(torch.uint8))
    assert torch.equal(s[slot_rows], s_all[slot_rows])


def _moe_kernel(name):
    return next(k for k in registry.all_kernels() if k.name == name)


def _deepgemm_moe_missing():
    return _moe_kernel("deepgemm_moe").missing(platform.visible_gpu())


def _moe_layer(w13, c13, w2, c2, top_k, plan_entries):
    """A MoE layer with the converted weights and a plan of ``plan_entries`` (its band kernels' objects built)."""
    e_count, h, inter = w13.shape[0], w13.shape[2], w2.shape[2]
    layer = torch.nn.Module()
    layer.w13_weight, layer.w2_weight, layer.top_k, layer.moe_ep_size = w13, w2, top_k, 1
    spec = MoESpec("test.experts", e_count, h, inter)
    plan = Plan(spec, platform.visible_gpu(), "auto", tuple(plan_entries))
    layer.mxfp8_state = state = HopperMoEState()
    state.w13, state.w2 = c13, c2
    for e in plan.entries[:-1]:
        e.kernel.create_buffers(layer, spec, state)
    return layer, plan


def test_deepgemm_moe_precompile_runs_once_per_shape():
    """At load: the DeepGEMM MoE layer once per tile config of the prefill range, once per layer shape."""
    from sglang_mxfp8.ops.deepgemm_sm90 import grouped_precompile_ms

    if _deepgemm_moe_missing():
        pytest.skip(_deepgemm_moe_missing())
    _, w13, c13, w2, c2, _, _ = _moe_case(1, seed=3)
    kernel = _moe_kernel("deepgemm_moe")
    layer, plan = _moe_layer(w13, c13, w2, c2, 4, [Entry(kernel, 1024), Entry(registry.TRITON_MOE)])
    expected = len(grouped_precompile_ms(1024, 4096, 4, w13.shape[0]))
    assert kernel.precompile(layer, layer.mxfp8_state, 1024, 4096) == expected > 1
    assert kernel.precompile(layer, layer.mxfp8_state, 1024, 4096) is None


@pytest.mark.parametrize("deep_gemm", [True, False])
def test_create_weights_builds_the_planned_prefill_moe(deep_gemm, monkeypatch):
    """The real MoE method's create_weights: the plan takes DeepGEMM from 1024 tokens where it imports (as the run
    script sets it up), else the CUTLASS grouped MoE from 2048, and the layer's state holds that kernel's object."""
    import sglang.srt.layers.quantization.fp8  # noqa: F401 - SGLang's module first: its patch imports quant_methods

    from sglang_mxfp8.kernels.moe.cutlass_grouped import CutlassGroupedMoE
    from sglang_mxfp8.kernels.moe.deepgemm import DeepGemmGroupedMoE
    from sglang_mxfp8.sglang import quant_methods as qm

    if deep_gemm and _deepgemm_moe_missing():
        pytest.skip(_deepgemm_moe_missing())
    if not deep_gemm:
        monkeypatch.setattr(platform, "deep_gemm_missing", lambda api, needs="": "not installed (test)")
    # a one-GPU server's tensor-parallel size, which SGLang's create_weights reads from its process group
    monkeypatch.setattr(sglang.srt.layers.quantization.fp8, "get_tensor_model_parallel_world_size", lambda: 1)
    method = qm.Mxfp8MoEMethod(qm.Mxfp8Config.from_config({"quant_method": "mxfp8", "activation_scheme": "dynamic",
                                                          "weight_block_size": [1, 32]}), "model.layers.0.mlp.experts")
    layer = torch.nn.Module()
    method.create_weights(layer, 4, 256, 128, torch.bfloat16)
    if deep_gemm:
        assert method.plan.bands() == {"1024+ tokens": "deepgemm_moe", "other batches": "triton_moe"}
        assert isinstance(layer.mxfp8_state.deepgemm, DeepGemmGroupedMoE)
    else:
        assert method.plan.bands() == {"2048+ tokens": "cutlass_moe", "other batches": "triton_moe"}
        assert isinstance(layer.mxfp8_state.cutlass, CutlassGroupedMoE)


@pytest.mark.parametrize("kind", ["cutlass", "deepgemm"])
def test_moe_apply_runs_prefill_batches_on_the_prefill_moe(kind):
    """Mxfp8MoEMethod.apply: batches in the plan's prefill band take the prefill MoE (CUTLASS grouped or
    DeepGEMM), smaller ones SGLang's Triton fused MoE; both are within FP8 accuracy of the float32 layer."""
    from sglang.srt.layers.moe.moe_runner import MoeRunnerConfig
    from sglang.srt.layers.moe.token_dispatcher.standard import StandardDispatchOutput
    from sglang.srt.layers.moe.topk import StandardTopKOutput
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    from sglang_mxfp8.sglang import quant_methods as qm

    if kind == "deepgemm" and _deepgemm_moe_missing():
        pytest.skip(_deepgemm_moe_missing())
    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy"))
    x, w13, c13, w2, c2, tw, ids = _moe_case(2048, seed=1)
    e_count, h, inter = w13.shape[0], x.shape[1], w2.shape[2]
    kernel, limit = (_moe_kernel("cutlass_moe"), 2048) if kind == "cutlass" else (_moe_kernel("deepgemm_moe"), 1024)
    layer, plan = _moe_layer(w13, c13, w2, c2, ids.shape[1], [Entry(kernel, limit), Entry(registry.TRITON_MOE)])
    method = qm.Mxfp8MoEMethod(qm.Mxfp8Config.from_config({"quant_method": "mxfp8", "activation_scheme": "dynamic",
                                                          "weight_block_size": [1, 32]}), "test.experts")
    method.plan = plan
    method.create_moe_runner(layer, MoeRunnerConfig(num_experts=e_count, num_local_experts=e_count, hidden_size=h,
                                                    intermediate_size_per_partition=inter, top_k=ids.shape[1],
                                                    params_dtype=torch.bfloat16, inplace=False))
    assert method.plan is plan  # create_moe_runner kept it
    triton_only = Plan(plan.spec, plan.gpu, "auto", (Entry(registry.TRITON_MOE),))
    state = layer.mxfp8_state

    def apply(rows):
        topk = StandardTopKOutput(tw[:rows], ids[:rows], None)
        return method.apply(layer, StandardDispatchOutput(x[:rows], None, topk)).hidden_states.float()

    for rows in (limit - 1, limit):
        got = apply(rows)
        prefill = kernel.experts(layer, state, x[:rows], tw[:rows], ids[:rows]).float()
        method.plan = triton_only
        triton = apply(rows)
        method.plan = plan
        assert torch.equal(got, prefill if rows >= limit else triton), rows
        assert not torch.equal(prefill, triton)  # the two paths are distinguishable
        ref = _moe_reference(x[:rows], w13, c13, w2, c2, tw[:rows], ids[:rows], fp8_activations=True)
        rel = {
            name: ((out - ref).norm() / ref.norm()).item() for name, out in (("prefill", prefill), ("triton", triton))
        }
        rel["between"] = ((prefill - triton).norm() / triton.norm()).item()
        assert rel["prefill"] < 3e-2 and rel["triton"] < 3e-2, rel


PRECOMPILE = r"""
import os, random, sys, time, torch
from types import SimpleNamespace
from sglang_mxfp8.ops.flashinfer_jit import tile_configs as fs
from sglang_mxfp8.ops.flashinfer_jit.blockscale_gemm import blockscale_gemm
from sglang_mxfp8.format.numerics import convert_to_block_scales, quantize_mxfp8
from sglang_mxfp8.kernels import registry
if sys.argv[1] == "flashinfer":  # FlashInfer's JIT compiles every kernel itself
    fs.concurrent_compile_unsupported = lambda: "left to FlashInfer by the test"
torch.manual_seed(0)
n, k, max_m = 2048, 4096, 2048
q, s = quantize_mxfp8(torch.randn(n, k, device="cuda") * 0.02)
bs, _ = convert_to_block_scales(q, s, 128)
cache = os.path.join(os.environ["TRTLLM_DG_CACHE_DIR"], "cache")
layer = torch.nn.Module()
layer.weight = torch.nn.Parameter(q, requires_grad=False)
start = time.perf_counter()
state = SimpleNamespace(converter=SimpleNamespace(block_scale=bs[None]))
ran = registry.FLASHINFER_SM90.precompile(layer, state, 1, max_m)
seconds = time.perf_counter() - start
compiled = set(os.listdir(cache))
sms = torch.cuda.get_device_properties(0).multi_processor_count
expected = {fs.jit_kernel_name(fs.GemmShape(n, k), c) for c in fs.configs_for(fs.GemmShape(n, k), 1, max_m, sms)}
print("RAN", ran, "COMPILED", len(compiled), "MISSING", sorted(expected - compiled),
      "EXTRA", sorted(compiled - expected))
print(f"PRECOMPILE {sys.argv[1]} {seconds:.1f} s")
outs = []
for m in random.Random(0).sample(range(1, max_m + 1), 40):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    outs.append(blockscale_gemm(x, q, bs, torch.bfloat16))
torch.cuda.synchronize()
print("NEW_AFTER", sorted(set(os.listdir(cache)) - compiled))
torch.save([o.cpu() for o in outs], sys.argv[2])
"""


def test_precompile_compiles_exactly_the_kernels_flashinfer_selects(tmp_path):
    """FlashInfer's JIT names each kernel it compiles in its cache folder: precompiling with FlashInfer compiling
    alone must produce exactly our enumeration's names, and serving any M afterwards nothing new; with our concurrent
    nvcc processes compiling them first, FlashInfer must find every kernel it runs there (it compiles nothing) and
    the GEMMs must return what they return with FlashInfer's own kernels, bit for bit."""
    import subprocess
    import sys

    pytest.importorskip("flashinfer")
    outputs = {}
    for who in ("flashinfer", "ours"):
        env = dict(os.environ, TRTLLM_DG_JIT_DUMP_CUBIN="1", TRTLLM_DG_CACHE_DIR=str(tmp_path / who))
        outputs[who] = tmp_path / f"{who}.pt"
        p = subprocess.run([sys.executable, "-c", PRECOMPILE, who, str(outputs[who])], capture_output=True, text=True,
                           env=env, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        line = next(x for x in p.stdout.splitlines() if x.startswith("RAN"))
        assert "MISSING [] EXTRA []" in line, (who, line)
        assert "NEW_AFTER []" in p.stdout, (who, p.stdout)
        print(next(x for x in p.stdout.splitlines() if x.startswith("PRECOMPILE")))
    theirs, ours = torch.load(outputs["flashinfer"]), torch.load(outputs["ours"])
    assert len(theirs) == len(ours) == 40 and all(torch.equal(a, b) for a, b in zip(theirs, ours))


def test_moe_apply_runs_one_token_on_the_gemv():
    """With the GEMV MoE on, Mxfp8MoEMethod.apply runs one token on the GEMV MoE and two on SGLang's Triton
    fused MoE; the two agree to FP8 accuracy."""
    from sglang.srt.layers.moe.moe_runner import MoeRunnerConfig
    from sglang.srt.layers.moe.token_dispatcher.standard import StandardDispatchOutput
    from sglang.srt.layers.moe.topk import StandardTopKOutput
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    from sglang_mxfp8.ops.triton_sm90.gemv import moe_gemv
    from sglang_mxfp8.sglang import quant_methods as qm

    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy"))
    x, w13, c13, w2, c2, tw, ids = _moe_case(2, seed=4)
    e_count, h, inter = w13.shape[0], x.shape[1], w2.shape[2]
    layer, plan = _moe_layer(w13, c13, w2, c2, ids.shape[1], [Entry(_moe_kernel("moe_gemv"), 1, 1),
                                                              Entry(registry.TRITON_MOE)])
    method = qm.Mxfp8MoEMethod(qm.Mxfp8Config.from_config({"quant_method": "mxfp8", "activation_scheme": "dynamic",
                                                          "weight_block_size": [1, 32]}), "test.experts")
    method.plan = plan
    method.create_moe_runner(layer, MoeRunnerConfig(num_experts=e_count, num_local_experts=e_count, hidden_size=h,
                                                    intermediate_size_per_partition=inter, top_k=ids.shape[1],
                                                    params_dtype=torch.bfloat16, inplace=False))
    assert method.plan is plan

    def apply(rows):
        topk = StandardTopKOutput(tw[:rows], ids[:rows], None)
        return method.apply(layer, StandardDispatchOutput(x[:rows], None, topk)).hidden_states

    one = apply(1)
    assert torch.equal(one, moe_gemv(x[:1], w13, c13.block_scale, w2, c2.block_scale, tw[:1], ids[:1]))
    assert "_moe_gemv_down_kernel" in _kernels_launched(lambda: apply(1))
    assert "_moe_gemv_down_kernel" not in _kernels_launched(lambda: apply(2))
    two = apply(2)
    method.plan = Plan(plan.spec, plan.gpu, "auto", (Entry(registry.TRITON_MOE),))
    assert "_moe_gemv_down_kernel" not in _kernels_launched(lambda: apply(1))
    assert torch.equal(two, apply(2))  # two tokens: the Triton fused MoE either way
    triton_one = apply(1).float()
    rel = ((one.float() - triton_one).norm() / triton_one.norm()).item()
    assert 0 < rel < 0.1, rel  # FP8 activations on the Triton path only: ~0.03-0.06 measured


@pytest.mark.parametrize("backend_cls", [TRITON, FLASHINFER])
def test_dense_apply_runs_one_token_on_the_gemv(backend_cls, monkeypatch):
    """On a shape they list, both Hopper dense plans run one token on the GEMV and two on their own kernel."""
    from sglang_mxfp8.ops.triton_sm90.gemv import w8a16_gemv

    layer, be = _layer(backend_cls, 5120, 2048)
    assert be.plan.kernel_for(1).name == "gemv"
    x = torch.randn(2, 2048, device="cuda", dtype=torch.bfloat16)
    one = be.apply(layer, x[:1])
    assert torch.equal(one, w8a16_gemv(x[:1], layer.weight, layer.mxfp8_converter.block_scale[0], be.block_rows))
    # outputs alone cannot tell the paths apart (the weight-only kernel can agree bit for bit): the kernel names do
    assert "_w8a16_gemv_kernel" in _kernels_launched(lambda: be.apply(layer, x[:1]))
    assert "_w8a16_gemv_kernel" not in _kernels_launched(lambda: be.apply(layer, x))
    two = be.apply(layer, x)
    be = Dense(
        registry.select_linear(be.plan.spec, be.plan.gpu, be.plan.flag, Settings(disabled_kernels=frozenset({"gemv"})))
    )
    assert "_w8a16_gemv_kernel" not in _kernels_launched(lambda: be.apply(layer, x[:1]))
    assert torch.equal(two, be.apply(layer, x))


@pytest.mark.parametrize("m", [16, 1024])
def test_linear_op_traced_for_piecewise_graphs_replays_the_eager_layer(m, monkeypatch):
    """SGLang's piecewise CUDA graphs: the real linear method on FlashInfer's backend (DeepGEMM or cuBLAS from 1024
    tokens), traced by torch.compile(fullgraph=True) with SGLang's piecewise flag set, then captured in a CUDA graph:
    each replay gives the eager layer's output bit for bit, NaN where it has NaN (a NaN token in the batch)."""
    pytest.importorskip("flashinfer")
    import sglang.srt.layers.quantization.fp8 as fp8
    from sglang.srt.compilation.piecewise_context_manager import enable_piecewise_cuda_graph
    from sglang.srt.layers.quantization.fp8_utils import initialize_fp8_gemm_config

    from conftest import mxfp8_linear, set_server_args
    from sglang_mxfp8 import settings

    monkeypatch.setenv("SGLANG_MXFP8_PRECOMPILE", "0")  # the two batch sizes compile on use
    settings.current.cache_clear()
    initialize_fp8_gemm_config(set_server_args(fp8_gemm_runner_backend="flashinfer_trtllm"))
    monkeypatch.setattr(fp8, "get_tensor_model_parallel_world_size", lambda: 1)  # one GPU's sizes, no process group
    layer = mxfp8_linear(
        "model.layers.0.self_attn.o_proj", *quantize_mxfp8(torch.randn(2048, 4096, device="cuda") * 0.02)
    )
    assert layer.quant_method.plan.base is FLASHINFER and layer.weight.is_cuda
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    x[-1, 3] = float("nan")
    eager = layer.quant_method.apply(layer, x)
    compiled = torch.compile(
        lambda t: layer.quant_method.apply(layer, t), fullgraph=True, backend="eager", dynamic=False
    )
    with enable_piecewise_cuda_graph():
        compiled(x)  # trace, then one eager run of the traced graph (kernels compiled outside the capture)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = compiled(x)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.isnan(), eager.isnan()) and torch.equal(out.nan_to_num(), eager.nan_to_num())


# hidden / intermediate sizes off the 128 grid: I 96, H 576 (SmolLM-class), H 96 (w2's N not a multiple of 64),
# gpt-oss-20b's 2880 x 2880 with 32 experts
OFF_GRID = [(8, 2048, 96, 4), (8, 576, 768, 4), (4, 96, 160, 2), (32, 2880, 2880, 4)]


@pytest.mark.parametrize("flag", ["auto", "triton", "flashinfer_cutlass"])
@pytest.mark.parametrize("e_count,h,inter,top_k", OFF_GRID)
def test_off_grid_moe_plans_the_masked_moe_and_matches_reference(flag, e_count, h, inter, top_k):
    """Every Hopper MoE flag serves a layer off the 128 grid with the masked W8A8 MoE, within 1e-2 of float32."""
    plan = registry.select_moe(MoESpec("test.experts", e_count, h, inter), platform.visible_gpu(), flag)
    assert plan.bands() == {"other batches": "triton_w8a8_moe"}, plan.bands()
    for m in (1, 16, 256, 4096):
        x, w13, c13, w2, c2, tw, ids = _moe_case(m, seed=m + h, e_count=e_count, h=h, inter=inter, top_k=top_k)
        state = HopperMoEState()
        state.w13, state.w2 = c13, c2
        layer = torch.nn.Module()
        layer.w13_weight, layer.w2_weight = w13, w2
        out = plan.base.experts(layer, state, x, tw, ids)
        ref = _moe_reference(x, w13, c13, w2, c2, tw, ids, fp8_activations=True)
        rel = ((out.float() - ref).norm() / ref.norm()).item()
        assert out.shape == x.shape and torch.isfinite(out).all() and rel < 1e-2, (m, rel)


def test_masked_moe_nan_token_graph_replay_and_refit_in_place():
    """The masked MoE on an off-grid layer: a NaN token changes no other token's output, a CUDA graph replays the
    eager result, and a refit through the plan rewrites the weights and scales in place (again: a no-op)."""
    from sglang_mxfp8.ops.triton_sm90.moe_sorted import moe_w8a8

    e_count, h, inter, top_k = 8, 576, 96, 4
    x, w13, c13, w2, c2, tw, ids = _moe_case(48, seed=3, e_count=e_count, h=h, inter=inter, top_k=top_k)
    out = moe_w8a8(x, w13, c13.block_scale, w2, c2.block_scale, tw, ids)
    poisoned = x.clone()
    poisoned[-1, 100] = float("nan")
    again = moe_w8a8(poisoned, w13, c13.block_scale, w2, c2.block_scale, tw, ids)
    assert torch.equal(again[:-1], out[:-1]) and again[-1].isnan().any()

    run = lambda: moe_w8a8(x, w13, c13.block_scale, w2, c2.block_scale, tw, ids)  # noqa: E731
    assert_graph_replay_equals_eager(run, x)

    layer = torch.nn.Module()
    layer.w13_weight = torch.nn.Parameter(torch.empty_like(w13), False)
    layer.w2_weight = torch.nn.Parameter(torch.empty_like(w2), False)
    plan = registry.select_moe(MoESpec("test.experts", e_count, h, inter), platform.visible_gpu(), "triton")
    state = plan.create_buffers(layer)
    ptrs = storage(layer, state)
    g = torch.Generator(device="cuda").manual_seed(11)
    run = lambda: plan.base.experts(layer, state, x, tw, ids)  # noqa: E731
    for _ in range(2):  # the first load, then a refit to other weights
        scales = load_other_experts(layer, plan, state, g)
        got = run()
        ref = _moe_reference(x, layer.w13_weight, state.w13, layer.w2_weight, state.w2, tw, ids, fp8_activations=True)
        assert ((got.float() - ref).norm() / ref.norm()).item() < 1e-2
    assert_processing_again_changes_nothing(layer, plan, state, scales, run, got)
    assert storage(layer, state) == ptrs


def test_gpt_oss_20b_moe_layer_weights_stay_under_055x_bf16():
    """A gpt-oss-20b-shaped MoE layer (32 experts, hidden 2880, intermediate 2880) as the masked MoE serves it: FP8
    weights, the checkpoint's UE8M0 scales and every derived buffer, nothing padded, against its BF16 weights."""
    e_count, h, inter = 32, 2880, 2880
    bf16_bytes = e_count * 3 * h * inter * 2
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    layer = torch.nn.Module()
    layer.w13_weight = torch.nn.Parameter(
        torch.empty(e_count, 2 * inter, h, dtype=torch.float8_e4m3fn, device="cuda"), False
    )
    layer.w2_weight = torch.nn.Parameter(
        torch.empty(e_count, h, inter, dtype=torch.float8_e4m3fn, device="cuda"), False
    )
    s13 = torch.empty(e_count, 2 * inter, h // 32, dtype=torch.uint8, device="cuda")
    s2 = torch.empty(e_count, h, inter // 32, dtype=torch.uint8, device="cuda")
    plan = registry.select_moe(MoESpec("gpt_oss.experts", e_count, h, inter), platform.visible_gpu(), "auto")
    state = plan.create_buffers(layer)
    torch.cuda.synchronize()
    ratio = (torch.cuda.memory_allocated() - base) / bf16_bytes
    print(f"gpt-oss-20b MoE layer: {ratio:.4f}x BF16 ({plan.base.name})")
    assert plan.base.name == "triton_w8a8_moe" and 0.5 < ratio <= 0.55, ratio
    del state, s13, s2


@pytest.mark.parametrize("groups,rows,k,block_rows", [(1, 5120, 2048, 128), (1, 1000, 2080, 128), (1, 200, 352, 1),
                                                      (16, 1536, 2048, 128), (4, 256, 768, 1)])
def test_block_scale_conversion_on_the_gpu_equals_the_cpu_conversion(groups, rows, k, block_rows):
    """A whole load's conversion (layouts.hopper_triton's kernel) gives the CPU steps' bytes and scales exactly, on
    weights whose rows span 10 binary orders (so elements fall into e4m3's subnormals), with zero sub-blocks; a second
    refresh changes nothing."""
    from sglang_mxfp8.layouts.hopper import BlockScaleConverter

    g = torch.Generator().manual_seed(rows + k)
    w = torch.randn(groups, rows, k, generator=g) * torch.logspace(-8, 2, rows)[None, :, None]
    w[:, ::5, 64:96] = 0.0
    q, s = quantize_mxfp8(w)
    done = {}
    for device in ("cpu", "cuda"):
        qd, sd = q.to(device, copy=True), s.to(device, copy=True)  # the CPU conversion must not write into q
        conv = BlockScaleConverter(groups, rows, k, block_rows, device, "w")
        stats = conv.refresh(qd, sd)
        before = qd.clone()
        assert conv.refresh(qd, sd).converted_rows == 0 and torch.equal(qd.view(torch.uint8), before.view(torch.uint8))
        done[device] = (qd.cpu(), conv.block_scale.cpu(), stats.changed_elements)
    (cq, cs, cchanged), (gq, gs, gchanged) = done["cpu"], done["cuda"]
    assert torch.equal(gq.view(torch.uint8), cq.view(torch.uint8)) and torch.equal(gs, cs)
    assert gchanged == cchanged


@pytest.mark.parametrize("rows,k", [(24576, 2048), (5120, 2048), (1000, 2080), (37, 96)])
def test_block_scale_conversion_loaded_scan_on_the_gpu_equals_the_torch_steps(rows, k):
    """layouts.scan_triton built for this GPU: one read of a loaded weight gives the torch steps' row fingerprints of
    weight and scale bit for bit (computed on the CPU), their nonzero-block map, and their refusal, word for word, of
    a NaN weight byte, a NaN scale byte and a zero scale under nonzero weights; 16 experts of a Qwen3-30B-A3B w13 among
    them."""
    from sglang_mxfp8.format.checkpoint import refuse_flagged_rows, validate_loaded
    from sglang_mxfp8.layouts.fingerprints import row_fingerprints
    from sglang_mxfp8.layouts.scan_triton import scan_loaded

    def refusal(f, *a):
        try:
            f(*a)
        except ValueError as e:
            return str(e)
        return None

    g = torch.Generator().manual_seed(rows + k)
    q, s = quantize_mxfp8(torch.randn(rows, k, generator=g) * 0.02)
    q.view(torch.uint8)[1::7, :32] = 0
    s[1::7, 0] = 0  # a zero scale over zeros: no refusal
    for trouble in ("none", "nan weight", "nan scale", "missing scale"):
        qq, ss = q.clone(), s.clone()
        row = rows * 2 // 3
        if trouble == "nan weight":
            qq.view(torch.uint8)[row, k - 1] = 0xFF
        elif trouble == "nan scale":
            ss[row, 0] = 255
        elif trouble == "missing scale":
            ss[row, -1] = 0
        sig_w = torch.empty(rows, dtype=torch.int64, device="cuda")
        sig_s = torch.empty_like(sig_w)
        nonzero, flags, scale_done = scan_loaded(qq.cuda(), ss.cuda(), sig_w, sig_s)
        expected = refusal(validate_loaded, qq, ss, "w")
        assert refusal(refuse_flagged_rows, flags, "w") == expected and (expected is None) == (trouble == "none")
        assert torch.equal(sig_w.cpu(), row_fingerprints(qq, torch.empty(rows, dtype=torch.int64))), trouble
        if scale_done:
            assert torch.equal(sig_s.cpu(), row_fingerprints(ss, torch.empty(rows, dtype=torch.int64))), trouble
        if expected is None:
            assert torch.equal(nonzero.cpu(), validate_loaded(qq, ss, "w"))


@pytest.mark.parametrize("m", [1, 16, 64, 128])
@pytest.mark.parametrize("base,n,k,split", [(TRITON, 5120, 2048, None), (FLASHINFER, 2048, 4096, None),
                                            (TRITON, 200, 352, 1), (FLASHINFER, 2048, 4096, 3)])
def test_split_k_gemm_matches_reference_and_replays_in_a_cuda_graph(m, base, n, k, split):
    """ops/triton_sm90/splitk_w8a8.py on the GPU: the float32 product of the quantized operands (the Triton layout's
    per-row 1x128 weight scales, FlashInfer's 128x128), K split or not (the splits' atomic sum included), with a bias
    and a NaN token; the same bytes when a CUDA graph replays it on new activations, its kept workspace zero after
    each replay."""
    from sglang_mxfp8.ops.triton_sm90.splitk_w8a8 import SplitKWorkspace, splitk_config, splitk_w8a8_gemm

    if base is FLASHINFER:
        pytest.importorskip("flashinfer")
    layer, be = _layer(base, n, k, disabled=("gemv", "weight_only"))
    w, ws, rows = layer.weight, layer.mxfp8_converter.block_scale[0], layer.mxfp8_converter.block_rows
    cfg = None if split is None else dict(splitk_config(m, n, k), SPLIT=split)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    out = splitk_w8a8_gemm(x, w, ws, bias, cfg, rows).float()
    ref = _reference(layer, be, x) + bias.float()
    rel = ((out - ref).norm() / ref.norm()).item()
    assert out.shape == (m, n) and torch.isfinite(out).all() and rel < 1e-2, rel
    if m > 1:
        bad = x.clone()
        bad[1, 5] = float("nan")
        nan_out = splitk_w8a8_gemm(bad, w, ws, bias, cfg, rows)
        assert nan_out[1].isnan().all() and torch.isfinite(nan_out[0]).all()
    static, space = x.clone(), SplitKWorkspace(n, "cuda")  # a kept workspace, as the kernel class keeps one
    splitk_w8a8_gemm(static, w, ws, bias, cfg, rows, space)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = splitk_w8a8_gemm(static, w, ws, bias, cfg, rows, space)
    for _ in range(3):  # each replay leaves the workspace zero for the next
        fresh = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        static.copy_(fresh)
        graph.replay()
        expected = _reference(layer, be, fresh) + bias.float()
        assert ((captured.float() - expected).norm() / expected.norm()).item() < 1e-2
        assert not space.sums.any() and not space.tickets.any()
