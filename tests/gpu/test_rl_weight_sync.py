"""Weight sync from a trainer on the GPU: BF16 tensors sent for layers served as MXFP8 are quantized where the layer
lives, byte for byte as ``sglang-mxfp8 convert`` writes them, for each scale rounding the converter offers (the same
check as tests/test_refit.py's on the CPU)."""

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
    reason="needs a Hopper (SM90) GPU; run python -m pytest tests/gpu on an H100/H200")

from test_refit import bf16_in_equals_convert  # noqa: E402


@pytest.mark.parametrize("rounding", ["ceil", "floor"])
def test_bf16_weights_sent_to_a_gpu_layer_are_what_convert_writes(tmp_path, rounding):
    bf16_in_equals_convert(tmp_path, rounding, "cuda")
