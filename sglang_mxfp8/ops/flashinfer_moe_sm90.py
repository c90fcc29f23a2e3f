"""FlashInfer's CUTLASS fused MoE (``cutlass_fused_moe``) in its FP8 block-scale mode on Hopper, built trimmed.

FlashInfer's SM90 ``fused_moe_90`` module compiles every dtype pair its binding can construct (181 objects, about
40 min on 16 cores). With ``use_deepseek_fp8_block_scale`` the binding constructs one runner,
``CutlassMoeFCRunner<bf16, fp8_e4m3>``, whose GEMMs both go through ``CutlassFp8BlockScaleGemmRunner::moeGemm``
(``fp8_blockscale_gemm.cu``, DeepGEMM kernels compiled with NVRTC on first use). :func:`block_scale_moe_spec` is
FlashInfer's own SM90 JIT spec for the installed version (its sources from the wheel, nvcc flags for sm_90a, include
paths, cache directory) reduced to that runner: 14 sources with FlashInfer 0.6.7, two of them derived from
FlashInfer's: the binding with its constructor reduced to the BF16 x FP8 runner, and the explicit instantiation of
that runner alone; its ``fp8_blockscale_gemm.cu`` is the DeepGEMM-only copy (ops/flashinfer_blockscale_build.py).
Python calls go through FlashInfer's own ``cutlass_fused_moe`` wrapper, handed this module instead of the full one.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import threading
import time
from pathlib import Path

from .flashinfer_blockscale_build import (TrimmedBuildError, build_spec, gemm_source_for, generator_pointed_at,
                                          write_if_different)

logger = logging.getLogger(__name__)

MOE_FLAG = "--moe-runner-backend"
MODULE_NAME = "fused_moe_90_fp8_block_scale"
_CONSTRUCTOR_START = "    // keep consistent with cpp/tensorrt_llm/plugins/mixtureOfExperts/mixtureOfExpertsPlugin.cpp\n"
_CONSTRUCTOR_END = "    if (!mKernelRunner) {\n"
_BF16_FP8_RUNNER = """    // sglang_mxfp8: the FP8 block-scale runner alone (bf16 activations, fp8_e4m3 weights, bf16 output)
    if (use_deepseek_fp8_block_scale && mActivationDtype == dl_bfloat16 &&
        mWeightDtype == dl_float8_e4m3fn && mOutputDtype == dl_bfloat16) {
      mKernelRunner = std::make_unique<kernels::CutlassMoeFCRunner<__nv_bfloat16, __nv_fp8_e4m3>>();
    }
"""
_INSTANTIATION = """// sglang_mxfp8: the one CutlassMoeFCRunner the FP8 block-scale binding constructs.
#include "cutlass_fused_moe_kernels.cuh"
#include "moe_kernels.h"

namespace tensorrt_llm::kernels::cutlass_kernels {
template class CutlassMoeFCRunner<__nv_bfloat16, __nv_fp8_e4m3, __nv_bfloat16>;
INSTANTIATE_FINALIZE_MOE_ROUTING(__nv_bfloat16, __nv_bfloat16, __nv_bfloat16);
}  // namespace tensorrt_llm::kernels::cutlass_kernels
"""
_BINDING = "fused_moe/cutlass_backend/flashinfer_cutlass_fused_moe_binding.cu"
_INSTANTIATIONS = "fused_moe/cutlass_backend/cutlass_fused_moe_instantiation.cu"
_MOE_GEMM_KERNELS = "moe_gemm_kernels_"  # one source per dtype pair: moe_gemm_kernels_bf16_fp8.cu is this runner's
_RUNNER_DTYPES = "_bf16_fp8.cu"
_LEFT_OUT_FLAGS = ("-DENABLE_FP4",)  # the FP4 runners and kernels are not compiled here


def trimmed_binding(binding_source: str) -> str:
    """FlashInfer's fused-MoE binding with its runner constructor reduced to the BF16 x FP8 block-scale runner."""
    start = binding_source.find(_CONSTRUCTOR_START)
    end = binding_source.find(_CONSTRUCTOR_END, start + 1)
    if start < 0 or end < 0:
        raise TrimmedBuildError(
            f"FlashInfer's {_BINDING} has no runner constructor between the markers this build trims "
            f"({_CONSTRUCTOR_START.strip()!r} ... {_CONSTRUCTOR_END.strip()!r})")
    trimmed = binding_source[:start] + _BF16_FP8_RUNNER + binding_source[end:]
    return re.sub(r'#include "\.\./\.\./tvm_ffi_utils\.h"', '#include "tvm_ffi_utils.h"', trimmed)


def _flashinfer_core():
    import flashinfer.fused_moe.core as core

    return core


@functools.lru_cache(maxsize=1)
def unsupported():
    """Why the installed FlashInfer cannot give the trimmed module (its binding or module factory not of the shape
    this build derives from), as one line; None where it can."""
    try:
        from flashinfer.jit import env as jit_env

        core = _flashinfer_core()
        trimmed_binding((Path(jit_env.FLASHINFER_CSRC_DIR) / _BINDING).read_text())
    except ImportError:
        return None  # no FlashInfer: platform.flashinfer_missing says so
    except (OSError, TrimmedBuildError) as e:
        return f"FlashInfer {_version()}: {e}; use {MOE_FLAG} triton"
    if getattr(core.get_cutlass_fused_moe_module, "__wrapped__", None) is None or not hasattr(
            core, "gen_cutlass_fused_moe_sm90_module"):
        return (f"FlashInfer {_version()} has no get_cutlass_fused_moe_module factory with an SM90 generator to hand "
                f"the trimmed module to; use {MOE_FLAG} triton")
    return None


def _version() -> str:
    import flashinfer

    return getattr(flashinfer, "__version__", "?")


def _kept(source: Path, csrc: Path) -> bool:
    """Whether one source of FlashInfer's full SM90 module is compiled here: not the generated TMA warp-specialized
    instantiations (other dtype pairs), not the MoE GEMM kernels of other dtype pairs, not the binding and runner
    instantiations it replaces; everything else (common code, heuristics, FP8 block-scale GEMM) as FlashInfer lists it."""
    if not source.is_relative_to(csrc):
        return False
    rel = source.relative_to(csrc).as_posix()
    if rel in (_BINDING, _INSTANTIATIONS):
        return False
    return not source.name.startswith(_MOE_GEMM_KERNELS) or source.name.endswith(_RUNNER_DTYPES)


@functools.lru_cache(maxsize=1)
def block_scale_moe_spec():
    """FlashInfer JitSpec of the trimmed SM90 fused MoE: FlashInfer's own SM90 spec (its flags, include paths, link
    flags, for the installed version and CUDA) with the sources and the FP4 define this runner does not need left
    out and the two derived sources, written into FlashInfer's generated-source cache, added; the FP8 block-scale GEMM
    source trimmed to its DeepGEMM path where it can be."""
    import dataclasses

    from flashinfer.jit import env as jit_env
    from flashinfer.jit.cpp_ext import is_cuda_version_at_least

    if not is_cuda_version_at_least("12.8"):
        raise TrimmedBuildError("FlashInfer compiles its FP8 block-scale MoE with CUDA 12.8 or newer only; "
                                f"use {MOE_FLAG} triton")
    full = _flashinfer_core().gen_cutlass_fused_moe_sm90_module()
    csrc = Path(jit_env.FLASHINFER_CSRC_DIR)
    gen_dir = Path(jit_env.FLASHINFER_GEN_SRC_DIR) / MODULE_NAME
    gen_dir.mkdir(parents=True, exist_ok=True)
    binding = gen_dir / "fp8_block_scale_moe_binding.cu"
    instantiation = gen_dir / "fp8_block_scale_moe_instantiation.cu"
    write_if_different(binding, trimmed_binding((csrc / _BINDING).read_text()))
    write_if_different(instantiation, _INSTANTIATION)
    kept = [src for src in full.sources if _kept(src, csrc)]
    if not any(src.name.startswith(_MOE_GEMM_KERNELS) for src in kept):
        raise TrimmedBuildError(f"FlashInfer {_version()}'s SM90 fused MoE lists no {_MOE_GEMM_KERNELS}*{_RUNNER_DTYPES}; "
                                f"use {MOE_FLAG} triton")
    generated = Path(jit_env.FLASHINFER_GEN_SRC_DIR) / "cutlass_instantiations"
    includes = [d for d in full.extra_include_dirs or [] if not d.is_relative_to(generated)]
    spec = dataclasses.replace(
        full, name=MODULE_NAME, sources=kept + [binding, instantiation],
        extra_cuda_cflags=[f for f in full.extra_cuda_cflags if f not in _LEFT_OUT_FLAGS],
        extra_include_dirs=includes + [csrc / "fused_moe" / "cutlass_backend", csrc],
    )
    return gemm_source_for(spec, MODULE_NAME)


_lock = threading.Lock()
_built = []  # the .so once this process has built or found it: every MoE layer's load asks again


@contextlib.contextmanager
def _progress(what: str):
    start = time.monotonic()
    done = threading.Event()

    def report():
        while not done.wait(30.0):
            logger.info("%s: still compiling, %.0f s", what, time.monotonic() - start)

    ticker = threading.Thread(target=report, daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        logger.info("%s: ready in %.1f s", what, time.monotonic() - start)


def build(verbose: bool = False) -> Path:
    """Compile the trimmed module into FlashInfer's JIT cache (nothing to do when it is there, once per process);
    returns the .so."""
    with _lock:
        if not _built:
            spec = block_scale_moe_spec()
            if not spec.is_compiled:
                logger.info("compiling FlashInfer's SM90 FP8 block-scale fused MoE (%d sources, once per FlashInfer "
                            "version; cached in %s)", len(spec.sources), spec.build_dir)
            with _progress("FlashInfer SM90 fused MoE"):
                build_spec(spec, verbose)
            _built.append(spec.jit_library_path)
    return _built[0]


@functools.lru_cache(maxsize=1)
def fused_moe_api():
    """FlashInfer's ``cutlass_fused_moe`` Python wrapper (its runner cache, autotuner and argument checks) bound to the
    trimmed module: FlashInfer's module factory called with the SM90 generator pointed at the trimmed spec."""
    why = unsupported()
    if why:
        raise TrimmedBuildError(why)
    core = _flashinfer_core()
    factory = core.get_cutlass_fused_moe_module.__wrapped__
    build()
    spec = block_scale_moe_spec()
    with generator_pointed_at(core, "gen_cutlass_fused_moe_sm90_module", spec):
        return factory("90")


def block_scale_moe(x, topk_weights, topk_ids, w13, w2, w13_scale, w2_scale, out=None,
                    tp_size=1, tp_rank=0, ep_size=1, ep_rank=0):
    """MoE forward through the trimmed module. w13 [E, 2I, H] FP8 as [up; gate], w2 [E, H, I] FP8; their float32
    scales per 128x128 block, [E, 2I/128, H/128] and [E, H/128, I/128]; x BF16 [T, H] (quantized per 1x128 group by
    the kernel); topk_ids int32."""
    import torch

    if out is None:
        out = torch.empty(x.shape[0], w2.shape[1], dtype=x.dtype, device=x.device)
    result = fused_moe_api().cutlass_fused_moe(
        out, x, topk_ids, topk_weights, w13, None, w2, None, torch.bfloat16, [w13_scale, w2_scale],
        tp_size=tp_size, tp_rank=tp_rank, ep_size=ep_size, ep_rank=ep_rank, use_deepseek_fp8_block_scale=True,
    )
    return result[0]
