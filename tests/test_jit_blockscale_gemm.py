"""FlashInfer's FP8 block-scale GEMM source trimmed to its DeepGEMM path
(sglang_mxfp8/ops/flashinfer_jit/blockscale_gemm.py), derived from the installed FlashInfer's real header and JIT specs,
and compiled with FlashInfer's own nvcc command where this machine has nvcc. The modules' link, load and numbers are
the GPU tests' (tests/gpu)."""

import json
import re
import shutil
from pathlib import Path

import pytest

from conftest import finish_ninja, ninja_objects, run_python, start_ninja
from sglang_mxfp8.ops.flashinfer_jit import blockscale_gemm as fb

pytestmark = pytest.mark.sglang  # CI runs these again with the newest SGLang

flashinfer_jit = pytest.importorskip("flashinfer.jit")

CUT = {"gemm_dispatch_old", "gemm_dispatch_sm89", "strided_batch_gemm_dispatch_sm89"}
STATIC_BRANCH_IN = {"fp8_grouped_gemm_run", "fp8_stride_batch_gemm_run"}


def flashinfer_header() -> str:
    return (Path(flashinfer_jit.env.FLASHINFER_CSRC_DIR) / fb.GEMM_DIR / fb.KERNEL_HEADER).read_text()


def top_level_functions(source: str):
    """(name, text) of each non-template function defined at namespace level: from its signature to its closing brace
    at column 0."""
    return [(m.group(1), m.group(0)) for m in re.finditer(r"^(?:void|bool) (\w+)\(.*?^\}\n", source, re.S | re.M)]


def without(source: str, functions) -> str:
    for _, text in functions:
        source = source.replace(text, "", 1)
    return source


def test_trimmed_header_keeps_every_deepgemm_function_and_cuts_the_sm89_and_static_paths():
    source = flashinfer_header()
    trimmed = fb.trimmed_kernel_header(source)
    before, after = top_level_functions(source), top_level_functions(trimmed)
    assert [name for name, _ in before] == [name for name, _ in after]  # no function lost, none added
    deepgemm_path = {"gemm_dispatch", "grouped_gemm_dispatch", "strided_batch_gemm_dispatch", "fp8_gemm_run"}
    assert deepgemm_path <= dict(before).keys()
    changed = set()
    for (name, old), (_, new) in zip(before, after):
        if old == new:
            continue
        changed.add(name)
        signature = old[:old.index("{\n") + 2]
        if name in CUT:  # the whole body: the error alone
            assert new == signature + fb._LEFT_OUT_ERROR + "}\n"
        else:  # the DeepGEMM branch kept byte for byte, the static one replaced by the error
            head = old[:old.index("} else {\n    using GemmType = Fp8Gemm<")]
            assert new == head + "} else {\n" + fb._LEFT_OUT_ERROR + "  }\n}\n"
            assert "getDeepGemmEnabled()" in head
    assert changed == CUT | STATIC_BRANCH_IN
    # the rest of the header (templates, kernels, the DeepGEMM dispatchers) is FlashInfer's except the SM89 include
    assert without(trimmed, after) == without(source, before).replace(fb._SM89_INCLUDE, "")
    assert fb._SM89_INCLUDE in source and "ada_blockwise_gemm" not in trimmed
    assert fb.trimmed_kernel_header(source) == trimmed  # a pure function of FlashInfer's header


@pytest.mark.parametrize("edit,message", [
    (lambda s: s.replace(fb._SM89_INCLUDE, ""), "does not include"),
    (lambda s: s.replace("void gemm_dispatch_sm89(", "void gemm_dispatch_ada("),
     "not one function starting 'void gemm_dispatch_sm89("),
    (lambda s: s.replace("  } else {\n    using GemmType = Fp8Gemm<", "  } else {\n    using GemmType = Fp8GemmV2<", 1),
     "has 1 non-DeepGEMM branches"),
    (lambda s: s + "\nvoid extra() { ada_blockwise_gemm::run(); }\n", "still calls ada_blockwise_gemm::"),
])
def test_a_header_not_of_the_shape_the_trim_derives_from_is_refused(edit, message):
    with pytest.raises(fb.TrimmedBuildError, match=re.escape(message)):
        fb.trimmed_kernel_header(edit(flashinfer_header()))


DERIVE = r"""
import json
from pathlib import Path
from flashinfer.jit import env as jit_env
from flashinfer.jit.gemm import gen_fp8_blockscale_gemm_sm90_module
from sglang_mxfp8.ops.flashinfer_jit import blockscale_gemm as fb, fused_moe as moe

stock, dense, fused = gen_fp8_blockscale_gemm_sm90_module(), fb.dense_spec(), moe.block_scale_moe_spec()
print(json.dumps(dict(
    unsupported=fb.unsupported(), csrc=str(jit_env.FLASHINFER_CSRC_DIR), gen=str(jit_env.FLASHINFER_GEN_SRC_DIR),
    stock=[str(s) for s in stock.sources], dense=[str(s) for s in dense.sources], fused=[str(s) for s in fused.sources],
    names=[stock.name, dense.name, fused.name], flags=[stock.extra_cuda_cflags == dense.extra_cuda_cflags,
                                                       stock.extra_ldflags == dense.extra_ldflags],
    includes=[[str(d) for d in stock.extra_include_dirs], [str(d) for d in dense.extra_include_dirs]],
    header=(Path(dense.sources[0]).parent / fb.KERNEL_HEADER).read_text() == fb.trimmed_kernel_header(
        (Path(jit_env.FLASHINFER_CSRC_DIR) / fb.GEMM_DIR / fb.KERNEL_HEADER).read_text()),
    source=Path(dense.sources[0]).read_text() == (Path(jit_env.FLASHINFER_CSRC_DIR) / fb.GEMM_SOURCE).read_text(),
    ninja=str(dense.ninja_path),
)))
"""


def derive(tmp_path, **env):
    p = run_python(DERIVE, {"FLASHINFER_CUDA_ARCH_LIST": "9.0a", "FLASHINFER_WORKSPACE_BASE": str(tmp_path), **env})
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1]), p.stderr


def test_dense_and_moe_modules_compile_the_trimmed_source_in_place_of_flashinfers(tmp_path):
    got, _ = derive(tmp_path)
    assert got["unsupported"] is None
    original = str(Path(got["csrc"]) / fb.GEMM_SOURCE)
    assert got["names"] == ["fp8_blockscale_gemm_90", fb.DENSE_MODULE, "fused_moe_90_fp8_block_scale"]
    for name, sources in ((fb.DENSE_MODULE, got["dense"]), ("fused_moe_90_fp8_block_scale", got["fused"])):
        trimmed = str(Path(got["gen"]) / name / "fp8_blockscale_gemm.cu")
        assert original not in sources and sources.count(trimmed) == 1
    # the dense module: FlashInfer's own spec, one source swapped, the GEMM folder added to the include path
    assert got["dense"] == [str(Path(got["gen"]) / fb.DENSE_MODULE / "fp8_blockscale_gemm.cu") if s == original else s
                            for s in got["stock"]]
    assert got["flags"] == [True, True]
    assert got["includes"][1] == got["includes"][0] + [str(Path(got["csrc"]) / fb.GEMM_DIR)]
    assert got["header"] and got["source"]


def test_deepgemm_switched_off_compiles_flashinfers_full_source_and_says_why(tmp_path):
    got, stderr = derive(tmp_path, TRTLLM_DG_ENABLED="0")
    assert got["unsupported"] == "TRTLLM_DG_ENABLED=0 runs FlashInfer's non-DeepGEMM kernels"
    assert got["names"] == ["fp8_blockscale_gemm_90", "fp8_blockscale_gemm_90", "fused_moe_90_fp8_block_scale"]
    assert got["dense"] == got["stock"] and str(Path(got["csrc"]) / fb.GEMM_SOURCE) in got["fused"]


def test_a_runner_factory_that_takes_no_module_keeps_flashinfers_dense_module(tmp_path):
    """Where FlashInfer's runner factory is not the cached function of its module generator, the dense op loads
    FlashInfer's own module (built by the same prebuild), and a log line says why."""
    code = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
from flashinfer.gemm import gemm_base
del gemm_base.get_fp8_blockscale_gemm_runner_sm90.__wrapped__
from sglang_mxfp8.ops.flashinfer_jit import blockscale_gemm as fb
print("NAME", fb.dense_spec().name)
"""
    p = run_python(code, {"FLASHINFER_CUDA_ARCH_LIST": "9.0a", "FLASHINFER_WORKSPACE_BASE": str(tmp_path)})
    assert p.returncode == 0, p.stderr[-3000:]
    assert "NAME fp8_blockscale_gemm_90\n" in p.stdout
    assert "compiles its full fp8_blockscale_gemm.cu (FlashInfer's gemm_base has no cached" in p.stdout


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CUDA toolkit) on this machine")
def test_trimmed_source_compiles_with_flashinfers_command_without_the_left_out_kernels(tmp_path):
    """The object nvcc makes with FlashInfer's own ninja rule for the dense module holds the DeepGEMM path's host
    code and its quantization kernels, and none of the static CUTLASS or SM89 GEMM kernels."""
    got, _ = derive(tmp_path)
    ninja = Path(got["ninja"])
    if not ninja.exists():
        p = run_python(
            "from sglang_mxfp8.ops.flashinfer_jit import blockscale_gemm as fb; fb.dense_spec().write_ninja()",
            {"FLASHINFER_CUDA_ARCH_LIST": "9.0a", "FLASHINFER_WORKSPACE_BASE": str(tmp_path)},
        )
        assert p.returncode == 0, p.stderr[-2000:]
    (target,) = ninja_objects(ninja, lambda source: source.endswith("/fp8_blockscale_gemm.cu"))
    finish_ninja(start_ninja(ninja, [target]), timeout=600)
    kernels = Path(target).read_bytes()  # the host stubs register each kernel by its mangled name
    assert kernels.count(b"scale_1x128_kernel") > 0 and kernels.count(b"fill_kernel") > 0
    assert kernels.count(b"cooperative_1x128_by_128x128_fp8_gemm_kernel") == 0  # 323 in FlashInfer's full object
    assert kernels.count(b"sm89_fp8_") == 0
