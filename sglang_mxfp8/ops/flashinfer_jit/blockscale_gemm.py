"""FlashInfer's FP8 block-scale GEMM source (``fp8_blockscale_gemm.cu``) built with its DeepGEMM path alone.

On Hopper, both FlashInfer modules this package loads run their FP8 block-scale GEMMs through that file's DeepGEMM
path (kernels compiled per tile config on first use): the dense ``fp8_blockscale_gemm_sm90`` op and the FP8
block-scale fused MoE (ops/flashinfer_jit/fused_moe.py). The file also compiles, for sm_90a, the kernels of two paths
that never run on Hopper: static CUTLASS kernels for when DeepGEMM is switched off (``TRTLLM_DG_ENABLED=0``) and the
SM89 (Ada) kernels, whose CuTe headers are most of the front end's time. Together they are 80-85% of the file's
nvcc time (110.7 s against 18.1 s, on an H200's host), the longest step of a fresh server's start
(docs/decisions.md). The trimmed copy keeps the DeepGEMM path as it is and gives the bodies of the other paths'
dispatch functions an error instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import re
from pathlib import Path
from typing import Optional

from . import unchecked

logger = logging.getLogger(__name__)

GEMM_DIR = "nv_internal/tensorrt_llm/kernels/cutlass_kernels/fp8_blockscale_gemm"
GEMM_SOURCE = f"{GEMM_DIR}/fp8_blockscale_gemm.cu"
KERNEL_HEADER = "fp8_blockscale_gemm_kernel.cuh"  # included by GEMM_SOURCE alone: it defines non-inline functions
DENSE_MODULE = "fp8_blockscale_gemm_90_deepgemm"
DEEPGEMM_SWITCH = "TRTLLM_DG_ENABLED"
_SM89_INCLUDE = '#include "ada_blockwise_gemm/sm89_fp8_gemm_1d1d.cuh"\n'
# The dispatch functions of the paths left out, by the start of their signatures.
_LEFT_OUT_FUNCTIONS = ("void gemm_dispatch_old(void* mat_a, int ld_a,",
                       "void gemm_dispatch_old(void* mat_a, void* mat_b,",
                       "void gemm_dispatch_sm89(",
                       "void strided_batch_gemm_dispatch_sm89(")
# The non-DeepGEMM branch of fp8_grouped_gemm_run and of fp8_stride_batch_gemm_run, each the end of its function.
_STATIC_BRANCH = re.compile(r"\} else \{\n    using GemmType = Fp8Gemm<.*?\n  \}\n\}\n", re.S)
_STATIC_BRANCHES = 2
_LEFT_OUT_ERROR = (f'  TLLM_THROW("sglang_mxfp8 built FlashInfer\'s FP8 block-scale GEMM for Hopper with its DeepGEMM '
                   f'path only, and DeepGEMM\'s JIT is off here ({DEEPGEMM_SWITCH}=0 or no JIT include folders); '
                   f'unset {DEEPGEMM_SWITCH} or use --fp8-gemm-backend triton");\n')


class TrimmedBuildError(RuntimeError):
    """FlashInfer's sources do not have the shape a trimmed build derives from."""


def _cut_body(source: str, signature: str) -> str:
    start = source.find("\n" + signature)
    if start < 0 or source.find("\n" + signature, start + 1) >= 0:
        raise TrimmedBuildError(f"FlashInfer's {KERNEL_HEADER} has not one function starting {signature!r}")
    body = source.index("{\n", start) + 2
    end = source.find("\n}\n", body)
    if end < 0:
        raise TrimmedBuildError(f"FlashInfer's {KERNEL_HEADER}: no end of the function starting {signature!r}")
    return source[:body] + _LEFT_OUT_ERROR + source[end + 1:]


def trimmed_kernel_header(source: str) -> str:
    """FlashInfer's fp8_blockscale_gemm_kernel.cuh without the SM89 and non-DeepGEMM kernels: the dispatch functions
    of those paths raise instead, and the SM89 header is not included."""
    if source.count(_SM89_INCLUDE) != 1:
        raise TrimmedBuildError(f"FlashInfer's {KERNEL_HEADER} does not include {_SM89_INCLUDE.strip()!r} once")
    trimmed = source.replace(_SM89_INCLUDE, "")
    for signature in _LEFT_OUT_FUNCTIONS:
        trimmed = _cut_body(trimmed, signature)
    trimmed, branches = _STATIC_BRANCH.subn("} else {\n" + _LEFT_OUT_ERROR + "  }\n}\n", trimmed)
    if branches != _STATIC_BRANCHES:
        raise TrimmedBuildError(f"FlashInfer's {KERNEL_HEADER} has {branches} non-DeepGEMM branches of the shape this "
                                f"build cuts, not {_STATIC_BRANCHES}")
    for kept in ("ada_blockwise_gemm::", "GemmType::run("):
        if kept in trimmed:
            raise TrimmedBuildError(
                f"FlashInfer's {KERNEL_HEADER} still calls {kept} outside the functions this build cuts")
    return trimmed


def _flashinfer_csrc() -> Path:
    from flashinfer.jit import env as jit_env

    return Path(jit_env.FLASHINFER_CSRC_DIR)


@functools.lru_cache(maxsize=1)
def _installed_trimmed_header() -> str:
    """The installed FlashInfer's kernel header, trimmed (read and cut once per process; raises as
    :func:`trimmed_kernel_header` does)."""
    return trimmed_kernel_header((_flashinfer_csrc() / GEMM_DIR / KERNEL_HEADER).read_text())


def write_trimmed_source(gen_dir: Path) -> Path:
    """The trimmed fp8_blockscale_gemm.cu in ``gen_dir`` beside its trimmed header (a quoted include looks beside the
    including file first); FlashInfer's other headers of the GEMM folder come from the include path
    :func:`with_trimmed_gemm` adds. Files are rewritten only when they differ, so ninja rebuilds only on a change."""
    folder = _flashinfer_csrc() / GEMM_DIR
    gen_dir.mkdir(parents=True, exist_ok=True)
    write_if_different(gen_dir / KERNEL_HEADER, _installed_trimmed_header())
    source = gen_dir / Path(GEMM_SOURCE).name
    write_if_different(source, (folder / Path(GEMM_SOURCE).name).read_text())
    return source


def write_if_different(path: Path, text: str) -> None:
    """Write ``text`` unless the file holds it already: its time stamp then stays, and ninja rebuilds nothing."""
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def build_spec(spec, verbose: bool = False) -> None:
    """Compile a FlashInfer JitSpec into FlashInfer's JIT cache (nothing to do when it is built or shipped prebuilt),
    under FlashInfer's lock for the spec, which a process loading it waits on. The ninja file is written from the spec
    every time (FlashInfer writes it only where there is none), so a change of sources rebuilds."""
    from filelock import FileLock

    if spec.is_aot:
        return
    with FileLock(spec.lock_path, thread_local=False):
        spec.write_ninja()
        spec.build(verbose, need_lock=False)


def with_trimmed_gemm(spec, name: str):
    """``spec`` (a FlashInfer JitSpec that compiles fp8_blockscale_gemm.cu) renamed to ``name``, with that source
    replaced by the trimmed copy written into FlashInfer's generated-source folder for ``name``."""
    from flashinfer.jit import env as jit_env

    csrc = _flashinfer_csrc()
    original = csrc / GEMM_SOURCE
    if original not in spec.sources:
        raise TrimmedBuildError(f"FlashInfer's {spec.name} module does not compile {GEMM_SOURCE}")
    trimmed = write_trimmed_source(Path(jit_env.FLASHINFER_GEN_SRC_DIR) / name)
    return dataclasses.replace(spec, name=name, sources=[trimmed if s == original else s for s in spec.sources],
                               extra_include_dirs=list(spec.extra_include_dirs or []) + [csrc / GEMM_DIR])


@functools.lru_cache(maxsize=1)
def unsupported() -> Optional[str]:
    """Why FlashInfer's full fp8_blockscale_gemm.cu is compiled here instead of the trimmed one (DeepGEMM switched off,
    a FlashInfer release the trim was not checked against, or its sources not of the shape the trim derives from), as
    one line; None where the trimmed one is."""
    if unchecked():
        return unchecked()
    if os.environ.get(DEEPGEMM_SWITCH) == "0":
        return f"{DEEPGEMM_SWITCH}=0 runs FlashInfer's non-DeepGEMM kernels"
    try:
        _installed_trimmed_header()
    except (OSError, TrimmedBuildError) as e:
        return str(e)
    return None


def gemm_source_for(spec, name: str):
    """``spec`` with the trimmed GEMM source, named ``name``; ``spec`` itself, with a log line saying why, where the
    trimmed source cannot be used."""
    why = unsupported()
    if why is None:
        try:
            return with_trimmed_gemm(spec, name)
        except TrimmedBuildError as e:
            why = str(e)
    logger.info("sglang_mxfp8: FlashInfer's %s compiles its full %s (%s)", spec.name, Path(GEMM_SOURCE).name, why)
    return spec


@contextlib.contextmanager
def generator_pointed_at(module, generator: str, spec):
    """FlashInfer's module generator ``module.<generator>`` returning ``spec`` while the block runs: a cached FlashInfer
    factory called inside (its ``__wrapped__``) then loads this package's module with FlashInfer's own set-up."""
    original = getattr(module, generator)
    setattr(module, generator, lambda use_fast_build=False: spec)
    try:
        yield
    finally:
        setattr(module, generator, original)


def _runner_factory_takes_a_module() -> bool:
    """Whether FlashInfer's SM90 runner factory is the cached function of the module generator it calls, the shape
    :func:`dense_runner` hands the trimmed module to."""
    from flashinfer.gemm import gemm_base

    factory = getattr(gemm_base, "get_fp8_blockscale_gemm_runner_sm90", None)
    return (getattr(factory, "__wrapped__", None) is not None
            and hasattr(gemm_base, "gen_fp8_blockscale_gemm_sm90_module"))


@functools.lru_cache(maxsize=1)
def dense_spec():
    """The JitSpec of FlashInfer's SM90 ``fp8_blockscale_gemm_sm90`` op this package loads: FlashInfer's own where
    flashinfer-jit-cache ships it prebuilt or its runner factory cannot be handed another module, else the same
    with the trimmed GEMM source."""
    from flashinfer.jit.gemm import gen_fp8_blockscale_gemm_sm90_module

    stock = gen_fp8_blockscale_gemm_sm90_module()
    if stock.is_aot:
        return stock
    if not _runner_factory_takes_a_module():
        logger.info("sglang_mxfp8: FlashInfer's %s compiles its full %s (FlashInfer's gemm_base has no cached "
                    "get_fp8_blockscale_gemm_runner_sm90 to hand the trimmed module to)", stock.name,
                    Path(GEMM_SOURCE).name)
        return stock
    return gemm_source_for(stock, DENSE_MODULE)


def build_dense(verbose: bool = False) -> None:
    """Compile :func:`dense_spec` into FlashInfer's JIT cache (CPU only: nothing is loaded)."""
    build_spec(dense_spec(), verbose)


@functools.lru_cache(maxsize=1)
def dense_runner():
    """FlashInfer's SM90 block-scale GEMM runner from :func:`dense_spec`: FlashInfer's runner factory, its module
    generator pointed at that spec (FlashInfer's own factory as it is where the spec is FlashInfer's)."""
    from flashinfer.gemm import gemm_base

    build_dense()
    spec = dense_spec()
    if spec.name != DENSE_MODULE:
        return gemm_base.get_fp8_blockscale_gemm_runner_sm90()
    with generator_pointed_at(gemm_base, "gen_fp8_blockscale_gemm_sm90_module", spec):
        return gemm_base.get_fp8_blockscale_gemm_runner_sm90.__wrapped__()


def blockscale_gemm(x, weight, weight_scale, out_dtype):
    """``x @ weight.T`` for BF16 ``x`` [M, K] (quantized per 1x128 group inside) and FP8 ``weight`` [N, K] with float32
    ``weight_scale`` per 128x128 block: the call FlashInfer's ``fp8_blockscale_gemm_sm90`` makes after its argument
    checks (the caller planned these shapes: K % 128 == 0, N % 64 == 0)."""
    import torch

    runner = dense_runner()
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    workspace_size = runner.get_workspace_size(m, n, k)
    if workspace_size > 0:
        runner.configure_workspace(torch.empty(workspace_size, dtype=torch.uint8, device=x.device))
    runner.run_gemm(x, weight, out, None, weight_scale)
    return out
