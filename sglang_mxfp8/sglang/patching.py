"""How a patch changes SGLang: one attribute replaced once (idempotent across repeated imports), or one warning
naming what this SGLang lacks; and the record of each patch as APPLIED, MISSING or KEPT.

A patch whose target is found nowhere is left out with one warning naming the SGLang version and the attribute:
SGLang then serves every other model as shipped, and an MXFP8 checkpoint is refused with that line
(:func:`check_complete`).
"""

from __future__ import annotations

import inspect
import logging
import sys
from types import ModuleType
from typing import Callable, Dict, List

from .. import SUPPORTED_SGLANG
from ..compat import sglang_version

logger = logging.getLogger("sglang_mxfp8")

APPLIED: Dict[str, str] = {}  # patch name -> "module.attribute" it replaced
MISSING: Dict[str, str] = {}  # patch name -> why it could not be applied (its warning line)
KEPT: Dict[str, str] = {}  # patch name -> why SGLang's own piece is used instead (this SGLang already does it)
_QUEUED: Dict[str, List[Callable[[], None]]] = {}  # module being imported -> patches waiting for it
_READY = set()  # modules whose import reached run_queued: what the patches need is defined


class PatchTargetMissing(RuntimeError):
    """This SGLang lacks what a patch replaces, so MXFP8 checkpoints cannot be served on it (one line)."""


def target(owner, attr: str, patch: str):
    """``owner.attr``, or None where this SGLang moved it (:func:`missing` says so)."""
    if owner is not None and hasattr(owner, attr):
        return getattr(owner, attr)
    name = getattr(owner, "__name__", type(owner).__name__) if owner is not None else "its module"
    missing(patch, f"has no {name}.{attr}")
    return None


def missing(patch: str, what: str) -> None:
    if patch not in MISSING:
        MISSING[patch] = (
            f"sglang_mxfp8 patch {patch!r}: sglang {sglang_version()} {what} (tested with sglang "
            f"{SUPPORTED_SGLANG}); MXFP8 checkpoints cannot be served on this SGLang, other models run as "
            "SGLang ships them"
        )
        logger.warning(MISSING[patch])


def after_import_of(module: str, apply: Callable[[], None]) -> bool:
    """Whether a patch that needs ``module`` can run now. Not while ``module`` is being imported (its own import of
    SGLang ran the hook that applies the patch): ``apply`` then waits for :func:`run_queued`, which ``module`` calls
    at its end."""
    spec = getattr(sys.modules.get(module), "__spec__", None)
    if module in _READY or not getattr(spec, "_initializing", False):
        return True
    _QUEUED.setdefault(module, []).append(apply)
    return False


def run_queued(module: str) -> None:
    """Apply the patches that waited for ``module``'s import to complete."""
    _READY.add(module)
    for apply in _QUEUED.pop(module, []):
        apply()


def check_complete() -> None:
    """Refuse to serve MXFP8 where a patch could not be applied to this SGLang (its one line)."""
    if MISSING:
        raise PatchTargetMissing(next(iter(MISSING.values())))


def replace(owner, attr: str, patch: str, make: Callable) -> None:
    """Replace ``owner.attr`` by ``make(original)`` once (idempotent across repeated imports)."""
    if owner is None:  # its class is missing: target() said so already
        return
    original = target(owner, attr, patch)
    if original is None or getattr(original, "__sglang_mxfp8_patch__", None) == patch:
        return
    new = make(original)
    new.__sglang_mxfp8_patch__ = patch
    if isinstance(inspect.getattr_static(owner, attr), staticmethod):
        new = staticmethod(new)  # class attribute lookups then return the marked function itself
    setattr(owner, attr, new)
    where = owner.__name__ if isinstance(owner, ModuleType) else f"{owner.__module__}.{owner.__qualname__}"
    APPLIED[patch] = f"{where}.{attr}"
