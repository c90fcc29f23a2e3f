"""cuBLAS's block-scaled FP8 GEMM on Hopper, reached through torch's ``scaled_mm`` (cuBLASLt 12.9 or newer).

It takes the operands FlashInfer's ``fp8_blockscale_gemm_sm90`` takes: an e4m3 activation with one float32
scale per (token, 128 columns) and an e4m3 weight with one float32 scale per 128x128 block. The activation is
quantized by our one-pass Triton kernel, which writes the token-fastest scale layout cuBLAS reads.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F


@functools.lru_cache(maxsize=None)
def unsupported() -> Optional[str]:
    """Why torch's ``scaled_mm`` cannot run cuBLAS's 1x128 x 128x128 block-scaled FP8 GEMM on this GPU (torch too
    old, off SM90, cuBLASLt before 12.9), or None. Without a visible GPU nothing can be probed: None."""
    if not hasattr(F, "ScalingType"):
        return f"torch {torch.__version__} has no torch.nn.functional.scaled_mm"
    if not torch.cuda.is_available():
        return None
    try:
        w = torch.zeros(128, 512, dtype=torch.float8_e4m3fn, device=f"cuda:{torch.cuda.current_device()}")
        one = torch.ones(1, 4, dtype=torch.float32, device=w.device)  # SGLang sets a bf16 default dtype
        blockscale_gemm(torch.ones(4, 512, dtype=torch.bfloat16, device=w.device), w, one)
    except (RuntimeError, NotImplementedError, ValueError) as e:
        return f"torch {torch.__version__}: {str(e).splitlines()[0]}"
    return None


def blockscale_gemm(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None,
                    out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K] bf16 -> [M, N]: x quantized per (token, 128 columns), times w [N, K] e4m3 with w_scale
    [ceil(N / 128), K / 128] float32 (row-major, one per 128x128 block), float32 accumulation in cuBLAS."""
    from .triton_sm90.act_quant import quantize_act_1x128

    m = x.shape[0]
    q, s = quantize_act_1x128(x, m_major=True)
    out = F.scaled_mm(q, w.t(), s, F.ScalingType.BlockWise1x128, w_scale.t(), F.ScalingType.BlockWise128x128,
                      output_dtype=out_dtype or x.dtype)[:m]
    return out if bias is None else out + bias
