"""Hopper MXFP8 dense kernels vs a float32 reference, on the GPU (run via benchmarks/run_h200.sh)."""

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
    reason="needs a Hopper (SM90) GPU; run bash benchmarks/run_h200.sh on an H100/H200",
)

from sglang_mxfp8.dense import HopperFlashInferDense, HopperTritonDense  # noqa: E402
from sglang_mxfp8.numerics import dequantize_block_fp8, quantize_mxfp8  # noqa: E402
from sglang_mxfp8.resolver import Choice  # noqa: E402

SHAPES = [(5120, 2048), (2048, 4096), (1000, 2080), (200, 352)]  # N not % 128, K % 32 but not % 128


class Layer(torch.nn.Module):
    pass


def _layer(backend_cls, n, k, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.02
    q, s = quantize_mxfp8(w)
    layer = Layer()
    layer.weight = torch.nn.Parameter(q, requires_grad=False)
    layer.weight_scale_inv = torch.nn.Parameter(s, requires_grad=False)
    be = backend_cls(Choice(backend_cls.kernel, "test"), "test.layer")
    be.create_buffers(layer, n, k)
    be.process_weights_after_loading(layer, layer.weight_scale_inv)
    return layer, be


def _reference(layer, be, x):
    """float32 product of the operands the kernel sees: 1x128-quantized activation x converted weight."""
    from sglang_mxfp8.numerics import quantize_activation_1x128

    w = dequantize_block_fp8(layer.weight, layer.mxfp8_converter.block_scale[0], be.block_rows)
    qa, sa = quantize_activation_1x128(x)
    a = qa.float() * sa.repeat_interleave(128, 1)[:, : x.shape[1]]
    return a @ w.t()


# FlashInfer's fp8_blockscale_gemm_sm90 needs K % 128 == 0 and N % 64 == 0 (the resolver routes the rest to Triton)
CASES = [(HopperTritonDense, n, k) for n, k in SHAPES] + [(HopperFlashInferDense, n, k) for n, k in SHAPES[:2]]


@pytest.mark.parametrize("m", [1, 7, 128, 1000])
@pytest.mark.parametrize("backend_cls,n,k", CASES)
def test_backend_matches_reference(m, backend_cls, n, k):
    if backend_cls is HopperFlashInferDense:
        pytest.importorskip("flashinfer")
    layer, be = _layer(backend_cls, n, k)
    if backend_cls is HopperTritonDense:
        be.weight_only_max_m = 0  # its W8A8 kernel here; small batches' weight-only product is tested below
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = be.apply(layer, x).float()
    ref = _reference(layer, be, x)
    rel = ((out - ref).norm() / ref.norm()).item()
    assert torch.isfinite(out).all() and rel < 1e-2, rel


def test_triton_bias_and_cuda_graph_replay_equal_eager():
    layer, be = _layer(HopperTritonDense, 1000, 2080)
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
@pytest.mark.parametrize("backend_cls,n,k", [(HopperTritonDense, n, k) for n, k in SHAPES]
                         + [(HopperFlashInferDense, n, k) for n, k in SHAPES])
def test_weight_only_gemm_matches_reference(m, backend_cls, n, k):
    """Weight-only FP8 on either backend's converted scales: BF16 activation as given, no quantization."""
    from sglang_mxfp8.triton_hopper import w8a16_gemm

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
    """The Triton backend's apply() runs the weight-only kernel up to weight_only_max_m tokens, W8A8 above."""
    from sglang_mxfp8.triton_hopper import w8a16_gemm

    layer, be = _layer(HopperTritonDense, 2048, 4096)
    limit = be.weight_only_max_m
    assert limit >= 1
    for m in (1, limit, limit + 1):
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        got = be.apply(layer, x)
        weight_only = w8a16_gemm(x, layer.weight, layer.mxfp8_converter.block_scale[0], be.block_rows)
        be.weight_only_max_m = 0
        w8a8 = be.apply(layer, x)
        be.weight_only_max_m = limit
        assert torch.equal(got, weight_only if m <= limit else w8a8), m
        assert not torch.equal(weight_only, w8a8)  # the two paths are distinguishable


@pytest.mark.parametrize("m", [1, 4, 16, 64])
def test_weight_only_moe_matches_reference(m):
    """Weight-only FP8 MoE (SGLang's token alignment, sgl_kernel's SiLU-and-mul) vs float32 on the same weights."""
    from sglang_mxfp8.refit import BlockScaleConverter
    from sglang_mxfp8.triton_hopper import moe_w8a16

    g = torch.Generator(device="cuda").manual_seed(m)
    e_count, h, inter, top_k = 16, 512, 256, 4
    w13, s13 = quantize_mxfp8(torch.randn(e_count, 2 * inter, h, device="cuda", generator=g) * 0.05)
    w2, s2 = quantize_mxfp8(torch.randn(e_count, h, inter, device="cuda", generator=g) * 0.05)
    c13 = BlockScaleConverter(e_count, 2 * inter, h, 128, "cuda", "w13")
    c13.refresh(w13, s13)
    c2 = BlockScaleConverter(e_count, h, inter, 128, "cuda", "w2")
    c2.refresh(w2, s2)
    x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16, generator=g)
    tw, ids = torch.topk(torch.softmax(torch.randn(m, e_count, device="cuda", generator=g), -1), top_k, dim=-1)
    tw, ids = (tw / tw.sum(-1, keepdim=True)).float(), ids.int()
    out = moe_w8a16(x, w13, c13.block_scale, w2, c2.block_scale, tw, ids).float()
    ref = torch.zeros(m, h, device="cuda")
    for e in range(e_count):
        rows, slots = (ids == e).nonzero(as_tuple=True)
        if len(rows):
            gate_up = x[rows].float() @ dequantize_block_fp8(w13[e], c13.block_scale[e], 128).t()
            act = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
            y = act @ dequantize_block_fp8(w2[e], c2.block_scale[e], 128).t()
            ref.index_add_(0, rows, y * tw[rows, slots, None])
    rel = ((out - ref).norm() / ref.norm()).item()
    assert torch.isfinite(out).all() and rel < 1e-2, rel  # bf16 intermediates and output


PRECOMPILE = r"""
import os, random, sys, torch
from flashinfer.gemm import fp8_blockscale_gemm_sm90
from sglang_mxfp8 import flashinfer_sm90 as fs
from sglang_mxfp8.numerics import convert_to_block_scales, quantize_mxfp8
n, k, max_m = 2048, 4096, 2048
q, s = quantize_mxfp8(torch.randn(n, k, device="cuda") * 0.02)
bs, _ = convert_to_block_scales(q, s, 128)
cache = os.path.join(os.environ["TRTLLM_DG_CACHE_DIR"], "cache")
ran = fs.precompile(q, bs, torch.bfloat16, max_m)
compiled = set(os.listdir(cache))
sms = torch.cuda.get_device_properties(0).multi_processor_count
expected = {fs.jit_kernel_name(n, k, c) for c in fs.configs_up_to(n, k, max_m, sms)}
print("RAN", ran, "COMPILED", len(compiled), "MISSING", sorted(expected - compiled), "EXTRA", sorted(compiled - expected))
for m in random.Random(0).sample(range(1, max_m + 1), 40):
    fp8_blockscale_gemm_sm90(torch.randn(m, k, device="cuda", dtype=torch.bfloat16), q, None, bs, out_dtype=torch.bfloat16)
torch.cuda.synchronize()
print("NEW_AFTER", sorted(set(os.listdir(cache)) - compiled))
"""


def test_precompile_compiles_exactly_the_kernels_flashinfer_selects(tmp_path):
    """FlashInfer's JIT, asked to write its cubins, names each kernel it compiles: precompiling must
    produce exactly our enumeration's names, and serving any M afterwards must compile nothing new."""
    import subprocess
    import sys

    pytest.importorskip("flashinfer")
    env = dict(os.environ, TRTLLM_DG_JIT_DUMP_CUBIN="1", TRTLLM_DG_CACHE_DIR=str(tmp_path))
    p = subprocess.run([sys.executable, "-c", PRECOMPILE], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    line = next(x for x in p.stdout.splitlines() if x.startswith("RAN"))
    assert "MISSING [] EXTRA []" in line, line
    assert "NEW_AFTER []" in p.stdout, p.stdout
