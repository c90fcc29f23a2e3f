"""The package's environment settings, read once per process into one frozen :class:`Settings`.

- ``SGLANG_MXFP8_DISABLE=1``: no patch is applied; SGLang runs exactly as shipped.
- ``SGLANG_MXFP8_DISABLED_KERNELS=gemv,cublas,...``: kernels the registry must not pick (names:
  ``sglang-mxfp8 doctor`` lists them; unknown names are reported when a plan is made).
- ``SGLANG_MXFP8_PRECOMPILE=0``: compile no kernel while the model loads (the first batch of each new
  tile config then waits for its compiler).
- ``SGLANG_MXFP8_DIRECT_COPIES=0``: every tensor of every load goes through SGLang's loaders (by default a refit
  copies each MXFP8 tensor straight where an earlier load put it: :mod:`.sglang.direct`).
- ``SGLANG_MXFP8_COMPILE_JOBS=N``: concurrent nvcc processes for the kernels compiled while the model loads
  (default: one per CPU; 0: leave them to FlashInfer, which compiles one after another).
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, field
from typing import FrozenSet, Mapping, Optional, Tuple

from . import DISABLE_ENV, parse_switch

logger = logging.getLogger("sglang_mxfp8")

DISABLED_KERNELS_ENV = "SGLANG_MXFP8_DISABLED_KERNELS"
PRECOMPILE_ENV = "SGLANG_MXFP8_PRECOMPILE"
COMPILE_JOBS_ENV = "SGLANG_MXFP8_COMPILE_JOBS"
DIRECT_COPIES_ENV = "SGLANG_MXFP8_DIRECT_COPIES"

@dataclass(frozen=True)
class Settings:
    disabled: bool = False
    disabled_kernels: FrozenSet[str] = frozenset()
    precompile: bool = True
    compile_jobs: Optional[int] = None  # None: one per CPU
    direct_copies: bool = True
    warnings: Tuple[str, ...] = field(default=(), compare=False)  # one per unusable switch

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "Settings":
        kernels = _names(env.get(DISABLED_KERNELS_ENV, ""))
        precompile = parse_switch(env.get(PRECOMPILE_ENV)) is not False
        notes = []
        jobs = env.get(COMPILE_JOBS_ENV, "").strip()
        if jobs and not jobs.isdigit():
            notes.append(f"{COMPILE_JOBS_ENV}={jobs!r} is not a number of processes (0, 1, 2, ...); using one per CPU")
        return cls(disabled=parse_switch(env.get(DISABLE_ENV)) is True, disabled_kernels=frozenset(kernels),
                   precompile=precompile,
                   compile_jobs=int(jobs) if jobs.isdigit() else None,
                   direct_copies=parse_switch(env.get(DIRECT_COPIES_ENV)) is not False, warnings=tuple(notes))


def _names(value: str) -> set:
    return {name.strip() for name in value.split(",") if name.strip()}


@functools.lru_cache(maxsize=None)
def current() -> Settings:
    """This process's settings (read from the environment on first use; ``current.cache_clear()`` re-reads)."""
    settings = Settings.from_env(os.environ)
    for note in settings.warnings:
        logger.warning("sglang_mxfp8: %s", note)
    return settings
