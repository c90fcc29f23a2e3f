"""``loader_utils.default_dtype_restored``: SGLang's ``set_default_torch_dtype`` restores torch's default dtype even
when its block raises.

SGLang 0.5.10.post1 to 0.5.17 restore it only when the block returns. A refit whose load and SGLang's own rollback
both fail raises through it, leaving the model dtype as torch's default; torch.compile guards on the default dtype, so
the next forward under piecewise CUDA graphs recompiles, and its fresh graphs try to capture outside SGLang's capture
(the scheduler dies on "PCG capture stream is not set"). Newer SGLang restores it in a ``finally``: kept.
"""

from __future__ import annotations

import contextlib
import functools
import sys

import torch

from ..patching import KEPT, replace, target

PATCH = "loader_utils.default_dtype_restored"


class _Probe(Exception):
    pass


def restores_on_error(set_default_torch_dtype) -> bool:
    """Whether ``set_default_torch_dtype`` puts the default dtype back when its block raises."""
    before = torch.get_default_dtype()
    try:
        with set_default_torch_dtype(torch.float64 if before != torch.float64 else torch.float16):
            raise _Probe
    except _Probe:
        pass
    restored = torch.get_default_dtype() == before
    torch.set_default_dtype(before)
    return restored


def restore_default_dtype_on_error() -> None:
    from sglang.srt.model_loader import utils

    original = target(utils, "set_default_torch_dtype", PATCH)
    if original is None or getattr(original, "__sglang_mxfp8_patch__", None) == PATCH:
        return
    if restores_on_error(original):
        KEPT[PATCH] = "SGLang's set_default_torch_dtype restores the default dtype in a finally"
        return

    def make(original):
        @functools.wraps(original)
        @contextlib.contextmanager
        def set_default_torch_dtype(dtype: torch.dtype):
            old = torch.get_default_dtype()
            torch.set_default_dtype(dtype)
            try:
                yield
            finally:
                torch.set_default_dtype(old)

        return set_default_torch_dtype

    replace(utils, "set_default_torch_dtype", PATCH, make)
    patched = utils.set_default_torch_dtype
    for name, module in list(sys.modules.items()):  # SGLang modules imported before this patch took it by name
        if name.startswith("sglang.") and module.__dict__.get("set_default_torch_dtype") is original:
            module.set_default_torch_dtype = patched
