"""DeepGEMM's dense FP8 GEMM on Hopper for prefill batches (``deep_gemm.fp8_gemm_nt``; DeepGEMM is built from
deepseek-ai/DeepGEMM, README "DeepGEMM"). It takes the FlashInfer backend's operands as they are: the e4m3 weight
with one float32 scale per 128x128 block, the activation quantized per (token, 128 columns) by our Triton kernel
with its scales token-fastest.

DeepGEMM compiles one kernel per tile config with nvcc the first time the config runs (cached on disk under
$DG_JIT_CACHE_DIR, default ~/.deep_gemm). On SM90 the config of an [M, K] x [N, K]^T product with M > 32 depends on
M only through ceil(M / 64) (csrc/jit_kernels/heuristics/sm90.hpp: block M 64, 128 or 256, waves counted from
ceil(M / block M)), so :func:`precompile` runs one M per 64 rows of the prefill range at load and no served batch
waits for nvcc.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import time
from types import ModuleType
from typing import Optional, Tuple

import torch

from .envs import env_switch

logger = logging.getLogger(__name__)

DENSE_ENV = "SGLANG_MXFP8_DEEPGEMM_PREFILL_DENSE"
# H200, CUDA-graph GPU time, same run (benchmarks/RESULTS.md, "DeepGEMM's dense GEMM for prefill batches"): our
# quantizer + DeepGEMM beat cuBLAS's block-scaled GEMM (what ran from 1024 tokens before) on 11 of the 12 cells at
# 1024 / 4096 / 8192 tokens on the four measured shapes, by 1.02-1.27x; it lost 5% on Llama-3-8B's up projection
# at 1024
DENSE_MIN_TOKENS = 1024
M_BUCKET = 64  # rows of M that share one DeepGEMM tile config above 32 (module docstring)


def load():
    """``deep_gemm``, imported after FlashInfer's GEMM module. On the H200 a process that loaded deep_gemm before
    FlashInfer (or SGLang's FP8 layers, which import it) died with a segmentation fault in DeepGEMM's first kernel
    compile, inside the std::regex of its include parser; loaded after either, the same GEMM ran (benchmarks/RESULTS.md,
    "DeepGEMM's dense GEMM for prefill batches": probe_deepgemm_import_order.py). A server imports SGLang's layers
    before loading the model; this keeps tools and tests that reach DeepGEMM first safe too. Where deep_gemm is not
    installed it fails at once, without FlashInfer's import (seconds on a CPU-only machine running doctor)."""
    if "deep_gemm" not in sys.modules and importlib.util.find_spec("deep_gemm") is None:
        raise ModuleNotFoundError("No module named 'deep_gemm'", name="deep_gemm")
    try:
        import flashinfer.gemm  # noqa: F401
    except ImportError:  # no FlashInfer: nothing to order
        pass
    import deep_gemm

    return deep_gemm


def load_or_why() -> Tuple[Optional[ModuleType], Optional[str]]:
    """(``deep_gemm``, None) where it imports (through :func:`load`), else (None, why not in one line)."""
    try:
        return load(), None
    except Exception as e:  # noqa: BLE001 - not installed, or built for another CUDA: fall back, say why
        return None, f"deep_gemm does not import ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"


def dense_unavailable(n: int, k: int, dtype: torch.dtype) -> Optional[str]:
    """Why DeepGEMM's dense GEMM cannot take an [n, k] layer's prefill batches here, or None: it is off
    (SGLANG_MXFP8_DEEPGEMM_PREFILL_DENSE=0), the model is not bf16 (DeepGEMM writes bf16), the shape is not whole
    128-column weight blocks and 64-row tiles, or ``deep_gemm`` does not import or has no ``fp8_gemm_nt``."""
    if not env_switch(DENSE_ENV, default=True):
        return f"{DENSE_ENV}=0"
    if dtype != torch.bfloat16:
        return f"a {str(dtype).replace('torch.', '')} model (DeepGEMM writes bf16)"
    if k % 128 or n % 64:
        return f"[{n} x {k}] is not a multiple of 128 in K and 64 in N"
    deep_gemm, why = load_or_why()
    if why:
        return why
    if not hasattr(deep_gemm, "fp8_gemm_nt"):
        return f"deep_gemm {getattr(deep_gemm, '__version__', '?')} has no fp8_gemm_nt"
    return None


def dense_gemm(x: torch.Tensor, w: torch.Tensor, w_block_scale: torch.Tensor,
               bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] bf16 -> [M, N] bf16: x quantized per (token, 128 columns) (rows padded to a multiple of 4, as
    DeepGEMM's TMA reads the token-fastest scales), times w [N, K] e4m3 with w_block_scale [ceil(N / 128), K / 128]
    float32 (one per 128x128 block), float32 accumulation in DeepGEMM."""
    from .triton_hopper import quantize_act_1x128

    q, s = quantize_act_1x128(x, m_major=True)
    out = torch.empty((q.shape[0], w.shape[0]), dtype=torch.bfloat16, device=x.device)
    load().fp8_gemm_nt((q, s), (w, w_block_scale), out)
    out = out[: x.shape[0]]
    return out if bias is None else out + bias


PRECOMPILE_ENV = "SGLANG_MXFP8_DEEPGEMM_PRECOMPILE"


def precompile_enabled() -> bool:
    """Whether the dense layers and the MoE (moe_hopper.DeepGemmGroupedMoE.precompile) run DeepGEMM's tile configs at
    load; on unless SGLANG_MXFP8_DEEPGEMM_PRECOMPILE=0 (then a prefill batch whose config is new waits for nvcc)."""
    return env_switch(PRECOMPILE_ENV, default=True)


def precompile_ms(min_m: int, max_m: int) -> list:
    """One M per 64-row bucket that a batch of min_m..max_m tokens can fall in (each bucket's largest M)."""
    return list(range(-(-min_m // M_BUCKET) * M_BUCKET, max_m + M_BUCKET, M_BUCKET)) if max_m >= min_m else []


_PRECOMPILED: set = set()  # (n, k, device) done in this process


def precompile(w: torch.Tensor, w_block_scale: torch.Tensor, min_m: int, max_m: int) -> Optional[int]:
    """Run the GEMM once per 64 rows of M from min_m to max_m (> 32), compiling every tile config those batches
    select; once per shape and process. Returns how many Ms ran, or None when this shape was done already."""
    from tqdm import tqdm

    n, k = w.shape
    key = (n, k, w.device)
    ms = precompile_ms(min_m, max_m)
    if key in _PRECOMPILED or not ms:
        return None
    _PRECOMPILED.add(key)
    start = time.perf_counter()
    x = torch.zeros(ms[-1], k, dtype=torch.bfloat16, device=w.device)
    for m in tqdm(ms, desc=f"sglang_mxfp8: DeepGEMM FP8 GEMM [{n} x {k}] tile configs", leave=False):
        dense_gemm(x[:m], w, w_block_scale)
    torch.cuda.synchronize(w.device)
    del x
    torch.cuda.empty_cache()  # SGLang sizes its KV cache from the free memory after loading
    logger.info("sglang_mxfp8: DeepGEMM FP8 GEMM [%d x %d]: ran M = %d..%d (one per %d rows) in %.1f s",
                n, k, ms[0], ms[-1], M_BUCKET, time.perf_counter() - start)
    return len(ms)
