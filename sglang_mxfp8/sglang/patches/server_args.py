"""``server_args.*``: the launch's JIT builds started before SGLang's imports, and SGLang's MoE-kernel step of
server-argument resolution kept for the MoE flags this package's kernels serve. Up to 0.5.17 the step is
``ServerArgs._handle_moe_kernel_config``; from 0.5.20 a resolution hook of that name."""

from __future__ import annotations

import functools

from ..launch import LaunchConfig, moe_kernel_config
from ..launch import start_launch_builds  # noqa: F401 - the server_args.launch_builds patch
from ..patching import APPLIED, missing, replace, target

MOE_KERNEL_STEP = "handle_moe_kernel_config"  # SGLang >= 0.5.20: the resolution step that replaced the method
PATCH = "server_args.moe_kernel_config"


def keep_moe_kernel_config() -> None:
    from sglang.srt import server_args

    from ...compat import sglang_module

    cls = target(server_args, "ServerArgs", PATCH)
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

                return moe_kernel_config(LaunchConfig.from_server_args(self), lambda: original(self), unquantized)

            return _handle_moe_kernel_config

        replace(cls, "_handle_moe_kernel_config", PATCH, make)
        return
    hooks = sglang_module("sglang.srt.arg_groups.resolution_hooks")
    if hooks is None or not hasattr(hooks, "register_resolution_hook"):
        missing(PATCH, "has neither ServerArgs._handle_moe_kernel_config nor resolution hooks")
        return
    if PATCH in APPLIED:
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

        moe_kernel_config(LaunchConfig.from_server_args(view), lambda: previous(server_args), unquantized)

    hooks.register_resolution_hook(MOE_KERNEL_STEP)(handle_moe_kernel_config)
    APPLIED[PATCH] = f"sglang.srt.arg_groups.resolution_hooks[{MOE_KERNEL_STEP!r}]"
