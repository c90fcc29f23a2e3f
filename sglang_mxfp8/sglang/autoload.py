"""Startup hook run by ``sglang_mxfp8.pth`` in every interpreter.

It imports nothing heavy, since every Python start in the environment pays for it (not ``importlib.abc``, not
``logging``): it only installs an import hook that applies :mod:`sglang_mxfp8.sglang.patches` right after the SGLang
modules they watch finish importing (one, before), so the scheduler process that SGLang spawns gets them too.
``SGLANG_MXFP8_DISABLE=1`` turns everything off.
"""

import os
import sys

from sglang_mxfp8 import DISABLE_ENV, parse_switch
from sglang_mxfp8.sglang import patches  # the named patches and the SGLang modules they watch; imports nothing heavy

WATCHED = patches.WATCHED


def disabled() -> bool:
    return parse_switch(os.environ.get(DISABLE_ENV)) is True


class _PatchingLoader:
    """The watched module's own loader, with its patches run around the module's execution (those marked ``before``
    first; the import system needs only create_module and exec_module of a loader)."""

    def __init__(self, loader, name):
        self._loader = loader
        self._name = name

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        patches.before_import(self._name)
        self._loader.exec_module(module)
        patches.after_import(self._name)

    def __getattr__(self, item):  # get_code, is_package, get_resource_reader, ...
        return getattr(self._loader, item)


class SglangImportHook:
    """Wraps the loader of each watched SGLang module so its patches run when it executes."""

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
            patches.after_import(name)


install()
