"""This package's builds of FlashInfer's SM90 JIT modules, derived from the installed FlashInfer's own sources.

- ``blockscale_gemm``: FlashInfer's FP8 block-scale GEMM source with its DeepGEMM path alone (both modules below
  compile it).
- ``fused_moe``: FlashInfer's CUTLASS fused MoE reduced to the one runner its FP8 block-scale mode constructs.
- ``tile_configs``: FlashInfer's DeepGEMM tile heuristic and kernel generator restated, so the kernels a layer
  shape can select compile concurrently at load instead of one by one in a served batch.

Each derivation was checked against the FlashInfer releases in :data:`CHECKED_VERSIONS`, the oldest and newest that
SGLang's supported range installs (the CPU tests run against both). On any other FlashInfer the trimmed builds give
way to FlashInfer's own, with one log line saying so; ``tile_configs`` checks the sources it restates by digest.
"""

from __future__ import annotations

import functools
import importlib.metadata
from typing import Optional

CHECKED_VERSIONS = ("0.6.7.post3", "0.7.2")  # SGLang 0.5.10.post1 installs the first, 0.5.23 the second


def installed_version() -> Optional[str]:
    """The installed flashinfer-python's version, or None where there is none."""
    try:
        return importlib.metadata.version("flashinfer-python")
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=1)
def unchecked() -> Optional[str]:
    """Why the trimmed builds give way to FlashInfer's own here (its version not one they were checked against), as one
    line; None where they serve."""
    version = installed_version()
    if version is None or version in CHECKED_VERSIONS:
        return None
    return (f"FlashInfer {version} is not a release sglang_mxfp8's trimmed builds were checked against "
            f"({', '.join(CHECKED_VERSIONS)})")
