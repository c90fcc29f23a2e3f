"""The trimmed SM90 fused-MoE JIT module (sglang_mxfp8/ops/flashinfer_jit/fused_moe.py) derived from the installed
FlashInfer's real sources and JIT spec, in a fresh process with FlashInfer's cache in a temporary folder (its JIT
spec factory needs a target architecture named: FLASHINFER_CUDA_ARCH_LIST=9.0a). Where this machine has nvcc, the
runner's sources are compiled with FlashInfer's own ninja rule and their symbols compared; the module's build, link
and numbers are timed and run on the GPU (tests/gpu, sglang-mxfp8 bench)."""

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import finish_ninja, ninja_objects, run_python, start_ninja
from sglang_mxfp8.ops.flashinfer_jit import fused_moe as f

pytestmark = pytest.mark.sglang  # CI runs these again with the newest SGLang

pytest.importorskip("flashinfer.jit")

DERIVE = r"""
import json, re
from pathlib import Path
import flashinfer
import flashinfer.fused_moe.core as core
from flashinfer.jit import env as jit_env
from sglang_mxfp8.ops.flashinfer_jit import fused_moe as f

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
    instantiation=next(Path(s) for s in ours.sources if s.name == "fp8_block_scale_moe_instantiation.cu").read_text(),
    derived=[str(s) for s in ours.sources if Path(s).is_relative_to(jit_env.FLASHINFER_GEN_SRC_DIR)],
    finalize_macro="#define INSTANTIATE_FINALIZE_MOE_ROUTING"
    in (csrc / "fused_moe/cutlass_backend/cutlass_fused_moe_kernels.cuh").read_text(),
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
    # and the derived sources: the binding and the runner's instantiation in place of FlashInfer's, the runner's
    # expert-map sort kernels in sources of their own (test_expert_map_sort_kernels_...)
    full = {s.split("/csrc/")[-1] for s in got["full_sources"] if "/csrc/" in s}
    derived = [s.rsplit("/", 1)[-1] for s in got["derived"]]
    assert derived == ["fp8_blockscale_gemm.cu", "fp8_block_scale_moe_binding.cu",
                       "fp8_block_scale_moe_instantiation.cu",
                       *[f"fp8_block_scale_moe_expert_maps_{w}.cu" for w in ("1_to_6", "7", "8", "9")]]
    ours = [s.split("/csrc/")[-1] for s in got["our_sources"] if s not in got["derived"][1:]]
    gemm = "nv_internal/tensorrt_llm/kernels/cutlass_kernels/fp8_blockscale_gemm/fp8_blockscale_gemm.cu"
    trimmed_gemm = [s for s in ours if s.endswith("/generated/fused_moe_90_fp8_block_scale/fp8_blockscale_gemm.cu")]
    assert len(trimmed_gemm) == 1 and gemm in full  # FlashInfer's, trimmed (test_jit_blockscale_gemm.py)
    ours = [gemm if s in trimmed_gemm else s for s in ours]
    assert set(ours) <= full and len(got["full_sources"]) >= 10 * len(got["our_sources"])
    assert [s for s in ours if "moe_gemm_kernels_" in s] == [
        "nv_internal/tensorrt_llm/kernels/cutlass_kernels/moe_gemm/moe_gemm_kernels_bf16_fp8.cu"]
    assert gemm in ours
    # FlashInfer's module factory calls set_deepgemm_jit_include_dirs on the module it loads: the grouped GEMMs' JIT
    # finds DeepGEMM's headers through it
    assert "fused_moe/cutlass_backend/deepgemm_jit_setup.cu" in ours
    assert not any("flashinfer_cutlass_fused_moe_binding" in s or "cutlass_fused_moe_instantiation" in s for s in ours)
    assert all(got["derived_exist"]) and got["name"] == "fused_moe_90_fp8_block_scale"
    if got["version"] == "0.6.7.post3":  # the release SGLang 0.5.10.post1 pins: 181 objects down to 18
        assert (len(got["full_sources"]), len(got["our_sources"])) == (181, 18)
    # FlashInfer's flags for this version and CUDA, sm_90a, without FP4
    assert got["our_flags"] == [f for f in got["full_flags"] if f != "-DENABLE_FP4"]
    assert (
        "-gencode=arch=compute_90a,code=sm_90a" in got["our_flags"] and "-DENABLE_FP8_BLOCK_SCALE" in got["our_flags"]
    )
    # the one instantiation: a runner FlashInfer itself instantiates, with the routing macro it defines
    assert got["runner_instantiated_by_flashinfer"] and got["finalize_macro"]
    assert "template class CutlassMoeFCRunner<__nv_bfloat16, __nv_fp8_e4m3, __nv_bfloat16>;" in got["instantiation"]
    assert '#include "fp8_block_scale_moe_kernels.cuh"' in got["instantiation"]


def kernels_header() -> str:
    from flashinfer.jit import env as jit_env

    return (Path(jit_env.FLASHINFER_CSRC_DIR) / f._KERNELS_HEADER).read_text()


def dispatched_widths(header: str):
    dispatcher = header[header.index(f._EXPERT_MAPS_DISPATCH):]
    return re.findall(r"&fusedBuildExpertMapsSortFirstTokenBlockSize<(\d+)>", dispatcher[:dispatcher.index("\n}\n")])


def test_expert_map_sort_kernels_move_to_sources_of_their_own_and_nothing_else_changes():
    """The runner's header as FlashInfer ships it plus the explicit instantiation declarations of the sort dispatch
    per radix width, which the other sources define from FlashInfer's own template code, each width once."""
    header = kernels_header()
    split, sources = f.split_expert_maps(header)
    widths = dispatched_widths(header)
    assert widths == [str(w) for w in range(1, 10)]
    at = header.index(f._EXPERT_MAPS_DISPATCH)
    inserted = split[at:len(split) - len(header) + at]
    assert split == header[:at] + inserted + header[at:]
    assert re.findall(r"^extern template bool fusedBuildExpertMapsSortFirstTokenBlockSize<(\d+)>\(", inserted,
                      re.M) == widths
    assert "__global__" not in inserted and "{" not in inserted  # declarations only
    templates = header[header.index(f._EXPERT_MAPS_START):at]
    per_source = [re.findall(r"^template bool fusedBuildExpertMapsSortFirstTokenBlockSize<(\d+)>\(", text, re.M)
                  for text in sources.values()]
    assert per_source == [widths[:-3], *[[w] for w in widths[-3:]]]
    for text in sources.values():
        assert templates in text  # FlashInfer's template code, byte for byte
        assert re.findall(r"^#include (.*)$", text, re.M) == [
            "<cub/cub.cuh>", '"tensorrt_llm/common/assert.h"', '"tensorrt_llm/common/cudaUtils.h"',
            '"tensorrt_llm/common/logger.h"']  # not the runner's header, whose non-template functions it defines
    assert f.split_expert_maps(header) == (split, sources)


@pytest.mark.parametrize("edit,message", [
    (lambda s: s.replace(f._EXPERT_MAPS_DISPATCH, "bool fusedBuildExpertMapsSortFirstTokenAll(\n"),
     "has not the expert-map sort templates"),
    (lambda s: s.replace("__global__ void fusedBuildExpertMapsSortFirstTokenKernel(",
                         "__global__ void fusedBuildExpertMapsKernel("), "has not the expert-map sort templates"),
    (lambda s: s.replace(f._EXPERT_MAPS_DISPATCH, "int helper() {\n  return 0;\n}\n\n" + f._EXPERT_MAPS_DISPATCH),
     "defines a non-template function among its expert-map sort templates ('int helper() {')"),
    (lambda s: re.sub(r"&fusedBuildExpertMapsSortFirstTokenBlockSize<(\d)>", r"&sortBlockSize<\1>", s),
     "takes no list of fusedBuildExpertMapsSortFirstTokenBlockSize"),
])
def test_a_header_not_of_the_shape_the_split_derives_from_is_refused(edit, message):
    with pytest.raises(f.TrimmedBuildError, match=re.escape(message)):
        f.split_expert_maps(edit(kernels_header()))


FALLBACK = r"""
import json, logging
from pathlib import Path
logging.basicConfig(level=logging.INFO, format="%(message)s")
from sglang_mxfp8.ops.flashinfer_jit import fused_moe as f
f._EXPERT_MAPS_DISPATCH = "bool fusedBuildExpertMapsSortFirstTokenAll(\n"  # a FlashInfer whose header changed
spec = f.block_scale_moe_spec()
print(json.dumps(dict(sources=[s.name for s in spec.sources], instantiation=next(
    s for s in spec.sources if s.name == "fp8_block_scale_moe_instantiation.cu").read_text())))
"""


def test_a_changed_header_compiles_the_runner_with_its_sort_kernels_and_says_why(tmp_path):
    p = run_python(FALLBACK, {"FLASHINFER_CUDA_ARCH_LIST": "9.0a", "FLASHINFER_WORKSPACE_BASE": str(tmp_path)})
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert '#include "cutlass_fused_moe_kernels.cuh"' in got["instantiation"]
    assert not [s for s in got["sources"] if "expert_maps" in s]
    assert "the fused MoE's runner source compiles its expert-map sort kernels too (FlashInfer's " \
           "cutlass_fused_moe_kernels.cuh has not the expert-map sort templates" in p.stderr


WRITE_NINJA = r"""
import sys
from sglang_mxfp8.ops.flashinfer_jit import fused_moe as f
if sys.argv[1] == "whole":
    f._EXPERT_MAPS_DISPATCH = "bool fusedBuildExpertMapsSortFirstTokenAll(\n"  # FlashInfer's header, unsplit
spec = f.block_scale_moe_spec()
spec.write_ninja()
print(spec.ninja_path)
"""


def global_symbols(objects):
    """(defined, undefined) global symbols of object files, by name; defined ones with their nm type."""
    out = subprocess.run(["nm", "-g", *map(str, objects)], capture_output=True, text=True, check=True).stdout
    rows = [line.split() for line in out.splitlines() if line.strip() and not line.endswith(":")]
    defined = [(r[2], r[1]) for r in rows if len(r) == 3]
    return defined, {r[1] for r in rows if len(r) == 2 and r[0] == "U"}


@pytest.mark.skipif(shutil.which("nvcc") is None or shutil.which("nm") is None,
                    reason="needs nvcc (CUDA toolkit) and nm on this machine")
def test_split_runner_objects_define_what_flashinfers_one_source_defines(tmp_path):
    """The runner's instantiation and the expert-map sources compiled with FlashInfer's own ninja rule, against the
    instantiation of FlashInfer's header as it ships (the fallback's): together they define every global symbol it
    defines (the 180 sort kernels among them) and no strong symbol twice, and nothing of the sort is left undefined."""
    builds = {}
    for variant in ("split", "whole"):
        p = run_python(WRITE_NINJA.replace("sys.argv[1]", repr(variant)),
                       {"FLASHINFER_CUDA_ARCH_LIST": "9.0a", "FLASHINFER_WORKSPACE_BASE": str(tmp_path / variant)})
        assert p.returncode == 0, p.stderr[-2000:]
        ninja = Path(p.stdout.strip().splitlines()[-1])
        targets = ninja_objects(ninja, lambda source: source.endswith("/fp8_block_scale_moe_instantiation.cu")
                                or "/fp8_block_scale_moe_expert_maps_" in source)
        builds[variant] = (targets, start_ninja(ninja, targets))  # both at once: one CPU each
    for _, build in builds.values():
        finish_ninja(build)
    split_targets, whole_targets = builds["split"][0], builds["whole"][0]
    assert len(split_targets) == 5 and len(whole_targets) == 1
    split_defined, split_undefined = global_symbols(split_targets)
    whole_defined, _ = global_symbols(whole_targets)

    def names(defined):  # less each file's own anonymous-namespace symbols
        return {name for name, _ in defined if "_GLOBAL__N_" not in name}

    assert names(whole_defined) <= names(split_defined)
    sort_kernels = {n for n in names(whole_defined) if "fusedBuildExpertMapsSortFirstTokenKernel" in n}
    assert len(sort_kernels) >= 100  # every radix width x top-k x block size (9 x 5 x 4 with FlashInfer 0.6.7)
    strong = [name for name, kind in split_defined if kind == "T"]
    assert len(strong) == len(set(strong))
    assert not {n for n in split_undefined if "fusedBuildExpertMaps" in n} - names(split_defined)
    instantiation = [t for t in split_targets if t.endswith("_moe_instantiation.cuda.o")]
    runner_defined, runner_undefined = global_symbols(instantiation)
    assert not {n for n, _ in runner_defined if "fusedBuildExpertMapsSortFirstTokenKernel" in n}
    assert len({n for n in runner_undefined if "fusedBuildExpertMapsSortFirstTokenBlockSize" in n}) == 9
