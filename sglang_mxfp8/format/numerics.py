"""MXFP8 numerics in pure torch (CPU and GPU), following OCP MX v1.0.

An MXFP8 tensor is e4m3 elements plus one E8M0 (UE8M0) scale byte per 32 consecutive
elements along the last dimension (K). Scale byte ``b`` means ``2 ** (b - 127)``; byte 255 is NaN.

Scale rounding. The spec derives the shared exponent as ``floor(log2(amax)) - emax_e4m3`` and lets
elements that then exceed 448 saturate ("floor"). The MXFP8 pre-training recipe (and
TransformerEngine, miles, FlashInfer and triton_kernels, which produce the checkpoints our users
serve) rounds ``amax / 448`` *up* to a power of two instead ("ceil"), so no element saturates.
We default to "ceil" so that converting a checkpoint here gives the same bytes as the tools that
trained it; "floor" is available for spec-exact experiments.
"ceil" is torchao's ``ScaleCalculationMode.RCEIL`` (torchao's ``CEIL`` is another rule), and "floor" is its
``FLOOR``.

Conversion to Hopper block scales. Hopper FP8 tensor-core kernels take one float32 scale per
1x128 (per row) or 128x128 block. Converting a group of 1x32 power-of-two scales to one
power-of-two block scale ``2**E`` (E = the largest sub-block exponent) is an exponent shift of each
element by ``s_i - E <= 0``; it is exact unless a shifted element lands in e4m3's subnormal range,
so we count and report the elements that changed.
"""

from __future__ import annotations

import math
from typing import Literal, Optional, Tuple

import torch

from .checkpoint import E8M0_NAN, MX_BLOCK

E4M3_MAX = 448.0
E4M3_EMAX = 8  # 448 = 1.75 * 2**8
E8M0_BIAS = 127
FP8 = torch.float8_e4m3fn
ScaleRounding = Literal["ceil", "floor"]


def check_k(x: torch.Tensor, what: str) -> None:
    if x.shape[-1] % MX_BLOCK:
        raise ValueError(
            f"{what}: last dimension {x.shape[-1]} is not a multiple of {MX_BLOCK}; "
            "MXFP8 needs K % 32 == 0 (leave this tensor unquantized instead)"
        )


def _shared_exponent(amax: torch.Tensor, rounding: ScaleRounding) -> torch.Tensor:
    """Exact integer block exponent from a float32 amax (> 0, finite), as int32."""
    mant, exp = torch.frexp(amax)  # amax = mant * 2**exp, mant in [0.5, 1)
    if rounding == "floor":
        # floor(log2(amax)) = exp - 1; spec: shared_exp = floor(log2(amax)) - emax_elem
        return (exp - 1 - E4M3_EMAX).to(torch.int32)
    if rounding != "ceil":
        raise ValueError(f"scale rounding must be 'ceil' or 'floor', got {rounding!r}")
    # smallest e with amax <= 448 * 2**e, i.e. amax / 2**e <= 448 exactly
    e = exp - 1 - E4M3_EMAX  # 2**(exp-1) <= amax, so amax/2**e in [256, 512)
    e = torch.where(torch.ldexp(amax, -e) > E4M3_MAX, e + 1, e)
    return e.to(torch.int32)


def quantize_mxfp8(
    x: torch.Tensor, rounding: ScaleRounding = "ceil"
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x[..., K]`` to (e4m3 ``[..., K]``, uint8 E8M0 scales ``[..., K/32]``).

    Zero blocks get scale byte 127 (1.0). Blocks holding NaN or +-Inf get scale byte 255 (NaN)
    and NaN elements, as OCP MX v1.0 prescribes. Exponents are clamped to E8M0's range [-127, 127].
    """
    check_k(x, "quantize_mxfp8")
    xb = x.float().reshape(*x.shape[:-1], x.shape[-1] // MX_BLOCK, MX_BLOCK)
    amax = xb.abs().amax(dim=-1)
    finite = torch.isfinite(amax)
    nonzero = amax > 0
    safe_amax = torch.where(finite & nonzero, amax, torch.ones_like(amax))
    e = _shared_exponent(safe_amax, rounding).clamp(-E8M0_BIAS, E8M0_BIAS)
    e = torch.where(nonzero, e, torch.zeros_like(e))
    scaled = torch.ldexp(xb, -e.unsqueeze(-1).to(xb.dtype))
    q = scaled.clamp(-E4M3_MAX, E4M3_MAX)
    q = torch.where(finite.unsqueeze(-1), q, torch.full_like(q, float("nan")))
    scale = (e + E8M0_BIAS).to(torch.uint8)
    scale = torch.where(finite, scale, torch.full_like(scale, E8M0_NAN))
    return q.reshape(x.shape).to(FP8), scale


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes -> float32 powers of two (255 -> NaN)."""
    s = scale.to(torch.int32)
    val = torch.ldexp(torch.ones_like(s, dtype=torch.float32), (s - E8M0_BIAS).float())
    return torch.where(s == E8M0_NAN, torch.full_like(val, float("nan")), val)


def dequantize_mxfp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(e4m3 ``[..., K]``, uint8 ``[..., K/32]``) -> float32 ``[..., K]``."""
    check_k(q, "dequantize_mxfp8")
    if scale.shape != (*q.shape[:-1], q.shape[-1] // MX_BLOCK):
        raise ValueError(
            f"dequantize_mxfp8: scale shape {tuple(scale.shape)} does not match weight "
            f"{tuple(q.shape)} (expected {(*q.shape[:-1], q.shape[-1] // MX_BLOCK)})"
        )
    qb = q.float().reshape(*q.shape[:-1], -1, MX_BLOCK)
    return (qb * e8m0_to_float(scale).unsqueeze(-1)).reshape(q.shape)


_NO_EXPONENT = -(1 << 20)  # a sub-block of zeros: no exponent


def block_exponents(q: torch.Tensor, scale: torch.Tensor, block_rows: int,
                    nonzero: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Target exponent per (row block, 128-column block) of MXFP8 ``q [R, K]`` with scales ``[R, K/32]``.

    The maximum sub-block exponent over sub-blocks holding a nonzero element (a zero block's
    scale byte is arbitrary and must not dominate); 0 for an all-zero block. Shape
    ``[ceil(R/block_rows), ceil(K/128)]``, int32. ``nonzero``: which sub-blocks hold a nonzero element, where the
    caller has it already (``[R, K/32]``, as checkpoint.validate_loaded returns it).
    """
    r, k = q.shape
    e = _subblock_exponents(q, scale, nonzero)
    kb = math.ceil(k / 128)
    nb = math.ceil(r / block_rows)
    e = torch.nn.functional.pad(e, (0, kb * 4 - e.shape[1], 0, nb * block_rows - r), value=_NO_EXPONENT)
    e = e.reshape(nb, block_rows, kb, 4).amax(dim=(1, 3))
    return torch.where(e == _NO_EXPONENT, torch.zeros_like(e), e)


def _subblock_exponents(q: torch.Tensor, scale: torch.Tensor, nonzero: Optional[torch.Tensor] = None) -> torch.Tensor:
    """int32 [R, K/32]: each 32-element sub-block's scale exponent, _NO_EXPONENT where it is all zeros."""
    r, k = q.shape
    nz = nonzero
    if nz is None:
        nz = (q.view(torch.uint8) & 0x7F).reshape(r, k // MX_BLOCK, MX_BLOCK).amax(-1) > 0
    return torch.where(nz, scale.to(torch.int32) - E8M0_BIAS, torch.full_like(scale, _NO_EXPONENT, dtype=torch.int32))


def convert_to_row_scales(q: torch.Tensor, scale: torch.Tensor) -> Tuple[torch.Tensor, int]:
    """Convert MXFP8 ``q [R, K]`` in place to one power-of-two scale per row (per-channel FP8, what per-token x
    per-channel FP8 GEMMs take); returns (float32 scales [R], elements changed).

    The row's exponent is its largest nonzero sub-block exponent (0 for an all-zero row); each element moves by
    ``s_i - E <= 0`` binary places, exact unless it lands in e4m3's subnormal range, as for block scales."""
    _check_conversion(q, scale, "convert_to_row_scales")
    e = _subblock_exponents(q, scale).amax(dim=1)
    e = torch.where(e == _NO_EXPONENT, torch.zeros_like(e), e)
    changed = shift_to_block_exponents(q, scale, e[:, None].expand(-1, math.ceil(q.shape[1] / 128)), 1)
    return exponents_to_scales(e), changed


def shift_to_block_exponents(q: torch.Tensor, scale: torch.Tensor, exps: torch.Tensor, block_rows: int) -> int:
    """Rewrite ``q [R, K]`` in place so that ``q * 2**exps`` (blockwise) equals the MXFP8 value.

    Each element moves by ``s_i - E <= 0`` binary places: exact except where it lands in e4m3's
    subnormal range. Returns how many elements changed value.
    """
    return int(count_shifted(q, scale, exps, block_rows))


def count_shifted(q: torch.Tensor, scale: torch.Tensor, exps: torch.Tensor, block_rows: int) -> torch.Tensor:
    """:func:`shift_to_block_exponents` with the count left on ``q``'s device (int64, 0-d): no host sync, so that
    a caller converting a weight in chunks waits once."""
    r, k = q.shape
    sub = scale.to(torch.int32) - E8M0_BIAS
    tgt = exps.repeat_interleave(block_rows, dim=0)[:r].repeat_interleave(4, dim=1)[:, : k // MX_BLOCK]
    shift = (sub - tgt).clamp(max=0).repeat_interleave(MX_BLOCK, dim=1).float()
    old = q.float()
    new = torch.ldexp(old, shift).to(FP8)
    changed = (torch.ldexp(new.float(), -shift) != old).sum()
    q.copy_(new)
    return changed


def exponents_to_scales(exps: torch.Tensor) -> torch.Tensor:
    return torch.ldexp(torch.ones_like(exps, dtype=torch.float32), exps.float())


def _check_conversion(q: torch.Tensor, scale: torch.Tensor, what: str) -> None:
    if q.dim() != 2 or q.dtype != FP8:
        raise ValueError(f"{what}: expected a 2-D float8_e4m3fn weight, got {q.dtype} {tuple(q.shape)}")
    check_k(q, what)
    r, k = q.shape
    if scale.shape != (r, k // MX_BLOCK) or scale.dtype != torch.uint8:
        raise ValueError(f"{what}: scale must be uint8 [{r}, {k // MX_BLOCK}], got {scale.dtype} {tuple(scale.shape)}")
    if bool((scale == E8M0_NAN).any()):
        raise ValueError(f"{what}: scale holds NaN (0xFF) bytes: the checkpoint has non-finite weights")


def convert_to_block_scales(q: torch.Tensor, scale: torch.Tensor, block_rows: int) -> Tuple[torch.Tensor, int]:
    """Convert MXFP8 ``q [R, K]`` in place to power-of-two block scales; returns (scales, changed).

    ``block_rows`` 1 gives one scale per row per 128 columns ([R, ceil(K/128)]); 128 gives
    128x128 blocks ([ceil(R/128), ceil(K/128)]). No second FP8 copy of the weight is made.
    """
    if block_rows not in (1, 128):
        raise ValueError(f"block_rows must be 1 or 128, got {block_rows}")
    _check_conversion(q, scale, "convert_to_block_scales")
    exps = block_exponents(q, scale, block_rows)
    changed = shift_to_block_exponents(q, scale, exps, block_rows)
    return exponents_to_scales(exps), changed


def dequantize_block_fp8(q: torch.Tensor, block_scale: torch.Tensor, block_rows: int) -> torch.Tensor:
    """Float32 value of an FP8 weight ``[R, K]`` with float32 (block_rows x 128) scales."""
    r, k = q.shape
    s = block_scale.repeat_interleave(block_rows, 0)[:r].repeat_interleave(128, 1)[:, :k]
    return q.float() * s


def quantize_activation_1x128(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token 1x128 FP8 quantization (float32 scales = amax/448), torch reference."""
    m, k = x.shape
    kb = math.ceil(k / 128)
    xp = torch.nn.functional.pad(x.float(), (0, kb * 128 - k)).reshape(m, kb, 128)
    s = (xp.abs().amax(-1) / E4M3_MAX).clamp(min=1e-12)
    q = (xp / s.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(FP8).reshape(m, kb * 128)[:, :k]
    return q.contiguous(), s


def moe_reference(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor, fp8_activations: bool = True,
                  up_first: bool = False) -> torch.Tensor:
    """float32 SiLU-gated MoE on FP8 experts with 128x128 block scales, the host reference of the Hopper MoE kernels:
    w13 [E, 2I, H] as [gate; up] rows ([up; gate] with ``up_first``), w2 [E, H, I]; each GEMM1 output and the
    SiLU-and-mul result rounded to bf16 as the kernels store them; ``fp8_activations``: both GEMM inputs quantized per
    1x128 group first (:func:`quantize_activation_1x128`), as the W8A8 kernels do."""
    def operand(a):
        if not fp8_activations:
            return a
        q, s = quantize_activation_1x128(a)
        return q.float() * s.repeat_interleave(128, 1)[:, : a.shape[1]]

    inter = w2.shape[2]
    ref = torch.zeros(x.shape, device=x.device)
    for e in topk_ids.unique().tolist():
        rows, slots = (topk_ids == e).nonzero(as_tuple=True)
        h = (operand(x[rows].float()) @ dequantize_block_fp8(w13[e], w13_scale[e], 128).t()).bfloat16().float()
        up, gate = (h[:, :inter], h[:, inter:]) if up_first else (h[:, inter:], h[:, :inter])
        act = (torch.nn.functional.silu(gate) * up).bfloat16().float()
        y = operand(act) @ dequantize_block_fp8(w2[e], w2_scale[e], 128).t()
        ref.index_add_(0, rows, y * topk_weights[rows, slots, None])
    return ref
