"""Compiling at load what a server's batch sizes will run, so no served batch waits for a compiler."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional, Sequence

import torch

from .base import log_once

logger = logging.getLogger("sglang_mxfp8")


_PRECOMPILED: set = set()


def precompile_batches(key: tuple, label: str, ms: Sequence[int], device, make: Callable[[int], Any],
                       run: Callable[[Any, int], None]) -> Optional[int]:
    """Run ``run(inputs, m)`` once per batch size in ``ms`` (``inputs = make(max(ms))``), so that every tile config
    those batches select is compiled now rather than when a served batch first needs it; once per ``key`` and
    process. Frees its inputs before SGLang sizes its KV cache from the free memory. Returns how many ran, or None."""
    if key in _PRECOMPILED or not ms:
        return None
    _PRECOMPILED.add(key)
    from tqdm import tqdm

    start = time.perf_counter()
    inputs = make(max(ms))
    for m in tqdm(ms, desc=f"sglang_mxfp8: {label}", leave=False):
        run(inputs, m)
    torch.cuda.synchronize(device)
    del inputs
    torch.cuda.empty_cache()
    logger.info("sglang_mxfp8: %s: ran %d batch sizes (%d..%d tokens) in %.1f s", label, len(ms), min(ms), max(ms),
                time.perf_counter() - start)
    return len(ms)


def compile_before_flashinfer(shape, configs) -> None:
    """Compile the kernels of ``shape`` at ``configs`` that FlashInfer's cache lacks with concurrent nvcc processes
    (SGLANG_MXFP8_COMPILE_JOBS; 0: none), before running batches makes FlashInfer compile them one after another;
    any failure leaves them to FlashInfer, with one warning."""
    from ..ops.flashinfer_jit import tile_configs
    from ..settings import current as current_settings

    jobs = current_settings().compile_jobs
    if jobs == 0:
        return
    try:
        tile_configs.compile_tile_configs(shape, configs, jobs)
    except (tile_configs.KernelCompileError, OSError) as e:
        log_once(30, f"sglang_mxfp8: FlashInfer SM90 GEMM kernels not compiled concurrently ({e}); FlashInfer "
                     "compiles them itself, one after another")

