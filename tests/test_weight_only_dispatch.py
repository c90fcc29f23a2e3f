"""Which batches the weight-only FP8 kernels serve: the dense backends' and the MoE method's rules,
and the SGLANG_MXFP8_WEIGHT_ONLY switch (the kernels' numerics: test_triton_cpu.py, tests/gpu)."""

import dataclasses

import pytest
import sglang.srt.layers.quantization  # noqa: F401 - first, as in SGLang's processes (its import applies our patch)
import torch
from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig

from sglang_mxfp8 import dense, quant_methods
from sglang_mxfp8.blackwell import BlackwellCutlassDense, BlackwellTrtllmDense
from sglang_mxfp8.dense import HopperFlashInferDense, HopperTritonDense
from sglang_mxfp8.resolver import Choice

HOPPER = (HopperTritonDense, HopperFlashInferDense)
PLAIN_MOE = MoeRunnerConfig(params_dtype=torch.bfloat16, top_k=8, num_experts=128)  # Qwen3-MoE's runner config


def _backend(cls):
    return cls(Choice(cls.kernel, "test"), "model.layers.0.self_attn.qkv_proj")


@pytest.mark.parametrize("cls", HOPPER)
def test_hopper_backends_serve_small_bf16_batches_weight_only(cls, monkeypatch):
    monkeypatch.delenv(dense.WEIGHT_ONLY_ENV, raising=False)
    be = _backend(cls)
    assert be.weight_only_max_m == dense.WEIGHT_ONLY_MAX_M >= 1
    layer = torch.nn.Module()  # the threshold is checked before the layer is read
    big = torch.randn(dense.WEIGHT_ONLY_MAX_M + 1, 256, dtype=torch.bfloat16)
    half = torch.randn(1, 256, dtype=torch.float16)
    assert be.weight_only(layer, big, None) is None  # the backend's own W8A8 kernel runs
    assert be.weight_only(layer, half, None) is None  # e4m3 x 2^k is exact in bf16 only


@pytest.mark.parametrize("value", ["0", "off", "False"])
@pytest.mark.parametrize("cls", HOPPER)
def test_weight_only_switch_off(cls, value, monkeypatch):
    monkeypatch.setenv(dense.WEIGHT_ONLY_ENV, value)
    assert _backend(cls).weight_only_max_m == 0
    assert HopperTritonDense.weight_only_max_m == dense.WEIGHT_ONLY_MAX_M  # the class default is untouched
    assert quant_methods.moe_weight_only_max_tokens(PLAIN_MOE, ep_size=1) == 0


@pytest.mark.parametrize("cls", (BlackwellTrtllmDense, BlackwellCutlassDense))
def test_blackwell_backends_never_run_the_hopper_weight_only_kernel(cls, monkeypatch):
    monkeypatch.delenv(dense.WEIGHT_ONLY_ENV, raising=False)
    be = _backend(cls)
    assert be.weight_only_max_m == 0
    assert be.weight_only(torch.nn.Module(), torch.randn(1, 256, dtype=torch.bfloat16), None) is None


@pytest.mark.parametrize("change,ep_size", [
    (dict(activation="gelu"), 1),
    (dict(is_gated=False), 1),
    (dict(gemm1_alpha=1.702, gemm1_clamp_limit=7.0), 1),  # gpt-oss's clamped SwiGLU
    (dict(gemm1_clamp_limit=7.0), 1),
    (dict(apply_router_weight_on_input=True), 1),
    (dict(no_combine=True, inplace=False), 1),
    (dict(params_dtype=torch.float16), 1),
    ({}, 2),  # expert parallel: topk ids name experts other ranks hold
])
def test_moe_weight_only_only_for_what_the_kernel_computes(change, ep_size, monkeypatch):
    monkeypatch.delenv(dense.WEIGHT_ONLY_ENV, raising=False)
    assert quant_methods.moe_weight_only_max_tokens(PLAIN_MOE, ep_size=1) == quant_methods.MOE_WEIGHT_ONLY_MAX_TOKENS >= 1
    assert quant_methods.moe_weight_only_max_tokens(dataclasses.replace(PLAIN_MOE, **change), ep_size) == 0
