"""Our Hopper Triton kernels' indexing, run on the CPU by Triton's interpreter (TRITON_INTERPRET=1).

Checks tiles, masks (M, N, K tails; K a multiple of 32 but not of 128), scale handling and bias
against float32/float64 references, for the W8A8 GEMM with its quantizer, the weight-only dense GEMM
and the MoE kernels. The interpreter's float->e4m3 cast does not round like the GPU's (cvt.rn.satfinite),
so the quantizer is checked here for its scales only; its rounding, speed and the FP8 tensor-core
path are tested on the H200 (tests/gpu, sglang-mxfp8 bench layers).
"""

from conftest import run_python
import pytest

pytestmark = pytest.mark.sglang  # CI runs these again with the newest SGLang

CODE = r"""
import torch
from sglang_mxfp8.ops.triton_sm90 import act_quant, dense_w8a8
from sglang_mxfp8.format.numerics import (convert_to_block_scales, dequantize_block_fp8, quantize_activation_1x128,
                                          quantize_mxfp8)
torch.manual_seed(0)
worst = 0.0
for m, n, k in [(1, 64, 128), (7, 200, 352), (33, 130, 256), (16, 96, 96), (70, 64, 160), (130, 72, 160)]:
    x = (torch.randn(m, k) * torch.logspace(-2, 2, k)).to(torch.bfloat16)
    q, s_ref = quantize_activation_1x128(x)
    for rows in (None, 1, 4, 16):  # tile heights: M tails masked in rows, K tails in columns
        _, s = act_quant.quantize_act_1x128(x, rows)
        assert torch.equal(s, s_ref), (m, k, rows)  # amax / 448 per (row, 128 columns)
        # cuBLAS's layout: rows padded to a multiple of 4 with zeros, scales token-fastest
        qm, sm = act_quant.quantize_act_1x128(x, rows, m_major=True)
        pad = -m % 4
        assert qm.shape == (m + pad, k) and sm.shape == (m + pad, s_ref.shape[1]) and sm.stride() == (1, m + pad)
        assert torch.equal(sm[:m], s_ref) and not qm[m:].float().any() and bool((sm[m:] == 1e-12).all()), (m, rows)
    nan = x.clone()
    nan[-1, k - 1] = float("nan")  # the host reference's row maximum propagates it: a NaN scale for that group
    _, s_nan = act_quant.quantize_act_1x128(nan)
    assert s_nan[-1, -1].isnan() and torch.equal(s_nan[:-1], s_ref[:-1]) and torch.equal(s_nan[-1, :-1], s_ref[-1, :-1])
    assert torch.equal(quantize_activation_1x128(nan)[1].isnan(), s_nan.isnan())
    w, ws = quantize_mxfp8(torch.randn(n, k) * 0.02)
    bs, _ = convert_to_block_scales(w, ws, 1)
    bias = torch.randn(n).to(torch.bfloat16)
    out = dense_w8a8.w8a8_gemm(q, s_ref, w, bs, torch.bfloat16, bias)
    deq = q.float() * s_ref.repeat_interleave(128, 1)[:, :k]
    ref = deq @ dequantize_block_fp8(w, bs, 1).t() + bias.float()
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err == err, (m, n, k)  # NaN would slip through max()
    worst = max(worst, err)
print(f"{worst:.6f}")
"""

WEIGHT_ONLY = r"""
import torch
from sglang_mxfp8.ops.triton_sm90 import dense_w8a16
from sglang_mxfp8.format.numerics import convert_to_block_scales, dequantize_block_fp8, quantize_mxfp8
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
            out = dense_w8a16._w8a16(x.float(), w, bs, rows, bias.float(), cfg)
            ref = x.double() @ deq.double().t() + bias.double()
            assert out.shape == (m, n) and out.dtype == torch.float32
            err = ((out.double() - ref).norm() / ref.norm()).item()
            assert err == err, (m, n, k, rows)  # NaN would slip through max()
            worst = max(worst, err)
try:
    dense_w8a16.w8a16_gemm(x.half(), w, bs, rows)
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


ALIGN = r"""
import torch

def align(topk_ids, block, num_experts):
    # SGLang's moe_align_block_size contract: ids grouped by expert, each group padded to the block
    # with the id numel() (invalid), one expert id per block, the padded total
    flat = topk_ids.flatten()
    groups, experts = [], []
    for e in range(num_experts):
        ids = (flat == e).nonzero().flatten().int()
        if len(ids):
            ids = torch.cat([ids, torch.full(((-len(ids)) % block,), flat.numel(), dtype=torch.int32)])
            groups.append(ids)
            experts += [e] * (len(ids) // block)
    sorted_ids = torch.cat(groups)
    return sorted_ids, torch.tensor(experts, dtype=torch.int32), torch.tensor([len(sorted_ids)], dtype=torch.int32)
"""

MOE_W8A8 = (
    ALIGN
    + r"""
import torch.nn.functional as F
from sglang_mxfp8.ops.triton_sm90 import act_quant, moe_sorted, splitk_w8a8
from sglang_mxfp8.format.numerics import dequantize_block_fp8, quantize_activation_1x128, quantize_mxfp8
from sglang_mxfp8.layouts.hopper import BlockScaleConverter

def silu_and_mul(u):
    return (F.silu(u[:, :u.shape[1] // 2].float()) * u[:, u.shape[1] // 2:].float()).to(u.dtype)

def deq_act(a):
    q, s = a
    return q.double() * s.double().repeat_interleave(128, 1)[:, :q.shape[1]]

torch.manual_seed(4)
gemm_worst = moe_worst = 0.0
# hidden / intermediate off the 128 grid (96, 160, 224, 288, 576): K tails masked in both GEMMs, N tails in w13's 2I
# and w2's H rows, 128x128 scale blocks cut short at both ends
for e_count, h, inter, top_k, m in [(4, 96, 96, 2, 5), (4, 576, 160, 3, 17), (8, 288, 224, 2, 40)]:
    w13, s13 = quantize_mxfp8(torch.randn(e_count, 2 * inter, h) * torch.logspace(-3, 0, h))
    # the same experts with w13 as [up; gate] (FlashInfer's order), taken before the conversion rewrites w13 in place
    w13s, s13s = torch.cat([w13[:, inter:], w13[:, :inter]], 1), torch.cat([s13[:, inter:], s13[:, :inter]], 1)
    w2, s2 = quantize_mxfp8(torch.randn(e_count, h, inter) * 0.05)
    c13 = BlockScaleConverter(e_count, 2 * inter, h, 128, "cpu", "w13"); c13.refresh(w13, s13)
    c2 = BlockScaleConverter(e_count, h, inter, 128, "cpu", "w2"); c2.refresh(w2, s2)
    assert c13.block_scale.shape == (e_count, -(-2 * inter // 128), -(-h // 128))
    d13 = [dequantize_block_fp8(w13[e], c13.block_scale[e], 128).double() for e in range(e_count)]
    d2 = [dequantize_block_fp8(w2[e], c2.block_scale[e], 128).double() for e in range(e_count)]
    # float32 activations: the interpreter's bf16 rounding is not the GPU's either (bf16 is tested in tests/gpu)
    x = torch.randn(m, h) * torch.logspace(-1, 1, h)
    tw, ids = torch.topk(torch.softmax(torch.randn(m, e_count), -1), top_k, dim=-1)
    tw, ids = (tw / tw.sum(-1, keepdim=True)).float(), ids.int()
    for cfg in (dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=2),
                dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=2)):
        # the GEMM alone, on the host quantizer's activation: its indexing, masks and scales against float64
        q, s = quantize_activation_1x128(x)
        sorted_ids, expert_ids, padded = align(ids, cfg["BLOCK_M"], e_count)
        up = torch.empty(m * top_k, 2 * inter, dtype=torch.float32)
        moe_sorted._moe_gemm_w8a8(q, s, w13, c13.block_scale, up, sorted_ids, expert_ids, padded, tw, top_k, cfg)
        ref_up = torch.stack([deq_act((q, s))[t // top_k] @ d13[int(ids.flatten()[t])].t() for t in range(m * top_k)])
        gemm_worst = max(gemm_worst, ((up.double() - ref_up).norm() / ref_up.norm()).item())
        # the whole MoE, against float64 GEMMs on activations quantized by the same Triton quantizer (the
        # interpreter's e4m3 cast is not the GPU's, so the host quantizer would differ by a few percent)
        out = moe_sorted.moe_w8a8(x, w13, c13.block_scale, w2, c2.block_scale, tw, ids, cfg, align, silu_and_mul)
        ref = torch.zeros(m, h, dtype=torch.float64)
        xq = deq_act(act_quant.quantize_act_1x128(x))
        for t in range(m):
            for j in range(top_k):
                e = int(ids[t, j])
                gate_up = (d13[e] @ xq[t]).float()
                act = deq_act(act_quant.quantize_act_1x128(silu_and_mul(gate_up[None])))[0]
                ref[t] += tw[t, j].double() * (d2[e] @ act)
        assert out.shape == (m, h) and out.dtype == torch.float32
        err = ((out.double() - ref).norm() / ref.norm()).item()
        assert err == err, (e_count, h, inter, m)  # NaN would slip through max()
        moe_worst = max(moe_worst, err)
    # w13 as [up; gate], converted on its own: the same MoE, each half read where it lies
    c13s = BlockScaleConverter(e_count, 2 * inter, h, 128, "cpu", "w13"); c13s.refresh(w13s, s13s)
    d13s = [dequantize_block_fp8(w13s[e], c13s.block_scale[e], 128).double() for e in range(e_count)]
    out = moe_sorted.moe_w8a8(x, w13s, c13s.block_scale, w2, c2.block_scale, tw, ids, cfg, align, silu_and_mul,
                              up_first=True)
    ref = torch.zeros(m, h, dtype=torch.float64)
    for t in range(m):
        for j in range(top_k):
            e = int(ids[t, j])
            up_gate = (d13s[e] @ xq[t]).float()
            gate_up = torch.cat([up_gate[inter:], up_gate[:inter]])
            act = deq_act(act_quant.quantize_act_1x128(silu_and_mul(gate_up[None])))[0]
            ref[t] += tw[t, j].double() * (d2[e] @ act)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err == err, (e_count, h, inter, m, "up first")
    moe_worst = max(moe_worst, err)
print(f"{gemm_worst:.8f} {moe_worst:.6f}")
"""
)


def test_interpreted_masked_w8a8_moe_matches_float64_reference():
    p = run_python(MOE_W8A8, {"TRITON_INTERPRET": "1"}, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    gemm, moe = map(float, p.stdout.split()[-2:])
    assert gemm < 1e-6  # exact operands, float32 accumulation and output
    assert moe < 1e-5  # float32 intermediates, output and sum over top_k


GEMV = r"""
import torch
import torch.nn.functional as F
from sglang_mxfp8.ops.triton_sm90 import gemv
from sglang_mxfp8.format.numerics import convert_to_block_scales, dequantize_block_fp8, quantize_mxfp8
from sglang_mxfp8.layouts.hopper import BlockScaleConverter

torch.manual_seed(3)
worst = 0.0
for n, k in [(64, 128), (200, 352), (130, 256), (96, 96), (300, 544)]:  # N and K tails, K % 128 != 0
    x = torch.randn(1, k) * torch.logspace(-2, 2, k)
    w, ws = quantize_mxfp8(torch.randn(n, k) * torch.logspace(-3, 1, n)[:, None])
    bias = torch.randn(n)
    for rows in (1, 128):  # our Triton layout (per row) and FlashInfer's (128x128)
        bs, _ = convert_to_block_scales(w, ws, rows)
        deq = dequantize_block_fp8(w, bs, rows).double()
        for cfg in (None, dict(BLOCK_N=8, GROUPS=4, num_warps=2, num_stages=2)):  # K groups masked past KB
            for b in (None, bias):
                # float32 activation: the interpreter truncates to bf16 (the GPU rounds; tested in tests/gpu)
                out = gemv._w8a16_gemv(x, w, bs, rows, b, cfg)
                ref = x.double() @ deq.t() + (0 if b is None else b.double())
                err = ((out.double() - ref).norm() / ref.norm()).item()
                assert out.shape == (1, n) and err == err, (n, k, rows)  # NaN would slip through max()
                worst = max(worst, err)
swapped_equal = []
for e_count, h, inter, top_k in [(8, 256, 128, 2), (8, 384, 160, 3), (4, 288, 96, 3)]:  # H, I, 2I tails
    w13, s13 = quantize_mxfp8(torch.randn(e_count, 2 * inter, h) * 0.05)
    # the same experts with w13 as [up; gate] (FlashInfer's order), taken before the conversion rewrites w13 in place
    w13s, s13s = torch.cat([w13[:, inter:], w13[:, :inter]], 1), torch.cat([s13[:, inter:], s13[:, :inter]], 1)
    w2, s2 = quantize_mxfp8(torch.randn(e_count, h, inter) * 0.05)
    c13 = BlockScaleConverter(e_count, 2 * inter, h, 128, "cpu", "w13"); c13.refresh(w13, s13)
    c2 = BlockScaleConverter(e_count, h, inter, 128, "cpu", "w2"); c2.refresh(w2, s2)
    x = torch.randn(1, h)
    tw, ids = torch.topk(torch.softmax(torch.randn(1, e_count), -1), top_k, dim=-1)
    tw, ids = (tw / tw.sum(-1, keepdim=True)).float(), ids.int()
    per_slot = []
    for j in range(top_k):
        e = int(ids[0, j])
        gate_up = dequantize_block_fp8(w13[e], c13.block_scale[e], 128).double() @ x[0].double()
        down = dequantize_block_fp8(w2[e], c2.block_scale[e], 128).double()
        per_slot.append(tw[0, j] * (down @ (F.silu(gate_up[:inter]) * gate_up[inter:])))
    ref = sum(per_slot)
    tile = dict(BLOCK_N=128, GROUPS=2, num_warps=2, num_stages=2)  # N tails below BLOCK_N, K groups masked
    for up_cfg, down_cfg in ((None, None), (tile, dict(tile, BLOCK_N=64, GROUPS=4))):
        out = gemv._moe_gemv(x, w13, c13.block_scale, w2, c2.block_scale, tw, ids, up_cfg, down_cfg)
        err = ((out[0].double() - ref).norm() / ref.norm()).item()
        assert out.shape == (1, h) and err == err, (e_count, h, inter)
        worst = max(worst, err)
    # w13 as [up; gate], converted on its own: each half read where it lies
    c13s = BlockScaleConverter(e_count, 2 * inter, h, 128, "cpu", "w13"); c13s.refresh(w13s, s13s)
    swapped = gemv._moe_gemv(x, w13s, c13s.block_scale, w2, c2.block_scale, tw, ids, None, None, up_first=True)
    ref_s = 0
    for j in range(top_k):
        e = int(ids[0, j])
        up_gate = dequantize_block_fp8(w13s[e], c13s.block_scale[e], 128).double() @ x[0].double()
        down = dequantize_block_fp8(w2[e], c2.block_scale[e], 128).double()
        ref_s = ref_s + tw[0, j] * (down @ (F.silu(up_gate[inter:]) * up_gate[:inter]))
    worst = max(worst, ((swapped[0].double() - ref_s).norm() / ref_s.norm()).item())
    if inter % 128 == 0:  # 128-row blocks that hold one half each convert alike in either order: the same bits
        swapped_equal.append(torch.equal(swapped, gemv._moe_gemv(x, w13, c13.block_scale, w2, c2.block_scale, tw, ids,
                                                               None, None)))
    dropped = ids.clone()
    dropped[0, -1] = -1  # an expert id < 0 (not on this rank) adds nothing
    out = gemv._moe_gemv(x, w13, c13.block_scale, w2, c2.block_scale, tw, dropped, None, None)
    rest = sum(per_slot[:-1])
    worst = max(worst, ((out[0].double() - rest).norm() / rest.norm()).item())
for bad in (torch.randn(1, 64).half(), torch.randn(2, 64).bfloat16()):
    for call in (lambda: gemv.w8a16_gemv(bad, w, bs, rows), lambda: gemv.moe_gemv(bad, w13, s13, w2, s2, tw, ids)):
        try:
            call()
        except TypeError as e:
            assert "one bfloat16 token" in str(e)
        else:
            raise AssertionError(f"{bad.dtype} {tuple(bad.shape)} accepted")
print(swapped_equal == [True], f"{worst:.8f}")
"""


def test_interpreted_gemv_kernels_match_float64_reference():
    p = run_python(GEMV, {"TRITON_INTERPRET": "1"}, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    equal, worst = p.stdout.split()[-2:]
    assert equal == "True"  # w13 as [up; gate] gives the bits of [gate; up] where its blocks convert alike
    assert float(worst) < 1e-5  # exact weights, fp32 operands and accumulation


GROUPED_GLUE = r"""
import torch
import torch.nn.functional as F
from sglang_mxfp8.ops.triton_sm90 import act_quant, moe_segments
from sglang_mxfp8.format.numerics import quantize_activation_1x128
torch.manual_seed(3)
experts, top_k = 6, 3
for m, k in [(1, 128), (5, 256), (9, 1152)]:  # 1152: nine 128-groups, a second K step with one group in it
    x = (torch.randn(m, k) * torch.logspace(-2, 2, k)).to(torch.bfloat16)
    x[-1, 7] = float("nan")
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(m)]).int()
    counts = torch.bincount(ids.flatten().long(), minlength=experts).int()
    padded = (counts + 127) // 128 * 128
    starts = (torch.cumsum(padded, 0) - padded).int()
    cursor, seg_end, end = moe_segments.moe_segments(ids, experts)
    assert torch.equal(cursor, starts) and torch.equal(seg_end, starts + padded) and torch.equal(end, starts + counts)
    rows = int(padded.sum()) + 128
    q, s, slots = moe_segments.moe_scatter_quant(x, ids, cursor, rows)
    assert torch.equal(cursor, starts + counts)  # advanced past each expert's slots
    q_tok, s_tok = act_quant.quantize_act_1x128(x)  # the interpreter's e4m3 cast on both sides
    assert torch.equal(s_tok.isnan(), quantize_activation_1x128(x)[1].isnan())
    assert s.shape == (rows, k // 128) and s.stride() == (1, rows) and slots.shape == (m, top_k)
    assert slots.unique().numel() == m * top_k  # no row claimed twice
    for t in range(m):
        for j in range(top_k):
            r, e = int(slots[t, j]), int(ids[t, j])
            assert starts[e] <= r < starts[e] + counts[e], (m, t, j)  # inside its expert's segment
            assert torch.equal(q[r].view(torch.uint8), q_tok[t].view(torch.uint8))
            assert torch.allclose(s[r], s_tok[t], rtol=0, atol=0, equal_nan=True)  # the NaN token's NaN scale too
    # the weighted gather against a float64 sum
    y = torch.randn(rows, 192).to(torch.bfloat16)
    tw = torch.rand(m, top_k)
    out = moe_segments.moe_gather(y, slots, tw)
    ref = (y[slots.long()].double() * tw.double()[..., None]).sum(1)
    assert out.dtype == torch.bfloat16 and out.shape == (m, 192)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 4e-3, m
# SiLU-and-mul with the quantizer on the rows that hold slots (experts of 20, 0, 37 and 128 slots: a partial 16-row
# block, an empty segment, a full one), against SiLU-and-mul in bf16 and the host quantizer's scales (the
# interpreter's exp may put a product on the neighbouring bf16 value: scales to 1%); the values dequantized against
# the activation (the interpreter's e4m3 cast is not the GPU's: a loose bound, a wrong row or column gives O(1))
inter = 256
counts = torch.tensor([20, 0, 37, 128], dtype=torch.int32)
ids = torch.repeat_interleave(torch.arange(4, dtype=torch.int32), counts)[torch.randperm(int(counts.sum()))]
_, seg_end, end = moe_segments.moe_segments(ids.view(-1, 1), 4)
assert seg_end.tolist() == [128, 128, 256, 384] and end.tolist() == [20, 128, 165, 384]
h = torch.randn(384 + 16, 2 * inter).to(torch.bfloat16)
a, a_s = moe_segments.silu_mul_quant(h, seg_end, end)
assert a_s.stride() == (1, 400)
a_up, a_s_up = moe_segments.silu_mul_quant(torch.cat([h[:, inter:], h[:, :inter]], 1), seg_end, end, up_first=True)
for lo, hi in [(0, 20), (128, 165), (256, 384)]:  # [up | gate] in: the same bits on the rows that hold a slot
    assert torch.equal(a_up[lo:hi].view(torch.uint8), a[lo:hi].view(torch.uint8))
    assert torch.equal(a_s_up[lo:hi], a_s[lo:hi])
act = (F.silu(h[:, :inter].float()) * h[:, inter:].float()).to(torch.bfloat16).float()
for lo, hi in [(0, 20), (128, 165), (256, 384)]:
    assert torch.allclose(a_s[lo:hi], quantize_activation_1x128(act[lo:hi])[1], rtol=1e-2, atol=0), (lo, hi)
    deq = a[lo:hi].float() * a_s[lo:hi].repeat_interleave(128, 1)
    assert ((deq - act[lo:hi]).norm() / act[lo:hi].norm()).item() < 0.1, (lo, hi)
# 300 experts over 5000 slots: five programs' histograms, bins past 256
ids = torch.randint(0, 300, (1000, 5), dtype=torch.int32)
counts = torch.bincount(ids.flatten().long(), minlength=300).int()
padded = (counts + 127) // 128 * 128
cursor, seg_end, end = moe_segments.moe_segments(ids, 300)
assert torch.equal(seg_end, torch.cumsum(padded, 0).int()) and torch.equal(end, seg_end - padded + counts)
assert torch.equal(cursor, seg_end - padded)
print("ok")
"""


def test_interpreted_grouped_moe_glue_matches_references():
    p = run_python(GROUPED_GLUE, {"TRITON_INTERPRET": "1"}, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split()[-1] == "ok"


SM90_COMPILE = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from sglang_mxfp8.ops.triton_sm90 import act_quant, moe_sorted, splitk_w8a8

def compile_sm90(kernel, pointers, constexprs, config):
    signature = {n: "constexpr" if n in constexprs else pointers.get(n, "i32") for n in kernel.arg_names}
    return triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                          target=GPUTarget("cuda", 90, 32), options=config)

moe = {"sorted_ids_ptr": "*i32", "expert_ids_ptr": "*i32", "padded_ptr": "*i32", "topk_w_ptr": "*fp32",
       "b_ptr": "*fp8e4nv", "sb_ptr": "*fp32", "c_ptr": "*bf16"}
for m, top_k, experts in ((4, 8, 128), (4096, 8, 128)):  # both tile configs the masked MoE picks
    cfg = moe_sorted.moe_w8a8_config(m, top_k, experts)
    tiles = {k: v for k, v in cfg.items() if k.startswith("BLOCK")}
    for gemm in (dict(A_ROW_DIV=top_k, MUL_ROUTED_WEIGHT=False, SWAP_HALVES=True),
                 dict(A_ROW_DIV=1, MUL_ROUTED_WEIGHT=True, SWAP_HALVES=False)):
        c = compile_sm90(moe_sorted._moe_w8a8_kernel, {**moe, "a_ptr": "*fp8e4nv", "sa_ptr": "*fp32"},
                         {**gemm, **tiles, "BLOCK_K": act_quant.GROUP_K},
                         {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})
        print("w8a8", tiles["BLOCK_M"], len(c.asm["cubin"]), "wgmma" if "wgmma" in c.asm["ptx"] else
              "mma" if "mma.sync" in c.asm["ptx"] else "no-mma")
dense = {"x_ptr": "*bf16", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "bias_ptr": "*bf16",
         "out_ptr": "*bf16", "sum_ptr": "*fp32", "ticket_ptr": "*i32"}
for m, atomic, quant_first in ((16, True, False), (16, False, False), (128, True, True)):
    cfg = splitk_w8a8.splitk_config(m, 5120, 2048)
    c = compile_sm90(splitk_w8a8._splitk_kernel, {**dense, "x_ptr": "*fp8e4nv" if quant_first else "*bf16"},
                     dict(HAS_BIAS=True, ATOMIC=atomic, SCALE_ROWS=1, QUANT_FIRST=quant_first, BLOCK_M=cfg["BLOCK_M"],
                          BLOCK_N=cfg["BLOCK_N"], GROUP=act_quant.GROUP_K),
                     {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})
    ptx = c.asm["ptx"]
    print("splitk", m, atomic, len(c.asm["cubin"]), "mma" if "mma" in ptx else "no-mma",
          "ticket" if "atom.global.gpu.acq_rel.add" in ptx else "no-ticket")
"""


def test_moe_kernels_compile_for_sm90_with_tensor_core_dots():
    """Triton compiles the sorted-token MoE kernels for sm_90 on this GPU-less machine (the interpreter runs no
    compiler): the masked W8A8 MoE at both tile configs it picks, its up and down GEMMs, lowers its FP8 dot to tensor
    cores (wgmma for 64-row tiles, mma for 16-row ones); so does the split-K dense GEMM, split or not."""
    p = run_python(SM90_COMPILE, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [line.split() for line in p.stdout.splitlines() if line.startswith("w8a8")]
    assert [(kind, rows, dot) for kind, rows, _, dot in lines] == [
        ("w8a8", "16", "mma"), ("w8a8", "16", "mma"), ("w8a8", "64", "wgmma"), ("w8a8", "64", "wgmma")]
    assert all(int(size) > 10_000 for _, _, size, _ in lines)  # cubins, not empty modules
    split = [line.split()[1:] for line in p.stdout.splitlines() if line.startswith("splitk")]
    # the split-K GEMM: tensor-core dots; split launches take their row block's ticket with an acq_rel atomic
    assert [(m, atomic, dot, ticket) for m, atomic, _, dot, ticket in split] == [
        ("16", "True", "mma", "ticket"), ("16", "False", "mma", "no-ticket"), ("128", "True", "mma", "ticket")], split
    assert all(int(size) > 10_000 for _, _, size, _, _ in split)


BLOCK_SCALES = r"""
import torch
from sglang_mxfp8.layouts.hopper_triton import to_block_scales_
from sglang_mxfp8.format.numerics import block_exponents, count_shifted, quantize_mxfp8

def both(q, s, br):
    # the GPU kernel (interpreted) against the torch conversion, on copies of the same bytes
    nonzero = ((q.view(torch.uint8) & 0x7F).reshape(q.shape[0], -1, 32).amax(-1) > 0)
    ref_q, got_q = q.clone(), q.clone()
    ref_e = block_exponents(ref_q, s, br, nonzero)
    ref_changed = int(count_shifted(ref_q, s, ref_e, br))
    got_e = torch.full_like(ref_e, 12345)
    got_changed = int(to_block_scales_(got_q, s, nonzero, br, got_e))
    assert torch.equal(got_e, ref_e), (br, (got_e != ref_e).nonzero()[:4])
    bad = (got_q.view(torch.uint8) != ref_q.view(torch.uint8)).nonzero()
    assert len(bad) == 0, (br, [(int(q.view(torch.uint8)[i, j]), int(got_q.view(torch.uint8)[i, j]),
                                 int(ref_q.view(torch.uint8)[i, j])) for i, j in bad[:4]])
    assert got_changed == ref_changed, (got_changed, ref_changed)
    return ref_changed

# every e4m3 byte but the two NaNs, moved down by 0..20 places: rows of 4 sub-blocks, the first at exponent 30 (the
# block's), the other three at 30 - d
codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
codes = torch.cat([codes, codes[:2]])  # 256: 8 chunks of 32
rows, scales = [], []
for d in range(21):
    for chunk in codes.view(8, 32):
        rows.append(chunk.repeat(4))
        scales.append(torch.tensor([127 + 30] + [127 + 30 - d] * 3, dtype=torch.uint8))
q = torch.stack(rows).view(torch.float8_e4m3fn)
s = torch.stack(scales)
changed = {br: both(q, s, br) for br in (1, 128)}
assert changed[1] == changed[128] > 0
# random weights: rows and K not multiples of the tiles, whole zero sub-blocks under large scale bytes (which must not
# set a block's exponent), rows of very different magnitudes (so elements fall into the subnormals), -0 kept
torch.manual_seed(0)
total = 0
for r, k in [(200, 160), (256, 2048), (31, 96), (384, 352)]:
    w = torch.randn(r, k) * torch.logspace(-6, 2, r)[:, None] * torch.logspace(0, -4, k)
    w[::7, 32:64] = 0.0
    w[3, :32] = -0.0
    q, s = quantize_mxfp8(w)
    s[::7, 1] = 250
    for br in (1, 128):
        total += both(q, s, br)
assert total > 0
print("ok", changed[1], total)
"""


def test_interpreted_block_scale_conversion_matches_the_torch_conversion_bit_for_bit():
    p = run_python(BLOCK_SCALES, {"TRITON_INTERPRET": "1"}, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    ok, exhaustive, random = p.stdout.split()[-3:]
    assert ok == "ok" and int(exhaustive) > 1000 and int(random) > 0, p.stdout


QUANTIZE = r"""
import random, torch
from quantize_cases import quantize_cases
from sglang_mxfp8.format.numerics import quantize_mxfp8
from sglang_mxfp8.ops.mxfp8_quant import quantize_mxfp8 as quantize_on_gpu
seed = random.randrange(1 << 30)
for i, x in enumerate(quantize_cases(seed)):
    for rounding in ("ceil", "floor") if i != 1 else ("ceil",):
        q, s = quantize_on_gpu(x, rounding)
        ref_q, ref_s = quantize_mxfp8(x, rounding)
        bad = (q.view(torch.uint8) != ref_q.view(torch.uint8)).nonzero()[:3].tolist()
        assert q.shape == x.shape and q.dtype == torch.float8_e4m3fn and not bad, (seed, i, rounding, bad)
        assert torch.equal(s, ref_s), (seed, i, rounding, (s != ref_s).nonzero()[:3].tolist())
print("equal", seed)
"""


def test_interpreted_mxfp8_quantizer_writes_the_torch_quantizers_bytes():
    """The GPU quantizer of a trainer's float weights (ops/mxfp8_quant.py), run by Triton's interpreter, gives
    format.numerics.quantize_mxfp8's e4m3 and scale bytes exactly, for both scale roundings, on every BF16 and FP16
    value and on FP32 beyond both ends of the scale range; its integer arithmetic is what the GPU runs."""
    from conftest import importable_tests_env

    p = run_python(QUANTIZE, {"TRITON_INTERPRET": "1", **importable_tests_env()}, timeout=600)
    assert p.returncode == 0 and p.stdout.startswith("equal"), p.stderr[-3000:]


BUCKET_VALUES = r"""
import random, torch
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
from sglang_mxfp8.format.checkpoint import checked_values, refused_update
from sglang_mxfp8.format.numerics import quantize_mxfp8
from sglang_mxfp8.ops import value_checks
from sglang_mxfp8.sglang.patches.model_runner import _bucket_tensors

seed = random.randrange(1 << 30)
rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
BAD = {torch.float8_e4m3fn: [0x7F, 0xFF], torch.uint8: [0xFF], torch.bfloat16: [0x7F80, 0xFF80, 0x7FC0, 0x7F81],
       torch.float16: [0x7C00, 0xFC00, 0x7E00], torch.float32: [0x7F800000, 0xFF800000, 0x7FC00000]}
GOOD = {torch.bfloat16: [0x7F7F, 0x0001, 0x8000], torch.float16: [0x7BFF, 0x0001, 0x8000],  # max, subnormal, -0
        torch.float32: [0x7F7FFFFF, 0x00000001, 0x80000000], torch.uint8: [0x7F, 0xFE], torch.float8_e4m3fn: [0x7E]}
BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32,
        torch.uint8: torch.uint8, torch.float8_e4m3fn: torch.uint8}
for trial in range(6):
    named = []
    for i in range(rng.randrange(3, 12)):
        rows, k = rng.randrange(1, 9), 32 * rng.randrange(1, 5)
        q, s = quantize_mxfp8(torch.randn(rows, k, generator=g))
        w = f"model.layers.{i}.mlp.down_proj.weight"
        named += [(w, q), (w + "_scale_inv", s[:, : rng.randrange(1, s.shape[1] + 1)].contiguous())]  # odd lengths
        dtype = rng.choice([torch.bfloat16, torch.float16, torch.float32])
        norm = torch.randn(rng.randrange(1, 70), generator=g).to(dtype)
        named.append((f"model.layers.{i}.input_layernorm.weight", norm))
        named.append((f"model.layers.{i}.ids", torch.randint(0, 255, (rng.randrange(1, 9),), dtype=torch.uint8)))
    aligned, at = [], 0  # torch views a float at a multiple of its size only (SGLang's reconstruction too)
    for n, t in named:
        if at % t.element_size():
            pad = t.element_size() - at % t.element_size()
            aligned.append((f"{n}.pad", torch.zeros(pad, dtype=torch.uint8)))
            at += pad
        aligned.append((n, t.clone()))
        at += t.numel() * t.element_size()
    named = aligned
    for n, t in named:
        if t.dtype not in BITS or (t.dtype == torch.uint8 and not n.endswith("_scale_inv")):
            continue
        flat = t.view(-1).view(BITS[t.dtype])
        top = 1 << (8 * t.element_size() - 1)  # int16 / int32 hold the upper half as negative numbers
        signed = (lambda v: v if v < top or t.element_size() == 1 else v - 2 * top)
        flat[rng.randrange(flat.numel())] = signed(rng.choice(GOOD[t.dtype]))  # the range's edges: never refused
        if rng.random() < 0.3:
            flat[rng.randrange(flat.numel())] = signed(rng.choice(BAD[t.dtype]))
    bucket = FlattenedTensorBucket(named_tensors=named)
    sent = {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}
    views = _bucket_tensors(sent)
    checked = checked_values(views)
    assert value_checks.fits(sent["flattened_tensor"], checked), seed
    got = value_checks.bad_tensors(sent["flattened_tensor"], [t for _, _, t in checked]).tolist()
    want = [int(refused_update([(n, t)], structure=False) is not None) for n, _, t in checked]
    assert got == want, (seed, trial, got, want)
    assert value_checks.first_refused(sent["flattened_tensor"], checked) == refused_update(views, structure=False), seed
print("equal", seed)
"""


def test_interpreted_bucket_value_checks_refuse_what_the_torch_checks_refuse():
    """A trainer's flattened bucket (SGLang's own FlattenedTensorBucket) checked in one launch by
    ops/value_checks.py, run by Triton's interpreter: per tensor, the same verdict as the torch checks, on tensors at
    odd byte offsets, with each kind of NaN / Inf bit pattern and the largest finite, subnormal and -0 values."""
    from conftest import importable_tests_env

    p = run_python(BUCKET_VALUES, {"TRITON_INTERPRET": "1", **importable_tests_env()}, timeout=600)
    assert p.returncode == 0 and p.stdout.startswith("equal"), p.stderr[-3000:]


LOADED_SCAN = r"""
import random, torch
from sglang_mxfp8.format.checkpoint import refuse_flagged_rows, validate_loaded
from sglang_mxfp8.format.numerics import quantize_mxfp8
from sglang_mxfp8.layouts.fingerprints import row_fingerprints
from sglang_mxfp8.layouts.scan_triton import fingerprint_rows, scan_loaded

def refusal(f, *a):
    try:
        f(*a)
    except ValueError as e:
        return str(e)
    return None

seed = random.randrange(1 << 30)
torch.manual_seed(seed)
cases = 0
# rows not a multiple of a program's 16; K/32 blocks not a multiple of the 32 read at a time; scale rows of 3 and 35
# bytes (no word fingerprint: torch's byte path is used there)
for r, k in [(1, 32), (37, 96), (16, 1024), (50, 1120), (9, 2048)]:
    w = torch.randn(r, k) * torch.logspace(-4, 2, r)[:, None]
    w[1::5, :32] = 0.0
    w[::3, -32:] = -0.0
    q, s = quantize_mxfp8(w)
    s[1::5, 0] = 0  # a zero scale over a block of zeros is no missing scale
    for trouble in ("none", "nan weight", "nan scale", "missing scale", "all three"):
        qq, ss = q.clone(), s.clone()
        row = random.randrange(r)
        if trouble in ("nan weight", "all three"):
            qq.view(torch.uint8)[row, random.randrange(k)] = random.choice([0x7F, 0xFF])
        if trouble in ("nan scale", "all three"):
            ss[random.randrange(r), random.randrange(k // 32)] = 255
        if trouble in ("missing scale", "all three"):
            ss[row, -1] = 0
            qq.view(torch.uint8)[row, -1] = 0x38
        sig_w, sig_s = torch.full((r,), 7, dtype=torch.int64), torch.full((r,), 7, dtype=torch.int64)
        nonzero, flags, scale_done = scan_loaded(qq, ss, sig_w, sig_s)
        expected = refusal(validate_loaded, qq, ss, "layer.w")
        assert refusal(refuse_flagged_rows, flags, "layer.w") == expected, (seed, r, k, trouble, flags)
        assert (expected is None) == (trouble == "none"), (seed, r, k, trouble, expected)
        if expected is None:
            assert torch.equal(nonzero, validate_loaded(qq, ss, "layer.w")), (seed, r, k)
        assert torch.equal(sig_w, row_fingerprints(qq, torch.empty(r, dtype=torch.int64))), (seed, r, k, trouble)
        assert scale_done == ((k // 32) % 4 == 0), (r, k)
        if scale_done:
            assert torch.equal(sig_s, row_fingerprints(ss, torch.empty(r, dtype=torch.int64))), (seed, r, k)
        assert torch.equal(fingerprint_rows(qq.view(torch.uint8), torch.empty(r, dtype=torch.int64)), sig_w)
        cases += 1
# one byte changed anywhere changes its row's fingerprint, as on the torch path
b = q.view(torch.uint8).clone()
before = fingerprint_rows(b, torch.empty(b.shape[0], dtype=torch.int64))
b[4, 2047] ^= 0x80
after = fingerprint_rows(b, torch.empty(b.shape[0], dtype=torch.int64))
assert (before != after).tolist() == [i == 4 for i in range(b.shape[0])]
print("equal", cases, seed)
"""


def test_interpreted_loaded_weight_scan_equals_the_torch_checks_and_fingerprints():
    """layouts/scan_triton.py run by Triton's interpreter: per row the same fingerprints as the torch steps (bit for
    bit), the same nonzero-block map, and the same refusal, word for word, for a NaN weight byte (0x7F, 0xFF), a NaN
    scale byte and a zero scale under nonzero weights, alone and together; shapes with row and block tails."""
    p = run_python(LOADED_SCAN, {"TRITON_INTERPRET": "1"}, timeout=600)
    assert p.returncode == 0 and p.stdout.startswith("equal"), p.stderr[-3000:]
    assert int(p.stdout.split()[1]) == 25, p.stdout


SPLIT_K = r"""
import random, torch
from sglang_mxfp8.ops.triton_sm90.act_quant import quantize_act_1x128
from sglang_mxfp8.ops.triton_sm90.dense_w8a8 import w8a8_gemm
from sglang_mxfp8.ops.triton_sm90.splitk_w8a8 import SplitKWorkspace, splitk_config, splitk_w8a8_gemm
from sglang_mxfp8.format.numerics import convert_to_block_scales, dequantize_block_fp8, quantize_mxfp8
seed = random.randrange(1 << 30)
torch.manual_seed(seed)
worst = 0.0
# N and K tails (K a multiple of 32, not of 128), every power-of-two token tile, one split and several (K ranges that
# do not divide the groups evenly)
for m, n, k, split in [(1, 64, 128, 1), (5, 130, 352, 2), (16, 200, 1024, 3), (33, 64, 2048, 5), (128, 96, 640, 1),
                       (70, 72, 1184, 4)]:
    x = (torch.randn(m, k) * torch.logspace(-2, 2, k)).to(torch.bfloat16)
    w, ws = quantize_mxfp8(torch.randn(n, k) * torch.logspace(-3, 1, n)[:, None])
    rows = 128 if m % 2 == 0 else 1  # both Hopper scale layouts: 128x128 blocks (FlashInfer's) and 1x128 (Triton's)
    bs, _ = convert_to_block_scales(w, ws, rows)
    product = x.double() @ dequantize_block_fp8(w, bs, rows).double().t()
    bias = (torch.randn(n) * product.abs().mean()).to(torch.bfloat16)  # the product's size: a doubled bias shows
    cfg = dict(splitk_config(m, n, k), SPLIT=split)
    out = splitk_w8a8_gemm(x, w, bs, bias, cfg, scale_rows=rows)
    q, s = quantize_act_1x128(x)  # the interpreter's float->e4m3 cast, as in the kernel (not the GPU's rounding)
    ref = (q.double() * s.double().repeat_interleave(128, 1)[:, :k]) @ dequantize_block_fp8(w, bs, rows).double().t()
    ref += bias.double()
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    # the activation quantized before the launch or inside each program: the same e4m3 and scales, the same bytes;
    # a kept workspace is left zero by each call, so the next gives the same bytes again
    flipped = dict(cfg, QUANT_FIRST=not cfg["QUANT_FIRST"])
    space = SplitKWorkspace(n, "cpu")
    for _ in range(2):
        assert torch.equal(splitk_w8a8_gemm(x, w, bs, bias, flipped, rows, space), out), (seed, m, n, k, split)
        assert not space.sums.any() and not space.tickets.any(), (m, n, split)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    # BF16 output rounding (the interpreter's store truncates: up to 2**-7 per element)
    assert err == err and err < 1e-2, (seed, m, n, k, split, err)
    if split == 1 and rows == 1:  # one launch, the same sums in the same order as the tiled kernel on these operands
        assert torch.equal(out, w8a8_gemm(q, s, w, bs, torch.bfloat16, bias)), (seed, m, n, k)
    worst = max(worst, err)
    if m > 1:  # a NaN in one token: that token's row is NaN, the others as before
        bad = x.clone()
        bad[m // 2, k - 1] = float("nan")
        nan_out = splitk_w8a8_gemm(bad, w, bs, bias, cfg, scale_rows=rows)
        assert nan_out[m // 2].isnan().all() and torch.equal(torch.cat([nan_out[:m // 2], nan_out[m // 2 + 1:]]),
                                                              torch.cat([out[:m // 2], out[m // 2 + 1:]])), (m, split)
cfg = splitk_config(16, 5120, 2048)
assert (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["SPLIT"], cfg["QUANT_FIRST"]) == (16, 64, 4, False), cfg
assert splitk_config(100, 2048, 4096)["BLOCK_M"] == 128
# splits: enough programs for every SM, but partials' atomics within a quarter of the weight's bytes
assert [splitk_config(m, 2048, 4096)["SPLIT"] for m in (16, 32, 64, 128)] == [8, 8, 4, 2]
assert [splitk_config(m, 5120, 2048)["SPLIT"] for m in (16, 64, 128)] == [4, 2, 1]
assert splitk_config(64, 2048, 4096)["QUANT_FIRST"] and not splitk_config(32, 2048, 4096)["QUANT_FIRST"]
print("close", worst, seed)
"""


def test_interpreted_split_k_gemm_matches_float64_on_the_quantized_operands():
    """ops/triton_sm90/splitk_w8a8.py run by Triton's interpreter: its in-kernel activation quantization and the
    (split) K sum give the float64 product of the operands act_quant's kernel gives, within BF16 output rounding, at
    1-128 tokens with N and K tails, one K split and several (unsplit: the tiled kernel's bytes), the same bytes with
    the activation quantized before the launch and on a kept workspace, which each call leaves zero; a NaN token's row
    is NaN and the other rows unchanged."""
    p = run_python(SPLIT_K, {"TRITON_INTERPRET": "1"}, timeout=600)
    assert p.returncode == 0 and p.stdout.startswith("close"), p.stderr[-3000:]
    assert float(p.stdout.split()[1]) < 1e-2


SILU_AND_MUL = r"""
import torch
from sglang_mxfp8.ops.triton_sm90.silu_and_mul import silu_and_mul, silu_and_mul_up_first
torch.manual_seed(7)
special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), -100.0, 100.0, 1e-40, -1e-40, 3.0])
for rows, inter, dtype in [(1, 768, torch.bfloat16), (37, 256, torch.bfloat16), (5, 1536, torch.float16),
                           (3, 96, torch.bfloat16)]:
    h = (torch.randn(rows, 2 * inter) * torch.logspace(-3, 1, 2 * inter)).to(dtype)
    h[0, :10] = special.to(dtype)  # gate: zeros of both signs, infinities, NaN, past exp's range, subnormals
    h[0, inter:inter + 10] = torch.tensor([2.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1e4, 1e4, -0.0]).to(dtype)
    gate, up = h[:, :inter].double(), h[:, inter:].double()
    exact = (gate / (1 + torch.exp(-gate)) * up).to(dtype)  # float64, rounded once
    got = silu_and_mul(h)
    swapped = torch.cat([h[:, inter:], h[:, :inter]], 1)
    out = torch.full((rows, inter), 7.0, dtype=dtype)
    assert silu_and_mul_up_first(swapped, out) is out
    assert torch.equal(out.view(torch.int16), got.view(torch.int16)), (rows, inter)  # same bits from [up | gate]
    bits, ref = got.view(torch.int16).int(), exact.view(torch.int16).int()
    nan = exact.isnan()
    assert torch.equal(got.isnan(), nan), (rows, inter)
    # a subnormal gate may flush to a zero of its sign (the interpreter does, as fast-math CUDA does); nowhere else
    flushed = torch.zeros_like(nan)
    flushed[0, 7:9] = True
    sub, want = got[0, 7:9], exact[0, 7:9]
    assert bool((sub == 0).all()) and torch.equal(sub.signbit(), want.signbit()) or torch.equal(sub, want)
    ulps = (bits - ref).abs()[~(nan | flushed)]
    # the interpreter casts float32 to BF16 by truncation (the GPU rounds to nearest): one unit there, FP16 exact
    assert int(ulps.max()) <= (1 if dtype == torch.bfloat16 else 0), (rows, inter, int(ulps.max()))
    assert torch.equal(got[0, :10].view(torch.int16)[[0, 1, 5, 9]], exact[0, :10].view(torch.int16)[[0, 1, 5, 9]])
for bad in (torch.zeros(4, 7), torch.zeros(8, 4).t()):
    try:
        silu_and_mul(bad)
    except ValueError as e:
        assert "need [R, 2I] and [R, I], each row contiguous" in str(e)
    else:
        raise AssertionError(bad.shape)
print("ok", silu_and_mul(torch.zeros(0, 64)).shape)
"""


def test_interpreted_silu_and_mul_rounds_as_float64_does_in_either_w13_order():
    """ops/triton_sm90/silu_and_mul.py run by Triton's interpreter: silu(gate) * up in float32, rounded once: the
    float64 result rounded to FP16 bit for bit, to BF16 within one unit (the interpreter truncates that cast), NaN
    where it is NaN, signed zeros kept; the [up | gate] order gives the same bits; bad shapes are one error."""
    p = run_python(SILU_AND_MUL, {"TRITON_INTERPRET": "1"}, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip().endswith("ok torch.Size([0, 32])"), p.stdout[-500:]
