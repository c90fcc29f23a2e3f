"""quantize_mxfp8 against a from-spec reimplementation of OCP MX v1.0 (pure Python, float64, its own e4m3 table),
on inputs drawn to reach the edges: signed zeros, e4m3 subnormals, block maxima exactly at, just under and just over
448 * 2**e, E8M0's lowest exponent, NaN and Inf."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_mxfp8.format.numerics import dequantize_mxfp8, quantize_mxfp8


def e4m3_value(code: int) -> float:
    """OCP FP8 E4M3 (the 'fn' variant): sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities,
    S.1111.111 is NaN; exponent 0 holds the subnormals m/8 * 2**-6."""
    sign = -1.0 if code & 0x80 else 1.0
    exp, man = (code >> 3) & 0xF, code & 0x7
    if exp == 0xF and man == 0x7:
        return math.nan
    if exp == 0:
        return sign * man / 8 * 2.0 ** -6
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


E4M3 = [(code, e4m3_value(code)) for code in range(256) if not math.isnan(e4m3_value(code))]


def e4m3_round(v: float) -> int:
    """The e4m3 code nearest v (|v| <= 448), ties to the even code; the sign kept for zeros."""
    best = min(E4M3, key=lambda cv: (abs(cv[1] - v), cv[0] & 1, cv[0]))
    code = best[0]
    if best[1] == 0.0:
        code = 0x80 if math.copysign(1.0, v) < 0 else 0x00
    return code


def reference_block(block, rounding):
    """(codes, scale byte) of one 32-element block, straight from the spec's definition."""
    if any(not math.isfinite(v) for v in block):
        return None, 255
    amax = max(abs(v) for v in block)
    if amax == 0:
        e = 0
    elif rounding == "ceil":  # smallest e with amax <= 448 * 2**e: no element saturates
        e = math.floor(math.log2(amax / 448))
        while amax > 448 * 2.0 ** e:
            e += 1
        while e > -200 and amax <= 448 * 2.0 ** (e - 1):
            e -= 1
    else:  # spec: floor(log2(amax)) - emax(e4m3) = floor(log2(amax)) - 8
        e = math.frexp(amax)[1] - 1 - 8
    e = max(-127, min(127, e))
    codes = [e4m3_round(max(-448.0, min(448.0, v / 2.0 ** e))) for v in block]
    return codes, e + 127


def edge_values(draw_e):
    """Values that sit on the edges, scaled by 2**e."""
    e = draw_e
    return st.sampled_from([
        0.0, -0.0, 448 * 2.0 ** e, -448 * 2.0 ** e, 448 * 2.0 ** e * (1 + 2 ** -20), 448 * 2.0 ** e * (1 - 2 ** -20),
        2.0 ** (e - 9), -(2.0 ** (e - 9)), 3 * 2.0 ** (e - 9), 2.0 ** (e - 6), 0.4375 * 2.0 ** (e - 6),
        1.0625 * 2.0 ** e, 1.1875 * 2.0 ** e,  # halfway between e4m3 neighbours: ties to even
    ])


@st.composite
def blocks(draw):
    e = draw(st.integers(min_value=-126, max_value=110))
    element = st.one_of(edge_values(e), st.floats(min_value=-500 * 2.0 ** e, max_value=500 * 2.0 ** e,
                                                   allow_nan=False, allow_infinity=False, width=32))
    values = draw(st.lists(element, min_size=32, max_size=32))
    return [float(torch.tensor(v, dtype=torch.float32)) for v in values]  # what a float32 tensor holds


@settings(max_examples=300, deadline=None)
@given(block=blocks(), rounding=st.sampled_from(["ceil", "floor"]))
def test_quantize_matches_the_spec_bit_for_bit(block, rounding):
    q, s = quantize_mxfp8(torch.tensor([block], dtype=torch.float32), rounding)
    codes, scale = reference_block(block, rounding)
    assert int(s[0, 0]) == scale, (block, rounding)
    assert q.view(torch.uint8)[0].tolist() == codes, (block, rounding)


def test_the_edges_are_reached():
    """The cases the property test is for, pinned: amax exactly 448 * 2**e keeps e under ceil; one ulp over moves to
    e + 1; signed zeros keep their sign; a subnormal survives; E8M0's floor clamps."""
    def one(values, rounding="ceil"):
        block = (values + [0.0] * 32)[:32]
        q, s = quantize_mxfp8(torch.tensor([block]), rounding)
        assert reference_block(block, rounding) == (q.view(torch.uint8)[0].tolist(), int(s[0, 0]))
        return q.view(torch.uint8)[0].tolist(), int(s[0, 0])

    assert one([448.0])[1] == 127 and one([448.0])[0][0] == 0x7E
    assert one([float(torch.tensor(448.0).nextafter(torch.tensor(1e9)))])[1] == 128
    codes, scale = one([-0.0, 0.0, 2.0 ** -9, 448.0])
    assert codes[:4] == [0x80, 0x00, 0x01, 0x7E] and scale == 127
    assert one([2.0 ** -140])[1] == 0 and one([3e38])[1] == 127 + 120  # E8M0 floor; float32 reaches 2**120 at most
    assert one([448.0, 500.0], "floor")[0][:2] == [0x7E, 0x7E]  # floor saturates, at +448


def test_non_finite_blocks_are_nan_and_only_they():
    x = torch.randn(2, 64)
    x[1, 40] = float("-inf")
    q, s = quantize_mxfp8(x)
    assert s[1, 1] == 255 and torch.isnan(dequantize_mxfp8(q, s)[1, 32:]).all()
    assert s[1, 0] != 255 and torch.isfinite(dequantize_mxfp8(q, s)[1, :32]).all()
    assert reference_block(x[1, 32:].tolist(), "ceil") == (None, 255)


@pytest.mark.parametrize("seed", range(3))
def test_dequantized_error_against_float64_is_bounded(seed):
    """Relative error of MXFP8 against the float64 original: e4m3's 3 mantissa bits give at most 2**-4 per element
    above the subnormal range."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(64, 256, generator=g, dtype=torch.float64) * torch.logspace(-3, 3, 256, dtype=torch.float64))
    q, s = quantize_mxfp8(x.float())
    rel = ((dequantize_mxfp8(q, s).double() - x).norm() / x.norm()).item()
    assert 1e-3 < rel < 2 ** -5, rel
