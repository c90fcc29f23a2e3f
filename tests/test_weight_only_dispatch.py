"""Which batches and layers the Triton backend serves with the weight-only FP8 GEMM, and the
SGLANG_MXFP8_WEIGHT_ONLY switch; which layers the Hopper backends serve with the one-token GEMV, and the
SGLANG_MXFP8_GEMV switch (the kernels' numerics: test_triton_cpu.py, tests/gpu)."""

import pytest
import torch

from sglang_mxfp8 import dense
from sglang_mxfp8.dense import HopperFlashInferDense, HopperTritonDense
from sglang_mxfp8.resolver import Choice


def _hopper_layer(n: int, k: int = 256, cls=HopperTritonDense):
    """A Hopper-backend layer as SGLang's loader builds it (weight, then the backend's buffers)."""
    be = cls(Choice(cls.kernel, "test"), "model.layers.0.self_attn.qkv_proj")
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.zeros(n, k, dtype=torch.float8_e4m3fn), requires_grad=False)
    be.create_buffers(layer, n, k)
    return layer, be


def test_triton_backend_serves_small_bf16_batches_weight_only(monkeypatch):
    monkeypatch.delenv(dense.WEIGHT_ONLY_ENV, raising=False)
    layer, be = _hopper_layer(2048)
    assert be.weight_only_max_m == dense.WEIGHT_ONLY_MAX_M == 16
    big = torch.randn(dense.WEIGHT_ONLY_MAX_M + 1, 256, dtype=torch.bfloat16)
    half = torch.randn(1, 256, dtype=torch.float16)
    assert be.weight_only(layer, big, None) is None  # the W8A8 kernel runs
    assert be.weight_only(layer, half, None) is None  # e4m3 x 2^k is exact in bf16 only


@pytest.mark.parametrize("n,expected", [(2048, 16), (5120, 16), (5121, 0), (14336, 0)])
def test_triton_backend_keeps_w8a8_for_wide_layers(n, expected, monkeypatch):
    """4096->14336 ran faster on the W8A8 kernel at M <= 16 on the H200; N <= 5120 on the weight-only one."""
    monkeypatch.delenv(dense.WEIGHT_ONLY_ENV, raising=False)
    assert _hopper_layer(n)[1].weight_only_max_m == expected == dense.weight_only_max_m(n)


@pytest.mark.parametrize("value", ["0", "off", "False"])
def test_weight_only_switch_off(value, monkeypatch):
    monkeypatch.setenv(dense.WEIGHT_ONLY_ENV, value)
    assert _hopper_layer(2048)[1].weight_only_max_m == 0


@pytest.mark.parametrize("cls", [HopperTritonDense, HopperFlashInferDense])
def test_one_token_gemv_runs_on_the_shapes_measured_faster(cls, monkeypatch):
    """Qwen3-30B-A3B's attention layers (as served: q/k/v fused) take the GEMV at one token by default; a layer
    shape the H200 never measured, or measured slower, keeps the backend's own kernel; SGLANG_MXFP8_GEMV=0: none."""
    from sglang_mxfp8.triton_hopper import GEMV_TUNED

    monkeypatch.delenv(dense.GEMV_ENV, raising=False)
    assert cls.gemv_shapes >= {(5120, 2048), (2048, 4096), (4096, 14336)} and cls.gemv_shapes <= GEMV_TUNED.keys()
    # Llama-3-8B's up projection: faster than the Triton backend's W8A8 whole op, not than FlashInfer's GEMM
    assert ((14336, 4096) in cls.gemv_shapes) == (cls is HopperTritonDense)
    layer, be = _hopper_layer(5120, 2048, cls=cls)
    assert be.gemv
    assert be.one_token(layer, torch.randn(2, 2048, dtype=torch.bfloat16), None) is None  # two tokens: its own kernel
    assert be.one_token(layer, torch.randn(1, 2048, dtype=torch.float16), None) is None  # exact in bf16 only
    assert _hopper_layer(2048, 4096, cls=cls)[1].gemv
    assert not _hopper_layer(2048, 2048, cls=cls)[1].gemv  # not measured
    monkeypatch.setenv(dense.GEMV_ENV, "0")
    layer, be = _hopper_layer(5120, 2048, cls=cls)
    assert not be.gemv and be.one_token(layer, torch.randn(1, 2048, dtype=torch.bfloat16), None) is None
