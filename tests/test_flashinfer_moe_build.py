"""The trimmed SM90 fused-MoE JIT module (sglang_mxfp8/ops/flashinfer_moe_sm90.py) derived from the installed
FlashInfer's real sources and JIT spec, in a fresh process with FlashInfer's cache in a temporary folder (its JIT
spec factory needs a target architecture named: FLASHINFER_CUDA_ARCH_LIST=9.0a). Nothing is compiled here: the
build is timed and run on the H200 (benchmarks/run_h200.sh fi-moe)."""

import json

from conftest import run_python

DERIVE = r"""
import json, re
from pathlib import Path
import flashinfer
import flashinfer.fused_moe.core as core
from flashinfer.jit import env as jit_env
from sglang_mxfp8.ops import flashinfer_moe_sm90 as f

csrc = Path(jit_env.FLASHINFER_CSRC_DIR)
source = (csrc / f._BINDING).read_text()
trimmed = f.trimmed_binding(source)
start, end = source.index(f._CONSTRUCTOR_START), source.index(f._CONSTRUCTOR_END)
prefix = source[:start].replace('"../../tvm_ffi_utils.h"', '"tvm_ffi_utils.h"')
constructor = trimmed[len(prefix):len(trimmed) - len(source[end:])]
full = core.gen_cutlass_fused_moe_sm90_module()
ours = f.block_scale_moe_spec()
try:
    f.trimmed_binding(source.replace(f._CONSTRUCTOR_END, ""))
    refusal = None
except f.TrimmedBuildError as e:
    refusal = str(e)
print(json.dumps(dict(
    version=flashinfer.__version__,
    unsupported=f.unsupported(),
    runners_in_flashinfer=sorted(set(re.findall(r"CutlassMoeFCRunner<([^;]*?)>>\(\)", source[start:end]))),
    runners_trimmed=re.findall(r"CutlassMoeFCRunner<([^;]*?)>>\(\)", constructor),
    block_scale_only="use_deepseek_fp8_block_scale &&" in constructor,
    prefix_kept=trimmed.startswith(prefix),
    suffix_kept=trimmed.endswith(source[end:]),
    relative_include_left='"../../tvm_ffi_utils.h"' in trimmed,
    refusal=refusal,
    full_sources=[str(p) for p in full.sources], our_sources=[str(p) for p in ours.sources],
    derived_exist=[p.exists() for p in ours.sources],
    full_flags=full.extra_cuda_cflags, our_flags=ours.extra_cuda_cflags, name=ours.name,
    instantiation=Path(ours.sources[-1]).read_text(),
    finalize_macro="#define INSTANTIATE_FINALIZE_MOE_ROUTING" in (csrc / "fused_moe/cutlass_backend/cutlass_fused_moe_kernels.cuh").read_text(),
    runner_instantiated_by_flashinfer="template class CutlassMoeFCRunner<__nv_bfloat16, __nv_fp8_e4m3, __nv_bfloat16>;"
        in (csrc / f._INSTANTIATIONS).read_text(),
)))
"""


def test_trimmed_module_is_flashinfers_sm90_module_reduced_to_the_block_scale_runner(tmp_path):
    p = run_python(DERIVE, {"FLASHINFER_CUDA_ARCH_LIST": "9.0a", "FLASHINFER_WORKSPACE_BASE": str(tmp_path)})
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["unsupported"] is None
    # the binding: its constructor builds the BF16 x FP8 runner alone, only when FP8 block scales are asked for;
    # everything around the constructor is FlashInfer's, byte for byte
    assert "__nv_bfloat16, __nv_fp8_e4m3" in got["runners_in_flashinfer"]
    assert len(got["runners_in_flashinfer"]) >= 4
    assert got["runners_trimmed"] == ["__nv_bfloat16, __nv_fp8_e4m3"] and got["block_scale_only"]
    assert got["prefix_kept"] and got["suffix_kept"] and not got["relative_include_left"]
    assert "flashinfer_cutlass_fused_moe_binding.cu has no runner constructor" in got["refusal"]
    # the sources: a subset of FlashInfer's own SM90 list with one MoE GEMM (BF16 x FP8), the FP8 block-scale GEMM,
    # and the two derived sources in place of FlashInfer's binding and instantiations
    full = {s.split("/csrc/")[-1] for s in got["full_sources"] if "/csrc/" in s}
    ours = [s.split("/csrc/")[-1] for s in got["our_sources"][:-2]]
    gemm = "nv_internal/tensorrt_llm/kernels/cutlass_kernels/fp8_blockscale_gemm/fp8_blockscale_gemm.cu"
    trimmed_gemm = [s for s in ours if s.endswith("/generated/fused_moe_90_fp8_block_scale/fp8_blockscale_gemm.cu")]
    assert len(trimmed_gemm) == 1 and gemm in full  # FlashInfer's, trimmed (test_flashinfer_blockscale_build.py)
    ours = [gemm if s in trimmed_gemm else s for s in ours]
    assert set(ours) <= full and len(got["full_sources"]) >= 10 * len(got["our_sources"])
    assert [s for s in ours if "moe_gemm_kernels_" in s] == [
        "nv_internal/tensorrt_llm/kernels/cutlass_kernels/moe_gemm/moe_gemm_kernels_bf16_fp8.cu"]
    assert gemm in ours
    # FlashInfer's module factory calls set_deepgemm_jit_include_dirs on the module it loads: the grouped GEMMs' JIT
    # finds DeepGEMM's headers through it
    assert "fused_moe/cutlass_backend/deepgemm_jit_setup.cu" in ours
    assert not any("flashinfer_cutlass_fused_moe_binding" in s or "cutlass_fused_moe_instantiation" in s for s in ours)
    assert [s.rsplit("/", 1)[-1] for s in got["our_sources"][-2:]] == [
        "fp8_block_scale_moe_binding.cu", "fp8_block_scale_moe_instantiation.cu"]
    assert all(got["derived_exist"]) and got["name"] == "fused_moe_90_fp8_block_scale"
    if got["version"] == "0.6.7.post3":  # the release SGLang 0.5.10.post1 pins: 181 objects down to 14
        assert (len(got["full_sources"]), len(got["our_sources"])) == (181, 14)
    # FlashInfer's flags for this version and CUDA, sm_90a, without FP4
    assert got["our_flags"] == [f for f in got["full_flags"] if f != "-DENABLE_FP4"]
    assert "-gencode=arch=compute_90a,code=sm_90a" in got["our_flags"] and "-DENABLE_FP8_BLOCK_SCALE" in got["our_flags"]
    # the one instantiation: a runner FlashInfer itself instantiates, with the routing macro it defines
    assert got["runner_instantiated_by_flashinfer"] and got["finalize_macro"]
    assert "template class CutlassMoeFCRunner<__nv_bfloat16, __nv_fp8_e4m3, __nv_bfloat16>;" in got["instantiation"]
