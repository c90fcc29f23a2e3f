"""What a plan compiles while the model loads (each kernel only the batches it will serve), DeepGEMM's tile buckets,
and the order in which deep_gemm and FlashInfer load."""

import importlib.util
import subprocess
import sys

import pytest
import torch

from sglang_mxfp8 import platform
from sglang_mxfp8.ops import cublas_sm90
from sglang_mxfp8.kernels import registry
from sglang_mxfp8.kernels.base import LinearSpec
from sglang_mxfp8.ops import deepgemm_sm90
from sglang_mxfp8.platform import GpuSpec
from sglang_mxfp8.settings import Settings

H200 = GpuSpec("NVIDIA H200", 90)


@pytest.mark.parametrize("deep_gemm,max_m,expected", [
    (True, 8192, [("gemv", 1, 1), ("deepgemm", 1024, 8192), ("flashinfer_sm90", 2, 1023)]),
    (False, 8192, [("gemv", 1, 1), ("cublas", 1024, 8192), ("flashinfer_sm90", 2, 1023)]),  # cuBLAS: no JIT
    (False, 256, [("gemv", 1, 1), ("flashinfer_sm90", 2, 256)]),
])
def test_precompile_runs_each_kernel_on_the_batches_it_serves(deep_gemm, max_m, expected, monkeypatch):
    """Plan.precompile hands each kernel the batch range it will serve up to the server's largest batch: FlashInfer's
    tile configs stop below the 1024-token prefill kernel, DeepGEMM's start there."""
    monkeypatch.setattr(platform, "deep_gemm_missing", lambda api, needs="": None if deep_gemm else "not installed")
    monkeypatch.setattr(cublas_sm90, "unsupported", lambda: None)
    monkeypatch.setattr(platform, "flashinfer_missing", lambda: None)
    plan = registry.select_linear(LinearSpec("o_proj", 5120, 2048), H200, "auto", Settings())
    ran = []
    for e in plan.entries:
        monkeypatch.setattr(
            e.kernel, "precompile", lambda layer, state, lo, hi, name=e.kernel.name: ran.append((name, lo, hi))
        )
    plan.precompile(torch.nn.Module(), None, max_m)
    assert ran == expected


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
    fault); platform.load_deep_gemm() imports FlashInfer's GEMM module first. Checked in a fresh
    process (a stand-in deep_gemm module: only the order is under test here)."""
    pytest.importorskip("flashinfer")
    code = ("import sys, types\n"
            "sys.modules['deep_gemm'] = types.ModuleType('deep_gemm')\n"
            "from sglang_mxfp8 import platform\n"
            "before = 'flashinfer.gemm' in sys.modules\n"
            "assert platform.load_deep_gemm() is sys.modules['deep_gemm']\n"
            "print(before, 'flashinfer.gemm' in sys.modules)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["False", "True"]


@pytest.mark.skipif(importlib.util.find_spec("deep_gemm") is not None, reason="deep_gemm is installed here")
def test_missing_deep_gemm_costs_no_flashinfer_import():
    """Where deep_gemm is not installed (every CPU machine running doctor), the check fails without importing
    FlashInfer's GEMM module first, with the same one-line reason."""
    code = ("import sys\n"
            "from sglang_mxfp8 import platform\n"
            "print(platform.deep_gemm_or_why()[1])\n"
            "print('flashinfer.gemm' in sys.modules)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.splitlines() == ["deep_gemm does not import (ModuleNotFoundError: No module named 'deep_gemm')",
                                     "False"]
