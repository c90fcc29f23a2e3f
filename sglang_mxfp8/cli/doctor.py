"""``sglang-mxfp8 doctor``: the plan of every layer kind of a checkpoint, as a launch would make it."""

from __future__ import annotations

import sys
import textwrap
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Optional

from .. import SUPPORTED_SGLANG, __version__
from ..format import checkpoint
from ..kernels import registry
from ..platform import GpuSpec

KNOWN_GPUS = {"h100": ("NVIDIA H100", 90), "h200": ("NVIDIA H200", 90), "b200": ("NVIDIA B200", 100),
              "gb200": ("NVIDIA GB200", 100), "rtx6000": ("NVIDIA RTX PRO 6000", 120)}


def _pkg(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def gpu_from_arg(arg: Optional[str]) -> Optional[GpuSpec]:
    if arg:
        if arg.lower() not in KNOWN_GPUS:
            raise SystemExit(
                f"--gpu {arg}: choose one of {', '.join(KNOWN_GPUS)} (or omit it to use this machine's GPU)"
            )
        return GpuSpec(*KNOWN_GPUS[arg.lower()])
    from ..platform import visible_gpu

    return visible_gpu()


def startup_hook_status() -> str:
    """Whether SGLang processes started from this environment will run sglang_mxfp8."""
    from ..sglang import autoload

    if autoload.disabled():
        return f"disabled by {autoload.DISABLE_ENV}=1 (SGLang runs as shipped)"
    if not any(isinstance(f, autoload.SglangImportHook) for f in sys.meta_path):
        return "NOT active: sglang_mxfp8.pth did not run in this interpreter; reinstall with `pip install -e .`"
    return "active (sglang_mxfp8.pth patches SGLang in every process it starts)"


def doctor(args) -> int:
    from ..platform import as_on_a_server, visible_gpu

    if getattr(args, "markdown", False):
        print(registry.markdown())
        return 0

    gpu = gpu_from_arg(args.gpu)
    if gpu is not None and gpu != visible_gpu():  # another machine's server: the libraries SGLang brings there
        with as_on_a_server():
            return report(args, gpu)
    return report(args, gpu)


def report(args, gpu: Optional[GpuSpec]) -> int:
    print(
        f"sglang_mxfp8 {__version__}  sglang {_pkg('sglang')} (tested: {SUPPORTED_SGLANG})  "
        f"flashinfer {_pkg('flashinfer-python')}  torch {_pkg('torch')}"
    )
    print(f"startup hook: {startup_hook_status()}")
    print(
        "\n".join(
            textwrap.wrap(
                f"kernels: {', '.join(registry.kernel_names())} (SGLANG_MXFP8_DISABLED_KERNELS=name,... turns any off)",
                100,
                subsequent_indent="  ",
            )
        )
    )
    if gpu is None:
        print("GPU: none visible (pass --gpu h200|b200|... to see what a GPU would run)")
    else:
        print(f"GPU: {gpu.label}")
        print(f"  {registry.DENSE_FLAG}: valid {', '.join(registry.flag_choices('linear', gpu)) or 'none'}")
        print(f"  {registry.MOE_FLAG}: valid {', '.join(registry.flag_choices('moe', gpu)) or 'none'}")
    if not args.model:
        return 0
    try:
        return checkpoint_report(Path(args.model), gpu, args)
    except checkpoint.CheckpointError as e:
        print(f"error: {e}")
        return 1


def not_mxfp8(ckpt: Path) -> Optional[str]:
    """Why ``ckpt`` is no MXFP8 checkpoint folder (one line), or None."""
    problem = checkpoint.not_a_folder(ckpt)
    if problem:
        return problem
    if checkpoint.detect_checkpoint(ckpt) is None:
        return (f"{ckpt}: not an MXFP8 checkpoint (no quant_method mxfp8 / quant_algo MXFP8); convert it first with "
                "`sglang-mxfp8 convert`")
    return None


def checkpoint_report(ckpt: Path, gpu: Optional[GpuSpec], args) -> int:
    """The checkpoint's format and, for ``gpu``, each layer kind's plan; 1 where a layer cannot run."""
    problem = not_mxfp8(ckpt)
    if problem is not None:
        print(problem)
        return 1
    fmt = checkpoint.detect_checkpoint(ckpt)
    flavor = "ModelOpt" if fmt.flavor == checkpoint.MODELOPT else "SGLang/miles"
    print(
        f"checkpoint: {ckpt} ({flavor} MXFP8, scales '{fmt.scale_name}', {len(fmt.ignored)} modules kept unquantized)"
    )
    if gpu is None:  # the checkpoint is checked; which kernel each layer gets depends on the GPU
        print("  kernels per layer: pass --gpu h200|b200|... to see them")
        return 0
    tp, ep = args.tp, args.ep_size
    if tp % ep:
        print(f"--ep-size {ep} does not divide --tp {tp}; SGLang's expert parallelism splits the tensor-parallel ranks")
        return 1
    if tp > 1:
        print(f"  at --tp {tp}" + (f" --ep-size {ep}" if ep > 1 else "") + ": kernels chosen on one rank's shard")
    status = 0
    for what, plan in registry.plan_checkpoint(ckpt, gpu, args.dense_flag, args.moe_flag, tp, ep):
        print(f"  {what}")
        if isinstance(plan, str):
            print("\n".join(textwrap.wrap(f"ERROR {plan}", 100, initial_indent="    ", subsequent_indent="      ")))
            status = 1
        else:
            print("\n".join(plan.table()))
    if fmt.ignored:
        kept = ", ".join(fmt.ignored[:4]) + (f", ... ({len(fmt.ignored)} in all)" if len(fmt.ignored) > 4 else "")
        print("\n".join(textwrap.wrap(f"BF16 (modules_to_not_convert; SGLang's own unquantized kernels): {kept}", 100,
                                      initial_indent="  ", subsequent_indent="    ")))
    return status


