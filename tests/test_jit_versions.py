"""The FlashInfer releases the trimmed JIT builds (sglang_mxfp8/ops/flashinfer_jit) were checked against, and what
happens on any other: FlashInfer's own modules, said in the log. ci/test.sh runs this file with the oldest supported
SGLang (FlashInfer 0.6.7.post3) and again with the newest (FlashInfer 0.7.2)."""

import importlib.metadata
import json
import re

import pytest

from conftest import run_python
from sglang_mxfp8.ops import flashinfer_jit

pytestmark = pytest.mark.sglang  # CI runs these again with the newest SGLang

pytest.importorskip("flashinfer.jit")


def test_the_flashinfer_the_installed_sglang_pins_is_a_checked_release():
    pins = [m.group(1) for r in importlib.metadata.requires("sglang") or []
            if (m := re.match(r"flashinfer[-_]python(?:\[[^]]*\])?\s*==\s*([^\s;,]+)", r)) and "extra ==" not in r]
    assert len(pins) == 1, importlib.metadata.requires("sglang")
    pinned = pins[0]
    assert pinned == flashinfer_jit.installed_version()
    assert pinned in flashinfer_jit.CHECKED_VERSIONS and flashinfer_jit.unchecked() is None


OTHER_RELEASE = r"""
import json, logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="LOG %(message)s")
import flashinfer.fused_moe.core as core
from flashinfer.jit.gemm import gen_fp8_blockscale_gemm_sm90_module
from sglang_mxfp8.ops import flashinfer_jit
flashinfer_jit.installed_version = lambda: "9.9.9"
from sglang_mxfp8.ops.flashinfer_jit import blockscale_gemm as fb, fused_moe as moe

dense, fused = fb.dense_spec(), moe.block_scale_moe_spec()
stock_dense, stock_fused = gen_fp8_blockscale_gemm_sm90_module(), core.gen_cutlass_fused_moe_sm90_module()
print(json.dumps(dict(
    unchecked=flashinfer_jit.unchecked(), dense_unsupported=fb.unsupported(), moe_unsupported=moe.unsupported(),
    names=[dense.name, fused.name], same_sources=[dense.sources == stock_dense.sources,
                                                  fused.sources == stock_fused.sources],
    same_flags=fused.extra_cuda_cflags == stock_fused.extra_cuda_cflags,
)))
"""


def test_another_flashinfer_release_builds_flashinfers_own_modules_and_says_so_once(tmp_path):
    p = run_python(OTHER_RELEASE, {"FLASHINFER_CUDA_ARCH_LIST": "9.0a", "FLASHINFER_WORKSPACE_BASE": str(tmp_path)})
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    why = "FlashInfer 9.9.9 is not a release sglang_mxfp8's trimmed builds were checked against (0.6.7.post3, 0.7.2)"
    assert got["unchecked"] == why and got["dense_unsupported"] == why
    assert got["moe_unsupported"] is None  # FlashInfer's full module serves the fused MoE: no reason to plan another
    assert got["names"] == ["fp8_blockscale_gemm_90", "fused_moe_90"]
    assert got["same_sources"] == [True, True] and got["same_flags"]
    logs = [line for line in p.stdout.splitlines() if line.startswith("LOG ")]
    assert logs.count(f"LOG sglang_mxfp8: FlashInfer's fp8_blockscale_gemm_90 compiles its full fp8_blockscale_gemm.cu "
                      f"({why})") == 1
    moe_lines = [line for line in logs if "fused MoE runs FlashInfer's own full SM90 module (fused_moe_90" in line]
    assert len(moe_lines) == 1 and why in moe_lines[0]


def test_no_flashinfer_installed_is_not_an_unchecked_release(monkeypatch):
    monkeypatch.setattr(flashinfer_jit, "installed_version", lambda: None)
    flashinfer_jit.unchecked.cache_clear()
    try:
        assert flashinfer_jit.unchecked() is None  # platform.flashinfer_missing says what is missing
    finally:
        flashinfer_jit.unchecked.cache_clear()
