"""Our Hopper Triton kernels' indexing, run on the CPU by Triton's interpreter (TRITON_INTERPRET=1).

Checks tiles, masks (M, N, K tails; K a multiple of 32 but not of 128), scale handling and bias
against float32 references, for the W8A8 GEMM with its quantizer and the weight-only GEMM. The interpreter's float->e4m3 cast does not round like the GPU's
(cvt.rn.satfinite), so the quantizer is checked here for its scales only; its rounding, speed and
the FP8 tensor-core path are tested on the H200 (tests/gpu, benchmarks/).
"""

from conftest import run_python

CODE = r"""
import torch
from sglang_mxfp8 import triton_hopper as th
from sglang_mxfp8.numerics import convert_to_block_scales, dequantize_block_fp8, quantize_activation_1x128, quantize_mxfp8
torch.manual_seed(0)
worst = 0.0
for m, n, k in [(1, 64, 128), (7, 200, 352), (33, 130, 256), (16, 96, 96), (70, 64, 160), (130, 72, 160)]:
    x = (torch.randn(m, k) * torch.logspace(-2, 2, k)).to(torch.bfloat16)
    q, s_ref = quantize_activation_1x128(x)
    for rows in (None, 1, 4, 16):  # tile heights: M tails masked in rows, K tails in columns
        _, s = th.quantize_act_1x128(x, rows)
        assert torch.equal(s, s_ref), (m, k, rows)  # amax / 448 per (row, 128 columns)
    w, ws = quantize_mxfp8(torch.randn(n, k) * 0.02)
    bs, _ = convert_to_block_scales(w, ws, 1)
    bias = torch.randn(n).to(torch.bfloat16)
    out = th.w8a8_gemm(q, s_ref, w, bs, torch.bfloat16, bias)
    deq = q.float() * s_ref.repeat_interleave(128, 1)[:, :k]
    ref = deq @ dequantize_block_fp8(w, bs, 1).t() + bias.float()
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    worst = max(worst, ((out.float() - ref).norm() / ref.norm()).item())
print(f"{worst:.6f}")
"""

WEIGHT_ONLY = r"""
import torch
from sglang_mxfp8 import triton_hopper as th
from sglang_mxfp8.numerics import convert_to_block_scales, dequantize_block_fp8, quantize_mxfp8
torch.manual_seed(1)
worst = 0.0
for m, n, k in [(1, 64, 128), (7, 200, 352), (16, 130, 256), (33, 96, 96), (64, 300, 160)]:
    x = (torch.randn(m, k) * torch.logspace(-2, 2, k)).to(torch.bfloat16)
    w, ws = quantize_mxfp8(torch.randn(n, k) * torch.logspace(-3, 1, n)[:, None])
    bias = torch.randn(n).to(torch.bfloat16)
    for rows in (1, 128):  # our Triton layout (per row) and FlashInfer's (128x128)
        bs, _ = convert_to_block_scales(w, ws, rows)
        deq = dequantize_block_fp8(w, bs, rows)
        assert torch.equal(deq.to(torch.bfloat16).float(), deq)  # e4m3 x 2^k is exact in bf16
        for cfg in (None, dict(BLOCK_M=16, BLOCK_N=16, num_warps=2, num_stages=2)):
            # float32 activation: the interpreter's bf16 dot is wrong (the GPU's is tested in tests/gpu)
            out = th._w8a16(x.float(), w, bs, rows, bias.float(), cfg)
            ref = x.double() @ deq.double().t() + bias.double()
            assert out.shape == (m, n) and out.dtype == torch.float32
            worst = max(worst, ((out.double() - ref).norm() / ref.norm()).item())
try:
    th.w8a16_gemm(x.half(), w, bs, rows)
except TypeError as e:
    assert "bfloat16" in str(e)
else:
    raise AssertionError("fp16 accepted")
print(f"{worst:.6f}")
"""


def test_interpreted_triton_kernels_match_float32_references():
    p = run_python(CODE, {"TRITON_INTERPRET": "1"}, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert float(p.stdout.split()[-1]) < 5e-3  # fp32 accumulation; bf16 output rounding only


def test_interpreted_weight_only_kernel_matches_float32_reference():
    p = run_python(WEIGHT_ONLY, {"TRITON_INTERPRET": "1"}, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert float(p.stdout.split()[-1]) < 1e-5  # exact weights, fp32 operands and accumulation
