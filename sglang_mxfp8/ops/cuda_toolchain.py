"""What nvcc needs to build FlashInfer's JIT modules on a machine without a GPU, found where a pip install puts it.

FlashInfer's Hopper modules include cuBLAS's and NVRTC's headers and link ``-lcuda -lnvrtc``. A CUDA toolkit without
those development files (nvcc alone, as some images ship it) fails deep inside ninja; the headers and libraries often
sit in the ``nvidia-*`` pip packages torch brought along. :func:`prepare` points the compiler at them (``CPATH``,
``LIBRARY_PATH``, links named as the linker looks them up) and says, one line each, what is still missing.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Dict, List, MutableMapping, Optional

# header -> the pip package that brings it
HEADERS = {"cublasLt.h": "nvidia-cublas", "nvrtc.h": "nvidia-cuda-nvrtc"}
# library linked with -l<name> -> where to get it
LIBRARIES = {"nvrtc": "pip install nvidia-cuda-nvrtc",
             "cuda": "the driver stub a full CUDA toolkit keeps in lib64/stubs, e.g. apt's cuda-driver-dev"}


# where the linker looks by itself (a GPU machine's driver puts libcuda.so.1 there)
SYSTEM_LIBS = ("/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64",
               "/usr/lib", "/usr/local/nvidia/lib64")


def toolkit_root() -> Optional[Path]:
    """The CUDA toolkit nvcc belongs to: CUDA_HOME, else the folder above the nvcc on PATH where it holds the
    toolkit's headers (not a wrapper script's folder), else /usr/local/cuda."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        return Path(home)
    nvcc = shutil.which("nvcc")
    for root in ([Path(nvcc).resolve().parent.parent] if nvcc else []) + [Path("/usr/local/cuda")]:
        if (root / "include" / "cuda_runtime.h").is_file():
            return root
    return None


def _pip_cuda_folders(kind: str) -> List[Path]:
    """``include`` or ``lib`` folders of the nvidia-* pip packages on this Python's path."""
    found = []
    for entry in map(Path, sys.path):
        nvidia = entry / "nvidia"
        if nvidia.is_dir():
            found += sorted(p for p in nvidia.glob(f"*/{kind}") if p.is_dir())
    return found


def _split(value: Optional[str]) -> List[Path]:
    return [Path(p) for p in (value or "").split(os.pathsep) if p]


def prepare(env: MutableMapping[str, str], links: Path) -> List[str]:
    """Add to ``env``'s CPATH and LIBRARY_PATH the pip packages' folders holding what the toolkit lacks (unversioned
    library names linked into ``links``); returns one line per header or library still found nowhere."""
    root = toolkit_root()
    toolkit = [root, root / "targets" / "x86_64-linux"] if root else []
    includes = [t / "include" for t in toolkit] + _split(env.get("CPATH"))
    libdirs = [t / d for t in toolkit for d in ("lib64", "lib", "lib64/stubs", "lib/stubs")] + _split(
        env.get("LIBRARY_PATH")) + [Path(d) for d in SYSTEM_LIBS]
    added: Dict[str, List[Path]] = {"CPATH": [], "LIBRARY_PATH": []}
    missing = []
    for header, package in HEADERS.items():
        if any((d / header).is_file() for d in includes):
            continue
        folder = next((d for d in _pip_cuda_folders("include") if (d / header).is_file()), None)
        if folder is None:
            missing.append(f"{header} (pip install {package}, or the CUDA toolkit's development headers)")
        elif folder not in added["CPATH"]:
            added["CPATH"].append(folder)
    for name, where in LIBRARIES.items():
        if any((d / f"lib{name}.so").exists() for d in libdirs):
            continue
        versioned = next((f for d in libdirs + _pip_cuda_folders("lib") for f in sorted(d.glob(f"lib{name}.so.*"))
                          if f.name.split(".so.")[1].isdigit()), None)
        if versioned is None:
            missing.append(f"lib{name}.so ({where})")
            continue
        links.mkdir(parents=True, exist_ok=True)
        link = links / f"lib{name}.so"
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(versioned)
        if links not in added["LIBRARY_PATH"]:
            added["LIBRARY_PATH"].append(links)
    for var, folders in added.items():
        if folders:
            env[var] = os.pathsep.join([str(f) for f in folders] + ([env[var]] if env.get(var) else []))
    return missing
