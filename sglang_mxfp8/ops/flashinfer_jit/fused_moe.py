"""FlashInfer's CUTLASS fused MoE (``cutlass_fused_moe``) in its FP8 block-scale mode on Hopper, built trimmed.

FlashInfer's SM90 ``fused_moe_90`` module compiles every dtype pair its binding can construct (181 objects, about
40 min on 16 cores). With ``use_deepseek_fp8_block_scale`` the binding constructs one runner,
``CutlassMoeFCRunner<bf16, fp8_e4m3>``, whose GEMMs both go through ``CutlassFp8BlockScaleGemmRunner::moeGemm``
(``fp8_blockscale_gemm.cu``, DeepGEMM kernels compiled with NVRTC on first use). :func:`block_scale_moe_spec` is
FlashInfer's own SM90 JIT spec for the installed version (its sources from the wheel, nvcc flags for sm_90a, include
paths, cache directory) reduced to that runner: 18 sources with FlashInfer 0.6.7, seven of them derived from
FlashInfer's: the binding with its constructor reduced to the BF16 x FP8 runner; the explicit instantiation of that
runner alone, with the expert-map sort kernels of its header split off into four sources that compile in parallel
with it (:func:`split_expert_maps`); ``fp8_blockscale_gemm.cu``, the DeepGEMM-only copy
(ops/flashinfer_jit/blockscale_gemm.py).
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
from typing import Dict, Tuple

from . import unchecked
from .blockscale_gemm import (TrimmedBuildError, build_spec, gemm_source_for, generator_pointed_at,
                              write_if_different)

logger = logging.getLogger(__name__)

MOE_FLAG = "--moe-runner-backend"
MODULE_NAME = "fused_moe_90_fp8_block_scale"
_STOCK_MODULE = "fused_moe_90"
_CONSTRUCTOR_START = (
    "    // keep consistent with cpp/tensorrt_llm/plugins/mixtureOfExperts/mixtureOfExpertsPlugin.cpp\n"
)
_CONSTRUCTOR_END = "    if (!mKernelRunner) {\n"
_BF16_FP8_RUNNER = """    // sglang_mxfp8: the FP8 block-scale runner alone (bf16 in and out, fp8_e4m3 weights)
    if (use_deepseek_fp8_block_scale && mActivationDtype == dl_bfloat16 &&
        mWeightDtype == dl_float8_e4m3fn && mOutputDtype == dl_bfloat16) {
      mKernelRunner = std::make_unique<kernels::CutlassMoeFCRunner<__nv_bfloat16, __nv_fp8_e4m3>>();
    }
"""
_INSTANTIATION = """// sglang_mxfp8: the one CutlassMoeFCRunner the FP8 block-scale binding constructs.
#include "KERNELS_HEADER"
#include "moe_kernels.h"

namespace tensorrt_llm::kernels::cutlass_kernels {
template class CutlassMoeFCRunner<__nv_bfloat16, __nv_fp8_e4m3, __nv_bfloat16>;
INSTANTIATE_FINALIZE_MOE_ROUTING(__nv_bfloat16, __nv_bfloat16, __nv_bfloat16);
}  // namespace tensorrt_llm::kernels::cutlass_kernels
"""
_BINDING = "fused_moe/cutlass_backend/flashinfer_cutlass_fused_moe_binding.cu"
_INSTANTIATIONS = "fused_moe/cutlass_backend/cutlass_fused_moe_instantiation.cu"
_KERNELS_HEADER = "fused_moe/cutlass_backend/cutlass_fused_moe_kernels.cuh"  # included by _INSTANTIATIONS alone
_SPLIT_HEADER = "fp8_block_scale_moe_kernels.cuh"
_RUNNER_NAMESPACE = "namespace tensorrt_llm::kernels::cutlass_kernels {\n"
_EXPERT_MAPS_START = ("template <int BLOCK_SIZE, int EXPERTS_PER_TOKEN, int LOG2_NUM_EXPERTS>\n"
                      "__global__ void fusedBuildExpertMapsSortFirstTokenKernel(")
_EXPERT_MAPS_DISPATCH = "bool fusedBuildExpertMapsSortFirstToken(\n"
_PER_LOG2_SIGNATURE = re.compile(
    r"template <int LOG2_NUM_EXPERTS>\nbool fusedBuildExpertMapsSortFirstTokenBlockSize(\([^)]*\)) \{")
_PER_LOG2_TAKEN = re.compile(r"&fusedBuildExpertMapsSortFirstTokenBlockSize<(\d+)>")
_EXPERT_MAPS_INCLUDES = ("#include <cub/cub.cuh>\n"
                         '#include "tensorrt_llm/common/assert.h"\n'
                         '#include "tensorrt_llm/common/cudaUtils.h"\n'
                         '#include "tensorrt_llm/common/logger.h"\n')
_ALONE = 3  # the largest radix widths each get a source of their own (see split_expert_maps)
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


def split_expert_maps(header: str) -> Tuple[str, Dict[str, str]]:
    """FlashInfer's cutlass_fused_moe_kernels.cuh with its expert-map sort kernels compiled in sources of their own,
    in parallel with the runner's: returns the header, with explicit instantiation declarations (``extern template``)
    of ``fusedBuildExpertMapsSortFirstTokenBlockSize<LOG2_NUM_EXPERTS>`` for each radix width its dispatcher takes,
    and the sources (by file name) that instantiate them from the header's own template code, which needs only CUB
    and TensorRT-LLM's common headers.

    That header defines non-template functions, so one source alone compiles it; its dispatcher instantiates the sort
    kernel for every radix width, top-k and block size (180 kernels), 40% of that source's nvcc time on the
    CPU machine (58.7 s; the header without them 35.9 s), the longest object of the module's build. The kernels'
    cost grows with the radix width (widths 1-6 together 17.6 s, 7-9 together 29.2 s), so the three widest get a
    source each and the others share one."""
    start = header.find(_EXPERT_MAPS_START)
    dispatch = header.find(_EXPERT_MAPS_DISPATCH, max(start, 0))
    namespace = header.find(_RUNNER_NAMESPACE)
    signature = _PER_LOG2_SIGNATURE.search(header, max(start, 0), max(dispatch, 0))
    if not 0 <= namespace < start < dispatch or signature is None or header.count(_EXPERT_MAPS_DISPATCH) != 1:
        raise TrimmedBuildError(
            f"FlashInfer's {Path(_KERNELS_HEADER).name} has not the expert-map sort templates and their one dispatcher "
            f"({_EXPERT_MAPS_START.splitlines()[1]!r} ... {_EXPERT_MAPS_DISPATCH.strip()!r}) this build splits off")
    templates = header[start:dispatch]
    for definition in templates.split("\n}\n"):  # each top-level definition, up to its closing brace at column 0
        code = "\n".join(line for line in definition.splitlines() if line.strip() and not line.startswith("//"))
        if code and not code.startswith("template <"):
            raise TrimmedBuildError(
                f"FlashInfer's {Path(_KERNELS_HEADER).name} defines a non-template function among its expert-map sort "
                f"templates ({code.splitlines()[0][:80]!r}), which a second source cannot compile again")
    body_end = header.find("\n}\n", dispatch)
    widths = [int(w) for w in _PER_LOG2_TAKEN.findall(header, dispatch, body_end)]
    if not widths or widths != sorted(set(widths)):
        raise TrimmedBuildError(
            f"FlashInfer's {Path(_KERNELS_HEADER).name}: its expert-map dispatcher takes no list of "
            f"fusedBuildExpertMapsSortFirstTokenBlockSize<LOG2_NUM_EXPERTS> this build splits off")

    def instantiation(width, extern):
        return (f"{'extern ' if extern else ''}template bool fusedBuildExpertMapsSortFirstTokenBlockSize<{width}>"
                f"{signature.group(1)};\n")

    declarations = "".join(instantiation(w, extern=True) for w in widths)
    split_header = (header[:dispatch] + "// sglang_mxfp8: instantiated in the fp8_block_scale_moe_expert_maps_*.cu "
                    "sources\n" + declarations + "\n" + header[dispatch:])
    usings = "".join(line + "\n" for line in header[:namespace].splitlines() if line.startswith("using namespace "))
    groups = [widths[:-_ALONE]] + [[w] for w in widths[-_ALONE:]] if len(widths) > _ALONE else [widths]
    sources = {}
    for group in groups:
        named = f"{group[0]}" if len(group) == 1 else f"{group[0]}_to_{group[-1]}"
        head = (f"// sglang_mxfp8: FlashInfer's expert-map sort kernels for radix width(s) {named.replace('_', ' ')}, "
                f"from its {Path(_KERNELS_HEADER).name}\n")
        sources[f"fp8_block_scale_moe_expert_maps_{named}.cu"] = (
            head + _EXPERT_MAPS_INCLUDES + "\n" + _RUNNER_NAMESPACE + "}\n" + usings + "\n" + _RUNNER_NAMESPACE
            + templates + "".join(instantiation(w, extern=False) for w in group)
            + "}  // namespace tensorrt_llm::kernels::cutlass_kernels\n")
    return split_header, sources


def _flashinfer_core():
    import flashinfer.fused_moe.core as core

    return core


@functools.lru_cache(maxsize=1)
def unsupported():
    """Why the installed FlashInfer cannot give the trimmed module (its binding or module factory not of the shape
    this build derives from), as one line; None where it can, and where FlashInfer's own module serves instead
    (:func:`stock_module`)."""
    try:
        from flashinfer.jit import env as jit_env

        core = _flashinfer_core()
        if stock_module():
            return None
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


@functools.lru_cache(maxsize=1)
def stock_module() -> bool:
    """Whether FlashInfer's own full SM90 module serves instead of the trimmed one (a FlashInfer release the trim was
    not checked against), said once in the log."""
    why = unchecked()
    if why:
        logger.warning("sglang_mxfp8: %s; the FP8 block-scale fused MoE runs FlashInfer's own full SM90 module (%s, "
                       "181 sources with FlashInfer 0.6.7: about 40 min on 16 cores, once per version)", why,
                       _STOCK_MODULE)
    return why is not None


def _version() -> str:
    import flashinfer

    return getattr(flashinfer, "__version__", "?")


def _kept(source: Path, csrc: Path) -> bool:
    """Whether one source of FlashInfer's full SM90 module is compiled here: not the generated TMA warp-specialized
    instantiations (other dtype pairs), not the MoE GEMM kernels of other dtype pairs, not the binding and runner
    instantiations it replaces; everything else (common code, heuristics, FP8 block-scale GEMM) as FlashInfer lists
    it."""
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
    out and the derived sources, written into FlashInfer's generated-source cache, added: the binding, the runner's
    instantiation and its expert-map sort sources (:func:`split_expert_maps`); the FP8 block-scale GEMM source
    trimmed to its DeepGEMM path where it can be. FlashInfer's own full spec where :func:`stock_module`."""
    import dataclasses

    from flashinfer.jit import env as jit_env
    from flashinfer.jit.cpp_ext import is_cuda_version_at_least

    if not is_cuda_version_at_least("12.8"):
        raise TrimmedBuildError("FlashInfer compiles its FP8 block-scale MoE with CUDA 12.8 or newer only; "
                                f"use {MOE_FLAG} triton")
    full = _flashinfer_core().gen_cutlass_fused_moe_sm90_module()
    if stock_module():
        return full
    csrc = Path(jit_env.FLASHINFER_CSRC_DIR)
    gen_dir = Path(jit_env.FLASHINFER_GEN_SRC_DIR) / MODULE_NAME
    gen_dir.mkdir(parents=True, exist_ok=True)
    binding = gen_dir / "fp8_block_scale_moe_binding.cu"
    instantiation = gen_dir / "fp8_block_scale_moe_instantiation.cu"
    write_if_different(binding, trimmed_binding((csrc / _BINDING).read_text()))
    try:
        header, expert_maps = split_expert_maps((csrc / _KERNELS_HEADER).read_text())
    except TrimmedBuildError as e:
        logger.info("sglang_mxfp8: the fused MoE's runner source compiles its expert-map sort kernels too (%s)", e)
        header_name, expert_maps = Path(_KERNELS_HEADER).name, {}
    else:
        header_name = _SPLIT_HEADER
        write_if_different(gen_dir / _SPLIT_HEADER, header)
    for name, text in expert_maps.items():
        write_if_different(gen_dir / name, text)
    write_if_different(instantiation, _INSTANTIATION.replace("KERNELS_HEADER", header_name))
    kept = [src for src in full.sources if _kept(src, csrc)]
    if not any(src.name.startswith(_MOE_GEMM_KERNELS) for src in kept):
        raise TrimmedBuildError(
            f"FlashInfer {_version()}'s SM90 fused MoE lists no {_MOE_GEMM_KERNELS}*{_RUNNER_DTYPES}; "
            f"use {MOE_FLAG} triton"
        )
    generated = Path(jit_env.FLASHINFER_GEN_SRC_DIR) / "cutlass_instantiations"
    includes = [d for d in full.extra_include_dirs or [] if not d.is_relative_to(generated)]
    spec = dataclasses.replace(
        full, name=MODULE_NAME, sources=kept + [binding, instantiation] + [gen_dir / name for name in expert_maps],
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
    build()
    if stock_module():
        return core.get_cutlass_fused_moe_module("90")
    factory = core.get_cutlass_fused_moe_module.__wrapped__
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
