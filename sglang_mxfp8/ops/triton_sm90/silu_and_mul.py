"""``silu_and_mul``: SiLU(gate) * up over a GEMM1 output laid out [gate | up] or [up | gate], rounded once to its
dtype, as sgl_kernel's ``silu_and_mul`` computes it. The [up | gate] order lets SGLang's CUTLASS grouped MoE run on
w13 as FlashInfer's fused MoE loads it ([up; gate]: kernels.moe.cutlass_grouped), with nothing copied."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # columns per program (Qwen3-30B-A3B's 768 in one)


@triton.jit
def silu_mul(gate, up):
    """silu(gate) * up in float32 (the one formula of this kernel and ``moe_segments``' fused SiLU-and-quantize)."""
    g = gate.to(tl.float32)
    return g / (1.0 + tl.exp(-g)) * up.to(tl.float32)


@triton.jit
def _silu_and_mul_kernel(h_ptr, out_ptr, I, stride_h, stride_o, UP_FIRST: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < I
    gate = tl.load(h_ptr + row * stride_h + UP_FIRST * I + cols, mask=ok, other=0.0)
    up = tl.load(h_ptr + row * stride_h + (1 - UP_FIRST) * I + cols, mask=ok, other=0.0)
    act = silu_mul(gate, up)
    tl.store(out_ptr + row * stride_o + cols, act.to(out_ptr.dtype.element_ty), mask=ok)


def silu_and_mul(h: torch.Tensor, out: torch.Tensor | None = None, up_first: bool = False) -> torch.Tensor:
    """h [R, 2I] ([gate | up]; [up | gate] with ``up_first``) -> out [R, I] of h's dtype: silu(gate) * up in float32,
    rounded once."""
    rows, width = h.shape
    inter = width // 2
    if out is None:
        out = torch.empty((rows, inter), dtype=h.dtype, device=h.device)
    if width % 2 or out.shape != (rows, inter) or h.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError(f"silu_and_mul: input {tuple(h.shape)} (stride {h.stride()}) and output {tuple(out.shape)} "
                         f"(stride {out.stride()}): need [R, 2I] and [R, I], each row contiguous")
    if rows:
        block = min(BLOCK, triton.next_power_of_2(inter))
        _silu_and_mul_kernel[(rows, triton.cdiv(inter, block))](
            h, out, inter, h.stride(0), out.stride(0), UP_FIRST=int(up_first), BLOCK=block, num_warps=4)
    return out


def silu_and_mul_up_first(h: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`silu_and_mul` of an [up | gate] GEMM1 output, with sgl_kernel's ``silu_and_mul(input, out)`` call."""
    return silu_and_mul(h, out, up_first=True)
