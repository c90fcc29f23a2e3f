"""Refit safety of in-place conversion: idempotent, storage never moves, partial reloads detected."""

import pytest
import torch

from sglang_mxfp8.numerics import dequantize_block_fp8, dequantize_mxfp8, quantize_mxfp8
from sglang_mxfp8.refit import BlockScaleConverter, PartialReloadError


def _ckpt(seed, groups=2, rows=256, k=320):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(groups, rows, k, generator=g) * torch.exp(torch.randn(groups, rows, 1, generator=g))
    return quantize_mxfp8(x)


def _value(conv, w, br):
    return torch.stack([dequantize_block_fp8(w[g], conv.block_scale[g], br) for g in range(w.shape[0])])


@pytest.mark.parametrize("br", [1, 128])
def test_load_twice_refit_and_switch(br):
    qa, sa = _ckpt(1)
    qb, sb = _ckpt(2)
    w, s = qa.clone(), sa.clone()
    conv = BlockScaleConverter(2, 256, 320, br, "cpu", "layers.0.mlp.experts.w13")
    ptrs = (w.data_ptr(), conv.block_scale.data_ptr())

    first = conv.refresh(w, s)
    assert first.converted_rows == 512
    converted = w.clone()
    ref_a = dequantize_mxfp8(qa, sa)
    assert ((_value(conv, w, br) - ref_a).norm() / ref_a.norm()) < 1e-4

    again = conv.refresh(w, s)  # post-load processing run twice with no reload
    assert again.converted_rows == 0 and torch.equal(w.view(torch.uint8), converted.view(torch.uint8))

    w.copy_(qa), s.copy_(sa)  # refit with the same checkpoint
    conv.refresh(w, s)
    assert torch.equal(w.view(torch.uint8), converted.view(torch.uint8))

    w.copy_(qb), s.copy_(sb)  # refit to another checkpoint == a fresh load of it
    conv.refresh(w, s)
    fresh_w = qb.clone()
    fresh = BlockScaleConverter(2, 256, 320, br, "cpu", "fresh")
    fresh.refresh(fresh_w, sb)
    assert torch.equal(w.view(torch.uint8), fresh_w.view(torch.uint8))
    assert torch.equal(conv.block_scale, fresh.block_scale)
    assert (w.data_ptr(), conv.block_scale.data_ptr()) == ptrs


def test_partial_reload_of_whole_groups_is_handled():
    qa, sa = _ckpt(3)
    qb, sb = _ckpt(4)
    w, s = qa.clone(), sa.clone()
    conv = BlockScaleConverter(2, 256, 320, 128, "cpu", "experts.w2")
    conv.refresh(w, s)
    w[1].copy_(qb[1]), s[1].copy_(sb[1])  # one expert reloaded
    stats = conv.refresh(w, s)
    assert stats.converted_rows == 256
    expect = torch.cat([qa[:1], qb[1:]]).clone()
    ref = BlockScaleConverter(2, 256, 320, 128, "cpu", "ref")
    ref.refresh(expect, torch.cat([sa[:1], sb[1:]]))
    assert torch.equal(w.view(torch.uint8), expect.view(torch.uint8))


def test_partial_reload_inside_a_128_block_is_refused():
    qa, sa = _ckpt(5)
    w, s = qa.clone(), sa.clone()
    conv = BlockScaleConverter(2, 256, 320, 128, "cpu", "model.layers.3.self_attn.qkv_proj")
    conv.refresh(w, s)
    w[0, :64].copy_(qa[0, :64])  # a shard boundary inside rows 0..127
    with pytest.raises(PartialReloadError, match=r"qkv_proj: rows 0\.\.127 \(group 0\) were partly reloaded"):
        conv.refresh(w, s)


def test_partial_row_reload_is_fine_for_per_row_scales():
    qa, sa = _ckpt(6, groups=1)
    w, s = qa.clone(), sa.clone()
    conv = BlockScaleConverter(1, 256, 320, 1, "cpu", "o_proj")
    conv.refresh(w, s)
    converted = w.clone()
    w[0, :64].copy_(qa[0, :64])
    conv.refresh(w, s)
    assert torch.equal(w.view(torch.uint8), converted.view(torch.uint8))


def test_scale_reloaded_without_weight_is_refused():
    qa, sa = _ckpt(7, groups=1)
    w, s = qa.clone(), sa.clone()
    conv = BlockScaleConverter(1, 256, 320, 1, "cpu", "down_proj")
    conv.refresh(w, s)
    s[0, 10] += 1
    with pytest.raises(PartialReloadError, match="down_proj: scale row 10 was reloaded but its weight row was not"):
        conv.refresh(w, s)


def test_nan_scale_names_layer_and_row():
    x = torch.randn(1, 64, 64)
    x[0, 9, 3] = float("inf")
    q, s = quantize_mxfp8(x)
    with pytest.raises(ValueError, match="gate_up_proj: scale row 9 holds NaN"):
        BlockScaleConverter(1, 64, 64, 1, "cpu", "gate_up_proj").refresh(q, s)


def test_missing_scale_tensor_is_detected():
    qa, _ = _ckpt(8, groups=1)
    unloaded = torch.zeros(1, 256, 10, dtype=torch.uint8)  # SGLang's zero-initialised scale parameter
    with pytest.raises(ValueError, match="o_proj: scale row 0 is zero under nonzero weights.*weight_scale_inv"):
        BlockScaleConverter(1, 256, 320, 1, "cpu", "o_proj").refresh(qa.clone(), unloaded)


def test_nan_weight_bytes_are_detected():
    qa, sa = _ckpt(9, groups=1)
    w = qa.clone()
    w.view(torch.uint8)[0, 17, 5] = 0x7F  # e4m3 NaN
    with pytest.raises(ValueError, match="qkv_proj: weight row 17 holds NaN"):
        BlockScaleConverter(1, 256, 320, 1, "cpu", "qkv_proj").refresh(w, sa)
