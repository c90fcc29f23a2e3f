"""Which kernel the FlashInfer backend gives a dense layer's prefill batches (DeepGEMM's FP8 GEMM, cuBLAS's
block-scaled GEMM or FlashInfer's own), its switches, and what is compiled at load (the kernels' numerics:
tests/gpu/test_hopper_kernels.py)."""

import importlib.util
import subprocess
import sys
import types

import pytest
import torch

from sglang_mxfp8 import deepgemm_sm90, dense, flashinfer_sm90
from sglang_mxfp8.dense import HopperFlashInferDense
from sglang_mxfp8.numerics import quantize_mxfp8
from sglang_mxfp8.resolver import Choice


def _flashinfer_layer(n: int, k: int, dtype=torch.bfloat16):
    """A FlashInfer-backend layer as SGLang's loader builds it (weight and model dtype, then the backend's buffers)."""
    be = HopperFlashInferDense(Choice(HopperFlashInferDense.kernel, "test"), "model.layers.0.mlp.down_proj")
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.zeros(n, k, dtype=torch.float8_e4m3fn), requires_grad=False)
    layer.orig_dtype = dtype
    be.create_buffers(layer, n, k)
    return layer, be


@pytest.mark.parametrize("n,k,expected", [(5120, 2048, 1024), (2048, 4096, 1024), (5120, 2080, 0), (1008, 2048, 0)])
def test_cublas_takes_prefill_batches_where_deepgemm_cannot(n, k, expected, monkeypatch):
    """Without DeepGEMM, batches of 1024+ tokens take cuBLAS's block-scaled GEMM where its scale layout fits (K a
    multiple of 512, N of 128); SGLANG_MXFP8_CUBLAS_PREFILL=0 keeps them on FlashInfer's."""
    monkeypatch.delenv(dense.CUBLAS_PREFILL_ENV, raising=False)
    monkeypatch.setattr(deepgemm_sm90, "dense_unavailable", lambda n, k, dtype: "not installed")
    be = _flashinfer_layer(n, k)[1]
    assert (be.prefill_kernel, be.prefill_min_m) == (("cublas", 1024) if expected else (None, 0))
    assert expected == dense.CUBLAS_MIN_TOKENS * bool(expected)
    monkeypatch.setenv(dense.CUBLAS_PREFILL_ENV, "0")
    be = _flashinfer_layer(n, k)[1]
    assert (be.prefill_kernel, be.prefill_min_m) == (None, 0)


def test_deepgemm_takes_prefill_batches_where_it_runs(monkeypatch):
    """Where DeepGEMM's dense GEMM can run, it takes batches of 1024+ tokens in place of cuBLAS (unless
    SGLANG_MXFP8_CUBLAS_PREFILL=1 asks for cuBLAS), and FlashInfer's kernels are compiled at load only for the
    smaller batches."""
    monkeypatch.delenv(dense.CUBLAS_PREFILL_ENV, raising=False)
    monkeypatch.setattr(deepgemm_sm90, "dense_unavailable", lambda n, k, dtype: None)
    monkeypatch.setattr(dense, "serving_max_tokens", lambda: 8192)
    monkeypatch.setattr(flashinfer_sm90, "precompile_enabled", lambda: True)
    largest = []
    monkeypatch.setattr(flashinfer_sm90, "precompile", lambda w, s, dtype, max_m: largest.append(max_m))
    for n, k in ((2048, 4096), (1088, 2048)):  # N = 1088: no cuBLAS, DeepGEMM all the same
        layer, be = _flashinfer_layer(n, k)
        assert (be.prefill_kernel, be.prefill_min_m) == ("deepgemm", deepgemm_sm90.DENSE_MIN_TOKENS) == ("deepgemm", 1024)
        q, s = quantize_mxfp8(torch.randn(n, k) * 0.02)
        layer.weight.data.copy_(q)
        be.process_weights_after_loading(layer, s)
    assert largest == [1023, 1023]
    monkeypatch.setenv(dense.CUBLAS_PREFILL_ENV, "1")  # cuBLAS asked for by name: it runs, DeepGEMM does not
    assert dense.dense_prefill_choice(2048, 4096, torch.bfloat16) == ("cublas", 1024, "SGLANG_MXFP8_CUBLAS_PREFILL=1 asks for cuBLAS")


def test_flashinfer_precompile_stops_below_the_cublas_batches(monkeypatch):
    """Without DeepGEMM, FlashInfer's tile configs are compiled at load only for the batches its GEMM will see."""
    monkeypatch.delenv(dense.CUBLAS_PREFILL_ENV, raising=False)
    monkeypatch.setattr(deepgemm_sm90, "dense_unavailable", lambda n, k, dtype: "not installed")
    monkeypatch.setattr(dense, "serving_max_tokens", lambda: 8192)
    monkeypatch.setattr(flashinfer_sm90, "precompile_enabled", lambda: True)
    largest = []
    monkeypatch.setattr(flashinfer_sm90, "precompile", lambda w, s, dtype, max_m: largest.append(max_m))
    for n, k in ((2048, 4096), (1088, 2048)):  # N = 1088: not whole 128-row blocks, so no cuBLAS
        layer, be = _flashinfer_layer(n, k)
        q, s = quantize_mxfp8(torch.randn(n, k) * 0.02)
        layer.weight.data.copy_(q)
        be.process_weights_after_loading(layer, s)
    assert largest == [dense.CUBLAS_MIN_TOKENS - 1, 8192]


def test_why_deepgemm_dense_cannot_run_is_named(monkeypatch):
    monkeypatch.delenv(deepgemm_sm90.DENSE_ENV, raising=False)
    assert deepgemm_sm90.dense_unavailable(5120, 2048, torch.float16) == "a float16 model (DeepGEMM writes bf16)"
    assert deepgemm_sm90.dense_unavailable(5120, 2080, torch.bfloat16) == "[5120 x 2080] is not a multiple of 128 in K and 64 in N"
    assert deepgemm_sm90.dense_unavailable(1000, 2048, torch.bfloat16) == "[1000 x 2048] is not a multiple of 128 in K and 64 in N"
    old = types.ModuleType("deep_gemm")  # a build without the dense GEMM
    old.__version__ = "0.0.1"
    monkeypatch.setitem(sys.modules, "deep_gemm", old)
    assert deepgemm_sm90.dense_unavailable(5120, 2048, torch.bfloat16) == "deep_gemm 0.0.1 has no fp8_gemm_nt"
    old.fp8_gemm_nt = lambda *a, **kw: None
    assert deepgemm_sm90.dense_unavailable(5120, 2048, torch.bfloat16) is None
    monkeypatch.setenv(deepgemm_sm90.DENSE_ENV, "0")
    assert deepgemm_sm90.dense_unavailable(5120, 2048, torch.bfloat16) == "SGLANG_MXFP8_DEEPGEMM_PREFILL_DENSE=0"
    layer, be = _flashinfer_layer(5120, 2048)
    assert be.prefill_kernel == "cublas"  # switched off: cuBLAS from 1024 tokens as before


@pytest.mark.skipif(importlib.util.find_spec("deep_gemm") is not None, reason="deep_gemm is installed here")
def test_deepgemm_not_installed_is_named():
    assert deepgemm_sm90.dense_unavailable(5120, 2048, torch.bfloat16) == (
        "deep_gemm does not import (ModuleNotFoundError: No module named 'deep_gemm')")


@pytest.mark.parametrize("min_m,max_m", [(1024, 8192), (1000, 1100), (1024, 16384), (1025, 1025)])
def test_deepgemm_precompile_runs_one_batch_per_tile_bucket(min_m, max_m):
    """Above 32 rows DeepGEMM's SM90 tile config depends on M only through ceil(M / 64): the Ms run at load fall in
    exactly the 64-row buckets that batches of min_m..max_m tokens can."""
    ms = deepgemm_sm90.precompile_ms(min_m, max_m)
    assert ms == sorted(set(ms)) and all(m % 64 == 0 for m in ms)
    assert {-(-m // 64) for m in range(min_m, max_m + 1)} == {m // 64 for m in ms}
    assert deepgemm_sm90.precompile_ms(2048, 1024) == []


def test_deep_gemm_is_loaded_after_flashinfer():
    """A process that loads deep_gemm before FlashInfer dies in DeepGEMM's first compile on the H200 (segmentation
    fault, benchmarks/RESULTS.md); deepgemm_sm90.load() imports FlashInfer's GEMM module first. Checked in a fresh
    process (a stand-in deep_gemm module: only the order is under test here)."""
    pytest.importorskip("flashinfer")
    code = ("import sys, types\n"
            "sys.modules['deep_gemm'] = types.ModuleType('deep_gemm')\n"
            "from sglang_mxfp8 import deepgemm_sm90\n"
            "before = 'flashinfer.gemm' in sys.modules\n"
            "assert deepgemm_sm90.load() is sys.modules['deep_gemm']\n"
            "print(before, 'flashinfer.gemm' in sys.modules)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["False", "True"]


@pytest.mark.skipif(importlib.util.find_spec("deep_gemm") is not None, reason="deep_gemm is installed here")
def test_missing_deep_gemm_costs_no_flashinfer_import():
    """Where deep_gemm is not installed (every CPU machine running doctor), the check fails without importing
    FlashInfer's GEMM module first, with the same one-line reason."""
    code = ("import sys\n"
            "from sglang_mxfp8 import deepgemm_sm90\n"
            "print(deepgemm_sm90.load_or_why()[1])\n"
            "print('flashinfer.gemm' in sys.modules)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.splitlines() == ["deep_gemm does not import (ModuleNotFoundError: No module named 'deep_gemm')",
                                     "False"]
