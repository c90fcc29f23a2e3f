"""One launch's configuration, read once: the checkpoint and the flags that choose its MXFP8 kernels, from the
launcher's command line (before SGLang's imports, for the JIT builds) or from SGLang's resolved server arguments; what
a launch checks before any process is spawned; the JIT builds it starts; and the flags a layer is planned with."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from .. import error_line
from ..format import checkpoint
from ..kernels import registry
from ..kernels.base import Mxfp8ConfigError, with_jit_modules
from ..kernels.plan import Plan
from ..kernels.jit_builds import LAUNCHER_ENV
from ..compat import served_args
from .patching import PatchTargetMissing, check_complete

logger = logging.getLogger("sglang_mxfp8")

# The server arguments a launch's kernels depend on: SGLang's destination name, its option strings (0.5.10.post1 to
# 0.5.23; tests/test_patches.py compares them with SGLang's own parser), and its default.
LAUNCH_ARGS = (
    ("model_path", ("--model-path", "--model"), None),
    ("quantization", ("--quantization",), None),
    ("fp8_gemm_runner_backend", ("--fp8-gemm-backend",), "auto"),
    ("moe_runner_backend", ("--moe-runner-backend",), "auto"),
    ("tp_size", ("--tp-size", "--tensor-parallel-size"), 1),
    ("ep_size", ("--ep-size", "--expert-parallel-size", "--ep"), 1),
)


@dataclass(frozen=True)
class LaunchConfig:
    """What chooses an MXFP8 launch's kernels: the checkpoint, ``--quantization``, the two backend flags, and the
    tensor- and expert-parallel sizes."""

    model_path: Optional[str] = None
    quantization: Optional[str] = None
    dense_flag: str = "auto"
    moe_flag: str = "auto"
    tp: int = 1
    ep: int = 1

    @classmethod
    def from_server_args(cls, args) -> "LaunchConfig":
        """From SGLang's ServerArgs (or its resolved view, SGLang >= 0.5.20), or anything with the same attributes."""
        return cls(getattr(args, "model_path", None), getattr(args, "quantization", None),
                   getattr(args, "fp8_gemm_runner_backend", None) or "auto",
                   getattr(args, "moe_runner_backend", None) or "auto",
                   getattr(args, "tp_size", None) or 1, getattr(args, "ep_size", None) or 1)

    @classmethod
    def from_argv(cls, argv: List[str]) -> Optional["LaunchConfig"]:
        """Read from a launcher's command line as SGLang's parser reads it, before SGLang is imported; None where the
        flags may come from elsewhere (``--config``) or cannot be read (SGLang's own parse then says what is wrong)."""
        import argparse

        class Parser(argparse.ArgumentParser):
            def error(self, message):  # an option without its value, a size that is no number: SGLang's to report
                raise ValueError(message)

        if any(arg == "--config" or arg.startswith("--config=") for arg in argv):
            return None
        parser = Parser(add_help=False)
        for dest, flags, default in LAUNCH_ARGS:
            parser.add_argument(*flags, dest=dest, default=default, type=int if isinstance(default, int) else str)
        try:
            return cls.from_server_args(parser.parse_known_args(argv)[0])
        except ValueError:
            return None

    def is_mxfp8(self) -> bool:
        """SGLang is asked to serve MXFP8: --quantization mxfp8, or a local MXFP8 checkpoint."""
        if self.quantization == "mxfp8":
            return True
        if self.quantization is None and self.model_path:
            try:
                return checkpoint.detect_checkpoint(self.model_path) is not None
            except OSError:
                return False
        return False


def layer_flags() -> Tuple[str, str]:
    """(--fp8-gemm-backend, --moe-runner-backend) a layer of this process is planned with: the values SGLang set for
    its layers (its MoE flag can differ from the launch's for a speculative draft model), else the server's."""
    config = LaunchConfig.from_server_args(served_args())
    dense, moe = config.dense_flag, config.moe_flag
    try:
        from sglang.srt.layers.quantization.fp8_utils import get_fp8_gemm_runner_backend

        dense = get_fp8_gemm_runner_backend().value
    except ImportError:
        pass
    try:
        from sglang.srt.layers.moe import get_moe_runner_backend

        moe = get_moe_runner_backend().value
    except (ImportError, AttributeError):
        pass
    return dense, moe


class Mxfp8LaunchError(SystemExit):
    """A launch that cannot serve MXFP8: its one-line reason goes to stderr and the launcher exits 1, with no
    traceback (and before SGLang spawns a process that would die on it later)."""

    def __init__(self, message: str):
        super().__init__(f"sglang_mxfp8: {message}")
        self.message = message


def validate_launch(config: LaunchConfig, gpu, settings=None, bands: bool = False) -> List[Plan]:
    """Fail before any process is spawned if the flags or a layer of the checkpoint cannot run MXFP8 on ``gpu``: the
    same plans ``sglang-mxfp8 doctor`` prints (band kernels never make a layer fail, so they are probed only where
    ``bands`` asks: which kernels the launch builds depends on them). Returns those plans (none where the checkpoint
    is not an MXFP8 one this package reads)."""
    try:
        registry.check_flag("linear", gpu, config.dense_flag, settings)
        path = Path(config.model_path or "")
        if not (path / "config.json").is_file():
            return []
        if checkpoint.has_experts(path):
            registry.check_flag("moe", gpu, config.moe_flag, settings)
        if checkpoint.detect_checkpoint(path) is None:  # --quantization mxfp8 on a BF16 checkpoint: SGLang's own
            return []
        try:
            plans = registry.plan_checkpoint(path, gpu, config.dense_flag, config.moe_flag, config.tp, config.ep,
                                             settings, bands=bands)
        except (OSError, ValueError, RuntimeError):  # unreadable weights: SGLang's loader says what is wrong with them
            return []
        for what, plan in plans:
            if isinstance(plan, str):
                raise Mxfp8ConfigError(plan)
        return [plan for _, plan in plans]
    except Mxfp8ConfigError as e:
        raise Mxfp8LaunchError(str(e)) from None


_BUILDING: Dict[str, subprocess.Popen] = {}  # kernel name -> the build process this launcher started for it
ANY_BATCH = 1 << 20  # more tokens than any server's batch: every band a plan has


def start_launch_builds() -> Optional[subprocess.Popen]:
    """Before SGLang's server_args module executes in the launching process: start the JIT builds an MXFP8 launch on
    this GPU will need, which :func:`moe_kernel_config` would start only after SGLang's imports and most of its
    argument resolution (28 s after the process started, on a fresh H100 machine). Never fails the launch: a command
    line this cannot read, or a launch that will be refused, is left to SGLang's parse and :func:`validate_launch`."""
    if LAUNCHER_ENV in os.environ:  # SGLang's scheduler and other children see the launcher's command line too
        return None
    try:
        config = LaunchConfig.from_argv(sys.argv[1:])
        if config is None or not config.model_path or not config.is_mxfp8():
            return None
        os.environ[LAUNCHER_ENV] = str(os.getpid())
        from ..platform import visible_gpu

        gpu = visible_gpu()
        return start_prebuilds(validate_launch(config, gpu, bands=True)) if gpu is not None else None
    except Mxfp8LaunchError:
        return None
    except Exception as e:  # noqa: BLE001 - the builds then start after SGLang's argument parsing, as without this
        logger.warning("sglang_mxfp8: could not start the JIT builds before SGLang's imports (%s); they start after "
                       "its argument parsing", error_line(e, 200))
        return None


def start_prebuilds(plans: List[Plan]) -> Optional[subprocess.Popen]:
    """Start the CPU-only JIT builds of the planned kernels that serve some batch (FlashInfer modules compiled into
    its cache; a base kernel whose batches all went to band kernels runs nothing and needs none) in a process of their
    own (:mod:`sglang_mxfp8.kernels.jit_builds`), so that they overlap SGLang's start-up and model load instead of
    following them; kernels this launcher already started are left to that process. The scheduler process loading a
    module still being built waits on FlashInfer's file lock for it."""
    from ..platform import cuda_arch_list

    serving = (e.kernel for plan in plans for e, _, _ in plan.ranges(ANY_BATCH))
    names = [k.name for k in with_jit_modules(serving) if k.name not in _BUILDING]
    if not names:
        return None
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", **{LAUNCHER_ENV: str(os.getpid())})
    env.setdefault("FLASHINFER_CUDA_ARCH_LIST", cuda_arch_list())
    process = subprocess.Popen([sys.executable, "-m", "sglang_mxfp8.kernels.jit_builds", *names], env=env,
                               start_new_session=True)
    _BUILDING.update(dict.fromkeys(names, process))
    return process


def keeps_our_moe_backend(config: LaunchConfig, gpu) -> bool:
    """Whether SGLang's MoE-kernel step must keep the MoE flag as given (this package's kernels run it), rather than
    choose for its own MXFP8 MoE: the registry's answer for this GPU; without a GPU to ask, the flags ours serve."""
    if gpu is None:
        return config.moe_flag in ("flashinfer_cutlass", "triton")
    return bool(registry.table("moe", gpu).entries(config.moe_flag)) and not registry.native(
        "moe", gpu, config.moe_flag
    )


def moe_kernel_config(config: LaunchConfig, stock: Callable[[], None], stock_unquantized: Callable[[], None]) -> None:
    """SGLang's MoE-kernel step of server-argument resolution, for MXFP8: check the launch (one line, exit 1), and keep
    the MoE backends our kernels serve by running SGLang's step as for an unquantized MoE (``stock_unquantized``)."""
    try:
        if not config.is_mxfp8():
            return stock()
        check_complete()
    except (checkpoint.CheckpointError, PatchTargetMissing) as e:  # MXFP8 that cannot be served here
        raise Mxfp8LaunchError(str(e)) from None
    from ..platform import visible_gpu

    gpu = visible_gpu()
    if gpu is not None:
        start_prebuilds(validate_launch(config, gpu, bands=True))
    if not keeps_our_moe_backend(config, gpu):
        return stock()
    # SGLang's MXFP8 rewrite and its ModelOpt-only flashinfer_cutlass assert describe its own
    # kernels; ours run these backends, so SGLang checks the rest as for an unquantized MoE.
    return stock_unquantized()
