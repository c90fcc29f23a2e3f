"""Refit safety of in-place conversion: idempotent, storage never moves, partial reloads detected."""

import json

import pytest
import torch

from sglang_mxfp8.layouts import hopper
from sglang_mxfp8.format.numerics import convert_to_block_scales, dequantize_block_fp8, dequantize_mxfp8, quantize_mxfp8
from sglang_mxfp8.layouts.fingerprints import PartialReloadError
from sglang_mxfp8.layouts.hopper import BlockScaleConverter

pytestmark = pytest.mark.sglang  # CI runs these again with the newest SGLang


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


def _reference(q, s, br):
    """Each group converted from scratch by the numerics' own function: (bytes, block scales, changed elements)."""
    q = q.clone()
    out = [convert_to_block_scales(q[g], s[g], br) for g in range(q.shape[0])]
    return q.view(torch.uint8), torch.stack([scales for scales, _ in out]), sum(changed for _, changed in out)


@pytest.mark.parametrize("br", [1, 128])
@pytest.mark.parametrize(
    "groups,rows,k,chunk",
    [
        (3, 384, 320, 1 << 24),
        (3, 384, 320, 128 * 128),
        (1, 200, 256, 1 << 24),
        (1, 200, 256, 64 * 256),
        (2, 200, 96, 1 << 24),
    ],
)
def test_whole_and_block_by_block_conversions_write_what_the_numerics_do(monkeypatch, br, groups, rows, k, chunk):
    """A whole load (one matrix in steps, steps across group borders) and a partial reload (group by group) give the
    bytes, scales and change count of each group converted from scratch; zero blocks and subnormal results included."""
    monkeypatch.setattr(hopper, "_CONVERT_CHUNK_ELEMENTS", chunk)
    qa, sa = _ckpt(11, groups, rows, k)
    qb, sb = _ckpt(12, groups, rows, k)
    qa.view(torch.uint8)[0, :3] = 0  # all-zero rows: zero sub-blocks, a zero block where br is 1
    sa[:, :, 1] += 6  # a sub-block far above its neighbours: theirs shift into e4m3's subnormals
    w, s = qa.clone(), sa.clone()
    conv = BlockScaleConverter(groups, rows, k, br, "cpu", "layers.0.mlp.experts.w13")
    stats = conv.refresh(w, s)
    ref_bytes, ref_scales, ref_changed = _reference(qa, sa, br)
    assert torch.equal(w.view(torch.uint8), ref_bytes) and torch.equal(conv.block_scale, ref_scales)
    assert stats.converted_rows == groups * rows and stats.changed_elements == ref_changed > 0

    w[-1].copy_(qb[-1]), s[-1].copy_(sb[-1])  # the last group reloaded: converted block by block
    stats = conv.refresh(w, s)
    mixed_q, mixed_s = torch.cat([qa[:-1], qb[-1:]]), torch.cat([sa[:-1], sb[-1:]])
    ref_bytes, ref_scales, _ = _reference(mixed_q, mixed_s, br)
    assert stats.converted_rows == rows
    assert torch.equal(w.view(torch.uint8), ref_bytes) and torch.equal(conv.block_scale, ref_scales)


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


def _fp8(*shape):
    return (torch.rand(*shape) + 0.5).to(torch.float8_e4m3fn)


def _u8(*shape):
    return torch.randint(100, 140, shape, dtype=torch.uint8)


def _moe_style_loader(param, loaded_weight, weight_name, shard_id=None, expert_id=None):
    param.data[expert_id].copy_(loaded_weight)  # FusedMoE.weight_loader's calling convention


def test_load_tracker_refuses_a_weight_loaded_without_its_scale():
    from sglang.srt.layers.parameter import ModelWeightParameter
    from sglang.srt.model_loader.weight_utils import default_weight_loader

    from sglang_mxfp8.sglang.loads import LoadTracker

    w13 = torch.nn.Parameter(torch.zeros(4, 8, 64, dtype=torch.float8_e4m3fn), requires_grad=False)
    s13 = torch.nn.Parameter(torch.zeros(4, 8, 2, dtype=torch.uint8), requires_grad=False)
    for p in (w13, s13):
        p.weight_loader = _moe_style_loader
    dense_w = ModelWeightParameter(data=torch.zeros(8, 64, dtype=torch.float8_e4m3fn), input_dim=1, output_dim=0,
                                   weight_loader=default_weight_loader)
    dense_s = torch.nn.Parameter(torch.zeros(8, 2, dtype=torch.uint8), requires_grad=False)
    moe = LoadTracker("model.layers.0.mlp.experts", {"w13": (w13, s13)})
    dense = LoadTracker("model.layers.0.mlp.down_proj", {"": (dense_w, dense_s)})

    for e in range(4):
        w13.weight_loader(w13, _fp8(8, 64), f"experts.{e}.up_proj.weight", shard_id="w3", expert_id=e)
        if e != 2:
            s13.weight_loader(s13, _u8(8, 2), f"experts.{e}.up_proj.weight_scale_inv", shard_id="w3", expert_id=e)
    with pytest.raises(
        ValueError,
        match=r"experts\.w13_weight: the checkpoint loaded this weight \(shards \('w3', 2\)\) "
        r"without its scale tensor",
    ):
        moe.check()
    moe.check()  # the sets were reset: a load that touched nothing passes

    dense_w.weight_loader(dense_w, _fp8(8, 64))
    dense_s.weight_loader(dense_s, _u8(8, 2))
    dense.check()
    assert dense_w.float().abs().sum() > 0 and dense_s.sum() > 0  # the wrapped loaders still load
    dense_s.weight_loader(dense_s, _u8(8, 2))
    with pytest.raises(ValueError, match=r"down_proj\.weight: the checkpoint loaded the scale without the weight"):
        dense.check()
    with pytest.raises(ValueError, match=r"down_proj\.weight: checkpoint tensor is torch.int8, expected "
                                         r"torch.float8_e4m3fn for an MXFP8 checkpoint; convert"):
        dense_w.weight_loader(dense_w, torch.zeros(8, 64, dtype=torch.int8))
    with pytest.raises(ValueError, match=r"down_proj\.weight: a torch.bfloat16 tensor of shape \[8, 48\] cannot be "
                                         r"MXFP8 \(K not a multiple of 32\)"):
        dense_w.weight_loader(dense_w, torch.zeros(8, 48, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"experts\.w13_weight \(shards \('w1', 1\)\): weight \[8, 64\] needs a scale "
                                         r"of shape \[8, 2\] \(one per 32 along K\), the checkpoint has \[8, 3\]"):
        w13.weight_loader(w13, _fp8(8, 64), "experts.1.gate_proj.weight", shard_id="w1", expert_id=1)
        s13.weight_loader(s13, _u8(8, 3), "experts.1.gate_proj.weight_scale_inv", shard_id="w1", expert_id=1)
    with pytest.raises(ValueError, match=r"experts\.w13_weight scale: checkpoint tensor is torch.float32"):
        s13.weight_loader(s13, torch.ones(8, 2), "experts.0.up_proj.weight_scale_inv", shard_id="w1", expert_id=0)


@pytest.mark.parametrize("br", [1, 128])
def test_a_refit_of_scales_alone_reaches_rows_the_conversion_left_unchanged(br):
    """Rows whose every 32-block shares its 128-block's exponent are left as loaded by the conversion, so their bytes
    in memory equal the checkpoint's. A refit whose checkpoint has the same weight bytes and other scales rewrites only
    the scales: those rows must be converted again from the new scales (the value, not the bytes, changed)."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(256, 256, generator=g)
    w = w / w.abs().reshape(256, 8, 32).amax(-1).repeat_interleave(32, 1) * 400  # each 32-block's amax: 400
    q, s = quantize_mxfp8(w)
    assert (s == s[0, 0]).all()  # one exponent everywhere: the conversion changes no byte
    weight, scale = q.clone(), s.clone()
    conv = BlockScaleConverter(1, 256, 256, br, "cpu", "model.layers.0.mlp.down_proj")
    assert conv.refresh(weight, scale).changed_elements == 0 and torch.equal(
        weight.view(torch.uint8), q.view(torch.uint8)
    )
    s2 = s.clone()
    s2[:128] += 3  # the first 128 rows' values times 8; their weight bytes as before
    weight.copy_(q), scale.copy_(s2)  # what the loader writes for that checkpoint
    conv.refresh(weight, scale)
    ref = dequantize_mxfp8(q, s2)
    assert torch.equal(_value(conv, weight[None], br)[0], ref)


def test_load_tracker_checks_every_expert_of_w13_and_w2():
    """A MoE layer's tracker pairs each expert's gate/up (w13: w1, w3) and down (w2) weight with its own scale."""
    from sglang_mxfp8.sglang.loads import LoadTracker

    params = {}
    for name, shape in (("w13", (4, 16, 64)), ("w2", (4, 64, 32))):
        params[name] = (
            torch.nn.Parameter(torch.zeros(*shape, dtype=torch.float8_e4m3fn), requires_grad=False),
            torch.nn.Parameter(torch.zeros(*shape[:-1], shape[-1] // 32, dtype=torch.uint8), requires_grad=False),
        )
        for p in params[name]:
            p.weight_loader = _moe_style_loader_rows
    tracker = LoadTracker("model.layers.0.mlp.experts", params)

    def load(e, shard, scale=True, weight=True):
        w, s = params["w2" if shard == "w2" else "w13"]
        rows, k = w.shape[1] // (1 if shard == "w2" else 2), w.shape[2]
        if weight:
            w.weight_loader(w, _fp8(rows, k), f"experts.{e}.{shard}.weight", shard_id=shard, expert_id=e)
        if scale:
            s.weight_loader(s, _u8(rows, k // 32), f"experts.{e}.{shard}.weight_scale_inv", shard_id=shard, expert_id=e)

    def load_all(**leave_out):
        """Every expert's w1, w3 and w2 with their scales; ``scale`` / ``weight``: the (expert, shard) left out."""
        for e in range(4):
            for shard in ("w1", "w3", "w2"):
                load(e, shard, **{part: (e, shard) != leave_out.get(part) for part in ("scale", "weight")})

    load_all(scale=(3, "w2"))
    with pytest.raises(
        ValueError,
        match=r"experts\.w2_weight: the checkpoint loaded this weight \(shards \('w2', 3\)\) "
        r"without its scale tensor",
    ):
        tracker.check()
    load_all(weight=(1, "w1"))
    with pytest.raises(ValueError, match=r"experts\.w13_weight: the checkpoint loaded the scale \(shards \('w1', 1\)\) "
                                         r"without the weight"):
        tracker.check()
    load_all()
    tracker.check()


def _moe_style_loader_rows(param, loaded_weight, weight_name, shard_id=None, expert_id=None):
    """FusedMoE.weight_loader's calling convention: w1 into the first half of w13's rows, w3 the second, w2 whole."""
    rows = loaded_weight.shape[0]
    start = rows if shard_id == "w3" else 0
    param.data[expert_id, start : start + rows].copy_(loaded_weight)


@pytest.mark.parametrize("rounding", ["ceil", "floor"])
def test_bf16_weights_a_trainer_sends_are_served_as_the_converter_writes_them(tmp_path, rounding):
    bf16_in_equals_convert(tmp_path, rounding, "cpu")


def bf16_in_equals_convert(tmp_path, rounding, device):
    """update_weights_from_tensor with BF16 tensors for layers served as MXFP8: each is quantized where its parameter
    lives (``device``) with the checkpoint's scale rounding, and the FP8 weight and its scale loaded (through SGLang's
    loaders' calling conventions, dense and MoE) are byte for byte what ``sglang-mxfp8 convert`` writes for the same
    tensors (real safetensors files); the scale is recorded, so the post-load check passes, and no float copy is
    kept. tests/gpu runs it on the GPU."""
    from safetensors.torch import load_file, save_file
    from sglang.srt.layers.parameter import ModelWeightParameter
    from sglang.srt.model_loader.weight_utils import default_weight_loader

    from sglang_mxfp8.format.convert import convert
    from sglang_mxfp8.sglang.loads import LoadTracker

    g = torch.Generator().manual_seed(11)
    trainer = {"model.layers.0.mlp.down_proj.weight": (torch.randn(64, 256, generator=g) * 0.05).bfloat16(),
               **{f"model.layers.0.mlp.experts.{e}.{p}.weight": (torch.randn(16, 64, generator=g)
                                                                * torch.logspace(-3, 1, 64)).bfloat16()
                  for e in range(2) for p in ("gate_proj", "up_proj")}}
    (tmp_path / "bf16").mkdir()
    save_file(trainer, str(tmp_path / "bf16" / "model.safetensors"))
    (tmp_path / "bf16" / "config.json").write_text('{"architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 1}')
    convert(tmp_path / "bf16", tmp_path / "mx", progress=False, rounding=rounding)
    written = load_file(str(tmp_path / "mx" / "model.safetensors"))
    assert (
        json.loads((tmp_path / "mx" / "config.json").read_text())["quantization_config"]["scale_rounding"] == rounding
    )

    trainer = {name: t.to(device) for name, t in trainer.items()}
    dense_w = ModelWeightParameter(data=torch.zeros(64, 256, dtype=torch.float8_e4m3fn, device=device), input_dim=1,
                                   output_dim=0, weight_loader=default_weight_loader)
    dense_s = torch.nn.Parameter(torch.zeros(64, 8, dtype=torch.uint8, device=device), requires_grad=False)
    dense = LoadTracker("model.layers.0.mlp.down_proj", {"": (dense_w, dense_s)}, rounding=rounding)
    dense_w.weight_loader(dense_w, trainer["model.layers.0.mlp.down_proj.weight"])
    dense.check()
    assert torch.equal(dense_w.cpu().view(torch.uint8),
                       written["model.layers.0.mlp.down_proj.weight"].view(torch.uint8))
    assert torch.equal(dense_s.cpu(), written["model.layers.0.mlp.down_proj.weight_scale_inv"])

    w13 = torch.nn.Parameter(torch.zeros(2, 32, 64, dtype=torch.float8_e4m3fn, device=device), requires_grad=False)
    s13 = torch.nn.Parameter(torch.zeros(2, 32, 2, dtype=torch.uint8, device=device), requires_grad=False)
    names = []

    def fused_moe_loader(param, loaded_weight, weight_name, shard_id=None, expert_id=None):
        names.append((weight_name, str(loaded_weight.dtype)))  # FusedMoE routes a scale by "scale" in its name
        assert ("scale" in weight_name) == (loaded_weight.dtype == torch.uint8)
        _moe_style_loader_rows(param, loaded_weight, weight_name, shard_id, expert_id)

    for p in (w13, s13):
        p.weight_loader = fused_moe_loader
    moe = LoadTracker("model.layers.0.mlp.experts", {"w13": (w13, s13)}, rounding=rounding)
    for e in range(2):
        for proj, shard in (("gate_proj", "w1"), ("up_proj", "w3")):
            w13.weight_loader(w13, trainer[f"model.layers.0.mlp.experts.{e}.{proj}.weight"],
                              "model.layers.0.mlp.experts.w13_weight", shard_id=shard, expert_id=e)
    moe.check()
    assert ("model.layers.0.mlp.experts.w13_weight_scale_inv", "torch.uint8") in names
    for e in range(2):
        for half, proj in ((slice(0, 16), "gate_proj"), (slice(16, 32), "up_proj")):
            name = f"model.layers.0.mlp.experts.{e}.{proj}.weight"
            assert torch.equal(w13[e, half].cpu().view(torch.uint8), written[name].view(torch.uint8)), name
            assert torch.equal(s13[e, half].cpu(), written[name + "_scale_inv"]), name


def _sum_preserving_change(row: torch.Tensor, g: torch.Generator, forbidden=()) -> None:
    """Change two bytes of a uint8 row so that its plain byte sum stays: a swap of two different bytes, or +d at one
    position and -d at another; no byte becomes one of ``forbidden``."""
    width = row.numel()
    while True:
        i, j = (int(v) for v in torch.randint(width, (2,), generator=g))
        a, b = int(row[i]), int(row[j])
        if i == j:
            continue
        if int(torch.randint(2, (), generator=g)) and a != b:
            new = b, a
        elif min(255 - a, b) > 0:
            d = int(torch.randint(1, min(255 - a, b) + 1, (), generator=g))
            new = a + d, b - d
        else:
            continue
        if not set(new) & set(forbidden):
            row[i], row[j] = new
            return


def test_row_fingerprints_tell_apart_rows_whose_bytes_keep_their_sum():
    from sglang_mxfp8.layouts.fingerprints import row_fingerprints

    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    n = 2000  # fingerprints of int32 products (wrapping) collided on about 1 in 2,000 such rows
    for width in (32, 320, 4096, 10, 330):  # int32 words; bytes where a row is no whole number of words
        rows = torch.randint(256, (n, width), generator=g, dtype=torch.uint8)
        changed = rows.clone()
        for r in range(changed.shape[0]):
            _sum_preserving_change(changed[r], g)
        assert torch.equal(rows.long().sum(1), changed.long().sum(1))
        before = row_fingerprints(rows, torch.empty(n, dtype=torch.int64))
        after = row_fingerprints(changed, torch.empty(n, dtype=torch.int64))
        assert bool((before != after).all()), int((before == after).sum())
        assert torch.equal(before, row_fingerprints(rows.clone(), torch.empty(n, dtype=torch.int64)))


@pytest.mark.parametrize("br", [1, 128])
def test_a_reload_whose_rows_keep_their_byte_sums_is_converted_again(br):
    """A refit that writes, into every row, the bytes the conversion left there with two of them moved (the byte sum
    unchanged) is a reload: the result equals a fresh server's conversion of what was loaded."""
    qa, sa = _ckpt(3, groups=1, rows=256, k=320)
    w, s = qa.clone(), sa.clone()
    conv = BlockScaleConverter(1, 256, 320, br, "cpu", "layers.0.mlp.down_proj")
    conv.refresh(w, s)
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    loaded = w.clone()
    for r in range(256):
        _sum_preserving_change(loaded.view(torch.uint8)[0, r], g, forbidden=(0x7F, 0xFF))  # e4m3 NaN
    w.copy_(loaded)
    stats = conv.refresh(w, s)
    fresh_w = loaded.clone()
    fresh = BlockScaleConverter(1, 256, 320, br, "cpu", "fresh")
    fresh.refresh(fresh_w, s)
    assert stats.converted_rows == 256
    assert torch.equal(w.view(torch.uint8), fresh_w.view(torch.uint8)) and torch.equal(
        conv.block_scale, fresh.block_scale
    )


STORAGE = r"""
import logging, sys
import torch
import conftest
import sglang.srt.layers.quantization.fp8 as fp8
from sglang_mxfp8.cli.doctor import KNOWN_GPUS
from sglang_mxfp8.format.numerics import quantize_mxfp8
from sglang_mxfp8.platform import GpuSpec
from sglang_mxfp8.sglang import quant_methods, weights

logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="LOG %(levelname)s %(message)s")
conftest.init_fp8_gemm_config(conftest.set_server_args(fp8_gemm_runner_backend="triton"))
quant_methods.current_gpu = lambda: GpuSpec(*KNOWN_GPUS["h200"])
fp8.get_tensor_model_parallel_world_size = lambda: 1
model = torch.nn.Module()
model.o_proj = conftest.mxfp8_linear("model.layers.0.self_attn.o_proj", *quantize_mxfp8(torch.randn(256, 256)))
model.down_proj = conftest.mxfp8_linear("model.layers.0.mlp.down_proj", *quantize_mxfp8(torch.randn(256, 512)))
state = [name for name, _ in model.o_proj.mxfp8_state.tensors()]
print("TENSORS", len(weights.mxfp8_tensors(model)), "STATE", len(state))
print("STEP first"); weights.check_storage(model)
print("STEP same"); weights.check_storage(model)
w, s = quantize_mxfp8(torch.randn(256, 512))
model.down_proj.weight.data.copy_(w); model.down_proj.weight_scale_inv.data.copy_(s)
model.down_proj.quant_method.process_weights_after_loading(model.down_proj)
print("STEP refit"); weights.check_storage(model)
MOVE
print("STEP moved"); weights.check_storage(model)
print("STEP again"); weights.check_storage(model)
"""


@pytest.mark.parametrize("move,name", [
    ("model.o_proj.weight.data = model.o_proj.weight.data.clone()", "o_proj.weight"),
    ("model.down_proj.weight_scale_inv.data = model.down_proj.weight_scale_inv.data.clone()",
     "down_proj.weight_scale_inv"),
    ("c = model.o_proj.mxfp8_state.converter; c.block_scale = c.block_scale.clone()",
     "o_proj.mxfp8_state.converter.block_scale"),
])
def test_the_storage_check_names_a_tensor_that_moved_after_the_first_load(move, name):
    """Every MXFP8 tensor's storage is compared with the first load's, after each load: an in-place refit keeps it
    (info), a parameter, scale or derived tensor given new storage is named (warning), on every later load too."""
    from conftest import run_python, importable_tests_env

    p = run_python(STORAGE.replace("MOVE", move), importable_tests_env())
    assert p.returncode == 0, p.stderr[-3000:]
    steps, current = {}, None
    for line in p.stdout.splitlines():
        if line.startswith("STEP "):
            current = line[5:]
        elif line.startswith("LOG ") and "sglang_mxfp8: " in line and current:
            steps.setdefault(current, []).append(line)
    tensors = int(p.stdout.split("TENSORS ")[1].split()[0])
    assert tensors >= 6 and int(p.stdout.split("STATE ")[1].split()[0]) >= 1
    assert steps["first"] == [f"LOG INFO sglang_mxfp8: storage of {tensors} MXFP8 tensors recorded at first load"]
    unchanged = [f"LOG INFO sglang_mxfp8: storage of all {tensors} MXFP8 tensors unchanged since the first load"]
    assert steps["same"] == unchanged and steps["refit"] == unchanged
    for step in ("moved", "again"):
        (line,) = steps[step]
        assert line.startswith(f"LOG WARNING sglang_mxfp8: 1 of {tensors} MXFP8 tensors moved since the first load "
                               f"(first: ") and f"{name}" in line, line


def test_a_tensor_update_is_checked_whole_before_anything_is_written():
    """refused_update names the first tensor a post-load check would refuse, on fresh random weights: an e4m3 weight
    without its scale (or a scale without its weight), a scale of the wrong shape or dtype, a float8 weight not e4m3,
    NaN e4m3 bytes, a NaN scale byte, and NaN or +-Inf in any float tensor; a whole good update passes."""
    from sglang_mxfp8.bench.refusals import SPOILS, spoiled
    from sglang_mxfp8.format.checkpoint import refused_update

    g = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    w = "model.layers.0.mlp.experts.3.down_proj.weight"
    q, s = quantize_mxfp8(torch.randn(64, 256, generator=g))
    good = {"model.norm.weight": torch.randn(256, generator=g).bfloat16(), w: q, f"{w}_scale_inv": s,
            "model.layers.0.mlp.gate.weight": torch.randn(8, 256, generator=g)}
    assert refused_update(list(good.items())) is None
    for what in SPOILS:
        if what != "missing_folder":
            update = {
                **{n: t for n, t in good.items() if not n.startswith(w)},
                **spoiled(what, w, good, "weight_scale_inv"),
            }
            assert refused_update(list(update.items())).startswith(f"{w}: "), what
    for bad_value in (float("nan"), float("inf"), float("-inf")):
        norm = good["model.norm.weight"].clone()
        norm[7] = bad_value
        assert (
            refused_update(list({**good, "model.norm.weight": norm}.items())) == "model.norm.weight: holds NaN or Inf"
        )
    nan_scale = s.clone()
    nan_scale[5, 2] = 255
    assert refused_update([(w, q), (f"{w}_scale_inv", nan_scale)]) == f"{w}_scale_inv: holds NaN scale bytes (255)"
    assert "a scale without its weight" in refused_update([(f"{w}_scale_inv", s)])
    assert "expected torch.uint8" in refused_update([(w, q), (f"{w}_scale_inv", s.float())])
    # signed zeros and subnormals are values, not refusals
    tiny = torch.tensor([-0.0, 0.0, 1e-40, -1e-45] * 64).view(1, 256)
    assert refused_update([("model.norm.weight", tiny)]) is None
    assert refused_update([(w, q), (f"{w}_scale_inv", s)], scale_name="weight_scale") is not None  # ModelOpt naming


def test_a_large_tensors_values_are_checked_chunk_by_chunk(monkeypatch):
    """Large tensors are checked in chunks (a BF16 embedding's isfinite would allocate twice its size): a bad value in
    any chunk, the last and partial one included, is still found, for each kind of value check."""
    from sglang_mxfp8.format import checkpoint

    monkeypatch.setattr(checkpoint, "CHECK_CHUNK", 96)
    g = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    w = "model.layers.0.mlp.down_proj.weight"
    q, s = quantize_mxfp8(torch.randn(40, 256, generator=g))  # 10240 e4m3 bytes, 320 scale bytes: 107 and 4 chunks
    emb = torch.randn(37, 64, generator=g).bfloat16()  # 2368 elements: 25 chunks, the last of 64
    assert checkpoint.refused_update([(w, q), (f"{w}_scale_inv", s), ("embed.weight", emb)]) is None
    for flat in (0, 95, 96, 1000, emb.numel() - 1):
        bad = emb.clone()
        bad.view(-1)[flat] = float("inf")
        assert checkpoint.refused_update([("embed.weight", bad)]) == "embed.weight: holds NaN or Inf", flat
    for flat in (0, 5000, q.numel() - 1):
        bad = q.clone()
        bad.view(-1).view(torch.uint8)[flat] = 0xFF
        assert checkpoint.refused_update([(w, bad), (f"{w}_scale_inv", s)]) == f"{w}: holds NaN e4m3 values", flat
    for flat in (0, 200, s.numel() - 1):
        bad = s.clone()
        bad.view(-1)[flat] = 255
        problem = checkpoint.refused_update([(w, q), (f"{w}_scale_inv", bad)])
        assert problem == f"{w}_scale_inv: holds NaN scale bytes (255)", flat


def test_shuffled_refusals_send_every_spoil_from_every_source_with_accepted_refits_between():
    """The GPU test's sequence: each spoil from disk, as named tensors and as a trainer's flattened bucket, ``repeats``
    times in a seeded order; a folder that does not exist from disk only; an accepted refit after every third refusal
    and last (on A, from disk)."""
    from collections import Counter

    from sglang_mxfp8.bench.refusals import SPOILS, Step, shuffled_steps

    steps = shuffled_steps(seed=5, repeats=2)
    refused = Counter(str(s) for s in steps if s.refused)
    expected = {f"{src}:{what}" for src in ("disk", "tensor", "bucket") for what in SPOILS
                if src == "disk" or what != "missing_folder"}
    assert set(refused) == expected and set(refused.values()) == {2}
    assert steps[-1] == Step("disk", "A") and shuffled_steps(seed=5, repeats=2) == steps != shuffled_steps(6, 2)
    runs, run = [], 0
    for s in steps:
        run = run + 1 if s.refused else 0
        runs.append(run)
    assert max(runs) == 3 and {s.source for s in steps if not s.refused} == {"disk", "tensor", "bucket"}
