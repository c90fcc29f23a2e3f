"""Host side of FlashInfer's SM90 block-scale GEMM kernels (FlashInfer 0.6.7.post3 and 0.7.2): the dense
``fp8_blockscale_gemm_sm90`` and the two grouped GEMMs of ``cutlass_fused_moe`` in its FP8 block-scale mode.

Both compile one kernel per tile config the first time the config is used: FlashInfer's DeepGEMM JIT
(csrc/nv_internal/tensorrt_llm/deep_gemm/compiler.cuh) runs nvcc on a generated source and keeps the cubin in
its cache folder ($TRTLLM_DG_CACHE_DIR/cache, else ~/.tensorrt_llm/cache), where later processes read it back.
The config follows from M (the tokens in the batch) by DeepGEMM's wave heuristic: a prefill batch whose M selects a
config not compiled yet stalls the server while it compiles (3 s stalls seen on the H200).
:func:`configs_for` lists every config a layer shape can select up to the largest batch the server runs, so the
kernel runs each once at load; :func:`compile_tile_configs` compiles those not in the cache yet with concurrent
nvcc processes first (FlashInfer compiles one after another), writing each where FlashInfer's JIT looks for it.

The heuristic is FlashInfer's ``gemm_dispatch`` and ``grouped_gemm_dispatch`` (csrc/nv_internal/tensorrt_llm/kernels/
cutlass_kernels/fp8_blockscale_gemm/fp8_blockscale_gemm_kernel.cuh) and ``get_best_gemm_config``
(csrc/nv_internal/tensorrt_llm/deep_gemm/jit_utils.cuh), restated here.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import MappingProxyType
from typing import Dict, Iterable, List, Mapping, NamedTuple, Optional, Tuple

SM90_SMEM_BYTES = 232448
BLOCK_K = 128
SWAP_AB_BELOW_M = 32  # smaller M runs the swap-AB kernel (weight rows as the "M" side)


class TileConfig(NamedTuple):
    swap_ab: bool
    block_m: int
    block_n: int
    stages: int
    multicast: int


NORMAL = "Normal"  # fp8_blockscale_gemm_sm90: one [M, K] x [N, K]^T product
GROUPED = "GroupedWithOffset"  # the FP8 block-scale fused MoE: one product per expert, rows at per-expert offsets


class GemmShape(NamedTuple):
    """What FlashInfer's JIT keys a kernel family by besides its tile config: the [N, K] weight of each group, the
    groups (1 for a dense layer; the experts of a fused MoE's grouped GEMMs) and the GEMM type."""
    n: int
    k: int
    groups: int = 1
    gemm_type: str = NORMAL


def moe_gemm_shapes(experts: int, hidden: int, intermediate: int) -> Tuple[GemmShape, GemmShape]:
    """The fused MoE's two grouped GEMMs (cutlass_fused_moe with use_deepseek_fp8_block_scale, SiLU-gated): FC1
    [2I, H] per expert, FC2 [H, I] per expert."""
    return GemmShape(2 * intermediate, hidden, experts, GROUPED), GemmShape(hidden, intermediate, experts, GROUPED)


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _smem_bytes(stages: int, k: int, block_m: int, block_n: int, swap_ab: bool) -> int:
    scales_k = _cdiv(k, BLOCK_K) * 4
    if not swap_ab:
        per_stage = block_m * BLOCK_K + block_m * 4 + block_n * BLOCK_K
        scales_b = _cdiv(scales_k * (1 if BLOCK_K % block_n == 0 else 2), 8) * 8
        return block_m * block_n * 2 + stages * per_stage + scales_b + stages * 16
    per_stage = block_m * BLOCK_K + _cdiv(block_n * 4, 128) * 128 + block_n * BLOCK_K
    return block_n * block_m * 2 + stages * per_stage + _cdiv(scales_k, 8) * 8 + stages * 16


def _best(m: int, n: int, k: int, num_sms: int, swap_ab: bool, groups: int = 1) -> TileConfig:
    """DeepGEMM's choice (get_best_gemm_config) for ``groups`` [m x k] @ [k x n] problems: fewest waves, then the
    fullest last wave; TMA multicast only for one group."""
    block_m = 64 if m <= 64 else 128

    def blocks(bn):
        return _cdiv(m, block_m) * _cdiv(n, bn) * groups

    def waves(bn):
        return _cdiv(blocks(bn), num_sms)

    def last_wave(bn):
        return blocks(bn) % num_sms or num_sms

    best = 16
    for bn in range(24, 129, 8):  # 16 is the first candidate; later ones replace it only when strictly better
        if waves(bn) < waves(best) or (waves(bn) == waves(best) and last_wave(bn) > last_wave(best)):
            best = bn
    stages = next(s for s in ((6, 5, 4) if BLOCK_K % best else (8, 7, 6, 5, 4))
                  if _smem_bytes(s, k, block_m, best, swap_ab) <= SM90_SMEM_BYTES)
    wide, other, tile = (n, m, block_m) if swap_ab else (m, n, best)
    multicast = 2 if groups == 1 and wide >= 1024 and other % (tile * 2) == 0 and num_sms % 2 == 0 else 1
    return TileConfig(swap_ab, block_m, best, stages, multicast)


def tile_config(m: int, shape: GemmShape, num_sms: int) -> TileConfig:
    """The kernel FlashInfer compiles and runs for ``shape`` and a batch of ``m`` tokens (gemm_dispatch,
    grouped_gemm_dispatch): swap-AB (weight rows as the "M" side) below 32 tokens, below 64 for the grouped GEMMs
    on 78-SM parts. The fused MoE's runner sets DeepGEMM's expected M to the batch's tokens
    (CutlassFp8BlockScaleGemmRunner::getWorkspaceSize, called on every forward)."""
    swap_below = 64 if shape.gemm_type == GROUPED and num_sms == 78 else SWAP_AB_BELOW_M
    if m >= swap_below:
        return _best(m, shape.n, shape.k, num_sms, swap_ab=False, groups=shape.groups)
    return _best(shape.n, m, shape.k, num_sms, swap_ab=True, groups=shape.groups)


def jit_kernel_name(shape: GemmShape, cfg: TileConfig) -> str:
    """The name FlashInfer's JIT gives the compiled kernel (its cache key; with TRTLLM_DG_JIT_DUMP_CUBIN=1
    also a folder under $TRTLLM_DG_CACHE_DIR/cache)."""
    g, st = shape.groups, cfg.stages
    return (f"{'gemm_swapAB_' if cfg.swap_ab else 'gemm_'}{shape.n}_{shape.k}_{cfg.block_m}_{cfg.block_n}_{BLOCK_K}_"
            f"{g}_{st}{g}_{st}_{cfg.multicast}_{shape.gemm_type}")


@functools.lru_cache(maxsize=None)
def configs_for(shape: GemmShape, min_m: int, max_m: int, num_sms: int) -> Mapping[TileConfig, int]:
    """{config: the smallest batch in min_m..max_m that selects it} (read-only; once per shape, band and process:
    every layer of a shape asks, and the walk takes 0.2 s at 16384 tokens)."""
    seen: Dict[TileConfig, int] = {}
    for m in range(min_m, max_m + 1):
        seen.setdefault(tile_config(m, shape, num_sms), m)
    return MappingProxyType(seen)


# -- concurrent compilation into FlashInfer's DeepGEMM JIT cache ------------------------------------------------------
# sha256 of FlashInfer's sources whose logic this module restates, per file: the kernel generator, nvcc flags and cache
# layout (compiler.cuh), the tile heuristic (jit_utils.cuh), the swap-AB thresholds of the dense and grouped dispatch
# (fp8_blockscale_gemm_kernel.cuh) and the fused MoE's expected M (fp8_blockscale_gemm.cu).
# tests/test_jit_tile_configs.py
# compiles FlashInfer's own generateKernel and get_best_gemm_config and compares. FlashInfer 0.6.7.post3 and 0.7.2 ship
# the same files. Any other file: FlashInfer compiles its kernels itself, as before.
RESTATED_SOURCES = MappingProxyType({
    "deep_gemm/compiler.cuh": frozenset({"e8a19b7954e44be0e9d7bafaca0448b60ce8f56bf39765903d5935957b0716f7"}),
    "deep_gemm/jit_utils.cuh": frozenset({"fc809669f1098ae239f2368d5aa87f8dac29d419acfd863b65aae7c31fe9e2f4"}),
    "kernels/cutlass_kernels/fp8_blockscale_gemm/fp8_blockscale_gemm_kernel.cuh":
        frozenset({"b0633a435cd15e29ac420d91d41e3084eef816ceb39f1c861742cbb4049615ec"}),
    "kernels/cutlass_kernels/fp8_blockscale_gemm/fp8_blockscale_gemm.cu":
        frozenset({"41262d1099c58db16ba56d7469e142f49139b42bbc44428a7a15ba6f4e499486"}),
})
KERNEL_FILE = "nvcc_kernel.cubin"  # FlashInfer's kJitUseNvcc is always true in these releases
_NUM_TMA_THREADS = _NUM_MATH_THREADS_PER_GROUP = 128


def _deep_gemm_dir() -> Path:
    from flashinfer.jit import env as jit_env

    return Path(jit_env.FLASHINFER_CSRC_DIR) / "nv_internal" / "tensorrt_llm"


@functools.lru_cache(maxsize=1)
def concurrent_compile_unsupported() -> Optional[str]:
    """Why :func:`compile_tile_configs` cannot stand in for FlashInfer's own compiler here, or None."""
    for rel, known in RESTATED_SOURCES.items():
        try:
            source = _deep_gemm_dir() / rel
            digest = hashlib.sha256(source.read_bytes()).hexdigest()
        except (ImportError, OSError) as e:
            return f"FlashInfer's DeepGEMM JIT source is not readable ({e})"
        if digest not in known:
            return f"{source} is not a version whose logic sglang_mxfp8 restates (sha256 {digest[:12]})"
    if shutil.which(nvcc_compiler()) is None:
        return f"no nvcc at {nvcc_compiler()}"
    return None


def jit_user_dir() -> Path:
    """FlashInfer's DeepGEMM JIT folder (getDefaultUserDir): $TRTLLM_DG_CACHE_DIR, else ~/.tensorrt_llm."""
    if os.environ.get("TRTLLM_DG_CACHE_DIR"):
        return Path(os.environ["TRTLLM_DG_CACHE_DIR"])
    if os.environ.get("HOME"):
        return Path(os.environ["HOME"]) / ".tensorrt_llm"
    return Path(tempfile.gettempdir()) / "tensorrt_llm"


def nvcc_compiler() -> str:
    """The nvcc FlashInfer's JIT runs (getNvccCompiler): $TRTLLM_DG_NVCC_COMPILER, else $CUDA_HOME/bin/nvcc, else
    nvcc."""
    if os.environ.get("TRTLLM_DG_NVCC_COMPILER"):
        return os.environ["TRTLLM_DG_NVCC_COMPILER"]
    if os.environ.get("CUDA_HOME"):
        return str(Path(os.environ["CUDA_HOME"]) / "bin" / "nvcc")
    return "nvcc"


def kernel_source(shape: GemmShape, cfg: TileConfig) -> str:
    """FlashInfer's generateKernel(n, k, block_m, block_n, 128, groups, stages, multicast, gemm_type, swap_ab)."""
    scheduler, kernel, scheduler_input = (
        ("SchedulerSelectorSwapAB", "fp8_gemm_kernel_swapAB", f"{shape.gemm_type}SchedulerInputSwapAB") if cfg.swap_ab
        else ("SchedulerSelector", "fp8_gemm_kernel", f"{shape.gemm_type}SchedulerInput"))
    tile = f"{shape.n}, {shape.k}, {cfg.block_m}, {cfg.block_n}, {BLOCK_K}, {shape.groups}"
    threads = f"{_NUM_TMA_THREADS}, {_NUM_MATH_THREADS_PER_GROUP}"
    return _KERNEL_TEMPLATE.format(
        scheduler=f"{scheduler}<GemmType::{shape.gemm_type}, {tile}, {cfg.multicast}>::type",
        kernel=f"{kernel}<{tile}, {cfg.stages}, {threads}, {cfg.multicast}, SchedulerType, {scheduler_input}>")


_KERNEL_TEMPLATE = """
#ifdef __CUDACC_RTC__
#ifndef NVRTC_JIT_COMPILATION
#define NVRTC_JIT_COMPILATION
#endif

#include <deep_gemm/nvrtc_std.cuh>

#else

#include <string>
#include <cuda.h>

#endif

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <deep_gemm/nvrtc_cutlass.cuh>
#include <deep_gemm/fp8_gemm_impl.cuh>

using namespace deep_gemm;

using SchedulerType =
typename {scheduler};

__global__ void dummy_kernel() {{
  void *ptr = (void *)&{kernel};
}}
"""


def nvcc_command(source: Path, cubin: Path) -> List[str]:
    """FlashInfer's nvcc command line for one kernel (Compiler::build with kJitUseNvcc), include folder as FlashInfer
    sets it (set_deepgemm_jit_include_dirs)."""
    return [nvcc_compiler(), str(source), "-o", str(cubin), "-std=c++17", "--gpu-architecture=sm_90a",
            "--ptxas-options=-allow-expensive-optimizations=true", "--ptxas-options=--register-usage-level=10",
            "--diag-suppress=161,174,177,940", "-D__FORCE_INCLUDE_CUDA_FP16_HPP_FROM_FP16_H__=1",
            "-D__FORCE_INCLUDE_CUDA_BF16_HPP_FROM_BF16_H__=1", "-O3", "-cubin", "--expt-relaxed-constexpr",
            "--expt-extended-lambda", "--compiler-options=-fPIC,-O3,-Wno-deprecated-declarations,-Wno-abi",
            f"-I{_deep_gemm_dir()}"]


def describe(shape: GemmShape) -> str:
    return f"[{shape.n} x {shape.k}]" + (f" x {shape.groups} experts" if shape.gemm_type == GROUPED else "")


class KernelCompileError(RuntimeError):
    pass


@contextlib.contextmanager
def _exclusive(lock: Path):
    """One process at a time per kernel (tensor-parallel ranks load the same layers at once); released when the
    process dies."""
    with open(lock, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _compile_one(shape: GemmShape, cfg: TileConfig, cache: Path, tmp: Path) -> bool:
    name = jit_kernel_name(shape, cfg)
    cubin = cache / name / KERNEL_FILE
    if cubin.exists():
        return False
    with _exclusive(tmp / f"{name}.sglang_mxfp8.lock"):
        if cubin.exists():  # another rank compiled it while this one waited
            return False
        work = Path(tempfile.mkdtemp(prefix=f"{name}_", dir=tmp))
        try:
            (work / "kernel.cu").write_text(kernel_source(shape, cfg))
            done = subprocess.run(nvcc_command(work / "kernel.cu", work / KERNEL_FILE), capture_output=True, text=True)
            if done.returncode != 0 or not (work / KERNEL_FILE).exists():
                raise KernelCompileError(f"nvcc failed on FlashInfer SM90 GEMM kernel {name} (exit {done.returncode}): "
                                         + " ".join((done.stderr or done.stdout).split())[:300])
            (cache / name).mkdir(parents=True, exist_ok=True)
            os.replace(work / KERNEL_FILE, cubin)  # atomic: FlashInfer's JIT sees the whole cubin or none
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return True


def compile_tile_configs(shape: GemmShape, configs: Iterable[TileConfig], jobs: Optional[int] = None,
                         progress: bool = True) -> int:
    """Compile, with up to ``jobs`` concurrent nvcc processes (default: every CPU), FlashInfer's SM90 block-scale GEMM
    kernels of ``shape`` at these tile configs that its cache does not hold yet, into the cache path its JIT reads
    them back from; returns how many were compiled."""
    why = concurrent_compile_unsupported()
    if why:
        raise KernelCompileError(why)
    user = jit_user_dir()
    cache, tmp = user / "cache", user / "tmp"
    cache.mkdir(parents=True, exist_ok=True)
    tmp.mkdir(parents=True, exist_ok=True)
    todo = [cfg for cfg in dict.fromkeys(configs) if not (cache / jit_kernel_name(shape, cfg) / KERNEL_FILE).exists()]
    if not todo:
        return 0
    from tqdm import tqdm

    with ThreadPoolExecutor(max_workers=max(1, min(jobs or os.cpu_count() or 1, len(todo)))) as pool:
        futures = [pool.submit(_compile_one, shape, cfg, cache, tmp) for cfg in todo]
        compiled = 0
        for fut in tqdm(
            futures,
            desc=f"sglang_mxfp8: FlashInfer SM90 GEMM {describe(shape)} kernels (nvcc, {len(todo)})",
            leave=False,
            disable=not progress,
        ):
            compiled += fut.result()
    return compiled
