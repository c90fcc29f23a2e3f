"""MXFP8 quantization (OCP MX v1.0) and lossless block-scale conversion, against float64 references."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_mxfp8.format.numerics import (
    E4M3_MAX,
    convert_to_block_scales,
    dequantize_block_fp8,
    dequantize_mxfp8,
    e8m0_to_float,
    moe_reference,
    quantize_activation_1x128,
    quantize_mxfp8,
)

# e4m3 has 3 mantissa bits: round-to-nearest error <= 2**-4 relative for normals.
E4M3_REL = 2.0**-4


def _rand(seed, rows, k, spread):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g, dtype=torch.float64)
    return x * torch.exp(torch.randn(rows, 1, generator=g, dtype=torch.float64) * spread)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 9), blocks=st.integers(1, 6), spread=st.floats(0, 8))
def test_ceil_scale_never_saturates_and_error_is_bounded(seed, rows, blocks, spread):
    x = _rand(seed, rows, 32 * blocks, spread)
    q, s = quantize_mxfp8(x)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.uint8 and s.shape == (rows, blocks)
    scale = e8m0_to_float(s).double()
    amax = x.abs().reshape(rows, blocks, 32).amax(-1)
    # ceil rounding: amax / scale in (224, 448] -> no element saturates, scale is the smallest such power of two
    ratio = amax / scale
    assert torch.all(ratio <= E4M3_MAX) and torch.all(ratio > E4M3_MAX / 2)
    err = (dequantize_mxfp8(q, s).double() - x).abs().reshape(rows, blocks, 32)
    # normal range: relative bound; subnormal range: half an ulp of the smallest subnormal (2**-10 * scale)
    bound = torch.maximum(x.abs().reshape(rows, blocks, 32) * E4M3_REL, (2.0**-10) * scale[..., None])
    assert torch.all(err <= bound + 1e-300)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), spread=st.floats(0, 4))
def test_floor_scale_follows_spec_and_saturates(seed, spread):
    x = _rand(seed, 4, 64, spread)
    q, s = quantize_mxfp8(x, rounding="floor")
    amax = x.abs().reshape(4, 2, 32).amax(-1)
    expected = torch.floor(torch.log2(amax)) - 8 + 127
    assert torch.equal(s.double(), expected)
    assert q.float().abs().max() <= E4M3_MAX


def test_exact_cases():
    # powers of two and e4m3-representable values survive exactly
    x = torch.tensor([[2.0**i for i in range(-6, 8)] * 2 + [1.5, -3.25, 448.0, 0.0]], dtype=torch.float32)
    q, s = quantize_mxfp8(x)
    assert int(s[0, 0]) == 127  # amax 448 -> scale 1.0
    assert torch.equal(dequantize_mxfp8(q, s), x)
    # zero blocks get scale 1.0 and stay zero
    q, s = quantize_mxfp8(torch.zeros(3, 64))
    assert torch.all(s == 127) and torch.all(q.float() == 0)


def test_nan_and_inf_poison_only_their_block():
    x = torch.randn(2, 96)
    x[0, 5] = float("nan")
    x[1, 40] = float("inf")
    q, s = quantize_mxfp8(x)
    assert s[0, 0] == 255 and s[1, 1] == 255
    assert s[0, 1] != 255 and s[1, 0] != 255
    d = dequantize_mxfp8(q, s)
    assert torch.isnan(d[0, :32]).all() and torch.isnan(d[1, 32:64]).all()
    assert torch.isfinite(d[0, 32:]).all() and torch.isfinite(d[1, :32]).all()


def test_rejects_k_not_multiple_of_32():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp8(torch.randn(2, 48))


@pytest.mark.parametrize("block_rows", [1, 128])
@pytest.mark.parametrize("shape", [(256, 512), (200, 320), (130, 96)])
def test_block_conversion_is_nearly_lossless(block_rows, shape):
    # Gaussian weights with heavy per-element tails and rows whose norms differ by ~2x (as in LLM layers)
    x = _rand(7, *shape, spread=0.7) * torch.exp(
        torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    )
    q, s = quantize_mxfp8(x)
    ref = dequantize_mxfp8(q, s).double()
    w = q.clone()
    ptr = w.data_ptr()
    scales, changed = convert_to_block_scales(w, s, block_rows)
    assert w.data_ptr() == ptr  # converted in place
    assert scales.shape == (math.ceil(shape[0] / block_rows), math.ceil(shape[1] / 128))
    assert torch.all(torch.log2(scales) == torch.round(torch.log2(scales)))  # powers of two
    got = dequantize_block_fp8(w, scales, block_rows).double()
    moved = int((got != ref).sum())
    assert moved == changed  # the reported count is exactly the elements whose value moved
    rel = ((got - ref).norm() / ref.norm()).item()
    # per-row blocks shift within one row only; 128-row blocks push the smallest rows' smallest
    # values into e4m3 subnormals
    assert rel < (1e-5 if block_rows == 1 else 1e-4), rel
    assert changed / w.numel() < (1e-3 if block_rows == 1 else 2e-2)


def test_block_conversion_exact_when_exponents_agree():
    # every 1x32 block of a row has the same amax -> shifts are zero -> bit-exact
    x = torch.randn(128, 256, dtype=torch.float64)
    x[:, ::32] = 100.0
    q, s = quantize_mxfp8(x)
    w = q.clone()
    scales, changed = convert_to_block_scales(w, s, 1)
    assert changed == 0 and torch.equal(w.view(torch.uint8), q.view(torch.uint8))


def test_zero_subblocks_do_not_dominate_block_scale():
    x = torch.randn(1, 128, dtype=torch.float64) * 1e-3
    x[0, 32:64] = 0.0  # zero block gets scale byte 127 (1.0), far above the others
    q, s = quantize_mxfp8(x)
    scales, changed = convert_to_block_scales(q.clone(), s, 1)
    assert scales.item() < 1e-2 and changed == 0


def test_conversion_rejects_nan_scales():
    x = torch.randn(4, 64)
    x[0, 0] = float("nan")
    q, s = quantize_mxfp8(x)
    with pytest.raises(ValueError, match="non-finite"):
        convert_to_block_scales(q, s, 1)


@pytest.mark.parametrize("shape", [(256, 512), (200, 320), (130, 96)])
def test_row_conversion_is_nearly_lossless(shape):
    """One power-of-two scale per row (per-channel FP8): the same in-place exponent shift as the block scales,
    over a whole row instead of 128x128; fewer elements move than with 128-row blocks on the same weights."""
    from sglang_mxfp8.format.numerics import convert_to_row_scales

    x = _rand(7, *shape, spread=0.7) * torch.exp(
        torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    )
    q, s = quantize_mxfp8(x)
    ref = dequantize_mxfp8(q, s).double()
    w = q.clone()
    ptr = w.data_ptr()
    scales, changed = convert_to_row_scales(w, s)
    assert w.data_ptr() == ptr and scales.shape == (shape[0],)
    assert torch.all(torch.log2(scales) == torch.round(torch.log2(scales)))  # powers of two
    got = w.double() * scales.double()[:, None]
    assert int((got != ref).sum()) == changed
    assert ((got - ref).norm() / ref.norm()).item() < 1e-4
    assert changed <= convert_to_block_scales(q.clone(), s, 128)[1]


def test_row_conversion_ignores_zero_subblocks_and_rejects_nan_scales():
    from sglang_mxfp8.format.numerics import convert_to_row_scales

    x = torch.randn(3, 256, dtype=torch.float64) * 1e-3
    x[0, 32:64] = 0.0  # a zero sub-block's scale byte (1.0) must not set the row's scale
    x[1] = 0.0  # an all-zero row: scale 1, nothing moves
    q, s = quantize_mxfp8(x)
    scales, changed = convert_to_row_scales(q.clone(), s)
    assert scales[0].item() < 1e-2 and scales[1].item() == 1.0
    x[2, 7] = float("nan")
    q, s = quantize_mxfp8(x)
    with pytest.raises(ValueError, match="convert_to_row_scales: scale holds NaN"):
        convert_to_row_scales(q, s)


def test_activation_1x128_reference():
    x = torch.randn(7, 352) * 3
    q, s = quantize_activation_1x128(x)
    assert q.shape == (7, 352) and s.shape == (7, 3)
    d = (q.float().reshape(7, -1)[:, :352] * s.repeat_interleave(128, 1)[:, :352])
    assert ((d - x).norm() / x.norm()).item() < 0.04


def test_moe_reference_matches_a_per_token_float64_loop():
    """The host MoE reference of the Hopper MoE tests against a per-token, per-slot float64 loop on the same
    dequantized experts (no FP8 activations: the loop rounds GEMM1 and SiLU-and-mul to bf16 as the reference does),
    hidden 160 off the 128 grid; [up; gate] rows with up_first give the same output as [gate; up] without."""
    g = torch.Generator().manual_seed(7)
    e_count, h, inter, top_k, m = 5, 160, 128, 2, 9
    w13, s13 = quantize_mxfp8(torch.randn(e_count, 2 * inter, h, generator=g) * 0.05)
    w2, s2 = quantize_mxfp8(torch.randn(e_count, h, inter, generator=g) * 0.05)
    b13 = torch.stack([convert_to_block_scales(w13[e].clone(), s13[e], 128)[0] for e in range(e_count)])
    b2 = torch.stack([convert_to_block_scales(w2[e].clone(), s2[e], 128)[0] for e in range(e_count)])
    x = torch.randn(m, h, generator=g)
    tw, ids = torch.topk(torch.softmax(torch.randn(m, e_count, generator=g), -1), top_k, dim=-1)
    expected = torch.zeros(m, h, dtype=torch.float64)
    for t in range(m):
        for j in range(top_k):
            e = int(ids[t, j])
            gate_up = (dequantize_block_fp8(w13[e], b13[e], 128).double() @ x[t].double()).bfloat16().double()
            act = (torch.nn.functional.silu(gate_up[:inter]) * gate_up[inter:]).bfloat16().double()
            expected[t] += tw[t, j].double() * (dequantize_block_fp8(w2[e], b2[e], 128).double() @ act)
    got = moe_reference(x, w13, b13, w2, b2, tw, ids, fp8_activations=False)
    assert got.shape == (m, h) and ((got.double() - expected).norm() / expected.norm()).item() < 1e-5
    half = inter // 128  # gate and up each whole 128-row scale blocks: swapping them swaps their block-scale rows
    swapped = moe_reference(
        x,
        torch.cat([w13[:, inter:], w13[:, :inter]], 1),
        torch.cat([b13[:, half:], b13[:, :half]], 1),
        w2,
        b2,
        tw,
        ids,
        fp8_activations=False,
        up_first=True,
    )
    assert torch.equal(swapped, got)
    fp8 = moe_reference(x, w13, b13, w2, b2, tw, ids)
    assert 0 < ((fp8.double() - expected).norm() / expected.norm()).item() < 0.05  # 1x128 FP8 activations


def test_every_scale_byte_decodes_to_its_power_of_two_and_255_to_nan():
    got = e8m0_to_float(torch.arange(256, dtype=torch.uint8)).double()
    assert torch.equal(got[:255], torch.tensor([math.ldexp(1.0, b - 127) for b in range(255)], dtype=torch.float64))
    assert torch.isnan(got[255])


def test_a_block_whose_scale_byte_is_255_dequantizes_to_nan_whatever_its_elements():
    """Scale byte 255 is NaN (OCP MX v1.0): every element of its block is NaN, finite and zero ones too, never
    +-Inf or a large finite value; the other blocks of the row keep their exact values."""
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    q = (torch.randn(6, 128, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    q.view(torch.uint8)[:, 40:44] = torch.tensor([0x00, 0x80, 0x01, 0x81], dtype=torch.uint8)  # +-0, +-subnormal
    s = torch.randint(100, 160, (6, 4), generator=g, dtype=torch.uint8)
    s[:, 1] = 255
    s[5, :] = 255
    got = dequantize_mxfp8(q, s)
    nan_block = torch.zeros(6, 128, dtype=torch.bool)
    nan_block[:, 32:64] = True
    nan_block[5] = True
    assert torch.isnan(got[nan_block]).all()
    ref = q.double() * torch.pow(2.0, s.double() - 127).repeat_interleave(32, dim=1)
    assert torch.equal(got[~nan_block].double(), ref[~nan_block])
    assert torch.equal(torch.signbit(got[~nan_block]), torch.signbit(ref[~nan_block]))


def _expected_block_exponents(q, s, block_rows):
    """Float64 reference: per (row block, 128 columns), the largest scale exponent of a 32-element sub-block holding a
    nonzero value (-0.0 is zero), 0 where there is none."""
    r, k = q.shape
    values = q.double()
    out = torch.zeros(-(-r // block_rows), -(-k // 128), dtype=torch.int64)
    for b in range(out.shape[0]):
        for c in range(out.shape[1]):
            exps = [int(s[i, j]) - 127 for i in range(b * block_rows, min(r, (b + 1) * block_rows))
                    for j in range(c * 4, min(k // 32, c * 4 + 4)) if bool((values[i, j * 32:(j + 1) * 32] != 0).any())]
            out[b, c] = max(exps) if exps else 0
    return out


@pytest.mark.parametrize("block_rows", [1, 128, "row"])
def test_signed_zeros_keep_their_sign_and_never_set_a_block_exponent(block_rows):
    """-0.0 (byte 0x80) is a zero: a sub-block of -0.0 with a large scale byte sets no exponent, and every +0.0 and
    -0.0 keeps its byte through the in-place conversion, as do values that shift into e4m3's zero."""
    from sglang_mxfp8.format.numerics import convert_to_row_scales

    seed = int(torch.randint(1 << 30, ()))
    x = _rand(seed, 130, 320, spread=0.5)
    q, s = quantize_mxfp8(x)
    g = torch.Generator().manual_seed(seed)
    bytes_ = q.view(torch.uint8)
    pick = torch.rand(q.shape, generator=g)
    bytes_[pick < 0.15] = 0x80
    bytes_[(pick >= 0.15) & (pick < 0.25)] = 0x00
    bytes_[3, 64:96] = 0x80  # a whole sub-block of -0.0 ...
    s[3, 2] = 250  # ... whose scale byte would dominate its blocks if -0.0 counted as nonzero
    bytes_[7, 0:32] = torch.tensor([0x80, 0x00] * 16, dtype=torch.uint8)
    s[7, 0] = 240
    before = q.clone()
    zeros = (before.view(torch.uint8) & 0x7F) == 0
    w = q.clone()
    if block_rows == "row":
        scales, changed = convert_to_row_scales(w, s)
        expected = _expected_block_exponents(before, s, 1).amax(dim=1)
        value = w.double() * scales.double()[:, None]
    else:
        scales, changed = convert_to_block_scales(w, s, block_rows)
        expected = _expected_block_exponents(before, s, block_rows)
        value = dequantize_block_fp8(w, scales, block_rows).double()
    assert torch.equal(torch.log2(scales.double()), expected.double())
    assert torch.equal(w.view(torch.uint8)[zeros], before.view(torch.uint8)[zeros])
    ref = dequantize_mxfp8(before, s).double()
    assert torch.equal(torch.signbit(value), torch.signbit(ref))  # values that underflowed keep their sign too
    assert int((value != ref).sum()) == changed
