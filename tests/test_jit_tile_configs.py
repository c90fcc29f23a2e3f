"""The tile-config enumeration behind precompiling FlashInfer's SM90 block-scale GEMM.

The facts checked against: the kernels an H200 profile of the served Qwen3-30B-A3B-shaped model ran
at batch 1 (an H200 profile of a served step): ``deep_gemm::fp8_gemm_kernel_swapAB<2048, 4096, 128, 16, 128,
1, 8, ...>`` and ``<5120, 2048, 128, 16, 128, 1, 8, ...>`` (N, K, block M, block N, block K, groups,
stages). tests/gpu checks the whole enumeration against the kernels FlashInfer compiles.
"""

import hashlib
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import set_server_args
from sglang_mxfp8.ops.flashinfer_jit import tile_configs as fs

pytestmark = pytest.mark.sglang  # CI runs these again with the newest SGLang

H200_SMS = 132


@pytest.mark.parametrize("n,k", [(2048, 4096), (5120, 2048)])
def test_batch_one_config_matches_the_h200_profile(n, k):
    cfg = fs.tile_config(1, fs.GemmShape(n, k), H200_SMS)
    assert cfg == fs.TileConfig(swap_ab=True, block_m=128, block_n=16, stages=8, multicast=1)
    assert fs.jit_kernel_name(fs.GemmShape(n, k), cfg) == f"gemm_swapAB_{n}_{k}_128_16_128_1_81_8_1_Normal"


def test_swap_ab_below_32_tokens_and_multicast_from_1024():
    dense = fs.GemmShape(5120, 2048)
    assert fs.tile_config(31, dense, H200_SMS).swap_ab and not fs.tile_config(32, dense, H200_SMS).swap_ab
    assert not fs.tile_config(32, dense, 78).swap_ab  # the 64-token threshold on 78 SMs is the grouped GEMMs' alone
    assert fs.tile_config(1023, dense, H200_SMS).multicast == 1
    big = fs.tile_config(8192, dense, H200_SMS)
    assert big.block_m == 128 and big.multicast == (2 if 5120 % (big.block_n * 2) == 0 else 1)
    assert fs.tile_config(64, dense, H200_SMS).block_m == 64 and fs.tile_config(65, dense, H200_SMS).block_m == 128


@pytest.mark.parametrize("n,k", [(5120, 2048), (2048, 4096), (14336, 4096), (4096, 14336)])
def test_every_config_up_to_max_m_has_its_smallest_m(n, k):
    shape = fs.GemmShape(n, k)
    configs = fs.configs_for(shape, 1, 8192, H200_SMS)
    assert 4 <= len(configs) <= 32  # a handful of kernels to compile per shape, not one per M
    for cfg, m in configs.items():
        assert fs.tile_config(m, shape, H200_SMS) == cfg
        assert all(fs.tile_config(j, shape, H200_SMS) != cfg for j in range(max(1, m - 64), m))
        assert fs._smem_bytes(cfg.stages, k, cfg.block_m, cfg.block_n, cfg.swap_ab) <= fs.SM90_SMEM_BYTES
    assert {fs.tile_config(m, shape, H200_SMS) for m in range(1, 8193, 37)} <= set(configs)
    band = fs.configs_for(shape, 1000, 3000, H200_SMS)  # a band kernel's batches: what they select
    assert set(band) == {fs.tile_config(m, shape, H200_SMS) for m in range(1000, 3001)} and min(band.values()) == 1000


def test_serving_max_tokens_from_sglang_server_args():
    import sglang.srt.layers.quantization.fp8  # noqa: F401 - SGLang's module first: its patch imports quant_methods

    from sglang_mxfp8.sglang.quant_methods import serving_max_tokens

    set_server_args(chunked_prefill_size=8192, max_prefill_tokens=16384, cuda_graph_max_bs=128)
    assert serving_max_tokens() == 8192
    set_server_args(chunked_prefill_size=-1, max_prefill_tokens=16384, cuda_graph_max_bs=128)
    assert serving_max_tokens() == 16384
    set_server_args(chunked_prefill_size=64, max_prefill_tokens=16384, cuda_graph_max_bs=256)
    assert serving_max_tokens() == 256


def _flashinfer_deep_gemm():
    from flashinfer.jit import env as jit_env

    return Path(jit_env.FLASHINFER_CSRC_DIR) / "nv_internal" / "tensorrt_llm" / "deep_gemm"


def _cpp_function(source: str, signature: str, closing: str = "\n}\n") -> str:
    """The text of one C++ function of a FlashInfer header, from its signature to ``closing`` (its last lines)."""
    start = source.index(signature)
    return source[start:source.index(closing, start) + len(closing)]


HARNESS = r"""
#include <algorithm>
#include <climits>
#include <cstdint>
#include <iostream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>
namespace deep_gemm {
%(enum)s
namespace jit {
using GemmConfig = std::tuple<int, int, int, int, int>;
%(to_string)s
%(jit_utils)s
%(generate)s
}  // namespace jit
}  // namespace deep_gemm
// generate N K BLOCK_M BLOCK_N GROUPS STAGES MULTICAST GEMM_TYPE SWAP_AB: FlashInfer's kernel source
// best M N K GROUPS SMS SWAP_AB: FlashInfer's get_best_gemm_config, as "block_m block_n stages multicast"
int main(int argc, char** argv) {
  auto u = [&](int i) { return static_cast<uint32_t>(std::stoul(argv[i])); };
  using deep_gemm::GemmType;
  if (std::string(argv[1]) == "best") {
    auto [bm, bn, st, mc, smem] = deep_gemm::jit::get_best_gemm_config(u(2), u(3), u(4), u(5), u(6), false,
                                                                       std::string(argv[7]) == "1");
    std::cout << bm << " " << bn << " " << st << " " << mc << "\n";
    return 0;
  }
  GemmType type = GemmType::Normal;
  for (GemmType t : {GemmType::Normal, GemmType::GroupedWithOffset})
    if (deep_gemm::jit::gemm_type_to_string(t) == argv[9]) type = t;
  std::cout << deep_gemm::jit::generateKernel(u(2), u(3), u(4), u(5), 128, u(6), u(7), u(8), type,
                                              std::string(argv[10]) == "1");
}
"""


@pytest.fixture(scope="module")
def flashinfer_jit_functions(tmp_path_factory):
    """FlashInfer's generateKernel, gemm_type_to_string, get_smem_size, is_tma_multicast_legal and
    get_best_gemm_config, cut from the installed headers and compiled with the host C++ compiler: a program that
    prints a kernel's source or the tile config FlashInfer picks."""
    dg = _flashinfer_deep_gemm()
    compiler, jit_utils, scheduler = ((dg / f).read_text() for f in ("compiler.cuh", "jit_utils.cuh", "scheduler.cuh"))
    for rel, known in fs.RESTATED_SOURCES.items():  # the files compared here and in the tests below
        assert hashlib.sha256((dg.parent / rel).read_bytes()).hexdigest() in known, rel
    helpers = jit_utils[jit_utils.index("inline int div_up(int a, int b)"):]
    helpers = helpers[:helpers.rindex("}  // namespace deep_gemm::jit")]
    work = tmp_path_factory.mktemp("fi_jit")
    (work / "harness.cpp").write_text(HARNESS % dict(
        enum=next(line for line in scheduler.splitlines() if line.startswith("enum class GemmType")),
        to_string=_cpp_function(jit_utils, "inline std::string gemm_type_to_string("),
        jit_utils=helpers,
        generate=_cpp_function(compiler, "inline std::string generateKernel(", "\n  return code;\n}\n")))
    cxx = shutil.which("g++") or shutil.which("c++")
    assert cxx, "a host C++ compiler is needed to run FlashInfer's kernel generator"
    build = subprocess.run([cxx, "-std=c++17", "-o", str(work / "fi_jit"), str(work / "harness.cpp")],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-2000:]

    def run(*args) -> str:
        return subprocess.run(
            [str(work / "fi_jit"), *map(str, args)], capture_output=True, text=True, check=True
        ).stdout

    return run


def test_kernel_source_is_flashinfers_own_generator_output(flashinfer_jit_functions):
    """FlashInfer's own generateKernel prints the same kernel source as ours for swap-AB and normal configs,
    multicast 1 and 2, a dense GEMM and the fused MoE's grouped GEMMs; the header is one whose hash the package
    lists as restated."""
    shapes = [fs.GemmShape(5120, 2048), fs.GemmShape(2048, 4096), fs.GemmShape(2048, 768), fs.GemmShape(4096, 14336),
              *fs.moe_gemm_shapes(128, 2048, 768)]
    seen = set()
    for shape in shapes:
        configs = fs.configs_for(shape, 1, 8192, 132)
        for cfg in list(configs)[:: max(1, len(configs) // 4)]:
            seen.add((shape.gemm_type, cfg.swap_ab, cfg.multicast))
            theirs = flashinfer_jit_functions("generate", shape.n, shape.k, cfg.block_m, cfg.block_n, shape.groups,
                                              cfg.stages, cfg.multicast, shape.gemm_type, int(cfg.swap_ab))
            assert fs.kernel_source(shape, cfg) == theirs, (shape, cfg)
    assert seen >= {(fs.NORMAL, True, 1), (fs.NORMAL, False, 1), (fs.NORMAL, False, 2), (fs.GROUPED, True, 1),
                    (fs.GROUPED, False, 1)}


@pytest.mark.parametrize("swap_ab", [False, True])
def test_tile_choice_is_flashinfers_get_best_gemm_config(flashinfer_jit_functions, swap_ab):
    """Our restatement of DeepGEMM's tile heuristic against FlashInfer's compiled get_best_gemm_config, on random
    problem sizes (one group and 8-256 groups, 78 and 132 SMs), plus the sizes the served models run."""
    import random

    rng = random.Random()
    cases = [(m, n, k, g, 132) for m in (1, 16, 31, 64, 65, 1024, 8192) for n, k in ((1536, 2048), (2048, 768))
             for g in (1, 128)]
    cases += [(rng.randint(1, 16384), 64 * rng.randint(1, 256), 128 * rng.randint(1, 64), rng.choice((1, 8, 60, 256)),
               rng.choice((78, 132))) for _ in range(60)]
    for m, n, k, groups, sms in cases:
        if swap_ab:
            m, n = n, min(m, 63)
        theirs = flashinfer_jit_functions("best", m, n, k, groups, sms, int(swap_ab)).split()
        ours = fs._best(m, n, k, sms, swap_ab, groups)
        assert [ours.block_m, ours.block_n, ours.stages, ours.multicast] == list(map(int, theirs)), (
            m,
            n,
            k,
            groups,
            sms,
        )


def test_moe_configs_follow_the_batch_size(flashinfer_jit_functions):
    """The fused MoE's grouped GEMMs: swap-AB below 32 tokens (64 on 78-SM parts), the expert count in every wave
    count and never multicast; each config listed with the smallest batch that selects it."""
    fc1, fc2 = fs.moe_gemm_shapes(128, 2048, 768)
    assert fc1 == fs.GemmShape(1536, 2048, 128, fs.GROUPED) and fc2 == fs.GemmShape(2048, 768, 128, fs.GROUPED)
    assert fs.tile_config(31, fc1, 132).swap_ab and not fs.tile_config(32, fc1, 132).swap_ab
    assert fs.tile_config(63, fc1, 78).swap_ab and not fs.tile_config(64, fc1, 78).swap_ab
    assert (
        fs.jit_kernel_name(fc2, fs.tile_config(1, fc2, 132))
        == "gemm_swapAB_2048_768_128_16_128_128_8128_8_1_GroupedWithOffset"
    )
    for shape in (fc1, fc2):
        configs = fs.configs_for(shape, 1, 8192, 132)
        assert 2 <= len(configs) <= 16 and all(c.multicast == 1 for c in configs)
        for cfg, m in configs.items():
            assert fs.tile_config(m, shape, 132) == cfg
            assert all(fs.tile_config(j, shape, 132) != cfg for j in range(1, m))


def test_nvcc_command_carries_flashinfers_flags():
    """Every flag of our nvcc command is one FlashInfer's Compiler::build passes with nvcc, and the reverse."""
    build = _cpp_function((_flashinfer_deep_gemm() / "compiler.cuh").read_text(), "  Runtime* build(", "\n  }\n")
    nvcc_part = build[
        build.index("std::vector<std::string> flags = {") : build.index("std::vector<std::string> cxxFlags")
    ]
    cxx_part = build[build.index("cxxFlags = {"):build.index("};", build.index("cxxFlags = {"))]
    theirs = re.findall(r'"([^"]*)"', nvcc_part) + [
        "--compiler-options=" + ",".join(re.findall(r'"([^"]*)"', cxx_part))
    ]
    ours = fs.nvcc_command(Path("kernel.cu"), Path("out.cubin"))
    assert ours[1:4] == ["kernel.cu", "-o", "out.cubin"]
    assert sorted(ours[4:-1]) == sorted(theirs) and ours[-1] == f"-I{_flashinfer_deep_gemm().parent}"
    assert "--gpu-architecture=sm_90a" in theirs and "-cubin" in theirs


@pytest.mark.skipif(shutil.which(fs.nvcc_compiler()) is None, reason="needs nvcc (CUDA toolkit) on this machine")
def test_compile_tile_configs_writes_each_cubin_where_flashinfer_reads_it(tmp_path, monkeypatch):
    """Two configs compiled by concurrent nvcc processes into $TRTLLM_DG_CACHE_DIR/cache/<FlashInfer's kernel
    name>/nvcc_kernel.cubin; a second call finds them; a failing nvcc names the kernel in one line."""
    monkeypatch.setenv("TRTLLM_DG_CACHE_DIR", str(tmp_path))
    cfgs = [fs.tile_config(1, fs.GemmShape(512, 256), 132), fs.tile_config(64, fs.GemmShape(512, 256), 132)]
    assert cfgs[0] != cfgs[1]
    shape = fs.GemmShape(512, 256)
    assert fs.compile_tile_configs(shape, cfgs, progress=False) == 2
    for cfg in cfgs:
        cubin = tmp_path / "cache" / fs.jit_kernel_name(shape, cfg) / "nvcc_kernel.cubin"
        data = cubin.read_bytes()
        assert data[:4] == b"\x7fELF" and (b"fp8_gemm_kernel_swapAB" if cfg.swap_ab else b"fp8_gemm_kernel") in data
    assert fs.compile_tile_configs(shape, cfgs, progress=False) == 0
    assert not [p for p in (tmp_path / "tmp").iterdir() if p.is_dir()]  # work folders removed
    monkeypatch.setenv("TRTLLM_DG_NVCC_COMPILER", shutil.which("false"))
    with pytest.raises(fs.KernelCompileError, match=r"nvcc failed on FlashInfer SM90 GEMM kernel gemm_512_256_"):
        fs.compile_tile_configs(shape, [fs.tile_config(4096, fs.GemmShape(512, 256), 132)], progress=False)


@pytest.fixture
def driver_stub(tmp_path, monkeypatch):
    """The CUDA driver's link stub a full toolkit keeps in lib64/stubs, which build's toolchain check looks for: this
    GPU-less machine's toolkit may lack it, and the prebuilds these tests run link nothing."""
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    (stubs / "libcuda.so").write_bytes(b"")
    monkeypatch.setenv("LIBRARY_PATH", str(stubs))


def test_build_command_compiles_ahead_what_the_first_server_start_would(tmp_path, monkeypatch, capsys, driver_stub):
    """``sglang-mxfp8 build --gpu h200 --model M`` on this GPU-less machine: each planned kernel's JIT module built
    once (FlashInfer's GEMM module for the dense layers; the Triton MoE has none), then, where nvcc is installed, the
    kernels of every dense layer shape for batches up to --max-tokens, exactly the ones a server's load would run,
    written into FlashInfer's cache; a second run finds them all. Wrong flags and no GPU are one line each."""
    import torch

    from sglang_mxfp8.cli import main as cli
    from sglang_mxfp8.bench.tiny_model import write_qwen3_moe
    from sglang_mxfp8.format.convert import convert
    from sglang_mxfp8.kernels.linear.flashinfer_sm90 import FlashInferSm90

    mx = tmp_path / "mx"
    convert(write_qwen3_moe(tmp_path / "bf16"), mx, progress=False)
    monkeypatch.setenv("TRTLLM_DG_CACHE_DIR", str(tmp_path / "dg"))
    monkeypatch.setenv("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    monkeypatch.setenv("SGLANG_MXFP8_DISABLED_KERNELS", "moe_gemv,triton_w8a8_moe")  # read fresh: conftest
    built = []
    monkeypatch.setattr(FlashInferSm90, "prebuild", lambda self: built.append(self.name))
    args = ["build", "--gpu", "h200", "--fp8-gemm-backend", "flashinfer_trtllm", "--moe-runner-backend", "triton",
            "--max-tokens", "48"]
    if not torch.cuda.is_available():
        assert cli(args[:1]) == 2 and "name the server's with --gpu h100 or --gpu h200" in capsys.readouterr().err
    assert (
        cli(args[:1] + ["--gpu", "b200"]) == 0 and "nothing to compile ahead for NVIDIA B200" in capsys.readouterr().out
    )
    assert cli(args[:4] + ["flashinfer_cutlass"]) == 1
    assert capsys.readouterr().err.strip().endswith("valid choices on this GPU: auto, triton, flashinfer_trtllm")
    assert cli(args) == 0 and built == ["flashinfer_sm90"]  # no --model: the flags' modules alone
    capsys.readouterr()
    if shutil.which(fs.nvcc_compiler()) is None:
        return  # the kernels need nvcc (CUDA toolkit); the modules' part is checked above
    assert cli(args + ["--model", str(mx)]) == 0 and built == ["flashinfer_sm90"] * 2
    # qkv, o of the tiny model
    expected = {fs.jit_kernel_name(fs.GemmShape(n, k), cfg) for n, k in ((512, 256), (256, 256))
                for cfg in fs.configs_for(fs.GemmShape(n, k), 1, 48, 132)}
    assert {p.name for p in (tmp_path / "dg" / "cache").iterdir()} == expected
    assert f"{len(expected)} kernels compiled for batches up to 48 tokens on 132 SMs" in capsys.readouterr().out
    assert cli(args + ["--model", str(mx)]) == 0 and "0 kernels compiled" in capsys.readouterr().out


@pytest.mark.skipif(shutil.which(fs.nvcc_compiler()) is None, reason="needs nvcc (CUDA toolkit) on this machine")
def test_build_command_compiles_the_fused_moe_grouped_kernels(tmp_path, monkeypatch, capsys, driver_stub):
    """``sglang-mxfp8 build --moe-runner-backend flashinfer_cutlass --model M`` with FlashInfer's fused MoE alone
    (its band kernels disabled): besides the dense layers', the grouped kernels FlashInfer's FP8 block-scale fused MoE
    compiles on first use (FC1 [2I, H] and FC2 [H, I] per expert, GroupedWithOffset) for every batch up to
    --max-tokens, named as FlashInfer's JIT names them and real sm_90a cubins. With its bands, the fused MoE serves
    no batch of this model past one token, and neither its module nor those kernels are built."""
    from sglang_mxfp8.cli import main as cli
    from sglang_mxfp8.bench.tiny_model import write_qwen3_moe
    from sglang_mxfp8.format.convert import convert
    from sglang_mxfp8.kernels.linear.flashinfer_sm90 import FlashInferSm90
    from sglang_mxfp8.kernels.moe.flashinfer_cutlass import FlashInferCutlassSm90MoE

    mx = tmp_path / "mx"
    convert(write_qwen3_moe(tmp_path / "bf16"), mx, progress=False)  # 8 experts, hidden 256, intermediate 128
    monkeypatch.setenv("TRTLLM_DG_CACHE_DIR", str(tmp_path / "dg"))
    monkeypatch.setenv("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    monkeypatch.setenv("SGLANG_MXFP8_DISABLED_KERNELS", "moe_gemv,triton_w8a8_moe")  # read fresh: conftest
    built = []
    for kernel in (FlashInferSm90, FlashInferCutlassSm90MoE):  # the JIT modules: tests/test_jit_fused_moe.py
        monkeypatch.setattr(kernel, "prebuild", lambda self: built.append(self.name))
    args = ["build", "--gpu", "h200", "--fp8-gemm-backend", "flashinfer_trtllm", "--moe-runner-backend",
            "flashinfer_cutlass", "--max-tokens", "40", "--model", str(mx)]
    assert cli(args) == 0 and built == ["flashinfer_sm90", "flashinfer_cutlass_moe_sm90"]
    grouped = {p.name for p in (tmp_path / "dg" / "cache").iterdir() if p.name.endswith("_GroupedWithOffset")}
    assert grouped == {"gemm_swapAB_256_256_128_16_128_8_88_8_1_GroupedWithOffset",  # FC1, 1-31 tokens
                       "gemm_256_256_64_16_128_8_88_8_1_GroupedWithOffset",  # FC1, 32-40
                       "gemm_swapAB_256_128_128_16_128_8_88_8_1_GroupedWithOffset",  # FC2
                       "gemm_256_128_64_16_128_8_88_8_1_GroupedWithOffset"}
    for name in grouped:
        data = (tmp_path / "dg" / "cache" / name / "nvcc_kernel.cubin").read_bytes()
        assert data[:4] == b"\x7fELF" and b"GroupedWithOffset" in data
    assert cli(args) == 0 and "0 kernels compiled" in capsys.readouterr().out


def test_a_flashinfer_whose_restated_sources_differ_compiles_its_kernels_itself(tmp_path, monkeypatch, caplog):
    """One restated file changed (here the tile heuristic's): no concurrent compile, the file named in one line, and a
    layer's load leaves the kernels to FlashInfer's own JIT with one warning instead of failing."""
    import logging

    from sglang_mxfp8.kernels.precompile import compile_before_flashinfer

    copy = tmp_path / "tensorrt_llm"
    for rel in fs.RESTATED_SOURCES:
        (copy / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(_flashinfer_deep_gemm().parent / rel, copy / rel)
    monkeypatch.setattr(fs, "_deep_gemm_dir", lambda: copy)
    fs.concurrent_compile_unsupported.cache_clear()
    monkeypatch.setattr(fs, "nvcc_compiler", lambda: shutil.which("true"))
    try:
        assert fs.concurrent_compile_unsupported() is None
        fs.concurrent_compile_unsupported.cache_clear()
        with open(copy / "deep_gemm" / "jit_utils.cuh", "a") as f:
            f.write("// a newer heuristic\n")
        why = fs.concurrent_compile_unsupported()
        assert why.startswith(
            f"{copy / 'deep_gemm' / 'jit_utils.cuh'} is not a version whose logic sglang_mxfp8 restates"
        )
        shape = fs.GemmShape(512, 256)
        with pytest.raises(fs.KernelCompileError, match="jit_utils.cuh is not a version"):
            fs.compile_tile_configs(shape, [fs.tile_config(1, fs.GemmShape(512, 256), 132)], progress=False)
        with caplog.at_level(logging.WARNING):
            compile_before_flashinfer(shape, [fs.tile_config(1, fs.GemmShape(512, 256), 132)])
        warned = [r.getMessage() for r in caplog.records if "not compiled concurrently" in r.getMessage()]
        assert len(warned) == 1 and "FlashInfer compiles them itself" in warned[0]
    finally:
        fs.concurrent_compile_unsupported.cache_clear()
