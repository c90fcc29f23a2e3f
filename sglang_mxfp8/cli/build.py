"""``sglang-mxfp8 build``: compile on the CPU, ahead of the server, what an MXFP8 server compiles at its first start
on a Hopper GPU: the JIT modules of the kernels its plans use (FlashInfer's, into FlashInfer's cache) and, with
``--model``, every kernel the layers' batch sizes up to ``--max-tokens`` select that its kernels compile on first use
(FlashInfer's SM90 GEMM tile configs, dense and the fused MoE's grouped GEMMs, into FlashInfer's DeepGEMM cache).
Run it where, and as the user, the server will run (the same cache variables), e.g. while building a container
image; the server then loads instead of compiling. Nothing here needs a GPU."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path
from typing import List

from ..kernels import registry
from ..kernels.base import Mxfp8ConfigError, with_jit_modules
from ..kernels.plan import Plan
from ..ops.cuda_toolchain import prepare, toolkit_root
from ..ops.flashinfer_jit.tile_configs import KernelCompileError
from .doctor import gpu_from_arg, not_mxfp8

# streaming multiprocessors of the GPUs --gpu names (the SXM parts; FlashInfer's tile choice depends on the count)
SMS = {"h100": 132, "h200": 132}


# the pip package that brings a module the builds import
PIP = {"flashinfer": "flashinfer-python", "deep_gemm": "sgl-deep-gemm", "torch": "torch"}


def build(args) -> int:
    try:
        return _build(args)
    except ModuleNotFoundError as e:
        name = (e.name or "").split(".")[0]
        print(f"sglang-mxfp8 build: {name or e} is not installed here, and the kernels of these plans compile with it: "
              f"pip install {PIP.get(name, name)} (pip install -e \".[serve]\" brings SGLang and FlashInfer)",
              file=sys.stderr)
        return 2


def _build(args) -> int:
    from ..platform import as_on_a_server, multiprocessors, visible_gpu

    problem = not_mxfp8(Path(args.model)) if args.model else None
    if problem is not None:
        print(f"sglang-mxfp8 build: {problem}", file=sys.stderr)
        return 2
    gpu = gpu_from_arg(args.gpu)
    if gpu is None:
        print(
            "sglang-mxfp8 build: no GPU is visible here; name the server's with --gpu h100 or --gpu h200",
            file=sys.stderr,
        )
        return 2
    if gpu.arch != "sm90":
        print(f"sglang-mxfp8 build: nothing to compile ahead for {gpu.label}: only Hopper's kernels are compiled at a "
              "server's first start")
        return 0
    here = visible_gpu()
    if here == gpu:
        num_sms = multiprocessors()
    else:
        num_sms = SMS.get((args.gpu or "").lower(), 132)
        os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")  # FlashInfer's JIT target, with no GPU to ask
    with contextlib.nullcontext() if here == gpu else as_on_a_server():
        try:
            plans = _plans(args, gpu)
            kernels = [e.kernel for plan in plans for e, _, _ in plan.ranges(args.max_tokens)] if args.model else [
                k for kind, flag in (("linear", args.dense_flag), ("moe", args.moe_flag))
                for k in registry.flag_kernels(kind, gpu, flag)]
        except Mxfp8ConfigError as e:
            print(f"sglang-mxfp8 build: {e}", file=sys.stderr)
            return 1
        modules = with_jit_modules(kernels)
        if modules:
            import flashinfer  # noqa: F401 - what builds them; build() names it where it is missing

            missing = prepare(os.environ, Path.home() / ".cache" / "sglang_mxfp8" / "cuda-links")
            if missing:
                print(f"sglang-mxfp8 build: nvcc ({toolkit_root() or 'not on PATH'}) cannot build "
                      f"{', '.join(k.name for k in modules)} here: it lacks {'; '.join(missing)}", file=sys.stderr)
                return 2
        for kernel in modules:
            start = time.perf_counter()
            print(f"{kernel.name}: building its JIT module (once per library version; up to two minutes the first "
                  "time)", flush=True)
            kernel.prebuild()
            print(f"{kernel.name}: JIT module ready in {time.perf_counter() - start:.0f} s", flush=True)
    if not args.model:
        return 0
    compiled, start = 0, time.perf_counter()
    try:
        for plan in plans:
            for entry, lo, hi in plan.ranges(args.max_tokens):
                compiled += entry.kernel.compile_ahead(plan.spec, lo, hi, num_sms, args.jobs)
    except KernelCompileError as e:
        print(f"sglang-mxfp8 build: {e}", file=sys.stderr)
        return 1
    print(f"{compiled} kernels compiled for batches up to {args.max_tokens} tokens on {num_sms} SMs in "
          f"{time.perf_counter() - start:.0f} s (the others were in the cache already)")
    return 0


def _plans(args, gpu) -> List[Plan]:
    """The plans of every layer kind of --model, every batch band (none without --model); Mxfp8ConfigError with the
    first layer no kernel can run."""
    if not args.model:
        return []
    plans = []
    for what, plan in registry.plan_checkpoint(Path(args.model), gpu, args.dense_flag, args.moe_flag,
                                               args.tp, args.ep_size):
        if isinstance(plan, str):
            raise Mxfp8ConfigError(f"{what}: {plan}")
        plans.append(plan)
    return plans
