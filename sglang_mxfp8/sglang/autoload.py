"""Startup hook run by ``sglang_mxfp8.pth`` in every interpreter.

It imports nothing heavy, since every Python start in the environment pays for it (not ``importlib.abc``, not
``logging``; 2.1 ms per Python start in an editable install, measured on the CPU): it only installs an import hook that applies
:mod:`sglang_mxfp8.sglang.plugin`'s patches right after SGLang's own modules finish importing, so the scheduler process
that SGLang spawns gets them too. ``SGLANG_MXFP8_DISABLE=1`` turns everything off.
"""

import os
import sys

from sglang_mxfp8 import DISABLE_ENV, parse_switch

# Module whose import triggers patching -> the plugin function that patches it (plugin.MOVED: where releases keep them).
WATCHED = {
    "sglang.srt.server_args": "patch_server_args",
    "sglang.srt.configs.model_config": "patch_model_config",
    "sglang.srt.layers.quantization": "patch_quantization",
    "sglang.srt.model_loader.loader": "patch_loader",
    "sglang.srt.layers.moe.fused_moe_triton.fused_moe_triton_config": "patch_moe_configs",  # <= 0.5.10.post1
    "sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe_triton_config": "patch_moe_configs",  # >= 0.5.11
    "sglang.srt.model_executor.model_runner": "patch_model_runner",
}
# Watched module -> the plugin function run before it executes. SGLang's launchers import server_args before they
# parse the command line (``python -m sglang.launch_server`` first of all): the JIT builds start before its imports.
BEFORE = {"sglang.srt.server_args": "start_launch_builds"}


def disabled() -> bool:
    return parse_switch(os.environ.get(DISABLE_ENV)) is True


def _run_patch(module_name: str) -> None:
    from sglang_mxfp8.sglang import plugin

    plugin.apply(WATCHED[module_name])


def _run_before(module_name: str) -> None:
    if module_name in BEFORE:
        from sglang_mxfp8.sglang import plugin

        getattr(plugin, BEFORE[module_name])()


class _PatchingLoader:
    """The watched module's own loader, with its BEFORE function run before the module executes and its patch after
    (the import system needs only create_module and exec_module of a loader)."""

    def __init__(self, loader, name):
        self._loader = loader
        self._name = name

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        _run_before(self._name)
        self._loader.exec_module(module)
        _run_patch(self._name)

    def __getattr__(self, item):  # get_code, is_package, get_resource_reader, ...
        return getattr(self._loader, item)


class SglangImportHook:
    """Wraps the loader of each watched SGLang module so its patch runs after it executes."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in WATCHED:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, fullname)
                return spec
        return None


def install() -> None:
    if disabled() or any(isinstance(f, SglangImportHook) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, SglangImportHook())
    for name in WATCHED:  # imported before the hook existed (e.g. python -c with a late .pth)
        if name in sys.modules:
            _run_patch(name)


install()
