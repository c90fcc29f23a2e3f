"""Every change sglang_mxfp8 makes to SGLang's behaviour, as named patches.

Applied by the startup hook right after each target module is imported (SGLang 0.5.10.post1 has no
plugin system, and newer SGLang loads its plugins after the launcher has resolved the server arguments), and again,
idempotently, by :func:`register` (the ``sglang.srt.plugins`` entry point). Each patch probes where the running SGLang
keeps its target (SGLang moved several between 0.5.10.post1 and 0.5.23; :data:`MOVED` lists them). A patch whose
target is found nowhere is left out with one warning naming the SGLang version and the attribute: SGLang then serves
every other model as shipped, and an MXFP8 checkpoint is refused with that line. A SGLang outside the tested range
gets one warning naming the range, and the patches apply wherever their targets exist.

Patches:
- ``server_args.moe_kernel_config``: MXFP8 + ``--moe-runner-backend flashinfer_cutlass``/``triton``
  (and ``auto`` on Hopper) is kept instead of being rewritten to ``flashinfer_trtllm``; SGLang's
  "flashinfer_cutlass only for ModelOpt" assert does not apply to MXFP8; impossible flag/GPU
  combinations fail here with one line. Up to 0.5.17 it wraps ``ServerArgs._handle_moe_kernel_config``; from
  0.5.20 SGLang's own resolution hook for that step (``register_resolution_hook``).
- before ``server_args`` executes (:func:`start_launch_builds`, not a patch): the launcher of an MXFP8 checkpoint
  starts the JIT builds its plans need, in a process of their own, before SGLang's imports.
- ``model_config.modelopt_mxfp8``: ModelOpt ``quant_algo: MXFP8`` is MXFP8, not per-tensor FP8.
- ``quantization.mxfp8_config``: ``QUANTIZATION_METHODS["mxfp8"]`` -> :class:`Mxfp8Config`
  (minimum capability 90, our linear and MoE methods).
- ``quantization.dense_dispatch``: ``dispatch_w8a8_mxfp8_linear`` in ``fp8``/``fp8_utils`` -> ours.
- ``loader.modelopt_mxfp8_file``: a ModelOpt MXFP8 checkpoint described only by hf_quant_config.json
  gets :class:`Mxfp8Config`; SGLang's ``get_quant_config`` finds no quantization_config in config.json
  and would otherwise build an online-quantization config for it.
- ``loader.conversion_report``: log, after each (re)load, how many elements conversion changed and
  whether every MXFP8 tensor (parameters and derived buffers) kept its storage since the first load.
- ``model_runner.refit_rollback``: SGLang's ``update_weights_from_disk`` sets the new model path before
  loading, so its rollback after a failed load re-reads the *bad* checkpoint, fails again and takes the
  scheduler down. The patch rolls back to the checkpoint that was being served and answers
  ``success: false`` with the error naming the tensor.
- ``moe_config.tuned``: SGLang 0.5.10.post1 ships no Triton fused-MoE tile configs for the Triton it
  runs with (3.6) and falls back to configs tuned for Triton 3.2. Where this package ships a config
  measured on the GPU for the running Triton (``sglang_mxfp8/moe_configs/``: a tile sweep of SGLang's
  block-FP8 fused MoE on the H200; SGLang's own ``tuning_fused_moe_triton.py`` writes such files), it is used instead; a config SGLang ships for the running
  Triton, ``SGLANG_MOE_CONFIG_DIR``, deterministic inference and launches that are not MXFP8 keep
  SGLang's choice.
- ``model_runner.tensor_update_postprocess``: SGLang (0.5.10.post1 to 0.5.23) runs no post-load processing after
  ``update_weights_from_tensor`` / ``..._distributed`` / ``..._ipc`` (RL weight sync) unless the trainer calls its
  post-processing endpoint, so kernel layouts would go stale. Those calls mark the model; the next
  ``ModelRunner.forward`` (before any CUDA-graph replay) re-runs our idempotent post-processing once for all buckets
  sent since (a post-processing SGLang ran meanwhile changes nothing: it is idempotent). From 0.5.17 the weight
  updates live on ``WeightUpdater``; both this and the rollback patch follow them there.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Callable, Dict, List, Optional

from .. import SUPPORTED_SGLANG, error_line
from ..format import checkpoint
from ..kernels import registry
from ..kernels.base import Mxfp8ConfigError, Plan, with_jit_modules
from ..kernels.jit_builds import LAUNCHER_ENV
from .compat import (MOVED, sglang_version, check_tested_range, served_args, sglang_module,  # noqa: F401
                     sglang_object, warn_if_untested)

logger = logging.getLogger("sglang_mxfp8")

APPLIED: Dict[str, str] = {}  # patch name -> "module.attribute" it replaced
MISSING: Dict[str, str] = {}  # patch name -> why it could not be applied (its warning line)
KEPT: Dict[str, str] = {}  # patch name -> why SGLang's own piece is used instead (this SGLang already does it)


class PatchTargetMissing(RuntimeError):
    """This SGLang lacks what a patch replaces, so MXFP8 checkpoints cannot be served on it (one line)."""


def _target(owner, attr: str, patch: str):
    """``owner.attr``, or None where this SGLang moved it: the patch is then left out with one warning, SGLang keeps
    serving every other model as shipped, and MXFP8 checkpoints are refused with that line (:func:`check_complete`)."""
    if owner is not None and hasattr(owner, attr):
        return getattr(owner, attr)
    name = getattr(owner, "__name__", type(owner).__name__) if owner is not None else "its module"
    _missing(patch, f"has no {name}.{attr}")
    return None


def _missing(patch: str, what: str) -> None:
    if patch not in MISSING:
        MISSING[patch] = (f"sglang_mxfp8 patch {patch!r}: sglang {sglang_version()} {what} (tested with sglang "
                          f"{SUPPORTED_SGLANG}); MXFP8 checkpoints cannot be served on this SGLang, other models run as "
                          "SGLang ships them")
        logger.warning(MISSING[patch])


def apply(patch_function: str) -> None:
    """Run one ``patch_*`` function of this module. Where this SGLang moved what it imports or replaces, SGLang stays
    as shipped with one warning, instead of its own import failing (BF16 models keep serving)."""
    warn_if_untested()
    try:
        globals()[patch_function]()
    except (ImportError, AttributeError) as e:
        _missing(patch_function, f"fails it ({error_line(e, 160)})")


def check_complete() -> None:
    """Refuse to serve MXFP8 where a patch could not be applied to this SGLang (its one line)."""
    if MISSING:
        raise PatchTargetMissing(next(iter(MISSING.values())))


def _replace(owner, attr: str, patch: str, make: Callable):
    """Replace ``owner.attr`` by ``make(original)`` once (idempotent across repeated imports)."""
    if owner is None:  # its class is missing: _target said so already
        return
    original = _target(owner, attr, patch)
    if original is None or getattr(original, "__sglang_mxfp8_patch__", None) == patch:
        return
    new = make(original)
    new.__sglang_mxfp8_patch__ = patch
    if isinstance(inspect.getattr_static(owner, attr), staticmethod):
        new = staticmethod(new)  # class attribute lookups then return the marked function itself
    setattr(owner, attr, new)
    where = owner.__name__ if isinstance(owner, ModuleType) else f"{owner.__module__}.{owner.__qualname__}"
    APPLIED[patch] = f"{where}.{attr}"


# ---- server args -------------------------------------------------------------------------------

def is_mxfp8_launch(args) -> bool:
    """True when SGLang is asked to serve MXFP8: --quantization mxfp8, or a local MXFP8 checkpoint."""
    if args.quantization == "mxfp8":
        return True
    if args.quantization is None and getattr(args, "model_path", None):
        try:
            return checkpoint.detect_checkpoint(args.model_path) is not None
        except OSError:
            return False
    return False


class Mxfp8LaunchError(SystemExit):
    """A launch that cannot serve MXFP8: its one-line reason goes to stderr and the launcher exits 1, with no
    traceback (and before SGLang spawns a process that would die on it later)."""

    def __init__(self, message: str):
        super().__init__(f"sglang_mxfp8: {message}")
        self.message = message


def validate_launch(args, gpu, settings=None, bands: bool = False) -> List[Plan]:
    """Fail before any process is spawned if the flags or a layer of the checkpoint cannot run MXFP8 on ``gpu``: the
    same plans ``sglang-mxfp8 doctor`` prints (band kernels never make a layer fail, so they are probed only where
    ``bands`` asks: which kernels the launch builds depends on them). Returns those plans (none where the checkpoint
    is not an MXFP8 one this package reads)."""
    try:
        registry.check_flag("linear", gpu, args.fp8_gemm_runner_backend, settings)
        path = Path(args.model_path or "")
        if not (path / "config.json").is_file():
            return []
        if checkpoint.has_experts(path):
            registry.check_flag("moe", gpu, args.moe_runner_backend, settings)
        if checkpoint.detect_checkpoint(path) is None:  # --quantization mxfp8 on a BF16 checkpoint: SGLang's own
            return []
        tp, ep = getattr(args, "tp_size", 1) or 1, getattr(args, "ep_size", 1) or 1
        try:
            plans = registry.plan_checkpoint(path, gpu, args.fp8_gemm_runner_backend, args.moe_runner_backend, tp, ep,
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

# The server arguments a launch's builds depend on: SGLang's destination name, its option strings (0.5.10.post1 to
# 0.5.23; tests/test_plugin.py compares with SGLang's own parser), and its default.
LAUNCH_ARGS = (
    ("model_path", ("--model-path", "--model"), None),
    ("quantization", ("--quantization",), None),
    ("fp8_gemm_runner_backend", ("--fp8-gemm-backend",), "auto"),
    ("moe_runner_backend", ("--moe-runner-backend",), "auto"),
    ("tp_size", ("--tp-size", "--tensor-parallel-size"), 1),
    ("ep_size", ("--ep-size", "--expert-parallel-size", "--ep"), 1),
)


def launch_args_from_argv(argv: List[str]):
    """The few server arguments that choose a launch's JIT builds, read from its command line as SGLang's parser
    reads them, before SGLang is imported; None where they may come from elsewhere (``--config``) or cannot be read
    (SGLang's own parse then starts the builds)."""
    import argparse

    class Parser(argparse.ArgumentParser):
        def error(self, message):  # an option without its value, a size that is no number: SGLang says what is wrong
            raise ValueError(message)

    if any(arg == "--config" or arg.startswith("--config=") for arg in argv):
        return None
    parser = Parser(add_help=False)
    for dest, flags, default in LAUNCH_ARGS:
        parser.add_argument(*flags, dest=dest, default=default, type=int if isinstance(default, int) else str)
    try:
        return parser.parse_known_args(argv)[0]
    except ValueError:
        return None


def start_launch_builds() -> Optional[subprocess.Popen]:
    """Before SGLang's server_args module executes in the launching process: start the JIT builds an MXFP8 launch on
    this GPU will need, which :func:`moe_kernel_config` would start only after SGLang's imports and most of its
    argument resolution (28 s after the process started, on a fresh H100 machine). Never fails the launch: a command
    line this cannot read, or a launch that will be refused, is left to SGLang's parse and :func:`validate_launch`."""
    if LAUNCHER_ENV in os.environ:  # SGLang's scheduler and other children see the launcher's command line too
        return None
    try:
        args = launch_args_from_argv(sys.argv[1:])
        if args is None or not args.model_path or not is_mxfp8_launch(args):
            return None
        os.environ[LAUNCHER_ENV] = str(os.getpid())
        from ..platform import visible_gpu

        gpu = visible_gpu()
        return start_prebuilds(validate_launch(args, gpu, bands=True)) if gpu is not None else None
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


def _keeps_our_moe_backend(args, gpu) -> bool:
    backend = args.moe_runner_backend
    return backend in ("flashinfer_cutlass", "triton") or (backend == "auto" and gpu is not None and gpu.sm == 90)


def moe_kernel_config(args, stock: Callable[[], None], stock_unquantized: Callable[[], None]) -> None:
    """SGLang's MoE-kernel step of server-argument resolution, for MXFP8: check the launch (one line, exit 1), and keep
    the MoE backends our kernels serve by running SGLang's step as for an unquantized MoE (``stock_unquantized``)."""
    try:
        if not is_mxfp8_launch(args):
            return stock()
        check_complete()
    except (checkpoint.CheckpointError, PatchTargetMissing) as e:  # MXFP8 that cannot be served here
        raise Mxfp8LaunchError(str(e)) from None
    from ..platform import visible_gpu

    gpu = visible_gpu()
    if gpu is not None:
        start_prebuilds(validate_launch(args, gpu, bands=True))
    if not _keeps_our_moe_backend(args, gpu):
        return stock()
    # SGLang's MXFP8 rewrite and its ModelOpt-only flashinfer_cutlass assert describe its own
    # kernels; ours run these backends, so SGLang checks the rest as for an unquantized MoE.
    return stock_unquantized()


MOE_KERNEL_STEP = "handle_moe_kernel_config"  # SGLang >= 0.5.20: the resolution step that replaced the method


def patch_server_args() -> None:
    from sglang.srt import server_args

    patch = "server_args.moe_kernel_config"
    cls = _target(server_args, "ServerArgs", patch)
    if cls is None:
        return
    if hasattr(cls, "_handle_moe_kernel_config"):  # SGLang <= 0.5.17
        def make(original):
            @functools.wraps(original)
            def _handle_moe_kernel_config(self):
                def unquantized():
                    quantization, self.quantization = self.quantization, None
                    try:
                        return original(self)
                    finally:
                        self.quantization = quantization

                return moe_kernel_config(self, lambda: original(self), unquantized)

            return _handle_moe_kernel_config

        _replace(cls, "_handle_moe_kernel_config", patch, make)
        return
    hooks = sglang_module("sglang.srt.arg_groups.resolution_hooks")
    if hooks is None or not hasattr(hooks, "register_resolution_hook"):
        _missing(patch, "has neither ServerArgs._handle_moe_kernel_config nor resolution hooks")
        return
    if patch in APPLIED:
        return
    from sglang.srt.arg_groups.model_override_base import resolved_view
    from sglang.srt.arg_groups.overrides import declare_resolution

    def handle_moe_kernel_config(server_args, previous) -> None:
        view = resolved_view(server_args)

        def unquantized():
            if view.quantization is None:  # a checkpoint's own quantization_config: SGLang reads it at model load
                return previous(server_args)
            declare_resolution(server_args, "sglang_mxfp8", quantization=None)
            try:
                previous(server_args)
            finally:
                declare_resolution(server_args, "sglang_mxfp8", quantization=view.quantization)

        moe_kernel_config(view, lambda: previous(server_args), unquantized)

    hooks.register_resolution_hook(MOE_KERNEL_STEP)(handle_moe_kernel_config)
    APPLIED[patch] = f"sglang.srt.arg_groups.resolution_hooks[{MOE_KERNEL_STEP!r}]"


# ---- fused MoE tile configs --------------------------------------------------------------------

TUNED_MOE_CONFIGS = Path(__file__).parent / "moe_configs"


def tuned_moe_config(file_name: str, triton_version: str, sglang_config_dir: str) -> Optional[Path]:
    """Our measured config for SGLang's config ``file_name``, unless SGLang has one for this Triton."""
    version_dir = f"triton_{triton_version.replace('.', '_')}"
    ours = TUNED_MOE_CONFIGS / version_dir / file_name
    if not ours.is_file() or os.path.exists(os.path.join(sglang_config_dir, "configs", version_dir, file_name)):
        return None
    return ours


def with_tuned_moe_configs(original, moe_config: ModuleType):
    """SGLang's ``get_moe_configs`` (of module ``moe_config``), answering from our configs where they apply."""

    @functools.lru_cache
    @functools.wraps(original)
    def get_moe_configs(E, N, dtype, block_n=0, block_k=0, per_channel_quant=False, down_moe=False):
        args = served_args()
        if (args is not None and "SGLANG_MOE_CONFIG_DIR" not in os.environ and not args.enable_deterministic_inference
                and is_mxfp8_launch(args)):
            name = moe_config.get_config_file_name(E, N, dtype, [block_n, block_k], per_channel_quant,
                                                   down_moe=down_moe)
            version = moe_config.triton.__version__
            ours = tuned_moe_config(name, version, os.path.dirname(os.path.realpath(moe_config.__file__)))
            if ours is not None:
                logger.info("Using MoE kernel config from %s (measured with Triton %s)", ours, version)
                return {int(m): cfg for m, cfg in json.loads(ours.read_text()).items()}
        return original(E, N, dtype, block_n, block_k, per_channel_quant, down_moe)

    return get_moe_configs


def patch_moe_configs() -> None:
    """Patches the config module once SGLang has imported it (the startup hook calls this then). Importing it here
    instead would run SGLang's MoE package imports in the middle of another of its imports (a circular import on
    0.5.23); a SGLang that keeps it elsewhere uses its own configs."""
    moe_config = next((sys.modules[name] for name in MOVED["moe_config"] if name in sys.modules), None)
    if moe_config is None:
        return
    _replace(moe_config, "get_moe_configs", "moe_config.tuned",
             lambda original: with_tuned_moe_configs(original, moe_config))


# ---- model config ------------------------------------------------------------------------------

MODELOPT_MXFP8_PROBE = {"quant_method": "modelopt", "quant_algo": "MXFP8", "exclude_modules": ["lm_head"]}


def reads_modelopt_mxfp8(parse) -> bool:
    """Whether SGLang's own ``ModelConfig._parse_modelopt_quant_config`` reads ModelOpt MXFP8 as MXFP8 (0.5.23 does;
    0.5.10.post1 to 0.5.20 read it as per-tensor FP8)."""
    try:
        parsed = parse(None, dict(MODELOPT_MXFP8_PROBE))
    except Exception:  # noqa: BLE001 - a parser that needs a real ModelConfig: assume the old reading
        return False
    return isinstance(parsed, dict) and parsed.get("quant_method") == "mxfp8"


def patch_model_config() -> None:
    from sglang.srt.configs import model_config

    patch = "model_config.modelopt_mxfp8"
    cls = _target(model_config, "ModelConfig", patch)
    original = _target(cls, "_parse_modelopt_quant_config", patch) if cls is not None else None
    if original is None or getattr(original, "__sglang_mxfp8_patch__", None) == patch:
        return
    if reads_modelopt_mxfp8(original):
        KEPT[patch] = "SGLang reads ModelOpt MXFP8 itself"
        return

    def make(original):
        @functools.wraps(original)
        def _parse_modelopt_quant_config(self, quant_config_dict):
            if checkpoint.is_modelopt_mxfp8(quant_config_dict):
                return {"quant_method": "mxfp8", "quant_algo": "MXFP8"}
            return original(self, quant_config_dict)

        return _parse_modelopt_quant_config

    _replace(cls, "_parse_modelopt_quant_config", patch, make)


# ---- quantization ------------------------------------------------------------------------------

def patch_quantization() -> None:
    from sglang.srt.layers import quantization
    from sglang.srt.layers.quantization import fp8, fp8_utils

    from . import quant_methods
    from .quant_methods import Mxfp8Config

    methods = _target(quantization, "QUANTIZATION_METHODS", "quantization.mxfp8_config")
    if methods is not None and methods.get("mxfp8") is not Mxfp8Config:
        methods["mxfp8"] = Mxfp8Config
        APPLIED["quantization.mxfp8_config"] = "sglang.srt.layers.quantization.QUANTIZATION_METHODS['mxfp8']"

    def make(original):
        @functools.wraps(quant_methods.dispatch_w8a8_mxfp8_linear)
        def dispatch_w8a8_mxfp8_linear(*args, **kwargs):
            # SGLang's own zero-argument call comes only from its online-quantization path
            # (BF16 checkpoint + --quantization mxfp8, Blackwell), which keeps SGLang's kernels.
            if not args and not kwargs:
                return original()
            return quant_methods.dispatch_w8a8_mxfp8_linear(*args, **kwargs)

        return dispatch_w8a8_mxfp8_linear

    _replace(fp8_utils, "dispatch_w8a8_mxfp8_linear", "quantization.dense_dispatch", make)
    fp8.dispatch_w8a8_mxfp8_linear = fp8_utils.dispatch_w8a8_mxfp8_linear


def patch_loader() -> None:
    from sglang.srt.model_loader import loader

    from .quant_methods import ConversionReport, Mxfp8Config

    def make_quant_config(original):
        @functools.wraps(original)
        def get_quant_config(model_config, load_config, packed_modules_mapping, *args, **kwargs):
            # A ModelOpt MXFP8 checkpoint may describe itself only in hf_quant_config.json; SGLang's
            # get_quant_config would then build an *online* MXFP8 config, as for a BF16 checkpoint.
            hf_quant = Path(model_config.model_path) / "hf_quant_config.json"
            if (model_config.quantization == "mxfp8" and hf_quant.is_file()
                    and getattr(model_config.hf_config, "quantization_config", None) is None):
                cfg = json.loads(hf_quant.read_text())
                if checkpoint.is_modelopt_mxfp8(cfg):
                    return Mxfp8Config.from_config({**cfg, "packed_modules_mapping": packed_modules_mapping})
            return original(model_config, load_config, packed_modules_mapping, *args, **kwargs)

        return get_quant_config

    _replace(loader, "get_quant_config", "loader.modelopt_mxfp8_file", make_quant_config)
    cls = _target(loader, "DefaultModelLoader", "loader.conversion_report")

    def make(original):
        @functools.wraps(original)
        def load_weights_and_postprocess(model, weights, target_device):
            ConversionReport.reset()
            for module in model.modules():  # a failed load before this one may have left records behind
                tracker = getattr(module, "mxfp8_loads", None)
                if tracker is not None:
                    tracker.reset()
            original(model, weights, target_device)
            if ConversionReport.total:
                logger.info(ConversionReport.line())
            check_storage(model)

        return load_weights_and_postprocess

    _replace(cls, "load_weights_and_postprocess", "loader.conversion_report", make)


def mxfp8_tensors(model) -> dict:
    """Every tensor our methods own in ``model``: parameters, buffers and the tensors of each layer's state."""
    from .quant_methods import Mxfp8LinearMethod, Mxfp8MoEMethod

    found = {}
    for mod_name, module in model.named_modules():
        if not isinstance(getattr(module, "quant_method", None), (Mxfp8LinearMethod, Mxfp8MoEMethod)):
            continue
        for name, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            found[f"{mod_name}.{name}"] = t
        state = getattr(module, "mxfp8_state", None)
        for name, t in (state.tensors() if state is not None else ()):
            found[f"{mod_name}.mxfp8_state.{name}"] = t
    return found


def check_storage(model) -> None:
    """Log whether every MXFP8 tensor kept its storage since the first load (CUDA graphs hold pointers)."""
    now = {name: t.data_ptr() for name, t in mxfp8_tensors(model).items()}
    if not now:
        return
    first = getattr(model, "_sglang_mxfp8_storage", None)
    if first is None:
        model._sglang_mxfp8_storage = now
        logger.info("sglang_mxfp8: storage of %d MXFP8 tensors recorded at first load", len(now))
        return
    moved = [name for name, ptr in now.items() if first.get(name) != ptr]
    if moved:
        logger.warning("sglang_mxfp8: %d of %d MXFP8 tensors moved since the first load (first: %s); captured "
                       "CUDA graphs would read stale memory", len(moved), len(now), moved[0])
    else:
        logger.info("sglang_mxfp8: storage of all %d MXFP8 tensors unchanged since the first load", len(now))


def postprocess_mxfp8_modules(model) -> int:
    """Run post-load processing of every sglang_mxfp8 method in ``model``; returns how many ran."""
    from .quant_methods import ConversionReport, Mxfp8LinearMethod, Mxfp8MoEMethod

    ConversionReport.reset()
    count = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, (Mxfp8LinearMethod, Mxfp8MoEMethod)):
            method.process_weights_after_loading(module)
            count += 1
    if ConversionReport.total:
        logger.info(ConversionReport.line())
    check_storage(model)
    return count


def refit_rollback(original):
    """Wrap ``ModelRunner.update_weights_from_disk``: a failed refit reloads the checkpoint being served, and the
    served checkpoint stays the one a later rollback reloads, whether the refit raised or answered False."""

    @functools.wraps(original)
    def update_weights_from_disk(self, model_path, load_format, *args, **kwargs):
        served_path, served_format = self.model_config.model_path, _model_runner(self).server_args.load_format
        try:
            ok, message = original(self, model_path, load_format, *args, **kwargs)
            if not ok:  # refused before loading (no such folder, another loader): nothing was read, and SGLang left
                self.model_config.model_path = served_path  # the bad path as the one a later rollback re-reads
            return ok, message
        except Exception as e:  # noqa: BLE001 - SGLang's own rollback re-read model_path and failed again
            logger.error("sglang_mxfp8: refit from %s failed (%s); reloading %s", model_path, e, served_path)
            ok, message = original(self, served_path, served_format, *args, **kwargs)
            if not ok:
                raise RuntimeError(f"refit from {model_path} failed ({e}) and so did the rollback to "
                                   f"{served_path} ({message}); the weights in memory are inconsistent") from e
            return False, f"Failed to update weights: {e}. Rolled back to {served_path}."

    return update_weights_from_disk


def _model_runner(owner):
    """The ModelRunner whose weights ``owner`` (a ModelRunner, or from 0.5.17 its WeightUpdater) updates."""
    return owner.get_model_runner() if hasattr(owner, "get_model_runner") else owner


def patch_model_runner() -> None:
    from sglang.srt.model_executor import model_runner

    patch = "model_runner.tensor_update_postprocess"
    cls = _target(model_runner, "ModelRunner", patch)
    updates = sglang_object("weight_updates", has="update_weights_from_disk")

    def marking(original):
        @functools.wraps(original)
        def update(self, *args, **kwargs):
            result = original(self, *args, **kwargs)
            _model_runner(self)._sglang_mxfp8_pending = True
            return result

        return update

    def make_forward(original):
        @functools.wraps(original)
        def forward(self, *args, **kwargs):
            if getattr(self, "_sglang_mxfp8_pending", False):
                self._sglang_mxfp8_pending = False
                postprocess_mxfp8_modules(self.model)
            return original(self, *args, **kwargs)

        return forward

    _replace(updates, "update_weights_from_disk", "model_runner.refit_rollback", refit_rollback)
    _replace(updates, "update_weights_from_tensor", patch, marking)
    for name in ("update_weights_from_distributed", "load_weights_from_distributed", "update_weights_from_ipc"):
        if hasattr(updates, name):  # the ways weights arrive other than from disk, by release
            _replace(updates, name, f"{patch}.{name}", marking)
    _replace(cls, "forward", patch + ".forward", make_forward)


def register() -> None:
    """Entry point (``sglang.srt.plugins``) for SGLang versions with a plugin system; idempotent after the startup
    hook."""
    from ..settings import current

    if current().disabled:
        return
    for patch_function in ("patch_server_args", "patch_model_config", "patch_quantization", "patch_loader",
                           "patch_moe_configs", "patch_model_runner"):
        apply(patch_function)
