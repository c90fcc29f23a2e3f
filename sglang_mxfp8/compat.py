"""Where the running SGLang keeps what this package touches, and which SGLang releases it was tested with.

SGLang moved several patch targets between 0.5.10.post1 and 0.5.23; :data:`MOVED` lists each one's locations, oldest
first, and :func:`sglang_object` answers with the first this SGLang has. Imports nothing of this package but its
version constants, so the kernels and the benchmarks can ask without importing the patches; and nothing Python has not
imported at its start (the startup hook reads it in every interpreter).
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import Optional

from . import NEWEST_SGLANG, OLDEST_SGLANG, SUPPORTED_SGLANG


@functools.lru_cache(maxsize=None)
def sglang_version() -> str:
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:  # noqa: BLE001 - any failure means "unknown"
        return "unknown"


# Patch targets SGLang moved between releases: where each is, oldest first (the first this SGLang has is used).
MOVED = {
    "moe_config": (  # <= 0.5.10.post1 | >= 0.5.11
        "sglang.srt.layers.moe.fused_moe_triton.fused_moe_triton_config",
        "sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe_triton_config",
    ),
    "piecewise_graph_flag": (  # <= 0.5.11 | >= 0.5.14
        "sglang.srt.compilation.piecewise_context_manager:is_in_piecewise_cuda_graph",
        "sglang.srt.model_executor.runner_backend_utils.tc_piecewise_cuda_graph.context_manager"
        ":is_in_tc_piecewise_cuda_graph",
    ),
    "moe_align_block_size": (  # <= 0.5.10.post1 | >= 0.5.11
        "sglang.srt.layers.moe.fused_moe_triton.moe_align_block_size:moe_align_block_size",
        "sglang.srt.layers.moe.moe_runner.triton_utils.moe_align_block_size:moe_align_block_size",
    ),
    "fused_experts": (  # SGLang's Triton fused MoE, for the benchmarks' BF16 baseline: <= 0.5.10.post1 | >= 0.5.11
        "sglang.srt.layers.moe.fused_moe_triton.fused_moe:outplace_fused_experts",
        "sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe:outplace_fused_experts",
    ),
    "weight_updates": (  # ModelRunner's methods <= 0.5.14 | a WeightUpdater of its own >= 0.5.17
        "sglang.srt.model_executor.model_runner:ModelRunner",
        "sglang.srt.model_executor.model_runner_components.weight_updater:WeightUpdater",
    ),
}


# flags SGLang 0.5.20 dropped for their successors (0.5.17 takes both): rewritten where the running SGLang lacks them
RENAMED_FLAGS = {"--disable-piecewise-cuda-graph": "--disable-prefill-cuda-graph",
                 "--cuda-graph-max-bs": "--cuda-graph-max-bs-decode"}


def model_runner_of(owner):
    """The ModelRunner whose weights ``owner`` (a ModelRunner, or from 0.5.17 its WeightUpdater) updates."""
    return owner.get_model_runner() if hasattr(owner, "get_model_runner") else owner


def graph_max_batch(args) -> Optional[int]:
    """The largest decode CUDA-graph batch of server arguments ``args`` (its flag was renamed in 0.5.20)."""
    return getattr(args, "cuda_graph_max_bs", None) or getattr(args, "cuda_graph_max_bs_decode", None)


def sglang_module(*names: str) -> Optional[ModuleType]:
    """The first of ``names`` this SGLang has, or None; a module that exists but fails to import raises."""
    for name in names:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as e:
            if not (e.name and (name == e.name or name.startswith(e.name + "."))):
                raise
    return None


@functools.lru_cache(maxsize=None)
def sglang_object(what: str, has: str = ""):
    """The first ``module:attribute`` of ``MOVED[what]`` this SGLang has (with an attribute ``has``, if given); looked
    up once per process (kernels call it per launch, and a failed import searches the whole path)."""
    for location in MOVED[what]:
        module_name, attr = location.split(":")
        obj = getattr(sglang_module(module_name), attr, None)
        if obj is not None and (not has or hasattr(obj, has)):
            return obj
    raise ImportError(f"found none of {', '.join(MOVED[what])}" + (f" with {has}" if has else ""))


@functools.lru_cache(maxsize=None)
def sglang_architectures() -> Optional[frozenset]:
    """The model architectures the installed SGLang has a class for (its models' ``EntryClass``), read from its source
    files without importing it; None where SGLang is not installed."""
    import importlib.util
    import re
    from pathlib import Path

    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    names = set()
    for path in (Path(next(iter(spec.submodule_search_locations))) / "srt" / "models").glob("*.py"):
        for entry in re.findall(r"^EntryClass\s*=\s*(\[.*?\]|\w+)", path.read_text(errors="replace"), re.M | re.S):
            names.update(re.findall(r"\w+", entry))
    return frozenset(names)


def served_args():
    """The server arguments in effect in this process, as resolved at launch, or None outside a server. SGLang >= 0.5.20
    keeps the operator's input on the record and resolution's decisions beside it (``get_global_server_args`` raises
    there): its resolved view answers."""
    try:
        from sglang.srt.arg_groups.model_override_base import resolved_view
        from sglang.srt.runtime_context import get_server_args
    except ImportError:
        from sglang.srt.server_args import get_global_server_args

        try:
            return get_global_server_args()
        except ValueError:  # not set: not a server process
            return None
    try:
        args = get_server_args()
    except (AttributeError, ValueError, RuntimeError):
        return None
    return resolved_view(args) if args is not None else None


def _release(version: str) -> tuple:
    """'0.5.10.post1' -> (0, 5, 10, 1): release numbers, then the post-release number (0 for none)."""
    head, _, post = version.partition(".post")
    try:
        return (*(int(x) for x in head.split(".")[:3]), int(post or 0))
    except ValueError:
        return ()


def check_tested_range(version: Optional[str] = None) -> Optional[str]:
    """The warning line when ``version`` (this SGLang's by default) is outside the range CI tests, else None."""
    version = version or sglang_version()
    release = _release(version)
    if release and _release(OLDEST_SGLANG) <= release <= _release(NEWEST_SGLANG):
        return None
    return (f"sglang_mxfp8: sglang {version} is outside the tested range {SUPPORTED_SGLANG}; patching it wherever its "
            "targets exist")


@functools.lru_cache(maxsize=None)
def warn_if_untested() -> None:
    """Log :func:`check_tested_range`'s line once per process."""
    line = check_tested_range()
    if line:
        import logging

        logging.getLogger("sglang_mxfp8").warning(line)
