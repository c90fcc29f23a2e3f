"""What GPU and which optional kernels libraries this process has (cached, cheap to call)."""

from __future__ import annotations

import functools
import importlib.util
from typing import Optional

from .resolver import GpuSpec


@functools.lru_cache(maxsize=None)
def visible_gpu() -> Optional[GpuSpec]:
    """The current CUDA device, or None without one."""
    import torch

    if not torch.cuda.is_available():
        return None
    dev = torch.cuda.current_device()
    return GpuSpec.from_capability(torch.cuda.get_device_name(dev), torch.cuda.get_device_capability(dev))


def current_gpu() -> GpuSpec:
    gpu = visible_gpu()
    if gpu is None:
        raise RuntimeError("sglang_mxfp8: no CUDA GPU is visible; MXFP8 kernels need Hopper (SM90) or Blackwell")
    return gpu


@functools.lru_cache(maxsize=None)
def flashinfer_available() -> bool:
    return importlib.util.find_spec("flashinfer") is not None
