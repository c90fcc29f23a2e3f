"""Weight sync from a trainer on the GPU: BF16 tensors sent for layers served as MXFP8 are quantized where the layer
lives, byte for byte as ``sglang-mxfp8 convert`` writes them, for each scale rounding the converter offers (the same
check as tests/test_refit.py's on the CPU)."""

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
    reason="needs a Hopper (SM90) GPU; run python -m pytest tests/gpu on an H100/H200")

from test_direct import bf16_update_quantized_where_it_lands  # noqa: E402
from test_refit import bf16_in_equals_convert  # noqa: E402


@pytest.mark.parametrize("rounding", ["ceil", "floor"])
def test_bf16_weights_sent_to_a_gpu_layer_are_what_convert_writes(tmp_path, rounding):
    bf16_in_equals_convert(tmp_path, rounding, "cuda")


@pytest.mark.parametrize("bucket", [False, True])
def test_bf16_weights_sent_after_a_load_are_quantized_where_they_land(bucket):
    bf16_update_quantized_where_it_lands("cuda", bucket)


def test_gpu_quantizer_writes_the_cpu_quantizers_bytes():
    """ops/mxfp8_quant.py on the GPU gives format.numerics.quantize_mxfp8's bytes on the CPU exactly, for both scale
    roundings: every BF16 and FP16 value, FP32 beyond both ends of the scale range, subnormals of each."""
    import random

    from quantize_cases import quantize_cases
    from sglang_mxfp8.format.numerics import quantize_mxfp8
    from sglang_mxfp8.ops.mxfp8_quant import quantize_mxfp8 as quantize_on_gpu

    seed = random.randrange(1 << 30)
    for i, x in enumerate(quantize_cases(seed)):
        for rounding in ("ceil", "floor"):
            q, s = quantize_on_gpu(x.cuda(), rounding)
            ref_q, ref_s = quantize_mxfp8(x, rounding)
            bad = (q.cpu().view(torch.uint8) != ref_q.view(torch.uint8)).nonzero()[:3].tolist()
            assert not bad and torch.equal(s.cpu(), ref_s), (seed, i, rounding, bad)


def test_a_second_refit_read_page_locks_nothing_new(tmp_path):
    """The refit reader's page-locked buffers come back from torch's pinned-memory cache on the next read: the first
    read page-locks what it reads ahead (shared buffers of one size) and the one larger tensor, the second nothing.
    The weights are e4m3 and their scales uint8, so (safetensors writes by dtype, then name) nearly every tensor is a
    run of its own, as in a converted checkpoint."""
    from safetensors.torch import save_file

    from sglang_mxfp8.format import reader

    g = torch.Generator().manual_seed(3)
    tensors = {f"model.layers.{i}.mlp.experts.{e}.up_proj.{kind}": torch.randint(0, 255, shape, generator=g,
                                                                                  dtype=torch.uint8).view(dtype)
               for i in range(4) for e in range(24) for kind, shape, dtype in (
                   ("weight", (768, 2048), torch.float8_e4m3fn), ("weight_scale_inv", (768, 64), torch.uint8))}
    tensors["model.embed_tokens.weight"] = torch.randn(4096, 4096, generator=g).bfloat16()  # 32 MiB: alone
    save_file(tensors, str(tmp_path / "model.safetensors"))
    stats = torch.cuda.host_memory_stats

    def read() -> int:
        before = stats()["allocated_bytes.allocated"]
        buffers = reader.Buffers(pinned=True)
        for name, t in reader.read_tensors([str(tmp_path / "model.safetensors")], pinned=True, buffers=buffers):
            assert t.is_pinned() and torch.equal(t.view(torch.uint8), tensors[name].view(torch.uint8)), name
        assert buffers.pageable == 0
        return stats()["allocated_bytes.allocated"] - before

    first = read()
    assert 0 < first <= reader.AHEAD_BYTES + 2 * reader.RUN_BYTES + (32 << 20), first
    assert read() == 0


def test_bucket_value_checks_on_the_gpu_refuse_what_the_torch_checks_refuse():
    """ops/value_checks.py built for this GPU: a trainer's bucket (SGLang's FlattenedTensorBucket) with one NaN or
    Inf in some tensors gets, per tensor, the torch checks' verdict, in one launch."""
    import random

    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    from sglang_mxfp8.format.checkpoint import checked_values, refused_update
    from sglang_mxfp8.format.numerics import quantize_mxfp8
    from sglang_mxfp8.ops import value_checks
    from sglang_mxfp8.sglang.patches.model_runner import _bucket_tensors

    seed = random.randrange(1 << 30)
    g = torch.Generator().manual_seed(seed)
    named = []
    for i in range(40):
        q, s = quantize_mxfp8(torch.randn(256, 2048, generator=g))
        w = f"model.layers.{i}.mlp.down_proj.weight"
        named += [(w, q), (w + "_scale_inv", s),
                  (f"model.layers.{i}.input_layernorm.weight", torch.randn(2048, generator=g).bfloat16())]
    spoil = {3: ("e4m3", 0x7F), 7: ("scale", 255), 11: ("bf16", float("inf")), 99: ("e4m3", 0xFF)}
    for i, (_, value) in spoil.items():
        t = named[i][1]
        if t.dtype == torch.bfloat16:
            t[int(torch.randint(t.numel(), (), generator=g))] = value
        else:
            t.view(torch.uint8).view(-1)[int(torch.randint(t.numel(), (), generator=g))] = value
    bucket = FlattenedTensorBucket(named_tensors=[(n, t.cuda()) for n, t in named])
    sent = {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}
    views = _bucket_tensors(sent)
    checked = checked_values(views)
    assert value_checks.fits(sent["flattened_tensor"], checked)
    got = value_checks.bad_tensors(sent["flattened_tensor"], [t for _, _, t in checked]).tolist()
    assert got == [int(refused_update([(n, t)], structure=False) is not None) for n, _, t in checked], seed
    assert sum(got) == len(spoil), seed
    assert value_checks.first_refused(sent["flattened_tensor"], checked) == refused_update(views, structure=False)
