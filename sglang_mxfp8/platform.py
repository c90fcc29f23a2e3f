"""What this process runs on: the GPU, and which optional kernel libraries import (each probe cached).

Nothing here imports SGLang; torch is imported only by the probes that need it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Optional, Tuple

from . import error_line

SM100_FAMILY = (100, 103, 107)
SM120_FAMILY = (120, 121)


@dataclass(frozen=True)
class GpuSpec:
    name: str
    sm: int  # major * 10 + minor

    @property
    def label(self) -> str:
        return f"{self.name} (SM{self.sm})"

    @property
    def arch(self) -> str:
        """The registry's architecture key: sm90, sm100 (100/103/107), sm110, sm120 (120/121), or other."""
        if self.sm == 90:
            return "sm90"
        if self.sm in SM100_FAMILY:
            return "sm100"
        if self.sm == 110:
            return "sm110"
        if self.sm in SM120_FAMILY:
            return "sm120"
        return "other"

    @classmethod
    def from_capability(cls, name: str, capability: Tuple[int, int]) -> "GpuSpec":
        return cls(name=name, sm=capability[0] * 10 + capability[1])


@functools.lru_cache(maxsize=None)
def visible_gpu() -> Optional[GpuSpec]:
    """The current CUDA device, or None without one."""
    import torch

    if not torch.cuda.is_available():
        return None
    dev = torch.cuda.current_device()
    return GpuSpec.from_capability(torch.cuda.get_device_name(dev), torch.cuda.get_device_capability(dev))


def cuda_arch_list() -> str:
    """``FLASHINFER_CUDA_ARCH_LIST`` naming what FlashInfer targets where it is unset (the capability of every visible
    GPU), for a build process that sees no GPU: FlashInfer names its cache folder after it, so the modules it builds
    are the ones a server on these GPUs loads."""
    import torch

    return " ".join(sorted({"%d.%d" % torch.cuda.get_device_capability(d) for d in range(torch.cuda.device_count())}))


def multiprocessors(device=None) -> int:
    """Streaming multiprocessors of a CUDA device (default: the current one); DeepGEMM-style tile heuristics count
    waves in them."""
    import torch

    props = torch.cuda.get_device_properties(torch.cuda.current_device() if device is None else device)
    return props.multi_processor_count


def current_gpu() -> GpuSpec:
    gpu = visible_gpu()
    if gpu is None:
        raise RuntimeError("sglang_mxfp8: no CUDA GPU is visible; MXFP8 kernels need Hopper (SM90) or Blackwell")
    return gpu


@functools.lru_cache(maxsize=None)
def flashinfer_available() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


_SERVER_LIBRARIES = False  # planning for another machine's server: FlashInfer there, as SGLang installs it


def flashinfer_missing() -> Optional[str]:
    if _SERVER_LIBRARIES or flashinfer_available():
        return None
    return "FlashInfer is not installed (pip install flashinfer-python)"


@contextlib.contextmanager
def as_on_a_server():
    """Plans for a GPU this machine does not have (``doctor --gpu``, the demo's CPU path) take the libraries a stock
    ``pip install sglang`` brings there: FlashInfer, which SGLang depends on. Optional ones (deep_gemm) stay as
    probed."""
    global _SERVER_LIBRARIES
    previous, _SERVER_LIBRARIES = _SERVER_LIBRARIES, True
    try:
        yield
    finally:
        _SERVER_LIBRARIES = previous


def load_deep_gemm() -> ModuleType:
    """``deep_gemm``, imported after FlashInfer's GEMM module. On the H200 a process that loaded deep_gemm before
    FlashInfer (or SGLang's FP8 layers, which import it) died with a segmentation fault in DeepGEMM's first kernel
    compile, inside the std::regex of its include parser; loaded after either, the same GEMM ran
    (seen on the H200). Where deep_gemm is not installed it fails
    at once, without FlashInfer's import (seconds on a CPU-only machine running doctor)."""
    if "deep_gemm" not in sys.modules and importlib.util.find_spec("deep_gemm") is None:
        raise ModuleNotFoundError("No module named 'deep_gemm'", name="deep_gemm")
    try:
        import flashinfer.gemm  # noqa: F401
    except ImportError:  # no FlashInfer: nothing to order
        pass
    import deep_gemm

    return deep_gemm


def deep_gemm_or_why() -> Tuple[Optional[ModuleType], Optional[str]]:
    """(``deep_gemm``, None) where it imports (through :func:`load_deep_gemm`), else (None, why not in one line)."""
    try:
        return load_deep_gemm(), None
    except Exception as e:  # noqa: BLE001 - not installed, or built for another CUDA: fall back, say why
        return None, f"deep_gemm does not import ({error_line(e)})"


def _takes(fn, keyword: str) -> bool:
    """Whether ``fn`` takes ``keyword``: a Python wrapper's signature (the sgl-deep-gemm wheel) or a binding's
    docstring, which holds its signature (a source build's pybind functions)."""
    try:
        if keyword in inspect.signature(fn).parameters:
            return True
    except (TypeError, ValueError):  # a builtin without a signature
        pass
    return keyword in (fn.__doc__ or "")


def deep_gemm_missing(api: str, needs: str = "") -> Optional[str]:
    """Why ``deep_gemm`` cannot serve ``api`` here (not importable, no such function, or it takes no ``needs``
    keyword), or None."""
    deep_gemm, why = deep_gemm_or_why()
    if why:
        return why
    fn = getattr(deep_gemm, api, None)
    if fn is None or (needs and not _takes(fn, needs)):
        return f"deep_gemm {getattr(deep_gemm, '__version__', '?')} has no {api}" + (f" with {needs}" if needs else "")
    return None
