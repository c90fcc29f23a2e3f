"""Every change sglang_mxfp8 makes to SGLang, as named patches, one module per SGLang module they touch.

Applied by the startup hook (:mod:`..autoload`) right after each watched SGLang module is imported (SGLang
0.5.10.post1 has no plugin system, and newer SGLang loads its plugins after the launcher has resolved the server
arguments), and again, idempotently, by :func:`register` (the ``sglang.srt.plugins`` entry point). Each patch finds
its target where the running SGLang keeps it (:mod:`..compat`); one whose target is found nowhere is left out with one
warning, SGLang serves every other model as shipped, and MXFP8 checkpoints are refused with that line
(:mod:`..patching`). A SGLang outside the tested range gets one warning naming the range.

Importing this package is cheap (every Python start in the environment reads it, through the startup hook): a
patch's code is imported when it runs (:mod:`..compat`, imported here, imports nothing Python has not already).
"""

from ...compat import MOVED


class Patch:
    """A named change to SGLang: the SGLang modules whose import applies it (``modules``, each release's location),
    the attributes it changes (``targets``, ``module:attribute.path``, any one of which a tested SGLang has), and where
    its code is (``apply``, ``submodule:function`` of this package). ``before``: it runs before its module executes,
    not after."""

    __slots__ = ("name", "modules", "targets", "apply", "before", "doc")

    def __init__(self, name, modules, targets, apply, doc, before=False):
        self.name, self.modules, self.targets, self.apply, self.doc, self.before = (name, modules, targets, apply,
                                                                                    doc, before)

    def run(self) -> None:
        import importlib

        submodule, function = self.apply.split(":")
        getattr(importlib.import_module(f"{__name__}.{submodule}"), function)()

    def __repr__(self) -> str:
        return f"Patch({self.name!r})"


SERVER_ARGS = ("sglang.srt.server_args",)
MODEL_CONFIG = ("sglang.srt.configs.model_config",)
QUANTIZATION = ("sglang.srt.layers.quantization",)
LOADER = ("sglang.srt.model_loader.loader",)
LOADER_UTILS = ("sglang.srt.model_loader.utils",)
MOE_CONFIG = MOVED["moe_config"]
MODEL_RUNNER = ("sglang.srt.model_executor.model_runner",)
WEIGHT_UPDATES = tuple(f"{where}.update_weights_from_disk" for where in MOVED["weight_updates"])

PATCHES = (
    Patch("server_args.launch_builds", SERVER_ARGS, ("sglang.srt.server_args:ServerArgs",),
          "server_args:start_launch_builds", before=True,
          doc="the launcher of an MXFP8 checkpoint starts the JIT builds its plans need, in a process of their own, "
              "before SGLang's imports"),
    Patch("server_args.moe_kernel_config", SERVER_ARGS,
          ("sglang.srt.server_args:ServerArgs._handle_moe_kernel_config",  # <= 0.5.17
           "sglang.srt.arg_groups.resolution_hooks:register_resolution_hook"),  # >= 0.5.20
          "server_args:keep_moe_kernel_config",
          doc="MXFP8 with a MoE flag our kernels serve is kept, not rewritten to SGLang's own MXFP8 MoE; impossible "
              "flag / GPU / layer combinations stop the launch with one line"),
    Patch("model_config.modelopt_mxfp8", MODEL_CONFIG,
          ("sglang.srt.configs.model_config:ModelConfig._parse_modelopt_quant_config",),
          "model_config:read_modelopt_mxfp8", doc="ModelOpt quant_algo MXFP8 is MXFP8, not per-tensor FP8"),
    Patch("model_config.mxfp8_notice", MODEL_CONFIG,
          ("sglang.srt.configs.model_config:ModelConfig._verify_quantization",),
          "model_config:say_what_serves_mxfp8",
          doc="SGLang's note that its MXFP8 path is not fully optimized gives way to one saying these kernels serve "
              "it"),
    Patch("quantization.mxfp8_config", QUANTIZATION, ("sglang.srt.layers.quantization:QUANTIZATION_METHODS",),
          "quantization:register_config", doc="QUANTIZATION_METHODS['mxfp8'] is our Mxfp8Config (minimum "
                                              "capability 90, our linear and MoE methods)"),
    Patch("quantization.dense_dispatch", QUANTIZATION,
          ("sglang.srt.layers.quantization.fp8_utils:dispatch_w8a8_mxfp8_linear",),
          "quantization:route_dense_dispatch", doc="SGLang's MXFP8 dense dispatch answers with our plan"),
    Patch("loader.modelopt_mxfp8_file", LOADER, ("sglang.srt.model_loader.loader:get_quant_config",),
          "loader:read_hf_quant_config",
          doc="a ModelOpt MXFP8 checkpoint described only by hf_quant_config.json gets Mxfp8Config"),
    Patch("loader.conversion_report", LOADER,
          ("sglang.srt.model_loader.loader:DefaultModelLoader.load_weights_and_postprocess",),
          "loader:report_each_load", doc="an MXFP8 model's refits copy each tensor straight where an earlier load put "
                                         "it; after each (re)load: what conversion changed, and whether every MXFP8 "
                                         "tensor kept its storage"),
    Patch("loader.pinned_refit_reads", LOADER,
          ("sglang.srt.model_loader.loader:buffered_multi_thread_safetensors_weights_iterator",
           "sglang.srt.model_loader.loader:safetensors_weights_iterator"), "loader:read_refits_pinned",
          doc="a refit of an MXFP8 model from disk reads its safetensors files straight into page-locked memory, "
              "several tensors ahead of the loader"),
    Patch("loader_utils.default_dtype_restored", LOADER_UTILS,
          ("sglang.srt.model_loader.utils:set_default_torch_dtype",), "loader_utils:restore_default_dtype_on_error",
          doc="a load that raises leaves torch's default dtype as it was (torch.compile guards on it: a refused refit "
              "must not recompile the piecewise CUDA graphs)"),
    Patch("moe_config.tuned", MOE_CONFIG, tuple(f"{m}:get_moe_configs" for m in MOE_CONFIG),
          "moe_config:use_tuned_configs",
          doc="the Triton fused-MoE tile configs this package measured for the running Triton, where SGLang ships "
              "none for it"),
    Patch("model_runner.refit_rollback", MODEL_RUNNER, WEIGHT_UPDATES, "model_runner:roll_back_failed_refits",
          doc="a failed /update_weights_from_disk rolls back to the checkpoint being served and answers "
              "success: false naming the tensor"),
    Patch("model_runner.tensor_update_postprocess", MODEL_RUNNER,
          ("sglang.srt.model_executor.model_runner:ModelRunner.forward",), "model_runner:postprocess_tensor_updates",
          doc="weights that arrive other than from disk (RL weight sync) are post-processed before the next forward"),
)

# watched SGLang module -> its patches, in PATCHES' order (the startup hook's list)
WATCHED = {}
for _patch in PATCHES:
    for _module in _patch.modules:
        WATCHED.setdefault(_module, []).append(_patch)
del _patch, _module


def run(patch: Patch) -> None:
    """Apply ``patch``. Where this SGLang moved what it imports or replaces, SGLang stays as shipped with one warning,
    instead of its own import failing (BF16 models keep serving)."""
    from ... import error_line
    from ...compat import warn_if_untested
    from ..patching import missing

    warn_if_untested()
    try:
        patch.run()
    except (ImportError, AttributeError) as e:
        missing(patch.name, f"fails it ({error_line(e, 160)})")


def before_import(module_name: str) -> None:
    for patch in WATCHED.get(module_name, ()):
        if patch.before:
            run(patch)


def after_import(module_name: str) -> None:
    for patch in WATCHED.get(module_name, ()):
        if not patch.before:
            run(patch)


def register() -> None:
    """Entry point (``sglang.srt.plugins``) for SGLang versions with a plugin system; idempotent after the startup
    hook."""
    from ...settings import current

    if current().disabled:
        return
    for patch in PATCHES:
        if not patch.before:
            run(patch)
