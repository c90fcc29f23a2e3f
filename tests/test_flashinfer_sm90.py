"""The tile-config enumeration behind precompiling FlashInfer's SM90 block-scale GEMM.

The facts checked against: the kernels an H200 profile of the served Qwen3-30B-A3B-shaped model ran
at batch 1 (benchmarks/RESULTS.md, e2e): ``deep_gemm::fp8_gemm_kernel_swapAB<2048, 4096, 128, 16, 128,
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
from sglang_mxfp8.ops import flashinfer_sm90 as fs

H200_SMS = 132


@pytest.mark.parametrize("n,k", [(2048, 4096), (5120, 2048)])
def test_batch_one_config_matches_the_h200_profile(n, k):
    cfg = fs.tile_config(1, n, k, H200_SMS)
    assert cfg == fs.TileConfig(swap_ab=True, block_m=128, block_n=16, stages=8, multicast=1)
    assert fs.jit_kernel_name(n, k, cfg) == f"gemm_swapAB_{n}_{k}_128_16_128_1_81_8_1_Normal"


def test_swap_ab_below_32_tokens_and_multicast_from_1024():
    assert fs.tile_config(31, 5120, 2048, H200_SMS).swap_ab and not fs.tile_config(32, 5120, 2048, H200_SMS).swap_ab
    assert fs.tile_config(1023, 5120, 2048, H200_SMS).multicast == 1
    big = fs.tile_config(8192, 5120, 2048, H200_SMS)
    assert big.block_m == 128 and big.multicast == (2 if 5120 % (big.block_n * 2) == 0 else 1)
    assert fs.tile_config(64, 5120, 2048, H200_SMS).block_m == 64 and fs.tile_config(65, 5120, 2048, H200_SMS).block_m == 128


@pytest.mark.parametrize("n,k", [(5120, 2048), (2048, 4096), (14336, 4096), (4096, 14336)])
def test_every_config_up_to_max_m_has_its_smallest_m(n, k):
    configs = fs.configs_up_to(n, k, 8192, H200_SMS)
    assert 4 <= len(configs) <= 32  # a handful of kernels to compile per shape, not one per M
    for cfg, m in configs.items():
        assert fs.tile_config(m, n, k, H200_SMS) == cfg
        assert all(fs.tile_config(j, n, k, H200_SMS) != cfg for j in range(max(1, m - 64), m))
        assert fs._smem_bytes(cfg.stages, k, cfg.block_m, cfg.block_n, cfg.swap_ab) <= fs.SM90_SMEM_BYTES
    assert {fs.tile_config(m, n, k, H200_SMS) for m in range(1, 8193, 37)} <= set(configs)


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
#include <cstdint>
#include <iostream>
#include <stdexcept>
#include <string>
namespace deep_gemm {
%(enum)s
namespace jit {
%(to_string)s
%(generate)s
}  // namespace jit
}  // namespace deep_gemm
int main(int argc, char** argv) {
  auto u = [&](int i) { return static_cast<uint32_t>(std::stoul(argv[i])); };
  std::cout << deep_gemm::jit::generateKernel(u(1), u(2), u(3), u(4), 128, 1, u(5), u(6),
                                              deep_gemm::GemmType::Normal, std::string(argv[7]) == "1");
}
"""


def test_kernel_source_is_flashinfers_own_generator_output(tmp_path):
    """FlashInfer's generateKernel and gemm_type_to_string, cut from the installed headers and compiled with the host
    C++ compiler, print the same kernel source as ours for swap-AB and normal configs, multicast 1 and 2; the header
    is one whose hash the package lists as restated."""
    dg = _flashinfer_deep_gemm()
    compiler, jit_utils, scheduler = ((dg / f).read_text() for f in ("compiler.cuh", "jit_utils.cuh", "scheduler.cuh"))
    assert hashlib.sha256((dg / "compiler.cuh").read_bytes()).hexdigest() in fs.RESTATED_COMPILER_CUH
    (tmp_path / "harness.cpp").write_text(HARNESS % dict(
        enum=next(line for line in scheduler.splitlines() if line.startswith("enum class GemmType")),
        to_string=_cpp_function(jit_utils, "inline std::string gemm_type_to_string("),
        generate=_cpp_function(compiler, "inline std::string generateKernel(", "\n  return code;\n}\n")))
    cxx = shutil.which("g++") or shutil.which("c++")
    assert cxx, "a host C++ compiler is needed to run FlashInfer's kernel generator"
    build = subprocess.run([cxx, "-std=c++17", "-o", str(tmp_path / "gen"), str(tmp_path / "harness.cpp")],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-2000:]
    cases = [(1, 5120, 2048), (16, 2048, 4096), (100, 5120, 2048), (4096, 2048, 768), (8192, 4096, 14336)]
    seen = set()
    for m, n, k in cases:
        cfg = fs.tile_config(m, n, k, 132)
        seen.add((cfg.swap_ab, cfg.multicast))
        theirs = subprocess.run([str(tmp_path / "gen"), str(n), str(k), str(cfg.block_m), str(cfg.block_n),
                                 str(cfg.stages), str(cfg.multicast), "1" if cfg.swap_ab else "0"],
                                capture_output=True, text=True, check=True).stdout
        assert fs.kernel_source(n, k, cfg) == theirs, (m, n, k, cfg)
    assert seen >= {(True, 1), (False, 1), (False, 2)}


def test_nvcc_command_carries_flashinfers_flags():
    """Every flag of our nvcc command is one FlashInfer's Compiler::build passes with nvcc, and the reverse."""
    build = _cpp_function((_flashinfer_deep_gemm() / "compiler.cuh").read_text(), "  Runtime* build(", "\n  }\n")
    nvcc_part = build[build.index("std::vector<std::string> flags = {"):build.index("std::vector<std::string> cxxFlags")]
    cxx_part = build[build.index("cxxFlags = {"):build.index("};", build.index("cxxFlags = {"))]
    theirs = re.findall(r'"([^"]*)"', nvcc_part) + ["--compiler-options=" + ",".join(re.findall(r'"([^"]*)"', cxx_part))]
    ours = fs.nvcc_command(Path("kernel.cu"), Path("out.cubin"))
    assert ours[1:4] == ["kernel.cu", "-o", "out.cubin"]
    assert sorted(ours[4:-1]) == sorted(theirs) and ours[-1] == f"-I{_flashinfer_deep_gemm().parent}"
    assert "--gpu-architecture=sm_90a" in theirs and "-cubin" in theirs


@pytest.mark.skipif(shutil.which(fs.nvcc_compiler()) is None, reason="needs nvcc (CUDA toolkit) on this machine")
def test_compile_tile_configs_writes_each_cubin_where_flashinfer_reads_it(tmp_path, monkeypatch):
    """Two configs compiled by concurrent nvcc processes into $TRTLLM_DG_CACHE_DIR/cache/<FlashInfer's kernel
    name>/nvcc_kernel.cubin; a second call finds them; a failing nvcc names the kernel in one line."""
    monkeypatch.setenv("TRTLLM_DG_CACHE_DIR", str(tmp_path))
    cfgs = [fs.tile_config(1, 512, 256, 132), fs.tile_config(64, 512, 256, 132)]
    assert cfgs[0] != cfgs[1]
    assert fs.compile_tile_configs(512, 256, cfgs, progress=False) == 2
    for cfg in cfgs:
        cubin = tmp_path / "cache" / fs.jit_kernel_name(512, 256, cfg) / "nvcc_kernel.cubin"
        data = cubin.read_bytes()
        assert data[:4] == b"\x7fELF" and (b"fp8_gemm_kernel_swapAB" if cfg.swap_ab else b"fp8_gemm_kernel") in data
    assert fs.compile_tile_configs(512, 256, cfgs, progress=False) == 0
    assert not [p for p in (tmp_path / "tmp").iterdir() if p.is_dir()]  # work folders removed
    monkeypatch.setenv("TRTLLM_DG_NVCC_COMPILER", shutil.which("false"))
    with pytest.raises(fs.KernelCompileError, match=r"nvcc failed on FlashInfer SM90 GEMM kernel gemm_512_256_"):
        fs.compile_tile_configs(512, 256, [fs.tile_config(4096, 512, 256, 132)], progress=False)


def test_build_command_compiles_ahead_what_the_first_server_start_would(tmp_path, monkeypatch, capsys):
    """``sglang-mxfp8 build --gpu h200 --model M`` on this GPU-less machine: each planned kernel's JIT module built
    once (FlashInfer's GEMM module for the dense layers; the Triton MoE has none), then, where nvcc is installed, the
    kernels of every dense layer shape for batches up to --max-tokens, exactly the ones a server's load would run,
    written into FlashInfer's cache; a second run finds them all. Wrong flags and no GPU are one line each."""
    import torch

    from sglang_mxfp8.cli import main as cli
    from sglang_mxfp8.cli.tiny_model import write_qwen3_moe
    from sglang_mxfp8.format.convert import convert
    from sglang_mxfp8.kernels.linear.flashinfer_sm90 import FlashInferSm90

    mx = tmp_path / "mx"
    convert(write_qwen3_moe(tmp_path / "bf16"), mx, progress=False)
    monkeypatch.setenv("TRTLLM_DG_CACHE_DIR", str(tmp_path / "dg"))
    monkeypatch.setenv("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    built = []
    monkeypatch.setattr(FlashInferSm90, "prebuild", lambda self: built.append(self.name))
    args = ["build", "--gpu", "h200", "--fp8-gemm-backend", "flashinfer_trtllm", "--moe-runner-backend", "triton",
            "--max-tokens", "48"]
    if not torch.cuda.is_available():
        assert cli(args[:1]) == 2 and "name the server's with --gpu h100 or --gpu h200" in capsys.readouterr().err
    assert cli(args[:1] + ["--gpu", "b200"]) == 0 and "nothing to compile ahead for NVIDIA B200" in capsys.readouterr().out
    assert cli(args[:4] + ["flashinfer_cutlass"]) == 1
    assert capsys.readouterr().err.strip().endswith("valid choices on this GPU: auto, triton, flashinfer_trtllm")
    assert cli(args) == 0 and built == ["flashinfer_sm90"]  # no --model: the flags' modules alone
    capsys.readouterr()
    if shutil.which(fs.nvcc_compiler()) is None:
        return  # the kernels need nvcc (CUDA toolkit); the modules' part is checked above
    assert cli(args + ["--model", str(mx)]) == 0 and built == ["flashinfer_sm90"] * 2
    expected = {fs.jit_kernel_name(n, k, cfg) for n, k in ((512, 256), (256, 256))  # qkv, o of the tiny model
                for cfg in fs.configs_up_to(n, k, 48, 132)}
    assert {p.name for p in (tmp_path / "dg" / "cache").iterdir()} == expected
    assert f"{len(expected)} kernels compiled for batches up to 48 tokens on 132 SMs" in capsys.readouterr().out
    assert cli(args + ["--model", str(mx)]) == 0 and "0 kernels compiled" in capsys.readouterr().out
